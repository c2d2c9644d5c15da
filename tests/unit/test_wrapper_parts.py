"""The wrapper's parts on their own: channel, trainer-side Control, event lines, process tree."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_ckpt import startsignals
from slurm_ckpt.control import Control, parse_signal
from slurm_ckpt.errors import ConfigError
from slurm_ckpt.protocol import Message, parse_message
from slurm_ckpt.wrapper.channel import ControlServer
from slurm_ckpt.wrapper.events import Events, parse_event
from slurm_ckpt.wrapper.proctree import descendants, kill_tree
from slurm_ckpt.wrapper.supervisor import SignalTrap


def test_channel_round_trip_over_the_socket() -> None:
    with ControlServer() as server:
        assert len(server.path) < 108  # sun_path limit
        c = Control(channel=server.path)
        c.send(f"ready {os.getpid()}")
        c.report_committed(120, "/runs/a b/step-000000120")
        got = server.receive()
        assert got == [Message("ready", pid=os.getpid()),
                       Message("committed", step=120, path="/runs/a b/step-000000120")]  # fmt: skip
        assert server.receive() == []  # drained, and never blocks
        d = Path(server.path).parent
    assert not d.exists()  # close() removes the socket and its private dir
    Control(channel=server.path).report_committed(1, "/x")  # wrapper gone: no error


def test_channel_as_a_plain_file(tmp_path: Path) -> None:
    f = tmp_path / "control.log"
    c = Control(channel=str(f))
    c.report_committed(5, "/p")
    c.report_committed(6, "/q")
    assert f.read_text() == "committed 5 /p\ncommitted 6 /q\n"


@pytest.mark.parametrize("line", ["", "ready", "ready x", "committed 5", "committed x /p"])
def test_malformed_messages_are_dropped(line: str) -> None:
    msg = parse_message(line)
    assert msg is None or msg.kind not in ("ready", "committed")


def test_parse_signal() -> None:
    assert parse_signal("USR1") == parse_signal("SIGUSR1") == parse_signal("usr1") == signal.SIGUSR1
    assert parse_signal(15) == signal.SIGTERM
    with pytest.raises(ConfigError, match="USR2"):
        parse_signal("NOPE")


def test_events_are_one_parseable_line_each() -> None:
    out = io.StringIO()
    ev = Events(out, rank=0, run=1)
    ev.emit("start", dir="/a b/c", flag=True, skip=None, cmd="python -c 'a\nb'")
    ev.request_time = time.monotonic()
    ev.emit("no-requeue", reason="max-requeues", msg="it's the 'limit'")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (parse_event(line) for line in lines)
    assert first == {"event": "start", "rank": "0", "run": "1", "dir": "/a b/c", "flag": "1",
                     "cmd": "python -c 'a\\nb'"}  # fmt: skip
    assert second is not None and second["msg"] == "it's the 'limit'" and float(second["t"]) >= 0
    assert parse_event("train: step 5") is None


_SIGNAL_PROBE = textwrap.dedent("""
    import os, signal, sys, time
    from slurm_ckpt.control import Control
    c = Control(channel="")
    c.install()
    pid = os.fork()
    if pid == 0:
        # a forked worker: ignores AND blocks both, so no later handler can make it die
        ok = signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
        ok &= {signal.SIGUSR1, signal.SIGTERM} <= signal.pthread_sigmask(signal.SIG_BLOCK, [])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as torch's worker does with its own handler
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        os._exit(0 if ok and not c.requested else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert not c.requested  # the child's signals did not reach our flag
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + 5
    while not c.requested and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.requested
    c2 = Control(channel="")
    os.kill(os.getpid(), signal.SIGTERM)
    while not c2.requested and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c2.requested  # every Control of the process sees a request
    print("probe ok")
""")


def test_trainer_handler_flag_and_forked_children() -> None:
    out = subprocess.run([sys.executable, "-c", _SIGNAL_PROBE], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "SLURM_CKPT_CONTROL": ""})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "probe ok" in out.stdout


def test_late_signal_during_exit_does_not_kill_the_trainer() -> None:
    # Seen on real Slurm: a USR1 landing during interpreter shutdown (after
    # Python restored default handlers) killed a trainer that had already saved.
    code = ("import atexit, os, signal\nfrom slurm_ckpt.control import Control\nControl(channel='').install()\n"
            "atexit.register(lambda: [os.kill(os.getpid(), s) for s in (signal.SIGUSR1, signal.SIGTERM)])\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stderr)


def test_descendants_and_kill_tree_on_a_real_tree() -> None:
    # A shell with two children, one of them renamed to an awkward comm.
    script = ("sleep 60 & python3 -c \"import ctypes,time; ctypes.CDLL(None).prctl(15, b'a) (b c', 0, 0, 0); "
              "time.sleep(60)\" & wait")  # fmt: skip
    sh = subprocess.Popen(["bash", "-c", script])
    try:
        from tests.integration.test_wrapper import wait_for

        kids = wait_for(lambda: (lambda d: d if len(d) >= 2 and any(p.comm == "a) (b c" for p in d)
                                 else None)(descendants(sh.pid)), what="two children")  # fmt: skip
        assert {p.ppid for p in kids} == {sh.pid}
        down = kill_tree(sh.pid, grace=0.5, timeout=5)
        assert set(down.terminated) == {p.pid for p in kids}
        assert not down.stragglers
        assert [p for p in descendants(sh.pid) if p.state != "Z"] == []
    finally:
        sh.kill()
        sh.wait()


@pytest.fixture
def before_hold() -> Iterator[list[int]]:
    """HELD signals go to a handler that lists them; whatever a test leaves held is released
    (the suite's autouse fixture restores the handlers)."""
    seen: list[int] = []
    for sig in startsignals.HELD:
        signal.signal(sig, lambda signum, frame: seen.append(signum))
    try:
        yield seen
    finally:
        startsignals.release()


def test_signals_held_at_start_up_go_to_the_trap_or_back_to_their_handler(before_hold: list[int]) -> None:
    """Held USR1 and TERM go to the trap that handles them, first and in order; a held USR2
    it does not handle is raised again under the handler it had before; afterwards every
    handler is the one from before the hold."""
    handlers = {sig: signal.getsignal(sig) for sig in startsignals.HELD}
    startsignals.hold()
    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGUSR1):
        os.kill(os.getpid(), sig)
    assert before_hold == []  # held, not handled
    with SignalTrap([signal.SIGUSR1, signal.SIGTERM]) as trap:
        assert before_hold == [signal.SIGUSR2]
        os.kill(os.getpid(), signal.SIGUSR1)  # after the take-over: behind the held ones
        assert trap.take() == [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR1]
    assert {sig: signal.getsignal(sig) for sig in startsignals.HELD} == handlers


def test_signals_held_when_run_fails_before_its_trap_are_raised_again(before_hold: list[int]) -> None:
    handlers = {sig: signal.getsignal(sig) for sig in startsignals.HELD}
    startsignals.hold()
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)
    startsignals.release()
    assert before_hold == [signal.SIGUSR1, signal.SIGTERM]
    assert {sig: signal.getsignal(sig) for sig in startsignals.HELD} == handlers
