"""A word-language-model loop, as in the PyTorch examples' ``word_language_model/main.py``.

Embedding, dropout, a two-layer LSTM (with dropout between layers), dropout, a
decoder tied to the embedding (``--tied``), ``log_softmax`` and NLL loss; the
corpus batchified into columns and walked in ``bptt`` slices, the hidden state
carried across slices and detached (``repackage_hidden``); plain SGD written as
the example writes it, ``p.data.add_(p.grad, alpha=-lr)`` after
``clip_grad_norm_``; after each epoch an evaluation, and ``lr /= 4`` when the
validation loss did not improve. The example saves the best model whole with
``torch.save(model, f)``; to resume mid-epoch the checkpoint here holds the
model's state dict, ``lr``, ``best_val_loss``, the epoch and the slice within
it, the hidden state being carried, and the torch RNG state (dropout's),
restored with ``torch.set_rng_state``. The corpus is synthetic, made in code.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slurm_ckpt import Checkpointer
from tests.compat.trainers.common import args, finish, pause_for_request, say

NTOKENS, EMSIZE, NHID, NLAYERS, DROPOUT, BPTT, CLIP, BATCH = 50, 32, 32, 2, 0.2, 8, 0.25, 4


class RNNModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(DROPOUT)
        self.encoder = nn.Embedding(NTOKENS, EMSIZE)
        self.rnn = nn.LSTM(EMSIZE, NHID, NLAYERS, dropout=DROPOUT)
        self.decoder = nn.Linear(NHID, NTOKENS)
        self.decoder.weight = self.encoder.weight  # --tied (needs NHID == EMSIZE)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, x: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:
        emb = self.drop(self.encoder(x))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, NTOKENS)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = next(self.parameters())
        return w.new_zeros(NLAYERS, bsz, NHID), w.new_zeros(NLAYERS, bsz, NHID)


def repackage_hidden(h: Any) -> Any:
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous()


def get_batch(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = min(BPTT, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)


def corpus(n: int, seed: int) -> torch.Tensor:
    """Tokens from a fixed random bigram table: something an LSTM can learn."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, NTOKENS, (NTOKENS, 3), generator=g)
    out = [0]
    for c in torch.randint(0, 3, (n - 1,), generator=g).tolist():
        out.append(int(table[out[-1], c]))
    return torch.tensor(out)


def evaluate(model: RNNModel, data: torch.Tensor) -> float:
    model.eval()
    total, hidden = 0.0, model.init_hidden(BATCH)
    with torch.no_grad():
        for i in range(0, data.size(0) - 1, BPTT):
            x, y = get_batch(data, i)
            output, hidden = model(x, hidden)
            total += len(x) * F.nll_loss(output, y).item()
    return total / (len(data) - 1)


def main() -> None:
    a = args(steps=30)
    torch.manual_seed(1111)
    train_data, val_data = batchify(corpus(400, 1), BATCH), batchify(corpus(120, 2), BATCH)
    model = RNNModel()
    lr, best_val_loss = 20.0, None
    slices = list(range(0, train_data.size(0) - 1, BPTT))

    ckpt = Checkpointer()
    start_epoch, skip, step, hidden = 1, 0, 0, None
    state = ckpt.load_latest()
    if state is not None:
        model.load_state_dict(state["model"])
        lr, best_val_loss = state["lr"], state["best_val_loss"]
        start_epoch, skip, step, hidden = state["epoch"], state["batch"], state["step"], state["hidden"]
        torch.set_rng_state(state["rng"])
        say(f"resumed from step {step} (epoch {start_epoch}, batch {skip})")
    started_at = step
    losses: dict[int, float] = {}
    epoch = start_epoch
    while step < a.steps:
        model.train()
        if skip == 0:
            hidden = model.init_hidden(BATCH)
        for batch, i in enumerate(slices):
            if batch < skip:
                continue
            data, targets = get_batch(train_data, i)
            model.zero_grad()
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
            loss = F.nll_loss(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            step += 1
            losses[step] = loss.item()
            pause_for_request(ckpt, step, a.pause_at, started_at)
            if ckpt.preempted:
                ckpt.save({"model": model.state_dict(), "lr": lr, "best_val_loss": best_val_loss, "epoch": epoch,
                           "batch": batch + 1, "step": step, "hidden": repackage_hidden(hidden),
                           "rng": torch.get_rng_state()}, step=step)  # fmt: skip
                say(f"checkpointed step {step} on request; stopping")
                ckpt.close()
                return
            if step == a.steps:
                break
        skip = 0
        if step == a.steps and batch < len(slices) - 1:
            break  # stopped mid-epoch: no evaluation
        val_loss = evaluate(model, val_data)
        say(f"epoch {epoch}: valid loss {val_loss:.3f}, lr {lr}")
        if not best_val_loss or val_loss < best_val_loss:
            best_val_loss = val_loss
        else:
            lr /= 4.0  # anneal when the validation loss did not improve
        epoch += 1
    ckpt.close()
    finish(a.out, model=model, optimizer=None, losses=losses, started_at=started_at,
           extra={"lr": lr, "best_val_loss": best_val_loss, "hidden": [h.sum().item() for h in hidden]})  # fmt: skip


if __name__ == "__main__":
    main()
