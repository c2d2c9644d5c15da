"""A DeiT-style loop and checkpoint, as ``facebookresearch/deit``'s ``main.py`` and
``engine.py`` make them (timm's ``train.py`` saves the same things).

A small vision transformer (patch embedding, class token, position embedding,
a pre-norm encoder layer with dropout) trained with AdamW over two parameter
groups (no weight decay for biases, norms and embeddings, as timm's
``param_groups_weight_decay``), a timm-style cosine schedule with warmup
stepped once an epoch with ``lr_scheduler.step(epoch)`` (its ``state_dict`` is
its ``__dict__`` without the optimizer), Mixup/CutMix drawn from NumPy's global
generator with label smoothing and a soft-target cross-entropy, a
``NativeScaler``-style GradScaler with gradient clipping, and a model EMA
updated after every step. The order of each epoch comes from a
``DistributedSampler`` with ``set_epoch``.

The checkpoint is DeiT's: ``model``, ``optimizer``, ``lr_scheduler``,
``epoch``, ``model_ema``, ``scaler`` and ``args``, the parsed command line as
an ``argparse.Namespace``. The resume is DeiT's too: ``load_state_dict`` for
each, and the EMA through ``_load_checkpoint_for_ema``, which ``torch.save``s
the loaded EMA state into a ``BytesIO`` and ``torch.load``s it back. DeiT saves
at the end of each epoch; to resume mid-epoch the checkpoint here also holds
the batch within the epoch, the step, and the torch and NumPy global RNG
states (dropout's, and Mixup's). The data are synthetic 8x8 images, made in
code.
"""

from __future__ import annotations

import argparse
import copy
import io
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from slurm_ckpt import Checkpointer
from tests.compat.trainers.common import args, digest, finish, pause_for_request, say


def get_args_parser() -> argparse.ArgumentParser:
    """DeiT's hyperparameters (a few of them, with its names and defaults' kinds)."""
    p = argparse.ArgumentParser("DeiT training", add_help=False)
    p.add_argument("--model", default="deit_nano_patch4_8", type=str)
    p.add_argument("--batch-size", default=16, type=int)
    p.add_argument("--epochs", default=3, type=int)
    p.add_argument("--drop", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--opt-betas", default=None, type=float, nargs="+")
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--warmup-lr", type=float, default=1e-4)
    p.add_argument("--min-lr", type=float, default=1e-5)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--mixup-switch-prob", type=float, default=0.5)
    p.add_argument("--model-ema", action="store_true", default=True)
    p.add_argument("--model-ema-decay", type=float, default=0.99)
    p.add_argument("--output_dir", default="output/deit_nano", type=str)
    p.add_argument("--seed", default=0, type=int)
    p.add_argument("--start_epoch", default=0, type=int)
    return p


class ViT(nn.Module):
    def __init__(self, drop: float, dim: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, dim) * 0.02)
        self.block = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=drop, batch_first=True, norm_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.block(x))[:, 0])


def param_groups_weight_decay(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or name.endswith(".bias") or name in ("cls_token", "pos_embed") else decay).append(p)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


class CosineLRScheduler:
    """timm's, in short: the lr of epoch ``t`` from ``step(t)``; its state is its ``__dict__``."""

    def __init__(self, optimizer: torch.optim.Optimizer, t_initial: int, lr_min: float, warmup_t: int,
                 warmup_lr_init: float) -> None:  # fmt: skip
        self.optimizer = optimizer
        self.param_group_field = "lr"
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_values = [group["initial_lr"] for group in optimizer.param_groups]
        self.t_initial, self.lr_min = t_initial, lr_min
        self.warmup_t, self.warmup_lr_init = warmup_t, warmup_lr_init
        self.warmup_steps = [(v - warmup_lr_init) / warmup_t for v in self.base_values]
        self.noise_range_t, self.noise_pct, self.noise_seed = None, 0.67, 42
        self.step(0)

    def _get_lr(self, t: int) -> list[float]:
        if t < self.warmup_t:
            return [self.warmup_lr_init + t * s for s in self.warmup_steps]
        t -= self.warmup_t
        frac = t / max(1, self.t_initial - self.warmup_t)
        return [self.lr_min + 0.5 * (v - self.lr_min) * (1 + math.cos(math.pi * frac)) for v in self.base_values]

    def step(self, epoch: int) -> None:
        for group, value in zip(self.optimizer.param_groups, self._get_lr(epoch), strict=True):
            group[self.param_group_field] = value

    def state_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__dict__.update(state_dict)


