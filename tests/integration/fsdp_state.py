"""A small FSDP2 model and optimizer on CPU (gloo), and bit-exact comparisons of their states.

Used by the tests that run ranks in real processes (``dist_ranks.py``): one
layer sharded on dim 1, one on dim 0, a replicated buffer, AdamW.
"""

from __future__ import annotations

from typing import Any


def model(world: int) -> tuple[Any, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.ReLU(), torch.nn.Linear(96, 40))
    model.register_buffer("scale", torch.tensor([2.0, 0.5]))
    fully_shard(model[0], mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def train(model: Any, opt: Any, step: int, rank: int) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 + 10 * step + rank)
    x = torch.randn(4, 96, generator=g)
    (model(x) * model.scale[0]).square().mean().backward()
    opt.step()
    opt.zero_grad()


def full(state: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor of a nested state, DTensors made whole (a collective)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, DTensor):
            out[key] = v.full_tensor()
        elif hasattr(v, "dtype") and hasattr(v, "shape"):
            out[key] = v.detach().clone()
        else:
            out.update(full(v, key + "."))
    return out


def mismatches(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    import torch

    bad = sorted(set(got) ^ set(want))
    bad += [k for k in sorted(set(got) & set(want)) if not torch.equal(got[k], want[k])]
    return bad
