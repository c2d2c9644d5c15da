"""One run of the wrapped command: start it, relay requests, wait, tear down.

The loop sleeps in ``select`` on two fds: the signal wakeup socket (every
trapped signal, SIGCHLD included, writes to it) and the control socket. Timers
(``--preempt-after``, the deadline, the hang watchdog's) are the select timeout.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType

from .. import startsignals
from ..protocol import COMMITTED, PROGRESS, READY, Message
from ..slurm import JobInfo
from .backend import JobBackend
from .channel import ControlServer
from .events import Events
from .policy import NodeReport, cancel_reason
from .proctree import descendants, kill_tree, reap, start_child
from .watchdog import Watchdog

__all__ = ["RunResult", "SignalTrap", "Supervisor", "Timing"]


WAKE = 1.0
"""The longest the loop sleeps, seconds."""


@dataclass(frozen=True)
class Timing:
    """How long the wrapper may wait for a checkpoint (see the package docstring)."""

    margin: float = 15.0
    kill_wait: float = 30.0
    wait: float = 300.0

    @property
    def term_window(self) -> float:
        """Seconds to work with after a SIGTERM: SIGKILL follows after KillWait."""
        return max(self.kill_wait - self.margin, self.kill_wait / 2)

    def deadline(self, sig: signal.Signals, info: JobInfo | None, now: float, wall: float) -> float:
        """The monotonic time by which the checkpoint must be committed."""
        end = info.end_time if info is not None else None
        if end is None:
            d = now + self.wait
        elif end - self.margin > wall:
            d = now + (end - self.margin - wall)
        else:  # the request came later than end - margin: the SIGKILL bound rules
            d = now + self.term_window
        if sig == signal.SIGTERM:
            d = min(d, now + self.term_window)
        return d


@dataclass
class RunResult:
    requested: bool = False
    trigger: str = ""
    cancelled: str = ""
    committed_step: int | None = None
    committed_path: str = ""
    status: int | None = None
    """The child's raw wait status; None if it had to be killed at the deadline."""
    killed_at_deadline: bool = False
    stragglers: int = 0
    hang: NodeReport | None = None
    """This node's ranks when the watchdog found no step progress for hang_timeout (then ended)."""

    @property
    def code(self) -> int:
        """The child's exit code as a shell reports it (128+N for signal N)."""
        if self.status is None:
            return 128 + signal.SIGKILL
        code = os.waitstatus_to_exitcode(self.status)
        return 128 - code if code < 0 else code


class SignalTrap:
    """Trapped signals queued in order, with a wakeup fd for ``select``."""

    def __init__(self, signals: Sequence[signal.Signals]) -> None:
        self.signals = list(dict.fromkeys(signals))
        self.pending: list[int] = []
        self._old: dict[signal.Signals, object] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.pending.append(signum)

    def __enter__(self) -> SignalTrap:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        for sig in self.signals:
            self._old[sig] = signal.signal(sig, self._handler)
        self.pending[:0] = startsignals.take_over(self._old)  # they came first
        if self.pending:  # wake the first select for what came during start-up
            self._w.send(b"\0")
        return self

    def fileno(self) -> int:
        return self._r.fileno()

    def take(self) -> list[int]:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while self._r.recv(4096):
                pass
        out, self.pending = self.pending, []
        return out

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        signal.set_wakeup_fd(self._old_fd)
        self._r.close()
        self._w.close()


