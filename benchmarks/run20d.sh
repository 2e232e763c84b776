#!/usr/bin/env bash
# Run 20d (2026-12-01, one H200): warp specialisation with descriptors built on the host
# (ceiling_probe.py --set 20d), one process per kernel (a faulting variant ends its process).
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python3 benchmarks/ceiling_probe.py --set 20d --kinds fwd --no-ours --rep 200 2>&1 | grep -v -i warn | tee "$OUT/ceiling-fwd.log"
timeout 200 python3 benchmarks/ceiling_probe.py --set 20d --kinds dq --no-ours --rep 200 2>&1 | grep -v -i warn | grep -v "^  File\|^    " | tee "$OUT/ceiling-dq.log"
timeout 200 python3 benchmarks/ceiling_probe.py --set 20d --kinds dkdv --no-ours --rep 200 2>&1 | grep -v -i warn | grep -v "^  File\|^    " | tee "$OUT/ceiling-dkdv.log"
echo "elapsed $(( $(date +%s) - start )) s"
