#!/usr/bin/env bash
# Run 18c (2026-12-01): the dS store moved after the dk product's issue; the scratch path
# against recomputation on four cases (ds_probe.py), what the stores still cost
# (variant_probe.py), head dim 256's new default on both paths. One device call.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
t0=$(date +%s)
timeout 200 python3 benchmarks/ds_probe.py --cases w4096+sink64+gqa+d64 --rounds 2 --rep 150 --profile > "$OUT/ds-probe.log" 2>&1
echo "ds_probe exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/ds-probe.log"
t0=$(date +%s)
timeout 100 python3 benchmarks/variant_probe.py --rounds 1 --only "dS stores all,no dS stores" > "$OUT/variant-probe.log" 2>&1
echo "variant_probe exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/variant-probe.log"
for mode in scratch recompute; do
  t0=$(date +%s)
  if [ $mode = recompute ]; then export MSA_BWD_SCRATCH_BYTES=0; fi
  timeout 60 python3 benchmarks/sweep.py --pattern window=4096 --n 16384 --heads 16 --head-dim 256 --bwd-only --rep 100 --no-profile \
    --dkdv "32,64,8,2" --dq "128,32,8,2" > "$OUT/sweep-d256-$mode.log" 2>&1
  echo "sweep exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/sweep-d256-$mode.log"
done
unset MSA_BWD_SCRATCH_BYTES
echo "==== ds probe"; grep -v -i warn "$OUT/ds-probe.log" | grep -E "round|profile|on vs off|peak|^[a-z0-9]+ +[0-9]|case|exit" | cut -c1-150
echo "==== variants"; grep -v -i warn "$OUT/variant-probe.log" | cut -c1-160
echo "==== d256"; grep -H -E "^bwd|exit|Error" "$OUT"/sweep-d256-*.log | cut -c1-190
echo "elapsed $(( $(date +%s) - start )) s"
