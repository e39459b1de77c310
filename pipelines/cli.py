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

The conditioning and research methods each bring their flags, checks, request fields and PNG parameters
(`pipelines.method.Method`); the command loops over their table, `METHODS`.

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
from typing import TYPE_CHECKING, Any

import numpy as np

from pipelines import conditioning_cli, research_cli, sampling_cli
from pipelines.method import Context, Method
from pipelines.model_names import resolve_model
from sdx import images, io
from sdx.errors import ArgumentParser, SdxError, exit_without_teardown, run_command

if TYPE_CHECKING:
    import PIL.Image

# every method's command-line part, in the order of --help and of the request's conditioning
METHODS: tuple[Method, ...] = (*conditioning_cli.METHODS, *research_cli.METHODS)
# flags recorded in the PNG's metadata when set (the methods record their own)
RECORDED = ("prompt_2", "negative_prompt_2", "image", "mask", "mask_blur", "apply_overlay", "refiner", "latents",
            "clip_skip", "lora", "vae", "embedding", "padding_mask_crop")


def _size(text: str) -> tuple[int, int]:
    parts = text.lower().replace(",", "x").split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not HEIGHTxWIDTH, e.g. 1024x1024")
    return int(parts[0]), int(parts[1])


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m sdx.sample", description=__doc__.split("\n\n")[0])
    for title, add in GROUPS:
        add(p.add_argument_group(title))
    for method in METHODS:
        method.add_flags(p.add_argument_group(method.title))
    return p


def _model_flags(g) -> None:
    g.add_argument("--model",
                   help="sdx folder, diffusers folder, single-file checkpoint, hub id, default model (default, "
                        "default-edit) or random-weight demo model (tiny, tiny_xl); without it: default, or "
                        "default-edit with --image (without --mask)")
    g.add_argument("--config", metavar="FOLDER",
                   help="single-file --model: a diffusers-layout folder whose config.json files (and tokenizers) "
                        "describe it, instead of the built-in preset its keys point to")
    g.add_argument("--preset", metavar="NAME",
                   help="single-file --model: read it as this preset, e.g. sd21 for an SD 2.x-base epsilon file")
    g.add_argument("--lora", metavar="FILE[:SCALE]", action="append", default=[],
                   help="merge a LoRA (kohya or diffusers/PEFT .safetensors, or hub org/name[/FILE]) into --model "
                        "at SCALE (default 1.0); repeatable")
    g.add_argument("--embedding", metavar="FILE[:TOKEN]", action="append", default=[],
                   help="add a textual inversion embedding (diffusers learned_embeds, A1111 or SDXL .safetensors, or a hub org/name/FILE) as the word TOKEN (default: its own token, else the file's name); repeatable")
    g.add_argument("--vae", metavar="MODEL",
                   help="use this VAE (diffusers VAE folder, pipeline folder, sdx folder, single VAE file, or hub id) "
                        "instead of the model's; also for --refiner")
    g.add_argument("--unet", metavar="MODEL",
                   help="use this UNet instead of the model's (LoRAs merge into it): a diffusers UNet folder (e.g. "
                        "latent-consistency/lcm-sdxl), a pipeline folder, an sdx folder, a weights file in diffusers or "
                        "original keys (e.g. ByteDance/SDXL-Lightning/sdxl_lightning_4step_unet.safetensors), or a hub id")


def _prompts_flags(g) -> None:
    g.add_argument("--prompt", nargs="+", help="one or more prompts")
    g.add_argument("--prompts-file", metavar="FILE",
                   help="many generations in one process: a prompt per line, or JSON objects with a \"prompt\" and "
                        "per-line settings (see pipelines/prompts_file.py); images go to --output/NNNNN.png and a run "
                        "started again skips those already written")
    g.add_argument("--prompt-2", nargs="+", help="SDXL: prompts for the second text encoder (default: --prompt)")
    g.add_argument("--negative-prompt", nargs="+", help="one, or one per prompt")
    g.add_argument("--negative-prompt-2", nargs="+", help="SDXL: for the second text encoder")
    g.add_argument("--long-prompt", choices=("truncate", "chunk"), default="truncate",
                   help="prompts over 77 tokens: cut (diffusers) or encode in 75-token chunks")
    g.add_argument("--clip-skip", type=int, help="use the text encoder output this many layers earlier")
    sampling_cli.add_prompt_flags(g)  # --prompt-syntax


