"""PyTorch Lightning under ``slurm-ckpt run``: checkpoint on the signal, stop cleanly, resume exactly.

    # on a laptop: USR1 after 20 s, restarted in place, resumed, finished
    slurm-ckpt run --local --preempt-after 20 -- python examples/lightning_train.py

    # in a batch script (docs/lightning.md has the whole one)
    #SBATCH --signal=USR1@120 --requeue --open-mode=append
    srun slurm-ckpt run -- python examples/lightning_train.py --steps 2000

Three things make a resumed run end with the same weights, bit for bit, as one
that was never stopped: every checkpoint goes through the Checkpointer
(``SlurmCkptIO``), the DataLoader is torchdata's ``StatefulDataLoader`` (Lightning
saves its position inside the epoch), and ``PreemptionCallback`` saves and
restores the random number generators (dropout here). Each step's loss is
appended to ``<out>/metrics.jsonl``; the last line printed holds the weights'
digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from slurm_ckpt.integrations.lightning import PreemptionCallback, SlurmCkptIO, plugins


def say(msg: str) -> None:
    print(f"lightning: {msg}", flush=True)


class Regressor(LightningModule):
    """A small MLP with dropout (so the random number generators matter), Adam and StepLR."""

    def __init__(self, step_time: float = 0.0) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 1))  # fmt: skip
        self.step_time = step_time

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)
        if self.step_time:
            time.sleep(self.step_time)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class MetricsFile(Callback):
    """Appends ``{"step", "loss"}`` per optimizer step: the run's metric history."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:  # fmt: skip
        loss = float(outputs["loss"])
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "loss": loss.hex()}) + "\n")
        if trainer.global_step % 20 == 0:
            say(f"step {trainer.global_step}")


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50, help="ModelCheckpoint every_n_train_steps")
    ap.add_argument("--out", type=Path, default=Path("lightning-out"))
    ap.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (demos)")
    ap.add_argument("--no-ckpt", action="store_true", help="an uninterrupted reference run, no checkpoints")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    seed_everything(0, workers=True, verbose=False)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 8, generator=g)
    y = (x @ torch.randn(8, generator=g)) + 0.1 * torch.randn(256, generator=g)
    loader = StatefulDataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model = Regressor(args.step_time)

    callbacks: list[Callback] = [MetricsFile(args.out / "metrics.jsonl")]
    if args.no_ckpt:
        trainer = Trainer(max_steps=args.steps, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          callbacks=callbacks)  # fmt: skip
        trainer.fit(model, loader)
    else:
        io = SlurmCkptIO()
        preempt = PreemptionCallback()
        every = ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=args.every,
                                save_top_k=-1, save_last=True)  # fmt: skip
        trainer = Trainer(max_steps=args.steps, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=args.out, plugins=plugins(io),
                          callbacks=[*callbacks, preempt, every])  # fmt: skip
        ckpt_path = io.resume_path()
        say(f"start from={io.ckpt.loaded_step or 0} restart={os.environ.get('SLURM_RESTART_COUNT', '0')}")
        trainer.fit(model, loader, ckpt_path=ckpt_path)
        io.ckpt.close()
        if preempt.stopped:
            say(f"stopping at step={preempt.step} for requeue")
            return 0
    (args.out / "done.txt").write_text(digest(model) + "\n")
    say(f"done steps={trainer.global_step} digest={digest(model)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
