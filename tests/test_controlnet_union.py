"""sdx.controlnet_union against diffusers' ControlNetUnionModel; its config's contract with diffusers' config.json;
its loading and converting.

Parity: diffusers' `ControlNetUnionModel.from_unet` of a tiny SDXL UNet, the union's own fields made tiny, every
parameter moved off its init and the zero-initialised convolutions and projection given real weights
(`union_from_unet`), saved with `save_pretrained` and loaded by `convert.controlnet.load_controlnet`; same inputs
(NCHW <-> NHWC at the boundary), float32; each residual's max abs error must be below 1e-4 x its scale.

diffusers' condition transformer attends across the batch (see `sdx.controlnet_union`): on a batch of different
rows sdx equals it with `rows_per_image=None`, and with each image's own rows it equals diffusers run on one
image at a time, which is what the sampler asks.
"""

import dataclasses
import inspect
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from convert import cli
from convert import controlnet_single_file as single
from convert.controlnet import load_controlnet, read_controlnet_part
from sdx import diffusers_config as DC, io, model_folder, weights as W
from sdx.controlnet_union import ControlNetUnionConfig, ControlNetUnionModel
from sdx.errors import SdxError
from sdx.unet import UNetConfig

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from tests.test_controlnet import _nchw, _nhwc, _one_torch_thread  # noqa: E402
from tests.test_unet import CASES as UNET_CASES, _inputs, _torch_unet  # noqa: E402
from tests.tiny_models import perturb  # noqa: E402

assert _one_torch_thread  # autouse, imported for this module too
WIDTHS = [8, 16, 16, 32]  # the image embedding: four stages (8x), narrow
UNION_PARTS = ("task_embedding", "transformer_layes", "spatial_ch_projs", "control_add_embedding")
# the union's own fields, tiny: the UNet's first width (32), two heads, two blocks, ProMax's eight types
TINY = dict(num_control_type=8, num_trans_channel=32, num_trans_head=2, num_trans_layer=2, num_proj_channel=32)
# name -> (ControlNetUnionConfig fields beyond TINY, modes, scales, the guess modes to try); one program each
CASES = {
    "one-type": ({}, [5], [0.7], (False, True)),
    "two-types": ({}, [3, 1], [0.6, 1.3], (False, True)),
    # guess mode only turns the scales off: with pooled residuals diffusers ignores it
    "two-types-global_pool": ({"global_pool_conditions": True}, [0, 6], [1.1, 0.4], (True,)),
}


def union_from_unet(unet, widths, seed: int = 0, **fields):
    """diffusers' ControlNetUnionModel.from_unet of `unet` with the union's fields `fields` (from_unet leaves them
    at their 320-wide defaults), every parameter moved off its init, and the zero-initialised convolutions and
    projection given real weights, as a trained one has."""
    base = diffusers.ControlNetUnionModel.from_unet(unet, conditioning_embedding_out_channels=widths)
    torch.manual_seed(seed)
    net = diffusers.ControlNetUnionModel.from_config(
        {**{k: v for k, v in base.config.items() if not k.startswith("_")}, **fields})
    shared = {k: v for k, v in base.state_dict().items() if not k.startswith(UNION_PARTS)}
    assert not net.load_state_dict(shared, strict=False).unexpected_keys  # from_unet's copy of the UNet
    generator = torch.Generator().manual_seed(seed + 10)
    perturb(net, generator)
    zeros = [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out,
             net.spatial_ch_projs]
    with torch.no_grad():
        for layer in zeros:
            layer.weight.normal_(0.0, 0.3, generator=generator)
    return net.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """fields -> (diffusers ControlNetUnionModel from the tiny SDXL UNet, its folder), made on first use."""
    made = {}

    def get(**fields):
        key = tuple(sorted(fields.items()))
        if key not in made:
            net = union_from_unet(_torch_unet(UNET_CASES["sdxl"]), WIDTHS, **TINY, **fields)
            folder = tmp_path_factory.mktemp("union")
            net.save_pretrained(folder)
            made[key] = (net, folder)
        return made[key]

    return get


