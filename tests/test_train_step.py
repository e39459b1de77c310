"""The training step: its loss and gradients against diffusers' UNet + DDPMScheduler in PyTorch for the same
batch, noise, timesteps and dropout (and a LoRA's against peft's); gradient accumulation equals the big batch; a tiny model overfits; the
loop's step is kept by `pipelines.executables`, keyed by its settings, and read back untraced."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pipelines import executables
from pipelines.family import Family
from sdx import mesh as meshlib
from sdx import clip, lora, schedulers, unet as U, weights as W
from sdx.vae import VAEConfig
from train import denoise, objective
from train import ema as emalib
from train import lr as lrlib
from train import optimizer as optlib
from train import step as steplib

torch = pytest.importorskip("torch")
F = torch.nn.functional
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

XL_UNET = dict(
    block_out_channels=[32, 64], layers_per_block=1, down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"], attention_head_dim=[2, 4], cross_attention_dim=32,
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=16 + 6 * 8, norm_num_groups=16,
)
SCHED = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
VAE = VAEConfig(scaling_factor=0.13025, latent_channels=4, block_out_channels=(32,), norm_num_groups=8)


def _models(in_channels: int, seed: int = 0, config=XL_UNET):
    torch.manual_seed(seed)
    ref = diffusers.UNet2DConditionModel(**config, in_channels=in_channels)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    cfg = U.UNetConfig.from_diffusers_config({**config, "in_channels": in_channels})
    state = {k: v.numpy() for k, v in ref.state_dict().items()}
    model = W.load_torch_state(W.abstract(lambda r: U.UNet2DConditionModel(cfg, rngs=r)), state, where="test")
    return ref, model


def _batch(n: int, pix2pix: bool, seed: int = 0) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    b = {
        "moments": np.concatenate([r.standard_normal((n, 8, 8, 4)), r.uniform(-3, -1, (n, 8, 8, 4))], -1).astype(np.float32),
        "context": r.standard_normal((n, 7, 32)).astype(np.float32),
        "pooled": r.standard_normal((n, 16)).astype(np.float32),
        "time_ids": np.tile(np.array([[96, 80, 8, 0, 64, 64]], np.float32), (n, 1)),
        "index": np.arange(100, 100 + n),
    }
    if pix2pix:
        b["image_latents"] = r.standard_normal((n, 8, 8, 4)).astype(np.float32)
    return b


NULL = {"context": np.full((7, 32), 0.25, np.float32), "pooled": np.full((16,), -0.5, np.float32)}


def _nchw(x) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x).transpose(0, 3, 1, 2)))


CASES = [
    dict(pix2pix=False, prediction_type="epsilon", snr_gamma=None, noise_offset=0.0, input_perturbation=0.0, p=0.0),
    dict(pix2pix=False, prediction_type="v_prediction", snr_gamma=5.0, noise_offset=0.1, input_perturbation=0.1, p=0.5),
    dict(pix2pix=True, prediction_type="epsilon", snr_gamma=5.0, noise_offset=0.0, input_perturbation=0.0, p=0.2),
]


def _loss_config(case) -> denoise.DenoiseConfig:
    fam = Family(xl=True, pix2pix=case["pix2pix"], aesthetic=False, encoders=("text_encoder", "text_encoder_2"),
                 force_zeros=True)
    sched = schedulers.from_name("ddpm", {**SCHED, "prediction_type": case["prediction_type"]})
    return denoise.DenoiseConfig(
        family=fam, scheduler=sched, vae=VAE, prediction_type=case["prediction_type"], snr_gamma=case["snr_gamma"],
        noise_offset=case["noise_offset"], input_perturbation=case["input_perturbation"],
        text_drop=case["p"], conditioning_dropout=case["p"],
    )


def _reference_loss(ref, case, batch, keys, conditioning=None, reduce=None, controlnet=None, dream=None,
                    pixel=None) -> torch.Tensor:
    """diffusers' training loss of `ref` (train_text_to_image.py / train_instruct_pix2pix.py) for `batch`, with
    the draws sdx's loss takes from `keys` (latent sample, noise, timesteps, dropout). conditioning: the
    dropped samples (bool numpy [B]) -> (context, pooled or None) in torch (default: the batch's, NULL where
    dropped); reduce(pred, target, scheduler, timesteps) -> the loss (default: `_mse` of the case);
    controlnet: a diffusers ControlNetModel steering `ref` from batch["control"]; dream: DREAM's detail
    preservation (diffusers.training_utils.compute_dream_and_update_latents, as train_text_to_image.py);
    pixel(pred, noisy, latents, timesteps) -> a term added to the loss (noisy: the UNet's noisy latents, without
    InstructPix2Pix's image latents)."""
    reduce = reduce or (lambda *a: _mse(*a, case["snr_gamma"], case["prediction_type"]))
    cfg = _loss_config(case)
    latents = objective.sample_latents(keys, jnp.asarray(batch["moments"]), VAE)
    noise, noise_in = objective.noise(keys, latents.shape[1:], cfg.noise_offset, cfg.input_perturbation)
    t = objective.timesteps(keys, 1000)
    if case["pix2pix"]:
        drop_text, drop_image = objective.conditioning_dropout(keys, case["p"])
    else:
        drop_text, drop_image = objective.empty_prompt(keys, case["p"]), None
    assert 0 < int(drop_text.sum()) < len(t) or case["p"] == 0  # the case exercises both branches

    ts = diffusers.DDPMScheduler(**SCHED, prediction_type=case["prediction_type"])
    tt = torch.from_numpy(np.array(t)).long()
    x0, eps = _nchw(latents), _nchw(noise)
    noisy = ts.add_noise(x0, _nchw(noise_in), tt)
    if conditioning is None:
        dt = torch.from_numpy(np.array(drop_text))
        ctx = torch.where(dt[:, None, None], torch.from_numpy(NULL["context"]), torch.from_numpy(batch["context"]))
        pooled = torch.where(dt[:, None], torch.from_numpy(NULL["pooled"]), torch.from_numpy(batch["pooled"]))
    else:
        ctx, pooled = conditioning(np.array(drop_text))
    noisy_latents = noisy
    if case["pix2pix"]:
        keep = 1.0 - torch.from_numpy(np.array(drop_image)).float()
        noisy = torch.cat([noisy, _nchw(batch["image_latents"]) * keep[:, None, None, None]], dim=1)
    added = None if pooled is None else {"text_embeds": pooled, "time_ids": torch.from_numpy(batch["time_ids"])}
    target = eps if case["prediction_type"] == "epsilon" else ts.get_velocity(x0, eps, tt)
    if dream is not None:
        from diffusers.training_utils import compute_dream_and_update_latents

        noisy, target = compute_dream_and_update_latents(ref, ts, tt, eps, noisy, target, ctx, dream)
    residuals = {}
    if controlnet is not None:  # train_controlnet_sdxl.py: the ControlNet's residuals into the UNet
        down, mid = controlnet(noisy, tt, encoder_hidden_states=ctx, added_cond_kwargs=added, return_dict=False,
                               controlnet_cond=_nchw(batch["control"]))
        residuals = {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}
    pred = ref(noisy, tt, ctx, added_cond_kwargs=added, **residuals).sample
    loss = reduce(pred, target, ts, tt)
    return loss if pixel is None else loss + pixel(pred, noisy_latents, x0, tt)


def _mse(pred, target, ts, tt, snr_gamma, prediction_type) -> torch.Tensor:
    """diffusers' train_text_to_image.py loss: the MSE, min-SNR weighted when snr_gamma is given."""
    if snr_gamma is None:
        return torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="mean")
    from diffusers.training_utils import compute_snr  # as diffusers' train_text_to_image.py

    snr = compute_snr(ts, tt)
    w = torch.stack([snr, snr_gamma * torch.ones_like(tt)], dim=1).min(dim=1)[0]
    w = w / snr if prediction_type == "epsilon" else w / (snr + 1)
    return (torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=[1, 2, 3]) * w).mean()


