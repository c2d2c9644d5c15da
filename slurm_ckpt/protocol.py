"""The control channel's messages: what the trainer tells the wrapper.

One datagram (or one appended line) per message, one message per line:

* ``ready <pid>``: the library's flag handler is installed in process ``pid``,
  so a checkpoint request held for it can be sent now;
* ``committed <step> <path>``: checkpoint ``step`` is committed at ``path``
  (the path may hold spaces; it runs to the end of the line).

The trainer's side (``control.py``) writes them with :func:`ready_line` and
:func:`committed_line`; the wrapper's (``wrapper/channel.py``) reads them with
:func:`parse_message`. No imports: the trainer loads this before torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "COMMITTED",
    "CONTROL_ENV",
    "READY",
    "SIGNAL_ENV",
    "Message",
    "committed_line",
    "parse_message",
    "ready_line",
]

CONTROL_ENV = "SLURM_CKPT_CONTROL"
"""The variable the wrapper sets to its channel (a socket path) for the trainer."""
SIGNAL_ENV = "SLURM_CKPT_SIGNAL"
"""The variable the wrapper sets to the name of the signal that asks for a checkpoint."""

READY = "ready"
COMMITTED = "committed"


@dataclass(frozen=True)
class Message:
    kind: str
    """``ready`` or ``committed`` (anything else is kept but ignored)."""
    pid: int = 0
    step: int = -1
    path: str = ""


def ready_line(pid: int) -> str:
    return f"{READY} {pid}"


def committed_line(step: int, path: str) -> str:
    return f"{COMMITTED} {step} {path}"


def parse_message(line: str) -> Message | None:
    """One channel line as a :class:`Message`, or None if it is malformed."""
    parts = line.rstrip("\n").split(" ", 2)
    try:
        if parts[0] == READY and len(parts) >= 2:
            return Message(READY, pid=int(parts[1]))
        if parts[0] == COMMITTED and len(parts) == 3:
            return Message(COMMITTED, step=int(parts[1]), path=parts[2])
    except ValueError:
        return None
    if parts[0] in (READY, COMMITTED):  # a known kind with missing fields
        return None
    return Message(parts[0]) if parts[0] else None
