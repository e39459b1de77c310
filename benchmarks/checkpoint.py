"""Training checkpoints: `train.checkpoint` saving and restoring a UNet's AdamW + EMA state as training
does against a reference, alternated in one process.

    python benchmarks/checkpoint.py --preset tiny_xl --repeats 3
    python benchmarks/checkpoint.py --compare compression --preset sd15 --channels 160,320,640,640

The state is what `python -m train.pix2pix --use_ema` checkpoints: the preset's UNet parameters (with
`--channels` replacing its widths), Adam's two moments, the EMA shadow (random values of the real shapes,
float32) and the step. `--compare packing` (the default): small arrays packed against Orbax array by
array (`train.checkpoint.PACKED_MAX` at -1); `--compare compression`: the arrays uncompressed against
Orbax's default zstd (`train.checkpoint.COMPRESSED`). Printed per method, the median over `--repeats`:
`save` (until `Checkpoints.save` returns: the host copy), `commit` (until the checkpoint is committed),
`restore` (onto the live state's shardings), the bytes on disk, and the ratio to the reference. A
full-size preset's state is four copies of its UNet in memory (SD 1.5: about 14 GB), restored into four more.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.sample import machine  # noqa: E402
from benchmarks.train import unet_config  # noqa: E402
from sdx import model_folder, presets  # noqa: E402
from train import checkpoint  # noqa: E402

# --compare -> {method: the train.checkpoint settings it runs with}, sdx's way first, the reference second
COMPARISONS = {
    "packing": {"packed": {"PACKED_MAX": checkpoint.PACKED_MAX}, "array by array": {"PACKED_MAX": -1}},
    "compression": {"uncompressed": {"COMPRESSED": False}, "zstd": {"COMPRESSED": True}},
}


def state(config: dict) -> dict:
    """{params, mu, nu, ema: {name: array}, step} with the shapes of the UNet of diffusers config `config`."""
    kind = model_folder.MODEL_KINDS["unet"]
    shapes = kind.param_shapes(kind.config_from_diffusers(config))
    r = np.random.default_rng(0)
    copy = lambda: {name: jnp.asarray(r.standard_normal(shape, np.float32)) for name, shape in shapes.items()}
    return {"params": copy(), "mu": copy(), "nu": copy(), "ema": copy(), "step": jnp.int32(7)}


def measure(live: dict, like: dict, where: Path) -> dict[str, float]:
    shutil.rmtree(where, ignore_errors=True)
    with checkpoint.Checkpoints(where) as ckpts:
        t0 = time.perf_counter()
        ckpts.save(1, live, {})
        t1 = time.perf_counter()
        ckpts.wait()
        t2 = time.perf_counter()
        restored, _ = ckpts.restore(1, like)
        jax.block_until_ready(restored)
        t3 = time.perf_counter()
    stored = sum(f.stat().st_size for f in where.rglob("*") if f.is_file())
    return {"save": t1 - t0, "commit": t2 - t0, "restore": t3 - t2, "GiB": stored / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", default="packing", choices=COMPARISONS)
    parser.add_argument("--preset", default="tiny_xl", choices=presets.NAMES)
    parser.add_argument("--channels", help="comma-separated block_out_channels replacing the preset's")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    methods = COMPARISONS[args.compare]
    live = state(unet_config(args))
    like = jax.tree.map(jnp.zeros_like, live)
    arrays = len(jax.tree.leaves(live))
    small = sum(x.size <= checkpoint.PACKED_MAX for x in jax.tree.leaves(live))
    print(f"{machine()}; {args.preset}: {arrays} arrays ({small} of at most {checkpoint.PACKED_MAX} elements), "
          f"{sum(x.nbytes for x in jax.tree.leaves(live)) / 2**20:.1f} MiB")
    times = {method: [] for method in methods}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for method, settings in methods.items():
                for name, value in settings.items():
                    setattr(checkpoint, name, value)
                times[method].append(measure(live, like, Path(tmp) / "checkpoints"))
    median = {m: {k: statistics.median(t[k] for t in runs) for k in runs[0]} for m, runs in times.items()}
    for method, m in median.items():
        print(f"{method:>15}: " + ", ".join(f"{k} {v:.2f}" + ("" if k == "GiB" else " s") for k, v in m.items()))
    (ours, ref), (a, b) = median.values(), methods
    print(f"{a} / {b}: " + ", ".join(f"{k} {ours[k] / ref[k]:.2f}x" for k in ours))


if __name__ == "__main__":
    main()
