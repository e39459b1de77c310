"""convert.lora against diffusers' load_lora_weights + fuse_lora, for kohya and diffusers/PEFT files.

LoRAs are made with peft on tiny SD 1.x-like and SDXL-like pipelines (UNet linear and conv layers,
both text encoders), with random non-zero up weights, alphas that differ from the ranks, and an
alpha pattern; the same tensors are then written in kohya's naming (SGM block names for SDXL, as
kohya's trainer writes them) and in diffusers' older `lora.down` naming.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from convert import lora as L
from convert import single_file_keys as K
from convert.checkpoint import Checkpoint
from sdx.errors import SdxError

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

from tests.tiny_models import make_tiny_pipeline  # noqa: E402

SCALE = 0.7
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1",
                "conv2", "conv_shortcut", "time_emb_proj", "conv", "conv_in", "conv_out", "linear_1", "linear_2"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
_MODELS = ("unet", "text_encoder", "text_encoder_2", "vae")


def _checkpoint(pipe) -> Checkpoint:
    comps = [c for c in _MODELS if getattr(pipe, c, None) is not None]
    configs = {c: dict(getattr(pipe, c).config) if c in ("unet", "vae") else getattr(pipe, c).config.to_dict()
               for c in comps}
    tensors = {c: {k: v.detach().numpy().copy() for k, v in getattr(pipe, c).state_dict().items()} for c in comps}
    return Checkpoint(type(pipe).__name__, configs, tensors)


class LoraSet:
    """A peft LoRA for a tiny pipeline, written in the three formats."""

    def __init__(self, kind: str, root: Path):
        from peft import LoraConfig
        from peft.utils import get_peft_model_state_dict

        self.folder = root / "pipeline"
        pipe = make_tiny_pipeline(kind, self.folder, seed=1)
        self.cls = type(pipe)
        self.checkpoint = _checkpoint(pipe)
        configs = {"unet": LoraConfig(r=4, lora_alpha=6, alpha_pattern={"to_k": 3}, init_lora_weights=False,
                                      target_modules=UNET_TARGETS)}
        for te, (r, alpha) in (("text_encoder", (2, 5)), ("text_encoder_2", (3, 2))):
            if getattr(pipe, te, None) is not None:
                configs[te] = LoraConfig(r=r, lora_alpha=alpha, init_lora_weights=False, target_modules=TEXT_TARGETS)
        torch.manual_seed(3)
        layers = {}
        for name, cfg in configs.items():
            getattr(pipe, name).add_adapter(cfg)
            layers[name] = {k: v.detach().clone() for k, v in get_peft_model_state_dict(getattr(pipe, name)).items()}
        self.layers = layers

        # diffusers/PEFT, with the LoraConfig in the file's metadata
        self.diffusers_file = root / "diffusers" / "pytorch_lora_weights.safetensors"
        self.cls.save_lora_weights(
            self.diffusers_file.parent, **{f"{n}_lora_layers": t for n, t in layers.items()},
            **{f"{n}_lora_adapter_metadata": c.to_dict() for n, c in configs.items()},
        )

        # kohya: module names with underscores, SGM names for the SDXL UNet, an alpha per module
        from safetensors.torch import save_file

        sgm = {}
        if kind.startswith("sdxl"):
            for e in K.unet_entries(self.checkpoint.configs["unet"], prefix=""):
                if e.kind == K.SAME and e.original.endswith(".weight"):
                    sgm[e.diffusers[0][: -len(".weight")]] = e.original[: -len(".weight")]
        kohya = {}
        for name, tensors in layers.items():
            prefix = {"unet": "lora_unet_", "text_encoder": "lora_te1_" if kind.startswith("sdxl") else "lora_te_",
                      "text_encoder_2": "lora_te2_"}[name]
            for key, value in tensors.items():
                if ".lora_A." not in key:
                    continue
                module = key.split(".lora_A.")[0]
                if name != "unet" and not module.startswith("text_model."):
                    module = "text_model." + module  # kohya names follow transformers 4's CLIP paths
                kname = prefix + sgm.get(module, module).replace(".", "_")
                kohya[f"{kname}.lora_down.weight"] = value.contiguous()
                kohya[f"{kname}.lora_up.weight"] = tensors[key.replace(".lora_A.", ".lora_B.")].contiguous()
                rank = value.shape[0]
                kohya[f"{kname}.alpha"] = torch.tensor(float(rank + 1 + len(kohya) % 3))  # alpha != rank, varied
        self.kohya_file = root / "kohya.safetensors"
        save_file(kohya, str(self.kohya_file))

        # diffusers' older names (no alphas: scale 1): UNet attention processors (`attn1.processor.to_q_lora`,
        # `to_out_lora`), `lora.down` for other UNet layers, `lora_linear_layer` in the text encoders
        old = {}
        for name, tensors in layers.items():
            for key, value in tensors.items():
                module, _, rest = key.partition(".lora_")
                role = "down" if rest.startswith("A") else "up"
                attn = re.fullmatch(r"(.*\.attn[12])\.(to_q|to_k|to_v|to_out\.0)", module)
                if name != "unet":
                    old[f"{name}.{module}.lora_linear_layer.{role}.weight"] = value.contiguous()
                elif attn:
                    proj = attn.group(2).replace(".0", "")
                    old[f"{name}.{attn.group(1)}.processor.{proj}_lora.{role}.weight"] = value.contiguous()
                else:
                    old[f"{name}.{module}.lora.{role}.weight"] = value.contiguous()
        self.old_file = root / "old.safetensors"
        save_file(old, str(self.old_file))

    def reference(self, path: Path) -> dict[str, dict[str, np.ndarray]]:
        """What diffusers makes of the file: load, fuse at SCALE, unload the adapters."""
        pipe = self.cls.from_pretrained(self.folder)
        pipe.load_lora_weights(str(path))
        pipe.fuse_lora(lora_scale=SCALE)
        pipe.unload_lora_weights()
        return {c: {k: v.numpy() for k, v in getattr(pipe, c).state_dict().items()}
                for c in self.checkpoint.tensors}

    def ours(self, path: Path) -> Checkpoint:
        ck = Checkpoint(self.checkpoint.pipeline_class, self.checkpoint.configs,
                        {c: dict(t) for c, t in self.checkpoint.tensors.items()})
        L.merge_lora(ck, path, SCALE)
        return ck


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = LoraSet(kind, tmp_path_factory.mktemp(f"lora_{kind}"))
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
@pytest.mark.parametrize("fmt", ["diffusers", "kohya", "old"])
def test_merge_equals_diffusers_fuse(loras, kind, fmt):
    lora = loras(kind)
    path = {"diffusers": lora.diffusers_file, "kohya": lora.kohya_file, "old": lora.old_file}[fmt]
    want = lora.reference(path)
    got = lora.ours(path).tensors
    changed = 0
    for c, tensors in want.items():
        assert set(tensors) == set(got[c]), c
        for k, w in tensors.items():
            g = got[c][k]
            assert g.dtype == w.dtype and g.shape == w.shape, (c, k)
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-6, err_msg=f"{c} {k}")
            changed += not np.array_equal(w, lora.checkpoint.tensors[c][k])
    n_modules = sum(len(t) for t in lora.layers.values()) // 2
    assert changed == n_modules, (changed, n_modules)  # every LoRA weight landed, nothing else moved


def test_text_encoder_keys_with_or_without_text_model_prefix(loras):
    """transformers 5 drops CLIPTextModel's `text_model.` prefix; a Checkpoint may have either form."""
    lora = loras("sd15")
    plain = lora.ours(lora.kohya_file).tensors["text_encoder"]
    ck = Checkpoint(lora.checkpoint.pipeline_class, lora.checkpoint.configs,
                    {c: {(f"text_model.{k}" if c == "text_encoder" else k): v for k, v in t.items()}
                     for c, t in lora.checkpoint.tensors.items()})
    L.merge_lora(ck, lora.kohya_file, SCALE)
    for k, v in plain.items():
        np.testing.assert_array_equal(ck.tensors["text_encoder"][f"text_model.{k}"], v)


