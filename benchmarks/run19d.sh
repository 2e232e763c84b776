#!/usr/bin/env bash
# Run 19d (2026-12-01, one H200): the dq kernel's W band as one loop (variant_probe.py's
# "dq one W loop"), on the kernels of 4f0de6f, more rounds than 19a (where it was inconclusive).
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for c in "w4096 window=4096 131072 16 128 6 90" "d64 window=4096 131072 32 64 5 90" "bidir512 causal=false,window=512 65536 16 128 5 60"; do
  set -- $c
  t0=$(date +%s)
  timeout $7 python3 benchmarks/variant_probe.py --only "dq one W loop" --pattern $2 --n $3 --heads $4 --head-dim $5 \
    --rounds $6 > "$OUT/vp-$1.log" 2>&1
  echo "variant_probe exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/vp-$1.log"
done
for f in "$OUT"/vp-*.log; do echo "==== $(basename $f)"; grep -v -i warn "$f" | cut -c1-150; done
echo "elapsed $(( $(date +%s) - start )) s"
