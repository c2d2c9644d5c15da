"""HF Trainer and Accelerate through the Checkpointer, with real (tiny, config-built) models.

Nothing is downloaded: models come from a ``GPT2Config`` in code and
``HF_HUB_OFFLINE`` is set. Resuming restores the frameworks' state from files
they read themselves, so it runs in this process.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from slurm_ckpt import CheckpointCorrupt, Checkpointer, ConfigError, UnsupportedValue
from slurm_ckpt.errors import ShardError
from slurm_ckpt.integrations._folder import folder_state, write_folder
from slurm_ckpt.integrations.accelerate import load_state, save_state
from slurm_ckpt.integrations.transformers import SlurmCkptCallback
from tests.faultfs.fixtures import make_tmpfs  # noqa: F401 - fixture
from tests.integration.rank_pool import RankPool


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


class Seqs(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 32, (32, 8), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))


def _trainer(out: Path, steps: int, callbacks: list[Any]) -> Trainer:
    args = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=4,
                             save_steps=5, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True)  # fmt: skip
    return Trainer(model=_model(), args=args, train_dataset=Seqs(), callbacks=callbacks)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_folder_round_trips_every_byte_and_refuses_escapes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(bytes(range(256)) * 3)
    (src / "sub" / "empty").write_bytes(b"")
    (src / "sub" / "b.json").write_text('{"x": 1}')
    with Checkpointer(tmp_path / "run", scratch=False) as ckpt:
        ckpt.save(folder_state(src), step=1)
        state = ckpt.load_latest()
    write_folder(state, tmp_path / "dst")
    for rel in ("a.bin", "sub/empty", "sub/b.json"):
        assert (tmp_path / "dst" / rel).read_bytes() == (src / rel).read_bytes()
    with pytest.raises(CheckpointCorrupt, match="leaves the folder"):
        write_folder({**state, "files": {"../evil": state["files"]["a.bin"]}}, tmp_path / "dst2")
    with pytest.raises(CheckpointCorrupt, match="own SLURM_CKPT_DIR"):
        write_folder({"model": 1}, tmp_path / "dst3")
    (src / "link").symlink_to(src / "a.bin")
    with pytest.raises(UnsupportedValue, match="symlink"):
        folder_state(src)


def test_trainer_resumes_from_newest_valid_where_its_own_resume_crashes(tmp_path: Path) -> None:
    """transformers' resume_from_checkpoint=True takes a half-written newest folder; ours skips it.

    Checkpoints 5 and 10 are committed. Then a save of step 15 dies half-way:
    ``checkpoint-15`` exists with a truncated model file, and the Checkpointer's
    copy of step 10 is damaged on disk too. The Trainer's own resume picks
    ``checkpoint-15`` and fails; ``resume_path`` verifies, passes over the
    damaged step 10, and resumes from step 5.
    """
    out = tmp_path / "out"
    cb = SlurmCkptCallback(Checkpointer(tmp_path / "run", scratch=False, keep=5))
    _trainer(out, 10, [cb]).train(resume_from_checkpoint=cb.resume_path(out))
    cb.ckpt.close()
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == ["step-000000005", "step-000000010"]

    half = out / "checkpoint-15"
    half.mkdir()
    for f in (out / "checkpoint-10").iterdir():
        data = f.read_bytes()
        (half / f.name).write_bytes(data[: len(data) // 2] if f.name == "model.safetensors" else data)
    with pytest.raises(Exception, match=r"(?i)safetensor|header|deserializ|incomplete|metadata"):
        _trainer(out, 20, []).train(resume_from_checkpoint=True)

    data = max((tmp_path / "run" / "step-000000010").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF
    data.write_bytes(bytes(raw))

    cb2 = SlurmCkptCallback(Checkpointer(tmp_path / "run", scratch=False, keep=5))
    resume = cb2.resume_path(out)
    assert resume is not None and resume.endswith("checkpoint-5") and cb2.ckpt.loaded_step == 5
    trainer = _trainer(out, 12, [cb2])
    trainer.train(resume_from_checkpoint=resume)
    assert trainer.state.global_step == 12
    logged = [e["step"] for e in trainer.state.log_history if "loss" in e]
    assert logged == list(range(1, 13))  # the history of steps 1-5 came back with the checkpoint
    cb2.ckpt.close()


def test_callback_saves_and_stops_on_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    control = tmp_path / "control.log"
    monkeypatch.setenv("SLURM_CKPT_CONTROL", str(control))
    cb = SlurmCkptCallback(Checkpointer(tmp_path / "run", scratch=False))
    cb.ckpt.control.request()  # what the wrapper's signal does
    trainer = _trainer(tmp_path / "out", 20, [cb])
    trainer.train()
    assert cb.stopped and cb.step == 1 and trainer.state.global_step == 1
    assert f"committed 1 {tmp_path / 'run' / 'step-000000001'}" in control.read_text()


class Stream(torch.utils.data.IterableDataset[dict[str, torch.Tensor]]):
    """The examples of ``Seqs`` as a stream: one pass is 8 batches of 4."""

    def __init__(self) -> None:
        self.seqs = Seqs()

    def __iter__(self) -> Any:
        return (self.seqs[i] for i in range(len(self.seqs)))


class SizedStream(Stream):
    def __len__(self) -> int:
        return len(self.seqs)


class _SignalAt(TrainerCallback):
    def __init__(self, step: int, losses: list[tuple[int, str]]) -> None:
        self.step, self.losses = step, losses

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append((state.global_step, float(logs["loss"]).hex()))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)  # what the wrapper forwards


@pytest.mark.parametrize("sized", [False, True])
def test_trainer_over_an_iterable_dataset_resumes_past_its_first_pass_or_refuses(tmp_path: Path, sized: bool) -> None:
    """A stream of 8 batches a pass, stopped at step 11 (the second pass): the Trainer would skip 11 batches
    of a fresh stream and start it again; with ``__len__`` it resumes at the right pass and position."""

    def trainer(out: Path, callbacks: list[Any], ckpt: bool = True) -> Trainer:
        args = TrainingArguments(output_dir=str(out), max_steps=14, per_device_train_batch_size=4,
                                 save_strategy="steps" if ckpt else "no", save_steps=5, logging_steps=1,
                                 report_to=[], use_cpu=True, seed=0, disable_tqdm=True)  # fmt: skip
        data = SizedStream() if sized else Stream()
        return Trainer(model=_model(), args=args, train_dataset=data, callbacks=callbacks)

    want: list[tuple[int, str]] = []
    trainer(tmp_path / "ref", [_SignalAt(0, want)], ckpt=False).train()
    got: list[tuple[int, str]] = []
    cb = SlurmCkptCallback(Checkpointer(tmp_path / "run", scratch=False))
    trainer(tmp_path / "out", [_SignalAt(11, got), cb]).train()
    cb.ckpt.close()
    assert cb.stopped and cb.step == 11
    cb = SlurmCkptCallback(Checkpointer(tmp_path / "run", scratch=False))
    resumed = trainer(tmp_path / "out", [_SignalAt(0, got), cb])
    if not sized:
        with pytest.raises(ConfigError, match=r"step 11, past the first pass over Stream.*__len__.*ignore_data_skip"):
            resumed.train(resume_from_checkpoint=cb.resume_path(tmp_path / "out"))
        return
    resumed.train(resume_from_checkpoint=cb.resume_path(tmp_path / "out"))
    cb.ckpt.close()
    assert got == want and [s for s, _ in got] == list(range(1, 15))


def test_accelerate_save_state_and_load_state_go_through_the_checkpointer(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)

    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict[str, int]:
            return {"n": self.n}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            self.n = sd["n"]

    counter = Counter()
    acc.register_for_checkpointing(counter)
    with Checkpointer(tmp_path / "run", scratch=False) as ckpt:
        assert load_state(acc, ckpt) is None  # first run: nothing to restore
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        counter.n = 3
        saved, lr, draw = _weights(model), sched.get_last_lr(), torch.get_rng_state()
        path = save_state(acc, ckpt, 3, staging=tmp_path / "stage")
        assert path == tmp_path / "run" / "step-000000003"
        assert not list((tmp_path / "stage").iterdir())  # the staging copy is gone

        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        sched.step()
        counter.n = 99
        torch.rand(5)
        assert load_state(acc, ckpt, staging=tmp_path / "stage") == 3
        assert not list((tmp_path / "stage").iterdir())  # nor the copy it loaded from
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    assert sched.get_last_lr() == lr and counter.n == 3
    assert torch.equal(torch.get_rng_state(), draw)

    with Checkpointer(tmp_path / "run", scratch=False) as ckpt:
        other = Accelerator(cpu=True)
        other.prepare(torch.nn.Linear(4, 3))  # not the model saved: Accelerate's load raises
        with pytest.raises(RuntimeError, match="size mismatch"):
            load_state(other, ckpt, staging=tmp_path / "stage")
        assert not list((tmp_path / "stage").iterdir())  # a copy of the checkpoint is not left behind


def test_accelerate_automatic_checkpoint_naming_is_refused(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                                    automatic_checkpoint_naming=True))  # fmt: skip
    with Checkpointer(tmp_path / "run", scratch=False) as ckpt, pytest.raises(ConfigError, match="automatic"):
        save_state(acc, ckpt, 1)


def _resume_worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """One rank of a job resuming, on the host ``args["hosts"][rank]`` names (ranks of one
    machine stand for several nodes): resume_path with a Checkpointer of its own; then
    from a run dir whose checkpoint rank 0 may not load; then with a collective
    Checkpointer (the default under torch.distributed), which every rank must refuse."""
    import socket

    from slurm_ckpt.integrations import _folder

    socket.gethostname = lambda: args["hosts"][rank]  # type: ignore[assignment]
    writes = []
    real = _folder.write_folder
    _folder.write_folder = lambda state, path: (writes.append(str(path)), real(state, path))[1]  # type: ignore[assignment]
    cb = SlurmCkptCallback(Checkpointer(args["run"], scratch=False, distributed=False))
    path = cb.resume_path(args["out"])
    files = {p.relative_to(path).as_posix(): p.read_bytes().hex() for p in Path(path).rglob("*") if p.is_file()}
    failed = ""
    try:
        SlurmCkptCallback(Checkpointer(args["unsafe"], scratch=False, distributed=False)).resume_path(args["out"])
    except ShardError as e:
        failed = f"{e} | {type(e.__cause__).__name__}"
    refused = ""
    try:
        SlurmCkptCallback(Checkpointer(args["run"], scratch=False)).resume_path(args["out"])
    except ConfigError as e:
        refused = str(e)
    return {"path": path, "loaded": cb.ckpt.loaded_step, "files": files, "writes": writes, "failed": failed,
            "refused": refused}


def test_resume_path_of_several_processes_is_one_step_and_one_copy_a_node(tmp_path: Path, rank_pool: RankPool) -> None:
    """Eight processes a node each reading the whole checkpoint and writing a copy of it would
    need eight times its size in memory and on disk; and each picking the newest valid one
    on its own could resume them from different steps."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    with Checkpointer(tmp_path / "run", scratch=False) as ck:
        for step in (5, 10):
            (folder / "model.safetensors").write_bytes(bytes([step]) * 3000)
            (folder / "rng_state_1.pth").write_bytes(b"rank 1 at %d" % step)
            ck.save(folder_state(folder), step)
    with Checkpointer(tmp_path / "unsafe", scratch=False, allow_pickle=True) as ck:
        ck.save({"format": "slurm-ckpt-folder", "files": {}, "odd": object()}, 3)
    out = tmp_path / "out"
    hosts = ["a", "a", "b"]
    got = rank_pool.launch(3, "tests.integration.test_huggingface:_resume_worker",
                 {"run": str(tmp_path / "run"), "unsafe": str(tmp_path / "unsafe"), "out": str(out),
                  "hosts": hosts}, tmp_path / "ranks")  # fmt: skip

    resume = out / ".slurm-ckpt-resume"
    assert [Path(g["path"]) for g in got] == [resume / f"node-{h}" / "checkpoint-10" for h in hosts]
    # The lowest rank of each host reads the newest valid step, and writes it out.
    assert [len(g["writes"]) for g in got] == [1, 0, 1]
    assert [g["loaded"] for g in got] == [10, None, 10]
    assert sorted(p.relative_to(resume).as_posix() for p in resume.glob("*/checkpoint-*")) == [
        "node-a/checkpoint-10", "node-b/checkpoint-10"]  # fmt: skip
    assert all(g["files"] == {"model.safetensors": (bytes([10]) * 3000).hex(),
                              "rng_state_1.pth": b"rank 1 at 10".hex()} for g in got)  # fmt: skip
    # An error where a step is read is raised on every rank, and chained to the error itself there.
    assert all(g["failed"].startswith("finding the checkpoint to resume from failed: rank 0 on a: UnsafeLoad: ")
               and "; rank 2 on b: UnsafeLoad: " in g["failed"] for g in got), [g["failed"] for g in got]  # fmt: skip
    assert [g["failed"].rsplit(" | ", 1)[1] for g in got] == ["UnsafeLoad", "NoneType", "UnsafeLoad"]
    assert all("Checkpointer(distributed=False)" in g["refused"] for g in got)


