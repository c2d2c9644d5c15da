"""``slurm-ckpt run``: run a training command so that a warning signal or a
preemption becomes a committed checkpoint and a requeue.

Usage (one wrapper per task)::

    srun slurm-ckpt run [--signal USR1] [--max-requeues N] [--margin S] -- python train.py
    slurm-ckpt run --local [--preempt-after S]... -- python train.py

What it does, in order:

1. **Start.** The command starts with ``SLURM_CKPT_DIR`` (absolute run dir),
   ``SLURM_CKPT_SCRATCH`` (when the prolog made one), ``SLURM_CKPT_CONTROL``
   (a Unix datagram socket) and ``SLURM_CKPT_SIGNAL`` set, and with the
   checkpoint signal and SIGTERM set to SIG_IGN, so neither can kill it before
   the library installs its flag handler. The library then reports ``ready``.
2. **Trap.** The checkpoint signal (``--signal``, USR1 by default) and SIGTERM
   both request a checkpoint; SIGCONT (Slurm sends it first) is left alone;
   SIGINT marks the run cancelled. ``--preempt-after S`` makes the wrapper send
   itself the signal S seconds after the command started (in every mode; in
   ``--local`` mode the i-th value applies to the i-th run).
3. **Ask.** On the first request the wrapper sends the checkpoint signal (never
   SIGTERM, which would kill a launcher such as torchrun) to the command and to
   every process that reported ``ready``. A request that came before a process
   was ready is sent to it again when its ``ready`` arrives, so it is held, never
   lost. Later signals do nothing, except that a SIGTERM shortens the deadline.
4. **Wait** until the command exits, or until the deadline:

   * ``EndTime - margin`` from Slurm, when that is still ahead;
   * else ``max(kill_wait - margin, kill_wait / 2)`` from now (SIGKILL follows
     SIGTERM after KillWait), which also caps the deadline after any SIGTERM;
   * with no end time (``--local``, no time limit): ``wrapper.wait`` seconds.

   At the deadline the command is ended. In every case the command's whole
   process tree is gone before the wrapper goes on (see ``proctree``).
5. **Decide** (``policy.decide_requeue``), then requeue or exit:

   * a command that exits non-zero on its own crashed: its code is passed
     through and nothing is requeued;
   * without a request nothing is requeued (the run simply ended);
   * only global rank 0 (``SLURM_PROCID`` 0) requeues, exactly once;
   * never after a cancel. Cancel vs preemption, from ``scontrol show job``
     when the request comes and again at decision time (``policy.cancel_reason``):
     ``scancel JOB`` makes the job COMPLETING (22.05's CLI hides the CANCELLED
     underneath) *before its time limit* (StartTime + TimeLimit), or CANCELLED
     once done; a time limit makes it COMPLETING only at or after that limit;
     ``scancel --signal=TERM`` and a preemption with GraceTime leave it RUNNING;
     SIGINT is a cancel too. If Slurm has already requeued the job itself
     (``Restarts`` grew: PreemptMode=REQUEUE), the wrapper reports that and
     exits 0. Limitation: with PreemptMode=CANCEL a preemption that sends only
     SIGTERM looks like a scancel and is not requeued;
   * not when ``SLURM_RESTART_COUNT >= --max-requeues``;
   * not when no checkpoint newer than the one present at start was committed
     during this run (reported on the channel, or found valid in the run dir);
   * requeue: pyslurm if it imports, else ``scontrol requeue JOB`` (array task:
     ``ARRAYJOB_TASK``); "Job is pending execution" counts as success. Without
     any Slurm client the wrapper exits ``wrapper.requeue_exit`` (non-zero) so
     that slurm.conf ``RequeueExit=<code>`` requeues the job.

   Exit status: 0 after a requeue (Slurm must not count a failure); otherwise
   the command's own code (128+N if it died of signal N, 137 if killed at
   the deadline).

Hang watchdog (``--hang-timeout S``, ``wrapper.hang_timeout``; off by default).
The command starts with ``SLURM_CKPT_PROGRESS`` set, and the library's ranks
send a heartbeat with their last step (``Checkpointer.maybe_save`` or
``progress``) and where their main thread is (see ``watchdog``). When no rank
of this node has reached a new step for S seconds (a rank inside a save or a
load counts as progressing):

* the wrapper ends its ranks at once, with no checkpoint request: a rank stuck
  in a collective cannot save, and the newest committed checkpoint stays what
  the job resumes from;
* it writes the node's report to ``<run dir>/.watchdog/job_<id>.<restarts>/`` (global
  rank 0 of the next run removes it);
* global rank 0's wrapper gathers the reports of the job's nodes (for up to S
  more seconds), and ``policy.decide_hang`` blames a node: one whose rank
  stopped in its own code while the others waited in a collective, else one
  behind the others' step, else one that never reported (its wrapper is gone);
* rank 0 requeues the job, then sets ``ExcNodeList`` (earlier exclusions kept)
  and, when the partition has fewer nodes left than the job asks, ``NumNodes``
  and ``NumTasks``; it drops the node from a ``ReqNodeList`` (``sbatch -w``),
  which would otherwise keep the job pending with Reason=BadConstraints (Slurm
  22.05 takes these fields only once the job is pending again).

A hang exits ``HANG_EXIT`` (124) where nothing is requeued, 0 after a requeue.
A command that never reports progress is never taken for hung, and time the
wrapper itself did not run (stopped with its ranks: a frozen node) does not
count as its ranks' idle time.

Log lines (stderr, see ``events``), ``slurm-ckpt run: event=NAME key=value…``:
``start`` (run, rank, job, restarts, max_requeues, baseline, dir), ``child-start``
(pid), ``preempt-after``, ``signal`` (signal, action=request|cancel|ignored…|
tighten-deadline), ``request`` (deadline_in, end_time, job_state), ``forward``
(pids), ``ready`` (pid), ``committed`` (step, path), ``deadline``, ``teardown``
(terminated, killed, stragglers), ``child-exit`` (code, killed), ``requeue``
(job, via, already), ``no-requeue`` (reason, msg), ``restart`` (run),
``hang`` (node, timeout, ranks as pid:step:where:idle), ``hang-decision``
(reason, bad, exclude, reported, nodes, msg), ``exit`` (code). Every line after the first request carries ``t``, seconds
since that request. ``no-requeue`` reasons: crashed, not-requested,
not-rank-0, cancelled, max-requeues, no-progress, requeue-failed, no-scontrol;
after a hang: hang-unlocated, not-rank-0, max-requeues, no-nodes-left, local.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from .._env import default_run_dir
from ..config import Config, WrapperConfig, job_dir_name
from ..control import parse_signal
from ..errors import ConfigError, SlurmError
from ..node.cgroup import join_io_cgroup
from ..protocol import CONTROL_ENV, PROGRESS_ENV, SIGNAL_ENV
from ..slurm import SlurmCommandMissing, SlurmEnv
from ..store import find_latest
from ..store.layout import fast_dir
from .backend import JobBackend, LocalJob, SlurmJob
from .channel import ControlServer
from .events import Events
from .policy import Decision, HangDecision, HangFacts, RunFacts, decide_hang, decide_requeue
from .proctree import become_subreaper
from .supervisor import RunResult, SignalTrap, Supervisor, Timing
from .watchdog import Watchdog, clear_reports, gather, heartbeat_interval, report_dir, write_report

__all__ = ["HANG_EXIT", "Decision", "HangDecision", "HangFacts", "RunFacts", "decide_hang", "decide_requeue",
           "run_wrapper"]  # fmt: skip

log = logging.getLogger("slurm_ckpt")

REQUEUE_BUDGET = 30.0
"""Seconds the requeue RPC may take, retries included."""
HANG_EXIT = 124
"""The wrapper's exit status after a hang that it did not requeue (as timeout(1))."""


