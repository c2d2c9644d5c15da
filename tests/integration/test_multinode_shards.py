"""Cross-node sharded checkpoints with real torch.distributed (gloo over loopback).

Two real processes play two nodes: each rank has its OWN scratch dir (its
"node-local" scratch) and both share one durable run dir. This file is also
the worker (``python test_multinode_shards.py PHASE RANK WORLD PORT BASE``);
each phase runs its scenarios once, and each test checks one scenario from
the JSON the ranks write. Phases:

* ``main``: saves, drains, resume preference, a rank without scratch, a
  failing rank, corrupt shards, shards left on scratch with the drain off,
  scratch retention while the assembly is blocked;
* ``death``: rank 1 is SIGKILLed in the middle of a save, after rank 0
  committed its shard on its scratch; the test then runs rank 0's epilog
  stage-out;
* ``resume``: a fresh pair resumes after that death.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

WORLD = 2
HERE = Path(__file__).resolve()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(phase: str, base: Path) -> list[subprocess.Popen[str]]:
    port = _free_port()
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))
    }
    env["PYTHONPATH"] = str(HERE.parents[2])
    return [subprocess.Popen([sys.executable, str(HERE), phase, str(r), str(WORLD), str(port), str(base)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(WORLD)]  # fmt: skip


def _finish(procs: list[subprocess.Popen[str]], timeout: float = 90) -> list[str]:
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outputs


def _results(base: Path, phase: str) -> list[dict[str, Any]]:
    return [json.loads((base / f"{phase}-rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def main(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("multinode")
    procs = _spawn("main", base)
    outputs = _finish(procs)
    assert [p.returncode for p in procs] == [0] * WORLD, "\n".join(
        f"----- rank {r} exited {p.returncode}:\n{outputs[r]}" for r, p in enumerate(procs)
    )
    return {"base": base, "ranks": _results(base, "main")}


def _manifest(path: Path) -> Any:
    from slurm_ckpt.store import verify_checkpoint

    return verify_checkpoint(path, full=True)


def test_scratch_is_back_to_keep_once_the_drain_staged_a_newer_shard(main: dict[str, Any]) -> None:
    """A shard being staged is kept on scratch beyond ``keep``; it goes once the drain
    has staged the newer one, with no save after."""
    for r in range(WORLD):
        got = main["ranks"][r]["trim"]
        assert got["blocked"] == ["step-000000001", "step-000000003"], got  # in the drain's hands, and the newest
        assert got["drained"] is True
        assert got["after"] == ["step-000000003"], got
        assert got["durable"] == ["step-000000003"], got


def test_the_trim_after_staging_spares_a_shard_committed_since(main: dict[str, Any]) -> None:
    """Step 5, committed on scratch after step 10 was handed to the drain, is not an old
    checkpoint beyond ``keep`` to the trim that follows 10's staging."""
    for r in range(WORLD):
        got = main["ranks"][r]["backstep"]
        assert got["drained"] is True
        assert got["after"] == ["step-000000005", "step-000000010"], got
        assert got["durable"] == ["step-000000010"], got


def test_each_rank_saves_to_its_own_scratch_and_the_drain_assembles_one_checkpoint(
    main: dict[str, Any],
) -> None:
    base = main["base"]
    got = [main["ranks"][r]["basic"] for r in range(WORLD)]
    for r in range(WORLD):
        # save() returned this rank's shard, committed on its own node's scratch.
        assert got[r]["paths"] == [
            f"{base}/basic-scratch{r}/ckpt/rank-{r:05d}/step-{s:09d}" for s in (10, 20)
        ]
        assert got[r]["durable_after_wait"] is True
    man = _manifest(base / "basic" / "step-000000020")
    assert man.world_size == WORLD
    assert {n.split("/")[0] for n in man.files} == {"rank-00000", "rank-00001"}
    shards = man.extra["shards"]
    assert sorted(shards) == ["rank-00000", "rank-00001"]
    for r in range(WORLD):
        where = shards[f"rank-{r:05d}"]
        assert where["host"] == socket.gethostname()
        assert where["staged_from"].endswith(f"basic-scratch{r}/ckpt/rank-{r:05d}/step-000000020")
        assert where["bytes"] == sum(
            rec.size for n, rec in man.files.items() if n.startswith(f"rank-{r:05d}/")
        )
    # No staging dir or temp dir is left once the checkpoint is committed.
    assert (
        sorted(
            p.name
            for p in (base / "basic").iterdir()
            if p.name.startswith(".") and "lock" not in p.name
        )
        == []
    )
    # TIER.json tells each node's epilog where its shards go.
    for r in range(WORLD):
        tier = json.loads((base / f"basic-scratch{r}" / "ckpt" / "TIER.json").read_text())
        assert tier == {"durable": str(base / "basic"), "keep": 3}