def _agree_worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """One rank on the host ``args["hosts"][rank]`` that finds the run dir ``args["runs"][rank]``
    (a node's scratch may hold a step the others do not): where resume_path put its copy."""
    import socket

    socket.gethostname = lambda: args["hosts"][rank]  # type: ignore[assignment]
    cb = SlurmCkptCallback(Checkpointer(args["runs"][rank], scratch=False, distributed=False))
    if rank == args.get("interrupted"):
        def interrupt(**kwargs: Any) -> None:
            raise KeyboardInterrupt

        cb.ckpt.load_latest = interrupt  # type: ignore[method-assign]  # Ctrl-C while this node reads
    try:
        path = cb.resume_path(args["out"])
    except (ShardError, KeyboardInterrupt) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    files = {p.relative_to(path).as_posix(): p.read_bytes().hex() for p in Path(path).rglob("*") if p.is_file()}
    return {"path": path, "files": files, "loaded": cb.ckpt.loaded_step}


def test_resume_path_of_nodes_that_find_different_newest_steps_is_the_oldest_of_them(
    tmp_path: Path, rank_pool: RankPool
) -> None:
    """A node may find a step the others do not (one still on its scratch); resuming the
    ranks of each node from the step it found would train them from different states."""
    folder, run, older = tmp_path / "checkpoint", tmp_path / "run", tmp_path / "older"
    folder.mkdir()
    for step in (5, 10):
        with Checkpointer(run, scratch=False) as ck:
            (folder / "model.safetensors").write_bytes(bytes([step]) * 3000)
            ck.save(folder_state(folder), step)
        if step == 5:
            shutil.copytree(run, older)  # node b's view: step 10 is not in it
    hosts, out = ["a", "a", "b"], tmp_path / "out"

    def resume(runs: list[Path], name: str) -> list[dict[str, Any]]:
        return rank_pool.launch(3, "tests.integration.test_huggingface:_agree_worker",  # type: ignore[no-any-return]
                      {"runs": [str(r) for r in runs], "hosts": hosts, "out": str(out / name)},
                      tmp_path / f"{name}-ranks")  # fmt: skip

    got = resume([run, run, older], "older-on-b")
    assert [Path(g["path"]) for g in got] == [
        out / "older-on-b" / ".slurm-ckpt-resume" / f"node-{h}" / "checkpoint-5" for h in hosts]  # fmt: skip
    assert all(g["files"] == {"model.safetensors": (bytes([5]) * 3000).hex()} for g in got)
    assert [g["loaded"] for g in got] == [5, None, 5]  # node a's reader read step 5, not its 10

    empty = tmp_path / "empty"
    got = resume([run, run, empty], "none-on-b")
    assert [g["error"] for g in got] == [
        f"ShardError: finding the checkpoint to resume from failed: rank 2 on b found no checkpoint in {empty}, "
        f"where rank 0 on a found step 10 in {run}: every process must see the same run dir (SLURM_CKPT_DIR on "
        "storage that every node mounts)"] * 3  # fmt: skip

    # Ctrl-C on one node's reader: the others are told, and it stays a KeyboardInterrupt there.
    got = rank_pool.launch(3, "tests.integration.test_huggingface:_agree_worker",
                 {"runs": [str(run)] * 3, "hosts": hosts, "out": str(out / "ctrl-c"), "interrupted": 2},
                 tmp_path / "ctrl-c-ranks", timeout=120)  # fmt: skip
    assert [g["error"] for g in got] == [
        "ShardError: finding the checkpoint to resume from failed: rank 2 on b: KeyboardInterrupt"] * 2 + [
        "KeyboardInterrupt: "]  # fmt: skip


