#!/usr/bin/env bash
# Run 16c (2026-12-01): the grid's third entry (window=4096,dilation=4) tuned into the database
# of run 16b (entries already there are skipped), that database installed as the shipped one,
# then msa-bench on every case with it.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
rm -f /tmp/grid16c.db; cp msa_codegen/data/tuning.db /tmp/grid16c.db
DB=/tmp/grid16c.db TESTS=0 BUDGET=20 HARD=130 bash benchmarks/gpu_tune.sh > "$OUT/tune.log" 2>&1
cp "$OUT/grid-0.log" "$OUT/grid.log" 2>/dev/null
[ -s "$OUT/tuning.db" ] && cp "$OUT/tuning.db" msa_codegen/data/tuning.db
t0=$(date +%s)
timeout 400 python3 -m msa_codegen.bench --reps-ms 150 --csv "$OUT/results.csv" > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/bench.log"
echo "==== tune"; grep -E "x\)|finished|budget|FAILED" "$OUT/tune.log" | sed 's/^\[grid [0-9]\/[0-9]\] //' | cut -c1-230
echo "==== bench"; grep -E "^\|" "$OUT/bench.log" | cut -c1-200; grep -E "dense|extrapol|1M|exit|setup|config" "$OUT/bench.log" | grep -v "^|" | cut -c1-250 | tail -8
echo "elapsed $(( $(date +%s) - start )) s"
