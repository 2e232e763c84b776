#!/usr/bin/env bash
# Run 15b (2026-12-01): GPU tests on the descriptor-resident tiles and folded scale, then sweeps of
# the launch configs on the new kernels (window=4096 D=128 fwd/bwd, D=64 fwd/bwd, bidirectional 512).
set -u
OUT=${OUT:-/tmp/msa-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
S=benchmarks/sweep.py
start=$(date +%s)
timeout 250 python3 -m pytest tests -m gpu -q -p no:cacheprovider -n 3 -k 'not test_gpu_tuned_config' > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - start )) s" >> "$OUT/pytest-gpu.log"
run() { local t=$1 name=$2; shift 2; timeout "$t" python3 $S --rep 60 "$@" 2>&1 | grep -v -i warn > "$OUT/$name.log"; echo "$name exit $?" >> "$OUT/$name.log"; }
run 110 sweep-w4096-bwd --pattern window=4096 --bwd-only --dkdv '32,64,4,2;64,64,4,2;64,64,4,3;64,128,8,2;128,64,8,2' --dq '128,64,8,3;128,128,8,2'
run 60 sweep-w4096-fwd --pattern window=4096 --fwd-only --fwd '128,128,8,3;128,64,8,3;128,128,8,2'
run 60 sweep-d64-fwd --pattern window=4096 --heads 32 --head-dim 64 --fwd-only --fwd '128,64,8,2;64,64,4,4;128,64,4,3;128,128,4,3;128,128,8,2'
run 50 sweep-bidir-fwd --pattern causal=false,window=512 --n 65536 --fwd-only --fwd '128,128,8,3;128,64,8,3;64,64,4,3;128,64,4,3'
run 90 sweep-d64-bwd --pattern window=4096 --heads 32 --head-dim 64 --bwd-only --dkdv '32,64,4,3;64,64,4,2;64,64,4,3;64,128,8,2' --dq '128,64,8,2;128,128,8,2'
echo "==== pytest"; grep -E "passed|failed|exit" "$OUT/pytest-gpu.log" | tail -3; grep -E "^(FAILED|ERROR)" "$OUT/pytest-gpu.log" | head -10 | cut -c1-250
for f in "$OUT"/sweep-*.log; do echo "==== $(basename $f)"; grep -E "^(fwd|bwd) |kernel|exit" "$f" | sed -E 's/(Fwd|Bwd)Config//; s/block_|num_//g' | cut -c1-200; done
echo "elapsed $(( $(date +%s) - start )) s"
