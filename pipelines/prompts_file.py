"""`python -m sdx.sample --prompts-file FILE`: many generations in one process, resumable.

FILE has one prompt per line, or one JSON object per line with a "prompt" and any of `SETTINGS`, which
replace the command's flags for that line (mixing both kinds of line is fine). Empty lines and lines
starting with "#" are skipped.

    a red circle on a blue background
    {"prompt": "a green square on a white background", "seed": 7, "steps": 30, "guidance_scale": 4.0}

The n-th prompt (from 0) writes `--output/NNNNN.png`, or `NNNNN-K.png` for its K-th image with
num_images > 1. Lines with the same sizes and steps reuse one set of compiled programs.

Resuming: a file that is already there and whose metadata holds the same prompt, seed and image index
is skipped, so a run that was killed continues where it stopped when started again (files are written
atomically: one is either complete or absent). A file with other metadata is an error unless --overwrite.
"""

from __future__ import annotations

import json
from pathlib import Path

from sdx.errors import SdxError

PROMPTS = ("prompt", "prompt_2", "negative_prompt", "negative_prompt_2")  # a string, as a one-item list flag
LISTS = (*PROMPTS, "ip_adapter_image", "ip_adapter_scale")  # settings of flags that take a list: one item
SETTINGS: dict[str, type] = {
    **dict.fromkeys(PROMPTS, str), "image": str, "mask": str, "mask_blur": float, "ip_adapter_image": str,
    **dict.fromkeys(("seed", "steps", "height", "width", "num_images", "padding_mask_crop"), int),
    **dict.fromkeys(("guidance_scale", "guidance_rescale", "image_guidance_scale", "strength", "ip_adapter_scale"), float),
}


def read(path: str) -> list[tuple[str, dict]]:
    """[(where, settings)] for each prompt line: "--prompts-file FILE, line N" and its settings as
    `argparse` destinations and values ({"prompt": [text], ...})."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SdxError(f"--prompts-file {path}: cannot read it as UTF-8 text ({e})") from None
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)]
    wheres = [(f"--prompts-file {path}, line {n}", line) for n, line in lines if line and not line.startswith("#")]
    settings = [(where, _settings(line, where)) for where, line in wheres]
    if not settings:
        raise SdxError(f"--prompts-file {path}: no prompts in it (one per line, or JSON objects with a \"prompt\")")
    return settings


def _settings(line: str, where: str) -> dict:
    if not line.startswith("{"):
        return {"prompt": [line]}
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise SdxError(f"{where}: a line starting with {{ must be one JSON object ({e.msg})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
        raise SdxError(f"{where}: the JSON object needs a \"prompt\" string")
    unknown = sorted(set(obj) - SETTINGS.keys())
    if unknown:
        raise SdxError(f"{where}: unknown setting {', '.join(unknown)}; the settings are {', '.join(SETTINGS)}")
    out = {}
    for key, value in obj.items():
        kind = SETTINGS[key]
        ok = isinstance(value, str) if kind is str else (
            isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool))
        if not ok:
            raise SdxError(f"{where}: \"{key}\" must be a{'n' if kind is int else ''} {kind.__name__}, got {value!r}")
        out[key] = [kind(value)] if key in LISTS else kind(value)
    return out


def paths(folder: Path, index: int, num_images: int) -> list[Path]:
    """The files of the `index`-th prompt's images."""
    if num_images == 1:
        return [folder / f"{index:05d}.png"]
    return [folder / f"{index:05d}-{k}.png" for k in range(num_images)]


def written(path: Path, prompt: str, seed: int, image_index: int) -> bool:
    """Whether `path` is image `image_index` of the prompt seeded `seed` (its own seed: seed + image_index),
    written by an earlier run; False when there is no file. A file that is another image (or no sdx image) is an
    error: it is neither overwritten nor taken for this one."""
    from PIL import Image, UnidentifiedImageError

    if not path.exists():
        return False
    try:
        with Image.open(path) as im:
            meta = json.loads(im.info.get("sdx", "{}"))
    except (OSError, UnidentifiedImageError, json.JSONDecodeError):
        meta = {}
    if (meta.get("prompt"), meta.get("seed"), meta.get("image_index")) == (prompt, seed + image_index, image_index):
        return True
    raise SdxError(f"{path} exists and is not the image asked for now (prompt {prompt!r}, seed {seed}); pass "
                   "--overwrite to replace it or choose another --output")
