"""A training run as one frozen dataclass, and the command line that fills it.

The flags are diffusers' training-script flags with the same meaning and defaults
(train_instruct_pix2pix(_sdxl).py, train_text_to_image(_sdxl).py, train_dreambooth(_lora).py,
train_controlnet(_sdxl).py, train_t2i_adapter_sdxl.py, textual_inversion(_sdxl).py), accepted
with underscores and with dashes (`--train_batch_size` and `--train-batch-size`), so a diffusers command
line runs after swapping `accelerate launch X.py` for `python -m train.X`. A diffusers flag sdx does not
implement is an error naming it, never silently ignored. Differences, on purpose:

- `--train_batch_size` is per device, as in diffusers (per GPU there): the global batch is it times the
  number of devices, and one optimizer step sees that times `--gradient_accumulation_steps` samples.
- `--lr_warmup_steps` and `--max_train_steps` count optimizer steps; diffusers multiplies the scheduler's
  warm-up and length by the number of processes, sdx does not.
- `--seed` defaults to 0 (diffusers: unseeded), so a run is reproducible unless asked otherwise.
- LoRA is text-to-image or DreamBooth with `--rank` (`python -m train.text_to_image_lora` and
  `python -m train.dreambooth_lora` default it to 4, as diffusers' LoRA scripts); `--lora_alpha` (default:
  the rank, diffusers' choice) is sdx's own.
- `--mixed_precision bf16`: bfloat16 compute with float32 master weights. `fp16` (what diffusers'
  documented commands use) runs as bf16, with a one-line note: what the flag asks for is 16-bit compute
  with float32 master weights, and bfloat16 gives that without the loss scaling float16's narrow range
  needs (accelerate's GradScaler, not done here); the frozen VAE stays float32 either way. The numbers
  are bfloat16's, not float16's.
- `--enable_xformers_memory_efficient_attention` (and `--enable_npu_flash_attention`, `--offload_ema`,
  `--foreach_ema`) are accepted and ignored, with a one-line note each: they pick a kernel or where a
  buffer lives, not the math (sdx's choice of attention kernel is `--attention`). Every other diffusers
  flag sdx does not implement stays an error (`UNSUPPORTED`), since ignoring it would change the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from sdx.attention import BACKENDS
from sdx.errors import ArgumentParser, SdxError
from train.data import INTERPOLATIONS
from train.lr import SCHEDULES
from train.objective import PREDICTION_TYPES

TASKS = ("pix2pix", "text_to_image", "dreambooth", "controlnet", "t2i_adapter", "textual_inversion", "vae")
CONTROL_TASKS = ("controlnet", "t2i_adapter")  # a model trained beside the frozen UNet from a control image
LORA_TASKS = ("text_to_image", "dreambooth")
EXPORT_FORMATS = ("sdx", "diffusers")

# diffusers flags that sdx's trainers do not implement, with what to do instead.
UNSUPPORTED = {
    "use_8bit_adam": "8-bit Adam is a bitsandbytes (CUDA PyTorch) optimizer; drop the flag",
    "allow_tf32": "XLA picks matmul precision itself; drop the flag",
    "push_to_hub": "upload --output_dir yourself with huggingface_hub",
    "hub_token": "upload --output_dir yourself with huggingface_hub",
    "hub_model_id": "upload --output_dir yourself with huggingface_hub",
    "non_ema_revision": "the non-EMA weights come from --pretrained_model_name_or_path and --revision",
    "dataset_config_name": "point --dataset_name at the configuration's parquet folder instead",
    "tracker_project_name": "only TensorBoard (--report_to tensorboard) is written",
    "local_rank": "multi-host runs use jax.distributed (JAX's coordinator variables), not a rank flag",
    "vae_precision": "the VAE runs in float32",
    "crops_coords_top_left_h": "SDXL crop conditioning is the crop actually applied to each image",
    "crops_coords_top_left_w": "SDXL crop conditioning is the crop actually applied to each image",
    "offset_noise": "give --noise_offset 0.1 (the same offset noise, of any scale)",
    "prior_generation_precision": "class images are sampled by the models as loaded for training; drop the flag",
    "pre_compute_text_embeddings": "frozen text encoders already run outside the step; drop the flag",
    "tokenizer_name": "the tokenizers are the model's own",
    "save_steps": "the words are written once, as learned_embeds.safetensors at the end; --checkpointing_steps "
                  "keeps resumable states",
    "save_as_full_pipeline": "sdx writes learned_embeds.safetensors; give it to any model with --embedding",
    "no_safe_serialization": "sdx writes safetensors only",
}

# diffusers flags (store_true) that change nothing sdx computes: accepted, ignored with a note.
IGNORED = {
    "enable_xformers_memory_efficient_attention": "it chooses an attention kernel, not the math; sdx's kernel is "
                                                  "--attention (xla, cudnn, chunked; by default the sampler's choice)",
    "enable_npu_flash_attention": "it chooses an attention kernel, not the math; sdx's kernel is --attention",
    "offload_ema": "it moves the EMA to the CPU between steps, not the math; sdx keeps the EMA sharded with the "
                   "parameters",
    "foreach_ema": "it chooses torch's batched EMA update, not the math; sdx's EMA update is part of the step",
    "set_grads_to_none": "it frees torch's gradient buffers between steps, not the math; sdx's gradients live "
                         "inside the compiled step",
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every flag of `python -m train.X`; see `parser` for each one's help."""

    task: str
    pretrained_model_name_or_path: str | None = None
    pretrained_vae_model_name_or_path: str | None = None
    revision: str | None = None
    variant: str | None = None
    cache_dir: str | None = None
    # data
    dataset_name: str | None = None
    train_data_dir: str | None = None
    original_image_column: str = "input_image"
    edit_prompt_column: str = "edit_prompt"
    edited_image_column: str = "edited_image"
    image_column: str = "image"
    caption_column: str | None = "text"
    conditioning_image_column: str = "conditioning_image"
    max_train_samples: int | None = None
    resolution: int = 512
    image_interpolation_mode: str = "bilinear"
    center_crop: bool = False
    random_flip: bool = False
    dataloader_num_workers: int = 0
    cache_latents: bool = False
    # DreamBooth: one subject's images under one prompt, optionally with prior preservation on its class
    instance_data_dir: str | None = None
    instance_prompt: str | None = None
    class_data_dir: str | None = None
    class_prompt: str | None = None
    with_prior_preservation: bool = False
    prior_loss_weight: float = 1.0
    num_class_images: int = 100
    sample_batch_size: int = 4
    repeats: int = 1
    # textual inversion: new words for the text encoders, learned from a few images
    placeholder_token: str | None = None
    initializer_token: str | None = None
    learnable_property: str = "object"
    num_vectors: int = 1
    # ControlNet: start from this ControlNet (else a copy of the UNet's encoder half, diffusers' from_unet)
    controlnet_model_name_or_path: str | None = None
    adapter_model_name_or_path: str | None = None
    # optimisation
    output_dir: str = "sdx-model-finetuned"
    seed: int = 0
    train_batch_size: int = 16
    num_train_epochs: int = 100
    max_train_steps: int | None = None
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    learning_rate: float = 1e-4
    scale_lr: bool = False
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 500
    lr_num_cycles: int = 1
    lr_power: float = 1.0
    lr_step_rules: str | None = None
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_weight_decay: float = 1e-2
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"
    attention: str | None = None  # None: `sdx.attention.default_backend` of the compute dtype
    fsdp: int = 1
    # LoRA (text-to-image): adapters of this rank on the UNet's attention projections instead of the whole UNet
    rank: int | None = None
    lora_alpha: float | None = None  # None: the rank (scale 1, as diffusers' LoRA scripts)
    train_text_encoder: bool = False  # LoRA: adapters on the text encoders' attention projections too
    text_encoder_lr: float | None = None  # their peak learning rate (None: --learning_rate)
    # objective
    prediction_type: str | None = None
    snr_gamma: float | None = None
    noise_offset: float = 0.0
    input_perturbation: float = 0.0
    conditioning_dropout_prob: float | None = None
    proportion_empty_prompts: float = 0.0
    timestep_bias_strategy: str = "none"
    timestep_bias_multiplier: float = 1.0
    timestep_bias_begin: int = 0
    timestep_bias_end: int = 1000
    timestep_bias_portion: float = 0.25
    dream_training: bool = False
    dream_detail_preservation: float = 1.0
    pixel_loss_weight: float = 0.0  # text-to-image, InstructPix2Pix: the decoded prediction's pixel error's weight
    pixel_loss_max_timestep: int = 400  # ... counted below this timestep
    # EMA
    use_ema: bool = False
    ema_decay: float = 0.9999
    ema_min_decay: float = 0.0
    ema_update_after_step: int = 0
    ema_use_warmup: bool = False
    ema_inv_gamma: float = 1.0
    ema_power: float = 2 / 3
    # VAE training
    kl_weight: float = 1e-6
    reconstruction_loss: str = "l1"
    vae_config: str | None = None
    decoder_only: bool = False
    edge_weight: float = 0.0
    latent_noise: float = 0.0
    unet_latents: tuple[float, ...] = ()
    # checkpoints, validation, logging, output
    checkpointing_steps: int = 500
    checkpoints_total_limit: int | None = None
    resume_from_checkpoint: str | None = None
    validation_prompt: tuple[str, ...] = ()
    val_image_url_or_path: str | None = None
    validation_image: tuple[str, ...] = ()
    num_validation_images: int = 4
    validation_steps: int | None = None
    validation_epochs: int | None = None
    validation_inference_steps: int = 20
    report_to: str = "tensorboard"
    logging_dir: str = "logs"
    export_format: str = "sdx"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# task -> its default resolution and output folder (diffusers' script defaults)
