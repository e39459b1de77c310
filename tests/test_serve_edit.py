"""An InstructPix2Pix model behind the server (`default-edit`): img2img with `image_cfg_scale` is the sampling
command's edit with --image-guidance-scale; text-to-image and a partial denoising strength are refused."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from sdx.sample import main as sample
from tests.serve_helpers import Server, b64_png, parameters, pixels
from train.shapes import render


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("serve-cache")
    s = Server("--model", "default-edit", cache=cache)
    s.cache = cache
    yield s
    assert s.stop() == 0


def test_an_edit_is_the_commands_edit(server, tmp_path):
    circle = render("circle", "red", "blue")
    Image.fromarray(circle).save(tmp_path / "in.png")
    body = {"prompt": "make the circle green", "init_images": [b64_png(circle)], "steps": 5, "width": 64,
            "height": 64, "seed": 6, "cfg_scale": 6, "image_cfg_scale": 1.3, "denoising_strength": 1.0}
    r = server.post("/sdapi/v1/img2img", body)
    assert r.status_code == 200, r.text
    out = tmp_path / "out.png"
    assert sample(["--model", "default-edit", "--cache", str(server.cache), "--image", str(tmp_path / "in.png"),
                   "--prompt", "make the circle green", "--steps", "5", "--height", "64", "--width", "64", "--seed",
                   "6", "--guidance-scale", "6", "--image-guidance-scale", "1.3", "--scheduler", "euler",
                   "--long-prompt", "chunk", "--output", str(out), "--quiet"]) == 0
    np.testing.assert_array_equal(pixels(r.json()["images"][0]), np.asarray(Image.open(out).convert("RGB")))
    assert "CFG scale: 6.0, Image CFG scale: 1.3, Seed: 6" in parameters(r.json()["images"][0])


def test_what_an_edit_model_cannot_do_is_refused(server):
    r = server.post("/sdapi/v1/txt2img", {"prompt": "x", "steps": 2, "width": 64, "height": 64})
    assert r.status_code == 422 and "an InstructPix2Pix model edits an image: pass --image" in r.json()["detail"]
    r = server.post("/sdapi/v1/img2img", {"prompt": "x", "steps": 2, "width": 64, "height": 64,
                                          "init_images": [b64_png(np.zeros((64, 64, 3), np.uint8))]})
    assert r.status_code == 422 and "denoising_strength 0.75: an InstructPix2Pix model edits from noise" in r.text
