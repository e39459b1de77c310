"""Small random-weight diffusers pipelines for tests, saved as diffusers folders.

`make_tiny_pipeline(kind, folder)` builds a PyTorch diffusers pipeline of the given kind with tiny
shapes (the `tiny` / `tiny_xl` presets of `sdx.presets`, varied per kind), moves every parameter
away from its initial value (norm scales off 1, biases off 0: a loader that drops one cannot pass a
parity test by luck), saves it with `save_pretrained`, and returns the pipeline.

Kinds: sd15, sd21 (epsilon), sd21_v (v-prediction), pix2pix (8-channel conv_in), sd15_inpaint (9-channel
conv_in), sdxl, sdxl_refiner (second text encoder only, aesthetic-score conditioning), sdxl_pix2pix,
sdxl_inpaint.

Tokenizers use the real CLIP BPE vocabulary (49408 tokens), written the way the released hub repos
ship it: vocab.json + merges.txt + tokenizer_config.json + special_tokens_map.json (pass
`tokenizer_files="transformers"` to keep what transformers' own `save_pretrained` writes instead,
tokenizer.json + tokenizer_config.json). The pad token is "<|endoftext|>" for OpenAI CLIP tokenizers
and "!" for the OpenCLIP ones (SD 2.x, SDXL's tokenizer_2), as in the real repos.

`Output`, `BAR`, `assert_parity` and `assert_effect` are how every whole-pipeline parity test compares sdx with
diffusers and shows that what it exercises changes the result.

Only tests import this module (torch, diffusers and transformers are test dependencies).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from pathlib import Path

import numpy as np
import torch

from sdx import presets
from sdx.tokenizer import write_builtin_folder

KINDS = ("sd15", "sd21", "sd21_v", "pix2pix", "sd15_inpaint", "sdxl", "sdxl_refiner", "sdxl_pix2pix", "sdxl_inpaint")
# the released model each kind shrinks (its pipeline class, scheduler and tokenizers)
_REAL = {"sd15": "sd15", "sd21": "sd21", "sd21_v": "sd21_v", "pix2pix": "pix2pix", "sd15_inpaint": "sd15_inpaint",
         "sdxl": "sdxl_base", "sdxl_refiner": "sdxl_refiner", "sdxl_pix2pix": "sdxl_pix2pix", "sdxl_inpaint": "sdxl_inpaint"}

# --------------------------------------------------------------------------------------------------
# Configs per kind


def _tiny_configs(kind: str) -> tuple[str, dict, dict, dict]:
    """(pipeline class, component configs, model_index extras, tokenizer pad tokens) for `kind`."""
    if kind not in KINDS:
        raise ValueError(f"unknown tiny pipeline kind {kind!r}; choose one of {KINDS}")
    xl = kind.startswith("sdxl")
    base = presets.get("tiny_xl" if xl else "tiny")
    real = presets.get(_REAL[kind])
    configs = copy.deepcopy(base.configs)
    configs["scheduler"] = real.configs["scheduler"]
    pads = {name: spec["pad_token"] for name, spec in real.tokenizers.items()}
    unet = configs["unet"]
    unet["in_channels"] = real.configs["unet"]["in_channels"]  # 8: InstructPix2Pix, 9: inpainting
    if kind in ("sd21", "sd21_v"):
        # OpenCLIP-H-like text encoder (gelu), linear projections in the transformers, per-level heads.
        configs["text_encoder"]["hidden_act"] = "gelu"
        unet.update(use_linear_projection=True, attention_head_dim=[2, 4], upcast_attention=kind == "sd21_v")
    if kind == "sdxl_refiner":
        del configs["text_encoder"]
        unet.update(
            block_out_channels=[32, 64, 64], attention_head_dim=[2, 4, 4], cross_attention_dim=64,
            down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
            up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], transformer_layers_per_block=2,
            projection_class_embeddings_input_dim=64 + 5 * unet["addition_time_embed_dim"],
        )
    return real.pipeline_class, configs, real.extra, pads


def perturb(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Move every parameter off its init: absolute noise for norms/biases, relative for the rest."""
    with torch.no_grad():
        for param in module.parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if param.ndim <= 1:
                param.add_(0.1 * noise)
            else:
                param.add_(0.5 * param.std().clamp(min=1e-3) * noise)