def _relative_error(ours, theirs: torch.Tensor) -> float:
    theirs = theirs.numpy()
    return float(np.abs(np.asarray(ours) - theirs).max() / np.abs(theirs).max())


LOSS_RTOL, GRAD_TOL = 2e-5, 1e-4


def _check_loss(loss, ref_loss: torch.Tensor) -> None:
    ours, theirs = float(loss), ref_loss.item()
    print(f"loss {ours} (diffusers {theirs}): relative difference {abs(ours - theirs) / abs(theirs):.1e}, "
          f"tolerance {LOSS_RTOL}")
    np.testing.assert_allclose(ours, theirs, rtol=LOSS_RTOL)


def _check_gradients(errors: dict, what: str = "parameters") -> None:
    """errors: {parameter: its gradient's largest difference from the reference's, relative to the reference
    gradient's largest magnitude}; each under `GRAD_TOL`, the worst one named."""
    worst = max(errors, key=errors.get)
    name = ".".join(map(str, worst)) if isinstance(worst, tuple) else worst
    print(f"gradients of {len(errors)} {what}: largest relative error {errors[worst]:.1e} ({name}), "
          f"tolerance {GRAD_TOL}")
    assert errors[worst] < GRAD_TOL, sorted(errors.items(), key=lambda item: -item[1])[:10]


