"""sdx.vae against diffusers' AutoencoderKL (float32, small random-weight models), plus config behaviour."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sdx import diffusers_config as DC, vae_tiles, weights
from sdx.errors import SdxError
from sdx.layers import Compute
from sdx.vae import AutoencoderKL, DiagonalGaussian, VAEConfig

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")


def _diffusers_kwargs(levels: int, **kw) -> dict:
    return dict(
        down_block_types=["DownEncoderBlock2D"] * levels, up_block_types=["UpDecoderBlock2D"] * levels, **kw
    )


# Small models; every one has non-square inputs so that an H/W mix-up fails.
CASES = {
    # two levels, quant convs, 2 resnets per encoder level (3 per decoder level); its decoder upsamples
    # 2×12×16 latents, enough pixels for `auto` on a CPU to convolve before upsampling (sdx.conv.PHASE_PIXELS)
    "quant_convs": dict(
        kw=_diffusers_kwargs(2, block_out_channels=[32, 64], layers_per_block=2, norm_num_groups=16),
        image=(2, 24, 32),
    ),
    # three levels (factor 4), no quant convs, Flux-style shift/scale, 8 latent channels
    "three_levels_shift": dict(
        kw=_diffusers_kwargs(
            3, block_out_channels=[16, 32, 32], layers_per_block=1, norm_num_groups=8, latent_channels=8,
            use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159,
        ),
        image=(2, 16, 12),
    ),
    # no mid-block attention, quant_conv without post_quant_conv; one channel per norm group
    "no_mid_attention": dict(
        kw=_diffusers_kwargs(
            2, block_out_channels=[16, 16], layers_per_block=1, norm_num_groups=16,
            use_post_quant_conv=False, mid_block_add_attention=False,
        ),
        image=(2, 8, 16),
    ),
}


def _torch_vae(kw: dict, seed: int = 0):
    """A diffusers AutoencoderKL whose every parameter (norm scales and biases included) is off its init."""
    torch.manual_seed(seed)
    model = diffusers.AutoencoderKL(**kw).eval()
    with torch.no_grad():
        for p in model.parameters():
            # norms/biases: absolute noise; kernels: noise at their own scale
            p.add_(torch.randn_like(p) * (0.2 if p.ndim == 1 else 0.5 * p.std()))
    return model


def _sdx_vae(tmodel, compute: Compute = Compute()) -> AutoencoderKL:
    cfg = VAEConfig.from_diffusers_config(dict(tmodel.config))
    state = {k: v.numpy() for k, v in tmodel.state_dict().items()}
    return weights.load_torch_state(
        weights.abstract(lambda rngs: AutoencoderKL(cfg, compute, rngs=rngs)), state, where="diffusers VAE"
    )


def _nhwc(t) -> np.ndarray:
    return t.detach().numpy().transpose(0, 2, 3, 1)


def _assert_close(name: str, got, want: np.ndarray) -> float:
    got = np.asarray(got)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = float(np.abs(got - want).max())
    scale = max(1.0, float(np.abs(want).max()))
    print(f"{name}: max abs err {err:.2e} (output scale {scale:.2f})")
    assert err <= 1e-4 * scale, f"{name}: max abs err {err:.3e} > {1e-4 * scale:.3e}"
    return err


# every case with the default convolutions, two with every convolution as a matmul (sdx.conv), one with every
# 3×3 one as Winograd's
@pytest.mark.parametrize("case, conv", [(c, "auto") for c in CASES] + [(c, "matmul") for c in ("quant_convs", "three_levels_shift")]
                         + [("quant_convs", "winograd")])
def test_parity_with_diffusers(case, conv):
    kw, (b, h, w) = CASES[case]["kw"], CASES[case]["image"]
    tmodel = _torch_vae(kw)
    model = _sdx_vae(tmodel, Compute(conv=conv))
    cfg = model.config
    f = cfg.downsample_factor
    assert f == 2 ** (len(kw["block_out_channels"]) - 1)

    rng = np.random.default_rng(0)
    # NCHW for torch. The second of each pair is a nearly flat image/latent: its GroupNorm variances are
    # ~1e-6, so a wrong norm epsilon (1e-5 for 1e-6) fails the test, which full-contrast inputs do not catch.
    flat = (np.arange(b) % 2 == 1)[:, None, None, None]
    x = (0.2 + np.where(flat, 0.01, 1.0) * rng.uniform(-1, 1, (b, 3, h, w))).astype(np.float32)
    noise = rng.standard_normal((b, cfg.latent_channels, h // f, w // f))
    z = (0.5 + np.where(flat, 0.001, 1.0) * noise).astype(np.float32)
    with torch.no_grad():
        post = tmodel.encode(torch.from_numpy(x)).latent_dist
        image = tmodel.decode(torch.from_numpy(z)).sample
        recon = tmodel(torch.from_numpy(x)).sample  # decode(posterior mode)

    x_nhwc = jnp.asarray(x.transpose(0, 2, 3, 1))
    dist = model.encode(x_nhwc)
    assert dist.mean.shape == (b, h // f, w // f, cfg.latent_channels)
    assert dist.mean.dtype == jnp.float32
    _assert_close(f"{case} mean", dist.mean, _nhwc(post.mean))
    _assert_close(f"{case} mode", dist.mode(), _nhwc(post.mode()))
    _assert_close(f"{case} logvar", dist.logvar, _nhwc(post.logvar))
    _assert_close(f"{case} std", dist.std, _nhwc(post.std))
    _assert_close(f"{case} decode", model.decode(jnp.asarray(z.transpose(0, 2, 3, 1))), _nhwc(image))
    _assert_close(f"{case} reconstruct", model(x_nhwc), _nhwc(recon))

    # what a pipeline does: scaled latents in, raw z to decode, exactly diffusers' formula
    latents = cfg.to_latents(dist.mode())
    shift, scale = kw.get("shift_factor") or 0.0, kw.get("scaling_factor", 0.18215)
    np.testing.assert_allclose(latents, (np.asarray(dist.mode()) - shift) * scale, rtol=1e-6)
    np.testing.assert_allclose(cfg.from_latents(latents), dist.mode(), rtol=1e-5, atol=1e-6)


# images cut into tiles of several shapes (whole, and cut by the right, bottom, or both edges: up to three
# sizes along a side), the last ones a few pixels wide; blends of 2-4 pixels
TILED_CASES = {
    "quant_convs, tiles of 24 px": ("quant_convs", 24, (2, 40, 30)),
    "three_levels_shift, tiles of 16 px": ("three_levels_shift", 16, (1, 36, 28)),
}


@pytest.mark.parametrize("name", TILED_CASES)
def test_tiled_passes_match_diffusers_enable_tiling(name, monkeypatch):
    """encode/decode(tiled=True) against diffusers' AutoencoderKL after `enable_tiling()`: the same tiles,
    the same blending, to float32 rounding; a pass no larger than one tile is not cut."""
    case, tile, (b, h, w) = TILED_CASES[name]
    tmodel = _torch_vae({**CASES[case]["kw"], "sample_size": tile})
    model = _sdx_vae(tmodel)
    f = model.config.downsample_factor
    assert (model.config.tiles(decoding=True).tile, model.config.tiles(decoding=False).tile) == (tile // f, tile)
    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 1, (b, 3, h, w)).astype(np.float32)
    z = (0.5 + rng.standard_normal((b, model.config.latent_channels, h // f, w // f))).astype(np.float32)
    with torch.no_grad():
        plain_moments, plain_image = tmodel.encode(torch.from_numpy(x)).latent_dist.mean, tmodel.decode(torch.from_numpy(z)).sample
        tmodel.enable_tiling()
        moments, image = tmodel.encode(torch.from_numpy(x)).latent_dist, tmodel.decode(torch.from_numpy(z)).sample

    graphdef, state = nnx.split(model)
    x, z = x.transpose(0, 2, 3, 1), z.transpose(0, 2, 3, 1)  # NHWC
    passes = lambda state, x, z: (lambda vae: (vae.encode(x, tiled=True), vae.decode(z, tiled=True)))(nnx.merge(graphdef, state))
    dist, decoded = jax.jit(passes)(state, x, z)
    _assert_close(f"{name} tiled mean", dist.mean, _nhwc(moments.mean))
    _assert_close(f"{name} tiled logvar", dist.logvar, _nhwc(moments.logvar))
    _assert_close(f"{name} tiled decode", decoded, _nhwc(image))
    # the tiles are really there: each GroupNorm sees one tile, so the tiled passes differ from the plain ones
    assert np.abs(_nhwc(image) - _nhwc(plain_image)).max() > 1e-2
    assert np.abs(_nhwc(moments.mean) - _nhwc(plain_moments)).max() > 1e-2
    monkeypatch.setattr(vae_tiles.Tiles, "corners", lambda *a: pytest.fail("a pass within one tile was cut"))
    jax.eval_shape(passes, state, x[:, :tile, :tile], z[:, :tile // f, :tile // f])


@pytest.mark.parametrize("tile", [2, 18])
def test_tiles_that_do_not_line_up_are_an_error(tile):
    """Tiles of 18 px on a factor-2 VAE: diffusers decodes tiles of 9 latents every 6 and keeps 14 pixels of
    each, 2 more than 6 latents make: its image comes out larger than untiled, each tile misplaced. Tiles
    of 2 px: one latent, which would not advance."""
    model = _sdx_vae(_torch_vae({**CASES["quant_convs"]["kw"], "sample_size": tile}))
    for tiled_pass, x in ((model.decode, jnp.zeros((1, 12, 12, 4))), (model.encode, jnp.zeros((1, 24, 24, 3)))):
        with pytest.raises(SdxError, match="do not line up.*multiple of 4 x its downsample factor"):
            tiled_pass(x, tiled=True)


def test_jit_and_bfloat16():
    """Under nnx.jit, in bfloat16: the posterior stays float32, decode returns the compute dtype."""
    tmodel = _torch_vae(CASES["no_mid_attention"]["kw"])
    model = _sdx_vae(tmodel, Compute(dtype=jnp.bfloat16))
    x = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (1, 8, 16, 3)), jnp.float32)
    dist = nnx.jit(lambda m, a: m.encode(a))(model, x)
    assert isinstance(dist, DiagonalGaussian) and dist.mean.dtype == jnp.float32
    assert dist.mean.shape == (1, 4, 8, 4)
    ref = _sdx_vae(tmodel).encode(x)
    assert float(jnp.abs(dist.mean - ref.mean).max()) < 0.1 * max(1.0, float(jnp.abs(ref.mean).max()))
    assert model.decode(dist.mode()).dtype == jnp.bfloat16


def test_wrong_layout_is_an_error():
    model = _sdx_vae(_torch_vae(CASES["no_mid_attention"]["kw"]))
    with pytest.raises(SdxError, match=r"NHWC image batch \(B, H, W, 3\)"):
        model.encode(jnp.zeros((1, 3, 8, 8)))
    with pytest.raises(SdxError, match="latent"):
        model.decode(jnp.zeros((1, 3, 3)))


# --------------------------------------------------------------------------------------------------
# Posterior


def test_diagonal_gaussian():
    rng = np.random.default_rng(0)
    mean = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    logvar = rng.uniform(-3, 3, (2, 3, 5, 4)).astype(np.float32)
    logvar[0, 0, 0, :2] = [50.0, -100.0]  # clipped to [-30, 20] as in diffusers
    dist = DiagonalGaussian.from_moments(jnp.asarray(np.concatenate([mean, logvar], axis=-1)))
    np.testing.assert_array_equal(dist.mean, mean)
    np.testing.assert_array_equal(dist.mode(), mean)
    assert dist.logvar[0, 0, 0, 0] == 20.0 and dist.logvar[0, 0, 0, 1] == -30.0
    np.testing.assert_allclose(dist.std, np.exp(0.5 * np.clip(logvar, -30, 20)), rtol=1e-6)

    key = jax.random.key(3)
    s = dist.sample(key)
    np.testing.assert_allclose(s, dist.mean + dist.std * jax.random.normal(key, mean.shape), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(dist.sample(key), s)
    assert s.dtype == jnp.float32 and not np.allclose(dist.sample(jax.random.key(4)), s)
    # a pytree: goes through jit
    np.testing.assert_allclose(jax.jit(lambda d, k: d.sample(k))(dist, key), s, rtol=1e-5)
    kl = 0.5 * np.sum(np.asarray(dist.mean) ** 2 + np.asarray(dist.var) - 1 - np.asarray(dist.logvar), axis=(1, 2, 3))
    np.testing.assert_allclose(dist.kl(), kl, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# Config

_SD15_CONFIG = {  # runwayml/stable-diffusion-v1-5 vae/config.json
    "_class_name": "AutoencoderKL", "_diffusers_version": "0.6.0", "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3, "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32, "out_channels": 3,
    "sample_size": 512, "scaling_factor": 0.18215, "up_block_types": ["UpDecoderBlock2D"] * 4,
}
_SD21_CONFIG = {  # stabilityai/stable-diffusion-2-1(-base) vae/config.json: no scaling_factor key
    **{k: v for k, v in _SD15_CONFIG.items() if k != "scaling_factor"},
    "_diffusers_version": "0.10.0.dev0", "_name_or_path": "./vae", "sample_size": 768,
}
_SDXL_CONFIG = {  # stabilityai/stable-diffusion-xl-base-1.0 vae/config.json
    **_SD15_CONFIG, "_diffusers_version": "0.20.0.dev0", "force_upcast": True, "sample_size": 1024,
    "scaling_factor": 0.13025,
}


def test_presets_match_released_configs():
    assert VAEConfig.from_diffusers_config(_SD15_CONFIG) == VAEConfig.preset("sd15")
    assert VAEConfig.from_diffusers_config(_SD21_CONFIG) == dataclasses.replace(VAEConfig.preset("sd15"), sample_size=768)
    assert VAEConfig.from_diffusers_config(_SDXL_CONFIG) == VAEConfig.preset("sdxl_base") == VAEConfig.preset("sdxl_refiner")
    assert VAEConfig.preset("sdxl_base").force_upcast and VAEConfig.preset("sdxl_base").scaling_factor == 0.13025
    assert VAEConfig.preset("sd15").downsample_factor == VAEConfig.preset("sdxl_base").downsample_factor == 8
    assert VAEConfig.preset("tiny").downsample_factor == 2
    with pytest.raises(SdxError, match="unknown preset 'sd3'"):
        VAEConfig.preset("sd3")


def test_real_size_parameter_names_match_diffusers():
    """The full SD/SDXL VAE, built abstractly, has exactly diffusers' keys and shapes (no compute)."""
    with torch.device("meta"):
        tmodel = diffusers.AutoencoderKL(**{k: v for k, v in _SDXL_CONFIG.items() if not k.startswith("_")})
    want = {k: tuple(v.shape) for k, v in tmodel.state_dict().items()}
    model = weights.abstract(lambda rngs: AutoencoderKL(VAEConfig.preset("sdxl_base"), rngs=rngs))
    fake = {k: np.broadcast_to(np.float32(0), s) for k, s in want.items()}
    mapped = weights.from_torch_keys(weights.param_shapes(model), fake, where="sdxl vae")  # strict both ways
    assert len(mapped) == len(want) == 248


