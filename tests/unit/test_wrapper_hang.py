"""The hang watchdog: whom ``decide_hang`` blames, the progress channel, and a real hung child."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from slurm_ckpt.config import WrapperConfig
from slurm_ckpt.control import Control, where_is
from slurm_ckpt.errors import ConfigError
from slurm_ckpt.protocol import PROGRESS_ENV, Message, parse_message, progress_line
from slurm_ckpt.wrapper.channel import ControlServer
from slurm_ckpt.wrapper.events import parse_event
from slurm_ckpt.wrapper.policy import HangFacts, NodeReport, RankProgress, decide_hang
from slurm_ckpt.wrapper.watchdog import Watchdog, clear_reports, gather, read_report, write_report

ROOT = Path(__file__).resolve().parents[2]


def node(name: str, *ranks: tuple[int, str]) -> NodeReport:
    return NodeReport(name, tuple(RankProgress(pid=100 + i, step=s, where=w, idle=31.0)
                                  for i, (s, w) in enumerate(ranks)))  # fmt: skip


N = ("n1", "n2", "n3")
WAITING = {n: node(n, (40, "collective")) for n in N}
BASE = HangFacts(timeout=30, nodes=N, reports=WAITING, partition_nodes=5, num_nodes=3, num_tasks=6)


def facts(**change: object) -> HangFacts:
    return dataclasses.replace(BASE, **change)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("reports", "bad", "why"),
    [
        # one rank sleeps in its own code; the others wait in all_reduce
        ({**WAITING, "n2": node("n2", (40, "compute"))}, ("n2",), "own code"),
        # a node with two ranks, one of them stuck: the node is blamed
        ({**WAITING, "n3": node("n3", (40, "collective"), (40, "compute"))}, ("n3",), "own code"),
        # all in collectives, n1 in an earlier one
        ({**WAITING, "n1": node("n1", (39, "collective"))}, ("n1",), "before step 40"),
        # n3's wrapper never reported (a dead node)
        ({n: WAITING[n] for n in ("n1", "n2")}, ("n3",), "never reported"),
    ],
)
def test_blames_the_node_that_held_the_job_up(reports: dict[str, NodeReport], bad: tuple[str, ...],
                                              why: str) -> None:  # fmt: skip
    d = decide_hang(facts(reports=reports))
    assert d.requeue and d.reason == "requeue"
    assert d.bad == bad and d.exclude == bad
    assert why in d.detail
    assert (d.num_nodes, d.num_tasks) == (None, None)  # 5 - 1 nodes left >= 3


@pytest.mark.parametrize(
    ("reports", "nodes"),
    [
        (WAITING, N),  # everyone waits in the same collective at the same step: no culprit
        ({n: node(n, (40, "compute")) for n in N}, N),  # everyone in its own code
        ({}, N),  # nobody reported
        ({"n1": node("n1", (40, "compute"))}, ("n1", "n2")),  # stuck and silent: ambiguous
    ],
)
def test_no_culprit_no_requeue(reports: dict[str, NodeReport], nodes: tuple[str, ...]) -> None:
    d = decide_hang(facts(reports=reports, nodes=nodes))
    assert not d.requeue and d.reason == "hang-unlocated" and not d.bad
    assert "not requeueing" in d.detail


def test_one_node_job_blames_its_only_node() -> None:
    d = decide_hang(facts(nodes=("n1",), reports={"n1": node("n1", (7, "compute"))}))
    assert d.requeue and d.exclude == ("n1",)


STUCK = {**WAITING, "n2": node("n2", (40, "compute"))}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"rank": 1}, "not-rank-0"),
        ({"restarts": 10}, "max-requeues"),
        ({"max_requeues": 0}, "max-requeues"),
        ({"partition_nodes": 1}, "no-nodes-left"),
        ({"partition_nodes": 3, "excluded": ("n9", "n8")}, "no-nodes-left"),
    ],
)
def test_guards_after_a_hang(change: dict[str, object], reason: str) -> None:
    d = decide_hang(facts(reports=STUCK, **change))
    assert not d.requeue and d.reason == reason and d.bad == ("n2",) and d.detail


def test_earlier_exclusions_are_kept_and_the_job_shrinks_to_what_is_left() -> None:
    d = decide_hang(facts(reports=STUCK, excluded=("n5",), partition_nodes=4))
    assert d.requeue and d.exclude == ("n2", "n5")
    assert (d.num_nodes, d.num_tasks) == (2, 4)  # 4 - 2 excluded; 2 tasks per node kept
    d = decide_hang(facts(reports=STUCK, partition_nodes=3, num_tasks=5))
    assert (d.num_nodes, d.num_tasks) == (2, None)  # tasks not a multiple of nodes: left alone
    d = decide_hang(facts(reports=STUCK, partition_nodes=0))
    assert d.requeue and d.num_nodes is None  # partition size unknown: no shrinking


def test_an_excluded_node_leaves_the_required_list() -> None:
    d = decide_hang(facts(reports=STUCK, required=("n1", "n2")))
    assert d.required == ("n1",)  # sbatch -w n1,n2 would otherwise never start again
    assert decide_hang(facts(reports=STUCK, required=("n2",))).required == ()  # cleared
    assert decide_hang(facts(reports=STUCK, required=("n1", "n3"))).required is None  # unchanged


def test_watchdog_deadline_follows_the_newest_step_and_saves() -> None:
    w = Watchdog(timeout=10)
    assert w.deadline is None  # no heartbeat yet: a command without the library is never hung
    w.beat(Message("progress", pid=1, step=5, where="compute"), now=100)
    w.beat(Message("progress", pid=2, step=5, where="compute"), now=101)
    assert w.deadline == 111
    w.beat(Message("progress", pid=1, step=5, where="collective"), now=108)  # same step: no progress
    assert w.deadline == 111
    w.beat(Message("progress", pid=2, step=6, where="compute"), now=109)
    assert w.deadline == 119
    w.beat(Message("progress", pid=1, step=5, where="checkpoint"), now=115)  # a long save is progress
    assert w.deadline == 125
    rep = w.report("n1", now=125)
    assert [(r.pid, r.step, r.where, r.idle) for r in rep.ranks] == [(1, 5, "checkpoint", 10.0),
                                                                      (2, 6, "compute", 16.0)]  # fmt: skip
    w.pause(4)  # the wrapper itself did not run for 4 s: not the ranks' idle time
    assert w.deadline == 129
    assert [r.idle for r in w.report("n1", now=129).ranks] == [10.0, 16.0]
    w.forget(1)
    w.forget(2)
    assert w.deadline is None


def test_reports_round_trip_through_a_dir(tmp_path: Path) -> None:
    rep = node("n2", (40, "compute"), (41, "collective"))
    write_report(tmp_path / "r", rep)
    assert read_report(tmp_path / "r" / "n2.json") == rep
    got = gather(tmp_path / "r", ("n2",), until=0)
    assert got == {"n2": rep}
    assert gather(tmp_path / "r", ("n1", "n2"), until=0) == {"n2": rep}  # n1 never came
    (tmp_path / "r" / "n1.json").write_text("{half")
    assert read_report(tmp_path / "r" / "n1.json") is None


@pytest.mark.parametrize("line", ["progress", "progress 1", "progress 1 2", "progress x 2 compute",
                                  "progress 1 2 somewhere", "progress 1 x compute"])  # fmt: skip
def test_malformed_progress_is_dropped(line: str) -> None:
    assert parse_message(line) is None


def test_progress_line_round_trip() -> None:
    assert parse_message(progress_line(12, 340, "collective")) == Message(
        "progress", pid=12, step=340, where="collective")  # fmt: skip


def _parked(*filenames: str) -> tuple[threading.Thread, threading.Event]:
    """A thread parked on an Event under one frame of code from each of ``filenames``, the last innermost."""
    ns: dict[str, object] = {}
    inner = "ev.wait()"
    for i, filename in reversed(list(enumerate(filenames))):
        exec(compile(f"def f{i}(ev):\n    {inner}\n", filename, "exec"), ns)
        inner = f"f{i}(ev)"
    ev = threading.Event()
    t = threading.Thread(target=ns["f0"], args=(ev,), daemon=True)
    t.start()
    return t, ev


def test_where_is_tells_a_collective_from_own_code() -> None:
    import slurm_ckpt

    pkg = os.path.dirname(slurm_ckpt.__file__)
    cases = {"/x/site-packages/torch/distributed/distributed_c10d.py": "collective",
             os.path.join(pkg, "store", "commit.py"): "checkpoint",
             "/home/u/train.py": "compute"}  # fmt: skip
    # DTensor's full_tensor() waits in wait_tensor under torch's dispatch frames (measured, torch 2.13)
    dispatch = ["/x/torch/_ops.py", "/x/torch/_library/autograd.py", "/x/torch/_library/autograd.py",
                "/x/torch/_ops.py"]  # fmt: skip
    stacks = [*(([f], want) for f, want in cases.items()),
              (["/home/u/train.py", "/x/torch/distributed/_functional_collectives.py", *dispatch], "collective"),
              (["/x/torch/distributed/elastic/multiprocessing/errors/__init__.py", "/home/u/train.py"], "compute")]  # fmt: skip
    for files, want in stacks:
        t, ev = _parked(*files)
        try:
            assert where_is(t.ident) == want, files
        finally:
            ev.set()
            t.join()


def test_heartbeat_only_when_the_wrapper_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    with ControlServer() as server:
        monkeypatch.delenv(PROGRESS_ENV, raising=False)
        quiet = Control(channel=server.path)
        quiet.progress(3)
        assert quiet._beat is None and server.receive() == []
        monkeypatch.setenv(PROGRESS_ENV, "0.05")
        c = Control(channel=server.path)
        c.progress(3)
        c.progress(4)
        assert c._beat is not None
        got: list[Message] = []
        while len(got) < 2:
            import select

            select.select([server], [], [], 5)
            got += server.receive()
        assert got[-1] == Message("progress", pid=os.getpid(), step=4, where="compute")
    c._beat.join(5)  # the wrapper's socket is gone: the heartbeat stops, and writes no file
    assert not c._beat.is_alive() and not Path(server.path).parent.exists()


def test_hang_timeout_is_validated() -> None:
    WrapperConfig(hang_timeout=0).validate()
    WrapperConfig(hang_timeout=2).validate()
    with pytest.raises(ConfigError, match="hang_timeout"):
        WrapperConfig(hang_timeout=0.5).validate()


def _wrapper(tmp_path: Path, timeout: str, child: str) -> tuple[int, list[dict[str, str]]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_CKPT_DIR=str(tmp_path / "ckpt"), PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-c", "from slurm_ckpt.cli import main; main()", "run", "--local",
            "--hang-timeout", timeout, "--", sys.executable, "-c", textwrap.dedent(child)]  # fmt: skip
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    return r.returncode, [e for e in map(parse_event, r.stderr.splitlines()) if e]


CHILD = """
    import time
    from slurm_ckpt.control import Control
    c = Control()
    c.install()
    for step in range({steps}):
        c.progress(step)
        time.sleep(0.1)
    c.progress({steps})
    {then}
