"""Where a generation's accelerator time goes: its kernels, summed by name and by kind, under each framework's
own profiler (`benchmarks/sample.py --profile`).

Each kernel is put in one kind by its name (`kind`): attention, convolution, matrix product, normalization or
reduction, copy or transpose, other fused elementwise work. A name that says nothing of the work falls in the
last: XLA's Triton fusions (`fusion_N`), among them the layer norms XLA fuses on a GPU. The summary gives the
profiled generation's wall time, the sum of its kernels' times (below the wall time: the device waited for the
host; above it: kernels ran side by side on several streams), each kind's share, and the longest kernels.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

# (kind, name fragments), tried in order: cuDNN's attention kernels also say "fprop", so attention comes first.
# XLA names a fusion after its ops ("loop_convert_fusion"), so "convert" is taken out before looking for "conv".
KINDS = (
    ("attention", ("sdpa", "flash", "fmha", "attention", "attn")),
    ("convolution", ("conv", "fprop", "dgrad", "wgrad", "implicit")),
    ("matrix product", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "dot")),
    ("normalization/reduction", ("reduce", "norm", "softmax", "welford")),
    ("copy/transpose", ("copy", "transpose", "memcpy", "memset", "concatenate", "slice", "pad", "nchw", "nhwc")),
)


def kind(name: str) -> str:
    """The kind of the kernel called `name` (the first of `KINDS` with a fragment in it; else elementwise/other)."""
    lowered = name.lower().replace("convert", "")
    return next((k for k, parts in KINDS if any(p in lowered for p in parts)), "elementwise/other")


def summarize(kernels: dict[str, tuple[float, int]], wall_s: float, top: int = 30) -> str:
    """A text table of `kernels` (name → (seconds, launches)) from one generation that took `wall_s`."""
    total = sum(s for s, _ in kernels.values())
    by_kind = collections.Counter()
    for name, (seconds, _) in kernels.items():
        by_kind[kind(name)] += seconds
    lines = [f"wall {wall_s * 1e3:.1f} ms; kernels {total * 1e3:.1f} ms ({total / wall_s:.0%} of the wall), "
             f"{sum(n for _, n in kernels.values())} launches, {len(kernels)} distinct kernels",
             "| kind | ms | share of kernel time |", "|---|---|---|"]
    lines += [f"| {k} | {s * 1e3:.1f} | {s / total:.1%} |" for k, s in by_kind.most_common()]
    lines += ["| kernel | kind | ms | launches |", "|---|---|---|---|"]
    longest = sorted(kernels.items(), key=lambda item: -item[1][0])[:top]
    lines += [f"| {name[:110]} | {kind(name)} | {s * 1e3:.2f} | {n} |" for name, (s, n) in longest]
    return "\n".join(lines)


def jax_profile(generate, folder: Path) -> str:
    """`generate()` once under JAX's profiler (its trace kept in `folder`): the summary of the device planes'
    kernels (a CPU has none)."""
    try:
        return _jax_profile(generate, folder)
    except Exception as error:  # a profiler that fails leaves the worker's timings standing
        return f"JAX's profiler failed: {error!r}"


def _jax_profile(generate, folder: Path) -> str:
    import jax

    t0 = time.perf_counter()
    with jax.profiler.trace(str(folder)):
        generate()
    wall = time.perf_counter() - t0
    data = jax.profiler.ProfileData.from_file(str(next(folder.rglob("*.xplane.pb"))))
    device_planes = [p for p in data.planes if p.name.startswith("/device:")]
    if not device_planes:
        return "no device plane in the trace (planes: " + ", ".join(p.name for p in data.planes) + ")"
    kernels = collections.defaultdict(lambda: [0.0, 0])
    streams = collections.Counter()
    for plane in device_planes:
        for line in plane.lines:
            if line.name.startswith(("XLA", "Steps", "Launch", "Source")):  # derived from the streams' events
                continue
            for event in line.events:
                kernels[event.name][0] += event.duration_ns * 1e-9
                kernels[event.name][1] += 1
                streams[f"{plane.name} {line.name}"] += 1
    header = "events per line: " + ", ".join(f"{k}: {v}" for k, v in streams.most_common(8))
    return header + "\n" + summarize({k: tuple(v) for k, v in kernels.items()}, wall)


def torch_profile(generate, sync) -> str:
    """`generate()` once under torch's profiler, CUDA activity only: the summary of its kernels."""
    try:
        return _torch_profile(generate, sync)
    except Exception as error:  # as in jax_profile
        return f"torch's profiler failed: {error!r}"


def _torch_profile(generate, sync) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate()
        sync()
    wall = time.perf_counter() - t0
    kernels = {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kernels[event.key] = (event.self_device_time_total * 1e-6, event.count)
    if not kernels:
        return "no CUDA kernels recorded:\n" + prof.key_averages().table(row_limit=40)
    return summarize(kernels, wall)