def _types(modes, rows: int, count: int = 8) -> np.ndarray:
    """(rows, count) float32: diffusers' multi-hot control_type."""
    out = np.zeros((rows, count), np.float32)
    out[:, modes] = 1.0
    return out


def _diffusers(net, x, t, ctx, images, modes, scales, added, guess=False):
    """diffusers' residuals (NCHW numpy) for images (B, K, C, H, W)."""
    with torch.no_grad():
        down, mid = net(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(ctx),
                        [torch.from_numpy(images[:, k]) for k in range(images.shape[1])],
                        control_type=torch.from_numpy(_types(modes, len(x))), control_type_idx=list(modes),
                        conditioning_scale=list(scales), guess_mode=guess, return_dict=False,
                        added_cond_kwargs={k: torch.from_numpy(v) for k, v in added.items()})
    return [r.numpy() for r in (*down, mid)]


def _sdx(down_mid) -> list[np.ndarray]:
    down, mid = down_mid
    return [_nchw(r) for r in (*down, mid)]


def _worst(got: list, want: list, where: str) -> float:
    """The largest residual error relative to the residual's scale; each residual must be meaningful."""
    assert len(got) == len(want)
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, (where, i, a.shape, b.shape)
        scale = float(np.abs(b).max())
        assert scale > 0.05, (where, i, scale)  # a meaningful residual, not a zero convolution's
        worst = max(worst, float(np.abs(a - b).max()) / scale)
    return worst


def _images(rows: int, k: int, seed: int = 1) -> np.ndarray:
    """(B, K, C, 8h, 8w) in [0, 1]: noise, each image dimmed by its own factor (so that their spatial means, the
    condition transformer's tokens, differ)."""
    rng = np.random.default_rng(seed)
    dim = rng.uniform(0.1, 1.0, (rows, k, 1, 1, 1)).astype(np.float32)
    return rng.random((rows, k, 3, 64, 64), dtype=np.float32) * dim


def _nhwc5(a: np.ndarray) -> jnp.ndarray:
    return jnp.asarray(a.transpose(0, 1, 3, 4, 2))  # (B, K, C, H, W) -> (B, K, H, W, C)


@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_diffusers(name, saved):
    """Two different rows (latents, timesteps, text, images), sdx attending across the whole batch as diffusers."""
    fields, modes, scales, guess_modes = CASES[name]
    torch_model, folder = saved(**fields)
    model = load_controlnet(folder)
    assert isinstance(model, ControlNetUnionModel) and model.config.num_control_type == 8
    x, t, ctx, added = _inputs(model.config.unet, (8, 8))
    images = _images(2, len(modes))

    def run(m, x, t, ctx, images, types, index, scale, added):
        return [m(x, t, ctx, images, types, index, scale, added, guess) for guess in guess_modes]

    outputs = nnx.jit(run)(model, _nhwc(x), jnp.asarray(t), jnp.asarray(ctx), _nhwc5(images),
                                    jnp.asarray(_types(modes, 2)), jnp.asarray(modes), jnp.asarray(scales, jnp.float32),
                                    {k: jnp.asarray(v) for k, v in added.items()})
    for guess, out in zip(guess_modes, outputs):
        want = _diffusers(torch_model, x, t, ctx, images, modes, scales, added, guess)
        worst = _worst(_sdx(out), want, f"{name} guess_mode={guess}")
        print(f"{name} guess_mode={guess}: worst residual max abs err / scale {worst:.2e} (bar 1e-4)")
        assert worst <= 1e-4


