"""A state loaded by slurm-ckpt behaves like the same state from ``torch.save`` + ``torch.load``.

Every case of ``cases.py`` runs on both loads, each in a child process of its
own (``runner.py``), and the observations must be equal: the same tensor
layouts and sharing, the same random numbers after ``set_rng_state``, the same
weights after ``load_state_dict`` and a step, and so on. The mmap loads are
held to ``torch.load(mmap=True)`` the same way. ``python -m tests.compat.table``
prints the whole comparison as a table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.compat import cases
from tests.compat.runner import Outcome, run

torch = pytest.importorskip("torch")

PAIRS = [("ours", "torch.load"), ("ours (mmap=True)", "torch.load(mmap=True)")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("compat")
    cases.save_both(cases.make_state(), root)
    return root


def check(case: str, ours: str, ref: str, root: Path) -> None:
    want = run(case, ref, root)
    assert want.result is not None and not want.raised, f"the reference {ref} itself failed: {want.result}"
    got = run(case, ours, root)
    assert got.result is not None, f"{ours}: the process died ({got.died}) in {case!r}"
    assert got.same_as(want), f"{ours} vs {ref} in {case!r}:\n" + "\n".join(differences(got, want))


def differences(got: Outcome, want: Outcome) -> list[str]:
    """The first few places where two observations differ, for the failure message."""
    a, b = (o.result.get("ok", o.result) if o.result else None for o in (got, want))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = [f" ours: {x}\n want: {y}" for x, y in zip(a, b, strict=True) if x != y]
        return out[:5] + ([f" ... {len(out) - 5} more"] if len(out) > 5 else [])
    return [f" ours: {a}", f" want: {b}"]


@pytest.mark.parametrize(("ours", "ref"), PAIRS, ids=["default", "mmap"])
@pytest.mark.parametrize("case", list(cases.CASES))
def test_loaded_state_behaves_like_torch_load(saved: Path, case: str, ours: str, ref: str) -> None:
    check(case, ours, ref, saved)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(cases.GPU_CASES))
def test_cuda_calls_on_a_loaded_state(saved: Path, case: str) -> None:
    check(case, "ours", "torch.load", saved)


def test_a_crash_in_a_case_is_an_outcome_not_the_end_of_the_suite(saved: Path) -> None:
    (case,) = cases.RUNNER_CHECKS
    got = run(case, "ours", saved)
    assert got.result is None and got.died == "SIGSEGV"
    assert got.cell(Outcome({"ok": 1})) == "**crash (SIGSEGV)**"
