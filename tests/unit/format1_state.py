"""The state in ``data/format1/``: a checkpoint written by slurm-ckpt's format 1 (before
tensors kept their storages), which every later version must still read."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def format1_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    w = torch.randn(3, 4, generator=g)
    return {
        "model": {"w": w, "b": torch.randn(4, generator=g), "more": torch.randn(100, generator=g)},
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4, generator=g)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}],
        },
        "rng": torch.Generator().manual_seed(5).get_state(),
        "t": torch.arange(12, dtype=torch.int16).reshape(3, 4).t(),
        "tied": [w, w],
        "np": np.arange(5, dtype=np.float64),
        "step": 7,
    }
