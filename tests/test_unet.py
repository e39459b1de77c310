"""sdx.unet against diffusers' UNet2DConditionModel, plus the config's contract with diffusers' config.json.

Parity: small random-weight diffusers UNets with every parameter perturbed away from its initial value
(norm scales not 1, biases not 0), loaded into sdx with the strict mapping, same inputs (NCHW <-> NHWC at
the boundary), float32; the max abs error must be below 1e-4 x the output's scale (we see ~1e-6).
"""

import dataclasses
import inspect
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sdx import diffusers_config as DC, presets, unet as U, weights as W
from sdx.controlnet import ControlNetConfig, ControlNetModel
from sdx.errors import SdxError
from sdx.layers import Attention, Compute

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

CA, D = "CrossAttnDownBlock2D", "DownBlock2D"
CU, UP = "CrossAttnUpBlock2D", "UpBlock2D"

# diffusers-style config dicts (what a unet/config.json holds), each small enough for two CPU cores.
CASES = {
    # SD 1.x: one integer attention_head_dim (= heads) for every level, conv proj_in/proj_out.
    "sd1": dict(
        block_out_channels=[32, 64], layers_per_block=2, down_block_types=[CA, D], up_block_types=[UP, CU],
        attention_head_dim=2, cross_attention_dim=24, sample_size=16,
    ),
    # SD 2.x: per-level heads, linear projections, upcast_attention, 16 groups.
    "sd2": dict(
        block_out_channels=[32, 64, 64], layers_per_block=1, down_block_types=[CA, CA, D],
        up_block_types=[UP, CU, CU], attention_head_dim=[2, 4, 4], cross_attention_dim=48,
        use_linear_projection=True, upcast_attention=True, norm_num_groups=16,
    ),
    # SDXL: text_time added conditioning, more than one transformer layer per block, per-level heads.
    "sdxl": dict(
        block_out_channels=[32, 64, 64], layers_per_block=1, down_block_types=[D, CA, CA],
        up_block_types=[CU, CU, UP], attention_head_dim=[2, 4, 8], transformer_layers_per_block=[1, 1, 2],
        cross_attention_dim=64, use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, projection_class_embeddings_input_dim=32 + 6 * 8,
    ),
    # InstructPix2Pix: SD 1.5 with 8 input channels (noisy latent + image latent).
    "pix2pix": dict(
        in_channels=8, block_out_channels=[32, 64], layers_per_block=1, down_block_types=[CA, D],
        up_block_types=[UP, CU], attention_head_dim=4, cross_attention_dim=24,
    ),
}
# Every other math-changing field sdx honours, on an odd latent size (diffusers' upsample_size path).
OPTIONS = dict(
    block_out_channels=[32, 64], layers_per_block=[1, 2], down_block_types=[CA, CA], up_block_types=[CU, CU],
    transformer_layers_per_block=[[1], [2, 1]], reverse_transformer_layers_per_block=[[1, 2, 1], [2, 1]],
    attention_head_dim=[2, 4], cross_attention_dim=[24, 24], only_cross_attention=[True, False],
    center_input_sample=True, time_embedding_dim=48, conv_in_kernel=1, conv_out_kernel=5, downsample_padding=0,
    flip_sin_to_cos=False, freq_shift=1, norm_eps=0.1, norm_num_groups=8, mid_block_scale_factor=2.0,
    out_channels=3,
)
for mid in ("UNetMidBlock2DCrossAttn", "UNetMidBlock2D", None):
    CASES[f"options-mid={mid}"] = dict(OPTIONS, mid_block_type=mid)
SIZES = {name: (11, 13) if name.startswith("options") else (16, 16) for name in CASES}
# also run as a sampler's steps do, reading `text_context`: SD 1's conv projections, SDXL's several layers
# per block, and a self-attention of only_cross_attention reading the text
TEXT_CONTEXT_CASES = ("sd1", "sdxl", "options-mid=UNetMidBlock2DCrossAttn")


