"""train.vae's loss against LDM's formula computed in PyTorch on diffusers' AutoencoderKL with the same
weights, the posterior sample and the decoder's input noise drawn from the same per-sample keys: every
flag that changes the math (--reconstruction_loss, --kl_weight, --edge_weight, --latent_noise,
--decoder_only, and --unet_latents, whose batches bring the latents to decode)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.test_train_objective import sample_keys
from tests.test_vae import CASES, _sdx_vae, _torch_vae
from train import vae as vaetask
from train.objective import Stream
from train.vae import VAELoss

torch = pytest.importorskip("torch")
F = torch.nn.functional

KW = CASES["quant_convs"]["kw"]  # latents 4x smaller than the pictures, quant convs on both sides


def _pictures(n: int = 3, h: int = 16, w: int = 24) -> np.ndarray:
    """(n, h, w, 3) in [-1, 1]: a flat background with a square of another colour, its edge soft on one side."""
    rng = np.random.default_rng(0)
    x = np.broadcast_to(rng.uniform(-1, 1, (n, 1, 1, 3)), (n, h, w, 3)).copy()
    x[:, 4:11, 6:15] = rng.uniform(-1, 1, (n, 1, 1, 3))
    x[:, 4:11, 15] = 0.5 * x[:, 4:11, 14] + 0.5 * x[:, 4:11, 16]
    return x.astype(np.float32)


def _nchw(a) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, np.float32).transpose(0, 3, 1, 2).copy())


def _reference(tmodel, x: np.ndarray, keys, cfg: VAELoss, latents: np.ndarray | None = None) -> float:
    """LDM's loss, mean over the batch of sum(weight * error) + kl_weight * KL, in PyTorch; given `latents`
    (NHWC, the decoder's units), those decoded against x, without the KL term."""
    xt = _nchw(x)
    with torch.no_grad():
        dist = tmodel.encode(xt).latent_dist
        shape = tuple(dist.mean.shape[i] for i in (2, 3, 1))  # one sample's NHWC latents (h, w, C)
        eps = jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, Stream.POSTERIOR), shape))(keys)
        z = dist.mean + dist.std * _nchw(eps) if latents is None else _nchw(latents)

        def noise(k):
            ku, ke = jax.random.split(jax.random.fold_in(k, Stream.LATENT_NOISE))
            return jax.random.uniform(ku, ()) * jax.random.normal(ke, shape)

        z = z + cfg.latent_noise * _nchw(jax.vmap(noise)(keys))
        recon = tmodel.decode(z).sample
        err = (recon - xt).abs() if cfg.reconstruction_loss == "l1" else (recon - xt) ** 2
        spread = F.max_pool2d(xt, 3, 1, 1) + F.max_pool2d(-xt, 3, 1, 1)  # max - min over 3x3, -inf padded
        err = err * (1 + cfg.edge_weight * spread.amax(dim=1, keepdim=True) / 2)
        kl = dist.kl() if latents is None else 0.0
        return float((err.sum(dim=(1, 2, 3)) + cfg.kl_weight * kl).mean())


@pytest.fixture(scope="module")
def models():
    tmodel = _torch_vae(KW)
    return tmodel, _sdx_vae(tmodel)


@pytest.mark.parametrize("cfg", [
    VAELoss("l1", 1e-6, False),
    VAELoss("l2", 0.5, False),
    VAELoss("l1", 1e-3, True, edge_weight=10.0),
    VAELoss("l2", 1e-6, False, edge_weight=3.0, latent_noise=0.5),
    VAELoss("l1", 0.0, True, latent_noise=2.0),
], ids=["l1", "l2-kl", "edges", "l2-edges-noise", "noise"])
def test_loss_matches_ldm_in_pytorch(models, cfg):
    tmodel, vae = models
    x = _pictures()
    keys = sample_keys(jax.random.key(5), np.arange(len(x)))
    graphdef, params = nnx.split(vae, nnx.Param)
    loss, aux = vaetask.vae_loss(graphdef, cfg)(params, {"pixels": jnp.asarray(x)}, keys, {})
    want = _reference(tmodel, x, keys, cfg)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5)
    assert float(aux["l1_per_pixel"]) > 0
    if cfg.latent_noise:  # the noise changes the loss: the draw is used, not only made
        plain = vaetask.vae_loss(graphdef, dataclasses.replace(cfg, latent_noise=0.0))(
            params, {"pixels": jnp.asarray(x)}, keys, {})[0]
        assert abs(float(plain) - want) > 1e-3 * want


@pytest.mark.parametrize("cfg", [
    VAELoss("l1", 1e-3, True, edge_weight=10.0),
    VAELoss("l2", 0.5, True, latent_noise=0.5),
], ids=["edges", "l2-noise"])
def test_given_latents_are_decoded_against_the_pictures(models, cfg):
    """--unet_latents: the batch's latents (not the encoder's) are decoded; no KL term, whatever its weight."""
    tmodel, vae = models
    x = _pictures()
    keys = sample_keys(jax.random.key(7), np.arange(len(x)))
    graphdef, params = nnx.split(vae, nnx.Param)
    shape = vae.encode(jnp.asarray(x)).mean.shape  # (B, h, w, C)
    latents = np.random.default_rng(3).normal(size=shape).astype(np.float32)
    loss, aux = vaetask.vae_loss(graphdef, cfg)(params, {"pixels": jnp.asarray(x), "unet_latents": latents}, keys, {})
    np.testing.assert_allclose(float(loss), _reference(tmodel, x, keys, cfg, latents), rtol=2e-5)
    assert "kl_per_element" not in aux
    encoded = vaetask.vae_loss(graphdef, cfg)(params, {"pixels": jnp.asarray(x)}, keys, {})[0]
    assert abs(float(encoded) - float(loss)) > 1e-2 * float(loss)  # the given latents, not the encoder's



def test_decoder_only_takes_no_gradient_into_the_encoder(models):
    _, vae = models
    x = jnp.asarray(_pictures(2))
    keys = sample_keys(jax.random.key(1), np.arange(2))
    graphdef, params = nnx.split(vae, nnx.Param)
    cfg = VAELoss("l1", 1e-3, True, edge_weight=5.0, latent_noise=0.3)
    grads = jax.grad(lambda p: vaetask.vae_loss(graphdef, cfg)(p, {"pixels": x}, keys, {})[0])(params)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    for path, g in flat:
        side = path[0].key in vaetask.ENCODER_SIDE
        assert (float(jnp.abs(g).max()) == 0) == side, jax.tree_util.keystr(path)
