"""`python -m sdx.sample`: text-to-image, img2img, inpainting, SDXL base + refiner and InstructPix2Pix.

    python -m sdx.sample --model stabilityai/stable-diffusion-xl-base-1.0 --prompt "a lighthouse" \
        --steps 30 --dtype bfloat16 --output out.png

--model takes an sdx folder, a diffusers folder, a single-file checkpoint, a hub id (converted once
into the cache; --lora, --vae, --unet, --embedding and --config are applied in that conversion), one of the shipped default
models (`default`, `default-edit`: trained by sdx on its shapes world; without --model, `default`, or
`default-edit` when --image is given without --mask) or a demo model name (`tiny`, `tiny_xl`: random weights, for
tests). The pipeline type comes from the model;
--image makes it img2img (or InstructPix2Pix for such a model), --image with --mask inpainting (an
inpainting model's own 9-channel way, or by blending with any other SD/SDXL model); --controlnet with
--control-image guides any of text-to-image, img2img and inpainting with ControlNets (--t2i-adapter with
--t2i-adapter-image with T2I-Adapters), --ip-adapter with
--ip-adapter-image adds an image to the prompt (IP-Adapter). Bad input ends with
one `error:` line and exit status 2.

The command lives in pipelines/ since it uses convert/ and pipelines/; sdx/sample.py is only its documented
entry point, which calls `main` at run time (sdx itself imports nothing above it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipelines import research_cli, sampling_cli
from pipelines.model_names import resolve_model
from sdx import images, io
from sdx.errors import ArgumentParser, SdxError, exit_without_teardown, run_command

if TYPE_CHECKING:
    import PIL.Image


def _size(text: str) -> tuple[int, int]:
    parts = text.lower().replace(",", "x").split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not HEIGHTxWIDTH, e.g. 1024x1024")
    return int(parts[0]), int(parts[1])


def _ip_scale(text: str) -> float | dict:
    """--ip-adapter-scale: a number, or a JSON object of per-block scales."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor a JSON object like "
                                         '\'{"up": {"block_0": [0.0, 1.0, 0.0]}}\'')
    return value


