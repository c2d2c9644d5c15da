"""slurm_ckpt.integrations.lightning with a real Lightning Trainer (CPU), in this process.

Resuming (which restores generators from a loaded checkpoint) runs in a
process of its own in ``test_frameworks_resume.py``; these tests cover the
plugin's saving, pointers, loading by path, and the preemption stop.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning.pytorch")

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from slurm_ckpt import CheckpointCorrupt, Checkpointer, ConfigError, NoCheckpoint, ShardError
from slurm_ckpt.integrations._steps import Pointer, read_pointer
from slurm_ckpt.integrations.lightning import PreemptionCallback, SlurmCkptIO, load_from_checkpoint


class Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class WithHparams(Tiny):
    """A module that saves its __init__ arguments, as most Lightning modules do."""

    def __init__(self, lr: float = 0.1, width: int = 3, tags: tuple[str, ...] = ("a",)) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def _loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1)), batch_size=4)


def _trainer(tmp_path: Path, io: SlurmCkptIO, callbacks: list[Callback], steps: int, **kw: Any) -> Trainer:
    return Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=tmp_path, plugins=[io], callbacks=callbacks, **kw)  # fmt: skip


@pytest.fixture
def io(tmp_path: Path) -> SlurmCkptIO:
    return SlurmCkptIO(Checkpointer(tmp_path / "run", scratch=False, keep=10))


def _steps(run: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in run.glob("step-*"))


def test_first_fit_starts_fresh_and_model_checkpoint_options_keep_working(tmp_path: Path, io: SlurmCkptIO) -> None:
    """every_n_train_steps, save_top_k with a monitor, save_last: Lightning's files are pointers."""
    assert io.resume_path() is None  # the first run: nothing to resume, fit starts fresh
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=2,
                         monitor="train_loss", save_last=True)  # fmt: skip
    trainer = _trainer(tmp_path, io, [PreemptionCallback(), mc], steps=12)
    trainer.fit(Tiny(), _loader(), ckpt_path=None)

    assert _steps(tmp_path / "run") == [4, 8, 12]
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert len(names) == 3 and "last.ckpt" in names  # top-2 plus last; the third was removed
    assert read_pointer(tmp_path / "ckpt" / "last.ckpt") == Pointer(12, tmp_path / "run")
    best = Path(mc.best_model_path)
    pointer = read_pointer(best)
    assert pointer is not None
    step = pointer.step
    assert step in (4, 8, 12) and f"step={step}" in best.name
    loaded = io.load_checkpoint(best)
    assert loaded["global_step"] == step
    # Lightning's own default is a function: tensors stay where they were saved.
    for where in (lambda storage, location: storage, "cpu", {"cpu": "cpu"}):
        assert io.load_checkpoint(best, map_location=where)["global_step"] == step
    assert set(loaded["state_dict"]) == {"net.weight", "net.bias"}
    assert io.load_checkpoint(str(io.ckpt.latest()))["global_step"] == 12


