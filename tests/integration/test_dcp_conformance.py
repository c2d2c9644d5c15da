"""slurm_ckpt.dcp against DCP's own FileSystemWriter/FileSystemReader, on the same input.

Each case runs once per backend: ``stock`` (DCP's file-system writer and
reader on a plain dir) and ``ours`` (``StorageWriter(run dir, step=0)`` and
``StorageReader(run dir)``). What DCP's users see (``storage_meta``, what
``overwrite=False`` refuses, what a load gives back) must be the same for
both; the cases that differ by design (stream extensions) say so.

One process, DCP's no-dist mode; the multi-rank cases are in ``test_dcp_dist.py``.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

from slurm_ckpt.dcp import StorageReader, StorageWriter
from slurm_ckpt.store import find_latest


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*uninitialized, assuming the intent")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        yield


@dataclass(frozen=True)
class Backend:
    name: str
    writer: Callable[..., Any]
    reader: Callable[[Path], Any]


STOCK = Backend("stock", lambda where, **kw: dcp.FileSystemWriter(where, **kw), lambda where: dcp.FileSystemReader(where))
OURS = Backend("ours", lambda where, **kw: StorageWriter(where, step=0, scratch=False, **kw),
               lambda where: StorageReader(where, scratch=False))  # fmt: skip


@pytest.fixture(params=[STOCK, OURS], ids=lambda b: b.name)
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.param  # type: ignore[no-any-return]


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16)},
        "step": torch.tensor(seed),
        "blob": io.BytesIO(f"bytes of {seed}".encode()),
        "meta": {"lr": 0.1 * seed, "name": f"run-{seed}", "sizes": [seed, seed + 1]},
    }


def template() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(6, 5), "b": torch.zeros(5, dtype=torch.bfloat16)}, "step": torch.tensor(-1),
            "blob": io.BytesIO(), "meta": {"lr": 0.0, "name": "", "sizes": []}}  # fmt: skip


def plain(value: Any) -> Any:
    """A loaded state as comparable Python values."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), value.tolist())
    if isinstance(value, io.BytesIO):
        return value.getvalue()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def load(backend: Backend, where: Path, into: dict[str, Any] | None = None) -> Any:
    target = template() if into is None else into
    dcp.load(target, storage_reader=backend.reader(where))
    return plain(target)


def test_storage_meta_names_the_path_the_reader_was_given_and_the_save(backend: Backend, tmp_path: Path) -> None:
    where = tmp_path / "ckpt"
    writer = backend.writer(where)
    dcp.save(state(1), storage_writer=writer)
    reader = backend.reader(where)
    meta = reader.read_metadata().storage_meta
    assert str(meta.checkpoint_id) == str(where)
    assert meta.save_id == writer.save_id is not None
    assert meta.load_id == reader.load_id is not None


@pytest.mark.parametrize("name", ["step-0", "step-000000000"])
def test_our_reader_given_a_step_dir_reports_that_path_and_the_save(tmp_path: Path, name: str) -> None:
    run = tmp_path / "run"
    writer = StorageWriter(run, step=0, scratch=False)
    dcp.save(state(1), storage_writer=writer)
    given = str(run / name)
    reader = StorageReader(given, scratch=False)
    meta = reader.read_metadata().storage_meta
    assert (meta.checkpoint_id, meta.save_id) == (given, writer.save_id)
    assert reader.checkpoint == run / "step-000000000"  # where it read from, apart


def test_each_save_has_its_own_save_id_and_the_reader_reports_the_one_it_reads(tmp_path: Path) -> None:
    run = tmp_path / "run"
    writer = StorageWriter(scratch=False)
    ids = []
    for step in (1, 2):
        dcp.save(state(step), checkpoint_id=str(run / f"step-{step}"), storage_writer=writer)
        ids.append(writer.save_id)
    assert ids[0] != ids[1]
    assert [StorageReader(run / f"step-{s}", scratch=False).read_metadata().storage_meta.save_id
            for s in (1, 2)] == ids  # fmt: skip


