"""slurm_ckpt.dcp as DCP's own users drive it, in one process (DCP's no-dist mode), on real files.

The multi-rank checks (FSDP2, resharding, kill -9 mid-save) are in
``test_dcp_dist.py``; here: round trips of nested states, planner-driven
partial loads, async save, damage, discovery, the CLI, and the commit's
all-or-nothing.
"""

from __future__ import annotations

import errno
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from slurm_ckpt.cli import main
from slurm_ckpt.dcp import StorageReader, StorageWriter
from slurm_ckpt.dcp.index import is_dcp
from slurm_ckpt.errors import ConfigError, NoSpace, SnapshotChanged
from slurm_ckpt.store import find_latest, verify_checkpoint


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*uninitialized, assuming the intent")
        yield


def nested(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(700, 1000, generator=g)  # 2.8 MB: 43 blocks of 64 KiB
    return {
        "model": {
            "big": big,
            "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
            "half_t": torch.randn(5, 9, generator=g).half().T,  # not contiguous
            "ints": torch.randint(-(2**40), 2**40, (17,), generator=g),
            "flags": torch.rand(11, generator=g) > 0.5,
            "bytes": torch.randint(0, 255, (3, 3), dtype=torch.uint8, generator=g),
            "scalar": torch.tensor(3.25),
            "empty": torch.empty(0, 4),
        },
        "layers": [torch.full((2,), float(seed)), {"deep": torch.arange(6, dtype=torch.int16).reshape(2, 3)}],
        "step": 100 + seed,
        "name": f"run-{seed}",
        "lr": [0.1, 0.01],
    }


def zeros_like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like(v) for v in state]
    return type(state)()


def assert_same(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert set(got) == set(want)
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_same(a, b)
    else:
        assert got == want


def tensor_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, list):
        return sum(tensor_bytes(v) for v in state)
    return 0


def test_nested_state_round_trips_bit_exact(tmp_path: Path) -> None:
    state = nested()
    w = StorageWriter(tmp_path / "run", step=100)
    dcp.save(state, storage_writer=w)
    assert w.last_committed == tmp_path / "run" / "step-000000100"
    man = verify_checkpoint(w.last_committed, full=True)
    assert is_dcp(man) and man.step == 100 and man.world_size == 1
    big = man.tensors["model.big"]["chunks"][0]
    assert big["block"] == 64 << 10 and len(big["crc32"]) == 43  # 2,800,000 bytes in 64 KiB blocks
    target = zeros_like(state)
    r = StorageReader(tmp_path / "run")
    dcp.load(target, storage_reader=r)
    assert_same(target, state)
    # Exactly the tensors' bytes (whole blocks of whole chunks) plus the small items' bytes.
    assert r.bytes_read == r.bytes_needed >= tensor_bytes(state)


def test_the_files_are_standard_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open

    state = nested()
    w = StorageWriter(tmp_path / "run", step=1)
    dcp.save(state, storage_writer=w)
    assert w.last_committed is not None
    with safe_open(str(w.last_committed / "dcp-00000.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.big"), state["model"]["big"])
        assert torch.equal(f.get_tensor("model.half_t"), state["model"]["half_t"])


def test_load_converts_to_the_target_dtype_as_dcp_does(tmp_path: Path) -> None:
    state = {"w": torch.randn(64, 64)}
    dcp.save(state, storage_writer=StorageWriter(tmp_path / "run", step=1))
    target = {"w": torch.zeros(64, 64, dtype=torch.bfloat16)}
    dcp.load(target, storage_reader=StorageReader(tmp_path / "run"))
    assert torch.equal(target["w"], state["w"].to(torch.bfloat16))


