"""The engine's CUDA paths: pinned staging, non-blocking copies with one sync.

Skipped without CUDA. Each test runs the real Checkpointer on the real device;
none of them fakes CUDA.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from slurm_ckpt import Checkpointer
from slurm_ckpt.config import Config, EngineConfig, StorageConfig

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def config(snapshot: str = "auto") -> Config:
    return Config(storage=StorageConfig(keep=10), engine=dataclasses.replace(EngineConfig(), snapshot=snapshot))


def gpu_state(step: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(step)
    return {
        "model": {f"w{i}": torch.randn(1024, 257, device="cuda", generator=g) for i in range(8)},
        "half": torch.randn(4097, device="cuda", generator=g).half(),
        "cpu": torch.arange(10),
        "step": step,
    }


def to_cpu(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: to_cpu(v) for k, v in x.items()}
    return x.cpu() if isinstance(x, torch.Tensor) else x


def same(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            same(got[k], want[k])
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got.cpu(), want.cpu())
    else:
        assert got == want


@pytest.mark.parametrize("snapshot", ["auto", "copy", "overlap"])
def test_async_save_of_cuda_state_is_staged_pinned_and_isolated(tmp_path: Path, snapshot: str) -> None:
    state = gpu_state(1)
    want = to_cpu(state)
    with Checkpointer(tmp_path, config=config(snapshot), distributed=False) as ck:
        h = ck.save_async(state, step=1)
        assert h.mode == "copy"  # overlap is for CPU tensors; CUDA ones are staged before returning
        # The trainer changes the GPU tensors right away: the checkpoint must not see it.
        for t in state["model"].values():
            t.add_(1)
        h.wait()
        assert ck.engine.staging._pinned and ck.engine.staging._buf.is_pinned()
        ptr = ck.engine.staging._buf.data_ptr()
        ck.save_async(gpu_state(2), step=2).wait()
        assert ck.engine.staging._buf.data_ptr() == ptr  # reused, not reallocated
        got = Checkpointer(tmp_path, config=config(), distributed=False).load_latest(map_location="cuda")
    assert got["step"] == 2 and got["model"]["w0"].is_cuda
    same(ck.engine.load(tmp_path / "step-000000001", _manifest(tmp_path / "step-000000001")), want)


def _manifest(path: Path) -> Any:
    from slurm_ckpt.store import verify_checkpoint

    return verify_checkpoint(path)


def test_sync_save_of_cuda_state_and_load_to_cuda(tmp_path: Path) -> None:
    state = gpu_state(3)
    with Checkpointer(tmp_path, config=config(), distributed=False) as ck:
        ck.save(state, step=3)
        got = ck.load_latest(map_location="cuda")
    assert got["model"]["w1"].device.type == "cuda"
    same(got, state)


def test_load_into_cuda_tensors_fills_them_in_place(tmp_path: Path) -> None:
    state = gpu_state(3)
    want = to_cpu(state)
    with Checkpointer(tmp_path, config=config(), distributed=False) as ck:
        ck.save(state, step=3)
        target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
                  "half": torch.zeros_like(state["half"])}  # fmt: skip
        ptrs = {k: v.data_ptr() for k, v in target["model"].items()}
        got = ck.load_latest(into=target)
    same(got, want)
    for k, v in target["model"].items():
        assert v.is_cuda and v.data_ptr() == ptrs[k] and got["model"][k] is v
    assert torch.equal(target["half"].cpu(), want["half"])
