"""The control channel's messages: what the trainer tells the wrapper.

One datagram (or one appended line) per message, one message per line:

* ``ready <pid>``: the library's flag handler is installed in process ``pid``,
  so a checkpoint request held for it can be sent now;
* ``committed <step> <path>``: checkpoint ``step`` is committed at ``path``
  (the path may hold spaces; it runs to the end of the line);
* ``progress <pid> <step> <where>``: a heartbeat, sent only when the wrapper
  watches for hangs (``$SLURM_CKPT_PROGRESS``): the last step process ``pid``
  reached, and where its main thread is now (:data:`WHERE`).

The trainer's side (``control.py``) writes them with :func:`ready_line` and
:func:`committed_line` (and :func:`progress_line`); the wrapper's (``wrapper/channel.py``) reads them with
:func:`parse_message`. No imports: the trainer loads this before torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "COMMITTED",
    "CONTROL_ENV",
    "PROGRESS",
    "PROGRESS_ENV",
    "READY",
    "SIGNAL_ENV",
    "WHERE",
    "Message",
    "committed_line",
    "parse_message",
    "progress_line",
    "ready_line",
]

CONTROL_ENV = "SLURM_CKPT_CONTROL"
"""The variable the wrapper sets to its channel (a socket path) for the trainer."""
SIGNAL_ENV = "SLURM_CKPT_SIGNAL"
"""The variable the wrapper sets to the name of the signal that asks for a checkpoint."""

PROGRESS_ENV = "SLURM_CKPT_PROGRESS"
"""Set by the wrapper only when it watches for hangs: seconds between heartbeats."""

READY = "ready"
COMMITTED = "committed"
PROGRESS = "progress"
WHERE = ("compute", "collective", "checkpoint")
"""Where a heartbeat finds the main thread: in the trainer's own code, waiting in a
``torch.distributed`` call, or inside slurm-ckpt (a save or a load)."""


@dataclass(frozen=True)
class Message:
    kind: str
    """``ready``, ``committed`` or ``progress`` (anything else is kept but ignored)."""
    pid: int = 0
    step: int = -1
    path: str = ""
    where: str = ""


def ready_line(pid: int) -> str:
    return f"{READY} {pid}"


def committed_line(step: int, path: str) -> str:
    return f"{COMMITTED} {step} {path}"


def progress_line(pid: int, step: int, where: str) -> str:
    return f"{PROGRESS} {pid} {step} {where}"


def parse_message(line: str) -> Message | None:
    """One channel line as a :class:`Message`, or None if it is malformed."""
    parts = line.rstrip("\n").split(" ", 2)
    try:
        if parts[0] == READY and len(parts) >= 2:
            return Message(READY, pid=int(parts[1]))
        if parts[0] == COMMITTED and len(parts) == 3:
            return Message(COMMITTED, step=int(parts[1]), path=parts[2])
        if parts[0] == PROGRESS and len(parts) == 3:
            step, _, where = parts[2].partition(" ")
            if where in WHERE:
                return Message(PROGRESS, pid=int(parts[1]), step=int(step), where=where)
    except ValueError:
        return None
    if parts[0] in (READY, COMMITTED, PROGRESS):  # a known kind with missing fields
        return None
    return Message(parts[0]) if parts[0] else None
