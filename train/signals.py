"""Graceful stop on SIGTERM (preemption, `kill`) and SIGINT (Ctrl-C).

    with GracefulStop() as stop:
        for step in ...:
            state = train_step(state, ...)
            if stop.requested:               # at a step boundary: the state is consistent
                ckpts.save(step, state, meta, force=True)
                break

The handlers only record the signal: nothing is raised inside the step or inside a checkpoint write, so
a second Ctrl-C (or the scheduler's repeated SIGTERM) while the checkpoint is written cannot cut it
short; it prints, once, that the run stops after the checkpoint is written. (Python runs a handler in
the main thread between bytecodes: while that thread is blocked waiting for Orbax's commit the signal
stays pending, and its line comes when the wait returns.) A write killed by SIGKILL is never mistaken
for a checkpoint either (see train/checkpoint.py). The previous handlers are put back when the block
exits.

Python runs signal handlers in the main thread only, and only the main thread may install them: used
from any other thread the context manager installs nothing and `requested` stays False.

Multi-host: a signal may reach only some hosts, and a host that stops alone would leave the others
waiting in a collective. `stop.requested_anywhere()` is True on every host when any host got a signal;
every process must call it at the same steps (it is a small all-gather), as it does the step itself.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _write_stderr(message: str) -> None:
    # os.write, not print: a handler can interrupt a print to the same stream, and re-entering a
    # buffered writer raises RuntimeError
    try:
        os.write(2, (message + "\n").encode())
    except OSError:
        pass


class GracefulStop:
    """Context manager; `requested` becomes True at the first of `signals` received inside the block.

    requested: a stop was asked for. received: the signals received, in order (as signal.Signals).
    installed: whether handlers were installed (False off the main thread).
    """

    def __init__(self, signals: tuple[int, ...] = DEFAULT_SIGNALS, *, log=_write_stderr):
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.requested = False
        self.received: list[signal.Signals] = []
        self.installed = False
        self._log = log
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        self.received.append(sig)
        if not self.requested:
            self.requested = True
            self._log(f"{sig.name} received: stopping at the end of this step, after a checkpoint is written")
        elif len(self.received) == 2:
            self._log(f"{sig.name} received again: stopping after the checkpoint is written")

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal.signal would raise ValueError; signals reach the main thread only anyway
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        self.installed = True
        return self

    def __exit__(self, *exc) -> None:
        if not self.installed:
            return
        for sig, previous in self._previous.items():
            # None: the previous handler was not installed from Python; the default is the best match
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
        self.installed = False

    def requested_anywhere(self) -> bool:
        """True on every process when any process received a signal (a collective: call it on all)."""
        if jax.process_count() == 1:
            return self.requested
        flags = multihost_utils.process_allgather(np.array([self.requested]))
        return bool(np.any(flags))
