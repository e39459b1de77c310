"""sdx.controlnet against diffusers' ControlNetModel, the UNet with a ControlNet's residuals against
diffusers' UNet2DConditionModel, and the config's contract with diffusers' config.json.

Parity: tiny random-weight diffusers ControlNets with every parameter moved off its initial value (so
the zero-initialised convolutions are random), saved with `save_pretrained` and loaded by
`convert.controlnet.load_controlnet`; same inputs (NCHW <-> NHWC at the boundary), float32; each
residual's max abs error must be below 1e-4 x that residual's scale.
"""

import dataclasses
import inspect
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from convert import hub
from convert.controlnet import load_controlnet
from pipelines import executables
from sdx import diffusers_config as DC, io, unet as U, weights as W
from sdx.controlnet import ControlNetConfig, ControlNetModel
from sdx.errors import SdxError
from sdx.model_folder import ModelKind

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from tests.test_convert import FakeHub  # noqa: E402
from tests.test_unet import CASES as UNET_CASES, _inputs, _sdx_unet, _torch_unet  # noqa: E402

CA, D = "CrossAttnDownBlock2D", "DownBlock2D"
SMALL_EMBEDDING = [8, 16, 16, 32]  # four stages as released ControlNets (8x), narrower

# diffusers ControlNetModel config dicts (what a ControlNet's config.json holds), small for two CPU cores.
SD1 = dict(
    block_out_channels=[32, 64], layers_per_block=2, down_block_types=[CA, D], attention_head_dim=2,
    cross_attention_dim=24, conditioning_embedding_out_channels=SMALL_EMBEDDING,
)
# SDXL: text_time added conditioning, several transformer layers, linear projections, heads given as
# num_attention_heads (which a ControlNet honours over attention_head_dim).
SDXL = dict(
    block_out_channels=[32, 64], layers_per_block=1, down_block_types=[D, CA], attention_head_dim=8,
    num_attention_heads=[2, 4], transformer_layers_per_block=[1, 2], cross_attention_dim=32,
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=16 + 6 * 8, conditioning_embedding_out_channels=SMALL_EMBEDDING,
)
# name -> (config.json, conditioning_scale, the guess_mode values to try); one compilation per case
CASES = {
    "sd1": (SD1, 0.7, (False, True)),
    # guess mode is ignored with pooled residuals (diffusers: `guess_mode and not global_pool_conditions`)
    "sd1-bgr-global_pool": (dict(SD1, controlnet_conditioning_channel_order="bgr", global_pool_conditions=True),
                            1.3, (True,)),
    "sdxl": (SDXL, 0.5, (False,)),
}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """torch's thread pool spins on a busy machine: with it the tiny reference models take many times the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _perturbed(model, seed=0):
    """Every parameter += 0.1 N(0, 1): norm scales off 1, biases off 0, zero convolutions random."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def _torch_controlnet(d, seed=0):
    torch.manual_seed(seed)
    return _perturbed(diffusers.ControlNetModel(**d), seed + 1)


def _controlnet_inputs(cfg: ControlNetConfig, hw=(8, 8), batch=2, seq=7, seed=0):
    x, t, ctx, added = _inputs(cfg.unet, hw, batch=batch, seq=seq, seed=seed)
    f = cfg.downscale_factor
    image = np.random.default_rng(seed + 1).random((batch, 3, f * hw[0], f * hw[1]), dtype=np.float32)  # [0, 1]
    return x, t, ctx, image, added


def _nchw(a):
    return np.asarray(a).transpose(0, 3, 1, 2)


def _nhwc(a):
    return jnp.asarray(a.transpose(0, 2, 3, 1))


@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_diffusers(name, tmp_path):
    d, scale, guess_modes = CASES[name]
    torch_model = _torch_controlnet(d)
    torch_model.save_pretrained(tmp_path)
    model = load_controlnet(tmp_path)
    x, t, ctx, image, added = _controlnet_inputs(model.config)
    # one program for every guess mode (XLA shares what they have in common); the scale is traced; the first
    # guess mode also as a sampler's steps call it, reading the ControlNet's `text_context`
    def run(m, s, x, t, ctx, image):
        text = m.text_context(ctx)
        return ([m(x, t, ctx, image, s, added, guess) for guess in guess_modes]
                + [m(x, t, text, image, s, added, guess_modes[0])])
    outputs = nnx.jit(run)(model, jnp.float32(scale), _nhwc(x), jnp.asarray(t), jnp.asarray(ctx), _nhwc(image))
    for guess, (down, mid) in zip([*guess_modes, guess_modes[0]], outputs):
        with torch.no_grad():
            down_ref, mid_ref = torch_model(
                torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(ctx), torch.from_numpy(image),
                conditioning_scale=scale, guess_mode=guess, return_dict=False,
                added_cond_kwargs={k: torch.from_numpy(v) for k, v in added.items()} if added else None,
            )
        assert len(down) == len(down_ref) == len(model.config.residual_channels)
        worst = 0.0
        for i, (out, ref) in enumerate([*zip(down, down_ref), (mid, mid_ref)]):
            out, ref = _nchw(out), ref.numpy()
            assert out.shape == ref.shape, (i, out.shape, ref.shape)
            err, ref_scale = float(np.abs(out - ref).max()), float(np.abs(ref).max())
            assert ref_scale > 0.05, (i, ref_scale)  # a meaningful residual, not a zero convolution's
            assert err <= 1e-4 * ref_scale, f"{name}: residual {i}: max abs err {err:.3e} vs scale {ref_scale:.3f}"
            worst = max(worst, err / ref_scale)
        print(f"{name} guess_mode={guess}: worst max abs err / scale {worst:.2e}")


