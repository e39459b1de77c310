"""python -m convert's writers and options: --format diffusers / single-file, --config, --vae, hub
--lora/--vae/--unet, and the one-line errors, on the tiny random-weight pipelines of tests/tiny_models.py.

Exports are checked against diffusers' own loaders (`from_pretrained`, `from_single_file`): their
state dicts must equal the source pipeline's bit for bit. The images a single file or a LoRA gives
through `python -m sdx.sample` are in tests/test_sample_checkpoints.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from convert import cli, hub, library
from convert.sdx_folder import read_sdx_folder
from sdx import model_folder
from sdx.io import read_safetensors

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from tests.test_convert import FakeHub  # noqa: E402
from tests.tiny_models import make_tiny_pipeline  # noqa: E402

_MODELS = ("unet", "vae", "text_encoder", "text_encoder_2")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (torch pipeline, its diffusers folder, its sdx folder), built once per kind."""
    made = {}

    def get(kind: str):
        if kind not in made:
            root = tmp_path_factory.mktemp(kind)
            pipe = make_tiny_pipeline(kind, root / "diffusers")
            made[kind] = (pipe, root / "diffusers", library.convert(root / "diffusers", root / "sdx"))
        return made[kind]

    return get


def state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def assert_same_state(want: dict, got: dict, where: str) -> None:
    assert set(want) == set(got), f"{where}: keys differ: {sorted(set(want) ^ set(got))[:6]}"
    for k, w in want.items():
        g = got[k]
        assert w.dtype == g.dtype and w.shape == g.shape and np.array_equal(w, g), f"{where}: {k} differs"


def assert_same_pipeline_weights(pipe, other) -> None:
    for c in _MODELS:
        if getattr(pipe, c, None) is not None:
            assert_same_state(state(getattr(pipe, c)), state(getattr(other, c)), c)


