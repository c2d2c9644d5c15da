"""Validated configuration.

Precedence, lowest first, documented here once:

1. built-in defaults (the dataclass defaults below);
2. the site file: ``/etc/slurm-ckpt/config.yaml``, or the file ``$SLURM_CKPT_CONFIG`` names;
3. environment: ``SLURM_CKPT_<SECTION>_<KEY>``, e.g. ``SLURM_CKPT_SCRATCH_BASE``;
4. CLI flags, applied by the caller with :func:`dataclasses.replace`.

Unknown keys and wrong types fail with a :class:`ConfigError` naming the file,
the key and the valid keys. ``templates/slurm-ckpt.yaml`` documents every key.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

__all__ = [
    "Config",
    "EngineConfig",
    "IOConfig",
    "IOLimits",
    "MetricsConfig",
    "ScratchConfig",
    "StorageConfig",
    "WrapperConfig",
    "format_size",
    "job_dir_name",
    "load_config",
    "parse_duration",
    "parse_size",
]

DEFAULT_CONFIG_PATH = "/etc/slurm-ckpt/config.yaml"

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
    "p": 1024**5, "pb": 1000**5, "pib": 1024**5,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float) -> int:
    """Parse ``40G``, ``1.5TiB``, ``512MiB`` or a plain byte count into bytes.

    Bare letters (``G``) are binary, as in Slurm's ``--tmp``; ``GB`` is decimal.
    """
    if isinstance(value, bool):
        raise ConfigError(f"size must be a number with a unit like 40G, not {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"size must not be negative: {value!r}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ConfigError(
            f"cannot parse size {value!r}: use a number and a unit such as 512MiB, 40G or 1.5TiB"
        )
    n = float(m.group(1)) * _UNITS[unit]
    if not n < 2**63:  # also catches inf from an absurdly long number
        raise ConfigError(f"size {value!r} is larger than any filesystem; check the number")
    return int(n)


def format_size(n: float) -> str:
    """Human-readable binary size: ``format_size(3 * 2**30) == '3.0GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Size(int):
    """An int of bytes that config files may spell ``40G``."""


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: str | int | float) -> float:
    """Parse ``7d``, ``12h``, ``30m``, ``90s`` or a plain number of seconds."""
    if isinstance(value, bool):
        raise ConfigError(f"duration must be a number with a unit like 7d, not {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"duration must not be negative: {value!r}")
        return float(value)
    m = _DURATION_RE.match(str(value))
    if not m:
        raise ConfigError(f"cannot parse duration {value!r}: use a number and s, m, h or d, such as 7d")
    return float(m.group(1)) * _SECONDS[m.group(2)]


class Duration(float):
    """Seconds that config files may spell ``7d`` or ``12h``."""


def job_dir_name(job_id: str) -> str:
    """``job_<id>``: a job's dir under ``<storage.root>/<user>/`` and under ``scratch.base``."""
    return f"job_{job_id}"


@dataclass(frozen=True)
class StorageConfig:
    root: str = ""
    """Durable run dirs live at <root>/<user>/job_<id>; empty means ./checkpoints."""
    keep: int = 3
    """Committed checkpoints kept per run dir (the newest valid one is never deleted)."""
    retries: int = 3
    """Retries of a transient I/O error (see retry_errnos) before a save fails."""
    retry_backoff: float = 0.5
    """Seconds before the first retry; doubles each time."""
    retry_errnos: tuple[str, ...] = ("ESTALE", "EAGAIN", "EINTR")
    """errno names retried; EIO is added on network filesystems."""
    on_async_error: str = "raise"
    """raise|warn: what the next save does when a background save failed."""
    allow_pickle: bool = False
    """Save unknown Python objects with pickle (trusted input only)."""
    drain: bool = True
    """Copy checkpoints from node-local scratch to the durable run dir in the background while
    the job runs; false leaves that to the epilog's stage-out after the job (no checkpoint
    traffic on shared storage during training, but only scratch holds them until then)."""
    hang_timeout: Duration = Duration(60)
    """Seconds without an answer from the durable run dir's storage (no write, fsync or copied
    chunk returns: a hung file server) before a save gives up; storage that is slow but answers
    is not hung. With node-local scratch the checkpoint commits there and is copied later;
    without, the save fails with StorageHung and training goes on. It bounds a Checkpointer in
    one process; the saves of several ranks wait for the storage."""
    stage_out_roots: tuple[str, ...] = ()
    """Dirs the epilog's stage-out may write under: a job's TIER.json naming a durable run
    dir elsewhere is refused (its checkpoint goes to <root>/<user>/job_<id>); empty: root only."""

    def validate(self) -> None:
        if self.keep < 1:
            raise ConfigError("storage.keep must be at least 1")
        if not 0 < self.hang_timeout < float("inf"):
            raise ConfigError(f"storage.hang_timeout must be a number of seconds above 0, got {self.hang_timeout!r}")
        if self.on_async_error not in ("raise", "warn"):
            raise ConfigError("storage.on_async_error must be 'raise' or 'warn'")
        for root in self.stage_out_roots:
            if not root.startswith("/") or "\0" in root:
                raise ConfigError(f"storage.stage_out_roots: {root!r} is not an absolute path")

    def stage_out_allowed(self) -> tuple[str, ...]:
        """Where stage-out may write: ``stage_out_roots``, else ``root``, else nowhere."""
        roots = self.stage_out_roots or ((self.root,) if self.root else ())
        return tuple(os.path.normpath(r) for r in roots)


@dataclass(frozen=True)
class ScratchConfig:
    base: str = "/local/slurm-ckpt"
    """Node-local scratch; the prolog creates <base>/job_<id>."""
    default_size: Size = Size(10 * 1024**3)
    """Reservation when the job asks for none (``--comment ckpt_scratch=40G``)."""
    headroom: Size = Size(0)
    """Bytes of the scratch filesystem never reserved."""
    over_reserve: str = "shrink"
    """shrink|none: an over-subscribing job gets what is left, or no scratch."""
    min_size: Size = Size(1024**3)
    """Below this, a shrunk reservation is not worth creating."""
    enforce: str = "auto"
    """auto|quota|loop|none: how the size is enforced. loop: a per-job filesystem image,
    loop-mounted; quota: XFS/ext4 project quota (base mounted with prjquota), which the job's
    user can step out of (see docs/admin.md); auto: loop where the node has loop devices and
    mkfs, else quota where the base has it, else none (the ledger only)."""
    loop_fstype: str = "ext4"
    """ext4|xfs: filesystem of the per-job image with enforce: loop (xfs needs >= 300MiB)."""
    prolog_timeout: float = 20.0
    """Seconds the prolog may take; keep below slurm.conf PrologEpilogTimeout."""
    epilog_timeout: float = 240.0
    """Seconds the epilog may take, stage-out included; keep below PrologEpilogTimeout."""
    check_timeout: float = 5.0
    """Seconds for the shared-storage space and quota check (a hung NFS must not hang the prolog)."""
    expected_ckpt_size: Size = Size(0)
    """Checkpoint size the space check assumes when the job gives no --comment ckpt_size=
    and has no checkpoint yet; 0 checks free space against nothing."""
    max_size: Size = Size(0)
    """Most one job may reserve, whatever it asks; 0: no cap but the filesystem. With no cap,
    a job asking for more than the filesystem could ever hold gets default_size."""
    max_inodes: int = 1_000_000
    """Most files and directories one job may make in scratch, where enforce can limit them
    (loop: the image's inode count; quota: the project's inode limit); 0: no limit. It bounds
    how long removing a job's scratch takes."""
    keep_failed: Duration = Duration(7 * 86400)
    """How long a scratch the epilog kept (its stage-out failed: it may hold the only copy of a
    checkpoint) stays, with its reservation, before a later hook removes it anyway (7d, 12h).
    The longest keep: a job whose stage-out failed on its own data (an unreadable checkpoint) keeps a
    seventh of it, and one that reserved more than default_size keeps it shorter in
    proportion (never under an hour). A kept scratch never blocks another job: when a new
    job needs its room, the oldest kept scratch goes first."""
    keep_per_user: Size = Size(0)
    """Most bytes of kept scratch one user may hold on this node; a newer keep drops the
    user's oldest, and one larger than this is not kept. 0: a quarter of the filesystem."""
    replicas: int = 0
    """Peer replicas of each node's scratch shards (several ranks on several nodes): each shard is
    copied, after its commit, to the scratch of the next ``replicas`` nodes in a ring, so a step
    outlives the loss of that many nodes before it reaches the durable tier. 0: off. The prolog
    reserves (1 + replicas) times the job's size; a job picks its own count with
    ``--comment ckpt_replicas=N``, which the TaskProlog exports to its tasks."""
    reap_budget: float = 60.0
    """Seconds a background reaper, started by a hook, spends removing what hooks could not
    remove within their own deadline (the graveyard) and kept scratch past keep_failed."""

    def validate(self) -> None:
        if self.over_reserve not in ("shrink", "none"):
            raise ConfigError("scratch.over_reserve must be 'shrink' or 'none'")
        if self.enforce not in ("auto", "quota", "loop", "none"):
            raise ConfigError("scratch.enforce must be auto, quota, loop or none")
        if self.loop_fstype not in ("ext4", "xfs"):
            raise ConfigError("scratch.loop_fstype must be ext4 or xfs")
        if min(self.prolog_timeout, self.epilog_timeout, self.check_timeout) <= 0:
            raise ConfigError("scratch.prolog_timeout, epilog_timeout and check_timeout must be > 0")
        if self.keep_failed <= 0 or self.reap_budget <= 0 or self.max_inodes < 0 or self.keep_per_user < 0:
            raise ConfigError("scratch.keep_failed and reap_budget must be > 0, max_inodes and keep_per_user >= 0")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 0:
            raise ConfigError("scratch.replicas must be an integer >= 0 (0: no peer replicas)")


@dataclass(frozen=True)
class WrapperConfig:
    signal: str = "USR1"
    """The checkpoint signal; must match sbatch --signal."""
    max_requeues: int = 10
    """Requeues allowed per job before the wrapper gives up."""
    margin: float = 15.0
    """Seconds kept free before the job's end time when waiting for a checkpoint."""
    requeue_exit: int = 0
    """Exit code when no Slurm client (pyslurm, scontrol) is on the node: list it in slurm.conf RequeueExit. 0: none."""
    kill_wait: float = 30.0
    """slurm.conf KillWait: seconds from SIGTERM to SIGKILL, which bound the checkpoint after a SIGTERM."""
    wait: float = 300.0
    """Seconds to wait for the checkpoint when Slurm gives no end time (--local, no time limit)."""
    hang_timeout: float = 0.0
    """Seconds without step progress on any rank of a node after which the job counts as hung:
    its ranks are ended and global rank 0 requeues it without the node that held it up
    (ExcNodeList). 0: off. Keep it well above the longest step and above the first step's time."""

    def validate(self) -> None:
        if self.hang_timeout != 0 and not self.hang_timeout >= 2:
            raise ConfigError("wrapper.hang_timeout must be 0 (off) or at least 2 seconds")
        if self.max_requeues < 0:
            raise ConfigError("wrapper.max_requeues must be >= 0")
        if not 0 <= self.requeue_exit <= 255:
            raise ConfigError("wrapper.requeue_exit must be an exit code, 0-255")
        if self.margin < 0 or self.kill_wait <= 0 or self.wait <= 0:
            raise ConfigError("wrapper.margin must be >= 0; kill_wait and wait must be > 0")
        from .control import parse_signal  # lazy: config stays free of signal machinery

        parse_signal(self.signal)


SNAPSHOTS = ("auto", "overlap", "copy", "fork")
"""The ``engine.snapshot`` modes (see ``slurm_ckpt.engine``)."""


@dataclass(frozen=True)
class EngineConfig:
    threads: int = 0
    """I/O threads for writes and reads; 0 picks two per core (2 to 8), but 8 for the reads of a
    load that is neither sharded (DTensor, DCP) nor mmap=True."""
    chunk_size: Size = Size(8 * 1024**2)
    """Bytes per write or read call (a multiple of 4 KiB); chunks are checksummed separately."""
    direct_io: bool = True
    """Use O_DIRECT where the filesystem supports it and runs it fast (buffered on ceph-fuse, and where it is refused)."""
    snapshot: str = "auto"
    """auto|overlap|copy|fork: how save_async captures the state (see the engine docs)."""
    pin_memory: bool = True
    """Stage CUDA tensors in pinned host memory (kept and reused between saves)."""
    torch_huge_pages: bool = True
    """slurm-ckpt run sets THP_MEM_ALLOC_ENABLE=1 for the command (unless set): torch then puts large CPU tensors on huge pages, which O_DIRECT writes and fork snapshots go faster from."""

    def validate(self) -> None:
        if self.snapshot == "lazy":
            raise ConfigError("engine.snapshot: lazy was removed; use overlap, which also returns before copying "
                              "the tensors and needs no fence before optimizer.step()")
        if self.snapshot not in SNAPSHOTS:
            raise ConfigError(f"engine.snapshot must be one of {', '.join(SNAPSHOTS)}")
        if self.chunk_size <= 0 or self.chunk_size % 4096:
            raise ConfigError("engine.chunk_size must be a positive multiple of 4KiB, e.g. 8M")
        if self.threads < 0:
            raise ConfigError("engine.threads must be >= 0 (0 picks by core count, 8 for plain loads' reads)")

    def torch_env(self, env: MutableMapping[str, str]) -> None:
        """Ask torch for huge pages in ``env`` (a trainer's, or the bench's own), unless
        it says otherwise or ``torch_huge_pages`` is off.

        torch's CPU allocator asks for transparent huge pages only when told to,
        and it reads the variable at its first allocation. An ``O_DIRECT`` write
        from 4 KiB pages spends the disk's per-request segment limit on small
        pieces, and a fork copies four-kilobyte page-table entries one by one;
        huge pages make both cheaper (``slurm-ckpt bench`` compares them,
        ``docs/performance.md``).
        """
        if self.torch_huge_pages:
            env.setdefault("THP_MEM_ALLOC_ENABLE", "1")


@dataclass(frozen=True)
class IOLimits:
    weight: int = 0
    """bfq / io.weight 1-1000 (0 leaves it unset)."""
    read_bps: Size = Size(0)
    """Read bytes/s limit on the device (0: none), e.g. 500M."""
    write_bps: Size = Size(0)
    """Write bytes/s limit on the device (0: none)."""
    read_iops: int = 0
    """Read operations/s limit (0: none)."""
    write_iops: int = 0
    """Write operations/s limit (0: none)."""

    def validate(self) -> None:
        if not 0 <= self.weight <= 1000 or min(self.read_iops, self.write_iops) < 0:
            raise ConfigError("io weight must be 0-1000 and iops limits >= 0")


@dataclass(frozen=True)
class IOConfig:
    enabled: bool = True
    device: str = ""
    """Block device (e.g. /dev/nvme0n1) the limits apply to; empty: the scratch base's."""
    default: IOLimits = field(default_factory=IOLimits)
    """Limits for jobs in partitions not listed below."""
    partitions: Mapping[str, IOLimits] = field(default_factory=dict)
    """Per-partition limits, by partition name."""
    cgroup_root: str = ""
    """cgroup mount to use: a v1 blkio hierarchy or the v2 root; empty: detect."""
    v2_job_cgroup: str = "system.slice/slurmstepd.scope/job_{job_id}"
    """Slurm's job cgroup under the v2 root (multiple-slurmd: <node>_slurmstepd.scope)."""
    v2_wait: float = 60.0
    """Seconds a helper waits for Slurm to create the v2 job cgroup after the prolog."""

    def for_partition(self, name: str | None) -> IOLimits:
        return self.partitions.get(name or "", self.default)

    def validate(self) -> None:
        for limits in (self.default, *self.partitions.values()):
            limits.validate()


@dataclass(frozen=True)
class MetricsConfig:
    textfile_dir: str = ""
    """node_exporter textfile-collector dir; empty disables the file."""
    port: int = 0
    """Serve metrics with prometheus_client on this port; 0 disables."""


@dataclass(frozen=True)
class Config:
    storage: StorageConfig = field(default_factory=StorageConfig)
    scratch: ScratchConfig = field(default_factory=ScratchConfig)
    wrapper: WrapperConfig = field(default_factory=WrapperConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    io: IOConfig = field(default_factory=IOConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def validate(self) -> Config:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            check = getattr(section, "validate", None)
            if check:
                check()
        return self


def load_config(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """Build the effective config: defaults < site file < environment.

    ``path`` defaults to ``$SLURM_CKPT_CONFIG``, else the site file; a missing
    site file is fine, a missing file named explicitly is an error.
    """
    env = os.environ if env is None else env
    explicit = path is not None or "SLURM_CKPT_CONFIG" in env
    src = Path(path if path is not None else env.get("SLURM_CKPT_CONFIG", DEFAULT_CONFIG_PATH))
    data: dict[str, Any] = {}
    if src.exists():
        try:
            # libyaml's parser where PyYAML has it: the same safe loader, and the hooks
            # read this file before every job.
            loaded = yaml.load(src.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{src}: cannot read config: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{src}: the top level must be a mapping of sections")
        data = loaded or {}
    elif explicit:
        raise ConfigError(f"{src}: config file not found (set by SLURM_CKPT_CONFIG or --config)")
    cfg = _build(Config, data, str(src), "")
    try:
        return _apply_env(cfg, env).validate()
    except ConfigError as e:
        overrides = any(k.startswith("SLURM_CKPT_") and k != "SLURM_CKPT_CONFIG" for k in env)
        raise ConfigError(f"{src}{' + SLURM_CKPT_* environment' if overrides else ''}: {e}") from None


def _apply_env(cfg: Config, env: Mapping[str, str]) -> Config:
    sections = {}
    for sec in dataclasses.fields(cfg):
        obj = getattr(cfg, sec.name)
        changes = {}
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            var = f"SLURM_CKPT_{sec.name.upper()}_{f.name.upper()}"
            if var in env and _is_scalar(hints[f.name]):
                changes[f.name] = _coerce(hints[f.name], env[var], var, "environment")
        if changes:
            sections[sec.name] = dataclasses.replace(obj, **changes)
    return dataclasses.replace(cfg, **sections) if sections else cfg


def _is_scalar(tp: Any) -> bool:
    return tp in (str, int, float, bool, Size, Duration) or typing.get_origin(tp) is tuple


def _build(cls: type[Any], data: Any, src: str, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{src}: {prefix or 'top level'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in valid:
            raise ConfigError(f"{src}: unknown key {where!r}; valid keys: {', '.join(valid)}")
        kwargs[key] = _coerce(hints[key], value, where, src)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str, src: str) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, src, f"{where}.")
    if origin in (Mapping, dict):
        _, vtype = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{src}: {where} must be a mapping")
        return {str(k): _coerce(vtype, v, f"{where}.{k}", src) for k, v in value.items()}
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise ConfigError(f"{src}: {where} must be a list, got {value!r}")
        return tuple(str(i).strip() for i in items)
    if tp is Size:
        try:
            return Size(parse_size(value))
        except ConfigError as e:
            raise ConfigError(f"{src}: {where}: {e}") from None
    if tp is Duration:
        try:
            return Duration(parse_duration(value))
        except ConfigError as e:
            raise ConfigError(f"{src}: {where}: {e}") from None
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        if isinstance(value, bool):
            return value
    elif tp is int and not isinstance(value, bool):
        try:
            if isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip("-").isdigit()):
                return int(value)
        except ValueError:
            pass
    elif tp is float and not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    elif tp is str and isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{src}: {where} must be of type {getattr(tp, '__name__', tp)}, got {value!r}")