def _check_every_gradient(grads: nnx.State, ref: torch.nn.Module) -> None:
    """sdx's gradient of every parameter (`grads`, the paths of diffusers' keys) against the gradient of the
    same parameter of `ref` after its backward pass, in torch's layout (`weights.to_torch_keys`)."""
    ours = W.to_torch_keys({".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)})
    theirs = dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    _check_gradients({k: _relative_error(ours[k], theirs[k].grad) for k in ours})


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_match_diffusers(case):
    """Same draws on both sides (taken from sdx's per-sample keys): the loss and every parameter's gradient
    equal diffusers' in float32."""
    ref, model = _models(8 if case["pix2pix"] else 4)
    batch = _batch(6, case["pix2pix"])
    graphdef, params = nnx.split(model)
    keys = steplib.sample_keys(jax.random.key(3), jnp.int32(7), jnp.asarray(batch["index"]))
    fn = denoise.loss_fn(graphdef, _loss_config(case))
    (loss, _), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(params, jax.tree.map(jnp.asarray, batch), keys,
                                                                     jax.tree.map(jnp.asarray, NULL))
    ref_loss = _reference_loss(ref, case, batch, keys)
    ref_loss.backward()

    _check_loss(loss, ref_loss)
    _check_every_gradient(grads, ref)


def test_lora_loss_and_gradients_match_peft():
    """LoRA of rank 4 and alpha 8 (scale 2): diffusers' UNet with peft's adapters as train_text_to_image_lora.py
    adds them (LoraConfig on to_q, to_k, to_v, to_out.0) against sdx's (`sdx.lora`, trained as train/loop.py
    does: the adapters the parameters, the UNet in the constants, `step.trained_in_part`), the same weights (lora_B
    random, not peft's zeros, so that every adapter has a gradient; sdx's blocks rematerialised): the same
    adapted layers, the same loss, and the gradient of every adapter equal in float32."""
    from peft import LoraConfig

    case = CASES[1]
    ref, model = _models(4)
    ref.requires_grad_(False)
    ref.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=list(lora.TARGETS)))
    count = lora.attach(model, 4, 8.0, jax.random.key(5))
    assert count == sum(1 for m in ref.modules() if hasattr(m, "lora_A")) > 0
    theirs = _shared_adapters(model, lambda path: ref.get_submodule(".".join(map(str, path))))

    batch = _batch(6, False)
    keys = steplib.sample_keys(jax.random.key(3), jnp.int32(7), jnp.asarray(batch["index"]))
    model.remat = True  # --gradient_checkpointing: blocks rematerialised around adapters and constants alike
    graphdef, params, base = nnx.split(model, lora.LoRAParam, ...)
    fn, constants = steplib.trained_in_part(denoise.loss_fn(graphdef, _loss_config(case)),
                                            jax.tree.map(jnp.asarray, NULL), base)
    (loss, _), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(params, jax.tree.map(jnp.asarray, batch), keys,
                                                                     constants)
    ref_loss = _reference_loss(ref, case, batch, keys)
    ref_loss.backward()

    _check_loss(loss, ref_loss)
    errors = {path: _relative_error(np.asarray(ours).T, theirs[path].grad) for path, ours in
              ((p, v.get_value()) for p, v in nnx.to_flat_state(grads))}
    assert errors.keys() == theirs.keys()
    _check_gradients(errors, "adapter weights")


SD_UNET = {k: v for k, v in XL_UNET.items() if k not in ("addition_embed_type", "addition_time_embed_dim",
                                                             "projection_class_embeddings_input_dim")}
# family -> the UNet's config and each text encoder's (hidden size, projection): SDXL's context is both
# encoders' hidden states side by side (16 + 16 = the UNet's 32) and its pooled embedding the second's projection
TEXT_CASES = {"sdxl": (XL_UNET, ((16, None), (16, 16))), "sd": (SD_UNET, ((32, None),))}


def _text_encoder(hidden: int, projection: int | None, seed: int):
    """(transformers' CLIP text model with every parameter perturbed, sdx's with the same weights)."""
    from tests.helpers_text import perturbed_clip

    hf = transformers.CLIPTextConfig(vocab_size=49408, hidden_size=hidden, intermediate_size=2 * hidden,
                                     num_hidden_layers=2, num_attention_heads=2, projection_dim=projection or hidden,
                                     eos_token_id=49407, bos_token_id=49406, pad_token_id=1)
    ref, state = perturbed_clip(hf, with_projection=projection is not None, seed=seed)
    cfg = clip.TextEncoderConfig.from_diffusers_config(hf.to_dict() | {"architectures": [type(ref).__name__]})
    model = W.load_torch_state(W.abstract(lambda r: clip.CLIPTextModel(cfg, rngs=r)),
                               clip.transformers_state(state, where="test"), where="test")
    return ref, model


