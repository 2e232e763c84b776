#!/usr/bin/env bash
# Run 18f (2026-12-01): the dS store before or after the dk product's issue, in one process,
# on the scratch path (MSA_BWD_SCRATCH_BYTES set), for the three cases 18a and 18e disagree on.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
export MSA_BWD_SCRATCH_BYTES=$((16 << 30))
for c in "window=4096 131072" "window=4096,dilation=2 131072" "causal=false,window=512 65536"; do
  set -- $c
  timeout 75 python3 benchmarks/variant_probe.py --pattern $1 --n $2 --rounds 2 --only "before the dk" 2>&1 | grep -v -i warn
done
