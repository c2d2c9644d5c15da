"""slurm.conf checks, and whether a checkpoint fits in the time Slurm gives it.

Facts for Slurm 22.05 (see the design doc): time limit, requeue and preemption
all end a job with SIGTERM, then SIGKILL after KillWait; ``--signal=USR1@N``
warns N seconds ahead only for the time limit; preemption sends the user
signal only with ``SlurmctldParameters=preempt_send_user_signal`` (23.02+:
``PreemptParameters=send_user_signal``); a process still in a write
UnkillableStepTimeout after SIGKILL drains the node.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from .finding import Context, Report, Severity, fmt_bytes, fmt_rate

__all__ = ["SlurmConf", "check_slurm_conf", "check_timing", "find_slurm_conf"]

_DURATION = re.compile(r"^\d+$")


class SlurmConf:
    """The global ``Key=Value`` settings of a slurm.conf (keys case-insensitive) and its partitions."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.values: dict[str, str] = {}
        self.partitions: dict[str, dict[str, str]] = {}
        self._read(path, depth=0)

    def _read(self, path: Path, depth: int) -> None:
        for raw in path.read_text(errors="replace").splitlines():
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if line.lower().startswith("include ") and depth < 8:
                inc = Path(line.split(None, 1)[1].strip())
                inc = inc if inc.is_absolute() else path.parent / inc
                if inc.is_file():
                    self._read(inc, depth + 1)
                continue
            pairs = [p.split("=", 1) for p in line.split() if "=" in p]
            if not pairs:
                continue
            first = pairs[0][0].lower()
            if first == "partitionname":
                self.partitions[pairs[0][1]] = {k.lower(): v for k, v in pairs[1:]}
            elif first not in ("nodename", "nodeset", "frontendname", "downnodes", "switchname"):
                for k, v in pairs:
                    self.values[k.lower()] = v

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key.lower(), default)

    def seconds(self, key: str, default: int) -> int:
        v = self.get(key)
        return int(v) if v is not None and _DURATION.match(v) else default

    def flags(self, key: str) -> set[str]:
        return {f.strip().lower() for f in (self.get(key) or "").split(",") if f.strip()}


def find_slurm_conf(explicit: str | None = None) -> Path | None:
    """``explicit``, else ``$SLURM_CONF`` (both returned even if missing: the caller
    says so), else the first of Debian's and Slurm's default paths that exists."""
    named = explicit or os.environ.get("SLURM_CONF")
    if named:
        return Path(named)
    for cand in ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf", "/usr/local/etc/slurm.conf"):
        if Path(cand).is_file():
            return Path(cand)
    return None


def check_slurm_conf(report: Report, ctx: Context, conf: SlurmConf) -> None:
    add, where = report.add, str(conf.path)
    if conf.get("JobRequeue") == "0":
        add("slurm", Severity.WARN, f"JobRequeue=0 in {where}: batch jobs cannot be requeued by default",
            "set JobRequeue=1, or make users pass sbatch --requeue")  # fmt: skip
    else:
        add("slurm", Severity.OK, f"JobRequeue={conf.get('JobRequeue', '1 (default)')}")
    for hook, what in (("Prolog", "no per-job node-local scratch is created"),
                       ("Epilog", "checkpoints left on node-local scratch are lost when the job ends")):  # fmt: skip
        val = conf.get(hook)
        if not val:
            add("slurm", Severity.WARN, f"no {hook} in {where}: {what}",
                f"{hook}=/usr/lib/slurm-ckpt/{hook.lower()} (the slurm-ckpt shim)")  # fmt: skip
        elif "slurm-ckpt" not in val and "slurm_ckpt" not in val:
            add("slurm", Severity.INFO, f"{hook}={val} does not look like the slurm-ckpt shim",
                f"make sure it runs `slurm-ckpt node {hook.lower()}`")  # fmt: skip
        else:
            add("slurm", Severity.OK, f"{hook}={val}")
    pflags = conf.flags("PrologFlags")
    if not pflags & {"alloc", "contain"}:
        add("slurm", Severity.WARN, f"PrologFlags={conf.get('PrologFlags', '(unset)')}: the Prolog runs "
            "at a node's first srun, after the batch script started, so scratch is missing until then",
            "add PrologFlags=Alloc")  # fmt: skip
    else:
        add("slurm", Severity.OK, f"PrologFlags={conf.get('PrologFlags')}")
    _check_preemption(report, conf)


