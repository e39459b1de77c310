"""`python -m train.vae`: fine-tune an AutoencoderKL, or train one from random weights.

    python -m train.vae --pretrained_model_name_or_path MODEL --dataset_name DATA --output_dir OUT
    python -m train.vae --vae_config tiny --train_data_dir FOLDER --resolution 64 --output_dir OUT

The loss is LDM's without the perceptual and adversarial terms: per sample the summed reconstruction
error over pixels (L1, or L2 with --reconstruction_loss l2) of the decoded posterior sample, plus
--kl_weight times the KL divergence of the posterior from N(0, 1) summed over latent elements; the
mean over the batch. --edge_weight W weighs each pixel's error by 1 + W times its edge strength (the
largest change over its 3x3 neighbourhood, in [0, 1]), so that outlines and corners, a few pixels of a
picture, are not blurred away; --latent_noise S adds noise of standard deviation S * u (u ~ U[0, 1) per
sample, in the latents' units before scaling_factor) to what the decoder decodes, so that it learns to
draw clean pictures from latents near the encoder's, as a diffusion model's are. With --decoder_only the
encoder is frozen (no gradient flows into it, the optimizer neither moves nor decays it): the latents it
gives, which a diffusion model was trained on, stay the same, and only their decoding improves. With
--unet_latents (a pipeline's decoder only) the decoder learns from what the pipeline's UNet draws rather than
from the encoder: each picture of the dataset and its caption go once through img2img at a low strength (each
batch at the next of the strengths given, with seed --seed plus the batch's number, the model's own guidance and
30 steps), and the loss decodes the final latents against the picture itself, without the KL term; the
pictures and those latents are stored in output_dir/cache as `--cache_latents` stores its encodings
(`train/cache.py`: built once, reused on resume, flipped pictures drawn apart). A UNet's latents differ from
the encoder's in the fine detail, such as a corner, which a decoder trained on the encoder's alone draws
rounded. The metrics also carry the mean absolute error per pixel (`l1_per_pixel`) and the KL per latent element,
which are comparable across resolutions.

Output: from a pipeline (--pretrained_model_name_or_path) the whole pipeline with the new VAE, an sdx
folder in --output_dir; from --vae_config a VAE folder in diffusers' layout (config.json and
diffusion_pytorch_model.safetensors), which `--vae`, `--pretrained_vae_model_name_or_path` and
`python -m convert --vae` take.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipelines import executables
from sdx import io, mesh as meshlib
from sdx import model_folder, presets, weights
from sdx.errors import SdxError
from sdx.vae import AutoencoderKL, VAEConfig
from train import cache as cachelib
from train import config as configlib
from train import data, export, loop, models, objective, sources
from train.config import TrainConfig


ENCODER_SIDE = ("encoder", "quant_conv")  # what --decoder_only freezes


def vae_config(spec: str) -> VAEConfig:
    """--vae_config: a preset name (its VAE) or a diffusers VAE config.json."""
    path = Path(spec)
    if path.is_file():
        return VAEConfig.from_diffusers_config(io.read_json(path, obj=True))
    if spec not in presets.NAMES:
        raise SdxError(f"--vae_config {spec}: neither a config.json file nor a preset ({', '.join(presets.NAMES)})")
    return VAEConfig.from_diffusers_config(presets.get(spec).configs["vae"])


@dataclasses.dataclass(frozen=True)
class VAELoss:
    """The flags that change the loss (see the module docstring)."""

    reconstruction_loss: str  # "l1" or "l2"
    kl_weight: float
    decoder_only: bool
    edge_weight: float = 0.0
    latent_noise: float = 0.0


def vae_loss(graphdef, cfg: VAELoss) -> functools.partial:
    """(params, batch, keys, constants) -> (loss, {"l1_per_pixel", "kl_per_element"}) for `train.step`
    (no constants: it reads the batch alone). A partial of a module function and values, so a compiled step
    is keyed by it (`pipelines.executables`)."""
    return functools.partial(_vae_loss, graphdef, cfg)


def _vae_loss(graphdef, cfg: VAELoss, params, batch, keys, constants):
    del constants
    vae = nnx.merge(graphdef, params)
    x = batch["pixels"]
    if "unet_latents" in batch:  # --unet_latents: what a UNet drew from x, in the decoder's units; no encoder
        z, kl = batch["unet_latents"], None
    else:
        dist = vae.encode(x)
        if cfg.decoder_only:  # the KL term is then a constant
            dist = jax.lax.stop_gradient(dist)
        z = objective.posterior_sample(keys, jnp.concatenate([dist.mean, dist.logvar], axis=-1))
        kl = dist.kl()  # (B,)
    recon = vae.decode(objective.latent_noise(keys, z, cfg.latent_noise)).astype(jnp.float32)
    err = jnp.abs(recon - x) if cfg.reconstruction_loss == "l1" else (recon - x) ** 2
    if cfg.edge_weight:
        err = err * (1.0 + cfg.edge_weight * objective.edge_strength(x))
    aux = {"l1_per_pixel": jnp.mean(jnp.abs(recon - x))}
    per_sample = jnp.sum(err, axis=(1, 2, 3))
    if kl is not None:
        per_sample = per_sample + cfg.kl_weight * kl
        aux["kl_per_element"] = jnp.mean(kl) / np.prod(z.shape[1:])
    return jnp.mean(per_sample), aux


@jax.jit
def _reconstruct(vae: nnx.Module, x: jax.Array) -> jax.Array:
    """The VAE's reconstruction of `x` from its posterior mode: traced and compiled once per run, as every
    validation passes a VAE of the same structure."""
    return vae(x)


class VAETask:
    def __init__(self, cfg: TrainConfig, mesh, log=print, restoring: bool = False):
        """restoring: a resumed run, whose VAE stays abstract (shapes, dtypes and shardings): the checkpoint
        fills it."""
        self.cfg, self.mesh, self.log = cfg, mesh, log
        compute = models.computes(cfg, mesh)["vae"]
        rule = meshlib.param_sharding(mesh)
        self.folder = None
        if cfg.vae_config:
            config = vae_config(cfg.vae_config)
            model = executables.abstract_model(model_folder.MODEL_KINDS["vae"], config, compute)
            if restoring:
                self.module = weights.placed_abstract(model, sharding=rule)
            else:  # drawn on the default device, then placed on the mesh as loaded weights are
                drawn = model_folder.module_arrays(AutoencoderKL(config, compute, rngs=nnx.Rngs(cfg.seed)))
                self.module = weights.materialize(model, drawn, sharding=rule)
        else:
            self.folder = models.resolve_folder(cfg, log)
            self.spec = model_folder.read_spec(self.folder)
            self.module = model_folder.load_component(self.folder, "vae", dtype=jnp.float32, compute=compute,
                                                      sharding=rule, spec=self.spec, abstract=executables.abstract_model,
                                                      read=not restoring)
        self.transform = data.Transform(resolution=cfg.resolution, center_crop=cfg.center_crop,
                                        random_flip=cfg.random_flip, seed=cfg.seed,
                                        interpolation=cfg.image_interpolation_mode)
        self.constants = {}  # what the loss reads besides the batch: nothing
        self.fixed = None  # the validation images: the first batch's, reconstructed at each validation
        self.cache = None  # --unet_latents: the pictures and what the UNet drew from them

    def prepare_data(self, source: sources.Source, out: Path) -> dict:
        """--unet_latents: draw the dataset once into out/cache/process-N (or reuse what is there), and return
        the loader's hooks that read it (train/cache.py); without it, nothing to do."""
        cfg = self.cfg
        if not cfg.unet_latents:
            return {}
        key = cachelib.data_key(cfg, source, self.folder) | {"unet_latents": list(cfg.unet_latents)}
        self.cache = cachelib.LatentCache.open_or_build(
            out / "cache" / f"process-{jax.process_index()}", source, self.transform,
            encode=unet_drawer(self.folder, self.module.config, cfg),
            batch_size=cfg.train_batch_size * jax.local_device_count(), key=key, log=self.log, flag="--unet_latents")
        return {"element": self.cache.element, "collate_fn": self.cache.collate}

    def _host_arrays(self, host: dict) -> dict:
        if self.cache is not None:
            return self.cache.gather(host)
        return {"pixels": host["pixels"], "index": np.asarray(host["index"])}

    def step_batch(self, host: dict) -> dict:
        arrays = self._host_arrays(host)
        if self.fixed is None:
            self.fixed = np.asarray(arrays["pixels"][: min(8, len(arrays["pixels"]))], np.float32)
        return meshlib.put_batch(self.mesh, arrays)

    def batch_shapes(self, host: dict) -> dict:
        return {k: jax.ShapeDtypeStruct(np.shape(v), jax.dtypes.canonicalize_dtype(np.asarray(v).dtype))
                for k, v in self._host_arrays(host).items()}

    def loss_fn(self, graphdef):
        cfg = self.cfg
        return vae_loss(graphdef, VAELoss(reconstruction_loss=cfg.reconstruction_loss, kl_weight=cfg.kl_weight,
                                          decoder_only=cfg.decoder_only, edge_weight=cfg.edge_weight,
                                          latent_noise=cfg.latent_noise))

    def frozen(self, params):
        """Under --decoder_only, True for the encoder's side (encoder, quant_conv); else None (all train)."""
        if not self.cfg.decoder_only:
            return None
        return jax.tree_util.tree_map_with_path(lambda path, _: path[0].key in ENCODER_SIDE, params)

    def validate(self, vae: nnx.Module, step: int, metrics) -> None:
        """Originals (top row) over their reconstructions from the posterior mode (bottom row)."""
        x = self.fixed
        recon = np.asarray(_reconstruct(vae, jnp.asarray(x)), np.float32)
        pair = np.concatenate([np.concatenate(list(x), axis=1), np.concatenate(list(recon), axis=1)], axis=0)
        metrics.image(step, "reconstruction", ((np.clip(pair, -1, 1) + 1) * 127.5).round().astype(np.uint8))

    def export(self, vae: nnx.Module, out: Path) -> None:
        if jax.process_index() != 0:
            return
        arrays = model_folder.module_arrays(vae)
        if self.folder is None:
            write_vae_folder(out, vae.config, arrays)
            self.log(f"VAE written to {out} (use it with --vae {out})")
            return
        entry = self.spec["components"]["vae"]
        part = model_folder.ModelPart(cls=entry["class"], config=vae.config, arrays=arrays,
                                      source_config=entry.get("source_config"))
        export.write_model(out, source=self.folder, spec=self.spec, pipeline_class=self.spec["pipeline_class"],
                           models={"vae": part}, export_format=self.cfg.export_format, log=self.log)


