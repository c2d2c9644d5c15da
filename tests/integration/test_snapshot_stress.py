"""``save_async`` followed at once by the changes trainers make: the default snapshot is exact.

Each trial saves a state with ``save_async`` and, the moment the call
returns, changes that state in one of the ways real training code does
(``CHANGES``). It then waits for the save and compares every tensor of the
committed checkpoint, bit for bit, with a clone of the state taken just before
the call. Nothing touches the state between that clone and the call's
return (the trial's own change starts after it), so the clone is the state at
the moment ``save_async`` returned. A checkpoint that differs from it is
*torn*; a save that raises is *failed*.

The states mix sizes, from a 0-dim tensor to 32 MiB, and three dtypes, so
that some changes are still running when a background copy ends, others
finish before it starts.

* The default (``auto``: ``copy``, or ``fork`` when a copy would not fit in
  memory): 0 torn and 0 failed, required.
* The opt-in mode (``overlap``): what it lets through is counted and recorded
  (``figures``, printed in the terminal summary); ``docs/async.md`` gives the
  same. Asserted of it is only what the docs promise: ``optimizer.step()``
  waits for an ``overlap`` copy, so it tears nothing and fails nothing.
* A checkpoint holding each kind of change is seen as torn: the comparison
  can see a tear at all.

The checkpoints go to a tmpfs when the tests run as root: the snapshot is
what is under test, not the disk, and the suite's other tests share the disk.
"""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import slurm_ckpt.engine as engine_module
from slurm_ckpt import Checkpointer
from slurm_ckpt.config import Config, EngineConfig, StorageConfig
from slurm_ckpt.store.verify import verify_checkpoint

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow

TRIALS = {"copy": 204, "fork": 102, "overlap": 102}
"""Trials per snapshot, the kinds of change equally often: ``auto`` chooses
``copy`` unless a copy would not fit in memory, and then ``fork``."""

SIZES = (1, 7, 4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
"""Element counts: a 0-dim tensor up to 16 MiB of float32 (32 MiB of float64 and
int64), either side of the 1 MiB that ``overlap`` copies before returning."""

Change = Callable[[list[Any], Any], None]


def _inplace(ts: list[Any], _: Any) -> None:
    for t in ts:
        t.add_(1)


def _data(ts: list[Any], _: Any) -> None:
    for t in ts:
        t.data.add_(1)  # .data: autograd's version counter does not move


def _numpy(ts: list[Any], _: Any) -> None:
    for t in ts:
        t.numpy()[...] += 1  # a NumPy view: torch sees nothing


def _copy(ts: list[Any], new: Any) -> None:
    for t, n in zip(ts, new, strict=True):
        t.copy_(n)


def _thread(ts: list[Any], _: Any) -> None:
    th = threading.Thread(target=_inplace, args=(ts, None))
    th.start()
    th.join()


CHANGES: dict[str, Change] = {"in-place op": _inplace, ".data": _data, "NumPy view": _numpy,
                              "copy_": _copy, "another thread": _thread, "optimizer.step()": lambda _, opt: opt.step()}  # fmt: skip


class Trainer:
    """A model with Adam, its gradients set once, so that every ``step()`` changes the
    parameters and the moments; and loose tensors of mixed sizes and dtypes, made once
    and reused, as a trainer's are, so the trials spend their time on saves."""

    def __init__(self, rng: random.Random) -> None:
        torch.manual_seed(rng.randrange(1 << 30))
        self.model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 16),
                                         torch.nn.Linear(16, 512), torch.nn.Linear(512, 512))  # fmt: skip
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.model(torch.randn(8, 1024)).square().mean().backward()
        self.opt.step()  # Adam makes its moments at the first step
        self.rng = rng
        self.pool = [self._tensor(n, dtype) for n in SIZES for dtype in (torch.float32, torch.float64, torch.int64)]

    @staticmethod
    def _tensor(n: int, dtype: Any) -> Any:
        shape = () if n == 1 else (n // 4, 4) if n % 4 == 0 else (n,)
        if dtype == torch.int64:
            return torch.randint(-1000, 1000, shape, dtype=dtype)
        return torch.empty(shape, dtype=dtype).uniform_(-1, 1)

    def loose(self) -> list[Any]:
        """3 to 6 tensors of the pool."""
        return self.rng.sample(self.pool, self.rng.randint(3, 6))


def clone(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(clone(v) for v in state)
    return state.clone() if isinstance(state, torch.Tensor) else state


def same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return bool(got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want))
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    if isinstance(want, list | tuple):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want, strict=True))
    return bool(got == want)


