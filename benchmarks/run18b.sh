#!/usr/bin/env bash
# Run 18b (2026-12-01): where the dk/dv kernel's extra time on the scratch path goes
# (variant_probe.py: stores to one slot, no stores, streaming pointer stores), dk/dv tile shapes
# on the scratch path, and head dim 256's backward configs on both paths. One device call.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
t0=$(date +%s)
timeout 200 python3 benchmarks/variant_probe.py --rounds 2 --only "dS stores all,no dS stores,streaming pointer" > "$OUT/variant-probe.log" 2>&1
echo "variant_probe exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/variant-probe.log"
t0=$(date +%s)
timeout 150 python3 benchmarks/sweep.py --pattern window=4096 --bwd-only --rep 100 --no-profile \
  --dkdv "64,64,4,2;64,128,8,2;128,64,8,2;64,64,8,2;32,64,4,2" --dq "128,64,8,3" > "$OUT/sweep-w4096-scratch.log" 2>&1
echo "sweep exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/sweep-w4096-scratch.log"
t0=$(date +%s)
timeout 80 python3 benchmarks/sweep.py --pattern window=4096 --n 16384 --heads 16 --head-dim 256 --bwd-only --rep 100 --no-profile \
  --dkdv "32,64,8,2;32,32,4,2;32,64,4,2;64,32,8,2" --dq "32,32,4,1" > "$OUT/sweep-d256-scratch.log" 2>&1
echo "sweep exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/sweep-d256-scratch.log"
t0=$(date +%s)
MSA_BWD_SCRATCH_BYTES=0 timeout 80 python3 benchmarks/sweep.py --pattern window=4096 --n 16384 --heads 16 --head-dim 256 --bwd-only --rep 100 --no-profile \
  --dkdv "32,64,8,2" --dq "128,32,8,2;128,32,8,2;64,32,4,2" > "$OUT/sweep-d256-recompute.log" 2>&1
echo "sweep exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/sweep-d256-recompute.log"
echo "==== variants"; grep -v -i warn "$OUT/variant-probe.log" | cut -c1-160
echo "==== w4096 scratch"; grep -h -E "^bwd|exit|Error" "$OUT"/sweep-w4096-scratch.log | cut -c1-170
echo "==== d256"; grep -H -E "^bwd|exit|Error" "$OUT"/sweep-d256-*.log | cut -c1-190
echo "elapsed $(( $(date +%s) - start )) s"