def fails(capsys, argv: list[str], *fragments: str) -> str:
    """Run python -m convert; it must fail with exit status 2 and one `error:` line holding `fragments`."""
    capsys.readouterr()  # drop what earlier steps printed
    assert cli.main([*argv, "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    for f in fragments:
        assert f in err, (f, err)
    return err


# --------------------------------------------------------------------------------------------------
# --format diffusers


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_diffusers_export_loads_in_from_pretrained_exactly(tiny, tmp_path, kind):
    pipe, folder, sdx = tiny(kind)
    for src in (sdx, folder):  # from an sdx folder and straight from a diffusers one
        out = library.convert(src, tmp_path / f"out-{src.name}", fmt="diffusers")
        theirs = type(pipe).from_pretrained(out)
        assert_same_pipeline_weights(pipe, theirs)
        assert type(theirs.scheduler) is type(pipe.scheduler)
        public = [{k: v for k, v in p.scheduler.config.items() if not k.startswith("_")} for p in (theirs, pipe)]
        assert public[0] == public[1]
        index = json.loads((out / "model_index.json").read_text())
        assert index["unet"] == ["diffusers", "UNet2DConditionModel"]
        assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
        if kind == "sdxl":
            assert index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
            assert index["force_zeros_for_empty_prompt"] is True
        for t in ("tokenizer", "tokenizer_2"):
            if getattr(pipe, t, None) is not None:
                assert getattr(theirs, t)("a fox").input_ids == getattr(pipe, t)("a fox").input_ids
    # ... and it reads back into sdx to the very same arrays
    back = library.convert(out, tmp_path / "back")
    for c in (c for c in _MODELS if getattr(pipe, c, None) is not None):
        assert_same_state(model_folder.read_arrays(sdx, c), model_folder.read_arrays(back, c), c)


def test_diffusers_export_without_source_configs(tiny, tmp_path):
    """An sdx folder that kept no diffusers configs exports the ones sdx's dataclasses make."""
    pipe, _, sdx = tiny("sdxl")
    bare = tmp_path / "bare"
    shutil.copytree(sdx, bare)
    spec = json.loads((bare / "sdx.json").read_text())
    for c in _MODELS:
        spec["components"][c]["source_config"] = None
    (bare / "sdx.json").write_text(json.dumps(spec))
    out = library.convert(bare, tmp_path / "out", fmt="diffusers", dtype="float16")
    theirs = type(pipe).from_pretrained(out, torch_dtype=torch.float32)
    for c in _MODELS:
        want = {k: v.astype(np.float16).astype(np.float32) for k, v in state(getattr(pipe, c)).items()}
        assert_same_state(want, state(getattr(theirs, c)), c)
        ours, orig = (dict(m.config) if c in ("unet", "vae") else m.config.to_dict()
                      for m in (getattr(theirs, c), getattr(pipe, c)))
        kind = model_folder.MODEL_KINDS[c]
        assert kind.config_from_diffusers(ours) == kind.config_from_diffusers(orig), c  # same math, maybe other spelling
    stored = read_safetensors(out / "unet" / "diffusion_pytorch_model.safetensors")
    assert {a.dtype for a in stored.values()} == {np.dtype(np.float16)}


# --------------------------------------------------------------------------------------------------
# --format single-file, single files in


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_sdx_to_single_file_to_sdx_is_exact(tiny, tmp_path, kind):
    pipe, folder, sdx = tiny(kind)
    assert cli.main([str(sdx), str(tmp_path / "model.safetensors"), "--format", "single-file", "-q"]) == 0
    theirs = type(pipe).from_single_file(str(tmp_path / "model.safetensors"), config=str(folder), local_files_only=True)
    assert_same_pipeline_weights(pipe, theirs)
    assert cli.main([str(tmp_path / "model.safetensors"), str(tmp_path / "back"), "--config", str(folder), "-q"]) == 0
    for c in (c for c in _MODELS if getattr(pipe, c, None) is not None):
        assert_same_state(model_folder.read_arrays(sdx, c), model_folder.read_arrays(tmp_path / "back", c), c)
    spec, back = model_folder.read_spec(sdx), model_folder.read_spec(tmp_path / "back")
    assert spec["components"]["scheduler"] == back["components"]["scheduler"]
    assert spec["pipeline_class"] == back["pipeline_class"] and spec["extra"] == back["extra"]


def test_single_file_without_tokenizers_gets_the_builtin_ones(tiny, tmp_path):
    pipe, folder, sdx = tiny("sdxl")
    path = library.convert(sdx, tmp_path / "model.safetensors", fmt="single-file", dtype="bfloat16")
    configs = tmp_path / "configs"  # config.json files only: no tokenizers, no model_index.json
    for c in ("unet", "vae", "text_encoder", "text_encoder_2", "scheduler"):
        (configs / c).mkdir(parents=True)
        for f in (folder / c).glob("*.json"):
            shutil.copy(f, configs / c)
    out = library.convert(path, tmp_path / "out", options=library.ModelOptions(config=str(configs)))
    assert {str(a.dtype) for a in read_safetensors(path).values()} == {"bfloat16"}
    for t in ("tokenizer", "tokenizer_2"):
        ours = model_folder.load_tokenizer(out, t)
        theirs = getattr(pipe, t)
        assert json.loads((out / t / "tokenizer_config.json").read_text())["pad_token"] == theirs.pad_token
        ids = ours(["a red fox, jumping!"])
        want = theirs(["a red fox, jumping!"], padding="max_length", max_length=77).input_ids
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want))


def test_single_file_cli_errors(tiny, tmp_path, capsys):
    _, folder, sdx = tiny("sd15")
    junk = tmp_path / "junk.safetensors"
    save_file({"model.something.weight": np.zeros((2, 2), np.float32)}, str(junk))
    fails(capsys, [str(junk), str(tmp_path / "o1")], "unknown single-file layout", "looked for",
          "model.diffusion_model.input_blocks.0.0.weight")
    path = library.convert(sdx, tmp_path / "model.safetensors", fmt="single-file")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-4096])
    fails(capsys, [str(cut), str(tmp_path / "o2"), "--config", str(folder)], str(cut))
    fails(capsys, [str(path), str(tmp_path / "o3"), "--config", str(folder), "--preset", "sdxl_base"], "does not fit")
    fails(capsys, [str(folder), str(tmp_path / "o4"), "--config", str(folder)], "--config applies to single-file")
    fails(capsys, [str(sdx), str(tmp_path / "model.ckpt"), "--format", "single-file"], "*.safetensors")
    fails(capsys, [str(sdx), str(path), "--format", "single-file"], "exists", "--overwrite")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