@pytest.mark.parametrize("family", TEXT_CASES)
def test_text_encoder_lora_loss_and_gradients_match_peft(family):
    """--train_text_encoder: peft's adapters on the text encoders' q_proj, k_proj, v_proj and out_proj (as
    train_text_to_image_lora_sdxl.py adds them) and on the UNet, the text encoded from token ids inside the
    step, against sdx's (the UNet and the encoders one module, `denoise` with `text_dtype`): the same loss and
    the gradient of every adapter, the encoders' included, in float32. A dropped caption: SDXL's zeros after
    encoding (force_zeros_for_empty_prompt); SD's empty prompt's ids through the adapted encoder (diffusers'
    "" caption), which a frozen null context would miss. SDXL's case rematerialises the UNet's blocks and the
    encoders' layers (--gradient_checkpointing)."""
    from peft import LoraConfig
    from tests.helpers_text import random_ids

    unet_config, encoder_shapes = TEXT_CASES[family]
    xl = family == "sdxl"
    case = CASES[1]  # v-prediction, min-SNR, offset noise, input perturbation, half the captions dropped
    ref, unet = _models(4, config=unet_config)
    refs, models = {"unet": ref}, {"unet": unet}
    names = ("text_encoder", "text_encoder_2")[:len(encoder_shapes)]
    for i, (name, (hidden, projection)) in enumerate(zip(names, encoder_shapes)):
        refs[name], models[name] = _text_encoder(hidden, projection, seed=10 + i)
    for name, r in refs.items():
        r.requires_grad_(False)
        r.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                 target_modules=list(lora.TARGETS if name == "unet" else lora.TEXT_TARGETS)))
        lora.attach(models[name], 4, 8.0, jax.random.key(5), targets=lora.TARGETS if name == "unet" else lora.TEXT_TARGETS)
    if xl:  # --gradient_checkpointing: the UNet's blocks and the encoders' layers rematerialised
        unet.remat = True
        for name in names:
            models[name].text_model.encoder.remat = True
    module = nnx.Dict(models)

    def layer_of(path):  # transformers 5's CLIPTextModel has no text_model level (WithProjection has)
        r, name = refs[path[0]], ".".join(map(str, path[1:]))
        return r.get_submodule(name if hasattr(r, "text_model") else name.removeprefix("text_model."))

    theirs = _shared_adapters(module, layer_of)
    assert {p[0] for p in theirs} == set(refs)

    batch = {k: v for k, v in _batch(6, False).items() if k not in ("context", "pooled")}
    pads = (49407, 0)  # SDXL's first tokenizer pads with EOS, its second with "!"
    batch["ids"] = np.stack([random_ids(6, pad_id=pads[j], seed=20 + j) for j in range(len(names))], axis=1)  # (B, E, 77)
    empty = np.full((len(names), 77), 49407, np.int32)  # "": BOS, then EOS padded with EOS
    empty[:, 0] = 49406
    fam = Family(xl=xl, pix2pix=False, aesthetic=False, encoders=names, force_zeros=xl)
    null = {"context": np.zeros((77, 32), np.float32), "pooled": np.zeros((16,), np.float32)} if xl else {"ids": empty}
    cfg = dataclasses.replace(_loss_config(case), family=fam, text_dtype="float32")
    graphdef, params, base = nnx.split(module, lora.LoRAParam, ...)
    fn, constants = steplib.trained_in_part(denoise.loss_fn(graphdef, cfg), jax.tree.map(jnp.asarray, null), base)
    keys = steplib.sample_keys(jax.random.key(3), jnp.int32(7), jnp.asarray(batch["index"]))
    (loss, _), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(params, jax.tree.map(jnp.asarray, batch), keys,
                                                                     constants)

    def conditioning(dropped):
        ids = torch.from_numpy(batch["ids"]).long()
        drop = torch.from_numpy(dropped)
        if not xl:
            ids = torch.where(drop[:, None, None], torch.from_numpy(empty).long()[None], ids)
        outs = [refs[n](ids[:, j], output_hidden_states=True) for j, n in enumerate(names)]
        if not xl:
            return outs[0].last_hidden_state, None
        keep = (~drop).float()
        context = torch.cat([o.hidden_states[-2] for o in outs], dim=-1) * keep[:, None, None]
        return context, outs[1].text_embeds * keep[:, None]

    ref_loss = _reference_loss(ref, case, batch, keys, conditioning)
    ref_loss.backward()

    _check_loss(loss, ref_loss)
    ours = {p: np.asarray(v.get_value()).T for p, v in nnx.to_flat_state(grads)}
    assert ours.keys() == theirs.keys()
    # SDXL reads the first encoder's next-to-last hidden state: its last layer has no gradient on either side
    unused = {p for p, w in theirs.items() if w.grad is None}
    assert {p[:4] for p in unused} == ({("text_encoder", "text_model", "encoder", "layers")} if xl else set())
    assert all(p[4] == 1 and not ours[p].any() for p in unused)
    errors = {p: _relative_error(ours[p], theirs[p].grad) for p in ours if p not in unused}
    for name in refs:
        _check_gradients({p: e for p, e in errors.items() if p[0] == name}, f"{name} adapter weights")