def _sampling_flags(g) -> None:
    g.add_argument("--steps", type=int, default=30, help="denoising steps (diffusers' num_inference_steps)")
    g.add_argument("--guidance-scale", type=float, default=None,
                   help="default: the model's own where it names one (`default`, `default-edit`: 2.0), else 7.5 (5.0 for SDXL)")
    g.add_argument("--guidance-rescale", type=float, default=0.0,
                   help="rescale of the guided prediction (Lin et al. 2023; zero-SNR and v-prediction models)")
    g.add_argument("--height", type=int, help="pixels (default: the model's training size, or the image's)")
    g.add_argument("--width", type=int, help="pixels (default: the model's training size, or the image's)")
    g.add_argument("--num-images", type=int, default=1, help="images per prompt")
    g.add_argument("--seed", type=int, default=0,
                   help="image j of a run is the image seed + j gives alone (A1111's seeds), at any batch size")
    sampling_cli.add_flags(g)  # --scheduler, --timestep-spacing, --eta
    g.add_argument("--latents", help="initial noise, .npy (images, channels, height/f, width/f) float32 as diffusers' latents=")


def _image_flags(g) -> None:
    g.add_argument("--image", help="input image: img2img, or the image an InstructPix2Pix model edits")
    g.add_argument("--strength", type=float, default=None,
                   help="img2img and inpainting: how much to change (default 0.8, SDXL 0.3; inpainting 1.0, SDXL 0.9999)")
    g.add_argument("--mask", metavar="FILE",
                   help="inpainting: white repaints, black keeps (resized to the image, greyscale, binarised at 0.5)")
    g.add_argument("--mask-blur", type=float, default=0.0, metavar="PX",
                   help="blur the mask by this Gaussian radius first (diffusers' mask_processor.blur)")
    g.add_argument("--apply-overlay", action="store_true",
                   help="inpainting: paste --image's pixels back where the mask keeps them, through --mask-blur's soft "
                        "edge (diffusers' apply_overlay; what A1111 does): the kept region stays exactly the input, "
                        "where the VAE's decode would shift it (always so with --padding-mask-crop)")
    g.add_argument("--padding-mask-crop", type=int, metavar="PX",
                   help="inpaint only a crop around the mask, grown by PX pixels, at the generation size (--height/"
                        "--width, default the model's), and paste it back into the image (diffusers' padding_mask_crop)")
    g.add_argument("--image-guidance-scale", type=float, default=1.5, help="InstructPix2Pix")


def _sdxl_flags(g) -> None:
    g.add_argument("--refiner", help="SDXL refiner model, run after the base (ensemble of experts)")
    g.add_argument("--high-noise-frac", type=float, default=0.8, help="where the base hands over to the refiner")
    g.add_argument("--original-size", type=_size, help="SDXL micro-conditioning, HxW")
    g.add_argument("--target-size", type=_size, help="SDXL micro-conditioning, HxW")
    g.add_argument("--crops-top-left", type=_size, default=(0, 0), help="SDXL micro-conditioning, TOPxLEFT")
    g.add_argument("--aesthetic-score", type=float, default=6.0, help="SDXL refiner")
    g.add_argument("--negative-aesthetic-score", type=float, default=2.5, help="SDXL refiner")


