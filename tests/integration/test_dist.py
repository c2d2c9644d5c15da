"""Sharded multi-rank checkpoints with real torch.distributed (gloo, 2 processes on loopback).

The pair of processes runs every scenario once (this file is also the worker:
``python test_dist.py RANK WORLD PORT RUN_DIR OUT``); each test checks one
scenario's results, which each rank writes as JSON.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("dist")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), str(WORLD), str(port), str(base / "runs"), str(base / f"out{r}.json")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(WORLD)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{outputs[r]}"
    return {"base": base, "ranks": [json.loads((base / f"out{r}.json").read_text()) for r in range(WORLD)]}


def test_each_rank_writes_its_shard_into_one_checkpoint(pair: dict[str, Any]) -> None:
    from slurm_ckpt.store import verify_checkpoint

    ckpt = pair["base"] / "runs" / "basic" / "step-000000020"
    man = verify_checkpoint(ckpt, full=True)
    assert man.world_size == WORLD
    shards = {name.split("/")[0] for name in man.files}
    assert shards == {"rank-00000", "rank-00001"}
    for r in range(WORLD):
        assert f"rank-{r:05d}/state.json" in man.files
        assert any(k.startswith(f"rank-{r:05d}/") for k in man.tensors)
    # Same path reported on both ranks, and only one checkpoint dir per step.
    assert pair["ranks"][0]["basic"]["paths"] == pair["ranks"][1]["basic"]["paths"]
    assert not [p for p in (pair["base"] / "runs" / "basic").iterdir() if p.name.startswith(".tmp")]


def test_resume_gives_each_rank_its_own_shard(pair: dict[str, Any]) -> None:
    for r in range(WORLD):
        got = pair["ranks"][r]["basic"]
        assert got["loaded_step"] == 20
        assert got["loaded_rank"] == r
        assert got["loaded_weight"] == [float(r * 100 + 20)] * 4


def test_a_failing_rank_fails_the_step_on_every_rank(pair: dict[str, Any]) -> None:
    r0, r1 = pair["ranks"][0]["fail"], pair["ranks"][1]["fail"]
    assert r1["error"] == "NoSpace"
    assert r0["error"] == "ShardError" and "rank 1" in r0["message"]
    run = pair["base"] / "runs" / "fail"
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".lock")) == ["step-000000001"]


def test_corrupt_shard_makes_all_ranks_fall_back_together(pair: dict[str, Any]) -> None:
    for r in range(WORLD):
        got = pair["ranks"][r]["corrupt"]
        assert got["loaded_step"] == 10, got
        assert got["loaded_weight"] == [float(r * 100 + 10)] * 4


def test_ranks_agree_on_a_request_seen_by_one_rank(pair: dict[str, Any]) -> None:
    # Only rank 1 got the request at step 5; both must stop and save step 5.
    for r in range(WORLD):
        got = pair["ranks"][r]["agree"]
        assert got["stopped_at"] == 5
    assert (pair["base"] / "runs" / "agree" / "step-000000005").is_dir()


def test_async_sharded_save_from_background_thread(pair: dict[str, Any]) -> None:
    for r in range(WORLD):
        got = pair["ranks"][r]["async"]
        assert got["loaded_step"] == 7
        assert got["loaded_weight"] == [float(r * 100 + 7)] * 4


def test_agreement_and_background_save_do_not_cross(pair: dict[str, Any]) -> None:
    for r in range(WORLD):
        got = pair["ranks"][r]["overlap"]
        assert got["loaded_step"] == 5 and got["loaded_weight"] == [float(r * 100 + 5)] * 4
        assert got["stops"] == 0


def test_closed_checkpointer_lets_the_process_group_go(pair: dict[str, Any]) -> None:
    for r in range(WORLD):
        got = pair["ranks"][r]
        assert got["gloo_threads_after_destroy"] == []
        assert got["use_after_close"].startswith("ConfigError: this Checkpointer for")
        assert "is closed; create a new one" in got["use_after_close"]


def test_pickles_in_one_rank_s_shard_are_refused_by_every_rank_before_any_read(pair: dict[str, Any]) -> None:
    got = [pair["ranks"][r]["pickle"] for r in range(WORLD)]
    assert [g["error"] for g in got] == ["UnsafeLoad"] * WORLD, got
    assert [g["into_after"] for g in got] == [[0.0] * 4] * WORLD, f"a rank read into its tensors first: {got}"
    assert all("step-000000003" in g["message"] for g in got), got


def test_rank_from_slurm_without_a_process_group(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from slurm_ckpt import Checkpointer

    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    ckpt = Checkpointer(tmp_path / "run")
    assert (ckpt.rank, ckpt.world_size) == (3, 4)
    # No process group: each process saves on its own, nothing collective.
    assert ckpt.maybe_save({"x": 1}, 10, every=5) is False
    assert (tmp_path / "run" / "step-000000010").is_dir()
    ckpt.close()


# ---------------------------------------------------------------- the worker


def _state(rank: int, step: int) -> dict[str, Any]:
    import torch

    return {"w": torch.full((4,), float(rank * 100 + step)), "rank": rank, "step": step}


def _scenario_basic(run: Path, rank: int) -> dict[str, Any]:
    from slurm_ckpt import Checkpointer

    ckpt = Checkpointer(run)
    paths = [str(ckpt.save(_state(rank, s), step=s)) for s in (10, 20)]
    ckpt.close()
    again = Checkpointer(run)
    state = again.load_latest()
    again.close()
    return {"paths": paths, "loaded_step": again.loaded_step, "loaded_rank": state["rank"],
            "loaded_weight": state["w"].tolist()}  # fmt: skip


def _scenario_fail(run: Path, rank: int) -> dict[str, Any]:
    from slurm_ckpt import Checkpointer
    from slurm_ckpt.errors import NoSpace

    ckpt = Checkpointer(run)
    ckpt.save(_state(rank, 1), step=1)

    def write_failing(tmp: Path) -> Any:
        raise NoSpace(errno.ENOSPC, "cannot write data file", tmp / "x")

    out: dict[str, Any] = {}
    try:
        if rank == 1:
            ckpt.placement.commit(2, write_failing)
        else:
            from slurm_ckpt.store.codec import encode_state
            from slurm_ckpt.store.writer import write_state

            enc = encode_state(_state(rank, 2))
            ckpt.placement.commit(2, lambda tmp: write_state(tmp, enc))
    except Exception as e:
        out = {"error": type(e).__name__, "message": str(e)}
    ckpt.close()
    return out


def _scenario_corrupt(run: Path, rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from slurm_ckpt import Checkpointer

    ckpt = Checkpointer(run)
    for s in (10, 20):
        ckpt.save(_state(rank, s), step=s)
    ckpt.close()
    dist.barrier()
    if rank == 1:  # flip one byte of rank 1's tensor data in the newest checkpoint
        f = next((run / "step-000000020" / "rank-00001").glob("*.safetensors"))
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    dist.barrier()
    again = Checkpointer(run)
    state = again.load_latest()
    again.close()
    return {"loaded_step": again.loaded_step, "loaded_weight": state["w"].tolist()}


def _scenario_agree(run: Path, rank: int) -> dict[str, Any]:
    from slurm_ckpt import Checkpointer

    ckpt = Checkpointer(run)
    stopped = None
    for step in range(1, 20):
        if rank == 1 and step == 5:
            ckpt.control.request()
        if ckpt.maybe_save(lambda s=step: _state(rank, s), step, every=100):
            stopped = step
            break
    ckpt.control.clear()
    ckpt.close()
    return {"stopped_at": stopped}


def _scenario_async(run: Path, rank: int) -> dict[str, Any]:
    from slurm_ckpt import Checkpointer

    ckpt = Checkpointer(run)
    ckpt.save_async(_state(rank, 7), step=7).wait(60)
    ckpt.close()
    again = Checkpointer(run)
    state = again.load_latest()
    again.close()
    return {"loaded_step": again.loaded_step, "loaded_weight": state["w"].tolist()}


def _scenario_overlap(run: Path, rank: int) -> dict[str, Any]:
    """Step-boundary agreement on the training thread while a background save
    runs its own collectives: they must not pair up across ranks."""
    from slurm_ckpt import Checkpointer

    ckpt = Checkpointer(run)
    agreed = []
    for step in range(1, 6):
        h = ckpt.save_async(_state(rank, step), step=step)
        # The same number of calls on every rank, as training steps would be.
        agreed += [ckpt.maybe_save(lambda: None, step, every=0) for _ in range(30)]
        h.wait(60)
    ckpt.close()
    again = Checkpointer(run)
    state = again.load_latest()
    again.close()
    return {"loaded_step": again.loaded_step, "loaded_weight": state["w"].tolist(),
            "agreements": len(agreed), "stops": sum(agreed)}  # fmt: skip


def _scenario_pickle(run: Path, rank: int) -> dict[str, Any]:
    """Only rank 0's shard holds pickled objects; a load without trusted=True."""
    import fractions

    import torch

    from slurm_ckpt import Checkpointer

    state: dict[str, Any] = {"w": torch.full((4,), 7.0 + rank)}
    into: dict[str, Any] = {"w": torch.zeros(4)}
    if rank == 0:
        state["extra"], into["extra"] = fractions.Fraction(1, 3), None
    with Checkpointer(run, allow_pickle=True) as ck:
        ck.save(state, step=3)
    with Checkpointer(run) as ck:
        error = _error_of(lambda: ck.load_latest(into=into))
    kind, _, message = error.partition(": ")
    return {"error": kind, "message": message, "into_after": into["w"].tolist()}


def _worker(rank: int, world: int, port: int, runs: Path, out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for name, fn in [("basic", _scenario_basic), ("fail", _scenario_fail), ("corrupt", _scenario_corrupt),
                     ("agree", _scenario_agree), ("async", _scenario_async),
                     ("overlap", _scenario_overlap), ("pickle", _scenario_pickle)]:  # fmt: skip
        results[name] = fn(runs / name, rank)
        dist.barrier()
    # A closed Checkpointer still in scope must not keep its groups alive
    # past destroy_process_group(): their gloo threads would outlive the
    # interpreter and can abort its teardown (exit 134).
    from slurm_ckpt import Checkpointer

    kept = Checkpointer(runs / "kept")
    kept.save(_state(rank, 1), step=1)
    kept.close()
    dist.destroy_process_group()
    results["gloo_threads_after_destroy"] = _gloo_threads()
    results["use_after_close"] = _error_of(lambda: kept.save(_state(rank, 2), step=2))
    out.write_text(json.dumps(results))


def _gloo_threads() -> list[str]:
    names = (Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))
    return [n for n in names if "gloo" in n]


def _error_of(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # the test reports whichever error it was
        return f"{type(e).__name__}: {e}"
    return ""


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
