"""The intervention mechanism (`sdx.interventions`) on a tiny UNet: patterns, processors that wrap and replace,
hooks, readouts through the outlined and rematerialised blocks, bfloat16; and the research flags' bad input
(one error line, exit status 2, nothing compiled). Whole pipelines against diffusers: test_research_pipelines.py;
batch invariance, the mesh and compile counts: test_research_sampling.py."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sdx import interventions as iv
from sdx import weights
from sdx.errors import SdxError
from sdx.freeu import FreeU, fourier_filter
from sdx.layers import Compute, Rows
from sdx.sample import main
from sdx.unet import UNet2DConditionModel, UNetConfig

SELF_ATTENTIONS = [f"{block}.transformer_blocks.0.attn1" for block in (
    "down_blocks.0.attentions.0", "mid_block.attentions.0", "up_blocks.1.attentions.0", "up_blocks.1.attentions.1")]


@pytest.fixture(scope="module")
def unet():
    """The `tiny` preset's UNet (SD-like: attentions at level 0 down, mid, level 0 up), random weights."""
    return UNet2DConditionModel(UNetConfig.preset("tiny"), rngs=nnx.Rngs(0))


def _inputs(batch=2):
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((batch, 8, 8, 4)), jnp.float32)
    ctx = jnp.asarray(r.standard_normal((batch, 7, 32)), jnp.float32)
    return x, jnp.float32(500.0), ctx


def _rebuilt(unet, cp: Compute):
    """`unet`'s weights in a UNet of the same config computing as `cp` says (its param dtype)."""
    graphdef = nnx.graphdef(weights.abstract(lambda r: UNet2DConditionModel(unet.config, cp, rngs=r)))
    return nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(cp.param_dtype), nnx.state(unet)))


@nnx.jit
def _run(model, x, t, ctx, placed):
    return iv.capture(model, x, t, ctx, interventions=placed)


def _call(model, *asked: iv.Intervention):
    """(output, records) of `model` on `_inputs()` with `asked` installed, jitted (their traced fields as inputs:
    interventions of one structure share a program)."""
    x, t, ctx = _inputs()
    return _run(model, x, t, ctx, iv.installed(model, asked))


def test_patterns_select_by_diffusers_paths_and_refuse_what_names_nothing(unet):
    selves = iv.attention_paths(unet, "self")
    assert selves == SELF_ATTENTIONS
    names = list(unet.sites())
    assert iv.select(selves, "up_blocks.*.attentions.*.transformer_blocks.*.attn1", "t") == SELF_ATTENTIONS[2:]
    assert iv.select(selves, "mid_block", "t") == SELF_ATTENTIONS[1:2]  # leading components select what is inside
    crosses = [p.replace("attn1", "attn2") for p in SELF_ATTENTIONS]
    assert iv.select(iv.attention_paths(unet), "**.attn2", "t") == crosses
    skips = [f"up_blocks.{i}.resnets.{j}.skip" for i in (0, 1) for j in range(2)]
    assert iv.select(names, "up_blocks.*.resnets.*.skip", "t") == skips
    for pattern, words in [("upblocks.1", "'upblocks' names nothing in this model"),
                           ("up_blocks.7", "'up_blocks.7' matches no site"), ("up_blocks..1", "is not a pattern")]:
        with pytest.raises(SdxError, match=words):
            iv.select(names, pattern, "t")


@dataclasses.dataclass(frozen=True)
class Probe(iv.Processor):
    """Records each attention's probabilities and finishes the attention from them (no backend)."""

    per_row: ClassVar[bool] = False

    def __call__(self, call):
        p = call.probabilities(call.query(), call.k)
        iv.record(call.path, p)
        return call.output(call.mix(p, call.v))


@dataclasses.dataclass(frozen=True)
class Scaled(iv.Processor):
    """Wraps the rest of the chain: its output times `gain` (traced)."""

    gain: float
    traced: ClassVar[tuple[str, ...]] = ("gain",)

    def __call__(self, call):
        return self.gain * call.proceed()


@dataclasses.dataclass(frozen=True)
class Zeroed(iv.Hook):
    """Replaces a block's output with zeros."""

    def __call__(self, site, x):
        return (jnp.zeros_like(x),)


@pytest.mark.parametrize("remat", [False, True])
def test_readouts_come_out_of_outlined_and_rematerialised_blocks(unet, remat):
    """A processor that forms the probabilities records them (rows summing to 1) and leaves the output as the
    plain call's; the records cross the blocks the UNet calls as computations of their own."""
    model = _rebuilt(unet, Compute(remat=True)) if remat else unet
    plain, none = _call(model)
    probed, records = _call(model, iv.At("**.attn2", Probe()))
    assert none == {} and sorted(records) == sorted(p.replace("attn1", "attn2") for p in SELF_ATTENTIONS)
    p = records["mid_block.attentions.0.transformer_blocks.0.attn2"]
    assert p.shape == (2, 8, 4 * 4, 7)  # (B, heads, the mid block's 4x4 positions, 7 text tokens)
    np.testing.assert_allclose(np.asarray(p.sum(-1)), 1.0, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(probed), np.asarray(plain), atol=2e-5 * float(np.abs(plain).max()))


