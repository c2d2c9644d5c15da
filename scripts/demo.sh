#!/usr/bin/env bash
# The main job: a real small PyTorch training run (with 2 DataLoader workers)
# under `slurm-ckpt run --local`, interrupted by a simulated Slurm warning
# signal, checkpointed, restarted in place, resumed and finished. The proof: its
# final weights are bit-identical to those of an uninterrupted run.
#
#   bash scripts/demo.sh            (DEMO_DIR, DEMO_STEPS, DEMO_PREEMPT_AFTER to change)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
base=${DEMO_DIR:-runs/demo}
steps=${DEMO_STEPS:-300}
after=${DEMO_PREEMPT_AFTER:-4}
train=(python examples/train.py --steps "$steps" --every 100 --workers 2 --step-time 0.02)
rm -rf "$base"
mkdir -p "$base"

echo "== 1. reference: $steps steps, never interrupted"
SLURM_CKPT_DIR="$base/reference" "${train[@]}" | tee "$base/reference.log"

echo
echo "== 2. the same run under the wrapper; USR1 arrives after ${after}s, as Slurm's warning would"
SLURM_CKPT_DIR="$base/preempted" slurm-ckpt run --local --preempt-after "$after" -- "${train[@]}" \
    2>&1 | tee "$base/preempted.log"

echo
echo "== 3. checkpoints of the interrupted run"
slurm-ckpt ls --dir "$base/preempted"

echo
echo "== proof"
ref=$(sed -n 's/.*weights \([0-9a-f]*\).*/\1/p' "$base/reference.log")
got=$(sed -n 's/.*weights \([0-9a-f]*\).*/\1/p' "$base/preempted.log")
stopped=$(grep 'event=committed' "$base/preempted.log" | grep ' run=1 ' | sed 's/.* step=\([0-9]*\).*/\1/' | tail -n1)
resumed=$(sed -n 's/^train: resumed from step \([0-9]*\).*/\1/p' "$base/preempted.log" | tail -n1)
restarts=$(grep -c 'event=restart' "$base/preempted.log" || true)
echo "interrupted: checkpoint at step ${stopped:-?} on request, restarted ${restarts} time(s), resumed from step ${resumed:-?}"
echo "uninterrupted run: weights ${ref:-missing}"
echo "interrupted run:   weights ${got:-missing}"
if [ "$restarts" -ge 1 ] && [ -n "$resumed" ] && [ "$resumed" -lt "$steps" ] && [ -n "$ref" ] && [ "$ref" = "$got" ]; then
    echo "OK: the interrupted, requeued and resumed run ended bit-identical to the uninterrupted one"
else
    echo "FAILED: the runs differ or the run was not interrupted mid-way" >&2
    exit 1
fi
