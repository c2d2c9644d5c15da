"""Who can write in ``storage.root`` and in the per-user dirs under it.

A root that every user may write in without the sticky bit lets any user
rename another's dir away; with or without it, a user may create
``<root>/<someone else>`` before that user does and plant checkpoints in it.
The stage-out and the library refuse such dirs (``store/owner.py``), so a
squatted dir costs its user their checkpoints' durable copy: this check
finds them first.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from ..store.owner import untrusted, untrusted_below
from .finding import Context, Report, Severity

__all__ = ["check_owners"]

_MAX_ENTRIES = 10_000
"""Per-user dirs looked at: a root with more is reported as checked in part."""


def check_owners(report: Report, ctx: Context, root: str) -> None:
    """Findings on ``root`` (``storage.root``), its per-user dirs, and the dirs down to ``ctx.path``."""
    if not root:
        return
    try:
        st = os.stat(root)
    except OSError as e:
        report.add("owners", Severity.WARN, f"storage.root {root}: {e.strerror}",
                   "create it, root-owned, mode 1777 or 0755")  # fmt: skip
        return
    mode = stat.S_IMODE(st.st_mode)
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        report.add("owners", Severity.ERROR,
                   f"storage.root {root} is writable by every user without the sticky bit (mode {mode:04o}): "
                   "any user can rename another's dir away and put their own in its place",
                   f"chmod 1777 {root}, or 0755 with a per-user dir made by the admin", mode=mode)  # fmt: skip
    elif st.st_uid != 0 or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        report.add("owners", Severity.WARN, f"storage.root {root} is owned by uid {st.st_uid}, mode {mode:04o}",
                   f"chown root {root} and chmod 1777 (or 0755) it", mode=mode)  # fmt: skip
    bad = _per_user(report, Path(root))
    # The root itself is no run dir: a shared one may be open to all (1777).
    why = untrusted_below(Path(root), ctx.path, os.geteuid()) if ctx.path.absolute() != Path(root).absolute() else None
    if why:
        report.add("owners", Severity.ERROR, f"the run dir cannot be used: {why}",
                   "the stage-out and the library refuse it; have the dir removed")  # fmt: skip
    elif not bad:
        report.add("owners", Severity.OK, f"storage.root {root} and its per-user dirs: owned and written by their users")


def _per_user(report: Report, root: Path) -> int:
    """Report each per-user dir another user owns or may write in; how many there were."""
    bad = seen = 0
    try:
        entries = os.scandir(root)
    except OSError as e:
        report.add("owners", Severity.WARN, f"cannot list {root}: {e.strerror}", "run the doctor as root")
        return 0
    with entries:
        for entry in entries:
            seen += 1
            if seen > _MAX_ENTRIES:
                report.add("owners", Severity.INFO, f"{root}: only the first {_MAX_ENTRIES} entries checked")
                break
            try:
                uid = pwd.getpwnam(entry.name).pw_uid
                st = entry.stat(follow_symlinks=False)
            except (KeyError, OSError):
                continue  # not named after a user: not a per-user dir
            why = untrusted(st, uid, last=True) if stat.S_ISDIR(st.st_mode) else "is not a directory"
            if why:
                bad += 1
                report.add("owners", Severity.ERROR, f"per-user dir {entry.path} {why}",
                           f"remove it or chown {entry.name} it and chmod 0700 it: until then "
                           f"{entry.name}'s stage-outs are refused", user=entry.name)  # fmt: skip
    return bad
