#!/usr/bin/env bash
# Run 18a (2026-12-01): the backward that passes the window band's dS from the dk/dv kernel to
# the dq kernel through scratch, against dq recomputing it (ds_probe.py, every issue-4 window
# case), and head dim 256's backward configs (NOTES run 17 item 12). One device call.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
t0=$(date +%s)
timeout 200 python3 benchmarks/ds_probe.py --cases w4096 --rounds 3 --rep 150 --dq-variants --profile > "$OUT/ds-probe-w4096.log" 2>&1
echo "ds_probe exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/ds-probe-w4096.log"
t0=$(date +%s)
timeout 220 python3 benchmarks/ds_probe.py --cases dil2+sink64+bidir512+gqa+d64 --rounds 2 --rep 150 > "$OUT/ds-probe-rest.log" 2>&1
echo "ds_probe exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/ds-probe-rest.log"
t0=$(date +%s)
timeout 80 python3 benchmarks/sweep.py --pattern window=4096 --n 16384 --heads 16 --head-dim 256 --bwd-only --rep 100 --no-profile \
  --dkdv "16,32,4,1;16,64,8,2;32,64,8,2" --dq "32,32,4,1" > "$OUT/sweep-d256-scratch.log" 2>&1
echo "sweep exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/sweep-d256-scratch.log"
t0=$(date +%s)
MSA_BWD_SCRATCH_BYTES=0 timeout 80 python3 benchmarks/sweep.py --pattern window=4096 --n 16384 --heads 16 --head-dim 256 --bwd-only --rep 100 --no-profile \
  --dkdv "16,64,8,2" --dq "32,32,4,1;64,32,4,2;64,32,8,2;128,32,8,2" > "$OUT/sweep-d256-recompute.log" 2>&1
echo "sweep exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/sweep-d256-recompute.log"
echo "==== ds probe"; grep -v -i warn "$OUT"/ds-probe-w4096.log "$OUT"/ds-probe-rest.log | cut -c1-200 | tail -60
echo "==== d256"; grep -h -E "^bwd|exit|Error" "$OUT"/sweep-d256-*.log | cut -c1-170
echo "elapsed $(( $(date +%s) - start )) s"
