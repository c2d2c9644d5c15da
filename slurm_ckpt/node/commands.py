"""The one seam through which the node hooks run external programs.

Hooks start with no PATH, so programs are looked up in a fixed system path,
run with an argv list (never a shell), a clean environment, ``/`` as their
working directory and a timeout.
"""

from __future__ import annotations

import logging

__all__ = ["SYSTEM_PATH", "run", "which"]

log = logging.getLogger("slurm_ckpt.node")

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def which(name: str) -> str | None:
    import shutil

    return shutil.which(name, path=SYSTEM_PATH)


def run(argv: list[str], timeout: float, pass_fds: tuple[int, ...] = ()) -> tuple[int, str]:
    """Run ``argv``; return (exit status, stdout+stderr). 127: not installed, 124: timed out.

    ``pass_fds`` keep their numbers in the child, for ``/proc/self/fd/N`` arguments.
    """
    import subprocess  # here: an epilog with nothing mounted runs no command at all

    exe = which(argv[0])
    if exe is None:
        return 127, f"{argv[0]}: not found in {SYSTEM_PATH}"
    try:
        p = subprocess.run([exe, *argv[1:]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, errors="replace",
                           timeout=max(timeout, 0.1), env={"PATH": SYSTEM_PATH, "LC_ALL": "C"},
                           pass_fds=pass_fds, cwd="/")  # fmt: skip
    except subprocess.TimeoutExpired:
        log.warning("%s timed out after %.1fs", argv[0], timeout)
        return 124, f"{argv[0]}: timed out after {timeout:.1f}s"
    if p.returncode:
        log.info("%s exited %d: %s", " ".join(argv), p.returncode, p.stdout.strip()[-500:])
    return p.returncode, p.stdout
