"""sdx.conv: the matmul and Winograd forms of a convolution equal torch's conv2d (values and gradients),
whole or in bands, `auto` takes each exactly where its rule says, and calls they cannot compute fall back
to XLA's convolution;
`Upsample2D` (nearest 2× then 3×3, folded by `upsample_conv` or not) equals torch's interpolate + conv2d
on every backend, and `auto` skips the upsampled image where its rule says."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sdx import conv as convlib
from sdx.layers import Compute, Upsample2D, conv

torch = pytest.importorskip("torch")

# (kernel, stride, padding as sdx.layers.conv takes it): every form the UNet, VAE and ControlNet build
FORMS = {
    "1x1": (1, 1, None),
    "3x3": (3, 1, None),
    "3x3 stride 2": (3, 2, None),  # the UNet's Downsample2D
    "3x3 stride 2, pad bottom-right": (3, 2, ((0, 1), (0, 1))),  # the VAE's Downsample2D
    "5x5": (5, 1, None),  # conv_out_kernel=5
    "3x3 unpadded": (3, 1, ((0, 0), (0, 0))),  # downsample_padding=0 before its explicit pad
}


def _layer(kernel, stride, padding, backend, cin=6, cout=5):
    layer = conv(Compute(conv=backend), cin, cout, kernel, stride=stride, padding=padding, rngs=nnx.Rngs(0))
    r = np.random.default_rng(1)
    layer.kernel[...] = jnp.asarray(r.standard_normal(layer.kernel.shape), jnp.float32)
    layer.bias[...] = jnp.asarray(r.standard_normal(layer.bias.shape), jnp.float32)
    return layer


def _torch_conv(layer, x, kernel, stride, padding):
    """torch's conv2d of the same NHWC input with the same HWIO kernel, and its gradients."""
    (top, bottom), (left, right) = padding or ((kernel // 2, kernel // 2),) * 2
    xt = torch.from_numpy(np.asarray(x).transpose(0, 3, 1, 2).copy()).requires_grad_()
    wt = torch.from_numpy(np.asarray(layer.kernel[...]).transpose(3, 2, 0, 1).copy()).requires_grad_()
    bt = torch.from_numpy(np.array(layer.bias[...]))
    out = torch.nn.functional.conv2d(torch.nn.functional.pad(xt, (left, right, top, bottom)), wt, bt, stride=stride)
    torch.sin(out).sum().backward()
    return (out.detach().numpy().transpose(0, 2, 3, 1), xt.grad.numpy().transpose(0, 2, 3, 1),
            wt.grad.numpy().transpose(2, 3, 1, 0))


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("backend", convlib.BACKENDS)
def test_every_backend_is_torch_conv2d(form, backend):
    kernel, stride, padding = FORMS[form]
    layer = _layer(kernel, stride, padding, backend)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 11, 13, 6)), jnp.float32)  # non-square

    graphdef, params = nnx.split(layer)
    loss = lambda params, x: jnp.sin(nnx.merge(graphdef, params)(x)).sum()
    out = layer(x)
    g_params, g_x = jax.grad(loss, argnums=(0, 1))(params, x)
    g_kernel = g_params["kernel"][...]
    want_out, want_gx, want_gk = _torch_conv(layer, x, kernel, stride, padding)
    assert out.shape == want_out.shape
    np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-5 * np.abs(want_out).max())
    np.testing.assert_allclose(np.asarray(g_x), want_gx, atol=2e-5 * np.abs(want_gx).max())
    np.testing.assert_allclose(np.asarray(g_kernel), want_gk, atol=2e-5 * np.abs(want_gk).max())


def _primitives(fn, x) -> list[str]:
    """The names of the primitives `fn(x)` traces to, those inside loops included, one per equation."""
    def names(jaxpr):
        out = []
        for e in jaxpr.eqns:
            out.append(e.primitive.name)
            out += [n for v in e.params.values() if hasattr(v, "jaxpr") for n in names(v.jaxpr)]
        return out
    return names(jax.make_jaxpr(fn)(x).jaxpr)


def test_matmul_backend_has_no_convolution():
    for kernel, stride, padding in FORMS.values():
        layer = _layer(kernel, stride, padding, "matmul")
        used = _primitives(layer, jnp.zeros((2, 11, 13, 6)))
        assert "conv_general_dilated" not in used and "dot_general" in used


