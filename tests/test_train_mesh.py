"""Training steps on a mesh of 4 fake CPU devices (data 2 x fsdp 2) equal the same steps on one device:
loss, gradient norm, updated parameters, optimizer state and EMA, in float32. Three ways of training, as
train/ runs them:

- unet: the whole UNet of InstructPix2Pix-SDXL; parameters, gradients, optimizer state and EMA split.
- text_lora: LoRA with `--train_text_encoder`, text-to-image SDXL: adapters (replicated) on the UNet and on
  both text encoders, which run inside the step on the batch's token ids; the UNet and the encoders split in
  the step's constants (a UNet-only LoRA is this without the encoders' adapters).
- controlnet: a ControlNet trains (split as the whole UNet is) beside the frozen UNet, split in the constants.

Every model's weights are counted split over fsdp, so that no case passes with everything replicated.

The optimizer is SGD with momentum after the scripts' gradient clipping (learning rate 1, LoRA's 0.05):
every quantity is linear in the gradients, so the comparison is as tight as float32 summation order allows
(AdamW divides by sqrt(v): a gradient that is ~0 up to rounding turns into a full-size update, which would
force a tolerance loose enough to hide a wrong reduction). AdamW itself is element-wise and equal to
torch's (tests/test_train_objective.py); what the mesh adds is the sharding of its state, which the
momentum trace exercises the same way.

The main test process has one device, so the mesh runs in a subprocess started with
XLA_FLAGS=--xla_force_host_platform_device_count=4; it computes both sides of every case (the
single-device one on the first of its devices) and saves them for the comparisons here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.processes import child_env

REPO = Path(__file__).resolve().parent.parent

UNET = dict(
    block_out_channels=[32, 64], layers_per_block=1, down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"], attention_head_dim=[2, 4], cross_attention_dim=32,
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=16 + 6 * 8, norm_num_groups=16, in_channels=8,
)
# the text-to-image cases' UNet (4 input channels): one level, cross-attention down, mid and up; what these
# cases add runs beside the UNet, and a level fewer leaves their steps 13-19% fewer operations to compile
T2I_UNET = {**UNET, "in_channels": 4, "block_out_channels": [32], "down_block_types": ["CrossAttnDownBlock2D"],
            "up_block_types": ["CrossAttnUpBlock2D"], "attention_head_dim": [2]}
SCHED = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
BATCH = 8  # per optimizer step: 2 micro-batches of 4, one sample per device each
ENCODERS = ("text_encoder", "text_encoder_2")
TOKENS, VOCAB = 7, 64  # a caption's token ids (the null context's length) and the tiny encoders' vocabulary
# case -> (the batch's conditioning, SGD's learning rate: LoRA's smaller, since the loss reads the product of
# two adapter matrices, see the test); InstructPix2Pix-SDXL with "image_latents", else text-to-image SDXL
CASES = {
    "unet": (("context", "pooled", "image_latents"), 1.0),
    "text_lora": (("ids",), 0.05),
    "controlnet": (("context", "pooled", "control"), 1.0),
}
# case -> the models whose weights the mesh splits, in the state or the step's constants
PARTS = {"unet": ("unet",), "text_lora": ("unet", *ENCODERS), "controlnet": ("unet", "controlnet")}


def _batch(step: int, case: str) -> dict[str, np.ndarray]:
    """Optimizer step `step`'s samples: posterior moments, SDXL's time ids, indices and `case`'s conditioning."""
    r = np.random.default_rng(step)
    n = BATCH
    batch = {
        "moments": np.concatenate([r.standard_normal((n, 8, 8, 4)), r.uniform(-3, -1, (n, 8, 8, 4))], -1).astype(np.float32),
        "context": r.standard_normal((n, TOKENS, 32)).astype(np.float32),
        "pooled": r.standard_normal((n, 16)).astype(np.float32),
        "time_ids": np.tile(np.array([[96, 80, 8, 0, 64, 64]], np.float32), (n, 1)),
        "image_latents": r.standard_normal((n, 8, 8, 4)).astype(np.float32),
        "index": np.arange(step * n, (step + 1) * n),
        "ids": r.integers(0, VOCAB - 1, (n, len(ENCODERS), TOKENS)).astype(np.int32),  # (B, E, T)
        "control": r.uniform(0, 1, (n, 16, 16, 3)).astype(np.float32),  # 2x the latents (the ControlNet's embedding)
    }
    batch["ids"][..., -1] = VOCAB - 1  # EOS last: the pooled embedding reads it
    return {k: v for k, v in batch.items() if k in ("moments", "time_ids", "index", *CASES[case][0])}