def test_a_kept_abstract_model_loads_the_same_controlnet(tmp_path, monkeypatch):
    """`load_controlnet(abstract=executables.abstract_model)`, as `Pipeline.load` calls it: the second load
    reads the abstract model back instead of building it, and holds the same weights."""
    _torch_controlnet(CASES["sd1"][0]).save_pretrained(tmp_path / "controlnet")
    monkeypatch.setattr(executables, "folder", lambda: tmp_path / "kept")
    first = load_controlnet(tmp_path / "controlnet", abstract=executables.abstract_model)
    monkeypatch.setattr(ModelKind, "abstract", lambda *a: pytest.fail("built, not read"))
    again = load_controlnet(tmp_path / "controlnet", abstract=executables.abstract_model)
    assert nnx.graphdef(again) == nnx.graphdef(first)
    for a, b in zip(jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(first)), strict=True):
        np.testing.assert_array_equal(a, b)


def _from_unet(d):
    """A perturbed diffusers UNet, a perturbed ControlNet made from it (diffusers' from_unet), and the same
    two in sdx."""
    cfg = U.UNetConfig.from_diffusers_config(d)
    torch_unet = _torch_unet(d)
    torch_cn = _perturbed(
        diffusers.ControlNetModel.from_unet(torch_unet, conditioning_embedding_out_channels=SMALL_EMBEDDING)
    )
    # ControlNetConfig(unet=...) is diffusers' from_unet: the same parameters, strictly
    cn_cfg = ControlNetConfig(unet=cfg, conditioning_embedding_out_channels=tuple(SMALL_EMBEDDING))
    cn = W.load_torch_state(W.abstract(lambda r: ControlNetModel(cn_cfg, rngs=r)),
                            {k: v.numpy() for k, v in torch_cn.state_dict().items()}, where="from_unet")
    return cfg, torch_unet, torch_cn, _sdx_unet(cfg, torch_unet), cn


def test_unet_adds_residuals_as_diffusers():
    """The residuals of a ControlNet made from the UNet (diffusers' from_unet) added by both UNets."""
    cfg, torch_unet, torch_cn, unet, _ = _from_unet(UNET_CASES["sd1"])
    x, t, ctx, _ = _inputs(cfg, (8, 8))
    image = np.random.default_rng(3).random((2, 3, 64, 64), dtype=np.float32)
    with torch.no_grad():
        down, mid = torch_cn(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(ctx), torch.from_numpy(image),
                             conditioning_scale=0.8, return_dict=False)
        ref = torch_unet(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(ctx),
                         down_block_additional_residuals=down, mid_block_additional_residual=mid).sample.numpy()
        plain = torch_unet(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(ctx)).sample.numpy()
    out = _nchw(nnx.jit(lambda m, *a: m(*a[:3], None, *a[3:]))(
        unet, _nhwc(x), jnp.asarray(t), jnp.asarray(ctx), tuple(_nhwc(r.numpy()) for r in down), _nhwc(mid.numpy()),
    ))
    err, scale = float(np.abs(out - ref).max()), float(np.abs(ref).max())
    print(f"unet with residuals: max abs err {err:.2e} (output scale {scale:.2f})")
    assert np.abs(ref - plain).max() > 0.1 * scale  # the residuals matter
    assert err <= 1e-4 * scale


