"""The states the benchmarks save: a transformer with Adam, and many small tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["flatten", "map_tensors", "small_state", "state_nbytes", "synthetic_state"]


def synthetic_state(nbytes: int) -> dict[str, Any]:
    """A model + Adam state of about ``nbytes`` (fp32; parameters are a third).

    Shaped like a transformer: per layer a few large matrices and several
    small vectors, the optimizer's ``exp_avg`` and ``exp_avg_sq`` for each, and
    an int-keyed optimizer state dict as torch makes it.
    """
    import torch

    params_bytes = max(nbytes // 3, 64 * 1024)
    d = 64
    while 12 * (2 * d) ** 2 * 4 * 4 <= params_bytes and d < 4096:
        d *= 2  # at least ~4 layers of the chosen width
    layers = max(1, round(params_bytes / (12 * d * d * 4)))
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "attn.qkv.weight": (3 * d, d), p + "attn.qkv.bias": (3 * d,),
                       p + "attn.out.weight": (d, d), p + "attn.out.bias": (d,),
                       p + "mlp.fc1.weight": (4 * d, d), p + "mlp.fc1.bias": (4 * d,),
                       p + "mlp.fc2.weight": (d, 4 * d), p + "mlp.fc2.bias": (d,),
                       p + "ln1.weight": (d,), p + "ln1.bias": (d,),
                       p + "ln2.weight": (d,), p + "ln2.bias": (d,)})  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    model = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    opt_state = {i: {"step": torch.tensor(100.0), "exp_avg": torch.randn(s, generator=gen),
                     "exp_avg_sq": torch.rand(s, generator=gen)}
                 for i, s in enumerate(shapes.values())}  # fmt: skip
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
               "params": list(range(len(shapes)))}]  # fmt: skip
    return {"model": model, "optim": {"state": opt_state, "param_groups": groups}, "step": 100}


def small_state(count: int = 10_000, numel: int = 256) -> dict[str, Any]:
    """``count`` small tensors: the case where per-tensor overheads dominate."""
    import torch

    gen = torch.Generator().manual_seed(1)
    return {"model": {f"p{i}": torch.randn(numel, generator=gen) for i in range(count)}, "step": 1}


def flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    """Tensors of ``state`` under dotted keys (what safetensors and DCP take)."""
    import torch

    out: dict[str, Any] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(state, torch.Tensor):
        out[prefix[:-1]] = state
    return out


def state_nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in flatten(state).values())


def map_tensors(state: Any, fn: Callable[[Any], Any]) -> Any:
    """``state`` with each tensor ``t`` replaced by ``fn(t)``; other values kept."""
    import torch

    if isinstance(state, dict):
        return {k: map_tensors(v, fn) for k, v in state.items()}
    if isinstance(state, list):
        return [map_tensors(v, fn) for v in state]
    return fn(state) if isinstance(state, torch.Tensor) else state