@pytest.mark.parametrize("snr_gamma", [None, 5.0])
def test_prior_preservation_loss_and_gradients_match_diffusers(snr_gamma):
    """DreamBooth's --with_prior_preservation: a batch of 3 instance and 3 class samples, diffusers' loss
    (train_dreambooth.py: the batch chunked in two, instance MSE + prior_loss_weight × class MSE; min-SNR on
    the instance half alone, with its timesteps, as train_dreambooth_lora_sdxl.py) against sdx's per-sample
    weights, whichever rows the class samples sit in: the same loss and gradients in float32."""
    case = {**CASES[0], "snr_gamma": snr_gamma}
    ref, model = _models(4)
    batch = _batch(6, False)
    prior = np.array([False, True, False, True, True, False])  # sdx: any rows; diffusers: the second half
    batch["prior"] = prior
    cfg = dataclasses.replace(_loss_config(case), prior_loss_weight=0.7)
    graphdef, params = nnx.split(model)
    keys = steplib.sample_keys(jax.random.key(3), jnp.int32(7), jnp.asarray(batch["index"]))
    fn = denoise.loss_fn(graphdef, cfg)
    (loss, _), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(params, jax.tree.map(jnp.asarray, batch), keys,
                                                                     jax.tree.map(jnp.asarray, NULL))
    order = torch.from_numpy(np.argsort(prior, kind="stable"))  # instance rows first, as diffusers' collate

    def dreambooth(pred, target, ts, tt):
        pred, pred_prior = torch.chunk(pred[order], 2)
        target, target_prior = torch.chunk(target[order], 2)
        prior_loss = torch.nn.functional.mse_loss(pred_prior.float(), target_prior.float(), reduction="mean")
        instance_t, _ = torch.chunk(tt[order], 2)
        return _mse(pred, target, ts, instance_t, snr_gamma, case["prediction_type"]) + 0.7 * prior_loss

    ref_loss = _reference_loss(ref, case, batch, keys, reduce=dreambooth)
    ref_loss.backward()
    _check_loss(loss, ref_loss)
    _check_every_gradient(grads, ref)


def test_controlnet_loss_and_gradients_match_diffusers():
    """A ControlNet step (train_controlnet_sdxl.py): diffusers' ControlNetModel.from_unet of the UNet, every
    parameter then moved (zero convolutions too, so that the residuals matter), its residuals added to the
    frozen UNet's; sdx's ControlNet with the same weights trained beside the UNet as train/controlnet.py
    trains it (the UNet in the constants): the same loss and gradient of every ControlNet parameter in float32."""
    from sdx.controlnet import ControlNetConfig, ControlNetModel

    case = CASES[1]  # v-prediction, min-SNR, offset noise, input perturbation, half the captions dropped
    ref, unet = _models(4)
    ref.requires_grad_(False)
    cn_ref = diffusers.ControlNetModel.from_unet(ref)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in cn_ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    cn_cfg = ControlNetConfig.from_diffusers_config(dict(cn_ref.config))
    net = W.load_torch_state(W.abstract(lambda r: ControlNetModel(cn_cfg, rngs=r)),
                             {k: v.numpy() for k, v in cn_ref.state_dict().items()}, where="test")
    batch = _batch(6, False)
    batch["control"] = np.random.default_rng(4).uniform(0, 1, (6, 64, 64, 3)).astype(np.float32)  # 8x the latents
    graphdef, params, base = nnx.split(nnx.Dict({"unet": unet, "controlnet": net}),
                                       nnx.All(nnx.Param, nnx.PathContains("controlnet")), ...)
    cfg = dataclasses.replace(_loss_config(case), controlnet=True)
    fn, constants = steplib.trained_in_part(denoise.loss_fn(graphdef, cfg), jax.tree.map(jnp.asarray, NULL), base)
    keys = steplib.sample_keys(jax.random.key(3), jnp.int32(7), jnp.asarray(batch["index"]))
    (loss, _), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(params, jax.tree.map(jnp.asarray, batch), keys,
                                                                     constants)
    ref_loss = _reference_loss(ref, case, batch, keys, controlnet=cn_ref)
    ref_loss.backward()
    _check_loss(loss, ref_loss)
    assert list(grads.keys()) == ["controlnet"]  # the UNet does not train
    _check_every_gradient(grads["controlnet"], cn_ref)


@pytest.mark.parametrize("detail", [1.0, 0.5])
def test_dream_loss_and_gradients_match_diffusers(detail):
    """--dream_training (train_text_to_image.py): diffusers' compute_dream_and_update_latents (a no-grad UNet
    call corrects x_t and the target) on an SD UNet, epsilon prediction with offset noise, input
    perturbation and dropped captions, against sdx's: the same loss and gradients in float32."""
    case = {**CASES[0], "noise_offset": 0.1, "input_perturbation": 0.1, "p": 0.5}
    ref, model = _models(4, config=SD_UNET)
    batch = {k: v for k, v in _batch(6, False).items() if k not in ("pooled", "time_ids")}
    fam = Family(xl=False, pix2pix=False, aesthetic=False, encoders=("text_encoder",), force_zeros=False)
    cfg = dataclasses.replace(_loss_config(case), family=fam, dream_detail_preservation=detail)
    null = {"context": NULL["context"]}
    graphdef, params = nnx.split(model)
    keys = steplib.sample_keys(jax.random.key(3), jnp.int32(7), jnp.asarray(batch["index"]))
    (loss, _), grads = jax.jit(jax.value_and_grad(denoise.loss_fn(graphdef, cfg), has_aux=True))(
        params, jax.tree.map(jnp.asarray, batch), keys, jax.tree.map(jnp.asarray, null))

    def conditioning(dropped):
        return torch.where(torch.from_numpy(dropped)[:, None, None], torch.from_numpy(NULL["context"]),
                           torch.from_numpy(batch["context"])), None

    ref_loss = _reference_loss(ref, case, batch, keys, conditioning, dream=detail)
    ref_loss.backward()
    plain = _reference_loss(ref, case, batch, keys, conditioning).item()
    print("loss without DREAM", plain)
    assert abs(plain - ref_loss.item()) > 1e-3 * abs(plain)  # DREAM changes the loss
    _check_loss(loss, ref_loss)
    _check_every_gradient(grads, ref)