def _device_flags(g) -> None:
    from sdx.attention import BACKENDS

    g.add_argument("--batch-size", type=int, help="images per compiled call (default: as many as fit in free memory)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the text encoders' and the UNet's")
    g.add_argument("--vae-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the VAE's (bfloat16: diffusers' choice in a bfloat16 pipeline; half the VAE's weights)")
    g.add_argument("--vae-tiling", action="store_true",
                   help="decode (and encode) images larger than the VAE's tile, its sample_size (SD 1.5: 512 px, SDXL: "
                        "1024), in overlapping tiles blended together, as diffusers' vae.enable_tiling(): the VAE's "
                        "working memory is one tile's at any image size")
    g.add_argument("--attention", choices=BACKENDS,
                   help="attention backend (default: chunked on a CPU, where it is faster from 1,024 tokens on; cudnn "
                        "in bfloat16 on an NVIDIA GPU from Ampere on; xla elsewhere)")
    g.add_argument("--fsdp", type=int, default=1, help="devices that share each parameter (default: replicate)")


def _output_flags(g) -> None:
    g.add_argument("--output", default="outputs", help="a .png file, or a folder for several images")
    g.add_argument("--grid", metavar="FILE.png",
                   help="also write all images as one grid PNG (a row per prompt with --num-images, else about square, "
                        "wider than tall)")
    g.add_argument("--overwrite", action="store_true", help="replace existing files")
    g.add_argument("--cache", help="where converted models and compiled programs are kept (default ~/.cache/sdx)")
    g.add_argument("--no-compilation-cache", action="store_true", help="do not keep compiled programs across runs")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


GROUPS = (("the model", _model_flags), ("prompts", _prompts_flags), ("sampling", _sampling_flags), ("img2img, inpainting and editing", _image_flags), ("SDXL: the refiner and micro-conditioning", _sdxl_flags), ("precision, memory and devices", _device_flags), ("output and cache", _output_flags))


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


def check_flags(args: argparse.Namespace) -> tuple:
    """Refuse bad values of the flags that say what to generate; returns the --latents array, the --image
    and --mask pictures and {method title: what its check read}, as read here."""
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
    _check_image_flags(args)
    picture = read_image(args.image) if args.image else None
    mask = read_mask(args.mask) if args.mask else None
    if args.padding_mask_crop is not None and not np.asarray(mask.convert("L")).any():
        raise SdxError(f"--padding-mask-crop: the mask {args.mask} is black everywhere (nothing to repaint)")
    if args.config and not Path(args.config).is_dir():
        raise SdxError(f"--config {args.config}: not a folder")
    latents = load_latents(args.latents) if args.latents else None
    sampling_cli.check(args)
    return latents, picture, mask, read_flags(args)


def read_flags(args: argparse.Namespace, given: dict | None = None) -> dict:
    """{method title: what its `check` of `args` read}, or what `given` holds for it instead (pictures a caller
    decoded itself, as the server does)."""
    given = given or {}
    return {method.title: given[method.title] if method.title in given else method.check(args) for method in METHODS}


def _check_image_flags(args: argparse.Namespace) -> None:
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


@dataclasses.dataclass
class Job:
    """One generation: the flags with its own settings applied, where its images go, what the checks read
    (`read`: each method's, by its title; None for a prompts-file line, whose pictures are read when its turn
    comes). done: every image is already written (a --prompts-file run started again)."""

    args: argparse.Namespace
    paths: list[Path]
    grid: Path | None = None
    latents: np.ndarray | None = None
    picture: PIL.Image.Image | None = None
    mask: PIL.Image.Image | None = None
    read: dict[str, Any] | None = None
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
    latents, picture, mask, read = check_flags(args)
    paths = output_paths(args.output, len(args.prompt) * args.num_images, args.seed, args.overwrite)
    grid_path = output_paths(args.grid, 1, args.seed, args.overwrite)[0] if args.grid else None
    io.check_writable(paths[0].parent, "--output")
    if grid_path is not None:
        io.check_writable(grid_path.parent, "--grid")
    return [Job(args, paths, grid_path, latents, picture, mask, read)]


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