def test_resume_reads_each_rank_its_own_shard_from_scratch_then_from_durable(
    main: dict[str, Any],
) -> None:
    base = main["base"]
    for r in range(WORLD):
        got = main["ranks"][r]["basic"]
        # Same save on both tiers: read from the node-local shards.
        assert got["local"] == {"step": 20, "rank": r, "w": [float(r * 100 + 20)] * 4,
                                "path": f"{base}/basic-scratch{r}/ckpt/rank-{r:05d}/step-000000020"}  # fmt: skip
        # Rank 1's scratch lost: every rank reads the durable copy, never rank 0's local shard alone.
        assert got["after_loss"] == {"step": 20, "rank": r, "w": [float(r * 100 + 20)] * 4,
                                     "path": f"{base}/basic/step-000000020"}  # fmt: skip


def test_rank_without_scratch_saves_straight_to_durable_with_a_warning(
    main: dict[str, Any],
) -> None:
    base = main["base"]
    r0, r1 = main["ranks"][0]["mixed"], main["ranks"][1]["mixed"]
    assert r0["path"] == f"{base}/mixed-scratch0/ckpt/rank-00000/step-000000010"
    # Rank 1's shard was committed in the durable staging dir before save() returned.
    assert r1["path"].startswith(f"{base}/mixed/.shards-step-000000010-")
    assert r1["path"].endswith("/rank-00001")
    assert any("rank 1" in w and "no node-local scratch" in w for w in r1["warnings"]), r1[
        "warnings"
    ]
    assert any("no node-local scratch on" in w for w in r0["warnings"]), r0["warnings"]
    man = _manifest(base / "mixed" / "step-000000010")
    assert man.extra["shards"]["rank-00001"]["staged_from"] is None  # written there directly
    for r in range(WORLD):
        assert main["ranks"][r]["mixed"]["loaded"] == {"step": 10, "w": [float(r * 100 + 10)] * 4}


def test_a_failing_rank_fails_the_save_everywhere_and_leaves_no_shard(main: dict[str, Any]) -> None:
    base = main["base"]
    r0, r1 = main["ranks"][0]["fail"], main["ranks"][1]["fail"]
    assert r1["error"] == "NoSpace"
    assert r0["error"] == "ShardError" and "rank 1" in r0["message"]
    # Rank 0's shard of the failed step was committed on its scratch, then dropped.
    assert [p.name for p in (base / "fail-scratch0" / "ckpt" / "rank-00000").glob("step-*")] == []
    assert [p.name for p in (base / "fail").glob("step-*")] == []
    assert r0["loaded"] is None and r1["loaded"] is None


def test_corrupt_shard_on_every_tier_moves_all_ranks_back_together(main: dict[str, Any]) -> None:
    for r in range(WORLD):
        got = main["ranks"][r]["corrupt"]
        assert got["loaded"] == {"step": 10, "w": [float(r * 100 + 10)] * 4}, got
        assert any("step-000000020" in s for s in got["skipped"]), got["skipped"]


def test_with_the_drain_off_shards_stay_local_and_resume_uses_them(main: dict[str, Any]) -> None:
    base = main["base"]
    for r in range(WORLD):
        got = main["ranks"][r]["nodrain"]
        assert got["durable_after_wait"] is False
        assert got["loaded"] == {"step": 30, "w": [float(r * 100 + 30)] * 4,
                                 "path": f"{base}/nodrain-scratch{r}/ckpt/rank-{r:05d}/step-000000030"}  # fmt: skip
        assert got["durable_steps"] == ["step-000000010"]


def test_pickles_in_one_rank_s_shard_on_scratch_are_refused_by_every_rank_before_any_read(
    main: dict[str, Any],
) -> None:
    got = [main["ranks"][r]["pickle"] for r in range(WORLD)]
    assert [g["error"] for g in got] == ["UnsafeLoad"] * WORLD, got
    assert [g["into_after"] for g in got] == [[0.0] * 4] * WORLD, f"a rank read into its tensors first: {got}"
    assert all("step 5" in g["message"] for g in got), got


