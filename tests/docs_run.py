"""Runs the documentation's code, page by page, in order, in this fresh process: `python -m tests.docs_run PLAN.json`.

tests/test_docs.py writes PLAN.json: a list of pages, each {"page": "docs/page.md", "work": its working folder,
"steps": [{"where": "docs/page.md:12", "kind": "python" | "sh", "code": ...}, ...]} in the page's order. Each page
runs in its own working folder; its Python blocks with `exec` in one module of its own, `docs_page` (a later block
sees an earlier one's names, as in a user's file). A shell block's commands run one by one: `python -m MODULE ARGS`
and `python FILE ARGS` in this process as `python` would run them (`runpy`, as `__main__`, with `sys.argv` set),
so the run pays Python's and JAX's start-up once and its commands share what JAX compiled in memory; a command
with environment variables before it (`XLA_FLAGS=... python -m ...`), shell syntax (pipes, redirections, `||`) or
another program runs in a `bash` of its own. The first command or block that fails (an exception, a non-zero exit
status) ends the run with its place in the page, status 1. Each command's and page's seconds are printed.

`python -m sdx.sample` ends through `sdx.errors.exit_without_teardown` (`os._exit`, no teardown): while a command
runs here, `os._exit` raises `SystemExit` instead, so that the next command runs. (Replacing sdx's own function
instead would count as a change to sdx's code, `pipelines.source_check`, and keep every program of the run out
of sdx's disk cache of compiled programs, which a user's warm command reads.)
"""

from __future__ import annotations

import json
import os
import runpy
import shlex
import subprocess
import sys
import time
import traceback
import types
import warnings

SHELL_SYNTAX = {"|", "||", "&&", ";", ">", ">>", "<", "&", "2>", "2>&1"}


def commands(block: str) -> list[str]:
    """The block's commands: its lines with `\\`-continuations joined, blank and comment lines left out."""
    joined, out = "", []
    for line in block.splitlines():
        joined += line.rstrip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        if joined.strip() and not joined.lstrip().startswith("#"):
            out.append(joined.strip())
        joined = ""
    return out


def split(command: str) -> tuple[dict[str, str], list[str]]:
    """(environment variables set before the command, its words), comments dropped."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def in_process(env: dict, words: list[str], command: str) -> bool:
    return not env and len(words) >= 2 and words[0] == "python" and "$" not in command and \
        not SHELL_SYNTAX & set(shlex.split(command, comments=True, posix=False))


def _raise_exit(status: int):
    raise SystemExit(status)


def run_command(command: str) -> int:
    env, words = split(command)
    if not in_process(env, words, command):
        line = f"{sys.executable} {command.removeprefix('python ')}" if command.startswith("python ") else command
        return subprocess.run(["bash", "-c", line], env={**os.environ, **env}).returncode
    saved, exit_now = sys.argv, os._exit
    os._exit = _raise_exit
    try:
        if words[1] == "-m":
            sys.argv = [words[2], *words[3:]]
            runpy.run_module(words[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = words[1:]
            runpy.run_path(words[1], run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    finally:
        sys.argv, os._exit = saved, exit_now


def run_page(page: dict) -> bool:
    os.chdir(page["work"])
    module = types.ModuleType("docs_page")  # the page's Python blocks live in a module, as a user's code would
    sys.modules[module.__name__] = module
    for step in page["steps"]:
        if step["kind"] == "python":
            print(f"== {step['where']}: python block", flush=True)
            start = time.perf_counter()
            try:
                exec(compile(step["code"], step["where"], "exec"), module.__dict__)
            except Exception:
                traceback.print_exc()
                print(f"FAILED: {step['where']}: the python block raised", flush=True)
                return False
            print(f"-- {time.perf_counter() - start:.1f} s", flush=True)
            continue
        for command in commands(step["code"]):
            print(f"== {step['where']}: {command}", flush=True)
            start = time.perf_counter()
            status = run_command(command)
            sys.stdout.flush()
            sys.stderr.flush()
            print(f"-- {time.perf_counter() - start:.1f} s", flush=True)
            if status != 0:
                print(f"FAILED: {step['where']}: exit status {status}: {command}", flush=True)
                return False
    return True


def main(path: str) -> int:
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")  # a module run again with -m
    for page in json.loads(open(path).read()):
        start = time.perf_counter()
        if not run_page(page):
            return 1
        print(f"== page {page['page']}: {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