def test_partial_loads_read_only_what_the_planner_asks_for(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    state = nested()
    dcp.save(state, storage_writer=StorageWriter(tmp_path / "run", step=1))
    # A target with a subset of the keys: only those are read.
    target = {"model": {"bf16": torch.zeros(33, 7, dtype=torch.bfloat16)}, "step": 0}
    r = StorageReader(tmp_path / "run")
    dcp.load(target, storage_reader=r)
    assert torch.equal(target["model"]["bf16"], state["model"]["bf16"]) and target["step"] == 100
    assert r.bytes_read == r.bytes_needed < 4096
    # A target key the checkpoint lacks: refused, unless the planner allows partial loads.
    extra = {"model": {"bf16": torch.zeros(33, 7, dtype=torch.bfloat16), "new": torch.zeros(2)}}
    with pytest.raises(CheckpointException, match="new"):
        dcp.load(extra, storage_reader=StorageReader(tmp_path / "run"))
    dcp.load(extra, storage_reader=StorageReader(tmp_path / "run"), planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(extra["model"]["new"], torch.zeros(2))
    # The planner that rebuilds a state from the metadata alone (DCP's "load by keys").
    got = _load_state_dict_from_keys({"layers"}, storage_reader=StorageReader(tmp_path / "run"))
    assert_same(got, {"layers": state["layers"]})


def test_async_save_holds_the_state_as_it_was_when_called(tmp_path: Path) -> None:
    state = nested()
    before = {"big": state["model"]["big"].clone(), "ints": state["model"]["ints"].clone()}
    fut = dcp.async_save(state, storage_writer=StorageWriter(tmp_path / "run", step=5))
    state["model"]["big"].add_(1.0)  # the trainer goes on and changes tensors in place
    state["model"]["ints"].zero_()
    (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result(timeout=120)
    target = zeros_like(nested())
    dcp.load(target, storage_reader=StorageReader(tmp_path / "run"))
    assert torch.equal(target["model"]["big"], before["big"])
    assert torch.equal(target["model"]["ints"], before["ints"])


def test_checkpoint_id_names_the_run_dir_and_step(tmp_path: Path) -> None:
    state = {"w": torch.arange(4.0)}
    dcp.save(state, checkpoint_id=str(tmp_path / "run" / "step-7"), storage_writer=StorageWriter())
    assert (tmp_path / "run" / "step-000000007" / "MANIFEST.json").is_file()
    target = {"w": torch.zeros(4)}
    dcp.load(target, checkpoint_id=str(tmp_path / "run" / "step-7"), storage_reader=StorageReader())
    assert torch.equal(target["w"], state["w"])
    with pytest.raises(ConfigError, match="does not end in step-N"):
        dcp.save(state, checkpoint_id=str(tmp_path / "run" / "latest"), storage_writer=StorageWriter())
    with pytest.raises(CheckpointException, match="no checkpoint to write"):
        dcp.save(state, storage_writer=StorageWriter(tmp_path / "run"))


def test_a_damaged_block_fails_the_load_naming_the_file(tmp_path: Path) -> None:
    state = nested()
    w = StorageWriter(tmp_path / "run", step=1)
    dcp.save(state, storage_writer=w)
    assert w.last_committed is not None
    f = w.last_committed / "dcp-00000.safetensors"
    man = verify_checkpoint(w.last_committed)
    big = man.tensors["model.big"]["chunks"][0]
    with f.open("r+b") as fh:  # one bit, in the big tensor's second block; the size stays
        fh.seek(big["at"] + big["block"] + 12345)
        b = fh.read(1)
        fh.seek(big["at"] + big["block"] + 12345)
        fh.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CheckpointException, match=r"dcp-00000.safetensors: checksum mismatch in bytes"):
        dcp.load(zeros_like(state), storage_reader=StorageReader(tmp_path / "run"))
    # What does not touch that block still loads.
    target = {"model": {"bf16": torch.zeros(33, 7, dtype=torch.bfloat16)}}
    dcp.load(target, storage_reader=StorageReader(tmp_path / "run"))
    assert torch.equal(target["model"]["bf16"], state["model"]["bf16"])
    out = CliRunner().invoke(main, ["verify", str(w.last_committed)])
    assert out.exit_code == 4 and "dcp-00000.safetensors: checksum mismatch" in out.output


def test_a_run_dir_loads_its_newest_valid_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    for step in (1, 2, 3):
        dcp.save(nested(step), storage_writer=StorageWriter(run, step=step, keep=10))
    (run / "step-000000003" / "dcp-00000.safetensors").open("r+b").truncate(1000)  # a torn copy
    (run / ".tmp-step-000000004-x-1-00").mkdir()  # never a candidate
    target = zeros_like(nested())
    r = StorageReader(run)
    dcp.load(target, storage_reader=r)
    assert r.checkpoint == run / "step-000000002"
    assert_same(target, nested(2))
    assert any("skipping" in m and "step-000000003" in m and "size is 1000" in m for m in caplog.messages)
    for step in (1, 2):
        (run / f"step-{step:09d}" / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointException, match=r"no valid checkpoint in .*skipped step-000000003: .*size is 1000"):
        dcp.load(zeros_like(nested()), storage_reader=StorageReader(run))


def test_the_cli_lists_verifies_and_resumes_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    dcp.save(nested(), storage_writer=StorageWriter(run, step=42))
    cli = CliRunner()
    out = cli.invoke(main, ["ls", "--dir", str(run), "--full"])
    assert out.exit_code == 0 and "42" in out.output and " ok" in out.output
    out = cli.invoke(main, ["verify", str(run / "step-000000042")])
    assert out.exit_code == 0 and out.output.startswith("ok: step 42, 1 files")
    out = cli.invoke(main, ["resume", "--dir", str(run)])
    assert out.exit_code == 0 and out.output.strip() == str(run / "step-000000042")


def test_retention_keeps_the_newest_k(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in range(1, 5):
        dcp.save({"w": torch.full((3,), float(step))}, storage_writer=StorageWriter(run, step=step, keep=2))
    from slurm_ckpt.store.retention import reaped

    reaped(30)
    assert sorted(p.name for p in run.glob("step-*")) == ["step-000000003", "step-000000004"]


def test_a_failed_write_commits_nothing_and_the_next_save_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import slurm_ckpt.engine.writer as engine_writer

    run = tmp_path / "run"
    w = StorageWriter(run, keep=10)
    w.step = 1
    dcp.save({"w": torch.ones(1000)}, storage_writer=w)
    real = engine_writer.write_image

    def full_disk(path: Path, image: Any, **kw: Any) -> Any:
        real(path, image, **kw)  # the bytes land, then the fsync finds the disk full
        raise NoSpace(errno.ENOSPC, "fsync failed", path)

    monkeypatch.setattr(engine_writer, "write_image", full_disk)
    w.step = 2
    with pytest.raises(CheckpointException, match="No space left on device"):
        dcp.save({"w": torch.full((1000,), 2.0)}, storage_writer=w)
    assert not (run / "step-000000002").exists()
    assert not list(run.glob(".tmp-*"))  # the coordinator's own failure: cleaned at once
    cand = find_latest([run])
    assert cand is not None and cand.step == 1
    # The run dir is not left locked: another writer saves at once.
    monkeypatch.setattr(engine_writer, "write_image", real)
    dcp.save({"w": torch.full((1000,), 3.0)}, storage_writer=StorageWriter(run, step=3))
    assert find_latest([run]).step == 3  # type: ignore[union-attr]


def test_a_tensor_changed_while_written_is_not_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import slurm_ckpt.engine.writer as engine_writer

    state = {"w": torch.zeros(300_000)}
    real = engine_writer.write_image

    def racing(path: Path, image: Any, **kw: Any) -> Any:
        state["w"][123_456] = 1.0  # another thread writes into the tensor meanwhile
        return real(path, image, **kw)

    monkeypatch.setattr(engine_writer, "write_image", racing)
    with pytest.raises(CheckpointException) as err:
        dcp.save(state, storage_writer=StorageWriter(tmp_path / "run", step=1))
    assert "SnapshotChanged" in str(err.value) and "changed while it was being written" in str(err.value)
    assert isinstance(SnapshotChanged("x"), RuntimeError)
    assert find_latest([tmp_path / "run"]) is None


def test_another_writer_holding_the_run_dir_fails_the_save_clearly(tmp_path: Path) -> None:
    from slurm_ckpt import Checkpointer

    run = tmp_path / "run"
    with Checkpointer(run, distributed=False) as ck:
        ck.save({"x": torch.ones(2)}, step=1)
        with pytest.raises(CheckpointException, match="is locked by another writer"):
            dcp.save({"w": torch.ones(2)}, storage_writer=StorageWriter(run, step=2))
    assert find_latest([run]).step == 1  # type: ignore[union-attr]


def test_the_tier_drain_copies_a_dcp_checkpoint_verified(tmp_path: Path) -> None:
    """A checkpoint committed on scratch reaches the durable run dir through the same drain
    (``store/tiers.py``) as any other, every byte checked, and loads from there."""
    from slurm_ckpt.store import RunDir
    from slurm_ckpt.store.tiers import Tiers

    fast, durable = tmp_path / "scratch" / "ckpt", tmp_path / "durable"
    state = nested()
    w = StorageWriter(fast, step=9)
    dcp.save(state, storage_writer=w)
    assert w.last_committed is not None
    tiers = Tiers(RunDir(fast), RunDir(durable), keep=3)
    tiers.submit(9, w.last_committed)
    assert tiers.close(timeout=120) and tiers.take_error() is None
    assert tiers.is_durable(9)
    man = verify_checkpoint(durable / "step-000000009", full=True)
    assert is_dcp(man) and man.extra["copied_from"] == str(w.last_committed)
    target = zeros_like(state)
    r = StorageReader(durable)
    dcp.load(target, storage_reader=r)
    assert r.checkpoint == durable / "step-000000009"
    assert_same(target, state)
    # Told about scratch, a reader takes the scratch copy of the newest step.
    r = StorageReader(durable, search=[fast])
    dcp.load(zeros_like(state), storage_reader=r)
    assert r.checkpoint == fast / "step-000000009"


def test_ranks_that_resolved_different_checkpoints_are_refused(tmp_path: Path) -> None:
    """A run dir read while a checkpoint is committed: one rank may see it, another not."""
    from torch.distributed.checkpoint.planner import LoadPlan

    plans = [LoadPlan([], storage_data=(str(tmp_path / "step-000000001"), 1, 1.0)),
             LoadPlan([], storage_data=(str(tmp_path / "step-000000002"), 2, 2.0))]  # fmt: skip
    with pytest.raises(ConfigError, match="the ranks resolved different checkpoints"):
        StorageReader(tmp_path).prepare_global_plan(plans)
    assert StorageReader(tmp_path).prepare_global_plan(plans[:1] * 2) == plans[:1] * 2


# ---------------------------------------------------------------- both ways with the Checkpointer


class Opaque:
    def __init__(self, n: int = 0) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def test_dcp_load_reads_a_checkpoint_of_the_checkpointer(tmp_path: Path) -> None:
    from slurm_ckpt import Checkpointer

    model, opt, sched = trained()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(), "step": 7,
             "rng": torch.get_rng_state(), "tied": {"a": model[0].weight},
             "plain": {"size": torch.Size([2, 3]), "avg": np.float32(0.1), "pair": (1, np.int64(2))},
             "arrays": {"c": np.arange(3.0), "t": np.arange(6.0).reshape(2, 3).T}}  # fmt: skip
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        ck.save(state, step=7)
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=99)
    model2(torch.randn(4, 8)).sum().backward()
    opt2.step()  # the moments exist, as they must for DCP to load into them
    target = {"model": model2.state_dict(), "optim": opt2.state_dict(), "sched": sched2.state_dict(), "step": 0,
              "rng": torch.zeros_like(state["rng"]), "tied": {"a": torch.zeros(6, 8)},
              "plain": {"size": None, "avg": None, "pair": None},
              "arrays": {"c": torch.zeros(3, dtype=torch.float64)}}  # fmt: skip
    r = StorageReader(tmp_path / "run")
    dcp.load(target, storage_reader=r)
    model2.load_state_dict(target["model"])
    opt2.load_state_dict(target["optim"])
    sched2.load_state_dict(target["sched"])
    assert_same(model2.state_dict(), model.state_dict())
    assert_same(opt2.state_dict()["state"], opt.state_dict()["state"])
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert sched2.state_dict() == sched.state_dict() and target["step"] == 7
    assert torch.equal(target["rng"], state["rng"]) and torch.equal(target["tied"]["a"], model[0].weight)
    plain = target["plain"]  # plain values keep their types
    assert type(plain["size"]) is torch.Size and plain["size"] == (2, 3)
    assert type(plain["avg"]) is np.float32 and plain["avg"] == np.float32(0.1)
    assert type(plain["pair"]) is tuple and type(plain["pair"][1]) is np.int64
    # An array as the tensor it is stored as; not one in Fortran order, stored as its
    # transpose, which a square one would otherwise fill a tensor with silently.
    assert np.array_equal(target["arrays"]["c"].numpy(), state["arrays"]["c"])
    fortran = {"arrays": {"t": torch.zeros(3, 2, dtype=torch.float64)}}
    with pytest.raises(BaseException, match=r"'arrays\.t' is or holds a NumPy array in Fortran order.*load_latest"):
        dcp.load(fortran, storage_reader=StorageReader(tmp_path / "run"))
    assert not fortran["arrays"]["t"].any()
    # Each data file is read whole once, to check it against the manifest's crc32.
    assert r.bytes_read >= sum(rec.size for n, rec in verify_checkpoint(tmp_path / "run" / "step-000000007").files.items()
                               if n.endswith(".safetensors"))  # fmt: skip


def test_a_damaged_checkpointer_file_fails_dcp_load_naming_it(tmp_path: Path) -> None:
    from slurm_ckpt import Checkpointer

    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        path = ck.save({"w": torch.arange(1000.0), "v": torch.ones(3)}, step=1)
    data = path / "tensors-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF  # in the last tensor's bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException, match=r"tensors-00000\.safetensors: checksum mismatch"):
        dcp.load({"w": torch.zeros(1000)}, storage_reader=StorageReader(tmp_path / "run"))


def test_pickled_values_reach_dcp_load_only_when_trusted(tmp_path: Path) -> None:
    from slurm_ckpt import Checkpointer
    from slurm_ckpt.errors import UnsafeLoad

    with Checkpointer(tmp_path / "run", distributed=False, scratch=False, allow_pickle=True) as ck:
        ck.save({"w": torch.ones(3), "o": Opaque(5)}, step=1)
    target: dict[str, Any] = {"w": torch.zeros(3)}
    dcp.load(target, storage_reader=StorageReader(tmp_path / "run"))  # the tensors need no trust
    assert torch.equal(target["w"], torch.ones(3))
    with pytest.raises(CheckpointException) as err:
        dcp.load({"w": torch.zeros(3), "o": None}, storage_reader=StorageReader(tmp_path / "run"))
    assert isinstance(next(iter(err.value.failures.values())), UnsafeLoad) or "trusted=True" in str(err.value)
    target = {"w": torch.zeros(3), "o": None}
    dcp.load(target, storage_reader=StorageReader(tmp_path / "run", trusted=True))
    assert target["o"] == Opaque(5)


def test_dcp_load_gives_a_namespace_its_objects_and_refuses_one_holding_tensors(tmp_path: Path) -> None:
    import argparse

    from slurm_ckpt import Checkpointer

    with Checkpointer(tmp_path / "run", distributed=False, scratch=False, allow_pickle=True) as ck:
        ck.save({"args": argparse.Namespace(o=Opaque(5), lr=0.1), "a": argparse.Namespace(t=torch.ones(2))}, step=1)
    target: dict[str, Any] = {"args": None}
    dcp.load(target, storage_reader=StorageReader(tmp_path / "run", trusted=True))
    assert target["args"] == argparse.Namespace(o=Opaque(5), lr=0.1)  # the pickled object, not its reference
    with pytest.raises(CheckpointException, match=r"'a' is a value holding tensors.*Checkpointer\.load_latest"):
        dcp.load({"a": None}, storage_reader=StorageReader(tmp_path / "run", trusted=True))  # not meta tensors


def test_the_checkpointer_loads_dcp_save_values_safely_unless_trusted(tmp_path: Path) -> None:
    from slurm_ckpt import Checkpointer
    from slurm_ckpt.errors import UnsafeLoad

    dcp.save({"w": torch.ones(3), "meta": {"epoch": 3, "names": ["a", "b"]}},
             storage_writer=StorageWriter(tmp_path / "plain", step=1))  # fmt: skip
    with Checkpointer(tmp_path / "plain", distributed=False, scratch=False) as ck:
        got = ck.load_latest()
    assert got["meta"] == {"epoch": 3, "names": ["a", "b"]} and torch.equal(got["w"], torch.ones(3))
    dcp.save({"w": torch.ones(3), "o": Opaque(2)}, storage_writer=StorageWriter(tmp_path / "odd", step=1))
    with Checkpointer(tmp_path / "odd", distributed=False, scratch=False) as ck:
        with pytest.raises(UnsafeLoad, match=r"'o'.*trusted=True"):
            ck.load_latest()
        assert ck.load_latest(trusted=True)["o"] == Opaque(2)


def test_dcp_load_reads_views_of_one_storage_and_refuses_a_strided_or_conjugate_one(tmp_path: Path) -> None:
    from slurm_ckpt import Checkpointer

    buf = torch.arange(24.0)
    z = torch.randn(6, dtype=torch.complex64)
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        ck.save({"head": buf[:6].view(2, 3), "tail": buf[10:], "p": torch.nn.Parameter(torch.ones(4))}, step=1)
        ck.save({"z": z.conj()}, step=2)  # contiguous, but its bytes are not its values
        ck.save({"t": buf.view(4, 6).t()}, step=3)
    target = {"head": torch.zeros(2, 3), "tail": torch.zeros(14), "p": torch.zeros(4)}
    dcp.load(target, storage_reader=StorageReader(tmp_path / "run" / "step-000000001"))
    assert torch.equal(target["head"], buf[:6].view(2, 3)) and torch.equal(target["tail"], buf[10:])
    assert torch.equal(target["p"], torch.ones(4))
    with pytest.raises(CheckpointException, match=r"non-contiguous view.*Checkpointer\.load_latest"):
        dcp.load({"t": torch.zeros(6, 4)}, storage_reader=StorageReader(tmp_path / "run"))
    with pytest.raises(CheckpointException, match=r"lazy conjugate.*Checkpointer\.load_latest"):
        dcp.load({"z": torch.zeros(6, dtype=torch.complex64)},
                 storage_reader=StorageReader(tmp_path / "run" / "step-000000002"))


# ---------------------------------------------------------------- scratch-first tiers


@pytest.fixture
def tiers_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(fast tier, run dir); ``SLURM_CKPT_SCRATCH`` names a scratch dir, as the prolog's."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("SLURM_CKPT_SCRATCH", str(scratch))
    return scratch / "ckpt", tmp_path / "run"


def test_with_scratch_dcp_save_commits_there_and_the_drain_makes_it_durable(tiers_env: tuple[Path, Path]) -> None:
    fast, run = tiers_env
    w = StorageWriter(run, keep=2)
    states = {}
    for step in (1, 2, 3):
        states[step] = nested(step)
        dcp.save(states[step], checkpoint_id=str(run / f"step-{step}"), storage_writer=w)
        assert w.last_committed == fast / f"step-{step:09d}"
    assert json.loads((fast / "TIER.json").read_text())["durable"] == str(run)
    assert w.drain(timeout=120) and w.is_durable(3)
    # Every step went through the drain (verified copy, committed with the protocol);
    # retention ran per tier.
    man = verify_checkpoint(run / "step-000000003", full=True)
    assert is_dcp(man) and man.extra["copied_from"] == str(fast / "step-000000003")
    assert w.close(timeout=120)
    assert [c.name for c in sorted(fast.glob("step-*"))] == ["step-000000002", "step-000000003"]
    assert [c.name for c in sorted(run.glob("step-*"))] == ["step-000000002", "step-000000003"]
    # The durable copy alone loads bit-exact, through DCP and through the Checkpointer.
    target = zeros_like(nested())
    r = StorageReader(run, scratch=False)
    dcp.load(target, storage_reader=r)
    assert r.checkpoint == run / "step-000000003"
    assert_same(target, states[3])
    from slurm_ckpt import Checkpointer

    with Checkpointer(run, scratch=False) as ck:
        got = ck.load_latest()
        assert ck.loaded_path == run / "step-000000003"
    assert torch.equal(got["model"]["big"], states[3]["model"]["big"])


def test_the_reader_takes_the_newest_checkpoint_of_either_tier(tiers_env: tuple[Path, Path]) -> None:
    import dataclasses

    from slurm_ckpt.config import load_config

    fast, run = tiers_env
    cfg = load_config()
    w = StorageWriter(run, step=1)
    dcp.save(nested(1), storage_writer=w)
    assert w.close(timeout=120) and (run / "step-000000001" / "MANIFEST.json").is_file()
    # Step 2 stays on scratch (storage.drain: false: the epilog stages it out).
    nodrain = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, drain=False))
    w = StorageWriter(run, step=2, config=nodrain)
    dcp.save(nested(2), storage_writer=w)
    assert w.last_committed == fast / "step-000000002" and not w.is_durable(2)
    target = zeros_like(nested())
    r = StorageReader(run)
    dcp.load(target, storage_reader=r)
    assert r.checkpoint == fast / "step-000000002"
    assert_same(target, nested(2))
    r = StorageReader(run, scratch=False)
    dcp.load(zeros_like(nested()), storage_reader=r)
    assert r.checkpoint == run / "step-000000001"
    w.close()
    # The Checkpointer of the same job resumes from the same one.
    from slurm_ckpt import Checkpointer

    with Checkpointer(run, config=nodrain) as ck:
        assert ck.load_latest()["step"] == 102 and ck.loaded_path == fast / "step-000000002"


