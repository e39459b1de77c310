"""Training speed and memory: one UNet training step of sdx against diffusers' (PyTorch), in one run.

    python benchmarks/train.py --preset sd15 --channels 64,128,256,256 --size 256 --batch 4 [--dtype bfloat16] [--remat]

The step is what diffusers' train_text_to_image(_sdxl).py does per batch once the latents and text
embeddings exist (sdx's `--cache_latents`; diffusers' scripts encode inside the loop, which both would
pay alike): a posterior sample from the VAE moments, noise, uniform timesteps, DDPMScheduler.add_noise,
the UNet forward and backward, MSE in float32, clip_grad_norm_(1.0) and AdamW. For sdx that is
`train.step.compile_step` with `train.denoise.loss_fn` (one ahead-of-time compiled program, donated
state); for diffusers `UNet2DConditionModel` + `DDPMScheduler` + `torch.optim.AdamW`, as the script
writes it. Same architecture (an sdx preset's UNet config, `--channels` to shrink it), same batch
shapes, random weights; `--dtype bfloat16` is sdx's `--mixed_precision bf16` and torch's autocast to
bfloat16 (float32 master weights both), `--remat` sdx's rematerialised blocks and diffusers'
`enable_gradient_checkpointing()`. `--lora RANK` trains adapters of that rank instead (alpha = rank) and
leaves the UNet frozen, in the compute dtype: sdx's `python -m train.text_to_image_lora` step (`sdx.lora`,
`train.step.trained_in_part`) against train_text_to_image_lora.py's (peft's LoraConfig on to_q, to_k, to_v,
to_out.0; the UNet cast to the compute dtype, AdamW and clipping over the adapters). `--controlnet` trains
a ControlNet made from the UNet (diffusers' from_unet; sdx's `train.controlnet.from_unet`) beside it,
frozen in the compute dtype: `python -m train.controlnet`'s step against train_controlnet.py's (the
ControlNet's residuals into the UNet, AdamW and clipping over the ControlNet).

Each framework runs in a subprocess of its own (so its peak memory is its own): `--warmup` steps (for
sdx the first one includes the compile), then `--repeats` timed steps, each waited for (sdx:
`block_until_ready`; CUDA: `synchronize`). Printed per framework: the first step's extra seconds, the
best step time, images/s at that time, peak memory (the accelerator's peak allocation on GPU/TPU, the
process's peak RSS on the CPU, which includes the framework itself), and sdx's ratio to diffusers.
On a CPU whose cores are shared with other work, `--threads 1` gives each framework one compute thread:
with two threads and one core taken, torch's OpenMP barriers wait on a descheduled thread and a step
takes ~60x longer (measured), which says nothing about either framework.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.sample import machine, peak_rss_bytes, run_workers  # noqa: E402


def unet_config(args) -> dict:
    """The preset's diffusers UNet config, with --channels replacing block_out_channels."""
    from sdx import presets

    cfg = {k: v for k, v in presets.get(args.preset).configs["unet"].items() if not k.startswith("_")}
    if args.channels:
        cfg["block_out_channels"] = [int(c) for c in args.channels.split(",")]
        if len(cfg["block_out_channels"]) != len(cfg["down_block_types"]):
            raise SystemExit(f"--channels needs {len(cfg['down_block_types'])} numbers for {args.preset}")
    return cfg


def shapes(args, cfg: dict) -> dict[str, tuple[int, ...]]:
    """The batch: VAE moments (NHWC, 2 x 4 channels), text context, and for SDXL the pooled embedding and time ids."""
    h = args.size // 8
    cross = cfg["cross_attention_dim"]
    cross = cross[0] if isinstance(cross, list) else cross
    out = {"moments": (args.batch, h, h, 8), "context": (args.batch, 77, cross)}
    if cfg.get("addition_embed_type") == "text_time":
        out["pooled"] = (args.batch, cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"])
        out["time_ids"] = (args.batch, 6)
    return out


def batch_arrays(args, cfg: dict):
    import numpy as np

    r = np.random.default_rng(0)
    out = {"control": r.uniform(0, 1, (args.batch, args.size, args.size, 3))} if args.controlnet else {}
    for name, shape in shapes(args, cfg).items():
        if name == "moments":  # mean ~ N(0, 1), log-variance around -6 (a VAE's typical posterior)
            c = shape[-1] // 2
            out[name] = np.concatenate([r.standard_normal((*shape[:-1], c)), r.uniform(-7, -5, (*shape[:-1], c))], -1)
        elif name == "time_ids":
            out[name] = np.tile(np.array([args.size, args.size, 0, 0, args.size, args.size], np.float64), (args.batch, 1))
        else:
            out[name] = r.standard_normal(shape)
    return {k: v.astype(np.float32) for k, v in out.items()}


SCHEDULER = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}


def _timed(step, sync, args) -> tuple[float, float]:
    """(first step's seconds, best of --repeats) after --warmup steps (the first included)."""
    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0
    for _ in range(args.warmup - 1):
        step()
    sync()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return first, min(times)


