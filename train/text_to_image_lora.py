"""`python -m train.text_to_image_lora`: LoRA fine-tuning of a text-to-image model (SD 1.x/2.x or SDXL),
with diffusers' train_text_to_image_lora(_sdxl).py flags (`--rank`, default 4). It is
`python -m train.text_to_image` with `--rank` given; the run writes `pytorch_lora_weights.safetensors`,
which `python -m sdx.sample --model BASE --lora FILE` and diffusers' `load_lora_weights` read.
`--train_text_encoder` puts adapters on the text encoders too (train_text_to_image_lora_sdxl.py's flag).

    python -m train.text_to_image_lora --pretrained_model_name_or_path stable-diffusion-v1-5 \\
        --dataset_name ./pokemon --caption_column text --resolution 512 --random_flip \\
        --train_batch_size 1 --num_train_epochs 100 --checkpointing_steps 5000 --learning_rate 1e-04 \\
        --lr_scheduler constant --lr_warmup_steps 0 --mixed_precision bf16 --rank 4 --output_dir sd-pokemon-lora
"""

from __future__ import annotations

import sys

from train import config, diffusion, loop


def train(argv=None) -> int:
    return loop.run(config.parse("text_to_image", argv, lora=True), diffusion.DiffusionTask, diffusion.open_data)


if __name__ == "__main__":
    loop.main(train, sys.argv[1:])