def test_async_save_with_scratch_holds_the_state_as_called_and_drains(tiers_env: tuple[Path, Path]) -> None:
    fast, run = tiers_env
    state = nested()
    before = {"big": state["model"]["big"].clone(), "ints": state["model"]["ints"].clone()}
    w = StorageWriter(run, step=5)
    fut = dcp.async_save(state, storage_writer=w)
    state["model"]["big"].add_(1.0)
    state["model"]["ints"].zero_()
    (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result(timeout=120)
    assert w.last_committed == fast / "step-000000005"
    assert w.close(timeout=120) and w.is_durable(5)
    target = zeros_like(nested())
    dcp.load(target, storage_reader=StorageReader(run, scratch=False))
    assert torch.equal(target["model"]["big"], before["big"])
    assert torch.equal(target["model"]["ints"], before["ints"])


def test_a_failed_drain_is_raised_at_the_next_save_and_the_checkpoint_stays_on_scratch(
    tiers_env: tuple[Path, Path],
) -> None:
    fast, _ = tiers_env
    blocker = fast.parent.parent / "not-a-dir"
    blocker.write_text("a file where the durable tier's parent should be")
    run = blocker / "run"  # every copy to it fails (ENOTDIR)
    w = StorageWriter(run, step=1)
    dcp.save({"w": torch.arange(8.0)}, storage_writer=w)
    assert not w.drain(timeout=120) and not w.is_durable(1)
    with pytest.raises(CheckpointException, match="cannot create run dir"):
        dcp.save({"w": torch.ones(8)}, checkpoint_id=str(run / "step-2"), storage_writer=w)
    verify_checkpoint(fast / "step-000000001", full=True)
    w.close(timeout=0)


def test_with_on_async_error_warn_a_failed_drain_is_logged_and_the_next_save_commits(
    tiers_env: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    import dataclasses
    import logging

    from slurm_ckpt.config import load_config

    fast, _ = tiers_env
    cfg = load_config()
    warn = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, on_async_error="warn"))
    blocker = fast.parent.parent / "not-a-dir"
    blocker.write_text("a file where the durable tier's parent should be")
    run = blocker / "run"  # every copy to it fails (ENOTDIR)
    w = StorageWriter(run, step=1, config=warn)
    dcp.save({"w": torch.arange(8.0)}, storage_writer=w)
    assert not w.drain(timeout=120)
    caplog.set_level(logging.WARNING, "slurm_ckpt")
    dcp.save({"w": torch.ones(8)}, checkpoint_id=str(run / "step-2"), storage_writer=w)
    assert w.last_committed == fast / "step-000000002"
    assert "cannot create run dir" in caplog.text
    verify_checkpoint(fast / "step-000000002", full=True)
    w.close(timeout=0)


def test_ranks_without_one_shared_scratch_dir_commit_to_the_run_dir(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from torch.distributed.checkpoint.planner import SavePlan

    from slurm_ckpt.dcp.writer import _Scratch

    w = StorageWriter(tmp_path / "run", step=1)
    w.set_up_storage_writer(True, rank=0)
    two = [SavePlan([], storage_data=_Scratch("node-a", str(tmp_path / "a"))),
           SavePlan([], storage_data=_Scratch("node-b", str(tmp_path / "b")))]  # fmt: skip
    try:
        plans = w.prepare_global_plan(two)
        target = plans[0].storage_data
        assert target.on_fast is False and (tmp_path / "run" / target.staging).is_dir(), target
        assert "several nodes" in caplog.text
    finally:
        w.close()
