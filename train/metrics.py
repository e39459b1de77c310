"""Where training metrics go: `metrics.jsonl` (one JSON object per logged step, appended and flushed),
TensorBoard event files (through tensorboardX) and a tqdm bar with the loss and images/s.

Only process 0 writes. A resumed run appends to the same JSONL file; lines for steps past the
checkpoint it resumed from (written by the interrupted run after its last checkpoint) are dropped
first, so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import jax
from PIL import Image
from tqdm import tqdm


class Metrics:
    def __init__(self, output_dir: Path, *, total_steps: int, start_step: int, tensorboard_dir: Path | None):
        self.main = jax.process_index() == 0
        self.output_dir = output_dir
        self.path = output_dir / "metrics.jsonl"
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", disable=not self.main, dynamic_ncols=True)
        self.writer = None
        if not self.main:
            return
        _truncate_after(self.path, start_step)
        self.file = open(self.path, "a", encoding="utf-8")
        if tensorboard_dir is not None:
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(str(tensorboard_dir), purge_step=start_step + 1)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Record `values` for optimizer step `step` (1-based: the number of steps done)."""
        clean = {k: float(v) for k, v in values.items()}
        # printed by the update, with the step it belongs to (refreshed on its own, it printed the new
        # loss beside the previous step's count, and every update beside the previous step's loss)
        self.bar.set_postfix(loss=f"{clean.get('loss', math.nan):.4f}", img_s=f"{clean.get('images_per_s', 0):.1f}",
                             refresh=False)
        self.bar.update(step - self.bar.n)
        if not self.main:
            return
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()
        if self.writer is not None:
            for k, v in clean.items():
                self.writer.add_scalar(f"train/{k}", v, step)

    def image(self, step: int, tag: str, grid) -> None:
        """A validation picture, grid uint8 (H, W, 3): output_dir/validation/step-NNNNNN.png and TensorBoard."""
        if not self.main:
            return
        folder = self.output_dir / "validation"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(grid).save(folder / f"step-{step:06d}.png")
        if self.writer is not None:
            self.writer.add_image(tag, grid, step, dataformats="HWC")

    def message(self, text: str) -> None:
        if self.main:
            self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
        if self.main:
            self.file.close()
            if self.writer is not None:
                self.writer.close()


def _truncate_after(path: Path, step: int) -> None:
    """Drop the lines of steps after `step` (left by a run that stopped after its last checkpoint)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except json.JSONDecodeError:
            break  # a line cut by a kill: nothing after it is complete
    path.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
