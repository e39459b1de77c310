"""The server through the `webuiapi` package, as its users call it: every call sends its neutral fields
(enable_hr false, restore_faces false, tiling false, subseed_strength 0, s_churn 0, eta 1, ...), and the answers
parse as they do from AUTOMATIC1111's web UI."""

from __future__ import annotations

import numpy as np
import pytest
import webuiapi
from PIL import Image

from tests.serve_helpers import Server
from train.shapes import render


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    s = Server(cache=tmp_path_factory.mktemp("serve-cache"))
    host, port = s.url.removeprefix("http://").split(":")
    yield webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler a", steps=4)
    assert s.stop() == 0


def test_txt2img_with_the_clients_defaults(api):
    result = api.txt2img(prompt="a red circle on a blue background", negative_prompt="blurry", seed=4, width=64,
                         height=64, cfg_scale=5, batch_size=2)
    assert len(result.images) == 2 and result.image.size == (64, 64)
    assert result.info["all_seeds"] == [4, 5] and result.info["sampler_name"] == "Euler a"
    assert result.image.info["parameters"].startswith("a red circle on a blue background\nNegative prompt: blurry\n"
                                                      "Steps: 4, Sampler: Euler a")
    again = api.txt2img(prompt="a red circle on a blue background", negative_prompt="blurry", seed=4, width=64,
                        height=64, cfg_scale=5, batch_size=2)
    np.testing.assert_array_equal(np.asarray(again.images[1]), np.asarray(result.images[1]))
    assert api.png_info(result.image).info == result.image.info["parameters"]


def test_img2img_and_inpainting_with_the_clients_defaults(api):
    circle = Image.fromarray(render("circle", "red", "blue"))
    plain = api.img2img(images=[circle], prompt="a red circle on a yellow background", seed=1, width=64, height=64,
                        denoising_strength=0.6)
    assert plain.image.size == (64, 64) and "Denoising strength: 0.6" in plain.image.info["parameters"]
    mask = Image.new("L", (64, 64))
    mask.paste(255, (0, 0, 64, 20))
    repainted = api.img2img(images=[circle], mask_image=mask, inpainting_fill=1, prompt="a yellow sky", seed=1,
                            width=64, height=64, denoising_strength=0.9)
    pixels, original = np.asarray(repainted.image.convert("RGB")), np.asarray(circle)
    np.testing.assert_array_equal(pixels[40:], original[40:])  # far from the blurred edge, the input as it was
    assert not np.array_equal(pixels[:10], original[:10])
    refused = pytest.raises(RuntimeError, api.img2img, images=[circle], mask_image=mask, prompt="x", width=64, height=64)
    assert refused.value.args[0] == 422 and "inpainting_fill 0" in refused.value.args[1]


def test_the_listing_calls(api):
    assert "Euler a" in api.util_get_sampler_names() and api.util_get_model_names() == ["default"]
    assert sorted(api.util_get_scheduler_names()) == ["automatic", "beta", "exponential", "karras"]
    assert api.util_get_current_model() == "default"
    assert api.get_upscalers() == [] and api.get_loras() == [] and api.get_sd_vae() == []
    assert api.get_scripts() == {"txt2img": [], "img2img": []} and not api.has_controlnet
    assert api.get_embeddings() == {"loaded": {}, "skipped": {}} and "ram" in api.get_memory()
    api.util_set_model("default")
    options = api.get_options()
    api.set_options(options)
    assert api.get_progress()["state"]["job_count"] == 0
    assert api.interrupt() == {} and api.skip() == {}