def _vaes():
    """(diffusers' AutoencoderKL of `VAE`'s shape, every weight moved off its init; sdx's with the same weights)."""
    from tests.test_vae import _diffusers_kwargs, _sdx_vae, _torch_vae

    ref = _torch_vae(_diffusers_kwargs(1, block_out_channels=list(VAE.block_out_channels), layers_per_block=1,
                                       norm_num_groups=VAE.norm_num_groups, latent_channels=VAE.latent_channels,
                                       scaling_factor=VAE.scaling_factor), seed=4)
    return ref, _sdx_vae(ref)


def test_pixel_loss_and_gradients_match_diffusers():
    """--pixel_loss_weight / --edge_weight / --pixel_loss_max_timestep: the clean latents each prediction implies
    (DDPMScheduler.step's pred_original_sample, clipping off) and the sampled latents, both decoded by diffusers'
    AutoencoderKL (frozen, its every weight moved off its init), their edge-weighted mean absolute error where
    the timestep is below the limit, added at its weight to the MSE; against sdx's, with the VAE's state in the
    step's constants: the same loss and every UNet gradient in float32. (Every prediction type's implied latents
    are checked against DDPMScheduler.step in tests/test_train_objective.py.)"""
    case = CASES[1]  # v-prediction, min-SNR, offset noise, input perturbation, half the captions dropped
    weight, edge_weight, max_t = 0.3, 20.0, 600
    vae_ref, vae = _vaes()
    vae_ref.requires_grad_(False)
    ref, model = _models(4)
    batch = _batch(6, False)
    vae_graphdef, vae_state = nnx.split(vae)
    cfg = dataclasses.replace(_loss_config(case), pixel_loss=denoise.PixelLoss(weight, edge_weight, max_t, vae_graphdef))
    graphdef, params = nnx.split(model)
    keys = steplib.sample_keys(jax.random.key(3), jnp.int32(7), jnp.asarray(batch["index"]))
    constants = {**jax.tree.map(jnp.asarray, NULL), "vae": vae_state}
    (loss, aux), grads = jax.jit(jax.value_and_grad(denoise.loss_fn(graphdef, cfg), has_aux=True))(
        params, jax.tree.map(jnp.asarray, batch), keys, constants)
    step = diffusers.DDPMScheduler(**SCHED, prediction_type=case["prediction_type"], clip_sample=False)

    def pixel(pred, noisy, latents, tt):
        counted = tt < max_t
        assert 0 < int(counted.sum()) < len(tt)  # both kinds of sample in the batch
        implied = torch.cat([step.step(pred[i:i + 1], int(tt[i]), noisy[i:i + 1],
                                       generator=torch.Generator().manual_seed(0)).pred_original_sample
                             for i in range(len(tt))])
        decode = lambda z: vae_ref.decode(z / VAE.scaling_factor).sample
        target = decode(latents).detach()
        edge = ((F.max_pool2d(target, 3, 1, 1) + F.max_pool2d(-target, 3, 1, 1)) / 2).amax(dim=1, keepdim=True)
        err = ((decode(implied) - target).abs() * (1 + edge_weight * edge)).mean(dim=(1, 2, 3))
        return weight * (err * counted.float()).mean()

    ref_loss = _reference_loss(ref, case, batch, keys, pixel=pixel)
    ref_loss.backward()
    plain = _reference_loss(ref, case, batch, keys).item()
    print("loss without the pixel term", plain)
    assert ref_loss.item() - plain > 0.1 * plain  # the term is a large part of the loss
    _check_loss(loss, ref_loss)
    np.testing.assert_allclose(weight * float(aux["pixel_error"]), ref_loss.item() - plain, rtol=1e-4)
    _check_every_gradient(grads, ref)