def _torch_unet(d, seed=0):
    torch.manual_seed(seed)
    model = diffusers.UNet2DConditionModel(**{k: v for k, v in d.items() if not k.startswith("_")}).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():  # move every norm scale off 1 and every bias off 0
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _sdx_unet(cfg, torch_model, cp=Compute()):
    state = {k: v.numpy() for k, v in torch_model.state_dict().items()}
    return W.load_torch_state(W.abstract(lambda r: U.UNet2DConditionModel(cfg, cp, rngs=r)), state, where="test")


def _inputs(cfg, hw, batch=2, seq=7, seed=0):
    r = np.random.default_rng(seed)
    x = r.standard_normal((batch, cfg.in_channels, *hw)).astype(np.float32)  # NCHW, as diffusers
    t = np.array([999.0, 21.0, 500.0][:batch], np.float32)
    ctx = r.standard_normal((batch, seq, cfg.cross_attention_dim[0])).astype(np.float32)
    added = None
    if cfg.addition_embed_type == "text_time":
        pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        added = {
            "text_embeds": r.standard_normal((batch, pooled)).astype(np.float32),
            "time_ids": np.array([[1024, 768, 0, 32, 1024, 1024], [512, 512, 16, 0, 768, 1024]][:batch], np.float32),
        }
    return x, t, ctx, added


def _run_both(torch_model, model, x, t, ctx, added):
    with torch.no_grad():
        kw = {k: torch.from_numpy(v) for k, v in added.items()} if added else None
        ref = torch_model(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(ctx), added_cond_kwargs=kw).sample
    out = nnx.jit(lambda m, *a: m(*a))(
        model, jnp.asarray(x.transpose(0, 2, 3, 1)), jnp.asarray(t), jnp.asarray(ctx),
        {k: jnp.asarray(v) for k, v in added.items()} if added else None,
    )
    return np.asarray(out).transpose(0, 3, 1, 2), ref.numpy()


# every case with the default convolutions (on a CPU: 1×1 kernels and the smallest levels as matmuls);
# three with every convolution as a matmul (sdx.conv), the kernels of 1, 3 and 5 and the unpadded one included;
# two with every 3×3 one as Winograd's
@pytest.mark.parametrize("name, conv", [(n, "auto") for n in CASES]
                         + [(n, "matmul") for n in ("sd1", "sdxl", "options-mid=UNetMidBlock2DCrossAttn")]
                         + [(n, "winograd") for n in ("sd1", "sdxl")])
def test_parity_with_diffusers(name, conv):
    d = CASES[name]
    cfg = U.UNetConfig.from_diffusers_config(d)
    torch_model = _torch_unet(d)
    model = _sdx_unet(cfg, torch_model, Compute(conv=conv))
    x, t, ctx, added = _inputs(cfg, SIZES[name])
    out, ref = _run_both(torch_model, model, x, t, ctx, added)
    assert out.shape == ref.shape
    outs = [("context", out)]
    if conv == "auto" and name in TEXT_CONTEXT_CASES:  # the call reading the projections made beforehand
        text = nnx.jit(lambda m, c: m.text_context(c))(model, jnp.asarray(ctx))
        with_text = nnx.jit(lambda m, *a: m(*a))(model, jnp.asarray(x.transpose(0, 2, 3, 1)), jnp.asarray(t), text,
                                                 jax.tree.map(jnp.asarray, added))
        outs.append(("text_context", np.asarray(with_text).transpose(0, 3, 1, 2)))
    scale = float(np.abs(ref).max())
    assert scale > 0.5  # a meaningful output, not something collapsed to zero
    for label, got in outs:
        err = float(np.abs(got - ref).max())
        print(f"{name}, {label}: max abs err {err:.2e} (output scale {scale:.2f})")
        assert err <= 1e-4 * scale, f"{name}, {label}: max abs err {err:.3e} vs output scale {scale:.3f}"


