"""The denoising objective's pieces as pure, jittable functions of float32 arrays and per-sample keys.

Randomness: a training step hands every function here `keys`, one key per sample (shape (B,) of typed
keys from `jax.random.key`, or (B, 2) uint32 from `jax.random.PRNGKey`), made by the loop as
`fold_in(fold_in(seed_key, step), global_sample_index)`. Each function `vmap`s over them and takes its
draw from its own sub-stream `fold_in(key, Stream.X)`, so

* a sample draws the same numbers whether it sits in a batch of 1 or 64, in a micro-batch or on any
  device of a mesh (gradient accumulation and sharding give the single-batch result), and
* the draws are independent of each other, and turning one on (offset noise, say) never shifts another.

Every draw taken from a per-sample key has its constant in `Stream`; add new ones there.

What diffusers' training scripts do, and where sdx differs (train_text_to_image(_sdxl).py,
train_instruct_pix2pix(_sdxl).py, diffusers.training_utils):

* noise ε ~ N(0, 1) of the latents' shape; offset noise adds `offset · N(0, 1)` of shape (1, 1, C) per
  sample (NHWC; diffusers' (B, C, 1, 1)); input perturbation builds x_t from ε + ip · N(0, 1) while the
  target keeps ε.
* timesteps uniform in [0, num_train_timesteps), or, with a timestep bias (train_text_to_image_sdxl.py's
  --timestep_bias_*), drawn with `TimestepBias.weights`: weight 1 everywhere but `multiplier` on the biased
  timesteps (the last or first `portion` of them, or [begin, end)), normalised; diffusers draws with
  torch.multinomial, sdx with a categorical draw from the sample's key.
* targets: epsilon → ε, v_prediction → √ᾱ ε − √(1−ᾱ) x0, sample → x0. The SDXL script's "sample" branch
  also subtracts the noise from the model output (`model_pred = model_pred - noise`); sdx does not: a
  "sample" model outputs x0 itself (as its sampler reads it), so the loss is MSE(output, x0).
* min-SNR-γ weights (Hang et al. 2023, "Efficient Diffusion Training via Min-SNR Weighting Strategy"):
  snr = ᾱ/(1 − ᾱ); epsilon min(snr, γ)/snr, v_prediction min(snr, γ)/(snr + 1), sample min(snr, γ) (the
  paper's x0 weight; diffusers' scripts leave it unnormalised too). With rescale_betas_zero_snr the last
  timestep has snr = 0, where diffusers' epsilon weight is 0/0 = NaN and poisons the step; sdx takes the
  limit snr → 0 of min(snr, γ)/snr, which is 1 (computed as min(γ/snr, 1), equal to diffusers' value
  bit for bit wherever that is finite). v and sample weights are 0 there, as in diffusers.
* loss: per-sample MSE in float32 (mean over the non-batch axes) times the weight, averaged over the
  batch; unweighted, that is `F.mse_loss(pred.float(), target.float())`.
* InstructPix2Pix conditioning dropout (Brooks et al. 2023, §3.2.1): one u ~ U[0, 1) per sample; the text
  is dropped when u < 2p, the image when p ≤ u < 3p (diffusers: `random_p < 2 * p` and
  `(random_p >= p) * (random_p < 3 * p)`), so p each of text only, both, image only.
* text-to-image's --proportion_empty_prompts: diffusers swaps the caption for "" at tokenisation; sdx
  draws u ~ U[0, 1) per sample in the step and uses the null conditioning when u < p.
* DreamBooth's prior preservation (train_dreambooth.py): a step's batch holds B instance and B class
  images, the loss is the instance MSE (min-SNR weighted when asked) plus prior_loss_weight times the
  class MSE (never SNR-weighted; the SDXL LoRA script takes the instance half's timesteps for the SNR, as
  sdx does; train_dreambooth.py weighs v-prediction by min(snr, γ)/snr + 1, sdx by its one rule above).
  sdx writes it as the batch mean of per-sample weights: 2 (or 2 · min-SNR) per instance, 2 ·
  prior_loss_weight per class image, so micro-batches and devices may hold any mix of the two.
* DREAM (Zhou et al. 2023, "DREAM: Diffusion Rectification and Estimation-Adaptive Models"; diffusers'
  --dream_training, training_utils.compute_dream_and_update_latents): one more model call without gradient
  predicts ε̂ at x_t; δ = (ε − ε̂)·√(1−ᾱ)^p moves x_t by √(1−ᾱ)·δ and the target by δ (epsilon prediction
  only, as in diffusers). sdx's extra call also passes SDXL's added conditioning, which diffusers' SD-only
  script never needs.
* the pixel loss (--pixel_loss_weight; sdx's own, no diffusers script has one): the clean latents a prediction
  implies (`predicted_x0`, DDPMScheduler.step's pred_original_sample) and the sampled latents, both decoded by the
  frozen VAE, compared by `pixel_error` (mean absolute error, the target's edges weighed by `edge_strength`).
* VAE posterior sample (--cache_latents stores the moments): mean + exp(logvar / 2) · N(0, 1), logvar
  clipped to [-30, 20], then `VAEConfig.to_latents` ((z − shift) · scale).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sdx.errors import SdxError
from sdx.schedulers import Scheduler, training
from sdx.vae import DiagonalGaussian, VAEConfig

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")


class Stream(enum.IntEnum):
    """The `fold_in` constant of each draw taken from a sample's key: one independent sub-stream each."""

    NOISE = 1
    TIMESTEP = 2
    OFFSET_NOISE = 3
    PERTURBATION = 4
    DROPOUT = 5  # InstructPix2Pix conditioning dropout's u
    POSTERIOR = 6  # the VAE posterior sample
    EMPTY_PROMPT = 7  # text-to-image's proportion_empty_prompts u
    LATENT_NOISE = 8  # the VAE decoder's input noise (--latent_noise)


