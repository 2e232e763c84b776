"""Probe (issue 4, run 15): which kernel-level changes would move the plain-window rows?

    PYTHONPATH=$PWD python3 benchmarks/kernel_probe.py [--n 131072] [--window 4096] [--rep 200] [--only fwd|bwd] [--rejected]

Stand-alone causal sliding-window kernels (B=1, H=16, D=128, bf16, N and the window multiples of
128), each checked against msa_codegen's own generated kernels and timed next to them in the same
process. Not part of the package: it decides which template rewrite is worth doing.

Forward (K/V through tensor descriptors, 128 x 128 tiles, the shape of the generated default):
- ``base``: scores scaled once (``s * qk_scale``), then ``exp2(s - m)``, as the templates do;
- ``fold``: the scale folded into the exponent (``exp2(s * qk_scale - m)``, one FMA per score)
  and the row maximum taken on the raw scores;
- ``lazy``: ``fold`` plus conditional rescaling: the accumulator and the row sums are rescaled
  only when some row's maximum grew by more than 8 (log2 units; probabilities stay below 2^8);
- ``pipe``: ``fold`` with the next block's QK^T issued before this block's PV product in the
  unmasked band (manual software pipelining);
- ``fold, host descriptors`` (run 16): ``fold`` with Q, K and V as descriptors built on the host
  (``TensorDescriptor``, kernel parameters) instead of in every program
  (``tl.make_tensor_descriptor``, written to global scratch), as the generated kernels do.

Backward (one key tile per program, the structure of the generated dk/dv kernel):
- ``dkdv``: dk/dv only (what our dk/dv kernel does; our dq kernel comes on top);
- ``fused``: dk/dv plus dq accumulated in fp32 with atomics (pointer atomics or a descriptor's
  atomic_add, the bulk tensor reduction on Hopper), then scaled and cast: 5 matmuls per block
  instead of the 7 of the two-kernel design, not deterministic.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _rows(T, rows, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    # a descriptor over the (rows, HEAD_DIM) contiguous view of a (B*H*N, D) tensor
    return tl.make_tensor_descriptor(T, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK, HEAD_DIM])


# ---- forward ---------------------------------------------------------------------------------

@triton.jit
def _fwd_band(acc, m_i, l_i, q, i, kd, vd, row0, lo, hi, qk_scale, WINDOW: tl.constexpr,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, MODE: tl.constexpr):
    # MODE 0 base, 1 fold, 2 lazy
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        k = kd.load([row0 + start, 0])
        v = vd.load([row0 + start, 0])
        s = tl.dot(q, tl.trans(k))
        if MODE == 0:
            s = s * qk_scale
        if MASKED:
            j = start + offs_n
            vis = (i[:, None] >= j[None, :]) & (i[:, None] - j[None, :] < WINDOW)
            s = tl.where(vis, s, float("-inf"))
        if MODE == 0:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        elif MODE == 1:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            if tl.max(m_new - m_i, 0) > 8.0:
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
                m_i = m_new
            p = tl.math.exp2(s * qk_scale - m_i[:, None])
            l_i = l_i + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_i, l_i


@triton.jit
def _fwd_band_pipe(acc, m_i, l_i, q, kd, vd, row0, lo, hi, qk_scale, BLOCK_N: tl.constexpr):
    # unmasked band, fold, with the next QK^T issued before this block's PV (one extra QK^T at
    # the end of the band)
    k = kd.load([row0 + lo, 0])
    s = tl.dot(q, tl.trans(k))
    for start in range(lo, hi, BLOCK_N):
        v = vd.load([row0 + start, 0])
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        k_next = kd.load([row0 + start + BLOCK_N, 0])
        s = tl.dot(q, tl.trans(k_next))
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _win_fwd(Q, K, V, O, LSE, N, BH, qk_scale, WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, PIPE: tl.constexpr,
             HOST: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    a0 = pid_m * BLOCK_M
    row0 = pid_bh * N
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    i = a0 + offs_m
    if HOST:
        # Q, K, V: descriptors built on the host over the (B*H*N, D) rows
        kd = K
        vd = V
        q = Q.load([row0 + a0, 0])
    else:
        kd = _rows(K, BH * N, HEAD_DIM, BLOCK_N)
        vd = _rows(V, BH * N, HEAD_DIM, BLOCK_N)
        q = _rows(Q, BH * N, HEAD_DIM, BLOCK_M).load([row0 + a0, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_lo = tl.maximum(a0 + BLOCK_M - WINDOW, 0)
    edge_lo = tl.maximum(a0 - WINDOW, 0)
    # diagonal first (every row sees its own key: m finite afterwards), then the band, then the edge
    acc, m_i, l_i = _fwd_band(acc, m_i, l_i, q, i, kd, vd, row0, a0, a0 + BLOCK_M, qk_scale, WINDOW,
                              BLOCK_N, True, MODE)
    if PIPE:
        acc, m_i, l_i = _fwd_band_pipe(acc, m_i, l_i, q, kd, vd, row0, full_lo, a0, qk_scale, BLOCK_N)
    else:
        acc, m_i, l_i = _fwd_band(acc, m_i, l_i, q, i, kd, vd, row0, full_lo, a0, qk_scale, WINDOW,
                                  BLOCK_N, False, MODE)
    acc, m_i, l_i = _fwd_band(acc, m_i, l_i, q, i, kd, vd, row0, edge_lo, full_lo, qk_scale, WINDOW,
                              BLOCK_N, True, MODE)
    o = acc / l_i[:, None]
    tl.store(O + (row0 + i).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], o.to(O.dtype.element_ty))
    tl.store(LSE + pid_bh.to(tl.int64) * N + i, (m_i + tl.log2(l_i)) * 0.6931471805599453)


def fwd(q, k, v, window, mode, pipe, bm=128, bn=128, warps=8, stages=3, host=False):
    b, h, n, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    if host:
        from triton.tools.tensor_descriptor import TensorDescriptor

        q, k, v = (TensorDescriptor.from_tensor(t.reshape(-1, d), [blk, d]) for t, blk in ((q, bm), (k, bn), (v, bn)))
    _win_fwd[(n // bm, b * h)](q, k, v, o, lse, n, b * h, d ** -0.5 * LOG2E, WINDOW=window, HEAD_DIM=d,
                               BLOCK_M=bm, BLOCK_N=bn, MODE=mode, PIPE=pipe, HOST=host, num_warps=warps,
                               num_stages=stages)
    return o, lse


# ---- backward --------------------------------------------------------------------------------

@triton.jit
def _bwd_band(dk, dv, k, v, j, qd, dod, dqd, DQ, LSE, DELTA, row0, lo, hi, qk_scale, WINDOW: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, DQ_MODE: tl.constexpr):
    # DQ_MODE 0: no dq; 1: pointer atomics; 2: descriptor atomic_add
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_M):
        q = qd.load([row0 + start, 0])
        do = dod.load([row0 + start, 0])
        i = start + offs_m
        lse2 = tl.load(LSE + row0 + i) * 1.4426950408889634
        delta = tl.load(DELTA + row0 + i)
        st = tl.dot(k, tl.trans(q))
        pt = tl.math.exp2(st * qk_scale - lse2[None, :])
        if MASKED:
            vis = (i[None, :] >= j[:, None]) & (i[None, :] - j[:, None] < WINDOW)
            pt = tl.where(vis, pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv)
        dpt = tl.dot(v, tl.trans(do))
        dst = (pt * (dpt - delta[None, :])).to(q.dtype)
        dk = tl.dot(dst, q, dk)
        if DQ_MODE > 0:
            dq = tl.dot(tl.trans(dst), k)
            if DQ_MODE == 1:
                tl.atomic_add(DQ + (row0 + i).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], dq, sem="relaxed")
            else:
                dqd.atomic_add([row0 + start, 0], dq)
    return dk, dv


@triton.jit
def _win_bwd(Q, K, V, DO, LSE, DELTA, DK, DV, DQ, N, BH, qk_scale, sm_scale, WINDOW: tl.constexpr,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DQ_MODE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b0 = pid_n * BLOCK_N
    row0 = pid_bh * N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    j = b0 + offs_n
    qd = _rows(Q, BH * N, HEAD_DIM, BLOCK_M)
    dod = _rows(DO, BH * N, HEAD_DIM, BLOCK_M)
    dqd = _rows(DQ, BH * N, HEAD_DIM, BLOCK_M)
    k = _rows(K, BH * N, HEAD_DIM, BLOCK_N).load([row0 + b0, 0])
    v = _rows(V, BH * N, HEAD_DIM, BLOCK_N).load([row0 + b0, 0])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    diag_hi = tl.minimum(b0 + BLOCK_N, N)
    full_hi = tl.minimum(b0 + WINDOW, N)
    edge_hi = tl.minimum(b0 + WINDOW + BLOCK_N, N)
    dk, dv = _bwd_band(dk, dv, k, v, j, qd, dod, dqd, DQ, LSE, DELTA, row0, b0, diag_hi, qk_scale, WINDOW,
                       HEAD_DIM, BLOCK_M, True, DQ_MODE)
    dk, dv = _bwd_band(dk, dv, k, v, j, qd, dod, dqd, DQ, LSE, DELTA, row0, diag_hi, full_hi, qk_scale, WINDOW,
                       HEAD_DIM, BLOCK_M, False, DQ_MODE)
    dk, dv = _bwd_band(dk, dv, k, v, j, qd, dod, dqd, DQ, LSE, DELTA, row0, full_hi, edge_hi, qk_scale, WINDOW,
                       HEAD_DIM, BLOCK_M, True, DQ_MODE)
    rows = (row0 + j).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + rows, (dk * sm_scale).to(DK.dtype.element_ty))
    tl.store(DV + rows, dv.to(DV.dtype.element_ty))


def bwd(q, k, v, o, do, lse, window, dq_mode, bm, bn, warps, stages):
    b, h, n, d = q.shape
    delta = (o.float() * do.float()).sum(-1)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    scale = d ** -0.5
    _win_bwd[(n // bn, b * h)](q, k, v, do, lse, delta, dk, dv, dq_acc, n, b * h, scale * LOG2E, scale,
                               WINDOW=window, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, DQ_MODE=dq_mode,
                               num_warps=warps, num_stages=stages)
    dq = (dq_acc * scale).to(q.dtype) if dq_mode else None
    return dq, dk, dv


# name, mode, pipe, stages, BLOCK_N, host-built descriptors
FWD_VARIANTS = [("base", 0, False, 3, 128, False), ("fold", 1, False, 3, 128, False),
                ("fold, host descriptors", 1, False, 3, 128, True)]
# measured in run 15a (NOTES.md) and slower than fold; --rejected times them again (with 3 stages
# pipe needs 257 KiB of shared memory)
FWD_REJECTED = [("lazy", 2, False, 3, 128, False), ("base", 0, False, 2, 128, False), ("pipe", 1, True, 2, 128, False)]
# run 16 (--n64): 128 x 64 tiles leave shared memory for deeper pipelines, with and without the
# manual QK^T / PV overlap
FWD_N64 = [("fold", 1, False, 3, 64, False), ("fold", 1, False, 4, 64, False), ("pipe", 1, True, 3, 64, False),
           ("pipe", 1, True, 4, 64, False)]
BWD_VARIANTS = [
    # name, dq_mode, block_m, block_n, warps, stages
    ("dkdv", 0, 32, 64, 4, 2), ("dkdv", 0, 64, 128, 8, 2), ("dkdv", 0, 32, 128, 8, 2), ("dkdv", 0, 64, 64, 4, 2),
    ("fused ptr", 1, 32, 64, 4, 2), ("fused ptr", 1, 64, 128, 8, 2), ("fused ptr", 1, 32, 128, 8, 2),
    ("fused ptr", 1, 64, 64, 4, 2), ("fused desc", 2, 32, 64, 4, 2), ("fused desc", 2, 64, 128, 8, 2),
    ("fused desc", 2, 32, 128, 8, 2), ("fused desc", 2, 64, 64, 4, 2), ("fused desc", 2, 64, 128, 8, 1),
    ("fused desc", 2, 128, 128, 8, 2),
]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _measure(label, run, error, bench, tflops, base):
    """Check one variant against our kernels' result, then time it; a failure is reported."""
    try:
        err = error(run())
        if not err < 2e-2:
            raise RuntimeError(f"wrong result: {err:.2e}")
        ms = bench(run)
        print(f"{label:40s} {ms:8.3f} {tflops(ms):6.0f} {ms / base:6.3f} {err:8.1e}", flush=True)
    except Exception as e:   # reported, never dropped
        print(f"{label:40s} failed: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--only", choices=["fwd", "bwd"])
    ap.add_argument("--rejected", action="store_true", help="also the forward variants run 15a rejected")
    ap.add_argument("--n64", action="store_true", help="also the forward variants with 128 x 64 tiles (run 16)")
    args = ap.parse_args(argv)
    import msa_codegen as msa
    from msa_codegen.ops import _ensure_allocator

    _ensure_allocator()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float16
    n, h, d, w = args.n, args.heads, 128, args.window
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(1, h, n, d, device=dev, dtype=dt, generator=g) for _ in range(4))
    pattern = f"window={w}"
    pairs = h * (w * n - w * (w - 1) // 2)
    tf = lambda ms, mult: mult * 4 * d * pairs / ms * 1e-9
    bench = (lambda fn: triton.testing.do_bench(fn, rep=args.rep)) if dev == "cuda" else (lambda fn: (fn(), 1.0)[1])
    for t in (q, k, v):
        t.requires_grad_()
    ref, ref_lse = msa.attention(q, k, v, pattern, return_lse=True)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), do)
    q, k, v = q.detach(), k.detach(), v.detach()
    print(f"{'variant':40s} {'ms':>8s} {'TF/s':>6s} {'/ours':>6s} {'rel err':>8s}", flush=True)
    if args.only != "bwd":
        import msa_codegen.ops as ops

        base = bench(lambda: msa.attention(q, k, v, pattern))
        print(f"{'ours fwd ' + pattern:40s} {base:8.3f} {tf(base, 1):6.0f} {1.0:6.3f}", flush=True)
        # our kernel with the scale not folded, then folded again: the A/B of the template's FOLD
        for fold in (False, True):
            ops.FOLD_SCALE = fold
            ms = bench(lambda: msa.attention(q, k, v, pattern))
            print(f"{'ours fwd, FOLD_SCALE=' + str(fold):40s} {ms:8.3f} {tf(ms, 1):6.0f} {ms / base:6.3f}", flush=True)
        err = lambda res: max(_rel(res[0], ref), (res[1] - ref_lse).abs().max().item())
        for name, mode, pipe, st, bn, host in (FWD_VARIANTS + (FWD_REJECTED if args.rejected else [])
                                               + (FWD_N64 if args.n64 else [])):
            run = lambda: fwd(q, k, v, w, mode, pipe, bn=bn, stages=st, host=host)
            _measure(f"fwd {name} M128 N{bn} s{st} w8", run, err, bench, lambda ms: tf(ms, 1), base)
    if args.only != "fwd":
        o = ref.detach()
        lse = ref_lse.detach()
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = msa.attention(qq, kk, vv, pattern)
        base = bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
        print(f"{'ours bwd ' + pattern:40s} {base:8.3f} {tf(base, 2.5):6.0f} {1.0:6.3f}", flush=True)
        for name, mode, bm, bn, warps, stages in BWD_VARIANTS:
            run = lambda: bwd(q, k, v, o, do, lse, w, mode, bm, bn, warps, stages)
            err = lambda res: max(_rel(res[1], rk), _rel(res[2], rv), _rel(res[0], rq) if res[0] is not None else 0.0)
            _measure(f"bwd {name} M{bm} N{bn} w{warps} s{stages}", run, err, bench, lambda ms: tf(ms, 2.5), base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
