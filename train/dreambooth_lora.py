"""`python -m train.dreambooth_lora`: DreamBooth with LoRA adapters (diffusers' train_dreambooth_lora.py
flags; `--rank` default 4, learning rate 5e-4). It is `python -m train.dreambooth` with `--rank` given;
the run writes `pytorch_lora_weights.safetensors`, which `python -m sdx.sample --lora` and diffusers'
`load_lora_weights` read; `--train_text_encoder` adapts the text encoders too.

    python -m train.dreambooth_lora --pretrained_model_name_or_path stable-diffusion-v1-5 \\
        --instance_data_dir ./dog --instance_prompt "a photo of sks dog" --resolution 512 \\
        --train_batch_size 1 --max_train_steps 500 --output_dir lora-dreambooth-dog
"""

from __future__ import annotations

import sys

from train import dreambooth, loop


def train(argv=None) -> int:
    return dreambooth.train(argv, lora=True)


if __name__ == "__main__":
    loop.main(train, sys.argv[1:])
