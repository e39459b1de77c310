"""The documentation's code runs: every ```sh and ```python block of README.md and docs/, so that a command or an
example that stops working fails the suite. The rules (docs/testing.md, "How the pages are tested", tells users):

- Every fenced block says its language: `sh` (commands), `python`, or `text` (output, a file's lines: not code).
- A block runs as written, unless the line right before it says otherwise, visibly (`MARKS`):
  `<sub>Tests: scaled down ...</sub>`: it runs with `SCALE` applied (each of those flags' numbers capped);
  `<sub>Tests: flags checked, not run: WHY</sub>`: each command's flags go through the command's own parser
  (`docs/hooks.py` COMMANDS; a trainer's whole `train.config.parse`), nothing runs;
  `<sub>Tests: not run: WHY</sub>`: an install, a GPU, hours of work.
  A mark that the rule does not need (a scaled block the caps do not change), or a block that needs one and
  lacks it, fails `test_every_block_is_marked_as_it_runs`.
- What a page names as not its own making (hub ids, the user's pictures and datasets) is made, tiny, at that
  path in the page's working folder (`STAND_INS`), so a command runs verbatim: `stabilityai/stable-diffusion-xl-
  base-1.0` is then a local folder holding a tiny random diffusers pipeline of that architecture. The pages run
  with HF_HUB_OFFLINE=1: a hub id missing from the table fails instead of downloading.
- A text block right after a command block that runs is its output: each of its lines must be in what ran printed.
  So is a comment after a `print(...)` in a Python block that runs: it starts with a line the run printed, whole,
  then ends or goes on after a colon or a comma (`print(x.shape)  # (1, 64, 64, 3), floats in [0, 1]`).
- The pages run one after another in one fresh `python` (tests/docs_run.py), each page's blocks in order, in a
  working folder of its own; they share one sdx cache, so `default` is assembled, a stand-in converted and a
  program compiled once. The run prints each command's seconds and its own CPU time.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from tests.docs_run import commands, split
from tests.processes import child_env

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LANGUAGES = ("sh", "python", "text")
MARKS = {"scaled down": "scaled", "flags checked": "checked", "not run": "skipped"}
MARK = re.compile(r"^<sub>Tests: (?P<mark>scaled down|flags checked|not run)\b.*</sub>$")
PRINTED = re.compile(r"^\s*print\(.*\)\s+# (.+)$", re.M)  # a print's comment: what it prints, first
FENCE = re.compile(r"^```(?P<lang>\S*)[^\n]*\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)

# the caps a scaled-down block runs with: --flag N becomes --flag min(N, cap)
SCALE = {"--max_train_steps": 2, "--num_train_epochs": 1, "--resolution": 64, "--height": 64, "--width": 64,
         "--train_batch_size": 2, "--count": 16, "--num_class_images": 2, "--num_validation_images": 1,
         "--steps": 2}


@functools.cache
def hooks():
    """docs/hooks.py (the MkDocs hook that writes the flag tables; its COMMANDS say which parser a command has)."""
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    mode: str  # "run", "scaled", "checked" or "skipped"
    output_of: Block | None = None  # a text block right after a command block that runs: its output

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    def runs(self) -> str:
        """The code as the tests run it (scaled down when marked so)."""
        return scaled(self.code) if self.mode == "scaled" else self.code


def scaled(code: str) -> str:
    def cap(match: re.Match) -> str:
        flag, sep, value = match.groups()
        return f"{flag}{sep}{min(int(value), SCALE[flag])}"

    return re.sub(r"(?<!\S)(--[a-z_]+)(\s+|=)(\d+)(?!\S)", lambda m: cap(m) if m[1] in SCALE else m[0], code)


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    out, end = [], None
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        mark = MARK.match(before)
        previous = out[-1] if out and not text[end:match.start()].strip() else None
        runs = previous is not None and previous.lang == "sh" and previous.mode in ("run", "scaled")
        out.append(Block(page, text.count("\n", 0, match.start()) + 1, match["lang"], match["code"],
                         MARKS[mark["mark"]] if mark else "run",
                         previous if runs and match["lang"] == "text" else None))
        end = match.end()
    return out


ALL = [b for page in PAGES for b in blocks(page)]
LAST = ("python-api.md", "changing-the-model.md")  # they run UNets of their own: after the pages that share programs
RUN_PAGES = sorted((page for page in PAGES if any(b.mode in ("run", "scaled") and b.lang != "text" for b in blocks(page))),
                   key=lambda page: page.name in LAST)


def test_every_block_is_marked_as_it_runs():
    """Each block has a language; a mark means what it says; the counts are printed (`pytest -s`)."""
    problems = []
    for b in ALL:
        if b.lang not in LANGUAGES:
            problems.append(f"{b.where}: a ```{b.lang} block: say sh, python or text")
        elif b.lang == "text" and b.mode != "run":
            problems.append(f"{b.where}: a text block is never run; drop its mark")
        elif b.mode == "scaled" and scaled(b.code) == b.code:
            problems.append(f"{b.where}: marked scaled down, but the caps change nothing: drop the mark")
        elif b.mode == "run" and b.lang == "sh" and scaled(b.code) != b.code:
            problems.append(f"{b.where}: needs the caps of SCALE: mark it <sub>Tests: scaled down ...</sub>")
        elif b.mode == "checked" and b.lang != "sh":
            problems.append(f"{b.where}: only commands have flags to check")
    assert not problems, "\n".join(problems)
    counts = {mode: sum(b.mode == mode and b.lang != "text" for b in ALL) for mode in ("run", "scaled", "checked",
                                                                                      "skipped")}
    commands_run = sum(len(commands(b.code)) for b in ALL if b.lang == "sh" and b.mode in ("run", "scaled"))
    print(f"{sum(b.lang != 'text' for b in ALL)} code blocks in {len(PAGES)} pages: {counts}; "
          f"{commands_run} commands run; {sum(b.lang == 'text' for b in ALL)} text blocks")


def test_the_flags_of_the_commands_shown_but_not_run_parse():
    """A `flags checked` block's commands: each goes through its command's parser (a trainer's whole
    `train.config.parse`, which also refuses bad values), so a renamed flag fails here."""
    commands_of = hooks().COMMANDS
    failures = []
    for b in (b for b in ALL if b.mode == "checked"):
        for command in commands(b.code):
            env, words = split(command)
            name = " ".join(words[:3])
            if name not in commands_of:
                failures.append(f"{b.where}: no parser for {name!r} (docs/hooks.py COMMANDS)")
                continue
            try:
                check_flags(commands_of[name], words[3:])
            except SystemExit as e:
                failures.append(f"{b.where}: {command}\n  refused (exit status {e.code}); see the error above")
    assert not failures, "\n".join(failures)


def check_flags(command, argv: list[str]) -> None:
    """`argv` through `command`'s parser (docs/hooks.py `Command`); a bad flag or value exits (SystemExit)."""
    if command.module == "train.config":
        from train import config

        task, lora = command.args
        config.parse(task, argv, lora=lora)
    else:
        command.parser().parse_args(argv)