def run_wrapper(
    argv: Sequence[str],
    cfg: Config,
    *,
    local: bool = False,
    preempt_after: Sequence[float] = (),
    run_dir: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run ``argv`` under the wrapper protocol; return the exit status for the wrapper."""
    if not argv:
        raise ConfigError("no command given: slurm-ckpt run [OPTIONS] -- CMD...")
    env = dict(os.environ if env is None else env)
    w: WrapperConfig = cfg.wrapper
    sig = parse_signal(w.signal)
    slurm = SlurmEnv.from_env(env)
    if not local and not slurm.in_job:
        raise ConfigError("not inside a Slurm job (no SLURM_JOB_ID); use --local to run outside Slurm")
    job: JobBackend = LocalJob() if local else SlurmJob(slurm)
    ckpt_dir = Path(run_dir or env.get("SLURM_CKPT_DIR") or default_run_dir(cfg)).absolute()
    child_env = _child_env(env, cfg, slurm, ckpt_dir, sig.name.removeprefix("SIG"))
    timing = Timing(margin=w.margin, kill_wait=w.kill_wait, wait=w.wait)
    rank = 0 if local else slurm.procid
    restarts = 0 if local else slurm.restart_count
    node = slurm.node or socket.gethostname().split(".")[0]
    if w.hang_timeout:
        child_env[PROGRESS_ENV] = f"{heartbeat_interval(w.hang_timeout):g}"
    if rank == 0 and restarts:
        clear_reports(ckpt_dir, slurm.job_id, restarts)  # the earlier runs' hang reports
    become_subreaper()
    # The prolog's per-job I/O cgroup (v1 blkio): joined before the child starts,
    # so the trainer and every worker it forks inherit the job's I/O limits.
    join_io_cgroup(env=env)
    with ControlServer() as server, SignalTrap([sig, _TERM, _INT, _CHLD]) as trap:
        child_env[CONTROL_ENV] = server.path
        run_no = 1
        while True:
            events = Events(rank=rank, run=run_no)
            dirs = _search_dirs(child_env, ckpt_dir)
            baseline = _newest_step(dirs)
            events.emit("start", mode="local" if local else "slurm", job=slurm.job_id or None,
                        restarts=restarts, max_requeues=w.max_requeues,
                        baseline=baseline, dir=str(ckpt_dir))  # fmt: skip
            after = preempt_after[run_no - 1] if run_no <= len(preempt_after) else None
            watchdog = Watchdog(w.hang_timeout) if w.hang_timeout else None
            res = Supervisor(argv, child_env, sig=sig, job=job, timing=timing, trap=trap, server=server,
                             events=events, preempt_after=after, watchdog=watchdog, node=node).run()  # fmt: skip
            if res.hang is not None:
                if isinstance(job, SlurmJob):
                    return _exit(events, _after_hang(res, job, child_env, rank, restarts, w, ckpt_dir, events))
                events.emit("no-requeue", reason="local", msg="a hang outside Slurm ends the run")
                return _exit(events, HANG_EXIT)
            decision = _decide(res, job, rank, restarts, w.max_requeues, baseline, dirs)
            if decision.reason == "already-requeued":
                events.emit("requeue", via="slurm", already=True, msg=decision.detail)
                return _exit(events, 0)
            if not decision.requeue:
                if res.requested or res.cancelled or decision.reason == "crashed":
                    events.emit("no-requeue", reason=decision.reason, msg=decision.detail)
                return _exit(events, res.code)
            if local:
                restarts += 1
                run_no += 1
                child_env["SLURM_RESTART_COUNT"] = str(restarts)  # as Slurm sets it after a requeue
                events.emit("restart", run=run_no, msg=decision.detail)
                continue
            return _exit(events, _requeue(job, res, events, w))


_TERM, _INT, _CHLD = (parse_signal(s) for s in ("TERM", "INT", "CHLD"))


def _exit(events: Events, code: int) -> int:
    events.emit("exit", code=code)
    return code


def _decide(
    res: RunResult, job: JobBackend, rank: int, restarts: int, max_requeues: int,
    baseline: int | None, dirs: list[Path],
) -> Decision:  # fmt: skip
    """Gather the facts of the run that just ended; ``policy.decide_requeue`` decides."""
    new_step = res.committed_step
    if res.committed_path:
        dirs = [*dirs, Path(res.committed_path).parent]
    scanned = _newest_step(dirs)
    if scanned is not None and (new_step is None or scanned > new_step) and scanned != baseline:
        new_step = scanned  # a command that checkpoints without the library
    facts = RunFacts(
        requested=res.requested, cancelled=res.cancelled, rank=rank, restarts=restarts,
        max_requeues=max_requeues, baseline_step=baseline, new_step=new_step,
        exit_code=res.code if res.status is not None else None, killed_at_deadline=res.killed_at_deadline,
    )  # fmt: skip
    if facts.needs_job and not job.local:
        facts = dataclasses.replace(facts, job=job.job_info(), now=time.time())
    return decide_requeue(facts)


def _requeue(job: JobBackend, res: RunResult, events: Events, w: WrapperConfig) -> int:
    try:
        out = job.requeue(REQUEUE_BUDGET)
    except SlurmCommandMissing as e:
        if w.requeue_exit:
            events.emit("requeue", via="RequeueExit", code=w.requeue_exit,
                        msg="no Slurm client on this node; exiting with the RequeueExit code")  # fmt: skip
            return w.requeue_exit
        events.emit("no-requeue", reason="no-scontrol", msg=str(e))
        return res.code
    except SlurmError as e:
        events.emit("no-requeue", reason="requeue-failed", msg=str(e))
        return res.code
    events.emit("requeue", job=out.job_id, via=out.via, already=out.already, attempts=out.attempts)
    return 0


def _after_hang(
    res: RunResult, job: SlurmJob, env: dict[str, str], rank: int, restarts: int, w: WrapperConfig,
    ckpt_dir: Path, events: Events,
) -> int:  # fmt: skip
    """Report this node's stall; on global rank 0, gather the nodes' reports, decide, requeue."""
    assert res.hang is not None
    where = report_dir(ckpt_dir, job.env.job_id, restarts)
    try:
        write_report(where, res.hang)
    except OSError as e:
        events.emit("hang-report", msg=f"cannot write the node's report in {where}: {e}")
    if rank != 0:
        events.emit("no-requeue", reason="not-rank-0", msg="after a hang, global rank 0 decides and requeues")
        return HANG_EXIT
    try:
        nodes = job.nodes(env)
    except SlurmError as e:
        events.emit("no-requeue", reason="requeue-failed", msg=str(e))
        return HANG_EXIT
    reports = gather(where, nodes, time.monotonic() + w.hang_timeout)
    info = job.job_info()
    try:
        placement = job.placement(info)
    except SlurmError as e:
        log.warning("cannot read the job's node placement: %s", e)
        placement = {}
    d = decide_hang(HangFacts(timeout=w.hang_timeout, nodes=nodes, reports=reports, rank=rank,
                              restarts=restarts, max_requeues=w.max_requeues, **placement))  # fmt: skip
    events.emit("hang-decision", reason=d.reason, bad=",".join(d.bad) or None, exclude=",".join(d.exclude) or None,
                reported=len(reports), nodes=len(nodes), msg=d.detail)  # fmt: skip
    if not d.requeue:
        events.emit("no-requeue", reason=d.reason, msg=d.detail)
        return HANG_EXIT
    try:
        out = job.requeue(REQUEUE_BUDGET)
        fields = {"ExcNodeList": ",".join(d.exclude)}
        if d.required is not None:
            fields["ReqNodeList"] = ",".join(d.required)  # empty clears it
        if d.num_nodes is not None:
            fields["NumNodes"] = str(d.num_nodes)
        if d.num_tasks is not None:
            fields["NumTasks"] = str(d.num_tasks)
        job.exclude(fields)
    except SlurmError as e:
        events.emit("no-requeue", reason="requeue-failed", msg=str(e))
        return HANG_EXIT
    events.emit("requeue", job=out.job_id, via=out.via, already=out.already, attempts=out.attempts,
                exclude=fields["ExcNodeList"], num_nodes=d.num_nodes, num_tasks=d.num_tasks)  # fmt: skip
    return 0


def _child_env(
    env: dict[str, str], cfg: Config, slurm: SlurmEnv, ckpt_dir: Path, sig_name: str
) -> dict[str, str]:
    out = dict(env)
    out["SLURM_CKPT_DIR"] = str(ckpt_dir)
    out[SIGNAL_ENV] = sig_name
    cfg.engine.torch_env(out)
    if not out.get("SLURM_CKPT_SCRATCH") and slurm.job_id and cfg.scratch.base:
        # The prolog's per-job scratch, when the TaskProlog did not export it.
        guess = Path(cfg.scratch.base) / job_dir_name(slurm.job_id)
        if guess.is_dir() and os.access(guess, os.W_OK):
            out["SLURM_CKPT_SCRATCH"] = str(guess)
    return out


def _search_dirs(env: dict[str, str], ckpt_dir: Path) -> list[Path]:
    dirs = [ckpt_dir]
    scratch = env.get("SLURM_CKPT_SCRATCH")
    if scratch:
        dirs.append(fast_dir(Path(scratch)))
    return dirs


def _newest_step(dirs: list[Path]) -> int | None:
    """Step of the newest checkpoint that passes the quick check (sizes, headers)."""
    try:
        cand = find_latest(dirs, full=False)
    except OSError as e:
        log.warning("cannot scan %s for checkpoints: %s", ", ".join(map(str, dirs)), e)
        return None
    return cand.step if cand else None

