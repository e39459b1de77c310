"""sdx.t2i_adapter against diffusers' T2IAdapter (full, full_xl and light, one- and three-channel images), the
UNet with an adapter's feature maps against diffusers' UNet2DConditionModel(down_intrablock_additional_residuals),
and the loader (folders, hub ids, the fp16 variant, strictness).

Parity: tiny random-weight diffusers models with every parameter moved off its initial value, float32, on
odd latent sizes (the 2x2 means that round sizes up, and the UNet's odd path); max abs error below 1e-5 of
the reference's scale.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from convert import hub
from convert.t2i_adapter import load_t2i_adapter
from pipelines import t2i_adapter as pipeline_adapter
from sdx import io, unet as U
from sdx.errors import SdxError
from sdx.t2i_adapter import T2IAdapterConfig

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from tests.test_convert import FakeHub  # noqa: E402
from tests.test_unet import CASES as UNET_CASES, _inputs, _sdx_unet, _torch_unet  # noqa: E402

# name -> (diffusers T2IAdapter config, control image size in latent pixels (h, w))
ADAPTERS = {
    "full": (dict(in_channels=3, channels=[16, 32, 32], num_res_blocks=2, downscale_factor=8,
                  adapter_type="full_adapter"), (5, 7)),
    "full_xl": (dict(in_channels=3, channels=[16, 32, 32, 32], num_res_blocks=1, downscale_factor=16,
                     adapter_type="full_adapter_xl"), (3, 5)),
    "light_gray": (dict(in_channels=1, channels=[16, 32], num_res_blocks=2, downscale_factor=8,
                        adapter_type="light_adapter"), (5, 3)),
}


def _torch_adapter(d, seed=0):
    torch.manual_seed(seed)
    model = diffusers.T2IAdapter(**d)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def _nchw(a):
    return np.asarray(a).transpose(0, 3, 1, 2)


def _nhwc(a):
    return jnp.asarray(np.asarray(a).transpose(0, 2, 3, 1))


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_parity_with_diffusers(name, tmp_path):
    d, (h, w) = ADAPTERS[name]
    torch_model = _torch_adapter(d)
    torch_model.save_pretrained(tmp_path)
    model = load_t2i_adapter(tmp_path)
    f = d["downscale_factor"]
    image = np.random.default_rng(0).random((2, d["in_channels"], h * f, w * f), dtype=np.float32)
    with torch.no_grad():
        refs = [r.numpy() for r in torch_model(torch.from_numpy(image))]
    outs = nnx.jit(lambda m, x: m(x))(model, _nhwc(image))
    assert [o.shape[1:] for o in outs] == model.config.feature_shapes(h * f, w * f)
    assert len(outs) == len(refs)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        out = _nchw(out)
        assert out.shape == ref.shape, (i, out.shape, ref.shape)
        err, scale = float(np.abs(out - ref).max()), float(np.abs(ref).max())
        print(f"{name} feature {i} {ref.shape}: max abs err {err:.2e} (scale {scale:.2f})")
        assert err <= 1e-5 * scale


# UNet case -> (its adapter, latent size): the SD 1.x UNet (a block with attentions, then one without) takes a
# full adapter's maps inside both blocks; the SDXL one (without, then two with) a full_xl adapter's in its three
# blocks and its mid block.
UNET_ADAPTERS = {
    "sd1": (dict(channels=[32, 64], num_res_blocks=1, downscale_factor=8, adapter_type="full_adapter"), (5, 7)),
    "sdxl": (dict(channels=[32, 64, 64, 64], num_res_blocks=1, downscale_factor=16, adapter_type="full_adapter_xl"),
             (6, 10)),
}


@pytest.mark.parametrize("case", list(UNET_ADAPTERS))
def test_unet_adds_feature_maps_as_diffusers(case):
    """diffusers' UNet given the adapter's maps (times 0.7) inside its down blocks; sdx's given them at the
    batch's rows, and for SD 1.x also with the sample shared by the two rows of one image (a sampler's guidance
    branches), where the maps meet activations computed once for both."""
    d = UNET_CASES[case]
    adapter_config, hw = UNET_ADAPTERS[case]
    cfg = U.UNetConfig.from_diffusers_config(d)
    torch_unet, adapter = _torch_unet(d), _torch_adapter(adapter_config, seed=3)
    unet = _sdx_unet(cfg, torch_unet)
    x, t, ctx, added = _inputs(cfg, hw)
    if case == "sd1":  # one image's latents and timestep read by both rows of the context
        x, t = np.repeat(x[:1], 2, axis=0), np.full((2,), t[0])
    image = torch.rand(1, 3, 8 * hw[0], 8 * hw[1], generator=torch.Generator().manual_seed(4)).repeat(2, 1, 1, 1)
    kw = {k: torch.from_numpy(v) for k, v in added.items()} if added else None
    with torch.no_grad():
        maps = [0.7 * m for m in adapter(image)]
        ref = torch_unet(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(ctx), added_cond_kwargs=kw,
                         down_intrablock_additional_residuals=[m.clone() for m in maps]).sample.numpy()
        plain = torch_unet(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(ctx), added_cond_kwargs=kw).sample.numpy()
    features = tuple(_nhwc(m.numpy()) for m in maps)
    sample = x[:1] if case == "sd1" else x
    run = nnx.jit(lambda m, x, t, ctx, added, f: m(x, t, ctx, added, down_intrablock_additional_residuals=f))
    out = _nchw(run(unet, _nhwc(sample), jnp.asarray(t[:1] if case == "sd1" else t), jnp.asarray(ctx),
                    {k: jnp.asarray(v) for k, v in added.items()} if added else None, features))
    err, scale = float(np.abs(out - ref).max()), float(np.abs(ref).max())
    print(f"{case}: max abs err {err:.2e} (output scale {scale:.2f}, the maps move it by {np.abs(ref - plain).max():.2f})")
    assert np.abs(ref - plain).max() > 0.05 * scale  # the maps matter
    assert err <= 1e-5 * scale


def test_unet_refuses_maps_that_do_not_fit():
    cfg = U.UNetConfig.from_diffusers_config(UNET_CASES["sd1"])
    unet = _sdx_unet(cfg, _torch_unet(UNET_CASES["sd1"]))
    x, t, ctx, _ = _inputs(cfg, (4, 4))
    wrong = (jnp.zeros((2, 4, 4, 32)), jnp.zeros((2, 4, 4, 64)))  # the second should be 2x2
    with pytest.raises(SdxError, match=r"feature map of shape \(2, 4, 4, 64\) meets the UNet's activation \(2, 2, 2, 64\)"):
        unet(_nhwc(x), jnp.asarray(t), jnp.asarray(ctx), down_intrablock_additional_residuals=wrong)
    with pytest.raises(SdxError, match="4 down_intrablock_additional_residuals for 2 down blocks and a mid block"):
        unet(_nhwc(x), jnp.asarray(t), jnp.asarray(ctx), down_intrablock_additional_residuals=wrong * 2)


def test_compatibility_check_names_what_differs():
    """What the sampler checks before compiling: the released shapes fit SD 1.5 and SDXL; an SD adapter does
    not fit SDXL."""
    sd15, sdxl = (U.UNetConfig.preset(name) for name in ("sd15", "sdxl_base"))
    full = T2IAdapterConfig()  # diffusers' defaults: TencentARC's SD 1.4/1.5 adapters
    full_xl = T2IAdapterConfig(channels=(320, 640, 1280, 1280), downscale_factor=16, adapter_type="full_adapter_xl")
    light = T2IAdapterConfig(channels=(320, 640, 1280), num_res_blocks=4, adapter_type="light_adapter")
    model = lambda config: type("Adapter", (), {"config": config})()  # noqa: E731 (what the check reads)
    for config, unet in ((full, sd15), (light, sd15), (full_xl, sdxl)):
        pipeline_adapter.check_compatible(model(config), unet, 8, "x")
    with pytest.raises(SdxError, match=r"made for another UNet: for 16x16 latents its feature maps are 320@16x16, "
                                       r"640@8x8, .* the UNet's blocks take 320@8x8, 640@8x8"):
        pipeline_adapter.check_compatible(model(full), sdxl, 8, "x")


@pytest.mark.parametrize("change, words", [
    ({"adapter_type": "huge_adapter"}, "adapter_type 'huge_adapter' is not one of"),
    ({"channels": [320, 640]}, None),  # diffusers builds a two-width full_xl: sdx does too
    ({"adapter_type": "full_adapter_xl", "channels": [32, 64, 64, 128]}, "from the third on must be equal"),
    ({"channels": "320"}, "channels='320' must be a non-empty list of positive integers"),
    ({"_class_name": "ControlNetModel"}, "_class_name 'ControlNetModel' is not T2IAdapter"),
])
def test_config_is_read_as_diffusers_reads_it(change, words):
    d = {"_class_name": "T2IAdapter", "adapter_type": "full_adapter_xl", **change}
    if words is None:
        assert T2IAdapterConfig.from_diffusers_config(d).channels == tuple(change["channels"])
        return
    with pytest.raises(SdxError, match=words):
        T2IAdapterConfig.from_diffusers_config(d)


def test_hub_id_fp16_variant_and_strict_loading(tmp_path, monkeypatch):
    """A hub repo with both precisions: bfloat16 fetches config.json and the fp16 weights alone. A folder with a
    tensor missing names it."""
    d = ADAPTERS["light_gray"][0]
    torch_model = _torch_adapter(d)
    torch_model.save_pretrained(tmp_path / "repo")
    torch_model.half().save_pretrained(tmp_path / "repo", variant="fp16")
    fake = FakeHub("org/adapter", tmp_path / "repo", tmp_path / "cache")
    monkeypatch.setattr(hub, "reachable", lambda: True)  # the hub answers
    for name in ("list_repo_files", "snapshot_download"):
        monkeypatch.setattr(hub, name, getattr(fake, name))
    model = load_t2i_adapter("org/adapter", dtype="bfloat16")
    assert fake.downloaded == {"config.json", "diffusion_pytorch_model.fp16.safetensors"}
    kernel = np.asarray(model.adapter.body[1].out_conv.kernel.get_value(), np.float32)[0, 0]  # (in, out)
    want = torch_model.adapter.body[1].out_conv.weight.detach().float().numpy()[:, :, 0, 0].T
    np.testing.assert_array_equal(kernel, want.astype(jnp.bfloat16).astype(np.float32))

    path = tmp_path / "repo" / "diffusion_pytorch_model.safetensors"
    tensors = {k: np.array(v) for k, v in io.read_safetensors(path).items()}
    del tensors["adapter.body.0.resnets.1.block2.bias"]
    io.write_safetensors(path, sorted(tensors.items()))
    with pytest.raises(SdxError, match=r"adapter\.body\.0\.resnets\.1\.block2\.bias"):
        load_t2i_adapter(tmp_path / "repo")
    with pytest.raises(SdxError, match="no such folder"):
        load_t2i_adapter(tmp_path / "nowhere")


def _original_state(model, kind: str) -> dict[str, np.ndarray]:
    """`model`'s weights under the original release's keys: diffusers' scripts/convert_original_t2i_adapter.py
    renaming, backwards (full: adapter.body.L.resnets.R -> body.(2L + R), adapter.body.L.in_conv ->
    body.2L.in_conv; light: adapter.body.L.resnets.R -> body.L.body.R)."""
    out = {}
    for key, value in model.state_dict().items():
        parts = key.removeprefix("adapter.").split(".")
        if parts[0] == "body" and kind == "full":
            level = int(parts[1])
            first = 2 * level + (int(parts[3]) if parts[2] == "resnets" else 0)
            parts = ["body", str(first), *(parts[4:] if parts[2] == "resnets" else parts[2:])]
        elif parts[0] == "body" and parts[2] == "resnets":
            parts = ["body", parts[1], "body", *parts[3:]]
        out[".".join(parts)] = value.numpy()
    return out


@pytest.mark.parametrize("kind, config", [
    ("full", dict(in_channels=1, channels=[16, 32, 32], num_res_blocks=2, downscale_factor=8)),  # a sketch adapter
    ("light", dict(channels=[16, 32], num_res_blocks=4, downscale_factor=8, adapter_type="light_adapter")),
])
def test_original_single_files_load_as_diffusers_converts_them(kind, config, tmp_path):
    """An original release's file (a .pth pickle, as TencentARC published them; its .safetensors twin): the
    architecture read from its shapes, the weights renamed as diffusers' conversion script renames them; the
    feature maps equal diffusers' model's."""
    torch_model = _torch_adapter(config)
    state = _original_state(torch_model, kind)
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, tmp_path / "adapter.pth")
    io.write_safetensors(tmp_path / "adapter.safetensors", sorted(state.items()))
    image = np.random.default_rng(1).random((1, config.get("in_channels", 3), 40, 56), dtype=np.float32)
    with torch.no_grad():
        refs = [r.numpy() for r in torch_model(torch.from_numpy(image))]
    for name in ("adapter.pth", "adapter.safetensors"):
        model = load_t2i_adapter(tmp_path / name)
        assert model.config == T2IAdapterConfig.from_diffusers_config(dict(torch_model.config))
        for out, ref in zip(nnx.jit(lambda m, x: m(x))(model, _nhwc(image)), refs, strict=True):
            np.testing.assert_allclose(_nchw(out), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    del state["body.1.block2.bias" if kind == "full" else "body.1.body.3.block2.bias"]
    io.write_safetensors(tmp_path / "cut.safetensors", sorted(state.items()))
    with pytest.raises(SdxError, match="block2.bias"):
        load_t2i_adapter(tmp_path / "cut.safetensors")
    io.write_safetensors(tmp_path / "other.safetensors", [("model.diffusion_model.conv_in.weight", np.zeros(1))])
    with pytest.raises(SdxError, match="not a T2I-Adapter file"):
        load_t2i_adapter(tmp_path / "other.safetensors")