def run_sdx(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from pipelines.family import Family
    from sdx import mesh as meshlib
    from sdx import attention, lora, schedulers, weights
    from sdx.layers import Compute
    from sdx.unet import UNet2DConditionModel, UNetConfig
    from sdx.vae import VAEConfig
    from train import denoise, optimizer
    from train import step as steplib

    raw = unet_config(args)
    cfg = UNetConfig.from_diffusers_config(raw)
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    param_dtype = dtype if args.lora or args.controlnet else jnp.float32  # a frozen UNet: the compute dtype
    compute = Compute(dtype=dtype, param_dtype=param_dtype, attention=args.attention or attention.default_backend(dtype),
                      remat=args.remat)
    model = weights.abstract(lambda r: UNet2DConditionModel(cfg, compute, rngs=r))
    n = sum(int(np.prod(s)) for s in weights.param_shapes(model).values())
    r = np.random.default_rng(0)
    arrays = {k: (0.02 * r.standard_normal(s)).astype(np.float32) for k, s in weights.param_shapes(model).items()}
    mesh = meshlib.make_mesh(1, devices=jax.devices()[:1])
    model = weights.materialize(model, arrays, dtype=param_dtype, sharding=meshlib.param_sharding(mesh))
    if args.controlnet:  # train.controlnet's module: the frozen UNet and a ControlNet made from it
        from convert.controlnet_folder import KIND
        from train.controlnet import from_unet

        part = from_unet(raw, arrays, jax.random.key(1))
        net = weights.materialize(KIND.abstract(part.config, dataclasses.replace(compute, param_dtype=jnp.float32)),
                                  part.arrays, dtype=jnp.float32, sharding=meshlib.param_sharding(mesh))
        model = nnx.Dict({"unet": model, "controlnet": net})
        n = sum(int(np.prod(v.shape)) for v in part.arrays.values())
    del arrays
    xl = "pooled" in shapes(args, raw)
    fam = Family(xl=xl, pix2pix=False, aesthetic=False,
                 encoders=("text_encoder", "text_encoder_2") if xl else ("text_encoder",), force_zeros=xl)
    loss_cfg = denoise.DenoiseConfig(family=fam, scheduler=schedulers.from_name("ddpm", SCHEDULER),
                                     vae=VAEConfig(scaling_factor=0.18215), prediction_type="epsilon",
                                     controlnet=bool(args.controlnet))
    host = batch_arrays(args, raw)
    null = {k: jnp.zeros(v.shape[1:], v.dtype) for k, v in host.items() if k in ("context", "pooled")}
    if args.lora:
        lora.attach(model, args.lora, float(args.lora), jax.random.key(0), sharding=meshlib.replicated(mesh))
    trained = lora.LoRAParam if args.lora else nnx.Param
    if args.controlnet:
        trained = nnx.All(nnx.Param, nnx.PathContains("controlnet"))
    graphdef, params, base = nnx.split(model, trained, ...)
    loss_fn, constants = steplib.trained_in_part(denoise.loss_fn(graphdef, loss_cfg), null, base)
    tx = optimizer.AdamW(1e-4, max_grad_norm=1.0)
    state = steplib.init_state(params, tx, use_ema=False)
    host["index"] = np.arange(args.batch)
    batch = meshlib.put_batch(mesh, host)
    seed = jax.random.key(0)
    t0 = time.perf_counter()
    fn = steplib.compile_step(state, {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}, seed, mesh,
                              constants=constants, loss_fn=loss_fn, tx=tx, accumulation=1, ema=None,
                              learning_rate=lambda s: 1e-4)
    compile_s = time.perf_counter() - t0
    holder = {"state": state}

    def step():
        holder["state"], metrics = fn(holder["state"], batch, seed)
        holder["metrics"] = metrics

    first, best = _timed(step, lambda: jax.block_until_ready(holder["metrics"]), args)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return {"framework": "sdx", "device": f"{device.platform}:{device.device_kind}", "first_extra_s": compile_s + first - best,
            "seconds": best, "params": n, "loss": float(holder["metrics"]["loss"]),
            "peak_bytes": stats.get("peak_bytes_in_use") or peak_rss_bytes(),
            "memory_kind": "device peak" if stats else "process peak RSS"}


def run_diffusers(args) -> dict:
    import diffusers
    import torch
    import torch.nn.functional as F
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    raw = unet_config(args)
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**raw).to(device).train()
    params = sum(p.numel() for p in unet.parameters())
    controlnet = None
    if args.controlnet:  # train_controlnet.py: the UNet frozen in the compute dtype, the ControlNet float32
        controlnet = diffusers.ControlNetModel.from_unet(unet).to(device).train()
        unet.requires_grad_(False)
        unet.to(torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
        params = sum(p.numel() for p in controlnet.parameters())
    if args.remat:
        unet.enable_gradient_checkpointing()
        if controlnet is not None:
            controlnet.enable_gradient_checkpointing()
    if args.lora:  # train_text_to_image_lora.py: the UNet frozen in the compute dtype, float32 adapters
        from peft import LoraConfig

        unet.requires_grad_(False)
        unet.to(torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
        unet.add_adapter(LoraConfig(r=args.lora, lora_alpha=args.lora, init_lora_weights="gaussian",
                                    target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
        for p in unet.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    trained = [p for p in (controlnet or unet).parameters() if p.requires_grad]
    scheduler = diffusers.DDPMScheduler(**SCHEDULER)
    optim = torch.optim.AdamW(trained, lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    host = {k: torch.from_numpy(v).to(device) for k, v in batch_arrays(args, raw).items()}
    moments = host["moments"].permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
    control = host["control"].permute(0, 3, 1, 2).contiguous() if controlnet is not None else None
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    holder = {}

    def step():  # train_text_to_image(_sdxl).py's inner loop, latents and embeddings given
        latents = DiagonalGaussianDistribution(moments).sample() * 0.18215
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=device).long()
        noisy = scheduler.add_noise(latents, noise, timesteps)
        added = {"text_embeds": host["pooled"], "time_ids": host["time_ids"]} if "pooled" in host else None
        residuals = {}
        with autocast:
            if controlnet is not None:
                down, mid = controlnet(noisy, timesteps, encoder_hidden_states=host["context"], controlnet_cond=control,
                                       added_cond_kwargs=added, return_dict=False)
                residuals = {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}
            pred = unet(noisy, timesteps, host["context"], added_cond_kwargs=added, **residuals).sample
        loss = F.mse_loss(pred.float(), noise.float(), reduction="mean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optim.step()
        optim.zero_grad()
        holder["loss"] = loss.detach()

    first, best = _timed(step, torch.cuda.synchronize if cuda else (lambda: None), args)
    return {"framework": "diffusers", "device": torch.cuda.get_device_name() if cuda else "cpu",
            "first_extra_s": first - best, "seconds": best, "params": params,
            "loss": float(holder["loss"]), "peak_bytes": torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes(),
            "memory_kind": "device peak" if cuda else "process peak RSS"}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="sd15", help="the sdx preset whose UNet is trained (sd15, sdxl_base, tiny_xl, ...)")
    p.add_argument("--channels", default="64,128,256,256",
                   help="block_out_channels replacing the preset's (comma-separated; '' keeps the preset's)")
    p.add_argument("--size", type=int, default=256, help="image size in pixels (latents are size / 8)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--remat", action="store_true", help="gradient checkpointing in both")
    p.add_argument("--lora", type=int, metavar="RANK", help="train LoRA adapters of this rank (alpha = rank) instead")
    p.add_argument("--controlnet", action="store_true", help="train a ControlNet made from the UNet beside it instead")
    p.add_argument("--attention", help="sdx attention backend (xla, cudnn, chunked; default: training's, "
                   "sdx.attention.default_backend of the dtype)")
    p.add_argument("--threads", type=int, choices=(1,), help="CPU: one compute thread per framework (torch's "
                   "set_num_threads, XLA's Eigen pool off), for a machine whose other cores are busy")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-reference", action="store_true", help="skip diffusers")
    p.add_argument("--worker", choices=("sdx", "diffusers"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        print(json.dumps({"sdx": run_sdx, "diffusers": run_diffusers}[args.worker](args)))
        return 0
    env = dict(os.environ)
    if args.threads == 1:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                            " intra_op_parallelism_threads=1").strip()
    frameworks = ["sdx"] + ([] if args.no_reference else ["diffusers"])
    results = run_workers(__file__, frameworks, argv if argv is not None else sys.argv[1:], env=env)
    if results is None:
        return 1
    print(f"# {machine()}; UNet of {args.preset} with block_out_channels {args.channels or 'as the preset'} "
          f"({results[0]['params'] / 1e6:.1f}M parameters{', the ControlNet' if args.controlnet else ''}), "
          f"{args.size}x{args.size}, batch {args.batch}, {args.dtype}"
          f"{', remat' if args.remat else ''}{f', LoRA rank {args.lora}' if args.lora else ''}"
          f"{', ControlNet' if args.controlnet else ''}"
          f"{', 1 thread' if args.threads else ''}; best of {args.repeats} steps "
          f"after {args.warmup}")
    print("| framework | device | compile + first step − steady (s) | s/step | images/s | peak memory (GiB) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['framework']} | {r['device']} | {r['first_extra_s']:.1f} | {r['seconds']:.3f} | "
              f"{args.batch / r['seconds']:.2f} | {r['peak_bytes'] / 2**30:.2f} ({r['memory_kind']}) |")
    if len(results) == 2:
        s, d = results
        assert s["params"] == d["params"], (s["params"], d["params"])
        print(f"sdx / diffusers: step time {s['seconds'] / d['seconds']:.2f}x, peak memory "
              f"{s['peak_bytes'] / d['peak_bytes']:.2f}x (below 1 means sdx is faster / smaller)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
