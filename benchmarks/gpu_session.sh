#!/usr/bin/env bash
# One device call doing, in order of priority, what a session must measure on the H200:
#   1. every GPU test (pytest -m gpu, WORKERS processes sharing the GPU; the one timing-sensitive
#      test, tuned vs default, runs alone afterwards)                   -> $OUT/pytest-gpu.log
#   2. the issue-3 command: msa-tune on the H200 for window=4096,dilation=2 at N=131072, then
#      `msa-codegen which` showing that attention() resolves to the stored row -> $OUT/msa-tune.log
#   3. the run-time sparsity benchmark rows (python -m msa_codegen.bench_dynamic $BENCH_ARGS)
#                                                                       -> $OUT/bench-dynamic.log
#   4. the issue-4 probe of descriptor loads and warp specialisation (benchmarks/ws_probe.py)
#                                                                       -> $OUT/ws-probe.log
#   5. the shipped grid, continued with whatever time is left (GRID=1)  -> $OUT/grid-0.log, $OUT/tuning.db
# Each step has its own time limit in seconds (T_TESTS, T_TUNE, T_BENCH, T_PROBE; 0 skips the
# step); the grid gets the rest up to END seconds after the start, so a slow step cannot take
# the others' time. Example: T_TUNE=0 GRID=0 bash benchmarks/gpu_session.sh
set -u
OUT=${OUT:-/tmp/msa-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
T_TESTS=${T_TESTS:-300}
WORKERS=${WORKERS:-3}   # 4 workers made the two largest dynamic tests run out of GPU memory (runs 10, 13)
T_TUNE=${T_TUNE:-90}
T_BENCH=${T_BENCH:-170}
BENCH_ARGS=${BENCH_ARGS:---reps-ms 200}
T_PROBE=${T_PROBE:-0}
GRID=${GRID:-1}
END=${END:-570}
SLOW_TEST=test_gpu_tuned_config_is_no_slower_than_the_default_and_attention_runs_it
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

if [ "$T_TESTS" -gt 0 ]; then
  t0=$(date +%s)
  timeout "$T_TESTS" bash -c "python3 -m pytest tests -m gpu -q -p no:cacheprovider -n $WORKERS -k 'not $SLOW_TEST' \
    && python3 -m pytest tests -m gpu -q -p no:cacheprovider -k $SLOW_TEST" > "$OUT/pytest-gpu.log" 2>&1
  echo "pytest exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/pytest-gpu.log"
fi

if [ "$T_TUNE" -gt 0 ]; then
  t0=$(date +%s)
  timeout "$T_TUNE" python3 -m msa_codegen.cli.tune --gpu h200 --pattern window=4096,dilation=2 --seqlen 131072 \
    --trials 6 --db /tmp/user-tuning.db > "$OUT/msa-tune.log" 2>&1
  echo "msa-tune exit $? in $(( $(date +%s) - t0 )) s" >> "$OUT/msa-tune.log"
  python3 -m msa_codegen.cli.main which --pattern window=4096,dilation=2 --seqlen 131072 --head-dim 128 \
    --dtype bf16 --db /tmp/user-tuning.db >> "$OUT/msa-tune.log" 2>&1
fi

if [ "$T_BENCH" -gt 0 ]; then
  timeout "$T_BENCH" python3 -m msa_codegen.bench_dynamic $BENCH_ARGS --csv "$OUT/results-dynamic.csv" \
    > "$OUT/bench-dynamic.log" 2>&1
  echo "bench_dynamic exit $?" >> "$OUT/bench-dynamic.log"
fi

if [ "$T_PROBE" -gt 0 ]; then
  timeout "$T_PROBE" python3 benchmarks/ws_probe.py > "$OUT/ws-probe.log" 2>&1
  echo "ws_probe exit $?" >> "$OUT/ws-probe.log"
fi

left=$(( END - ($(date +%s) - start) ))
if [ "$GRID" = 1 ] && [ "$left" -gt 45 ]; then
  TESTS=0 BUDGET=$(( left - 40 )) HARD=$(( left - 5 )) GRID_ARGS="--trials-fwd 6 --trials-bwd 8" \
    bash benchmarks/gpu_tune.sh > "$OUT/grid-summary.log" 2>&1
fi

echo "==== pytest";   grep -E "passed|failed|error|exit" "$OUT/pytest-gpu.log" 2>/dev/null | tail -6 | cut -c1-300
grep -E "^(FAILED|ERROR)" "$OUT/pytest-gpu.log" 2>/dev/null | head -20 | cut -c1-300
echo "==== msa-tune"; grep -v "^\s*$" "$OUT/msa-tune.log" 2>/dev/null | grep -v Warning | tail -16 | cut -c1-220
echo "==== bench";    grep -v Warning "$OUT/bench-dynamic.log" 2>/dev/null | tail -40 | cut -c1-260
echo "==== probe";    cat "$OUT/ws-probe.log" 2>/dev/null | grep -v Warning | tail -16 | cut -c1-220
echo "==== grid";     tail -12 "$OUT/grid-summary.log" 2>/dev/null | cut -c1-220
echo "elapsed $(( $(date +%s) - start )) s"
