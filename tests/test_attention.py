"""Every attention backend equals the plain one (and the plain one equals textbook attention); cuDNN is
chosen only for the calls it can take."""

import logging
import math
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdx import attention
from sdx.attention import cudnn_rejects, dot_product_attention
from tests.processes import child_env

REPO = Path(__file__).resolve().parents[1]

needs_nvidia_gpu = pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason=f"the cudnn backend needs an NVIDIA GPU; JAX's default backend here is {jax.default_backend()!r}",
)


def _qkv(b=2, tq=37, tk=29, h=3, d=8, seed=0, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    make = lambda t: jnp.asarray(r.standard_normal((b, t, h, d)), dtype=dtype)
    return make(tq), make(tk), make(tk)


def _numpy_attention(q, k, v, scale, causal=False):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        tq, tk = q.shape[1], k.shape[1]
        logits = np.where(np.tril(np.ones((tq, tk), bool), k=tk - tq), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", w, v)


@pytest.mark.parametrize("causal", [False, True])
def test_xla_is_textbook_attention(causal):
    q, k, v = _qkv(tq=29)
    for scale in (None, 0.3):
        # full float32 products: on a GPU JAX's default is TF32 (1e-3 off here on an H100)
        with jax.default_matmul_precision("highest"):
            out = dot_product_attention(q, k, v, backend="xla", causal=causal, scale=scale)
        ref = _numpy_attention(q, k, v, 1 / math.sqrt(q.shape[-1]) if scale is None else scale, causal)
        np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6)


def test_xla_bfloat16_inputs_keep_float32_softmax():
    q, k, v = _qkv(dtype=jnp.bfloat16)
    out = dot_product_attention(q, k, v, backend="xla")
    assert out.dtype == jnp.bfloat16
    ref = _numpy_attention(q, k, v, 1 / math.sqrt(q.shape[-1]))
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2)


@pytest.mark.parametrize("tq, chunk", [(37, 16), (32, 16), (12, 16)])  # ragged last block, exact, one block
def test_chunked_equals_xla(tq, chunk, monkeypatch):
    monkeypatch.setattr(attention, "BLOCKED_LOGITS", 1)  # blocks at any size
    q, k, v = _qkv(tq=tq)
    ref = dot_product_attention(q, k, v, backend="xla")
    out = dot_product_attention(q, k, v, backend="chunked", chunk_size=chunk)
    assert out.shape == ref.shape
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6)


@pytest.mark.parametrize("b, shards", [(4, 1), (4, 2), (4, 4), (6, 4)])  # one row a block, 2, all, gcd(6, 4) = 2
def test_chunked_blocks_of_batch_rows_equal_xla(b, shards, monkeypatch):
    monkeypatch.setattr(attention, "BLOCKED_LOGITS", 1)
    q, k, v = _qkv(b=b, tq=37)
    q = q * (1 + jnp.arange(b, dtype=q.dtype) / 4)[:, None, None, None]  # rows unlike each other: a swap shows
    ref = dot_product_attention(q, k, v, backend="xla")
    out = dot_product_attention(q, k, v, backend="chunked", chunk_size=16, shards=shards)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6)  # outputs about 1; rows swapped: 1


