"""The page at `/` in a real headless Chromium (Debian's, driven by Playwright): type a prompt, generate, see the
image, and check it is the API's image for the same settings; then start from a dropped image (img2img)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.serve_helpers import Server, b64_png, pixels
from train.shapes import render

CHROMIUM = "/usr/bin/chromium"  # Debian's, which `make test` installs (Playwright's own browsers are never fetched)
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--no-first-run"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server("--api-auth", "page:word", cache=tmp_path_factory.mktemp("serve-cache"), auth=("page", "word"))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def page(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        context = browser.new_context(http_credentials={"username": "page", "password": "word"})
        tab = context.new_page()
        tab.set_default_timeout(300_000)
        tab.goto(server.url + "/")
        tab.wait_for_function("document.querySelectorAll('#sampler option').length > 5")  # the API's samplers
        yield tab
        browser.close()


def _fill(page, **fields) -> None:
    for name, value in fields.items():
        page.fill(f"#{name}", str(value))


def _result(page, count: int) -> tuple[np.ndarray, str]:
    """The newest result's pixels (from its download link: the PNG itself) and its parameters text."""
    page.wait_for_function(f"document.querySelectorAll('#results figure').length >= {count}")
    href = page.get_attribute("#results figure:first-child a", "href")
    assert page.get_attribute("#results figure:first-child a", "download").endswith(".png")
    return pixels(href.split(",", 1)[1]), page.inner_text("#results figure:first-child pre")


def test_the_page_generates_the_apis_image(server, page):
    assert page.input_value("#width") == "64" and page.input_value("#cfg") == "2"  # the default model's own
    _fill(page, prompt="a red circle on a blue background", negative="", steps=4, seed=11, batch=2)
    page.select_option("#sampler", "Euler a")
    page.click("#generate")
    page.wait_for_selector("#interrupt:disabled")
    shown, text = _result(page, 2)
    assert "Seed: 12," in page.inner_text("#results figure:nth-child(2) pre")  # the request's images in order
    assert page.inner_text("#error") == "" and page.eval_on_selector("#progress", "e => e.style.width") == "100%"
    body = {"prompt": "a red circle on a blue background", "negative_prompt": "", "steps": 4, "seed": 11,
            "width": 64, "height": 64, "sampler_name": "Euler a", "cfg_scale": 2.0, "batch_size": 2}
    r = server.post("/sdapi/v1/txt2img", body)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(shown, pixels(r.json()["images"][0]))
    assert text.startswith("a red circle on a blue background\nSteps: 4, Sampler: Euler a, CFG scale: 2.0, Seed: 11")


def test_a_dropped_image_is_the_start_of_img2img(server, page):
    circle = render("circle", "red", "blue")
    page.evaluate("""([b64]) => {
        const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
        const data = new DataTransfer();
        data.items.add(new File([bytes], "circle.png", {type: "image/png"}));
        document.getElementById("drop").dispatchEvent(new DragEvent("drop", {dataTransfer: data, bubbles: true}));
    }""", [b64_png(circle)])
    page.wait_for_selector("#init:not([hidden])")
    _fill(page, prompt="a red circle on a yellow background", steps=5, seed=3, strength=0.6, batch=1)
    page.click("#generate")
    page.wait_for_selector("#interrupt:disabled")
    shown, text = _result(page, 3)
    assert "Denoising strength: 0.6" in text
    body = {"prompt": "a red circle on a yellow background", "negative_prompt": "", "steps": 5, "seed": 3,
            "width": 64, "height": 64, "sampler_name": "Euler a", "cfg_scale": 2.0, "denoising_strength": 0.6,
            "init_images": [b64_png(circle)]}
    r = server.post("/sdapi/v1/img2img", body)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(shown, pixels(r.json()["images"][0]))