def test_the_flag_tables_in_the_pages_are_current():
    """The flag tables written into the pages (between `<!-- flags: COMMAND -->` and `<!-- end of flags -->`, so that
    the Markdown shows them) are what the parsers' `--help` says now; a row changed by hand is stale too."""
    h = hooks()
    with_tables = [page for page in PAGES if h.TABLES.search(page.read_text())]
    assert len(with_tables) >= 11, with_tables
    stale = h.stale(PAGES)
    assert not stale, f"stale flag tables in {', '.join(str(p.relative_to(REPO)) for p in stale)}: run `{h.WRITE}`"
    page = (REPO / "docs" / "generating.md").read_text()
    edited = page.replace("| `--steps STEPS` | denoising steps", "| `--steps N` | steps")
    assert edited != page and h.current(edited, "docs/generating.md") == page
    with pytest.raises(ValueError, match="without its"):
        h.current(page.replace("<!-- end of flags -->", ""), "docs/generating.md")


def test_every_flag_has_a_sentence_and_a_topic():
    """Every flag of the sampler, the converter and the trainers has its help sentence and shows its default
    (`sdx.errors.HelpFormatter`); the sampler's and the trainers' are in topic groups. `--help` and the flag tables
    of the documentation show them so."""
    from sdx.errors import HelpFormatter

    h = hooks()
    problems = []
    for command, where in h.COMMANDS.items():
        if where.module not in ("pipelines.cli", "convert.cli", "train.config"):
            continue  # the tools behind the default models (train.shapes, train.init, train.shapes_eval)
        parser = where.parser()
        if parser.formatter_class is not HelpFormatter:
            problems.append(f"{command}: its --help does not show the defaults (sdx.errors.ArgumentParser)")
        for group, actions in h.groups(parser):
            for action in actions:
                if not (action.help or "").strip():
                    problems.append(f"{command} {action.option_strings or action.dest}: no help")
                if where.module != "convert.cli" and group.title in ("options", "optional arguments"):
                    problems.append(f"{command} {action.option_strings[0]}: in no topic group")
    assert not problems, "\n".join(problems)