def write_vae_folder(out: Path, config: VAEConfig, arrays: dict[str, np.ndarray]) -> None:
    """A diffusers-layout VAE folder: config.json and diffusion_pytorch_model.safetensors (torch keys)."""
    torch_arrays = weights.to_torch_keys(arrays)
    out.mkdir(parents=True, exist_ok=True)
    io.write_safetensors(out / "diffusion_pytorch_model.safetensors", sorted(torch_arrays.items()))
    io.atomic_write_json(out / "config.json", {"_class_name": "AutoencoderKL", **config.to_diffusers_config()})


def unet_drawer(folder: Path, vae_config: VAEConfig, cfg: TrainConfig):
    """--unet_latents: a host batch of the loader (pictures, captions) -> {"pixels", "unet_latents"}: the
    pictures, and the final latents the pipeline in `folder` draws from each picture and its caption by img2img
    (its own scheduler and guidance, 30 steps), in the decoder's units (before scaling_factor). Batch b (counted
    from 0) is drawn at strength cfg.unet_latents[b % their number], with seed cfg.seed + b. The pipeline is
    loaded at the first batch."""
    from pipelines.pipeline import Pipeline
    from pipelines.request import Request

    pipe = None
    batches = itertools.count()

    def draw(host: dict) -> dict:
        nonlocal pipe
        pipe = pipe or Pipeline.load(folder, dtype="float32")
        b = next(batches)
        pixels = np.asarray(host["pixels"], np.float32)  # (B, H, W, 3) in [-1, 1]
        strength = cfg.unet_latents[b % len(cfg.unet_latents)]
        request = Request(prompts=[str(t) for t in host["text"]], image=pixels, height=pixels.shape[1],
                          width=pixels.shape[2], seed=cfg.seed + b, strength=strength, output_latents=True)
        latents = jnp.asarray(pipe(request))  # (B, h, w, C), the UNet's units
        return {"pixels": jnp.asarray(pixels), "unet_latents": vae_config.from_latents(latents).astype(jnp.float32)}

    return draw


def open_data(cfg: TrainConfig):
    columns = sources.Columns(images=(cfg.image_column,), text=cfg.caption_column if cfg.unet_latents else None,
                              names=("pixels",))
    return sources.open_source(cfg.dataset_name or cfg.train_data_dir, columns, max_samples=cfg.max_train_samples,
                            seed=cfg.seed, cache_dir=cfg.cache_dir)


def train(argv=None) -> int:
    cfg = configlib.parse("vae", argv)
    return loop.run(cfg, VAETask, open_data)


if __name__ == "__main__":
    loop.main(train, sys.argv[1:])
