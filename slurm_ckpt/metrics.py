"""Prometheus metrics of checkpointing: a node_exporter textfile, optionally served.

No dependency is needed for the textfile path: this module keeps its own small
registry and writes the text exposition format. node_exporter's textfile
collector (``--collector.textfile.directory``) picks the file up. It is written
to a temp name and renamed, because the collector may read it at any moment and
must never see half a file.

Exported series (every one carries ``job_id``, ``rank`` and ``user`` labels)::

    slurm_ckpt_save_duration_seconds          histogram  commit time of a save
    slurm_ckpt_load_duration_seconds          histogram  time to load a checkpoint
    slurm_ckpt_save_bytes_total               counter    bytes committed
    slurm_ckpt_load_bytes_total               counter    bytes loaded
    slurm_ckpt_save_throughput_bytes_per_second gauge    bytes/s of the last save
    slurm_ckpt_saves_total                    counter    committed saves
    slurm_ckpt_save_failures_total{errno=}    counter    failed saves by errno name
    slurm_ckpt_last_committed_step            gauge      step of the newest commit
    slurm_ckpt_last_committed_timestamp_seconds gauge    its wall-clock time
    slurm_ckpt_stageout_lag_seconds           gauge      age of the oldest checkpoint not yet durable
    slurm_ckpt_durable_stalled                gauge      1 while durable-tier I/O hangs past storage.hang_timeout
    slurm_ckpt_requeues_total                 counter    times this job was requeued
    slurm_ckpt_start_timestamp_seconds        gauge      when this process started
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import MetricsConfig

__all__ = ["EXPORTED", "MAX_LOCAL_TASKS", "PREFIX", "Metrics", "remove_job_textfiles", "textfile_name"]

log = logging.getLogger("slurm_ckpt")

PREFIX = "slurm_ckpt_"
SAVE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
LOAD_BUCKETS = SAVE_BUCKETS

_HELP: dict[str, tuple[str, str]] = {
    "save_duration_seconds": ("histogram", "Time from the start of a save to its durable commit."),
    "load_duration_seconds": ("histogram", "Time to find, verify and load a checkpoint."),
    "save_bytes_total": ("counter", "Bytes of committed checkpoints."),
    "load_bytes_total": ("counter", "Bytes of loaded checkpoints."),
    "save_throughput_bytes_per_second": ("gauge", "Throughput of the last committed save."),
    "saves_total": ("counter", "Committed saves."),
    "save_failures_total": ("counter", "Saves that failed, by errno name."),
    "last_committed_step": ("gauge", "Step of the newest committed checkpoint."),
    "last_committed_timestamp_seconds": ("gauge", "Unix time of the newest commit."),
    "stageout_lag_seconds": ("gauge", "Age of the oldest checkpoint not yet on the durable tier (0: none)."),
    "durable_stalled": ("gauge", "1 while a call to the durable tier has hung past storage.hang_timeout, else 0."),
    "requeues_total": ("counter", "Times this job has been requeued (SLURM_RESTART_COUNT)."),
    "start_timestamp_seconds": ("gauge", "Unix time this training process started."),
    "replica_nodes": ("gauge", "Nodes holding every shard of the newest replicated step (own copy included)."),
    "replica_bytes_sent_total": ("counter", "Bytes this rank sent to peers' scratch as replicas."),
    "replica_bytes_received_total": ("counter", "Bytes of peers' shards this rank received as replicas."),
}
EXPORTED = frozenset(PREFIX + name for name in _HELP)
"""Every metric family name this module can write (for dashboard and rule checks)."""


def _safe(s: str) -> str:
    return "".join(c if c.isalnum() or c == "-" else "-" for c in s)


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def _labels(base: Mapping[str, str], extra: Mapping[str, str] | None = None) -> str:
    items = {**base, **(extra or {})}
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in sorted(items.items())) + "}"


class _Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = tuple(buckets)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.counts[i] += 1

    def lines(self, name: str, base: Mapping[str, str]) -> Iterator[str]:
        for b, c in zip(self.bounds, self.counts, strict=True):
            yield f"{name}_bucket{_labels(base, {'le': _fmt(b)})} {c}"
        yield f"{name}_bucket{_labels(base, {'le': '+Inf'})} {self.count}"
        yield f"{name}_sum{_labels(base)} {_fmt(self.sum)}"
        yield f"{name}_count{_labels(base)} {self.count}"


class Metrics:
    """Checkpoint metrics of one training process.

    Recording never raises into training: a textfile that cannot be written is
    logged once and skipped.
    """

    def __init__(
        self,
        textfile: str | os.PathLike[str] | None = None,
        labels: Mapping[str, str] | None = None,
        *,
        requeues: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.textfile = Path(textfile) if textfile else None
        self.labels = dict(labels or {})
        self.clock = clock
        self._lock = threading.Lock()
        self._save = _Histogram(SAVE_BUCKETS)
        self._load = _Histogram(LOAD_BUCKETS)
        self._values: dict[str, float] = {
            "save_bytes_total": 0, "load_bytes_total": 0, "saves_total": 0,
            "requeues_total": requeues, "start_timestamp_seconds": clock(),
            "stageout_lag_seconds": 0, "durable_stalled": 0,
        }  # fmt: skip
        self._failures: dict[str, int] = {}
        self._warned = False
        self._server: Any = None

    @classmethod
    def from_config(
        cls, cfg: MetricsConfig, *, job_id: str = "", env: Mapping[str, str] | None = None
    ) -> Metrics:
        """Metrics for this process: the textfile is ``<textfile_dir>/slurm_ckpt_<job>_<rank>.prom``."""
        env = os.environ if env is None else env
        rank = env.get("SLURM_PROCID") or env.get("RANK") or "0"
        user = env.get("SLURM_JOB_USER") or env.get("USER", "")
        # The file is named by SLURM_JOB_ID, the one id the epilog knows, so it can
        # remove the file (remove_job_textfiles); the label keeps the array form.
        file_id = env.get("SLURM_JOB_ID", "") or f"pid{os.getpid()}"
        job = job_id or file_id
        path = None
        if cfg.textfile_dir:
            # By the task's index on this node, which the epilog can name without
            # listing the dir (ranks of other nodes' tasks it cannot know).
            local = env.get("SLURM_LOCALID") or env.get("LOCAL_RANK") or rank
            path = Path(cfg.textfile_dir) / textfile_name(file_id, local)
        restarts = env.get("SLURM_RESTART_COUNT", "0")
        m = cls(path, {"job_id": job, "rank": rank, "user": user},
                requeues=int(restarts) if restarts.isdigit() else 0)  # fmt: skip
        if cfg.port:
            # One port per process on the node: ranks sharing a node must not collide.
            local = env.get("SLURM_LOCALID") or env.get("LOCAL_RANK") or "0"
            m.serve(cfg.port + (int(local) if local.isdigit() else 0))
        m.flush()
        return m

    # -- recording --------------------------------------------------------
    @contextlib.contextmanager
    def time_save(self, step: int, nbytes: int) -> Iterator[None]:
        """Time a save; a commit is recorded on success, a failure (by errno) on error."""
        t0 = time.monotonic()
        try:
            yield
        except BaseException as e:
            self.save_failed(e)
            raise
        self.save_committed(step, time.monotonic() - t0, nbytes)

    def save_committed(self, step: int, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._save.observe(seconds)
            v = self._values
            v["save_bytes_total"] += nbytes
            v["saves_total"] += 1
            v["save_throughput_bytes_per_second"] = nbytes / seconds if seconds > 0 else 0.0
            v["last_committed_step"] = step
            v["last_committed_timestamp_seconds"] = self.clock()
        self.flush()

    def save_failed(self, exc: BaseException) -> None:
        code = getattr(exc, "errno", None)
        name = errno_mod.errorcode.get(code, "other") if isinstance(code, int) else "other"
        with self._lock:
            self._failures[name] = self._failures.get(name, 0) + 1
        self.flush()

    @contextlib.contextmanager
    def time_load(self) -> Iterator[list[int]]:
        """Time a load; append the loaded byte count to the yielded list (nothing = none found)."""
        t0 = time.monotonic()
        nbytes: list[int] = []
        yield nbytes
        if nbytes:
            self.loaded(time.monotonic() - t0, sum(nbytes))

    def loaded(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._load.observe(seconds)
            self._values["load_bytes_total"] += nbytes
        self.flush()

    def set_replicas(self, nodes: int, sent: int, received: int) -> None:
        """After a save's peer replication: on how many nodes it lives, and the bytes so far."""
        with self._lock:
            v = self._values
            v["replica_nodes"] = nodes
            v["replica_bytes_sent_total"] = sent
            v["replica_bytes_received_total"] = received
        self.flush()

    def set_stageout_lag(self, seconds: float) -> None:
        with self._lock:
            self._values["stageout_lag_seconds"] = max(0.0, seconds)
        self.flush()

    def set_durable_stalled(self, stalled: bool) -> None:
        with self._lock:
            self._values["durable_stalled"] = 1 if stalled else 0
        self.flush()

    # -- output -----------------------------------------------------------
    def render(self) -> str:
        """The text exposition format (version 0.0.4)."""
        out: list[str] = []
        with self._lock:
            for short, (kind, help_) in _HELP.items():
                name = PREFIX + short
                if short == "save_duration_seconds":
                    lines = list(self._save.lines(name, self.labels))
                elif short == "load_duration_seconds":
                    lines = list(self._load.lines(name, self.labels))
                elif short == "save_failures_total":
                    lines = [f"{name}{_labels(self.labels, {'errno': k})} {n}"
                             for k, n in sorted(self._failures.items())]  # fmt: skip
                elif short in self._values:
                    lines = [f"{name}{_labels(self.labels)} {_fmt(self._values[short])}"]
                else:
                    continue
                if lines:
                    out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *lines]
        return "\n".join(out) + "\n"

    def flush(self) -> None:
        """Write the textfile atomically (tmp + fsync + rename); no-op without a textfile."""
        if self.textfile is None:
            return
        d = self.textfile.parent
        # The collector reads only *.prom, so the temp name is never picked up half-written.
        tmp = d / f".{self.textfile.name}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, self.render().encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.textfile)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if not self._warned:
                self._warned = True
                log.warning("cannot write metrics file %s: %s (metrics.textfile_dir)", self.textfile, e)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve these metrics over HTTP with prometheus_client (an optional dependency)."""
        try:
            from prometheus_client import CollectorRegistry, start_http_server
            from prometheus_client.parser import text_string_to_metric_families
        except ImportError:
            log.warning("metrics.port=%d ignored: pip install prometheus_client to serve metrics", port)
            return
        me = self

        class _Collector:
            def collect(self) -> Any:
                return text_string_to_metric_families(me.render())

        reg = CollectorRegistry(auto_describe=False)
        reg.register(_Collector())
        try:
            self._server = start_http_server(port, addr=addr, registry=reg)
        except OSError as e:
            # Metrics must never stop training: a busy port costs the endpoint only.
            log.warning("cannot serve metrics on port %d: %s (metrics.port)", port, e)

    def close(self, *, remove: bool = False) -> None:
        """Stop serving; with ``remove``, delete the textfile (the job is over)."""
        srv = self._server[0] if isinstance(self._server, tuple) else None
        if srv is not None:
            srv.shutdown()
        if remove and self.textfile is not None:
            with contextlib.suppress(FileNotFoundError):
                self.textfile.unlink()


def textfile_name(job_id: str, local_id: str) -> str:
    """The textfile of task ``local_id`` (its index on the node) of job ``job_id``."""
    return f"slurm_ckpt_{_safe(job_id)}_{_safe(local_id)}.prom"


MAX_LOCAL_TASKS = 1024
"""Tasks of one job on one node whose textfiles the epilog removes (local ids 0..N-1)."""


def remove_job_textfiles(textfile_dir: str | os.PathLike[str], job_id: str, *, until: float | None = None,
                         tasks: int = MAX_LOCAL_TASKS) -> list[Path]:  # fmt: skip
    """Delete the textfiles job ``job_id`` (its SLURM_JOB_ID) wrote, for the epilog, so no
    alert fires for a job that no longer runs. Returns what was removed.

    Only the exact names :meth:`Metrics.from_config` gives (local ids below
    ``tasks``), each unlinked by name: the dir is never listed, so the entries
    users make in a world-writable dir cost nothing, and none of them is
    removed. Stops at ``until`` (a ``time.monotonic()`` value).
    """
    removed = []
    d = os.open(textfile_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i in range(tasks):
            if until is not None and time.monotonic() >= until:
                log.warning("stopped removing the textfiles of job %s at the deadline", job_id)
                break
            name = textfile_name(job_id, str(i))
            try:
                os.unlink(name, dir_fd=d)  # a directory at the name stays: EISDIR
            except OSError:
                continue
            removed.append(Path(textfile_dir) / name)
    finally:
        os.close(d)
    return removed
