"""`python -m convert SRC OUT`: read any supported source (a pipeline or a ControlNet), write the asked format.

The argument parsing only; the work is `convert.library.convert`. Errors a user can fix are printed
as one line `error: ...`, exit status 2.
"""

from __future__ import annotations

import argparse

from convert.library import WRITERS, convert
from convert.sources import ModelOptions
from sdx import weights
from sdx.errors import ArgumentParser, run_command


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m convert` (also the documentation's flag table, docs/hooks.py)."""
    p = ArgumentParser(
        prog="python -m convert", hint=" (see python -m convert --help)",
        description="Convert a model (diffusers folder, hub id, single-file checkpoint or sdx folder), a pipeline or "
                    "a ControlNet, into an sdx model folder, a diffusers folder or a single file.",
    )
    p.add_argument("src", metavar="SRC",
                   help="diffusers-layout folder, hub id (org/name), single-file checkpoint (.safetensors, .ckpt) "
                        "or sdx folder")
    p.add_argument("out", metavar="OUT",
                   help="output folder, or .safetensors file for --format single-file (must not exist, or be an "
                        "empty folder, unless --overwrite)")
    p.add_argument("--format", dest="fmt", default="sdx", choices=list(WRITERS),
                   help="output layout: sdx folder, diffusers folder (from_pretrained) or one original-layout "
                        ".safetensors file (from_single_file) (default: sdx)")
    p.add_argument("--dtype", default="float32", choices=list(weights.DTYPES),
                   help="dtype of the written weights (default: float32)")
    p.add_argument("--variant", default=None,
                   help="weights variant to read, e.g. fp16 (default: fp16 for a 16-bit --dtype when it exists)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) for a hub id")
    p.add_argument("--config", metavar="FOLDER", default=None,
                   help="single-file SRC: a diffusers-layout folder whose config.json files (and tokenizers) "
                        "describe it, instead of the built-in preset; for a ControlNet file, its diffusers "
                        "ControlNet folder")
    p.add_argument("--preset", default=None,
                   help="single-file SRC: the built-in preset to read it as, e.g. sd21 for an SD 2.x-base "
                        "(epsilon) file (default: detected from its keys)")
    p.add_argument("--lora", metavar="FILE[:SCALE]", action="append", default=[],
                   help="merge a LoRA (kohya or diffusers/PEFT .safetensors, or a hub org/name[/FILE]) at SCALE "
                        "(default 1.0); repeatable")
    p.add_argument("--embedding", metavar="FILE[:TOKEN]", action="append", default=[],
                   help="add a textual inversion embedding (diffusers learned_embeds, A1111 or SDXL .safetensors, or a hub org/name/FILE) as the word TOKEN (default: its own token, else the file's name); repeatable")
    p.add_argument("--vae", metavar="MODEL", default=None,
                   help="use this VAE instead of the model's: a diffusers VAE folder, a pipeline folder, an sdx "
                        "folder, a single VAE file, or a hub id (org/name or org/name/FILE)")
    p.add_argument("--unet", metavar="MODEL", default=None,
                   help="use this UNet instead of the model's (LoRAs merge into it): a diffusers UNet folder (e.g. "
                        "latent-consistency/lcm-sdxl), a pipeline folder, an sdx folder, a weights file in diffusers or "
                        "original keys (e.g. ByteDance/SDXL-Lightning/sdxl_lightning_4step_unet.safetensors), or a hub id")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("-q", "--quiet", action="store_true", help="print errors only")
    return p



def main(argv: list[str] | None = None) -> int:
    def body():
        args = parser().parse_args(argv)
        log = (lambda _msg: None) if args.quiet else (lambda msg: print(msg, flush=True))
        options = ModelOptions.from_args(config=args.config, preset=args.preset, lora=args.lora, vae=args.vae,
                                         embedding=args.embedding, unet=args.unet)
        convert(args.src, args.out, fmt=args.fmt, dtype=args.dtype, variant=args.variant, revision=args.revision,
                overwrite=args.overwrite, options=options, log=log)

    return run_command(body)