@pytest.mark.allow_skip
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="`auto` is `xla` off the CPU")
def test_auto_takes_a_matmul_where_its_rule_says():
    """On a CPU: a 1×1 kernel always; a larger one when B·Ho·Wo ≤ C (patch rows ≤ input channels)."""
    uses_conv = lambda kernel, stride, b, hw, c: "conv_general_dilated" in _primitives(
        _layer(kernel, stride, None, "auto", cin=c), jnp.zeros((b, hw, hw, c)))
    assert not uses_conv(1, 1, 2, 32, 8)  # 2,048 rows, 8 channels: still a matmul
    assert not uses_conv(3, 1, 2, 4, 32)  # 32 rows, 32 channels
    assert uses_conv(3, 1, 2, 4, 31)  # 32 rows, 31 channels
    assert not uses_conv(3, 2, 2, 8, 32)  # stride 2: 2·4·4 = 32 output rows
    assert uses_conv(3, 1, 2, 8, 32)  # stride 1: 128 rows


def test_calls_the_matmul_cannot_compute_stay_convolutions():
    x, w = jnp.ones((1, 6, 6, 4)), jnp.ones((3, 3, 4, 4))
    nhwc = jax.lax.conv_dimension_numbers(x.shape, w.shape, ("NHWC", "HWIO", "NHWC"))
    f = convlib.for_backend("matmul")
    calls = {
        "string padding": lambda x: f(x, w, (1, 1), "SAME", dimension_numbers=nhwc),
        "dilation": lambda x: f(x, w, (1, 1), ((2, 2), (2, 2)), rhs_dilation=(2, 2), dimension_numbers=nhwc),
        "groups": lambda x: f(x, jnp.ones((3, 3, 2, 4)), (1, 1), ((1, 1), (1, 1)), feature_group_count=2,
                              dimension_numbers=jax.lax.conv_dimension_numbers(x.shape, (3, 3, 2, 4),
                                                                               ("NHWC", "HWIO", "NHWC"))),
        "NCHW layout": lambda x: f(x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1), (1, 1), ((1, 1), (1, 1))),
        "1-D": lambda x: f(x[0], w[0], (1,), ((1, 1),), dimension_numbers=("NHC", "HIO", "NHC")),
    }
    for name, call in calls.items():
        assert "conv_general_dilated" in _primitives(call, x), name


def test_winograd_backend_takes_exactly_the_3x3_stride_1_padding_1_float32_calls():
    for form, (kernel, stride, padding) in FORMS.items():
        used = _primitives(_layer(kernel, stride, padding, "winograd"), jnp.zeros((2, 11, 13, 6)))
        want = (16, False) if form == "3x3" else (0, True)  # 16 products and no convolution, or XLA's
        assert (used.count("dot_general"), "conv_general_dilated" in used) == want, form
    bf16 = conv(Compute(dtype=jnp.bfloat16, conv="winograd"), 6, 5, 3, rngs=nnx.Rngs(0))
    assert "conv_general_dilated" in _primitives(bf16, jnp.zeros((2, 11, 13, 6), jnp.bfloat16))


def test_winograd_in_bands_is_torch_conv2d(monkeypatch):
    """An image above WINOGRAD_BAND pixels goes in bands of whole rows under `lax.map`; odd sizes, the last
    band's padding cropped, values and gradients."""
    monkeypatch.setattr(convlib, "WINOGRAD_BAND", 40)  # 2 rows a band: 6 bands of each 11×13 image
    layer = _layer(3, 1, None, "winograd")
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 11, 13, 6)), jnp.float32)
    assert "scan" in _primitives(layer, x)
    graphdef, params = nnx.split(layer)
    loss = lambda params, x: jnp.sin(nnx.merge(graphdef, params)(x)).sum()
    out = layer(x)
    g_params, g_x = jax.grad(loss, argnums=(0, 1))(params, x)
    for got, want in zip((out, g_x, g_params["kernel"][...]), _torch_conv(layer, x, 3, 1, None)):
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5 * np.abs(want).max())


@pytest.mark.allow_skip
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="`auto` is `xla` off the CPU")
def test_auto_takes_winograd_where_its_rule_says():
    """On a CPU: a float32 3×3 kernel (stride 1, padding 1) with B·H·W ≥ WINOGRAD_PIXELS and at least
    WINOGRAD_CHANNELS channels in and out."""
    def winograd(b, h, w, c, o, dtype=jnp.float32, stride=1):
        layer = conv(Compute(dtype=dtype), c, o, 3, stride=stride, rngs=nnx.Rngs(0))
        return _primitives(layer, jnp.zeros((b, h, w, c), dtype)).count("dot_general") == 16
    assert (convlib.WINOGRAD_PIXELS, convlib.WINOGRAD_CHANNELS) == (512, 256)
    assert winograd(2, 16, 16, 256, 256)  # 512 pixels
    assert not winograd(1, 16, 31, 256, 256)  # 496
    assert not winograd(2, 16, 16, 255, 256) and not winograd(2, 16, 16, 256, 255)
    assert not winograd(2, 16, 16, 256, 256, dtype=jnp.bfloat16)
    assert not winograd(2, 32, 32, 256, 256, stride=2)  # a downsampler: 512 output pixels


