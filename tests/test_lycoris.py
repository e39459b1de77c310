"""convert.lora's LoCon, LoHa and LoKr against LyCORIS itself (the `lycoris-lora` package, on PyTorch).

LyCORIS's own modules are put on layers of a tiny SDXL pipeline (linear layers and 3x3 / 1x1 convolutions of
the UNet, both text encoders), every factor drawn at random (LyCORIS starts one at zero), alphas that differ
from the ranks; the file holds each module's `custom_state_dict()` (what LyCORIS saves) under the kohya name
of its layer. The reference update of a layer is what the module's forward adds to its weight (`_update`).
sdx merges the file at strength SCALE; the merged weight minus the original
must be SCALE times that update, for every variant LyCORIS writes: LoCon (kohya's LoRA) plain and with a
Tucker core; LoHa plain and with Tucker cores; LoKr with w1 and w2 whole, w2 or both as products, w2 as a
Tucker core, and a chosen factor.
"""

from __future__ import annotations

import numpy as np
import pytest

from convert import lora as L
from convert.checkpoint import Checkpoint
from sdx.errors import SdxError

torch = pytest.importorskip("torch")
lycoris = pytest.importorskip("lycoris")

from lycoris.modules import LohaModule, LokrModule, LoConModule  # noqa: E402

from tests.tiny_models import make_tiny_pipeline  # noqa: E402

SCALE = 0.7
# (component, module path) of the layers adapted: linear and convolutions (3x3, 1x1, the 3x3 conv_in)
LAYERS = [
    ("unet", "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"),
    ("unet", "down_blocks.1.attentions.0.transformer_blocks.0.ff.net.0.proj"),
    ("unet", "up_blocks.0.resnets.0.conv1"),
    ("unet", "up_blocks.0.resnets.0.conv_shortcut"),
    ("unet", "conv_in"),
    ("text_encoder", "text_model.encoder.layers.0.self_attn.k_proj"),
    ("text_encoder_2", "text_model.encoder.layers.1.mlp.fc2"),
]
PREFIX = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}
# variant -> (module class, keyword arguments): every layout of factors LyCORIS saves
VARIANTS = {
    "locon": (LoConModule, {}),
    "locon_tucker": (LoConModule, {"use_tucker": True}),
    "loha": (LohaModule, {}),
    "loha_tucker": (LohaModule, {"use_tucker": True}),
    "lokr": (LokrModule, {}),
    "lokr_both_products": (LokrModule, {"decompose_both": True}),
    "lokr_tucker": (LokrModule, {"use_tucker": True}),
    "lokr_factor_4": (LokrModule, {"factor": 4}),
    "lokr_whole": (LokrModule, {"full_matrix": True}),
}


def _update(module):
    """What a LyCORIS module's forward adds to its layer's weight: LoCon's product (its scalar in it) times the
    scale, LoHa's and LoKr's `get_weight` (the scale in it) times the scalar. (Their `get_diff_weight` scales a
    second time; A1111, ComfyUI and the forward scale once.)"""
    if isinstance(module, LoConModule):
        return module.make_weight() * module.scale
    return module.get_weight(module.shape) * module.scalar


def _copy(checkpoint: Checkpoint) -> Checkpoint:
    """A checkpoint to merge into: its own dicts over the same arrays (merge_lora replaces arrays, never writes
    into them)."""
    tensors = {c: dict(t) for c, t in checkpoint.tensors.items()}
    return Checkpoint(checkpoint.pipeline_class, checkpoint.configs, tensors)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    pipe = make_tiny_pipeline("sdxl", tmp_path_factory.mktemp("pipeline"), seed=1)
    tensors = {c: {k: v.detach().numpy().copy() for k, v in getattr(pipe, c).state_dict().items()}
               for c in ("unet", "text_encoder", "text_encoder_2")}
    configs = {"unet": dict(pipe.unet.config), "text_encoder": pipe.text_encoder.config.to_dict(),
               "text_encoder_2": pipe.text_encoder_2.config.to_dict()}
    return pipe, Checkpoint(type(pipe).__name__, configs, tensors)


def _lycoris_file(pipe, variant: str, path) -> dict[tuple[str, str], np.ndarray]:
    """Write LyCORIS modules of `variant` on LAYERS into `path`; returns (component, weight key) -> the update
    each module's forward adds to its layer's weight."""
    from safetensors.torch import save_file

    cls, kwargs = VARIANTS[variant]
    torch.manual_seed(5)
    saved, updates = {}, {}
    for i, (component, module_path) in enumerate(LAYERS):
        # transformers 5's CLIPTextModel has no `text_model.` level; kohya's names keep transformers 4's
        found = {n: m for n, m in getattr(pipe, component).named_modules()
                 if n in (module_path, module_path.removeprefix("text_model."))}
        (layer_path, layer), = found.items()
        name = PREFIX[component] + module_path.replace(".", "_")
        rank = 2 + i % 2
        module = cls(name, layer, 1.0, lora_dim=rank, alpha=rank + 1.5, **kwargs)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
            updates[component, f"{layer_path}.weight"] = _update(module).numpy()
        for key, value in module.custom_state_dict().items():
            saved[f"{name}.{key}"] = value.detach().contiguous()
    save_file(saved, str(path))
    return updates


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_merged_update_is_lycoris_forward_s(pipeline, tmp_path, variant):
    pipe, checkpoint = pipeline
    path = tmp_path / f"{variant}.safetensors"
    updates = _lycoris_file(pipe, variant, path)
    ours = _copy(checkpoint)
    L.merge_lora(ours, path, SCALE)
    for (component, key), update in updates.items():
        merged = ours.tensors[component][key] - checkpoint.tensors[component][key]
        assert np.abs(update).max() > 1e-3, (component, key)  # a real update
        np.testing.assert_allclose(merged, SCALE * update.reshape(merged.shape), rtol=1e-5,
                                   atol=1e-6 * np.abs(update).max(), err_msg=f"{variant}: {component} {key}")
    changed = [(c, k) for c, t in ours.tensors.items() for k in t
               if not np.array_equal(t[k], checkpoint.tensors[c][k])]
    assert sorted(changed) == sorted(updates)