_DEFAULTS = {
    "pix2pix": {"resolution": 256, "output_dir": "instruct-pix2pix-model"},
    "text_to_image": {"resolution": 512, "output_dir": "sd-model-finetuned"},
    "dreambooth": {"resolution": 512, "output_dir": "text-inversion-model", "train_batch_size": 4,
                   "num_train_epochs": 1, "learning_rate": 5e-6, "caption_column": None},
    "controlnet": {"resolution": 512, "output_dir": "controlnet-model", "train_batch_size": 4, "num_train_epochs": 1,
                   "learning_rate": 5e-6},
    "t2i_adapter": {"resolution": 1024, "output_dir": "t2iadapter-model", "train_batch_size": 4, "num_train_epochs": 1,
                    "learning_rate": 5e-6, "validation_steps": 100},
    "textual_inversion": {"resolution": 512, "output_dir": "text-inversion-model", "max_train_steps": 5000,
                          "repeats": 100, "image_interpolation_mode": "bicubic", "validation_steps": 100},
    "vae": {"resolution": 256, "output_dir": "vae-finetuned", "learning_rate": 4.5e-6},
}
# `python -m train.X_lora`'s defaults over X's (diffusers' train_text_to_image_lora.py, train_dreambooth_lora.py)
_LORA_DEFAULTS = {"text_to_image": {"rank": 4, "output_dir": "sd-model-finetuned-lora"},
                  "dreambooth": {"rank": 4, "output_dir": "lora-dreambooth-model", "learning_rate": 5e-4}}



