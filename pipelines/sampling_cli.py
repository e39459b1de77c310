"""`python -m sdx.sample`'s sampler and prompt-syntax flags: `--scheduler` (sdx's names, ladder suffixes, and
the A1111 and ComfyUI names people type, `sdx.schedulers.names`), the two settings the few-step recipes change
on the model's own schedule, `--timestep-spacing` (SDXL-Lightning and Hyper-SD sample with "trailing") and
`--eta` (DDIM's eta, TCD's gamma), and `--prompt-syntax` (how prompts weigh words, `pipelines.text`).
`add_flags` and `add_prompt_flags` put them on the parser; `check` refuses what the named sampler lacks before
anything loads; `configured` applies them to a loaded pipeline's scheduler."""

from __future__ import annotations

import argparse
import dataclasses

from sdx.errors import SdxError


def _scheduler_name(text: str) -> str:
    from sdx.schedulers import names

    try:
        return names.canonical(text)
    except SdxError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_flags(p: argparse.ArgumentParser) -> None:
    from sdx.schedulers import names

    p.add_argument("--scheduler", type=_scheduler_name, metavar="NAME", help=names.help_text())
    p.add_argument("--timestep-spacing", choices=("leading", "trailing", "linspace"),
                   help="which training timesteps the steps visit (diffusers' timestep_spacing; default: the "
                        "scheduler's). SDXL-Lightning and Hyper-SD LoRAs sample with trailing")
    p.add_argument("--eta", type=float, metavar="ETA",
                   help="DDIM's eta (default 0) or TCD's gamma (default 0.3): the share of fresh noise per step")


def add_prompt_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-syntax", choices=("a1111", "compel", "none"), default="a1111",
                   help="how prompts weigh words: a1111 (the web UI's (word:1.3), (word), [word], \\( for a bracket, "
                        "BREAK; the default), compel ((words)1.3, word++, word-, (\"a\", \"b\").and()) or none "
                        "(brackets are text, as in diffusers)")


def _changes(args: argparse.Namespace, cls) -> dict:
    """The scheduler fields --timestep-spacing and --eta set on a sampler of class `cls`, or an error."""
    changes = {}
    if args.timestep_spacing is not None:
        if not cls.spaced:
            raise SdxError(f"--timestep-spacing: {cls.__name__}'s timesteps do not follow a spacing")
        changes["timestep_spacing"] = args.timestep_spacing
    if args.eta is not None:
        if "eta" not in {f.name for f in dataclasses.fields(cls)}:
            raise SdxError(f"--eta: {cls.__name__} has no eta (DDIM's eta and TCD's gamma have one)")
        if not args.eta >= 0:
            raise SdxError(f"--eta {args.eta} must be a number >= 0")
        changes["eta"] = args.eta
    return changes


def check(args: argparse.Namespace) -> None:
    """Refuse, before anything is loaded, a setting the --scheduler named does not have, and a prompt the
    --prompt-syntax cannot read."""
    from pipelines import text
    from sdx.schedulers import SCHEDULERS, names

    if args.scheduler is not None:
        _changes(args, SCHEDULERS[names.resolve(args.scheduler)[0]][0])
    prompts = [t for flag in ("prompt", "prompt_2", "negative_prompt", "negative_prompt_2")
               for t in getattr(args, flag, None) or ()]
    text.check_syntax(args.prompt_syntax, prompts)


def configured(args: argparse.Namespace, pipe):
    """`pipe` with --timestep-spacing and --eta set on its scheduler (the model's own, or --scheduler's)."""
    changes = _changes(args, type(pipe.scheduler))
    return dataclasses.replace(pipe, scheduler=dataclasses.replace(pipe.scheduler, **changes)) if changes else pipe
