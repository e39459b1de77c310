"""Conditioning plug-ins together, through `python -m sdx.sample` against diffusers where diffusers has the
combination, on tiny random models, float32, from the same initial noise, at `tests.tiny_models.Bar`:

- a ControlNet with Perturbed-Attention Guidance (SDXL: diffusers' StableDiffusionXLControlNetPAGPipeline);
- an IP-Adapter with Perturbed-Attention Guidance (SD 1.5: StableDiffusionPAGPipeline with `load_ip_adapter`);
- two IP-Adapters at once, each with its own image and scale (diffusers' list form of `load_ip_adapter`,
  `set_ip_adapter_scale` and `ip_adapter_image`), through the command and through `Pipeline`;
- a ControlNet, a T2I-Adapter and a LoRA together (SD 1.5: StableDiffusionControlNetPipeline with the LoRA fused
  and the adapter's feature maps passed to its UNet as diffusers' adapter pipeline passes them: diffusers has no
  pipeline with both).

Each run shows that every method in it moves diffusers' own result by at least ten times the bar
(`assert_effect`), so a plug-in dropped from the combination fails.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from convert.library import ensure_sdx_folder
from pipelines.image_prompt import ImagePrompt
from pipelines.pipeline import Pipeline
from pipelines.request import Request
from sdx.ip_adapter import PLAIN, PLUS
from tests.test_controlnet_pipelines import STEPS, control_image, controlnet  # noqa: F401 (controlnet: a fixture)
from tests.test_ip_adapter_pipelines import adapter_folder, prompt_picture
from tests.test_pipelines import latent_shape, noise_file, reference, sample, tiny  # noqa: F401 (tiny: a fixture)
from tests.test_t2i_adapter_pipelines import adapter  # noqa: F401 (a fixture)
from tests.tiny_models import assert_effect, assert_parity

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")


def test_controlnet_with_pag_sdxl(tiny, controlnet, tmp_path):
    pipe, folder = tiny("sdxl")
    net, net_folder = controlnet("sdxl")
    path, picture = control_image(tmp_path, (64, 64))
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    pag = diffusers.StableDiffusionXLControlNetPAGPipeline(**pipe.components, controlnet=net, pag_applied_layers=["mid"],
                                                           add_watermarker=False)
    run = dict(prompt="a tower", image=picture, latents=noise, num_inference_steps=STEPS, guidance_scale=5.0,
               height=64, width=64, pag_scale=3.0, controlnet_conditioning_scale=0.8)
    ref = reference(pag, **run)
    ours = sample(tmp_path, folder, "--prompt", "a tower", "--controlnet", str(net_folder), "--control-image", path,
                  "--controlnet-conditioning-scale", "0.8", "--pag-scale", "3", "--pag-layers", "mid",
                  "--guidance-scale", "5", "--steps", str(STEPS), "--latents", str(latents))
    assert_parity(ours, ref)
    assert_effect("--pag-scale 3 (with a ControlNet)", ref, reference(pag, **{**run, "pag_scale": 0.0}))
    assert_effect("--controlnet (with PAG)", ref, reference(pag, **{**run, "controlnet_conditioning_scale": 0.0}))


def _ip_pag(pipe, roots, layers):
    """diffusers' PAG pipeline over pipe's components with the IP-Adapters in `roots` loaded (unloaded after)."""
    pag = diffusers.StableDiffusionPAGPipeline(**{**pipe.components, "image_encoder": None, "feature_extractor": None},
                                               pag_applied_layers=layers)
    pag.load_ip_adapter([str(r) for r in roots], subfolder=[""] * len(roots),
                        weight_name=["ip-adapter.safetensors"] * len(roots))
    return pag


def test_ip_adapter_with_pag(tiny, tmp_path):
    pipe, folder = tiny("sd15")
    root = tmp_path / "ip"
    root.mkdir()
    weights = adapter_folder(pipe, PLAIN, root)
    path, picture = prompt_picture(tmp_path)
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    pag = _ip_pag(pipe, [root], ["mid"])
    pag.set_ip_adapter_scale(0.7)
    run = dict(prompt="a kite", negative_prompt="fog", latents=noise, num_inference_steps=4, guidance_scale=7.5,
               height=64, width=64, pag_scale=3.0, ip_adapter_image=picture)
    try:
        ref = reference(pag, **run)
        no_pag = reference(pag, **{**run, "pag_scale": 0.0})
        pag.set_ip_adapter_scale(0.0)
        no_ip = reference(pag, **run)
    finally:
        pag.unload_ip_adapter()
    ours = sample(tmp_path, folder, "--prompt", "a kite", "--negative-prompt", "fog", "--steps", "4",
                  "--guidance-scale", "7.5", "--latents", str(latents), "--height", "64", "--width", "64",
                  "--pag-scale", "3", "--pag-layers", "mid", "--ip-adapter", str(weights), "--ip-adapter-image", path,
                  "--ip-adapter-scale", "0.7")
    assert_parity(ours, ref)
    assert_effect("--pag-scale 3 (with an IP-Adapter)", ref, no_pag)
    assert_effect("--ip-adapter (with PAG)", ref, no_ip)


def test_two_ip_adapters_at_once(tiny, tmp_path):
    """A plus and a plain adapter, each its own image and scale, sharing the first one's image encoder (diffusers'
    pipelines hold one: the first adapter's folder's); the same through `Pipeline` with `ImagePrompt`s, and a new
    scale compiles nothing."""
    pipe, folder = tiny("sd15")
    roots = [tmp_path / "a", tmp_path / "b"]
    for root in roots:
        root.mkdir()
    files = [adapter_folder(pipe, PLUS, roots[0], seed=0), adapter_folder(pipe, PLAIN, roots[1], seed=3)]
    encoder = str(roots[0] / "image_encoder")  # it gives the plus adapter's hidden states and the plain one's embeddings
    (path_a, picture_a), (path_b, picture_b) = prompt_picture(tmp_path), prompt_picture(tmp_path / "b", (40, 40))
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    both = diffusers.StableDiffusionPipeline(**{**pipe.components, "image_encoder": None, "feature_extractor": None})
    both.load_ip_adapter([str(r) for r in roots], subfolder=["", ""], weight_name=["ip-adapter.safetensors"] * 2)
    run = dict(prompt="a kite", negative_prompt="fog", latents=noise, num_inference_steps=4, guidance_scale=7.5,
               height=64, width=64, ip_adapter_image=[picture_a, picture_b])
    try:
        both.set_ip_adapter_scale([0.6, 0.9])
        ref = reference(both, **run)
        both.set_ip_adapter_scale([0.6, 0.0])
        first_only = reference(both, **run)
        both.set_ip_adapter_scale([0.0, 0.9])
        second_only = reference(both, **run)
    finally:
        both.unload_ip_adapter()
    args = ["--prompt", "a kite", "--negative-prompt", "fog", "--steps", "4", "--guidance-scale", "7.5",
            "--latents", str(latents), "--height", "64", "--width", "64"]
    ours = sample(tmp_path, folder, *args, "--ip-adapter", str(files[0]), "--ip-adapter-image", path_a,
                  "--ip-adapter", str(files[1]), "--ip-adapter-image", path_b, "--ip-adapter-scale", "0.6",
                  "--ip-adapter-scale", "0.9", "--ip-adapter-image-encoder", encoder,
                  "--ip-adapter-image-encoder", encoder)
    assert_parity(ours, ref)
    assert_effect("the second --ip-adapter", ref, first_only)
    assert_effect("the first --ip-adapter", ref, second_only)

    adapted = Pipeline.load(ensure_sdx_folder(folder, cache_dir=tmp_path), ip_adapters=tuple(map(str, files)),
                            image_encoders=(encoder, encoder))
    request = lambda scales: Request(  # noqa: E731
        prompts=["a kite"], negative_prompts=["fog"], steps=4, guidance_scale=7.5, height=64, width=64,
        latents=noise.numpy(), conditioning=[ImagePrompt.of([picture_a], adapted, 0, scales[0]),
                                             ImagePrompt.of([picture_b], adapted, 1, scales[1])])
    api = adapted(request((0.6, 0.9)))
    np.testing.assert_allclose(api, ours.images.astype(np.float32) / 255, atol=1.5 / 255)
    adapted(request((0.2, 0.4)))
    assert adapted.sampler.compilations == 1


@contextlib.contextmanager
def _lora(pipe, path, scale: float):
    """diffusers' pipe with the LoRA at `path` fused at `scale` while the block runs (the tiny pipeline is shared)."""
    pipe.load_lora_weights(str(path))
    pipe.fuse_lora(lora_scale=scale)
    try:
        yield
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()