def test_text_context_holds_every_attention_reading_the_text_and_only_its_model_takes_it():
    """A UNet's and a ControlNet's: each refuses the other's."""
    d = CASES["options-mid=UNetMidBlock2DCrossAttn"]  # only_cross_attention on the first level: attn1 reads it too
    cfg = U.UNetConfig.from_diffusers_config(d)
    model = U.UNet2DConditionModel(cfg, rngs=nnx.Rngs(0))
    x, t, ctx, _ = _inputs(cfg, (8, 8))
    text = model.text_context(jnp.asarray(ctx))
    reading = {name for name, m in _torch_unet(d).named_modules() if getattr(m, "is_cross_attention", False)}
    assert set(text.kv) == reading  # diffusers' module paths: every attn2, and attn1 where only_cross_attention
    assert any(k.endswith("attn1") for k in text.kv)
    k, v = text.kv[next(iter(sorted(text.kv)))]
    assert k.shape == v.shape and k.shape[:2] == ctx.shape[:2]
    other = dict(text.kv)
    other.pop(next(iter(other)))
    sample = jnp.asarray(x.transpose(0, 2, 3, 1))
    with pytest.raises(SdxError, match="unet: this TextContext was not made by this model's text_context"):
        model(sample, jnp.asarray(t), U.TextContext(text.states, other))
    net = ControlNetModel(ControlNetConfig(unet=dataclasses.replace(cfg, center_input_sample=False)), rngs=nnx.Rngs(0))
    with pytest.raises(SdxError, match="controlnet: this TextContext was not made by this model's text_context"):
        net(sample, jnp.asarray(t), text, jnp.zeros((2, 64, 64, 3)))
    net_text = net.text_context(jnp.asarray(ctx))  # the encoder half's: the same paths, the up blocks' left out
    assert set(net_text.kv) == {k for k in text.kv if not k.startswith("up_blocks.")} != set(text.kv)
    with pytest.raises(SdxError, match="unet: this TextContext was not made by this model's text_context"):
        model(sample, jnp.asarray(t), net_text)


@pytest.mark.parametrize("name, blank", [("sdxl", U.BlankRows(2, (0,))),  # classifier-free guidance's layout
                                         ("options-mid=UNetMidBlock2DCrossAttn", U.BlankRows(3, (1, 2)))])  # InstructPix2Pix's
def test_blank_rows_skip_their_cross_attentions_and_keep_diffusers_output(name, blank):
    """Rows whose text is zeros (SDXL's negative branch without a negative prompt) compute no
    cross-attention when `text_context` is told where they are: the output is still diffusers'. Forcing
    `is_blank` on rows that are not zeros shows the shortcut is the path taken: those rows change, the
    others do not. The second case's first level has only_cross_attention (its attn1 reads the text)."""
    d = CASES[name]
    cfg = U.UNetConfig.from_diffusers_config(d)
    torch_model = _torch_unet(d)
    model = _sdx_unet(cfg, torch_model)
    x, t, ctx, added = _inputs(cfg, SIZES[name], batch=blank.period)
    zeroed = ctx.copy()
    zeroed[list(blank.rows)] = 0.0
    run = nnx.jit(lambda m, text: m(jnp.asarray(x.transpose(0, 2, 3, 1)), jnp.asarray(t), text, jax.tree.map(jnp.asarray, added)))
    context = nnx.jit(lambda m, c: m.text_context(c, blank))
    text = context(model, jnp.asarray(zeroed))
    assert bool(text.is_blank) and not bool(context(model, jnp.asarray(ctx)).is_blank)
    out, ref = _run_both(torch_model, model, x, t, zeroed, added)
    got = np.asarray(run(model, text)).transpose(0, 3, 1, 2)
    scale = float(np.abs(ref).max())
    assert np.abs(got - ref).max() <= 1e-4 * scale and np.abs(out - ref).max() <= 1e-4 * scale
    # the shortcut forced on rows that read text: those rows lose it, the others keep theirs
    forced = dataclasses.replace(context(model, jnp.asarray(ctx)), is_blank=jnp.asarray(True))
    full = np.asarray(run(model, model.text_context(jnp.asarray(ctx)))).transpose(0, 3, 1, 2)
    wrong = np.asarray(run(model, forced)).transpose(0, 3, 1, 2)
    others = list(blank.others())
    np.testing.assert_allclose(wrong[others], full[others], rtol=0, atol=1e-5 * scale)
    assert all(np.abs(wrong[r] - full[r]).max() > 1e-2 * scale for r in blank.rows)
    with pytest.raises(SdxError, match="blank rows of period 3 in a batch of 2 rows"):
        model.text_context(jnp.zeros((2, 7, ctx.shape[-1])), U.BlankRows(3, (0,)))


