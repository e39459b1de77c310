"""The training step: its loss and gradients against diffusers' UNet + DDPMScheduler in PyTorch for the same
batch, noise, timesteps and dropout (and a LoRA's against peft's); gradient accumulation equals the big batch; a tiny model overfits; the
loop's step is kept by `pipelines.executables`, keyed by its settings, and read back untraced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pipelines import executables
from pipelines.family import Family
from sdx import mesh as meshlib
from sdx import lora, schedulers, unet as U, weights as W
from sdx.vae import VAEConfig
from train import denoise, objective
from train import ema as emalib
from train import lr as lrlib
from train import optimizer as optlib
from train import step as steplib

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

XL_UNET = dict(
    block_out_channels=[32, 64], layers_per_block=1, down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"], attention_head_dim=[2, 4], cross_attention_dim=32,
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=16 + 6 * 8, norm_num_groups=16,
)
SCHED = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
VAE = VAEConfig(scaling_factor=0.13025, latent_channels=4, block_out_channels=(32,), norm_num_groups=8)


def _models(in_channels: int, seed: int = 0):
    torch.manual_seed(seed)
    ref = diffusers.UNet2DConditionModel(**XL_UNET, in_channels=in_channels)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    cfg = U.UNetConfig.from_diffusers_config({**XL_UNET, "in_channels": in_channels})
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


def _reference_loss(ref, case, batch, keys) -> torch.Tensor:
    """diffusers' training loss of `ref` (train_text_to_image.py / train_instruct_pix2pix.py) for `batch`, with
    the draws sdx's loss takes from `keys` (latent sample, noise, timesteps, dropout)."""
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
    dt = torch.from_numpy(np.array(drop_text))
    ctx = torch.where(dt[:, None, None], torch.from_numpy(NULL["context"]), torch.from_numpy(batch["context"]))
    pooled = torch.where(dt[:, None], torch.from_numpy(NULL["pooled"]), torch.from_numpy(batch["pooled"]))
    if case["pix2pix"]:
        keep = 1.0 - torch.from_numpy(np.array(drop_image)).float()
        noisy = torch.cat([noisy, _nchw(batch["image_latents"]) * keep[:, None, None, None]], dim=1)
    pred = ref(noisy, tt, ctx, added_cond_kwargs={"text_embeds": pooled, "time_ids": torch.from_numpy(batch["time_ids"])}).sample
    target = eps if case["prediction_type"] == "epsilon" else ts.get_velocity(x0, eps, tt)
    if case["snr_gamma"] is None:
        return torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="mean")
    from diffusers.training_utils import compute_snr  # as diffusers' train_text_to_image.py

    snr = compute_snr(ts, tt)
    w = torch.stack([snr, 5.0 * torch.ones_like(tt)], dim=1).min(dim=1)[0]
    w = w / snr if case["prediction_type"] == "epsilon" else w / (snr + 1)
    return (torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=[1, 2, 3]) * w).mean()


def _relative_error(ours, theirs: torch.Tensor) -> float:
    theirs = theirs.numpy()
    return float(np.abs(np.asarray(ours) - theirs).max() / np.abs(theirs).max())


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_match_diffusers(case):
    """Same draws on both sides (taken from sdx's per-sample keys): loss and gradients of conv_in and an
    attention projection equal diffusers' in float32."""
    ref, model = _models(8 if case["pix2pix"] else 4)
    batch = _batch(6, case["pix2pix"])
    graphdef, params = nnx.split(model)
    keys = steplib.sample_keys(jax.random.key(3), jnp.int32(7), jnp.asarray(batch["index"]))
    fn = denoise.loss_fn(graphdef, _loss_config(case))
    (loss, _), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(params, jax.tree.map(jnp.asarray, batch), keys,
                                                                     jax.tree.map(jnp.asarray, NULL))
    ref_loss = _reference_loss(ref, case, batch, keys)
    ref_loss.backward()

    print("loss", float(loss), ref_loss.item())
    np.testing.assert_allclose(float(loss), ref_loss.item(), rtol=2e-5)
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(grads)}
    g_conv = np.asarray(flat["conv_in.kernel"]).transpose(3, 2, 0, 1)  # HWIO -> OIHW
    g_q = np.asarray(flat["down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_q.kernel"]).T  # (in, out) -> (out, in)
    for ours, theirs in ((g_conv, ref.conv_in.weight.grad), (g_q, ref.down_blocks[1].attentions[0].transformer_blocks[0].attn2.to_q.weight.grad)):
        err = _relative_error(ours, theirs)
        print("relative gradient error", err)
        assert err < 1e-4


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
    adapters, g = nnx.state(model, lora.LoRAParam), torch.Generator().manual_seed(7)
    theirs = {}
    for path, _ in nnx.to_flat_state(adapters):
        if path[-1] != "up":
            continue
        layer = ref.get_submodule(".".join(map(str, path[:-2])))
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        with torch.no_grad():
            b.copy_(0.1 * torch.randn(b.shape, generator=g))
        theirs[path[:-1] + ("down",)], theirs[path] = a, b
    nnx.update(model, nnx.from_flat_state([(p, jnp.asarray(w.detach().numpy().T)) for p, w in theirs.items()]))
    assert all(w.requires_grad for w in theirs.values())

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

    print("loss", float(loss), ref_loss.item())
    np.testing.assert_allclose(float(loss), ref_loss.item(), rtol=2e-5)
    errors = {path: _relative_error(np.asarray(ours).T, theirs[path].grad) for path, ours in
              ((p, v.get_value()) for p, v in nnx.to_flat_state(grads))}
    assert errors.keys() == theirs.keys()
    print("largest relative gradient error", max(errors.values()))
    assert max(errors.values()) < 1e-4, errors


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


def _loop_step(model, batch, *, schedule=("constant", 1e-3), beta2=0.999, decay=0.9, snr_gamma=None) -> dict:
    """`compile_step`'s arguments as train/loop.py makes them: every piece a value (AdamW under a train.lr
    schedule, EMA, the denoising loss), so `pipelines.executables` keys the program."""
    fam = Family(xl=True, pix2pix=False, aesthetic=False, encoders=("text_encoder", "text_encoder_2"), force_zeros=True)
    cfg = denoise.DenoiseConfig(family=fam, scheduler=schedulers.from_name("ddpm", SCHED), vae=VAE,
                                prediction_type="epsilon", text_drop=0.3, snr_gamma=snr_gamma)
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
               key(snr_gamma=5.0)]
    assert None not in changed and len({key(), *changed}) == 6


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