def _lora_file(pipe, folder) -> object:
    """A PEFT LoRA of pipe's UNet (attention projections), written as diffusers writes one."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    config = LoraConfig(r=4, lora_alpha=6, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    torch.manual_seed(5)
    pipe.unet.add_adapter(config, adapter_name="composition")
    layers = get_peft_model_state_dict(pipe.unet, adapter_name="composition")
    pipe.unet.delete_adapters("composition")
    type(pipe).save_lora_weights(folder, unet_lora_layers=layers)
    return folder / "pytorch_lora_weights.safetensors"


@contextlib.contextmanager
def _with_adapter(pipe, adapter_model, picture, scale: float):
    """pipe's UNet given the adapter's feature maps of `picture` at `scale` at every call, for every row of its
    batch, as diffusers' StableDiffusionAdapterPipeline gives them (`down_intrablock_additional_residuals`)."""
    pixels = torch.from_numpy(np.asarray(picture.convert("RGB"), np.float32) / 255.0).permute(2, 0, 1)[None]
    with torch.no_grad():
        state = [f * scale for f in adapter_model(pixels)]
    forward = pipe.unet.forward

    def adapted(sample, *args, **kwargs):
        rows = sample.shape[0]
        kwargs["down_intrablock_additional_residuals"] = [torch.cat([f] * rows) for f in state]
        return forward(sample, *args, **kwargs)

    pipe.unet.forward = adapted
    try:
        yield
    finally:
        pipe.unet.forward = forward


