"""A checkpoint ready to be written: the ``write`` function that ``commit()`` calls.

A job is made when a save is requested (``Engine.job``, one snapshot module
per mode in ``snapshot/``) and holds whatever makes its data immune to later
changes: the tensors themselves for a synchronous save, a staged copy, a copy
being made on a thread of its own, or a forked child's copy-on-write snapshot
(``snapshot/fork.py``).
``write(tmp)`` can be called more than once, each time into a fresh temp dir,
because a retried commit writes everything again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..store.codec import EncodedState
from ..store.tensorfile import FileRecord
from ..store.writer import small_files, tensor_file_name, tensor_index, write_small_files
from .guard import hold, release
from .layout import FileImage

__all__ = ["ImageJob", "SaveJob", "WriteImage"]

WriteImage = Callable[[Path, FileImage], FileRecord]


class SaveJob:
    """Files of one checkpoint: the small ones serialized now, the tensor file on ``write``."""

    mode = "sync"

    def __init__(self, enc: EncodedState) -> None:
        self.blobs = small_files(enc)  # now: later changes to the objects must not leak in
        self.name = tensor_file_name(0)
        self.index = tensor_index(enc, self.name)
        self.nbytes = enc.nbytes
        self.has_tensors = bool(enc.tensors)
        self.captured = threading.Event()
        """Set once the trainer's tensors are no longer read (see ``SaveHandle.fence``)."""

    def write(self, tmp: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
        files = write_small_files(tmp, self.blobs)
        if self.has_tensors:
            files[self.name] = self._write_tensors(tmp / self.name)
        return files, self.index

    def _write_tensors(self, path: Path) -> FileRecord:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the job holds; after this ``write`` must not be called."""
        self.captured.set()


class ImageJob(SaveJob):
    """Writes a file image: the tensors in place, a staged copy, or one still being staged.

    ``image`` is the image, or a function that makes it (the ``overlap``
    snapshot's copy), which runs at once on a thread of its own; ``write``
    waits for it. The trainer must not change what that thread copies until
    ``captured`` is set, and every ``optimizer.step()`` waits for it by itself
    (``guard.py``). Copying before the commit starts, rather than in
    ``write``, keeps a fence from waiting on a filesystem that stalls.
    """

    def __init__(self, enc: EncodedState, image: FileImage | Callable[[], FileImage], write: WriteImage,
                 mode: str) -> None:  # fmt: skip
        super().__init__(enc)
        self.mode = mode
        self._write_image = write
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if isinstance(image, FileImage):
            self.image: FileImage | None = image
            self.captured.set()
            return
        self.image = None
        self._capture: Callable[[], FileImage] | None = image
        hold(self.captured)
        self._thread = threading.Thread(target=self._copy, name="slurm-ckpt-copy", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        try:
            assert self._capture is not None
            self.image = self._capture()
        except BaseException as e:  # raised by write(), so the commit fails with it
            self._error = e
        finally:
            self._capture = None  # it holds the trainer's tensors
            self.captured.set()  # on failure too: a fence must never hang
            release(self.captured)

    def _write_tensors(self, path: Path) -> FileRecord:
        self.captured.wait()
        if self._error is not None:
            raise self._error
        assert self.image is not None, "job already closed"
        return self._write_image(path, self.image)

    def close(self) -> None:
        if self._thread is not None:
            # The staging buffer goes to the next save: no copy may still be writing into it.
            self._thread.join()
        self.image = None
        super().close()