def test_shared_sample_rows_give_diffusers_residuals_and_output():
    """A sampler's classifier-free guidance, both branches reading one image's latents and control image:
    the ControlNet and the UNet given the sample (and the image) once for two context rows give diffusers'
    results for them repeated."""
    cfg, torch_unet, torch_cn, unet, cn = _from_unet(UNET_CASES["sd1"])
    x, _, ctx, _ = _inputs(cfg, (8, 8))
    x, t = x[:1], np.float32(321.0)
    image = np.random.default_rng(3).random((1, 3, 64, 64), dtype=np.float32)
    with torch.no_grad():
        repeated = lambda a: torch.from_numpy(np.repeat(a, 2, axis=0))  # noqa: E731
        down, mid = torch_cn(repeated(x), torch.full((2,), t), torch.from_numpy(ctx), repeated(image),
                             conditioning_scale=0.8, return_dict=False)
        ref = torch_unet(repeated(x), torch.full((2,), t), torch.from_numpy(ctx),
                         down_block_additional_residuals=down, mid_block_additional_residual=mid).sample.numpy()

    def run(unet, cn, x, ctx, image):
        down, mid = cn(x, t, ctx, image, 0.8)
        return down, mid, unet(x, t, ctx, None, down, mid)

    got_down, got_mid, out = nnx.jit(run)(unet, cn, _nhwc(x), jnp.asarray(ctx), _nhwc(image))
    for i, (got, want) in enumerate([*zip(got_down, down), (got_mid, mid), (out, torch.from_numpy(ref))]):
        got, want = _nchw(got), want.numpy()
        assert got.shape == want.shape, (i, got.shape, want.shape)
        err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
        assert scale > 0.05 and err <= 1e-4 * scale, f"output {i}: max abs err {err:.3e} vs scale {scale:.3f}"


def test_residuals_are_checked():
    cfg = U.UNetConfig.from_diffusers_config(UNET_CASES["sd1"])
    unet = W.abstract(lambda r: U.UNet2DConditionModel(cfg, rngs=r))
    cn = W.abstract(lambda r: ControlNetModel(ControlNetConfig(unet=cfg), rngs=r))
    x, t, ctx, _ = _inputs(cfg, (8, 8))
    x = x.transpose(0, 2, 3, 1)
    image = np.zeros((2, 64, 64, 3), np.float32)
    down, mid = nnx.eval_shape(lambda m, scale: m(x, t, ctx, image, scale), cn, jnp.float32(0.5))  # traced scale
    shapes = lambda *args: nnx.eval_shape(lambda m, *a: m(*a), unet, *args)  # errors come at trace time
    assert shapes(x, t, ctx, None, down, mid).shape == x.shape
    with pytest.raises(SdxError, match="come together"):
        shapes(x, t, ctx, None, down, None)
    with pytest.raises(SdxError, match="5 down_block_additional_residuals for 6"):
        shapes(x, t, ctx, None, down[:-1], mid)
    with pytest.raises(SdxError, match=r"down_block_additional_residuals\[1\] of shape \(2, 4, 4, 64\) meets"):
        shapes(x, t, ctx, None, (down[0], down[4], *down[2:]), mid)
    with pytest.raises(SdxError, match="controlnet_cond must be"):
        nnx.eval_shape(lambda m: m(x, t, ctx, image[:, :32], 1.0), cn)
    assert nnx.eval_shape(lambda m: m(x, t, ctx, image, np.ones(2, np.float32)), cn)[1].shape == mid.shape  # per row
    with pytest.raises(SdxError, match=r"conditioning_scale must be one number or one per row \(2\), not \(3,\)"):
        nnx.eval_shape(lambda m: m(x, t, ctx, image, np.ones(3, np.float32)), cn)


# ---- loading -----------------------------------------------------------------------------------------


def test_hub_id_fp16_variant_and_compute_dtype(tmp_path, monkeypatch):
    """A repo keeping its ControlNet in controlnet/ in both precisions: bfloat16 fetches only the fp16 weights."""
    torch_model = _torch_controlnet(SD1)
    torch_model.save_pretrained(tmp_path / "repo" / "controlnet")
    torch_model.half().save_pretrained(tmp_path / "repo" / "controlnet", variant="fp16")
    fake = FakeHub("org/controlnet", tmp_path / "repo", tmp_path / "cache")
    monkeypatch.setattr(hub, "reachable", lambda: True)  # the hub answers
    for name in ("list_repo_files", "snapshot_download"):
        monkeypatch.setattr(hub, name, getattr(fake, name))
    model = load_controlnet("org/controlnet", dtype="bfloat16")  # a 16-bit dtype reads the fp16 variant
    assert fake.downloaded == {"controlnet/config.json", "controlnet/diffusion_pytorch_model.fp16.safetensors"}
    assert model.dtype == jnp.bfloat16 and model.compute.param_dtype == jnp.bfloat16
    kernel = np.asarray(model.controlnet_mid_block.kernel.get_value(), np.float32)[0, 0]  # (in, out)
    want = torch_model.controlnet_mid_block.weight.detach().float().numpy()[:, :, 0, 0].T
    np.testing.assert_array_equal(kernel, want.astype(jnp.bfloat16).astype(np.float32))
    (tmp_path / "repo" / "controlnet").rename(tmp_path / "repo" / "other")
    with pytest.raises(SdxError, match="neither config.json nor controlnet/config.json"):
        load_controlnet("org/controlnet")