"""


def test_a_hung_child_is_ended_and_reported(tmp_path: Path) -> None:
    code, events = _wrapper(tmp_path, "2", CHILD.format(steps=5, then="time.sleep(3600)"))
    hang = [e for e in events if e["event"] == "hang"]
    assert code == 124 and len(hang) == 1
    _pid, step, where, idle = hang[0]["ranks"].split(":")
    assert (step, where) == ("5", "compute") and float(idle) >= 2
    assert [e["reason"] for e in events if e["event"] == "no-requeue"] == ["local"]


def test_a_child_that_makes_progress_is_left_alone(tmp_path: Path) -> None:
    code, events = _wrapper(tmp_path, "2", CHILD.format(steps=40, then="pass"))  # 4 s of steps
    assert code == 0 and not [e for e in events if e["event"] == "hang"]


def test_the_next_run_clears_the_earlier_runs_reports_only(tmp_path: Path) -> None:
    report = NodeReport("n1", (RankProgress(1, 5, "collective", 10.0),))
    for job, run in (("7", 0), ("7", 1), ("7", 2), ("8", 0)):
        write_report(tmp_path / ".watchdog" / f"job_{job}.{run}", report)
    clear_reports(tmp_path, "7", 2)
    assert sorted(p.name for p in (tmp_path / ".watchdog").iterdir()) == ["job_7.2", "job_8.0"]
    clear_reports(tmp_path, "7", 3)
    clear_reports(tmp_path, "8", 1)
    assert not (tmp_path / ".watchdog").exists()


FROZEN_CHILD = """
    import os, signal, sys, time
    from slurm_ckpt.control import Control
    c = Control()
    c.install()
    for step in range(6):
        c.progress(step)
        time.sleep(0.1)
    time.sleep(1.5)  # one heartbeat (every 1.25 s) tells the wrapper of step 5
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getppid()} {os.getpid()}")
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    os.kill(os.getppid(), signal.SIGSTOP)  # the wrapper, then this rank: the node freezes whole
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.5)  # thawed, still at step 5: the wrapper hears no new step before it looks
    for step in range(6, 20):
        c.progress(step)
        time.sleep(0.1)
