"""train.objective: per-sample randomness, dropout frequencies, targets, min-SNR weights and the loss
against diffusers' DDPMScheduler, compute_snr and the training scripts' formulas."""

from __future__ import annotations

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers.training_utils import compute_snr

from sdx import schedulers
from sdx.errors import SdxError
from sdx.schedulers import training
from sdx.vae import VAEConfig
from train import objective
from train.objective import Stream

SHAPE = (8, 6, 4)  # one sample's NHWC latents (h, w, C)


def sample_keys(seed_key, index):
    """The loop's per-sample keys: fold_in(step_key, global sample index)."""
    return jax.vmap(lambda i: jax.random.fold_in(seed_key, i))(jnp.asarray(index))


@jax.jit
def draws(keys, moments):
    noise, noise_in = objective.noise(keys, SHAPE, 0.1, 0.05)
    drop_text, drop_image = objective.conditioning_dropout(keys, 0.3)
    return {"noise": noise, "noise_in": noise_in, "t": objective.timesteps(keys, 1000),
            "drop_text": drop_text, "drop_image": drop_image, "empty": objective.empty_prompt(keys, 0.5),
            "posterior": objective.posterior_sample(keys, moments),
            "latent_noise": objective.latent_noise(keys, moments[..., :SHAPE[2]], 0.7)}


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_a_sample_draws_the_same_in_any_batch(make_key):
    step_key = jax.random.fold_in(make_key(3), 17)
    moments = jnp.asarray(np.random.default_rng(0).standard_normal((8, *SHAPE[:2], 2 * SHAPE[2]), np.float32))
    full = draws(sample_keys(step_key, np.arange(8)), moments)
    assert full["t"].dtype == jnp.int32 and full["noise"].dtype == jnp.float32
    for i in range(8):  # alone, batch of 1
        one = draws(sample_keys(step_key, [i]), moments[i:i + 1])
        for name in full:
            np.testing.assert_array_equal(one[name][0], full[name][i], err_msg=name)
    order = np.array([5, 2, 7])  # another batch composition and order
    part = draws(sample_keys(step_key, order), moments[order])
    for name in full:
        np.testing.assert_array_equal(part[name], full[name][order], err_msg=name)
    # different samples (and steps) draw differently
    assert len(set(np.asarray(full["noise"][:, 0, 0, 0]).tolist())) == 8
    other = draws(sample_keys(jax.random.fold_in(make_key(3), 18), np.arange(8)), moments)
    assert not np.allclose(other["noise"], full["noise"])


def test_draws_are_independent_sub_streams():
    keys = sample_keys(jax.random.key(0), np.arange(4))
    plain, same = objective.noise(keys, SHAPE)
    assert same is plain
    offset, _ = objective.noise(keys, SHAPE, offset=0.1)
    perturbed, noise_in = objective.noise(keys, SHAPE, input_perturbation=0.1)
    np.testing.assert_array_equal(perturbed, plain)  # the target noise is not moved by the perturbation
    shift = np.asarray(offset - plain)  # offset noise: one shift per (sample, channel), (B, 1, 1, C)
    np.testing.assert_allclose(shift, np.broadcast_to(shift[:, :1, :1, :], shift.shape), atol=1e-6)
    assert np.abs(shift).max() > 0
    normal = jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, Stream.PERTURBATION), SHAPE))(keys)
    np.testing.assert_allclose(noise_in, plain + 0.1 * normal, rtol=1e-6, atol=1e-6)
    assert len(set(Stream)) == len(Stream.__members__)  # every draw its own constant


def test_noise_statistics():
    keys = sample_keys(jax.random.key(1), np.arange(4096))
    noise, _ = objective.noise(keys, (2, 2, 4), offset=0.5)
    flat = np.asarray(noise).reshape(-1)
    assert abs(flat.mean()) < 0.02 and abs(flat.var() - 1.25) < 0.03  # 1 + 0.5² per element
    t = np.asarray(objective.timesteps(keys, 1000))
    assert t.min() >= 0 and t.max() <= 999 and abs(t.mean() - 499.5) < 15


