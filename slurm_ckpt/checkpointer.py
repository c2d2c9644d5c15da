"""The training-side API: ``Checkpointer``."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from ._env import default_run_dir, job_id
from .config import Config, load_config
from .control import Control
from .errors import CheckpointCorrupt
from .store import RunDir, Skipped, find_latest, iter_valid, load_state, note_skip
from .store.codec import encode_state
from .store.writer import write_state

__all__ = ["Checkpointer", "SaveHandle"]

log = logging.getLogger("slurm_ckpt")


class SaveHandle:
    """A save in flight. ``wait()`` returns the committed path or raises its error."""

    def __init__(self, step: int) -> None:
        self.step = step
        self._done = threading.Event()
        self._path: Path | None = None
        self._error: BaseException | None = None

    def _finish(self, path: Path | None, error: BaseException | None) -> None:
        self._path, self._error = path, error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout}s")
        if self._error is not None:
            raise self._error
        assert self._path is not None
        return self._path


class Checkpointer:
    """Saves and restores training state, crash-safely.

    The run dir is ``dir`` if given, else ``$SLURM_CKPT_DIR``, else
    ``<storage.root>/<user>/job_<id>`` from the config, else ``./checkpoints``.

    >>> ckpt = Checkpointer()
    >>> state = ckpt.load_latest()          # None on a fresh start
    >>> ckpt.save({"model": model.state_dict(), "step": 10}, step=10)
    """

    def __init__(
        self,
        dir: str | Path | None = None,
        *,
        keep: int | None = None,
        config: Config | None = None,
        allow_pickle: bool | None = None,
        lock_timeout: float | None = 0,
    ) -> None:
        self.config = config or load_config()
        self.run_dir = RunDir(Path(dir) if dir else default_run_dir(self.config), lock_timeout=lock_timeout)
        self.keep = keep if keep is not None else self.config.storage.keep
        self.allow_pickle = self.config.storage.allow_pickle if allow_pickle is None else allow_pickle
        self.control = Control()
        self.control.install()
        self._inflight: SaveHandle | None = None
        self.last_committed: Path | None = None
        self.loaded_step: int | None = None
        self.loaded_path: Path | None = None

    @property
    def dir(self) -> Path:
        return self.run_dir.path

    @property
    def search_dirs(self) -> list[Path]:
        """Run dirs that discovery looks in, fastest tier first."""
        return [self.dir]

    @property
    def preempted(self) -> bool:
        """True once a checkpoint-and-stop was requested (the wrapper's signal)."""
        return self.control.requested

    def save(self, state: Any, step: int) -> Path:
        """Write ``state`` as checkpoint ``step``; return once it is durable and committed."""
        self._drain_inflight()
        return self._save_sync(state, step)

    def _save_sync(self, state: Any, step: int) -> Path:
        enc = encode_state(state, allow_pickle=self.allow_pickle)
        path = self.run_dir.commit(
            step, lambda tmp: write_state(tmp, enc), nbytes=enc.nbytes, job_id=job_id()
        )
        self.last_committed = path
        self.run_dir.retain(self.keep, protect=[path])
        self.control.report_committed(step, str(path))
        return path

    def save_async(self, state: Any, step: int) -> SaveHandle:
        """Stage ``state`` and write it in the background; returns once staging is done.

        Later in-place changes to the state's tensors do not reach this checkpoint.
        """
        self._drain_inflight()
        staged = encode_state(state, allow_pickle=self.allow_pickle,
                              prepare=lambda t: t.detach().to("cpu", copy=True).contiguous())  # fmt: skip
        handle = SaveHandle(step)

        def run() -> None:
            try:
                path = self.run_dir.commit(step, lambda tmp: write_state(tmp, staged),
                                           nbytes=staged.nbytes, job_id=job_id())  # fmt: skip
                self.last_committed = path
                self.run_dir.retain(self.keep, protect=[path])
                self.control.report_committed(step, str(path))
                handle._finish(path, None)
            except BaseException as e:  # surfaced on wait() and the next save
                log.error("background save of step %d failed: %s", step, e)
                handle._finish(None, e)

        self._inflight = handle
        threading.Thread(target=run, name=f"slurm-ckpt-save-{step}", daemon=False).start()
        return handle

    def _drain_inflight(self) -> None:
        h, self._inflight = self._inflight, None
        if h is not None:
            h.wait()

    def wait(self) -> None:
        """Block until any background save is committed; raise its error if it failed."""
        self._drain_inflight()

    def latest(self, *, skipped: list[Skipped] | None = None) -> Path | None:
        """Path of the newest checkpoint that passes a full verification, or None."""
        cand = find_latest(self.search_dirs, full=True, skipped=skipped)
        return cand.path if cand else None

    def load_latest(
        self, *, map_location: Any = None, trusted: bool = False, skipped: list[Skipped] | None = None
    ) -> Any:
        """The state of the newest valid checkpoint, or None if there is none.

        Checksums are verified as the data is read; a checkpoint that fails is
        skipped with a warning naming the bad file, and the next older one is
        tried. ``loaded_step`` and ``loaded_path`` then say which one was used.
        """
        for cand in iter_valid(self.search_dirs, full=False, skipped=skipped):
            try:
                state = load_state(cand.path, cand.manifest, map_location=map_location, trusted=trusted)
            except CheckpointCorrupt as e:
                note_skip(cand.path, str(e), skipped)
                continue
            self.loaded_step, self.loaded_path = cand.step, cand.path
            return state
        return None

    def close(self) -> None:
        """Finish any background save and release the run dir lock."""
        try:
            self._drain_inflight()
        finally:
            self.run_dir.unlock()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