def _flag(p, name: str, **kw) -> None:
    """Add --name and its dashed spelling --na-me, both writing `name`, to parser or group `p`."""
    spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    p.add_argument(*spellings, dest=name, **kw)


def _bool(p, name: str, help: str) -> None:
    _flag(p, name, action="store_true", help=help)


def parser(task: str, lora: bool = False) -> argparse.ArgumentParser:
    """The flags of `python -m train.X`, grouped by topic (what `--help` and the documentation's flag tables show).
    lora: `python -m train.X_lora` (X with `--rank` 4 by default)."""
    d = {f.name: f.default for f in dataclasses.fields(TrainConfig)} | _DEFAULTS[task]
    d |= _LORA_DEFAULTS[task] if lora else {}
    name = f"{task}_lora" if lora else task
    p = ArgumentParser(prog=f"python -m train.{name}", allow_abbrev=False,
                       description=f"Fine-tune with sdx ({name}); flags as diffusers' training scripts, with "
                                   "underscores or dashes.")
    opt = lambda g, name, help, **kw: _flag(g, name, default=d[name], help=help, **kw)
    edge_weight = lambda g, when: opt(g, "edge_weight", "weigh each pixel's error by 1 + this times its edge strength "
                                   "(the largest change over its 3x3 neighbourhood, 0 to 1): outlines and corners "
                                   "count more" + when, type=float)

    g = p.add_argument_group("model")
    model_help = "what `python -m sdx.sample --model` takes: sdx folder, diffusers folder, single file or hub id"
    if task == "vae":
        model_help += "; its VAE is fine-tuned (or give --vae_config to start from random weights)"
    opt(g, "pretrained_model_name_or_path", model_help)
    opt(g, "pretrained_vae_model_name_or_path", "use this VAE instead of the model's (as `--vae` of the sampler)")
    opt(g, "revision", "hub revision of the model")
    opt(g, "variant", "weights variant to read (e.g. fp16)")
    opt(g, "cache_dir", "hub cache folder for models and datasets")
    if task == "t2i_adapter":
        opt(g, "adapter_model_name_or_path", "start from this T2I-Adapter (what `python -m sdx.sample --t2i-adapter` "
            "takes); default: diffusers' T2IAdapter for the UNet, as torch initialises it")
    if task == "controlnet":
        opt(g, "controlnet_model_name_or_path", "start from this ControlNet (what `python -m sdx.sample --controlnet` "
            "takes); default: a copy of the UNet's encoder half, zero convolutions zero")

    g = p.add_argument_group("data")
    if task == "dreambooth":
        opt(g, "instance_data_dir", "a folder of the subject's images (every image file in it, no metadata)")
        opt(g, "dataset_name", "or the subject's images as a dataset (what text-to-image's --dataset_name takes)")
        opt(g, "image_column", "--dataset_name: the image column")
        opt(g, "caption_column", "--dataset_name: a column of each image's own prompt (default: --instance_prompt "
            "for all)")
        opt(g, "repeats", "read each instance image this many times per epoch", type=int)
        opt(g, "instance_prompt", "the prompt of every instance image, naming the subject (e.g. 'a photo of sks "
            "dog')")
    elif task == "textual_inversion":
        opt(g, "train_data_dir", "a folder of the images (every image file in it, no metadata)")
        opt(g, "repeats", "read each image this many times per epoch", type=int)
    else:
        opt(g, "dataset_name", "parquet dataset: a hub dataset id, a local folder of .parquet files, or one file")
        opt(g, "train_data_dir", "an image folder with metadata.jsonl (file_name plus the text column)")
    if task == "pix2pix":
        opt(g, "original_image_column", "the image before the edit")
        opt(g, "edit_prompt_column", "the edit instruction")
        opt(g, "edited_image_column", "the image after the edit")
    elif task not in ("dreambooth", "textual_inversion"):
        opt(g, "image_column", "the image column")
        if task in ("text_to_image", *CONTROL_TASKS):
            opt(g, "caption_column", "the caption column")
        if task == "vae":
            opt(g, "caption_column", "--unet_latents: the caption column (the prompts the UNet draws with)")
        if task in CONTROL_TASKS:
            opt(g, "conditioning_image_column", "the control image column (edges, depth, ...)")
    if task not in ("dreambooth", "textual_inversion"):
        opt(g, "max_train_samples", "use only this many samples (the first after a seeded shuffle)", type=int)
    opt(g, "resolution", "training size in pixels (shorter side resized to it, then cropped square)", type=int)
    opt(g, "image_interpolation_mode", "the resize filter (torchvision's names; the SDXL scripts default to "
        "lanczos)", choices=tuple(INTERPOLATIONS))
    if task not in CONTROL_TASKS:  # diffusers' ControlNet and T2I-Adapter scripts crop the center, unflipped
        _bool(g, "center_crop", "crop the center (default: a random crop)")
    if task == "textual_inversion":  # it always flips, as diffusers' script does
        p.set_defaults(random_flip=True)
    elif task not in CONTROL_TASKS:
        _bool(g, "random_flip", "flip horizontally with probability 1/2")
    opt(g, "dataloader_num_workers", "data loading worker processes (0: in the main process)", type=int)
    if task in ("pix2pix", "text_to_image"):
        _bool(g, "cache_latents", "encode the dataset once (VAE moments, text embeddings) into output_dir/cache")

    if task == "dreambooth":
        g = p.add_argument_group("prior preservation", "DreamBooth's class images, which keep the class's look")
        _bool(g, "with_prior_preservation", "also train on images of the subject's class under --class_prompt, "
              "so that the class keeps its look")
        opt(g, "class_data_dir", "the class images; when it holds fewer than --num_class_images, the rest are "
            "sampled into it with --class_prompt")
        opt(g, "class_prompt", "the prompt of the class images (e.g. 'a photo of dog')")
        opt(g, "prior_loss_weight", "weight of the class images' loss", type=float)
        opt(g, "num_class_images", "class images used (sampled first when the folder holds fewer)", type=int)
        opt(g, "sample_batch_size", "images per sampler call when sampling class images", type=int)
    if task == "textual_inversion":
        g = p.add_argument_group("the new word")
        opt(g, "placeholder_token", "the new word, e.g. '<cat-toy>' (not yet in the tokenizer)")
        opt(g, "initializer_token", "one existing word whose vector the new word's vectors start from, e.g. 'toy'")
        opt(g, "learnable_property", "what the word stands for: an object ('a photo of a <word>', ...) or a style "
            "('a painting in the style of <word>', ...)", choices=("object", "style"))
        opt(g, "num_vectors", "vectors of the word (tokens <word>, <word>_1, ...)", type=int)

    g = p.add_argument_group("optimisation")
    opt(g, "seed", "seed of every random draw (noise, timesteps, dropout, crops, flips, shuffling)", type=int)
    opt(g, "train_batch_size", "samples per device per micro-batch", type=int)
    opt(g, "num_train_epochs", "epochs (when --max_train_steps is not given)", type=int)
    opt(g, "max_train_steps", "optimizer steps; overrides --num_train_epochs", type=int)
    opt(g, "gradient_accumulation_steps", "micro-batches per optimizer step (summed inside one compiled step)",
        type=int)
    opt(g, "learning_rate", "peak learning rate", type=float)
    _bool(g, "scale_lr", "multiply the learning rate by accumulation steps x batch size x devices")
    opt(g, "lr_scheduler", "learning-rate curve", choices=SCHEDULES)
    opt(g, "lr_warmup_steps", "linear warm-up, in optimizer steps", type=int)
    opt(g, "lr_num_cycles", "cosine_with_restarts: number of hard restarts", type=int)
    opt(g, "lr_power", "polynomial: power of the decay", type=float)
    opt(g, "lr_step_rules", "piecewise_constant: 'multiplier:step,...,last_multiplier', as diffusers' step_rules")
    opt(g, "adam_beta1", "AdamW beta1", type=float)
    opt(g, "adam_beta2", "AdamW beta2", type=float)
    opt(g, "adam_weight_decay", "AdamW decoupled weight decay", type=float)
    opt(g, "adam_epsilon", "AdamW epsilon", type=float)
    opt(g, "max_grad_norm", "clip the global gradient norm to this (0: no clipping)", type=float)

    g = p.add_argument_group("precision, memory and devices")
    opt(g, "mixed_precision", "bf16: bfloat16 compute, float32 master weights (fp16 runs as bf16)",
        choices=("no", "bf16", "fp16"))
    _bool(g, "gradient_checkpointing", "rematerialise each block in the backward pass (less memory, more compute)")
    opt(g, "attention", "attention backend (default: the sampler's: chunked on a CPU, cudnn in bf16 on an NVIDIA GPU "
        "with flash attention, xla elsewhere)", choices=BACKENDS)
    opt(g, "fsdp", "devices sharing each parameter, gradient and optimizer state (the rest split the batch)",
        type=int)

    if task in LORA_TASKS:
        g = p.add_argument_group("LoRA", "adapters instead of the whole UNet")
        opt(g, "rank", "LoRA: train adapters of this rank on the UNet's attention projections (to_q, to_k, to_v, "
            "to_out.0) and write them as pytorch_lora_weights.safetensors" + ("" if lora else " (default: the whole "
            "UNet)"), type=int)
        opt(g, "lora_alpha", "LoRA: the adapters' alpha; they add alpha / rank x their product (default: the rank)",
            type=float)
        _bool(g, "train_text_encoder", "LoRA: also train adapters on the text encoders' attention projections "
              "(q_proj, k_proj, v_proj, out_proj), written into the same file; the encoders then run in every step")
        opt(g, "text_encoder_lr", "--train_text_encoder: the encoders' adapters' peak learning rate (default: "
            "--learning_rate; --scale_lr leaves it alone), on the same schedule", type=float)

    g = p.add_argument_group("objective")
    if task != "vae":
        opt(g, "prediction_type", "training target (default: the model's scheduler config)", choices=PREDICTION_TYPES)
        opt(g, "snr_gamma", "min-SNR loss weighting with this gamma (5.0 is the paper's)", type=float)
        opt(g, "noise_offset", "offset noise scale", type=float)
        opt(g, "timestep_bias_strategy", "weigh the timesteps drawn: the later or earlier --timestep_bias_portion of "
            "them, or [--timestep_bias_begin, --timestep_bias_end), times --timestep_bias_multiplier",
            choices=("none", "earlier", "later", "range"))
        opt(g, "timestep_bias_multiplier", "the biased timesteps' weight (the others' is 1)", type=float)
        opt(g, "timestep_bias_begin", "range: the first biased timestep", type=int)
        opt(g, "timestep_bias_end", "range: the biased timesteps end before this one", type=int)
        opt(g, "timestep_bias_portion", "earlier/later: the share of the timesteps biased", type=float)
        opt(g, "input_perturbation", "input perturbation scale", type=float)
        if task == "pix2pix":
            opt(g, "conditioning_dropout_prob", "drop text, image, or both, each with this probability", type=float)
        elif task != "textual_inversion":
            opt(g, "proportion_empty_prompts", "replace this proportion of captions by the empty prompt", type=float)
        if task == "text_to_image":
            _bool(g, "dream_training", "DREAM: correct the noisy latents and target by the model's own prediction "
                  "(one more forward pass without gradient; epsilon-prediction models)")
            opt(g, "dream_detail_preservation", "DREAM's p: the correction is scaled by sqrt(1 - alpha_bar)^p",
                type=float)
        if task in ("text_to_image", "pix2pix"):
            opt(g, "pixel_loss_weight", "add this times the mean absolute error of the picture the prediction "
                "implies (its clean latents through the frozen VAE decoder) against the clean latents' picture, "
                "at timesteps below --pixel_loss_max_timestep (one decoder pass more in each step)", type=float)
            opt(g, "pixel_loss_max_timestep", "--pixel_loss_weight: the timesteps it counts at are below this one",
                type=int)
            edge_weight(g, " (with --pixel_loss_weight)")
    else:
        opt(g, "kl_weight", "weight of the KL term", type=float)
        opt(g, "reconstruction_loss", "l1 or l2", choices=("l1", "l2"))
        opt(g, "vae_config", "train from random weights: a preset name or a VAE config.json")
        _bool(g, "decoder_only", "train the decoder (and post_quant_conv) only: the encoder, and so every latent "
              "a model was trained on, stays exactly as it is")
        edge_weight(g, "")
        opt(g, "latent_noise", "decode the latents plus noise of standard deviation this times u ~ U[0, 1) (latent "
            "units before scaling_factor): the decoder learns to draw latents near the encoder's cleanly",
            type=float)
        _flag(g, "unet_latents", nargs="+", type=float, default=[], metavar="STRENGTH",
              help="--decoder_only: decode, against each picture, the latents the model's own UNet draws from it "
                   "and its caption by img2img at these strengths (each batch of the dataset at the next in turn), "
                   "instead of the encoder's; the dataset is drawn once into output_dir/cache")

    g = p.add_argument_group("EMA", "an exponential moving average of the weights (diffusers' EMAModel)")
    _bool(g, "use_ema", "keep an exponential moving average of the weights; validate and save it")
    opt(g, "ema_decay", "EMA: maximum decay", type=float)
    opt(g, "ema_min_decay", "EMA: minimum decay", type=float)
    opt(g, "ema_update_after_step", "EMA: copy the weights until this optimizer step, then average", type=int)
    _bool(g, "ema_use_warmup", "EMA: decay 1 - (1 + step/inv_gamma)^-power instead of (1 + step)/(10 + step)")
    opt(g, "ema_inv_gamma", "EMA warm-up inverse gamma", type=float)
    opt(g, "ema_power", "EMA warm-up power", type=float)

    g = p.add_argument_group("checkpoints")
    opt(g, "checkpointing_steps", "save a resumable checkpoint every N optimizer steps", type=int)
    opt(g, "checkpoints_total_limit", "keep only the newest N checkpoints", type=int)
    opt(g, "resume_from_checkpoint", "'latest' or a checkpoint folder")

    g = p.add_argument_group("validation")
    if task != "vae":
        _flag_with_alias(g, "validation_prompt", "--validation_prompts", nargs="+", default=[],
                         help="prompt(s) (pix2pix: the edit instruction) sampled at each validation")
        if task == "pix2pix":
            _flag_with_alias(g, "val_image_url_or_path", "--val_image_url", default=None,
                             help="the image validation edits (a local path)")
        if task in CONTROL_TASKS:
            opt(g, "validation_image", "control image(s) of the validation (local paths): one, one per prompt, or "
                "several for one prompt", nargs="+")
        opt(g, "num_validation_images", "images per validation prompt", type=int)
        opt(g, "validation_inference_steps", "sampler steps of validation images", type=int)
    opt(g, "validation_steps", "validate every N optimizer steps", type=int)
    opt(g, "validation_epochs", "validate every N epochs", type=int)

    g = p.add_argument_group("output and logging")
    opt(g, "output_dir", "where the model, checkpoints, logs and validation images go")
    opt(g, "report_to", "metrics sink besides metrics.jsonl", choices=("tensorboard", "none"))
    opt(g, "logging_dir", "TensorBoard folder, relative to --output_dir", type=str)
    opt(g, "export_format", "also write the final model in this layout (the sdx folder is always written)",
        choices=EXPORT_FORMATS)
    return p