def test_epilog_of_each_node_stages_its_shards_and_the_last_one_commits(
    main: dict[str, Any],
) -> None:
    """What ``slurm-ckpt node epilog`` runs per node, on the shards the drain left."""
    from slurm_ckpt.node.shardstage import stage_shards
    from slurm_ckpt.store import find_latest

    base = main["base"]
    durable = base / "nodrain"
    start = time.monotonic()
    first = stage_shards(base / "nodrain-scratch1" / "ckpt", durable, lock_timeout=5)
    assert first.status == "staged" and "waiting for other nodes' shards" in first.detail, first
    assert first.step is None
    assert find_latest([durable]).step == 10  # one shard staged: not a checkpoint yet
    second = stage_shards(base / "nodrain-scratch0" / "ckpt", durable, lock_timeout=5)
    took = time.monotonic() - start
    assert second.status == "staged" and second.step == 30, second
    man = _manifest(durable / "step-000000030")
    assert sorted(man.extra["shards"]) == ["rank-00000", "rank-00001"]
    assert find_latest([durable]).step == 30
    assert not list(durable.glob(".shards-step-*"))
    # Idempotent: a second epilog run (or the other node's) finds it done.
    for r in range(WORLD):
        again = stage_shards(base / f"nodrain-scratch{r}" / "ckpt", durable, lock_timeout=5)
        assert again.status == "up-to-date", again
    print(f"\nstage-out of 2 nodes' shards (sequential, library level): {took:.3f} s")


def test_epilog_stage_out_child_handles_shards_as_the_user(main: dict[str, Any]) -> None:
    """The epilog's own stage-out (forked child with the user's ids, TIER.json) on each node."""
    from slurm_ckpt.node.job import Job
    from slurm_ckpt.node.stageout import StageLimits, stage_out

    base = main["base"]
    job = Job.from_env({"SLURM_JOB_ID": "4242", "SLURM_JOB_UID": str(os.getuid()),
                        "SLURM_JOB_GID": str(os.getgid()), "SLURM_JOB_USER": _user()})  # fmt: skip
    # No default durable dir: TIER.json on each node's scratch names the run dir
    # (scratch and durable share one filesystem here, so no scratch device is named).
    limits = StageLimits((str(base),), frozenset(), 2**40)
    first = stage_out(base / "nodrain2-scratch0" / "ckpt", None, job, timeout=30, limits=limits)
    assert first.status == "staged" and first.step is None and first.scratch_disposable, first
    second = stage_out(base / "nodrain2-scratch1" / "ckpt", None, job, timeout=30, limits=limits)
    assert second.status == "staged" and second.step == 30, second
    assert second.path == str(base / "nodrain2" / "step-000000030")
    assert sorted(_manifest(base / "nodrain2" / "step-000000030").extra["shards"]) == [
        "rank-00000",
        "rank-00001",
    ]
    third = stage_out(base / "nodrain2-scratch0" / "ckpt", None, job, timeout=30, limits=limits)
    assert third.status == "up-to-date" and third.scratch_disposable, third


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _commit_local_shard(scratch: Path, rank: int, step: int, save_id: str, value: int) -> Any:
    """What a rank's save commits on its node (CrossNode.commit without the collectives)."""
    from slurm_ckpt.store import RunDir
    from slurm_ckpt.store import shards as sh
    from slurm_ckpt.store.codec import encode_state
    from slurm_ckpt.store.writer import write_state

    enc = encode_state({"v": value, "rank": rank})
    rd = RunDir(scratch / "ckpt" / sh.shard_name(rank))
    path = rd.commit(step, lambda tmp: write_state(tmp, enc), world_size=WORLD,
                     extra=sh.shard_extra(rank, WORLD, save_id))  # fmt: skip
    rd.unlock()
    return path


