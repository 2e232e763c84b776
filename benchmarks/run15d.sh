#!/usr/bin/env bash
# Run 15d (2026-12-01): same-process A/B of template edits (benchmarks/variant_probe.py) at
# window=4096 D=128 and D=64, and a forward config sweep on the current template.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
timeout 200 python3 benchmarks/variant_probe.py --rep 120 --rounds 2 2>&1 | grep -v -i warn > "$OUT/variants-d128.log"; echo "exit $?" >> "$OUT/variants-d128.log"
timeout 100 python3 benchmarks/variant_probe.py --rep 100 --rounds 1 --heads 32 --head-dim 64 --only "fwd:" 2>&1 | grep -v -i warn > "$OUT/variants-d64.log"; echo "exit $?" >> "$OUT/variants-d64.log"
timeout 70 python3 benchmarks/sweep.py --rep 80 --pattern window=4096 --fwd-only --fwd '128,128,8,3;64,64,4,3;64,128,4,3;128,64,8,3' 2>&1 | grep -v -i warn > "$OUT/sweep-fwd.log"
cat "$OUT/variants-d128.log" "$OUT/variants-d64.log"; grep "^fwd" "$OUT/sweep-fwd.log" | sed -E 's/FwdConfig//; s/block_|num_//g'
echo "elapsed $(( $(date +%s) - start )) s"