# --------------------------------------------------------------------------------------------------
# --vae


def tiny_vae(pipe, folder: Path, seed: int, **changes):
    """A VAE shaped like `pipe`'s (unless `changes` say otherwise) with other weights, saved at `folder`."""
    config = {k: v for k, v in dict(pipe.vae.config).items() if not k.startswith("_")}
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKL(**{**config, **changes}).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.05 * torch.randn_like(p))
    vae.save_pretrained(folder)
    return vae


def test_vae_swap(tiny, tmp_path, capsys):
    pipe, folder, sdx = tiny("sd15")
    vae = tiny_vae(pipe, tmp_path / "vae", seed=5, scaling_factor=0.5, force_upcast=False)
    want = state(vae)

    # a diffusers VAE folder: its weights and its own latent scaling
    out = library.convert(folder, tmp_path / "out", options=library.ModelOptions(vae=str(tmp_path / "vae")))
    assert_same_state(want, {k: np.asarray(v) for k, v in read_sdx_folder(out).tensors["vae"].items()}, "vae")
    config = model_folder.model_config(out, "vae")
    assert config.scaling_factor == 0.5 and config.force_upcast is False
    # ... which is what diffusers runs when given that VAE (through our diffusers export)
    exported = library.convert(out, tmp_path / "exported", fmt="diffusers")
    theirs = type(pipe).from_pretrained(exported)
    assert_same_state(want, state(theirs.vae), "exported vae")
    assert theirs.vae.config.scaling_factor == 0.5
    assert_same_state(state(pipe.unet), state(theirs.unet), "unet")

    # a pipeline folder (its vae/), an sdx folder, and a single VAE file (no config: the model's scaling)
    (tmp_path / "pipeline").mkdir()
    shutil.copytree(tmp_path / "vae", tmp_path / "pipeline" / "vae")
    (tmp_path / "pipeline" / "model_index.json").write_text("{}")
    from convert import single_file
    from convert.checkpoint import Checkpoint

    vae_file = tmp_path / "vae.safetensors"
    single_file.write_single_file(Checkpoint("", {"vae": dict(vae.config)}, {"vae": want}), vae_file)
    for source in (tmp_path / "pipeline", out, vae_file):
        got = library.convert(sdx, tmp_path / f"via-{source.stem}", options=library.ModelOptions(vae=str(source)))
        assert_same_state(want, {k: np.asarray(v) for k, v in read_sdx_folder(got).tensors["vae"].items()}, source)
        scaling = model_folder.model_config(got, "vae").scaling_factor
        assert scaling == (pipe.vae.config.scaling_factor if source == vae_file else 0.5)

    tiny_vae(pipe, tmp_path / "vae8", seed=6, latent_channels=8)
    fails(capsys, [str(sdx), str(tmp_path / "o"), "--vae", str(tmp_path / "vae8")],
          "architecture differs", "latent_channels 8 (the model's: 4)")
    fails(capsys, [str(sdx), str(tmp_path / "o"), "--vae", str(tmp_path / "nowhere")], "--vae", "no such file")
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------------
# Hub ids for --vae, --unet and --lora


