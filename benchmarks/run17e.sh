#!/usr/bin/env bash
# Run 17e (2026-12-01): where the forward and dk/dv loops stall, per SASS instruction (Nsight
# Compute's SourceCounters: warp-state samples by program counter), window=4096, N=32768. A lead
# for the next session; changes nothing.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
$NCU --version | tail -1
timeout 200 $NCU --clock-control none --kernel-name regex:'msa_(fwd|bwd_dkdv)' --launch-count 2 \
  --section SourceCounters --section WarpStateStats --import-source no \
  -o "$OUT/ncu-src" python3 benchmarks/ncu_case.py > "$OUT/ncu-run.log" 2>&1
echo "ncu exit $? after $(( $(date +%s) - start )) s" >> "$OUT/ncu-run.log"
if [ -f "$OUT/ncu-src.ncu-rep" ]; then
  $NCU --import "$OUT/ncu-src.ncu-rep" --page details > "$OUT/ncu-src-details.txt" 2>&1
  $NCU --import "$OUT/ncu-src.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu-src-sass.csv" 2> "$OUT/ncu-src-sass.err"
  echo "source page exit $?" >> "$OUT/ncu-run.log"
fi
echo "==== ncu"; tail -4 "$OUT/ncu-run.log"; head -c 600 "$OUT/ncu-src-sass.err" 2>/dev/null
ls -la "$OUT"
echo "elapsed $(( $(date +%s) - start )) s"