@pytest.mark.parametrize("name", ["sd15", "sdxl_base", "tiny"])
def test_config_round_trip(name):
    cfg = dataclasses.replace(VAEConfig.preset(name), shift_factor=0.5, sample_size=(64, 96))
    for c in (VAEConfig.preset(name), cfg):
        assert VAEConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(SdxError, match="unknown field.*attention_head_dim"):
        VAEConfig.from_dict({**cfg.to_dict(), "attention_head_dim": 8})


def test_scaling_helpers():
    cfg = VAEConfig(scaling_factor=0.5, shift_factor=0.25)
    z = jnp.array([1.0, -2.0])
    np.testing.assert_allclose(cfg.to_latents(z), [0.375, -1.125])
    np.testing.assert_allclose(cfg.from_latents(cfg.to_latents(z)), z)
    np.testing.assert_allclose(VAEConfig.preset("sd15").to_latents(z), z * 0.18215)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"act_fn": "gelu"}, "act_fn"),
        ({"down_block_types": ["DownEncoderBlock2D"] * 3 + ["AttnDownEncoderBlock2D"]}, "down_block_types"),
        ({"up_block_types": ["UpDecoderBlock2D"] * 3}, "up_block_types"),
        ({"_class_name": "AutoencoderTiny"}, "_class_name"),
        ({"norm_type": "spatial"}, "norm_type"),  # a field sdx does not know: it might change the math
        ({"norm_num_groups": 48}, "norm_num_groups"),
    ],
)
def test_unimplemented_config_is_an_error(change, field):
    with pytest.raises(SdxError, match=field):
        VAEConfig.from_diffusers_config({**_SD15_CONFIG, **change})


