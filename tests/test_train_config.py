"""The training command lines: diffusers' flags with underscores or dashes, their defaults, and one
`error:` line with exit status 2 for anything sdx does not do or a bad value."""

from __future__ import annotations

import jax
import pytest

from sdx import attention
from train import config, models

# diffusers' documented InstructPix2Pix command line (examples/instruct_pix2pix/README.md), as is but for
# the final --push_to_hub (an upload, which sdx leaves to the user: an error, tested below).
DIFFUSERS_PIX2PIX = """
--pretrained_model_name_or_path=runwayml/stable-diffusion-v1-5 --dataset_name=fusing/instructpix2pix-1000-samples
--enable_xformers_memory_efficient_attention --resolution=256 --random_flip --train_batch_size=4
--gradient_accumulation_steps=4 --gradient_checkpointing --max_train_steps=15000 --checkpointing_steps=5000
--checkpoints_total_limit=1 --learning_rate=5e-05 --max_grad_norm=1 --lr_warmup_steps=0
--conditioning_dropout_prob=0.05 --mixed_precision=fp16 --seed=42
""".split()


def test_diffusers_command_line_parses_with_its_meaning(capsys):
    c = config.parse("pix2pix", DIFFUSERS_PIX2PIX)
    assert c.pretrained_model_name_or_path == "runwayml/stable-diffusion-v1-5"
    assert (c.resolution, c.train_batch_size, c.gradient_accumulation_steps) == (256, 4, 4)
    assert c.random_flip and c.gradient_checkpointing and not c.center_crop
    assert (c.max_train_steps, c.checkpointing_steps, c.checkpoints_total_limit) == (15000, 5000, 1)
    assert (c.learning_rate, c.max_grad_norm, c.lr_warmup_steps) == (5e-05, 1.0, 0)
    assert (c.conditioning_dropout_prob, c.mixed_precision, c.seed) == (0.05, "bf16", 42)
    assert c.report_to == "tensorboard" and c.attention is None  # the sampler's, per dtype (`models.computes`)
    # the two substitutions are said, one line each
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == 2 and all(n.startswith("note: ") for n in notes), notes
    assert "enable_xformers_memory_efficient_attention is ignored" in notes[0]
    assert "fp16 runs as bf16" in notes[1]


def test_xformers_flag_changes_nothing_and_dashes_work(capsys):
    base = ["--pretrained_model_name_or_path", "m", "--dataset_name", "d"]
    plain = config.parse("pix2pix", base)
    assert config.parse("pix2pix", base + ["--enable-xformers-memory-efficient-attention"]) == plain
    assert config.parse("pix2pix", base + ["--mixed_precision", "bf16"]) == config.parse(
        "pix2pix", base + ["--mixed-precision", "fp16"])


def test_dashes_and_underscores_are_the_same_flag():
    base = ["--pretrained_model_name_or_path", "m", "--dataset_name", "d"]
    a = config.parse("text_to_image", base + ["--train_batch_size", "3", "--snr_gamma=5", "--use_ema"])
    b = config.parse("text_to_image", base + ["--train-batch-size", "3", "--snr-gamma=5", "--use-ema"])
    assert a == b and a.train_batch_size == 3 and a.snr_gamma == 5.0 and a.use_ema


def test_task_defaults_follow_diffusers_scripts():
    base = ["--pretrained_model_name_or_path", "m", "--dataset_name", "d"]
    p = config.parse("pix2pix", base)
    t = config.parse("text_to_image", base)
    assert (p.resolution, p.output_dir) == (256, "instruct-pix2pix-model")
    assert (t.resolution, t.output_dir) == (512, "sd-model-finetuned")
    assert (p.train_batch_size, p.learning_rate, p.lr_warmup_steps, p.adam_weight_decay) == (16, 1e-4, 500, 1e-2)
    assert (p.original_image_column, p.edit_prompt_column, p.edited_image_column) == (
        "input_image", "edit_prompt", "edited_image")
    assert (t.image_column, t.caption_column) == ("image", "text")


