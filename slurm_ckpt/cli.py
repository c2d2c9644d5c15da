"""The ``slurm-ckpt`` command: a thin layer over the library.

Exit codes, mapped here and nowhere else:
0 ok · 1 failure · 2 usage or config error · 3 no valid checkpoint ·
4 a checkpoint failed verification · 5 another writer holds the lock ·
6 doctor: the worst finding is a warning · 7 doctor: the worst finding is an error.
``run`` instead exits with its command's status (0 after a requeue).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from . import __version__
from .config import format_size, load_config
from .errors import CheckpointCorrupt, ConfigError, LockHeld, SlurmCkptError

if TYPE_CHECKING:
    from .store import Skipped

# The store and the job environment are imported by the commands that use
# them: `slurm-ckpt node prolog|epilog` runs before and after every job and
# needs neither.

__all__ = ["main"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_NONE, EXIT_CORRUPT, EXIT_LOCKED = 0, 1, 2, 3, 4, 5
EXIT_DOCTOR_WARN, EXIT_DOCTOR_ERROR = 6, 7

F = TypeVar("F", bound=Callable[..., Any])


def _errors_to_exit(fn: F) -> F:
    """Turn our exceptions into one line on stderr and a documented exit code."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            click.echo(f"slurm-ckpt: config error: {e}", err=True)
            sys.exit(EXIT_USAGE)
        except CheckpointCorrupt as e:
            click.echo(f"slurm-ckpt: corrupt: {e}", err=True)
            sys.exit(EXIT_CORRUPT)
        except LockHeld as e:
            click.echo(f"slurm-ckpt: {e}", err=True)
            sys.exit(EXIT_LOCKED)
        except SlurmCkptError as e:
            click.echo(f"slurm-ckpt: error: {e}", err=True)
            sys.exit(EXIT_FAIL)

    return wrapper  # type: ignore[return-value]


def _run_dir(dir: str | None) -> Path:
    from ._env import default_run_dir

    return Path(dir) if dir else default_run_dir(load_config())


