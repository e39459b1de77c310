"""`python -m train.pix2pix`: InstructPix2Pix fine-tuning (SD 1.x/2.x or SDXL), with diffusers'
train_instruct_pix2pix(_sdxl).py flags.

    python -m train.pix2pix --pretrained_model_name_or_path stable-diffusion-v1-5 \\
        --dataset_name fusing/instructpix2pix-1000-samples --resolution 256 --random_flip \\
        --train_batch_size 4 --gradient_accumulation_steps 4 --gradient_checkpointing \\
        --max_train_steps 15000 --checkpointing_steps 5000 --learning_rate 5e-05 \\
        --conditioning_dropout_prob 0.05 --mixed_precision bf16 --use_ema --output_dir ip2p

A text-to-image model's UNet is widened to 8 input channels first (see train/models.py).
"""

from __future__ import annotations

import sys

from train import config, diffusion, loop


def train(argv=None) -> int:
    return loop.run(config.parse("pix2pix", argv), diffusion.DiffusionTask, diffusion.open_data)


if __name__ == "__main__":
    loop.main(train, sys.argv[1:])
