#!/usr/bin/env bash
# One device call doing, in order of priority, what a session must measure on the H200:
#   1. every GPU test (pytest -m gpu)                                  -> $OUT/pytest-gpu.log
#   2. the issue-3 command: msa-tune on the H200 for window=4096,dilation=2 at N=131072, then
#      `msa-codegen which` showing that attention() resolves to the stored row -> $OUT/msa-tune.log
#   3. the run-time sparsity benchmark rows (python -m msa_codegen.bench_dynamic) -> $OUT/bench-dynamic.log
#   4. the shipped grid, continued with whatever time is left          -> $OUT/grid-0.log, $OUT/tuning.db
# Each step has its own time limit (seconds: T_TESTS, T_TUNE, T_BENCH; the grid gets the rest up to
# END seconds after the start), so a slow step cannot take the others' time.
set -u
OUT=${OUT:-/tmp/msa-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
T_TESTS=${T_TESTS:-330}
T_TUNE=${T_TUNE:-90}
T_BENCH=${T_BENCH:-150}
END=${END:-570}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

timeout "$T_TESTS" python3 -m pytest tests -m gpu -q -p no:cacheprovider > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - start )) s" >> "$OUT/pytest-gpu.log"

t0=$(date +%s)
timeout "$T_TUNE" python3 -m msa_codegen.cli.tune --gpu h200 --pattern window=4096,dilation=2 --seqlen 131072 \
  --trials 6 --db /tmp/user-tuning.db > "$OUT/msa-tune.log" 2>&1
echo "msa-tune exit $? in $(( $(date +%s) - t0 )) s" >> "$OUT/msa-tune.log"
python3 -m msa_codegen.cli.main which --pattern window=4096,dilation=2 --seqlen 131072 --head-dim 128 \
  --dtype bf16 --db /tmp/user-tuning.db >> "$OUT/msa-tune.log" 2>&1

if [ -f msa_codegen/bench_dynamic.py ]; then
  timeout "$T_BENCH" python3 -m msa_codegen.bench_dynamic --reps-ms 200 --csv "$OUT/results-dynamic.csv" \
    > "$OUT/bench-dynamic.log" 2>&1
  echo "bench_dynamic exit $?" >> "$OUT/bench-dynamic.log"
fi

left=$(( END - ($(date +%s) - start) ))
if [ "$left" -gt 45 ]; then
  TESTS=0 BUDGET=$(( left - 40 )) HARD=$(( left - 5 )) GRID_ARGS="--trials-fwd 6 --trials-bwd 8" \
    bash benchmarks/gpu_tune.sh > "$OUT/grid-summary.log" 2>&1
fi

echo "==== pytest";   tail -2 "$OUT/pytest-gpu.log"
echo "==== msa-tune"; grep -v "^\s*$" "$OUT/msa-tune.log" | grep -v Warning | tail -16 | cut -c1-220
echo "==== bench";    grep -v Warning "$OUT/bench-dynamic.log" 2>/dev/null | tail -30 | cut -c1-220
echo "==== grid";     tail -12 "$OUT/grid-summary.log" 2>/dev/null | cut -c1-220
echo "elapsed $(( $(date +%s) - start )) s"
