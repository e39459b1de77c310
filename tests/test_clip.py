"""The CLIP text encoder equals transformers' CLIPTextModel / CLIPTextModelWithProjection in float32."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sdx import clip, diffusers_config as DC, weights
from sdx.errors import SdxError
from tests.helpers_text import perturbed_clip, random_ids

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# (hidden, intermediate, layers, heads, act, eps, with_projection, eos_token_id)
CASES = {
    "clip_l-like quick_gelu legacy-eos": (64, 96, 3, 4, "quick_gelu", 1e-5, False, 2),
    "bigG-like gelu projection legacy-eos": (64, 128, 2, 4, "gelu", 1e-5, True, 2),
    "gelu projection modern-eos eps1e-3": (48, 80, 3, 6, "gelu", 1e-3, True, 49407),
    "quick_gelu modern-eos": (32, 64, 2, 2, "quick_gelu", 1e-5, False, 49407),
}


def _hf_config(hidden, inter, layers, heads, act, eps, eos):
    return transformers.CLIPTextConfig(
        vocab_size=49408, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, max_position_embeddings=77, hidden_act=act, layer_norm_eps=eps,
        projection_dim=24, eos_token_id=eos, bos_token_id=49406, pad_token_id=1,
    )


def _input_ids():
    """Tokenizer-like rows padded with EOS (SDXL encoder 1) and with "!"=0 (encoder 2), a row without
    any EOS and a row with EOS in the middle of noise, where the two pooling rules can differ."""
    rng = np.random.default_rng(1)
    ids = np.concatenate([random_ids(2, pad_id=49407, seed=2), random_ids(2, pad_id=0, seed=3)])
    no_eos = rng.integers(0, 49407, (1, 77))
    eos_mid = rng.integers(0, 49407, (1, 77))
    eos_mid[0, [30, 50]] = 49407
    return np.concatenate([ids, no_eos, eos_mid]).astype(np.int32)


def _max_err(ours, ref) -> tuple[float, float]:
    ref = ref.detach().numpy() if hasattr(ref, "detach") else np.asarray(ref)
    return float(np.abs(np.asarray(ours) - ref).max()), float(max(1.0, np.abs(ref).max()))


def _assert_close(name, ours, ref, errors):
    err, scale = _max_err(ours, ref)
    errors[name] = err
    # float32: the observed error is ~1e-7 of the output scale; a wrong epsilon, activation, scale or
    # transpose moves the outputs by 1e-4 of their scale or (much) more.
    assert err <= 1e-5 * scale, f"{name}: max abs error {err:.3g} at output scale {scale:.3g}"


@pytest.mark.parametrize("case", CASES)
def test_parity_with_transformers(case):
    hidden, inter, layers, heads, act, eps, proj, eos = CASES[case]
    hf_cfg = _hf_config(hidden, inter, layers, heads, act, eps, eos)
    model, state = perturbed_clip(hf_cfg, with_projection=proj, seed=len(case))
    cfg_json = hf_cfg.to_dict() | {"architectures": [type(model).__name__]}
    cfg = clip.TextEncoderConfig.from_diffusers_config(cfg_json)
    assert cfg.with_projection == proj and cfg.hidden_act == act and cfg.layer_norm_eps == eps

    abstract = weights.abstract(lambda rngs: clip.CLIPTextModel(cfg, rngs=rngs))
    ours = weights.load_torch_state(abstract, clip.transformers_state(state, where=case), where=case)

    ids = _input_ids()
    with torch.no_grad():
        ref = model(torch.from_numpy(ids).long(), output_hidden_states=True)
    out = nnx.jit(lambda m, x: m(x))(ours, jnp.asarray(ids))

    errors: dict[str, float] = {}
    assert len(out.hidden_states) == len(ref.hidden_states) == layers + 1
    for i, (a, b) in enumerate(zip(out.hidden_states, ref.hidden_states)):
        _assert_close(f"hidden_states[{i}]", a, b, errors)
    _assert_close("last_hidden_state", out.last_hidden_state, ref.last_hidden_state, errors)
    if proj:
        _assert_close("text_embeds", out.text_embeds, ref.text_embeds, errors)
        ref_pooled = model.text_model(torch.from_numpy(ids).long()).pooler_output
    else:
        assert out.text_embeds is None
        ref_pooled = ref.pooler_output
    _assert_close("pooler_output", out.pooler_output, ref_pooled, errors)
    print(f"\n{case}: max abs errors " + ", ".join(f"{k}={v:.2e}" for k, v in errors.items()))


def test_eos_positions_follow_transformers_rules():
    ids = jnp.asarray([
        [49406, 5, 49407, 49407, 49407],  # padded with EOS: first EOS either way
        [49406, 5, 49407, 0, 0],  # padded with "!"
        [49406, 7, 9, 3, 1],  # no EOS: legacy takes the largest id, modern position 0
    ])
    np.testing.assert_array_equal(clip.eos_positions(ids, 2), [2, 2, 0])
    np.testing.assert_array_equal(clip.eos_positions(ids, 49407), [2, 2, 0])
    np.testing.assert_array_equal(clip.eos_positions(ids, 9), [0, 0, 2])
    np.testing.assert_array_equal(clip.eos_positions(jnp.asarray([[3, 49406, 8]]), 2), [1])


def _tiny_model_and_state(proj: bool):
    hf_cfg = _hf_config(32, 48, 2, 4, "gelu", 1e-5, 2)
    model, state = perturbed_clip(hf_cfg, with_projection=proj, seed=5)
    cfg = clip.TextEncoderConfig.from_diffusers_config(hf_cfg.to_dict() | {"architectures": [type(model).__name__]})
    return cfg, model, state


def test_checkpoint_keys_position_ids_and_prefix():
    cfg, model, state = _tiny_model_and_state(proj=False)
    assert all(not k.startswith("text_model.") for k in state)  # transformers 5 saves CLIPTextModel unprefixed
    # The diffusers-repo layout (transformers 4): prefixed keys and the position_ids buffer.
    old = {"text_model." + k: v for k, v in state.items()}
    old["text_model.embeddings.position_ids"] = np.arange(77, dtype=np.int64)[None]
    a = clip.transformers_state(old, where="old.safetensors")
    b = clip.transformers_state(state, where="new.safetensors")
    assert set(a) == set(b) and "text_model.embeddings.position_ids" not in a
    abstract = weights.abstract(lambda rngs: clip.CLIPTextModel(cfg, rngs=rngs))
    weights.load_torch_state(abstract, a, where="old.safetensors")
    # Nothing else is dropped: an unknown key still fails the strict loader by name.
    with pytest.raises(SdxError, match="text_model.encoder.layers.9.mlp.fc1.weight"):
        weights.load_torch_state(
            abstract, a | {"text_model.encoder.layers.9.mlp.fc1.weight": np.zeros((48, 32), np.float32)}, where="x"
        )
    with pytest.raises(SdxError, match="both with and without"):
        clip.transformers_state(old | state, where="mixed.safetensors")


def test_hidden_state_selection():
    cfg, _, state = _tiny_model_and_state(proj=True)
    abstract = weights.abstract(lambda rngs: clip.CLIPTextModel(cfg, rngs=rngs))
    model = weights.load_torch_state(abstract, clip.transformers_state(state, where="t"), where="t")

    @nnx.jit
    def run(m, ids):
        out = m(ids)
        picks = (
            m.hidden_state(out, skip=0, final_layer_norm=True),
            m.hidden_state(out, skip=1, final_layer_norm=False),
            m.hidden_state(out, skip=1, final_layer_norm=True),
        )
        return out, picks, m.text_model.final_layer_norm(out.hidden_states[-2])

    out, (last, penult, penult_ln), ref_ln = run(model, jnp.asarray(random_ids(2, pad_id=0)))
    np.testing.assert_array_equal(last, out.last_hidden_state)
    np.testing.assert_array_equal(penult, out.hidden_states[-2])
    np.testing.assert_array_equal(penult_ln, ref_ln)
    np.testing.assert_array_equal(model.hidden_state(out, skip=2, final_layer_norm=False), out.hidden_states[0])
    with pytest.raises(SdxError, match="clip skip"):
        model.hidden_state(out, skip=3, final_layer_norm=False)


def test_bfloat16_runs_close_to_float32():
    from sdx.layers import Compute

    cfg = clip.TextEncoderConfig.preset("tiny")
    f32 = clip.CLIPTextModel(cfg, rngs=nnx.Rngs(0))
    bf16 = clip.CLIPTextModel(cfg, Compute(dtype=jnp.bfloat16, param_dtype=jnp.float32), rngs=nnx.Rngs(0))
    ids = jnp.asarray(random_ids(2, pad_id=49407))
    run = nnx.jit(lambda m, x: m(x).last_hidden_state)
    a, b = run(f32, ids), run(bf16, ids)
    assert b.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(b, np.float32), a, atol=0.1)


# The text encoder config.json files of the diffusers repos, as public mirrors of the hub files hold them
# (SDXL base: PRITHIVSAKTHIUR/AI-Art-Generator-SDXL; SD 1.5: HDRJ-One/runwayml-stable-diffusion-v1-5,
# the same numbers; SD 2.1 base: jack-op11/stable-diffusion-2-1-base).
REAL_CONFIGS = {
    "clip_l": {  # runwayml/stable-diffusion-v1-5 and stabilityai/stable-diffusion-xl-base-1.0 text_encoder
        "architectures": ["CLIPTextModel"], "attention_dropout": 0.0, "bos_token_id": 0, "dropout": 0.0,
        "eos_token_id": 2, "hidden_act": "quick_gelu", "hidden_size": 768, "initializer_factor": 1.0,
        "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-05, "max_position_embeddings": 77,
        "model_type": "clip_text_model", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1,
        "projection_dim": 768, "torch_dtype": "float16", "transformers_version": "4.34.0", "vocab_size": 49408,
    },
    "openclip_bigg": {  # stabilityai/stable-diffusion-xl-base-1.0 text_encoder_2
        "architectures": ["CLIPTextModelWithProjection"], "attention_dropout": 0.0, "bos_token_id": 0, "dropout": 0.0,
        "eos_token_id": 2, "hidden_act": "gelu", "hidden_size": 1280, "initializer_factor": 1.0,
        "initializer_range": 0.02, "intermediate_size": 5120, "layer_norm_eps": 1e-05, "max_position_embeddings": 77,
        "model_type": "clip_text_model", "num_attention_heads": 20, "num_hidden_layers": 32, "pad_token_id": 1,
        "projection_dim": 1280, "torch_dtype": "float16", "transformers_version": "4.34.0", "vocab_size": 49408,
    },
    "openclip_h": {  # stabilityai/stable-diffusion-2-1(-base) text_encoder
        "architectures": ["CLIPTextModel"], "attention_dropout": 0.0, "bos_token_id": 0, "dropout": 0.0,
        "eos_token_id": 2, "hidden_act": "gelu", "hidden_size": 1024, "initializer_factor": 1.0,
        "initializer_range": 0.02, "intermediate_size": 4096, "layer_norm_eps": 1e-05, "max_position_embeddings": 77,
        "model_type": "clip_text_model", "num_attention_heads": 16, "num_hidden_layers": 23, "pad_token_id": 1,
        "projection_dim": 512, "torch_dtype": "float16", "transformers_version": "4.26.0.dev0", "vocab_size": 49408,
    },
}


# Where each encoder sits in the pipeline presets of sdx.presets.
PRESET_OF = {"clip_l": ("sd15", "text_encoder"), "openclip_bigg": ("sdxl_base", "text_encoder_2"),
             "openclip_h": ("sd21", "text_encoder")}


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_presets_match_real_configs(name):
    cfg = clip.TextEncoderConfig.from_diffusers_config(REAL_CONFIGS[name])
    assert cfg == clip.TextEncoderConfig.preset(*PRESET_OF[name])
    assert clip.TextEncoderConfig.from_dict(cfg.to_dict()) == cfg
    assert clip.TextEncoderConfig.from_diffusers_config(cfg.to_diffusers_config()) == cfg
    # transformers reads our config.json back to the same architecture.
    hf = transformers.CLIPTextConfig(**{k: v for k, v in cfg.to_diffusers_config().items() if k != "architectures"})
    assert (hf.hidden_size, hf.num_hidden_layers, hf.hidden_act, hf.eos_token_id) == (
        cfg.hidden_size, cfg.num_hidden_layers, cfg.hidden_act, cfg.eos_token_id
    )


def test_tiny_presets_build_with_clip_vocabulary():
    for cfg in (clip.TextEncoderConfig.preset("tiny"), clip.TextEncoderConfig.preset("tiny_xl", "text_encoder_2")):
        shapes = weights.param_shapes(weights.abstract(lambda rngs, c=cfg: clip.CLIPTextModel(c, rngs=rngs)))
        assert shapes["text_model.embeddings.token_embedding.embedding"] == (49408, cfg.hidden_size)
        assert ("text_projection.kernel" in shapes) == cfg.with_projection


def test_config_errors_name_the_field():
    base = REAL_CONFIGS["clip_l"]
    with pytest.raises(SdxError, match="hidden_act='relu'"):
        clip.TextEncoderConfig.from_diffusers_config(base | {"hidden_act": "relu"})
    with pytest.raises(SdxError, match="architectures"):
        clip.TextEncoderConfig.from_diffusers_config(base | {"architectures": ["CLIPModel"]})
    with pytest.raises(SdxError, match="model_type"):
        clip.TextEncoderConfig.from_diffusers_config(base | {"model_type": "siglip_text_model"})
    with pytest.raises(SdxError, match="num_attention_heads"):
        clip.TextEncoderConfig.from_diffusers_config(base | {"num_attention_heads": 7})
    with pytest.raises(SdxError, match="unknown field.*rope_theta"):  # might change the math: refused
        clip.TextEncoderConfig.from_diffusers_config(base | {"rope_theta": 10000.0})
    with pytest.raises(SdxError, match="pruned_heads"):
        clip.TextEncoderConfig.from_diffusers_config(base | {"pruned_heads": {"0": [1]}})
    with pytest.raises(SdxError, match="bogus"):
        clip.TextEncoderConfig.from_dict(clip.TextEncoderConfig.preset("sd15").to_dict() | {"bogus": 1})
    # Missing fields take transformers' CLIPTextConfig defaults, as transformers would.
    d = clip.TextEncoderConfig.from_diffusers_config({"architectures": ["CLIPTextModel"]})
    hf = transformers.CLIPTextConfig()
    assert (d.hidden_size, d.num_attention_heads, d.eos_token_id) == (hf.hidden_size, hf.num_attention_heads, hf.eos_token_id)
    assert dataclasses.replace(clip.TextEncoderConfig.preset("sd15")) == clip.TextEncoderConfig.preset("sd15")


def test_every_transformers_field_is_accounted_for():
    """Each key transformers writes for a CLIPTextConfig is honoured, inert, fixed or generic bookkeeping."""
    import inspect

    params = inspect.signature(transformers.CLIPTextConfig.__init__).parameters
    ours = {k: p.default for k, p in params.items() if k in DC.TEXT_ENCODER_DEFAULTS}
    assert ours == DC.TEXT_ENCODER_DEFAULTS
    honoured = {f.name for f in dataclasses.fields(clip.TextEncoderConfig)} - {"with_projection"} | {"architectures"}
    assert honoured == set(DC.TEXT_ENCODER_DEFAULTS) | {"architectures"}
    written = set(transformers.CLIPTextConfig().to_dict()) | set(transformers.PretrainedConfig().to_dict())
    known = honoured | set(DC.TEXT_ENCODER_INERT) | set(DC.TEXT_ENCODER_FIXED) | DC.TRANSFORMERS_GENERIC
    assert {k for k in written if not k.startswith("_")} <= known
    cfg = clip.TextEncoderConfig.preset("sd15")
    full = transformers.CLIPTextConfig(**cfg.to_diffusers_config()).to_dict()  # every key transformers 5 writes
    assert clip.TextEncoderConfig.from_diffusers_config(full) == cfg