# UNets whose sample rows a sampler's classifier-free guidance shares (no pooled text in the time embedding):
# SD 2's linear projections, only_cross_attention on the first level (its attn1 reads the text: only conv_in
# and a resnet are shared) on an odd size, and a first level without attention (SDXL's layout without its
# added conditioning: shared down to the second level); SD 1's with a ControlNet in tests/test_controlnet.py
SHARED_CASES = {name: CASES[name] for name in ("sd2", "options-mid=None")} | {
    "plain-first-level": {k: v for k, v in CASES["sdxl"].items()
                          if k not in ("addition_embed_type", "addition_time_embed_dim", "projection_class_embeddings_input_dim")},
}


@pytest.mark.parametrize("name", SHARED_CASES)
def test_sample_rows_shared_by_the_context_rows_give_diffusers_output_for_each(name):
    """A sample of B / n rows with a context of B rows (guidance branches reading the same latents) is
    diffusers' output for the sample repeated n times in place: two images, n = 2, the timestep one scalar
    as a sampler gives it (the sampler's calls, reading `text_context`, in tests/test_sampler.py)."""
    d = SHARED_CASES[name]
    cfg = U.UNetConfig.from_diffusers_config(d)
    torch_model = _torch_unet(d)
    model = _sdx_unet(cfg, torch_model)
    x, _, _, _ = _inputs(cfg, SIZES.get(name, (16, 16)))
    ctx = np.random.default_rng(5).standard_normal((4, 7, cfg.cross_attention_dim[0])).astype(np.float32)
    t = np.float32(321.0)
    out = np.asarray(nnx.jit(lambda m, x, c: m(x, t, c))(model, jnp.asarray(x.transpose(0, 2, 3, 1)), jnp.asarray(ctx)))
    with torch.no_grad():
        ref = torch_model(torch.from_numpy(np.repeat(x, 2, axis=0)), torch.full((4,), t), torch.from_numpy(ctx)).sample
    out, ref = out.transpose(0, 3, 1, 2), ref.numpy()
    assert out.shape == ref.shape
    err, scale = float(np.abs(out - ref).max()), float(np.abs(ref).max())
    print(f"{name}: max abs err {err:.2e} (output scale {scale:.2f})")
    assert scale > 0.5 and err <= 1e-4 * scale
    assert np.abs(out[0] - out[1]).max() > 1e-2 * scale  # the two rows of an image read different text


