"""Hugging Face ``Trainer`` under ``slurm-ckpt run``: commit each checkpoint, stop on the signal, resume.

    # on a laptop: USR1 after 30 s, restarted in place, resumed, finished
    HF_HUB_OFFLINE=1 slurm-ckpt run --local --preempt-after 30 -- python examples/hf_trainer_train.py

    # in a batch script (docs/huggingface.md has the whole one)
    #SBATCH --signal=USR1@120 --requeue --open-mode=append
    srun slurm-ckpt run -- python examples/hf_trainer_train.py --steps 2000

A two-layer GPT-2 built from a config in code (nothing is downloaded) learns a
synthetic sequence task. ``SlurmCkptCallback`` commits every checkpoint the
Trainer saves and stops training at the next step on the wrapper's signal;
``resume_path`` hands the newest valid one to ``resume_from_checkpoint``. The
Trainer restores its own RNG states and data position from it, so the final
weights equal those of a run that never stopped, bit for bit; its log history
(``trainer_state.json``) continues across the runs. Each logged step also goes
to ``<out>/metrics.jsonl``; the last line printed holds the weights' digest.
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
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from slurm_ckpt.integrations.transformers import SlurmCkptCallback


def say(msg: str) -> None:
    print(f"hf: {msg}", flush=True)


class Sequences(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed random token sequences; the model learns to continue them."""

    def __init__(self, n: int = 128, length: int = 16, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class MetricsFile(TrainerCallback):
    """Appends each logged loss with its step to ``metrics.jsonl``; slows steps for demos."""

    def __init__(self, path: Path, step_time: float) -> None:
        self.path, self.step_time = path, step_time

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:  # fmt: skip
        if logs and "loss" in logs:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, "loss": float(logs["loss"]).hex()}) + "\n")
        if state.global_step % 20 == 0:
            say(f"step {state.global_step}")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:  # fmt: skip
        if self.step_time:
            time.sleep(self.step_time)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=50, help="TrainingArguments.save_steps")
    ap.add_argument("--out", type=Path, default=Path("hf-out"))
    ap.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (demos)")
    ap.add_argument("--no-ckpt", action="store_true", help="an uninterrupted reference run, no checkpoints")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    targs = TrainingArguments(
        output_dir=str(args.out / "trainer"), max_steps=args.steps, per_device_train_batch_size=8,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=10, logging_steps=1,
        save_strategy="no" if args.no_ckpt else "steps", save_steps=args.every, save_total_limit=2,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    callbacks: list[TrainerCallback] = [MetricsFile(args.out / "metrics.jsonl", args.step_time)]
    cb = SlurmCkptCallback()
    if not args.no_ckpt:
        callbacks.append(cb)
    trainer = Trainer(model=model, args=targs, train_dataset=Sequences(), callbacks=callbacks)
    resume = None if args.no_ckpt else cb.resume_path(targs.output_dir)
    say(f"start from={cb.ckpt.loaded_step or 0 if resume else 0} "
        f"restart={os.environ.get('SLURM_RESTART_COUNT', '0')}")  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    if not args.no_ckpt:
        cb.ckpt.close()
    if cb.stopped:
        say(f"stopping at step={cb.step} for requeue")
        return 0
    history = [e["step"] for e in trainer.state.log_history if "loss" in e]
    (args.out / "history.json").write_text(json.dumps(history) + "\n")
    (args.out / "done.txt").write_text(digest(model) + "\n")
    say(f"done steps={trainer.state.global_step} digest={digest(model)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
