"""Probe (issue 4): would tensor-descriptor loads and warp specialisation speed up the window forward?

    PYTHONPATH=$PWD python3 benchmarks/ws_probe.py [--n 131072] [--window 4096] [--rep 200]

A stand-alone causal sliding-window forward (B=1, H=16, D=128, bf16; N a multiple of 128 and
the window a multiple of 128) written three ways, each timed against msa_codegen's own
generated forward for ``window=W`` in the same process:

- ``ptr``: pointer loads, like the generated kernels (the baseline inside the probe);
- ``desc``: K/V/Q through on-device tensor descriptors (``tl.make_tensor_descriptor``: TMA on
  Hopper), software-pipelined;
- ``desc+ws``: the same loops with ``tl.range(..., warp_specialize=True)`` (a producer warp
  issues the TMA loads, the other warps compute).

Each tile of BLOCK_M query rows walks three key ranges: the lower edge of the window (masked),
the keys every row sees (unmasked) and the diagonal (masked). Output and LSE are compared with
msa_codegen's; the table gives ms, effective TFLOP/s (4 * D * H * visible pairs) and the ratio
to msa_codegen. Needs a Hopper (or newer) GPU; a variant that fails to compile is reported.
Not part of the package: it measures whether the template rewrite is worth doing.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _band(acc, m_i, l_i, q, i, K, V, kd, vd, kv_row0, lo, hi, qk_scale, stride_n, WINDOW: tl.constexpr,
          HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DESC: tl.constexpr,
          WS: tl.constexpr, STAGES: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        if DESC:
            k = kd.load([kv_row0 + start, 0])
            v = vd.load([kv_row0 + start, 0])
        else:
            rows = (kv_row0 + start + offs_n).to(tl.int64)
            k = tl.load(K + rows[:, None] * stride_n + offs_d[None, :])
            v = tl.load(V + rows[:, None] * stride_n + offs_d[None, :])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            j = start + offs_n
            vis = (i[:, None] >= j[None, :]) & (i[:, None] - j[None, :] < WINDOW)
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _win_fwd(Q, K, V, O, LSE, N, BH, qk_scale, stride_n, WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DESC: tl.constexpr, WS: tl.constexpr,
             STAGES: tl.constexpr, CONST_STRIDE: tl.constexpr):
    if CONST_STRIDE:
        stride_n = HEAD_DIM
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    a0 = pid_m * BLOCK_M
    row0 = pid_bh * N                 # q, k, v, o are (B*H*N, D), rows of one head contiguous
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    i = a0 + offs_m
    if DESC:
        qd = tl.make_tensor_descriptor(Q, shape=[BH * N, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
        kd = tl.make_tensor_descriptor(K, shape=[BH * N, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
        vd = tl.make_tensor_descriptor(V, shape=[BH * N, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
        q = qd.load([row0 + a0, 0])
    else:
        kd = K
        vd = V
        q = tl.load(Q + (row0 + i).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # keys every row of the tile sees: [a0 + BLOCK_M - WINDOW, a0); lower edge below, diagonal above
    full_lo = tl.maximum(a0 + BLOCK_M - WINDOW, 0)
    edge_lo = tl.maximum(a0 - WINDOW, 0)
    # order: unmasked band, diagonal, lower edge; every row has seen its own key before the
    # edge, whose first blocks some rows see nothing of (so m stays finite: no NaN guard)
    acc, m_i, l_i = _band(acc, m_i, l_i, q, i, K, V, kd, vd, row0, full_lo, a0, qk_scale, stride_n, WINDOW,
                          HEAD_DIM, BLOCK_N, False, DESC, WS, STAGES)
    acc, m_i, l_i = _band(acc, m_i, l_i, q, i, K, V, kd, vd, row0, a0, a0 + BLOCK_M, qk_scale, stride_n, WINDOW,
                          HEAD_DIM, BLOCK_N, True, DESC, WS, STAGES)
    acc, m_i, l_i = _band(acc, m_i, l_i, q, i, K, V, kd, vd, row0, edge_lo, full_lo, qk_scale, stride_n, WINDOW,
                          HEAD_DIM, BLOCK_N, True, DESC, WS, STAGES)
    o = acc / l_i[:, None]
    tl.store(O + (row0 + i).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], o.to(O.dtype.element_ty))
    tl.store(LSE + pid_bh.to(tl.int64) * N + i, (m_i + tl.log2(l_i)) * 0.6931471805599453)


def run(q, k, v, window, block_m, block_n, desc, ws, stages, warps, const_stride=True):
    b, h, n, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    # const_stride: the row stride of K/V is the constexpr HEAD_DIM (folded); else the run-time
    # argument, as in the generated kernels (pointer loads only)
    _win_fwd[(n // block_m, b * h)](q, k, v, o, lse, n, b * h, d ** -0.5 * 1.4426950408889634, d,
                                    WINDOW=window, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, DESC=desc,
                                    WS=ws, STAGES=stages, CONST_STRIDE=const_stride, num_warps=warps)
    return o, lse


VARIANTS = [
    # name, block_m, block_n, desc, ws, stages, warps, const_stride
    # (run 10, 2026-12-01: every desc+ws variant with 4 warps failed in Triton 3.6's
    # NVGPUWarpSpecialization pass; not repeated here)
    ("ptr", 128, 64, False, False, 3, 8, True),
    ("ptr, run-time stride", 128, 64, False, False, 3, 8, False),
    ("desc", 128, 64, True, False, 3, 8, True),
    ("desc", 128, 128, True, False, 3, 8, True),
    ("desc+ws", 128, 64, True, True, 3, 8, True),
    ("desc+ws", 128, 64, True, True, 4, 8, True),
    ("desc+ws", 128, 128, True, True, 3, 8, True),
    ("desc+ws", 128, 128, True, True, 4, 8, True),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--rep", type=int, default=200)
    args = ap.parse_args(argv)
    import msa_codegen as msa

    # on-device descriptors need a global scratch allocation
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    n, h, d, w = args.n, args.heads, 128, args.window
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    pattern = f"window={w}"
    ref, ref_lse = msa.attention(q, k, v, pattern, return_lse=True)
    pairs = h * (w * n - w * (w - 1) // 2)
    tflops = lambda ms: 4 * d * pairs / ms * 1e-9
    base = triton.testing.do_bench(lambda: msa.attention(q, k, v, pattern), rep=args.rep)
    rows = [("msa_codegen " + pattern, "-", base, tflops(base), 1.0, 0.0)]
    print(f"{'variant':34s} {'ms':>8s} {'TF/s':>6s} {'/ours':>6s} {'rel err':>8s}", flush=True)
    print(f"{rows[0][0]:34s} {base:8.3f} {tflops(base):6.0f} {1.0:6.3f}", flush=True)
    for name, bm, bn, desc, ws, stages, warps, cs in VARIANTS:
        label = f"{name} M{bm} N{bn} s{stages} w{warps}"
        try:
            o, lse = run(q, k, v, w, bm, bn, desc, ws, stages, warps, cs)
            err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
            lse_err = (lse - ref_lse).abs().max().item()
            if not (err < 2e-2 and lse_err < 1e-2):
                raise RuntimeError(f"wrong result: rel err {err:.2e}, LSE max abs err {lse_err:.2e}")
            ms = triton.testing.do_bench(lambda: run(q, k, v, w, bm, bn, desc, ws, stages, warps, cs),
                                         rep=args.rep)
            print(f"{label:34s} {ms:8.3f} {tflops(ms):6.0f} {ms / base:6.3f} {err:8.1e}", flush=True)
        except Exception as e:   # reported, never dropped
            print(f"{label:34s} failed: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
