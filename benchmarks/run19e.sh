#!/usr/bin/env bash
# Run 19e (2026-12-01, one H200): dilated W bands back to three loops in the dk/dv kernel
# (19c measured the one-loop band 4% slower there). The GPU tests of dilated patterns, the
# two dilation entries of the shipped grid re-tuned (window=4096's rows still match its
# kernels), msa-bench on the two dilation cases with those rows in place (this machine only).
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
timeout 150 python3 -m pytest tests -m gpu -q -p no:cacheprovider -n 3 -k dilation > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/pytest-gpu.log"
cp msa_codegen/data/tuning.db /tmp/grid.db
t0=$(date +%s)
timeout 240 python3 -m msa_codegen.tuner.grid --db /tmp/grid.db --limit 3 --budget-s 200 > "$OUT/grid.log" 2>&1
echo "grid exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/grid.log"
python3 -m msa_codegen.tuner.grid --db /tmp/grid.db --export "$OUT/tuning.db" >> "$OUT/grid.log" 2>&1
cp "$OUT/tuning.db" msa_codegen/data/tuning.db
cp benchmarks/results.csv "$OUT/results.csv"
left=$(( 440 - ($(date +%s) - start) ))
t0=$(date +%s)
timeout $left python3 -m msa_codegen.bench --cases w4096-d2,w4096-d4 --reps-ms 150 --csv "$OUT/results.csv" > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/bench.log"
echo "==== pytest"; grep -h -E "passed|failed|exit" "$OUT"/pytest-gpu.log | tail -2; grep -h -E "^(FAILED|ERROR)" "$OUT"/pytest-gpu.log | head -5 | cut -c1-250
echo "==== grid"; grep -E "x\)|finished|budget|exit|Error" "$OUT/grid.log" | sed 's/^\[grid [0-9]\/[0-9]\] //' | cut -c1-230
echo "==== bench"; grep -v -i warn "$OUT/bench.log" | tail -12 | cut -c1-220
echo "elapsed $(( $(date +%s) - start )) s"