def _module(case: str, mesh):
    """(the module `case` trains, its parameters placed on `mesh` by `sdx.mesh.param_sharding` with no minimum
    size (a tiny model has no tensor of its 2**18 elements), the filter of its variables that train). LoRA's
    adapters are replicated, as train/diffusion.py places them; the ControlNet is drawn at random, its zero
    convolutions too, so that every weight has a gradient from the first step."""
    import jax
    from flax import nnx

    from sdx import clip, lora as loralib, mesh as meshlib, unet as U
    from sdx.controlnet import ControlNetConfig, ControlNetModel

    pix2pix = "image_latents" in CASES[case][0]
    unet = U.UNet2DConditionModel(U.UNetConfig.from_diffusers_config(UNET if pix2pix else T2I_UNET), rngs=nnx.Rngs(0))
    parts = {"unet": unet}
    if case == "text_lora":  # SDXL's: the context is both hidden states side by side (16 + 16), pooled the second's
        for j, name in enumerate(ENCODERS):
            cfg = clip.TextEncoderConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, projection_dim=16, with_projection=j == 1,
                                         eos_token_id=VOCAB - 1)
            parts[name] = clip.CLIPTextModel(cfg, rngs=nnx.Rngs(1 + j))
    if case == "controlnet":  # (B, 16, 16, 3) images: an embedding of two widths halves them once
        cfg = ControlNetConfig(unet=unet.config, conditioning_embedding_out_channels=(16, 32))
        parts["controlnet"] = ControlNetModel(cfg, rngs=nnx.Rngs(3))
    module = nnx.Dict(parts) if len(parts) > 1 else unet
    rule = meshlib.param_sharding(mesh, min_size=1)

    def place(path, x):
        return jax.device_put(x, rule(".".join(str(getattr(p, "key", p)) for p in path), x.shape))

    nnx.update(module, jax.tree.map_with_path(place, nnx.state(module, nnx.Param)))
    if case == "controlnet":
        return module, nnx.All(nnx.Param, nnx.PathContains("controlnet"))
    if not case.endswith("lora"):
        return module, nnx.Param
    for j, (name, part) in enumerate(parts.items()):
        targets = loralib.TARGETS if name == "unet" else loralib.TEXT_TARGETS
        loralib.attach(part, 2, 4.0, jax.random.key(1 + j), targets=targets, sharding=meshlib.replicated(mesh))
    # up drawn too (not zero), so that the first step has gradients for every adapter
    draw = lambda x: jax.device_put(jax.random.normal(jax.random.key(2), x.shape) * 0.1, x.sharding)
    nnx.update(module, jax.tree.map(draw, nnx.state(module, nnx.PathContains("up"))))
    return module, loralib.LoRAParam


def run_steps(mesh, case: str, steps: int = 2) -> dict[str, np.ndarray]:
    """`steps` optimizer steps (2 micro-batches each) of `case` on `mesh`, as train/loop.py runs them: the
    module's variables that do not train are the step's constants (`step.trained_in_part`). Returns the
    losses, grad norms and every leaf of the final state (params, optimizer state, EMA) as numpy, and
    [leaves split over fsdp, leaves] of the state ("split_state") and of each part's weights, adapters
    aside, whether in the state or the constants ("split_<part>")."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from pipelines.family import Family
    from sdx import lora as loralib
    from sdx import mesh as meshlib
    from sdx import schedulers
    from sdx.vae import VAEConfig
    from train import denoise, ema, optimizer as optlib
    from train import step as steplib

    module, trainable = _module(case, mesh)
    graphdef, params, base = nnx.split(module, trainable, ...)
    conditioning, learning_rate = CASES[case]
    fam = Family(xl=True, pix2pix="image_latents" in conditioning, aesthetic=False, encoders=ENCODERS,
                 force_zeros=True)
    # a fifth of the captions dropped (3 of these 16; InstructPix2Pix: and images); text_lora's encoders in the loss
    cfg = denoise.DenoiseConfig(family=fam, scheduler=schedulers.from_name("ddpm", SCHED),
                                vae=VAEConfig(scaling_factor=0.13025, latent_channels=4), prediction_type="epsilon",
                                noise_offset=0.05, text_drop=0.2, conditioning_dropout=0.2, snr_gamma=5.0,
                                text_dtype="float32" if case == "text_lora" else None, controlnet=case == "controlnet")
    null = {"context": jnp.full((TOKENS, 32), 0.25), "pooled": jnp.full((16,), -0.5)}
    tx = optax.chain(optlib.clip_grad_norm(1.0), optax.sgd(learning_rate, momentum=0.9))
    state = steplib.init_state(params, tx, use_ema=True)
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in _batch(0, case).items()}
    seed = jax.random.key(7)
    loss_fn, constants = steplib.trained_in_part(denoise.loss_fn(graphdef, cfg), null, base)
    fn = steplib.compile_step(state, shapes, seed, mesh, constants=constants, loss_fn=loss_fn, tx=tx,
                              accumulation=2, ema=ema.EMAConfig(decay=0.9), learning_rate=lambda s: 1e-3)
    losses, norms = [], []
    for i in range(steps):
        state, metrics = fn(state, meshlib.put_batch(mesh, _batch(i, case)), seed)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))

    def split(tree) -> np.ndarray:
        leaves = jax.tree.leaves(tree)
        return np.array([sum(meshlib.FSDP in str(getattr(x.sharding, "spec", "")) for x in leaves), len(leaves)])

    nnx.update(module, state.params)  # the trained weights, placed as the step left them
    parts = dict(module.items()) if isinstance(module, nnx.Dict) else {"unet": module}
    weights = nnx.All(nnx.Param, nnx.Not(loralib.LoRAParam))
    out = {f"leaf{i:04d}": np.asarray(jax.device_get(x)) for i, x in enumerate(jax.tree.leaves(state))}
    out |= {f"split_{name}": split(nnx.state(part, weights)) for name, part in parts.items()}
    return {**out, "loss": np.array(losses), "grad_norm": np.array(norms), "split_state": split(state)}


CHILD = """
import jax, numpy as np
from sdx import mesh as meshlib
from tests.test_train_mesh import CASES, run_steps
assert jax.device_count() == 4, jax.devices()
meshes = {"single": meshlib.make_mesh(1, devices=jax.devices()[:1]), "mesh": meshlib.make_mesh(2)}  # (data 2, fsdp 2)
assert dict(meshes["mesh"].shape) == {"data": 2, "fsdp": 2}, meshes["mesh"].shape
for case in CASES:
    for side, mesh in meshes.items():
        np.savez(f"{OUT}/{case}_{side}.npz", **run_steps(mesh, case))
