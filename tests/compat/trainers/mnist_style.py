"""An MNIST-style loop, as in the PyTorch examples' ``mnist/main.py``.

Two conv layers, two dropouts, two linear layers and ``log_softmax``; Adadelta
at lr 1.0 with ``StepLR(step_size=1, gamma=0.7)`` stepped after each epoch; a
shuffling train loader and a test pass after each epoch. The example saves only
``model.state_dict()`` at the end; to resume mid-epoch the checkpoint here also
holds the optimizer's and the scheduler's state dicts, the epoch and the batch
within it, the loader's generator state as the epoch began (which fixes the
epoch's order) and the global torch RNG state (dropout's), restored with
``Generator.set_state`` and ``torch.set_rng_state``. The data are synthetic
12x12 "digits", made in code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slurm_ckpt import Checkpointer
from tests.compat.trainers.common import args, finish, pause_for_request, say


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def digits(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 1, 12, 12, generator=g) * 0.5
    images[torch.arange(n), 0, labels, labels] += 3.0  # a class-dependent pixel to learn
    return TensorDataset(images, labels)


def main() -> None:
    a = args(steps=40)
    torch.manual_seed(1)
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    loader_rng = torch.Generator().manual_seed(2)
    train_loader = DataLoader(digits(256, 3), batch_size=16, shuffle=True, generator=loader_rng)
    test_loader = DataLoader(digits(64, 4), batch_size=32)

    ckpt = Checkpointer()
    start_epoch, skip, step = 1, 0, 0
    state = ckpt.load_latest()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, skip, step = state["epoch"], state["batch_idx"], state["step"]
        loader_rng.set_state(state["loader_rng"])
        torch.set_rng_state(state["rng"])
        say(f"resumed from step {step} (epoch {start_epoch}, batch {skip})")
    started_at = step
    losses: dict[int, float] = {}
    epochs = -(-a.steps // len(train_loader))
    for epoch in range(start_epoch, epochs + 1):
        epoch_rng = loader_rng.get_state()  # what this epoch's shuffle starts from
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            if batch_idx < skip:
                continue  # batches this epoch already trained on before the interruption
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            step += 1
            losses[step] = loss.item()
            pause_for_request(ckpt, step, a.pause_at, started_at)
            if ckpt.preempted:
                rng = torch.get_rng_state()
                ckpt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                           "scheduler": scheduler.state_dict(), "epoch": epoch, "batch_idx": batch_idx + 1,
                           "step": step, "loader_rng": epoch_rng, "rng": rng}, step=step)  # fmt: skip
                say(f"checkpointed step {step} on request; stopping")
                ckpt.close()
                return
            if step == a.steps:
                break
        skip = 0
        model.eval()
        with torch.no_grad():
            correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in test_loader)
        say(f"epoch {epoch}: test accuracy {correct}/64")
        scheduler.step()
        if step == a.steps:
            break
    ckpt.close()
    finish(a.out, model=model, optimizer=optimizer, losses=losses, started_at=started_at,
           extra={"lr": scheduler.get_last_lr()})  # fmt: skip


if __name__ == "__main__":
    main()