def _flag_with_alias(p, name: str, alias: str, **kw) -> None:
    spellings = [f"--{name}", f"--{name.replace('_', '-')}", alias, alias.replace("_", "-")]
    p.add_argument(*dict.fromkeys(spellings), dest=name, **kw)


def parse(task: str, argv: list[str] | None = None, lora: bool = False) -> TrainConfig:
    """The run `argv` describes, checked; bad input exits 2 with one `error:` line. lora: see `parser`."""
    if task not in TASKS or (lora and task not in LORA_TASKS):
        raise ValueError(task)
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser(task, lora)
    kept = []
    for arg in argv:
        name = arg.lstrip("-").split("=", 1)[0].replace("-", "_")
        if arg.startswith("--") and name in UNSUPPORTED:
            p.error(f"--{name} (a diffusers flag) is not supported by sdx: {UNSUPPORTED[name]}")
        if arg.startswith("--") and "=" not in arg and name in IGNORED:
            _note(f"--{name} is ignored: {IGNORED[name]}")
            continue
        kept.append(arg)
    values = dict(vars(p.parse_args(kept)))
    for name in ("validation_prompt", "validation_image", "unet_latents"):
        if name in values:
            values[name] = tuple(values[name] or ())
    if values["mixed_precision"] == "fp16":
        _note("--mixed_precision fp16 runs as bf16: bfloat16 compute with float32 master weights (float16 would "
              "need loss scaling, which sdx does not do)")
        values["mixed_precision"] = "bf16"
    cfg = TrainConfig(task=task, **values)
    try:
        check(cfg)
    except SdxError as e:
        p.error(str(e))
    return cfg