def make_tiny_pipeline(kind: str, folder, *, seed: int = 0, tokenizer_files: str = "hub"):
    """Build the tiny diffusers pipeline `kind`, save it under `folder` (created), return the pipeline.

    tokenizer_files: "hub" (vocab.json/merges.txt/tokenizer_config.json/special_tokens_map.json, as
    the released repos) or "transformers" (what transformers' save_pretrained writes).
    """
    import diffusers
    import transformers

    pipeline_class, configs, extra, pads = _tiny_configs(kind)
    folder = Path(folder)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)

    def model_kwargs(cfg: dict) -> dict:
        return {k: v for k, v in cfg.items() if not k.startswith("_")}

    components = {}
    unet = diffusers.UNet2DConditionModel(**model_kwargs(configs["unet"]))
    vae = diffusers.AutoencoderKL(**model_kwargs(configs["vae"]))
    scheduler_cls = getattr(diffusers, configs["scheduler"]["_class_name"])
    components["scheduler"] = scheduler_cls.from_config(configs["scheduler"])
    for name, model in (("unet", unet), ("vae", vae)):
        perturb(model, generator)
        components[name] = model.eval()
    for te, tok in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
        if te not in configs:
            components[te] = components[tok] = None
            continue
        cfg = {k: v for k, v in configs[te].items() if k not in ("architectures", "model_type")}
        arch = getattr(transformers, configs[te]["architectures"][0])
        model = arch(transformers.CLIPTextConfig(**cfg))
        perturb(model, generator)
        components[te] = model.eval()
        tok_dir = write_builtin_folder(folder / tok, pad_token=pads[tok])
        components[tok] = transformers.CLIPTokenizer.from_pretrained(tok_dir)

    pipe_cls = getattr(diffusers, pipeline_class)
    wanted = set(inspect.signature(pipe_cls.__init__).parameters)
    kwargs = {k: v for k, v in components.items() if k in wanted}
    if "safety_checker" in wanted:
        kwargs.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    if "image_encoder" in wanted:
        kwargs["image_encoder"] = None
    kwargs.update({k: v for k, v in extra.items() if k in wanted})
    pipe = pipe_cls(**kwargs)
    pipe.save_pretrained(folder)
    if tokenizer_files == "hub":
        for tok in ("tokenizer", "tokenizer_2"):
            if components.get(tok) is not None:
                (folder / tok / "tokenizer.json").unlink(missing_ok=True)
                write_builtin_folder(folder / tok, pad_token=pads[tok])
    elif tokenizer_files != "transformers":
        raise ValueError(f"tokenizer_files={tokenizer_files!r}: use 'hub' or 'transformers'")
    return pipe


# --------------------------------------------------------------------------------------------------
# Comparing whole pipelines


@dataclasses.dataclass(frozen=True)
class Output:
    """A whole pipeline's result: 8-bit images (N, H, W, 3), and the float32 latents (N, h, w, C) its VAE decoded
    them from, in the scheduler's units; either may be None (latents a test cannot reach, a run that stops at
    the latents)."""

    images: np.ndarray | None
    latents: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Bar:
    """What a whole-pipeline parity test lets sdx differ from diffusers by: the latents' largest absolute
    difference relative to the reference's largest value, and the 8-bit images' mean and largest absolute
    difference in levels (the README's numbers; every path the tests run keeps them, measured 2026-12: latents
    within 5.2e-6, images within 0.0004 levels on average)."""

    latents: float = 1e-5
    mean: float = 0.01
    max: int = 1


BAR = Bar()


def _latents_change(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b|."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _levels(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    assert a.shape == b.shape, (a.shape, b.shape)
    return np.abs(a.astype(np.int32) - b.astype(np.int32))


def _measures(a: Output, b: Output) -> tuple[str, ...]:
    """The measures both outputs have, "latents" and/or "images" (at least one, and the same on both sides)."""
    have = lambda o: tuple(name for name in ("latents", "images") if getattr(o, name) is not None)
    assert have(a) == have(b) and have(a), (have(a), have(b))
    return have(a)


def assert_parity(ours: Output, ref: Output) -> None:
    """sdx's output equals diffusers' within `BAR`: the latents and the 8-bit images, as far as they have them."""
    said, ok, bar = [], [], BAR
    for measure in _measures(ours, ref):
        if measure == "latents":
            err = _latents_change(ours.latents, ref.latents)
            said.append(f"latents relative error {err:.1e} (bar {bar.latents:.0e})")
            ok.append(err <= bar.latents)
        else:
            diff = _levels(ours.images, ref.images)
            said.append(f"8-bit mean abs diff {diff.mean():.4f}, max {diff.max()} (bar {bar.mean}, {bar.max})")
            ok.append(diff.mean() <= bar.mean and diff.max() <= bar.max)
    print("parity: " + "; ".join(said))
    assert all(ok), "sdx differs from the reference by more than the bar"


def assert_effect(what: str, output: Output, without: Output) -> None:
    """`what` (a flag, a model, a scale) moves the result from `without` to `output` by at least ten times
    `BAR` in every measure they have, so an sdx that ignored it could not pass `assert_parity`. The two are
    usually diffusers' outputs (a reference call costs far less than an sdx compile)."""
    said, ok, bar = [], [], BAR
    for measure in _measures(output, without):
        if measure == "latents":
            moved = _latents_change(without.latents, output.latents)
            said.append(f"latents by {moved:.1e} relative ({moved / bar.latents:.0f}x the bar {bar.latents:.0e})")
            ok.append(moved >= 10 * bar.latents)
        else:
            mean = _levels(output.images, without.images).mean()
            said.append(f"8-bit images by {mean:.3f} levels mean ({mean / bar.mean:.0f}x the bar {bar.mean})")
            ok.append(mean >= 10 * bar.mean)
    print(f"effect of {what}: " + ", ".join(said))
    assert all(ok), f"{what} moves the result by less than ten times the parity bar"