def test_the_pixel_loss_is_finite_where_the_terminal_snr_is_zero():
    """At zero terminal SNR an epsilon prediction implies no clean latents at the last timestep (1/√ᾱ = ∞);
    above --pixel_loss_max_timestep the sample is not counted, and its infinities must not reach the gradient."""
    vae_graphdef, vae_state = nnx.split(_vaes()[1])
    sched = schedulers.from_name("ddpm", {**SCHED, "rescale_betas_zero_snr": True})
    assert sched.alphas_cumprod[-1] == 0
    cfg = dataclasses.replace(_loss_config(CASES[0]), scheduler=sched,
                              pixel_loss=denoise.PixelLoss(1.0, 10.0, 400, vae_graphdef))
    rng = np.random.default_rng(1)
    latents, noisy, pred = (jnp.asarray(rng.standard_normal((2, 8, 8, 4)), jnp.float32) for _ in range(3))
    t = jnp.array([999, 10], jnp.int32)
    pixel_error = lambda p: denoise._pixel_error(cfg, vae_state, latents, noisy, p, t)
    error, grad = jax.jit(jax.value_and_grad(pixel_error))(pred)
    assert np.isfinite(float(error)) and float(error) > 0
    grad = np.asarray(grad)
    assert np.isfinite(grad).all() and not grad[0].any() and grad[1].any()


def _shared_adapters(model: nnx.Module, layer_of, seed: int = 7) -> dict:
    """peft's adapters copied into sdx's adapters on `model` (each lora_B drawn random first, not peft's
    zeros, so that every adapter has a gradient): {sdx adapter weight path: peft's weight}. layer_of(path):
    the torch layer of the sdx layer at `path` (a tuple)."""
    g, theirs = torch.Generator().manual_seed(seed), {}
    for path, _ in nnx.to_flat_state(nnx.state(model, lora.LoRAParam)):
        if path[-1] != "up":
            continue
        layer = layer_of(path[:-2])
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        with torch.no_grad():
            b.copy_(0.1 * torch.randn(b.shape, generator=g))
        theirs[path[:-1] + ("down",)], theirs[path] = a, b
    nnx.update(model, nnx.from_flat_state([(p, jnp.asarray(w.detach().numpy().T)) for p, w in theirs.items()]))
    assert all(w.requires_grad for w in theirs.values())
    return theirs


def _step(model, batch, accumulation):
    fam = Family(xl=True, pix2pix=False, aesthetic=False, encoders=("text_encoder", "text_encoder_2"), force_zeros=True)
    cfg = denoise.DenoiseConfig(family=fam, scheduler=schedulers.from_name("ddpm", SCHED), vae=VAE,
                                prediction_type="epsilon", text_drop=0.3)
    graphdef, params = nnx.split(model)
    tx = optax.sgd(0.1)
    state = steplib.init_state(params, tx, use_ema=True)
    mesh = meshlib.make_mesh(1)
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    fn = steplib.compile_step(state, shapes, jax.random.key(0), mesh, constants=NULL, loss_fn=denoise.loss_fn(graphdef, cfg),
                              tx=tx, accumulation=accumulation, ema=emalib.EMAConfig(decay=0.9), learning_rate=lambda s: 0.1)
    return fn, state


