#!/usr/bin/env bash
# One GPU session's worth of tuning: the GPU tests on GPU 0 first (TESTS=1), then the shipped
# grid (msa_codegen.tuner.grid), one shard per GPU, all writing to one database; it resumes
# from msa_codegen/data/tuning.db (entries already there are skipped).
#
#   BUDGET=420 bash benchmarks/gpu_tune.sh        # then: cp $OUT/tuning.db msa_codegen/data/
#
# Grid processes stop starting entries after BUDGET seconds (from the start of this script) and
# are killed at HARD seconds; a killed entry loses only its unfinished direction (SQLite WAL).
set -u
OUT=${OUT:-/tmp/msa-out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-420}
HARD=${HARD:-560}
DB=${DB:-/tmp/msa-grid.db}
TESTS=${TESTS:-1}
EXTRA=${EXTRA:-}
export PYTHONUNBUFFERED=1
start=$(date +%s)
[ -f msa_codegen/data/tuning.db ] && [ ! -f "$DB" ] && cp msa_codegen/data/tuning.db "$DB"
NG=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
pids=()
for i in $(seq 0 $((NG - 1))); do
  (
    export CUDA_VISIBLE_DEVICES=$i
    if [ "$i" = 0 ] && [ "$TESTS" = 1 ]; then
      python3 -m pytest tests -m gpu -q -p no:cacheprovider $EXTRA > "$OUT/pytest-gpu.log" 2>&1
      echo "pytest exit $?" >> "$OUT/pytest-gpu.log"
    fi
    b=$(left)
    if [ "$b" -gt 30 ]; then
      timeout $(( HARD - ($(date +%s) - start) )) \
        python3 -m msa_codegen.tuner.grid --db "$DB" --shard "$i/$NG" --budget-s "$b" ${GRID_ARGS:-} > "$OUT/grid-$i.log" 2>&1
      echo "grid $i exit $?" >> "$OUT/grid-$i.log"
    else
      echo "grid $i not started: $b s of BUDGET left, more than 30 needed" > "$OUT/grid-$i.log"
    fi
  ) &
  pids+=($!)
done
wait "${pids[@]}"
python3 -m msa_codegen.tuner.grid --db "$DB" --export "$OUT/tuning.db"
echo "==== pytest (GPU 0)"; tail -3 "$OUT/pytest-gpu.log" 2>/dev/null
for i in $(seq 0 $((NG - 1))); do echo "==== grid $i"; grep -E "FAILED|finished|budget|nothing|not started" "$OUT/grid-$i.log"; done
echo "==== rows"; grep -h "x) " "$OUT"/grid-*.log | sed 's/^\[grid [0-9]\/[0-9]\] //' | cut -c1-200
echo "elapsed $(( $(date +%s) - start )) s"
