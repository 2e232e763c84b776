#!/usr/bin/env bash
# Rerun a measurement on a GPU machine, from the repository root:
#
#   bash benchmarks/run.sh SUITE [ARGS...]      # ARGS go to the suite's command
#
# Suites:
#   bench      msa-bench: every case against FlexAttention / SDPA flash (BENCHMARKS.md's table);
#              appends to benchmarks/results.csv. ARGS e.g. --cases w4096,w4096-d2
#   dynamic    the run-time sparsity rows (python -m msa_codegen.bench_dynamic), same CSV
#   msa        the MSA rows (python -m msa_codegen.bench_msa): msa_attention against dense causal
#              SDPA flash and FlexAttention on the same attention, with a per-phase breakdown
#   gpu-tests  pytest -m gpu (WORKERS processes when pytest-xdist is there), then the tuner's
#              timing-sensitive test alone, so that it does not share the GPU; ARGS go to both
#              pytest commands (a -k of your own replaces the split). SHARD=K/N runs every N-th
#              test from the K-th (the tuner's in part N): on an 80 GB card, WORKERS=2 and
#              SHARD=1/2, 2/2 in two calls (three workers ran float64 references out of memory,
#              two did not finish the suite in one 560 s call, 2026-12-05)
#   tune       the shipped tuning grid (msa_codegen.tuner.grid), one shard per GPU, resumed from
#              msa_codegen/data/tuning.db; rows exported to $OUT/tuning.db (copy it into
#              msa_codegen/data/ to ship it), then the grid's --list of $DB for this GPU (what is
#              filled). BUDGET / HARD: seconds to stop starting entries / kill
#   compare    every filled grid entry of the shipped database (or DB): tuned against the heuristic
#              default in the same interleaved rounds (msa_codegen.tuner.grid --compare); ARGS e.g.
#              --rounds 7
#   host       benchmarks/host_probe.py: where a short call's host time goes (direct launches on /
#              off, Triton's launch stubbed out, each kernel's launch three ways); ARGS e.g.
#              --case hash8-8k, or --case docs-w4096-8k --families triton,gluon (host against
#              kernel time per family first)
#   ceiling    benchmarks/ceiling_probe.py: the floors of the backward's loop structure next to our
#              kernels (docs/performance.md); ARGS e.g. --kinds dkdv,dq
#   select     benchmarks/select_probe.py: select_blocks' selection kernel in its launch variants
#              (rows / candidates per step, warps, sort-and-merge against insertion) at 128k and 1M
#   ws-check   does this Triton's warp specialisation work on those loops? (ceiling_probe.py's
#              sets ws-dup / ws-host, one process per kernel under a 90 s timeout: they can
#              fault or hang)
#   sweep      benchmarks/sweep.py: launch configurations of one case, forward and backward;
#              ARGS e.g. --pattern window=4096 --heads 32 --head-dim 64 --fwd-only
#   gluon      the Gluon family (kernels/gluon.py, issue 22), under 5 minutes: stage 1 its GPU
#              tests (pytest tests/kernels/test_gluon.py tests/kernels/test_gluon_bwd.py -m gpu,
#              limit T1=180 s), stage 2 benchmarks/gluon_bench.py (w4096, bidir-w512, w4096-s64:
#              forward and forward + backward with MSA_CODEGEN_GLUON unset and set, the Gluon
#              backward where eligible, one process; limit T2=80 s; rows to
#              $OUT/gluon_bench.jsonl as they finish), then a summary: each stage's exit status and
#              the timing table. ARGS go to pytest
#   hash-floor  benchmarks/hash_blocks.py --time: the Hash-sparse floor probe (our call and
#              FlexAttention against dense causal over equal packed documents on both kernel
#              families, with each forward+backward's kernel time); ARGS e.g. --n 8192
#   gluon-ab   benchmarks/gluon_ab.py: variants of the Gluon forward's template (files) against
#              the tree's, one process; ARGS e.g. --variant old=/tmp/old.jinja --cases 0,1
#              (--direction bwd: the backward's template, fused forms beside the two kernels)
#   msa-ab     benchmarks/msa_ab.py: MsaConfig variants of the MSA kernels' launches against the
#              default and a copy of it, phase by phase (main forward, main backward, teaching
#              backward, both backwards in one launch), one process; ARGS e.g. --variant two=fwd_rows=64,fwd_warps=4,fwd_stages=1;
#              --reverse-index: the reverse index's sort keys at 64 against 32 bits instead
#   sink-ab    benchmarks/sink_ab.py: the Gluon backward's sink pass alone in launch variants (rows x
#              stages, another copy of kernels/sink.py) against the tree's, one process; ARGS e.g.
#              --variant 32x3 --baseline /tmp/sink_old.py (git show REV:msa_codegen/kernels/sink.py), or
#              --pattern window=4096,sink=256 --forms fused --flip-chunk-launches (gluon.SINK_CHUNK_LAUNCHES)
#   fused-ab   benchmarks/fused_ab.py: the Gluon family's fused backward against its two-kernel
#              backward through attention(deterministic=False / True), one process, and for
#              msa-bench's plain cases the Triton family's too; ARGS e.g.
#              docs-w4096,topk16-gqa,gqa-w4096,enc-w256-4k
#   cross-triton  benchmarks/cross_triton.py run: the Triton family's kernels as another Triton
#              compiled them (``python benchmarks/cross_triton.py emit --out DIR`` in that Triton's
#              virtual environment, no GPU; DIR carried here) against this Triton's, kernel time on
#              the launches of one call per msa-bench case; ARGS e.g. --from .xt38. A DIR emitted
#              with --family gluon holds the Gluon forward of w4096 and dense-causal instead
#   power      benchmarks/power_probe.py: our forward against the card's own bf16 matrix rate in
#              alternating rounds, the SM clock and board power read through NVML every ~5 ms
#              inside each timing (a card at its power limit); ARGS e.g. --cases w4096 --rounds 5
#   gluon-orders  benchmarks/gluon_orders.py: the Gluon forward's tile orders (head-major, by
#              cost, pairs, listed) against the Triton forward, dense patterns and windows, one
#              process; ARGS e.g. --cases 0,7
#
# Set-up shared by every suite: the repository on PYTHONPATH (no install needed), and the wheels
# carried in .whl/ (the GPU image lacks optuna and sqlalchemy; see the device tool's wheels.sh)
# installed into /tmp/site when that folder exists. Logs go to $OUT/SUITE.log (OUT defaults to
# /tmp/msa-out); bench and dynamic also copy the updated results.csv there. TIMEOUT=S bounds the
# suite's command (0: none).
set -u
suite=${1:-}
[ $# -gt 0 ] && shift
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/msa-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit 1
fi
TIMEOUT=${TIMEOUT:-0}
limit() { if [ "$TIMEOUT" -gt 0 ]; then timeout "$TIMEOUT" "$@"; else "$@"; fi; }
sources_hash() {   # sha1 of msa_codegen's .py / .jinja files, in path order
  find msa_codegen \( -name '*.py' -o -name '*.jinja' \) -print | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12
}
header() {
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  # the commit can be stale where the tree was copied without its .git (a device machine's copy
  # keeps the session's first one): the sources' hash names the code that ran
  # (the same command on the machine the tree came from gives the same hash)
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown) (may be stale)," \
       "sources $(sources_hash), $(date -u '+%Y-%m-%d %H:%M UTC')"
}
log="$OUT/${suite:-none}.log"
start=$(date +%s)

