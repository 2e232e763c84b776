"""Probe: how fast can Triton run the attention loops' structure at all?

    PYTHONPATH=$PWD python3 benchmarks/ceiling_probe.py [--set floors] [--kinds fwd,dkdv,dq] [--no-ours]
        [--n 131072] [--heads 16] [--window 4096] [--rep 150]
    PYTHONPATH=/tmp/t36:$PWD python benchmarks/ceiling_probe.py --sass [--set floors]   # no GPU: sm_90 SASS

The backward of the two-kernel deterministic design does 7 products a block pair: the dk/dv
kernel QK^T, dO V^T, P^T dO and dS^T Q (one key tile a program, its K and V resident), the dq
kernel QK^T, dO V^T and dS K (one query tile a program). The kernels here keep exactly that
loop structure for a causal window (B=1, D=128, bf16, the band of every tile without its edge
masks), with K/V (dk/dv) or Q/dO (dq) loaded once through a tensor descriptor and the streamed
tiles through pipelined descriptor loads, and vary what happens between the products:

- ``products``: nothing but a cast between them (S^T -> P^T, dP^T -> dS^T): the time of the
  products and their loads alone, the ceiling of this structure in the Triton that compiles it;
- ``softmax``: the backward's element-wise work as the generated kernels do it (exp2 of the
  folded scores minus LSE2, delta, both through 1-D descriptors), still without edge masks;
- ``RS`` (dk/dv only): K and V moved into registers before the loop (a select on the tile's row
  bound, which the compiler cannot fold), so that S^T and dP^T read their A operand from
  registers instead of shared memory (at 64 x 64 both operands from shared memory need about
  128 bytes a cycle, the shared-memory bandwidth of an SM);
- ``WS``: the loop as ``tl.range(..., warp_specialize=True)`` (sets ``ws``, ``ws-dup``,
  ``ws-host``, with ``DUP`` and ``HOST`` variants; the forward too, ``_fwd``), each checked
  against the same kernel without it.

Sets: ``floors`` (the default) the ceilings; ``ws``, ``ws-dup``, ``ws-host`` the warp-specialised
variants. On the GPU image's Triton 3.6 every WS variant computed wrong sums, faulted or hung
(docs/performance.md): run those sets one kernel per process (``--kinds``), under a
timeout, to check another Triton. The outputs are not attention gradients (no masks;
``products`` has no softmax): each non-WS variant is checked only for being finite, and timed.
Every figure is printed as ms and as the rate of the products it executes (2, 4 or 3 products of
2 * BLOCK_M * BLOCK_N * D per block) against the bf16 matmul rate measured in the same process
(torch.mm, 8192^3). Not part of the package.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _rows(T, rows, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HOST: tl.constexpr = False):
    # HOST: T is already a descriptor, built on the host (triton.tools.tensor_descriptor)
    if HOST:
        return T
    else:
        return tl.make_tensor_descriptor(T, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                         block_shape=[BLOCK, HEAD_DIM])


@triton.jit
def _query_tile(Q, K, V, N, BH, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HOST: tl.constexpr):
    # the set-up of a query-tile program (dq, forward): its rows, the K/V descriptors, its Q tile
    i0 = tl.program_id(0) * BLOCK_M
    row0 = tl.program_id(1) * N
    kd = _rows(K, BH * N, HEAD_DIM, BLOCK_N, HOST)
    vd = _rows(V, BH * N, HEAD_DIM, BLOCK_N, HOST)
    q = _rows(Q, BH * N, HEAD_DIM, BLOCK_M, HOST).load([row0 + i0, 0])
    return i0, row0, kd, vd, q


@triton.jit
def _query_band(i0, N, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # the key blocks of a query tile's band (the host twin is _blocks)
    return (tl.maximum(i0 - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N, tl.minimum(i0 + BLOCK_M, N)


@triton.jit
def _dkdv(Q, K, V, DO, LSE2, DELTA, DK, DV, N, BH, qk_scale, WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTMAX: tl.constexpr, RS: tl.constexpr,
          WS: tl.constexpr = False, STAGES: tl.constexpr = 2, DUP: tl.constexpr = False,
          HOST: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b0 = pid_n * BLOCK_N
    row0 = pid_bh * N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    qd = _rows(Q, BH * N, HEAD_DIM, BLOCK_M, HOST)
    dod = _rows(DO, BH * N, HEAD_DIM, BLOCK_M, HOST)
    k = _rows(K, BH * N, HEAD_DIM, BLOCK_N, HOST).load([row0 + b0, 0])
    v = _rows(V, BH * N, HEAD_DIM, BLOCK_N, HOST).load([row0 + b0, 0])
    if RS:
        own = (b0 + offs_n < N)[:, None]
        k = tl.where(own, k, 0.0)
        v = tl.where(own, v, 0.0)
    lse_d = tl.make_tensor_descriptor(LSE2 + row0, shape=[N], strides=[1], block_shape=[BLOCK_M])
    delta_d = tl.make_tensor_descriptor(DELTA + row0, shape=[N], strides=[1], block_shape=[BLOCK_M])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    lo = (b0 // BLOCK_M) * BLOCK_M
    hi = tl.minimum(b0 + BLOCK_N + WINDOW - 1, N)
    for start in tl.range(lo, hi, BLOCK_M, num_stages=STAGES, warp_specialize=WS):
        q = qd.load([row0 + start, 0])
        do = dod.load([row0 + start, 0])
        st = tl.dot(k, tl.trans(q))
        if SOFTMAX:
            lse2 = lse_d.load([start])
            delta = delta_d.load([start])
            pt = tl.math.exp2(st * qk_scale - lse2[None, :])
        else:
            pt = st
        if DUP:
            # a second load of the tile for its second product: each shared-memory buffer then
            # feeds one wgmma (the ``ws`` set found the WS loop wrong when one feeds two);
            # program_id(2), zero at run time, keeps the compiler from merging the two loads
            dv = tl.dot(pt.to(do.dtype), dod.load([row0 + start + tl.program_id(2), 0]), dv)
        else:
            dv = tl.dot(pt.to(do.dtype), do, dv)
        dpt = tl.dot(v, tl.trans(do))
        if SOFTMAX:
            dst = (pt * (dpt - delta[None, :])).to(q.dtype)
        else:
            dst = dpt.to(q.dtype)
        if DUP:
            dk = tl.dot(dst, qd.load([row0 + start + tl.program_id(2), 0]), dk)
        else:
            dk = tl.dot(dst, q, dk)
    rows = (row0 + b0 + offs_n).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + rows, dk.to(DK.dtype.element_ty))
    tl.store(DV + rows, dv.to(DV.dtype.element_ty))


@triton.jit
def _dq(Q, K, V, DO, LSE2, DELTA, DQ, N, BH, qk_scale, WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTMAX: tl.constexpr, RS: tl.constexpr,
        WS: tl.constexpr = False, STAGES: tl.constexpr = 2, DUP: tl.constexpr = False,
        HOST: tl.constexpr = False):
    i0, row0, kd, vd, q = _query_tile(Q, K, V, N, BH, HEAD_DIM, BLOCK_M, BLOCK_N, HOST)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    do = _rows(DO, BH * N, HEAD_DIM, BLOCK_M, HOST).load([row0 + i0, 0])
    if WS:
        # pointer loads here fail Triton 3.6's warp-specialisation pass; descriptors compile
        lse2 = tl.make_tensor_descriptor(LSE2 + row0, shape=[N], strides=[1], block_shape=[BLOCK_M]).load([i0])
        delta = tl.make_tensor_descriptor(DELTA + row0, shape=[N], strides=[1], block_shape=[BLOCK_M]).load([i0])
    else:
        lse2 = tl.load(LSE2 + row0 + i0 + offs_m)
        delta = tl.load(DELTA + row0 + i0 + offs_m)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo, hi = _query_band(i0, N, WINDOW, BLOCK_M, BLOCK_N)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        k = kd.load([row0 + start, 0])
        v = vd.load([row0 + start, 0])
        s = tl.dot(q, tl.trans(k))
        dp = tl.dot(do, tl.trans(v))
        if SOFTMAX:
            p = tl.math.exp2(s * qk_scale - lse2[:, None])
            ds = (p * (dp - delta[:, None])).to(k.dtype)
        else:
            ds = (dp - s).to(k.dtype)
        if DUP:
            dq = tl.dot(ds, kd.load([row0 + start + tl.program_id(2), 0]), dq)
        else:
            dq = tl.dot(ds, k, dq)
    rows = (row0 + i0 + offs_m).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DQ + rows, dq.to(DQ.dtype.element_ty))


@triton.jit
def _fwd(Q, K, V, O, N, BH, qk_scale, WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
         BLOCK_N: tl.constexpr, WS: tl.constexpr = False, STAGES: tl.constexpr = 3, HOST: tl.constexpr = False):
    # the forward's band without edge masks: online softmax over the key blocks of a query tile
    i0, row0, kd, vd, q = _query_tile(Q, K, V, N, BH, HEAD_DIM, BLOCK_M, BLOCK_N, HOST)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo, hi = _query_band(i0, N, WINDOW, BLOCK_M, BLOCK_N)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        k = kd.load([row0 + start, 0])
        v = vd.load([row0 + start, 0])
        s = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    rows = (row0 + i0 + offs_m).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(O + rows, (acc / l_i[:, None]).to(O.dtype.element_ty))


# (kind, mode, SOFTMAX, RS, WS, DUP, (block_m, block_n, warps, stages)); the generated defaults are
# forward (128, 128, 8, 3), dk/dv (64, 64, 4, 2) and dq (128, 64, 8, 3) for D=128 (config.py)
_MODES = {"dkdv": [("products", False, False), ("softmax", True, False), ("products RS", False, True),
                   ("softmax RS", True, True)],
          "dq": [("products", False, False), ("softmax", True, False)]}
SET_FLOORS = ([("dkdv", m, soft, rs, False, False, c) for c in [(64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2),
                                                            (128, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3),
                                                            (128, 64, 4, 2)] for m, soft, rs in _MODES["dkdv"]]
          + [("dq", m, soft, rs, False, False, c) for c in [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2),
                                                          (64, 64, 4, 3), (64, 128, 4, 2)] for m, soft, rs in _MODES["dq"]])
# Set ws: ``tl.range(..., warp_specialize=True)``. In Triton 3.6 it takes effect with 4 warps only
# (8 warps compile without partitions): a producer partition issues the TMA loads and two
# consumer warpgroups of 4 warps (232 registers each) split the tile's rows, 64 each, so the
# tile is 128 rows: the key tile of dk/dv (block_n 128), the query tile of dq (block_m 128).
# Each WS variant is checked against the same kernel without WS.
_BASE = [("dkdv", "products", False, False, False, False, (64, 64, 4, 2)),
         ("dkdv", "softmax", True, False, False, False, (64, 64, 4, 2)),
         ("dq", "products", False, False, False, False, (128, 64, 8, 3)),
         ("dq", "softmax", True, False, False, False, (128, 64, 8, 3)),
         ("fwd", "softmax", True, False, False, False, (128, 128, 8, 3))]
SET_WS = (_BASE[:4] + [(kind, m + " WS", soft, False, True, False, c) for kind, shapes in (
    ("dkdv", [(64, 128, 4, 2), (64, 128, 4, 3), (32, 128, 4, 2), (32, 128, 4, 3)]),
    ("dq", [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 2)])) for c in shapes
    for m, soft in (("products", False), ("softmax", True))]
    # the forward; (128, 128, 4, 3) with WS needs 240 KiB of shared memory
    + _BASE[4:] + [("fwd", "softmax WS", True, False, True, False, c) for c in [(128, 128, 4, 2), (128, 64, 4, 3),
                                                                             (128, 64, 4, 4)]])
# Set ws-dup: the ws set's dk/dv WS loop was wrong (products) or faulted (softmax). Hypothesis: a
# shared-memory buffer that feeds two wgmmas (Q: S^T and dK; dO: dP^T and dV; K in dq: S and
# dQ) is released to the producer after the first. DUP loads such a tile a second time, so that
# every buffer feeds one product.
SET_WS_DUP = (_BASE + [("fwd", "softmax WS", True, False, True, False, c) for c in [(128, 128, 4, 2), (128, 64, 4, 3)]]
          + [("dq", m, soft, False, True, dup, c) for c in [(128, 64, 4, 2), (128, 64, 4, 3)]
             for dup in (False, True) for m, soft in (("products WS" + (" DUP" if dup else ""), False),
                                                      ("softmax WS" + (" DUP" if dup else ""), True))]
          + [("dkdv", m, soft, False, True, True, c) for c in [(64, 128, 4, 2), (32, 128, 4, 2), (32, 128, 4, 3)]
             for m, soft in (("products WS DUP", False), ("softmax WS DUP", True))])
# Set ws-host: every WS variant of ws-dup was wrong or faulted (Triton 3.6), the forward included
# (each of its buffers feeds one product), which refutes ws-dup's hypothesis. The loops follow Triton's own
# attention tutorial except that the descriptors are built in the kernel
# (tl.make_tensor_descriptor, written to global scratch): " HOST" in a mode name passes
# descriptors built on the host instead (triton.tools.tensor_descriptor).
SET_WS_HOST = ([("fwd", "softmax", True, False, False, False, (128, 128, 8, 3)),
           ("fwd", "softmax HOST", True, False, False, False, (128, 128, 8, 3))]
          + [("fwd", "softmax WS HOST", True, False, True, False, c) for c in [(128, 128, 4, 2), (128, 64, 4, 3)]]
          + [("dq", m, soft, False, ws, False, (128, 64, 4, 2)) for ws in (False, True)
             for m, soft in (("products HOST" + (" WS" if ws else ""), False),
                             ("softmax HOST" + (" WS" if ws else ""), True))]
          + [("dkdv", m, soft, False, ws, False, (64, 128, 4, 2)) for ws in (False, True)
             for m, soft in (("products HOST" + (" WS" if ws else ""), False),
                             ("softmax HOST" + (" WS" if ws else ""), True))])
SETS = {"floors": SET_FLOORS, "ws": SET_WS, "ws-dup": SET_WS_DUP, "ws-host": SET_WS_HOST}


def _blocks(kind, n, w, bm, bn):
    """Blocks each variant's loops run over all programs of one head (the host twin of the bounds)."""
    total = 0
    if kind == "dkdv":
        for b0 in range(0, n, bn):
            lo, hi = b0 // bm * bm, min(b0 + bn + w - 1, n)
            total += len(range(lo, hi, bm))
    else:
        for i0 in range(0, n, bm):
            lo, hi = max(i0 - w + 1, 0) // bn * bn, min(i0 + bm, n)
            total += len(range(lo, hi, bn))
    return total


