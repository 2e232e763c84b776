#!/usr/bin/env bash
# Run 17h (2026-12-01): which dk/dv configs with 16-row query blocks fault (run 17g: (16, 64, 4, 4)
# "misaligned address" on the LSE2 kernels), one process each; D=256's default (16, 32, 4, 1) too.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
run() { timeout 40 python3 benchmarks/sweep.py --pattern window=4096 --bwd-only --rep 30 --no-profile "$@" 2>&1 | grep -E "^bwd" | cut -c1-200; }
run --n 16384 --dkdv "16,64,4,1" --dq "128,64,8,3"
run --n 16384 --dkdv "16,64,4,2" --dq "128,64,8,3"
run --n 16384 --dkdv "16,128,8,2" --dq "128,64,8,3"
run --n 16384 --dkdv "32,64,4,2" --dq "128,64,8,3"
run --n 16384 --head-dim 256 --dkdv "16,32,4,1" --dq "32,32,4,1"
echo "elapsed $(( $(date +%s) - start )) s"
