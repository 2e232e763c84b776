"""Compile the MSA kernels for an sm_90 GPU without a GPU, with the launchers' own parameters.

Run as a script in a process without TRITON_INTERPRET (``python tests/msa/aot_msa.py``). The
interpreter accepts what the GPU compiler rejects (non-constexpr globals, loop-carried types)
and knows no shared-memory limit; this checks both, for the head layouts and head dims the
launchers treat differently. Prints one line per kernel; exits non-zero on the first failure.
"""
from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from msa_codegen.msa import launch

SMEM_LIMIT = 232448   # bytes of shared memory per block on sm_90
_BF16 = ("Q", "K", "V", "QP", "KP", "DO")
_I32_PTRS = ("DSTART", "ITEMS", "REV", "IDX")
_FLOATS = ("qk_scale", "pk_scale", "scale", "p_scale")
_INTS = ("N", "NBLK", "HKV", "HPK", "n_items")


def compile_sm90(kern, meta: dict, types: dict | None = None):
    """``kern`` for sm_90 with ``meta``'s constexprs and options; ``types`` overrides an
    argument's type by name (by default: the MSA launchers' names)."""
    sig, consts, attrs = {}, {}, {}
    options = {k: meta[k] for k in ("num_warps", "num_stages") if k in meta}
    for i, name in enumerate(kern.arg_names):
        if kern.params[i].is_constexpr:
            sig[name] = "constexpr"
            consts[(i,)] = meta[name]
            continue
        elif types and name in types:
            sig[name] = types[name]
        elif name in _BF16:
            sig[name] = "*bf16"
        elif name in _I32_PTRS:
            sig[name] = "*i32"
        elif name in _FLOATS:
            sig[name] = "fp32"
        elif name in _INTS or name.startswith("s_"):
            sig[name] = "i32"
        else:
            sig[name] = "*fp32"
        if sig[name] != "fp32":
            # as the launcher specialises them on a GPU (pointers, strides and N divisible by 16): the
            # compiler then vectorises and pipelines more, and asks for more shared memory (Triton 3.6:
            # 238592 B instead of 164628 B for the forward's second pass with the KL)
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def main():
    k = launch.kernels()
    # (H, Hkv, Hp, Hpk, D, Dp, block, top_k / block)
    # the shape; 16 heads per proxy over 16 KV heads (a span of 16); 32 / 8 / 1 (a span of 8
    # groups of 4: padded to the whole group, its tiles overflowed shared memory); 32 / 4 / 4 (8 heads
    # on a KV head: the backward's 128-row tiles overflowed it before they were cut into chunks, and
    # the out + KL pass's 16 entries x 8 heads at three stages on Triton 3.6); 32 / 2 / 2 (16 heads on
    # a KV head: four backward chunks, the teaching gradient alone in one 256-row tile); D = Dp = 256
    # (sub-blocks)
    layouts = [(16, 2, 4, 1, 128, 128, 128, 16), (16, 16, 1, 1, 128, 64, 128, 16), (32, 8, 1, 1, 128, 128, 128, 16),
               (32, 4, 4, 1, 128, 128, 128, 16), (32, 2, 2, 1, 128, 128, 128, 16), (4, 4, 2, 1, 256, 256, 64, 64)]
    for h, hkv, hp, hpk, d, dp, block, n_sel in layouts:
        heads = launch.Heads(h, hkv, hp, hpk)
        jobs = [(k.msa_select_kernel, launch.select_meta(hp, hpk, dp, block, n_sel, True, torch.bfloat16))]
        fwd = launch.fwd_meta(heads, d, dp, block, n_sel, True, False, torch.bfloat16)
        jobs += [(k.msa_fwd_kernel, dict(fwd, PASS=1, WITH_OUT=False, WITH_KL=False))]
        jobs += [(k.msa_fwd_kernel, launch.pass2_meta(fwd, with_out, with_kl))
                 for with_out, with_kl in ((True, False), (True, True), (False, True))]
        bwd = launch.bwd_meta(heads, d, dp, block, n_sel, True, False, torch.bfloat16)
        jobs += [(k.msa_bwd_kernel, dict(bwd, MAIN=True, WITH_KL=True))]
        teach = launch.bwd_meta(heads, d, dp, block, n_sel, True, False, torch.bfloat16, main=False)
        jobs += [(k.msa_bwd_kernel, dict(teach, MAIN=False, WITH_KL=True))]
        if not within_shared(jobs, f"H={h}/{hkv} Hp={hp}/{hpk} D={d} Dp={dp} block={block}"):
            return 1
    return 0


def within_shared(jobs, label: str = "", types: dict | None = None) -> bool:
    """Compile each ``(kernel, meta)``, print its shared memory; False at the first over sm_90's."""
    for kern, meta, *own in jobs:
        smem = compile_sm90(kern, meta, types).metadata.shared
        print(f"{kern.__name__} {own[0] if own else label}: {smem} B shared")
        if smem > SMEM_LIMIT:
            print(f"over the {SMEM_LIMIT} B of sm_90", file=sys.stderr)
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