def _kernels(prof, iters):
    """(ms per iteration, launches per iteration, name) of every CUDA kernel in a profile, slowest first."""
    rows = []
    for e in prof.key_averages():
        dev_t = getattr(e, "device_time_total", None)
        if dev_t is None:
            dev_t = getattr(e, "cuda_time_total", 0)
        if dev_t and e.key and not e.key.startswith(("aten::", "cuda", "Memcpy", "ProfilerStep")) \
                and e.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((dev_t / iters / 1000.0, e.count // iters, e.key))
    return sorted(rows, reverse=True)


def _sass(variants):
    """Compile every variant for sm_90 with the installed Triton and print registers, spills and
    where each HGMMA reads its A operand (benchmarks/sass_report.py's report)."""
    from pathlib import Path

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sass_report import report

    print(f"Triton {triton.__version__}, sm_90", flush=True)
    for kind, mode, soft, rs, ws, dup, (bm, bn, warps, stages) in variants:
                if " HOST" in mode:
                    print(f"{kind} {mode} ({bm}, {bn}, {warps}, {stages}): skipped (host descriptors: GPU runs only)")
                    continue
                kern = {"dkdv": _dkdv, "dq": _dq, "fwd": _fwd}[kind]
                sig, consts = {}, {}
                values = dict(WINDOW=4096, HEAD_DIM=128, BLOCK_M=bm, BLOCK_N=bn, SOFTMAX=soft, RS=rs, WS=ws,
                              STAGES=stages, DUP=dup)
                for idx, name in enumerate(kern.arg_names):
                    if kern.params[idx].is_constexpr:
                        sig[name] = "constexpr"
                        if name in values:
                            consts[(idx,)] = values[name]
                    elif name in ("N", "BH"):
                        sig[name] = "i32"
                    elif name == "qk_scale":
                        sig[name] = "fp32"
                    elif name in ("LSE2", "DELTA"):
                        sig[name] = "*fp32"
                    else:
                        sig[name] = "*bf16"
                label = f"{kind} {mode} ({bm}, {bn}, {warps}, {stages})"
                try:
                    compiled = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=consts),
                                              target=GPUTarget("cuda", 90, 32),
                                              options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True))
                    report(compiled, label)
                except Exception as e:   # reported, never dropped
                    print(f"{label}: failed to compile: {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--rep", type=int, default=150, help="do_bench's rep (ms) per figure")
    ap.add_argument("--kinds", help="only these kernels (fwd,dkdv,dq); a faulting variant ends its process")
    ap.add_argument("--no-ours", action="store_true", help="skip timing our kernels")
    ap.add_argument("--set", choices=sorted(SETS), default="floors", help="which variants (default: %(default)s)")
    ap.add_argument("--sass", action="store_true", help="no GPU: compile each variant for sm_90 and report it")
    args = ap.parse_args(argv)
    if args.sass:
        _sass(SETS[args.set])
        return 0
    import msa_codegen as msa
    from msa_codegen.kernels.tma import _ensure_allocator

    _ensure_allocator()
    n, h, d, w = args.n, args.heads, 128, args.window
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    bench = lambda fn: triton.testing.do_bench(fn, rep=args.rep, return_mode="median")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=g)
    peak = 2 * 8192 ** 3 / bench(lambda: a @ a) * 1e-9
    print(f"torch.mm bf16 8192^3: {peak:.0f} TFLOP/s (the matmul rate of this process)", flush=True)
    pattern = f"window={w}"
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = msa.attention(qq, kk, vv, pattern, return_lse=True)
    ours = None
    if not args.no_ours:
        fwd_ms = bench(lambda: msa.attention(q, k, v, pattern))
        print(f"ours forward {pattern}: {fwd_ms:.3f} ms", flush=True)
        ours = bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
        pairs = h * (w * n - w * (w - 1) // 2)
        print(f"ours backward {pattern}, H={h}, N={n}: {ours:.3f} ms ({2.5 * 4 * d * pairs / ours * 1e-9:.0f} TFLOP/s "
              f"effective, 2.5 x 4 D pairs)", flush=True)
        # our backward's kernels, one by one (torch.profiler, 10 iterations)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)
            torch.cuda.synchronize()
        for t, _, name in _kernels(prof, 10):
            if t > 0.05:
                print(f"  ours, kernel {name[:60]}: {t:.3f} ms a backward", flush=True)
    lse2 = (lse.detach().float() * 1.4426950408889634).contiguous()
    delta = (out.detach().float() * do.float()).sum(-1).contiguous()
    scale = d ** -0.5 * 1.4426950408889634
    print(f"{'variant':34s} {'ms':>8s} {'prod TF/s':>9s} {'of mm':>6s}", flush=True)
    best = {}
    for kind, mode, soft, rs, ws, dup, (bm, bn, warps, stages) in SETS[args.set]:
        if args.kinds and kind not in args.kinds.split(","):
            continue
        kern = {"dkdv": _dkdv, "dq": _dq, "fwd": _fwd}[kind]
        products = {"dkdv": 4, "dq": 3, "fwd": 2}[kind]
        flops = products * 2 * bm * bn * d * h * _blocks("dkdv" if kind == "dkdv" else "dq", n, w, bm, bn)
        label = f"{kind} {mode} ({bm}, {bn}, {warps}, {stages})"
        try:
            outs = tuple(torch.empty_like(q) for _ in range(2 if kind == "dkdv" else 1))
            grid = (n // bn, h) if kind == "dkdv" else (n // bm, h)

            host = " HOST" in mode
            if host:
                from triton.tools.tensor_descriptor import TensorDescriptor

                rows = lambda t, blk: TensorDescriptor.from_tensor(t.view(-1, d), [blk, d])
                # block shapes as the kernels load them: Q and dO by BLOCK_M rows, K and V by BLOCK_N
                ins = (rows(q, bm), rows(k, bn), rows(v, bn), rows(do, bm))
            else:
                ins = (q, k, v, do)

            def run(ws=ws, outs=outs):
                if kind == "fwd":
                    kern[grid](*ins[:3], *outs, n, h, scale, WINDOW=w, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, WS=ws,
                               STAGES=stages, HOST=host, num_warps=warps, num_stages=stages)
                else:
                    kern[grid](*ins, lse2, delta, *outs, n, h, scale, WINDOW=w, HEAD_DIM=d, BLOCK_M=bm,
                               BLOCK_N=bn, SOFTMAX=soft, RS=rs, WS=ws, STAGES=stages, DUP=dup and ws, HOST=host,
                               num_warps=warps, num_stages=stages)
            run()
            torch.cuda.synchronize()
            if not all(torch.isfinite(t).all().item() for t in outs):
                raise RuntimeError("non-finite output")
            check = ""
            if ws:
                # the same kernel without warp specialisation computes the same sums
                ref = tuple(torch.empty_like(t) for t in outs)
                run(ws=False, outs=ref)
                err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(outs, ref))
                if not err < 1e-2:
                    raise RuntimeError(f"differs from the kernel without WS: {err:.2e}")
                check = f"  (vs no WS {err:.1e})"
            ms = bench(run)
            rate = flops / ms * 1e-9
            print(f"{label:34s} {ms:8.3f} {rate:9.0f} {rate / peak:6.1%}{check}", flush=True)
            key = (kind, mode.split()[0])
            if key not in best or ms < best[key][0]:
                best[key] = (ms, label)
        except Exception as e:   # reported, never dropped
            print(f"{label:34s} failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}",
                  flush=True)
            if "CUDA error" in str(e):
                raise
    print("\nbest of each (dk/dv + dq is the floor of the two-kernel design in this Triton):", flush=True)
    for key, (ms, label) in sorted(best.items()):
        print(f"  {label:34s} {ms:8.3f} ms", flush=True)
    for mode in ("products", "softmax"):
        if ("dkdv", mode) in best and ("dq", mode) in best:
            total = best[("dkdv", mode)][0] + best[("dq", mode)][0]
            print(f"  {mode}: dk/dv + dq = {total:.3f} ms" + (f" against ours {ours:.3f}" if ours else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
