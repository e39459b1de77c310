"""The training loop every task shares: data, compiled step, checkpoints, metrics, validation, export.

    run(cfg, task) -> exit status

A `Task` (train/diffusion.py for text-to-image and InstructPix2Pix, train/vae.py for the VAE) says what
differs: which module trains, how a host batch becomes the step's batch (tokens, time ids, the frozen
encoders), the loss, validation and what is exported. Everything here is the same for all of them:

1. everything the user gave is checked before any heavy work (files, columns, the output folder);
2. models are loaded and placed on the mesh, the step is compiled ahead of time once;
3. the loop runs optimizer steps; every `checkpointing_steps`, at the end and on SIGTERM/SIGINT, the
   state (trainable parameters, optimizer, EMA, step) and the data iterator's position are saved;
   `--resume_from_checkpoint latest` continues exactly (every random draw derives from the seed, the
   step and the sample index);
4. the final model (EMA weights when EMA is on) is written into --output_dir as an sdx folder (a LoRA
   run writes its adapters alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from sdx import io
from sdx import mesh as meshlib
from sdx.errors import SdxError, run_command
from train import checkpoint, data, lr, optimizer, signals
from train import ema as emalib
from train import step as steplib
from train.config import TrainConfig
from train.metrics import Metrics


class Task(Protocol):
    """What one kind of training adds to the loop (see train/diffusion.py, train/vae.py). A task may also
    have `prepare_data(source, output_dir) -> dict`, extra keyword arguments of `data.make_loader` (the
    latent cache's, train/cache.py), `frozen(params) -> tree of bools or None`, the parameters of
    `module` that the optimizer leaves alone (`optimizer.FrozenExcept`; the VAE's encoder under
    --decoder_only), `learning_rate_scales(params, peak_learning_rate) -> tree of floats or None`, each
    parameter's learning rate over the run's (`optimizer.ScaledLearningRates`; `--text_encoder_lr`),
    `make_loader(source, batch_size=) -> loader`, the host batches when the task reads its
    data its own way (DreamBooth's instance and class images; `data.Loader`'s interface), and `trainable`,
    an nnx filter of the variables of `module` that train (default every nnx.Param; a LoRA run's
    adapters): the others are the step's constants (`step.trained_in_part`), in no optimizer state, EMA or
    checkpoint."""

    module: nnx.Module  # the trainable model, placed on the mesh (when restoring, abstract: the checkpoint fills it)
    constants: dict[str, jax.Array]  # arrays the loss reads besides the batch, fixed for the run

    def batch_shapes(self, host_batch: dict[str, np.ndarray]) -> dict[str, jax.ShapeDtypeStruct]: ...
    def step_batch(self, host_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]: ...
    def loss_fn(self, graphdef) -> steplib.LossFn: ...
    def validate(self, module: nnx.Module, step: int, metrics: Metrics) -> None: ...
    def export(self, module: nnx.Module, out: Path) -> None: ...


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Step counts. micro: samples per device per micro-batch; per_step: samples per optimizer step
    (all hosts); steps_per_epoch: optimizer steps in one pass over the data; total: optimizer steps."""

    per_host_batch: int
    per_step: int
    steps_per_epoch: int
    total: int
    epochs: int


def schedule(cfg: TrainConfig, num_samples: int) -> Schedule:
    per_step = cfg.train_batch_size * jax.device_count() * cfg.gradient_accumulation_steps
    per_host = per_step // jax.process_count()
    steps_per_epoch = num_samples // per_step
    if steps_per_epoch == 0:
        raise SdxError(
            f"the dataset has {num_samples} usable samples, fewer than one optimizer step takes ({per_step} = "
            f"{cfg.train_batch_size} per device x {jax.device_count()} devices x {cfg.gradient_accumulation_steps} "
            "accumulation steps); lower --train_batch_size or --gradient_accumulation_steps"
        )
    total = cfg.max_train_steps or cfg.num_train_epochs * steps_per_epoch
    return Schedule(per_host, per_step, steps_per_epoch, total, math.ceil(total / steps_per_epoch))


def learning_rate(cfg: TrainConfig) -> float:
    if not cfg.scale_lr:
        return cfg.learning_rate
    return lr.scale_lr(cfg.learning_rate, cfg.gradient_accumulation_steps, cfg.train_batch_size, jax.device_count())


def make_optimizer(cfg: TrainConfig, total_steps: int):
    sched = lr.schedule(cfg.lr_scheduler, learning_rate(cfg), warmup_steps=cfg.lr_warmup_steps,
                        total_steps=total_steps, num_cycles=cfg.lr_num_cycles, power=cfg.lr_power,
                        step_rules=cfg.lr_step_rules)
    tx = optimizer.AdamW(sched, beta1=cfg.adam_beta1, beta2=cfg.adam_beta2, weight_decay=cfg.adam_weight_decay,
                         eps=cfg.adam_epsilon, max_grad_norm=cfg.max_grad_norm or None)
    return tx, sched


def ema_config(cfg: TrainConfig) -> emalib.EMAConfig | None:
    if not cfg.use_ema:
        return None
    return emalib.EMAConfig(decay=cfg.ema_decay, min_decay=cfg.ema_min_decay, update_after_step=cfg.ema_update_after_step,
                            use_warmup=cfg.ema_use_warmup, inv_gamma=cfg.ema_inv_gamma, power=cfg.ema_power)


def validation_due(cfg: TrainConfig, step: int, sched: Schedule) -> bool:
    if cfg.validation_steps:
        return step % cfg.validation_steps == 0
    every = (cfg.validation_epochs or 1) * sched.steps_per_epoch
    return step % every == 0


def run(cfg: TrainConfig, make_task, open_data) -> int:
    """make_task(cfg, mesh, log, restoring) -> Task; open_data(cfg) -> data.Source (columns checked)."""
    out = Path(cfg.output_dir)
    io.check_writable(out, "--output_dir")  # created once the model has loaded: a bad input writes nothing
    source = open_data(cfg)
    meshlib.initialize()
    mesh = meshlib.make_mesh(cfg.fsdp)
    sched = schedule(cfg, len(source))
    resume = checkpoint.resolve(cfg.resume_from_checkpoint, out)
    # on stdout above the progress bar (on stderr), not glued to the end of its line
    metrics_log = tqdm.write if jax.process_index() == 0 else (lambda *_: None)

    task = make_task(cfg, mesh, metrics_log, restoring=resume is not None)
    out.mkdir(parents=True, exist_ok=True)
    graphdef, params, base = nnx.split(task.module, getattr(task, "trainable", nnx.Param), ...)
    loss_fn, constants = steplib.trained_in_part(task.loss_fn(graphdef), task.constants, base)
    tx, lr_schedule = make_optimizer(cfg, sched.total)
    frozen = task.frozen(params) if hasattr(task, "frozen") else None
    if frozen is not None:
        tx = optimizer.FrozenExcept(tx, frozen)
    scales = task.learning_rate_scales(params, learning_rate(cfg)) if hasattr(task, "learning_rate_scales") else None
    if scales is not None:
        tx = optimizer.ScaledLearningRates(tx, scales)
    ema = ema_config(cfg)
    if hasattr(task, "make_loader"):  # a task reading its data its own way (DreamBooth's two parts)
        loader = task.make_loader(source, batch_size=sched.per_host_batch)
    else:
        prepare = getattr(task, "prepare_data", None)  # --cache_latents: the loader reads the cache, not images
        hooks = prepare(source, out) if prepare is not None else {}
        loader = data.make_loader(source, task.transform, batch_size=sched.per_host_batch, seed=cfg.seed,
                                  num_epochs=None, workers=cfg.dataloader_num_workers, **hooks)
    ckpts = checkpoint.Checkpoints(out / "checkpoints", keep=cfg.checkpoints_total_limit)
    start = 0
    if resume is None:
        state = steplib.init_state(params, tx, use_ema=ema is not None)
    else:  # onto the state's shapes and shardings: a resumed run never holds a second state
        like = steplib.abstract_state(params, tx, use_ema=ema is not None)
        saved, meta = ckpts.restore(resume, _flat(like))
        state = jax.tree.unflatten(jax.tree.structure(like), [saved[k] for k in sorted(saved)])
        loader.restore(meta["data"])
        start = int(state.step)
        metrics_log(f"resumed from step {start} ({resume})")
    seed_key = jax.random.key(cfg.seed)
    it = iter(loader)
    first = next(it)
    compiled = steplib.compile_step(
        state, meshlib.global_batch_shapes(task.batch_shapes(first)), seed_key, mesh, constants=constants,
        loss_fn=loss_fn, tx=tx, accumulation=cfg.gradient_accumulation_steps, ema=ema,
        learning_rate=lr_schedule,
    )
    tb = (out / cfg.logging_dir) if cfg.report_to == "tensorboard" else None
    metrics = Metrics(out, total_steps=sched.total, start_step=start, tensorboard_dir=tb)
    metrics.message(f"{len(source)} samples, {sched.per_step} per optimizer step, {sched.total} steps "
                    f"({sched.epochs} epochs) on {jax.device_count()} devices")

    def save(step: int, force: bool = False) -> None:
        ckpts.save(step, _flat(state), {"data": loader.state(), "config": cfg.to_dict()}, force=force)

    host_batch = first
    stopped = False
    try:
        with signals.GracefulStop() as stop:
            for step in range(start + 1, sched.total + 1):
                t0 = time.perf_counter()
                batch = task.step_batch(host_batch)
                images = batch["index"].shape[0]  # the step's samples, all hosts (DreamBooth: both parts)
                state, values = compiled(state, batch, seed_key)
                values = {k: float(v) for k, v in jax.device_get(values).items()}
                dt = time.perf_counter() - t0
                values.update(step_time=dt, images_per_s=images / dt, skipped=float(loader.skipped))
                metrics.log(step, values)
                if not math.isfinite(values["loss"]):
                    raise SdxError(f"the loss became {values['loss']} at step {step}; lower --learning_rate")
                if step % cfg.checkpointing_steps == 0 or step == sched.total:
                    save(step)
                if (cfg.validation_prompt or cfg.task == "vae") and validation_due(cfg, step, sched):
                    task.validate(module_for_export(graphdef, state, base), step, metrics)
                if step < sched.total and stop.requested_anywhere():
                    save(step, force=True)
                    stopped = True
                    break
                if step < sched.total:
                    host_batch = next(it)
        ckpts.wait()
    except BaseException:  # the progress bar closes first: an error prints on its own line
        metrics.close()
        with contextlib.suppress(Exception):  # a failed save raises again here; its error is the one in flight
            ckpts.close()
        raise
    if stopped:
        metrics.close()
        print(f"stopped at step {step}; continue with --resume_from_checkpoint latest", file=sys.stderr)
        return 0
    if loader.skipped:
        metrics.message(f"{loader.skipped} unreadable samples were skipped")
    task.export(module_for_export(graphdef, state, base), out)
    metrics.close()
    ckpts.close()
    return 0


def _flat(state: steplib.TrainState) -> dict[str, jax.Array]:
    """The state's leaves keyed by position ("00000", ...): what a checkpoint stores. The structure comes
    back from the live state at restore (nnx's integer-keyed lists do not survive Orbax's tree restore)."""
    return {f"{i:05d}": leaf for i, leaf in enumerate(jax.tree.leaves(state))}


def module_for_export(graphdef, state: steplib.TrainState, base) -> nnx.Module:
    """The trained module, with the EMA weights when EMA is on, and its untrained variables `base`."""
    return nnx.merge(graphdef, state.ema if state.ema is not None else state.params, base)


def compilation_cache() -> None:
    """JAX's persistent compilation cache in the sdx cache folder (`$SDX_CACHE/jax`, as the sampler's), unless
    JAX_COMPILATION_CACHE_DIR already names one: a resumed run (a preempted machine coming back) loads the
    compiled step instead of compiling it again."""
    if jax.config.jax_compilation_cache_dir:
        return
    from convert.library import default_cache_dir
    from pipelines.sampler import enable_compilation_cache

    enable_compilation_cache(default_cache_dir() / "jax")


def main(run_task, argv=None) -> Any:
    """Entry point of `python -m train.X`: the persistent compilation cache on; one `error:` line and exit
    status 2 for any bad input."""
    compilation_cache()
    raise SystemExit(run_command(lambda: run_task(argv)))