"""


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "T"


@pytest.mark.slow  # the freeze outlasts the 5 s timeout
def test_a_wrapper_thawed_with_its_ranks_reports_no_hang(tmp_path: Path) -> None:
    """A wrapper stopped with its ranks (SIGSTOP, a frozen node) for longer than the timeout
    did not see them idle: thawed, it reports no hang, and the ranks go on and finish.

    The watched idle time stays under the 5 s timeout: up to 1.5 s before the freeze, 1 s
    of the wrapper's wake-up slack, 0.5 s after the thaw and one 1.25 s heartbeat."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_CKPT_DIR=str(tmp_path / "ckpt"), PYTHONPATH=str(ROOT))
    pids = tmp_path / "pids"
    argv = [sys.executable, "-c", "from slurm_ckpt.cli import main; main()", "run", "--local",
            "--hang-timeout", "5", "--", sys.executable, "-c", textwrap.dedent(FROZEN_CHILD), str(pids)]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (pids.exists() and all(map(_stopped, map(int, pids.read_text().split())))):
            assert time.monotonic() < deadline and proc.poll() is None, "the child never froze"
            time.sleep(0.05)
        wrapper, child = map(int, pids.read_text().split())
        assert wrapper == proc.pid
        time.sleep(7)  # the freeze itself, longer than the 5 s timeout (not a synchronisation)
        for pid in (wrapper, child):  # thawed, as Slurm does (SIGCONT) when it ends the job
            os.kill(pid, signal.SIGCONT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    events = [e for e in map(parse_event, err.splitlines()) if e]
    assert not [e for e in events if e["event"] == "hang"], err
    assert proc.returncode == 0, err
