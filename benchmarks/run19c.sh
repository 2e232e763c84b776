#!/usr/bin/env bash
# Run 19c (2026-12-01, one H200): the shipped grid's three entries re-tuned on the kernels of
# 4f0de6f (its dk/dv edit orphaned the shipped rows), then msa-bench on every case with those
# rows in place (the tree's msa_codegen/data/tuning.db replaced on this machine only).
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cp msa_codegen/data/tuning.db /tmp/grid.db
t0=$(date +%s)
timeout 330 python3 -m msa_codegen.tuner.grid --db /tmp/grid.db --limit 3 --budget-s 300 > "$OUT/grid.log" 2>&1
echo "grid exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/grid.log"
python3 -m msa_codegen.tuner.grid --db /tmp/grid.db --export "$OUT/tuning.db" >> "$OUT/grid.log" 2>&1
cp "$OUT/tuning.db" msa_codegen/data/tuning.db
cp benchmarks/results.csv "$OUT/results.csv"
left=$(( 585 - ($(date +%s) - start) ))
t0=$(date +%s)
timeout $left python3 -m msa_codegen.bench --reps-ms 150 --csv "$OUT/results.csv" > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/bench.log"
echo "==== grid"; grep -E "x\)|finished|budget|exit|Error" "$OUT/grid.log" | sed 's/^\[grid [0-9]\/[0-9]\] //' | cut -c1-230
echo "==== bench"; grep -v -i warn "$OUT/bench.log" | tail -30 | cut -c1-220
echo "elapsed $(( $(date +%s) - start )) s"
