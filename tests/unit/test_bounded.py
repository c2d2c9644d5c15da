"""``store/bounded.py``: a call that does not return is given up on, and commits nothing after.

The hang here is a write function waiting on an event; the real one (servers
stopped under a FUSE mount) is in ``tests/storage/test_storage_hung.py``.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import pytest

from slurm_ckpt.errors import StorageError, StorageHung
from slurm_ckpt.store.bounded import Bound
from slurm_ckpt.store.commit import commit
from slurm_ckpt.store.layout import list_steps
from slurm_ckpt.store.tensorfile import FileRecord


def test_result_and_error_pass_through(tmp_path: Path) -> None:
    b = Bound(tmp_path, 30)
    assert b.call(lambda: 7) == 7
    with pytest.raises(StorageError) as e:
        b.call(lambda: (_ for _ in ()).throw(StorageError(errno.EIO, "boom", tmp_path)))
    assert e.value.errno == errno.EIO


def test_hung_call_is_given_up_and_not_piled_on(tmp_path: Path) -> None:
    stalls: list[bool] = []
    b = Bound(tmp_path, 0.2, stalls.append)
    release = threading.Event()
    with pytest.raises(StorageHung) as e:
        b.call(release.wait)
    assert isinstance(e.value, TimeoutError) and e.value.filename == str(tmp_path)
    assert stalls == [True] and b.stalled
    with pytest.raises(StorageHung, match="still stuck"):
        b.call(lambda: 1)
    stuck = b.abandoned
    assert stuck is not None
    release.set()
    stuck.join(30)
    assert stalls == [True, False] and not b.stalled
    assert b.call(lambda: 2) == 2


def test_given_up_commit_leaves_nothing(tmp_path: Path) -> None:
    """The worker comes back after the caller went on: no checkpoint, no temp dir."""
    release = threading.Event()

    def write(into: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
        release.wait()  # the hung write()
        (into / "data").write_bytes(b"written after the trainer went on")
        return {}, {}

    b = Bound(tmp_path, 0.2)
    with pytest.raises(StorageHung):
        b.call(lambda: commit(tmp_path, 5, write))
    stuck = b.abandoned
    assert stuck is not None
    release.set()
    stuck.join(30)
    assert list_steps(tmp_path) == []
    assert list(tmp_path.iterdir()) == []
