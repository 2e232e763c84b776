#!/usr/bin/env bash
# Run 17g (2026-12-01): run 17f's sweep died on "CUDA misaligned address" (a sticky error, so the
# rows were lost); each of its dk/dv configs again, one process each, to find which one faults.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
for c in "32,64,4,4" "16,64,4,4" "32,64,4,3" "64,64,4,2"; do
  t0=$(date +%s)
  timeout 45 python3 benchmarks/sweep.py --pattern window=4096 --bwd-only --rep 100 --no-profile \
    --dkdv "$c" --dq "128,64,8,3" > "$OUT/sweep-$c.log" 2>&1
  echo "$c exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/sweep-$c.log"
done
echo "==== sweep"; grep -h -E "^bwd|exit|Error" "$OUT"/sweep-*.log | cut -c1-170
echo "elapsed $(( $(date +%s) - start )) s"
