"""Fixtures shared by the whole suite. Keep this small and generic."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)

# One budget for every property test, so the suite's time is set here and not test by
# test. No deadline: on a shared or loaded machine a slow example is not a failure.
# HYPOTHESIS_PROFILE=thorough searches far longer, for a nightly run or a change to the
# code a property test guards.
settings.register_profile("default", max_examples=40, deadline=None)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# With pytest-xdist (``pytest -n 2 --dist loadscope``, as scripts/test.sh runs it) the
# tests that use the machine itself (Slurm clusters, the node hooks as root, loop and
# FUSE mounts, cgroups, the storage lab) form one unit of work: one worker runs them one
# after another, as without xdist. The others run beside them a module at a time, so a
# module's fixtures (a pool of ranks, a saved checkpoint) start once.
_MACHINE = frozenset({"faults", "node", "slurm", "storage"})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class _MachineFirst(LoadScopeScheduling):  # type: ignore[misc]
        # The largest unit goes out first (--loadscope-reorder): the machine's.
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            parts = module.split("/")
            return "machine" if len(parts) > 2 and parts[1] in _MACHINE else module

    return _MachineFirst(config, log)


@pytest.fixture(autouse=True)
def _isolated_process_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No SLURM_CKPT_* from the caller's shell leaks in; signal handlers are restored.

    A ``Checkpointer`` installs SIGTERM/SIGUSR1 handlers in the main thread;
    without the restore, one test would change how later tests react to signals.
    """
    for var in list(os.environ):
        if var.startswith("SLURM_CKPT_"):
            monkeypatch.delenv(var)
    saved = {s: signal.getsignal(s) for s in _SIGNALS}
    yield
    for s, handler in saved.items():
        if handler is not None:
            signal.signal(s, handler)


def _figures_dir(config: pytest.Config) -> Path:
    return Path(config._tmp_path_factory.getbasetemp()) / "figures"  # type: ignore[attr-defined]


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[[str, str], Path]:
    """``figures(name, text)`` records measured figures or captured output for the report.

    Each record is a file under the session's temp dir and is printed in the
    terminal summary, so CI logs show it without ``-s``.
    """

    def record(name: str, text: str) -> Path:
        out = _figures_dir(request.config)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{name}.txt"
        path.write_text(text if text.endswith("\n") else text + "\n")
        return path

    return record


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    try:
        out = _figures_dir(config)
    except (AttributeError, OSError):
        return
    # Each xdist worker has its own temp dir under the session's (popen-gw0, ...).
    for path in sorted([*out.glob("*.txt"), *out.parent.glob("*/figures/*.txt")], key=lambda p: p.name):
        terminalreporter.section(f"figures: {path.stem} ({path})")
        terminalreporter.write(path.read_text())


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A fresh, not yet created run dir."""
    return tmp_path / "run"


def _is_mountpoint(path: Path) -> bool:
    return subprocess.run(["mountpoint", "-q", str(path)], check=False).returncode == 0


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Factory: ``tmpfs("4m")`` mounts a real tmpfs of that size and returns its path.

    Skips unless root. Every mount is unmounted at teardown, even on failure.
    """
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        path = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                       check=True)  # fmt: skip
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        if _is_mountpoint(path):
            # -l: a test that failed may still hold a file open in there.
            subprocess.run(["umount", "-l", str(path)], check=False)
