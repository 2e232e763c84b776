#!/usr/bin/env bash
# Run 16g (2026-12-01): the last device call of session 16, on the LSE2 change (msa_bwd_pre
# writes the LSE in log2 units; the dk/dv kernel streams LSE2 and delta through descriptors):
# every GPU test but the tuner's timing test, then msa-bench's window=4096 row if time is left.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
SLOW=test_gpu_tuned_config_is_no_slower_than_the_default_and_attention_runs_it
timeout 160 python3 -m pytest tests -m gpu -q -p no:cacheprovider -n 6 -k "not $SLOW" > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - start )) s" >> "$OUT/pytest-gpu.log"
grep -h -E "passed|failed|exit" "$OUT/pytest-gpu.log" | tail -3; grep -h -E "^(FAILED|ERROR)" "$OUT/pytest-gpu.log" | head -10 | cut -c1-250
t0=$(date +%s)
timeout 120 python3 -m msa_codegen.bench --cases w4096 --reps-ms 100 --csv "$OUT/results.csv" > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/bench.log"
grep -E "^\|" "$OUT/bench.log" | cut -c1-200; tail -1 "$OUT/bench.log"
echo "elapsed $(( $(date +%s) - start )) s"
