"""A1111's infotext: the `parameters` text of each PNG and of `info`'s `infotexts`, and its reading for png-info.

    a red circle on a blue background
    Negative prompt: blurry
    Steps: 20, Sampler: Euler a, Schedule type: Karras, CFG scale: 7.0, Seed: 7, Size: 512x512, Model: default, ...

The prompt's lines, then the negative prompt's (when there is one), then one line of `key: value` pairs; a value
holding a comma, a colon or a line break is written as a JSON string, as A1111 quotes it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from importlib import metadata


def version() -> str:
    try:
        return f"sdx {metadata.version('sdx')}"
    except metadata.PackageNotFoundError:
        return "sdx"


@dataclasses.dataclass(frozen=True)
class Shown:
    """What the infotext tells of one request, every image alike but its seed (None: not written)."""

    prompt: str
    negative_prompt: str
    steps: int
    sampler: str
    schedule: str | None
    cfg_scale: float
    image_cfg_scale: float | None
    width: int
    height: int
    model: str
    vae: str | None
    denoising_strength: float | None
    clip_skip: int | None
    mask_blur: int | None
    extra: tuple[tuple[str, str], ...] = ()  # e.g. ("ControlNet 0", "...")

    def text(self, seed: int) -> str:
        """The infotext of the image seeded `seed`."""
        pairs = [("Steps", self.steps), ("Sampler", self.sampler), ("Schedule type", self.schedule),
                 ("CFG scale", self.cfg_scale), ("Image CFG scale", self.image_cfg_scale), ("Seed", seed),
                 ("Size", f"{self.width}x{self.height}"), ("Model", self.model), ("VAE", self.vae),
                 ("Denoising strength", self.denoising_strength), ("Clip skip", self.clip_skip),
                 ("Mask blur", self.mask_blur), *self.extra, ("Version", version())]
        line = ", ".join(f"{k}: {_quote(str(v))}" for k, v in pairs if v is not None)
        negative = f"\nNegative prompt: {self.negative_prompt}" if self.negative_prompt else ""
        return f"{self.prompt}{negative}\n{line}"


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ",:\n") else text


_PAIR = re.compile(r'\s*([\w][\w \-/+]*):\s*("(?:\\.|[^\\"])*"|[^,]*)(?:,|$)')


def parse(text: str) -> dict[str, str]:
    """An infotext as {"Prompt": ..., "Negative prompt": ..., "Steps": "20", "Size-1": "512", "Size-2": "512",
    ...}: what png-info answers as `parameters`."""
    *lines, last = text.strip().split("\n") if text.strip() else [""]
    pairs = _PAIR.findall(last)
    if len(pairs) < 3:  # no parameters line: all of it is prompt
        lines, pairs = [*lines, last], []
    prompt, negative, into_negative = [], [], False
    for line in lines:
        if line.startswith("Negative prompt:"):
            into_negative, line = True, line[len("Negative prompt:"):].strip()
        (negative if into_negative else prompt).append(line)
    out = {"Prompt": "\n".join(prompt), "Negative prompt": "\n".join(negative)}
    for key, value in pairs:
        value = value.strip()
        if value.startswith('"') and value.endswith('"') and len(value) > 1:
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        out[key] = value
        size = re.fullmatch(r"(\d+)x(\d+)", value)
        if size:
            out[f"{key}-1"], out[f"{key}-2"] = size.groups()
    return out


def info(shown: Shown, seeds: list[int], *, batch_size: int, sampler_name: str, job_timestamp: str,
         call_batch: int | None = None) -> str:
    """The `info` JSON string A1111's txt2img and img2img answer with (Processed.js()'s fields), and sdx's
    `sdx_call_batch`: the batch size of the compiled call the images were made in (other users' requests among them),
    with which `python -m sdx.sample --batch-size` makes them bit for bit."""
    texts = [shown.text(s) for s in seeds]
    return json.dumps({
        "prompt": shown.prompt, "all_prompts": [shown.prompt] * len(seeds),
        "negative_prompt": shown.negative_prompt, "all_negative_prompts": [shown.negative_prompt] * len(seeds),
        "seed": seeds[0] if seeds else None, "all_seeds": seeds, "subseed": -1, "all_subseeds": [-1] * len(seeds),
        "subseed_strength": 0, "width": shown.width, "height": shown.height, "sampler_name": sampler_name,
        "cfg_scale": shown.cfg_scale, "steps": shown.steps, "batch_size": batch_size, "restore_faces": False,
        "face_restoration_model": None, "sd_model_name": shown.model, "sd_model_hash": None,
        "sd_vae_name": shown.vae, "sd_vae_hash": None, "seed_resize_from_w": -1, "seed_resize_from_h": -1,
        "denoising_strength": shown.denoising_strength, "extra_generation_params": dict(shown.extra),
        "index_of_first_image": 0, "infotexts": texts, "styles": [], "job_timestamp": job_timestamp,
        "clip_skip": shown.clip_skip or 1, "is_using_inpainting_conditioning": False, "version": version(),
        "sdx_call_batch": call_batch,
    })