def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: every page in the nav, no broken link or anchor, the flag tables and the API
    reference generated (a warning fails it)."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "training" / "pix2pix" / "index.html").read_text().count("<tr>") > 40


# -- what the pages name as the user's own: made, tiny, at that path in each page's working folder


def _pipeline(kind: str):
    def build(out: Path, _build) -> None:
        from tests.tiny_models import make_tiny_pipeline

        make_tiny_pipeline(kind, out)
    return build


def _controlnet(out: Path, build) -> None:
    import diffusers

    unet = diffusers.UNet2DConditionModel.from_pretrained(build("stable-diffusion-v1-5/stable-diffusion-v1-5") / "unet")
    diffusers.ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=[8, 16]).save_pretrained(out)


def _controlnet_union(out: Path, build) -> None:
    import diffusers

    from tests.test_controlnet_union import TINY, union_from_unet

    unet = diffusers.UNet2DConditionModel.from_pretrained(build("stabilityai/stable-diffusion-xl-base-1.0") / "unet")
    union_from_unet(unet, [8, 16], **TINY).save_pretrained(out)


def _sketch_adapter(out: Path, _build) -> None:
    import diffusers

    from tests.test_t2i_adapter_pipelines import SHAPES

    diffusers.T2IAdapter(in_channels=1, **SHAPES["sdxl"]).save_pretrained(out)


def _ip_adapter(out: Path, build) -> None:
    import diffusers

    from sdx import ip_adapter
    from tests.test_ip_adapter_pipelines import adapter_folder

    pipe = type("Pipe", (), {"unet": diffusers.UNet2DConditionModel.from_pretrained(
        build("stable-diffusion-v1-5/stable-diffusion-v1-5") / "unet")})
    (out / "models").mkdir(parents=True)
    adapter_folder(pipe, ip_adapter.PLAIN, out / "models").rename(out / "models" / "ip-adapter_sd15.safetensors")


def _vae(out: Path, build) -> None:
    shutil.copytree(build("stabilityai/stable-diffusion-xl-base-1.0") / "vae", out)


def _lora(out: Path, build) -> None:
    """A diffusers-layout LoRA (what `python -m train.text_to_image_lora` writes) on one attention of the SDXL
    stand-in's UNet (and so of `tiny_xl`, its architecture)."""
    from safetensors.numpy import load_file, save_file

    unet = load_file(build("stabilityai/stable-diffusion-xl-base-1.0") / "unet" / "diffusion_pytorch_model.safetensors")
    key = next(k for k in unet if k.endswith("attn1.to_q.weight"))
    rows, cols = unet[key].shape
    rng = np.random.default_rng(0)
    module = key.removesuffix(".weight")
    save_file({f"unet.{module}.lora_A.weight": rng.normal(size=(4, cols)).astype(np.float32),
               f"unet.{module}.lora_B.weight": rng.normal(size=(rows, 4)).astype(np.float32) * 0.1}, str(out))


def _embedding(out: Path, build) -> None:
    """An A1111 textual-inversion file (`emb_params`, two vectors) for the SD 1.5 stand-in's text encoder."""
    from safetensors.numpy import save_file

    sd15 = build("stable-diffusion-v1-5/stable-diffusion-v1-5")
    config = json.loads((sd15 / "text_encoder" / "config.json").read_text())
    vectors = np.random.default_rng(0).normal(size=(2, config["hidden_size"])).astype(np.float32)
    save_file({"emb_params": vectors}, str(out))


def _picture(draw):
    def build(out: Path, _build) -> None:
        im = Image.new("RGB", (32, 32), (40, 60, 200))
        draw(ImageDraw.Draw(im))
        im.save(out)
    return build