case "$suite" in
  bench)
    { header; limit python3 -m msa_codegen.bench --reps-ms 150 "$@"; } 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    cp benchmarks/results.csv "$OUT/results.csv" ;;
  dynamic)
    { header; limit python3 -m msa_codegen.bench_dynamic --reps-ms 100 "$@"; } 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    cp benchmarks/results.csv "$OUT/results.csv" ;;
  msa)
    { header; limit python3 -m msa_codegen.bench_msa --reps-ms 200 "$@"; } 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    cp benchmarks/results.csv "$OUT/results.csv" ;;
  gpu-tests)
    SLOW=test_gpu_tuned_config_is_no_slower_than_the_default_and_attention_runs_it
    par=""
    python3 -c "import xdist" 2>/dev/null && par="-n ${WORKERS:-3}"   # 4 workers ran out of GPU memory
    # SHARD=K/N: the K-th of N parts (every N-th collected test, from the K-th), so that a
    # suite longer than one device call runs in N calls; the tuner's test runs in part N
    sel=(tests)
    run_slow=1
    if [ -n "${SHARD:-}" ]; then
      k=${SHARD%/*}; n=${SHARD#*/}
      mapfile -t sel < <(python3 -m pytest tests -m gpu -q --collect-only -p no:cacheprovider -k "not $SLOW" "$@" \
                         2>/dev/null | grep '::' | awk -v k="$k" -v n="$n" 'NR % n == k % n')
      [ "$k" = "$n" ] || run_slow=0
      [ ${#sel[@]} -gt 0 ] || { echo "run.sh: SHARD=$SHARD selects no test" >&2; exit 2; }
    fi
    {
      header
      [ -n "${SHARD:-}" ] && echo "shard $SHARD: ${#sel[@]} tests"
      limit python3 -m pytest "${sel[@]}" -m gpu -q -p no:cacheprovider $par -k "not $SLOW" "$@"; r1=$?
      r2=0
      if [ $run_slow = 1 ]; then
        limit python3 -m pytest tests -m gpu -q -p no:cacheprovider -k "$SLOW" "$@"; r2=$?
      fi
      exit $(( r1 || r2 ))
    } 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]} ;;
  tune)
    BUDGET=${BUDGET:-420}; HARD=${HARD:-560}; DB=${DB:-/tmp/msa-grid.db}
    [ -f msa_codegen/data/tuning.db ] && [ ! -f "$DB" ] && cp msa_codegen/data/tuning.db "$DB"
    NG=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    header | tee "$log"
    pids=()
    for i in $(seq 0 $((NG - 1))); do
      left=$(( BUDGET - ($(date +%s) - start) ))
      CUDA_VISIBLE_DEVICES=$i timeout $(( HARD - ($(date +%s) - start) )) \
        python3 -m msa_codegen.tuner.grid --db "$DB" --shard "$i/$NG" --budget-s "$left" "$@" > "$OUT/grid-$i.log" 2>&1 &
      pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    python3 -m msa_codegen.tuner.grid --db "$DB" --export "$OUT/tuning.db" 2>&1 | tee -a "$log"
    python3 -m msa_codegen.tuner.grid --list --db "$DB" \
      --gpu "$(python3 -c 'import torch; print(torch.cuda.get_device_name())')" 2>&1 | tee -a "$log"
    for i in $(seq 0 $((NG - 1))); do
      echo "==== grid $i" | tee -a "$log"
      grep -E "FAILED|finished|budget|nothing|x\) " "$OUT/grid-$i.log" | cut -c1-200 | tee -a "$log"
    done ;;
  compare)
    { header; limit python3 -m msa_codegen.tuner.grid --compare ${DB:+--db "$DB"} "$@"; } 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]} ;;
  host)
    { header; limit python3 benchmarks/host_probe.py "$@"; } 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]} ;;
  ceiling)
    { header; limit python3 benchmarks/ceiling_probe.py --rep 200 "$@"; } 2>&1 | grep -v -i warn | tee "$log"
    rc=${PIPESTATUS[0]} ;;
  select)
    { header; limit python3 benchmarks/select_probe.py "$@"; } 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]} ;;
  ws-check)
    header | tee "$log"
    rc=0
    for set in ws-dup ws-host; do
      for kind in fwd dq dkdv; do
        echo "==== set $set, $kind" | tee -a "$log"
        timeout 90 python3 benchmarks/ceiling_probe.py --set "$set" --kinds "$kind" --no-ours --rep 100 "$@" 2>&1 \
          | grep --line-buffered -E "^(fwd|dq|dkdv) |torch.mm" | tee -a "$log"
        r=${PIPESTATUS[0]}
        [ "$r" = 124 ] && echo "  (timed out after 90 s: a variant hung)" | tee -a "$log"
        [ "$r" != 0 ] && rc=$r
      done
    done ;;
  sweep)
    { header; limit python3 benchmarks/sweep.py "$@"; } 2>&1 | grep -v -i warn | tee "$log"
    rc=${PIPESTATUS[0]} ;;
  hash-floor)
    { header; limit python3 benchmarks/hash_blocks.py --time "$@"; } 2>&1 | grep -v -i warn | tee "$log"
    rc=${PIPESTATUS[0]} ;;
  gluon-ab)
    { header; limit python3 benchmarks/gluon_ab.py "$@"; } 2>&1 | grep -v -i warn | tee "$log"
    rc=${PIPESTATUS[0]} ;;
  msa-ab)
    { header; limit python3 benchmarks/msa_ab.py "$@"; } 2>&1 | grep -v -i warn | tee "$log"
    rc=${PIPESTATUS[0]} ;;
  sink-ab)
    { header; limit python3 benchmarks/sink_ab.py "$@"; } 2>&1 | grep -v -i warn | tee "$log"
    rc=${PIPESTATUS[0]} ;;
  fused-ab)
    { header; limit python3 benchmarks/fused_ab.py "$@"; } 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]} ;;
  gluon-orders)
    { header; limit python3 benchmarks/gluon_orders.py "$@"; } 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]} ;;
  power)
    { header; limit python3 benchmarks/power_probe.py "$@"; } 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]} ;;
  cross-triton)
    { header; limit python3 benchmarks/cross_triton.py run "$@"; } 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]} ;;
  gluon)
    T1=${T1:-180}; T2=${T2:-80}
    par=""
    python3 -c "import xdist" 2>/dev/null && par="-n ${WORKERS:-3}"
    rm -f "$OUT/gluon_bench.jsonl"
    {
      header
      echo "==== stage 1: GPU tests of the Gluon family (limit $T1 s)"
      # faulthandler_timeout: a test past 60 s (a hung kernel) prints its traceback before T1 ends it
      timeout "$T1" python3 -m pytest tests/kernels/test_gluon.py tests/kernels/test_gluon_bwd.py -m gpu -v --tb=short \
        -p no:cacheprovider -o faulthandler_timeout=60 -rfEs $par "$@"; r1=$?
      [ "$r1" = 124 ] && echo "stage 1 TIMED OUT after $T1 s (the lines above say which tests finished)"
      echo "==== stage 2: Gluon against Triton, one process (limit $T2 s)"
      timeout "$T2" python3 benchmarks/gluon_bench.py --out "$OUT/gluon_bench.jsonl" --watchdog $((T2 - 5)); r2=$?
      [ "$r2" = 124 ] && echo "stage 2 TIMED OUT after $T2 s (rows below are the cases that finished)"
      echo "==== summary: stage 1 (tests) exit $r1, stage 2 (timing) exit $r2 (124: timed out)"
      if [ -s "$OUT/gluon_bench.jsonl" ]; then
        timeout 60 python3 benchmarks/gluon_bench.py --table "$OUT/gluon_bench.jsonl"
      else
        echo "(no timing rows)"
      fi
      exit $(( r1 || r2 ))
    } 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]} ;;
  *)
    sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2 ;;
esac
echo "$suite: exit $rc after $(( $(date +%s) - start )) s; log $log" | tee -a "$log"
exit "$rc"