def test_overwrite_false_refuses_a_second_save_and_keeps_the_first(backend: Backend, tmp_path: Path) -> None:
    where = tmp_path / "ckpt"
    dcp.save(state(1), storage_writer=backend.writer(where, overwrite=False))
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save(state(2), storage_writer=backend.writer(where, overwrite=False))
    assert load(backend, where) == plain(state(1))
    dcp.save(state(3), storage_writer=backend.writer(where, overwrite=True))
    assert load(backend, where) == plain(state(3))


def test_overwrite_false_refuses_a_step_the_run_dir_holds_when_saving_to_scratch(tmp_path: Path) -> None:
    # A new job's scratch starts empty while the run dir holds the step: it exists all the same.
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    scratch.mkdir()
    dcp.save(state(1), storage_writer=StorageWriter(run, step=4, scratch=False))
    w = StorageWriter(run, step=4, scratch=scratch, overwrite=False)
    with pytest.raises(CheckpointException, match=r"Checkpoint already exists.*step 4"):
        dcp.save(state(2), storage_writer=w)
    w.close()
    assert load(OURS, run) == plain(state(1))
    assert not [p.name for p in scratch.rglob("*step-*")]  # refused before anything was staged


class _Reverse(StreamTransformExtension):
    """A stream extension as a user would write one (DCP's own ``ZStandard`` needs a module not installed here)."""

    @staticmethod
    def registry_name() -> str:
        return "reverse"

    @staticmethod
    def from_descriptor(version: str) -> _Reverse:
        return _Reverse()

    def get_descriptor(self) -> str:
        return "reverse/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        raise AssertionError("slurm_ckpt.dcp must refuse the extension before it writes")

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        raise AssertionError("never read")


def test_stream_extensions_are_refused_when_the_save_is_planned_naming_the_extension(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with pytest.raises(CheckpointException, match="_Reverse") as refused:
        dcp.save(state(1), storage_writer=StorageWriter(run, step=0, scratch=False, _extensions=[_Reverse()]))
    assert "_extensions" in str(refused.value)
    assert find_latest([run]) is None
    assert not run.exists() or not [p for p in run.iterdir() if p.name.startswith((".tmp", "step-"))]
    # The refusal let go of the run dir; an empty list means no extensions, as for FileSystemWriter.
    dcp.save(state(2), storage_writer=StorageWriter(run, step=0, scratch=False, _extensions=[]))
    reader = StorageReader(run, scratch=False, _extension_registry=None)
    got = template()
    dcp.load(got, storage_reader=reader)
    assert plain(got) == plain(state(2))


def test_a_load_without_a_template_gives_what_stock_gives(tmp_path: Path) -> None:
    # What dcp_to_torch_save does: the whole checkpoint, as the checkpoint describes it.
    got = {}
    for b in (STOCK, OURS):
        where = tmp_path / b.name
        dcp.save(state(5), storage_writer=b.writer(where))
        out: dict[str, Any] = {}
        dcp.load(out, storage_reader=b.reader(where), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        got[b.name] = plain(out)
    assert got["ours"] == got["stock"]


def test_loads_into_other_dtypes_and_partial_templates_give_what_stock_gives(tmp_path: Path) -> None:
    def targets() -> list[dict[str, Any]]:
        return [
            {"model": {"w": torch.zeros(6, 5, dtype=torch.float64), "b": torch.zeros(5)}},  # cast on load
            {"model": {"b": torch.zeros(5, dtype=torch.bfloat16)}, "meta": {"name": ""}},  # part of the state
            {"meta": {"lr": 0.0, "name": "", "sizes": []}, "blob": io.BytesIO()},  # no tensors at all
        ]

    got: dict[str, list[Any]] = {}
    for b in (STOCK, OURS):
        where = tmp_path / b.name
        dcp.save(state(7), storage_writer=b.writer(where))
        got[b.name] = [load(b, where, t) for t in targets()]
    assert got["ours"] == got["stock"]


def test_an_empty_state_saves_and_loads_as_with_stock(backend: Backend, tmp_path: Path) -> None:
    where = tmp_path / "ckpt"
    dcp.save({}, storage_writer=backend.writer(where))
    out: dict[str, Any] = {}
    dcp.load(out, storage_reader=backend.reader(where))
    assert out == {}
