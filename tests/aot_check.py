"""Compile a plan's generated kernels for an sm_90 GPU without a GPU (Triton's bundled ptxas).

Run as a script in a process without TRITON_INTERPRET: ``python aot_check.py PATTERN FLAGS...``
(FLAGS: ``positional``, ``segments``, ``classes``; ``tma``: the plain forward's tensor-descriptor
loads; ``launch``: instead of small tiles, head dim 128 (``hd=N``: N) in bf16 (``fp16``: fp16)
with a GQA group of 1 (``group=G``: G) at the default launch configuration of an H200 (with
``segments`` and no ``classes``, hash buckets: the short buckets' one too), specialised as a GPU
launch specialises contiguous tensors: strides of 1 and a GQA group of 1 become constants, the
rest divisible by 16, as ``tuning.resources`` compiles a candidate). The interpreter accepts code
that the GPU compiler rejects (loop-carried types, scalar/tensor mixing), and ptxas can fail on
code that compiles at other sizes (Triton 3.6's ptxas 12.8 crashed with SIGSEGV on a dense
positional forward at the launch configuration that compiled at 64-row tiles);
this catches both on machines without CUDA. With ``launch``, ptxas's report names the kernels
whose wgmma it serialized (its C7511 / C7512 / C7515: every product waits for the one before; the dense D=128
dq's were, until an empty loop left the template); ``pipelined`` makes that an error. Run it with a fresh
``TRITON_CACHE_DIR``: a cached kernel is not compiled again, so ptxas reports nothing for it.
"""
import contextlib
import io
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from msa_codegen.kernels import render as codegen
from msa_codegen.pattern.lowering import lower
from msa_codegen.pattern.spec import parse

_INT_PTRS = ("RTAB", "ROFF", "RINV", "QPOS", "KPOS", "QSEG", "KSEG")
_FP32_PTRS = ("LSE", "LSE2", "DELTA", "DLSE", "DK", "DV")
_INTS = ("H_OFF", "H", "GROUP", "N", "NQ", "NK", "HK", "KV_OFF", "Q_CHUNK", "MAXB")
_CONSTS = dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64, DOT_PREC="tf32", PREFIX_TILES=False, HAS_DLSE=False, FOLD=True,
               DS=False)


def compile_kernel(kern, dtype="bf16", tma=False, constexprs=None, options=None):
    """``kern`` compiled for sm_90; ``constexprs`` override the defaults above, ``options`` are
    Triton's compile options (num_warps, num_stages, ...)."""
    sig, consts = {}, {}
    values = {**_CONSTS, "TMA": tma, **(constexprs or {})}
    for idx, name in enumerate(kern.arg_names):
        if kern.params[idx].is_constexpr:
            sig[name] = "constexpr"
            consts[(idx,)] = values[name]
        elif name in _INTS or name.startswith("stride_"):
            sig[name] = "i32"
        elif name in ("qk_scale", "sm_scale"):
            sig[name] = "fp32"
        elif name in _INT_PTRS:
            sig[name] = "*i32"
        elif name in _FP32_PTRS:
            sig[name] = "*fp32"
        else:
            sig[name] = "*" + dtype
    return triton.compile(ASTSource(fn=kern, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=options)


def compile_launch(plan, pattern, tma, head_dim=128, dtype="bf16", group=1):
    """``plan``'s kernels at ``head_dim`` in ``dtype`` (bf16 / fp16) with GQA ``group``, as an H200
    launches them by default."""
    import torch

    from msa_codegen.heuristics import default_config
    from msa_codegen.kernels.schedule import block_d
    from msa_codegen.tuning import resources

    # hash buckets (segments without classes) run the short buckets' default or, for long ones,
    # the pattern's: both
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    cfgs = {default_config(torch.device("cuda"), head_dim, tdtype, capability="9.0", pattern=pattern,
                           buckets=buckets) for buckets in {False, plan.segments and not plan.classes}}
    fwd, bwd = codegen.load(plan, "fwd"), codegen.load(plan, "bwd")
    bd = block_d(head_dim)
    common = dict(HEAD_DIM=head_dim, BLOCK_D=bd, DOT_PREC="tf32", TMA=tma, FOLD=True, DS=False, HAS_DLSE=False,
                  PREFIX_TILES=False)
    # the stats pass (msa_bwd_pre) launches with 64-row tiles and Triton's default warps and stages
    jobs = [(bwd.msa_bwd_pre, dict(BLOCK_M=64), 4, 3)]
    for f, b in ((c.fwd, c.bwd) for c in cfgs):
        jobs += [(fwd.msa_fwd, dict(BLOCK_M=f.block_m, BLOCK_N=f.block_n), f.num_warps, f.num_stages),
                 (bwd.msa_bwd_dkdv, dict(BLOCK_M=b.block_m1, BLOCK_N=b.block_n1), b.num_warps1, b.num_stages1),
                 (bwd.msa_bwd_dq, dict(BLOCK_M=b.block_m2, BLOCK_N=b.block_n2), b.num_warps2, b.num_stages2)]
    for kern, tiles, warps, stages in jobs:
        names = {n for i, n in enumerate(kern.arg_names) if kern.params[i].is_constexpr}
        consts = {k: v for k, v in {**common, **tiles}.items() if k in names}
        # the tuner's ahead-of-time compile (launch specialisation, fp fusion; cached per kernel key)
        resources.kernel_shared(kern, consts, num_warps=warps, num_stages=stages, capability="9.0", dtype_name=dtype,
                                group=group)


def main(pattern, *flags):
    plan = lower(parse(pattern).groups[0].spec, positional="positional" in flags, segments="segments" in flags,
                 classes="classes" in flags)
    if "launch" in flags:
        hd = [int(f[3:]) for f in flags if f.startswith("hd=")]
        group = [int(f[6:]) for f in flags if f.startswith("group=")]
        # ptxas's own report of each compile (Triton prints it to stdout under this knob; a kernel
        # found in Triton's cache is not compiled again, so callers pass a fresh TRITON_CACHE_DIR)
        os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            compile_launch(plan, pattern, tma="tma" in flags, head_dim=hd[0] if hd else 128,
                           dtype="fp16" if "fp16" in flags else "bf16", group=group[0] if group else 1)
        found = sorted(set(re.findall(r"\((C75\d\d)\)[^\n]*wgmma\.mma_async instructions are serialized"
                                      r"[^\n]*function '(\w+)'", log.getvalue())))
        serialized = sorted({name for _, name in found})
        if found:
            print("wgmma serialized by ptxas in", *(f"{name} ({code})" for code, name in found))
        if "pipelined" in flags and serialized:
            sys.exit(f"{pattern}: ptxas serialized every wgmma of {', '.join(serialized)}")
        print("compiled", pattern, *flags)
        return
    fwd, bwd = codegen.load(plan, "fwd"), codegen.load(plan, "bwd")
    for kern in (fwd.msa_fwd, bwd.msa_bwd_pre, bwd.msa_bwd_dq, bwd.msa_bwd_dkdv):
        compile_kernel(kern, tma="tma" in flags)
        if plan.ds_capable and kern in (bwd.msa_bwd_dq, bwd.msa_bwd_dkdv):
            # the band's dS through the scratch buffer (kernels.schedule.ds_heads)
            compile_kernel(kern, tma="tma" in flags, constexprs={"DS": True})
    print("compiled", pattern, *flags)


if __name__ == "__main__":
    main(*sys.argv[1:])
