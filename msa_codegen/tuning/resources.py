"""Shared memory of a candidate, from an ahead-of-time compile for the GPU's target, on any machine.

The analytic filter of ``space.why_excluded`` counts the tiles of the pipeline; it cannot see
what the compiler adds (layout conversions through shared memory, the epilogue, descriptors) nor
how much more it pipelines when pointers and strides are known to be divisible by 16. Triton's
ahead-of-time compile can: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``
runs the whole NVIDIA pipeline (LLVM and the bundled ptxas) on a CPU and reports
``metadata.shared``, the bytes a launch asks for.

The compile is specialised as a launch on the GPU is, for a problem whose lengths and strides
are multiples of 16 (the representative problems are): pointers 16-byte aligned, integers that
Triton specialises either 1 (a ``constexpr``) or divisible by 16, except those the kernel marks
``do_not_specialize``. Unspecialised, the figure is lower than what the GPU asks for (Triton 3.6:
164628 B instead of 238592 B for one MSA kernel), so a filter built on it would let through
candidates that then fail at launch.

Verdicts are cached per (kernel source, constexprs, options, target) in memory and in
``$MSA_CODEGEN_HOME/smem-cache/`` (one small JSON file per key, written atomically; an unreadable
one is dropped and recomputed), so a second run of the tuner compiles nothing twice.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from ..heuristics import SHARED_OPTIN
from ..kernels import render

SM90_SHARED_OPTIN = SHARED_OPTIN["9.0"]    # 232448: bytes of shared memory per block (opt-in) on sm_90
#                                            (H100 / H200); on a GPU the tuner asks the device (space.device_smem_bytes)
SM100_SHARED_OPTIN = SHARED_OPTIN["10.0"]  # the same on sm_100 (B200 / B100: 228 KiB per SM, 227 KiB per block);
#                                            CUDA's tuning guide for Blackwell gives both figures
SM120_SHARED_OPTIN = SHARED_OPTIN["12.0"]  # 101376 (99 KiB) on sm_120 (RTX 50xx, RTX PRO 6000), as on 8.6 and 8.9:
#                                            the CUDA C++ Programming Guide's per-capability table
_FP32_PTRS = ("LSE", "LSE2", "DELTA", "DLSE", "DK", "DV")
_INT_PTRS = ("RTAB", "ROFF", "RINV", "QPOS", "KPOS", "QSEG", "KSEG")
_FLOATS = ("qk_scale", "sm_scale")
_INTS = ("H_OFF", "H", "GROUP", "N", "NQ", "NK", "HK", "KV_OFF", "Q_CHUNK", "MAXB")
_UNIT_STRIDES = ("stride_qpn", "stride_kpn", "stride_qsn", "stride_ksn")
_memo: dict[str, int] = {}


def available() -> bool:
    """Whether this process can compile for an NVIDIA target ahead of time: Triton's NVIDIA
    backend is installed and kernels are not interpreted (``TRITON_INTERPRET=1`` turns every
    ``@triton.jit`` function into a Python one that cannot be compiled)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        return False
    return True


def target_of(capability: str):
    """Triton's ``GPUTarget`` of a ``"major.minor"`` capability (warp size 32)."""
    from triton.backends.compiler import GPUTarget

    major, minor = (int(x) for x in str(capability).split(".")[:2])
    return GPUTarget("cuda", 10 * major + minor, 32)


def _signature(kern, constexprs: dict, dtype_name: str, group: int):
    """(signature, constexprs, attrs) of ``kern`` as a GPU launch specialises it."""
    sig, consts, attrs = {}, {}, {}
    no_spec = set(getattr(kern, "do_not_specialize", ()) or ())
    for i, name in enumerate(kern.arg_names):
        if kern.params[i].is_constexpr:
            sig[name] = "constexpr"
            consts[(i,)] = constexprs[name]
            continue
        if name in _FLOATS:
            sig[name] = "fp32"
            continue
        if name.startswith("stride_") or name in _INTS:
            # an integer: the last dim's stride (contiguous rows), the row stride of run-time positions
            # and segments (normalised to contiguous int32 rows) and a GQA group of 1 are 1, which
            # Triton turns into a constexpr; the rest are multiples of 16 in the problems we tune
            unit = ((name.startswith("stride_") and name.endswith("d")) or name in _UNIT_STRIDES
                    or (name == "GROUP" and group == 1))
            if name in no_spec:
                sig[name] = "i32"
            elif unit:
                sig[name] = "constexpr"
                consts[(i,)] = 1
            else:
                sig[name] = "i32"
                attrs[(i,)] = [["tt.divisibility", 16]]
            continue
        # a pointer: 16-byte aligned (torch's allocations)
        if name in _FP32_PTRS:
            sig[name] = "*fp32"
        elif name in _INT_PTRS:
            sig[name] = "*i32"
        else:
            sig[name] = "*" + dtype_name
        attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def _cache_dir() -> Path:
    # beside the rendered kernels: $MSA_CODEGEN_HOME, default ~/.cache/msa_codegen
    return render.home() / "smem-cache"


