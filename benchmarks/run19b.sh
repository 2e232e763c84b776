#!/usr/bin/env bash
# Run 19b (2026-12-01, one H200): the dk/dv kernel's W band as one loop (bwd.py.jinja, SPLIT).
# The GPU tests, the tuner's timing test, then the new templates against the previous commit's
# in one process (variant_probe.py --templates; old_templates_run19 is a copy of 9ad8666's
# msa_codegen/templates, sent with the tree and not committed: recreate it with
# `mkdir old_templates_run19 && git archive 9ad8666 msa_codegen/templates | tar -x --strip-components=2 -C old_templates_run19`).
# Run 19c re-tunes.
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
SLOW=test_gpu_tuned_config_is_no_slower_than_the_default_and_attention_runs_it
t0=$(date +%s)
timeout 290 python3 -m pytest tests -m gpu -q -p no:cacheprovider -n 3 -k "not $SLOW" > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/pytest-gpu.log"
t0=$(date +%s)
timeout 90 python3 -m pytest tests -m gpu -q -p no:cacheprovider -k "$SLOW" > "$OUT/pytest-gpu-tuner.log" 2>&1
echo "pytest (tuner timing test) exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/pytest-gpu-tuner.log"
for c in "w4096 window=4096 131072 4 70" "bidir512 causal=false,window=512 65536 3 45" "sink64 window=4096,sink=64 131072 3 60"; do
  set -- $c
  left=$(( 570 - ($(date +%s) - start) ))
  [ "$left" -lt 30 ] && { echo "not run: $left s left" > "$OUT/vp-$1.log"; continue; }
  t0=$(date +%s)
  timeout $(( left < $5 ? left : $5 )) python3 benchmarks/variant_probe.py --pattern $2 --n $3 --rounds $4 --only "templates of" \
    --templates old_templates_run19 > "$OUT/vp-$1.log" 2>&1
  echo "variant_probe exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/vp-$1.log"
done
echo "==== pytest"; grep -h -E "passed|failed|exit" "$OUT"/pytest-gpu.log "$OUT"/pytest-gpu-tuner.log | tail -4
grep -h -E "^(FAILED|ERROR)" "$OUT"/pytest-gpu*.log | head -10 | cut -c1-250
for f in "$OUT"/vp-*.log; do echo "==== $(basename $f)"; grep -v -i warn "$f" | cut -c1-150; done
echo "elapsed $(( $(date +%s) - start )) s"