def test_shared_rows_are_refused_where_they_cannot_be():
    """One clear error each: a model whose time embedding reads the pooled text (SDXL), and a context whose
    rows are not a multiple of the sample's."""
    cfg = U.UNetConfig.preset("tiny_xl")
    model = W.abstract(lambda r: U.UNet2DConditionModel(cfg, rngs=r))
    x, t, ctx, added = _inputs(cfg, (8, 8))
    shapes = lambda *args: nnx.eval_shape(lambda m: m(*args), model)  # noqa: E731  errors come at trace time
    with pytest.raises(SdxError, match="rows of its sample cannot be shared: give one per context row"):
        shapes(x[:1].transpose(0, 2, 3, 1), t[:1], ctx, jax.tree.map(lambda a: a[:1], added))
    plain = W.abstract(lambda r: U.UNet2DConditionModel(U.UNetConfig.preset("tiny"), rngs=r))
    x, t, ctx, _ = _inputs(plain.config, (8, 8), batch=3)
    with pytest.raises(SdxError, match=r"the sample's 2 rows or a multiple of them, got \(3, 7"):
        nnx.eval_shape(lambda m: m(x[:2].transpose(0, 2, 3, 1), 1.0, ctx), plain)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_a_blank_rows_cross_attention_is_its_value_of_zero(qkv_bias):
    """The shortcut with and without projection biases (the UNets have none): a blank row's output is
    to_out of to_v's bias, or to_out's bias, for every query, as the attention computed in full."""
    layer = Attention(Compute(), 16, heads=2, head_dim=8, context_dim=12, qkv_bias=qkv_bias, rngs=nnx.Rngs(0))
    layer.key = "attn2"
    r = np.random.default_rng(0)
    params = nnx.state(layer, nnx.Param)  # biases start at zero: every parameter moved off its initial value
    nnx.update(layer, jax.tree.map(lambda a: jnp.asarray(r.standard_normal(a.shape), jnp.float32), params))
    x, ctx = (jnp.asarray(r.standard_normal(shape), jnp.float32) for shape in ((4, 5, 16), (4, 7, 12)))
    ctx = ctx.at[2].set(0.0)  # image 1's blank row
    blank = U.BlankRows(2, (0,))
    text = U.TextContext(ctx, {"attn2": layer.keys_values(ctx)}, blank, jnp.asarray(True))
    full, short = layer(x, ctx), layer(x, text)
    np.testing.assert_allclose(np.asarray(short)[[1, 2, 3]], np.asarray(full)[[1, 2, 3]], rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(short)[0] - np.asarray(full)[0]).max() > 1e-2  # row 0 reads text: it changed


