"""The states in ``data/``: checkpoints written by earlier formats, which every
later version must still read as they were written."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def format1_state() -> dict[str, Any]:
    """``data/format1/``: format 1, before tensors kept their storages (0.1.0)."""
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


def format2_state() -> dict[str, Any]:
    """``data/format2/``: format 2, before numpy scalars and ``torch.Size`` kept their types (0.2.0).

    What it was given; format 2 stored ``np_f32`` and ``np_i64`` as JSON numbers and
    ``size`` as a tuple, so they load as a float, an int and a tuple.
    """
    g = torch.Generator().manual_seed(12)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    w = torch.randn(4, 6, generator=g)
    return {
        "model": model.state_dict(),
        "tied": [w, w],
        "t": w.t(),
        "row": w[2],
        "np_f32": np.float32(0.1),
        "np_i64": np.int64(-5),
        "size": torch.Size([2, 3]),
        "nan": float("nan"),
        "step": 9,
    }
