"""The flag tables of the documentation, generated from the commands' parsers, and the MkDocs hook (mkdocs.yml
`hooks:`) that refuses to build a page whose tables are stale.

A page holds each command's flags between `<!-- flags: python -m train.pix2pix -->` and `<!-- end of flags -->`:
one table per topic (the parser's argument groups), each flag with the sentence and default its `--help` prints
(`sdx.errors.HelpFormatter` writes both), written into the Markdown itself so that a reader on a forge or in an
editor sees them. `python docs/hooks.py --write` rewrites them after a flag is renamed, added or given another
default; tests/test_docs.py fails while one is stale, builds the site (`mkdocs build --strict`) and uses
`COMMANDS` to check the flags of the commands the pages show but do not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import importlib
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Command:
    """A command's parser: `module.parser(*args)` (the trainers': `train.config.parser(task, lora)`)."""

    module: str
    args: tuple = ()

    def parser(self) -> argparse.ArgumentParser:
        return importlib.import_module(self.module).parser(*self.args)


# every command the pages show -> where its parser is
COMMANDS = {
    "python -m sdx.sample": Command("pipelines.cli"),
    "python -m sdx.serve": Command("serve.cli"),
    "python -m convert": Command("convert.cli"),
    **{f"python -m train.{task}{'_lora' if lora else ''}": Command("train.config", (task, lora))
       for task, lora in (("pix2pix", False), ("text_to_image", False), ("text_to_image", True), ("dreambooth", False),
                          ("dreambooth", True), ("controlnet", False), ("t2i_adapter", False),
                          ("textual_inversion", False), ("vae", False))},
    "python -m train.shapes": Command("train.shapes"),
    "python -m train.init": Command("train.init"),
    "python -m train.shapes_eval": Command("train.shapes_eval"),
}

TABLES = re.compile(r"^<!-- flags: (?P<command>[^>]+?) -->\n(?P<tables>.*?)^<!-- end of flags -->$", re.M | re.S)
WRITE = "python docs/hooks.py --write"


def flags(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    """`--name VALUE` as `--help` spells it (the first spelling; positionals by their metavar)."""
    if not action.option_strings:
        return formatter._format_args(action, action.dest.upper())
    first = action.option_strings[0]
    if action.nargs == 0:
        return first
    return f"{first} {formatter._format_args(action, formatter._get_default_metavar_for_optional(action))}"


def groups(parser: argparse.ArgumentParser) -> list[tuple[argparse._ArgumentGroup, list[argparse.Action]]]:
    """The parser's argument groups with their flags, in `--help`'s order, without `-h` and empty groups."""
    shown = [(g, [a for a in g._group_actions if a.help is not argparse.SUPPRESS
                  and not isinstance(a, argparse._HelpAction)]) for g in parser._action_groups]
    return [(g, actions) for g, actions in shown if actions]


def _cell(text: str) -> str:
    return html.escape(" ".join(text.split()), quote=False).replace("|", "\\|")


def flag_tables(command: str) -> str:
    """The Markdown tables of `command`'s flags: one per argument group, under its title."""
    parser = COMMANDS[command].parser()
    formatter = parser._get_formatter()
    out = []
    for group, actions in groups(parser):
        out += [f"**{group.title}**" + (f": {group.description}" if group.description else ""), "",
                "| flag | what it does |", "|---|---|"]
        out += [f"| `{flags(a, formatter)}` | {_cell(formatter._expand_help(a))} |" for a in actions]
        out.append("")
    return "\n".join(out)


def current(markdown: str, where: str) -> str:
    """`markdown` with the tables between each page's markers generated anew."""
    def tables(match: re.Match) -> str:
        command = match["command"]
        if command not in COMMANDS:
            raise KeyError(f"{where}: no parser for {command!r}; add it to COMMANDS in docs/hooks.py")
        return f"<!-- flags: {command} -->\n\n{flag_tables(command)}\n<!-- end of flags -->"

    if len(re.findall(r"^<!-- flags: ", markdown, re.M)) != len(TABLES.findall(markdown)):
        raise ValueError(f"{where}: a `<!-- flags: COMMAND -->` without its `<!-- end of flags -->` line")
    return TABLES.sub(tables, markdown)


def stale(pages) -> list[Path]:
    """Those of `pages` whose flag tables differ from what the parsers give now."""
    return [page for page in pages if current(page.read_text(), str(page)) != page.read_text()]


def on_page_markdown(markdown: str, page, config, files) -> str:
    if current(markdown, page.file.src_path) != markdown:
        raise ValueError(f"docs/{page.file.src_path}: its flag tables are stale; run `{WRITE}`")
    return markdown


def main(argv: list[str]) -> int:
    """`python docs/hooks.py --write`: rewrite the stale tables of every page; `--check`: list them, status 1."""
    if argv not in (["--write"], ["--check"]):
        print(f"usage: {WRITE} | --check", file=sys.stderr)
        return 2
    old = stale(sorted(DOCS.rglob("*.md")))
    for page in old:
        if argv == ["--write"]:
            page.write_text(current(page.read_text(), str(page)))
        print(f"{'rewrote' if argv == ['--write'] else 'stale:'} {page.relative_to(DOCS.parent)}")
    return 1 if old and argv == ["--check"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