def test_controlnet_t2i_adapter_and_lora(tiny, controlnet, adapter, tmp_path):
    pipe, folder = tiny("sd15")
    net, net_folder = controlnet("sd15")
    adapter_model, adapter_folder_ = adapter("sd15")
    lora = _lora_file(pipe, tmp_path)
    path, picture = control_image(tmp_path, (64, 64))
    sketch_path, sketch = control_image(tmp_path, (64, 64), seed=3, name="sketch.png")
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    guided = diffusers.StableDiffusionControlNetPipeline(**pipe.components, controlnet=net)
    run = dict(prompt="a bridge", negative_prompt="rain", image=picture, latents=noise, num_inference_steps=STEPS,
               guidance_scale=7.5, height=64, width=64, controlnet_conditioning_scale=0.9)
    with _lora(guided, lora, 0.8):
        with _with_adapter(guided, adapter_model, sketch, 0.7):
            ref = reference(guided, **run)
            no_control = reference(guided, **{**run, "controlnet_conditioning_scale": 0.0})
        no_adapter = reference(guided, **run)
    with _with_adapter(guided, adapter_model, sketch, 0.7):
        no_lora = reference(guided, **run)
    ours = sample(tmp_path, folder, "--prompt", "a bridge", "--negative-prompt", "rain", "--controlnet",
                  str(net_folder), "--control-image", path, "--controlnet-conditioning-scale", "0.9", "--t2i-adapter",
                  str(adapter_folder_), "--t2i-adapter-image", sketch_path, "--t2i-adapter-scale", "0.7",
                  "--lora", f"{lora}:0.8", "--steps", str(STEPS), "--latents", str(latents))
    assert_parity(ours, ref)
    assert_effect("--controlnet (with an adapter and a LoRA)", ref, no_control)
    assert_effect("--t2i-adapter (with a ControlNet and a LoRA)", ref, no_adapter)
    assert_effect("--lora (with a ControlNet and an adapter)", ref, no_lora)
