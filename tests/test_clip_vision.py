"""The CLIP image encoder equals transformers' CLIPVisionModelWithProjection in float32, loads strictly from
a transformers folder, and its input preparation equals transformers' CLIPImageProcessor (which, with no
torchvision in the test environment, transformers 5 makes its PIL backend, CLIPImageProcessorPil: what
diffusers' load_ip_adapter then builds)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from sdx import clip_vision
from sdx.clip import CLIPAttention, TextEncoderConfig
from sdx.clip_vision import VisionEncoderConfig, image_encoder_inputs, load_image_encoder
from sdx.errors import SdxError
from sdx.layers import F32

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

# (hidden_act, layers, layer_norm_eps)
CASES = {"gelu": ("gelu", 3, 1e-5), "quick_gelu": ("quick_gelu", 2, 1e-3)}
SIZE, PATCH = 32, 8  # 16 patches and the class token


def _hf_config(act="gelu", layers=2, eps=1e-5):
    return transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, image_size=SIZE,
        patch_size=PATCH, projection_dim=16, hidden_act=act, layer_norm_eps=eps,
    )


def _saved_model(folder, act="gelu", layers=2, eps=1e-5, seed=0):
    """A transformers CLIPVisionModelWithProjection in eval mode with every parameter moved off its initial
    value (layer norms no longer 1/0, class and position embeddings shifted), saved as safetensors in `folder`."""
    torch.manual_seed(seed)
    model = transformers.CLIPVisionModelWithProjection(_hf_config(act, layers, eps)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model


def _pixels(batch=3, seed=1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, SIZE, SIZE, 3)).astype(np.float32)


def _assert_close(name, ours, ref, errors):
    ref = ref.detach().numpy()
    err, scale = float(np.abs(np.asarray(ours) - ref).max()), float(max(1.0, np.abs(ref).max()))
    errors[name] = err
    # float32: the observed error is ~1e-7 of the output scale; a missing norm, a wrong embedding, a causal
    # mask or a transposed kernel moves the outputs by far more than 1e-5 of it.
    assert err <= 1e-5 * scale, f"{name}: max abs error {err:.3g} at output scale {scale:.3g}"


@pytest.mark.parametrize("case", CASES)
def test_parity_with_transformers(case, tmp_path):
    act, layers, eps = CASES[case]
    ref_model = _saved_model(tmp_path, act, layers, eps, seed=len(case))
    ours = load_image_encoder(tmp_path)
    assert ours.config == VisionEncoderConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, image_size=SIZE,
        patch_size=PATCH, hidden_act=act, layer_norm_eps=eps, projection_dim=16,
    )
    pixels = _pixels()
    with torch.no_grad():
        ref = ref_model(torch.from_numpy(pixels.transpose(0, 3, 1, 2)), output_hidden_states=True)  # NCHW
    out = nnx.jit(lambda m, x: m(x))(ours, jnp.asarray(pixels))

    errors: dict[str, float] = {}
    assert len(out.hidden_states) == len(ref.hidden_states) == layers + 1
    for i, (a, b) in enumerate(zip(out.hidden_states, ref.hidden_states)):
        _assert_close(f"hidden_states[{i}]", a, b, errors)
    _assert_close("last_hidden_state", out.last_hidden_state, ref.last_hidden_state, errors)
    _assert_close("image_embeds", out.image_embeds, ref.image_embeds, errors)
    print(f"\n{case}: max abs errors " + ", ".join(f"{k}={v:.2e}" for k, v in errors.items()))


def test_config_defaults_and_full_clip_config():
    assert VisionEncoderConfig.from_transformers_config({}) == VisionEncoderConfig.from_transformers_config(
        transformers.CLIPVisionConfig().to_dict()
    )
    vision = _hf_config("quick_gelu", 3).to_dict()
    full = transformers.CLIPConfig(vision_config=vision).to_dict()
    assert VisionEncoderConfig.from_transformers_config(full) == VisionEncoderConfig.from_transformers_config(vision)
    # transformers 4's files: the generic keys, token ids and head pruning of its PretrainedConfig
    old = {**vision, "pruned_heads": {}, "bos_token_id": None, "dropout": 0.0, "torch_dtype": "float16"}
    assert VisionEncoderConfig.from_transformers_config(old).num_hidden_layers == 3
    cfg = VisionEncoderConfig.from_transformers_config(vision)
    assert VisionEncoderConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.head_dim == 8 and cfg.num_positions == 17


@pytest.mark.parametrize("change, field", [
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"num_channels": 4}, "num_channels"),
    ({"num_attention_heads": 5}, "num_attention_heads"),
    ({"image_size": [32, 32]}, "image_size"),
    ({"model_type": "siglip_vision_model"}, "model_type"),
    ({"pruned_heads": {"0": [1]}}, "pruned_heads"),
    ({"use_rope": True}, "use_rope"),
])
def test_config_refuses_what_sdx_does_not_implement(change, field):
    with pytest.raises(SdxError, match=field):
        VisionEncoderConfig.from_transformers_config({**_hf_config().to_dict(), **change})


def test_position_ids_buffer_and_strict_keys(tmp_path):
    _saved_model(tmp_path)
    state = safetensors_numpy.load_file(tmp_path / "model.safetensors")
    expected = np.asarray(load_image_encoder(tmp_path)(jnp.asarray(_pixels(1))).image_embeds)

    # transformers < 4.31 saved the position_ids buffer: dropped
    old = {**state, clip_vision.POSITION_IDS: np.arange(17, dtype=np.int64)[None]}
    safetensors_numpy.save_file(old, tmp_path / "model.safetensors")
    got = load_image_encoder(tmp_path)(jnp.asarray(_pixels(1))).image_embeds
    np.testing.assert_array_equal(np.asarray(got), expected)

    extra, missing, misshaped = ("vision_model.encoder.layers.0.extra.weight", "vision_model.post_layernorm.weight",
                                 "vision_model.embeddings.class_embedding")
    broken = {
        extra: {**state, extra: state["visual_projection.weight"]},
        missing: {k: v for k, v in state.items() if k != missing},
        misshaped: {**state, misshaped: np.zeros(31, np.float32)},
    }
    for key, tensors in broken.items():
        safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
        with pytest.raises(SdxError, match=key.replace(".", r"\.")):
            load_image_encoder(tmp_path)


def test_sharded_folder(tmp_path):
    ref_model = _saved_model(tmp_path / "one")
    ref_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    pixels = jnp.asarray(_pixels(2))
    a = load_image_encoder(tmp_path / "one")(pixels).image_embeds
    b = load_image_encoder(tmp_path / "sharded")(pixels).image_embeds
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_errors(tmp_path):
    with pytest.raises(SdxError, match="no such folder"):
        load_image_encoder(tmp_path / "nowhere")
    with pytest.raises(SdxError, match="no config.json"):
        load_image_encoder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_hf_config().to_dict()))
    with pytest.raises(SdxError, match="no weights"):
        load_image_encoder(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(SdxError, match="pytorch_model.bin.*safetensors"):
        load_image_encoder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**_hf_config().to_dict(), "hidden_act": "silu"}))
    with pytest.raises(SdxError, match=r"config\.json.*hidden_act='silu'"):
        load_image_encoder(tmp_path)


def test_wrong_input_size(tmp_path):
    _saved_model(tmp_path)
    model = load_image_encoder(tmp_path)
    for shape in [(1, 24, 24, 3), (1, SIZE, SIZE), (1, 3, SIZE, SIZE)]:
        with pytest.raises(SdxError, match=f"\\(batch, {SIZE}, {SIZE}, 3\\)"):
            model(jnp.zeros(shape))


def test_bfloat16_load(tmp_path):
    _saved_model(tmp_path)
    model = load_image_encoder(tmp_path, dtype="bfloat16")
    params = nnx.state(model, nnx.Param)
    dtypes = {np.dtype(p.dtype) for p in nnx.to_flat_state(params).leaves}
    assert dtypes == {np.dtype(ml_dtypes.bfloat16)}
    pixels = jnp.asarray(_pixels(1))
    out = model(pixels).image_embeds
    assert out.dtype == jnp.bfloat16
    ref = np.asarray(load_image_encoder(tmp_path)(pixels).image_embeds)
    assert np.abs(np.asarray(out, np.float32) - ref).max() <= 0.05 * np.abs(ref).max()


def _pictures() -> list[Image.Image]:
    """Non-square pictures of every kind the processor treats apart: landscape and portrait, odd sizes, smaller
    and larger than the target, RGBA (composited onto white), L, LA and P with a transparent colour."""
    rng = np.random.default_rng(3)
    noise = lambda h, w, c: rng.integers(0, 256, (h, w, c), dtype=np.uint8)  # noqa: E731
    palette = Image.fromarray(noise(29, 41, 3)).quantize(16)
    palette.info["transparency"] = 3
    return [
        Image.fromarray(noise(23, 37, 3)),  # landscape, smaller than 32
        Image.fromarray(noise(301, 117, 3)),  # portrait, odd, larger
        Image.fromarray(noise(45, 45, 3)),  # square, odd
        Image.fromarray(noise(50, 77, 4), mode="RGBA"),
        Image.fromarray(noise(64, 33, 1)[..., 0], mode="L"),
        Image.fromarray(noise(31, 90, 2), mode="LA"),
        palette,
    ]


@pytest.mark.parametrize("size", [32, 224])
def test_image_encoder_inputs_equal_clip_image_processor(size):
    processor = transformers.CLIPImageProcessor(size=size, crop_size=size)
    for i, picture in enumerate(_pictures()):
        ref = processor(images=[picture], return_tensors="np").pixel_values.transpose(0, 2, 3, 1)  # NCHW -> NHWC
        ours = image_encoder_inputs([picture], size)
        assert ours.shape == ref.shape == (1, size, size, 3) and ours.dtype == np.float32
        err = float(np.abs(ours - ref).max())
        print(f"size {size} picture {i} ({picture.mode} {picture.size}): max abs error {err:.1e}")
        assert err <= 1e-6, f"picture {i} ({picture.mode} {picture.size}): max abs error {err:.3g}"
    batch = image_encoder_inputs(_pictures()[:3], size)
    assert batch.shape == (3, size, size, 3)
    with pytest.raises(SdxError, match="no pictures"):
        image_encoder_inputs([], size)


def test_text_attention_stays_causal():
    """The vision config turns the shared attention's causal mask off; the text config keeps it."""
    text = TextEncoderConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=1)
    vision = VisionEncoderConfig.from_transformers_config(_hf_config().to_dict())
    assert CLIPAttention(text, F32, rngs=nnx.Rngs(0)).causal
    assert not CLIPAttention(vision, F32, rngs=nnx.Rngs(0)).causal
