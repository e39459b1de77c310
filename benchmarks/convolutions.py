"""One 3×3 convolution (stride 1, padding 1, float32) in each of `sdx.conv`'s forms, at the shapes of SD 1.5's
and SDXL's UNets (the guidance batch of 2) and of their VAE decoder, in one process.

    python benchmarks/convolutions.py [--repeats 5]

Printed per shape: milliseconds (best of `--repeats` after a warm-up, each form compiled with the sampler's
XLA:CPU options) of `xla`, `matmul` and `winograd`, which form `auto` takes there, and winograd / the
faster of the other two. `auto`'s thresholds (`sdx.conv.WINOGRAD_PIXELS`, `WINOGRAD_CHANNELS`, the
matmul rule) are read from such runs; run it again to check them on another CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks.sample import machine  # noqa: E402
from pipelines import cpu_kernels  # noqa: E402
from sdx import conv as convlib  # noqa: E402

FORMS = ("xla", "matmul", "winograd")
# (batch, height, width, channels in, channels out)
SHAPES = (
    (2, 64, 64, 320, 320), (2, 64, 64, 640, 320), (2, 32, 32, 320, 320), (2, 32, 32, 320, 640),
    (2, 32, 32, 640, 640), (2, 32, 32, 1280, 640), (2, 32, 32, 1280, 1280), (2, 16, 16, 640, 640),
    (2, 16, 16, 640, 1280), (2, 16, 16, 1280, 1280), (2, 8, 8, 1280, 1280),  # the UNets' levels
    (1, 64, 64, 512, 512), (1, 128, 128, 512, 512), (1, 256, 256, 256, 256), (1, 256, 256, 256, 128),
    (1, 256, 256, 128, 128),  # the VAE decoder's
)


def best_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def taken_by_auto(x, k) -> str:
    """The form `auto` computes this convolution in, read from its traced primitives."""
    jaxpr = jax.make_jaxpr(lambda x, k: convlib.for_backend("auto")(x, k, (1, 1), ((1, 1), (1, 1)),
                                                                   dimension_numbers=_nhwc(x, k)))(x, k)
    names = _primitive_names(jaxpr.jaxpr)
    return "xla" if "conv_general_dilated" in names else "matmul" if names.count("dot_general") == 1 else "winograd"


def _primitive_names(jaxpr) -> list[str]:
    """Every equation's primitive, those of the loops' bodies included."""
    names = []
    for e in jaxpr.eqns:
        names.append(e.primitive.name)
        for v in e.params.values():
            if hasattr(v, "jaxpr"):  # a closed jaxpr: a loop's body
                names += _primitive_names(v.jaxpr)
    return names


def _nhwc(x, k):
    return lax.conv_dimension_numbers(x.shape, k.shape, ("NHWC", "HWIO", "NHWC"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(f"# {machine()}, jax {jax.__version__}, best of {args.repeats}, ms")
    print("| shape B×H×W×C→O | B·H·W | xla | matmul | winograd | auto takes | winograd / best other |")
    print("|---|---|---|---|---|---|---|")
    options = cpu_kernels.compiler_options(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",)))
    rng = np.random.default_rng(0)
    for b, h, w, c, o in SHAPES:
        x = jax.numpy.asarray(rng.standard_normal((b, h, w, c)), jax.numpy.float32)
        k = jax.numpy.asarray(rng.standard_normal((3, 3, c, o)) / np.sqrt(9 * c), jax.numpy.float32)
        ms = {}
        for form in FORMS:
            conv = convlib.for_backend(form)
            fn = jax.jit(lambda x, k, conv=conv: conv(x, k, (1, 1), ((1, 1), (1, 1)), dimension_numbers=_nhwc(x, k)))
            ms[form] = best_ms(fn.lower(x, k).compile(options), (x, k), args.repeats)
        ratio = ms["winograd"] / min(ms["xla"], ms["matmul"])
        print(f"| {b}×{h}×{w}×{c}→{o} | {b * h * w} | {ms['xla']:.1f} | {ms['matmul']:.1f} | {ms['winograd']:.1f} "
              f"| {taken_by_auto(x, k)} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
