"""sdx.ip_adapter against diffusers: a UNet with an IP-Adapter's image tokens (plain and plus projections) equals
diffusers' UNet2DConditionModel with the same file loaded by its `_load_ip_adapter_weights` (what
`load_ip_adapter` calls), in float32, for SD 1.x- and SDXL-shaped UNets; and the file checks.

The files are written in the original release's layout (`image_proj.*`, `ip_adapter.<1, 3, 5, ...>.*`) with
random weights, so a wrong numbering of the cross-attentions, a wrong head split or a missing scale fails.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sdx import ip_adapter as IP
from sdx.errors import SdxError
from sdx.unet import UNetConfig

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from tests.test_controlnet import _one_torch_thread  # noqa: E402, F401 (autouse: one torch thread here too)
from tests.test_unet import CASES, _inputs, _sdx_unet, _torch_unet  # noqa: E402

EMBED = 12  # the image encoder's width the test adapters read


def _cross_attention_widths(model) -> list[int]:
    """Each cross-attention's inner width, in diffusers' processor order (what the file numbers)."""
    widths = []
    for name in model.attn_processors:
        if name.endswith("attn2.processor"):
            module = model.get_submodule(name[: -len(".processor")])
            widths.append(module.to_q.out_features)
    return widths


def adapter_file(model, kind: str, seed: int = 0, tokens: int = 4) -> dict[str, torch.Tensor]:
    """A random IP-Adapter for the diffusers UNet `model`, flat as the released .safetensors files."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: 0.3 * torch.randn(*shape, generator=g)
    d = model.config.cross_attention_dim
    out = {}
    if kind == IP.PLAIN:
        out |= {"image_proj.proj.weight": rand(tokens * d, EMBED), "image_proj.proj.bias": rand(tokens * d),
                "image_proj.norm.weight": 1 + rand(d), "image_proj.norm.bias": rand(d)}
    else:
        hidden, inner = 16, 2 * IP.RESAMPLER_HEAD_DIM  # two heads
        out |= {"image_proj.latents": rand(1, tokens, hidden), "image_proj.proj_in.weight": rand(hidden, EMBED),
                "image_proj.proj_in.bias": rand(hidden), "image_proj.proj_out.weight": rand(d, hidden),
                "image_proj.proj_out.bias": rand(d), "image_proj.norm_out.weight": 1 + rand(d),
                "image_proj.norm_out.bias": rand(d)}
        for i in range(4):  # diffusers builds four blocks whatever the file holds
            p = f"image_proj.layers.{i}."
            for norm in ("0.norm1", "0.norm2", "1.0"):
                out |= {f"{p}{norm}.weight": 1 + rand(hidden), f"{p}{norm}.bias": rand(hidden)}
            out |= {f"{p}0.to_q.weight": rand(inner, hidden), f"{p}0.to_kv.weight": rand(2 * inner, hidden),
                    f"{p}0.to_out.weight": rand(hidden, inner), f"{p}1.1.weight": rand(4 * hidden, hidden),
                    f"{p}1.3.weight": rand(hidden, 4 * hidden)}
    for i, width in enumerate(_cross_attention_widths(model)):
        out |= {f"ip_adapter.{2 * i + 1}.to_k_ip.weight": rand(width, d),
                f"ip_adapter.{2 * i + 1}.to_v_ip.weight": rand(width, d)}
    return out


def _diffusers_with(model, tensors: dict, scale: float):
    nested = {"image_proj": {}, "ip_adapter": {}}
    for key, value in tensors.items():
        group, _, rest = key.partition(".")
        nested[group][rest] = value
    model._load_ip_adapter_weights([nested], low_cpu_mem_usage=False)
    for processor in model.attn_processors.values():
        if hasattr(processor, "scale"):
            processor.scale = [scale]
    return model


@pytest.mark.parametrize("case,kind,scale", [("sd1", IP.PLAIN, 0.6), ("sd1", IP.PLUS, 1.0), ("sdxl", IP.PLAIN, 1.0),
                                             ("sdxl", IP.PLUS, 0.4)])
