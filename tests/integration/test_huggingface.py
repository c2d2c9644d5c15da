"""HF Trainer and Accelerate through the Checkpointer, with real (tiny, config-built) models.

Nothing is downloaded: models come from a ``GPT2Config`` in code and
``HF_HUB_OFFLINE`` is set. Resuming restores the frameworks' state from files
they read themselves, so it runs in this process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from slurm_ckpt import CheckpointCorrupt, Checkpointer, ConfigError, UnsupportedValue
from slurm_ckpt.errors import ShardError
from slurm_ckpt.integrations._folder import folder_state, write_folder
from slurm_ckpt.integrations.accelerate import load_state, save_state
from slurm_ckpt.integrations.transformers import SlurmCkptCallback


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


def test_resume_path_of_several_processes_is_one_step_and_one_copy_a_node(tmp_path: Path) -> None:
    """Eight processes a node each reading the whole checkpoint and writing a copy of it would
    need eight times its size in memory and on disk; and each picking the newest valid one
    on its own could resume them from different steps."""
    from tests.integration.dist_ranks import launch

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
    got = launch(3, "tests.integration.test_huggingface:_resume_worker",
                 {"run": str(tmp_path / "run"), "unsafe": str(tmp_path / "unsafe"), "out": str(out),
                  "hosts": hosts}, tmp_path / "ranks")  # fmt: skip

    resume = out / ".slurm-ckpt-resume"
    assert [Path(g["path"]) for g in got] == [resume / f"node-{h}" / "checkpoint-10" for h in hosts]
    # The lowest rank of each host writes; rank 0 alone picks the step, by reading it.
    assert [len(g["writes"]) for g in got] == [1, 0, 1]
    assert [g["loaded"] for g in got] == [10, None, None]
    assert sorted(p.relative_to(resume).as_posix() for p in resume.glob("*/checkpoint-*")) == [
        "node-a/checkpoint-10", "node-b/checkpoint-10"]  # fmt: skip
    assert all(g["files"] == {"model.safetensors": (bytes([10]) * 3000).hex(),
                              "rng_state_1.pth": b"rank 1 at 10".hex()} for g in got)  # fmt: skip
    # An error on rank 0 is raised on every rank, and chained to the error itself where it happened.
    assert all(g["failed"].startswith("finding the checkpoint to resume from failed: rank 0: UnsafeLoad")
               for g in got), [g["failed"] for g in got]  # fmt: skip
    assert [g["failed"].rsplit(" | ", 1)[1] for g in got] == ["UnsafeLoad", "NoneType", "NoneType"]
    assert all("Checkpointer(distributed=False)" in g["refused"] for g in got)
