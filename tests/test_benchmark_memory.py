"""benchmarks/memory.py: the parameters it counts are the loaded model's, and its decode programs are the
sampler's, one image at a time taking one image's temporaries where the whole batch takes four."""

import jax
import pytest

from benchmarks import memory
from convert.demo import random_parts
from sdx import presets


def test_parameters_are_the_built_models_and_the_decode_runs_in_turns():
    parts = random_parts(presets.get("tiny"), seed=0)
    for component, dtype in (("unet", "float32"), ("vae", "bfloat16"), ("text_encoder", "float32")):
        arrays = jax.tree.leaves(parts[component].arrays)
        itemsize = 2 if dtype == "bfloat16" else 4
        assert memory.parameter_bytes("tiny", component, dtype) == sum(a.size for a in arrays) * itemsize

    out = memory.report("tiny", 64, 4, "float32", "float32", "xla")
    temps = {line.split(", ", 1)[1]: gib for line, gib in out.items() if line.startswith("temporaries")}
    one_by_one, at_once = temps["decode of 4, one image at a time (the sampler's)"], temps["decode of 4 at once"]
    assert at_once == pytest.approx(4 * one_by_one, rel=0.1)
    params = sum(gib for line, gib in out.items() if line.startswith("parameters"))
    peak = out["estimated peak: parameters + the largest program's temporaries and outputs"]
    assert peak == pytest.approx(params + max(temps["UNet call on 8 latents"], one_by_one), rel=0.05)


def test_a_tiled_decode_holds_one_tile():
    """tiny's VAE tiles are 128 px (its sample_size): a 256 px image decodes in nine tiles of up to 128 px, each
    with a quarter of the whole image's temporaries or less; the untiled one is printed beside it."""
    out = memory.report("tiny", 256, 1, "float32", "float32", "xla", vae_tiling=True)
    temps = {line.split(", ", 1)[1]: gib for line, gib in out.items() if line.startswith("temporaries")}
    tiled, untiled = temps["decode of 1, one image at a time, in tiles (the sampler's)"], temps["decode of 1, one image at a time, untiled"]
    print(f"decode temporaries: {tiled:.4f} GiB in tiles, {untiled:.4f} untiled")
    assert tiled < 0.4 * untiled
