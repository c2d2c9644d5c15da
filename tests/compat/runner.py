"""Runs one compatibility case on one loader's state, in a child process of its own.

A load that hands out a bad tensor can crash the process that uses it (a
SIGSEGV in ``torch.set_rng_state``), so every case runs in a fresh child: a
crash is an outcome, not the end of the suite. Children fork from a fork
server that imported torch once, so each costs a fork, not a torch import.
"""

from __future__ import annotations

import multiprocessing
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Outcome", "run"]

_CTX = multiprocessing.get_context("forkserver")
# torch._dynamo: the first optimizer a process builds imports it, which takes seconds.
_CTX.set_forkserver_preload(["torch", "torch._dynamo", "numpy", "slurm_ckpt.checkpointer", "tests.compat.cases"])


@dataclass(frozen=True)
class Outcome:
    """What a case did: returned an observation, raised, or the process died."""

    result: dict[str, Any] | None
    """``{"ok": observation}`` or ``{"error": name, "message": ...}``; None if it died."""
    died: str = ""
    """How the child ended when it sent nothing: a signal's name, or an exit code."""

    @property
    def raised(self) -> str:
        return "" if self.result is None or "ok" in self.result else str(self.result["error"])

    def same_as(self, ref: Outcome) -> bool:
        """Equal observations, or the same exception type (messages name paths and sizes)."""
        if self.result is None or ref.result is None:
            return False
        if "ok" in ref.result:
            return self.result.get("ok", self) == ref.result["ok"]
        return self.raised == ref.raised

    def cell(self, ref: Outcome | None = None) -> str:
        """A table cell: how it went, against ``ref`` if given."""
        if self.result is None:
            return f"**crash ({self.died})**"
        if ref is None or ref is self:
            return "ok" if not self.raised else f"raises {self.raised}"
        if self.same_as(ref):
            return "same" if not self.raised else f"same (raises {self.raised})"
        if self.raised:
            return f"**raises {self.raised}**: {self.result['message']}"
        return "**differs**"


def run(case: str, loader: str, root: Path, timeout: float = 300) -> Outcome:
    """Run ``case`` on the state ``loader`` loads from ``root`` (see ``cases.save_both``)."""
    from tests.compat import cases

    recv, send = _CTX.Pipe(duplex=False)
    proc = _CTX.Process(target=cases.child, args=(case, loader, str(root), send), daemon=True)
    proc.start()
    send.close()
    result = None
    try:
        if recv.poll(timeout):
            result = recv.recv()
    except EOFError:  # it died before sending
        pass
    proc.join(timeout)
    if proc.is_alive():  # a hang guard only: a case takes seconds
        proc.kill()
        proc.join()
        return Outcome(None, f"no answer in {timeout:.0f} s")
    if result is None:
        code = proc.exitcode or 0
        return Outcome(None, signal.Signals(-code).name if code < 0 else f"exit {code}")
    return Outcome(result)
