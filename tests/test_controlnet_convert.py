"""ControlNets through `python -m convert` and `convert.controlnet.load_controlnet`: original single files,
sdx and diffusers folders, hub ids.

Parity: the tiny random-weight diffusers ControlNets of tests/test_controlnet.py (SD 1.x and SDXL), written
as original single files by `python -m convert --format single-file`. diffusers' own reader
(`ControlNetModel.from_single_file` with the model's config folder) must find every original weight in
that file (all but SDXL's added embedding, which diffusers' converter leaves out), and the residuals of
sdx's ControlNet read from the file must equal diffusers' ControlNet's: float32, each residual's max abs
error below 1e-4 x its scale. The released full-size layouts (SD 1.5, SD 2.1, SDXL) are checked against
diffusers' converter key by key and value by value on zero-stride arrays (no memory).
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from convert import cli, controlnet_folder, hub, library
from convert import controlnet_single_file as single
from convert.controlnet import load_controlnet, read_controlnet_part
from convert.sources import ModelOptions
from sdx import io, model_folder
from sdx.controlnet import ControlNetConfig
from sdx.errors import SdxError

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from tests.test_controlnet import (  # noqa: E402
    SD1, SD15_CONTROLNET, SDXL, SDXL_CONTROLNET, _controlnet_inputs, _nchw, _nhwc, _one_torch_thread, _torch_controlnet,
)
from tests.test_convert import FakeHub  # noqa: E402

assert _one_torch_thread  # autouse, imported for this module too
CONFIGS = {"sd1": SD1, "sdxl": SDXL}
# thibaud/controlnet-sd21's architecture: SD 2.1's UNet (OpenCLIP-H context, head width 64, linear projections)
SD21_CONTROLNET = dict(SD15_CONTROLNET, attention_head_dim=[5, 10, 20, 20], cross_attention_dim=1024,
                       use_linear_projection=True)
# one program per architecture for every test (nnx.jit caches on the model's graph)
_residuals = nnx.jit(lambda m, *a: m(*a))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (diffusers ControlNet, the folder it is saved in), made on first use."""
    made = {}

    def get(name):
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            made[name] = (_torch_controlnet(CONFIGS[name]), folder)
            made[name][0].save_pretrained(folder)
        return made[name]

    return get


def _worst_error(model, torch_model, scale=0.7) -> float:
    """The largest max abs error / scale over the residuals of `model` (sdx) and `torch_model` (diffusers)."""
    x, t, ctx, image, added = _controlnet_inputs(model.config)
    down, mid = _residuals(model, _nhwc(x), jnp.asarray(t), jnp.asarray(ctx), _nhwc(image), jnp.float32(scale),
                           jax.tree.map(jnp.asarray, added))
    with torch.no_grad():
        down_ref, mid_ref = torch_model(
            torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(ctx), torch.from_numpy(image),
            conditioning_scale=scale, return_dict=False,
            added_cond_kwargs={k: torch.from_numpy(v) for k, v in added.items()} if added else None,
        )
    worst = 0.0
    for out, ref in [*zip(down, down_ref, strict=True), (mid, mid_ref)]:
        ref = ref.numpy()
        worst = max(worst, float(np.abs(_nchw(out) - ref).max()) / float(np.abs(ref).max()))
    return worst


def _state(torch_model) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in torch_model.state_dict().items()}


def _write_single_file(folder, out) -> dict[str, np.ndarray]:
    assert cli.main([str(folder), str(out), "--format", "single-file", "-q"]) == 0
    return io.read_safetensors(out)


def _rewrite(path, edit) -> None:
    tensors = {k: np.array(v) for k, v in io.read_safetensors(path).items()}
    edit(tensors)
    io.write_safetensors(path, sorted(tensors.items()))


