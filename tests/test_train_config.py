"""The training command lines: diffusers' flags with underscores or dashes, their defaults, and one
`error:` line with exit status 2 for anything sdx does not do or a bad value."""

from __future__ import annotations

import pytest

from train import config

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
    assert c.report_to == "tensorboard" and c.attention == "xla"
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


@pytest.mark.parametrize("flag", ["--timestep_bias_strategy=later", "--use_8bit_adam", "--push_to_hub",
                                  "--allow-tf32", "--non_ema_revision=main", "--dream_training"])
def test_unimplemented_diffusers_flag_is_named(capsys, flag):
    msg = _error(capsys, "pix2pix", ["--pretrained_model_name_or_path", "m", "--dataset_name", "d", flag])
    assert flag.lstrip("-").split("=")[0].replace("-", "_") in msg and "not supported" in msg


@pytest.mark.parametrize("extra, words", [
    (["--train_batch_size", "0"], "train_batch_size"),
    (["--learning_rate", "-1"], "learning_rate"),
    (["--conditioning_dropout_prob", "0.5"], "conditioning_dropout_prob"),
    (["--mixed_precision", "fp32"], "mixed_precision"),
    (["--lr_scheduler", "exotic"], "lr_scheduler"),
    (["--ema_min_decay", "0.99", "--ema_decay", "0.9"], "ema_min_decay"),
    (["--adam_beta2", "1.0"], "adam_beta2"),
    (["--max_train_steps", "0"], "max_train_steps"),
    (["--bogus_flag", "1"], "bogus_flag"),
    (["--train_data_dir", "x"], "exactly one"),
    (["--validation_prompt", "make it red"], "val_image_url_or_path"),
])
def test_bad_values_one_error_line(capsys, extra, words):
    msg = _error(capsys, "pix2pix", ["--pretrained_model_name_or_path", "m", "--dataset_name", "d", *extra])
    assert words in msg


def test_model_is_required(capsys):
    assert "pretrained_model_name_or_path" in _error(capsys, "text_to_image", ["--dataset_name", "d"])
