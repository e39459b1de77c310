"""Sampling speed and memory: sdx against diffusers (PyTorch) on the same weights, in one run.

    python benchmarks/sample.py --preset sd15 --size 512 --steps 20 --batch 1 [--dtype bfloat16]

A random-weight diffusers folder is built for the preset (no download: the architectures come from
`sdx.presets`), converted to the sdx layout, and each framework then runs in a subprocess of its own
(so peak memory is its own): one warm-up generation (for sdx: the ahead-of-time compile), then
`--repeats` timed generations. Printed: the first call's extra seconds (sdx: the ahead-of-time compile), seconds per image, images per second, peak
memory, and sdx's ratio to diffusers. diffusers runs when torch and diffusers are installed.
Peak memory is the accelerator's peak allocation on GPU/TPU and the process's peak RSS on the CPU.

Achieved FLOP/s: the job's floating-point operations, XLA's count of the model math (benchmarks/flops.py;
the same for both frameworks), over each one's seconds, next to the machine's peak
as each framework reaches it in its own process: the best of 5 float32 (or bfloat16) products of random
2048×2048 matrices on a CPU, 8192×8192 on an accelerator (sdx's layers' product, `sdx.products`, for sdx;
torch.matmul for diffusers).

`--profile` adds one generation under each framework's profiler and prints where its accelerator time went
(benchmarks/kernels.py).

`--end-to-end N` measures what a user waits for instead: the wall time of a fresh process making one
image, `python -m sdx.sample` (its compilation cache warmed by one untimed run first) against a
diffusers script doing the same job (load, generate, write the PNG), alternated N times; the medians
are printed. Where the two models' files do not both fit in the OS page cache, each run reads its weights
from the disk again; `--pairs` also times a second run of each right after its first, its files cached.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import kernels  # noqa: E402


def build_diffusers_folder(preset_name: str, folder: Path, dtype: str = "float32") -> Path:
    """Random-weight diffusers pipeline of `preset_name`, saved in `dtype` with save_pretrained (once).
    The weights are drawn on a CUDA GPU when there is one (SDXL's 3.5 billion on a CPU take minutes)."""
    if (folder / "model_index.json").exists():
        return folder
    import diffusers
    import torch
    import transformers

    from sdx import presets
    from sdx.tokenizer import write_builtin_folder

    torch.manual_seed(0)
    preset = presets.get(preset_name)
    public = lambda cfg: {k: v for k, v in cfg.items() if not k.startswith("_")}
    draw_on = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    saved = lambda model: model.to("cpu", getattr(torch, dtype))
    with draw_on:
        parts = {
            "unet": saved(diffusers.UNet2DConditionModel(**public(preset.configs["unet"]))),
            "vae": saved(diffusers.AutoencoderKL(**public(preset.configs["vae"]))),
        }
    parts["scheduler"] = getattr(diffusers, preset.configs["scheduler"]["_class_name"]).from_config(preset.configs["scheduler"])
    for te, tok in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
        if te in preset.configs:
            cfg = {k: v for k, v in preset.configs[te].items() if k not in ("architectures", "model_type")}
            with draw_on:
                parts[te] = saved(getattr(transformers, preset.configs[te]["architectures"][0])(transformers.CLIPTextConfig(**cfg)))
            tok_dir = write_builtin_folder(folder / "_tok" / tok, pad_token=preset.tokenizers[tok]["pad_token"])
            parts[tok] = transformers.CLIPTokenizer.from_pretrained(tok_dir)
        else:
            parts[te] = parts[tok] = None
    cls = getattr(diffusers, preset.pipeline_class)
    extra = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False, "image_encoder": None}
    import inspect

    wanted = set(inspect.signature(cls.__init__).parameters)
    kwargs = {k: v for k, v in {**parts, **extra, **preset.extra}.items() if k in wanted}
    cls(**kwargs).save_pretrained(folder)
    return folder