def _sub(keys: jax.Array, stream: Stream) -> jax.Array:
    """Each sample's key of `stream`: keys [B] -> [B] (typed keys; uint32 keys keep their trailing (2,))."""
    return jax.vmap(lambda k: jax.random.fold_in(k, int(stream)))(keys)


def _per_sample(keys: jax.Array, stream: Stream, draw) -> jax.Array:
    """draw(key) for every sample's `stream` key, stacked on a new leading batch axis."""
    return jax.vmap(draw)(_sub(keys, stream))


def _is_zero(x) -> bool:
    """A Python number equal to 0 (its draw can be skipped); traced values are never skipped."""
    return isinstance(x, (int, float)) and x == 0


# ------------------------------------------------------------------------------------------------------
# Draws


@dataclasses.dataclass(frozen=True)
class TimestepBias:
    """train_text_to_image_sdxl.py's timestep bias: strategy "later" (the last `portion` of the timesteps),
    "earlier" (the first `portion`) or "range" ([begin, end)) has its weight times `multiplier`."""

    strategy: str
    multiplier: float = 1.0
    begin: int = 0
    end: int = 1000
    portion: float = 0.25

    def weights(self, num_train_timesteps: int) -> np.ndarray:
        """float64[num_train_timesteps], summing to 1 (diffusers' generate_timestep_weights)."""
        w = np.ones(num_train_timesteps)
        count = int(self.portion * num_train_timesteps)
        if self.strategy == "later":
            biased = slice(-count, None)  # count 0: all of them (diffusers' slice), uniform once normalised
        elif self.strategy == "earlier":
            biased = slice(0, count)
        elif self.strategy == "range":
            if not (0 <= self.begin and self.end <= num_train_timesteps):
                raise SdxError(f"--timestep_bias_begin/--timestep_bias_end {self.begin}..{self.end}: the range must lie "
                               f"in [0, {num_train_timesteps}]")
            biased = slice(self.begin, self.end)
        else:
            raise SdxError(f"unknown timestep bias strategy {self.strategy!r} (earlier, later, range)")
        w[biased] *= self.multiplier
        return w / w.sum()


def timesteps(keys: jax.Array, num_train_timesteps: int, bias: TimestepBias | None = None,
              cubic: bool = False) -> jax.Array:
    """int32[B]: each sample's training timestep, uniform in [0, num_train_timesteps), or drawn with `bias`'s
    weights, or `cubic`: floor((1 - u^3) T), u uniform in [0, 1), the late (noisy) timesteps more often
    (train_t2i_adapter_sdxl.py's sampling, the T2I-Adapter paper's section 3.4: the structure an adapter
    conveys is decided early in sampling)."""
    if cubic:
        T = num_train_timesteps
        draw = lambda k: jnp.clip(jnp.floor((1 - jax.random.uniform(k, ()) ** 3) * T), 0, T - 1).astype(jnp.int32)
    elif bias is None:
        draw = lambda k: jax.random.randint(k, (), 0, num_train_timesteps, jnp.int32)
    else:
        logits = jnp.log(jnp.asarray(bias.weights(num_train_timesteps), jnp.float32))
        draw = lambda k: jax.random.categorical(k, logits).astype(jnp.int32)
    return _per_sample(keys, Stream.TIMESTEP, draw)


