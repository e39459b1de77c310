"""Mutation check of the glue between components: does the test suite see a constant or formula in
`pipelines/` (and the sampler) moved by half a percent?

    python benchmarks/mutations.py [--only NAME ...] [--list] [--keep]

Each mutation below multiplies one quantity of the code that no component test covers (the guidance
combination, guidance_rescale, init_noise_sigma, img2img's noising and posterior latents, inpainting's blend and
latent mask, SDXL's time ids and aesthetic score, the refiner's hand-over, CosXL's image latents, InstructPix2Pix's
image guidance, the ControlNet, T2I-Adapter and IP-Adapter scales, the decode's [-1, 1] -> [0, 1]) by 1.005, in a
copy of the repository, and runs the whole-pipeline tests named beside it there. A mutation is caught when they
fail. The working tree is never touched: the files git lists (tracked, and untracked ones it does not ignore)
are copied once into a temporary folder, and each mutation runs in a fresh copy of that snapshot, with
PYTHONPATH pointing at it (so the copy's packages, not the editable install's, are imported, in the test
processes and in every process they start; checked before anything runs). The named tests first run on the
unmutated snapshot (one pytest run): a mutation whose test already fails there is reported as such, not as
caught.

Printed: one row per mutation, what it changed, the test that ran, caught / MISSED, the first failure line
pytest reported (which bar the mutant crossed) and the seconds. Exit status 1 if any mutation was missed.
It runs tests, so it is slow (about a minute per mutation on a 2-core CPU): run it in the background.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FACTOR = "1.005"


@dataclasses.dataclass(frozen=True)
class Mutation:
    """`old` (found exactly once in `path`) replaced by `new`; `tests`: pytest node ids that should fail."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


P = "tests/test_pipelines.py::"
MUTATIONS = (
    Mutation("classifier-free guidance scale", "pipelines/guidance.py",
             'uncond + scales.of("text", cond) * (cond - uncond)',
             f'uncond + scales.of("text", cond) * {FACTOR} * (cond - uncond)',
             (P + "test_sd15_text_to_image",)),
    Mutation("guidance_rescale phi", "pipelines/guidance.py",
             "phi * (guided * factor) + (1.0 - phi) * guided",
             f"phi * {FACTOR} * (guided * factor) + (1.0 - phi * {FACTOR}) * guided",
             (P + "test_sd21_v_prediction_with_guidance_rescale_and_scheduler_override",)),
    Mutation("init_noise_sigma", "pipelines/sampler.py",
             "x = inputs.noise * state.init_noise_sigma",
             f"x = inputs.noise * (state.init_noise_sigma * {FACTOR})",
             (P + "test_sd15_text_to_image",)),
    Mutation("img2img noising: the noise added", "pipelines/sampler.py",
             "x = plan.scheduler.add_noise(state, image_latents, inputs.noise)",
             f"x = plan.scheduler.add_noise(state, image_latents, inputs.noise * {FACTOR})",
             (P + "test_sd15_img2img",)),
    Mutation("img2img: the image's posterior latents", "pipelines/sampler.py",
             "return config.to_latents(posterior.mean + posterior.std * eps)",
             f"return config.to_latents(posterior.mean * {FACTOR} + posterior.std * eps)",
             (P + "test_sd15_img2img",)),
    Mutation("inpainting blend: the known latents", "pipelines/sampler.py",
             "plan.scheduler.add_noise(state, known.latents, known.noise)",
             f"plan.scheduler.add_noise(state, known.latents * {FACTOR}, known.noise)",
             ("tests/test_inpaint.py::test_sd_ordinary_model_blends_the_known_region[1.0-0]",)),
    Mutation("inpainting: the latent-size mask", "pipelines/masks.py",
             "return mask[:, ::factor, ::factor]",
             f"return mask[:, ::factor, ::factor] * {FACTOR}",
             ("tests/test_inpaint.py::test_sd_inpainting_model[1.0]",)),
    Mutation("SDXL time ids: the target size", "pipelines/request.py",
             "return [*original, *crops, *target]",
             f"return [*original, *crops, *(v * {FACTOR} for v in target)]",
             (P + "test_sdxl_text_to_image_two_prompts_zero_negative_clip_skip",)),
    Mutation("refiner time ids: the aesthetic score", "pipelines/request.py",
             "r.negative_aesthetic_score if negative else r.aesthetic_score]",
             f"r.negative_aesthetic_score if negative else r.aesthetic_score * {FACTOR}]",
             (P + "test_sdxl_refiner_img2img_with_aesthetic_scores",)),
    Mutation("refiner hand-over: the base's latents", "pipelines/pipeline.py",
             "init_latents=latents.transpose(0, 3, 1, 2),",
             f"init_latents=latents.transpose(0, 3, 1, 2) * {FACTOR},",
             (P + "test_sdxl_base_then_refiner_with_clip_skip",)),
    Mutation("CosXL: the image latents' scaling factor", "pipelines/sampler.py",
             'extra = extra * models["vae"].config.scaling_factor',
             f'extra = extra * (models["vae"].config.scaling_factor * {FACTOR})',
             (P + "test_instruct_pix2pix[cosxl_edit]",)),
    Mutation("InstructPix2Pix: the image guidance", "pipelines/guidance.py",
             'scales.of("image", cond) * (image - uncond)',
             f'scales.of("image", cond) * {FACTOR} * (image - uncond)',
             (P + "test_instruct_pix2pix[pix2pix]",)),
    Mutation("ControlNet: the conditioning scale per call", "pipelines/control.py",
             "out[k] = np.float32(c.scale) * np.where(",
             f"out[k] = np.float32(c.scale * {FACTOR}) * np.where(",
             ("tests/test_controlnet_pipelines.py::test_sd_img2img_at_diffusers_default_scale",)),
    Mutation("T2I-Adapter: the feature maps' gate", "pipelines/t2i_adapter.py",
             "jnp.repeat(f * _per_row(gate, f), call.branches, axis=0)",
             f"jnp.repeat(f * (_per_row(gate, f) * {FACTOR}), call.branches, axis=0)",
             ("tests/test_t2i_adapter_pipelines.py::test_sd_text_to_image_takes_the_adapter_image_size",)),
    Mutation("IP-Adapter: the attention scales", "pipelines/image_prompt.py",
             "np.repeat(scales[None], batch.rows, axis=0)",
             f"np.repeat(scales[None] * np.float32({FACTOR}), batch.rows, axis=0)",
             ("tests/test_ip_adapter_pipelines.py::test_text_to_image_matches_diffusers[sd15-StableDiffusionPipeline-plain-0.7]",)),
    Mutation("decode: [-1, 1] to [0, 1]", "pipelines/pipeline.py",
             "np.clip(out / 2 + 0.5, 0.0, 1.0)",
             f"np.clip(out / 2 * {FACTOR} + 0.5, 0.0, 1.0)",
             (P + "test_sd15_text_to_image",)),
)


