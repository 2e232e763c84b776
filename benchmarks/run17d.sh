#!/usr/bin/env bash
# Run 17d (2026-12-01): one 2-D descriptor for delta and LSE2 in dk/dv's unmasked blocks (one TMA
# issue and one CTA barrier fewer a block; variant_probe.py text edit), timed against the
# unedited kernels in one process. A lead for the next session; changes nothing.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
for args in "--pattern window=4096 --rounds 3" "--pattern window=4096 --heads 32 --head-dim 64 --rounds 2" "--pattern window=4096,sink=64 --rounds 2"; do
  t0=$(date +%s)
  echo "== variant_probe $args" >> "$OUT/probe.log"
  timeout 100 python3 benchmarks/variant_probe.py $args --only "one 2-D" >> "$OUT/probe.log" 2>&1
  echo "exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/probe.log"
done
echo "==== probe"; grep -E "==|round|2-D|exit|applicable" "$OUT/probe.log" | cut -c1-160
echo "elapsed $(( $(date +%s) - start )) s"
