"""sdx.outline: on a CPU each transformer block of a UNet and each layer of a text encoder compiles to a
call of its own that XLA keeps (so XLA:CPU orders one short kernel sequence per block), computing what
the inlined block computes, gradients included; off the CPU the block is called inline."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sdx import outline
from sdx.clip import CLIPTextModel, TextEncoderConfig
from sdx.layers import F32, BasicTransformerBlock
from sdx.unet import UNet2DConditionModel, UNetConfig

pytestmark = [pytest.mark.skipif(jax.default_backend() != "cpu", reason="outlining is for XLA:CPU"), pytest.mark.allow_skip]

KEPT_CALL = re.compile(r"= \S+ call\(.*inlineable=\"false\"")


def _kept_calls(fn, *args) -> int:
    """How many calls XLA kept in its optimized program of fn(*args)."""
    return len(KEPT_CALL.findall(jax.jit(fn).lower(*args).compile().as_text()))


def _block_and_inputs():
    block = BasicTransformerBlock(F32, 32, heads=2, head_dim=16, context_dim=24, rngs=nnx.Rngs(0))
    r = np.random.default_rng(0)
    x, ctx = (jnp.asarray(r.standard_normal(shape), jnp.float32) for shape in ((2, 10, 32), (2, 7, 24)))
    return block, x, ctx


def test_a_block_is_one_kept_call_with_the_blocks_results_and_gradients():
    block, x, ctx = _block_and_inputs()
    graphdef, state = nnx.split(block)
    outlined = lambda s, x, ctx: outline.call(nnx.merge(graphdef, s), x, ctx)
    direct = lambda s, x, ctx: nnx.merge(graphdef, s)(x, ctx)
    assert _kept_calls(outlined, state, x, ctx) == 1
    assert _kept_calls(direct, state, x, ctx) == 0
    np.testing.assert_allclose(jax.jit(outlined)(state, x, ctx), jax.jit(direct)(state, x, ctx), rtol=1e-6, atol=1e-6)
    loss = lambda fn: jax.jit(jax.grad(lambda s, x: jnp.sum(fn(s, x, ctx) ** 2), argnums=(0, 1)))
    (gs, gx), (ref_s, ref_x) = loss(outlined)(state, x), loss(direct)(state, x)
    np.testing.assert_allclose(gx, ref_x, rtol=1e-5, atol=1e-5)
    ref = dict(nnx.to_flat_state(ref_s))
    for path, g in nnx.to_flat_state(gs):
        np.testing.assert_allclose(g.value, ref[path].value, rtol=1e-5, atol=1e-5)


def _outlined_and_inline(make_call, state, monkeypatch, calls: int):
    """make_call() (a new function each time, so jit traces it again) has `calls` kept calls and, with
    every outline.call inline, none and the same results."""
    assert calls > 1
    assert _kept_calls(make_call(), state) == calls
    outlined = jax.jit(make_call())(state)
    monkeypatch.setattr(outline, "call", lambda block, *args: block(*args))
    assert _kept_calls(make_call(), state) == 0
    for got, want in zip(jax.tree.leaves(outlined), jax.tree.leaves(jax.jit(make_call())(state)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_each_transformer_block_of_a_unet_is_a_kept_call(monkeypatch):
    cfg = UNetConfig.preset("tiny_xl")
    model = UNet2DConditionModel(cfg, rngs=nnx.Rngs(0))
    r = np.random.default_rng(1)
    x = jnp.asarray(r.standard_normal((2, 8, 8, cfg.in_channels)), jnp.float32)
    ctx = jnp.asarray(r.standard_normal((2, 7, cfg.cross_attention_dim[0])), jnp.float32)
    pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
    added = {"text_embeds": jnp.asarray(r.standard_normal((2, pooled)), jnp.float32),
             "time_ids": jnp.tile(jnp.asarray([[64.0, 64, 0, 0, 64, 64]]), (2, 1))}
    blocks = sum(isinstance(m, BasicTransformerBlock) for _, m in nnx.iter_graph(model))
    graphdef, state = nnx.split(model)
    make_call = lambda: lambda s: nnx.merge(graphdef, s)(x, jnp.asarray([999.0, 21.0]), ctx, added)
    _outlined_and_inline(make_call, state, monkeypatch, calls=blocks)


def test_each_layer_of_a_text_encoder_is_a_kept_call(monkeypatch):
    """(and nothing inside a layer: the causal mask's jitted helpers stay inline)"""
    cfg = TextEncoderConfig.preset("tiny_xl", "text_encoder_2")
    graphdef, state = nnx.split(CLIPTextModel(cfg, rngs=nnx.Rngs(0)))
    ids = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, cfg.max_position_embeddings)))
    make_call = lambda: lambda s: nnx.merge(graphdef, s)(ids)
    _outlined_and_inline(make_call, state, monkeypatch, calls=cfg.num_hidden_layers)


def test_off_the_cpu_a_block_is_called_inline(monkeypatch):
    block, x, ctx = _block_and_inputs()
    graphdef, state = nnx.split(block)
    outlined = lambda s, x, ctx: outline.call(nnx.merge(graphdef, s), x, ctx)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert "inlineable" not in jax.jit(outlined).lower(state, x, ctx).as_text()