class _Refusing:
    """A ``register_for_checkpointing`` object whose load fails on one process (state that
    process cannot take), so that Accelerate's load_state raises there alone."""

    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.interrupt = False  # Ctrl-C in the middle of the load instead

    def state_dict(self) -> dict[str, int]:
        return {"n": 1}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        if self.refuse and self.interrupt:
            raise KeyboardInterrupt
        if self.refuse:
            raise ValueError("this process cannot take the saved state")


def _failing_worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """One process of a two-process Accelerate job whose save or load fails on one process
    only: the main one's commit on a full run dir, the other's files on a full staging dir,
    the other's load of an object. Each outcome: the error's type and message."""
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(1024, 512))  # 2 MiB of weights: more than the full run dir holds
    refusing = _Refusing(refuse=rank == 1)
    acc.register_for_checkpointing(refusing)
    stage = Path(args["stage"])

    def outcome(call: Any) -> str:
        try:
            call()
        except BaseException as e:
            return f"{type(e).__name__}: {e}"
        return "ok"

    full = Checkpointer(args["full"], scratch=False, distributed=False)
    run = Checkpointer(args["run"], scratch=False, distributed=False)
    got = {
        "commit": outcome(lambda: save_state(acc, full, 1, staging=stage)),
        "write": outcome(lambda: save_state(acc, run, 2, staging=Path(args["full_stage"]) if rank else stage)),
        "save": outcome(lambda: save_state(acc, run, 3, staging=stage)),
        "load": outcome(lambda: load_state(acc, run, staging=stage)),
    }
    refusing.interrupt = True
    got["interrupted"] = outcome(lambda: load_state(acc, run, staging=stage))
    full.close()
    run.close()
    del model
    return got


