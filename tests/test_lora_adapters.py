"""sdx.lora, the adapters LoRA training puts on a model: an adapter starts as the model it adapts, fusing it
gives the adapted model's outputs, and its state dict is what diffusers' LoRA files hold. (Its gradients
against peft's: tests/test_train_step.py; its training run, file and sampling: tests/test_train_lora.py;
reading LoRA files: tests/test_lora.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sdx import lora, presets, unet as U


def _unet():
    cfg = U.UNetConfig.from_diffusers_config(presets.get("tiny").configs["unet"])
    return U.UNet2DConditionModel(cfg, rngs=nnx.Rngs(0))


def _inputs(model):
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((2, 8, 8, model.config.in_channels)), jnp.float32)
    ctx = jnp.asarray(r.standard_normal((2, 7, model.config.cross_attention_dim[0])), jnp.float32)
    return x, jnp.asarray([10, 700]), ctx


def _call(model, inputs):
    return np.asarray(model(*inputs, None))


def test_adapters_start_as_the_model_fuse_into_it_and_keep_diffusers_names():
    model = _unet()
    inputs = _inputs(model)
    before = _call(model, inputs)
    count = lora.attach(model, 2, 3.0, jax.random.key(0))
    names = sorted(".".join(map(str, p[:-2])) for p, _ in nnx.to_flat_state(nnx.state(model, lora.LoRAParam))
                   if p[-1] == "down")
    assert count == len(names) > 0 and all(n.rsplit(".", 2)[-1] in ("to_q", "to_k", "to_v") or
                                           n.endswith("to_out.0") for n in names), names
    np.testing.assert_array_equal(_call(model, inputs), before)  # up is zero: exactly the model

    r = np.random.default_rng(1)
    ups = nnx.state(model, lora.LoRAParam)
    nnx.update(model, jax.tree.map(lambda a: jnp.asarray(r.standard_normal(a.shape) * 0.2, a.dtype), ups))
    adapted = _call(model, inputs)
    assert np.abs(adapted - before).max() > 1e-2  # the adapters change the output
    plain = lora.fused(model)
    assert not nnx.state(plain, lora.LoRAParam) and nnx.state(model, lora.LoRAParam)  # the adapted model is kept
    np.testing.assert_allclose(_call(plain, inputs), adapted, rtol=0, atol=2e-5 * np.abs(adapted).max())
    assert nnx.graphdef(plain) == nnx.graphdef(_unet())  # the plain model's structure: what the sampler compiles

    # the file's layout: lora_A = downᵀ (rank, in), lora_B = (scale · up)ᵀ (out, rank), so that B · A is the
    # kernel's change (transposed to torch's (out, in)) with a reader's default alpha (= rank)
    arrays = lora.state_dict(model)
    assert sorted(arrays) == sorted(f"unet.{n}.lora_{ab}.weight" for n in names for ab in "AB")
    kernels = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    fused = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(plain, nnx.Param))}
    for n in names:
        a, b = arrays[f"unet.{n}.lora_A.weight"], arrays[f"unet.{n}.lora_B.weight"]
        assert a.shape[0] == b.shape[1] == 2 and a.dtype == b.dtype == np.float32
        np.testing.assert_allclose(fused[f"{n}.kernel"] - kernels[f"{n}.kernel"], (b @ a).T, atol=1e-6)


def test_no_target_is_an_error():
    with pytest.raises(ValueError, match="no linear layer"):
        lora.attach(_unet(), 2, 2.0, jax.random.key(0), targets=("to_nothing",))
