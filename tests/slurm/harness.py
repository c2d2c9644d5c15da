"""Drive the private test cluster of ``tests/slurm/cluster.sh`` from Python.

:class:`Cluster` starts and stops it through the script (the single source of
its configuration), runs Slurm commands against it and submits jobs;
:class:`Job` polls one job's state with a deadline, reads its output and skips
the ~121 s requeue wait. Every wait polls ``scontrol`` until a condition holds
or a deadline passes; nothing sleeps in place of synchronisation.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

__all__ = [
    "FINISHED",
    "HERE",
    "REPO",
    "SETTINGS",
    "VENV_BIN",
    "Cluster",
    "ClusterError",
    "Job",
    "parse_record",
    "poll",
]

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SCRIPT = HERE / "cluster.sh"
VENV_BIN = REPO / ".venv" / "bin"
FINISHED = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
    "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
})  # fmt: skip
# The harness's own settings (root, lock, ports, subnet), read once at import:
# the suite's autouse fixture clears SLURM_CKPT_* from os.environ in each test.
SETTINGS = {k: v for k, v in os.environ.items() if k.startswith("SLURM_CKPT_CLUSTER_")}
_KEY = re.compile(r"(?:^|\s)([A-Z][A-Za-z0-9_:/]*)=")

T = TypeVar("T")


class ClusterError(RuntimeError):
    """The cluster could not start, or a Slurm command failed; carries the output."""


def parse_record(line: str) -> dict[str, str]:
    """``Key=Value Key=Value`` (``scontrol show -o``, jobcomp) -> dict; values may hold spaces."""
    matches = list(_KEY.finditer(line))
    out: dict[str, str] = {}
    for m, nxt in zip(matches, [*matches[1:], None], strict=True):
        out.setdefault(m.group(1), line[m.end() : nxt.start() if nxt else len(line)].strip())
    return out


def poll(what: str, check: Callable[[], T | None], timeout: float, interval: float = 0.2,
         on_timeout: Callable[[], str] | None = None) -> T:  # fmt: skip
    """Call ``check`` until it returns a value that is not None; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{on_timeout()}" if on_timeout else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{extra}")
        time.sleep(interval)