def trial(ck: Checkpointer, tr: Trainer, kind: str, step: int) -> tuple[str, str]:
    """One save_async and change; returns (outcome, the mode the save used)."""
    if kind == "optimizer.step()":
        state: Any = {"model": tr.model.state_dict(), "optim": tr.opt.state_dict(), "step": step}
        ts: list[Any] = []
    else:
        ts = tr.loose()
        state = {"loose": ts, "step": step}
    new = [t + 1 for t in ts] if kind == "copy_" else None
    want = clone(state)
    h = ck.save_async(state, step=step)
    CHANGES[kind](ts, new if kind == "copy_" else tr.opt)  # at once
    try:
        path = h.wait(120)
    except Exception:
        return "failed", h.mode
    got = ck.engine.load(path, verify_checkpoint(path, full=False))
    assert not same(state, want), f"{kind} left the state as it was: the trial could not see a tear"
    return ("clean" if same(got, want) else "torn"), h.mode


def run(root: Path, snapshot: str, trials: int, seed: int) -> tuple[dict[str, Counter[str]], Counter[str]]:
    """``trials`` trials, the kinds of change shuffled; outcomes per kind, and modes used."""
    rng = random.Random(seed)
    tr = Trainer(rng)
    kinds = [k for _ in range(trials // len(CHANGES)) for k in CHANGES]
    rng.shuffle(kinds)
    outcomes: dict[str, Counter[str]] = {k: Counter() for k in CHANGES}
    modes: Counter[str] = Counter()
    cfg = Config(storage=StorageConfig(retries=0, keep=2), engine=EngineConfig(snapshot=snapshot))

    def fresh() -> Checkpointer:
        return Checkpointer(root / snapshot, config=cfg, distributed=False, scratch=False)

    ck = fresh()
    try:
        for step, kind in enumerate(kinds, 1):
            outcome, mode = trial(ck, tr, kind, step)
            outcomes[kind][outcome] += 1
            modes[mode] += 1
            if outcome == "failed":
                # overlap copies before returning for the rest of a run once it
                # caught a change; a new run measures overlap again.
                ck.close()
                ck = fresh()
    finally:
        ck.close()
    return outcomes, modes


def table(title: str, outcomes: dict[str, Counter[str]], modes: Counter[str]) -> str:
    lines = [f"{title} (the saves used: {', '.join(f'{m} {n}' for m, n in sorted(modes.items()))})",
             f"  {'change right after save_async':<30} {'trials':>6} {'clean':>6} {'torn':>6} {'failed':>6}"]  # fmt: skip
    total: Counter[str] = Counter()
    for kind, c in outcomes.items():
        total.update(c)
        lines.append(f"  {kind:<30} {sum(c.values()):>6} {c['clean']:>6} {c['torn']:>6} {c['failed']:>6}")
    lines.append(f"  {'all':<30} {sum(total.values()):>6} {total['clean']:>6} {total['torn']:>6} {total['failed']:>6}")
    return "\n".join(lines)


@pytest.fixture
def root(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    if os.geteuid() == 0:
        yield request.getfixturevalue("tmpfs")("1g")
    else:
        yield tmp_path


@pytest.mark.parametrize("path", ["copy", "fork"])
def test_the_default_snapshot_is_exact_under_every_change(
    root: Path, path: str, monkeypatch: pytest.MonkeyPatch, figures: Callable[[str, str], Path]
) -> None:
    if path == "fork":
        # What auto does when a staging copy would not fit in the memory left.
        monkeypatch.setattr(engine_module, "available_memory", lambda: 0)
    outcomes, modes = run(root, "auto", TRIALS[path], seed=13)
    figures(f"snapshot-stress-auto-{path}", table(f"auto, {path}", outcomes, modes))
    bad = {k: dict(c) for k, c in outcomes.items() if c["torn"] or c["failed"]}
    assert not bad, f"the default snapshot let changes made after save_async returned through: {bad}"
    assert modes == Counter({path: TRIALS[path]})


def test_what_overlap_lets_through_is_recorded(root: Path, figures: Callable[[str, str], Path]) -> None:
    outcomes, modes = run(root, "overlap", TRIALS["overlap"], seed=14)
    figures("snapshot-stress-overlap", table("overlap", outcomes, modes))
    step = outcomes["optimizer.step()"]
    assert step["torn"] == step["failed"] == 0, f"optimizer.step() did not wait for the copy: {dict(step)}"


def test_a_checkpoint_holding_each_change_compares_as_torn(root: Path) -> None:
    tr = Trainer(random.Random(15))
    cfg = Config(storage=StorageConfig(retries=0, keep=2), engine=EngineConfig(snapshot="copy"))
    with Checkpointer(root / "torn", config=cfg, distributed=False, scratch=False) as ck:
        for step, kind in enumerate(CHANGES, 1):
            ts = [] if kind == "optimizer.step()" else tr.loose()
            state: Any = {"model": tr.model.state_dict(), "optim": tr.opt.state_dict(), "loose": ts, "step": step}
            want = clone(state)
            CHANGES[kind](ts, [t + 1 for t in ts] if kind == "copy_" else tr.opt)
            path = ck.save(state, step=step)  # after the change: what a tear at its worst holds
            assert not same(ck.engine.load(path, verify_checkpoint(path, full=False)), want), kind
