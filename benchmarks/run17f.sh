#!/usr/bin/env bash
# Run 17f (2026-12-01): run 17e found 15% of dk/dv's stall samples waiting on the Q/dO TMA
# arrival (mbarrier try-wait) with 2 stages; 3 stages at BLOCK_M1=64 fall to one CTA per SM.
# Smaller query blocks with more stages prefetch further ahead in the same shared memory: dk/dv
# (32, 64, 4, 3/4) and (16, 64, 4, 4) against the default (64, 64, 4, 2), the default repeated.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
timeout 150 python3 benchmarks/sweep.py --pattern window=4096 --bwd-only --rep 100 \
  --dkdv "64,64,4,2;32,64,4,4;32,64,4,3;16,64,4,4;64,64,4,2;32,64,4,4" --dq "128,64,8,3" > "$OUT/sweep.log" 2>&1
echo "sweep exit $? after $(( $(date +%s) - start )) s" >> "$OUT/sweep.log"
echo "==== sweep"; grep -E "^bwd|kernel|exit" "$OUT/sweep.log" | cut -c1-170
echo "elapsed $(( $(date +%s) - start )) s"