@dataclass
class Cluster:
    """A running (or about to run) test cluster rooted at ``root``."""

    root: Path = field(default_factory=lambda: Path(
        SETTINGS.get("SLURM_CKPT_CLUSTER_ROOT", "/tmp/slurm-ckpt-cluster")))  # fmt: skip
    nodes: int = 1
    settings: dict[str, str] = field(default_factory=dict)
    """Per-test slurm.conf settings now in effect (extra.conf)."""
    base_settings: dict[str, str] = field(default_factory=dict)
    """The settings the cluster started with; tests put them back."""
    attached: bool = False
    """Started by someone else (``attach``): never stopped, and only our jobs are cancelled."""
    submitted: list[str] = field(default_factory=list)

    @classmethod
    def attach(cls) -> Cluster:
        """The cluster already running (``cluster.sh up`` by hand), as it is."""
        c = cls(attached=True)
        try:
            c.nodes = int((c.root / "nodes").read_text())
            lines = (c.root / "etc" / "extra.conf").read_text().splitlines()
        except (OSError, ValueError) as e:
            raise ClusterError(f"no running cluster in {c.root}: {e}") from e
        kv = (ln.split("=", 1) for ln in lines if "=" in ln and not ln.lstrip().startswith("#"))
        c.base_settings = {k.strip(): v.strip() for k, v in kv}
        c.settings = dict(c.base_settings)
        c.run("scontrol", "ping")
        return c

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def shared(self) -> Path:
        """Durable storage that every node sees."""
        return self.root / "shared"

    @property
    def scratch(self) -> Path:
        """Node-local scratch: the same path on every node, a different tmpfs on each."""
        return self.root / "scratch"

    @property
    def node_names(self) -> list[str]:
        if self.nodes == 1:
            return [os.uname().nodename.split(".")[0]]
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    def node_addr(self, node: str) -> str:
        """The address a node's slurmd (and its jobs) listen on; MASTER_ADDR for rank 0."""
        if self.nodes == 1:
            return "127.0.0.1"
        return f"{SETTINGS.get('SLURM_CKPT_CLUSTER_NET', '10.77.0')}.{10 + int(node[4:])}"

    def node_link(self, node: str) -> str:
        """Host end of ``node``'s veth: ``ip link set <it> down`` cuts the node off."""
        if self.nodes == 1:
            raise ClusterError("a one-node cluster runs in the host network; it has no link")
        return f"{SETTINGS.get('SLURM_CKPT_CLUSTER_VETH', 'sckv')}{int(node[4:])}"

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(SETTINGS)
        env.update(SLURM_CONF=str(self.conf), SLURM_CKPT_CLUSTER_ROOT=str(self.root))
        env.update(extra or {})
        return env

    # -- lifecycle (all through cluster.sh) ---------------------------------
    def _script(self, *args: str, timeout: float, env: Mapping[str, str] | None = None) -> None:
        env = self.env(env)
        proc = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True,
                              text=True, timeout=timeout, check=False)  # fmt: skip
        if proc.returncode != 0:
            raise ClusterError(f"cluster.sh {' '.join(args)} failed ({proc.returncode}):\n"
                               f"{proc.stdout}{proc.stderr}")  # fmt: skip

    def up(self, *, owner: int | None = None, lock_timeout: float = 1800) -> None:
        """Start the cluster; first wait up to ``lock_timeout`` s for the machine-wide lock."""
        args = ["up", "--nodes", str(self.nodes)]
        if owner:
            args += ["--owner", str(owner)]
        for key, value in self.settings.items():
            args += ["--set", f"{key}={value}"]
        self._script(*args, timeout=lock_timeout + 180,
                     env={"SLURM_CKPT_CLUSTER_LOCK_TIMEOUT": str(int(lock_timeout))})  # fmt: skip

    def down(self) -> None:
        self._script("down", timeout=180)

    def configure(self, settings: Mapping[str, str | int | None]) -> None:
        """Apply per-test slurm.conf settings (None removes one) and ``scontrol reconfigure``.

        Anything slurm.conf accepts: ``Prolog``, ``Epilog``, ``TaskProlog``,
        ``PrologFlags``, ``PrologEpilogTimeout``, ``KillWait``... A key set here
        overrides the generated default.
        """
        for key, value in settings.items():
            if value is None:
                self.settings.pop(key, None)
            else:
                self.settings[key] = str(value)
        args = ["reconfigure"]
        for key, value in self.settings.items():
            args += ["--set", f"{key}={value}"]
        self._script(*args, timeout=120)

    def logs(self, lines: int = 30) -> str:
        """Tails of the daemon logs, for failure messages."""
        out = []
        for path in sorted((self.root / "log").glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"----- {path}\n" + "\n".join(text))
        return "\n".join(out)

    # -- commands --------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> str:
        """Run a Slurm command (``scontrol``, ``squeue``...) against this cluster; its stdout."""
        proc = subprocess.run(list(argv), env=self.env(), capture_output=True, text=True,
                              timeout=timeout, check=False)  # fmt: skip
        if check and proc.returncode != 0:
            raise ClusterError(f"{shlex.join(argv)} exited {proc.returncode}: "
                               f"{proc.stderr.strip() or proc.stdout.strip()}")  # fmt: skip
        return proc.stdout

    def node_state(self, node: str) -> str:
        return parse_record(self.run("scontrol", "show", "node", "-o", node)).get("State", "")

    def slurmd_pid(self, node: str) -> int:
        return int((self.root / "run" / f"slurmd-{node}.pid").read_text())

    def on_node(self, node: str, path: str | Path) -> Path:
        """``path`` as ``node`` sees it (through its slurmd's mount namespace), e.g. its scratch."""
        return Path(f"/proc/{self.slurmd_pid(node)}/root") / Path(path).relative_to("/")

    def exec_on(self, node: str, *argv: str, check: bool = True) -> str:
        """Run ``argv`` inside ``node``'s namespaces (network, hostname, mounts)."""
        proc = subprocess.run(["bash", str(SCRIPT), "exec", node, "--", *argv], env=self.env(),
                              capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        if check and proc.returncode != 0:
            raise ClusterError(
                f"on {node}: {shlex.join(argv)} exited {proc.returncode}: {proc.stderr}"
            )
        return proc.stdout

    def sbatch(self, script: str, *options: str, workdir: Path, name: str = "job",
               env: Mapping[str, str] | None = None) -> Job:  # fmt: skip
        """Submit ``script`` (a shell script body) with ``options``; output to workdir/<name>.out.

        ``--open-mode=append`` keeps the output of every run of a requeued job.
        The job's environment is the submitter's, with ``env`` on top.
        """
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / f"{name}.sbatch"
        body = script if script.startswith("#!") else "#!/bin/bash\n" + script
        path.write_text(body)
        out = workdir / f"{name}.out"
        argv = ["sbatch", "--parsable", f"--job-name={name}", f"--output={out}",
                "--open-mode=append", f"--chdir={workdir}", *options, str(path)]  # fmt: skip
        proc = subprocess.run(argv, env=self.env(env), capture_output=True, text=True,
                              timeout=30, check=False)  # fmt: skip
        if proc.returncode != 0:
            raise ClusterError(f"{shlex.join(argv)} failed: {proc.stderr.strip()}")
        job = Job(self, proc.stdout.strip().split(";")[0], out)
        self.submitted.append(job.id)
        return job

    def jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%A").split()

    def cancel_all(self, timeout: float = 60) -> None:
        """Cancel every job (attached: every job we submitted) and wait until they are gone."""
        mine = set(self.submitted)

        def left() -> list[str]:
            return [j for j in self.jobs() if not self.attached or j in mine]

        if left():
            self.run("scancel", *left(), check=False)
        poll("our jobs to leave the queue", lambda: True if not left() else None, timeout,
             on_timeout=lambda: self.run("squeue", check=False))  # fmt: skip


@dataclass
class Job:
    """One batch job on the test cluster."""

    cluster: Cluster
    id: str
    output_path: Path
    history: list[tuple[float, str]] = field(default_factory=list)
    """(time, state) each time a poll saw the state change."""

    def info(self) -> dict[str, str]:
        """``scontrol show job -o``; after slurmctld forgets the job, its jobcomp record."""
        out = self.cluster.run("scontrol", "show", "job", "-o", self.id, check=False)
        rec = parse_record(out) if out.strip() else self._jobcomp()
        state = rec.get("JobState", "")
        if not self.history or self.history[-1][1] != state:
            self.history.append((time.time(), state))
        return rec

    def _jobcomp(self) -> dict[str, str]:
        last: dict[str, str] = {}
        path = self.cluster.root / "log" / "jobcomp.txt"
        with contextlib.suppress(FileNotFoundError):
            for line in path.read_text().splitlines():
                rec = parse_record(line)
                if rec.get("JobId") == self.id:
                    last = rec
        return last

    @property
    def state(self) -> str:
        return self.info().get("JobState", "")

    @property
    def restarts(self) -> int:
        return int(self.info().get("Restarts", "0") or 0)

    def output(self) -> str:
        try:
            return self.output_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def describe(self) -> str:
        """Everything useful when a wait fails: record, output, daemon logs."""
        return (f"job {self.id}: {self.info()}\nstate history: {self.history}\n"
                f"----- output {self.output_path}\n{self.output()[-6000:]}\n"
                f"{self.cluster.logs(15)}")  # fmt: skip

    def wait_for(self, what: str, check: Callable[[dict[str, str]], bool],
                 timeout: float) -> dict[str, str]:  # fmt: skip
        def once() -> dict[str, str] | None:
            rec = self.info()
            return rec if check(rec) else None

        return poll(f"job {self.id}: {what}", once, timeout, on_timeout=self.describe)

    def wait_state(self, states: str | Iterable[str], timeout: float = 60) -> dict[str, str]:
        wanted = {states} if isinstance(states, str) else set(states)
        return self.wait_for(f"state in {sorted(wanted)}", lambda r: r.get("JobState") in wanted,
                             timeout)  # fmt: skip

    def wait_running(self, timeout: float = 60) -> dict[str, str]:
        return self.wait_state("RUNNING", timeout)

    def wait_finished(self, timeout: float = 120) -> dict[str, str]:
        return self.wait_state(FINISHED, timeout)

    def wait_output(self, pattern: str, timeout: float = 60, count: int = 1) -> re.Match[str]:
        """Wait until ``pattern`` (a regex) occurs ``count`` times in the output; the last match."""

        def once() -> re.Match[str] | None:
            found = list(re.finditer(pattern, self.output(), re.MULTILINE))
            return found[count - 1] if len(found) >= count else None

        return poll(f"job {self.id} output to match {pattern!r} x{count}", once, timeout,
                    on_timeout=self.describe)  # fmt: skip

    def signal(self, sig: signal.Signals | str, *, batch: bool = False) -> float:
        """``scancel --signal`` to the job's steps (or only the batch shell); the time sent."""
        name = sig.name.removeprefix("SIG") if isinstance(sig, signal.Signals) else sig
        argv = ["scancel", f"--signal={name}", *(["--batch"] if batch else []), self.id]
        sent = time.time()
        self.cluster.run(*argv)
        return sent

    def cancel(self) -> None:
        self.cluster.run("scancel", self.id, check=False)

    def skip_requeue_wait(self, restarts: int = 1, timeout: float = 90) -> dict[str, str]:
        """Once requeued (``restarts`` reached, PENDING), start it now instead of in ~121 s.

        The job stays COMPLETING until its epilog ends, so this also waits for that.
        """
        self.wait_for(f"requeued (Restarts>={restarts}) and PENDING",
                      lambda r: int(r.get("Restarts", "0") or 0) >= restarts
                      and r.get("JobState") == "PENDING", timeout)  # fmt: skip
        # The requeue revoked the job's credential on slurmd; a new credential
        # created within the same second (time_t) still counts as revoked, and
        # slurmctld then kills the job for good ("Killing non-startable batch
        # job: Job credential revoked", FAILED). Slurm's own ~121 s BeginTime
        # exists for this; one second past the revocation is enough.
        pending = time.time()
        poll("the second after the requeue", lambda: True if int(time.time()) > int(pending) else None,
             2, interval=0.02)  # fmt: skip
        self.cluster.run("scontrol", "update", f"JobId={self.id}", "StartTime=now")
        return self.wait_for("past its BeginTime", lambda r: r.get("Reason") != "BeginTime"
                             or r.get("JobState") != "PENDING", 30)  # fmt: skip