def snapshot(dest: Path) -> None:
    """The files git lists in the working tree (tracked, and untracked ones not ignored), copied into `dest`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():  # a tracked file deleted in the working tree is left out
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def mutate(root: Path, m: Mutation) -> None:
    path = root / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"{m.name}: {m.path} holds {text.count(m.old)} copies of {m.old!r}, not one; update the mutation")
    path.write_text(text.replace(m.old, m.new))


def env_for(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}


def check_imports(root: Path) -> None:
    """The copy's packages are the ones imported there (not the editable install's working tree)."""
    code = "import convert, pipelines, sdx, train; print('\\n'.join(m.__file__ for m in (convert, pipelines, sdx, train)))"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=env_for(root), check=True, capture_output=True,
                         text=True).stdout.split()
    wrong = [f for f in out if not Path(f).resolve().is_relative_to(root.resolve())]
    if wrong:
        raise SystemExit(f"the copy in {root} imports packages from elsewhere: {wrong}")


def run_tests(root: Path, tests: tuple[str, ...], timeout: float, stop: bool = True) -> tuple[set[str], str, float]:
    """(the node ids that failed, what the first failing test said, seconds) of pytest on `tests` in `root`, stopping
    at the first failure if `stop`. What a test said: the last comparison it printed (`tests.tiny_models`'s
    "parity:" / "effect of" lines), else pytest's first error line."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-rfE", "-p", "no:cacheprovider", *(["-x"] if stop else []), *tests]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env_for(root), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return set(tests), f"timed out after {timeout:.0f} s", time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    lines = proc.stdout.splitlines() + proc.stderr.splitlines()
    failed = {line.split()[1] for line in lines if re.match(r"(FAILED|ERROR) \S+", line)}
    if proc.returncode not in (0, 1) and not failed:
        failed = set(tests)  # pytest itself failed (a collection or usage error)
    if not failed:
        return failed, "", seconds
    printed = [line for line in lines if line.startswith(("parity:", "effect of"))]
    errors = [line[1:].strip() for line in lines if re.match(r"E\s", line)]
    said = printed[-1] if printed else errors[0] if errors else f"exit status {proc.returncode}"
    return failed, said, seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", help="run only the mutations whose names contain one of these words")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--keep", action="store_true", help="keep the temporary copies (printed)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run")
    args = p.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or any(w.lower() in m.name.lower() for w in args.only)]
    if args.list or not chosen:
        for m in MUTATIONS:
            print(f"{m.name}: {m.path}: {m.old!r} -> {m.new!r}; {' '.join(m.tests)}")
        return 0 if args.list else 2
    work = Path(tempfile.mkdtemp(prefix="sdx-mutations-"))
    base = work / "snapshot"
    snapshot(base)
    for m in chosen:  # every mutation applies to the snapshot, before anything slow runs
        probe = work / "probe"
        shutil.copytree(base, probe)
        mutate(probe, m)
        shutil.rmtree(probe)
    check_imports(base)
    print(f"snapshot of {REPO} in {base}; {len(chosen)} mutations, each by x{FACTOR}", flush=True)

    unique = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
    broken, said, seconds = run_tests(base, unique, args.timeout, stop=False)
    print(f"unmutated: {len(unique) - len(broken)} of {len(unique)} tests pass ({seconds:.0f} s)"
          + (f"; failing: {' '.join(sorted(broken))} ({said})" if broken else ""), flush=True)

    rows, missed = [], 0
    for k, m in enumerate(chosen):
        root = work / f"mutant-{k}"
        shutil.copytree(base, root)
        mutate(root, m)
        if broken & set(m.tests):
            verdict, said, seconds = "n/a (fails unmutated)", "", 0.0
        else:
            failed, said, seconds = run_tests(root, m.tests, args.timeout)
            verdict = "caught" if failed else "MISSED"
            missed += not failed
        rows.append((m.name, f"{m.path}: x{FACTOR}", " ".join(t.split("::", 1)[1] for t in m.tests), verdict, said,
                     f"{seconds:.0f}"))
        print(f"{m.name}: {verdict} {said} ({seconds:.0f} s)", flush=True)
        if not args.keep:
            shutil.rmtree(root)
    print()
    print("| mutation | where | test | result | first failure | s |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")
    if args.keep:
        print(f"copies kept in {work}")
    else:
        shutil.rmtree(work)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
