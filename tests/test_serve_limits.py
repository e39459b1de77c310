"""What the server refuses, and how: bad values and what sdx cannot honour (422, one line naming the field, the
sampling command's words), its limits, oversized bodies (413), pictures from URLs or claiming too many pixels, and
requests without its HTTP Basic credentials (401 with WWW-Authenticate, on every route, the page and the API's own
documentation). The server stays up throughout and never answers 500."""

from __future__ import annotations

import base64
import struct
import zlib

import numpy as np
import pytest
import requests

from tests.serve_helpers import Server, b64_png

AUTH = ("user", "pass:word")
OK = {"prompt": "a red circle", "steps": 2, "width": 64, "height": 64, "seed": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server("--api-auth", "user:pass:word,other:x", "--max-steps", "20", "--max-pixels", str(128 * 128),
               "--max-prompt-length", "300", "--max-image-pixels", str(256 * 256), "--max-body-mb", "0.5",
               "--cors-allow-origins", "http://page.example:3000",
               cache=tmp_path_factory.mktemp("serve-cache"), auth=AUTH)
    yield s
    assert s.get("/sdapi/v1/sd-models").status_code == 200  # still up after everything below
    assert s.stop() == 0
    assert "Traceback" not in "".join(s.stderr)


def _png_claiming(width: int, height: int) -> str:
    """A PNG whose header claims width x height pixels, with no pixel data: a decompression bomb's header."""
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    return base64.b64encode(raw).decode()


TXT2IMG = [
    ({"steps": 0}, "steps 0 must be a positive integer"),
    ({"steps": 21}, "steps 21: more than this server's --max-steps 20"),
    ({"steps": "many"}, "steps: Input should be a valid integer"),
    ({"width": 101}, "--width 101: this model takes sizes that are positive multiples of"),
    ({"width": 128, "height": 128, "batch_size": 2}, "more than this server's --max-pixels 16384"),
    ({"prompt": "x" * 301}, "prompt: 301 characters, more than this server's --max-prompt-length 300"),
    ({"sampler_name": "DPM fast"}, "sampler_name: unknown scheduler 'DPM fast'"),
    ({"scheduler": "Uniform"}, "scheduler 'Uniform': this server has the schedule types Automatic, Karras"),
    ({"sampler_name": "DDIM", "scheduler": "Karras"}, "ddim has no karras sigmas"),
    ({"enable_hr": True}, "enable_hr True: sdx has no hires fix"),
    ({"eta": 0.5}, "eta 0.5: Euler has no eta"),
    ({"subseed_strength": 0.3}, "subseed_strength 0.3: sdx has no variation seeds"),
    ({"seed": -7}, "seed -7: -1 (a random seed) or a number from 0"),
    ({"styles": ["cinematic"]}, "styles ['cinematic']: this server has no prompt styles"),
    ({"prompt": "a cat <lora:style:0.7>"}, "prompt: <lora:style:0.7>: this server merged its LoRAs at start"),
    ({"override_settings": {"sd_model_checkpoint": "../../other.safetensors"}},
     "override_settings.sd_model_checkpoint '../../other.safetensors': this server serves 'default'"),
    ({"override_settings": {"sd_vae": "/tmp/vae.safetensors"}}, "override_settings.sd_vae '/tmp/vae.safetensors'"),
    ({"alwayson_scripts": {"ADetailer": {"args": [False]}}}, "alwayson_scripts: always on script ADetailer not found"),
]


@pytest.mark.parametrize("change, words", TXT2IMG, ids=[w.split(":")[0][:30] for _, w in TXT2IMG])
def test_txt2img_refuses_what_sdx_cannot_honour(server, change, words):
    r = server.post("/sdapi/v1/txt2img", {**OK, **change})
    assert r.status_code == 422 and words in r.json()["detail"], r.text
    assert "\n" not in r.json()["detail"]


IMAGE = b64_png(np.zeros((64, 64, 3), np.uint8))
IMG2IMG = [
    ({}, "init_images: give the image to start from"),
    ({"init_images": ["https://example.com/cat.png"]}, "init_images[0]: the server fetches no URLs"),
    ({"init_images": [_png_claiming(300, 300)]}, "init_images[0]: 300x300 is more than this server's --max-image-pixels"),
    ({"init_images": [_png_claiming(50_000, 50_000)]}, "init_images[0]: more pixels than this server's --max-image"),
    ({"init_images": ["bm90IGFuIGltYWdl"]}, "init_images[0]: cannot read the image"),
    ({"init_images": [IMAGE], "denoising_strength": 1.5}, "denoising_strength 1.5 must be in [0, 1]"),
    ({"init_images": [IMAGE], "resize_mode": 3, "width": 128}, "resize_mode 3: 0 (just resize), 1 (crop and resize)"),
    ({"init_images": [IMAGE], "mask": IMAGE}, "inpainting_fill 0: sdx starts from the image under the mask"),
    ({"init_images": [IMAGE], "mask": "data:image/png;base64,!!", "inpainting_fill": 1}, "mask: cannot read the image"),
    ({"init_images": [IMAGE], "mask_blur_x": 2, "mask_blur_y": 6, "mask": IMAGE, "inpainting_fill": 1},
     "mask_blur_x 2, mask_blur_y 6: sdx blurs a mask alike in both directions"),
    ({"init_images": [IMAGE, IMAGE]}, "init_images: 2 images; sdx starts a request's images from one"),
]


@pytest.mark.parametrize("change, words", IMG2IMG, ids=[w.split(":")[0][:30] for _, w in IMG2IMG])
def test_img2img_refuses_bad_pictures_and_what_sdx_cannot_honour(server, change, words):
    r = server.post("/sdapi/v1/img2img", {**OK, **change})
    assert r.status_code == 422 and words in r.json()["detail"], r.text


def test_bad_json_and_oversized_bodies(server):
    r = requests.post(server.url + "/sdapi/v1/txt2img", data=b"{not json", auth=AUTH,
                      headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 422 and "JSON" in r.json()["detail"], r.text
    big = {**OK, "prompt": "x", "comments": {"padding": "y" * 600_000}}
    r = server.post("/sdapi/v1/txt2img", big)
    assert r.status_code == 413 and "--max-body-mb 0.5" in r.json()["detail"]
    streamed = requests.post(server.url + "/sdapi/v1/txt2img", data=(b"y" * 65536 for _ in range(10)), auth=AUTH,
                             headers={"content-type": "application/json"}, timeout=60)  # no Content-Length
    assert streamed.status_code == 413


@pytest.mark.parametrize("path", ["/", "/docs", "/openapi.json", "/sdapi/v1/sd-models", "/sdapi/v1/progress",
                                  "/controlnet/model_list"])
def test_every_route_wants_the_credentials(server, path):
    for auth in (None, ("user", "wrong"), ("nobody", "pass:word"), ("other", "pass:word")):
        r = requests.get(server.url + path, auth=auth, timeout=60)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Basic"), (path, auth)
    assert server.get(path).status_code == 200
    assert server.get(path, auth=("other", "x")).status_code == 200


def test_a_post_without_credentials_runs_nothing(server):
    r = requests.post(server.url + "/sdapi/v1/txt2img", json=OK, timeout=60)
    assert r.status_code == 401
    r = server.post("/sdapi/v1/txt2img", OK)
    assert r.status_code == 200 and len(r.json()["images"]) == 1


def test_cors_lets_the_allowed_origin_call_the_api_and_no_other(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    r = requests.options(server.url + "/sdapi/v1/txt2img", headers={"Origin": "http://page.example:3000", **preflight},
                         timeout=60)  # a browser's preflight carries no credentials
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "http://page.example:3000"
    other = requests.options(server.url + "/sdapi/v1/txt2img", headers={"Origin": "http://elsewhere", **preflight},
                             timeout=60)
    assert "Access-Control-Allow-Origin" not in other.headers
    r = server.get("/sdapi/v1/sd-models", headers={"Origin": "http://page.example:3000"})
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "http://page.example:3000"