def test_unet_with_adapter_matches_diffusers(tmp_path, case, kind, scale):
    d = CASES[case]
    cfg = UNetConfig.from_diffusers_config(d)
    reference = _torch_unet(d)
    model = _sdx_unet(cfg, reference)
    tensors = adapter_file(reference, kind)
    path = tmp_path / "ip-adapter.safetensors"
    safetensors_torch.save_file(tensors, str(path))
    adapter = IP.load_ip_adapter(path, model)
    assert adapter.config.kind == kind and adapter.config.tokens == 4

    x, t, ctx, added = _inputs(cfg, (8, 8))
    rng = np.random.default_rng(3)
    features = rng.standard_normal((2, EMBED) if kind == IP.PLAIN else (2, 5, EMBED)).astype(np.float32)
    with torch.no_grad():
        _diffusers_with(reference, tensors, scale)
        kw = {k: torch.from_numpy(v) for k, v in (added or {}).items()}
        ref = reference(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(ctx),
                        added_cond_kwargs=kw | {"image_embeds": [torch.from_numpy(features)[:, None]]}).sample.numpy()

    def run(unet, adapter, x, t, ctx, features, added):
        return unet(x, t, ctx, added, interventions=adapter.interventions(unet, adapter.tokens(features), scale))

    out = nnx.jit(run)(model, adapter, jnp.asarray(x.transpose(0, 2, 3, 1)), jnp.asarray(t), jnp.asarray(ctx),
                       jnp.asarray(features), {k: jnp.asarray(v) for k, v in added.items()} if added else None)
    out = np.asarray(out).transpose(0, 3, 1, 2)
    without = nnx.jit(lambda m, *a: m(*a))(model, jnp.asarray(x.transpose(0, 2, 3, 1)), jnp.asarray(t),
                                           jnp.asarray(ctx), {k: jnp.asarray(v) for k, v in added.items()} if added else None)
    err, effect = np.abs(out - ref).max(), np.abs(out - np.asarray(without).transpose(0, 3, 1, 2)).max()
    print(f"{case} {kind} scale {scale}: max abs error {err:.2e}, the adapter moves the output by {effect:.2f}")
    assert effect > 0.1  # the adapter acts, so the comparison means something
    assert err < 1e-4 * max(1.0, np.abs(ref).max())


# per-block specs as diffusers' set_ip_adapter_scale takes them (InstantStyle's style and layout blocks among them)
SPECS = {
    "sd1": [{"down": {"block_0": [0.5, 2.0]}}, {"up": {"block_1": [0.0, 1.0, 0.0]}, "mid": [0.3]}, {"down": 0.7, "up": 1.5}],
    "sdxl": [{"up": {"block_0": [0.0, 1.0]}}, {"down": {"block_2": 0.4}, "mid": 2.0, "up": {"block_1": [1.0]}}],
}


@pytest.mark.parametrize("case", SPECS)
def test_per_block_scales_match_diffusers(case):
    import types

    from diffusers.loaders.ip_adapter import IPAdapterMixin

    d = CASES[case]
    reference = _torch_unet(d)
    model = _sdx_unet(UNetConfig.from_diffusers_config(d), reference)
    _diffusers_with(reference, adapter_file(reference, IP.PLAIN), 1.0)
    names = [name[: -len(".processor")] for name in reference.attn_processors if name.endswith("attn2.processor")]
    for spec in SPECS[case]:
        IPAdapterMixin.set_ip_adapter_scale(types.SimpleNamespace(unet=reference), spec)
        theirs = [reference.attn_processors[f"{name}.processor"].scale[0] for name in names]
        ours = IP.attention_scales(IP.diffusers_scales(spec, model), model)
        np.testing.assert_array_equal(ours, np.float32(theirs), err_msg=str(spec))
        assert len(set(theirs)) > 1  # the spec tells blocks apart
    with pytest.raises(SdxError, match="no block_7"):
        IP.diffusers_scales({"up": {"block_7": 1.0}}, model)
    with pytest.raises(SdxError, match="unknown part 'middle'"):
        IP.diffusers_scales({"middle": 1.0}, model)
    with pytest.raises(SdxError, match="give 1 or"):
        block = next(i for i, b in enumerate(model.up_blocks) if b.attentions is not None)
        IP.diffusers_scales({"up": {f"block_{block}": [1.0] * 7}}, model)


def test_attention_order_is_diffusers_processor_order():
    d = CASES["sdxl"]
    reference = _torch_unet(d)
    model = _sdx_unet(UNetConfig.from_diffusers_config(d), reference)
    ours = [key for key, _ in IP.cross_attentions(model)]
    theirs = [name[: -len(".processor")] for name in reference.attn_processors if name.endswith("attn2.processor")]
    assert ours == theirs


def test_file_errors(tmp_path):
    d = CASES["sd1"]
    reference = _torch_unet(d)
    model = _sdx_unet(UNetConfig.from_diffusers_config(d), reference)
    tensors = adapter_file(reference, IP.PLAIN)

    def load(tensors, name="a.safetensors"):
        path = tmp_path / name
        safetensors_torch.save_file(tensors, str(path))
        return IP.load_ip_adapter(path, model)

    with pytest.raises(SdxError, match="no such file"):
        IP.load_ip_adapter(tmp_path / "missing.safetensors", model)
    with pytest.raises(SdxError, match=r"\.bin file"):
        IP.load_ip_adapter(tmp_path / "ip-adapter_sd15.bin", model)
    with pytest.raises(SdxError, match="unexpected tensor 'extra'"):
        load(tensors | {"extra": torch.zeros(1)})
    with pytest.raises(SdxError, match="made for another UNet"):
        load({**tensors, "ip_adapter.1.to_k_ip.weight": torch.zeros(3, 24), "ip_adapter.1.to_v_ip.weight": torch.zeros(3, 24)})
    with pytest.raises(SdxError, match="FaceID"):
        load({"image_proj.norm.weight": torch.zeros(24), "image_proj.proj.0.weight": torch.zeros(4, 4),
              **{k: v for k, v in tensors.items() if k.startswith("ip_adapter.")}})
    with pytest.raises(SdxError, match="has shape"):
        load({**tensors, "image_proj.norm.bias": torch.zeros(5)})
