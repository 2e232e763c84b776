#!/usr/bin/env bash
# Run 19a (2026-12-01): one W-band loop instead of three (lower edge, band, diagonal) in the
# forward, dq and dk/dv kernels, A/B in one process (variant_probe.py), on the issue-4 cases.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
run() {  # log name, timeout, args
  local name=$1 t=$2; shift 2
  local t0=$(date +%s)
  timeout "$t" python3 benchmarks/variant_probe.py --only "one W loop" "$@" > "$OUT/$name.log" 2>&1
  echo "variant_probe exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/$name.log"
}
run vp-w4096 200 --pattern window=4096 --rounds 4
run vp-sink64 100 --pattern window=4096,sink=64 --rounds 3
run vp-bidir512 90 --pattern causal=false,window=512 --n 65536 --rounds 3
run vp-d64 110 --pattern window=4096 --heads 32 --head-dim 64 --rounds 3
for f in "$OUT"/vp-*.log; do echo "==== $(basename $f)"; grep -v -i warn "$f" | cut -c1-150; done
echo "elapsed $(( $(date +%s) - start )) s"