def test_accelerate_save_or_load_failing_on_one_process_fails_on_every_process(
    tmp_path: Path, rank_pool: RankPool, make_tmpfs: Callable[..., Path]  # noqa: F811 - fixture
) -> None:
    """A process whose part of save_state or load_state fails must not leave the others
    waiting at Accelerate's next barrier until the collective timeout (30 min with gloo):
    every process raises, the failing one its own error, the others naming it."""
    full_stage = make_tmpfs("64K")
    with open(full_stage / "filler", "wb") as f, pytest.raises(OSError, match="No space"):
        f.write(b"x" * (1 << 20))  # full: not one more block
    args = {"full": str(make_tmpfs("1M")), "run": str(tmp_path / "run"), "stage": str(tmp_path / "stage"),
            "full_stage": str(full_stage)}  # fmt: skip
    got = rank_pool.launch(2, "tests.integration.test_huggingface:_failing_worker", args, tmp_path / "ranks", timeout=120)

    # Each process raises its own error, and the others the same error, with its rank.
    assert got[0]["commit"].startswith("NoSpace: "), got[0]
    assert got[1]["commit"] == f"ShardError: committing checkpoint 1 failed: rank 0: {got[0]['commit']}"
    # torch.save's own error on the full disk ("unexpected pos"), raised where it happened.
    assert got[1]["write"] != "ok" and not got[1]["write"].startswith("ShardError"), got[1]
    assert got[0]["write"] == f"ShardError: writing checkpoint 2 failed: rank 1: {got[1]['write']}"
    assert [g["save"] for g in got] == ["ok", "ok"]
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == ["step-000000003"]  # nothing of 2
    assert got[1]["load"] == "ValueError: this process cannot take the saved state"
    assert got[0]["load"] == "ShardError: loading checkpoint 3 failed: rank 1: ValueError: this process cannot take the saved state"
    # Ctrl-C: no one waits.
    assert [g["interrupted"] for g in got] == ["ShardError: loading checkpoint 3 failed: rank 1: KeyboardInterrupt",
                                               "KeyboardInterrupt: "]  # fmt: skip
    assert not list((tmp_path / "stage").iterdir())  # neither a save's files nor the load's copy stay


