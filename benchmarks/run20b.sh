#!/usr/bin/env bash
# Run 20b (2026-12-01, one H200): warp specialisation in Triton 3.6 (4 warps: a producer and two
# consumer warpgroups) on the probe's forward, dk/dv and dq loops, each checked against the same
# kernel without it and timed next to the non-WS probe and our kernels (ceiling_probe.py --set 20b).
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 500 python3 benchmarks/ceiling_probe.py --set 20b --rep 200 2>&1 | grep -v -i warn | tee "$OUT/ceiling.log"
echo "elapsed $(( $(date +%s) - start )) s"
