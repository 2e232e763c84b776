#!/usr/bin/env bash
# Run 16a (2026-12-01): the run-16 templates (dk/dv two-pass head loop, one-test masked band
# blocks): the GPU tests, a same-process A/B against the templates of baca436 (extracted to
# .ab_old/ with `git archive baca436 msa_codegen/templates | tar -x -C .ab_old`), and a dk/dv
# config sweep on the new kernels. One device call.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
SLOW=test_gpu_tuned_config_is_no_slower_than_the_default_and_attention_runs_it
t0=$(date +%s)
timeout 260 python3 -m pytest tests -m gpu -q -p no:cacheprovider -n 3 -k "not $SLOW" > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/pytest-gpu.log"
OLD=.ab_old/msa_codegen/templates
for args in "--pattern window=4096" "--pattern window=4096 --heads 32 --head-dim 64" "--pattern window=4096,dilation=2"; do
  t0=$(date +%s)
  echo "== variant_probe $args" >> "$OUT/ab.log"
  timeout 100 python3 benchmarks/variant_probe.py $args --templates $OLD --only templates --rounds 2 >> "$OUT/ab.log" 2>&1
  echo "exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/ab.log"
done
t0=$(date +%s)
timeout 130 python3 benchmarks/sweep.py --pattern window=4096 --bwd-only --rep 100 \
  --dkdv "64,64,4,2;64,64,4,3;64,128,8,2;32,64,4,2;32,128,8,2;128,64,8,2;64,128,8,1;32,64,4,3" --dq "128,64,8,3" > "$OUT/sweep.log" 2>&1
echo "sweep exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/sweep.log"
echo "==== pytest"; grep -h -E "passed|failed|exit" "$OUT"/pytest-gpu*.log | tail -3; grep -h -E "^(FAILED|ERROR)" "$OUT"/pytest-gpu*.log | head -10 | cut -c1-250
echo "==== A/B"; grep -E "==|round|templates|exit|not applicable" "$OUT/ab.log" | cut -c1-160
echo "==== sweep"; grep -E "^bwd|kernel|exit" "$OUT/sweep.log" | cut -c1-170
echo "elapsed $(( $(date +%s) - start )) s"
