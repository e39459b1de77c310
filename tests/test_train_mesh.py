"""Training steps on a mesh of 4 fake CPU devices (data 2 x fsdp 2; parameters, gradients, optimizer
state and EMA really split over fsdp) equal the same steps on one device: loss, gradient norm, updated
parameters, optimizer state and EMA, in float32. The same for LoRA adapters on a UNet split over fsdp.

The optimizer is SGD with momentum after the scripts' gradient clipping, learning rate 1: every
quantity is linear in the gradients, so the comparison is as tight as float32 summation order allows
(AdamW divides by sqrt(v): a gradient that is ~0 up to rounding turns into a full-size update, which
would force a tolerance loose enough to hide a wrong reduction). AdamW itself is element-wise and
equal to torch's (tests/test_train_objective.py); what the mesh adds is the sharding of its state,
which the momentum trace exercises the same way.

The main test process has one device, so the mesh runs in a subprocess started with
XLA_FLAGS=--xla_force_host_platform_device_count=4; it computes both sides (the single-device one on
the first of its devices) and saves them for the comparisons here.
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
SCHED = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
BATCH = 8  # per optimizer step: 2 micro-batches of 4, one sample per device each


def _batch(step: int) -> dict[str, np.ndarray]:
    r = np.random.default_rng(step)
    n = BATCH
    return {
        "moments": np.concatenate([r.standard_normal((n, 8, 8, 4)), r.uniform(-3, -1, (n, 8, 8, 4))], -1).astype(np.float32),
        "context": r.standard_normal((n, 7, 32)).astype(np.float32),
        "pooled": r.standard_normal((n, 16)).astype(np.float32),
        "time_ids": np.tile(np.array([[96, 80, 8, 0, 64, 64]], np.float32), (n, 1)),
        "image_latents": r.standard_normal((n, 8, 8, 4)).astype(np.float32),
        "index": np.arange(step * n, (step + 1) * n),
    }


def run_steps(mesh, fsdp_min_size: int, steps: int = 2, lora: bool = False) -> dict[str, np.ndarray]:
    """`steps` optimizer steps (2 micro-batches each) of an InstructPix2Pix-SDXL loss on `mesh`; the
    parameters placed by `sdx.mesh.param_sharding(mesh, fsdp_min_size)`. Returns the losses, grad norms,
    and every leaf of the final state (params, optimizer state, EMA) as numpy, plus how many leaves
    of the state are split over fsdp. lora: LoRA adapters (rank 2, replicated) train, as train/loop.py
    trains them: the UNet's parameters the step's constants (`step.trained_in_part`), of which `split` then counts
    the leaves split over fsdp."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from pipelines.family import Family
    from sdx import mesh as meshlib
    from sdx import lora as loralib
    from sdx import schedulers, unet as U
    from sdx.vae import VAEConfig
    from train import denoise, ema, optimizer as optlib
    from train import step as steplib

    model = U.UNet2DConditionModel(U.UNetConfig.from_diffusers_config(UNET), rngs=nnx.Rngs(0))
    rule = meshlib.param_sharding(mesh, min_size=fsdp_min_size)

    def place(path, x):
        return jax.device_put(x, rule(".".join(str(getattr(p, "key", p)) for p in path), x.shape))

    nnx.update(model, jax.tree.map_with_path(place, nnx.state(model, nnx.Param)))
    if lora:  # up drawn too (not zero), so that the first step has gradients for every adapter
        loralib.attach(model, 2, 4.0, jax.random.key(1), sharding=meshlib.replicated(mesh))
        ups = nnx.state(model, nnx.PathContains("up"))
        draw = lambda x: jax.device_put(jax.random.normal(jax.random.key(2), x.shape) * 0.1, x.sharding)
        nnx.update(model, jax.tree.map(draw, ups))
    graphdef, params, base = nnx.split(model, loralib.LoRAParam if lora else nnx.Param, ...)
    fam = Family(xl=True, pix2pix=True, aesthetic=False, encoders=("text_encoder", "text_encoder_2"), force_zeros=True)
    cfg = denoise.DenoiseConfig(family=fam, scheduler=schedulers.from_name("ddpm", SCHED),
                                vae=VAEConfig(scaling_factor=0.13025, latent_channels=4), prediction_type="epsilon",
                                noise_offset=0.05, conditioning_dropout=0.2, snr_gamma=5.0)
    null = {"context": jnp.full((7, 32), 0.25), "pooled": jnp.full((16,), -0.5)}
    # LoRA: a smaller step, since the loss reads the product of two adapter matrices (see the test)
    tx = optax.chain(optlib.clip_grad_norm(1.0), optax.sgd(0.05 if lora else 1.0, momentum=0.9))
    state = steplib.init_state(params, tx, use_ema=True)
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in _batch(0).items()}
    seed = jax.random.key(7)
    loss_fn, constants = steplib.trained_in_part(denoise.loss_fn(graphdef, cfg), null, base)
    fn = steplib.compile_step(state, shapes, seed, mesh, constants=constants, loss_fn=loss_fn, tx=tx,
                              accumulation=2, ema=ema.EMAConfig(decay=0.9), learning_rate=lambda s: 1e-3)
    losses, norms = [], []
    for i in range(steps):
        state, metrics = fn(state, meshlib.put_batch(mesh, _batch(i)), seed)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    leaves = jax.tree.leaves(state)
    split = sum(1 for x in jax.tree.leaves(base if lora else state) if meshlib.FSDP in str(getattr(x.sharding, "spec", "")))
    out = {f"leaf{i:04d}": np.asarray(jax.device_get(x)) for i, x in enumerate(leaves)}
    return {**out, "loss": np.array(losses), "grad_norm": np.array(norms), "split": np.array(split),
            "leaves": np.array(len(leaves))}