def test_loader_is_strict(tmp_path):
    _torch_controlnet(SD1).save_pretrained(tmp_path)
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    tensors = {k: np.array(v) for k, v in io.read_safetensors(path).items()}
    del tensors["controlnet_down_blocks.3.bias"]
    io.write_safetensors(path, sorted(tensors.items()))
    with pytest.raises(SdxError, match=r"controlnet_down_blocks\.3\.bias"):
        load_controlnet(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, conditioning_channels=4)))
    with pytest.raises(SdxError, match=r"controlnet_cond_embedding\.conv_in\.weight.*shape"):
        load_controlnet(tmp_path)
    with pytest.raises(SdxError, match="no such folder"):
        load_controlnet(tmp_path / "absent")


# ---- config ------------------------------------------------------------------------------------------

# config.json fields of released ControlNets (the rest are diffusers' defaults)
SD15_CONTROLNET = dict(
    _class_name="ControlNetModel", attention_head_dim=8, block_out_channels=[320, 640, 1280, 1280],
    cross_attention_dim=768, down_block_types=[CA, CA, CA, D], layers_per_block=2,
)
SDXL_CONTROLNET = dict(
    _class_name="ControlNetModel", addition_embed_type="text_time", addition_time_embed_dim=256,
    attention_head_dim=[5, 10, 20], block_out_channels=[320, 640, 1280], cross_attention_dim=2048,
    down_block_types=[D, CA, CA], projection_class_embeddings_input_dim=2816,
    transformer_layers_per_block=[1, 2, 10], use_linear_projection=True,
)


def test_defaults_table_is_diffusers():
    params = inspect.signature(diffusers.ControlNetModel.__init__).parameters
    assert DC.CONTROLNET_DEFAULTS == {k: p.default for k, p in params.items() if k != "self"}


@pytest.mark.parametrize("d", [SD15_CONTROLNET, SDXL_CONTROLNET], ids=["sd15", "sdxl"])
def test_full_size_parameters_match_diffusers_state_dict(d):
    """Released sizes: diffusers on the meta device, sdx abstract; every key maps with its shape."""
    cfg = ControlNetConfig.from_diffusers_config(d)
    with torch.device("meta"):
        torch_model = diffusers.ControlNetModel(**{k: v for k, v in d.items() if not k.startswith("_")})
    source = {k: np.broadcast_to(np.float32(0), tuple(v.shape)) for k, v in torch_model.state_dict().items()}
    mapped = W.from_torch_keys(W.param_shapes(W.abstract(lambda r: ControlNetModel(cfg, rngs=r))), source, where="meta")
    assert len(mapped) == len(source)


def test_config_fields():
    sdxl = ControlNetConfig.from_diffusers_config(SDXL)
    assert sdxl.unet.num_attention_heads == (2, 4)  # num_attention_heads wins over attention_head_dim
    assert sdxl.unet.transformer_layers_per_block == (1, 2) and sdxl.unet.addition_embed_type == "text_time"
    assert ControlNetConfig.from_dict(json.loads(json.dumps(sdxl.to_dict()))) == sdxl
    asymmetric = ControlNetConfig.from_diffusers_config(dict(SD1, transformer_layers_per_block=[[1, 2], 1]))
    assert asymmetric.unet.down_transformer_layers(0) == (1, 2)
    assert ControlNetConfig.from_diffusers_config(SD15_CONTROLNET).downscale_factor == 8
    with pytest.raises(SdxError, match="unknown field.*sdx"):
        ControlNetConfig.from_dict(dict(sdxl.to_dict(), extra=1))
    with pytest.raises(SdxError, match="mid block"):
        ControlNetConfig(unet=dataclasses.replace(U.UNetConfig(), mid_block_type=None))


@pytest.mark.parametrize("field, value", [
    ("controlnet_conditioning_channel_order", "rgba"),
    ("conditioning_embedding_out_channels", None),
    ("mid_block_type", None),
    ("layers_per_block", [2, 2, 2, 2]),
    ("cross_attention_dim", [768, 768, 768, 768]),
    ("num_attention_heads", "8"),
    ("resnet_time_scale_shift", "scale_shift"),
    ("class_embed_type", "timestep"),
    ("num_class_embeds", 10),
    ("encoder_hid_dim", 768),
    ("addition_embed_type", "text"),
    ("act_fn", "gelu"),
    ("down_block_types", [CA, CA, "SimpleCrossAttnDownBlock2D", D]),
    ("block_out_channels", [320, 640, 1280]),
    ("_class_name", "SD3ControlNetModel"),
    ("some_future_field", 1),
])
def test_unimplemented_values_name_the_field(field, value):
    with pytest.raises(SdxError, match=field):
        ControlNetConfig.from_diffusers_config(dict(SD15_CONTROLNET, **{field: value}))
