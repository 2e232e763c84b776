"""Compile select_blocks' kernels for an sm_90 GPU without a GPU, with the launchers' own parameters.

Run as a script in a process without TRITON_INTERPRET (``python tests/sparsity/aot_select.py``).
The interpreter accepts what the GPU compiler rejects and knows no register or shared-memory
limit; this checks both for the head dims and K the launchers size differently. One line per
kernel; exits non-zero on the first failure.
"""
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from msa_codegen.sparsity import selection

SMEM_LIMIT = 232448   # bytes of shared memory per block on sm_90


def compile_sm90(kern, meta: dict, x_dtype: str = "bf16"):
    sig, consts, attrs = {}, {}, {}
    options = {k: meta[k] for k in ("num_warps", "num_stages") if k in meta}
    for i, name in enumerate(kern.arg_names):
        if kern.params[i].is_constexpr:
            sig[name] = "constexpr"
            consts[(i,)] = meta[name]
            continue
        sig[name] = {"X": "*" + x_dtype, "IDX": "*i32", "OUT": "*fp32", "QM": "*fp32", "KM": "*fp32"}.get(name, "i32")
        # as a GPU launch specialises pointers, strides and sizes divisible by 16
        attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def main():
    k = selection._kernels()
    jobs = []
    for d, block, group, x_dtype in ((128, 128, 1, "bf16"), (128, 128, 4, "fp16"), (80, 64, 2, "fp32"), (256, 32, 1, "bf16")):
        jobs.append((k.block_means_kernel, selection._means_meta(d, block, group), x_dtype,
                     f"D={d} block={block} G={group} {x_dtype}"))
    for d, slots, causal in ((128, 16, True), (128, 16, False), (64, 1, True), (128, 32, True), (128, 64, True), (256, 256, True),
                              (256, selection.MAX_SLOTS, True)):
        jobs.append((k.block_select_kernel, selection._select_meta(d, slots, causal), "bf16",
                     f"D={d} K={slots} causal={causal}"))
    for kern, meta, x_dtype, what in jobs:
        c = compile_sm90(kern, meta, x_dtype)
        smem = c.metadata.shared
        print(f"{kern.__name__} {what}: {smem} B shared")
        if smem > SMEM_LIMIT:
            print(f"over the {SMEM_LIMIT} B of sm_90", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
