"""The load route (``store/load.py``): each file parsed once, nothing read before a refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_ckpt import Checkpointer, UnsafeLoad
from slurm_ckpt.store import tensorfile

torch = pytest.importorskip("torch")


def test_a_load_parses_each_data_files_header_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A state of 10,000 small tensors has a header of 10,000 entries: discovery
    # parsing it and then the reader parsing it again cost as much as the read.
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        ck.save({"model": {f"p{i}": torch.full((4,), float(i)) for i in range(50)}, "step": 1}, 1)
        parsed: list[Path] = []
        real = tensorfile.read_header
        monkeypatch.setattr(tensorfile, "read_header", lambda f, path, size: parsed.append(path) or real(f, path, size))
        for module in ("slurm_ckpt.engine.reader", "slurm_ckpt.store.verify"):
            monkeypatch.setattr(f"{module}.read_header", tensorfile.read_header)
        state = ck.load_latest()
    assert torch.equal(state["model"]["p49"], torch.full((4,), 49.0))
    assert [p.name for p in parsed] == ["tensors-00000.safetensors"]


def test_pickled_objects_without_trusted_are_refused_before_into_is_written(tmp_path: Path) -> None:
    # A large CPU target is read straight into its memory: the refusal must come
    # before that, or the caller's model holds the checkpoint it refused to load.
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False, allow_pickle=True) as ck:
        ck.save({"w": torch.ones(1 << 20), "obj": object.__new__(_Opaque)}, 1)
        target = torch.zeros(1 << 20)
        with pytest.raises(UnsafeLoad, match="trusted=True"):
            ck.load_latest(into={"w": target})
    assert not target.any()


class _Opaque:
    """A value only pickle can hold."""
