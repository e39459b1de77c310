"""pipelines.host_memory: freed heap memory goes back to the OS, and the sampler gives it back after
compiling (or reading) its programs; on a CPU the sampler takes the text encoders' file pages out of the
process once prepare has used them."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from pipelines import host_memory
from pipelines.pipeline import Pipeline
from pipelines.request import Request
from sdx import mesh as meshlib

linux_glibc = pytest.mark.skipif(sys.platform != "linux" or host_memory._malloc_trim() is None,
                                 reason="malloc_trim is glibc's")


def _anonymous_rss() -> int:
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["RssAnon"].split()[0]) * 1024


@linux_glibc
@pytest.mark.allow_skip
def test_freed_heap_memory_leaves_the_process():
    blocks = [np.ones(8192) for _ in range(4096)]  # 256 MiB in 64 KiB blocks: under glibc's mmap threshold, on the heap
    pin = np.ones(8192)  # allocated above them, so freeing them leaves free memory inside the heap, not at its top
    del blocks
    held = _anonymous_rss()
    assert host_memory.trim()
    assert held - _anonymous_rss() > 128 * 2**20
    del pin


def test_the_sampler_trims_once_per_new_set_of_programs(tmp_path_factory, demo_build, monkeypatch):
    folder = demo_build("tiny_xl", tmp_path_factory.mktemp("demo"))
    pipe = Pipeline.load(folder, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    calls = []
    monkeypatch.setattr(host_memory, "trim", lambda: calls.append(1) or True)
    for steps in (2, 2, 3):
        request = Request(prompts=["a red fox"], height=32, width=32, steps=steps, guidance_scale=5.0)
        plan, inputs, _ = pipe._work(request)[0]
        pipe.sampler.compiled(plan, pipe.sampler.place(inputs))
    assert len(calls) == 2  # steps 2, then steps 3; the second steps-2 call found its programs in memory


def _mapped_bytes(path: Path) -> int:
    """Bytes of `path`'s pages mapped into this process (Linux: the Rss of its mappings in /proc/self/smaps)."""
    total, ours = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if fields[0].endswith(":"):
            if ours and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
        else:  # a mapping's header: address range, permissions, offset, device, inode[, path]
            ours = len(fields) >= 6 and fields[5] == str(path)
    return total


@pytest.mark.allow_skip
@pytest.mark.skipif(sys.platform != "linux" or jax.default_backend() != "cpu",
                    reason="a CPU uses the weight files in place; /proc/self/smaps is Linux's")
def test_the_text_encoders_pages_leave_the_process_after_prepare(tmp_path_factory, demo_build):
    """Once prepare has encoded the prompts, the text encoders' file pages are unmapped: they and the UNet's
    are not counted in the process at once (`weights.unmap`). The next generation maps them again and gives
    the same images."""
    folder = demo_build("tiny_xl", tmp_path_factory.mktemp("demo"))
    pipe = Pipeline.load(folder, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    request = Request(prompts=["a red fox"], height=32, width=32, steps=2, guidance_scale=5.0)
    first = pipe(request)
    encoders = [folder / f"{name}.safetensors" for name in ("text_encoder", "text_encoder_2")]
    assert all(path.is_file() for path in encoders)
    # at most the header's pages, which the kernel maps around a fault on the first tensor's (fault-around)
    assert all(_mapped_bytes(path) <= 64 * 1024 < path.stat().st_size for path in encoders)
    assert _mapped_bytes(folder / "unet.safetensors") > 0, "the UNet's pages stay: every call reads them"
    np.testing.assert_array_equal(pipe(request), first)