def _search_dirs(dir: str | None) -> list[Path]:
    """``--dir`` alone; else the durable run dir and, when it exists, the scratch tier first."""
    from ._env import scratch_dir
    from .store.tiers import read_dirs

    return [Path(dir)] if dir else read_dirs(_run_dir(None), scratch_dir())


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="slurm-ckpt")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """Crash-safe checkpoints for Slurm jobs: save, verify, resume, requeue."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="slurm-ckpt: %(levelname)s: %(message)s")


_dir_option = click.option(
    "--dir", "dir", type=click.Path(file_okay=False), default=None,
    help="Run dir (default: $SLURM_CKPT_DIR, then the config's storage.root, then ./checkpoints).",
)  # fmt: skip


@main.command()
@_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the path.")
@click.option("--quick", is_flag=True, help="Check sizes and headers only, not every checksum.")
@_errors_to_exit
def resume(dir: str | None, as_json: bool, quick: bool) -> None:
    """Print the newest valid checkpoint; exit 3 if there is none.

    Corrupt or partial checkpoints are skipped and named on stderr. Without
    --dir, the job's scratch tier ($SLURM_CKPT_SCRATCH/ckpt) is searched too.
    """
    from .store import find_latest

    skipped: list[Skipped] = []
    dirs = _search_dirs(dir)
    cand = find_latest(dirs, full=not quick, skipped=skipped)
    for s in skipped:
        click.echo(f"slurm-ckpt: skipped {s.path}: {s.reason}", err=True)
    if cand is None:
        if as_json:
            click.echo(json.dumps({"path": None, "step": None}))
        else:
            click.echo(f"slurm-ckpt: no valid checkpoint in {' or '.join(map(str, dirs))}", err=True)
        sys.exit(EXIT_NONE)
    if as_json:
        m = cand.manifest
        click.echo(json.dumps({"path": str(cand.path), "step": cand.step, "time": m.time,
                               "job_id": m.job_id, "nbytes": m.nbytes}))  # fmt: skip
    else:
        click.echo(str(cand.path))


@main.command("ls")
@_dir_option
@click.option("--full", is_flag=True, help="Verify every checksum (reads all data).")
@_errors_to_exit
def ls_(dir: str | None, full: bool) -> None:
    """List checkpoints: step, time, size and status (of each tier, without --dir)."""
    dirs = _search_dirs(dir)
    for run_dir, tier in zip(dirs, ["scratch", "durable"] if len(dirs) > 1 else [""], strict=True):
        if tier:
            click.echo(f"# {tier} tier: {run_dir}")
        _ls_dir(run_dir, full)


def _ls_dir(run_dir: Path, full: bool) -> None:
    from .placement.replicas import read_index
    from .store import verify_checkpoint
    from .store.layout import list_steps

    rows = list_steps(run_dir)
    # Steps saved on the nodes' scratch with peer replicas: on how many nodes each lives.
    replicas = read_index(run_dir)
    committed = {step for step, _ in rows}
    scratch_only = sorted((int(k) for k in replicas if k.isdigit() and int(k) not in committed), reverse=True)
    if not rows and not scratch_only:
        click.echo(f"no checkpoints in {run_dir}")
        return
    click.echo(f"{'STEP':>10}  {'TIME (UTC)':<20}  {'SIZE':>9}  STATUS")
    entries = sorted([*((step, path) for step, path in rows), *((step, None) for step in scratch_only)],
                     key=lambda e: e[0], reverse=True)  # fmt: skip
    for step, path in entries:
        info = replicas.get(str(step))
        if path is None:
            assert info is not None
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(info.get("time", 0))))
            click.echo(f"{step:>10}  {when:<20}  {'-':>9}  on scratch only, on {_nodes(info)}")
            continue
        try:
            m = verify_checkpoint(path, full=full)
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m.time))
            size, status = format_size(sum(r.size for r in m.files.values())), "ok" if full else "ok (sizes)"
        except CheckpointCorrupt as e:
            when, size, status = "-", "-", f"CORRUPT: {e}"
        if info is not None and status.startswith("ok"):
            status += f"; also on {_nodes(info)}' scratch"
        click.echo(f"{step:>10}  {when:<20}  {size:>9}  {status}")


def _nodes(info: dict[str, Any]) -> str:
    n = info.get("nodes")
    return f"{n} node" + ("" if n == 1 else "s")


@main.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@_errors_to_exit
def verify(path: str) -> None:
    """Verify every file and checksum of one checkpoint dir; exit 4 naming a bad file."""
    from .store import verify_checkpoint

    m = verify_checkpoint(Path(path), full=True)
    click.echo(f"ok: step {m.step}, {len(m.files)} files, {format_size(sum(r.size for r in m.files.values()))}")


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--local", is_flag=True, help="Run outside Slurm; a 'requeue' restarts CMD in place.")
@click.option("--preempt-after", type=float, multiple=True, metavar="S",
              help="Send the checkpoint signal S seconds after CMD starts (repeat: one per run).")  # fmt: skip
@click.option("--signal", "sig", default=None, help="Checkpoint signal (default: wrapper.signal, USR1).")
@click.option("--max-requeues", type=click.IntRange(min=0), default=None,
              help="Give up requeueing once SLURM_RESTART_COUNT reaches this.")  # fmt: skip
@click.option("--margin", type=click.FloatRange(min=0), default=None,
              help="Seconds before the job's end time by which the checkpoint must be committed.")  # fmt: skip
@click.option("--hang-timeout", type=click.FloatRange(min=0), default=None, metavar="S",
              help="Requeue without the node that holds the job up after S seconds with no step "
                   "progress (default: wrapper.hang_timeout; 0: off).")  # fmt: skip
@_dir_option
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@_errors_to_exit
def run(
    local: bool, preempt_after: tuple[float, ...], sig: str | None, max_requeues: int | None,
    margin: float | None, hang_timeout: float | None, dir: str | None, cmd: tuple[str, ...],
) -> None:  # fmt: skip
    """Run CMD so that a Slurm signal becomes a checkpoint and a requeue.

    Exits with CMD's status, or 0 after a requeue. See `slurm_ckpt.wrapper`.
    """
    from . import startsignals

    startsignals.hold()  # before the imports and config below: a signal may come already
    try:
        import dataclasses

        from .wrapper import run_wrapper

        cfg = load_config()
        flags: dict[str, Any] = {"signal": sig, "max_requeues": max_requeues, "margin": margin,
                                 "hang_timeout": hang_timeout}  # fmt: skip
        wcfg = dataclasses.replace(cfg.wrapper, **{k: v for k, v in flags.items() if v is not None})
        wcfg.validate()
        cfg = dataclasses.replace(cfg, wrapper=wcfg)
        code = run_wrapper(list(cmd), cfg, local=local, preempt_after=preempt_after, run_dir=dir)
    finally:
        startsignals.release()  # a no-op once the wrapper's trap took them over
    sys.exit(code)


@main.command()
# A plain string: click.Path would stat it here, and a stat on a hung mount never returns.
@click.argument("path", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.option("--slurm-conf", type=click.Path(dir_okay=False), default=None,
              help="slurm.conf to check (default: $SLURM_CONF, then /etc/slurm/slurm.conf).")  # fmt: skip
@click.option("--lead-time", type=float, default=None,
              help="Seconds of sbatch --signal=USR1@N warning (default: assume 120).")  # fmt: skip
@click.option("--ckpt-size", default=None, help="One checkpoint's size, e.g. 40GB or 37GiB (default: the newest in PATH).")
@click.option("--probe-size", default="128M", show_default=True, help="Most bytes the write probe writes.")
@click.option("--probe-seconds", type=float, default=5.0, show_default=True, help="Most seconds the probe runs.")
@click.option("--hang-seconds", type=float, default=5.0, show_default=True,
              help="Seconds a storage check may go without answering before the mount is reported hung.")  # fmt: skip
@_errors_to_exit
def doctor(
    path: str | None, as_json: bool, slurm_conf: str | None, lead_time: float | None,
    ckpt_size: str | None, probe_size: str, probe_seconds: float, hang_seconds: float,
) -> None:  # fmt: skip
    """Diagnose checkpoint storage and the Slurm setup; exit 0 ok, 6 warnings, 7 errors.

    PATH defaults to the run dir. Checks write+fsync bandwidth and latency, free
    space and inodes, mount type and options, quota, page-cache settings, who can
    write in storage.root and its per-user dirs, slurm.conf, the signal lead time against checkpoint size, and cgroup io limits.
    """
    from ._env import default_run_dir
    from .config import parse_size
    from .doctor import Severity, run_doctor

    cfg = load_config()
    report = run_doctor(path or default_run_dir(cfg), slurm_conf=slurm_conf, lead_time=lead_time,
                        ckpt_size=parse_size(ckpt_size) if ckpt_size else None, keep=cfg.storage.keep,
                        probe_bytes=parse_size(probe_size), probe_seconds=probe_seconds,
                        storage_root=cfg.storage.root, hang_seconds=hang_seconds)  # fmt: skip
    click.echo(report.to_json() if as_json else report.to_text())
    worst = report.worst
    if worst >= Severity.ERROR:
        sys.exit(EXIT_DOCTOR_ERROR)
    sys.exit(EXIT_DOCTOR_WARN if worst >= Severity.WARN else EXIT_OK)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
              add_help_option=False)  # fmt: skip
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """Benchmarks against torch.save, DCP, safetensors and the raw disk (from a source checkout).

    The benchmarks live in the checkout's ``bench/``, not in the installed
    package; this runs ``python -m bench`` there (``--help`` lists its options).
    """
    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "__init__.py").is_file():
        raise click.UsageError("the benchmarks ship with the source, not the package: "
                               "run `python -m bench` in a clone of slurm-ckpt")  # fmt: skip
    sys.path.insert(0, str(root))
    from bench.cli import bench as run

    run.main(list(args), prog_name="slurm-ckpt bench")


@main.group()
def node() -> None:
    """Node hooks: `prolog`/`epilog` run as root by the shims, `taskprolog` as the user.

    The hooks exit non-zero (which makes Slurm drain the node) only for a node
    fault; a job's own problems reach its output as warnings.
    """


@node.command("prolog")
@_errors_to_exit
def node_prolog() -> None:
    """Reserve and create the job's scratch, set its I/O limits, check its storage."""
    from .node import run_prolog

    run_prolog()


@node.command("epilog")
@_errors_to_exit
def node_epilog() -> None:
    """Stage out the newest scratch-only checkpoint, then remove scratch, reservation, cgroup."""
    from .node import run_epilog

    run_epilog()


@node.command("taskprolog")
def node_taskprolog() -> None:
    """Print `export`/`print` lines for slurmstepd (TaskProlog; never fails the task)."""
    from .node import task_prolog

    for line in task_prolog():
        click.echo(line)
