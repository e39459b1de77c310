"""ControlNet through `alwayson_scripts`, sd-webui-controlnet's unit fields, for the ControlNets the server was
started with: a unit's image equals `python -m sdx.sample --controlnet`'s for the same settings, a request without
units the command's without ControlNet, and what sdx cannot honour in a unit is refused naming its field."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageDraw

from sdx.sample import main as sample
from tests.serve_helpers import Server, b64_png, parameters, pixels
from tests.test_controlnet_pipelines import controlnet  # noqa: F401 (the fixture)
from tests.test_pipelines import tiny  # noqa: F401 (the fixture)

BODY = {"prompt": "a glass house", "steps": 4, "width": 64, "height": 64, "seed": 3, "cfg_scale": 6}
FLAGS = ["--prompt", "a glass house", "--steps", "4", "--height", "64", "--width", "64", "--seed", "3",
         "--guidance-scale", "6", "--scheduler", "euler", "--long-prompt", "chunk"]


@pytest.fixture(scope="module")
def case(tiny, controlnet, tmp_path_factory):  # noqa: F811
    _, folder = tiny("sd15")
    _, net_folder = controlnet("sd15")
    where = tmp_path_factory.mktemp("serve-controlnet")
    edges = Image.new("RGB", (64, 64))
    ImageDraw.Draw(edges).ellipse((12, 10, 50, 54), outline="white", width=3)
    edges.save(where / "edges.png")
    server = Server("--model", str(folder), "--controlnet", str(net_folder), cache=where / "cache")
    yield server, folder, net_folder, where, edges
    assert server.stop() == 0


def _command(case, *flags: str) -> np.ndarray:
    _, folder, _, where, _ = case
    out = where / "out.png"
    assert sample(["--model", str(folder), "--cache", str(where / "cache"), "--output", str(out), "--overwrite",
                   "--quiet", *FLAGS, *flags]) == 0
    return np.asarray(Image.open(out).convert("RGB"))


def test_a_unit_gives_the_commands_image(case):
    server, _, net_folder, where, edges = case
    assert server.get("/controlnet/model_list").json() == {"model_list": [net_folder.name]}
    assert server.get("/sdapi/v1/scripts").json()["txt2img"] == ["controlnet"]
    unit = {"enabled": True, "model": f"{net_folder.name} [0123abcd]", "module": "none", "weight": 0.7,
            "image": b64_png(np.asarray(edges)), "guidance_start": 0.2, "guidance_end": 0.8,
            "control_mode": "Balanced", "resize_mode": "Resize and Fill", "pixel_perfect": False,
            "processor_res": 512, "threshold_a": 64, "threshold_b": 64, "low_vram": False}
    r = server.post("/sdapi/v1/txt2img", {**BODY, "alwayson_scripts": {"ControlNet": {"args": [unit]}}})
    assert r.status_code == 200, r.text
    theirs = _command(case, "--controlnet", str(net_folder), "--control-image", str(where / "edges.png"),
                      "--controlnet-conditioning-scale", "0.7", "--control-guidance-start", "0.2",
                      "--control-guidance-end", "0.8")
    np.testing.assert_array_equal(pixels(r.json()["images"][0]), theirs)
    assert (f'ControlNet 0: "Module: none, Model: {net_folder.name}, Weight: 0.7, Guidance Start: 0.2, Guidance End: '
            '0.8"') in parameters(r.json()["images"][0])
    plain = server.post("/sdapi/v1/txt2img", {**BODY, "alwayson_scripts": {"controlnet": {"args": [
        {**unit, "enabled": False}]}}})
    assert plain.status_code == 200, plain.text
    np.testing.assert_array_equal(pixels(plain.json()["images"][0]), _command(case))
    assert not np.array_equal(theirs, _command(case))


@pytest.mark.parametrize("change, words", [
    ({"model": "control_v11p_sd15_depth"}, "args[0].model 'control_v11p_sd15_depth': this server has the ControlNets"),
    ({"module": "canny"}, "args[0].module 'canny': sdx runs no preprocessor"),
    ({"control_mode": "ControlNet is more important"}, "args[0].control_mode 'ControlNet is more important'"),
    ({"image": None}, "args[0].image: give the control map"),
    ({"resize_mode": "Crop and Resize", "image": b64_png(np.zeros((40, 30, 3), np.uint8))},
     "args[0].resize_mode 'Crop and Resize': sdx resizes a control map to the generation size"),
])
def test_what_a_unit_cannot_have_is_refused(case, change, words):
    server, _, net_folder, _, edges = case
    unit = {"model": net_folder.name, "image": b64_png(np.asarray(edges)), **change}
    r = server.post("/sdapi/v1/txt2img", {**BODY, "alwayson_scripts": {"controlnet": {"args": [unit]}}})
    assert r.status_code == 422 and words in r.json()["detail"], r.text