class Supervisor:
    """Runs the command once and reports what happened in a :class:`RunResult`."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        sig: signal.Signals,
        job: JobBackend,
        timing: Timing,
        trap: SignalTrap,
        server: ControlServer,
        events: Events,
        preempt_after: float | None = None,
        watchdog: Watchdog | None = None,
        node: str = "",
    ) -> None:
        self.argv, self.env, self.sig, self.job = argv, env, sig, job
        self.timing, self.trap, self.server, self.events = timing, trap, server, events
        self.preempt_after = preempt_after
        self.watchdog, self.node = watchdog, node
        self.res = RunResult()
        self.ready: set[int] = set()
        self.deadline: float | None = None

    def run(self) -> RunResult:
        child = start_child(self.argv, self.env, ignore=(self.sig, signal.SIGTERM))
        self.child = child
        self.events.emit("child-start", pid=child.pid, cmd=" ".join(self.argv))
        preempt_at = None if self.preempt_after is None else time.monotonic() + self.preempt_after
        woke = time.monotonic()
        while self.res.status is None:
            now = time.monotonic()
            if self.watchdog is not None:
                # The loop wakes at least every WAKE seconds; a longer gap is time the
                # wrapper did not run (SIGSTOP, a frozen node) while its ranks were
                # likely stopped too. Thawed, it must not report a hang it never saw.
                self.watchdog.pause(max(now - woke - WAKE, 0.0))
            woke = now
            if preempt_at is not None and now >= preempt_at:
                preempt_at = None
                self.events.emit("preempt-after", signal=_name(self.sig))
                os.kill(os.getpid(), self.sig)  # the same path a Slurm signal takes
            if self.deadline is not None and now >= self.deadline:
                self.res.killed_at_deadline = True
                self.events.emit("deadline", committed=self.res.committed_step is not None,
                                 msg="the command did not exit before the deadline; ending it")  # fmt: skip
                break
            stalled = None if self.watchdog is None else self.watchdog.deadline
            if stalled is not None and now >= stalled and self.res.hang is None:
                assert self.watchdog is not None
                self.res.hang = self.watchdog.report(self.node, now)
                self.events.emit("hang", node=self.node, timeout=self.watchdog.timeout,
                                 ranks=" ".join(f"{r.pid}:{r.step}:{r.where}:{r.idle:.1f}" for r in self.res.hang.ranks),
                                 msg="no step progress on this node; ending its ranks without a checkpoint")  # fmt: skip
                break
            # The WAKE cap is a safety net only: a Python-level handler can run
            # just after take() drained its wakeup byte; events normally wake us.
            timers = [t - now for t in (preempt_at, self.deadline, stalled) if t is not None]
            timeout = max(min([*timers, WAKE]), 0)
            with contextlib.suppress(InterruptedError):
                select.select([self.trap.fileno(), self.server.fileno()], [], [], timeout)
            for signum in self.trap.take():
                self._on_signal(signal.Signals(signum))
            for msg in self.server.receive():
                self._on_message(msg)
            reap(self._on_exit)
        # After a hang no rank gets a grace period: one stuck in a collective cannot
        # save, and the newest committed checkpoint is what the job resumes from.
        down = kill_tree(os.getpid(), on_exit=self._on_exit, grace=0.0 if self.res.hang else 1.0)
        if down.terminated or down.killed or down.stragglers:
            self.events.emit(
                "teardown", terminated=len(down.terminated), killed=len(down.killed),
                stragglers=" ".join(f"{p.pid}:{p.state}:{p.comm}" for p in down.stragglers) or None,
            )  # fmt: skip
        self.res.stragglers = len(down.stragglers)
        for msg in self.server.receive():  # a report sent just before the exit
            self._on_message(msg)
        self.events.emit("child-exit", code=self.res.code, killed=self.res.killed_at_deadline)
        return self.res

    def _on_exit(self, pid: int, status: int) -> None:
        if self.watchdog is not None:
            self.watchdog.forget(pid)
        if pid == self.child.pid:
            self.res.status = status
            self.child.returncode = os.waitstatus_to_exitcode(status)

    def _on_signal(self, sig: signal.Signals) -> None:
        if sig == signal.SIGCHLD:
            return
        if sig == signal.SIGINT:
            # The terminal or srun delivers Ctrl-C to the command directly;
            # forwarding it again would interrupt its clean-up.
            self.res.cancelled = "SIGINT"
            self.events.emit("signal", signal=_name(sig), action="cancel")
            return
        if self.res.requested:
            action = "ignored (a checkpoint is already requested)"
            if sig == signal.SIGTERM and self.deadline is not None:
                self.deadline = min(self.deadline, time.monotonic() + self.timing.term_window)
                action = "tighten-deadline"
            self.events.emit("signal", signal=_name(sig), action=action)
            return
        self.res.requested, self.res.trigger = True, _name(sig)
        self.events.request_time = time.monotonic()
        self.events.emit("signal", signal=_name(sig), action="request")
        self._forward(self._targets())  # first: the Slurm query below can take a while
        info = None if self.job.local else self.job.job_info()
        self.deadline = self.timing.deadline(sig, info, time.monotonic(), time.time())
        self.events.emit(
            "request", signal=_name(sig), deadline_in=self.deadline - time.monotonic(),
            end_time=None if info is None or info.end_time is None else int(info.end_time),
            job_state=None if info is None else info.state,
        )  # fmt: skip
        self.res.cancelled = self.res.cancelled or cancel_reason(info, time.time())

    def _targets(self) -> list[int]:
        return [self.child.pid, *sorted(self.ready - {self.child.pid})]

    def _forward(self, pids: list[int]) -> None:
        sent = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, self.sig)
                sent.append(pid)
        self.events.emit("forward", signal=_name(self.sig), pids=",".join(map(str, sent)) or "-")

    def _on_message(self, msg: Message) -> None:
        if msg.kind == READY:
            # Only a process of our own tree may steer where signals go.
            if msg.pid in self.ready or msg.pid not in {p.pid for p in descendants(os.getpid())}:
                return
            self.ready.add(msg.pid)
            self.events.emit("ready", pid=msg.pid)
            if self.res.requested:  # a request held while the trainer was not listening
                self._forward([msg.pid])
        elif msg.kind == COMMITTED:
            if self.res.committed_step is None or msg.step >= self.res.committed_step:
                self.res.committed_step, self.res.committed_path = msg.step, msg.path
            self.events.emit("committed", step=msg.step, path=msg.path)
        elif msg.kind == PROGRESS and self.watchdog is not None and msg.pid in self.ready:
            self.watchdog.beat(msg, time.monotonic())



def _name(sig: signal.Signals) -> str:
    """``USR1``, as sbatch --signal spells it."""
    return sig.name.removeprefix("SIG")