def test_condition_transformer_attends_as_diffusers_across_the_rows_asked(saved):
    """The condition transformer's blocks against diffusers' (torch's MultiheadAttention without batch_first) on
    tokens (B=4, K+1=3, C): attending across all four rows is diffusers' result, across pairs is diffusers' on
    each pair alone, and the two differ (the rows really are the sequence)."""
    torch_model, folder = saved()
    model = load_controlnet(folder)
    tokens = np.random.default_rng(5).standard_normal((4, 3, 32)).astype(np.float32)

    def reference(rows):
        with torch.no_grad():
            x = torch.from_numpy(tokens[rows])
            for layer in torch_model.transformer_layes:
                x = layer(x)
        return x.numpy()

    def ours(m, x, group):
        for layer in m.transformer_layes:
            x = layer(x, group)
        return x

    whole, pairs = nnx.jit(lambda m, x: (ours(m, x, 4), ours(m, x, 2)))(model, jnp.asarray(tokens))
    alone = np.concatenate([reference(slice(0, 2)), reference(slice(2, 4))])
    scale = np.abs(alone).max()
    errors = [float(np.abs(np.asarray(whole) - reference(slice(0, 4))).max() / scale),
              float(np.abs(np.asarray(pairs) - alone).max() / scale)]
    mixed = float(np.abs(reference(slice(0, 4)) - alone).max() / scale)
    print(f"condition transformer: whole batch {errors[0]:.1e}, pairs {errors[1]:.1e} (bar 1e-5); diffusers' "
          f"batch of four moves the pairs' tokens by {mixed:.2f} of their scale")
    assert max(errors) <= 1e-5 and mixed > 0.05


def test_each_image_attends_across_its_own_rows(saved):
    """Two images, each with classifier-free guidance's two rows (negative and positive text, the same latents
    and control images): sdx's batch of both, each attending across its own rows, gives each image what diffusers
    gives it alone; diffusers' batch of both mixes them."""
    torch_model, folder = saved()
    model = load_controlnet(folder)
    modes, scales = [1, 4], [0.8, 1.2]
    x, _, ctx, added = _inputs(model.config.unet, (8, 8), batch=4, seed=3)
    x = np.repeat(x[::2], 2, axis=0)  # image-major: (image 0 negative, image 0 positive, image 1 ...)
    t = np.full((4,), 601.0, np.float32)
    added = {"text_embeds": added["text_embeds"], "time_ids": np.repeat(added["time_ids"][:2], 2, axis=0)}
    images = np.repeat(_images(2, 2, seed=4), 2, axis=0)
    out = nnx.jit(lambda m, *a: m(*a, rows_per_image=2))(
        model, _nhwc(x), jnp.asarray(t), jnp.asarray(ctx), _nhwc5(images), jnp.asarray(_types(modes, 4)),
        jnp.asarray(modes), jnp.asarray(scales, jnp.float32), {k: jnp.asarray(v) for k, v in added.items()})
    ours = _sdx(out)
    both = _diffusers(torch_model, x, t, ctx, images, modes, scales, added)
    for j in range(2):
        rows = slice(2 * j, 2 * j + 2)
        alone = _diffusers(torch_model, x[rows], t[rows], ctx[rows], images[rows], modes, scales,
                           {k: v[rows] for k, v in added.items()})
        worst = _worst([r[rows] for r in ours], alone, f"image {j}")
        mixed = _worst([r[rows] for r in both], alone, f"image {j} in diffusers' batch")
        print(f"image {j}: sdx in a batch of two vs diffusers alone {worst:.2e} (bar 1e-4); diffusers' batch of two "
              f"moves it by {mixed:.2e} of the residuals' scale")
        assert worst <= 1e-4


