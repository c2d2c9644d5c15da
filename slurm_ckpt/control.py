"""The trainer's side of the wrapper protocol: a flag set by signals, and a report channel.

The signal handler only sets a flag; the checkpoint itself happens at the next
step boundary, where the model and optimizer are consistent (saving inside a
handler can run mid-backward, Lightning's open bug).

Signals. ``slurm-ckpt run`` starts the trainer with the checkpoint signal
(``$SLURM_CKPT_SIGNAL``, USR1 by default) and SIGTERM set to SIG_IGN, so one
that arrives while torch is still importing can neither kill it nor be acted
on half-way. :meth:`Control.install` replaces SIG_IGN with the flag handler and
then reports ``ready`` so the wrapper re-sends any request it held meanwhile.

Children. Slurm signals every process of the step, DataLoader workers
included. A forked child inherits our handler, so (1) the handler acts only in
the process that installed it, and (2) a fork hook sets both signals to SIG_IGN
*and blocks them* in every child forked with ``os.fork`` (DataLoader workers,
``multiprocessing`` fork), so workers neither die nor act: torch's workers
install their own SIGTERM handler, which only a blocked mask defeats. A forked
child that execs inherits the blocked mask (``subprocess`` does not run the
hook). Workers started with the ``spawn``/``forkserver`` methods exec a fresh
interpreter, which resets a handled signal to its default action: use the
default ``fork`` method (Linux) for DataLoader workers under Slurm.

Progress. When the wrapper watches for hangs it sets ``$SLURM_CKPT_PROGRESS``
(seconds). :meth:`Control.progress` then stores the step (a plain attribute,
no system call) and the first call starts a daemon thread that sends
``progress <pid> <step> <where>`` that often: the thread keeps beating while
the main thread is stuck, and says where it is stuck (``sys._current_frames``),
which is how the wrapper tells a rank waiting in a collective from the rank
that holds it up. Without the variable, ``progress`` stores the step and
nothing else happens.

Channel. ``$SLURM_CKPT_CONTROL`` names the wrapper's Unix datagram socket;
lines are ``ready <pid>`` and ``committed <step> <path>`` (``protocol.py``). If it names anything
else (a plain file), lines are appended to it, which is handy for debugging
without the wrapper. A dead or missing wrapper never fails a save.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import signal
import socket
import stat
import sys
import threading
import weakref
from types import FrameType

from .errors import ConfigError
from .protocol import (
    CONTROL_ENV,
    PROGRESS_ENV,
    SIGNAL_ENV,
    committed_line,
    progress_line,
    ready_line,
)

__all__ = ["Control", "parse_signal"]

log = logging.getLogger("slurm_ckpt")

# Every live Control in the process; a signal sets the flag of each.
_live: weakref.WeakSet[Control] = weakref.WeakSet()
_handled: set[signal.Signals] = set()
_owner_pid = 0
_fork_hook_registered = False


def parse_signal(name: str | int) -> signal.Signals:
    """``"USR1"``, ``"SIGUSR1"``, ``"usr1"`` or ``10`` -> ``signal.SIGUSR1``."""
    text = str(name).strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise ConfigError(
            f"unknown signal {name!r}: use a name such as USR1, USR2 or TERM"
        ) from None


def _handler(signum: int, frame: FrameType | None) -> None:
    # A forked child runs this copy until its fork hook resets it; it must not
    # act on a request meant for the trainer.
    if os.getpid() == _owner_pid:
        for c in list(_live):
            c._requested = True


def _after_fork_in_child() -> None:
    ours = [sig for sig in _handled if signal.getsignal(sig) is _handler]
    if not ours:  # the handler was replaced since: not ours to change
        return
    with contextlib.suppress(ValueError, OSError):
        for sig in ours:
            signal.signal(sig, signal.SIG_IGN)
        # Blocked as well as ignored: a DataLoader worker installs its own C
        # handler for SIGTERM (torch's _set_worker_signal_handlers), which would
        # let Slurm's SIGTERM kill it. A blocked signal stays pending, whatever
        # handler is installed later.
        signal.pthread_sigmask(signal.SIG_BLOCK, ours)


def _ignore_at_exit() -> None:
    if os.getpid() != _owner_pid:
        return
    for sig in _handled:
        with contextlib.suppress(ValueError, OSError):
            signal.signal(sig, signal.SIG_IGN)


class Control:
    """The process's checkpoint-request flag and its channel to the wrapper."""

    def __init__(self, channel: str | None = None, signal_name: str | None = None) -> None:
        self.channel = os.environ.get(CONTROL_ENV, "") if channel is None else channel
        name = signal_name or os.environ.get(SIGNAL_ENV, "") or "USR1"
        self.signal = parse_signal(name)
        # A plain bool, not a threading.Event: Event.set() takes a lock, and a
        # second signal (Slurm sends USR1 then TERM) arriving while the first
        # handler holds it deadlocks the main thread. A store of a bool cannot.
        self._requested = False
        self._step = -1
        self._beat: threading.Thread | None = None
        try:
            self._beat_every = float(os.environ.get(PROGRESS_ENV, "") or 0)
        except ValueError:
            self._beat_every = 0.0
        _live.add(self)

    @property
    def requested(self) -> bool:
        """True once a checkpoint-and-stop was requested since this Control was made."""
        return self._requested

    def request(self) -> None:
        """Request a checkpoint-and-stop, as the signal would."""
        self._requested = True

    def clear(self) -> None:
        """Forget a request (a trainer that handled it and chose to go on)."""
        self._requested = False

    def install(self) -> None:
        """Install the flag handlers and tell the wrapper we are listening.

        Main thread only (Python's rule for signal handlers); elsewhere, and on
        later calls in the same process, it does nothing.
        """
        global _owner_pid, _fork_hook_registered
        if threading.current_thread() is not threading.main_thread():
            return
        wanted = {self.signal, signal.SIGTERM}
        if _owner_pid == os.getpid() and all(signal.getsignal(s) is _handler for s in wanted):
            return
        _owner_pid = os.getpid()
        for sig in wanted:
            signal.signal(sig, _handler)
            _handled.add(sig)
        if not _fork_hook_registered:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            # Interpreter shutdown resets Python-handled signals to SIG_DFL, so a
            # late USR1 (Slurm's, or the wrapper's forward) would kill a trainer
            # that has already saved and is exiting: ignore them from atexit on.
            atexit.register(_ignore_at_exit)
            _fork_hook_registered = True
        self.send(ready_line(os.getpid()))

    def progress(self, step: int) -> None:
        """Record that the trainer reached ``step`` (call once per step; it costs an
        attribute store). Under a wrapper that watches for hangs, the first call
        starts the heartbeat thread."""
        self._step = step
        if self._beat is None and self._beat_every > 0 and self.channel:
            self._beat = threading.Thread(target=self._heartbeat, args=(threading.main_thread().ident,),
                                          name="slurm-ckpt-progress", daemon=True)  # fmt: skip
            self._beat.start()

    def _heartbeat(self, main: int | None) -> None:
        pid, tick = os.getpid(), threading.Event()
        # Datagrams only, never appended to a file; it stops once the wrapper's socket is gone.
        while os.getpid() == pid and _is_socket(self.channel):
            _send_datagram(self.channel, (progress_line(pid, self._step, where_is(main)) + "\n").encode())
            tick.wait(self._beat_every)

    def report_committed(self, step: int, path: str) -> None:
        """Tell the wrapper (if any) that ``step`` is committed at ``path``."""
        self.send(committed_line(step, path))

    def send(self, line: str) -> None:
        """Deliver one line to the wrapper; failures are logged, never raised."""
        if not self.channel:
            return
        data = (line.rstrip("\n") + "\n").encode()
        try:
            st = os.stat(self.channel)
        except FileNotFoundError:
            st = None
        except OSError as e:
            log.debug("control channel %s: %s", self.channel, e)
            return
        if st is not None and stat.S_ISSOCK(st.st_mode):
            _send_datagram(self.channel, data)
        else:
            _append(self.channel, data)