def _key(kern, sig, consts, attrs, options, capability) -> str:
    import triton

    # JITFunction.cache_key hashes the kernel's source and the functions it calls
    text = json.dumps([triton.__version__, kern.cache_key, sorted(sig.items()),
                       sorted((k[0], repr(v)) for k, v in consts.items()), sorted((k[0], v) for k, v in attrs.items()),
                       sorted(options.items()), str(capability)], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _read(key: str) -> int | None:
    path = _cache_dir() / f"{key}.json"
    try:
        return int(json.loads(path.read_text())["shared"])
    except FileNotFoundError:
        return None
    except Exception:   # corrupt: dropped and recomputed
        path.unlink(missing_ok=True)
        return None


def _write(key: str, shared: int) -> None:
    d = _cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump({"shared": shared}, f)
        os.replace(tmp, d / f"{key}.json")
    except OSError:
        pass   # a read-only home: the verdict is recomputed next time


def kernel_shared(kern, constexprs: dict, *, num_warps: int, num_stages: int, dtype_name: str = "bf16",
                  group: int = 1, capability: str = "9.0") -> int:
    """Bytes of shared memory one launch of ``kern`` asks for on ``capability``, by compiling it
    ahead of time (cached). Compile errors propagate."""
    import triton
    from triton.compiler import ASTSource

    sig, consts, attrs = _signature(kern, constexprs, dtype_name, group)
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True}
    key = _key(kern, sig, consts, attrs, options, capability)
    if key in _memo:
        return _memo[key]
    shared = _read(key)
    if shared is None:
        compiled = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs),
                                  target=target_of(capability), options=options)
        shared = int(compiled.metadata.shared)
        _write(key, shared)
    _memo[key] = shared
    return shared


_TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def launches(pattern: str, direction: str, params: dict, *, head_dim: int, dtype: torch.dtype, heads: int,
             kv_heads: int, seqlen: int):
    """The kernel launches one candidate makes on a Hopper-or-newer GPU for a plain call (no
    positions or run-time sparsity): (name, kernel, constexprs, num_warps, num_stages) each,
    per head group of the pattern. Mirrors ``kernels.launch``."""
    from ..config import BwdConfig, FwdConfig
    from ..kernels.schedule import block_d, dot_precision
    from ..plan import plan_for

    plan = plan_for(pattern, torch.device("cpu"), dtype, head_dim, heads, kv_heads, seqlen)
    bd, prec = block_d(head_dim), dot_precision(dtype)
    # descriptors on sm_90+ for 2-byte dtypes with TMA-able layouts (kernels.tma.use_tma)
    tma = torch.tensor([], dtype=dtype).element_size() == 2
    out = []
    for grp in plan.groups:
        if direction == "fwd":
            c = FwdConfig(**params)
            out.append(("fwd", grp.kernels("fwd").msa_fwd,
                        dict(HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_M=c.block_m, BLOCK_N=c.block_n, DOT_PREC=prec,
                             TMA=tma, FOLD=True), c.num_warps, c.num_stages))
            continue
        c = BwdConfig(**params)
        mod = grp.kernels("bwd")
        common = dict(HEAD_DIM=head_dim, BLOCK_D=bd, DOT_PREC=prec, TMA=tma, DS=False)
        # dS scratch is off by default (schedule.BWD_SCRATCH_DEFAULT): dq recomputes with its own tiles
        out.append(("dk/dv", mod.msa_bwd_dkdv, dict(common, BLOCK_M=c.block_m1, BLOCK_N=c.block_n1,
                                                    PREFIX_TILES=False), c.num_warps1, c.num_stages1))
        if grp.kernel_plan.prefix:
            out.append(("dk/dv prefix", mod.msa_bwd_dkdv, dict(common, BLOCK_M=c.block_m1, BLOCK_N=c.block_n1,
                                                               PREFIX_TILES=True), c.num_warps1, c.num_stages1))
        out.append(("dq", mod.msa_bwd_dq, dict(common, BLOCK_M=c.block_m2, BLOCK_N=c.block_n2),
                    c.num_warps2, c.num_stages2))
    return out


def candidate_shared(pattern: str, direction: str, params: dict, *, head_dim: int, dtype: torch.dtype,
                     heads: int, kv_heads: int, seqlen: int, capability: str = "9.0") -> dict[str, int]:
    """The largest shared memory (bytes) of each kernel of one candidate, compiled ahead of time."""
    out: dict[str, int] = {}
    for name, kern, consts, warps, stages in launches(pattern, direction, params, head_dim=head_dim, dtype=dtype,
                                                       heads=heads, kv_heads=kv_heads, seqlen=seqlen):
        b = kernel_shared(kern, consts, num_warps=warps, num_stages=stages, dtype_name=_TRITON_DTYPES[dtype],
                          group=heads // kv_heads, capability=capability)
        out[name] = max(out.get(name, 0), b)
    return out


def over_limit(pattern: str, direction: str, params: dict, *, limit: int, **kw) -> str | None:
    """Why a candidate does not fit ``limit`` bytes of shared memory per block (its ahead-of-time
    compile's figure), or None when it fits. Compile errors propagate."""
    for name, b in candidate_shared(pattern, direction, params, **kw).items():
        if b > limit:
            return f"{name}: {b} B of shared memory per block (compiled for the target), the device has {limit}"
    return None


def _verdict_worker(args) -> tuple[str | None, float]:
    """(In a worker process.) ``over_limit``'s verdict, or the compile error; and the seconds it took."""
    import time

    from .measure import error_line

    pattern, direction, params, limit, kw = args
    t0 = time.perf_counter()
    try:
        why = over_limit(pattern, direction, params, limit=limit, **kw)
        return ("ok" if why is None else "smem:" + why), time.perf_counter() - t0
    except Exception as e:
        return "error:" + error_line(e), time.perf_counter() - t0
