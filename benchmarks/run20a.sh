#!/usr/bin/env bash
# Run 20a (2026-12-01, one H200): the ceiling of the backward's loop structure in Triton 3.6
# (benchmarks/ceiling_probe.py: products only, with the element-wise work, K/V as register
# operands), next to our backward and its kernels, in one process.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 500 python3 benchmarks/ceiling_probe.py --rep 200 2>&1 | grep -v -i warn | tee "$OUT/ceiling.log"
echo "elapsed $(( $(date +%s) - start )) s"