def environment(args: argparse.Namespace):
    """(the cache folder, the mesh, the `convert.sources.ModelOptions`) of the model and device flags, with JAX's
    compilation cache on in the cache unless --no-compilation-cache: what the command (and the server) set up
    before loading."""
    from convert.library import default_cache_dir
    from convert.sources import ModelOptions
    from pipelines.sampler import enable_compilation_cache
    from sdx import mesh as meshlib

    cache = Path(args.cache) if args.cache else default_cache_dir()
    if not args.no_compilation_cache:
        enable_compilation_cache(cache / "jax")
    meshlib.initialize()
    options = ModelOptions.from_args(config=args.config, preset=args.preset, lora=args.lora, vae=args.vae,
                                     embedding=args.embedding, unet=args.unet)
    return cache, meshlib.make_mesh(args.fsdp), options


def run(args: argparse.Namespace) -> list[Path]:
    from convert import default_models
    from pipelines.pipeline import NonFiniteImages

    jobs = check_args(args)
    log = (lambda msg: None) if args.quiet else _log
    todo = [job for job in jobs if not job.done]
    if len(todo) < len(jobs):
        log(f"{len(jobs) - len(todo)} of {len(jobs)} prompts are already written; generating the other {len(todo)}")
    if not todo:
        return []
    cache, mesh, options = environment(args)
    # inpainting and ControlNet or T2I-Adapter img2img take the text-to-image model
    edits = any(job.args.image and not job.args.mask and not job.args.controlnet and not job.args.t2i_adapter
                for job in jobs)
    args.model = args.model or ("default-edit" if edits else "default")
    # the first request's programs are read while the weights load (a refiner's run is two other requests)
    first = None if args.refiner else lambda pipe: job_request(todo[0], pipe)[0]
    pipes = _load(args, resolve_model(args.model, dtype=args.dtype, cache=cache, log=log, options=options), mesh, cache,
                  log, first)
    sizes = set()
    for job in todo:  # every request is checked against the model before the progress bar opens
        job.args.model = args.model
        request = job_request(job, pipes[0])[0]
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
    from convert.sources import ModelOptions
    from pipelines.pipeline import Pipeline
    from sdx.attention import default_backend

    attention = args.attention or default_backend(args.dtype)
    load = lambda folder, name, **kw: Pipeline.load(folder, dtype=args.dtype, vae_dtype=args.vae_dtype, scheduler=args.scheduler,
                                                    attention=attention, mesh=mesh, name=name, **kw)
    models = {key: value for method in METHODS for key, value in method.load(args, cache, log).items()}
    pipe = sampling_cli.configured(args, load(folder, args.model, cache=cache, log=log, first=first, **models))
    if not args.refiner:
        return [pipe]
    if not pipe.family.xl or pipe.family.pix2pix:
        raise SdxError("--refiner follows an SDXL base model; this model is not one")
    ref_folder = resolve_model(args.refiner, dtype=args.dtype, cache=cache, log=log, options=ModelOptions(vae=args.vae))
    return [pipe, sampling_cli.configured(args, load(ref_folder, args.refiner))]


