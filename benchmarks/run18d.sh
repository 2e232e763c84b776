#!/usr/bin/env bash
# Run 18d (2026-12-01): the GPU tests on the run-18 templates (scratch path opt-in, D>128
# backward default), then the shipped grid's three entries tuned into a fresh database on
# them (the template edit orphaned run 17's rows). One device call.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
SLOW=test_gpu_tuned_config_is_no_slower_than_the_default_and_attention_runs_it
t0=$(date +%s)
timeout 290 python3 -m pytest tests -m gpu -q -p no:cacheprovider -n 3 -k "not $SLOW" > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/pytest-gpu.log"
DB=/tmp/fresh.db TESTS=0 BUDGET=165 HARD=285 bash benchmarks/gpu_tune.sh > "$OUT/gpu-tune.log" 2>&1
echo "==== pytest"; grep -h -E "passed|failed|exit" "$OUT"/pytest-gpu.log | tail -3; grep -h -E "^(FAILED|ERROR)" "$OUT"/pytest-gpu.log | head -10 | cut -c1-250
echo "==== tune"; tail -12 "$OUT/gpu-tune.log" | cut -c1-230
echo "elapsed $(( $(date +%s) - start )) s"
