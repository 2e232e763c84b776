#!/usr/bin/env bash
# Run 17c (2026-12-01): the new D=64 defaults (forward 8 warps, dk/dv 2 stages) checked twice
# more in alternation against the old ones and by the GPU tests that run D=64; then msa-bench on
# every case with the LSE2 kernels and the six rows of run 17b (the shipped database).
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
t0=$(date +%s)
timeout 120 python3 -m pytest tests -m gpu -q -p no:cacheprovider -k "D64 or pointer_loads" > "$OUT/pytest-gpu-d64.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/pytest-gpu-d64.log"
t0=$(date +%s)
timeout 60 python3 benchmarks/sweep.py --pattern window=4096 --heads 32 --head-dim 64 --fwd-only --rep 100 \
  --fwd "128,64,4,3;128,64,8,3;128,64,4,3;128,64,8,3" > "$OUT/sweep-d64-fwd.log" 2>&1
echo "sweep exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/sweep-d64-fwd.log"
t0=$(date +%s)
timeout 80 python3 benchmarks/sweep.py --pattern window=4096 --heads 32 --head-dim 64 --bwd-only --rep 100 \
  --dkdv "64,64,4,3;64,64,4,2;64,64,4,3;64,64,4,2" --dq "64,64,4,2" > "$OUT/sweep-d64-bwd.log" 2>&1
echo "sweep exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/sweep-d64-bwd.log"
cp benchmarks/results.csv "$OUT/results.csv"
t0=$(date +%s)
timeout 400 python3 -m msa_codegen.bench --reps-ms 150 --csv "$OUT/results.csv" > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/bench.log"
echo "==== pytest"; tail -2 "$OUT/pytest-gpu-d64.log"; grep -h -E "^(FAILED|ERROR)" "$OUT"/pytest-gpu-d64.log | head -5 | cut -c1-250
echo "==== sweeps"; grep -h -E "^(fwd|bwd)|exit" "$OUT"/sweep-d64-*.log | cut -c1-170
echo "==== bench"; grep -E "^\|" "$OUT/bench.log" | cut -c1-200; grep -E "dense|extrapol|1M|exit|setup|config" "$OUT/bench.log" | grep -v "^|" | cut -c1-250 | tail -8
echo "elapsed $(( $(date +%s) - start )) s"