STAND_INS = {
    "stabilityai/stable-diffusion-xl-base-1.0": _pipeline("sdxl"),
    "stabilityai/stable-diffusion-xl-refiner-1.0": _pipeline("sdxl_refiner"),
    "stable-diffusion-v1-5/stable-diffusion-v1-5": _pipeline("sd15"),
    "timbrooks/instruct-pix2pix": _pipeline("pix2pix"),
    "diffusers/stable-diffusion-xl-1.0-inpainting-0.1": _pipeline("sdxl_inpaint"),
    "lllyasviel/control_v11p_sd15_canny": _controlnet,
    "xinsir/controlnet-union-sdxl-1.0": _controlnet_union,
    "TencentARC/t2i-adapter-sketch-sdxl-1.0": _sketch_adapter,
    "h94/IP-Adapter": _ip_adapter,
    "madebyollin/sdxl-vae-fp16-fix": _vae,
    # the user's files: a LoRA, an embedding, pictures of the shapes world (32x32: the smallest programs)
    "style.safetensors": _lora,
    "easynegative.safetensors": _embedding,
    "photo.png": _picture(lambda d: d.ellipse((8, 8, 24, 24), fill=(220, 30, 30))),
    "mask.png": _picture(lambda d: (d.rectangle((0, 0, 31, 31), fill=0), d.ellipse((6, 6, 26, 26), fill="white"))),
    "edges.png": _picture(lambda d: (d.rectangle((0, 0, 31, 31), fill=0), d.ellipse((8, 8, 24, 24), outline="white"))),
    "sketch.png": _picture(lambda d: (d.rectangle((0, 0, 31, 31), fill=0), d.line((4, 28, 16, 4, 28, 28), "white"))),
    "style.png": _picture(lambda d: d.rectangle((4, 4, 20, 20), fill=(250, 200, 20))),
}


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """name -> its stand-in, built on first use (and what it needs) in a folder of this module."""
    root = tmp_path_factory.mktemp("stand-ins")

    @functools.cache
    def build(name: str) -> Path:
        out = root / name
        out.parent.mkdir(parents=True, exist_ok=True)
        STAND_INS[name](out, build)
        return out

    return build


@pytest.fixture(scope="module")
def docs_cache(tmp_path_factory, demo_build):
    """The sdx cache every page shares, with the demo models already in it (built once per test run)."""
    cache = tmp_path_factory.mktemp("docs-cache")
    for name in ("tiny", "tiny_xl"):
        demo_build(name, cache / "models")
    return cache


def test_the_pages_code_runs(stand_ins, docs_cache, tmp_path):
    """Every page's blocks that run, in one fresh process (tests/docs_run.py), page after page, each in a working
    folder of its own with the stand-ins it names; a text block shown as a command's output must be in what ran;
    what README.md's tour leaves in its folder, git ignores (.gitignore)."""
    plan = []
    for page in RUN_PAGES:
        steps = [{"where": b.where, "kind": b.lang, "code": b.runs()} for b in blocks(page)
                 if b.mode in ("run", "scaled") and b.lang != "text"]
        work = tmp_path / str(page.relative_to(REPO)).replace("/", "-")
        work.mkdir()
        code = "\n".join(s["code"] for s in steps)
        for name in STAND_INS:
            if re.search(rf"(?<![\w/.-]){re.escape(name)}(?![\w.-])", code):
                (work / name).parent.mkdir(parents=True, exist_ok=True)
                (work / name).symlink_to(stand_ins(name))
        plan.append({"page": str(page.relative_to(REPO)), "work": str(work), "steps": steps})
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = child_env(SDX_CACHE=str(docs_cache), HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(REPO))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "tests.docs_run", str(tmp_path / "plan.json")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1800)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    (tmp_path / "output.txt").write_text(proc.stdout + proc.stderr)
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith(("==", "--", "FAILED"))))
    print(f"CPU time of the run: {after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime:.0f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    printed = proc.stdout + proc.stderr
    stand_ins = {name.split("/")[0] for name in STAND_INS}
    made = sorted(p.name + "/" * p.is_dir() for p in (tmp_path / "README.md").iterdir() if p.name not in stand_ins)
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=REPO, input="\n".join(made),
                             capture_output=True, text=True).stdout.split()
    assert made and ignored == made, f"README.md's tour leaves files git does not ignore: {set(made) - set(ignored)}"
    lines = {line.strip() for line in printed.splitlines() if line.strip()}
    for b in ALL:
        missing = [line for line in b.code.splitlines() if b.output_of and line.strip() and line not in printed]
        assert not missing, f"{b.where}: the output shown is not what {b.output_of.where} printed: {missing}"
        if b.lang == "python" and b.mode in ("run", "scaled"):
            for shown in PRINTED.findall(b.code):
                assert any(shown == line or shown.startswith((f"{line}:", f"{line},")) for line in lines), \
                    f"{b.where}: the comment '# {shown}' does not start with a line that its print printed"