@pytest.mark.parametrize("p", [0.05, 0.1, 0.2])
def test_conditioning_dropout_frequencies_and_inequalities(p):
    n = 100_000
    keys = sample_keys(jax.random.key(7), np.arange(n))
    drop_text, drop_image = jax.jit(objective.conditioning_dropout, static_argnums=1)(keys, p)
    drop_text, drop_image = np.asarray(drop_text), np.asarray(drop_image)
    se = np.sqrt(p * (1 - p) / n)
    for name, freq in [("text only", (drop_text & ~drop_image).mean()), ("both", (drop_text & drop_image).mean()),
                       ("image only", (~drop_text & drop_image).mean())]:
        assert abs(freq - p) < 5 * se, (name, freq)
    assert abs((~drop_text & ~drop_image).mean() - (1 - 3 * p)) < 5 * np.sqrt(3 * p * (1 - 3 * p) / n)
    # the exact rule, on the stream's u: text when u < 2p, image when p <= u < 3p (diffusers' script)
    u = np.asarray(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, Stream.DROPOUT)))(keys[:2000]))
    np.testing.assert_array_equal(drop_text[:2000], u < 2 * p)
    np.testing.assert_array_equal(drop_image[:2000], (u >= p) & (u < 3 * p))
    empty = np.asarray(objective.empty_prompt(keys, p))
    assert abs(empty.mean() - p) < 5 * se
    assert (empty != drop_text).any()  # its own stream


def test_mix_conditioning():
    rng = np.random.default_rng(0)
    cond = {"context": jnp.asarray(rng.standard_normal((4, 3, 5), np.float32)).astype(jnp.bfloat16),
            "pooled": jnp.asarray(rng.standard_normal((4, 6), np.float32)),
            "image_latents": jnp.asarray(rng.standard_normal((4, 2, 2, 4), np.float32)),
            "time_ids": jnp.ones((4, 6))}
    null = {"context": jnp.full((3, 5), 9.0), "pooled": jnp.full((6,), 8.0)}
    drop_text, drop_image = jnp.array([True, False, True, False]), jnp.array([False, False, True, True])
    out = objective.mix_conditioning(drop_text, drop_image, cond, null)
    assert out["context"].dtype == jnp.bfloat16 and out["time_ids"] is cond["time_ids"]
    for i in range(4):
        want_ctx = null["context"] if drop_text[i] else cond["context"][i].astype(jnp.float32)
        np.testing.assert_array_equal(out["context"][i].astype(jnp.float32), want_ctx)
        np.testing.assert_array_equal(out["pooled"][i], null["pooled"] if drop_text[i] else cond["pooled"][i])
        want_img = np.zeros((2, 2, 4)) if drop_image[i] else cond["image_latents"][i]
        np.testing.assert_array_equal(out["image_latents"][i], want_img)


