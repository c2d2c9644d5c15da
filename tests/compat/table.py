"""Print the compatibility table: each torch call on a loaded state, ``torch.load``'s against ours.

    python -m tests.compat.table            # from the repository root

A cell says how the call went on that load: ``ok`` for ``torch.load`` (the
reference), ``same`` where ours gave exactly what ``torch.load`` gave,
``same (raises X)`` where both raise the same error, and in bold what differs
or crashed. Each cell is a child process of its own (``runner.py``).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shutil
import tempfile
from pathlib import Path

import torch

from tests.compat import cases
from tests.compat.runner import run

__all__ = ["main"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, help="where to save the state (default: a temporary dir)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        cases.save_both(cases.make_state(), root)
        names = list(cases.CASES) + (list(cases.GPU_CASES) if torch.cuda.is_available() else [])
        print(f"torch {torch.__version__}, {platform.python_implementation()} {platform.python_version()}, "
              f"{platform.machine()}, {datetime.date.today()}; CUDA {'on' if torch.cuda.is_available() else 'off'}")  # fmt: skip
        print()
        print("| torch call on the loaded state | `torch.load` | ours | `torch.load(mmap=True)` | ours, `mmap=True` |")
        print("|---|---|---|---|---|")
        for name in names:
            ref, ours = run(name, "torch.load", root), run(name, "ours", root)
            mref, mours = run(name, "torch.load(mmap=True)", root), run(name, "ours (mmap=True)", root)
            print(f"| {name} | {ref.cell()} | {ours.cell(ref)} | {mref.cell()} | {mours.cell(mref)} |", flush=True)
        if not torch.cuda.is_available():
            for name in cases.GPU_CASES:
                print(f"| {name} | not run: no CUDA | not run | not run | not run |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