def test_models_built_alike_have_equal_graphs_and_unknown_names_are_refused():
    """The backend is a module-level function, so jit's cache (keyed on the graph) sees equal models."""
    build = lambda: nnx.graphdef(_layer(3, 1, None, "auto"))
    assert build() == build()
    with pytest.raises(ValueError, match="conv backend 'cudnn' is not one of auto, xla, matmul, winograd"):
        convlib.for_backend("cudnn")


def _upsample_layer(backend, channels=6):
    layer = Upsample2D(Compute(conv=backend), channels, rngs=nnx.Rngs(0))
    r = np.random.default_rng(3)
    layer.conv.kernel[...] = jnp.asarray(r.standard_normal(layer.conv.kernel.shape), jnp.float32)
    layer.conv.bias[...] = jnp.asarray(r.standard_normal(layer.conv.bias.shape), jnp.float32)
    return layer


def _upsampled_shapes(layer, x) -> list[tuple[int, ...]]:
    """The shapes of the values `layer(x)` computes (its output included)."""
    return [v.aval.shape for e in jax.make_jaxpr(layer)(x).eqns for v in e.outvars]


@pytest.mark.parametrize("backend", convlib.BACKENDS)
@pytest.mark.parametrize("shape", [(2, 11, 13, 6), (1, 4, 5, 6)])  # 286 pixels: `auto` folds on a CPU; 20: not
def test_upsample_conv_is_torch_nearest_upsampling_then_conv2d(backend, shape):
    layer = _upsample_layer(backend)
    x = jnp.asarray(np.random.default_rng(4).standard_normal(shape), jnp.float32)
    graphdef, params = nnx.split(layer)
    loss = lambda params, x: jnp.sin(nnx.merge(graphdef, params)(x)).sum()
    out = layer(x)
    g_params, g_x = jax.grad(loss, argnums=(0, 1))(params, x)

    xt = torch.from_numpy(np.asarray(x).transpose(0, 3, 1, 2).copy()).requires_grad_()
    wt = torch.from_numpy(np.asarray(layer.conv.kernel[...]).transpose(3, 2, 0, 1).copy()).requires_grad_()
    bt = torch.from_numpy(np.array(layer.conv.bias[...])).requires_grad_()
    want = torch.nn.functional.conv2d(torch.nn.functional.interpolate(xt, scale_factor=2.0, mode="nearest"), wt, bt,
                                      padding=1)
    torch.sin(want).sum().backward()
    pairs = [(out, want.detach().numpy().transpose(0, 2, 3, 1)), (g_x, xt.grad.numpy().transpose(0, 2, 3, 1)),
             (g_params["conv"]["kernel"][...], wt.grad.numpy().transpose(2, 3, 1, 0)),
             (g_params["conv"]["bias"][...], bt.grad.numpy())]
    for got, expected in pairs:
        assert got.shape == expected.shape
        np.testing.assert_allclose(np.asarray(got), expected, atol=2e-5 * np.abs(expected).max())


@pytest.mark.allow_skip
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="`auto` is `xla` off the CPU")
def test_auto_convolves_before_upsampling_where_its_rule_says():
    """On a CPU, `auto` never upsamples (no (B, 2H, W, C) half-way image) when B·H·W ≥ PHASE_PIXELS
    (`folds_upsampling`)."""
    upsampled = lambda backend, b, h, w: (b, 2 * h, w, 6) in _upsampled_shapes(
        _upsample_layer(backend), jnp.zeros((b, h, w, 6)))
    assert convlib.PHASE_PIXELS == 256
    assert not upsampled("auto", 2, 8, 16)  # 256 pixels
    assert upsampled("auto", 1, 15, 17)  # 255
    assert upsampled("xla", 2, 8, 16) and upsampled("matmul", 2, 8, 16)


@pytest.mark.allow_skip
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="`auto` is `xla` off the CPU")
def test_the_kernel_gradient_of_a_folded_upsampling_is_an_ordinary_convolution():
    """`upsample_conv` pads before its 2×2 convolution: padded by the convolution itself (by the kernel's
    full width), the kernel's gradient compiles to a convolution with a reversed kernel, which XLA:CPU runs
    25-80× slower (benchmarks/LOG.md; a third of a training step's time)."""
    layer = _upsample_layer("auto")
    x = jnp.zeros((2, 11, 13, 6))  # folded (`folds_upsampling`), and XLA's convolution, not a matmul
    graphdef, params = nnx.split(layer)
    grad = jax.jit(jax.grad(lambda params: jnp.sin(nnx.merge(graphdef, params)(x)).sum()))
    convolutions = [line for line in grad.lower(params).compile().as_text().splitlines() if " convolution(" in line]
    assert convolutions and not any("rhs_reversal" in line for line in convolutions), convolutions