def test_an_older_save_of_the_same_step_never_replaces_a_newer_one(tmp_path: Path) -> None:
    """Two saves of step 50 (a run resumed from an older step saved it again): the
    staged set of the older save must not overwrite the newer committed one."""
    from slurm_ckpt.node.shardstage import stage_shards
    from slurm_ckpt.store import Manifest
    from slurm_ckpt.store import shards as sh

    durable = tmp_path / "run"
    durable.mkdir()
    old_id, new_id = sh.new_save_id(), sh.new_save_id()
    for r in range(WORLD):
        _commit_local_shard(tmp_path / f"old{r}", r, 50, old_id, value=1)
    time.sleep(0.01)  # distinct manifest times (ordering only, not synchronisation)
    for r in range(WORLD):
        _commit_local_shard(tmp_path / f"new{r}", r, 50, new_id, value=2)
        (tmp_path / f"new{r}" / "ckpt" / "TIER.json").write_text(json.dumps({"durable": str(durable)}))
    for r in range(WORLD):
        assert stage_shards(tmp_path / f"new{r}" / "ckpt", durable, 5).status == "staged"
    assert Manifest.read(durable / "step-000000050").extra["save_id"] == new_id
    # The old save's shards arrive late (a slow node): staged, but never assembled over it.
    for r in range(WORLD):
        shard = next(sh.local_shards(tmp_path / f"old{r}" / "ckpt" / sh.shard_name(r)))
        sh.stage_shard(shard, durable)
    assert sh.complete(durable, 50, old_id, WORLD) is None
    assert Manifest.read(durable / "step-000000050").extra["save_id"] == new_id
    assert not list(durable.glob(".shards-step-*"))  # the obsolete staging dir is gone
    # Complete again: idempotent, returns the committed step.
    assert sh.complete(durable, 50, new_id, WORLD) == durable / "step-000000050"


def test_a_full_durable_tier_is_pruned_for_a_shard_as_for_a_checkpoint(
    tmp_path: Path, tmpfs: Any
) -> None:
    """The drain's shard copy into a full durable tier (a real 8 MiB tmpfs) prunes
    the older checkpoints down to ``keep - 1`` and copies again, as the tier drain
    does for whole checkpoints; without ``keep`` it fails and leaves nothing behind."""
    from slurm_ckpt.errors import NoSpace
    from slurm_ckpt.store import RunDir, verify_checkpoint
    from slurm_ckpt.store import shards as sh
    from slurm_ckpt.store.codec import encode_state
    from slurm_ckpt.store.writer import write_state

    def commit(rd: Any, step: int, **meta: Any) -> Path:
        import torch

        enc = encode_state({"step": step, "blob": torch.frombuffer(bytearray(os.urandom(3 << 20)), dtype=torch.uint8)})
        return rd.commit(step, lambda tmp: write_state(tmp, enc), nbytes=enc.nbytes, **meta)

    durable = tmpfs("8m")
    run = RunDir(durable)
    commit(run, 10)
    commit(run, 20)
    run.unlock()
    save_id = sh.new_save_id()
    local = RunDir(tmp_path / "ckpt" / sh.shard_name(0))
    commit(local, 30, world_size=1, extra=sh.shard_extra(0, 1, save_id))
    local.unlock()
    shard = next(sh.local_shards(tmp_path / "ckpt" / sh.shard_name(0)))

    with pytest.raises(NoSpace):
        sh.stage_shard(shard, durable)
    assert not list(durable.rglob(".tmp-*")) and not list(durable.glob(f"{sh.STAGING_PREFIX}*/*"))
    staged = sh.stage_shard(shard, durable, keep=2)
    assert staged.parent == sh.staging_dir(durable, 30, save_id)
    assert sorted(p.name for p in durable.glob("step-*")) == ["step-000000020"]  # 10 pruned, 20 kept
    verify_checkpoint(durable / "step-000000020", full=True)
    done = sh.complete(durable, 30, save_id, 1)
    assert done == durable / "step-000000030"
    verify_checkpoint(done, full=True)


# ----------------------------------------------------------- death mid-save