def parser() -> argparse.ArgumentParser:
    from sdx.attention import BACKENDS

    p = ArgumentParser(prog="python -m sdx.sample", description=__doc__.split("\n\n")[0])
    model = p.add_argument_group("the model")
    prompts = p.add_argument_group("prompts")
    sampling = p.add_argument_group("sampling")
    image = p.add_argument_group("img2img, inpainting and editing")
    sdxl = p.add_argument_group("SDXL: the refiner and micro-conditioning")
    control = p.add_argument_group("ControlNet")
    adapter = p.add_argument_group("T2I-Adapter")
    ip = p.add_argument_group("IP-Adapter")
    device = p.add_argument_group("precision, memory and devices")
    output = p.add_argument_group("output and cache")
    model.add_argument("--model",
                   help="sdx folder, diffusers folder, single-file checkpoint, hub id, default model (default, "
                        "default-edit) or random-weight demo model (tiny, tiny_xl); without it: default, or "
                        "default-edit with --image (without --mask)")
    model.add_argument("--config", metavar="FOLDER",
                   help="single-file --model: a diffusers-layout folder whose config.json files (and tokenizers) "
                        "describe it, instead of the built-in preset its keys point to")
    model.add_argument("--preset", metavar="NAME",
                   help="single-file --model: read it as this preset, e.g. sd21 for an SD 2.x-base epsilon file")
    model.add_argument("--lora", metavar="FILE[:SCALE]", action="append", default=[],
                   help="merge a LoRA (kohya or diffusers/PEFT .safetensors, or hub org/name[/FILE]) into --model "
                        "at SCALE (default 1.0); repeatable")
    model.add_argument("--embedding", metavar="FILE[:TOKEN]", action="append", default=[],
                   help="add a textual inversion embedding (diffusers learned_embeds, A1111 or SDXL .safetensors, or a hub org/name/FILE) as the word TOKEN (default: its own token, else the file's name); repeatable")
    model.add_argument("--vae", metavar="MODEL",
                   help="use this VAE (diffusers VAE folder, pipeline folder, sdx folder, single VAE file, or hub id) "
                        "instead of the model's; also for --refiner")
    model.add_argument("--unet", metavar="MODEL",
                   help="use this UNet instead of the model's (LoRAs merge into it): a diffusers UNet folder (e.g. "
                        "latent-consistency/lcm-sdxl), a pipeline folder, an sdx folder, a weights file in diffusers or "
                        "original keys (e.g. ByteDance/SDXL-Lightning/sdxl_lightning_4step_unet.safetensors), or a hub id")
    prompts.add_argument("--prompt", nargs="+", help="one or more prompts")
    prompts.add_argument("--prompts-file", metavar="FILE",
                   help="many generations in one process: a prompt per line, or JSON objects with a \"prompt\" and "
                        "per-line settings (see pipelines/prompts_file.py); images go to --output/NNNNN.png and a run "
                        "started again skips those already written")
    prompts.add_argument("--prompt-2", nargs="+", help="SDXL: prompts for the second text encoder (default: --prompt)")
    prompts.add_argument("--negative-prompt", nargs="+", help="one, or one per prompt")
    prompts.add_argument("--negative-prompt-2", nargs="+", help="SDXL: for the second text encoder")
    sampling.add_argument("--steps", type=int, default=30, help="denoising steps (diffusers' num_inference_steps)")
    sampling.add_argument("--guidance-scale", type=float, default=None, help="default 7.5 (5.0 for SDXL)")
    sampling.add_argument("--guidance-rescale", type=float, default=0.0,
                          help="rescale of the guided prediction (Lin et al. 2023; zero-SNR and v-prediction models)")
    image.add_argument("--image", help="input image: img2img, or the image an InstructPix2Pix model edits")
    image.add_argument("--strength", type=float, default=None,
                   help="img2img and inpainting: how much to change (default 0.8, SDXL 0.3; inpainting 1.0, SDXL 0.9999)")
    image.add_argument("--mask", metavar="FILE",
                   help="inpainting: white repaints, black keeps (resized to the image, greyscale, binarised at 0.5)")
    image.add_argument("--mask-blur", type=float, default=0.0, metavar="PX",
                   help="blur the mask by this Gaussian radius first (diffusers' mask_processor.blur)")
    image.add_argument("--apply-overlay", action="store_true",
                   help="inpainting: paste --image's pixels back where the mask keeps them, through --mask-blur's soft "
                        "edge (diffusers' apply_overlay; what A1111 does): the kept region stays exactly the input, "
                        "where the VAE's decode would shift it (always so with --padding-mask-crop)")
    image.add_argument("--padding-mask-crop", type=int, metavar="PX",
                   help="inpaint only a crop around the mask, grown by PX pixels, at the generation size (--height/"
                        "--width, default the model's), and paste it back into the image (diffusers' padding_mask_crop)")
    control.add_argument("--controlnet", metavar="MODEL", action="append", default=[],
                   help="a ControlNet (diffusers or sdx folder, hub id, or original single file) to guide the model "
                        "with; repeatable, each with its --control-image")
    control.add_argument("--control-image", metavar="FILE", action="append", default=[],
                   help="the map a --controlnet reads (edges, depth, pose, ... as the user made it), in the same order; "
                        "resized to the generation size")
    control.add_argument("--controlnet-conditioning-scale", metavar="S", type=float, nargs="+",
                   help="one, or one per --controlnet (default 1.0; img2img 0.8; inpainting 0.5, SDXL 1.0: diffusers')")
    control.add_argument("--control-guidance-start", metavar="F", type=float, nargs="+", default=[0.0],
                   help="share of the steps before a ControlNet starts acting: one, or one per --controlnet")
    control.add_argument("--control-guidance-end", metavar="F", type=float, nargs="+", default=[1.0],
                   help="share of the steps after which a ControlNet stops acting: one, or one per --controlnet")
    control.add_argument("--guess-mode", action="store_true",
                   help="ControlNets act without the prompt's help: their residuals scaled from 0.1 to 1 across the "
                        "blocks and, with guidance, on the text branch only")
    adapter.add_argument("--t2i-adapter", metavar="MODEL", action="append", default=[],
                   help="a T2I-Adapter (diffusers folder, hub id, e.g. TencentARC/t2iadapter_sketch_sd14v1, or an original "
                        "t2iadapter_*.pth file) to guide the model with; repeatable, each with its --t2i-adapter-image")
    adapter.add_argument("--t2i-adapter-image", metavar="FILE", action="append", default=[],
                   help="the map a --t2i-adapter reads (sketch, depth, pose, ...), in the same order; resized to the "
                        "generation size")
    adapter.add_argument("--t2i-adapter-scale", metavar="S", type=float, nargs="+",
                   help="weight of each adapter's features: one, or one per --t2i-adapter (default 1.0)")
    adapter.add_argument("--t2i-adapter-factor", metavar="F", type=float, default=1.0,
                   help="share of the steps, from the first, that the T2I-Adapters act in (default 1.0)")
    ip.add_argument("--ip-adapter", metavar="FILE",
                   help="an IP-Adapter .safetensors file (plain or plus, e.g. h94/IP-Adapter's "
                        "models/ip-adapter_sd15.safetensors) that lets --ip-adapter-image prompt the model")
    ip.add_argument("--ip-adapter-image", metavar="FILE", help="the image prompt an --ip-adapter reads")
    ip.add_argument("--ip-adapter-scale", metavar="S", type=_ip_scale, default=1.0,
                   help="weight of the image prompt in every cross-attention (default 1.0; 0 ignores it), or per block "
                        "as JSON, diffusers' set_ip_adapter_scale dict, e.g. '{\"up\": {\"block_0\": [0.0, 1.0, 0.0]}}' "
                        "(InstantStyle: the style block only; parts and blocks left out get 0)")
    ip.add_argument("--ip-adapter-image-encoder", metavar="FOLDER",
                   help="the adapter's CLIP image encoder (a transformers CLIPVisionModelWithProjection folder; "
                        "default: image_encoder beside the --ip-adapter file, as h94/IP-Adapter lays them out)")
    image.add_argument("--image-guidance-scale", type=float, default=1.5, help="InstructPix2Pix")
    sampling.add_argument("--height", type=int, help="pixels (default: the model's training size, or the image's)")
    sampling.add_argument("--width", type=int, help="pixels (default: the model's training size, or the image's)")
    sampling.add_argument("--num-images", type=int, default=1, help="images per prompt")
    device.add_argument("--batch-size", type=int, help="images per compiled call (default: as many as fit in free memory)")
    sampling.add_argument("--seed", type=int, default=0,
                          help="image j's noise is fold_in(PRNGKey(seed), j): the same image at any batch size")
    sampling_cli.add_flags(sampling)  # --scheduler, --timestep-spacing, --eta
    device.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the text encoders' and the UNet's")
    device.add_argument("--vae-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the VAE's (bfloat16: diffusers' choice in a bfloat16 pipeline; half the VAE's weights)")
    device.add_argument("--vae-tiling", action="store_true",
                   help="decode (and encode) images larger than the VAE's tile, its sample_size (SD 1.5: 512 px, SDXL: "
                        "1024), in overlapping tiles blended together, as diffusers' vae.enable_tiling(): the VAE's "
                        "working memory is one tile's at any image size")
    output.add_argument("--output", default="outputs", help="a .png file, or a folder for several images")
    output.add_argument("--grid", metavar="FILE.png",
                   help="also write all images as one grid PNG (a row per prompt with --num-images, else about square, "
                        "wider than tall)")
    output.add_argument("--overwrite", action="store_true", help="replace existing files")
    sdxl.add_argument("--refiner", help="SDXL refiner model, run after the base (ensemble of experts)")
    sdxl.add_argument("--high-noise-frac", type=float, default=0.8, help="where the base hands over to the refiner")
    sampling.add_argument("--latents", help="initial noise, .npy (images, channels, height/f, width/f) float32 as diffusers' latents=")
    prompts.add_argument("--long-prompt", choices=("truncate", "chunk"), default="truncate",
                   help="prompts over 77 tokens: cut (diffusers) or encode in 75-token chunks")
    prompts.add_argument("--clip-skip", type=int, help="use the text encoder output this many layers earlier")
    sampling_cli.add_prompt_flags(prompts)  # --prompt-syntax
    sdxl.add_argument("--original-size", type=_size, help="SDXL micro-conditioning, HxW")
    sdxl.add_argument("--target-size", type=_size, help="SDXL micro-conditioning, HxW")
    sdxl.add_argument("--crops-top-left", type=_size, default=(0, 0), help="SDXL micro-conditioning, TOPxLEFT")
    sdxl.add_argument("--aesthetic-score", type=float, default=6.0, help="SDXL refiner")
    sdxl.add_argument("--negative-aesthetic-score", type=float, default=2.5, help="SDXL refiner")
    device.add_argument("--attention", choices=BACKENDS,
                   help="attention backend (default: chunked on a CPU, where it is faster from 1,024 tokens on; cudnn "
                        "in bfloat16 on an NVIDIA GPU from Ampere on; xla elsewhere)")
    device.add_argument("--fsdp", type=int, default=1, help="devices that share each parameter (default: replicate)")
    output.add_argument("--cache", help="where converted models and compiled programs are kept (default ~/.cache/sdx)")
    output.add_argument("--no-compilation-cache", action="store_true", help="do not keep compiled programs across runs")
    output.add_argument("--quiet", action="store_true", help="no progress bar")
    research_cli.add_flags(p.add_argument_group("research methods"))  # FreeU, PAG, SAG
    return p


