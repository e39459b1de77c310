"""LoRAs and embeddings given at start (--lora, --embedding): listed by name, and a prompt's `<lora:NAME:W>` taken
off when NAME is merged at W (the image is the command's with that --lora), refused otherwise."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file, save_file

from sdx import model_folder
from sdx.sample import main as sample
from tests.serve_helpers import Server, pixels

BODY = {"prompt": "a lighthouse", "steps": 3, "width": 64, "height": 64, "seed": 2}


@pytest.fixture(scope="module")
def case(demo_models, tmp_path_factory):
    """A diffusers-layout LoRA on one self-attention of `tiny_xl`'s UNet and an SDXL embedding of two vectors."""
    folder, where = demo_models("tiny_xl"), tmp_path_factory.mktemp("serve-loras")
    unet = load_file(folder / "unet.safetensors")
    key = next(k for k in unet if k.endswith("attn1.to_q.kernel"))
    cols, rows = unet[key].shape  # sdx kernels are (in, out)
    rng = np.random.default_rng(0)
    module = key.removesuffix(".kernel")
    save_file({f"unet.{module}.lora_A.weight": rng.normal(size=(4, cols)).astype(np.float32),
               f"unet.{module}.lora_B.weight": rng.normal(size=(rows, 4)).astype(np.float32)}, str(where / "style.safetensors"))
    spec = model_folder.read_spec(folder)["components"]
    widths = [spec[te]["config"]["hidden_size"] for te in ("text_encoder", "text_encoder_2")]
    save_file({"clip_l": rng.normal(size=(2, widths[0])).astype(np.float32),
               "clip_g": rng.normal(size=(2, widths[1])).astype(np.float32)}, str(where / "shiny.safetensors"))
    flags = ["--model", "tiny_xl", "--lora", f"{where / 'style.safetensors'}:0.5", "--embedding",
             f"{where / 'shiny.safetensors'}:<shiny>"]
    server = Server(*flags, cache=demo_models.cache)
    yield server, flags, where, demo_models.cache, widths
    assert server.stop() == 0


def test_they_are_listed_by_name(case):
    server, _, _, _, widths = case
    assert server.get("/sdapi/v1/loras").json() == [{"name": "style", "alias": "style", "path": "style",
                                                     "metadata": {"scale": 0.5}}]
    assert server.get("/sdapi/v1/embeddings").json() == {"loaded": {"<shiny>": {
        "step": None, "sd_checkpoint": None, "sd_checkpoint_name": None, "shape": widths[0], "vectors": 2}},
        "skipped": {}}


def test_a_merged_loras_tag_is_taken_off_and_another_refused(case):
    server, flags, where, cache, _ = case
    tagged = server.post("/sdapi/v1/txt2img", {**BODY, "prompt": "a lighthouse <lora:style:0.5>, <shiny>"})
    assert tagged.status_code == 200, tagged.text
    out = where / "out.png"
    assert sample([*flags, "--cache", str(cache), "--prompt", "a lighthouse , <shiny>", "--steps", "3", "--height",
                   "64", "--width", "64", "--seed", "2", "--guidance-scale", "7", "--scheduler", "euler",
                   "--long-prompt", "chunk", "--output", str(out), "--quiet"]) == 0
    np.testing.assert_array_equal(pixels(tagged.json()["images"][0]), np.asarray(Image.open(out).convert("RGB")))
    for tag in ("<lora:style:1>", "<lora:other:0.5>", "<hypernet:style:0.5>"):
        r = server.post("/sdapi/v1/txt2img", {**BODY, "negative_prompt": f"blurry {tag}"})
        assert r.status_code == 422 and f"negative_prompt: {tag}: this server merged its LoRAs at start (--lora): " \
                                        "<lora:style:0.5>" in r.json()["detail"], r.text
