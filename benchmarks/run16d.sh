#!/usr/bin/env bash
# Run 16d (2026-12-01): the grid's third entry (window=4096,dilation=4), which run 16c meant to
# tune but did not start (its BUDGET=20 was under gpu_tune.sh's 30 s floor), into the database
# of run 16b; then the forward probe with host-built descriptors (kernel_probe.py --only fwd).
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
rm -f /tmp/grid16d.db; cp msa_codegen/data/tuning.db /tmp/grid16d.db
DB=/tmp/grid16d.db TESTS=0 BUDGET=45 HARD=150 bash benchmarks/gpu_tune.sh > "$OUT/tune.log" 2>&1
t0=$(date +%s)
timeout 150 python3 benchmarks/kernel_probe.py --only fwd --rep 200 > "$OUT/probe.log" 2>&1
echo "probe exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/probe.log"
echo "==== tune"; grep -E "x\)|finished|budget|FAILED|exit|exported" "$OUT/tune.log" | sed 's/^\[grid [0-9]\/[0-9]\] //' | cut -c1-230
echo "==== probe"; grep -v -i warn "$OUT/probe.log" | cut -c1-160 | tail -12
echo "elapsed $(( $(date +%s) - start )) s"