def test_an_error_told_to_the_other_processes_is_its_type_and_text_cut_at_1000_characters() -> None:
    from slurm_ckpt.integrations._folder import error_text

    assert error_text(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert error_text(ValueError("no")) == "ValueError: no"

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    assert error_text(Unprintable()) == "Unprintable"  # and this process still joins the others' gather
    long = error_text(ValueError("x" * 5000))
    assert len(long) == 1000 and long.startswith("ValueError: xx") and long.endswith("x\u2026")


def test_ranks_that_failed_alike_are_named_once_with_their_error() -> None:
    """What rank 0 raises when ranks 1 to 3 failed a step: the texts are gathered from
    every process (here given as the gathers would return them)."""
    from slurm_ckpt.integrations._folder import together

    def run(texts: list[str]) -> str:
        with pytest.raises(ShardError) as e, together("writing checkpoint 7", lambda flag: [1, 2, 3],
                                                      lambda text: texts):  # fmt: skip
            pass
        return str(e.value)

    assert run(["", "NoSpace: full", "NoSpace: full", "OSError: gone"]) == (
        "writing checkpoint 7 failed: ranks 1, 2: NoSpace: full; rank 3: OSError: gone")


def _trainer_worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """One process of a two-process Trainer: a commit that fails on the main process (a
    full run dir), then a stop requested on rank 1 alone (as Slurm signals one task first)."""
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    failing = SlurmCkptCallback(Checkpointer(args["full"], scratch=False, distributed=False))
    try:
        _trainer(Path(args["out"]) / "failing", 5, [failing]).train()
        commit = "ok"
    except Exception as e:
        commit = f"{type(e).__name__}: {e}"
    failing.ckpt.close()
    cb = SlurmCkptCallback(Checkpointer(args["run"], scratch=False, distributed=False))
    if rank == 1:
        cb.ckpt.control.request()  # what the wrapper's signal does
    trainer = _trainer(Path(args["out"]) / "stopping", 20, [cb])
    trainer.train()
    cb.ckpt.close()
    return {"commit": commit, "stopped": cb.stopped, "step": cb.step, "global_step": trainer.state.global_step}


def test_trainer_commit_failing_on_the_main_process_fails_every_process(
    tmp_path: Path, rank_pool: RankPool, make_tmpfs: Callable[..., Path]  # noqa: F811 - fixture
) -> None:
    """The Trainer calls on_save on every process; a commit that fails on the main one must
    not leave the others waiting at the next barrier until the collective timeout. And a
    stop requested on one process stops all of them at the same step."""
    args = {"full": str(make_tmpfs("16K")), "run": str(tmp_path / "run"), "out": str(tmp_path / "out")}
    got = rank_pool.launch(2, "tests.integration.test_huggingface:_trainer_worker", args, tmp_path / "ranks", timeout=120)

    assert got[0]["commit"].startswith("NoSpace: "), got[0]
    assert got[1]["commit"] == f"ShardError: committing checkpoint 5 failed: rank 0: {got[0]['commit']}"
    assert [(g["stopped"], g["step"], g["global_step"]) for g in got] == [(True, 1, 1)] * 2
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == ["step-000000001"]