def test_processors_wrap_and_hooks_replace(unet):
    """`proceed` runs the rest of the chain (a wrapper scaling by 1 changes nothing, by 0 removes the attention's
    output); a hook on a block's output replaces it."""
    plain, _ = _call(unet)
    same, _ = _call(unet, iv.At("**.attn1", Scaled(1.0)))
    gone, _ = _call(unet, iv.At("**.attn1", Scaled(0.0)))
    np.testing.assert_allclose(np.asarray(same), np.asarray(plain), rtol=1e-6, atol=1e-6)
    assert float(np.abs(np.asarray(gone) - np.asarray(plain)).max()) > 1e-2
    zeroed, _ = _call(unet, iv.At("mid_block", Zeroed()))
    assert float(np.abs(np.asarray(zeroed) - np.asarray(plain)).max()) > 1e-2
    with pytest.raises(SdxError, match="'mid_blocks' names nothing"):
        _call(unet, iv.At("mid_blocks", Zeroed()))


def test_traced_fields_split_from_static_and_bind_back():
    at = iv.At("**.attn1", Scaled(0.5), kind="self")
    static, leaves = iv.split(at)
    other, _ = iv.split(iv.At("**.attn1", Scaled(2.0), kind="self"))
    assert static == iv.At("**.attn1", Scaled(None), kind="self") == other and hash(static) == hash(other)
    assert [float(v) for v in leaves] == [0.5] and leaves[0].dtype == np.float32
    assert iv.bind(static, leaves).what.gain == leaves[0]
    assert jax.tree.leaves(FreeU(1.0, 2.0, 3.0, 4.0)) == [1.0, 2.0, 3.0, 4.0]


def test_a_processor_from_outside_this_repository_keeps_its_programs_off_the_disk():
    """A plan's interventions key its compiled programs by their classes' names and static fields: sdx's own
    are covered by the source digest; any other class (here, this test module's) has no key the digest
    covers, so its programs are not stored or read back (never a stale program)."""
    from pipelines import executables

    own, _ = iv.split(FreeU(1.5, 1.6, 0.9, 0.2))
    assert "sdx.freeu.FreeU(b1=None" in executables._text(own)
    foreign, _ = iv.split(iv.At("mid_block", Scaled(0.5)))
    with pytest.raises(executables.Unkeyable, match="tests.test_interventions.Scaled"):
        executables._text(foreign)


def test_rows_pick_and_join_are_inverse():
    layout = Rows(3, (2,))
    a = jnp.arange(12.0).reshape(12, 1)  # 4 images of 3 rows
    kept, mine = layout.pick(a, layout.others()), layout.pick(a, layout.rows)
    assert np.asarray(mine).ravel().tolist() == [2, 5, 8, 11]
    np.testing.assert_array_equal(np.asarray(layout.join(kept, mine)), np.asarray(a))


def test_freeu_filter_and_bfloat16(unet):
    """The Fourier filter at scale 1 is the identity (to float32 rounding) and scales the mean (the lowest
    frequency) at any other; FreeU and PAG's identity attention run in bfloat16 with float32's result."""
    from pipelines.pag import Identity

    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, 4))
    np.testing.assert_allclose(np.asarray(fourier_filter(x, jnp.float32(1.0))), np.asarray(x), atol=1e-6)
    np.testing.assert_allclose(np.asarray(fourier_filter(x, jnp.float32(0.5)).mean((1, 2))),
                               0.5 * np.asarray(x.mean((1, 2))), atol=1e-6)
    asked = (FreeU(1.5, 1.6, 0.9, 0.2), iv.At("mid_block", Identity(Rows(2, (1,))), kind="self"))
    full, _ = _call(unet, *asked)
    half = _rebuilt(unet, Compute(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
    out, _ = _call(half, *asked)
    assert out.dtype == jnp.bfloat16
    rel = float(np.abs(np.asarray(out, np.float32) - np.asarray(full)).max() / np.abs(np.asarray(full)).max())
    assert rel < 0.05, rel


@pytest.mark.parametrize("model, args, words", [
    ("tiny", ["--pag-scale", "3", "--pag-layers", "up_blocks.("], "--pag-layers 'up_blocks.(': not a regular"),
    ("tiny", ["--pag-scale", "3", "--pag-layers", "up_blocks.7"], "--pag-layers 'up_blocks.7': matches no module"),
    ("tiny", ["--pag-scale", "3", "--pag-layers", "up_blocks.0"], "the modules it names have no self-attention"),
    ("tiny_xl", ["--sag-scale", "0.5"], "Self-Attention Guidance is for SD 1.x and 2.x; diffusers has no SDXL SAG"),
    ("tiny", ["--sag-scale", "0.5"], "Self-Attention Guidance reads alphas_cumprod at integer timesteps"),
    ("tiny", ["--pag-layers", "mid"], "--pag-adaptive-scale and --pag-layers go with Perturbed-Attention Guidance"),
    ("tiny", ["--pag-scale", "-1"], "--pag-scale -1.0 must be a finite number >= 0"),
])
def test_bad_research_flags_fail_with_one_line_before_compiling(demo_models, tmp_path, capsys, jax_events, model, args,
                                                                words):
    demo_models(model)
    compiled = jax_events("backend_compile")
    argv = ["--model", model, "--prompt", "a fox", "--steps", "2", "--height", "32", "--width", "32",
            "--output", str(tmp_path / "out"), "--cache", str(demo_models.cache), "--quiet", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert not [name for name in compiled if name in ("_prepare", "_denoise", "_decode")], compiled
