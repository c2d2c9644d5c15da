"""A nanoGPT-style loop resumed with ``load_latest(into=...)`` continues bit for bit.

The loop is the one of ``trainers/nanogpt_style.py`` (tied embedding and LM
head, AdamW in two groups, a GradScaler that skips steps, a cosine schedule
set by hand, ``torch.set_rng_state``), with a vocabulary large enough that
the tied weight (1 MiB) is read straight into the fresh model's memory. The
resumed run loads into the fresh model's ``state_dict()``, then hands the
rest of the loaded state to ``load_state_dict`` and ``set_rng_state`` as the
trainer does; it must end where the run that never stopped ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from slurm_ckpt import Checkpointer
from tests.compat.trainers import nanogpt_style as g

ARGS = {"vocab_size": 8192, "n_embd": 32}  # the tied weight: 8192 x 32 float32, 1 MiB


def parts() -> tuple[Any, Any, Any]:
    model = g.GPT(g.GPTConfig(**ARGS))
    optimizer = model.configure_optimizers(g.weight_decay, g.learning_rate, (g.beta1, g.beta2))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120, growth_interval=3)
    return model, optimizer, scaler


def train(model: Any, optimizer: Any, scaler: Any, batch: Any, start: int, stop: int) -> Any:
    X, Y = batch
    for it in range(start, stop):
        for group in optimizer.param_groups:
            group["lr"] = g.get_lr(it)
        for _ in range(g.gradient_accumulation_steps):
            loss = model(X, Y)[1] / g.gradient_accumulation_steps
            X, Y = g.get_batch("train")
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), g.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return X, Y


def test_a_resume_into_the_fresh_model_s_tensors_continues_bit_for_bit(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from slurm_ckpt.engine import reader

    read_in_place: list[list[str]] = []
    real = reader._read

    def spy(*args: Any) -> Any:  # the targets each file read writes straight into
        read_in_place.append(sorted(args[-1]))
        return real(*args)

    monkeypatch.setattr(reader, "_read", spy)
    torch.manual_seed(1337)
    model, optimizer, scaler = parts()
    batch = train(model, optimizer, scaler, g.get_batch("train"), 0, 6)
    with Checkpointer(tmp_path / "run", distributed=False, scratch=False) as ck:
        ck.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                 "rng": torch.get_rng_state(), "batch": batch, "iter_num": 6}, step=6)  # fmt: skip
        train(model, optimizer, scaler, batch, 6, 12)  # straight on
        want = (model.state_dict(), optimizer.state_dict()["state"], scaler.get_scale(), torch.rand(4))

        torch.manual_seed(0)  # another process's generator, until the checkpoint's is restored
        fresh, optimizer, scaler = parts()
        weight = fresh.lm_head.weight
        got = ck.load_latest(into={"model": fresh.state_dict()})
    assert got["model"]["lm_head.weight"].data_ptr() == weight.data_ptr()
    assert read_in_place == [["model/transformer.wte.weight"]]  # the tied weight, read straight into its memory
    fresh.load_state_dict(got["model"])
    optimizer.load_state_dict(got["optimizer"])
    scaler.load_state_dict(got["scaler"])
    torch.set_rng_state(got["rng"])
    train(fresh, optimizer, scaler, got["batch"], got["iter_num"], 12)
    assert fresh.transformer.wte.weight is fresh.lm_head.weight  # still tied
    for name, t in fresh.state_dict().items():
        assert torch.equal(t, want[0][name]), name
    for i, state in optimizer.state_dict()["state"].items():
        for k, v in state.items():
            assert torch.equal(v, want[1][i][k]), (i, k)
    assert scaler.get_scale() == want[2] and torch.equal(torch.rand(4), want[3])
