#!/usr/bin/env bash
# The one command for a lent GPU (docs/gpu.md): the CUDA tests, then each pair's speed run in a process of its own,
# written under OUT_DIR as it goes (log: OUT_DIR/log.txt), merged at the end into OUT_DIR/bench_gpu.json. `--plan`:
# what it compiles and captures and how long it takes, in seconds on any machine; exits 1 over a run's budget.
set -uo pipefail
cd "$(dirname "$0")/.."
# One process per pair and batch: the first GPU run (H200) gave 0.5b-7b's batch 1 about 100 s and ran out of its
# budget before batch 32's engine rows, which a later process measured in 60 s of warm-ups.
RUNS=(
  "--device cuda --pairs 0.5b-7b --batches 1 --time-budget 105"
  "--device cuda --pairs 0.5b-7b --batches 32 --time-budget 115"
  "--device cuda --pairs 1.5b-14b --batches 1 --time-budget 130"
)
PY=${PYTHON:-python3}
if [ "${1:-}" = "--plan" ]; then
  exec "$PY" bench/speed.py --device cpu --plan-script "${RUNS[@]}"
fi
OUT=${1:?usage: bash bench/gpu_oneshot.sh OUT_DIR | --plan}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CITER_GPU_TESTS_OUT="$OUT"
start=$(date +%s)
{
  echo "== plan"
  "$PY" bench/speed.py --device cpu --plan-script "${RUNS[@]}"
  echo "== device"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "== CUDA tests ($(( $(date +%s) - start )) s)"
  timeout 150 "$PY" -m pytest -c tests/gpu/pytest.ini --confcutdir tests/gpu -p no:cacheprovider tests/gpu -q \
    || echo "CUDA tests exited $?"
  i=0
  for r in "${RUNS[@]}"; do
    echo "== run $i ($(( $(date +%s) - start )) s): bench/speed.py $r"
    # shellcheck disable=SC2086  # a run's arguments, split on purpose
    "$PY" bench/speed.py $r --out "$OUT/bench_gpu_$i.json" || echo "run $i exited $?"
    i=$((i + 1))
  done
  echo "== merge ($(( $(date +%s) - start )) s)"
  files=$(ls "$OUT"/bench_gpu_*.json 2>/dev/null | paste -sd, -)
  [ -n "$files" ] && "$PY" bench/speed.py --recompute "$files" --out "$OUT/bench_gpu.json"
  echo "== wall $(( $(date +%s) - start )) s"
} 2>&1 | tee "$OUT/log.txt"
