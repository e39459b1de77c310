"""pipelines.source_check through `executables.code_change`, and the disk cache: a process that changed sdx's code after importing it never
reads a program stored for the unchanged code (nor keeps one), and says so in one warning line."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from PIL import Image

from pipelines import executables
from sdx import attention, unet
from sdx.sample import main


def test_the_imported_code_is_what_its_files_hold():
    assert executables.code_change() is None


def _scaled_up_block(original):
    def patched(self, *args, **kwargs):
        return original(self, *args, **kwargs) * 2.0

    return patched


@pytest.mark.parametrize("how", ["function", "wraps", "constant", "imported name", "class"])
def test_a_replaced_method_constant_imported_name_or_class_is_seen(monkeypatch, how):
    if how == "function":
        monkeypatch.setattr(unet.UpBlock2D, "__call__", _scaled_up_block(unet.UpBlock2D.__call__))
        want = "sdx.unet.UpBlock2D.__call__ is tests.test_source_check._scaled_up_block.<locals>.patched"
    elif how == "wraps":  # a wrapper that takes the original's name and module
        monkeypatch.setattr(unet.UpBlock2D, "__call__", functools.wraps(unet.UpBlock2D.__call__)(
            _scaled_up_block(unet.UpBlock2D.__call__)))
        want = "sdx.unet.UpBlock2D.__call__ is sdx.unet.UpBlock2D.__call__ ("
    elif how == "constant":
        monkeypatch.setattr(attention, "BLOCKED_LOGITS", 7)
        want = "sdx.attention.BLOCKED_LOGITS is 7, not 1048576"
    elif how == "imported name":
        monkeypatch.setattr(unet, "Attention", type("Attention", (unet.Attention,), {"__module__": __name__}))
        want = "sdx.unet.Attention is tests.test_source_check.Attention, not sdx.layers.Attention"
    else:
        monkeypatch.setattr(unet, "UpBlock2D", type("UpBlock2D", (unet.UpBlock2D,), {"__module__": __name__}))
        want = "sdx.unet.UpBlock2D is tests.test_source_check.UpBlock2D"
    change = executables.code_change()
    print(change)
    assert change is not None and change.startswith(want), change
    monkeypatch.undo()
    assert executables.code_change() is None


def test_a_patched_up_block_is_run_not_the_program_stored_for_the_unpatched_one(demo_models, tmp_path, monkeypatch,
                                                                                capsys):
    """The issue's case: a FreeU-like experiment patches UpBlock2D and runs the command again with the disk
    cache on. Before, the second run read the first run's programs (the same sdx source, the same key) and
    wrote the unpatched image; now the change turns the disk cache off with one warning line."""
    model = demo_models("tiny")  # its UNet's first up block is an UpBlock2D

    def run(name: str) -> np.ndarray:
        out = tmp_path / f"{name}.png"
        assert main(["--model", str(model), "--prompt", "a lighthouse", "--steps", "2", "--height", "32", "--width",
                     "32", "--cache", str(tmp_path / "cache"), "--output", str(out), "--quiet"]) == 0
        return np.asarray(Image.open(out), dtype=np.int32)

    plain = run("plain")
    assert any((tmp_path / "cache" / "jax" / "executables").iterdir())  # the programs were kept
    capsys.readouterr()
    monkeypatch.setattr(unet.UpBlock2D, "__call__", _scaled_up_block(unet.UpBlock2D.__call__))
    patched = run("patched")
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    effect = np.abs(patched - plain).mean()
    print(f"the patch moves the image by {effect:.1f} mean 8-bit levels; warnings: {warnings}")
    assert effect > 10
    assert len(warnings) == 1 and "sdx.unet.UpBlock2D.__call__" in warnings[0] and "disk cache" in warnings[0]
    monkeypatch.undo()
    np.testing.assert_array_equal(run("plain-again"), plain)  # unpatched again: the kept programs serve


def _foreign_block(x, *, scale):  # a researcher's own code: this test module is not one of sdx's packages
    return x * scale


def test_a_program_of_code_from_outside_sdx_is_not_kept_and_says_so_once(tmp_path, monkeypatch, capsys):
    import jax.numpy as jnp

    monkeypatch.setattr(executables, "folder", lambda: tmp_path)
    fn = functools.partial(_foreign_block, scale=2.0)
    for _ in range(2):
        assert executables.path_of(fn, (jnp.ones(3),), {}) is None
        np.testing.assert_array_equal(executables.compile(fn, jnp.ones(3))(jnp.ones(3)), 2.0)
    warnings = capsys.readouterr().err.splitlines()
    assert warnings == [w for w in warnings if w.startswith("warning: tests.test_source_check._foreign_block is not "
                                                             "sdx's code")] and len(warnings) == 1, warnings
    assert not any(tmp_path.iterdir())
