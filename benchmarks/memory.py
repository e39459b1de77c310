"""A sampling job's device memory by XLA's own memory analysis: the programs are compiled for this machine's
backend with abstract weights, so nothing is allocated or run and SDXL fits on any machine.

    python benchmarks/memory.py PRESET SIZE BATCH [--dtype bfloat16] [--vae-dtype float32] [--attention NAME]
                                                  [--vae-tiling]

Printed in GiB, per device of one: the parameters of each model (resident for the whole run), the
temporaries of one UNet call on the guidance batch (2 × BATCH latents), of the VAE decode as the sampler
runs it (one image at a time, `pipelines.sampler._in_turns`) and of the whole batch decoded at once, and
the estimated peak: the parameters plus the largest program's temporaries and outputs. With `--vae-tiling`
the sampler's decode is the tiled one (`sdx.vae_tiles`, `python -m sdx.sample --vae-tiling`), and the
untiled one is printed beside it. What the estimate
leaves out: the allocator's fragmentation, the inputs a program is handed, and on a GPU the compile's
autotuning scratch and cuDNN's workspaces.

`--dtype` is the text encoders' and the UNet's, `--vae-dtype` the VAE's (float32, as `python -m
sdx.sample` runs it by default); `--attention` defaults to what `python -m sdx.sample` picks for this
backend and dtype (`sdx.attention.default_backend`). On a GPU the numbers are the GPU compiler's own buffer
assignment. The programs are compiled with the sampler's options (`pipelines/cpu_kernels.py`; none off a CPU).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.flops import _factor, unet_call  # noqa: E402
from pipelines import cpu_kernels  # noqa: E402
from pipelines.sampler import _decode, working_bytes  # noqa: E402
from sdx import attention, presets  # noqa: E402
from sdx import mesh as meshlib  # noqa: E402
from sdx.layers import Compute  # noqa: E402
from sdx.model_folder import MODEL_KINDS  # noqa: E402

GiB = 2**30


def sampler_options() -> dict[str, str]:
    """The compile options of the sampler's programs on one device of this backend."""
    return cpu_kernels.compiler_options(meshlib.make_mesh(devices=jax.devices()[:1]))


def parameter_bytes(preset_name: str, component: str, dtype) -> int:
    """Bytes of a preset's component's parameters in `dtype`."""
    kind = MODEL_KINDS[component]
    config = kind.config_from_diffusers(presets.get(preset_name).configs[component])
    return sum(leaf.size for leaf in jax.tree.leaves(nnx.state(kind.abstract(config)))) * jnp.dtype(dtype).itemsize


def decode_program(preset_name: str, size: int, batch: int, compute: Compute, turns: bool,
                   tiled: bool = False) -> jax.stages.Compiled:
    """The sampler's decode of `batch` latents, one image at a time (`turns`) or all at once, in tiles or not."""
    configs = presets.get(preset_name).configs
    kind, factor = MODEL_KINDS["vae"], _factor(configs)
    config = kind.config_from_diffusers(configs["vae"])
    graphdef, params = nnx.split(kind.abstract(config, compute))
    latents = jax.ShapeDtypeStruct((batch, size // factor, size // factor, config.latent_channels), jnp.float32)
    fn = functools.partial(_decode, graphdef, devices=1 if turns else batch, tiled=tiled)
    return jax.jit(fn).lower(params, latents).compile(sampler_options())


def report(preset_name: str, size: int, batch: int, dtype: str, vae_dtype: str, backend: str,
           vae_tiling: bool = False) -> dict[str, float]:
    """{line: GiB} of the job (see the module's docstring)."""
    configs = presets.get(preset_name).configs
    compute = lambda dt: Compute(dtype=jnp.dtype(dt), param_dtype=jnp.dtype(dt), attention=backend)
    models = {c: vae_dtype if c == "vae" else dtype for c in ("text_encoder", "text_encoder_2", "unet", "vae") if c in configs}
    out = {f"parameters, {c} ({dt})": parameter_bytes(preset_name, c, dt) / GiB for c, dt in models.items()}
    resident = sum(out.values())
    one_at_a_time = f"decode of {batch}, one image at a time"
    sampler = {  # the programs a run holds one at a time
        f"UNet call on {2 * batch} latents": unet_call(preset_name, size, 2 * batch, compute(dtype)).compile(sampler_options()),
        f"{one_at_a_time}{', in tiles' if vae_tiling else ''} (the sampler's)":
            decode_program(preset_name, size, batch, compute(vae_dtype), True, tiled=vae_tiling),
    }
    whole = {f"decode of {batch} at once": decode_program(preset_name, size, batch, compute(vae_dtype), False)}
    if vae_tiling:
        whole[f"{one_at_a_time}, untiled"] = decode_program(preset_name, size, batch, compute(vae_dtype), True)
    stats = {name: p.memory_analysis() for name, p in {**sampler, **whole}.items()}
    out.update({f"temporaries, {name}": m.temp_size_in_bytes / GiB for name, m in stats.items()})
    working = max(map(working_bytes, sampler.values()))
    out["estimated peak: parameters + the largest program's temporaries and outputs"] = resident + working / GiB
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Print a sampling job's device memory by XLA's memory analysis.")
    p.add_argument("preset")
    p.add_argument("size", type=int, help="image side in pixels")
    p.add_argument("batch", type=int, help="images per call")
    p.add_argument("--dtype", default="float32", help="the text encoders' and the UNet's")
    p.add_argument("--vae-dtype", default="float32")
    p.add_argument("--attention", help="default: sdx.attention.default_backend(--dtype) on this backend")
    p.add_argument("--vae-tiling", action="store_true", help="the sampler decodes in tiles (python -m sdx.sample --vae-tiling)")
    a = p.parse_args(argv)
    backend = a.attention or attention.default_backend(jnp.dtype(a.dtype))
    print(f"# {a.preset} {a.size}² batch {a.batch}, {a.dtype} (VAE {a.vae_dtype}{', in tiles' if a.vae_tiling else ''}), "
          f"{backend} attention, on {jax.devices()[0].device_kind}")
    for line, gib in report(a.preset, a.size, a.batch, a.dtype, a.vae_dtype, backend, a.vae_tiling).items():
        print(f"{gib:8.2f} GiB  {line}")


if __name__ == "__main__":
    main()
