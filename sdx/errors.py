"""The one exception type for input a user can fix: a bad flag, a missing file, a misshapen tensor.

The command-line entry points print its message on one line and exit with status 2; anything else
that escapes is a bug in sdx and keeps its traceback.
"""

import argparse
import difflib
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

EXIT_USAGE = 2


class SdxError(Exception):
    """Input-level failure with a message that says what was wrong and what to do."""


class HelpFormatter(argparse.HelpFormatter):
    """`--help` with each flag's default after its sentence, unless the sentence already says it or the default is
    "not given" (None, False, nothing). The documentation's flag tables are this text (docs/hooks.py)."""

    def _get_help_string(self, action):
        text = action.help or ""
        value = action.default
        unset = value is None or value is False or value is argparse.SUPPRESS or value in ([], ())
        if not action.option_strings or "default" in text or unset:
            return text
        return f"{text} (default: {shown(action.default).replace('%', '%%')})"


def shown(value) -> str:
    """A default as a user would type it: 1e-06, 0.6667, 1.0, a list as its values."""
    if isinstance(value, float):
        text = f"{value:.4g}"
        return text if "." in text or "e" in text else f"{text}.0"
    if isinstance(value, (list, tuple)):
        return " ".join(shown(v) for v in value)
    return str(value)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one `error:` line and exit status 2, like every other sdx error, whose
    `--help` shows the defaults (`HelpFormatter`), and which names the flag an unknown one is near ("did you mean
    --steps?"). hint: appended to the message, e.g. " (see python -m convert --help)"."""

    def __init__(self, *args, hint: str = "", **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.hint = hint

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            flags = long_flags(self)
            typed = [word.split("=", 1)[0] for word in unknown if word.startswith("--")]
            guesses = [(word, near[0]) for word in typed if (near := difflib.get_close_matches(word, flags, n=1))]
            said = ", ".join(match if len(guesses) == 1 else f"{match} for {word}" for word, match in guesses)
            self.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" (did you mean {said}?)" if said else ""))
        return parsed

    def error(self, message):
        print(f"error: {message}{self.hint}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def long_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every `--flag` of `parser` and of its subcommands' parsers."""
    flags = []
    for action in parser._actions:
        flags += [flag for flag in action.option_strings if flag.startswith("--")]
        if isinstance(action, argparse._SubParsersAction):
            flags += [flag for sub in action.choices.values() for flag in long_flags(sub)]
    return flags


def run_command(body: Callable[[], int | None]) -> int:
    """A command's exit status: `body()`'s own (None: 0); an SdxError raised in it: its message as one
    `error:` line and EXIT_USAGE; argparse's exits (--help, a usage error it printed): their code."""
    try:
        return body() or 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_USAGE if e.code else 0
    except SdxError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return EXIT_USAGE


def exit_without_teardown(status: int) -> NoReturn:
    """End a finished sampling command with `status`, its output flushed, without the interpreter's teardown:
    that frees every array, compiled program and mapped weight file one object at a time (SDXL in float32:
    0.6 s of a 31 s warm `python -m sdx.sample` on a 2-core CPU, benchmarks/LOG.md), where the kernel
    frees a process's memory at once. Only for a command whose every write is done and closed when it
    returns (the sampler writes each image atomically before it goes on); training, whose checkpoints
    may still be being written, ends the usual way."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