def test_the_scale_is_alpha_over_the_rank_of_a_product(pipeline, tmp_path):
    """The same LoHa factors with alpha doubled merge to twice the update; without an alpha, to the update at
    scale 1 (LyCORIS: alpha = rank)."""
    pipe, checkpoint = pipeline
    from safetensors.numpy import load_file, save_file

    path = tmp_path / "loha.safetensors"
    updates = _lycoris_file(pipe, "loha", path)
    tensors = load_file(str(path))
    deltas = {}
    for case, change in (("twice", lambda k, v: np.asarray(v * 2) if k.endswith(".alpha") else v), ("none", None)):
        changed = {k: (change(k, v) if change else v) for k, v in tensors.items() if change or not k.endswith(".alpha")}
        save_file(changed, str(tmp_path / f"{case}.safetensors"))
        adapters = L.lora_deltas(checkpoint, tmp_path / f"{case}.safetensors")
        deltas[case] = {key: adapter.scale for key, adapter in adapters.items()}
    reference = {key: adapter.scale for key, adapter in L.lora_deltas(checkpoint, path).items()}
    assert reference.keys() == updates.keys()
    for key, scale in reference.items():
        assert deltas["twice"][key] == pytest.approx(2 * scale)
        assert deltas["none"][key] == 1.0 and scale != 1.0


@pytest.mark.parametrize("tensors, match", [
    ({"lora_unet_conv_in.hada_w1_a": (4, 2), "lora_unet_conv_in.hada_w1_b": (2, 36)}, "no hada_w2_a weight"),
    ({"lora_unet_conv_in.lokr_w1_a": (2, 2), "lora_unet_conv_in.lokr_w2": (2, 2)}, "no lokr_w1_b weight"),
    ({"lora_unet_conv_in.lokr_w1": (2, 2), "lora_unet_conv_in.lora_up.weight": (4, 2)},
     "mixes weights of lokr and lora"),
    ({"lora_unet_conv_in.hada_w1_a": (4, 2), "lora_unet_conv_in.hada_w1_b": (2, 36),
      "lora_unet_conv_in.hada_w2_a": (4, 2), "lora_unet_conv_in.hada_w2_b": (2, 36),
      "lora_unet_conv_in.hada_t1": (2, 2, 3, 3)}, "Tucker cores"),
    ({"lora_unet_conv_in.lokr_w1": (2, 2), "lora_unet_conv_in.lokr_w2": (3, 3)}, "do not fit the weight"),
    ({"lora_unet_conv_in.hada_w1_a": (32, 2), "lora_unet_conv_in.hada_w1_b": (3, 36),  # conv_in: (32, 4, 3, 3)
      "lora_unet_conv_in.hada_w2_a": (32, 2), "lora_unet_conv_in.hada_w2_b": (2, 36)}, "factors do not fit together"),
    ({"lora_unet_conv_in.hada_w1_a": (32, 2), "lora_unet_conv_in.hada_w1_b": (2, 36),  # a half of one row: not
      "lora_unet_conv_in.hada_w2_a": (1, 2), "lora_unet_conv_in.hada_w2_b": (2, 36)}, "halves are"),  # broadcast
    ({"lora_unet_conv_in.alpha": ()}, "an alpha without the weights"),
    # an update of 10^10 numbers is refused from the factors' shapes, before anything is multiplied
    ({"lora_unet_conv_in.lokr_w1_a": (100_000, 1), "lora_unet_conv_in.lokr_w1_b": (1, 100_000),
      "lora_unet_conv_in.lokr_w2": (1, 1)}, "10,000,000,000 numbers"),
])
def test_malformed_lycoris_modules_are_one_error_naming_the_key(pipeline, tmp_path, tensors, match):
    _, checkpoint = pipeline
    from safetensors.numpy import save_file

    save_file({k: np.ones(shape, np.float32) for k, shape in tensors.items()}, str(tmp_path / "bad.safetensors"))
    ours = _copy(checkpoint)
    with pytest.raises(SdxError, match=match) as error:
        L.merge_lora(ours, tmp_path / "bad.safetensors", SCALE)
    assert "lora_unet_conv_in" in str(error.value) or "conv_in" in str(error.value)