def _error(capsys, task, argv) -> str:
    with pytest.raises(SystemExit) as e:
        config.parse(task, argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("flag", ["--vae_precision=fp16", "--use_8bit_adam", "--push_to_hub",
                                  "--allow-tf32", "--non_ema_revision=main", "--hub_token=x"])
def test_unimplemented_diffusers_flag_is_named(capsys, flag):
    msg = _error(capsys, "pix2pix", ["--pretrained_model_name_or_path", "m", "--dataset_name", "d", flag])
    assert flag.lstrip("-").split("=")[0].replace("-", "_") in msg and "not supported" in msg


# (task, extra flags, words the error must hold): every flag `config.check` or argparse refuses, at a bad value
BAD_VALUES = [
    *[("pix2pix", [f"--{name}", "0"], f"--{name} must be at least 1, got 0") for name in (
        "resolution", "train_batch_size", "num_train_epochs", "gradient_accumulation_steps", "checkpointing_steps",
        "fsdp", "lr_num_cycles", "num_validation_images", "validation_inference_steps", "max_train_steps",
        "max_train_samples", "checkpoints_total_limit", "validation_steps", "validation_epochs")],
    *[("pix2pix", [f"--{name}", "-1"], f"--{name} must not be negative, got -1") for name in (
        "lr_warmup_steps", "dataloader_num_workers", "ema_update_after_step", "noise_offset", "input_perturbation",
        "max_grad_norm", "adam_weight_decay")],
    ("vae", ["--kl_weight", "-1"], "--kl_weight must not be negative"),
    ("vae", ["--edge_weight", "-1"], "--edge_weight must not be negative"),
    ("vae", ["--latent_noise", "-0.1"], "--latent_noise must not be negative"),
    ("vae", ["--unet_latents", "0.2"], "give --pretrained_model_name_or_path and --decoder_only"),
    ("vae", ["--unet_latents", "0.2", "--decoder_only", "--vae_config", "tiny"], "(not --vae_config)"),
    ("vae", ["--unet_latents", "0.2", "0", "--decoder_only"], "--unet_latents 0.0: an img2img strength is in (0, 1]"),
    ("vae", ["--unet_latents", "1.5", "--decoder_only"], "--unet_latents 1.5: an img2img strength is in (0, 1]"),
    ("vae", ["--unet_latents", "0.2", "--decoder_only", "--caption_column", ""], "give --caption_column"),
    ("vae", ["--unet_latents", "weak"], "invalid float value: 'weak'"),
    ("pix2pix", ["--learning_rate", "0"], "--learning_rate must be positive"),
    ("pix2pix", ["--learning_rate", "-1"], "--learning_rate must be positive"),
    ("pix2pix", ["--adam_epsilon", "0"], "--adam_epsilon must be positive"),
    ("pix2pix", ["--adam_beta1", "1"], "--adam_beta1 must be in [0, 1)"),
    ("pix2pix", ["--adam_beta2", "-0.1"], "--adam_beta2 must be in [0, 1)"),
    ("pix2pix", ["--ema_decay", "1.5"], "--ema_decay must be in [0, 1]"),
    ("pix2pix", ["--ema_min_decay", "-0.5"], "--ema_min_decay must be in [0, 1]"),
    ("pix2pix", ["--ema_min_decay", "0.99", "--ema_decay", "0.9"], "--ema_min_decay 0.99 is above --ema_decay 0.9"),
    ("pix2pix", ["--ema_inv_gamma", "0"], "--ema_inv_gamma and --ema_power must be positive"),
    ("pix2pix", ["--ema_power", "-1"], "--ema_inv_gamma and --ema_power must be positive"),
    ("pix2pix", ["--snr_gamma", "0"], "--snr_gamma must be positive"),
    ("pix2pix", ["--conditioning_dropout_prob", "0.5"], "--conditioning_dropout_prob must be in [0, 1/3]"),
    ("pix2pix", ["--conditioning_dropout_prob", "-0.1"], "--conditioning_dropout_prob must be in [0, 1/3]"),
    ("text_to_image", ["--proportion_empty_prompts", "1.5"], "--proportion_empty_prompts must be in [0, 1]"),
    ("pix2pix", ["--validation_prompt", "make it red"], "needs --val_image_url_or_path"),
    ("pix2pix", ["--train_data_dir", "x"], "exactly one of --dataset_name"),
    # argparse: choices and types
    ("pix2pix", ["--mixed_precision", "fp32"], "invalid choice: 'fp32'"),
    ("pix2pix", ["--lr_scheduler", "exotic"], "invalid choice: 'exotic'"),
    ("pix2pix", ["--attention", "flash"], "invalid choice: 'flash'"),
    ("pix2pix", ["--prediction_type", "x0"], "invalid choice: 'x0'"),
    ("pix2pix", ["--report_to", "wandb"], "invalid choice: 'wandb'"),
    ("pix2pix", ["--export_format", "onnx"], "invalid choice: 'onnx'"),
    ("vae", ["--reconstruction_loss", "l3"], "invalid choice: 'l3'"),
    ("pix2pix", ["--resolution", "big"], "invalid int value: 'big'"),
    ("pix2pix", ["--learning_rate", "fast"], "invalid float value: 'fast'"),
    ("pix2pix", ["--bogus_flag", "1"], "unrecognized arguments: --bogus_flag"),
    ("text_to_image", ["--conditioning_dropout_prob", "0.1"], "unrecognized arguments: --conditioning_dropout_prob"),
    ("vae", ["--snr_gamma", "5"], "unrecognized arguments: --snr_gamma"),
    ("vae", ["--max_train_stpes", "5"], "unrecognized arguments: --max_train_stpes 5 (did you mean --max_train_steps?)"),
    ("text_to_image", ["--rank", "0"], "--rank must be at least 1, got 0"),
    ("text_to_image", ["--lora_alpha", "8"], "--rank must be at least 1, got None"),
    ("text_to_image", ["--rank", "4", "--lora_alpha", "0"], "--lora_alpha must be positive"),
    ("text_to_image", ["--rank", "4", "--export_format", "diffusers"], "pytorch_lora_weights.safetensors"),
    ("text_to_image", ["--train_text_encoder"],
     "--train_text_encoder trains LoRA adapters on the text encoders: give --rank"),
    ("pix2pix", ["--train_text_encoder"], "unrecognized arguments: --train_text_encoder"),
    ("text_to_image", ["--rank", "4", "--text_encoder_lr", "1e-5"], "with --train_text_encoder"),
    ("text_to_image", ["--rank", "4", "--train_text_encoder", "--text_encoder_lr", "0"], "give a positive one"),
    ("pix2pix", ["--rank", "4"], "unrecognized arguments: --rank"),
    ("text_to_image", ["--timestep_bias_strategy", "later", "--timestep_bias_multiplier", "0"],
     "--timestep_bias_multiplier must be positive"),
    ("text_to_image", ["--timestep_bias_strategy", "earlier", "--timestep_bias_portion", "1.5"],
     "--timestep_bias_portion must be in [0, 1]"),
    ("text_to_image", ["--timestep_bias_strategy", "range", "--timestep_bias_begin", "500", "--timestep_bias_end",
                       "200"], "give 0 <= begin < end"),
    ("text_to_image", ["--timestep_bias_strategy", "middle"], "invalid choice: 'middle'"),
    ("text_to_image", ["--dream_training", "--dream_detail_preservation", "0"],
     "--dream_detail_preservation must be positive"),
    ("pix2pix", ["--dream_training"], "unrecognized arguments: --dream_training"),
    ("text_to_image", ["--pixel_loss_weight", "-1"], "--pixel_loss_weight must not be negative"),
    ("pix2pix", ["--pixel_loss_weight", "1", "--pixel_loss_max_timestep", "0"],
     "--pixel_loss_max_timestep must be at least 1, got 0"),
    ("text_to_image", ["--edge_weight", "-2"], "--edge_weight must not be negative"),
    ("dreambooth", ["--instance_data_dir", "i", "--instance_prompt", "sks", "--pixel_loss_weight", "1"],
     "unrecognized arguments: --pixel_loss_weight"),
    ("controlnet", ["--pixel_loss_weight", "1"], "unrecognized arguments: --pixel_loss_weight"),
    ("dreambooth", ["--instance_data_dir", "i"], "DreamBooth needs one of --instance_data_dir and --dataset_name"),
    ("dreambooth", ["--instance_data_dir", "i", "--instance_prompt", "sks", "--with_prior_preservation"],
     "--with_prior_preservation needs --class_data_dir"),
    ("dreambooth", ["--instance_data_dir", "i", "--instance_prompt", "sks", "--num_class_images", "0"],
     "--num_class_images must be at least 1"),
    ("dreambooth", ["--instance_data_dir", "i", "--instance_prompt", "sks", "--prior_loss_weight", "-1"],
     "--prior_loss_weight must not be negative"),
    ("dreambooth", ["--instance_data_dir", "i", "--instance_prompt", "sks", "--train_text_encoder"],
     "give --rank (or run python -m train.dreambooth_lora)"),
    ("dreambooth", ["--instance_data_dir", "i", "--instance_prompt", "sks", "--offset_noise"], "--noise_offset 0.1"),
    ("dreambooth", ["--instance_data_dir", "i", "--instance_prompt", "sks", "--caption_column", "t"],
     "--caption_column reads a --dataset_name's prompts"),
    ("dreambooth", ["--instance_data_dir", "i", "--instance_prompt", "sks", "--dataset_name", "d"],
     "DreamBooth needs one of --instance_data_dir and --dataset_name"),
    ("dreambooth", ["--dataset_name", "d", "--instance_prompt", "sks", "--repeats", "0"],
     "--repeats must be at least 1"),
]


@pytest.mark.parametrize("task, extra, words", BAD_VALUES)
def test_bad_values_one_error_line(capsys, task, extra, words):
    data = [] if task == "dreambooth" else ["--dataset_name", "d"]  # DreamBooth's data: --instance_data_dir
    msg = _error(capsys, task, ["--pretrained_model_name_or_path", "m", *data, *extra])
    assert words in msg, msg


def test_dreambooth_takes_diffusers_defaults():
    """train_dreambooth.py's defaults, and train_dreambooth_lora.py's for `python -m train.dreambooth_lora`."""
    base = ["--pretrained_model_name_or_path", "m", "--instance_data_dir", "i", "--instance_prompt", "sks"]
    c = config.parse("dreambooth", base)
    assert (c.learning_rate, c.train_batch_size, c.num_train_epochs, c.output_dir, c.resolution, c.rank) == (
        5e-6, 4, 1, "text-inversion-model", 512, None)
    assert (c.with_prior_preservation, c.prior_loss_weight, c.num_class_images, c.sample_batch_size) == (
        False, 1.0, 100, 4)
    c = config.parse("dreambooth", base, lora=True)
    assert (c.learning_rate, c.rank, c.output_dir) == (5e-4, 4, "lora-dreambooth-model")


def test_lora_script_is_text_to_image_with_a_rank():
    """`python -m train.text_to_image_lora` takes diffusers' train_text_to_image_lora.py defaults (rank 4, its
    output folder); `python -m train.text_to_image --rank N` is the same run."""
    base = ["--pretrained_model_name_or_path", "m", "--dataset_name", "d"]
    c = config.parse("text_to_image", base, lora=True)
    assert (c.task, c.rank, c.lora_alpha, c.output_dir, c.resolution) == (
        "text_to_image", 4, None, "sd-model-finetuned-lora", 512)
    assert config.parse("text_to_image", base + ["--rank", "4", "--output_dir", "sd-model-finetuned-lora"]) == c
    assert config.parse("text_to_image", base).rank is None  # the whole UNet
    assert not c.train_text_encoder and config.parse("text_to_image", base + ["--train-text-encoder"],
                                                     lora=True).train_text_encoder
    run = models.computes(config.parse("text_to_image", base + ["--mixed_precision", "bf16"], lora=True))
    assert run["unet"].param_dtype == run["unet"].dtype == jax.numpy.bfloat16  # frozen weights in the compute dtype
    assert models.computes(config.parse("text_to_image", base + ["--mixed_precision", "bf16"]))["unet"].param_dtype == \
        jax.numpy.float32  # master weights


def test_model_is_required(capsys):
    assert "pretrained_model_name_or_path" in _error(capsys, "text_to_image", ["--dataset_name", "d"])


def test_without_attention_each_model_takes_the_sampler_s_backend_for_its_dtype():
    base = ["--pretrained_model_name_or_path", "m", "--dataset_name", "d"]
    for flags in ([], ["--mixed_precision", "bf16"]):
        run = models.computes(config.parse("pix2pix", base + flags))
        assert {name: c.attention for name, c in run.items()} == {
            name: attention.default_backend(c.dtype) for name, c in run.items()}
    run = models.computes(config.parse("pix2pix", base + ["--attention", "xla"]))
    assert {c.attention for c in run.values()} == {"xla"}
    if jax.default_backend() == "cpu":
        assert models.computes(config.parse("pix2pix", base))["unet"].attention == "chunked"
