"""`python -m train.text_to_image`: text-to-image fine-tuning (SD 1.x/2.x or SDXL), with diffusers'
train_text_to_image(_sdxl).py flags.

    python -m train.text_to_image --pretrained_model_name_or_path stable-diffusion-v1-5 \\
        --train_data_dir ./pokemon --caption_column text --resolution 512 --center_crop --random_flip \\
        --train_batch_size 1 --gradient_accumulation_steps 4 --gradient_checkpointing \\
        --max_train_steps 15000 --learning_rate 1e-05 --snr_gamma 5.0 --mixed_precision bf16 \\
        --use_ema --output_dir sd-pokemon
"""

from __future__ import annotations

import sys

from train import config, diffusion, loop


def train(argv=None) -> int:
    return loop.run(config.parse("text_to_image", argv), diffusion.DiffusionTask, diffusion.open_data)


if __name__ == "__main__":
    loop.main(train, sys.argv[1:])
