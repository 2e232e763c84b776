#!/usr/bin/env bash
# Run 20e (2026-12-01, one H200): msa-bench on every case in one process at HEAD (no kernel
# change since runs 19c/19e), then the three plain-window cases again in a second process, whose
# first calls find Triton's on-disk cache warm (issue 4: under 3 s with a warm cache).
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cp benchmarks/results.csv "$OUT/results.csv"
t0=$(date +%s)
timeout 420 python3 -m msa_codegen.bench --reps-ms 150 --csv "$OUT/results.csv" > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/bench.log"
t0=$(date +%s)
timeout 150 python3 -m msa_codegen.bench --cases w4096,w4096-s64,gqa-w4096 --reps-ms 100 --csv "$OUT/warm.csv" > "$OUT/bench-warm.log" 2>&1
echo "bench (warm cache) exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/bench-warm.log"
echo "==== bench"; grep -v -i warn "$OUT/bench.log" | tail -24 | cut -c1-220
echo "==== bench, warm cache"; grep -v -i warn "$OUT/bench-warm.log" | tail -10 | cut -c1-220
echo "elapsed $(( $(date +%s) - start )) s"