def _preempting(conf: SlurmConf) -> bool:
    ptype = (conf.get("PreemptType") or "preempt/none").lower()
    modes = {m.lower() for v in [conf.get("PreemptMode") or ""] +
             [p.get("preemptmode", "") for p in conf.partitions.values()] for m in v.split(",")}  # fmt: skip
    return ptype != "preempt/none" and bool(modes & {"requeue", "cancel"})


def _check_preemption(report: Report, conf: SlurmConf) -> None:
    if not _preempting(conf):
        return
    if "preempt_send_user_signal" in conf.flags("SlurmctldParameters") or \
            "send_user_signal" in conf.flags("PreemptParameters"):  # fmt: skip
        report.add("slurm", Severity.OK, "preempted jobs get the --signal user signal first")
    else:
        report.add("slurm", Severity.WARN, "preemption is on but preempted jobs get only SIGTERM "
                   "(KillWait seconds before SIGKILL), not the --signal warning",
                   "set SlurmctldParameters=preempt_send_user_signal (Slurm 22.05; "
                   "PreemptParameters=send_user_signal from 23.02)")  # fmt: skip


def check_timing(report: Report, ctx: Context, conf: SlurmConf | None) -> None:
    """Does one checkpoint fit in the lead time, KillWait(+GraceTime) and the other timeouts?"""
    if not ctx.ckpt_size:
        report.add("timing", Severity.INFO, "checkpoint size unknown: the lead-time check was skipped",
                   "pass --ckpt-size 40G, or point doctor at a run dir that holds a checkpoint")  # fmt: skip
        return
    if ctx.bandwidth <= 0:
        report.add("timing", Severity.INFO, "no bandwidth measured: the lead-time check was skipped")
        return
    need = ctx.ckpt_size / ctx.bandwidth
    size, bw = fmt_bytes(ctx.ckpt_size), fmt_rate(ctx.bandwidth)
    lead = ctx.lead_time
    suggest = int(math.ceil((need * 1.5 + 30) / 10) * 10)
    data = {"needed_s": round(need, 1), "lead_time_s": lead, "checkpoint_bytes": ctx.ckpt_size,
            "bandwidth_bytes_per_s": round(ctx.bandwidth)}  # fmt: skip
    msg = f"your {size} checkpoint needs ~{need:.0f} s at {bw}; your lead time is {lead:.0f} s"
    if not ctx.lead_time_given:
        msg += " (assumed; pass --lead-time)"
    fix = f"sbatch --signal=USR1@{suggest} (or save to node-local scratch, which drains later)"
    if need > lead:
        report.add("timing", Severity.ERROR, msg + ": the emergency checkpoint will be cut off", fix, **data)
    elif need > 0.7 * lead:
        report.add("timing", Severity.WARN, msg + ": little margin", fix, **data)
    else:
        report.add("timing", Severity.OK, msg, **data)
    if conf is None:
        return
    kill_wait = conf.seconds("KillWait", 30)
    if _preempting(conf):
        grace = max((int(p.get("gracetime", "0")) for p in conf.partitions.values()
                     if p.get("gracetime", "").isdigit()), default=0)  # fmt: skip
        budget = kill_wait + grace
        if need > budget:
            report.add("timing", Severity.WARN, f"a preempted job has GraceTime+KillWait = {budget} s; "
                       f"the checkpoint needs ~{need:.0f} s", "raise the partitions' GraceTime, or "
                       "save to node-local scratch on preemption", grace_s=grace, kill_wait_s=kill_wait)  # fmt: skip
    unkillable = conf.seconds("UnkillableStepTimeout", 60)
    if need > kill_wait + unkillable:
        report.add("timing", Severity.WARN, f"a save still writing at SIGKILL stays unkillable; after "
                   f"UnkillableStepTimeout={unkillable} s Slurm drains the node (save needs ~{need:.0f} s)",
                   f"UnkillableStepTimeout={suggest}", unkillable_s=unkillable)  # fmt: skip
    pet = conf.seconds("PrologEpilogTimeout", 0)
    if pet and need > pet:
        report.add("timing", Severity.WARN, f"the epilog's stage-out of one checkpoint needs ~{need:.0f} s "
                   f"but PrologEpilogTimeout={pet}", f"PrologEpilogTimeout={suggest}",
                   prolog_epilog_timeout_s=pet)  # fmt: skip
