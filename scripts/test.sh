#!/usr/bin/env bash
# The whole test suite, as CI runs it: system packages, venv, lint, types, docs, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-system-deps.sh
bash scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff"; ruff check slurm_ckpt tests bench examples
echo "== mypy"; mypy
echo "== docs"; NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet
# Two workers: one runs the tests that use the machine, one at a time, the other the rest
# beside them (tests/conftest.py). The machine's take longer than all the rest together.
echo "== pytest"; pytest -n 2 --dist loadscope "$@"