CHILD = """
import jax, numpy as np
from sdx import mesh as meshlib
from tests.test_train_mesh import run_steps
assert jax.device_count() == 4, jax.devices()
one = meshlib.make_mesh(1, devices=jax.devices()[:1])
mesh = meshlib.make_mesh(2)  # (data 2, fsdp 2)
assert dict(mesh.shape) == {"data": 2, "fsdp": 2}, mesh.shape
np.savez(f"{OUT}/single.npz", **run_steps(one, 1))
np.savez(f"{OUT}/mesh.npz", **run_steps(mesh, 1))
np.savez(f"{OUT}/lora_single.npz", **run_steps(one, 1, lora=True))
np.savez(f"{OUT}/lora_mesh.npz", **run_steps(mesh, 1, lora=True))
print("ok")
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh")
    env = child_env(devices=4)
    script = f"OUT = {str(out)!r}\n" + textwrap.dedent(CHILD)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {name: dict(np.load(out / f"{name}.npz")) for name in ("single", "mesh", "lora_single", "lora_mesh")}


def _leaves(r):
    return [r[k] for k in sorted(r) if k.startswith("leaf")]


def test_the_mesh_really_splits_the_state(results):
    assert int(results["single"]["split"]) == 0
    mesh = results["mesh"]
    # parameters, their momentum trace and EMA: most leaves are split over fsdp
    assert int(mesh["split"]) > 0.5 * int(mesh["leaves"]), (int(mesh["split"]), int(mesh["leaves"]))


# (run, loss rtol, gradient-norm rtol, largest leaf difference relative to the leaf's largest value)
TOLERANCES = [("", 1e-6, 1e-6, 5e-5), ("lora_", 2e-6, 1e-5, 2e-4)]


@pytest.mark.parametrize("run, loss_rtol, norm_rtol, leaf_rtol", TOLERANCES)
def test_sharded_steps_equal_single_device(results, run, loss_rtol, norm_rtol, leaf_rtol):
    """The whole UNet trained, and LoRA adapters (replicated) on a UNet split over fsdp in the constants.
    LoRA's adapter gradients round further apart between the two layouts than the whole UNet's (measured:
    loss 2.8e-7, gradient norm 2.6e-6, leaves 5.1e-5 relative, at learning rate 0.05; 1.9e-6, 4.8e-6 and
    2.1e-4 at 1, where the first step moves the adapters by about their own size and the loss reads their
    product), hence its bounds; a gradient not reduced over the devices, or a UNet shard read as the whole,
    would be off by tens of percent."""
    single, mesh = results[f"{run}single"], results[f"{run}mesh"]
    assert len(single["loss"]) == 2 and single["loss"][0] != single["loss"][1]
    if run:
        assert int(single["split"]) == 0 and int(mesh["split"]) > 100, int(mesh["split"])  # the UNet really split
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
