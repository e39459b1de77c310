"""The KL autoencoder of Stable Diffusion (diffusers' `AutoencoderKL`), NHWC, in Flax NNX.

Images (B, H, W, 3) in [-1, 1] go to a diagonal Gaussian over latents (B, H/f, W/f, latent_channels),
f = `config.downsample_factor` = 2^(levels-1) (8 for every released SD/SDXL VAE). The module works on
raw latents `z`, as diffusers' `vae.encode`/`vae.decode` do; the diffusion models see
`config.to_latents(z)` = (z - shift_factor) * scaling_factor, and `config.from_latents` undoes it.

Parameter paths mirror diffusers' keys (`encoder.down_blocks.0.resnets.0.conv1`,
`encoder.mid_block.attentions.0.to_q`, `decoder.up_blocks.0.upsamplers.0.conv`, `quant_conv`), so
`sdx.weights.load_torch_state` maps a diffusers state dict mechanically.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx, struct

from sdx import diffusers_config, presets, vae_tiles
from sdx.config import JsonConfig, Kind
from sdx.errors import SdxError
from sdx.layers import F32, Attention, Compute, Downsample2D, GroupNorm, ResnetBlock2D, Upsample2D, conv

_EPS = 1e-6  # every GroupNorm of the VAE (diffusers hard-codes resnet_eps=1e-6 in Encoder/Decoder)


# --------------------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True)
class VAEConfig(JsonConfig):
    """Architecture of an AutoencoderKL plus the latent scaling the diffusion models expect.

    The field names are diffusers' config.json keys. `scaling_factor`/`shift_factor` do not enter the
    module's math (see `to_latents`/`from_latents`). `force_upcast`: the weights overflow in float16
    (the SDXL VAE), so a pipeline running in float16 must run this VAE in float32. `sample_size` is the
    image size the VAE was trained at: a tiled pass's tile size (`tiles`).
    """

    label: ClassVar[str] = "VAE config"
    kinds: ClassVar[Mapping[str, Kind]] = {k: kind for k, kind in diffusers_config.VAE_KINDS.items()
                                           if not k.endswith("_block_types")}

    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    latent_channels: int = 4
    norm_num_groups: int = 32
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None  # per latent channel (Playground v2.5's VAE)
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True
    sample_size: int | tuple[int, ...] = 512

    def __post_init__(self):
        object.__setattr__(self, "block_out_channels", tuple(int(c) for c in self.block_out_channels))
        if isinstance(self.sample_size, (list, tuple)):
            object.__setattr__(self, "sample_size", tuple(int(s) for s in self.sample_size))
        if not self.block_out_channels:
            raise SdxError("VAE config: block_out_channels is empty")
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            raise SdxError(
                f"VAE config: block_out_channels {self.block_out_channels} must all be divisible by "
                f"norm_num_groups={self.norm_num_groups}"
            )
        if self.layers_per_block < 1:
            raise SdxError(f"VAE config: layers_per_block={self.layers_per_block} must be at least 1")
        if not self.scaling_factor:
            raise SdxError("VAE config: scaling_factor must be a non-zero number")
        for name in ("latents_mean", "latents_std"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(v) for v in value))
                if len(getattr(self, name)) != self.latent_channels:
                    raise SdxError(f"VAE config: {name} has {len(value)} entries for {self.latent_channels} latent "
                                   "channels")
        if (self.latents_mean is None) != (self.latents_std is None):
            raise SdxError("VAE config: latents_mean and latents_std go together (give both, or neither)")
        if self.latents_std is not None and (self.shift_factor is not None or not all(self.latents_std)):
            raise SdxError("VAE config: latents_std must be non-zero, and latents_mean/latents_std do not go with "
                           "shift_factor")

    def tiles(self, decoding: bool) -> vae_tiles.Tiles:
        """Where a tiled decode's (or encode's) tiles are: diffusers' sizes, tiles of `sample_size` image pixels
        (its first entry when it is a pair; tile_sample_min_size) and that // downsample_factor latent pixels
        (tile_latent_min_size). An SdxError when they do not line up (`vae_tiles.Tiles.for_pass`)."""
        size = self.sample_size[0] if isinstance(self.sample_size, tuple) else self.sample_size
        latent = size // self.downsample_factor
        return vae_tiles.Tiles.for_pass(latent, size) if decoding else vae_tiles.Tiles.for_pass(size, latent)

    @property
    def downsample_factor(self) -> int:
        """Image pixels per latent pixel along each side: 2^(len(block_out_channels) - 1)."""
        return 2 ** (len(self.block_out_channels) - 1)

    def to_latents(self, z: jax.Array) -> jax.Array:
        """Raw VAE latent (a posterior sample or mode, (..., C)) -> the diffusion model's latent: (z - shift) *
        scale, or with per-channel statistics (z - mean) * scale / std (diffusers' SDXL img2img pipeline)."""
        if self.latents_mean is not None:
            std, mean = (jnp.asarray(v, z.dtype) for v in (self.latents_std, self.latents_mean))
            return (z - mean) * self.scaling_factor / std
        if self.shift_factor is not None:
            z = z - self.shift_factor
        return z * self.scaling_factor

    def from_latents(self, latents: jax.Array) -> jax.Array:
        """The diffusion model's latent -> raw VAE latent for `decode`: latents / scale + shift, or latents * std /
        scale + mean."""
        if self.latents_mean is not None:
            std, mean = (jnp.asarray(v, latents.dtype) for v in (self.latents_std, self.latents_mean))
            return latents * std / self.scaling_factor + mean
        z = latents / self.scaling_factor
        if self.shift_factor is not None:
            z = z + self.shift_factor
        return z

    # -- serialisation -------------------------------------------------------------------------------

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> VAEConfig:
        """From a diffusers `vae/config.json` dict (missing keys take diffusers' defaults; the rules for
        every key are `sdx.diffusers_config`'s)."""
        return cls(**diffusers_config.vae_fields(d))

    def to_diffusers_config(self) -> dict[str, Any]:
        """A complete diffusers `vae/config.json` dict (`AutoencoderKL(**d)` accepts it without `_` keys);
        `from_diffusers_config` reads it back to an equal config."""
        return diffusers_config.vae_to_diffusers(self.to_dict())

    @classmethod
    def preset(cls, name: str) -> VAEConfig:
        """The VAE of pipeline preset `name` of `sdx.presets` (sd15, sdxl_base, tiny, ...)."""
        return cls.from_diffusers_config(presets.get(name).configs["vae"])


# --------------------------------------------------------------------------------------------------
# Posterior


@struct.dataclass
class DiagonalGaussian:
    """The encoder's posterior N(mean, exp(logvar)) per latent element, in float32 (a pytree).

    mean, logvar: (B, h, w, latent_channels); logvar clipped to [-30, 20] as in diffusers.
    """

    mean: jax.Array
    logvar: jax.Array

    @classmethod
    def from_moments(cls, moments: jax.Array) -> DiagonalGaussian:
        """moments: (B, h, w, 2*latent_channels), mean first then log-variance (diffusers' chunk order)."""
        mean, logvar = jnp.split(moments.astype(jnp.float32), 2, axis=-1)
        return cls(mean=mean, logvar=jnp.clip(logvar, -30.0, 20.0))

    @property
    def std(self) -> jax.Array:
        return jnp.exp(0.5 * self.logvar)

    @property
    def var(self) -> jax.Array:
        return jnp.exp(self.logvar)

    def mode(self) -> jax.Array:
        return self.mean

    def sample(self, key: jax.Array) -> jax.Array:
        """mean + std * eps, eps ~ N(0, 1) drawn from `key` (float32)."""
        return self.mean + self.std * jax.random.normal(key, self.mean.shape, jnp.float32)

    def kl(self) -> jax.Array:
        """KL(self || N(0, 1)) summed over (h, w, c): (B,)."""
        return 0.5 * jnp.sum(self.mean**2 + self.var - 1.0 - self.logvar, axis=(1, 2, 3))


# --------------------------------------------------------------------------------------------------
# Blocks


class DownEncoderBlock2D(nnx.Module):
    """`layers` resnets then (except at the last level) a stride-2 conv with (0,1,0,1) padding."""

    def __init__(self, cp: Compute, cin: int, cout: int, *, layers: int, groups: int, downsample: bool, rngs: nnx.Rngs):
        self.resnets = nnx.List([
            ResnetBlock2D(cp, cin if i == 0 else cout, cout, temb_channels=None, groups=groups, eps=_EPS, rngs=rngs)
            for i in range(layers)
        ])
        self.downsamplers = nnx.List([Downsample2D(cp, cout, padding=0, rngs=rngs)]) if downsample else None

    def __call__(self, x):
        for resnet in self.resnets:
            x = resnet(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)  # (B, H/2, W/2, C)
        return x


class UpDecoderBlock2D(nnx.Module):
    """`layers` resnets then (except at the last level) nearest 2x upsampling and a conv."""

    def __init__(self, cp: Compute, cin: int, cout: int, *, layers: int, groups: int, upsample: bool, rngs: nnx.Rngs):
        self.resnets = nnx.List([
            ResnetBlock2D(cp, cin if i == 0 else cout, cout, temb_channels=None, groups=groups, eps=_EPS, rngs=rngs)
            for i in range(layers)
        ])
        self.upsamplers = nnx.List([Upsample2D(cp, cout, rngs=rngs)]) if upsample else None

    def __call__(self, x):
        for resnet in self.resnets:
            x = resnet(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)  # (B, 2H, 2W, C)
        return x


class UNetMidBlock2D(nnx.Module):
    """resnets.0, single-head full self-attention over all pixels (group-normed, residual), resnets.1."""

    def __init__(self, cp: Compute, channels: int, *, groups: int, attention: bool, rngs: nnx.Rngs):
        block = lambda: ResnetBlock2D(cp, channels, channels, temb_channels=None, groups=groups, eps=_EPS, rngs=rngs)
        self.resnets = nnx.List([block(), block()])
        # diffusers: Attention(heads=1, dim_head=channels, norm_num_groups=groups, residual_connection=True,
        # bias=True, upcast_softmax=True, _from_deprecated_attn_block=True); sdx's softmax is always float32.
        self.attentions = nnx.List([
            Attention(
                cp, channels, heads=1, head_dim=channels, qkv_bias=True, groups=groups, eps=_EPS, residual=True,
                rescale_output_factor=1.0, rngs=rngs,
            )
        ]) if attention else None

    def __call__(self, x):
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class Encoder(nnx.Module):
    """conv_in, down blocks, mid block, GroupNorm-SiLU-conv_out to 2*latent_channels moments."""

    def __init__(self, cfg: VAEConfig, cp: Compute, *, rngs: nnx.Rngs):
        ch, g = cfg.block_out_channels, cfg.norm_num_groups
        self.conv_in = conv(cp, cfg.in_channels, ch[0], 3, rngs=rngs)
        self.down_blocks = nnx.List([
            DownEncoderBlock2D(
                cp, ch[max(i - 1, 0)], ch[i], layers=cfg.layers_per_block, groups=g,
                downsample=i < len(ch) - 1, rngs=rngs,
            )
            for i in range(len(ch))
        ])
        self.mid_block = UNetMidBlock2D(cp, ch[-1], groups=g, attention=cfg.mid_block_add_attention, rngs=rngs)
        self.conv_norm_out = GroupNorm(cp, ch[-1], g, _EPS, rngs=rngs)
        self.conv_out = conv(cp, ch[-1], 2 * cfg.latent_channels, 3, rngs=rngs)

    def __call__(self, x):
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))  # (B, h, w, 2*latent_channels)


