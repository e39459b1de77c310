"""convert.single_file: original SGM/LDM single files <-> diffusers-keyed Checkpoint.

Cross-checks: our writer's file loads in diffusers' own `from_single_file` to state dicts equal to
the source pipeline's, and our reader gives back the Checkpoint exactly; at real sizes (no weights),
the key table agrees entry by entry with diffusers' converters.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types

import numpy as np
import pytest

from convert import sampling_markers
from convert import single_file as sf
from convert import single_file_keys as K
from convert.checkpoint import Checkpoint
from sdx import presets
from sdx.errors import SdxError

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from tests.tiny_models import make_tiny_pipeline  # noqa: E402

_MODELS = ("unet", "vae", "text_encoder", "text_encoder_2")
EXPECTED_TYPE = {"sd15": "sd15", "sd21_v": "sd21_v", "pix2pix": "pix2pix", "sd15_inpaint": "sd15_inpaint",
                 "sdxl": "sdxl_base", "sdxl_refiner": "sdxl_refiner", "sdxl_pix2pix": "sdxl_pix2pix",
                 "sdxl_inpaint": "sdxl_inpaint"}


def _config(model) -> dict:
    """A diffusers model's config (a FrozenDict) or a transformers one (a PretrainedConfig) as a dict."""
    return dict(model.config) if isinstance(model.config, dict) else model.config.to_dict()


def checkpoint_of(pipe) -> Checkpoint:
    """The diffusers-keyed Checkpoint of a torch pipeline (text encoder keys as the model names them)."""
    comps = [c for c in _MODELS if getattr(pipe, c, None) is not None]
    return Checkpoint(
        pipeline_class=type(pipe).__name__,
        configs={c: _config(getattr(pipe, c)) for c in comps},
        tensors={c: {k: v.detach().numpy().copy() for k, v in getattr(pipe, c).state_dict().items()} for c in comps},
    )


def _canonical(component: str, tensors: dict) -> dict:
    if component.startswith("text_encoder"):
        return sf._canonical_text_keys(tensors)
    return tensors


