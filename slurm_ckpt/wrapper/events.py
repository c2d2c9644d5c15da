"""The wrapper's log: one line per event, ``key=value`` pairs, parseable and stable.

Every line looks like::

    slurm-ckpt run: event=committed rank=0 run=1 step=120 t=2.31 path=/ckpt/job_7/step-000000120

``t`` is seconds since the checkpoint request (the first signal), so a log
shows the time from signal to committed checkpoint to requeue. Values with
spaces are shell-quoted (``shlex.split`` reads a line back). The events and
their fields are listed in the :mod:`slurm_ckpt.wrapper` docstring.
"""

from __future__ import annotations

import shlex
import sys
import time
from typing import Any, TextIO

__all__ = ["Events", "parse_event"]

PREFIX = "slurm-ckpt run:"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    elif isinstance(value, bool):
        value = int(value)
    # One event, one line, even for a command line holding a script.
    text = str(value).replace("\r", "\\r").replace("\n", "\\n")
    return shlex.quote(text)


def parse_event(line: str) -> dict[str, str] | None:
    """The fields of one wrapper log line, or None if it is not one."""
    if not line.startswith(PREFIX):
        return None
    out = {}
    for tok in shlex.split(line[len(PREFIX) :]):
        key, _, value = tok.partition("=")
        out[key] = value
    return out


class Events:
    """Writes event lines to ``stream`` (stderr: Slurm's job output)."""

    def __init__(self, stream: TextIO | None = None, **common: Any) -> None:
        self.stream = stream
        self.common = common
        self.request_time: float | None = None
        """time.monotonic() of the checkpoint request, the origin of ``t``."""

    def emit(self, event: str, **fields: Any) -> None:
        parts = {"event": event, **self.common}
        if self.request_time is not None and "t" not in fields:
            parts["t"] = time.monotonic() - self.request_time
        parts.update({k: v for k, v in fields.items() if v is not None})
        line = PREFIX + " " + " ".join(f"{k}={_fmt(v)}" for k, v in parts.items())
        stream = self.stream or sys.stderr
        print(line, file=stream, flush=True)
