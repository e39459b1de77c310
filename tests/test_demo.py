"""The demo models (`--model tiny` / `tiny_xl`) have every norm scale and bias drawn, so that a test that runs
them sees one dropped; `random_parts` (how `python -m train.init` starts a model) keeps the standard init."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from convert.demo import random_parts
from sdx import presets


@pytest.mark.parametrize("name", ["tiny", "tiny_xl"])
def test_demo_models_norm_scales_and_biases_are_drawn(tmp_path, demo_build, name):
    folder = demo_build(name, tmp_path)
    files = sorted(folder.glob("*.safetensors"))
    assert {f.stem for f in files} == {"unet", "vae", *presets.get(name).text_encoders}
    for file in files:
        # each scale's and bias's difference from its init (1 or 0): nonzero in every element, N(0, 0.1²) overall
        drawn = {p: a - p.endswith(".scale") for p, a in load_file(file).items()
                 if p.rpartition(".")[2] in ("scale", "bias")}
        assert drawn and all(d.all() for d in drawn.values()), file.name
        assert 0.09 < np.concatenate([d.ravel() for d in drawn.values()]).std() < 0.11, file.name


def test_random_parts_keep_the_standard_init():
    arrays = random_parts(presets.get("tiny"), 0, ("vae",))["vae"].arrays
    assert all((a == p.endswith(".scale")).all() for p, a in arrays.items() if p.rpartition(".")[2] in ("scale", "bias"))
