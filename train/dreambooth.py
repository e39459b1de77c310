"""`python -m train.dreambooth`: DreamBooth (Ruiz et al. 2023) with diffusers' train_dreambooth.py flags,
SD 1.x/2.x or SDXL: fine-tune on a few images of one subject, all under `--instance_prompt`; with
`--with_prior_preservation`, each step also trains on as many images of the subject's class under
`--class_prompt` (sampled from the model first when `--class_data_dir` holds fewer than
`--num_class_images`), weighted by `--prior_loss_weight`, so that the class keeps its look.

    python -m train.dreambooth --pretrained_model_name_or_path stable-diffusion-v1-5 \\
        --instance_data_dir ./dog --instance_prompt "a photo of sks dog" \\
        --with_prior_preservation --class_data_dir ./dog-class --class_prompt "a photo of dog" \\
        --resolution 512 --train_batch_size 1 --learning_rate 5e-6 --lr_warmup_steps 0 --max_train_steps 400 \\
        --output_dir dreambooth-dog

It is the text-to-image task (`train.diffusion`) on this data (`train.dreambooth_data`): the whole UNet
trains and the run writes an sdx folder, or with `--rank` (`python -m train.dreambooth_lora`) LoRA
adapters train and it writes `pytorch_lora_weights.safetensors`; `--train_text_encoder` adapts the text
encoders too. The class images are sampled by the pipeline the validations use (the model as loaded for
training; 50 steps, at the model's own guidance, `Family.guidance_scale`: diffusers' pipeline defaults, 7.5 or 5.0
for SDXL, unless the model names one).
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import numpy as np
from flax import nnx

from pipelines.request import Request
from sdx.errors import SdxError
from train import config, data, diffusion, loop
from train.dreambooth_data import CLASS_STREAM, DreamBoothData, DreamBoothLoader, open_data, sample_class_images

CLASS_SAMPLING_STEPS = 50  # diffusers' pipelines' default num_inference_steps


class DreamBoothTask(diffusion.DiffusionTask):
    def make_loader(self, source: DreamBoothData, *, batch_size: int) -> DreamBoothLoader:
        """The class images sampled when missing, then one loader per part (`train.dreambooth_data`)."""
        cfg = self.cfg
        classes = None
        if source.class_dir is not None:
            sample_class_images(source, self._sample, cfg, self.log)
            classes = source.classes()
        tokenize = self.transform.tokenize  # the loader's (`diffusion.tokenizer_fn`)
        ids = {"instance": tokenize(cfg.instance_prompt), "class": tokenize(cfg.class_prompt or "")}

        def loader(images, seed: int) -> data.Loader:
            return data.make_loader(images, dataclasses.replace(self.transform, seed=seed), batch_size=batch_size,
                                    seed=seed, num_epochs=None, workers=cfg.dataloader_num_workers)

        return DreamBoothLoader(loader(source.instance, cfg.seed),
                                None if classes is None else loader(classes, cfg.seed + CLASS_STREAM), ids)

    def _sample(self, count: int, seed: int) -> np.ndarray:
        """`count` images of --class_prompt by the model as loaded (uint8 (count, res, res, 3))."""
        cfg = self.cfg
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(self.module))):
            raise SdxError(f"--class_data_dir {cfg.class_data_dir} lacks class images, and a resumed run has not "
                           "loaded the model that samples them; put them back, or start the run again")
        pipe = self.pipeline(self.module, f"{cfg.pretrained_model_name_or_path} (class images)")
        request = Request(prompts=[cfg.class_prompt], height=cfg.resolution, width=cfg.resolution,
                          steps=CLASS_SAMPLING_STEPS, num_images_per_prompt=count, batch_size=cfg.sample_batch_size,
                          seed=seed)  # guidance: the model's own (`Pipeline.complete`)
        return (pipe(request) * 255).round().astype(np.uint8)


def train(argv=None, lora: bool = False) -> int:
    return loop.run(config.parse("dreambooth", argv, lora=lora), DreamBoothTask, open_data)


if __name__ == "__main__":
    loop.main(train, sys.argv[1:])
