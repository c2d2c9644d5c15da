#!/usr/bin/env bash
# Creates .venv in the checkout and installs slurm-ckpt with its test extras.
# torch is pinned to 2.13.0 because that is the CPU wheel available offline;
# any other version would pull a multi-GB CUDA build.
set -euo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,torch,bench,metrics]"
