"""The examples' models and data, trained the frameworks' own way: no slurm-ckpt at all.

What ``test_frameworks_e2e.py`` measures the integrations against, on the same
cluster with the same signal:

* ``lightning``: Lightning's default SLURM handling (``SLURMEnvironment`` with
  ``auto_requeue=True``, chosen by Lightning under ``srun``): its SIGUSR1
  handler saves ``hpc_ckpt_N.ckpt`` and calls ``scontrol requeue``; on restart
  ``fit(ckpt_path=None)`` loads the newest hpc checkpoint.
* ``hf``: ``transformers.Trainer`` with ``save_steps``; restarted, it resumes
  with ``resume_from_checkpoint=True`` when a ``checkpoint-N`` folder exists.
* ``accelerate``: ``accelerator.save_state`` every ``--every`` steps into
  ``<out>/state``, ``load_state`` from it on start.

    python peer_trainer.py lightning|hf|accelerate --steps 60 --every 15 --out DIR

Lines: ``peer: start from=N restart=R``, ``peer: done steps=N digest=HEX``; each
step's loss goes to ``<out>/metrics.jsonl`` as in the examples.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def say(msg: str) -> None:
    print(f"peer: {msg}", flush=True)


def lightning(args: argparse.Namespace) -> str:
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    ex = example("lightning_train")
    seed_everything(0, workers=True, verbose=False)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 8, generator=g)
    y = (x @ torch.randn(8, generator=g)) + 0.1 * torch.randn(256, generator=g)
    loader = StatefulDataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model = ex.Regressor(args.step_time)
    trainer = Trainer(max_steps=args.steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=args.out,
                      callbacks=[ex.MetricsFile(args.out / "metrics.jsonl"),
                                 ModelCheckpoint(dirpath=args.out / "ckpt",
                                                 every_n_train_steps=args.every)])  # fmt: skip
    hpc = sorted(args.out.glob("hpc_ckpt_*.ckpt"))
    say(f"start from={hpc[-1].name if hpc else 0} restart={os.environ.get('SLURM_RESTART_COUNT', '0')}")
    trainer.fit(model, loader)  # ckpt_path=None: Lightning loads the newest hpc checkpoint under SLURM
    return str(ex.digest(model))


def hf(args: argparse.Namespace) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    ex = example("hf_trainer_train")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    out = args.out / "trainer"
    targs = TrainingArguments(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=8, learning_rate=1e-3,
        lr_scheduler_type="linear", warmup_steps=10, logging_steps=1, save_strategy="steps",
        save_steps=args.every, save_total_limit=2, report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=targs, train_dataset=ex.Sequences(),
                      callbacks=[ex.MetricsFile(args.out / "metrics.jsonl", args.step_time)])  # fmt: skip
    resume = any(out.glob("checkpoint-*"))
    say(f"start from={'last' if resume else 0} restart={os.environ.get('SLURM_RESTART_COUNT', '0')}")
    trainer.train(resume_from_checkpoint=True if resume else None)
    return str(ex.digest(model))


def accelerate(args: argparse.Namespace) -> str:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

    ex = example("accelerate_train")
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    ids = torch.randint(0, 64, (128, 16), generator=torch.Generator().manual_seed(1234))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8, shuffle=True,
                                         generator=torch.Generator().manual_seed(5))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=10, num_training_steps=args.steps)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    state, step_file = args.out / "state", args.out / "state-step.txt"
    step = 0
    if state.is_dir() and step_file.exists():
        acc.load_state(str(state))
        step = int(step_file.read_text())
    say(f"start from={step} restart={os.environ.get('SLURM_RESTART_COUNT', '0')}")
    metrics: Any = open(args.out / "metrics.jsonl", "a")  # noqa: SIM115
    epoch, skip = divmod(step, len(loader))
    while step < args.steps:
        loader.set_epoch(epoch)
        for (batch,) in acc.skip_first_batches(loader, skip) if skip else loader:
            loss = model(input_ids=batch, labels=batch).loss
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            metrics.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
            metrics.flush()
            time.sleep(args.step_time)
            if step % args.every == 0:
                acc.save_state(str(state))  # overwrites the one folder in place, as users do
                step_file.write_text(str(step))
            if step == args.steps:
                break
        skip, epoch = 0, epoch + 1
    return str(ex.digest(acc.unwrap_model(model)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("framework", choices=["lightning", "hf", "accelerate"])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=15)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--step-time", type=float, default=0.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    digest = {"lightning": lightning, "hf": hf, "accelerate": accelerate}[args.framework](args)
    (args.out / "done.txt").write_text(digest + "\n")
    say(f"done digest={digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
