"""A nanoGPT-style loop, as in Karpathy's ``train.py``.

A small GPT (token and position embeddings, pre-LayerNorm blocks of causal
self-attention and an MLP, dropout, the token embedding tied to the LM head);
AdamW with weight decay on the 2-D parameters only (``configure_optimizers``),
a warmup-then-cosine learning rate written into every param group each
iteration, gradient accumulation, a GradScaler with ``unscale_`` and gradient
clipping, random batches drawn with ``torch.randint`` and the next batch
fetched while the current one trains, and an evaluation every
``eval_interval`` iterations that saves when the validation loss improved.

The checkpoint holds what nanoGPT's holds (``model``, ``optimizer``,
``model_args``, ``iter_num``, ``best_val_loss``, a 0-dim tensor there, and
``config``) and what a bit-exact resume also needs: the GradScaler's state,
the torch RNG state (batches and dropout) and the batch already fetched.
The corpus is synthetic, made in code.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from slurm_ckpt import Checkpointer
from tests.compat.trainers.common import args, finish, pause_for_request, say


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.1
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.attn_dropout, self.resid_dropout = nn.Dropout(c.dropout), nn.Dropout(c.dropout)
        self.n_head, self.n_embd = c.n_head, c.n_embd
        self.register_buffer("bias", torch.tril(torch.ones(c.block_size, c.block_size))
                             .view(1, 1, c.block_size, c.block_size))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias), CausalSelfAttention(c), nn.LayerNorm(c.n_embd, bias=c.bias)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias), nn.GELU(),
                                 nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias), nn.Dropout(c.dropout))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(c.vocab_size, c.n_embd), "wpe": nn.Embedding(c.block_size, c.n_embd),
            "drop": nn.Dropout(c.dropout), "h": nn.ModuleList([Block(c) for _ in range(c.n_layer)]),
            "ln_f": nn.LayerNorm(c.n_embd, bias=c.bias),
        })  # fmt: skip
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple[float, float]) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


# the config, as nanoGPT's globals()
batch_size, block_size, gradient_accumulation_steps = 4, 16, 2
learning_rate, min_lr, warmup_iters, lr_decay_iters = 1e-2, 1e-3, 5, 40
weight_decay, beta1, beta2, grad_clip = 1e-1, 0.9, 0.95, 1.0
eval_interval, eval_iters = 10, 2
config = {k: v for k, v in dict(globals()).items() if isinstance(v, (int, float)) and not k.startswith("_")}

data = np.random.default_rng(0).integers(0, 64, size=2000).astype(np.uint16)  # the "train.bin"
val_data = np.random.default_rng(1).integers(0, 64, size=500).astype(np.uint16)


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    d = data if split == "train" else val_data
    ix = torch.randint(len(d) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(d[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(d[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
    return x, y


def get_lr(it: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@torch.no_grad()
def estimate_loss(model: GPT) -> dict[str, torch.Tensor]:
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            x, y = get_batch(split)
            losses[k] = model(x, y)[1].item()
        out[split] = losses.mean()
    model.train()
    return out


def main() -> None:
    a = args(steps=30)
    torch.manual_seed(1337)
    model_args = asdict(GPTConfig())
    ckpt = Checkpointer()
    checkpoint = ckpt.load_latest()
    if checkpoint is not None:
        model_args = checkpoint["model_args"]  # as nanoGPT: the saved architecture wins
    model = GPT(GPTConfig(**model_args))
    optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
    # float16 training's scaler; on a CPU it runs too, and a huge initial scale
    # makes it skip steps and back off, so its state matters to the result.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120, growth_interval=3)
    iter_num, best_val_loss = 0, 1e9
    X, Y = get_batch("train")
    if checkpoint is not None:
        state_dict = checkpoint["model"]
        for k in list(state_dict):
            if k.startswith("_orig_mod."):  # a torch.compile'd model's prefix, as nanoGPT strips it
                state_dict[k[len("_orig_mod.") :]] = state_dict.pop(k)
        model.load_state_dict(state_dict)
        iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        torch.set_rng_state(checkpoint["rng"])
        X, Y = checkpoint["batch"]
        checkpoint = None  # free up memory
        say(f"resumed from step {iter_num}")
    started_at = iter_num
    losses: dict[int, float] = {}

    def snapshot() -> dict[str, object]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "model_args": model_args,
                "iter_num": iter_num, "best_val_loss": best_val_loss, "config": config,
                "scaler": scaler.state_dict(), "rng": torch.get_rng_state(), "batch": (X, Y)}  # fmt: skip

    while iter_num < a.steps:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % eval_interval == 0 and iter_num > started_at:
            ev = estimate_loss(model)
            if ev["val"] < best_val_loss:
                best_val_loss = ev["val"]
                ckpt.save(snapshot(), step=iter_num)
                say(f"step {iter_num}: val loss {ev['val']:.4f}, saved")
        for _ in range(gradient_accumulation_steps):
            loss = model(X, Y)[1] / gradient_accumulation_steps
            X, Y = get_batch("train")  # fetch the next batch while this one trains
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        losses[iter_num] = loss.item() * gradient_accumulation_steps
        pause_for_request(ckpt, iter_num, a.pause_at, started_at)
        if ckpt.maybe_save(snapshot, iter_num):
            say(f"checkpointed step {iter_num} on request; stopping")
            ckpt.close()
            return
    ckpt.close()
    finish(a.out, model=model, optimizer=optimizer, losses=losses, started_at=started_at,
           extra={"scale": scaler.get_scale(), "best_val_loss": float(best_val_loss)})  # fmt: skip


if __name__ == "__main__":
    main()
