#!/usr/bin/env bash
# Run 20c (2026-12-01, one H200): warp specialisation again (ceiling_probe.py --set 20c), one
# process per kernel so that a faulting variant (20b: dk/dv WS) cannot take the others with it;
# DUP loads a tile that feeds two products twice (one wgmma per shared-memory buffer).
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python3 benchmarks/ceiling_probe.py --set 20c --kinds fwd --rep 200 2>&1 | grep -v -i warn | tee "$OUT/ceiling-fwd.log"
timeout 200 python3 benchmarks/ceiling_probe.py --set 20c --kinds dq --no-ours --rep 200 2>&1 | grep -v -i warn | grep -v "^  File\|^    " | tee "$OUT/ceiling-dq.log"
timeout 200 python3 benchmarks/ceiling_probe.py --set 20c --kinds dkdv --no-ours --rep 200 2>&1 | grep -v -i warn | grep -v "^  File\|^    " | tee "$OUT/ceiling-dkdv.log"
echo "elapsed $(( $(date +%s) - start )) s"
