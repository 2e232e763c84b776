#!/usr/bin/env bash
# Does this Triton's warp specialisation work for our loops? (GPU; issue 4, NOTES.md run 20)
#   bash benchmarks/ws_check.sh     # a few minutes; about 9 if every process hangs to its timeout
# Runs ceiling_probe.py's warp-specialised variants (sets 20c: in-kernel descriptors, and 20d:
# host-built descriptors), one process per kernel and set under a timeout, because on Triton 3.6
# they computed wrong sums, faulted (which ends a process) or hung. Each WS variant is checked
# against the same kernel without WS; a row with a time and "(vs no WS ...)" passed.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for set in 20c 20d; do
  for kind in fwd dq dkdv; do
    echo "==== set $set, $kind"
    timeout 90 python3 benchmarks/ceiling_probe.py --set "$set" --kinds "$kind" --no-ours --rep 100 2>&1 \
      | grep --line-buffered -E "^(fwd|dq|dkdv) |torch.mm" | tee -a "$OUT/ws-check.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && echo "  (timed out after 90 s: a variant hung)" | tee -a "$OUT/ws-check.log"
  done
done
