#!/usr/bin/env bash
# Run 17b (2026-12-01): the shipped grid's first three entries (window=4096, dilations 2 and 4,
# both directions) tuned on the LSE2 kernels into a fresh database; the tuner's timing test;
# the D=64 sweeps (forward with descriptors never re-swept since run 12; dk/dv on LSE2).
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
rm -f /tmp/fresh.db; touch /tmp/fresh.db
DB=/tmp/fresh.db TESTS=0 BUDGET=175 HARD=300 bash benchmarks/gpu_tune.sh > "$OUT/tune.log" 2>&1
cp /tmp/msa-out/grid-*.log "$OUT/" 2>/dev/null; cp /tmp/msa-out/tuning.db "$OUT/" 2>/dev/null
SLOW=test_gpu_tuned_config_is_no_slower_than_the_default_and_attention_runs_it
t0=$(date +%s)
timeout 100 python3 -m pytest tests -m gpu -q -p no:cacheprovider -k "$SLOW" > "$OUT/pytest-gpu-tuner.log" 2>&1
echo "pytest (tuner timing test) exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/pytest-gpu-tuner.log"
t0=$(date +%s)
timeout 80 python3 benchmarks/sweep.py --pattern window=4096 --heads 32 --head-dim 64 --fwd-only --rep 100 \
  --fwd "128,64,4,3;128,64,8,3;128,128,8,3;128,128,8,2;64,64,4,3;64,128,4,3;128,64,4,4;128,128,4,3" > "$OUT/sweep-d64-fwd.log" 2>&1
echo "sweep exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/sweep-d64-fwd.log"
t0=$(date +%s)
timeout 100 python3 benchmarks/sweep.py --pattern window=4096 --heads 32 --head-dim 64 --bwd-only --rep 100 \
  --dkdv "64,64,4,3;64,64,4,2;64,128,8,2;64,128,8,3" --dq "64,64,4,2;128,64,8,3" > "$OUT/sweep-d64-bwd.log" 2>&1
echo "sweep exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/sweep-d64-bwd.log"
echo "==== tune"; grep -E "x\)|finished|budget|FAILED|not started|exported|elapsed" "$OUT/tune.log" | sed 's/^\[grid [0-9]\/[0-9]\] //' | cut -c1-230
echo "==== pytest"; tail -2 "$OUT/pytest-gpu-tuner.log"
echo "==== sweeps"; grep -h -E "^(fwd|bwd)|kernel|exit" "$OUT"/sweep-d64-*.log | cut -c1-170
echo "elapsed $(( $(date +%s) - start )) s"
