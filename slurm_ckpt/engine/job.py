"""A checkpoint ready to be written: the ``write`` function that ``commit()`` calls.

A job is made when a save is requested (``Engine.job``) and holds whatever
makes its data immune to later changes: the tensors themselves for a
synchronous save, a staged copy, or a forked child's copy-on-write snapshot.
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
from .forked import ForkedWriter
from .layout import FileImage

__all__ = ["ForkJob", "ImageJob", "LazyJob", "SaveJob"]

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
    """Writes a file image in the calling thread (tensors in place, or a staged copy)."""

    def __init__(self, enc: EncodedState, image: FileImage, write: WriteImage, mode: str) -> None:
        super().__init__(enc)
        self.image: FileImage | None = image
        self._write_image = write
        self.mode = mode
        self.captured.set()

    def _write_tensors(self, path: Path) -> FileRecord:
        assert self.image is not None, "job already closed"
        return self._write_image(path, self.image)

    def close(self) -> None:
        self.image = None
        super().close()


class ForkJob(SaveJob):
    """Writes from a forked child's copy-on-write snapshot."""

    mode = "fork"

    def __init__(self, enc: EncodedState, writer: ForkedWriter) -> None:
        super().__init__(enc)
        self.writer = writer
        self.captured.set()

    def _write_tensors(self, path: Path) -> FileRecord:
        return self.writer.write(path)

    def close(self) -> None:
        self.writer.close()
        super().close()


class LazyJob(SaveJob):
    """Copies the live tensors into staging on the first write, in the background.

    The trainer must not change them until ``captured`` is set: that is the
    fence (``SaveHandle.fence()``), which it calls before ``optimizer.step()``.
    """

    mode = "lazy"

    def __init__(self, enc: EncodedState, stage: Callable[[], FileImage], write: WriteImage) -> None:
        super().__init__(enc)
        self._stage = stage
        self._write_image = write
        self._image: FileImage | None = None

    def _write_tensors(self, path: Path) -> FileRecord:
        if self._image is None:
            try:
                self._image = self._stage()
            finally:
                self.captured.set()  # on failure too: a fence must never hang
        return self._write_image(path, self._image)

    def close(self) -> None:
        self._image = None
        super().close()
