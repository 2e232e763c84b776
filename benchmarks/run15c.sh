#!/usr/bin/env bash
# Run 15c (2026-12-01): A/B of the folded scale in our forward against the stand-alone probe, D=64
# backward combinations, then msa-bench on the headline window cases with the new defaults.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
timeout 100 python3 benchmarks/kernel_probe.py --only fwd --rep 150 2>&1 | grep -v -i warn > "$OUT/probe-fwd.log"; echo "probe exit $?" >> "$OUT/probe-fwd.log"
timeout 80 python3 benchmarks/sweep.py --rep 60 --pattern window=4096 --heads 32 --head-dim 64 --bwd-only --dkdv '64,64,4,3' --dq '128,128,8,2;64,64,4,2;128,64,8,2' 2>&1 | grep -v -i warn > "$OUT/sweep-d64-bwd.log"
timeout 330 python3 -m msa_codegen.bench --cases w4096,w4096-s64,gqa-w4096,bidir-w512,d64-w4096,dense-causal --reps-ms 150 --csv "$OUT/results.csv" > "$OUT/bench.log" 2>&1; echo "bench exit $?" >> "$OUT/bench.log"
echo "==== probe"; cat "$OUT/probe-fwd.log"
echo "==== d64 bwd"; grep -E "^bwd |kernel" "$OUT/sweep-d64-bwd.log" | sed -E 's/BwdConfig//; s/block_|num_//g' | cut -c1-200
echo "==== bench"; grep -E "^\|" "$OUT/bench.log" | cut -c1-200; tail -2 "$OUT/bench.log"
echo "elapsed $(( $(date +%s) - start )) s"
