#!/usr/bin/env bash
# Run 16f (2026-12-01): the dk/dv kernel's unmasked LSE/delta loads through 1-D descriptors, a
# same-process A/B (variant_probe.py), after ncu (run 16e) showed long-scoreboard stalls there.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
for args in "--pattern window=4096" "--pattern window=4096 --heads 32 --head-dim 64"; do
  t0=$(date +%s)
  echo "== variant_probe $args" >> "$OUT/ab.log"
  timeout 100 python3 benchmarks/variant_probe.py $args --only "LSE/delta" --rounds 3 >> "$OUT/ab.log" 2>&1
  echo "exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/ab.log"
done
grep -E "==|round|LSE|exit|not applicable|failed" "$OUT/ab.log" | cut -c1-160
echo "elapsed $(( $(date +%s) - start )) s"
