"""train/metrics.py: what a training run prints and writes for each optimizer step."""

from __future__ import annotations

import json

from train.metrics import Metrics


def test_each_printed_step_shows_its_own_loss(tmp_path, capsys):
    """The bar prints once per logged step (every update printed here), each line with that step's loss
    and images/s; metrics.jsonl has one line per step."""
    metrics = Metrics(tmp_path, total_steps=3, start_step=0, tensorboard_dir=None)
    metrics.bar.mininterval, metrics.bar.miniters = 0, 1
    capsys.readouterr()
    losses = {1: 0.5, 2: 0.25, 3: 0.125}
    for step, loss in losses.items():
        metrics.log(step, {"loss": loss, "images_per_s": 10.0 * step})
    metrics.close()
    printed = [part for part in capsys.readouterr().err.split("\r") if "/3 [" in part]
    for step, loss in losses.items():
        lines = [p for p in printed if f" {step}/3 [" in p]
        assert lines and all(f"loss={loss:.4f}" in p and f"img_s={10.0 * step:.1f}" in p for p in lines), printed
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == list(losses.items())