def test_accumulation_equals_one_big_batch():
    _, model = _models(4)
    batch = _batch(4, False)
    big, state = _step(model, batch, 1)
    s1, m1 = big(state, batch, jax.random.key(0))
    _, model = _models(4)
    acc, state = _step(model, batch, 2)
    s2, m2 = acc(state, batch, jax.random.key(0))
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
    for a, b in zip(jax.tree.leaves(s1.ema), jax.tree.leaves(s2.ema)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
    assert int(s2.step) == 1


def _loop_step(model, batch, *, schedule=("constant", 1e-3), beta2=0.999, decay=0.9, **loss) -> dict:
    """`compile_step`'s arguments as train/loop.py makes them: every piece a value (AdamW under a train.lr
    schedule, EMA, the denoising loss; `loss`: more DenoiseConfig fields), so `pipelines.executables` keys
    the program."""
    fam = Family(xl=True, pix2pix=False, aesthetic=False, encoders=("text_encoder", "text_encoder_2"), force_zeros=True)
    cfg = denoise.DenoiseConfig(family=fam, scheduler=schedulers.from_name("ddpm", SCHED), vae=VAE,
                                prediction_type="epsilon", text_drop=0.3, **loss)
    graphdef, params = nnx.split(model)
    learning_rate = lrlib.schedule(*schedule, warmup_steps=2, total_steps=10)
    tx = optlib.AdamW(learning_rate, beta2=beta2, max_grad_norm=1.0)
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    return dict(state=steplib.init_state(params, tx, use_ema=True), batch_shapes=shapes, seed_key=jax.random.key(0),
                mesh=meshlib.make_mesh(1), constants=NULL, loss_fn=denoise.loss_fn(graphdef, cfg), tx=tx, accumulation=1,
                ema=emalib.EMAConfig(decay=decay), learning_rate=learning_rate)


def test_tiny_model_overfits_and_a_later_run_reads_its_step_back_untraced(tmp_path, monkeypatch, jax_events):
    """The loop's step overfits a repeated batch. A later run of the same configuration (a resumed one) takes
    the compiled step from the cache folder without tracing it, and steps to the same state."""
    monkeypatch.setattr(executables, "folder", lambda: tmp_path)
    batch = _batch(4, False)
    traced = jax_events("jaxpr_trace", "train_step")
    _, model = _models(4)
    kw = _loop_step(model, batch)
    fn, state = steplib.compile_step(**kw), kw["state"]
    losses = []
    for i in range(40):
        state, m = fn(state, batch, kw["seed_key"])
        losses.append(float(m["loss"]))
        if i == 0:
            first = [np.asarray(x) for x in jax.tree.leaves(state)]
    first_loss, last_loss = np.mean(losses[:5]), np.mean(losses[-5:])
    print("loss", first_loss, "->", last_loss)
    assert last_loss < 0.6 * first_loss
    assert len(traced) == 1 and [p.name.split("-")[0] for p in tmp_path.iterdir()] == ["train_step"]

    _, model = _models(4)
    kw = _loop_step(model, batch)
    state, _ = steplib.compile_step(**kw)(kw["state"], batch, kw["seed_key"])
    assert len(traced) == 1  # read back
    for a, b in zip(first, jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_the_loop_s_step_is_keyed_by_every_setting_of_its_loss_optimizer_schedule_and_ema(tmp_path, monkeypatch):
    monkeypatch.setattr(executables, "folder", lambda: tmp_path)
    _, model = _models(4)
    batch = _batch(2, False)

    def key(**change):
        kw = _loop_step(model, batch, **change)
        fn, args, options = steplib.step_program(**kw)
        return executables.path_of(fn, args, options)

    changed = [key(schedule=("constant", 2e-3)), key(schedule=("cosine", 1e-3)), key(beta2=0.99), key(decay=0.99),
               key(snr_gamma=5.0), key(timestep_bias=objective.TimestepBias("later", 2.0)),
               key(timestep_bias=objective.TimestepBias("later", 3.0))]
    assert None not in changed and len({key(), *changed}) == 8


@pytest.mark.parametrize("use_ema", [True, False])
def test_a_resumed_run_restores_onto_the_shapes_dtypes_and_shardings_init_state_makes(use_ema):
    """`abstract_state` (a resumed run's restore target: nothing computed or allocated) has `init_state`'s tree
    and each leaf's shape, dtype and sharding: AdamW's moments and counts, a frozen part's empty places, the
    step, and the EMA (float32 over bfloat16 parameters)."""
    mesh = meshlib.make_mesh(1)
    r = np.random.default_rng(0)
    params = {"a": {"kernel": r.standard_normal((3, 4)), "bias": r.standard_normal(4)},
              "b": {"kernel": r.standard_normal((4, 2)).astype(jnp.bfloat16)}}
    params = jax.tree.map(lambda x: jax.device_put(jnp.asarray(x), meshlib.replicated(mesh)), params)
    frozen = {"a": {"kernel": True, "bias": True}, "b": {"kernel": False}}
    tx = optlib.FrozenExcept(optlib.AdamW(lrlib.schedule("constant", 1e-3)), frozen)
    made, abstract = steplib.init_state(params, tx, use_ema), steplib.abstract_state(params, tx, use_ema)
    assert jax.tree.structure(abstract) == jax.tree.structure(made)
    describe = lambda state: [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(state)]
    assert describe(abstract) == describe(made)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    assert (abstract.ema is not None) == use_ema and (not use_ema or abstract.ema["b"]["kernel"].dtype == jnp.float32)


def test_a_vae_step_with_a_frozen_encoder_is_keyed_too(tmp_path, monkeypatch):
    """The VAE's loss and `optimizer.FrozenExcept` (--decoder_only) are values as well: the step is kept."""
    from sdx.vae import AutoencoderKL
    from train.vae import ENCODER_SIDE, VAELoss, vae_loss

    monkeypatch.setattr(executables, "folder", lambda: tmp_path)
    vae = W.abstract(lambda r: AutoencoderKL(VAE, rngs=r))
    graphdef, params = nnx.split(vae, nnx.Param)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    frozen = jax.tree_util.tree_map_with_path(lambda path, _: path[0].key in ENCODER_SIDE, params)
    schedule = lrlib.schedule("constant", 1e-4)
    tx = optlib.FrozenExcept(optlib.AdamW(schedule), frozen)
    state = steplib.init_state(params, tx, use_ema=False)
    program = lambda decoder_only: steplib.step_program(
        state, {"pixels": jax.ShapeDtypeStruct((2, 16, 16, 3), jnp.float32), "index": jax.ShapeDtypeStruct((2,), jnp.int32)},
        jax.random.key(0), meshlib.make_mesh(1), loss_fn=vae_loss(graphdef, VAELoss("l1", 1e-6, decoder_only)),
        tx=tx, accumulation=1, ema=None, learning_rate=schedule)
    keys = [executables.path_of(*program(d)) for d in (True, False)]
    assert None not in keys and keys[0] != keys[1]