def read_image(path: str) -> PIL.Image.Image:
    """The --image file, decoded in full to an RGB PIL image (before any model is loaded)."""
    try:
        return images.decode(path)
    except images.UnreadableImage as e:
        raise SdxError(f"--image {path}: cannot read the image ({e})") from None


def fit_image(im: PIL.Image.Image, path: str, size: tuple[int, int] | None, multiple: int) -> np.ndarray:
    """(1, H, W, 3) float32 in [-1, 1] from RGB image `im` (read from `path`). Resized (Lanczos) to `size`
    when given, else down to a multiple of `multiple`."""
    from PIL import Image

    if size is None:
        size = (im.height // multiple * multiple, im.width // multiple * multiple)
        if min(size) == 0:
            raise SdxError(f"--image {path}: {im.width}x{im.height} is smaller than {multiple} pixels")
    if (im.height, im.width) != size:
        im = im.resize((size[1], size[0]), Image.LANCZOS)
    arr = np.asarray(im, dtype=np.float32) / 255.0
    return (arr * 2.0 - 1.0)[None]


def load_latents(path: str) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise SdxError(f"--latents {path}: cannot read a .npy array ({e})") from None
    return np.asarray(arr, dtype=np.float32)


def output_paths(output: str, count: int, seed: int, overwrite: bool) -> list[Path]:
    out = Path(output)
    if out.suffix.lower() == ".png":
        if count != 1:
            raise SdxError(f"--output {output} is one file but {count} images are asked for; give a folder")
        paths = [out]
    else:
        paths = [out / f"{seed}-{i:04d}.png" for i in range(count)]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        raise SdxError(f"{existing[0]} exists; pass --overwrite to replace it or choose another --output")
    return paths


def read_picture(path: str, flag: str) -> PIL.Image.Image:
    """The picture at `path`, or an SdxError naming `flag`."""
    try:
        return images.decode(path)
    except images.UnreadableImage as e:
        raise SdxError(f"{flag} {path}: cannot read the image ({e})") from None


def per_model(values: list[float] | None, n: int, flag: str, models: str = "--controlnet") -> list[float] | None:
    """A flag's values given once or once per model of the `models` flag, as one per model (None stays None)."""
    if values is None or len(values) == n:
        return values
    if len(values) == 1:
        return values * n
    raise SdxError(f"{flag}: give one value or one per {models} ({n}), not {len(values)}")


def check_control_flags(args: argparse.Namespace) -> list[PIL.Image.Image]:
    """Refuse bad ControlNet flags; returns the --control-image pictures, as read here."""
    n = len(args.controlnet)
    if len(args.control_image) != n:
        raise SdxError(f"give one --control-image per --controlnet ({n}), not {len(args.control_image)}")
    if not n:
        if args.guess_mode or args.controlnet_conditioning_scale:
            raise SdxError("--guess-mode and --controlnet-conditioning-scale act on ControlNets: pass --controlnet")
        return []
    if args.refiner:
        raise SdxError("--controlnet and --refiner do not go together: a ControlNet guides one model")
    from pipelines.control import check_window

    starts = per_model(args.control_guidance_start, n, "--control-guidance-start")
    ends = per_model(args.control_guidance_end, n, "--control-guidance-end")
    per_model(args.controlnet_conditioning_scale, n, "--controlnet-conditioning-scale")
    for start, end in zip(starts, ends):
        check_window(start, end)
    return [read_picture(path, "--control-image") for path in args.control_image]


def check_t2i_adapter_flags(args: argparse.Namespace) -> list[PIL.Image.Image]:
    """Refuse bad T2I-Adapter flags (and a local adapter whose architecture cannot be read); returns the
    --t2i-adapter-image pictures, as read here."""
    n = len(args.t2i_adapter)
    if len(args.t2i_adapter_image) != n:
        raise SdxError(f"give one --t2i-adapter-image per --t2i-adapter ({n}), not {len(args.t2i_adapter_image)}")
    if not n:
        if args.t2i_adapter_scale or args.t2i_adapter_factor != 1.0:
            raise SdxError("--t2i-adapter-scale and --t2i-adapter-factor act on T2I-Adapters: pass --t2i-adapter")
        return []
    if args.refiner:
        raise SdxError("--t2i-adapter and --refiner do not go together: an adapter guides one model")
    if not 0.0 <= args.t2i_adapter_factor <= 1.0:
        raise SdxError(f"--t2i-adapter-factor {args.t2i_adapter_factor}: the share of the steps the adapters act in, "
                       "from 0 to 1")
    for scale in per_model(args.t2i_adapter_scale, n, "--t2i-adapter-scale", "--t2i-adapter") or []:
        if not math.isfinite(scale):
            raise SdxError(f"--t2i-adapter-scale {scale} must be a finite number")
    from convert.t2i_adapter import local_config

    for spec in args.t2i_adapter:
        if Path(spec).exists():
            local_config(Path(spec), f"--t2i-adapter {spec}")
    return [read_picture(path, "--t2i-adapter-image") for path in args.t2i_adapter_image]


def check_ip_adapter_flags(args: argparse.Namespace) -> PIL.Image.Image | None:
    """Refuse bad IP-Adapter flags; returns the --ip-adapter-image picture, as read here."""
    if not args.ip_adapter:
        if args.ip_adapter_image or args.ip_adapter_image_encoder:
            raise SdxError("--ip-adapter-image and --ip-adapter-image-encoder go with an IP-Adapter: pass --ip-adapter")
        return None
    if not args.ip_adapter_image:
        raise SdxError("--ip-adapter: give the image it reads, --ip-adapter-image")
    if args.refiner:
        raise SdxError("--ip-adapter and --refiner do not go together: an IP-Adapter is made for one UNet")
    if not isinstance(args.ip_adapter_scale, dict) and not math.isfinite(args.ip_adapter_scale):
        raise SdxError(f"--ip-adapter-scale {args.ip_adapter_scale} must be a finite number")
    from convert.hub import split_hub_path
    from convert.sources import looks_local
    from sdx.ip_adapter import config_of, read_file

    spec = args.ip_adapter
    on_hub = not Path(spec).exists() and not looks_local(spec) and (split_hub_path(spec) or ("", None))[1] is not None
    if not on_hub:
        config_of(read_file(spec), f"--ip-adapter {spec}")  # a missing, pickled or foreign file fails here, unloaded
    try:
        return images.decode(args.ip_adapter_image)
    except images.UnreadableImage as e:
        raise SdxError(f"--ip-adapter-image {args.ip_adapter_image}: cannot read the image ({e})") from None


def check_flags(args: argparse.Namespace) -> tuple:
    """Refuse bad values of the flags that say what to generate; returns the --latents array, the --image
    and --mask pictures, the --control-image and --t2i-adapter-image pictures and the --ip-adapter-image picture,
    as read here."""
    from pipelines.masks import read_mask

    for flag in ("steps", "num_images", "batch_size", "height", "width", "fsdp"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise SdxError(f"--{flag.replace('_', '-')} {value} must be a positive integer")
    if args.strength is not None and not 0.0 <= args.strength <= 1.0:
        raise SdxError(f"--strength {args.strength} must be in [0, 1] (the share of the steps that run)")
    if args.refiner and not 0.0 < args.high_noise_frac < 1.0:
        raise SdxError(f"--high-noise-frac {args.high_noise_frac} must be strictly between 0 and 1")
    if args.clip_skip is not None and args.clip_skip < 0:
        raise SdxError(f"--clip-skip {args.clip_skip} must be >= 0")
    if args.mask_blur < 0:
        raise SdxError(f"--mask-blur {args.mask_blur} must be >= 0 (a blur radius in pixels)")
    if args.mask and not args.image:
        raise SdxError("--mask marks what to repaint in --image: pass --image too")
    if args.mask and args.refiner:
        raise SdxError("--mask and --refiner do not go together: inpainting runs one model")
    if args.apply_overlay and not args.mask:
        raise SdxError("--apply-overlay pastes the part of --image that --mask keeps back over the result: pass --mask")
    if args.padding_mask_crop is not None and (not args.mask or args.padding_mask_crop < 0):
        raise SdxError(f"--padding-mask-crop {args.padding_mask_crop}: a number of pixels >= 0, with --mask")
    picture = read_image(args.image) if args.image else None
    mask = read_mask(args.mask) if args.mask else None
    if args.padding_mask_crop is not None and not np.asarray(mask.convert("L")).any():
        raise SdxError(f"--padding-mask-crop: the mask {args.mask} is black everywhere (nothing to repaint)")
    if args.config and not Path(args.config).is_dir():
        raise SdxError(f"--config {args.config}: not a folder")
    latents = load_latents(args.latents) if args.latents else None
    research_cli.check(args)
    sampling_cli.check(args)
    return latents, picture, mask, check_control_flags(args), check_t2i_adapter_flags(args), check_ip_adapter_flags(args)


@dataclasses.dataclass
class Job:
    """One generation: the flags with its own settings applied, where its images go, what the checks read.
    done: every image is already written (a --prompts-file run started again)."""

    args: argparse.Namespace
    paths: list[Path]
    grid: Path | None = None
    latents: np.ndarray | None = None
    picture: PIL.Image.Image | None = None
    mask: PIL.Image.Image | None = None
    controls: list[PIL.Image.Image] = dataclasses.field(default_factory=list)
    adapters: list[PIL.Image.Image] = dataclasses.field(default_factory=list)
    ip_picture: PIL.Image.Image | None = None
    done: bool = False


def check_args(args: argparse.Namespace) -> list[Job]:
    """Refuse bad values before anything heavy (loading, converting, compiling, sampling) runs; returns the
    generations asked for: one, or one per line of --prompts-file."""
    if args.cache:
        io.check_writable(Path(args.cache), "--cache")
    if args.prompts_file is not None:
        return _prompts_file_jobs(args)
    if not args.prompt:
        raise SdxError("give --prompt (one or more prompts) or --prompts-file FILE")
    latents, picture, mask, controls, adapters, ip_picture = check_flags(args)
    paths = output_paths(args.output, len(args.prompt) * args.num_images, args.seed, args.overwrite)
    grid_path = output_paths(args.grid, 1, args.seed, args.overwrite)[0] if args.grid else None
    io.check_writable(paths[0].parent, "--output")
    if grid_path is not None:
        io.check_writable(grid_path.parent, "--grid")
    return [Job(args, paths, grid_path, latents, picture, mask, controls, adapters, ip_picture)]


def _prompts_file_jobs(args: argparse.Namespace) -> list[Job]:
    from pipelines import prompts_file

    for flag in ("prompt", "grid", "latents"):
        if getattr(args, flag):
            raise SdxError(f"--{flag} and --prompts-file do not go together (a line may hold a \"prompt\" and settings)")
    folder = Path(args.output)
    if folder.suffix.lower() == ".png":
        raise SdxError(f"--output {args.output}: with --prompts-file it is the folder the images go to")
    io.check_writable(folder, "--output")
    jobs = []
    for index, (where, settings) in enumerate(prompts_file.read(args.prompts_file)):
        line = argparse.Namespace(**{**vars(args), **settings})
        try:
            check_flags(line)
            paths = prompts_file.paths(folder, index, line.num_images)
            done = [False] if args.overwrite else [prompts_file.written(p, line.prompt[0], line.seed, k)
                                                  for k, p in enumerate(paths)]
        except SdxError as e:
            raise SdxError(f"{where}: {e}") from None
        jobs.append(Job(line, paths, done=all(done)))  # the pictures are read again when their turn comes
    return jobs


def save_png(path: Path, pixels: np.ndarray, params: dict) -> None:
    """Atomically write an 8-bit PNG carrying `params` as JSON (`sdx`) and A1111-style text (`parameters`)."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("sdx", json.dumps(params, sort_keys=True))
    a1111 = f"{params['prompt']}\nNegative prompt: {params.get('negative_prompt') or ''}\n" + ", ".join(
        f"{k}: {params[v]}" for k, v in (("Steps", "steps"), ("Sampler", "scheduler"), ("CFG scale", "guidance_scale"),
                                         ("Seed", "seed"), ("Size", "size"), ("Model", "model"))
    )
    info.add_text("parameters", a1111)
    path.parent.mkdir(parents=True, exist_ok=True)
    io.atomic_write(path, lambda f: Image.fromarray(pixels).save(f, format="PNG", pnginfo=info))


def run(args: argparse.Namespace) -> list[Path]:
    from convert import default_models
    from convert.library import default_cache_dir
    from convert.sources import ModelOptions
    from pipelines.pipeline import NonFiniteImages
    from pipelines.sampler import enable_compilation_cache
    from sdx import mesh as meshlib

    jobs = check_args(args)
    log = (lambda msg: None) if args.quiet else _log
    todo = [job for job in jobs if not job.done]
    if len(todo) < len(jobs):
        log(f"{len(jobs) - len(todo)} of {len(jobs)} prompts are already written; generating the other {len(todo)}")
    if not todo:
        return []
    cache = Path(args.cache) if args.cache else default_cache_dir()
    if not args.no_compilation_cache:
        enable_compilation_cache(cache / "jax")
    meshlib.initialize()
    mesh = meshlib.make_mesh(args.fsdp)
    options = ModelOptions.from_args(config=args.config, preset=args.preset, lora=args.lora, vae=args.vae,
                                     embedding=args.embedding, unet=args.unet)
    # inpainting and ControlNet or T2I-Adapter img2img take the text-to-image model
    edits = any(job.args.image and not job.args.mask and not job.args.controlnet and not job.args.t2i_adapter
                for job in jobs)
    args.model = args.model or ("default-edit" if edits else "default")
    # the first request's programs are read while the weights load (a refiner's run is two other requests)
    first = None if args.refiner else lambda pipe: _request(todo[0], pipe)[0]
    pipes = _load(args, resolve_model(args.model, dtype=args.dtype, cache=cache, log=log, options=options), mesh, cache,
                  log, first)
    sizes = set()
    for job in todo:  # every request is checked against the model before the progress bar opens
        job.args.model = args.model
        request = _request(job, pipes[0])[0]
        sizes.add((request.height, request.width))
    default_models.warn_other_size(args.model, sizes, pipes[0].default_size)

    count = sum(len(job.paths) for job in todo)
    bar = None
    if not args.quiet:  # a prompts file's progress is counted in images, one generation's in model calls
        from tqdm import tqdm

        bar = tqdm(desc="images" if args.prompts_file else "denoising", unit="image" if args.prompts_file else "step",
                   total=count if args.prompts_file else 0, file=sys.stderr)
    steps_bar = None if args.prompts_file else bar
    compile_seconds = []

    def compiled(plan, seconds: float) -> None:
        compile_seconds.append(seconds)
        tiles = ", the VAE in tiles" if plan.vae_tiling else ""
        log(f"compiled in {seconds:.1f} s ({plan.batch} image(s) per call{tiles})")
        if bar is not None:
            _leave_out(bar, seconds)

    for p in pipes:
        p.sampler.compile_log = compiled
    t0, written, failed = time.perf_counter(), [], []
    try:
        for job in todo:
            try:
                written += _generate(job, pipes, steps_bar, log)
            except NonFiniteImages as e:  # the other prompts still run
                failed.append(f"{job.paths[0].name}: {e}" if args.prompts_file else str(e))
            if bar is not None and args.prompts_file:
                bar.update(len(job.paths))
    finally:  # an error (a full disk) prints on its own line, under the closed bar
        if bar is not None:
            bar.close()
    elapsed = time.perf_counter() - t0
    sampling = elapsed - sum(compile_seconds)
    log(f"{count} image(s) in {sampling:.2f} s sampling ({count / max(sampling, 1e-9):.2f} images/s) "
        f"+ {sum(compile_seconds):.1f} s compiling")
    if failed:
        raise SdxError("; ".join(failed))
    return written


def _leave_out(bar, seconds: float) -> None:
    """Leave `seconds` that just passed (a compile) out of a tqdm bar's elapsed time and rate: the bar last
    printed before they began (when its total grew, or at the previous image), so its clock moves by them
    and its first step no longer reads as the compile's length, nor its estimate of the time left."""
    bar.start_t += seconds
    bar.last_print_t += seconds


def _log(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)  # above an open progress bar, not glued to it


def _load(args: argparse.Namespace, folder: Path, mesh, cache: Path, log, first=None) -> list:
    """[the pipeline] or [the SDXL base, the refiner]; first: `Pipeline.load`'s."""
    from convert.sources import ModelOptions, resolve_ip_adapter
    from pipelines.pipeline import Pipeline
    from sdx.attention import default_backend

    attention = args.attention or default_backend(args.dtype)
    load = lambda folder, name, **kw: Pipeline.load(folder, dtype=args.dtype, vae_dtype=args.vae_dtype, scheduler=args.scheduler,
                                                    attention=attention, mesh=mesh, name=name, **kw)
    ip_adapter = encoder = None
    if args.ip_adapter:
        ip_adapter, encoder = resolve_ip_adapter(args.ip_adapter, args.ip_adapter_image_encoder, cache_dir=cache / "models",
                                                 log=log)
    pipe = load(folder, args.model, controlnets=tuple(args.controlnet), t2i_adapters=tuple(args.t2i_adapter),
                ip_adapter=ip_adapter, image_encoder=encoder, cache=cache, log=log, first=first)
    pipe = sampling_cli.configured(args, pipe)
    if not args.refiner:
        return [pipe]
    if not pipe.family.xl or pipe.family.pix2pix:
        raise SdxError("--refiner follows an SDXL base model; this model is not one")
    ref_folder = resolve_model(args.refiner, dtype=args.dtype, cache=cache, log=log, options=ModelOptions(vae=args.vae))
    return [pipe, sampling_cli.configured(args, load(ref_folder, args.refiner))]


def _request(job: Job, pipe):
    """The job's `Request`, checked against the model, and its `pipelines.masks.Crop` with
    --padding-mask-crop, else None (--image and --mask are read again for a prompts-file line)."""
    from pipelines import image_prompt
    from pipelines.masks import Crop, fit_mask, read_mask
    from pipelines.request import Request
    from pipelines.t2i_adapter import AdapterImage, fit_image as fit_adapter_image

    a = job.args
    picture = job.picture if job.picture is not None or not a.image else read_image(a.image)
    mask_picture = job.mask if job.mask is not None or not a.mask else read_mask(a.mask)
    control_pictures = job.controls or [read_picture(path, "--control-image") for path in a.control_image]
    adapter_pictures = job.adapters or [read_picture(path, "--t2i-adapter-image") for path in a.t2i_adapter_image]
    ip_picture = job.ip_picture if job.ip_picture is not None or not a.ip_adapter_image else check_ip_adapter_flags(a)
    size = (a.height, a.width) if a.height and a.width else None
    blur, crop = a.mask_blur, None
    if a.padding_mask_crop is not None:  # the crop around the mask, at the asked or the model's size
        size = (a.height or pipe.default_size, a.width or pipe.default_size)
        crop = Crop.around(picture, mask_picture, blur, size, a.padding_mask_crop)
        picture, mask_picture, blur = crop.cut(picture, size), crop.cut(crop.mask, size), 0.0
        control_pictures = [crop.cut(p, size) for p in control_pictures]
        adapter_pictures = [crop.cut(p, size) for p in adapter_pictures]
    image = fit_image(picture, a.image, size, pipe.multiple) if picture is not None else None
    mask = fit_mask(mask_picture, image.shape[1:3], blur) if mask_picture is not None else None
    if image is not None:
        height, width = image.shape[1:3]
    else:  # text-to-image: the flags, else the first control or adapter image's size (as diffusers), else the model's
        first = (control_pictures or adapter_pictures or [None])[0]
        step = max([pipe.multiple, *(adapter.config.downscale_factor for adapter in pipe.t2i_adapters)])
        height = a.height or (first.height // step * step if first else pipe.default_size)
        width = a.width or (first.width // step * step if first else pipe.default_size)
    controls = _controls(a, pipe, control_pictures, (height, width), image is not None, mask is not None)
    scales = per_model(a.t2i_adapter_scale, len(adapter_pictures), "--t2i-adapter-scale", "--t2i-adapter")
    adapters = [AdapterImage(fit_adapter_image(p, (height, width), adapter.config.in_channels), scale)
                for p, adapter, scale in zip(adapter_pictures, pipe.t2i_adapters, scales or [1.0] * len(adapter_pictures))]
    request = pipe.complete(Request(  # what the flags leave open: the model's defaults, as Pipeline.complete says
        prompts=a.prompt, prompts_2=a.prompt_2, negative_prompts=a.negative_prompt,
        negative_prompts_2=a.negative_prompt_2, height=height, width=width, steps=a.steps,
        num_images_per_prompt=a.num_images, batch_size=a.batch_size, seed=a.seed,
        guidance_scale=a.guidance_scale, image_guidance_scale=a.image_guidance_scale,
        guidance_rescale=a.guidance_rescale, strength=a.strength,
        image=image, mask=mask, latents=job.latents,
        original_size=a.original_size, target_size=a.target_size, crops_coords_top_left=a.crops_top_left,
        aesthetic_score=a.aesthetic_score, negative_aesthetic_score=a.negative_aesthetic_score,
        clip_skip=a.clip_skip, long_prompt=a.long_prompt, prompt_syntax=a.prompt_syntax, controls=controls, guess_mode=a.guess_mode,
        vae_tiling=a.vae_tiling, adapters=adapters, adapter_factor=a.t2i_adapter_factor, image_prompt=None if ip_picture is None else
        image_prompt.ImagePrompt(image_prompt.prepare([ip_picture], pipe.image_encoder), a.ip_adapter_scale),
        **research_cli.request_fields(a),
    ))
    pipe.validate(request)
    return request, crop


def _controls(a: argparse.Namespace, pipe, pictures: list, size: tuple[int, int], image: bool, mask: bool) -> list:
    """The request's `Control`s: each --control-image at the generation size, its scale (diffusers' default
    for the pipeline: 1.0, img2img 0.8, inpainting 0.5 (SDXL 1.0)) and guidance window."""
    from pipelines.control import Control, fit_control_image

    n = len(pictures)
    if not n:
        return []
    default = (1.0 if pipe.family.xl else 0.5) if mask else 0.8 if image else 1.0
    scales = per_model(a.controlnet_conditioning_scale, n, "--controlnet-conditioning-scale") or [default] * n
    starts = per_model(a.control_guidance_start, n, "--control-guidance-start")
    ends = per_model(a.control_guidance_end, n, "--control-guidance-end")
    channels = [net.config.conditioning_channels for net in pipe.controlnets]
    return [Control(fit_control_image(p, size, c), scale, start, end)
            for p, c, scale, start, end in zip(pictures, channels, scales, starts, ends)]


def _generate(job: Job, pipes: list, bar, log) -> list[Path]:
    """Generate the job's images and write them (and its grid); returns the paths written. Images that came
    out non-finite are not written: after writing the others, their error is raised."""
    from pipelines.pipeline import NonFiniteImages, refine, to_uint8
    from pipelines.request import per_prompt

    a, pipe = job.args, pipes[0]
    request, crop = _request(job, pipe)
    bad = generated = None
    try:
        if len(pipes) > 1:
            images = refine(pipe, pipes[1], request, a.high_noise_frac, bar)
        else:
            generated = pipe.generate(request, bar)  # the images and what --attention-maps reads out
            images = generated.images
    except NonFiniteImages as e:
        images, bad = np.nan_to_num(e.images), e
    pixels = to_uint8(images)
    if crop is not None:  # back into the input image, at its size
        pixels = np.stack([crop.paste(p) for p in pixels])
    elif a.apply_overlay:  # the kept pixels of the input, at the generation's size
        from pipelines.masks import overlaid, read_mask

        picture = job.picture if job.picture is not None else read_image(a.image)
        mask_picture = job.mask if job.mask is not None else read_mask(a.mask)
        pixels = np.stack([overlaid(p, picture, mask_picture, a.mask_blur) for p in pixels])
    scheduler_name = a.scheduler or type(pipe.scheduler).__name__
    negatives = per_prompt(a.negative_prompt, len(a.prompt), "--negative-prompt")
    written = []
    for i, path in enumerate(job.paths):
        if bad is not None and i in bad.bad:
            continue
        prompt_index = i // a.num_images  # images are grouped by prompt
        params = {
            "prompt": request.prompts[prompt_index],
            "negative_prompt": negatives[prompt_index] if negatives else None,
            "seed": a.seed, "image_index": i, "steps": a.steps, "scheduler": scheduler_name,
            "guidance_scale": request.guidance_scale, "guidance_rescale": request.guidance_rescale,
            "size": f"{pixels.shape[2]}x{pixels.shape[1]}", "model": a.model, "dtype": a.dtype,
            "vae_dtype": a.vae_dtype,
        }
        if a.vae_tiling:
            params["vae_tiling"] = True
        for key in ("prompt_2", "negative_prompt_2", "image", "mask", "mask_blur", "apply_overlay", "refiner", "latents",
                    "clip_skip",
                    "lora", "vae", "embedding", "controlnet", "control_image", "guess_mode", "padding_mask_crop", "t2i_adapter",
                    "t2i_adapter_image", "ip_adapter", "ip_adapter_image"):
            if getattr(a, key, None):
                params[key] = getattr(a, key)
        if a.image and pipe.family.pix2pix:
            params["image_guidance_scale"] = request.image_guidance_scale
        elif a.image:
            params["strength"] = request.strength
        if request.controls:
            params["controlnet_conditioning_scale"] = [c.scale for c in request.controls]
        if request.adapters:
            params["t2i_adapter_scale"] = [adapter.scale for adapter in request.adapters]
            params["t2i_adapter_factor"] = request.adapter_factor
        if request.image_prompt is not None:
            params["ip_adapter_scale"] = request.image_prompt.scale
        params.update(research_cli.png_params(a))
        save_png(path, pixels[i], params)
        log(f"wrote {path}")
        written.append(path)
    written += research_cli.write_readouts(a, pipe, request, generated, pixels, job.paths, log)
    if bad is not None:
        raise bad
    if job.grid is not None:
        columns = a.num_images if a.num_images > 1 else math.ceil(len(pixels) / math.isqrt(len(pixels)))
        save_png(job.grid, grid(pixels, columns), {**params, "prompt": " | ".join(request.prompts), "grid": columns})
        log(f"wrote {job.grid}")
        written.append(job.grid)
    return written


def grid(images: np.ndarray, columns: int) -> np.ndarray:
    """(N, H, W, C) -> one (rows * H, columns * W, C) picture, row-major, the last row padded with black."""
    n, h, w, c = images.shape
    rows = math.ceil(n / columns)
    padded = np.concatenate([images, np.zeros((rows * columns - n, h, w, c), images.dtype)])
    return padded.reshape(rows, columns, h, w, c).swapaxes(1, 2).reshape(rows * h, columns * w, c)


def main(argv: list[str] | None = None) -> int:
    def body():
        run(parser().parse_args(argv))

    return run_command(body)


if __name__ == "__main__":
    exit_without_teardown(main())
