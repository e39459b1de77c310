"""`python -m sdx.serve` over plain HTTP: A1111's routes, and images equal to `python -m sdx.sample`'s for the same
settings (their 8-bit pixels), for text-to-image, img2img and inpainting (the kept pixels put back, or a crop
around the mask pasted back)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from sdx.sample import main as sample
from tests.serve_helpers import Server, b64_png, parameters, pixels
from train.shapes import render

PROMPT = "a red circle on a blue background"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("serve-cache")
    s = Server(cache=cache)
    s.cache = cache
    yield s
    assert s.stop() == 0


def _command(server, where, *flags: str) -> list[np.ndarray]:
    out = where / "out"
    assert sample(["--model", "default", "--cache", str(server.cache), "--output", str(out), "--quiet",
                   "--long-prompt", "chunk", "--overwrite", *flags]) == 0
    return [np.asarray(Image.open(p).convert("RGB")) for p in sorted(out.glob("*.png"))]


def test_txt2img_gives_the_commands_images_and_a1111s_info(server, tmp_path):
    body = {"prompt": PROMPT, "negative_prompt": "", "steps": 5, "width": 64, "height": 64, "seed": 5,
            "batch_size": 2, "cfg_scale": 6.5, "sampler_name": "DPM++ 2M", "scheduler": "Karras",
            "some_field_of_an_extension": {"ignored": True}}
    r = server.post("/sdapi/v1/txt2img", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    ours = [pixels(b) for b in answer["images"]]
    theirs = _command(server, tmp_path, "--prompt", PROMPT, "--steps", "5", "--height", "64", "--width", "64",
                      "--seed", "5", "--num-images", "2", "--batch-size", "2", "--guidance-scale", "6.5",
                      "--scheduler", "dpmpp_2m_karras")
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)
    info = json.loads(answer["info"])
    assert info["all_seeds"] == [5, 6] and info["seed"] == 5 and info["all_prompts"] == [PROMPT, PROMPT]
    assert (info["width"], info["height"], info["steps"], info["cfg_scale"]) == (64, 64, 5, 6.5)
    assert info["sampler_name"] == "DPM++ 2M" and info["sd_model_name"] == "default"
    for k, image in enumerate(answer["images"]):
        text = parameters(image)
        assert text == info["infotexts"][k]
        assert text.startswith(f"{PROMPT}\nSteps: 5, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 6.5, "
                               f"Seed: {5 + k}, Size: 64x64, Model: default")
    assert answer["parameters"]["prompt"] == PROMPT and "some_field_of_an_extension" not in answer["parameters"]


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    where = tmp_path_factory.mktemp("pictures")
    circle = render("circle", "red", "blue")
    mask = np.zeros(circle.shape[:2], np.uint8)
    mask[: circle.shape[0] // 3] = 255
    Image.fromarray(circle).save(where / "in.png")
    Image.fromarray(mask).save(where / "mask.png")
    return where, circle, mask


@pytest.mark.parametrize("case", ["img2img", "inpaint", "inpaint crop"])
def test_img2img_gives_the_commands_images(server, picture, tmp_path, case):
    where, circle, mask = picture
    body = {"prompt": "a red circle on a yellow background", "init_images": ["data:image/png;base64," + b64_png(circle)],
            "steps": 6, "width": 64, "height": 64, "seed": 2, "denoising_strength": 0.7, "sampler_name": "Euler a"}
    flags = ["--prompt", body["prompt"], "--image", str(where / "in.png"), "--steps", "6", "--height", "64",
             "--width", "64", "--seed", "2", "--strength", "0.7", "--scheduler", "euler_a", "--guidance-scale", "7"]
    if case != "img2img":
        body.update(mask=b64_png(mask), mask_blur=3, inpainting_fill=1, inpaint_full_res=case == "inpaint crop",
                    inpaint_full_res_padding=4)
        flags += ["--mask", str(where / "mask.png"), "--mask-blur", "3"]
        flags += ["--padding-mask-crop", "4"] if case == "inpaint crop" else ["--apply-overlay"]
    r = server.post("/sdapi/v1/img2img", body)
    assert r.status_code == 200, r.text
    (ours,), (theirs,) = [pixels(b) for b in r.json()["images"]], _command(server, tmp_path, *flags)
    np.testing.assert_array_equal(ours, theirs)
    assert "Denoising strength: 0.7" in parameters(r.json()["images"][0])
    assert ("Mask blur: 3" in parameters(r.json()["images"][0])) == (case != "img2img")
    assert r.json()["parameters"]["init_images"] is None  # include_init_images false, as A1111


def test_the_listing_routes(server):
    get = lambda path: server.get(path).json()
    names = [s["name"] for s in get("/sdapi/v1/samplers")]
    assert {"Euler", "Euler a", "DPM++ 2M", "DPM++ 2M SDE", "DDIM", "UniPC", "LCM"} <= set(names)
    assert [s["label"] for s in get("/sdapi/v1/schedulers")] == ["Automatic", "Karras", "Exponential", "Beta"]
    assert get("/sdapi/v1/sd-models") == [{"title": "default", "model_name": "default", "hash": None,
                                            "sha256": None, "filename": "default", "config": None}]
    assert get("/sdapi/v1/sd-vae") == [] and get("/sdapi/v1/upscalers") == [] and get("/sdapi/v1/loras") == []
    assert get("/sdapi/v1/scripts") == {"txt2img": [], "img2img": []}
    assert get("/sdapi/v1/embeddings") == {"loaded": {}, "skipped": {}}
    memory = get("/sdapi/v1/memory")
    assert memory["ram"]["total"] > memory["ram"]["used"] > 0 and "cuda" in memory
    assert get("/sdapi/v1/progress")["state"]["job_count"] == 0  # nothing of this caller runs
    assert server.get("/docs").status_code == 200
    schema = get("/openapi.json")["components"]["schemas"]
    assert schema["Txt2Img"]["properties"]["sampler_index"]["default"] == "Euler"
    assert schema["Img2Img"]["properties"]["denoising_strength"]["default"] == 0.75
    assert "<title>" in server.get("/").text
    assert server.get("/sdapi/v1/cmd-flags").status_code == 404  # nothing that would show flags or paths


def test_options_take_the_whole_dict_back_and_refuse_other_models(server):
    options = server.get("/sdapi/v1/options").json()
    assert options["sd_model_checkpoint"] == "default" and options["CLIP_stop_at_last_layers"] == 1
    assert server.post("/sdapi/v1/options", {**options, "CLIP_stop_at_last_layers": 2}).status_code == 200
    assert server.get("/sdapi/v1/options").json()["CLIP_stop_at_last_layers"] == 2
    assert server.post("/sdapi/v1/options", options).status_code == 200  # as Open WebUI sends it back
    r = server.post("/sdapi/v1/options", {"sd_model_checkpoint": "/etc/passwd"})
    assert r.status_code == 422 and "this server serves 'default'" in r.json()["detail"]
    assert server.get("/sdapi/v1/options").json() == options


def test_clip_skip_is_the_commands_clip_skip_less_one(server, tmp_path):
    body = {"prompt": PROMPT, "steps": 3, "width": 64, "height": 64, "seed": 9,
            "override_settings": {"CLIP_stop_at_last_layers": 2}}
    r = server.post("/sdapi/v1/txt2img", body)
    assert r.status_code == 200, r.text
    theirs, = _command(server, tmp_path, "--prompt", PROMPT, "--steps", "3", "--height", "64", "--width", "64",
                       "--seed", "9", "--scheduler", "euler", "--guidance-scale", "7", "--clip-skip", "1")
    np.testing.assert_array_equal(pixels(r.json()["images"][0]), theirs)
    assert "Clip skip: 2" in parameters(r.json()["images"][0])


def test_png_info_reads_the_parameters_back(server):
    text = 'a "quoted", prompt\nNegative prompt: dull\nSteps: 4, Sampler: Euler a, Seed: 3, Size: 64x48, Model: x'
    image = np.zeros((8, 8, 3), np.uint8)
    from serve.images import b64, png

    r = server.post("/sdapi/v1/png-info", {"image": "data:image/png;base64," + b64(png(image, text))})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["info"] == text and got["items"] == {}
    assert got["parameters"] | {} == {"Prompt": 'a "quoted", prompt', "Negative prompt": "dull", "Steps": "4",
                                      "Sampler": "Euler a", "Seed": "3", "Size": "64x48", "Size-1": "64",
                                      "Size-2": "48", "Model": "x"}


def test_each_images_infotext_seed_reproduces_it_alone(server):
    """A1111's all_seeds: image j of a request seeded s is the image seeded s + j alone (one image a call, where
    XLA's kernels round otherwise than in a call of three: at most one 8-bit level, serve/batcher.py)."""
    body = {"prompt": PROMPT, "steps": 3, "width": 64, "height": 64, "seed": 20, "batch_size": 3}
    together = server.post("/sdapi/v1/txt2img", body).json()["images"]
    for image in together:
        seed = int(parameters(image).split("Seed: ")[1].split(",")[0])
        alone = server.post("/sdapi/v1/txt2img", {**body, "seed": seed, "batch_size": 1}).json()["images"][0]
        apart = np.abs(pixels(image).astype(int) - pixels(alone))
        print(f"seed {seed}: alone against in a batch of 3, 8-bit max {apart.max()}, mean {apart.mean():.4f}")
        assert apart.max() <= 1 and apart.mean() < 0.01
