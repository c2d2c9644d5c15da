"""Training states for the fault tests: every value derived from the step, so a load is checkable."""

from __future__ import annotations

from typing import Any

__all__ = ["check_state", "state"]


def state(step: int, kib: int = 64) -> dict[str, Any]:
    """A small training state whose every value is derived from ``step`` (checkable after load)."""
    import torch

    g = torch.Generator().manual_seed(step)
    return {"step": step, "model": {"w": torch.randn(kib * 256, generator=g)}, "rng": [step, step * 7]}


def check_state(loaded: Any, step: int, kib: int = 64) -> None:
    import torch

    want = state(step, kib)
    assert loaded["step"] == step and loaded["rng"] == want["rng"]
    assert torch.equal(loaded["model"]["w"], want["model"]["w"])