def test_node_death_mid_save_resume_returns_the_previous_whole_checkpoint(tmp_path: Path) -> None:
    from slurm_ckpt.node.shardstage import stage_shards
    from slurm_ckpt.store import find_latest

    base = tmp_path
    for r in range(WORLD):
        (base / f"scratch{r}").mkdir()
    procs = _spawn("death", base)
    shard0 = base / "scratch0" / "ckpt" / "rank-00000" / "step-000000020"
    inside = base / "rank1-inside-save"
    deadline = time.monotonic() + 60
    try:
        while not ((shard0 / "MANIFEST.json").exists() and inside.exists()):
            assert time.monotonic() < deadline, "rank 0 never committed its shard of step 20"
            assert all(p.poll() is None for p in procs), _finish(procs)
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)  # the node dies with its shard half-saved
        procs[1].wait(10)
        try:
            out0 = procs[0].communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            procs[0].kill()  # Slurm ends the job on the surviving node the same way
            out0 = procs[0].communicate()[0]
    finally:
        _finish(procs, timeout=5)
    # Rank 0's save never returned: gloo saw the peer go (or the job was ended around it).
    if (base / "death-rank0.json").exists():
        assert _results_one(base, "death", 0)["death"]["error"] in (
            "RuntimeError",
            "DistBackendError",
        ), out0
    durable = base / "run"
    assert find_latest([durable]).step == 10
    # The surviving node's epilog stages its shard; the set stays incomplete.
    res = stage_shards(base / "scratch0" / "ckpt", durable, lock_timeout=5)
    assert res.status == "staged" and "waiting for other nodes' shards" in res.detail, res
    staged = list(durable.glob(".shards-step-000000020-*/rank-00000"))
    assert len(staged) == 1 and not list(durable.glob(".shards-step-000000020-*/rank-00001"))
    assert find_latest([durable]).step == 10
    assert subprocess.run([str(Path(sys.executable).with_name("slurm-ckpt")), "resume", "--dir", str(durable)],
                          capture_output=True, text=True, check=False).stdout.count("step-000000010") == 1  # fmt: skip

    # A fresh pair (the requeued job, rank 0 back on the node that kept its shard).
    procs = _spawn("resume", base)
    outputs = _finish(procs)
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{outputs[r]}"
    for r, got in enumerate(_results(base, "resume")):
        assert got["resume"]["loaded"] == {"step": 10, "w": [float(r * 100 + 10)] * 4,
                                 "path": f"{durable}/step-000000010"}, got  # fmt: skip


def _results_one(base: Path, phase: str, rank: int) -> dict[str, Any]:
    return dict(json.loads((base / f"{phase}-rank{rank}.json").read_text()))


# ---------------------------------------------------------------- the worker


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _state(rank: int, step: int) -> dict[str, Any]:
    import torch

    return {"w": torch.full((4,), float(rank * 100 + step)), "rank": rank, "step": step}


def _ckpt(run: Path, rank: int, *, scratch: bool = True, drain: bool = True, keep: int = 3) -> Any:
    """A Checkpointer on durable ``run``, with this rank's own scratch ``<run>-scratch<rank>``."""
    from slurm_ckpt import Checkpointer
    from slurm_ckpt.config import Config

    cfg = Config()
    cfg = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, drain=drain, keep=keep))
    mine = run.with_name(f"{run.name}-scratch{rank}")
    mine.mkdir(exist_ok=True)
    return Checkpointer(run, config=cfg, scratch=mine if scratch else False)


def _loaded(ckpt: Any, state: Any, path: bool = False) -> dict[str, Any] | None:
    if state is None:
        return None
    out = {"step": ckpt.loaded_step, "w": state["w"].tolist()}
    if path:
        out["path"] = str(ckpt.loaded_path)
    return out


def _basic(base: Path, rank: int) -> dict[str, Any]:
    import shutil

    import torch.distributed as dist

    run = base / "basic"
    ckpt = _ckpt(run, rank)
    paths = [str(ckpt.save(_state(rank, s), step=s)) for s in (10, 20)]
    ckpt.wait()  # this rank's shard is staged; the slower rank's drain assembles
    dist.barrier()
    durable = ckpt.is_durable(20)
    ckpt.close()
    again = _ckpt(run, rank)
    state = again.load_latest()
    local = {**(_loaded(again, state, path=True) or {}), "rank": state["rank"]}
    again.close()
    dist.barrier()
    if rank == 1:
        shutil.rmtree(base / "basic-scratch1" / "ckpt" / "rank-00001")
    dist.barrier()
    third = _ckpt(run, rank)
    state = third.load_latest()
    after = {**(_loaded(third, state, path=True) or {}), "rank": state["rank"]}
    third.close()
    return {"paths": paths, "durable_after_wait": durable, "local": local, "after_loss": after}


def _mixed(base: Path, rank: int) -> dict[str, Any]:
    run = base / "mixed"
    catch = _Warnings()
    logging.getLogger("slurm_ckpt").addHandler(catch)
    try:
        ckpt = _ckpt(run, rank, scratch=rank == 0)
    finally:
        logging.getLogger("slurm_ckpt").removeHandler(catch)
    path = str(ckpt.save(_state(rank, 10), step=10))
    ckpt.close()
    again = _ckpt(run, rank, scratch=rank == 0)
    loaded = _loaded(again, again.load_latest())
    again.close()
    return {"path": path, "warnings": catch.messages, "loaded": loaded}