def _note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def check(c: TrainConfig) -> None:
    """Value checks that need no file access (files are checked by the loop before any heavy work)."""
    if c.task == "vae":
        if not c.pretrained_model_name_or_path and not c.vae_config:
            raise SdxError("give --pretrained_model_name_or_path (its VAE is fine-tuned) or --vae_config")
        if c.unet_latents:
            _check_unet_latents(c)
    elif not c.pretrained_model_name_or_path:
        raise SdxError("--pretrained_model_name_or_path is required")
    if c.task == "dreambooth":
        _check_dreambooth(c)
    elif c.task == "textual_inversion":
        if not c.train_data_dir or not c.placeholder_token or not c.initializer_token:
            raise SdxError("textual inversion needs --train_data_dir (the images), --placeholder_token (the new word) "
                           "and --initializer_token (an existing word it starts from)")
        if c.num_vectors < 1:
            raise SdxError(f"--num_vectors must be at least 1, got {c.num_vectors}")
    elif bool(c.dataset_name) == bool(c.train_data_dir):
        raise SdxError("give exactly one of --dataset_name (parquet) and --train_data_dir (image folder)")
    positive = ("resolution", "train_batch_size", "num_train_epochs", "gradient_accumulation_steps",
                "checkpointing_steps", "fsdp", "lr_num_cycles", "num_validation_images", "validation_inference_steps",
                "num_class_images", "sample_batch_size", "repeats")
    for name in positive:
        if getattr(c, name) < 1:
            raise SdxError(f"--{name} must be at least 1, got {getattr(c, name)}")
    for name in ("max_train_steps", "max_train_samples", "checkpoints_total_limit", "validation_steps",
                 "validation_epochs"):
        value = getattr(c, name)
        if value is not None and value < 1:
            raise SdxError(f"--{name} must be at least 1, got {value}")
    for name in ("lr_warmup_steps", "dataloader_num_workers", "ema_update_after_step"):
        if getattr(c, name) < 0:
            raise SdxError(f"--{name} must not be negative, got {getattr(c, name)}")
    if c.learning_rate <= 0:
        raise SdxError(f"--learning_rate must be positive, got {c.learning_rate}")
    for name in ("noise_offset", "input_perturbation", "max_grad_norm", "adam_weight_decay", "kl_weight",
                 "prior_loss_weight", "edge_weight", "latent_noise", "pixel_loss_weight"):
        if getattr(c, name) < 0:
            raise SdxError(f"--{name} must not be negative, got {getattr(c, name)}")
    if c.adam_epsilon <= 0:
        raise SdxError(f"--adam_epsilon must be positive, got {c.adam_epsilon}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(c, name) < 1:
            raise SdxError(f"--{name} must be in [0, 1), got {getattr(c, name)}")
    for name in ("ema_decay", "ema_min_decay"):
        if not 0 <= getattr(c, name) <= 1:
            raise SdxError(f"--{name} must be in [0, 1], got {getattr(c, name)}")
    if c.ema_min_decay > c.ema_decay:
        raise SdxError(f"--ema_min_decay {c.ema_min_decay} is above --ema_decay {c.ema_decay}")
    if c.ema_inv_gamma <= 0 or c.ema_power <= 0:
        raise SdxError("--ema_inv_gamma and --ema_power must be positive")
    if c.timestep_bias_strategy != "none":
        if c.timestep_bias_multiplier <= 0:
            raise SdxError(f"--timestep_bias_multiplier must be positive, got {c.timestep_bias_multiplier}; to draw "
                           "timesteps uniformly, use --timestep_bias_strategy none")
        if not 0 <= c.timestep_bias_portion <= 1:
            raise SdxError(f"--timestep_bias_portion must be in [0, 1], got {c.timestep_bias_portion}")
        if c.timestep_bias_strategy == "range" and not 0 <= c.timestep_bias_begin < c.timestep_bias_end:
            raise SdxError(f"--timestep_bias_begin {c.timestep_bias_begin} and --timestep_bias_end "
                           f"{c.timestep_bias_end}: give 0 <= begin < end")
    if c.dream_training and c.dream_detail_preservation <= 0:
        raise SdxError(f"--dream_detail_preservation must be positive, got {c.dream_detail_preservation}")
    if c.pixel_loss_weight and c.pixel_loss_max_timestep < 1:
        raise SdxError(f"--pixel_loss_max_timestep must be at least 1, got {c.pixel_loss_max_timestep}")
    if c.snr_gamma is not None and c.snr_gamma <= 0:
        raise SdxError(f"--snr_gamma must be positive, got {c.snr_gamma}")
    if c.conditioning_dropout_prob is not None and not 0 <= c.conditioning_dropout_prob <= 1 / 3:
        raise SdxError(f"--conditioning_dropout_prob must be in [0, 1/3] (text, image and both are each dropped "
                       f"with it), got {c.conditioning_dropout_prob}")
    if not 0 <= c.proportion_empty_prompts <= 1:
        raise SdxError(f"--proportion_empty_prompts must be in [0, 1], got {c.proportion_empty_prompts}")
    if c.mixed_precision not in ("no", "bf16"):
        raise SdxError(f"--mixed_precision {c.mixed_precision}: use no or bf16")
    if c.rank is not None or c.lora_alpha is not None:
        if c.task not in LORA_TASKS:
            raise SdxError(f"LoRA (--rank, --lora_alpha) trains text-to-image and DreamBooth runs only, not {c.task}")
        if c.rank is None or c.rank < 1:
            raise SdxError(f"--rank must be at least 1, got {c.rank}")
        if c.lora_alpha is not None and c.lora_alpha <= 0:
            raise SdxError(f"--lora_alpha must be positive, got {c.lora_alpha}")
        if c.export_format != "sdx":
            raise SdxError(f"--export_format {c.export_format}: a LoRA run writes diffusers' "
                           "pytorch_lora_weights.safetensors, which diffusers and sdx both read; drop the flag")
    if c.text_encoder_lr is not None and (not c.train_text_encoder or c.text_encoder_lr <= 0):
        raise SdxError(f"--text_encoder_lr {c.text_encoder_lr}: give a positive one, with --train_text_encoder")
    if c.train_text_encoder and c.rank is None:
        raise SdxError(f"--train_text_encoder trains LoRA adapters on the text encoders: give --rank (or run "
                       f"python -m train.{c.task}_lora); whole text encoders are not fine-tuned")
    if c.task in CONTROL_TASKS and c.validation_prompt:
        n, m = len(c.validation_prompt), len(c.validation_image)
        if m == 0:
            raise SdxError("--validation_prompt needs --validation_image (the control image) for a ControlNet or a "
                           "T2I-Adapter")
        if not (m == 1 or n == 1 or m == n):
            raise SdxError(f"--validation_prompt ({n}) and --validation_image ({m}): give one image, one prompt, "
                           "or as many of each (diffusers' pairing)")
    if c.task == "pix2pix" and c.validation_prompt and not c.val_image_url_or_path:
        raise SdxError("--validation_prompt needs --val_image_url_or_path (the image to edit) for pix2pix")


def _check_unet_latents(c: TrainConfig) -> None:
    if c.vae_config or not c.decoder_only:
        raise SdxError("--unet_latents fine-tunes a pipeline's decoder on what its UNet draws: give "
                       "--pretrained_model_name_or_path and --decoder_only (not --vae_config)")
    bad = [s for s in c.unet_latents if not 0 < s <= 1]
    if bad:
        raise SdxError(f"--unet_latents {bad[0]}: an img2img strength is in (0, 1]")
    if not c.caption_column:
        raise SdxError("--unet_latents draws each picture from its caption: give --caption_column")


def _check_dreambooth(c: TrainConfig) -> None:
    """DreamBooth's own flags (diffusers' train_dreambooth.py's checks)."""
    if bool(c.instance_data_dir) == bool(c.dataset_name) or not c.instance_prompt:
        raise SdxError("DreamBooth needs one of --instance_data_dir and --dataset_name (the subject's images), and "
                       "--instance_prompt")
    if c.caption_column and not c.dataset_name:
        raise SdxError("--caption_column reads a --dataset_name's prompts; an --instance_data_dir has none")
    if c.with_prior_preservation:
        if not c.class_data_dir or not c.class_prompt:
            raise SdxError("--with_prior_preservation needs --class_data_dir (where the class images are, or are "
                           "sampled into) and --class_prompt")
    elif c.class_data_dir or c.class_prompt:
        _note("--class_data_dir and --class_prompt are not used without --with_prior_preservation")
