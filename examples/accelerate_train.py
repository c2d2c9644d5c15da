"""Hugging Face Accelerate under ``slurm-ckpt run``: save_state/load_state through the Checkpointer.

    # on a laptop: USR1 after 30 s, restarted in place, resumed, finished
    HF_HUB_OFFLINE=1 slurm-ckpt run --local --preempt-after 30 -- python examples/accelerate_train.py

    # in a batch script (docs/huggingface.md has the whole one)
    #SBATCH --signal=USR1@120 --requeue --open-mode=append
    srun slurm-ckpt run -- python examples/accelerate_train.py --steps 2000

A two-layer GPT-2 built from a config in code (nothing is downloaded), an
AdamW optimizer and a linear schedule, prepared by an ``Accelerator``. ``save_state(accelerator, ckpt, step)`` commits what
``accelerator.save_state`` writes (model, optimizer, scheduler, RNG states)
as one checkpoint; ``load_state`` restores the newest valid one and returns its
step, from which the loop finds its epoch and skips the batches already used
(``skip_first_batches``, Accelerate's own way). The loop checks ``ckpt.preempted`` at every step: on the
wrapper's signal it saves and exits 0, and the requeued run continues the
same data stream, ending with the weights of a run that never stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DataLoaderConfiguration, set_seed
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

from slurm_ckpt import Checkpointer
from slurm_ckpt.integrations.accelerate import load_state, preempted, save_state


def say(msg: str) -> None:
    print(f"accelerate: {msg}", flush=True)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=50, help="periodic checkpoint interval")
    ap.add_argument("--out", type=Path, default=Path("accelerate-out"))
    ap.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (demos)")
    ap.add_argument("--no-ckpt", action="store_true", help="an uninterrupted reference run, no checkpoints")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    # The seedable sampler shuffles each epoch from (seed, epoch); with a generator
    # of its own, the DataLoader never draws from torch's global generator, whose
    # stream (dropout) a resumed run continues where load_state puts it.
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (128, 16), generator=torch.Generator().manual_seed(1234))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8, shuffle=True,
                                         generator=torch.Generator().manual_seed(5))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=10, num_training_steps=args.steps)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

    # The main process commits what every process wrote: a Checkpointer of its own.
    ckpt = None if args.no_ckpt else Checkpointer(distributed=False)
    step = (load_state(accelerator, ckpt) or 0) if ckpt is not None else 0
    say(f"start from={step} restart={os.environ.get('SLURM_RESTART_COUNT', '0')}")
    main_process = accelerator.is_main_process
    metrics = open(args.out / "metrics.jsonl" if main_process else os.devnull, "a")  # noqa: SIM115
    model.train()
    # Where the data stream stands: the epoch, and the batches of it already used.
    epoch, skip = divmod(step, len(loader))
    while step < args.steps:
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for (batch,) in batches:
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            metrics.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
            metrics.flush()
            if step % 20 == 0:
                say(f"step {step}")
            if args.step_time:
                time.sleep(args.step_time)
            if ckpt is not None and preempted(accelerator, ckpt):  # agreed: all stop at this step
                save_state(accelerator, ckpt, step)
                ckpt.close()
                say(f"stopping at step={step} for requeue")
                return 0
            if ckpt is not None and (step % args.every == 0 or step == args.steps):
                save_state(accelerator, ckpt, step)
            if step == args.steps:
                break
        epoch += 1
    if ckpt is not None:
        ckpt.close()
    weights = digest(accelerator.unwrap_model(model))
    if main_process:
        (args.out / "done.txt").write_text(weights + "\n")
    say(f"done steps={step} digest={weights}")
    return 0


if __name__ == "__main__":
    code = main()
    # With gloo, torch 2.13 can abort the interpreter's teardown once an optimizer is
    # built (exit 134, which the wrapper takes for a crash): everything is on disk by
    # now, so leave the group and exit without one (docs/tiers.md, "Ending a
    # multi-rank trainer"; examples/train.py does the same).
    PartialState().destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