class Mixup:
    """timm's Mixup/CutMix in batch mode: its draws come from NumPy's global generator."""

    def __init__(self, mixup_alpha: float, cutmix_alpha: float, switch_prob: float, label_smoothing: float,
                 num_classes: int) -> None:  # fmt: skip
        self.mixup_alpha, self.cutmix_alpha, self.switch_prob = mixup_alpha, cutmix_alpha, switch_prob
        self.label_smoothing, self.num_classes = label_smoothing, num_classes

    def __call__(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        use_cutmix = np.random.rand() < self.switch_prob
        lam = float(np.random.beta(self.cutmix_alpha, self.cutmix_alpha) if use_cutmix
                    else np.random.beta(self.mixup_alpha, self.mixup_alpha))  # fmt: skip
        if use_cutmix:  # rand_bbox, with the area actually cut as lam
            h, w = x.shape[-2:]
            cut_h, cut_w = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
            cy, cx = np.random.randint(0, h), np.random.randint(0, w)
            yl, yh = np.clip(cy - cut_h // 2, 0, h), np.clip(cy + cut_h // 2, 0, h)
            xl, xh = np.clip(cx - cut_w // 2, 0, w), np.clip(cx + cut_w // 2, 0, w)
            x[:, :, yl:yh, xl:xh] = x.flip(0)[:, :, yl:yh, xl:xh]
            lam = 1 - float((yh - yl) * (xh - xl)) / (h * w)
        else:
            x.mul_(lam).add_(x.flip(0).mul_(1 - lam))
        off = self.label_smoothing / self.num_classes
        y1h = torch.full((target.size(0), self.num_classes), off).scatter_(1, target.view(-1, 1), 1 - self.label_smoothing + off)
        return x, y1h * lam + y1h.flip(0) * (1 - lam)


class ModelEma:
    """timm's (v1): a copy of the model, its state moved toward the model's after each step."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.ema = copy.deepcopy(model).eval()
        self.decay = decay

    def update(self, model: nn.Module) -> None:
        with torch.no_grad():
            msd = model.state_dict()
            for k, ema_v in self.ema.state_dict().items():
                ema_v.copy_(ema_v * self.decay + (1.0 - self.decay) * msd[k].detach())

    def _load_checkpoint(self, checkpoint_path: Any) -> None:
        checkpoint = torch.load(checkpoint_path, map_location="cpu")
        self.ema.load_state_dict(checkpoint)


def _load_checkpoint_for_ema(model_ema: ModelEma, checkpoint: Any) -> None:
    """DeiT's utils: hands an already-loaded state to ``ModelEma._load_checkpoint``."""
    mem_file = io.BytesIO()
    torch.save(checkpoint, mem_file)
    mem_file.seek(0)
    model_ema._load_checkpoint(mem_file)


def synthetic_images(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 3, 8, 8, generator=g) * 0.5
    images[torch.arange(n), labels % 3, labels % 8, :] += 2.0  # a class-dependent stripe to learn
    return TensorDataset(images, labels)


def main() -> None:
    a = args(steps=36)
    hp = get_args_parser().parse_args([])
    torch.manual_seed(hp.seed)
    np.random.seed(hp.seed)
    dataset = synthetic_images(192, 1)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=hp.seed)
    # Each iter() of a DataLoader draws a seed for its workers, from the global
    # generator unless it has its own: a resumed epoch's iter() must not draw
    # from the restored global one, which dropout goes on from.
    loader = DataLoader(dataset, batch_size=hp.batch_size, sampler=sampler, drop_last=True, generator=torch.Generator())
    model = ViT(hp.drop)
    optimizer = torch.optim.AdamW(param_groups_weight_decay(model, hp.weight_decay), lr=hp.lr)
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=hp.epochs, lr_min=hp.min_lr, warmup_t=hp.warmup_epochs,
                                     warmup_lr_init=hp.warmup_lr)  # fmt: skip
    mixup_fn = Mixup(hp.mixup, hp.cutmix, hp.mixup_switch_prob, hp.smoothing, num_classes=10)
    loss_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)  # NativeScaler's _scaler
    model_ema = ModelEma(model, hp.model_ema_decay)

    ckpt = Checkpointer()
    step, skip = 0, 0
    checkpoint = ckpt.load_latest()
    if checkpoint is not None:
        saved = {k: v for k, v in vars(checkpoint["args"]).items() if k != "start_epoch"}  # set by a resume
        if saved != {k: v for k, v in vars(hp).items() if k != "start_epoch"}:
            raise SystemExit(f"resumed with other hyperparameters: {checkpoint['args']} != {hp}")
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        hp.start_epoch = checkpoint["epoch"]  # mid-epoch: this epoch again, from its next batch
        _load_checkpoint_for_ema(model_ema, checkpoint["model_ema"])
        loss_scaler.load_state_dict(checkpoint["scaler"])
        step, skip = checkpoint["step"], checkpoint["batch_idx"]
        torch.set_rng_state(checkpoint["rng"])
        np.random.set_state(checkpoint["np_rng"])
        say(f"resumed from step {step} (epoch {hp.start_epoch}, batch {skip})")
    started_at = step
    losses: dict[int, float] = {}
    for epoch in range(hp.start_epoch, hp.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for batch_idx, (samples, targets) in enumerate(loader):
            if batch_idx < skip:
                continue  # batches this epoch already trained on before the interruption
            samples, targets = mixup_fn(samples, targets)
            outputs = model(samples)
            loss = torch.sum(-targets * F.log_softmax(outputs, dim=-1), dim=-1).mean()  # SoftTargetCrossEntropy
            optimizer.zero_grad()
            loss_scaler.scale(loss).backward()
            loss_scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), hp.clip_grad)
            loss_scaler.step(optimizer)
            loss_scaler.update()
            model_ema.update(model)
            step += 1
            losses[step] = loss.item()
            pause_for_request(ckpt, step, a.pause_at, started_at)
            if ckpt.preempted:
                ckpt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                           "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch,
                           "model_ema": model_ema.ema.state_dict(), "scaler": loss_scaler.state_dict(), "args": hp,
                           "batch_idx": batch_idx + 1, "step": step, "rng": torch.get_rng_state(),
                           "np_rng": np.random.get_state()}, step=step)  # fmt: skip
                say(f"checkpointed step {step} on request; stopping")
                ckpt.close()
                return
            if step == a.steps:
                break
        skip = 0
        lr_scheduler.step(epoch + 1)
        if step == a.steps:
            break
    ckpt.close()
    finish(a.out, model=model, optimizer=optimizer, losses=losses, started_at=started_at, generators=("torch", "numpy"),
           extra={"ema": digest(model_ema.ema.state_dict()), "lr": [g["lr"] for g in optimizer.param_groups],
                  "scale": loss_scaler.get_scale()})  # fmt: skip


if __name__ == "__main__":
    main()
