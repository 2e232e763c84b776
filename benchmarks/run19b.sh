#!/usr/bin/env bash
# Run 19b (2026-12-01, two H200s): the dk/dv kernel's W band as one loop (bwd.py.jinja, SPLIT).
# GPU 0: the GPU tests, then the tuner's timing test. GPU 1: the new templates against the
# previous commit's in one process (variant_probe.py --templates; old_templates_run19 is a copy
# of 9ad8666's msa_codegen/templates, sent with the tree and not committed), then the shipped grid's
# three entries re-tuned into a copy of the shipped database (the edit orphans its rows).
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
SLOW=test_gpu_tuned_config_is_no_slower_than_the_default_and_attention_runs_it
(
  export CUDA_VISIBLE_DEVICES=0
  t0=$(date +%s)
  timeout 300 python3 -m pytest tests -m gpu -q -p no:cacheprovider -n 3 -k "not $SLOW" > "$OUT/pytest-gpu.log" 2>&1
  echo "pytest exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/pytest-gpu.log"
  t0=$(date +%s)
  timeout 120 python3 -m pytest tests -m gpu -q -p no:cacheprovider -k "$SLOW" > "$OUT/pytest-gpu-tuner.log" 2>&1
  echo "pytest (tuner timing test) exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/pytest-gpu-tuner.log"
) &
p0=$!
(
  export CUDA_VISIBLE_DEVICES=1
  for c in "w4096 window=4096 131072 4" "bidir512 causal=false,window=512 65536 3" "sink64 window=4096,sink=64 131072 3"; do
    set -- $c
    t0=$(date +%s)
    timeout 100 python3 benchmarks/variant_probe.py --pattern $2 --n $3 --rounds $4 --only "templates of" \
      --templates old_templates_run19 > "$OUT/vp-$1.log" 2>&1
    echo "variant_probe exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/vp-$1.log"
  done
  [ -f /tmp/grid.db ] || cp msa_codegen/data/tuning.db /tmp/grid.db
  b=$(( 500 - ($(date +%s) - start) ))
  timeout $(( b + 60 )) python3 -m msa_codegen.tuner.grid --db /tmp/grid.db --limit 3 --budget-s $b > "$OUT/grid.log" 2>&1
  echo "grid exit $?" >> "$OUT/grid.log"
  python3 -m msa_codegen.tuner.grid --db /tmp/grid.db --export "$OUT/tuning.db" >> "$OUT/grid.log" 2>&1
) &
p1=$!
wait $p0 $p1
echo "==== pytest"; grep -h -E "passed|failed|exit" "$OUT"/pytest-gpu.log "$OUT"/pytest-gpu-tuner.log | tail -4
grep -h -E "^(FAILED|ERROR)" "$OUT"/pytest-gpu*.log | head -10 | cut -c1-250
for f in "$OUT"/vp-*.log; do echo "==== $(basename $f)"; grep -v -i warn "$f" | cut -c1-150; done
echo "==== grid"; grep -E "x\)|finished|budget|exit|Error" "$OUT/grid.log" | cut -c1-230
echo "elapsed $(( $(date +%s) - start )) s"