def test_unmatched_and_unsupported_keys_are_named(loras, tmp_path):
    from safetensors.numpy import save_file

    lora = loras("sd15")
    down, up = np.ones((2, 32), np.float32), np.ones((32, 2), np.float32)
    save_file({"lora_unet_down_blocks_0_nowhere.lora_down.weight": down,
               "lora_unet_down_blocks_0_nowhere.lora_up.weight": up}, str(tmp_path / "k.safetensors"))
    with pytest.raises(SdxError, match="lora_unet_down_blocks_0_nowhere"):
        lora.ours(tmp_path / "k.safetensors")
    save_file({"unet.mid_block.nowhere.lora_A.weight": down, "unet.mid_block.nowhere.lora_B.weight": up},
              str(tmp_path / "d.safetensors"))
    with pytest.raises(SdxError, match=r"unet\.mid_block\.nowhere\.lora_A\.weight"):
        lora.ours(tmp_path / "d.safetensors")
    save_file({"lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": down,
               "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": up}, str(tmp_path / "te2.safetensors"))
    with pytest.raises(SdxError, match="text_encoder_2, which this model does not have"):
        lora.ours(tmp_path / "te2.safetensors")
    save_file({"lora_unet_conv_in.hada_w1_a": down}, str(tmp_path / "loha.safetensors"))
    with pytest.raises(SdxError, match="its loha module has no hada_w1_b weight"):  # LoHa itself: test_lycoris.py
        lora.ours(tmp_path / "loha.safetensors")
    save_file({"lora_unet_conv_in.dora_scale": down}, str(tmp_path / "dora.safetensors"))
    with pytest.raises(SdxError, match="DoRA"):
        lora.ours(tmp_path / "dora.safetensors")
    save_file({"unet.conv_in.lora_A.weight": np.ones((2, 4, 3, 3), np.float32)}, str(tmp_path / "half.safetensors"))
    with pytest.raises(SdxError, match="no matching up weight"):
        lora.ours(tmp_path / "half.safetensors")


def test_parse_lora_arg():
    assert L.parse_lora_arg("style.safetensors:0.8") == (Path("style.safetensors"), 0.8)
    assert L.parse_lora_arg("style.safetensors") == (Path("style.safetensors"), 1.0)
    assert L.parse_lora_arg("dir/a:b.safetensors:-0.5") == (Path("dir/a:b.safetensors"), -0.5)
    assert L.parse_lora_arg(r"C:\loras\x.safetensors") == (Path(r"C:\loras\x.safetensors"), 1.0)
    with pytest.raises(SdxError):
        L.parse_lora_arg("")
    with pytest.raises(SdxError, match="finite"):
        L.parse_lora_arg("a.safetensors:nan")