def assert_tensors_equal(want: dict, got: dict, where: str) -> None:
    assert set(want) == set(got), f"{where}: keys differ: {sorted(set(want) ^ set(got))[:10]}"
    for k in want:
        a, b = np.asarray(want[k]), np.asarray(got[k])
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f"{where}: {k} differs"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (diffusers folder, pipeline, single file written by sdx), built once per kind."""
    cache = {}

    def get(kind):
        if kind not in cache:
            folder = tmp_path_factory.mktemp(kind)
            pipe = make_tiny_pipeline(kind, folder / "diffusers")
            path = folder / "model.safetensors"
            sf.write_single_file(checkpoint_of(pipe), path)
            cache[kind] = (folder / "diffusers", pipe, path)
        return cache[kind]

    return get


# --------------------------------------------------------------------------------------------------
# Round trips through diffusers' own reader and ours


@pytest.mark.parametrize("kind", list(EXPECTED_TYPE))
def test_written_file_loads_in_diffusers_and_reads_back_exactly(tiny, kind):
    folder, pipe, path = tiny(kind)
    theirs = type(pipe).from_single_file(str(path), config=str(folder), local_files_only=True)
    for c in _MODELS:
        if getattr(pipe, c, None) is None:
            continue
        want = {k: v.numpy() for k, v in getattr(pipe, c).state_dict().items()}
        got = getattr(theirs, c).state_dict()
        assert not [k for k, v in got.items() if v.is_meta], f"{c}: diffusers left weights unloaded"
        assert_tensors_equal(want, {k: v.numpy() for k, v in got.items()}, f"diffusers {c}")

    tensors = sf.load_tensors(path)
    assert sf.detect_model_type(tensors) == EXPECTED_TYPE[kind]
    back = sf.read_single_file(path, folder)
    source = checkpoint_of(pipe)
    assert set(back.tensors) == set(source.tensors)
    for c in source.tensors:
        assert_tensors_equal(_canonical(c, source.tensors[c]), back.tensors[c], f"sdx {c}")
    assert back.pipeline_class == type(pipe).__name__
    assert back.configs["scheduler"]["_class_name"] == type(pipe.scheduler).__name__
    assert set(back.tokenizers) == {t for t in ("tokenizer", "tokenizer_2") if getattr(pipe, t, None) is not None}
    pads = {t: spec["pad_token"] for t, spec in sf.tokenizer_specs(back).items()}
    assert pads == {t: getattr(pipe, t).pad_token for t in back.tokenizers}

    # ... and writing what we read gives the same file contents (sdx -> single file -> sdx -> single file)
    again = sf.single_file_tensors(back)
    assert_tensors_equal(dict(tensors), again, "rewritten file")


def test_sd2_prediction_type_follows_diffusers_unless_told(tiny, tmp_path):
    folder, _, path = tiny("sd21_v")
    # model configs only (no scheduler, no model_index): the prediction type comes from the preset
    for name in ("unet", "vae", "text_encoder"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((folder / name / "config.json").read_text())
    assert sf.read_single_file(path, tmp_path).configs["scheduler"]["prediction_type"] == "v_prediction"
    eps = sf.read_single_file(path, tmp_path, preset="sd21")
    assert eps.configs["scheduler"]["prediction_type"] == "epsilon"
    assert eps.configs["unet"] == json.loads((folder / "unet" / "config.json").read_text())
    with pytest.raises(SdxError, match="does not fit"):
        sf.read_single_file(path, tmp_path, preset="sd15")


def test_preset_without_folder_rejects_tiny_file_with_a_hint(tiny):
    _, _, path = tiny("sd15")
    with pytest.raises(SdxError, match=r"--config"):
        sf.read_single_file(path)


# --------------------------------------------------------------------------------------------------
# The key table at real sizes against diffusers' converters (no weights involved)


def _fake(entries) -> dict[str, np.ndarray]:
    """A distinct small tensor per original key, shaped so that every transform is exercised."""
    rng = np.random.default_rng(0)
    out = {}
    for i, e in enumerate(entries):
        if e.kind == K.CONV1X1:
            out[e.original] = np.full((2, 3, 1, 1), i, np.float32) + rng.random((2, 3, 1, 1), np.float32)
        elif e.kind == K.TRANSPOSE:
            out[e.original] = rng.random((4, 4), np.float32)
        elif e.kind == K.QKV:
            out[e.original] = rng.random((3 * 4, 4) if e.original.endswith("weight") else (3 * 4,), np.float32)
        else:
            out[e.original] = np.full((1,), i, np.float32)
    return out


def _by_diffusers_key(entries, fake) -> dict[str, np.ndarray]:
    out = {}
    for e in entries:
        for k, a in zip(e.diffusers, K.to_diffusers(e, fake[e.original])):
            out[f"{e.component}:{k}"] = a
    return out


def _meta_keys(component: str, config: dict) -> set[str]:
    with torch.device("meta"):
        if component == "unet":
            model = diffusers.UNet2DConditionModel.from_config(config)
        elif component == "vae":
            model = diffusers.AutoencoderKL.from_config(config)
        else:
            cfg = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
            model = getattr(transformers, config["architectures"][0])(transformers.CLIPTextConfig(**cfg))
    keys = set(model.state_dict())
    return set(sf._canonical_text_keys(dict.fromkeys(keys))) if component.startswith("text") else keys


@pytest.mark.parametrize("name", ["sdxl_base", "sdxl_refiner", "sd15", "sd21_v", "pix2pix"])
def test_table_matches_diffusers_converters_at_real_size(name):
    from diffusers.loaders import single_file_utils as su

    preset = presets.get(name)
    layout = sf.MODEL_TYPES[name][0]
    components = ["unet", "vae", *K.LAYOUTS[layout]]
    entries = K.pipeline_entries(layout, preset.configs, components)
    fake = _fake(entries)
    ours = _by_diffusers_key(entries, fake)
    assert len({e.original for e in entries}) == len(entries), "an original key appears twice"

    tfake = {k: torch.from_numpy(v) for k, v in fake.items()}
    theirs = {}
    for k, v in su.convert_ldm_unet_checkpoint(tfake, preset.configs["unet"]).items():
        theirs[f"unet:{k}"] = v
    for k, v in su.convert_ldm_vae_checkpoint(tfake, preset.configs["vae"]).items():
        theirs[f"vae:{k}"] = v
    for comp, (style, prefix) in K.LAYOUTS[layout].items():
        if style == "clip":
            converted = su.convert_ldm_clip_checkpoint({k: v for k, v in tfake.items() if k.startswith(prefix)})
            converted = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in converted.items()}
        else:
            model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=4))  # fake q/k/v are 4 rows each
            sub = {k: v for k, v in tfake.items() if k.startswith(prefix)}
            if f"{prefix}text_projection" not in sub:
                sub[f"{prefix}text_projection"] = torch.zeros(4, 4)  # diffusers sizes q/k/v from it
            converted = su.convert_open_clip_checkpoint(model, sub, prefix=prefix)
            if "CLIPTextModelWithProjection" not in preset.configs[comp]["architectures"]:
                converted.pop("text_projection.weight", None)
        theirs.update({f"{comp}:{k}": v for k, v in converted.items()})
    theirs = {k: v.numpy() for k, v in theirs.items()}
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))[:10]
    for k in ours:
        assert np.array_equal(ours[k], theirs[k]), k
    # the diffusers side of the table is exactly the models' parameters
    for comp in components:
        want = _meta_keys(comp, preset.configs[comp])
        got = {k.split(":", 1)[1] for k in ours if k.startswith(comp + ":")}
        assert got == want, (comp, sorted(got ^ want)[:10])


def test_table_knows_real_keys():
    """A few keys of the released files, as they are spelled there."""
    xl_components = ["unet", "vae", "text_encoder", "text_encoder_2"]
    xl = {e.original for e in K.pipeline_entries("sdxl", presets.get("sdxl_base").configs, xl_components)}
    for key in ("model.diffusion_model.input_blocks.4.1.transformer_blocks.1.attn1.to_k.weight",
                "model.diffusion_model.output_blocks.2.2.conv.weight",
                "model.diffusion_model.middle_block.1.transformer_blocks.9.ff.net.2.bias",
                "model.diffusion_model.label_emb.0.2.weight",
                "conditioner.embedders.0.transformer.text_model.encoder.layers.11.mlp.fc2.weight",
                "conditioner.embedders.1.model.transformer.resblocks.31.attn.in_proj_weight",
                "conditioner.embedders.1.model.text_projection",
                "first_stage_model.decoder.up.3.block.2.norm1.weight",
                "first_stage_model.encoder.mid.attn_1.proj_out.weight"):
        assert key in xl, key
    sd1 = {e.original for e in K.pipeline_entries("sd1", presets.get("sd15").configs, ["unet", "vae", "text_encoder"])}
    for key in ("model.diffusion_model.output_blocks.11.0.skip_connection.weight",
                "model.diffusion_model.input_blocks.3.0.op.weight",
                "model.diffusion_model.output_blocks.2.1.conv.weight",
                "cond_stage_model.transformer.text_model.final_layer_norm.bias"):
        assert key in sd1, key


# --------------------------------------------------------------------------------------------------
# What a file may carry besides the model, and what it may not


def _write(path, tensors):
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))


def test_ignored_tensors_and_ema(tiny, tmp_path):
    folder, pipe, path = tiny("sd15")
    tensors = dict(sf.load_tensors(path))
    unet_keys = [k for k in tensors if k.startswith(K.UNET_PREFIX)]
    extra = {
        "betas": np.zeros(1000, np.float32), "alphas_cumprod": np.zeros(1000, np.float32),
        "model_ema.decay": np.array(0.9999, np.float32), "model_ema.num_updates": np.array(1, np.int64),
        "cond_stage_model.transformer.text_model.embeddings.position_ids": np.arange(77)[None],
        "first_stage_model.loss.logvar": np.zeros((), np.float32),
    }
    ema = {sf._ema_source(k): tensors[k] + 1 for k in unet_keys}
    _write(tmp_path / "full.safetensors", {**tensors, **extra, **ema})
    plain = sf.read_single_file(tmp_path / "full.safetensors", folder)
    assert_tensors_equal(sf.read_single_file(path, folder).tensors["unet"], plain.tensors["unet"], "non-EMA")
    from_ema = sf.read_single_file(tmp_path / "full.safetensors", folder, ema=True)
    conv_in = from_ema.tensors["unet"]["conv_in.weight"]
    np.testing.assert_array_equal(conv_in, tensors[K.UNET_PREFIX + "input_blocks.0.0.weight"] + 1)


def test_sd2_extra_openclip_layer_and_projection_are_ignored(tiny, tmp_path):
    folder, pipe, path = tiny("sd21_v")
    tensors = dict(sf.load_tensors(path))
    n = pipe.text_encoder.config.num_hidden_layers
    p = "cond_stage_model.model."
    extra = {k.replace(f"resblocks.{n - 1}.", f"resblocks.{n}."): v for k, v in tensors.items()
             if k.startswith(f"{p}transformer.resblocks.{n - 1}.")}
    extra[p + "text_projection"] = np.ones((32, 32), np.float32)
    extra[p + "logit_scale"] = np.array(4.6, np.float32)
    _write(tmp_path / "sd2.safetensors", {**tensors, **extra})
    back = sf.read_single_file(tmp_path / "sd2.safetensors", folder)
    assert_tensors_equal(sf.read_single_file(path, folder).tensors["text_encoder"], back.tensors["text_encoder"], "sd2")


def test_old_clip_key_spelling_is_accepted(tiny, tmp_path):
    folder, _, path = tiny("sd15")
    tensors = dict(sf.load_tensors(path))
    old = {k.replace("cond_stage_model.transformer.text_model.", "cond_stage_model.transformer."): v
           for k, v in tensors.items()}
    assert "cond_stage_model.transformer.final_layer_norm.weight" in old
    _write(tmp_path / "old.safetensors", old)
    back = sf.read_single_file(tmp_path / "old.safetensors", folder)
    assert_tensors_equal(sf.read_single_file(path, folder).tensors["text_encoder"], back.tensors["text_encoder"], "old")


def test_unknown_and_missing_keys_are_named(tiny, tmp_path):
    folder, _, path = tiny("sd15")
    tensors = dict(sf.load_tensors(path))
    _write(tmp_path / "extra.safetensors", {**tensors, "model.diffusion_model.bogus.weight": np.zeros(1, np.float32)})
    with pytest.raises(SdxError, match=r"model\.diffusion_model\.bogus\.weight"):
        sf.read_single_file(tmp_path / "extra.safetensors", folder)
    gone = "model.diffusion_model.middle_block.1.proj_out.weight"
    _write(tmp_path / "missing.safetensors", {k: v for k, v in tensors.items() if k != gone})
    with pytest.raises(SdxError, match=r"missing: model\.diffusion_model\.middle_block\.1\.proj_out\.weight"):
        sf.read_single_file(tmp_path / "missing.safetensors", folder)


def test_writer_rejects_unknown_diffusers_keys(tiny):
    _, pipe, _ = tiny("sd15")
    ck = checkpoint_of(pipe)
    ck.tensors["unet"]["down_blocks.0.bogus.weight"] = np.zeros(1, np.float32)
    with pytest.raises(SdxError, match=r"unet: down_blocks\.0\.bogus\.weight"):
        sf.single_file_tensors(ck)


# CosXL's scheduler (tests/test_edm_models.py samples it against diffusers)
_COSXL = {"_class_name": "EDMEulerScheduler", "num_train_timesteps": 1000, "prediction_type": "v_prediction",
          "rho": 7.0, "sigma_data": 1.0, "sigma_max": 120.0, "sigma_min": 0.002, "sigma_schedule": "exponential"}


def test_sampling_markers_say_how_an_sdxl_file_is_sampled(tiny, tmp_path):
    """Each scheduler's markers, written into a float16 file, and read back over the config folder's Euler."""
    folder, pipe, _ = tiny("sdxl")
    base = checkpoint_of(pipe)
    euler = dict(pipe.scheduler.config)
    cases = {  # name -> (scheduler, markers written)
        "default models": (presets.get("shapes").configs["scheduler"], {"v_pred", "ztsnr"}),
        "v-prediction": ({**euler, "prediction_type": "v_prediction"}, {"v_pred"}),
        "cosxl": (_COSXL, {"edm_vpred.sigma_max", "edm_vpred.sigma_min"}),
        "epsilon": (euler, set()),
    }
    for name, (scheduler, markers) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        sf.write_single_file(dataclasses.replace(base, configs={**base.configs, "scheduler": scheduler}), path,
                             dtype=np.float16)
        tensors = sf.load_tensors(path)
        assert set(tensors) & set(sampling_markers.KEYS) == markers, name
        back = sf.read_single_file(path, folder).configs["scheduler"]
        if name == "cosxl":  # the sigmas stay float32: sigma_min 0.002 is not a float16
            assert tensors["edm_vpred.sigma_min"].dtype == np.float32
            assert back == {**_COSXL, "sigma_min": float(np.float32(0.002))}
            continue
        for field, default in (("prediction_type", "epsilon"), ("rescale_betas_zero_snr", False)):
            assert back.get(field, default) == scheduler.get(field, default), (name, field)
        spacing = "trailing" if "ztsnr" in markers else euler["timestep_spacing"]
        assert back["timestep_spacing"] == spacing, name


@pytest.mark.parametrize("markers, message", [
    ({"edm_mean": np.zeros(4, np.float32)}, "edm_mean and edm_std without the other"),
    ({"ztsnr": np.zeros(0, np.float32)}, "ztsnr without v_pred"),
    ({"edm_vpred.sigma_max": np.float32([80, 120])}, "edm_vpred.sigma_max must be one positive number"),
    ({"edm_vpred.sigma_max": np.float32(-1)}, "edm_vpred.sigma_max must be one positive number"),
    ({"edm_mean": np.zeros(3, np.float32), "edm_std": np.ones(3, np.float32)}, "one value per latent channel (4)"),
])
def test_bad_sampling_markers_are_named(markers, message):
    configs = {"scheduler": dict(presets.get("sdxl_base").configs["scheduler"]), "vae": {"latent_channels": 4}}
    with pytest.raises(SdxError, match=re.escape(message)):
        sampling_markers.read(markers, configs, {}, pix2pix=False, where="model.safetensors")


def test_unknown_layout_lists_what_was_looked_for(tmp_path):
    _write(tmp_path / "odd.safetensors", {"transformer.blocks.0.weight": np.zeros(2, np.float32)})
    with pytest.raises(SdxError) as err:
        sf.read_single_file(tmp_path / "odd.safetensors")
    message = str(err.value)
    assert "\n" not in message
    for name in ("sdxl_base", "sdxl_refiner", "sd15", "sd21_v", "pix2pix", "transformer.blocks.0.weight",
                 "conditioner.embedders.1.model.ln_final.weight", "cond_stage_model.model.ln_final.weight"):
        assert name in message, name


def test_truncated_and_corrupt_files_name_the_file(tiny, tmp_path):
    _, _, path = tiny("sd15")
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(SdxError, match=r"cut\.safetensors: truncated"):
        sf.read_single_file(cut)
    head = tmp_path / "head.safetensors"
    head.write_bytes(data[:100])
    with pytest.raises(SdxError, match=r"head\.safetensors"):
        sf.read_single_file(head)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(SdxError, match=r"junk\.safetensors"):
        sf.read_single_file(junk)


def test_pickled_checkpoint_weights_only(tiny, tmp_path):
    folder, _, path = tiny("sd15")
    tensors = sf.load_tensors(path)
    state = {k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}
    torch.save({"state_dict": state, "global_step": 470000}, tmp_path / "model.ckpt")
    back = sf.read_single_file(tmp_path / "model.ckpt", folder)
    assert_tensors_equal(sf.read_single_file(path, folder).tensors["unet"], back.tensors["unet"], "ckpt")

    # any object but tensors and plain containers (here a SimpleNamespace) must not be unpickled
    torch.save({"state_dict": state, "callback": types.SimpleNamespace(x=1)}, tmp_path / "evil.ckpt")
    with pytest.raises(SdxError, match=r"evil\.ckpt: cannot be read with torch\.load\(weights_only=True\)") as err:
        sf.read_single_file(tmp_path / "evil.ckpt", folder)
    assert "\n" not in str(err.value)


def test_standalone_vae_files(tiny, tmp_path):
    folder, pipe, _ = tiny("sdxl")
    ck = checkpoint_of(pipe)
    vae_only = Checkpoint(pipeline_class="", configs={"vae": ck.configs["vae"]}, tensors={"vae": ck.tensors["vae"]})
    sf.write_single_file(vae_only, tmp_path / "vae.safetensors")
    keys = set(sf.load_tensors(tmp_path / "vae.safetensors"))
    assert "encoder.mid.attn_1.q.weight" in keys and not any(k.startswith("first_stage_model.") for k in keys)
    back = sf.read_single_file(tmp_path / "vae.safetensors", folder)
    assert set(back.tensors) == {"vae"}
    assert_tensors_equal(ck.tensors["vae"], back.tensors["vae"], "vae file")
    assert back.configs["vae"]["scaling_factor"] == pipe.vae.config.scaling_factor
    # diffusers' own VAE file (diffusers keys) through read_vae
    pipe.vae.save_pretrained(tmp_path / "dvae")
    got = sf.read_vae(tmp_path / "dvae" / "diffusion_pytorch_model.safetensors", ck.configs["vae"])
    assert_tensors_equal(ck.tensors["vae"], got, "diffusers vae file")
    # and diffusers reads ours
    theirs = diffusers.AutoencoderKL.from_single_file(
        str(tmp_path / "vae.safetensors"), config=str(folder / "vae"), local_files_only=True
    )
    assert_tensors_equal(ck.tensors["vae"], {k: v.numpy() for k, v in theirs.state_dict().items()}, "diffusers vae")


def test_config_folder_needs_a_diffusers_layout(tiny, tmp_path):
    _, _, path = tiny("sd15")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SdxError, match="diffusers layout"):
        sf.read_single_file(path, tmp_path / "empty")
    bad = tmp_path / "bad"
    (bad / "unet").mkdir(parents=True)
    (bad / "unet" / "config.json").write_text("{not json")
    with pytest.raises(SdxError, match="not valid JSON"):
        sf.read_single_file(path, bad)


def test_presets_fit_sdx_and_diffusers():
    """Every preset's configs are accepted by sdx's config classes and scheduler factory."""
    from sdx import schedulers
    from sdx.clip import TextEncoderConfig
    from sdx.unet import UNetConfig
    from sdx.vae import VAEConfig

    for name in presets.NAMES:
        preset = presets.get(name)
        UNetConfig.from_diffusers_config(preset.configs["unet"])
        VAEConfig.from_diffusers_config(preset.configs["vae"])
        for te in preset.text_encoders:
            TextEncoderConfig.from_diffusers_config(preset.configs[te])
        schedulers.from_config(preset.configs["scheduler"])
        assert set(preset.tokenizers) == {"tokenizer" if te == "text_encoder" else "tokenizer_2"
                                          for te in preset.text_encoders}