def test_a_batch_split_over_devices_stays_split_in_chunked_blocks(tmp_path):
    """On four devices, blocks of one row per device's share need no collective; blocks of one row of the
    batch (shards=1) would gather the batch onto every device (the check can fail)."""
    script = textwrap.dedent(
        """
        import re
        import jax, numpy as np
        from sdx import attention, mesh as meshlib
        attention.BLOCKED_LOGITS = 1
        mesh = meshlib.make_mesh()
        assert mesh.devices.size == 4, mesh
        r = np.random.default_rng(0)
        q, k, v = (r.standard_normal((8, t, 3, 8)).astype(np.float32) for t in (37, 29, 29))
        split = meshlib.batch_sharding(mesh, 4)
        ref = attention.dot_product_attention(q, k, v, backend="xla")
        for shards in (1, 4):
            run = jax.jit(lambda q, k, v: attention.dot_product_attention(q, k, v, backend="chunked", chunk_size=16,
                                                                          shards=shards),
                          in_shardings=(split,) * 3, out_shardings=split)
            text = run.lower(q, k, v).compile().as_text()
            found = sorted(set(re.findall(r"(all-gather|all-to-all|collective-permute|all-reduce)", text)))
            np.testing.assert_allclose(np.asarray(run(q, k, v)), np.asarray(ref), atol=1e-6)
            print(shards, ",".join(found) or "none")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=child_env(devices=4), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    whole_batch, split_batch = proc.stdout.splitlines()[:2]
    assert whole_batch != "1 none" and split_batch == "4 none", proc.stdout


@pytest.mark.parametrize("b, shards", [(2, 1), (4, 2)])
def test_chunked_gradient_equals_xla(b, shards, monkeypatch):
    monkeypatch.setattr(attention, "BLOCKED_LOGITS", 1)
    q, k, v = _qkv(b=b, tq=37)
    loss = lambda backend: lambda q, k, v: jnp.sum(
        jnp.sin(dot_product_attention(q, k, v, backend=backend, chunk_size=16, shards=shards))
    )
    with jax.default_matmul_precision("highest"):  # on a GPU, TF32 products failed 1e-5 in one of two runs
        g_ref = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
        g = jax.jit(jax.grad(loss("chunked"), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_chunked_blocks_only_large_attentions(monkeypatch):
    """Below BLOCKED_LOGITS (logits per head and image) the chunked backend is the plain one, no loop."""
    q, k, v = _qkv(tq=37, tk=29)
    traced = lambda: str(jax.make_jaxpr(lambda q, k, v: dot_product_attention(q, k, v, backend="chunked",
                                                                              chunk_size=16))(q, k, v))
    monkeypatch.setattr(attention, "BLOCKED_LOGITS", 37 * 29 + 1)
    assert "scan" not in traced()
    monkeypatch.setattr(attention, "BLOCKED_LOGITS", 37 * 29)
    assert "scan" in traced()


@pytest.mark.parametrize(
    "platform, capability, dtype, expected",
    [
        ("cpu", None, "bfloat16", "chunked"),
        ("gpu", (9, 0), "bfloat16", "cudnn"),
        ("gpu", (8, 0), "float16", "cudnn"),
        ("gpu", (9, 0), "float32", "xla"),  # cuDNN takes half precision only
        ("gpu", (7, 5), "bfloat16", "xla"),  # no flash attention before Ampere
        ("gpu", None, "bfloat16", "xla"),  # another vendor's GPU
        ("tpu", None, "bfloat16", "xla"),
    ],
)
def test_the_sampler_default_backend(monkeypatch, platform, capability, dtype, expected):
    monkeypatch.setattr(attention.jax, "default_backend", lambda: platform)
    monkeypatch.setattr(attention, "_cuda_capability", lambda: capability)
    assert attention.default_backend(dtype) == expected


@pytest.mark.parametrize("devices, expected", [
    ([("gpu", "9.0")], (9, 0)), ([("gpu", "8.6"), ("gpu", "9.0")], (8, 6)), ([("gpu", "gfx942")], None),
    ([("cpu", None)], None),
])
def test_the_cuda_capability_is_read_off_the_first_gpu(monkeypatch, devices, expected):
    fake = [types.SimpleNamespace(platform=p, compute_capability=c) for p, c in devices]
    monkeypatch.setattr(attention.jax, "devices", lambda: fake)
    attention._cuda_capability.cache_clear()  # read once per process
    try:
        assert attention._cuda_capability() == expected
    finally:
        attention._cuda_capability.cache_clear()


def test_chunked_refuses_causal():
    q, k, v = _qkv(tq=37)
    with pytest.raises(ValueError, match="causal"):
        dot_product_attention(q, k, v, backend="chunked", causal=True, chunk_size=16)


def test_unknown_backend_is_named():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="flash"):
        dot_product_attention(q, k, v, backend="flash")


@pytest.mark.parametrize(
    "dtype, head_dim, limit, rejected",
    [
        (jnp.float32, 512, 256, "float32 inputs"),  # the VAE mid-block's one 512-wide head, float32 by default
        (jnp.bfloat16, 512, 256, "head_dim 512"),  # the same head in bfloat16
        (jnp.bfloat16, 64, 128, None),  # SD 2.x / SDXL UNet heads
        (jnp.float16, 40, 128, None),  # SD 1.x UNet heads
        (jnp.float16, 160, 128, "head_dim 160"),  # over the pre-Hopper limit ...
        (jnp.float16, 160, 256, None),  # ... within Hopper's
        (jnp.bfloat16, 36, 256, "head_dim 36"),  # not a multiple of 8
    ],
)
def test_cudnn_takes_only_half_precision_and_its_head_dims(dtype, head_dim, limit, rejected):
    reason = cudnn_rejects(dtype, head_dim, max_head_dim=limit)
    assert reason == rejected if rejected is None else rejected in reason


def test_cudnn_backend_runs_rejected_calls_on_xla_and_says_so_once(caplog):
    q, k, v = _qkv(d=12)  # float32, head_dim 12: cuDNN takes neither (and is never reached, so no GPU needed)
    attention._log_fallback.cache_clear()
    with caplog.at_level(logging.INFO, logger="sdx.attention"):
        outs = [dot_product_attention(q, k, v, backend="cudnn") for _ in range(2)]
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(dot_product_attention(q, k, v, backend="xla")))
    assert len(caplog.records) == 1 and "float32 inputs" in caplog.records[0].getMessage()


@pytest.mark.parametrize("tq, tk, causal", [(37, 29, False), (36, 29, False), (37, 30, False), (29, 29, True)])
def test_cudnn_padding_of_odd_lengths_is_masked_out(monkeypatch, tq, tk, causal):
    # `_cudnn`'s padding and masks, run through jax.nn's XLA implementation (which takes the same
    # sequence lengths) so that a CPU checks them: values and gradients equal unpadded attention.
    calls = []
    real = jax.nn.dot_product_attention

    def on_xla(*args, implementation=None, **kwargs):
        calls.append(args[1].shape[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", on_xla)
    q, k, v = _qkv(tq=tq, tk=tk, d=8)
    scale = 8 ** -0.5
    loss = lambda f: (lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))))
    padded = lambda q, k, v: attention._cudnn(q, k, v, scale, causal)
    reference = lambda q, k, v: dot_product_attention(q, k, v, backend="xla", causal=causal)
    with jax.default_matmul_precision("highest"):  # on a GPU, TF32 products differed by 6e-4
        np.testing.assert_allclose(padded(q, k, v), reference(q, k, v), atol=1e-6)
        grads = [jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v) for f in (padded, reference)]
    for g, r in zip(*grads):
        np.testing.assert_allclose(g, r, atol=1e-5)
    assert calls and all(t % 2 == 0 for t in calls)


@needs_nvidia_gpu
@pytest.mark.allow_skip
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cudnn_equals_xla(dtype):
    # cuDNN flash attention: half-precision inputs, head_dim a multiple of 8; UNet-like shapes
    # (self-attention over 256 latent tokens, cross-attention over 77 text tokens), and SDXL's at 1024²
    # with classifier-free guidance (4096 latent tokens, 10 heads of 64).
    # Odd lengths go through the padding of `_cudnn`: a 99-token query, CLIP's causal 77 tokens.
    shapes = ((2, 256, 256, 5, False), (2, 256, 77, 5, False), (2, 4096, 4096, 10, False), (2, 4096, 77, 10, False),
              (2, 99, 77, 5, False), (2, 77, 77, 5, True))
    for b, tq, tk, h, causal in shapes:
        q, k, v = _qkv(b=b, tq=tq, tk=tk, h=h, d=64, dtype=dtype)
        ref = dot_product_attention(q, k, v, backend="xla", causal=causal)
        out = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, backend="cudnn", causal=causal))(q, k, v)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2)


@needs_nvidia_gpu
@pytest.mark.allow_skip
def test_cudnn_gradient_equals_xla():
    # Training with --attention cudnn differentiates through cuDNN's flash attention (its own backward
    # kernel); bfloat16 at SD 1.5's 512² shapes: self-attention, cross-attention over 77 text tokens
    # (an odd length, padded and masked), both lengths odd, and CLIP's causal self-attention.
    for b, tq, tk, causal in ((2, 4096, 4096, False), (2, 4096, 77, False), (2, 99, 77, False), (2, 77, 77, True)):
        q, k, v = _qkv(b=b, tq=tq, tk=tk, h=8, d=40, dtype=jnp.bfloat16)
        w = jnp.asarray(np.random.default_rng(1).standard_normal((b, tq, 8, 40)), jnp.float32)

        def loss(backend):
            return lambda q, k, v: jnp.sum(
                dot_product_attention(q, k, v, backend=backend, causal=causal).astype(jnp.float32) * w)

        ref = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
        out = jax.jit(jax.grad(loss("cudnn"), argnums=(0, 1, 2)))(q, k, v)
        for name, g, r in zip("qkv", out, ref):
            g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
            scale = np.abs(r).max()
            assert np.abs(g - r).max() <= 3e-2 * scale, (name, tq, tk, causal, np.abs(g - r).max(), scale)
