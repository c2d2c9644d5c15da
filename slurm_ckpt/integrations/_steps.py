"""Reading one named checkpoint, and the small files that name one, for the integrations.

``Checkpointer.load_latest`` is what a resume wants. A framework also asks for
a particular checkpoint by a path of its own (Lightning's ``best_model_path``,
``last.ckpt``): the integrations write a small *pointer* file there that names
the step, and :func:`load_step` reads that step.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine import Engine
from ..errors import CheckpointCorrupt, NoCheckpoint
from ..store import Skipped, iter_valid
from ..store.fsutil import fsync_dir, write_file_durably
from ..store.verify import Candidate

if TYPE_CHECKING:
    from ..checkpointer import Checkpointer

__all__ = ["Pointer", "load_step", "oldest_newest", "read_pointer", "resume_step", "write_pointer"]

log = logging.getLogger("slurm_ckpt")

_FORMAT = "slurm-ckpt-pointer"
# A pointer is a few dozen bytes; a real checkpoint file under the same name is
# far larger, and is not read whole to find out that it is not a pointer.
_MAX_POINTER = 4096


@dataclass(frozen=True)
class Pointer:
    """What a pointer file names: a step, and the run dir it was committed to."""

    step: int
    run_dir: Path


def load_step(dirs: list[Path], engine: Engine, step: int, *, trusted: bool = False,
              map_location: Any = None) -> Any:  # fmt: skip
    """The state of checkpoint ``step`` in the run dirs ``dirs`` (fastest tier first)."""
    found = _find_step(dirs, step)
    return engine.load(found.path, found.manifest, trusted=trusted, map_location=map_location)


def resume_step(ckpt: Checkpointer, step: int, newest: int | None, *, trusted: bool = False) -> Any:
    """Checkpoint ``step`` of ``ckpt``, read to resume from where ``newest`` was found but
    the processes agreed on ``step``: ``ckpt.loaded_step`` and ``loaded_path`` then name it,
    as after ``load_latest``."""
    log.warning("resuming from step %d, the oldest of the newest steps the processes found; this one found "
                "step %s, which stays where it is", step, newest)  # fmt: skip
    found = _find_step(ckpt.search_dirs, step)
    state = ckpt.engine.load(found.path, found.manifest, trusted=trusted)
    ckpt.loaded_step, ckpt.loaded_path = step, found.path
    return state


def _find_step(dirs: list[Path], step: int) -> Candidate:
    skipped: list[Skipped] = []
    for cand in iter_valid(dirs, full=False, skipped=skipped):
        if cand.step == step:
            return cand
        if cand.step < step:
            break
    why = "".join(f"; {s.path} was skipped: {s.reason}" for s in skipped)
    raise NoCheckpoint(
        f"checkpoint step {step} is not in {', '.join(map(str, dirs))} or does not verify{why}. "
        "Retention keeps the newest storage.keep checkpoints (Checkpointer(keep=N)): raise it to "
        "keep older ones, or resume from the newest valid checkpoint (load_latest). A step not yet "
        "copied to the run dir is read from this node's scratch only (SLURM_CKPT_SCRATCH)"
    )


def oldest_newest(found: list[tuple[str, int | None, str]]) -> tuple[int | None, str]:
    """The step that processes resume from together, from what each of them found
    (who it is, the newest valid step it found or None, where it looked): the
    oldest of those steps, which the others have too or can read among older
    ones unless retention removed it. Also why they cannot agree, or "": one
    found no checkpoint where another found one."""
    none = [f for f in found if f[1] is None]
    if not none:
        return min(s for _, s, _ in found if s is not None), ""
    some = next((f for f in found if f[1] is not None), None)
    if some is None:
        return None, ""
    return None, (
        f"{none[0][0]} found no checkpoint in {none[0][2]}, where {some[0]} found step {some[1]} in "
        f"{some[2]}: every process must see the same run dir (SLURM_CKPT_DIR on storage that every node mounts)"
    )


def write_pointer(path: Path, step: int, run_dir: Path) -> None:
    """Make ``path`` a small file naming checkpoint ``step``: written whole, then renamed over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    body = {"format": _FORMAT, "step": step, "run_dir": str(run_dir)}
    write_file_durably(tmp, (json.dumps(body) + "\n").encode())
    # Renamed over the old one, then the directory synced: the name holds the
    # old pointer or the new one, never a part of either.
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_pointer(path: Path) -> Pointer | None:
    """What a pointer file names, or None if ``path`` is not one (a torch file, say)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_MAX_POINTER + 1)
    except (IsADirectoryError, FileNotFoundError):
        return None
    if len(head) > _MAX_POINTER:
        return None
    try:
        body = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(body, dict) or body.get("format") != _FORMAT:
        return None
    step, run_dir = body.get("step"), body.get("run_dir")
    if type(step) is not int or not isinstance(run_dir, str):
        raise CheckpointCorrupt(f"{path}: a slurm-ckpt pointer without a step and a run dir: {body!r:.200}", path)
    return Pointer(step, Path(run_dir))