def _fail(base: Path, rank: int) -> dict[str, Any]:
    import errno

    from slurm_ckpt.errors import NoSpace
    from slurm_ckpt.placement import CrossNode

    run = base / "fail"
    ckpt = _ckpt(run, rank)
    out: dict[str, Any] = {}
    try:
        if rank == 1:

            def write_failing(tmp: Path) -> Any:
                raise NoSpace(errno.ENOSPC, "cannot write data file", tmp / "x")

            assert isinstance(ckpt.placement, CrossNode)
            ckpt.placement.commit(5, write_failing)
        else:
            ckpt.save(_state(rank, 5), step=5)
    except Exception as e:
        out = {"error": type(e).__name__, "message": str(e)}
    ckpt.close()
    again = _ckpt(run, rank)
    out["loaded"] = _loaded(again, again.load_latest())
    again.close()
    return out


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt(base: Path, rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    run = base / "corrupt"
    ckpt = _ckpt(run, rank)
    for s in (10, 20):
        ckpt.save(_state(rank, s), step=s)
    ckpt.wait()
    ckpt.close()
    dist.barrier()
    if rank == 1:  # rank 1's shard of step 20 is damaged on scratch and on the durable tier
        for d in (
            base / "corrupt-scratch1" / "ckpt" / "rank-00001" / "step-000000020",
            run / "step-000000020" / "rank-00001",
        ):
            _flip_byte(next(d.glob("tensors-*.safetensors")))
    dist.barrier()
    skipped: list[Any] = []
    again = _ckpt(run, rank)
    loaded = _loaded(again, again.load_latest(skipped=skipped))
    again.close()
    return {"loaded": loaded, "skipped": [str(s.path) for s in skipped]}


def _nodrain(base: Path, rank: int, name: str = "nodrain") -> dict[str, Any]:
    import torch.distributed as dist

    run = base / name
    ckpt = _ckpt(run, rank)
    ckpt.save(_state(rank, 10), step=10)
    ckpt.close()
    dist.barrier()  # both drains done: step 10 is assembled
    off = _ckpt(run, rank, drain=False)
    off.save(_state(rank, 30), step=30)
    durable = off.drain(timeout=5)
    off.close()
    again = _ckpt(run, rank)
    loaded = _loaded(again, again.load_latest(), path=True)
    again.close()
    steps = sorted(p.name for p in run.glob("step-*"))
    return {"durable_after_wait": durable, "loaded": loaded, "durable_steps": steps}


def _pickle(base: Path, rank: int) -> dict[str, Any]:
    """Only rank 0's shard holds pickled objects, and both stay on scratch (no drain);
    a load without trusted=True."""
    import fractions

    import torch

    from slurm_ckpt import Checkpointer
    from slurm_ckpt.config import Config

    run = base / "pickle"
    cfg = Config()
    cfg = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, drain=False))
    mine = run.with_name(f"{run.name}-scratch{rank}")
    mine.mkdir(exist_ok=True)
    state: dict[str, Any] = {"w": torch.full((4,), 7.0 + rank)}
    into: dict[str, Any] = {"w": torch.zeros(4)}
    if rank == 0:
        state["extra"], into["extra"] = fractions.Fraction(1, 3), None
    with Checkpointer(run, config=cfg, scratch=mine, allow_pickle=True) as ck:
        ck.save(state, step=5)
    error = ""
    with Checkpointer(run, config=cfg, scratch=mine) as ck:
        try:
            ck.load_latest(into=into)
        except Exception as e:  # the test checks which error each rank raised
            error = f"{type(e).__name__}: {e}"
    kind, _, message = error.partition(": ")
    return {"error": kind, "message": message, "into_after": into["w"].tolist()}