def job_folder(args) -> Path:
    """The job's random-weight diffusers folder in WORK (built once per preset and dtype)."""
    name = f"diffusers-{args.preset}" + ("" if args.dtype == "float32" else f"-{args.dtype}")
    return build_diffusers_folder(args.preset, Path(args.work) / name, args.dtype)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_workers(script: str, frameworks, argv, *, extra=(), env=None) -> list[dict] | None:
    """`script --worker FW *extra *argv` for each framework, each in a subprocess of its own; the JSON of
    each one's last output line, or None once one fails (its error printed)."""
    results = []
    for fw in frameworks:
        cmd = [sys.executable, script, "--worker", fw, *extra, *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
        if proc.returncode:
            print(f"{fw} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            return None
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{fw}: {json.dumps(results[-1])}", file=sys.stderr, flush=True)  # kept if a later worker is stopped
    return results


def count_flops(args) -> float:
    """The job's floating-point operations (benchmarks/flops.py), counted in a CPU-only process: on a GPU,
    JAX gives no cost analysis of a lowered program."""
    command = [sys.executable, str(REPO / "benchmarks" / "flops.py"), args.preset, str(args.size), str(args.steps),
               str(args.batch), *(["--no-guidance"] if args.guidance <= 1 else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return float(done.stdout.split()[-1])


def machine() -> str:
    """The date and the machine, for a results header."""
    return f"{time.strftime('%Y-%m-%d')} {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"


def matmul_size(accelerator: bool) -> int:
    """The matrix side for `matmul_peak`: large enough to fill the device (2048 saturates a CPU; a GPU
    needs about 8192)."""
    return 8192 if accelerator else 2048


def matmul_peak(matmul, operand, n: int, sync) -> float:
    """FLOP/s of the best of 5 products of two random n×n matrices `operand(n, seed)` (after one
    warm-up); sync(product) waits for one."""
    a, b = operand(n, 0), operand(n, 1)
    sync(matmul(a, b))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        sync(matmul(a, b))
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def sdx_job(args):
    """(the sdx pipeline, the request) of the job: `args.folder` converted once into WORK/sdx, the compilation
    cache in CACHE/jax where `--cache` keeps it (benchmarks/options.py reads the programs this stores)."""
    import numpy as np

    from convert.library import ensure_sdx_folder
    from pipelines import sampler
    from pipelines.pipeline import Pipeline
    from pipelines.request import Request

    sampler.enable_compilation_cache(args.cache and Path(args.cache) / "jax")
    folder = ensure_sdx_folder(str(args.folder), dtype=args.dtype, cache_dir=Path(args.work) / "sdx")
    pipe = Pipeline.load(folder, dtype=args.dtype, vae_dtype=args.vae_dtype, attention=args.attention)
    noise = np.random.default_rng(0).standard_normal((args.batch, pipe.channels, args.size // pipe.factor, args.size // pipe.factor))
    request = Request(prompts=[PROMPT] * args.batch, height=args.size, width=args.size,
                      steps=args.steps, latents=noise.astype(np.float32), guidance_scale=args.guidance)
    return pipe, request


def run_sdx(args) -> dict:
    import jax

    from pipelines import sampler
    from sdx import products

    if args.blank_rows == "always":
        sampler.BLANK_ROWS_PLATFORMS = (jax.default_backend(),)
    pipe, request = sdx_job(args)
    t0 = time.perf_counter()
    pipe(request)
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        pipe(request)
        times.append(time.perf_counter() - t0)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    peak_bytes = stats.get("peak_bytes_in_use") or peak_rss_bytes()  # before the matmul's buffers
    profile = args.profile and kernels.jax_profile(lambda: pipe(request), Path(tempfile.mkdtemp(dir=args.work)))
    operand = lambda n, seed: jax.random.normal(jax.random.key(seed), (n, n), args.dtype)
    return {
        "framework": "sdx", "device": f"{device.platform}:{device.device_kind}", "compile_s": first - min(times),
        "seconds": min(times), "peak_bytes": peak_bytes, "memory_kind": "device peak" if stats else "process peak RSS",
        "matmul_peak": matmul_peak(jax.jit(lambda a, b: products.dot_general(a, b, (((1,), (0,)), ((), ())))),
                                   operand, matmul_size(device.platform != "cpu"), lambda x: x.block_until_ready()),
        "profile": profile,
    }


def run_diffusers(args) -> dict:
    import diffusers
    import numpy as np
    import torch

    cuda = torch.cuda.is_available()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    pipe = diffusers.DiffusionPipeline.from_pretrained(args.folder, torch_dtype=dtype).to("cuda" if cuda else "cpu")
    pipe.set_progress_bar_config(disable=True)
    f = pipe.vae_scale_factor
    noise = np.random.default_rng(0).standard_normal((args.batch, pipe.vae.config.latent_channels, args.size // f, args.size // f))
    latents = torch.tensor(noise, dtype=dtype, device=pipe.device)
    call = lambda: pipe([PROMPT] * args.batch, height=args.size, width=args.size,
                        num_inference_steps=args.steps, latents=latents, guidance_scale=args.guidance, output_type="np")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.inference_mode():
        t0 = time.perf_counter()
        call()
        sync()
        first = time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            call()
            sync()
            times.append(time.perf_counter() - t0)
    peak_bytes = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()
    operand = lambda n, seed: torch.randn((n, n), dtype=dtype, device=pipe.device,
                                          generator=torch.Generator(pipe.device).manual_seed(seed))
    with torch.inference_mode():
        peak = matmul_peak(torch.matmul, operand, matmul_size(cuda), lambda _: sync())
        profile = args.profile and cuda and kernels.torch_profile(call, sync)
    return {
        "framework": "diffusers", "device": torch.cuda.get_device_name() if cuda else "cpu", "compile_s": first - min(times),
        "seconds": min(times), "peak_bytes": peak_bytes, "memory_kind": "device peak" if cuda else "process peak RSS",
        "matmul_peak": peak, "profile": profile,
    }


def end_to_end_diffusers(args) -> dict:
    """The diffusers side of --end-to-end: what a short user script does, timed by the caller."""
    from PIL import Image

    import diffusers
    import numpy as np
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = diffusers.DiffusionPipeline.from_pretrained(args.folder, torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    latents = torch.tensor(np.load(Path(args.work) / "noise.npy"), dtype=dtype, device=device)
    image = pipe(PROMPT, height=args.size, width=args.size, num_inference_steps=args.steps, latents=latents,
                 guidance_scale=args.guidance, output_type="np").images[0]
    Image.fromarray((image * 255).round().astype(np.uint8)).save(Path(args.work) / "diffusers.png")
    return {}


def end_to_end(args, folder: Path) -> None:
    import statistics

    import numpy as np

    from convert.library import ensure_sdx_folder
    from sdx import presets

    work = Path(args.work)
    sdx_folder = ensure_sdx_folder(str(folder), dtype=args.dtype, cache_dir=work / "sdx")
    f = 2 ** (len(presets.get(args.preset).configs["vae"]["block_out_channels"]) - 1)
    shape = (1, presets.get(args.preset).configs["vae"].get("latent_channels", 4), args.size // f, args.size // f)
    np.save(work / "noise.npy", np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    sdx = [sys.executable, "-m", "sdx.sample", "--model", str(sdx_folder), "--prompt", PROMPT, "--steps", str(args.steps),
           "--height", str(args.size), "--width", str(args.size), "--guidance-scale", str(args.guidance), "--dtype", args.dtype,
           "--vae-dtype", args.vae_dtype,
           "--attention", args.attention, "--latents", str(work / "noise.npy"), "--output", str(work / "sdx.png"),
           "--overwrite", "--quiet",
           "--cache", args.cache or str(work / "cache")]
    reference = [sys.executable, __file__, "--worker", "diffusers-e2e", "--folder", str(folder), *sys.argv[1:]]
    subprocess.run(sdx, cwd=REPO, check=True)  # fills the compilation cache
    runs = 2 if args.pairs else 1
    times = {(name, k): [] for name in ("sdx", "diffusers") for k in range(runs)}
    for _ in range(args.end_to_end):
        for name, command in (("sdx", sdx), ("diffusers", reference)):
            for k in range(runs):
                t0 = time.perf_counter()
                subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
                times[name, k].append(time.perf_counter() - t0)
    med = {key: statistics.median(v) for key, v in times.items()}
    print(f"# {machine()}; preset {args.preset}, {args.size}x{args.size}, {args.steps} steps, 1 image, {args.dtype}, "
          f"end to end (fresh process each, alternated {args.end_to_end}x{' in pairs' if args.pairs else ''}, median)")
    for k, after in enumerate(("the other framework's run", "its own run")[:runs]):
        label = f" (right after {after})" if args.pairs else ""
        for name in ("sdx", "diffusers"):
            print(f"{name}{label}: median {med[name, k]:.2f} s ({', '.join(f'{v:.2f}' for v in times[name, k])})")
        print(f"sdx / diffusers{label}: {med['sdx', k] / med['diffusers', k]:.2f}x")


PROMPT = "a photograph of an astronaut riding a horse"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="sd15", help="an sdx preset (sd15, sd21, sdxl_base, tiny, tiny_xl, ...)")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--guidance", type=float, default=7.0,
                   help="guidance scale for both frameworks; 1 or less runs no classifier-free guidance (one UNet "
                        "call a step on the batch, as few-step models such as SDXL-Lightning and Turbo are run)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--vae-dtype", choices=("float32", "bfloat16"),
                   help="sdx's VAE (default: --dtype, as diffusers' pipeline runs its VAE; before 2026-11-26's fifth round "
                        "sdx's was float32)")
    p.add_argument("--attention", default="xla", help="sdx attention backend (xla, cudnn, chunked)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "sdx-bench"), help="where models are built")
    p.add_argument("--no-reference", action="store_true", help="skip diffusers")
    p.add_argument("--cache", help="keep sdx's compiled programs here, as `python -m sdx.sample --cache` does (default: "
                                   "none, so the first call compiles; --end-to-end: WORK/cache); an --end-to-end "
                                   "run given the same folder reads them, and the other way round")
    p.add_argument("--end-to-end", type=int, metavar="N", help="time N alternated fresh processes of each instead")
    p.add_argument("--pairs", action="store_true",
                   help="--end-to-end: run each framework twice in a row per round, the second run finding its weight "
                        "files in the OS page cache (two SDXL float32 models do not both fit in 24 GiB)")
    p.add_argument("--blank-rows", choices=("auto", "always"), default="auto",
                   help="always: SDXL's zero negative branch skips its cross-attentions on this backend too (auto: on "
                        "the backends in pipelines.sampler.BLANK_ROWS_PLATFORMS); steady state only")
    p.add_argument("--profile", action="store_true",
                   help="steady state: one more generation under each framework's profiler, its accelerator time "
                        "summed by kernel and by kind (benchmarks/kernels.py; diffusers' on a CUDA GPU only)")
    p.add_argument("--worker", choices=("sdx", "diffusers", "diffusers-e2e"), help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.blank_rows == "always" and args.end_to_end:
        p.error("--blank-rows always is for the steady state: an --end-to-end run is `python -m sdx.sample`'s own")
    if args.profile and args.end_to_end:
        p.error("--profile is for the steady state: an --end-to-end run times whole processes")
    args.vae_dtype = args.vae_dtype or args.dtype
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        workers = {"sdx": run_sdx, "diffusers": run_diffusers, "diffusers-e2e": end_to_end_diffusers}
        print(json.dumps(workers[args.worker](args)))
        return 0
    folder = job_folder(args)
    if args.end_to_end:
        end_to_end(args, folder)
        return 0
    frameworks = ["sdx"] + ([] if args.no_reference else ["diffusers"])
    results = run_workers(__file__, frameworks, argv or sys.argv[1:], extra=("--folder", str(folder)))
    if results is None:
        return 1
    print(f"# {machine()}; preset {args.preset}, {args.size}x{args.size}, {args.steps} steps, batch {args.batch}, "
          f"guidance {args.guidance:g}{'' if args.guidance > 1 else ' (none)'}, {args.dtype} (sdx's VAE {args.vae_dtype})")
    flops = count_flops(args)  # the same math for both
    print(f"# {flops / 1e12:.3f} TFLOP per generation (XLA's count of the model math, benchmarks/flops.py)")
    print("| framework | device | first call − steady (s) | s/image | images/s | peak memory (GiB) | GFLOP/s achieved | "
          "matmul peak GFLOP/s | of peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        per_image = r["seconds"] / args.batch
        achieved = flops / r["seconds"]
        print(f"| {r['framework']} | {r['device']} | {r['compile_s']:.1f} | {per_image:.3f} | {1 / per_image:.3f} | "
              f"{r['peak_bytes'] / 2**30:.2f} ({r['memory_kind']}) | {achieved / 1e9:.1f} | "
              f"{r['matmul_peak'] / 1e9:.1f} | {achieved / r['matmul_peak']:.0%} |")
    if len(results) == 2:
        s, d = results
        print(f"sdx / diffusers: time {s['seconds'] / d['seconds']:.2f}x, peak memory {s['peak_bytes'] / d['peak_bytes']:.2f}x "
              f"(below 1 means sdx is faster / smaller)")
    for r in results:
        if r["profile"]:
            print(f"\n## {r['framework']}: one generation's kernels\n{r['profile']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
