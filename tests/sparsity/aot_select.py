"""Compile select_blocks' kernels for an sm_90 GPU without a GPU, with the launchers' own parameters.

Run as a script in a process without TRITON_INTERPRET (``python tests/sparsity/aot_select.py``).
The interpreter accepts what the GPU compiler rejects and knows no register or shared-memory
limit; this checks both for the head dims and K the launchers size differently. One line per
kernel; exits non-zero on the first failure.
"""
import os
import sys

from msa_codegen.sparsity import selection

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "msa"))
# benchmarks/: the probe's options of the means kernel
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from aot_msa import within_shared  # noqa: E402   (tests/msa: the MSA kernels' compile check)

#: argument types the MSA launchers' defaults do not give
TYPES = {"NB": "i32", "HO": "i32", "BHO": "i32", "K_OUT": "i32", "OUT": "*fp32", "QM": "*fp32", "KM": "*fp32",
         "TOPS": "*i64"}


def main():
    k = selection._kernels()
    jobs = []
    # the block means of q and k (one launch) as the launcher sizes them: D=128 block=128 the timed
    # form (32-row steps summed at once, 2 blocks a program); 16-row steps at D=256; 8 steps of a
    # 256-block; the loop of [BLOCK_R, D] sums past 8 steps (block 256 at D=256, 1024 at D=128)
    for d, block, group, x_dtype in ((128, 128, 1, "bf16"), (128, 128, 4, "fp16"), (80, 64, 2, "fp32"), (256, 32, 1, "bf16"),
                                     (256, 128, 1, "bf16"), (256, 64, 8, "bf16"), (128, 256, 1, "bf16"),
                                     (256, 256, 2, "bf16"), (128, 1024, 1, "fp16"), (64, 128, 1, "bf16")):
        jobs.append((k.block_means_pair_kernel, selection._means_meta(d, block, group), x_dtype,
                     f"means D={d} block={block} G={group} {x_dtype}"))
    for d, slots, causal in ((128, 16, True), (128, 16, False), (64, 1, True), (128, 32, True), (128, 64, True), (256, 256, True),
                              (256, selection.MAX_SLOTS, True)):
        jobs.append((k.block_select_kernel, selection._select_meta(d, slots, causal), "bf16",
                     f"D={d} K={slots} causal={causal}"))
    # a row tile's candidates in runs, and their merge
    jobs.append((k.block_select_kernel, dict(selection._select_meta(128, 16, True, 1024), SPLIT=4), "bf16",
                 "D=128 K=16 causal=True SPLIT=4"))
    jobs.append((k.block_merge_kernel, dict(BLOCK_M=64, W=16, SPLIT=8, num_warps=4), "bf16", "merge W=16 SPLIT=8"))
    # long rows: insertion from wide tiles into 128 rows
    for d, causal in ((128, True), (128, False), (256, True), (64, True)):
        jobs.append((k.block_select_kernel, selection._select_meta(d, 16, causal, selection.LONG_SELECT), "bf16",
                     f"D={d} K=16 causal={causal} long rows"))
    # the insertion form at other tiles (the probe's): wider tiles than W, fewer rows
    for block_m, block_n, warps in ((64, 16, 4), (16, 64, 2), (32, 32, 4)):
        meta = dict(selection._select_meta(128, 16, True), INSERT=True, BLOCK_M=block_m, BLOCK_N=block_n,
                    num_warps=warps)
        jobs.append((k.block_select_kernel, meta, "bf16", f"D=128 K=16 INSERT {block_m}x{block_n} {warps} warps"))
    # the probe's other options of the means kernel (benchmarks/select_probe.py)
    from select_probe import MEANS
    for opts in MEANS:
        jobs.append((k.block_means_pair_kernel, dict(selection._means_meta(128, 128, 1), **opts), "bf16",
                     f"means D=128 block=128 {opts}"))
    for kern, meta, x_dtype, what in jobs:
        if not within_shared([(kern, meta, what)], types=dict(TYPES, **{x: "*" + x_dtype for x in ("Q", "K")})):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
