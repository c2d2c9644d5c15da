"""Who may have made a durable dir: the checkpoints' user or root, and no one else may write in it.

Under a shared ``storage.root`` that others can write in, another user can
create ``<root>/<user>/job_<id>`` before the job does and plant a newer
checkpoint in it: a resume would load that user's state, and the epilog's
stage-out would take it for an up-to-date copy of the job's own and delete
scratch. So every dir from the root down to a run dir, and the checkpoints
in it, must belong to the user or to root, and be writable by its owner
alone. On the way to a run dir, a root-owned dir with the sticky bit may be
writable by all (mode 1777, like ``/tmp``): no one can rename or delete
there what another user made.

The node hooks import this module alone: it imports nothing of the store.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["untrusted", "untrusted_below"]


def untrusted(st: os.stat_result, uid: int, *, last: bool) -> str | None:
    """Why a durable dir with status ``st`` cannot be trusted by user ``uid``, or None.

    ``last=False`` (a dir on the way, not the run dir or a checkpoint) also
    allows a root-owned sticky dir that all may write in.
    """
    if st.st_uid not in (uid, 0):
        return (f"is owned by uid {st.st_uid}, not by the job's user (uid {uid}) or root: another user may "
                "have made it first; have it removed, or give the job a SLURM_CKPT_DIR of its own")  # fmt: skip
    if st.st_mode & 0o022 and not (not last and st.st_uid == 0 and st.st_mode & stat.S_ISVTX):
        return (f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}): "
                "chmod go-w it (or, for a shared root, chmod 1777 it)")  # fmt: skip
    return None


def untrusted_below(root: Path, run_dir: Path, uid: int) -> str | None:
    """Why a dir from ``root`` down to ``run_dir`` (those that exist) cannot be trusted, or None.

    None too when ``run_dir`` is not below ``root``: the user named it.
    """
    try:
        rel = run_dir.absolute().relative_to(root.absolute())
    except ValueError:
        return None
    path = root.absolute()
    chain = [path] + [path := path / name for name in rel.parts]
    for i, d in enumerate(chain):
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            return None
        except OSError as e:
            return f"{d} cannot be checked: {e.strerror}"
        if i and stat.S_ISLNK(st.st_mode):
            return f"{d} is a symlink, not a directory: another user may have put it there; have it removed"
        if why := untrusted(st, uid, last=d == chain[-1]):
            return f"{d} {why}"
    return None