def test_inputs_are_checked(saved):
    _, folder = saved()
    model = load_controlnet(folder)
    x, t, ctx, added = _inputs(model.config.unet, (8, 8))
    x, images, types = _nhwc(x), jnp.zeros((2, 2, 64, 64, 3)), jnp.asarray(_types([0, 1], 2))
    shape = lambda *a, **kw: nnx.eval_shape(lambda m: m(x, t, ctx, *a, added_cond=added, **kw), model)  # noqa: E731
    assert shape(images, types, jnp.asarray([0, 1]), jnp.ones((2, 2)))[1].shape == (2, 2, 2, 64)
    with pytest.raises(SdxError, match=r"controlnet_cond must be \(B=2 or 1, K images"):
        shape(images[:, 0], types, jnp.asarray([0, 1]))
    with pytest.raises(SdxError, match="controlnet_cond must be"):
        shape(images[:, :, :32], types, jnp.asarray([0, 1]))
    with pytest.raises(SdxError, match=r"control_type must be \(B=2 or 1, num_control_type=8\)"):
        shape(images, types[:, :6], jnp.asarray([0, 1]))
    with pytest.raises(SdxError, match=r"control_type_idx must be one value, one per image \(2\)"):
        shape(images, types, jnp.asarray([0, 1, 2]))
    with pytest.raises(SdxError, match=r"conditioning_scale must be"):
        shape(images, types, jnp.asarray([0, 1]), jnp.ones((3,)))
    with pytest.raises(SdxError, match="rows_per_image=3 does not divide"):
        shape(images, types, jnp.asarray([0, 1]), rows_per_image=3)


# ---- loading and converting ---------------------------------------------------------------------------


def _state(net) -> dict:
    return {k: v.detach().numpy() for k, v in net.state_dict().items()}


def test_what_xinsir_ships_loads_as_a_union(saved, tmp_path):
    """xinsir's config.json names ControlNetModel and carries num_control_type; a single file in diffusers' keys
    reads with its config folder (and, a released SDXL size, without: `single.preset_config`)."""
    torch_model, folder = saved()
    config = json.loads((folder / "config.json").read_text())
    xinsir = tmp_path / "xinsir"
    xinsir.mkdir()
    (xinsir / "config.json").write_text(json.dumps(dict(config, _class_name="ControlNetModel")))
    (xinsir / "diffusion_pytorch_model.safetensors").symlink_to(folder / "diffusion_pytorch_model.safetensors")
    want = read_controlnet_part(folder)
    for source, options in ((xinsir, {}), (folder / "diffusion_pytorch_model.safetensors", {"config": folder})):
        part = read_controlnet_part(source, **options)
        assert part.cls == "ControlNetUnionModel" and part.config == want.config
        assert all(np.array_equal(part.arrays[k], want.arrays[k]) for k in want.arrays)
    # without the union's fields, the weights' task_embedding still says union: diffusers' 320-wide defaults
    (xinsir / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in TINY}))
    with pytest.raises(SdxError, match="controlnet-union config: num_trans_channel=320 must be the first block's"):
        read_controlnet_part(xinsir)
    released = {"conv_in.weight": (320, 4, 3, 3), "task_embedding": (8, 320),
                 "controlnet_cond_embedding.conv_in.weight": (16, 3, 3, 3),
                 **{f"controlnet_cond_embedding.blocks.{2 * k - 1}.weight": (w, 3, 3, 3)
                    for k, w in enumerate([32, 96, 256], start=1)},
                 **{f"controlnet_cond_embedding.{name}.weight": (1, 1, 3, 3)
                    for name in ("blocks.0", "blocks.2", "blocks.4", "conv_out")}}
    promax = single.preset_config({k: np.zeros(s, np.float32) for k, s in released.items()}, "diffusers", "sdxl_base",
                                  where="promax")
    cfg = ControlNetUnionConfig.from_diffusers_config(promax)
    assert cfg.num_control_type == 8 and cfg.conditioning_embedding_out_channels == (16, 32, 96, 256)