def test_scalar_timestep_and_bfloat16_compute():
    cfg = U.UNetConfig.from_diffusers_config(CASES["pix2pix"])
    torch_model = _torch_unet(CASES["pix2pix"])
    x, _, ctx, _ = _inputs(cfg, (8, 8))
    with torch.no_grad():
        ref = torch_model(torch.from_numpy(x), 321, torch.from_numpy(ctx)).sample.numpy().transpose(0, 2, 3, 1)
    xs, cs = jnp.asarray(x.transpose(0, 2, 3, 1)), jnp.asarray(ctx)
    call = nnx.jit(lambda m, x, t, c: m(x, t, c))
    out = call(_sdx_unet(cfg, torch_model), xs, 321, cs)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-4 * np.abs(ref).max())
    bf16 = _sdx_unet(cfg, torch_model, Compute(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
    out16 = call(bf16, xs, jnp.array(321.0), cs)
    assert out16.dtype == jnp.bfloat16
    rel = np.abs(np.asarray(out16, np.float32) - ref).max() / np.abs(ref).max()
    assert rel < 5e-2, rel


def test_remat_gives_same_output_and_gradient():
    d = CASES["pix2pix"]
    cfg = U.UNetConfig.from_diffusers_config(d)
    model = _sdx_unet(cfg, _torch_unet(d))
    x, t, ctx, _ = _inputs(cfg, (8, 8), seq=5)
    x = x.transpose(0, 2, 3, 1)

    def loss_and_grad(remat):
        model.remat = remat  # a static attribute: the same parameters, a different program
        graphdef, state = nnx.split(model)
        loss = lambda state: jnp.mean(nnx.merge(graphdef, state)(x, t, ctx) ** 2)
        traced = jax.jit(jax.value_and_grad(loss)).trace(state)
        return traced.lower().compile()(state), str(traced.jaxpr)

    ((l0, g0), plain), ((l1, g1), remat) = loss_and_grad(False), loss_and_grad(True)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    flat0, flat1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
    assert len(flat0) == len(flat1) > 100
    for a, b in zip(flat0, flat1):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=1e-5)
    # remat is really there: one rematerialised call per down, mid and up block, none without it
    calls = lambda jaxpr: len(re.findall(r"\b(?:remat\w*|checkpoint)\[", jaxpr))  # `remat2` in jax 0.10
    assert calls(remat) == 2 * cfg.levels + 1, calls(remat)
    assert calls(plain) == 0


def test_added_cond_is_required_and_checked():
    model = W.abstract(lambda r: U.UNet2DConditionModel(U.UNetConfig.preset("tiny_xl"), rngs=r))
    x, t, ctx, added = _inputs(U.UNetConfig.preset("tiny_xl"), (8, 8))
    x = x.transpose(0, 2, 3, 1)
    shapes = lambda *args: nnx.eval_shape(lambda m: m(*args), model)  # errors come at trace time
    assert shapes(x, t, ctx, added).shape == x.shape
    with pytest.raises(SdxError, match="added_cond"):
        shapes(x, t, ctx)
    refiner_ids = dict(added, time_ids=added["time_ids"][:, :5])  # 5 refiner ids for a base-style model
    with pytest.raises(SdxError, match="time_ids"):
        shapes(x, t, ctx, refiner_ids)
    with pytest.raises(SdxError, match="timesteps"):
        shapes(x, np.ones(3, np.float32), ctx, added)
    with pytest.raises(SdxError, match="NHWC"):
        shapes(x.transpose(0, 3, 1, 2), t, ctx, added)
    with pytest.raises(SdxError, match="encoder_hidden_states"):
        shapes(x, t, ctx[..., :32], added)  # one tiny CLIP's width where the model wants both


# ---- config ----------------------------------------------------------------------------------------

# unet/config.json of the released checkpoints (the fields that matter; the rest are diffusers defaults).
HUB = {
    "sd15": {  # runwayml/stable-diffusion-v1-5
        "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.6.0", "act_fn": "silu",
        "attention_head_dim": 8, "block_out_channels": [320, 640, 1280, 1280], "center_input_sample": False,
        "cross_attention_dim": 768, "down_block_types": [CA, CA, CA, D], "downsample_padding": 1,
        "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2,
        "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4,
        "sample_size": 64, "up_block_types": [UP, CU, CU, CU],
    },
    "sd21_v": {  # stabilityai/stable-diffusion-2-1
        "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.10.0.dev0", "act_fn": "silu",
        "attention_head_dim": [5, 10, 20, 20], "block_out_channels": [320, 640, 1280, 1280],
        "center_input_sample": False, "cross_attention_dim": 1024, "down_block_types": [CA, CA, CA, D],
        "downsample_padding": 1, "dual_cross_attention": False, "flip_sin_to_cos": True, "freq_shift": 0,
        "in_channels": 4, "layers_per_block": 2, "mid_block_scale_factor": 1, "norm_eps": 1e-05,
        "norm_num_groups": 32, "num_class_embeds": None, "only_cross_attention": False, "out_channels": 4,
        "sample_size": 96, "up_block_types": [UP, CU, CU, CU], "upcast_attention": True,
        "use_linear_projection": True,
    },
    "sd21": {  # stabilityai/stable-diffusion-2-1-base
        "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.8.0", "act_fn": "silu",
        "attention_head_dim": [5, 10, 20, 20], "block_out_channels": [320, 640, 1280, 1280],
        "center_input_sample": False, "cross_attention_dim": 1024, "down_block_types": [CA, CA, CA, D],
        "downsample_padding": 1, "dual_cross_attention": False, "flip_sin_to_cos": True, "freq_shift": 0,
        "in_channels": 4, "layers_per_block": 2, "mid_block_scale_factor": 1, "norm_eps": 1e-05,
        "norm_num_groups": 32, "num_class_embeds": None, "only_cross_attention": False, "out_channels": 4,
        "sample_size": 64, "up_block_types": [UP, CU, CU, CU], "use_linear_projection": True,
    },
    "sdxl_base": {  # stabilityai/stable-diffusion-xl-base-1.0
        "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.19.0.dev0", "act_fn": "silu",
        "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64, "addition_time_embed_dim": 256,
        "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280], "center_input_sample": False,
        "class_embed_type": None, "class_embeddings_concat": False, "conv_in_kernel": 3, "conv_out_kernel": 3,
        "cross_attention_dim": 2048, "cross_attention_norm": None, "down_block_types": [D, CA, CA],
        "downsample_padding": 1, "dual_cross_attention": False, "encoder_hid_dim": None,
        "encoder_hid_dim_type": None, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4,
        "layers_per_block": 2, "mid_block_only_cross_attention": None, "mid_block_scale_factor": 1,
        "mid_block_type": "UNetMidBlock2DCrossAttn", "norm_eps": 1e-05, "norm_num_groups": 32,
        "num_attention_heads": None, "num_class_embeds": None, "only_cross_attention": False, "out_channels": 4,
        "projection_class_embeddings_input_dim": 2816, "resnet_out_scale_factor": 1.0,
        "resnet_skip_time_act": False, "resnet_time_scale_shift": "default", "sample_size": 128,
        "time_cond_proj_dim": None, "time_embedding_act_fn": None, "time_embedding_dim": None,
        "time_embedding_type": "positional", "timestep_post_act": None, "transformer_layers_per_block": [1, 2, 10],
        "up_block_types": [CU, CU, UP], "upcast_attention": None, "use_linear_projection": True,
    },
    "sdxl_refiner": {  # stabilityai/stable-diffusion-xl-refiner-1.0
        "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.19.0.dev0", "act_fn": "silu",
        "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64, "addition_time_embed_dim": 256,
        "attention_head_dim": [6, 12, 24, 24], "block_out_channels": [384, 768, 1536, 1536],
        "cross_attention_dim": 1280, "down_block_types": [D, CA, CA, D], "in_channels": 4, "layers_per_block": 2,
        "mid_block_type": "UNetMidBlock2DCrossAttn", "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4,
        "projection_class_embeddings_input_dim": 2560, "sample_size": 128, "transformer_layers_per_block": 4,
        "up_block_types": [UP, CU, CU, UP], "upcast_attention": None, "use_linear_projection": True,
    },
    "pix2pix": {  # timbrooks/instruct-pix2pix
        "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.13.0.dev0", "act_fn": "silu",
        "attention_head_dim": 8, "block_out_channels": [320, 640, 1280, 1280], "cross_attention_dim": 768,
        "down_block_types": [CA, CA, CA, D], "in_channels": 8, "layers_per_block": 2, "norm_eps": 1e-05,
        "norm_num_groups": 32, "out_channels": 4, "sample_size": 64, "up_block_types": [UP, CU, CU, CU],
        "upcast_attention": False, "use_linear_projection": False,
    },
}


def test_defaults_table_is_diffusers():
    params = inspect.signature(diffusers.UNet2DConditionModel.__init__).parameters
    theirs = {k: p.default for k, p in params.items() if k != "self"}
    assert DC.UNET_DEFAULTS == theirs


def test_every_diffusers_field_is_accounted_for():
    honoured = {f.name for f in dataclasses.fields(U.UNetConfig)} - {"num_attention_heads"} | {"attention_head_dim"}
    fixed, inert = set(DC.UNET_FIXED), set(DC.UNET_INERT)
    assert not (honoured & fixed) and not (honoured & inert) and not (fixed & inert)
    assert honoured | fixed | inert == set(DC.UNET_DEFAULTS) | {"num_attention_heads"}


@pytest.mark.parametrize("name", list(HUB))
def test_hub_configs_give_the_presets(name):
    assert U.UNetConfig.from_diffusers_config(HUB[name]) == U.UNetConfig.preset(name)


@pytest.mark.parametrize("name", presets.NAMES)
def test_presets_round_trip(name):
    cfg = U.UNetConfig.preset(name)
    d = json.loads(json.dumps(cfg.to_diffusers_config()))
    assert U.UNetConfig.from_diffusers_config(d) == cfg
    assert U.UNetConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("name", presets.NAMES)
def test_preset_parameters_match_diffusers_state_dict(name):
    """Full-size models: diffusers on the meta device, sdx abstract; every key maps with its shape."""
    cfg = U.UNetConfig.preset(name)
    with torch.device("meta"):
        torch_model = diffusers.UNet2DConditionModel(
            **{k: v for k, v in cfg.to_diffusers_config().items() if not k.startswith("_")}
        )
    source = {k: np.broadcast_to(np.float32(0), tuple(v.shape)) for k, v in torch_model.state_dict().items()}
    abstract = W.abstract(lambda r: U.UNet2DConditionModel(cfg, rngs=r))
    mapped = W.from_torch_keys(W.param_shapes(abstract), source, where=name)  # strict: raises on any mismatch
    assert len(mapped) == len(source)


def test_extra_keys_that_do_not_change_the_math_are_accepted():
    d = dict(HUB["sd15"], _name_or_path="/x", _use_default_values=["a"], resnet_skip_time_act=True,
             cross_attention_norm="group_norm", mid_block_only_cross_attention=True, sample_size=[64, 96])
    cfg = U.UNetConfig.from_diffusers_config(d)
    assert cfg.sample_size == (64, 96)
    assert dataclasses.replace(cfg, sample_size=64) == U.UNetConfig.preset("sd15")


@pytest.mark.parametrize("field, value", [
    ("resnet_time_scale_shift", "scale_shift"),
    ("time_embedding_type", "fourier"),
    ("class_embed_type", "timestep"),
    ("num_class_embeds", 10),
    ("class_embeddings_concat", True),
    ("addition_embed_type", "text"),
    ("encoder_hid_dim", 768),
    ("encoder_hid_dim_type", "text_proj"),
    ("time_embedding_act_fn", "silu"),
    ("timestep_post_act", "silu"),
    ("dual_cross_attention", True),
    ("attention_type", "gated"),
    ("act_fn", "gelu"),
    ("dropout", 0.1),
    ("num_attention_heads", 8),
    ("norm_num_groups", None),
    ("conv_in_kernel", 4),
    ("downsample_padding", 2),
    ("mid_block_type", "UNetMidBlock2DSimpleCrossAttn"),
    ("down_block_types", [CA, CA, "SimpleCrossAttnDownBlock2D", D]),
    ("up_block_types", ["AttnUpBlock2D", CU, CU, CU]),
    ("transformer_layers_per_block", [[1, 1], 1, 1, 1]),  # asymmetric without reverse_transformer_layers_per_block
    ("layers_per_block", [2, 2]),
    ("attention_head_dim", None),
    ("some_future_field", 1),
])
def test_unimplemented_values_name_the_field(field, value):
    with pytest.raises(SdxError, match=field):
        U.UNetConfig.from_diffusers_config(dict(HUB["sd15"], **{field: value}))


def test_text_time_needs_its_dimensions_and_wrong_class_is_refused():
    with pytest.raises(SdxError, match="projection_class_embeddings_input_dim"):
        U.UNetConfig.from_diffusers_config(dict(HUB["sd15"], addition_embed_type="text_time"))
    with pytest.raises(SdxError, match="_class_name"):
        U.UNetConfig.from_diffusers_config(dict(HUB["sd15"], _class_name="UNet3DConditionModel"))
    with pytest.raises(SdxError, match="unknown preset .sd3."):
        U.UNetConfig.preset("sd3")
