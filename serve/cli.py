"""`python -m sdx.serve`: AUTOMATIC1111's `/sdapi/v1` API and a page at `/` over one model.

    python -m sdx.serve                                   # the default model on http://127.0.0.1:7860, offline
    python -m sdx.serve --model stabilityai/stable-diffusion-xl-base-1.0 --dtype bfloat16 --listen --port 7861 \\
        --api-auth alice:secret

The model flags are the sampling command's own (`--model`, `--lora`, `--vae`, `--unet`, `--embedding`,
`--controlnet`, `--dtype`, `--attention`, `--fsdp`, ...), taken from its parser. Bad flags end with one `error:`
line and exit status 2 before anything loads; the server prints its address once it listens, and SIGINT or SIGTERM
stop it: queued requests get a 503, the running one is cut at its next step.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from serve.security import parse_auth
from serve.translate import Limits
from sdx.errors import ArgumentParser, SdxError, run_command

# the sampling command's flags the server takes, by destination, in its parser's groups
MODEL_FLAGS = ("model", "config", "preset", "lora", "embedding", "vae", "unet", "controlnet")
DEVICE_FLAGS = ("dtype", "vae_dtype", "attention", "fsdp", "cache", "no_compilation_cache")


def parser() -> argparse.ArgumentParser:
    from pipelines import cli as sampling

    p = ArgumentParser(prog="python -m sdx.serve", description=__doc__.split("\n\n")[0])
    borrowed = {a.dest: a for a in sampling.parser()._actions}
    model = p.add_argument_group("the model (as python -m sdx.sample takes it)")
    for dest in MODEL_FLAGS:
        model._add_action(borrowed[dest])
    borrowed["model"].help = borrowed["model"].help.split("; without it")[0] + "; without it: default"
    device = p.add_argument_group("precision, memory and devices (as python -m sdx.sample takes them)")
    for dest in DEVICE_FLAGS:
        device._add_action(borrowed[dest])
    net = p.add_argument_group("network and access")
    net.add_argument("--port", type=int, default=7860, help="the TCP port (0: any free one, printed at start)")
    net.add_argument("--listen", action="store_true",
                     help="listen on every network interface (default: 127.0.0.1 only, this machine)")
    net.add_argument("--api-auth", metavar="USER:PASS[,USER:PASS]",
                     help="HTTP Basic credentials every request must carry: the API, the page, /docs")
    net.add_argument("--cors-allow-origins", metavar="ORIGIN[,ORIGIN]",
                     help="browser origins (e.g. http://localhost:3000) allowed to call the API from their pages")
    queue = p.add_argument_group("the queue and batching")
    queue.add_argument("--queue-size", type=int, default=64,
                       help="requests that may wait; past it a request gets 503 with Retry-After")
    queue.add_argument("--max-batch", type=int, default=8, help="images run together in one compiled call")
    queue.add_argument("--batch-wait-ms", type=float, default=20.0,
                       help="how long a batch may wait for more requests to join it")
    queue.add_argument("--fixed-batch", action="store_true",
                       help="every call runs at --max-batch images, padded: a request's images are then the same "
                            "bits alone as with others (and as the command's with --batch-size MAX), a lone request "
                            "costing a full call")
    queue.add_argument("--warmup", metavar="HEIGHTxWIDTH", type=sampling._size, nargs="*",
                       help="sizes whose programs to compile at start")
    limits = p.add_argument_group("limits of one request (each refused with a 4xx)")
    defaults = Limits()
    limits.add_argument("--max-pixels", type=int, default=defaults.max_pixels,
                        help="width x height x images of one request")
    limits.add_argument("--max-steps", type=int, default=defaults.max_steps, help="sampling steps of one request")
    limits.add_argument("--max-prompt-length", type=int, default=defaults.max_prompt_length,
                        help="characters of a prompt or negative prompt")
    limits.add_argument("--max-image-pixels", type=int, default=defaults.max_image_pixels,
                        help="pixels of a picture sent in (larger ones are refused before they are decoded)")
    limits.add_argument("--max-body-mb", type=float, default=defaults.max_body_bytes / 2**20,
                        help="megabytes of a request body")
    return p


@dataclasses.dataclass(frozen=True)
class Settings:
    """The server's settings, checked: where it listens, who may call it, its queue and limits."""

    host: str
    port: int
    users: tuple[tuple[str, str], ...]
    cors_origins: tuple[str, ...]
    queue_size: int
    max_batch: int
    batch_wait_ms: float
    fixed_batch: bool
    warmup: tuple[tuple[int, int], ...]
    limits: Limits


def check(args: argparse.Namespace) -> Settings:
    """Refuse bad flags before anything loads."""
    from convert.sources import ModelOptions
    from sdx import io

    if not 0 <= args.port <= 65535:
        raise SdxError(f"--port {args.port}: a TCP port, 0 to 65535")
    for flag in ("queue_size", "max_batch", "max_pixels", "max_steps", "max_prompt_length", "max_image_pixels",
                 "fsdp"):
        if getattr(args, flag) < 1:
            raise SdxError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be a positive integer")
    for flag in ("batch_wait_ms", "max_body_mb"):
        if not getattr(args, flag) > 0:
            raise SdxError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be a positive number")
    for height, width in args.warmup or ():
        if height < 1 or width < 1:
            raise SdxError(f"--warmup {height}x{width}: sizes are positive")
    origins = tuple(o.strip() for o in (args.cors_allow_origins or "").split(",") if o.strip())
    if args.cors_allow_origins is not None and not origins:
        raise SdxError("--cors-allow-origins: give one or more origins, separated by commas")
    if args.config and not Path(args.config).is_dir():
        raise SdxError(f"--config {args.config}: not a folder")
    if args.cache:
        io.check_writable(Path(args.cache), "--cache")
    ModelOptions.from_args(config=args.config, preset=args.preset, lora=args.lora, vae=args.vae,
                           embedding=args.embedding, unet=args.unet)  # a bad LoRA scale fails here
    limits = Limits(max_pixels=args.max_pixels, max_steps=args.max_steps, max_prompt_length=args.max_prompt_length,
                    max_image_pixels=args.max_image_pixels, max_body_bytes=int(args.max_body_mb * 2**20))
    return Settings(host="0.0.0.0" if args.listen else "127.0.0.1", port=args.port,
                    users=parse_auth(args.api_auth) if args.api_auth is not None else (), cors_origins=origins,
                    queue_size=args.queue_size, max_batch=args.max_batch, batch_wait_ms=args.batch_wait_ms,
                    fixed_batch=args.fixed_batch, warmup=tuple(args.warmup or ()), limits=limits)


def main(argv: list[str] | None = None) -> int:
    def body():
        from serve import server

        args = parser().parse_args(argv)
        server.run(args, check(args))

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