def test_posterior_sample_and_latents():
    rng = np.random.default_rng(1)
    moments = jnp.asarray(rng.standard_normal((3, 4, 4, 8), np.float32) * 2)
    moments = moments.at[0, 0, 0, 4].set(-40.0)  # logvar clipped to -30 as diffusers
    keys = sample_keys(jax.random.key(2), np.arange(3))
    z = objective.posterior_sample(keys, moments)
    eps = jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, Stream.POSTERIOR), (4, 4, 4)))(keys)
    mean, logvar = np.split(np.asarray(moments), 2, axis=-1)
    want = mean + np.exp(0.5 * np.clip(logvar, -30, 20)) * np.asarray(eps)
    np.testing.assert_allclose(z, want, rtol=1e-6, atol=1e-6)
    vae = VAEConfig(scaling_factor=0.13025, shift_factor=0.0609)
    np.testing.assert_allclose(objective.sample_latents(keys, moments, vae), (want - 0.0609) * 0.13025,
                               rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------------
# Against diffusers

BETAS = {
    "linear": {"beta_schedule": "linear"},
    "scaled_linear": {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012},
    "cosine": {"beta_schedule": "squaredcos_cap_v2"},
    "zero_snr_v": {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
                   "rescale_betas_zero_snr": True, "prediction_type": "v_prediction"},
}


def nchw(x):
    return torch.from_numpy(np.ascontiguousarray(np.transpose(np.asarray(x), (0, 3, 1, 2))))


@pytest.mark.parametrize("prediction_type", objective.PREDICTION_TYPES)
@pytest.mark.parametrize("config", list(BETAS.values()), ids=list(BETAS))
def test_noisy_input_and_target_match_ddpm_scheduler(config, prediction_type):
    sched = schedulers.from_name("ddpm", config)
    ref = diffusers.DDPMScheduler.from_config(config)
    keys = sample_keys(jax.random.key(4), np.arange(6))
    latents = jnp.asarray(np.random.default_rng(2).standard_normal((6, *SHAPE), np.float32))
    noise, noise_in = objective.noise(keys, SHAPE, 0.1, 0.1)
    t = jnp.array([0, 1, 250, 500, 998, 999], jnp.int32)
    noisy = jax.jit(training.add_noise, static_argnums=0)(sched, latents, noise_in, t)
    target = jax.jit(objective.target, static_argnums=(0, 1))(sched, prediction_type, latents, noise, t)
    tt = torch.from_numpy(np.array(t)).long()
    ref_noisy = ref.add_noise(nchw(latents), nchw(noise_in), tt)
    ref_target = {"epsilon": nchw(noise), "sample": nchw(latents),
                  "v_prediction": ref.get_velocity(nchw(latents), nchw(noise), tt)}[prediction_type]
    np.testing.assert_allclose(nchw(noisy).numpy(), ref_noisy.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(nchw(target).numpy(), ref_target.numpy(), rtol=1e-6, atol=1e-6)


def script_weights(ref, timesteps, gamma, prediction_type):
    """The weights of train_text_to_image(_sdxl).py's --snr_gamma branch, verbatim."""
    snr = compute_snr(ref, timesteps)
    mse_loss_weights = torch.stack([snr, gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
    if prediction_type == "epsilon":
        mse_loss_weights = mse_loss_weights / snr
    elif prediction_type == "v_prediction":
        mse_loss_weights = mse_loss_weights / (snr + 1)
    return mse_loss_weights


@pytest.mark.parametrize("prediction_type", objective.PREDICTION_TYPES)
@pytest.mark.parametrize("config", list(BETAS.values()), ids=list(BETAS))
@pytest.mark.parametrize("gamma", [5.0, 1.0])
def test_min_snr_weights_match_the_scripts(config, prediction_type, gamma):
    sched = schedulers.from_name("ddpm", config)
    ref = diffusers.DDPMScheduler.from_config(config)
    # the weighting alone: the reference reads our float32 alphas_cumprod (the zero-SNR rescale's torch
    # sqrt may differ from ours in the last bit; test_schedulers checks the schedules themselves)
    ref.alphas_cumprod = torch.from_numpy(np.array(sched.alphas_cumprod))
    t = np.arange(sched.num_train_timesteps)
    ours = np.asarray(jax.jit(objective.min_snr_weights, static_argnums=(0, 2, 3))(sched, t, gamma, prediction_type))
    want = script_weights(ref, torch.from_numpy(t), gamma, prediction_type).numpy()
    assert ours.dtype == np.float32 and np.isfinite(ours).all()
    finite = np.isfinite(want)
    np.testing.assert_allclose(ours[finite], want[finite], rtol=1e-6, atol=0)
    if config.get("rescale_betas_zero_snr"):
        assert sched.alphas_cumprod[-1] == 0
        # snr = 0: diffusers' epsilon weight is 0/0 = NaN; ours is the limit 1. v and sample: 0 in both.
        assert ours[-1] == {"epsilon": 1.0, "v_prediction": 0.0, "sample": 0.0}[prediction_type]
        assert finite[:-1].all() and finite[-1] == (prediction_type != "epsilon")
    else:
        assert finite.all()


def test_zero_snr_against_diffusers_own_schedule():
    config = BETAS["zero_snr_v"]
    sched, ref = schedulers.from_name("ddpm", config), diffusers.DDPMScheduler.from_config(config)
    t = np.arange(1000)
    ours = objective.min_snr_weights(sched, t, 5.0, "v_prediction")
    np.testing.assert_allclose(ours, script_weights(ref, torch.from_numpy(t), 5.0, "v_prediction").numpy(),
                               rtol=1e-4, atol=1e-7)


def test_unknown_prediction_type_is_an_error():
    sched = schedulers.from_name("ddpm", BETAS["linear"])
    x, t = jnp.zeros((1, *SHAPE)), jnp.zeros((1,), jnp.int32)
    with pytest.raises(SdxError, match="'flow'"):
        objective.target(sched, "flow", x, x, t)
    with pytest.raises(SdxError, match="'flow'"):
        objective.min_snr_weights(sched, t, 5.0, "flow")
    with pytest.raises(SdxError, match="snr_gamma"):
        objective.min_snr_weights(sched, t, 0.0, "epsilon")


def test_loss_matches_torch_mse():
    rng = np.random.default_rng(3)
    pred = rng.standard_normal((5, *SHAPE), np.float32)
    target = rng.standard_normal((5, *SHAPE), np.float32)
    weights = rng.uniform(0, 2, 5).astype(np.float32)
    tp, tt, tw = nchw(pred), nchw(target), torch.from_numpy(weights)
    want = F.mse_loss(tp.float(), tt.float(), reduction="mean").item()
    assert np.isclose(float(objective.loss(jnp.asarray(pred), jnp.asarray(target))), want, rtol=1e-6)
    # bf16 predictions are compared in float32
    assert objective.loss(jnp.asarray(pred, jnp.bfloat16), jnp.asarray(target)).dtype == jnp.float32
    per = F.mse_loss(tp.float(), tt.float(), reduction="none")
    per = per.mean(dim=list(range(1, len(per.shape))))
    np.testing.assert_allclose(objective.per_sample_mse(jnp.asarray(pred), jnp.asarray(target)), per.numpy(), rtol=1e-6)
    want_w = (per * tw).mean().item()
    got_w = float(jax.jit(objective.loss)(jnp.asarray(pred), jnp.asarray(target), jnp.asarray(weights)))
    assert np.isclose(got_w, want_w, rtol=1e-6)


def test_big_batch_loss_is_the_mean_of_equal_micro_batch_losses():
    rng = np.random.default_rng(4)
    pred, target = rng.standard_normal((2, 8, *SHAPE), np.float32), rng.standard_normal((2, 8, *SHAPE), np.float32)
    weights = rng.uniform(0, 2, (2, 8)).astype(np.float32)
    micro = [float(objective.loss(pred[i], target[i], weights[i])) for i in range(2)]
    whole = float(objective.loss(pred.reshape(16, *SHAPE), target.reshape(16, *SHAPE), weights.reshape(16)))
    assert np.isclose(np.mean(micro), whole, rtol=1e-6)


def _diffusers_timestep_weights(strategy, multiplier, begin, end, portion, num_timesteps=1000) -> torch.Tensor:
    """train_text_to_image_sdxl.py's generate_timestep_weights, transcribed (the examples are not a package)."""
    weights = torch.ones(num_timesteps)
    num_to_bias = int(portion * num_timesteps)
    if strategy == "later":
        bias_indices = slice(-num_to_bias, None)
    elif strategy == "earlier":
        bias_indices = slice(0, num_to_bias)
    else:
        bias_indices = slice(begin, end)
    weights[bias_indices] *= multiplier
    weights /= weights.sum()
    return weights


BIASES = [("later", 2.0, 0, 1000, 0.25), ("earlier", 5.0, 0, 1000, 0.1), ("range", 3.0, 200, 500, 0.25),
          ("later", 0.5, 0, 1000, 0.0), ("later", 4.0, 0, 1000, 0.333)]


@pytest.mark.parametrize("bias", BIASES)
def test_timestep_bias_weights_and_draws_are_diffusers(bias):
    """The weights equal diffusers' generate_timestep_weights; 20k draws (one per sample key, as the step
    draws them) land in the biased timesteps as often as the weights say (within 4 standard deviations)."""
    ours = objective.TimestepBias(*bias).weights(1000)
    theirs = _diffusers_timestep_weights(*bias).double().numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    keys = sample_keys(jax.random.key(1), np.arange(20_000))
    t = np.asarray(jax.jit(lambda k: objective.timesteps(k, 1000, objective.TimestepBias(*bias)))(keys))
    assert t.min() >= 0 and t.max() < 1000
    heavy = ours > ours.min()  # the biased timesteps (all False when the bias changes nothing)
    want = ours[heavy].sum() if heavy.any() else 0.0
    got = np.isin(t, np.flatnonzero(heavy)).mean()
    assert abs(got - want) < 4 * np.sqrt(max(want * (1 - want), 1e-9) / len(t)) + 1e-9, (got, want)
    assert len(np.unique(t)) > 900  # every timestep can be drawn


def test_a_range_outside_the_schedule_is_refused():
    with pytest.raises(SdxError, match="must lie in"):
        objective.TimestepBias("range", 2.0, 0, 1200).weights(1000)


@pytest.mark.parametrize("prediction_type", objective.PREDICTION_TYPES)
@pytest.mark.parametrize("config", list(BETAS.values()), ids=list(BETAS))
def test_predicted_x0_is_ddpm_step_s_predicted_original_sample(config, prediction_type):
    """The clean latents a prediction implies (the pixel loss decodes them) equal DDPMScheduler.step's
    pred_original_sample, timestep by timestep (clipping off), for every prediction type."""
    sched = schedulers.from_name("ddpm", config)
    ref = diffusers.DDPMScheduler.from_config({**config, "clip_sample": False, "prediction_type": prediction_type})
    ref.alphas_cumprod = torch.from_numpy(np.array(sched.alphas_cumprod))  # the formula alone, as above
    rng = np.random.default_rng(5)
    noisy, pred = (rng.standard_normal((5, *SHAPE)).astype(np.float32) for _ in range(2))
    t = np.array([0, 1, 250, 700, 998], np.int32)
    ours = np.asarray(jax.jit(objective.predicted_x0, static_argnums=(0, 1))(
        sched, prediction_type, jnp.asarray(noisy), jnp.asarray(pred), jnp.asarray(t)))
    want = torch.cat([ref.step(nchw(pred[i:i + 1]), int(t[i]), nchw(noisy[i:i + 1]),
                               generator=torch.Generator().manual_seed(0)).pred_original_sample for i in range(5)])
    np.testing.assert_allclose(nchw(ours).numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def test_pixel_error_weighs_the_target_s_edges():
    """Each sample's mean absolute error, every pixel's times 1 + w × the target's largest change over its 3x3
    neighbourhood (half the channels' max - min, -inf padded), computed with torch's max pooling."""
    rng = np.random.default_rng(6)
    target = np.full((2, 6, 7, 3), -0.5, np.float32)
    target[:, 2:4, 3:6] = rng.uniform(-1, 1, (2, 1, 1, 3))  # a block: edges around it, flat elsewhere
    decoded = target + rng.normal(0, 0.2, target.shape).astype(np.float32)
    for w in (0.0, 30.0):
        ours = np.asarray(objective.pixel_error(jnp.asarray(decoded), jnp.asarray(target), w))
        t = nchw(target)
        edge = ((F.max_pool2d(t, 3, 1, 1) + F.max_pool2d(-t, 3, 1, 1)) / 2).amax(dim=1, keepdim=True)
        want = ((nchw(decoded) - t).abs() * (1 + w * edge)).mean(dim=(1, 2, 3)).numpy()
        np.testing.assert_allclose(ours, want, rtol=1e-6)
    assert np.all(ours > np.asarray(objective.pixel_error(jnp.asarray(decoded), jnp.asarray(target), 0.0)))


def test_edge_strength_is_the_largest_change_around_a_pixel():
    x = np.full((1, 5, 6, 3), -1.0, np.float32)
    x[0, 2, 3] = [1.0, -1.0, 0.0]  # one bright pixel: red changes by 2, blue by 1
    e = np.asarray(objective.edge_strength(jnp.asarray(x)))[0, :, :, 0]
    want = np.zeros((5, 6))
    want[1:4, 2:5] = 1.0  # its 3x3 neighbourhood sees the full change; the image's border adds none
    np.testing.assert_array_equal(e, want)
    flat = np.asarray(objective.edge_strength(jnp.full((1, 4, 4, 3), 0.3)))
    np.testing.assert_array_equal(flat, 0.0)
