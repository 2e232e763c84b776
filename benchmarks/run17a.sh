#!/usr/bin/env bash
# Run 17a (2026-12-01): the LSE2 templates (0198cb7 re-applied): the GPU tests, the device
# timeline of the forward under do_bench's flush (gap_trace.py: why do_bench exceeds the kernels
# by 0.4 ms), a dk/dv config sweep on the new kernels and Nsight Compute's view of the new dk/dv
# kernel (as in run 16e). One device call.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
SLOW=test_gpu_tuned_config_is_no_slower_than_the_default_and_attention_runs_it
t0=$(date +%s)
timeout 270 python3 -m pytest tests -m gpu -q -p no:cacheprovider -n 3 -k "not $SLOW" > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/pytest-gpu.log"
t0=$(date +%s)
timeout 100 python3 benchmarks/gap_trace.py > "$OUT/gap-trace.log" 2>&1
echo "gap_trace exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/gap-trace.log"
t0=$(date +%s)
timeout 120 python3 benchmarks/sweep.py --pattern window=4096 --bwd-only --rep 100 \
  --dkdv "64,64,4,2;64,128,8,2;64,64,4,3;32,64,4,2;64,128,8,3" --dq "128,64,8,3" > "$OUT/sweep.log" 2>&1
echo "sweep exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/sweep.log"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis"
t0=$(date +%s)
timeout 120 $NCU --clock-control none --kernel-name regex:'msa_bwd_dkdv' --launch-count 1 $SECTIONS \
  -o "$OUT/ncu-dkdv" python3 benchmarks/ncu_case.py > "$OUT/ncu-run.log" 2>&1
echo "ncu exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/ncu-run.log"
[ -f "$OUT/ncu-dkdv.ncu-rep" ] && $NCU --import "$OUT/ncu-dkdv.ncu-rep" --page details > "$OUT/ncu-dkdv.txt" 2>&1
[ -f "$OUT/ncu-dkdv.ncu-rep" ] && $NCU --import "$OUT/ncu-dkdv.ncu-rep" --page raw --csv > "$OUT/ncu-dkdv-raw.csv" 2>&1
echo "==== pytest"; grep -h -E "passed|failed|exit" "$OUT"/pytest-gpu.log | tail -3; grep -h -E "^(FAILED|ERROR)" "$OUT"/pytest-gpu.log | head -10 | cut -c1-250
echo "==== gap trace"; grep -v -i warn "$OUT/gap-trace.log" | grep -E "^(ours|flex| )|exit" | cut -c1-200
echo "==== sweep"; grep -E "^bwd|kernel|exit" "$OUT/sweep.log" | cut -c1-170
echo "==== ncu"; tail -2 "$OUT/ncu-run.log"; grep -E "Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Issued Warp|Registers Per|Achieved Occ" "$OUT/ncu-dkdv.txt" 2>/dev/null | cut -c1-150 | head -20
echo "elapsed $(( $(date +%s) - start )) s"