_PKG = os.path.dirname(os.path.abspath(__file__)) + os.sep
_DIST = f"{os.sep}torch{os.sep}distributed{os.sep}"
_ELASTIC = f"{_DIST}elastic{os.sep}"  # torchrun's @record wraps a whole main(): not a collective


def where_is(thread_id: int | None, depth: int = 16) -> str:
    """Where thread ``thread_id`` is now: ``collective`` if one of its innermost
    ``depth`` Python frames is in ``torch.distributed`` (it waits for the other
    ranks; a DTensor collective waits under a dozen frames of torch's dispatch),
    ``checkpoint`` if any frame is slurm-ckpt's own (a save or a load is making
    progress), else ``compute``."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    n = 0
    while frame is not None:
        name = frame.f_code.co_filename
        if n < depth and _DIST in name and _ELASTIC not in name:
            return "collective"
        if name.startswith(_PKG) and not name.endswith("control.py"):
            return "checkpoint"
        frame, n = frame.f_back, n + 1
    return "compute"


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _send_datagram(path: str, data: bytes) -> None:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.setblocking(False)
            s.sendto(data, path)
    except OSError as e:
        # ECONNREFUSED: the wrapper is gone; EAGAIN: its queue is full. The
        # checkpoint itself is committed either way, which is what matters.
        level = logging.DEBUG if e.errno in (errno.ECONNREFUSED, errno.ENOENT) else logging.WARNING
        log.log(level, "cannot report to the wrapper at %s: %s", path, e)


def _append(path: str, data: bytes) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        log.warning("cannot open control file %s: %s", path, e)
        return
    try:
        os.write(fd, data)
    except OSError as e:
        log.warning("cannot write control file %s: %s", path, e)
    finally:
        os.close(fd)
