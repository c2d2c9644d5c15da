"""slurm_ckpt.dcp with CUDA tensors: saved from the device, loaded back onto it (one process).

Skipped without CUDA; nothing here fakes it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_tensors_round_trip_through_the_dcp_backend(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from slurm_ckpt import sharded
    from slurm_ckpt.dcp import StorageReader, StorageWriter

    g = torch.Generator(device="cuda").manual_seed(0)
    state = {"w": torch.randn(1000, 1000, device="cuda", generator=g), "h": torch.randn(7, device="cuda").half()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=StorageWriter(tmp_path / "run", step=1))
        target = {"w": torch.zeros(1000, 1000, device="cuda"), "h": torch.zeros(7, device="cuda").half()}
        dcp.load(target, storage_reader=StorageReader(tmp_path / "run"))
    assert target["w"].is_cuda and torch.equal(target["w"], state["w"]) and torch.equal(target["h"], state["h"])
    sharded.save(state, tmp_path / "sharded", 2)
    into = {"w": torch.zeros(1000, 1000, device="cuda")}
    got = sharded.load(tmp_path / "sharded", into=into)
    assert got is not None and got.state["w"] is into["w"] and torch.equal(into["w"], state["w"])
    assert not got.state["h"].is_cuda and torch.equal(got.state["h"], state["h"].cpu())  # whole, on the CPU
