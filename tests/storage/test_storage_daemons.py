"""A server of the real GlusterFS or CephFS killed in the middle of a save.

The fault fires from inside the save, at a chosen point (the first block of
tensor data, or the manifest), so it always lands mid-save. The save runs on
a thread: where the client blocks until the server is back, a watchdog
restarts it (``Lab.killed``), so the test always ends. Afterwards the newest
valid checkpoint, read through the other mount, must be bit-exact, and no
checkpoint-looking directory may be partial.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_ckpt import Checkpointer
from slurm_ckpt.config import Config, MetricsConfig, StorageConfig
from slurm_ckpt.errors import SlurmCkptError
from slurm_ckpt.store import verify_checkpoint
from tests.faults.helpers import check_state, state
from tests.storage.lab import Lab

pytestmark = pytest.mark.root

KIB = 16384  # 16 MiB of tensor data: several blocks, so "the first block" is mid-save
# Seconds the save may take with the server down before the test restarts it itself.
DEGRADED = 20.0


def _config(tmp_path: Path) -> Config:
    return Config(storage=StorageConfig(keep=3, retry_backoff=0.01),
                  metrics=MetricsConfig(textfile_dir=str(tmp_path / "metrics")))  # fmt: skip


@pytest.fixture
def run_dirs(lab: Lab, request: pytest.FixtureRequest) -> Iterator[tuple[Path, Path]]:
    fs = request.param
    name = f"d-{time.monotonic_ns()}"
    a, b = lab.mount(fs, "a") / name, lab.mount(fs, "b") / name
    a.mkdir()
    yield a / "run", b / "run"
    shutil.rmtree(a, ignore_errors=True)


def _fire_at(monkeypatch: pytest.MonkeyPatch, at: str, fault: Callable[[], None]) -> threading.Event:
    """Run ``fault`` once, inside the save: at its first data write, or before its manifest."""
    import slurm_ckpt.engine.writer as engine_writer
    import slurm_ckpt.store.commit as commit

    fired = threading.Event()
    once = threading.Lock()

    def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
        def hooked(*args: Any, **kwargs: Any) -> Any:
            with once:
                if not fired.is_set():
                    fault()
                    fired.set()
            return real(*args, **kwargs)

        return hooked

    if at == "data":
        monkeypatch.setattr(engine_writer, "_pwritev_all", wrap(engine_writer._pwritev_all))
    else:
        monkeypatch.setattr(commit, "write_file_durably", wrap(commit.write_file_durably))
    return fired


class Outcome:
    """What the save under the fault did."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.while_down = False  # it returned before the server was restarted
        self.restarted_at_once = False


def _save_through(lab: Lab, server: str, a: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  at: str, *, restart_at_once: bool = False) -> Outcome:  # fmt: skip
    """Step 1 committed, then step 2 saved with ``server`` killed at ``at``."""
    writer = Checkpointer(a, config=_config(tmp_path))
    writer.save(state(1, kib=KIB), step=1)
    out = Outcome()
    out.restarted_at_once = restart_at_once

    def fault() -> None:
        lab.kill(server)
        if restart_at_once:
            lab.restart(server)

    fired = _fire_at(monkeypatch, at, fault)

    def save() -> None:
        t0 = time.monotonic()
        try:
            out.path = writer.save(state(2, kib=KIB), step=2)
        except BaseException as e:  # judged by the test
            out.error = e
        out.seconds = time.monotonic() - t0

    saver = threading.Thread(target=save)
    try:
        with lab.killed(server, bound=DEGRADED + 10):
            saver.start()
            saver.join(DEGRADED)
            out.while_down = not saver.is_alive()
        saver.join(60)
        assert not saver.is_alive(), f"the save still blocks 60 s after {server} came back"
    finally:
        monkeypatch.undo()
        writer.close()
    assert fired.is_set(), "the fault never fired: the save did not reach the hook"
    return out


def _check_after(a: Path, b: Path, tmp_path: Path, out: Outcome) -> None:
    """The save committed or failed typed; the newest valid checkpoint through the other
    mount is the one it should be, bit-exact; nothing partial looks committed."""
    if out.error is not None:
        assert isinstance(out.error, SlurmCkptError), repr(out.error)
    want = 2 if out.error is None else 1
    reader = Checkpointer(b, config=_config(tmp_path))
    skipped: list[Any] = []
    try:
        loaded = reader.load_latest(skipped=skipped)
        assert loaded is not None, (f"no valid checkpoint through the other mount: skipped {skipped}, "
                                    f"{sorted(p.name for p in b.iterdir())} there, "
                                    f"{sorted(p.name for p in a.iterdir())} through the first")  # fmt: skip
        check_state(loaded, want, kib=KIB)
        assert reader.loaded_step == want
    finally:
        reader.close()
    for p in b.iterdir():
        if p.name.startswith("step-"):
            verify_checkpoint(p, full=True)  # raises on a partial or damaged checkpoint
    # The filesystem works again: a new save through one mount is the newest through the other.
    writer = Checkpointer(a, config=_config(tmp_path))
    try:
        writer.save(state(3, kib=64), step=3)
    finally:
        writer.close()
    reader = Checkpointer(b, config=_config(tmp_path))
    try:
        check_state(reader.load_latest(), 3)
    finally:
        reader.close()


def _report(server: str, at: str, out: Outcome) -> None:
    what = "committed" if out.error is None else f"failed: {type(out.error).__name__}: {out.error}"
    when = "with the server down" if out.while_down else "after the restart"
    if out.restarted_at_once:
        when = "the server restarted at once"
    print(f"\n{server} killed at {at}: {what} in {out.seconds:.2f} s, {when}")


@pytest.mark.parametrize("run_dirs", ["gluster"], indirect=True)
@pytest.mark.parametrize("brick", ["gluster-b1", "gluster-b2"])
def test_gluster_brick_killed_mid_save(lab: Lab, run_dirs: tuple[Path, Path], brick: str, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    a, b = run_dirs
    out = _save_through(lab, brick, a, tmp_path, monkeypatch, "data")
    _report(brick, "data", out)
    assert out.while_down, f"the save waited for {brick} to come back: the other brick holds a replica"
    _check_after(a, b, tmp_path, out)


@pytest.mark.parametrize("run_dirs", ["ceph"], indirect=True)
def test_ceph_osd_killed_mid_save(lab: Lab, run_dirs: tuple[Path, Path], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    a, b = run_dirs
    out = _save_through(lab, "ceph-osd.1", a, tmp_path, monkeypatch, "data")
    _report("ceph-osd.1", "data", out)
    assert out.while_down, "the save waited for the OSD to come back: the other OSD holds a replica"
    _check_after(a, b, tmp_path, out)


@pytest.mark.parametrize("run_dirs", ["ceph"], indirect=True)
@pytest.mark.parametrize("at", ["data", "manifest"])
def test_ceph_mds_restarted_mid_save(lab: Lab, run_dirs: tuple[Path, Path], at: str, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    a, b = run_dirs
    before = lab.pids("ceph-mds")
    out = _save_through(lab, "ceph-mds", a, tmp_path, monkeypatch, at, restart_at_once=True)
    _report("ceph-mds", at, out)
    _check_after(a, b, tmp_path, out)
    after = lab.pids("ceph-mds")
    assert after and not after & before, f"the MDS was not restarted: {before} then {after}"
