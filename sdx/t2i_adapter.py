"""T2I-Adapter (Mou et al. 2023, "T2I-Adapter: Learning Adapters to Dig out More Controllable Ability for
Text-to-Image Diffusion Models", arXiv:2302.08453): a small convolutional network that reads a control
image (sketch, depth, pose, canny, ...) once and returns one feature map per UNet level, which the UNet adds
inside its down blocks (`UNet2DConditionModel.__call__`'s `down_intrablock_additional_residuals`).

`T2IAdapter` mirrors diffusers' class of the same name (diffusers/models/adapter.py): its attribute paths are
diffusers' state-dict keys (`adapter.conv_in`, `adapter.body.1.in_conv`, `adapter.body.1.resnets.0.block1`),
so a diffusers folder loads with no rename table (`convert.t2i_adapter`). Three architectures, as released:

- full (`t2iadapter_*_sd14v1`, `t2i-adapter_*_sd15`): pixel-unshuffle by 8 (the latent's size), a 3x3 conv,
  then one block per width, each after the first halving the map (2x2 mean, rounding sizes up) and widening
  it with a 1x1 conv; each block is `num_res_blocks` resnets (3x3 conv, ReLU, 1x1 conv, plus the input).
- full_xl (`t2i-adapter-*-sdxl-1.0`): pixel-unshuffle by 16 (half the latent's size, SDXL's first level after
  its downsampler); only the third block halves the map.
- light (`t2iadapter_color_sd14v1`): no conv_in; every block is 1x1 in, resnets of two 3x3 convs at a
  quarter width, 1x1 out; every block after the first halves the map, and one more block repeats the last
  width at half its size.

Tensors are NHWC; the control image is (B, H, W, in_channels) in [0, 1], H and W multiples of the
unshuffle factor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from sdx.config import COUNT, COUNT_LIST, NAME, JsonConfig, Kind, check_types
from sdx.errors import SdxError
from sdx.layers import F32, Compute, conv

FULL, FULL_XL, LIGHT = "full_adapter", "full_adapter_xl", "light_adapter"
TYPES = (FULL, FULL_XL, LIGHT)


@dataclasses.dataclass(frozen=True)
class T2IAdapterConfig(JsonConfig):
    """diffusers' T2IAdapter config: in_channels of the control image; channels, each block's width;
    num_res_blocks per block; downscale_factor, the pixel-unshuffle's; adapter_type, one of `TYPES`."""

    label: ClassVar[str] = "t2i-adapter config"
    kinds: ClassVar[Mapping[str, Kind]] = {
        "in_channels": COUNT, "channels": COUNT_LIST, "num_res_blocks": COUNT, "downscale_factor": COUNT,
        "adapter_type": NAME,
    }

    in_channels: int = 3
    channels: tuple[int, ...] = (320, 640, 1280, 1280)
    num_res_blocks: int = 2
    downscale_factor: int = 8
    adapter_type: str = FULL

    def __post_init__(self):
        if self.adapter_type not in TYPES:
            raise SdxError(f"{self.label}: adapter_type {self.adapter_type!r} is not one of {', '.join(TYPES)}")
        if self.adapter_type == FULL_XL and len(set(self.channels[2:])) > 1:
            raise SdxError(f"{self.label}: a {FULL_XL}'s channels from the third on must be equal (its blocks after "
                           f"the third keep the width), got {list(self.channels)}")
        if self.adapter_type == LIGHT and any(c % 4 for c in self.channels):
            raise SdxError(f"{self.label}: a {LIGHT}'s channels must be multiples of 4 (its resnets run at a quarter)")

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> T2IAdapterConfig:
        """From a diffusers T2IAdapter `config.json` dict (missing fields take diffusers' defaults)."""
        if not isinstance(d, Mapping):
            raise SdxError(f"{cls.label}: must be a JSON object, not {type(d).__name__}")
        if d.get("_class_name", "T2IAdapter") != "T2IAdapter":
            raise SdxError(f"{cls.label}: _class_name {d['_class_name']!r} is not T2IAdapter")
        defaults = cls()
        values = {f.name: d.get(f.name, getattr(defaults, f.name)) for f in dataclasses.fields(cls)}
        check_types(cls.label, values, cls.kinds)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})

    def to_diffusers_config(self) -> dict[str, Any]:
        """The config.json diffusers' T2IAdapter.from_pretrained reads."""
        return {"_class_name": "T2IAdapter", **self.to_dict()}

    @property
    def halvings(self) -> tuple[bool, ...]:
        """Whether each block halves the map it reads (one per feature map)."""
        n = len(self.channels)
        if self.adapter_type == FULL:
            return (False,) + (True,) * (n - 1)
        if self.adapter_type == FULL_XL:
            return tuple(i == 2 for i in range(n))
        return (False,) + (True,) * n  # light: one block per width, then the extra one

    def feature_shapes(self, height: int, width: int) -> list[tuple[int, int, int]]:
        """(h, w, channels) of each feature map for a control image of height x width pixels."""
        h, w = height // self.downscale_factor, width // self.downscale_factor
        widths = self.channels + ((self.channels[-1],) if self.adapter_type == LIGHT else ())
        out = []
        for halves, c in zip(self.halvings, widths):
            if halves:
                h, w = -(-h // 2), -(-w // 2)
            out.append((h, w, c))
        return out


def pixel_unshuffle(x: jax.Array, r: int) -> jax.Array:
    """torch's PixelUnshuffle on NHWC: (B, H, W, C) -> (B, H/r, W/r, C*r*r), channel c*r*r + i*r + j holding
    pixel (i, j) of each r x r cell."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // r, r, w // r, r, c)  # (B, h, i, w, j, C)
    return x.transpose(0, 1, 3, 5, 2, 4).reshape(b, h // r, w // r, c * r * r)  # (B, h, w, C, i, j) -> flat


def halve(x: jax.Array) -> jax.Array:
    """torch's AvgPool2d(2, stride=2, ceil_mode=True) on NHWC: the mean of each 2x2 cell, a cell cut by an odd
    edge averaging the pixels it has. (B, H, W, C) -> (B, ceil(H/2), ceil(W/2), C)."""
    b, h, w, c = x.shape
    pad = ((0, 0), (0, h % 2), (0, w % 2), (0, 0))
    hh, ww = -(-h // 2), -(-w // 2)
    total = jnp.pad(x, pad).reshape(b, hh, 2, ww, 2, c).sum(axis=(2, 4))  # (B, hh, 2, ww, 2, C) -> (B, hh, ww, C)
    count = jnp.pad(jnp.ones((1, h, w, 1), x.dtype), pad).reshape(1, hh, 2, ww, 2, 1).sum(axis=(2, 4))
    return total / count


class AdapterResnetBlock(nnx.Module):
    """x + block2(relu(block1(x))): block1 3x3; block2 1x1 (full adapters) or 3x3 (light)."""

    def __init__(self, cp: Compute, channels: int, second_kernel: int, *, rngs: nnx.Rngs):
        self.block1 = conv(cp, channels, channels, 3, rngs=rngs)
        self.block2 = conv(cp, channels, channels, second_kernel, rngs=rngs)

    def __call__(self, x):
        return x + self.block2(jax.nn.relu(self.block1(x)))


class AdapterBlock(nnx.Module):
    """diffusers' AdapterBlock (full adapters): halve if `down`, a 1x1 in_conv when the width changes, resnets."""

    def __init__(self, cp: Compute, cin: int, cout: int, resnets: int, down: bool, *, rngs: nnx.Rngs):
        self.down = down
        self.in_conv = conv(cp, cin, cout, 1, rngs=rngs) if cin != cout else None
        self.resnets = nnx.List([AdapterResnetBlock(cp, cout, 1, rngs=rngs) for _ in range(resnets)])

    def __call__(self, x):
        if self.down:
            x = halve(x)
        if self.in_conv is not None:
            x = self.in_conv(x)
        for resnet in self.resnets:
            x = resnet(x)
        return x


class LightAdapterBlock(nnx.Module):
    """diffusers' LightAdapterBlock: halve if `down`, 1x1 to a quarter of `cout`, resnets, 1x1 to `cout`."""

    def __init__(self, cp: Compute, cin: int, cout: int, resnets: int, down: bool, *, rngs: nnx.Rngs):
        mid = cout // 4
        self.down = down
        self.in_conv = conv(cp, cin, mid, 1, rngs=rngs)
        self.resnets = nnx.List([AdapterResnetBlock(cp, mid, 3, rngs=rngs) for _ in range(resnets)])
        self.out_conv = conv(cp, mid, cout, 1, rngs=rngs)

    def __call__(self, x):
        if self.down:
            x = halve(x)
        x = self.in_conv(x)
        for resnet in self.resnets:
            x = resnet(x)
        return self.out_conv(x)


class Adapter(nnx.Module):
    """diffusers' FullAdapter, FullAdapterXL or LightAdapter, as `config.adapter_type` says."""

    def __init__(self, config: T2IAdapterConfig, cp: Compute, *, rngs: nnx.Rngs):
        c = config
        cin = c.in_channels * c.downscale_factor**2
        n = c.num_res_blocks
        if c.adapter_type == LIGHT:
            self.conv_in = None
            ins = (cin,) + c.channels
            outs = c.channels + (c.channels[-1],)
            blocks = [LightAdapterBlock(cp, a, b, n, down, rngs=rngs) for a, b, down in zip(ins, outs, c.halvings)]
        else:
            self.conv_in = conv(cp, cin, c.channels[0], 3, rngs=rngs)
            ins = (c.channels[0],) + c.channels[:-1]  # each block reads the previous one's width
            blocks = [AdapterBlock(cp, a, b, n, down, rngs=rngs) for a, b, down in zip(ins, c.channels, c.halvings)]
        self.body = nnx.List(blocks)
        self.factor = c.downscale_factor

    def __call__(self, x) -> list[jax.Array]:
        x = pixel_unshuffle(x, self.factor)
        if self.conv_in is not None:
            x = self.conv_in(x)
        features = []
        for block in self.body:
            x = block(x)
            features.append(x)
        return features


class T2IAdapter(nnx.Module):
    """diffusers' T2IAdapter. `__call__`: the control image (B, H, W, in_channels) in [0, 1] -> one feature
    map per block, (B, h_i, w_i, channels_i) in `cp.dtype` (`T2IAdapterConfig.feature_shapes`)."""

    def __init__(self, config: T2IAdapterConfig, cp: Compute = F32, *, rngs: nnx.Rngs):
        self.config = config
        self.dtype = cp.dtype
        self.adapter = Adapter(config, cp, rngs=rngs)

    def __call__(self, image: jax.Array) -> list[jax.Array]:
        c = self.config
        f = c.downscale_factor
        if image.ndim != 4 or image.shape[-1] != c.in_channels or image.shape[1] % f or image.shape[2] % f:
            raise SdxError(
                f"t2i-adapter: the control image must be (B, H, W, {c.in_channels}) NHWC with H and W multiples of "
                f"{f}, got {tuple(image.shape)}"
            )
        return self.adapter(image.astype(self.dtype))