def noise(keys: jax.Array, shape: Sequence[int], offset: float = 0.0,
          input_perturbation: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """(noise, noise_in): f32[B, *shape] each, shape = one sample's latents (h, w, C).

    noise = ε + offset · δ, ε ~ N(0, 1) of `shape`, δ ~ N(0, 1) of shape (1, ..., 1, C) (offset noise:
    one shift per channel and sample); it is the epsilon/v target. noise_in = noise + input_perturbation
    · N(0, 1) is what x_t is built from (input perturbation, Ning et al. 2023); it is `noise` itself when
    input_perturbation is 0.
    """
    shape = tuple(shape)
    eps = _per_sample(keys, Stream.NOISE, lambda k: jax.random.normal(k, shape, jnp.float32))
    if not _is_zero(offset):
        channel = (1,) * (len(shape) - 1) + shape[-1:]
        eps = eps + offset * _per_sample(keys, Stream.OFFSET_NOISE, lambda k: jax.random.normal(k, channel, jnp.float32))
    if _is_zero(input_perturbation):
        return eps, eps
    extra = _per_sample(keys, Stream.PERTURBATION, lambda k: jax.random.normal(k, shape, jnp.float32))
    return eps, eps + input_perturbation * extra


def posterior_sample(keys: jax.Array, moments: jax.Array) -> jax.Array:
    """f32[B, h, w, C]: a sample of each VAE posterior, unscaled (apply `VAEConfig.to_latents` next).
    moments: [B, h, w, 2C], mean then log-variance (`DiagonalGaussian.from_moments`)."""
    return jax.vmap(lambda k, m: DiagonalGaussian.from_moments(m).sample(k))(_sub(keys, Stream.POSTERIOR), moments)


def sample_latents(keys: jax.Array, moments: jax.Array, vae: VAEConfig) -> jax.Array:
    """f32[B, h, w, C]: the diffusion model's latents, `vae.to_latents(posterior_sample(keys, moments))`."""
    return vae.to_latents(posterior_sample(keys, moments))


def latent_noise(keys: jax.Array, z: jax.Array, scale: float) -> jax.Array:
    """z [B, h, w, C] plus noise of a per-sample standard deviation `scale` * u, u ~ U[0, 1): a decoder trained
    on it learns to decode latents near the encoder's, as a diffusion model's are (none when scale is 0)."""
    if _is_zero(scale):
        return z

    def draw(k):
        ku, ke = jax.random.split(k)
        return scale * jax.random.uniform(ku, (), jnp.float32) * jax.random.normal(ke, z.shape[1:], jnp.float32)

    return z + _per_sample(keys, Stream.LATENT_NOISE, draw)


def conditioning_dropout(keys: jax.Array, p: float) -> tuple[jax.Array, jax.Array]:
    """InstructPix2Pix's (drop_text, drop_image), bool[B] each: u ~ U[0, 1) per sample, drop_text = u < 2p,
    drop_image = p ≤ u < 3p (p each of text only, both, image only; diffusers' inequalities)."""
    u = _per_sample(keys, Stream.DROPOUT, lambda k: jax.random.uniform(k, (), jnp.float32))
    return u < 2 * p, (u >= p) & (u < 3 * p)


def empty_prompt(keys: jax.Array, proportion: float) -> jax.Array:
    """bool[B]: the samples whose caption is replaced by the null conditioning (u < proportion)."""
    u = _per_sample(keys, Stream.EMPTY_PROMPT, lambda k: jax.random.uniform(k, (), jnp.float32))
    return u < proportion


def mix_conditioning(drop_text: jax.Array, drop_image: jax.Array | None, cond: Mapping[str, jax.Array],
                     null: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The conditioning after dropout.

    cond: "context" (B, 77, D), optionally "pooled" (B, P) (SDXL) and "image_latents" (B, h, w, C)
    (InstructPix2Pix); other entries pass through. null: the null text conditioning without a batch axis,
    "context" (77, D) and "pooled" (P,): what the pipeline uses without a negative prompt (zeros under
    force_zeros_for_empty_prompt, else the encoding of ""). A dropped text replaces both the context and
    the pooled embedding (diffusers' SDXL script keeps the pooled one; the pipeline's null has both); a
    dropped image is zeros.
    """
    out = dict(cond)
    for name in ("context", "pooled"):
        if name in cond:
            value = cond[name]
            mask = drop_text.reshape(-1, *(1,) * (value.ndim - 1))
            out[name] = jnp.where(mask, null[name].astype(value.dtype), value)
    if drop_image is not None and "image_latents" in cond:
        image = cond["image_latents"]
        out["image_latents"] = jnp.where(drop_image.reshape(-1, *(1,) * (image.ndim - 1)), jnp.zeros_like(image), image)
    return out


# ------------------------------------------------------------------------------------------------------
# Targets, weights, loss


def _check_prediction_type(prediction_type: str) -> None:
    if prediction_type not in PREDICTION_TYPES:
        raise SdxError(f"unknown prediction type {prediction_type!r} (choose from {', '.join(PREDICTION_TYPES)})")


def target(sched: Scheduler, prediction_type: str, latents: jax.Array, noise: jax.Array, t: jax.Array) -> jax.Array:
    """What the model learns to output at x_t = add_noise(latents, noise_in, t): f32, latents' shape.
    `noise` is the unperturbed noise (the first result of `noise`)."""
    _check_prediction_type(prediction_type)
    if prediction_type == "epsilon":
        return noise.astype(jnp.float32)
    if prediction_type == "v_prediction":
        return training.get_velocity(sched, latents.astype(jnp.float32), noise.astype(jnp.float32), t)
    return latents.astype(jnp.float32)


def min_snr_weights(sched: Scheduler, t: jax.Array, gamma: float, prediction_type: str) -> jax.Array:
    """f32[B]: min-SNR-γ loss weights (see the module docstring; finite at zero terminal SNR)."""
    _check_prediction_type(prediction_type)
    if isinstance(gamma, (int, float)) and not gamma > 0:
        raise SdxError(f"snr_gamma must be positive, got {gamma}")
    snr = training.snr(sched, t)
    if prediction_type == "epsilon":
        return jnp.minimum(gamma / snr, 1.0)  # = min(snr, γ)/snr; γ/0 = inf -> 1 at zero SNR
    clipped = jnp.minimum(snr, gamma)
    return clipped / (snr + 1) if prediction_type == "v_prediction" else clipped


def prior_preservation_weights(prior: jax.Array, weights: jax.Array | None, prior_loss_weight: float) -> jax.Array:
    """f32[B]: DreamBooth's loss weights for a batch of as many instance as class samples (prior: bool[B],
    True for a class sample; weights: the instance samples' min-SNR weights or None), so that `loss` gives
    mean(instance weights × MSE) + prior_loss_weight × mean(class MSE)."""
    instance = 2.0 if weights is None else 2.0 * weights.astype(jnp.float32)
    return jnp.where(prior, jnp.float32(2.0 * prior_loss_weight), instance)


def dream(sched: Scheduler, t: jax.Array, noise: jax.Array, noisy: jax.Array, target: jax.Array,
          predicted: jax.Array, detail_preservation: float) -> tuple[jax.Array, jax.Array]:
    """DREAM's (noisy, target) for an epsilon model (see the module docstring). predicted: the model's
    output for `noisy`, without gradient; noise: the unperturbed noise (the target's)."""
    a = jnp.asarray(sched.alphas_cumprod)[t].reshape(-1, *(1,) * (noisy.ndim - 1))  # (B, 1, 1, 1)
    sigma = (1.0 - a) ** 0.5
    delta = jax.lax.stop_gradient(noise - predicted) * sigma ** detail_preservation
    return noisy + sigma * delta, target + delta


def per_sample_mse(pred: jax.Array, target: jax.Array) -> jax.Array:
    """f32[B]: mean squared error of each sample, in float32."""
    err = jnp.square(pred.astype(jnp.float32) - target.astype(jnp.float32))
    return jnp.mean(err, axis=tuple(range(1, err.ndim)))


def loss(pred: jax.Array, target: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """f32 scalar: mean over the batch of weights × per-sample MSE (unweighted: the plain MSE)."""
    mse = per_sample_mse(pred, target)
    return jnp.mean(mse if weights is None else weights.astype(jnp.float32) * mse)


def predicted_x0(sched: Scheduler, prediction_type: str, noisy: jax.Array, pred: jax.Array, t: jax.Array) -> jax.Array:
    """f32, latents' shape: the clean latents the model's output `pred` at x_t = `noisy` implies (a sample model's
    output itself; the others' by `training.original_sample`)."""
    _check_prediction_type(prediction_type)
    if prediction_type == "sample":
        return pred.astype(jnp.float32)
    return training.original_sample(sched, noisy.astype(jnp.float32), pred.astype(jnp.float32), t,
                                    v_prediction=prediction_type == "v_prediction")


def pixel_error(decoded: jax.Array, target: jax.Array, edge_weight: float) -> jax.Array:
    """f32[B]: each sample's mean absolute error over pixels of `decoded` against `target` ((B, H, W, C) in
    [-1, 1]), each pixel's weighed by 1 + edge_weight times the target's edge strength there (`edge_strength`)."""
    err = jnp.abs(decoded.astype(jnp.float32) - target.astype(jnp.float32))
    if not _is_zero(edge_weight):
        err = err * (1.0 + edge_weight * edge_strength(target))
    return jnp.mean(err, axis=tuple(range(1, err.ndim)))


def edge_strength(x: jax.Array) -> jax.Array:
    """(B, H, W, 1) in [0, 1]: over each pixel's 3x3 neighbourhood (inside the image), the largest of the
    channels' max - min, of pixels x (B, H, W, C) in [-1, 1]."""
    window = lambda init, op: jax.lax.reduce_window(x, init, op, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")
    spread = window(-jnp.inf, jax.lax.max) - window(jnp.inf, jax.lax.min)  # (B, H, W, C)
    return jnp.max(spread, axis=-1, keepdims=True) / 2