@pytest.mark.parametrize("change, message", [
    ({"latents_mean": [0.0] * 4}, "latents_mean and latents_std go together"),
    ({"latents_mean": [0.0] * 3, "latents_std": [1.0] * 3}, "latents_mean has 3 entries for 4 latent channels"),
    ({"latents_mean": [0.0] * 4, "latents_std": [1.0, 0.0, 1.0, 1.0]}, "latents_std must be non-zero"),
])
def test_latent_statistics_are_checked(change, message):
    with pytest.raises(SdxError, match=message):
        VAEConfig.from_diffusers_config({**_SD15_CONFIG, **change})


def test_latent_statistics_scale_each_channel_as_diffusers_sdxl_pipelines():
    """Playground v2.5's VAE: encode (z - mean) * scale / std (SDXL img2img), decode latents * std / scale + mean."""
    mean, std = [-1.6574, 1.886, -1.383, 2.5155], [8.4927, 5.9022, 6.8341, 5.4722]
    cfg = VAEConfig.from_diffusers_config({**_SD15_CONFIG, "scaling_factor": 0.5, "latents_mean": mean, "latents_std": std})
    z = np.random.default_rng(0).standard_normal((2, 3, 5, 4)).astype(np.float32)  # NHWC
    m, s = (torch.tensor(v).view(1, 4, 1, 1) for v in (mean, std))
    zt = torch.from_numpy(z).permute(0, 3, 1, 2)
    want = ((zt - m) * 0.5 / s).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(cfg.to_latents(jnp.asarray(z)), want, rtol=1e-6)
    np.testing.assert_allclose(cfg.from_latents(jnp.asarray(want)), (torch.from_numpy(want).permute(0, 3, 1, 2) * s / 0.5
                                                                     + m).permute(0, 2, 3, 1).numpy(), rtol=1e-6)
    assert VAEConfig.from_diffusers_config(cfg.to_diffusers_config()) == cfg


def test_every_diffusers_field_is_accounted_for():
    import inspect

    params = inspect.signature(diffusers.AutoencoderKL.__init__).parameters
    theirs = {k: p.default for k, p in params.items() if k != "self"}
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in DC.VAE_DEFAULTS.items()} == {
        k: list(v) if isinstance(v, tuple) else v for k, v in theirs.items()
    }
    honoured, fixed = set(DC.VAE_HONOURED), set(DC.VAE_FIXED) | {"down_block_types", "up_block_types"}
    assert honoured == {f.name for f in dataclasses.fields(VAEConfig)}
    assert not honoured & fixed and honoured | fixed == set(theirs)


def test_bookkeeping_keys_are_ignored():
    d = {**_SDXL_CONFIG, "_name_or_path": "/x", "_use_default_values": ["shift_factor"], "_commit_hash": "abc"}
    assert VAEConfig.from_diffusers_config(d) == VAEConfig.preset("sdxl_base")