def job_request(job: Job, pipe):
    """The job's `Request`, checked against the model, and its `pipelines.masks.Crop` with
    --padding-mask-crop, else None (--image and --mask are read again for a prompts-file line)."""
    from pipelines.masks import Crop, fit_mask, read_mask
    from pipelines.request import Request

    a = job.args
    picture = job.picture if job.picture is not None or not a.image else read_image(a.image)
    mask_picture = job.mask if job.mask is not None or not a.mask else read_mask(a.mask)
    read = job.read if job.read is not None else read_flags(a)
    size = (a.height, a.width) if a.height and a.width else None
    blur, crop = a.mask_blur, None
    if a.padding_mask_crop is not None:  # the crop around the mask, at the asked or the model's size
        size = (a.height or pipe.default_size, a.width or pipe.default_size)
        crop = Crop.around(picture, mask_picture, blur, size, a.padding_mask_crop)
        picture, mask_picture, blur = crop.cut(picture, size), crop.cut(crop.mask, size), 0.0
    image = fit_image(picture, a.image, size, pipe.multiple) if picture is not None else None
    mask = fit_mask(mask_picture, image.shape[1:3], blur) if mask_picture is not None else None
    size = image.shape[1:3] if image is not None else _text_to_image_size(a, pipe, read)
    at = Context(pipe, tuple(size), image is not None, mask is not None, crop)
    fields = {"conditioning": [], "interventions": []}
    for method in METHODS:
        for key, value in method.request(a, read[method.title], at).items():
            fields[key] = fields[key] + value if key in ("conditioning", "interventions") else value
    request = pipe.complete(Request(  # what the flags leave open: the model's defaults, as Pipeline.complete says
        prompts=a.prompt, prompts_2=a.prompt_2, negative_prompts=a.negative_prompt,
        negative_prompts_2=a.negative_prompt_2, height=size[0], width=size[1], steps=a.steps,
        num_images_per_prompt=a.num_images, batch_size=a.batch_size, seed=a.seed,
        guidance_scale=a.guidance_scale, image_guidance_scale=a.image_guidance_scale,
        guidance_rescale=a.guidance_rescale, strength=a.strength, image=image, mask=mask, latents=job.latents,
        original_size=a.original_size, target_size=a.target_size, crops_coords_top_left=a.crops_top_left,
        aesthetic_score=a.aesthetic_score, negative_aesthetic_score=a.negative_aesthetic_score,
        clip_skip=a.clip_skip, long_prompt=a.long_prompt, prompt_syntax=a.prompt_syntax, vae_tiling=a.vae_tiling,
        **fields,
    ))
    pipe.validate(request)
    return request, crop


def _text_to_image_size(a: argparse.Namespace, pipe, read: dict) -> tuple[int, int]:
    """Text-to-image's size: the flags, else the first control or adapter picture's (as diffusers), rounded
    down to what the model and its adapters take, else the model's."""
    first = next((p for method in METHODS for p in method.pictures(read[method.title])), None)
    step = max([pipe.multiple, *(adapter.config.downscale_factor for adapter in pipe.conditioning_models("t2i_adapter"))])
    return (a.height or (first.height // step * step if first else pipe.default_size),
            a.width or (first.width // step * step if first else pipe.default_size))


def _generate(job: Job, pipes: list, bar, log) -> list[Path]:
    """Generate the job's images and write them (and its grid); returns the paths written. Images that came
    out non-finite are not written: after writing the others, their error is raised."""
    from pipelines.pipeline import NonFiniteImages, refine, to_uint8
    from pipelines.request import per_prompt

    a, pipe = job.args, pipes[0]
    request, crop = job_request(job, pipe)
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
            "seed": a.seed + i, "image_index": i, "steps": a.steps, "scheduler": scheduler_name,
            "guidance_scale": request.guidance_scale, "guidance_rescale": request.guidance_rescale,
            "size": f"{pixels.shape[2]}x{pixels.shape[1]}", "model": a.model, "dtype": a.dtype,
            "vae_dtype": a.vae_dtype,
        }
        if a.vae_tiling:
            params["vae_tiling"] = True
        params |= {key: getattr(a, key) for key in RECORDED if getattr(a, key, None)}
        if a.image and pipe.family.pix2pix:
            params["image_guidance_scale"] = request.image_guidance_scale
        elif a.image:
            params["strength"] = request.strength
        for method in METHODS:
            params |= method.png(a, request)
        save_png(path, pixels[i], params)
        log(f"wrote {path}")
        written.append(path)
    for method in METHODS:
        written += method.write(a, pipe, request, generated, pixels, job.paths, log)
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