class Decoder(nnx.Module):
    """conv_in, mid block, up blocks over the reversed channels (layers_per_block+1 resnets each), out."""

    def __init__(self, cfg: VAEConfig, cp: Compute, *, rngs: nnx.Rngs):
        ch, g = tuple(reversed(cfg.block_out_channels)), cfg.norm_num_groups
        self.conv_in = conv(cp, cfg.latent_channels, ch[0], 3, rngs=rngs)
        self.mid_block = UNetMidBlock2D(cp, ch[0], groups=g, attention=cfg.mid_block_add_attention, rngs=rngs)
        self.up_blocks = nnx.List([
            UpDecoderBlock2D(
                cp, ch[max(i - 1, 0)], ch[i], layers=cfg.layers_per_block + 1, groups=g,
                upsample=i < len(ch) - 1, rngs=rngs,
            )
            for i in range(len(ch))
        ])
        self.conv_norm_out = GroupNorm(cp, ch[-1], g, _EPS, rngs=rngs)
        self.conv_out = conv(cp, ch[-1], cfg.out_channels, 3, rngs=rngs)

    def __call__(self, z):
        x = self.conv_in(z)
        x = self.mid_block(x)
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))  # (B, H, W, out_channels)


class AutoencoderKL(nnx.Module):
    """encode: image (B, H, W, 3) in [-1, 1] -> DiagonalGaussian over raw z (B, H/f, W/f, latent_channels);
    decode: raw z -> image (B, H, W, 3), roughly in [-1, 1]. f = config.downsample_factor.

    The posterior is float32 whatever `compute.dtype`; `decode` returns `compute.dtype`.
    """

    READ_ON_USE = ("encoder", "quant_conv")
    """What a text-to-image run never reads: loading does not read these parameters' file pages ahead
    (`sdx.weights.materialize`, on a CPU); a run that encodes reads them when it first does (0.13 GB at SD
    1.5's and SDXL's size)."""

    def __init__(self, config: VAEConfig, compute: Compute = F32, *, rngs: nnx.Rngs):
        self.config, self.compute = config, compute
        lc = config.latent_channels
        self.encoder = Encoder(config, compute, rngs=rngs)
        self.decoder = Decoder(config, compute, rngs=rngs)
        self.quant_conv = conv(compute, 2 * lc, 2 * lc, 1, rngs=rngs) if config.use_quant_conv else None
        self.post_quant_conv = conv(compute, lc, lc, 1, rngs=rngs) if config.use_post_quant_conv else None

    def encode(self, x: jax.Array, tiled: bool = False) -> DiagonalGaussian:
        """tiled: an image larger than a tile (`config.tiles`) is encoded in overlapping tiles, blended
        (`sdx.vae_tiles`, diffusers' `enable_tiling`)."""
        _check_channels("encode", x, self.config.in_channels, "image")
        x = x.astype(self.compute.dtype)
        moments = vae_tiles.apply(self._moments, x, self.config.tiles(decoding=False)) if tiled else self._moments(x)
        return DiagonalGaussian.from_moments(moments)

    def _moments(self, x: jax.Array) -> jax.Array:
        h = self.encoder(x)
        return h if self.quant_conv is None else self.quant_conv(h)  # (B, h, w, 2 * latent_channels)

    def decode(self, z: jax.Array, tiled: bool = False) -> jax.Array:
        """tiled: latents larger than a tile (`config.tiles`) are decoded in overlapping tiles, blended
        (`sdx.vae_tiles`, diffusers' `enable_tiling`): one tile's working memory at a time."""
        _check_channels("decode", z, self.config.latent_channels, "latent")
        z = z.astype(self.compute.dtype)
        return vae_tiles.apply(self._decoded, z, self.config.tiles(decoding=True)) if tiled else self._decoded(z)

    def _decoded(self, z: jax.Array) -> jax.Array:
        return self.decoder(z if self.post_quant_conv is None else self.post_quant_conv(z))

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """Reconstruction: decode the posterior's mode, or a sample when `key` is given (diffusers' forward)."""
        dist = self.encode(x)
        return self.decode(dist.mode() if key is None else dist.sample(key))


def _check_channels(what: str, x: jax.Array, channels: int, kind: str) -> None:
    if x.ndim != 4 or x.shape[-1] != channels:
        raise SdxError(
            f"VAE {what}: expected an NHWC {kind} batch (B, H, W, {channels}), got shape {tuple(x.shape)}"
        )
