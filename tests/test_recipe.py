"""`train/recipe.sh`, the default models' recipe, run dry: its python is a stand-in that records each command, which
is then parsed by the parser of the module it names (a renamed or mistyped flag fails here, not hours into a run),
and a work folder with finished and interrupted stages shows which stages it skips and which it resumes."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from convert import cli, default_models
from train import config as configlib
from train import init, shapes, shapes_eval

REPO = Path(__file__).resolve().parents[1]
TRAINERS = {"train.vae": "vae", "train.text_to_image": "text_to_image", "train.pix2pix": "pix2pix"}
PARSERS = {"train.shapes": shapes.parser, "train.init": init.parser, "train.shapes_eval": shapes_eval.parser,
           "convert.default_models": default_models.parser, "convert": cli.parser}
SEP = "\x1f"  # between the arguments of one recorded command


def dry_run(tmp_path: Path, work: Path, **env) -> list[list[str]]:
    """The commands the recipe runs in `work` (each: python's arguments after `python`), in order."""
    log = tmp_path / "commands.log"
    log.unlink(missing_ok=True)
    shim = tmp_path / "python"
    shim.write_text(f'#!/usr/bin/env bash\n(IFS=$\'{SEP}\'; printf \'%s\\n\' "$*") >> "{log}"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    done = subprocess.run(["bash", str(REPO / "train" / "recipe.sh"), str(work)], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": str(shim), **env}, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    return [line.split(SEP) for line in log.read_text().splitlines()] if log.exists() else []


def parse(command: list[str]):
    """The parsed arguments of one recorded `-m MODULE ARGS...` command, by MODULE's own parser."""
    assert command[0] == "-m", command
    module, argv = command[1], command[2:]
    if module in TRAINERS:
        return configlib.parse(TRAINERS[module], argv)
    return PARSERS[module]().parse_args(argv)


def test_every_command_of_the_recipe_parses_in_order(tmp_path):
    work = tmp_path / "work"
    commands = dry_run(tmp_path, work)
    assert [c[1] for c in commands] == [
        "train.shapes", "train.shapes", "train.vae", "train.vae", "train.init", "train.text_to_image",
        "train.text_to_image", "train.pix2pix", "train.pix2pix", "train.vae", "convert", "train.pix2pix",
        "convert.default_models", "train.shapes_eval"]
    parsed = [parse(c) for c in commands]
    vae_1, vae, first, second, edit, edit_2, decoder, swap, edit_4, pack = parsed[2], parsed[3], *parsed[5:13]
    # the VAE's second part resumes from the first part's last checkpoint and steps its rate down after it
    assert vae.resume_from_checkpoint == f"{work}/vae-1/checkpoints/{vae_1.max_train_steps}"
    assert vae.max_train_steps == vae_1.max_train_steps + 1500 and vae.lr_step_rules.startswith("1:5000,0.3:5500,")
    assert parsed[4].vae == f"{work}/vae"
    # each second pass starts from its first pass, at a lower rate with another seed; the edit model is
    # fine-tuned from the first text-to-image pass; pack takes both second passes
    assert (first.pretrained_model_name_or_path, first.output_dir) == (f"{work}/init", f"{work}/t2i")
    assert (second.pretrained_model_name_or_path, second.output_dir) == (f"{work}/t2i", f"{work}/t2i-2")
    assert second.learning_rate == first.learning_rate / 2 and second.seed != first.seed
    assert (edit.pretrained_model_name_or_path, edit.output_dir) == (f"{work}/t2i", f"{work}/edit")
    assert (edit_2.pretrained_model_name_or_path, edit_2.output_dir) == (f"{work}/edit", f"{work}/edit-2")
    assert edit_2.learning_rate < edit.learning_rate and edit_2.seed != edit.seed
    assert edit.snr_gamma is None and edit_2.snr_gamma is None
    # the decoder alone is fine-tuned on the second text-to-image pass, and the edit model takes that VAE
    assert (decoder.pretrained_model_name_or_path, decoder.output_dir) == (f"{work}/t2i-2", f"{work}/t2i-3")
    assert decoder.decoder_only and decoder.edge_weight > 0 and decoder.latent_noise > 0
    assert (swap.src, swap.out, swap.vae) == (f"{work}/edit-2", f"{work}/edit-3", f"{work}/t2i-3")
    # the edit model's last pass starts from the one with that VAE, whose decoder its pixel loss draws through; pack
    # takes it and the decoder's text-to-image model
    assert (edit_4.pretrained_model_name_or_path, edit_4.output_dir) == (f"{work}/edit-3", f"{work}/edit-4")
    assert (edit_4.pixel_loss_weight, edit_4.edge_weight, edit_4.pixel_loss_max_timestep) == (0.2, 30.0, 400)
    assert edit_4.learning_rate < edit_2.learning_rate and edit_4.seed not in (edit.seed, edit_2.seed)
    assert edit_4.snr_gamma is None and edit_4.lr_warmup_steps == 50 and edit_2.lr_warmup_steps == 100
    assert edit.pixel_loss_weight == edit_2.pixel_loss_weight == 0
    assert (pack.command, pack.t2i, pack.edit) == ("pack", f"{work}/t2i-3", f"{work}/edit-4")
    assert (pack.guidance_scale, pack.edit_guidance_scale) == (2.0, 2.0)
    assert all(p.resume_from_checkpoint is None for p in (vae_1, first, second, edit, edit_2, decoder, edit_4))


AFTER_T2I = ["train.pix2pix", "train.pix2pix", "train.vae", "convert", "train.pix2pix", "convert.default_models",
             "train.shapes_eval"]
# where a run stopped: (what the work folder holds, finished stages' files and the interrupted stage's checkpoints;
# the commands a rerun gives; the interrupted stage's output folder and its steps with VAE_STEPS=300 and
# T2I_MORE_STEPS=300)
INTERRUPTIONS = {
    "the VAE's second part": (["captions/", "edits/", "vae-1/config.json", "vae/checkpoints/"],
                              ["train.vae", "train.init", "train.text_to_image", "train.text_to_image", *AFTER_T2I],
                              "vae", 300 + 1500),
    "the second text-to-image pass": (["captions/", "edits/", "vae-1/config.json", "vae/config.json", "init/sdx.json",
                                       "t2i/sdx.json", "t2i-2/checkpoints/"], ["train.text_to_image", *AFTER_T2I],
                                      "t2i-2", 300),
    "the VAE decoder": (["captions/", "edits/", "vae-1/config.json", "vae/config.json", "init/sdx.json", "t2i/sdx.json",
                         "t2i-2/sdx.json", "edit/sdx.json", "edit-2/sdx.json", "t2i-3/checkpoints/"],
                        ["train.vae", "convert", "train.pix2pix", "convert.default_models", "train.shapes_eval"],
                        "t2i-3", 1000),
    "the pixel-loss edit pass": (["captions/", "edits/", "vae-1/config.json", "vae/config.json", "init/sdx.json",
                                  "t2i/sdx.json", "t2i-2/sdx.json", "edit/sdx.json", "edit-2/sdx.json",
                                  "t2i-3/sdx.json", "edit-3/sdx.json", "edit-4/checkpoints/"],
                                 ["train.pix2pix", "convert.default_models", "train.shapes_eval"], "edit-4", 1500),
}


@pytest.mark.parametrize("where", sorted(INTERRUPTIONS))
def test_a_rerun_skips_finished_stages_and_resumes_the_interrupted_one(tmp_path, where):
    held, expected, folder, steps = INTERRUPTIONS[where]
    work = tmp_path / "work"
    for name in held:
        path = work / name
        if name.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}")
    commands = dry_run(tmp_path, work, VAE_STEPS="300", T2I_MORE_STEPS="300")
    assert [c[1] for c in commands] == expected
    first, *later = [parse(c) for c in commands[:-2]]  # all but pack and the evaluation; the first resumes
    assert (first.output_dir, first.resume_from_checkpoint) == (f"{work}/{folder}", "latest")
    assert first.max_train_steps == steps
    assert all(getattr(p, "resume_from_checkpoint", None) is None for p in later)


@pytest.mark.parametrize("module", sorted({**PARSERS, **TRAINERS}))
def test_a_mistyped_flag_fails_the_parse(module):
    with pytest.raises(SystemExit) as e:
        parse(["-m", module, "--no-such-flag"])
    assert e.value.code == 2