# ---- parity ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_single_file_is_what_diffusers_reads(name, saved, tmp_path):
    torch_model, folder = saved(name)
    path = tmp_path / "control.safetensors"
    tensors = _write_single_file(folder, path)
    assert all(k.startswith(single.PREFIX) for k in tensors)
    for key in ("input_hint_block.14.weight", "zero_convs.0.0.weight", "middle_block_out.0.bias",
                *(["label_emb.0.2.weight"] if name == "sdxl" else [])):
        assert single.PREFIX + key in tensors, key

    theirs = diffusers.ControlNetModel.from_single_file(str(path), config=str(folder), low_cpu_mem_usage=False)
    want, got = _state(torch_model), _state(theirs)
    differ = {k for k in want if not np.array_equal(got[k], want[k])}
    # diffusers' converter has no rule for label_emb: its SDXL add_embedding keeps its random initialisation
    assert differ == ({k for k in want if k.startswith("add_embedding.")} if name == "sdxl" else set())

    worst = _worst_error(load_controlnet(path, config=folder), torch_model)
    print(f"{name}: single file -> sdx, worst residual max abs err / scale {worst:.2e}")
    assert worst <= 1e-4
    # without its config the file is read as the released architecture its keys point to, which it is not
    with pytest.raises(SdxError, match="no preset describes|not a released architecture"):
        load_controlnet(path)


def test_folder_round_trips(saved, tmp_path):
    """diffusers folder -> sdx folder -> the same residuals; sdx folder -> diffusers folder -> the same weights."""
    torch_model, folder = saved("sd1")
    sdx = tmp_path / "sdx"
    assert cli.main([str(folder), str(sdx), "-q"]) == 0
    assert io.read_json(sdx / model_folder.SPEC_FILE)[model_folder.MODEL_CLASS] == "ControlNetModel"
    worst = _worst_error(load_controlnet(sdx), torch_model)
    print(f"sd1: diffusers folder -> sdx folder, worst residual max abs err / scale {worst:.2e}")
    assert worst <= 1e-4

    assert cli.main([str(sdx), str(tmp_path / "diffusers"), "--format", "diffusers", "-q"]) == 0
    back = _state(diffusers.ControlNetModel.from_pretrained(tmp_path / "diffusers"))
    want = _state(torch_model)
    assert back.keys() == want.keys() and all(np.array_equal(back[k], want[k]) for k in want)

    library.convert(sdx, tmp_path / "bf16", dtype="bfloat16")
    assert io.read_json(tmp_path / "bf16" / model_folder.SPEC_FILE)["dtype"] == "bfloat16"
    assert load_controlnet(tmp_path / "bf16", dtype="bfloat16").conv_in.kernel.get_value().dtype == jnp.bfloat16
    with pytest.raises(SdxError, match="an sdx ControlNetModel folder, not a pipeline"):
        model_folder.read_spec(sdx)


def test_file_layouts_read_alike(saved, tmp_path):
    """With or without control_model., pickled, with the Stable Diffusion model bundled (ControlNet 1.0)."""
    _, folder = saved("sd1")
    tensors = _write_single_file(folder, tmp_path / "control.safetensors")
    want = read_controlnet_part(tmp_path / "control.safetensors", config=folder).arrays
    bare = {k[len(single.PREFIX):]: v for k, v in tensors.items()}
    io.write_safetensors(tmp_path / "bare.safetensors", sorted(bare.items()))
    bundled = {**tensors, "model.diffusion_model.out.2.weight": np.ones(2, np.float32),
               "first_stage_model.decoder.conv_out.bias": np.ones(3, np.float32), "betas": np.ones(4, np.float32)}
    torch.save({"state_dict": {k: torch.from_numpy(np.array(v)) for k, v in bundled.items()}}, tmp_path / "full.pth")
    for path in ("bare.safetensors", "full.pth"):
        got = read_controlnet_part(tmp_path / path, config=folder).arrays
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want), path

    torch.save({"state_dict": {**{k: torch.from_numpy(np.array(v)) for k, v in tensors.items()},
                               "something.else": torch.zeros(1)}}, tmp_path / "odd.ckpt")
    with pytest.raises(SdxError, match=r"outside control_model\. .*something\.else"):
        read_controlnet_part(tmp_path / "odd.ckpt", config=folder)