def test_folders_round_trip(saved, tmp_path):
    """diffusers folder -> sdx folder -> the same weights; sdx folder -> diffusers folder diffusers reads back."""
    torch_model, folder = saved()
    sdx = tmp_path / "sdx"
    assert cli.main([str(folder), str(sdx), "-q"]) == 0
    assert io.read_json(sdx / model_folder.SPEC_FILE)[model_folder.MODEL_CLASS] == "ControlNetUnionModel"
    got, want = read_controlnet_part(sdx), read_controlnet_part(folder)
    assert got.config == want.config and all(np.array_equal(got.arrays[k], want.arrays[k]) for k in want.arrays)
    assert isinstance(load_controlnet(sdx), ControlNetUnionModel)
    assert cli.main([str(sdx), str(tmp_path / "diffusers"), "--format", "diffusers", "-q"]) == 0
    back = diffusers.ControlNetUnionModel.from_pretrained(tmp_path / "diffusers")
    assert back.config.num_trans_layer == 2 and _state(back).keys() == _state(torch_model).keys()
    assert all(np.array_equal(v, _state(torch_model)[k]) for k, v in _state(back).items())
    assert cli.main([str(sdx), str(tmp_path / "one.safetensors"), "--format", "single-file", "-q"]) == 2


# ---- config ------------------------------------------------------------------------------------------

# xinsir/controlnet-union-sdxl-1.0's ProMax config.json (diffusers' defaults for the fields it leaves out)
XINSIR_PROMAX = dict(
    _class_name="ControlNetModel", addition_embed_type="text_time", addition_time_embed_dim=256,
    attention_head_dim=[5, 10, 20], block_out_channels=[320, 640, 1280],
    conditioning_embedding_out_channels=[16, 32, 96, 256],
    cross_attention_dim=2048, down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    projection_class_embeddings_input_dim=2816, transformer_layers_per_block=[1, 2, 10], use_linear_projection=True,
    num_control_type=8,
)


def test_defaults_table_is_diffusers():
    params = inspect.signature(diffusers.ControlNetUnionModel.__init__).parameters
    assert DC.CONTROLNET_UNION_DEFAULTS == {k: p.default for k, p in params.items() if k != "self"}


def test_full_size_parameters_match_diffusers_state_dict():
    """xinsir's ProMax: diffusers on the meta device, sdx abstract; every key maps with its shape."""
    cfg = ControlNetUnionConfig.from_diffusers_config(XINSIR_PROMAX)
    with torch.device("meta"):
        torch_model = diffusers.ControlNetUnionModel(**{k: v for k, v in XINSIR_PROMAX.items() if k[0] != "_"})
    source = {k: np.broadcast_to(np.float32(0), tuple(v.shape)) for k, v in torch_model.state_dict().items()}
    model = W.abstract(lambda r: ControlNetUnionModel(cfg, rngs=r))
    assert len(W.from_torch_keys(W.param_shapes(model), source, where="meta")) == len(source)
    assert ControlNetUnionConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("field, value", [
    ("controlnet_conditioning_channel_order", "bgr"),
    ("mid_block_type", "UNetMidBlock2D"),
    ("addition_embed_type", None),
    ("num_trans_channel", 640),
    ("num_proj_channel", 64),
    ("num_trans_head", 7),
    ("num_control_type", 0),
    ("num_trans_layer", "1"),
    ("_class_name", "SD3ControlNetModel"),
    ("some_future_field", 1),
])
def test_unimplemented_values_name_the_field(field, value):
    with pytest.raises(SdxError, match=field):
        ControlNetUnionConfig.from_diffusers_config(dict(XINSIR_PROMAX, **{field: value}))


def test_union_is_told_from_a_controlnet_by_its_config():
    assert DC.is_controlnet_union({"_class_name": "ControlNetUnionModel"}) and DC.is_controlnet_union(XINSIR_PROMAX)
    assert not DC.is_controlnet_union({"_class_name": "ControlNetModel", "block_out_channels": [320]})
    with pytest.raises(SdxError, match="addition_time_embed_dim"):
        ControlNetUnionConfig(unet=dataclasses.replace(UNetConfig.from_diffusers_config(UNET_CASES["sdxl"]),
                                                       addition_time_embed_dim=None), num_trans_channel=32)
