#!/usr/bin/env bash
# Run 16e (2026-12-01): hardware counters of our three window=4096 kernels (Nsight Compute, the
# first time in this project), then the forward probe's 128 x 64 variants (kernel_probe.py --n64).
# Leads for the next session; changes nothing.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis"
timeout 200 $NCU --clock-control none --kernel-name regex:'msa_(fwd|bwd_dq|bwd_dkdv)' --launch-count 3 $SECTIONS \
  -o "$OUT/ncu-w4096" python3 benchmarks/ncu_case.py > "$OUT/ncu-run.log" 2>&1
echo "ncu exit $? after $(( $(date +%s) - start )) s" >> "$OUT/ncu-run.log"
[ -f "$OUT/ncu-w4096.ncu-rep" ] && $NCU --import "$OUT/ncu-w4096.ncu-rep" --page details > "$OUT/ncu-w4096.txt" 2>&1
[ -f "$OUT/ncu-w4096.ncu-rep" ] && $NCU --import "$OUT/ncu-w4096.ncu-rep" --page raw --csv > "$OUT/ncu-w4096-raw.csv" 2>&1
t0=$(date +%s)
timeout 120 python3 benchmarks/kernel_probe.py --only fwd --n64 --rep 200 > "$OUT/probe.log" 2>&1
echo "probe exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/probe.log"
echo "==== ncu"; tail -3 "$OUT/ncu-run.log"; grep -E "msa_|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc Active|No Eligible|Issued Warp|Stall|Tensor|Memory Throughput" "$OUT/ncu-w4096.txt" 2>/dev/null | cut -c1-150 | head -60
echo "==== probe"; grep -v -i warn "$OUT/probe.log" | cut -c1-160 | tail -12
echo "elapsed $(( $(date +%s) - start )) s"