@pytest.mark.parametrize("d", [SD15_CONTROLNET, SD21_CONTROLNET, SDXL_CONTROLNET], ids=["sd15", "sd21", "sdxl"])
def test_released_layouts_against_diffusers_converter(d):
    """Full size on zero-stride arrays, each tensor a different constant: sdx's table and diffusers' converter
    put every original tensor in the same place, and the keys alone give back the architecture."""
    from diffusers.loaders.single_file_utils import convert_controlnet_checkpoint

    with torch.device("meta"):
        model = diffusers.ControlNetModel(**{k: v for k, v in d.items() if not k.startswith("_")})
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state = {k: np.broadcast_to(np.float32(i), s) for i, (k, s) in enumerate(sorted(shapes.items()))}
    original = single.to_original(d, state)
    theirs = convert_controlnet_checkpoint(original, {"layers_per_block": 2, **d})
    added = {k for k in state if k.startswith("add_embedding.")}  # SDXL's, which diffusers' converter leaves out
    assert theirs.keys() == state.keys() - added
    assert all(theirs[k].shape == state[k].shape and theirs[k].flat[0] == state[k].flat[0] for k in theirs)

    config, ours = single.from_single_file(original, where="meta")
    assert ControlNetConfig.from_diffusers_config(config) == ControlNetConfig.from_diffusers_config(d)
    assert ours.keys() == state.keys() and all(ours[k].flat[0] == state[k].flat[0] for k in state)
    assert single.from_single_file(state, where="meta")[0] == config  # a file in diffusers' keys


# ---- bad input ---------------------------------------------------------------------------------------


def _cli_fails(capsys, *args) -> str:
    assert cli.main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_bad_single_files(saved, tmp_path, capsys):
    _, folder = saved("sd1")
    path = tmp_path / "control.safetensors"
    _write_single_file(folder, path)
    out = tmp_path / "out"

    _rewrite(path, lambda t: t.pop(single.PREFIX + "zero_convs.3.0.bias"))
    with pytest.raises(SdxError, match=r"missing: zero_convs\.3\.0\.bias"):
        load_controlnet(path, config=folder)
    assert "zero_convs.3.0.bias" in _cli_fails(capsys, path, out, "--config", folder)
    assert not out.exists()

    bias = np.zeros(64, np.float32)
    _rewrite(path, lambda t: t.update({single.PREFIX + "zero_convs.3.0.bias": bias,
                                       single.PREFIX + "zero_convs.9.0.bias": bias}))
    assert "zero_convs.9.0.bias" in _cli_fails(capsys, path, out, "--config", folder)  # no place for it
    _rewrite(path, lambda t: t.pop(single.PREFIX + "zero_convs.9.0.bias"))
    hint_conv = np.zeros((8, 4, 3, 3), np.float32)  # a 4-channel conditioning image for a 3-channel config
    _rewrite(path, lambda t: t.update({single.PREFIX + "input_hint_block.0.weight": hint_conv}))
    assert "controlnet_cond_embedding.conv_in.weight" in _cli_fails(capsys, path, out, "--config", folder)
    assert "read as a ControlNet for sd15, as asked" in _cli_fails(capsys, path, out, "--preset", "sd15")

    unet = tmp_path / "unet"
    unet.mkdir()
    (unet / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    with pytest.raises(SdxError, match="UNet2DConditionModel"):
        load_controlnet(path, config=unet)

    io.write_safetensors(tmp_path / "other.safetensors", {"encoder.weight": np.zeros(2, np.float32)})
    with pytest.raises(SdxError, match="not a ControlNet"):
        load_controlnet(tmp_path / "other.safetensors")
    _cli_fails(capsys, tmp_path / "other.safetensors", out)  # read as a pipeline checkpoint, which it is not either
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))


# ---- hub -----------------------------------------------------------------------------------------------


def test_hub_id_fetches_only_the_controlnet(saved, tmp_path, monkeypatch):
    _, folder = saved("sd1")
    repo = tmp_path / "repo"
    shutil.copytree(folder, repo)
    shutil.copy(repo / "diffusion_pytorch_model.safetensors", repo / "diffusion_pytorch_model.fp16.safetensors")
    (repo / "control_sd15.pth").write_bytes(b"not read")
    fake = FakeHub("org/controlnet", repo, tmp_path / "cache")
    monkeypatch.setattr(hub, "reachable", lambda: True)  # the hub answers
    for name in ("list_repo_files", "snapshot_download"):
        monkeypatch.setattr(hub, name, getattr(fake, name))
    out = library.convert("org/controlnet", tmp_path / "out")
    assert fake.downloaded == {"config.json", "diffusion_pytorch_model.safetensors"}
    want = read_controlnet_part(folder).arrays
    got = controlnet_folder.read_sdx(out).arrays
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    with pytest.raises(SdxError, match="--lora, --vae, --unet and --embedding apply to pipelines"):
        library.convert("org/controlnet", tmp_path / "out2", options=ModelOptions(vae=str(folder)))
