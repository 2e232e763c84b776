#!/usr/bin/env bash
# Run 15e (2026-12-01): the final kernels of this session: msa-bench on every case (1M included),
# then every GPU test: PART=1 the benchmark and the tuner's timing test, PART=2 the other GPU tests
# (one device call each: 10 minutes a call).
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
SLOW=test_gpu_tuned_config_is_no_slower_than_the_default_and_attention_runs_it
PART=${PART:-1}
if [ "$PART" = 1 ]; then
timeout 400 python3 -m msa_codegen.bench --reps-ms 150 --csv "$OUT/results.csv" > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - start )) s" >> "$OUT/bench.log"
t0=$(date +%s)
timeout 100 python3 -m pytest tests -m gpu -q -p no:cacheprovider -k "$SLOW" > "$OUT/pytest-gpu-tuner.log" 2>&1
echo "pytest (tuner timing test) exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/pytest-gpu-tuner.log"
else
t0=$(date +%s)
timeout 420 python3 -m pytest tests -m gpu -q -p no:cacheprovider -n 3 -k "not $SLOW" > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/pytest-gpu.log"
fi
echo "==== bench"; grep -E "^\|" "$OUT/bench.log" | cut -c1-200; grep -E "dense|extrapol|1M|exit" "$OUT/bench.log" | grep -v "^|" | cut -c1-250 | tail -8
echo "==== pytest"; grep -h -E "passed|failed|exit" "$OUT"/pytest-gpu*.log | tail -6; grep -h -E "^(FAILED|ERROR)" "$OUT"/pytest-gpu*.log | head -10 | cut -c1-250
echo "elapsed $(( $(date +%s) - start )) s"