def test_hub_vae_unet_and_lora(tiny, tmp_path, monkeypatch, capsys):
    pipe, folder, sdx = tiny("sd15")
    monkeypatch.setattr(hub, "reachable", lambda: True)  # the hub answers

    def serve(repo_id: str, repo: Path) -> FakeHub:
        fake = FakeHub(repo_id, repo, tmp_path / f"cache-{repo_id.replace('/', '--')}")
        for name in ("list_repo_files", "hf_hub_download", "snapshot_download"):
            monkeypatch.setattr(hub, name, getattr(fake, name))
        return fake

    # a pipeline repo as --vae: only its vae/ config and weights are fetched
    fake = serve("org/pipe", folder)
    out = library.convert(sdx, tmp_path / "out", options=library.ModelOptions(vae="org/pipe"))
    assert fake.downloaded == {"vae/config.json", "vae/diffusion_pytorch_model.safetensors"}
    assert_same_state(state(pipe.vae), {k: np.asarray(v) for k, v in read_sdx_folder(out).tensors["vae"].items()}, "vae")
    # and as --unet: its unet/ folder, or one weights file in it
    for spec, files in (("org/pipe", {"unet/config.json", "unet/diffusion_pytorch_model.safetensors"}),
                        ("org/pipe/unet/diffusion_pytorch_model.safetensors", {"unet/diffusion_pytorch_model.safetensors"})):
        fake.downloaded.clear()
        out = library.convert(sdx, tmp_path / f"unet-{len(files)}", options=library.ModelOptions(unet=spec))
        assert fake.downloaded == files
        assert_same_state(state(pipe.unet), {k: np.asarray(v) for k, v in read_sdx_folder(out).tensors["unet"].items()},
                          spec)

    # a LoRA repo: pytorch_lora_weights.safetensors by default, or the file named after the repo id
    repo = tmp_path / "lora-repo"
    repo.mkdir()
    up = np.full((32, 2), 0.02, np.float32)
    lora = {"unet.conv_in.lora_A.weight": np.full((2, 4, 3, 3), 0.01, np.float32),
            "unet.conv_in.lora_B.weight": np.full((32, 2, 1, 1), 0.02, np.float32)}
    save_file(lora, str(repo / "pytorch_lora_weights.safetensors"))
    save_file({"lora_te_text_model_encoder_layers_0_mlp_fc2.lora_down.weight": np.full((2, 64), 0.01, np.float32),
               "lora_te_text_model_encoder_layers_0_mlp_fc2.lora_up.weight": up}, str(repo / "other.safetensors"))
    fake = serve("org/lora", repo)
    a = library.convert(sdx, tmp_path / "a", options=library.ModelOptions.from_args(lora=["org/lora:0.5"]))
    assert fake.downloaded == {"pytorch_lora_weights.safetensors"}
    delta = np.asarray(read_sdx_folder(a).tensors["unet"]["conv_in.weight"]) - state(pipe.unet)["conv_in.weight"]
    np.testing.assert_allclose(delta, 0.5 * 2 * 0.01 * 0.02, rtol=0, atol=1e-6)
    # the same folder on disk as --lora: its pytorch_lora_weights.safetensors, as diffusers' load_lora_weights
    local = library.convert(sdx, tmp_path / "a-local", options=library.ModelOptions.from_args(lora=[f"{repo}:0.5"]))
    assert (read_sdx_folder(local).tensors["unet"]["conv_in.weight"] == read_sdx_folder(a).tensors["unet"]["conv_in.weight"]).all()
    fake.downloaded.clear()
    library.convert(sdx, tmp_path / "b", options=library.ModelOptions.from_args(lora=["org/lora/other.safetensors"]))
    assert fake.downloaded == {"other.safetensors"}
    fails(capsys, [str(sdx), str(tmp_path / "c"), "--lora", "org/lora/missing.safetensors"],
          "hub repo 'org/lora'", "has no file missing.safetensors")
    (repo / "pytorch_lora_weights.safetensors").rename(repo / "third.safetensors")
    fails(capsys, [str(sdx), str(tmp_path / "c"), "--lora", "org/lora"], "several .safetensors files")
    fails(capsys, [str(sdx), str(tmp_path / "c"), "--lora", str(repo)], "the folder", "several .safetensors files")
    fails(capsys, [str(sdx), str(tmp_path / "c"), "--vae", "org/lora"], "neither a VAE repo")
    fails(capsys, [str(sdx), str(tmp_path / "c"), "--unet", "org/lora"], "neither a UNet repo")
    fails(capsys, [str(sdx), str(tmp_path / "c"), "--lora", "org/elsewhere:0.3"], "hub repo 'org/elsewhere'", "not found")

    import httpx2
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable(*a, **kw):
        raise httpx2.ConnectError("[Errno -3] Temporary failure in name resolution")

    def not_cached(*a, **kw):
        raise LocalEntryNotFoundError("not in the cache")

    monkeypatch.setattr(hub, "list_repo_files", unreachable)
    monkeypatch.setattr(hub, "snapshot_download", not_cached)
    for flag in ("--vae", "--unet", "--lora"):
        fails(capsys, [str(sdx), str(tmp_path / "c"), flag, "org/far-away"], "'org/far-away'", "could not be reached")
