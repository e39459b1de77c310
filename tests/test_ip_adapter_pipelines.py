"""IP-Adapter through `python -m sdx.sample --ip-adapter --ip-adapter-image` against diffusers' pipelines after
`load_ip_adapter` (its CLIP image encoder, its CLIPImageProcessor and its negative image embeddings), on tiny
random models, from the same initial noise.

Each adapter is a random file in the original layout for the tiny pipeline's UNet (`tests.test_ip_adapter`)
with a tiny transformers CLIPVisionModelWithProjection saved beside it in `image_encoder/`, the layout of
h94/IP-Adapter; the image prompt is a picture of another size and shape than the encoder's input, so the
resize and crop are covered. Latents and images are compared as in test_pipelines.py
(`tests.tiny_models.assert_parity`), and each test shows that the adapter and its scale move the result
(`assert_effect`, against diffusers' output without them).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image

from convert.library import ensure_sdx_folder
from pipelines.image_prompt import ImagePrompt
from pipelines.pipeline import Pipeline
from pipelines.request import Request
from sdx import ip_adapter as IP
from sdx.errors import SdxError
from sdx.sample import main
from tests.test_ip_adapter import EMBED, adapter_file
from tests.test_pipelines import (  # noqa: F401 (tiny: the fixture)
    input_image,
    latent_shape,
    noise_file,
    reference,
    sample,
    tiny,
)
from tests.tiny_models import assert_effect, assert_parity, perturb

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

STEPS = 4


def adapter_folder(pipe, kind: str, root, seed: int = 0):
    """root/ip-adapter.safetensors for pipe's UNet and root/image_encoder (a tiny CLIP vision model whose
    projection (plain) or hidden states (plus) are EMBED wide)."""
    config = transformers.CLIPVisionConfig(
        hidden_size=EMBED if kind == IP.PLUS else 16, projection_dim=EMBED, intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=2, image_size=32, patch_size=8, hidden_act="gelu",
    )
    torch.manual_seed(seed)
    encoder = transformers.CLIPVisionModelWithProjection(config).eval()
    perturb(encoder, torch.Generator().manual_seed(seed + 1))
    encoder.save_pretrained(root / "image_encoder")
    safetensors_torch.save_file(adapter_file(pipe.unet, kind, seed), str(root / "ip-adapter.safetensors"))
    return root / "ip-adapter.safetensors"


def prompt_picture(tmp_path, size=(50, 37)) -> tuple[str, Image.Image]:
    rng = np.random.default_rng(5)
    picture = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    path = tmp_path / "style.png"
    picture.save(path)
    return str(path), picture


def _diffusers(pipe, cls, root, scale: float):
    """`cls` over pipe's components with the adapter in `root` loaded (into pipe's own UNet: `unload_ip_adapter`
    when done)."""
    adapted = cls(**{**pipe.components, "image_encoder": None, "feature_extractor": None})
    adapted.load_ip_adapter(str(root), subfolder="", weight_name="ip-adapter.safetensors")
    adapted.set_ip_adapter_scale(scale)
    return adapted


@pytest.mark.parametrize("kind,model,adapter,scale", [
    ("sd15", "StableDiffusionPipeline", IP.PLAIN, 0.7),
    # SDXL without a negative prompt: zero text in the negative branch (blank rows), read with the adapter;
    # per-block scales (the up blocks left out: 0)
    ("sdxl", "StableDiffusionXLPipeline", IP.PLUS, {"down": 1.0, "mid": 0.5}),
])
def test_text_to_image_matches_diffusers(tiny, tmp_path, kind, model, adapter, scale):
    pipe, folder = tiny(kind)
    root = tmp_path / "adapter"
    root.mkdir()
    weights = adapter_folder(pipe, adapter, root)
    path, picture = prompt_picture(tmp_path)
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 2, 64, 64))
    negative = {"negative_prompt": ["dark", "blurry"]} if kind == "sd15" else {}
    run = dict(prompt=["a lighthouse", "a red kite"], latents=noise, num_inference_steps=STEPS, height=64, width=64,
               **negative)
    plain = reference(pipe, **run)
    adapted = _diffusers(pipe, getattr(diffusers, model), root, scale)
    ref = reference(adapted, ip_adapter_image=picture, **run)
    adapted.set_ip_adapter_scale(1.0)
    everywhere = reference(adapted, ip_adapter_image=picture, **run)
    adapted.unload_ip_adapter()
    args = ["--prompt", "a lighthouse", "a red kite", "--steps", str(STEPS), "--height", "64", "--width", "64",
            "--latents", str(latents)]
    if negative:
        args += ["--negative-prompt", "dark", "blurry"]
    ours = sample(tmp_path, folder, *args, "--ip-adapter", str(weights), "--ip-adapter-image", path,
                  "--ip-adapter-scale", json.dumps(scale))
    assert_parity(ours, ref)
    assert_effect("--ip-adapter", ref, plain)
    assert_effect(f"--ip-adapter-scale {json.dumps(scale)} (against 1)", ref, everywhere)


def test_instruct_pix2pix_reads_no_image_in_both_negative_branches(tiny, tmp_path):
    pipe, folder = tiny("pix2pix")
    scheduler = diffusers.EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    euler = type(pipe)(**{**pipe.components, "scheduler": scheduler})
    root = tmp_path / "adapter"
    root.mkdir()
    weights = adapter_folder(pipe, IP.PLAIN, root, seed=3)
    image_path, image = input_image(tmp_path)
    path, picture = prompt_picture(tmp_path, (31, 64))
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = dict(image=image, num_inference_steps=STEPS, guidance_scale=7.0, image_guidance_scale=1.7, latents=noise)
    plain = reference(euler, "make it snowy", **run)
    adapted = _diffusers(euler, diffusers.StableDiffusionInstructPix2PixPipeline, root, 0.8)
    ref = reference(adapted, "make it snowy", ip_adapter_image=picture, **run)
    adapted.unload_ip_adapter()
    ours = sample(tmp_path, folder, "--prompt", "make it snowy", "--image", str(image_path), "--steps", str(STEPS),
                  "--guidance-scale", "7", "--image-guidance-scale", "1.7", "--latents", str(latents),
                  "--scheduler", "euler", "--ip-adapter", str(weights), "--ip-adapter-image", path,
                  "--ip-adapter-scale", "0.8")
    assert_parity(ours, ref)
    assert_effect("--ip-adapter", ref, plain)


def test_scale_is_an_input_and_zero_is_no_adapter(tiny, tmp_path):
    """A new scale compiles nothing; at 0 the image is the one without an adapter (diffusers skips it then)."""
    pipe, folder = tiny("sd15")
    root = tmp_path / "adapter"
    root.mkdir()
    weights = adapter_folder(pipe, IP.PLAIN, root)
    _, picture = prompt_picture(tmp_path)
    folder = ensure_sdx_folder(folder, cache_dir=tmp_path)
    plain = Pipeline.load(folder)
    adapted = Pipeline.load(folder, ip_adapters=(str(weights),))  # the encoder: image_encoder/ beside the file
    prompt = ImagePrompt.of([picture], adapted)
    request = Request(prompts=["a kite"], height=64, width=64, steps=2, batch_size=1)
    images = {scale: adapted(dataclasses.replace(request, conditioning=[dataclasses.replace(prompt, scale=scale)]))
              for scale in (1.0, 0.5, 0.0)}
    assert adapted.sampler.compilations == 1
    np.testing.assert_array_equal(images[0.0], plain(request))
    moved = np.abs(images[1.0] - images[0.5]).mean()
    print(f"scale 1 against 0.5 moves the images by {moved:.3f} mean (scale 0 against no adapter: equal)")
    assert moved > 0.01
    with pytest.raises(SdxError, match=r"give one --ip-adapter-image per --ip-adapter \(1\), not 0"):
        adapted(request)
    with pytest.raises(SdxError, match=r"give one --ip-adapter-image per --ip-adapter \(0\), not 1"):
        plain(dataclasses.replace(request, conditioning=[prompt]))


def test_hub_file_fetches_the_encoder_beside_it(tmp_path, monkeypatch):
    """`--ip-adapter org/name/sub/file.safetensors` fetches that file and sub/image_encoder's config and
    safetensors weights, nothing else; a given encoder folder is not fetched."""
    from convert import hub
    from convert.sources import resolve_ip_adapter
    from tests.test_convert import FakeHub

    repo = tmp_path / "repo"
    for sub in ("models", "sdxl_models"):
        (repo / sub / "image_encoder").mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "pytorch_model.bin"):
            (repo / sub / "image_encoder" / name).write_text("x")
        for name in ("ip-adapter_x.safetensors", "ip-adapter_x.bin"):
            (repo / sub / name).write_text("x")
    fake = FakeHub("org/ip", repo, tmp_path / "cache")
    monkeypatch.setattr(hub, "reachable", lambda: True)  # the hub answers
    for name in ("list_repo_files", "snapshot_download"):
        monkeypatch.setattr(hub, name, getattr(fake, name))
    adapter, encoder = resolve_ip_adapter("org/ip/sdxl_models/ip-adapter_x.safetensors")
    assert fake.downloaded == {"sdxl_models/ip-adapter_x.safetensors", "sdxl_models/image_encoder/config.json",
                               "sdxl_models/image_encoder/model.safetensors"}
    assert adapter.is_file() and (encoder / "config.json").is_file()
    fake.downloaded.clear()
    _, encoder = resolve_ip_adapter("org/ip/sdxl_models/ip-adapter_x.safetensors", "org/ip/models/image_encoder")
    assert fake.downloaded == {"sdxl_models/ip-adapter_x.safetensors", "models/image_encoder/config.json",
                               "models/image_encoder/model.safetensors"}
    assert encoder.name == "image_encoder" and encoder.parent.name == "models"
    with pytest.raises(SdxError, match="has no file models/other.safetensors"):
        resolve_ip_adapter("org/ip/models/other.safetensors")
    with pytest.raises(SdxError, match="name the adapter's file"):
        resolve_ip_adapter("org/ip")


def test_bad_flags_fail_before_loading(tiny, tmp_path):
    _, folder = tiny("sd15")
    path, _ = prompt_picture(tmp_path)
    base = ["--model", str(folder), "--prompt", "x", "--output", str(tmp_path / "out"), "--cache", str(tmp_path / "c"),
            "--quiet"]
    assert main(base + ["--ip-adapter-image", path]) == 2  # no adapter
    assert main(base + ["--ip-adapter", str(tmp_path / "missing.safetensors"), "--ip-adapter-image", path]) == 2
    assert main(base + ["--ip-adapter", str(tmp_path / "ip-adapter_sd15.bin"), "--ip-adapter-image", path]) == 2
    lora_like = tmp_path / "lora.safetensors"
    safetensors_torch.save_file({"unet.x.lora_A.weight": torch.zeros(2, 2)}, str(lora_like))
    assert main(base + ["--ip-adapter", str(lora_like), "--ip-adapter-image", path]) == 2
    assert not (tmp_path / "c").exists()  # nothing was loaded or converted


def test_adapter_for_another_unet_or_encoder(tiny, tmp_path, capsys):
    pipe, folder = tiny("sd15")
    xl, _ = tiny("sdxl")
    root = tmp_path / "adapter"
    root.mkdir()
    weights = adapter_folder(xl, IP.PLAIN, root)
    path, _ = prompt_picture(tmp_path)
    base = ["--model", str(folder), "--prompt", "x", "--output", str(tmp_path / "out"), "--cache", str(tmp_path / "c"),
            "--quiet", "--ip-adapter-image", path, "--steps", "1"]
    assert main(base + ["--ip-adapter", str(weights)]) == 2
    assert "made for another UNet" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    weights = adapter_folder(pipe, IP.PLAIN, other)
    transformers.CLIPVisionModelWithProjection(transformers.CLIPVisionConfig(
        hidden_size=16, projection_dim=EMBED + 1, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=8)).save_pretrained(tmp_path / "wrong_encoder")
    assert main(base + ["--ip-adapter", str(weights), "--ip-adapter-image-encoder", str(tmp_path / "wrong_encoder")]) == 2
    assert "its image encoder gives 13-wide ones" in capsys.readouterr().err
    assert main(base + ["--ip-adapter", str(weights), "--ip-adapter-scale", '{"up": {"block_9": 1.0}}']) == 2
    assert "up has no block_9 with attentions" in capsys.readouterr().err
    assert main(base + ["--ip-adapter", str(weights), "--ip-adapter-scale", "high"]) == 2
    assert "neither a number nor a JSON object" in capsys.readouterr().err
