"""The trainer's side of the wrapper protocol: a flag set by signals, and a report channel.

The signal handler only sets a flag; the checkpoint itself happens at the next
step boundary, where the model and optimizer are consistent (saving inside a
handler can run mid-backward, Lightning's open bug).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

__all__ = ["Control"]


class Control:
    """Per-process checkpoint-request flag and the channel to the wrapper."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._installed = False
        self.channel = os.environ.get("SLURM_CKPT_CONTROL", "")

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self) -> None:
        self._event.set()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self._event.set()

    def install(self) -> None:
        """Install the flag-setting handlers (main thread only; later calls are no-ops)."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        name = os.environ.get("SLURM_CKPT_SIGNAL", "USR1").upper().removeprefix("SIG")
        for sig in {getattr(signal, f"SIG{name}"), signal.SIGTERM}:
            signal.signal(sig, self._handler)
        self._installed = True

    def report_committed(self, step: int, path: str) -> None:
        """Tell the wrapper (if any) that ``step`` is committed at ``path``."""
        if not self.channel:
            return
        line = f"committed {step} {path}\n".encode()
        fd = os.open(self.channel, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