print("ok")
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh")
    env = child_env(devices=4)
    script = f"OUT = {str(out)!r}\n" + textwrap.dedent(CHILD)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [f"{case}_{side}" for case in CASES for side in ("single", "mesh")]
    return {name: dict(np.load(out / f"{name}.npz")) for name in names}


def _leaves(r):
    return [r[k] for k in sorted(r) if k.startswith("leaf")]


@pytest.mark.parametrize("case", CASES)
def test_the_mesh_really_splits_the_weights(results, case):
    """Most of each part's weights are split over fsdp, in the state or the step's constants, and so is the
    state where it holds whole weights (the UNet's, the ControlNet's: with their momentum and EMA); LoRA's
    state, the adapters, is replicated. One device splits nothing."""
    single, mesh = results[f"{case}_single"], results[f"{case}_mesh"]
    for name in ("state", *PARTS[case]):
        assert single[f"split_{name}"][0] == 0, name
    for part in PARTS[case]:
        split, weights = mesh[f"split_{part}"]
        assert split > 0.5 * weights, (part, split, weights)
    split, leaves = mesh["split_state"]
    assert (split == 0) if case.endswith("lora") else (split > 0.5 * leaves), (split, leaves)


# (case, loss rtol, gradient-norm rtol, largest leaf difference relative to the leaf's largest value)
TOLERANCES = [("unet", 1e-6, 1e-6, 5e-5), ("text_lora", 2e-6, 1e-5, 2e-4), ("controlnet", 1e-6, 1e-6, 5e-5)]


@pytest.mark.parametrize("case, loss_rtol, norm_rtol, leaf_rtol", TOLERANCES)
def test_sharded_steps_equal_single_device(results, case, loss_rtol, norm_rtol, leaf_rtol):
    """Measured relative differences (loss, gradient norm, largest leaf difference): unet 2.0e-7, 3.4e-7, 5.7e-6;
    controlnet 1.2e-7, 8.6e-8, 3.7e-6; text_lora 1.9e-7, 4.8e-6, 4.7e-5 (a UNet-only LoRA: 1.8e-7, 5.9e-6,
    5.6e-5). Adapters'
    gradients round further apart than whole weights' (the largest leaf differences are their momentum
    traces), and as far between one device and a data-only mesh (4 x 1, nothing split; text_lora 3.2e-6 and
    4.9e-5): the order in which the batch is summed, not the split. Hence LoRA's bounds (at learning rate 1,
    where the first step moves the adapters by about their own size and the loss reads their product, a UNet
    LoRA's leaves differed by 2.1e-4). A gradient not reduced over the devices, or a weight shard read as the whole,
    would be off by tens of percent."""
    single, mesh = results[f"{case}_single"], results[f"{case}_mesh"]
    assert len(single["loss"]) == 2 and single["loss"][0] != single["loss"][1]
    print("relative differences: loss", np.abs(mesh["loss"] / single["loss"] - 1).max(),
          "grad norm", np.abs(mesh["grad_norm"] / single["grad_norm"] - 1).max())
    np.testing.assert_allclose(mesh["loss"], single["loss"], rtol=loss_rtol)
    np.testing.assert_allclose(mesh["grad_norm"], single["grad_norm"], rtol=norm_rtol)
    worst = 0.0
    for a, b in zip(_leaves(mesh), _leaves(single), strict=True):
        if a.dtype.kind == "f":  # parameters, momentum and EMA; relative to the leaf's largest value
            worst = max(worst, float(np.abs(a - b).max()) / max(float(np.abs(b).max()), 1e-3))
        else:
            np.testing.assert_array_equal(a, b)  # the step count
    print("worst relative difference", worst)
    assert worst < leaf_rtol