def test_signal_checkpoints_at_the_next_batch_and_stops_fit(tmp_path: Path, io: SlurmCkptIO,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A real SIGUSR1 mid-epoch: committed, reported to the wrapper, fit returns early."""
    control = tmp_path / "control.log"  # a plain file receives the wrapper protocol's lines
    monkeypatch.setenv("SLURM_CKPT_CONTROL", str(control))
    io = SlurmCkptIO(Checkpointer(tmp_path / "run", scratch=False))

    class SignalAt(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            if trainer.global_step == 5:
                os.kill(os.getpid(), signal.SIGUSR1)

    preempt = PreemptionCallback()
    trainer = _trainer(tmp_path, io, [SignalAt(), preempt], steps=40)
    trainer.fit(Tiny(), _loader(), ckpt_path=io.resume_path())

    assert preempt.stopped and preempt.step == 5 and trainer.global_step == 5
    assert _steps(tmp_path / "run") == [5]
    assert read_pointer(tmp_path / "preempted.ckpt") == Pointer(5, tmp_path / "run")
    assert f"committed 5 {tmp_path / 'run' / 'step-000000005'}" in control.read_text()
    state = io.load_checkpoint(str(tmp_path / "run" / "step-000000005"))
    # Taken once Lightning has finished the batch (logged it, stepped per-step plateau
    # schedulers): the batch is completed, and Lightning resumes at the next one.
    progress = state["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    assert (progress["processed"], progress["completed"]) == (5, 5)
    assert ["rng" in r for r in state["callbacks"]["PreemptionCallback"]["ranks"]] == [True]


def test_saves_after_the_stop_name_the_stop_checkpoint_instead_of_replacing_it(tmp_path: Path, io: SlurmCkptIO) -> None:
    """After the stop Lightning saves again at the same global_step (ModelCheckpoint at the epoch's end and
    save_last in on_train_end), states that count the epoch as finished; resume must get the stop's."""

    class SignalAt(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)

    preempt = PreemptionCallback()
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_last=True)
    trainer = _trainer(tmp_path, io, [SignalAt(), preempt, mc], steps=40)
    trainer.fit(Tiny(), _loader(), ckpt_path=io.resume_path())
    assert preempt.step == 3 and trainer.current_epoch == 1  # Lightning ended the epoch after the stop
    assert _steps(tmp_path / "run") == [3]
    # on_train_end saved last.ckpt, as no save of this fit had yet: it names the stop's step
    assert read_pointer(tmp_path / "ckpt" / "last.ckpt") == Pointer(3, tmp_path / "run")
    state = SlurmCkptIO(Checkpointer(tmp_path / "run", scratch=False)).ckpt.load_latest()
    assert state["epoch"] == 0 and state["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 0


def test_lightning_own_slurm_requeue_is_refused(tmp_path: Path, io: SlurmCkptIO,
                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    for k, v in {"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                 "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "7"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    trainer = Trainer(max_steps=2, logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
                      plugins=[io, SLURMEnvironment(auto_requeue=True)], callbacks=[PreemptionCallback()])  # fmt: skip
    with pytest.raises(ConfigError, match=r"auto_requeue=False"):
        trainer.fit(Tiny(), _loader())
    assert _steps(tmp_path / "run") == []


def test_preemption_callback_needs_the_plugin(tmp_path: Path) -> None:
    trainer = Trainer(max_steps=2, logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
                      callbacks=[PreemptionCallback()])  # fmt: skip
    with pytest.raises(ConfigError, match="SlurmCkptIO"):
        trainer.fit(Tiny(), _loader())


def test_weights_only_export_is_lightning_file_not_a_resume_point(tmp_path: Path, io: SlurmCkptIO) -> None:
    mc = ModelCheckpoint(dirpath=tmp_path / "export", every_n_train_steps=3, save_weights_only=True)
    trainer = _trainer(tmp_path, io, [mc], steps=6)
    trainer.fit(Tiny(), _loader())
    assert _steps(tmp_path / "run") == []
    (export,) = (tmp_path / "export").iterdir()
    assert read_pointer(export) is None
    assert set(io.load_checkpoint(export)["state_dict"]) == {"net.weight", "net.bias"}


def test_async_save_commits_and_writes_pointers_by_teardown(tmp_path: Path, io: SlurmCkptIO) -> None:
    io = SlurmCkptIO(Checkpointer(tmp_path / "run", scratch=False, keep=10), async_save=True)
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = _trainer(tmp_path, io, [mc], steps=9)
    model = Tiny()
    trainer.fit(model, _loader())
    assert _steps(tmp_path / "run") == [3, 6, 9]
    assert sorted(read_pointer(p).step for p in (tmp_path / "ckpt").iterdir()) == [3, 6, 9]  # type: ignore[union-attr]
    saved = io.load_checkpoint(tmp_path / "ckpt" / "epoch=0-step=9.ckpt")["state_dict"]
    assert torch.equal(saved["net.weight"], model.net.weight.detach())


def test_lightning_hpc_resume_fails_on_the_first_run_where_resume_path_starts_fresh(
    tmp_path: Path, io: SlurmCkptIO
) -> None:
    """Lightning's own ckpt_path="hpc" (its SLURM resume) raises when no HPC checkpoint exists yet."""
    with pytest.raises(ValueError, match="no HPC checkpoint was found"):
        _trainer(tmp_path, SlurmCkptIO(Checkpointer(tmp_path / "other", scratch=False)), [], 2).fit(
            Tiny(), _loader(), ckpt_path="hpc"
        )
    trainer = _trainer(tmp_path, io, [PreemptionCallback()], steps=2)
    trainer.fit(Tiny(), _loader(), ckpt_path=io.resume_path())
    assert trainer.global_step == 2


def test_load_from_checkpoint_reads_a_pointer_as_lightning_reads_its_own_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Model.load_from_checkpoint(best_model_path)``, the usual way to get the trained model."""
    paths = {}
    for name, plugins in (("ours", [SlurmCkptIO(Checkpointer(tmp_path / "run", scratch=False, keep=2))]),
                          ("lightning", [])):  # fmt: skip
        torch.manual_seed(0)
        mc = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=4, save_top_k=2, monitor="train_loss")
        trainer = Trainer(max_steps=12, logger=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=tmp_path, plugins=plugins, callbacks=[mc])  # fmt: skip
        trainer.fit(WithHparams(lr=0.05, tags=("x", "y")), _loader())
        paths[name] = Path(mc.best_model_path)
    ours, theirs = paths["ours"], paths["lightning"]
    assert ours.name == theirs.name and read_pointer(ours) is not None and read_pointer(theirs) is None
    with pytest.raises(Exception, match=r"(?i)unpickl|load key"):  # Lightning's reader: torch.load of the pointer
        WithHparams.load_from_checkpoint(ours)

    # An evaluation script elsewhere: the pointer names its run dir.
    monkeypatch.delenv("SLURM_CKPT_DIR", raising=False)
    monkeypatch.chdir(tmp_path / "lightning")
    for kwargs in ({}, {"lr": 0.5, "map_location": "cpu", "strict": True}):
        got, want = load_from_checkpoint(WithHparams, ours, **kwargs), WithHparams.load_from_checkpoint(theirs, **kwargs)
        assert type(got) is WithHparams and dict(got.hparams) == dict(want.hparams), (got.hparams, want.hparams)
        assert got.hparams["tags"] == ("x", "y") and got.hparams["lr"] == kwargs.get("lr", 0.05)
        assert got.state_dict().keys() == want.state_dict().keys()
        for k, v in want.state_dict().items():
            assert torch.equal(got.state_dict()[k], v), k
    # A file Lightning wrote goes to Lightning's reader.
    assert dict(load_from_checkpoint(WithHparams, theirs).hparams) == {"lr": 0.05, "width": 3, "tags": ("x", "y")}

    # keep=2 left steps 8 and 12: a pointer to step 4 names what retention removed.
    Path(tmp_path / "old.ckpt").write_text(ours.read_text().replace(f'"step": {read_pointer(ours).step}', '"step": 4'))  # type: ignore[union-attr]
    with pytest.raises(NoCheckpoint, match=r"step 4 .*storage.keep"):
        load_from_checkpoint(WithHparams, tmp_path / "old.ckpt")
    (tmp_path / "bad.ckpt").write_text('{"format": "slurm-ckpt-pointer", "step": "12"}')
    with pytest.raises(CheckpointCorrupt, match="pointer without a step and a run dir"):
        load_from_checkpoint(WithHparams, tmp_path / "bad.ckpt")


def test_load_from_checkpoint_finds_a_step_still_on_node_local_scratch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after fit, the best step may be on scratch only: the run dir gets it later."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("SLURM_CKPT_SCRATCH", str(scratch))
    io = SlurmCkptIO(Checkpointer(tmp_path / "run", keep=5))
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    model = WithHparams(lr=0.05)
    _trainer(tmp_path, io, [mc], steps=4).fit(model, _loader())
    io.ckpt.wait()  # copied to the run dir: now take it away from there
    shutil.rmtree(tmp_path / "run" / "step-000000004")
    got = load_from_checkpoint(WithHparams, mc.best_model_path)
    assert torch.equal(got.net[0].weight, model.net[0].weight) and got.hparams["lr"] == 0.05
    monkeypatch.delenv("SLURM_CKPT_SCRATCH")  # an evaluation script after the job: scratch is gone
    with pytest.raises(NoCheckpoint, match="scratch"):
        load_from_checkpoint(WithHparams, mc.best_model_path)
    io.ckpt.close()


class _Started(Callback):
    """The step training starts from, once the checkpoint is restored."""

    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.step = trainer.global_step


def _ddp_worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """One rank of a Lightning DDP job (CPU, gloo) that resumes through resume_path
    from the run dir ``args["runs"][rank]``: what this rank found, and how fit went."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # started by the launcher, as srun starts tasks
    io = SlurmCkptIO(Checkpointer(args["runs"][rank], scratch=False, keep=10, distributed=False))
    started = _Started()
    trainer = _trainer(Path(args["out"]), io, [PreemptionCallback(), started], 20, accelerator="cpu",
                       devices=world, strategy="ddp", enable_checkpointing=False)  # fmt: skip
    torch.manual_seed(0)
    model = Tiny()
    path = io.resume_path()
    found = io.ckpt.loaded_step
    error = ""
    try:
        trainer.fit(model, _loader(), ckpt_path=path)
    except ShardError as e:
        error = str(e)
    io.ckpt.close()
    return {"found": found, "loaded": io.ckpt.loaded_step, "started": started.step, "step": trainer.global_step,
            "error": error,
            "weights": [p.detach().flatten().tolist() for p in model.parameters()]}  # fmt: skip


def test_ddp_ranks_that_find_different_newest_steps_resume_from_the_same_one(tmp_path: Path) -> None:
    """Each rank calls resume_path before fit, when there is no process group to agree
    over, and may find another newest step (one still on its node's scratch, say). Ranks
    resumed from different steps would train different numbers of steps, and the one
    that ends first leaves the other waiting in a collective until the timeout."""
    from tests.integration.dist_ranks import launch

    run = tmp_path / "run"
    io = SlurmCkptIO(Checkpointer(run, scratch=False, keep=10))
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    torch.manual_seed(0)
    _trainer(tmp_path, io, [every], 15).fit(Tiny(), _loader())
    io.ckpt.close()
    assert _steps(run) == [5, 10, 15]
    older = tmp_path / "older"  # the other rank's view: step 15 is not in it
    shutil.copytree(run, older)
    shutil.rmtree(older / "step-000000015")

    def resume(runs: list[Path], name: str) -> list[dict[str, Any]]:
        return launch(2, "tests.integration.test_lightning_io:_ddp_worker",  # type: ignore[no-any-return]
                      {"runs": [str(r) for r in runs], "out": str(tmp_path / name)}, tmp_path / f"{name}-ranks",
                      timeout=120)  # fmt: skip

    got = resume([run, older], "newer-on-rank-0")
    assert [g["found"] for g in got] == [15, 10]
    # The oldest of the newest steps the ranks found: rank 0 reads step 10 instead of its 15.
    assert [(g["started"], g["step"], g["error"]) for g in got] == [(10, 20, "")] * 2
    assert got[0]["weights"] == got[1]["weights"]
    assert [g["loaded"] for g in got] == [10, 10]  # what the Checkpointer says it resumed from

    empty = tmp_path / "empty"  # a rank that finds nothing (its run dir not on shared storage)
    got = resume([older, empty], "none-on-rank-1")
    assert [g["found"] for g in got] == [10, None]
    assert all(g["started"] is None for g in got)
    assert [g["error"] for g in got] == [
        f"resuming Lightning: rank 1 found no checkpoint in {empty}, where rank 0 found step 10 in {older}: every "
        "process must see the same run dir (SLURM_CKPT_DIR on storage that every node mounts)"] * 2  # fmt: skip

    newest = tmp_path / "newest"  # retention kept step 15 alone: step 10 cannot be read there
    shutil.copytree(run, newest)
    for step in (5, 10):
        shutil.rmtree(newest / f"step-{step:09d}")
    got = resume([newest, older], "unreadable-on-rank-0")
    assert [g["found"] for g in got] == [15, 10]
    assert all(g["started"] is None for g in got)
    assert all(g["error"].startswith("resuming Lightning from checkpoint 10 failed: rank 0: NoCheckpoint: "
                                     "checkpoint step 10 is not in") for g in got), got  # fmt: skip