def _blocked_drain(base: Path, rank: int, name: str, first: int, meanwhile: Callable[[Any], None]) -> dict[str, Any]:
    """keep=1, with rank 0 holding the assembly lock (a stage-out on another node): each
    rank saves step ``first``, waits until its drain holds it, calls ``meanwhile(ckpt)``,
    then the lock goes and the drain ends. Returns this rank's scratch steps while
    blocked and after, whether the drain ended, and the durable steps."""
    import fcntl

    import torch.distributed as dist

    from slurm_ckpt.store.shards.layout import ASSEMBLY_LOCK

    run = base / name
    ckpt = _ckpt(run, rank, keep=1)
    mine = base / f"{name}-scratch{rank}" / "ckpt" / f"rank-{rank:05d}"
    blocker = None
    if rank == 0:
        blocker = open(run / ASSEMBLY_LOCK, "a")  # noqa: SIM115
        fcntl.flock(blocker, fcntl.LOCK_EX)
    dist.barrier()
    drainer = ckpt.placement._drainer
    ckpt.save(_state(rank, first), step=first)
    with drainer.cv:  # the drain holds ``first``, waiting for the assembly lock
        assert drainer.cv.wait_for(lambda: drainer.draining is not None, 60)
    meanwhile(ckpt)
    blocked = sorted(p.name for p in mine.glob("step-*"))
    dist.barrier()
    if blocker is not None:
        blocker.close()
    drained = ckpt.drain(timeout=60)
    after = sorted(p.name for p in mine.glob("step-*"))
    dist.barrier()  # both shards staged: the slower rank's drain assembled the checkpoint
    ckpt.close()
    return {"blocked": blocked, "drained": drained, "after": after,
            "durable": sorted(p.name for p in run.glob("step-*"))}  # fmt: skip


def _trim(base: Path, rank: int) -> dict[str, Any]:
    """Steps 2 and 3 are saved while the drain waits with step 1 in hand."""

    def newer(ckpt: Any) -> None:
        for s in (2, 3):
            ckpt.save(_state(rank, s), step=s)

    return _blocked_drain(base, rank, "trim", 1, newer)


def _backstep(base: Path, rank: int) -> dict[str, Any]:
    """While the drain waits with step 10 in hand, a run resumed from an older step
    commits step 5 on scratch and has not handed it over yet."""

    def older(ckpt: Any) -> None:
        job = ckpt.engine.job(_state(rank, 5))
        ckpt.placement.fast.commit(5, job.write, nbytes=job.nbytes)  # committed, not handed over

    return _blocked_drain(base, rank, "backstep", 10, older)


def _death(base: Path, rank: int) -> dict[str, Any]:
    from slurm_ckpt import Checkpointer
    from slurm_ckpt.config import Config
    from slurm_ckpt.placement import CrossNode

    ckpt = Checkpointer(base / "run", config=Config(), scratch=base / f"scratch{rank}")
    ckpt.save(_state(rank, 10), step=10)
    ckpt.wait()
    try:
        if rank == 1:

            def write_stalling(tmp: Path) -> Any:
                # Half of the shard is on disk when the node dies.
                (tmp / "tensors-00000.safetensors").write_bytes(b"\0" * 4096)
                (base / "rank1-inside-save").touch()
                time.sleep(120)
                raise AssertionError("rank 1 should have been killed")

            assert isinstance(ckpt.placement, CrossNode)
            ckpt.placement.commit(20, write_stalling)
        else:
            ckpt.save(_state(rank, 20), step=20)
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"saved": 20}


def _resume(base: Path, rank: int) -> dict[str, Any]:
    from slurm_ckpt import Checkpointer
    from slurm_ckpt.config import Config

    # Rank 1 lands on a node without its old scratch (the dead node's is gone).
    scratch = base / f"scratch{rank}" if rank == 0 else base / "fresh1"
    scratch.mkdir(exist_ok=True)
    ckpt = Checkpointer(base / "run", config=Config(), scratch=scratch)
    loaded = _loaded(ckpt, ckpt.load_latest(), path=True)
    ckpt.close()
    return {"loaded": loaded}


PHASES = {
    "main": {
        "basic": _basic,
        "mixed": _mixed,
        "fail": _fail,
        "corrupt": _corrupt,
        "nodrain": _nodrain,
        "nodrain2": lambda b, r: _nodrain(b, r, "nodrain2"),
        "trim": _trim,
        "backstep": _backstep,
        "pickle": _pickle,
    },
    "death": {"death": _death},
    "resume": {"resume": _resume},
}


def _worker(phase: str, rank: int, world: int, port: int, base: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    out: dict[str, Any] = {}
    for name, fn in PHASES[phase].items():
        out[name] = fn(base, rank)
        (base / f"{phase}-rank{rank}.json").write_text(json.dumps(out))
    if phase != "death":
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
