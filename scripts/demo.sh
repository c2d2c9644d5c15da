#!/usr/bin/env bash
# The main job: a real small PyTorch training run under `slurm-ckpt run --local`,
# interrupted by a simulated Slurm warning signal, resumed, and finished.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
run=${DEMO_DIR:-runs/demo}
rm -rf "$run"
echo "== training with a simulated preemption (checkpoints in $run)"
SLURM_CKPT_DIR="$run" python examples/train.py --steps 200 --stop-at 120
echo "== resuming"
SLURM_CKPT_DIR="$run" python examples/train.py --steps 200
slurm-ckpt ls --dir "$run"
