"""The one seam through which slurm-ckpt runs Slurm commands.

Everything that talks to Slurm through its CLI calls :func:`run_slurm`, so a
test (or a site without Slurm on the nodes) has exactly one place to look at.
The binaries are found on ``PATH``; ``SCONTROL`` overrides the scontrol binary,
as in LBNL NHC, for sites that install Slurm somewhere odd.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass

from ..errors import SlurmError

__all__ = ["CommandResult", "SlurmCommandMissing", "binary", "run_slurm"]

log = logging.getLogger("slurm_ckpt")

_OVERRIDES = {"scontrol": "SCONTROL", "scancel": "SCANCEL", "squeue": "SQUEUE"}
# Slurm signals every process of a job step, so a second USR1 or a SIGTERM
# would kill the wrapper's own `scontrol requeue` half-way (seen on a real
# cluster: "exited -10"). The command starts with them blocked instead; a
# blocked signal is inherited across exec and never delivered to it.
_SHIELDED = {signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM}


class SlurmCommandMissing(SlurmError, FileNotFoundError):
    """The Slurm command is not installed on this node (common inside containers)."""


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        """One line for an error message: the command, its status and its stderr."""
        err = (self.stderr or self.stdout).strip().replace("\n", " | ")
        return f"`{' '.join(self.argv)}` exited {self.returncode}: {err or '(no output)'}"


def binary(name: str) -> str | None:
    """Absolute path of Slurm command ``name``, or None when it is not installed."""
    var = _OVERRIDES.get(name)
    override = os.environ.get(var, "") if var else ""
    if override:
        return override if os.access(override, os.X_OK) else None
    return shutil.which(name)


def run_slurm(name: str, *args: str, timeout: float = 30.0) -> CommandResult:
    """Run Slurm command ``name`` with ``args``; never raises on a non-zero exit.

    Raises :class:`SlurmCommandMissing` if the command is not installed and
    :class:`SlurmError` if it does not finish within ``timeout`` seconds (a
    hung slurmctld must not eat the job's last minute).
    """
    exe = binary(name)
    if exe is None:
        raise SlurmCommandMissing(
            f"{name} not found on PATH (or ${_OVERRIDES.get(name, name.upper())}): "
            "install the Slurm client on the node, or set wrapper.requeue_exit and "
            "RequeueExit in slurm.conf"
        )
    argv = (exe, *args)
    log.debug("running %s", " ".join(argv))
    try:
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SHIELDED)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)  # fmt: skip
        finally:
            # Our own handlers see anything that arrived meanwhile, once unblocked.
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        with proc:
            try:
                stdout, stderr = proc.communicate(timeout=max(timeout, 0.1))
            except subprocess.TimeoutExpired:
                # As subprocess.run does: a grandchild may hold the pipes open.
                proc.kill()
                proc.wait()
                raise
    except subprocess.TimeoutExpired:
        raise SlurmError(
            f"`{' '.join(argv)}` did not answer within {timeout:.0f}s; is slurmctld up?"
        ) from None
    except OSError as e:
        raise SlurmError(f"cannot run {exe}: {e}") from e
    return CommandResult(argv, proc.returncode, stdout, stderr)
