"""An L-BFGS loop, as in the PyTorch examples' ``time_sequence_prediction/train.py``.

Two ``LSTMCell``s of 51 units and a linear layer, in double precision, fitted
to sine waves with ``torch.optim.LBFGS(lr=0.8)`` and a closure, on the whole
training set each step. The example saves nothing; to resume, the checkpoint
here holds the model's and the optimizer's state dicts (L-BFGS keeps its last
direction, step size and a history of past directions and gradient changes,
all as tensors), the step and the global torch RNG state. L-BFGS takes dot
products of those tensors at every step, and a dot product gives other last
bits at another alignment in memory (the compatibility suite's L-BFGS case
shows it in float32; in this double-precision state the tensors a step reads
happened to stay 16-byte aligned even when the reader packed them). The data
are made with NumPy, as in the example, but fewer and shorter waves.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from slurm_ckpt import Checkpointer
from tests.compat.trainers.common import args, finish, pause_for_request, say


class Sequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, 51)
        self.lstm2 = nn.LSTMCell(51, 51)
        self.linear = nn.Linear(51, 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        outputs = []
        h_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            outputs += [self.linear(h_t2)]
        return torch.cat(outputs, dim=1)


def waves(n: int = 12, length: int = 60, period: int = 20) -> torch.Tensor:
    x = np.empty((n, length), np.int64)
    x[:] = np.array(range(length)) + np.random.randint(-4 * period, 4 * period, n).reshape(n, 1)
    return torch.from_numpy(np.sin(x / 1.0 / period).astype("float64"))


def main() -> None:
    a = args(steps=8)
    np.random.seed(0)
    torch.manual_seed(0)
    data = waves()
    input, target = data[3:, :-1], data[3:, 1:]
    seq = Sequence().double()
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8, max_iter=4)

    ckpt = Checkpointer()
    step = 0
    state = ckpt.load_latest()
    if state is not None:
        seq.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        torch.set_rng_state(state["rng"])
        say(f"resumed from step {step}")
    started_at = step
    losses: dict[int, float] = {}
    while step < a.steps:

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = criterion(seq(input), target)
            loss.backward()
            return loss

        loss = optimizer.step(closure)  # type: ignore[arg-type]
        step += 1
        losses[step] = float(loss.detach())
        pause_for_request(ckpt, step, a.pause_at, started_at)
        if ckpt.preempted:
            ckpt.save({"model": seq.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                       "rng": torch.get_rng_state()}, step=step)  # fmt: skip
            say(f"checkpointed step {step} on request; stopping")
            ckpt.close()
            return
    ckpt.close()
    finish(a.out, model=seq, optimizer=optimizer, losses=losses, started_at=started_at)


if __name__ == "__main__":
    main()
