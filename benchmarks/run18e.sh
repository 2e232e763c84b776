#!/usr/bin/env bash
# Run 18e (2026-12-01): the grid's third entry (dilation 4) tuned on the run-18 kernels (18d ran
# out of budget after two), msa-bench on every case, and three more rounds of the scratch path
# against recomputation for dilation 2 and causal=false,window=512. One device call.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
DB=/tmp/fresh.db TESTS=0 BUDGET=45 HARD=160 bash benchmarks/gpu_tune.sh > "$OUT/gpu-tune.log" 2>&1
cp benchmarks/results.csv "$OUT/results.csv"
t0=$(date +%s)
timeout 280 python3 -m msa_codegen.bench --reps-ms 150 --csv "$OUT/results.csv" > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/bench.log"
t0=$(date +%s)
timeout 90 python3 benchmarks/ds_probe.py --cases dil2+bidir512 --rounds 3 --rep 150 > "$OUT/ds-probe.log" 2>&1
echo "ds_probe exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/ds-probe.log"
echo "==== tune"; grep -E "^'|finished|budget" "$OUT/gpu-tune.log" | cut -c1-230
echo "==== bench"; grep -v -i warn "$OUT/bench.log" | tail -30 | cut -c1-220
echo "==== ds probe"; grep -E "round|on vs off|^[a-z0-9]+ +[0-9]|exit" "$OUT/ds-probe.log" | cut -c1-150
echo "elapsed $(( $(date +%s) - start )) s"
