"""Probe (issue 22): can Triton 3.6's Gluon run a warp-specialised Hopper attention forward?

    PYTHONPATH=$PWD python benchmarks/gluon_probe.py                  # every stage, H100/H200
    PYTHONPATH=$PWD python benchmarks/gluon_probe.py --stages attn_ws2,attn_nows
    PYTHONPATH=$PWD python benchmarks/gluon_probe.py --stages issue22 # backward + forward leads
    PYTHONPATH=$PWD python benchmarks/gluon_probe.py --aot [--only bwd_,attn_ws2p]  # no GPU: sm_90

Each stage runs in its own subprocess under a timeout, so that a hang or a fault in one is
recorded and the next still runs. From simple to the goal:

- ``copy``: TMA load (mbarrier expect/wait) -> registers -> shared -> TMA store;
- ``gemm``: one warpgroup, ``warpgroup_mma`` on TMA-loaded tiles, C = A B^T, vs torch;
- ``gemm_ws``: ``gl.warp_specialize``: a 1-warp TMA producer fills a ring of shared buffers
  (ready/empty mbarriers), an 8-warp consumer runs ``warpgroup_mma``; 8192^3 bf16 TFLOP/s
  against torch.matmul in the same process;
- ``attn_*``: the causal sliding-window forward (query i sees keys i-W < j <= i), bf16,
  D=128, online softmax, output and LSE (natural log of the scaled scores), 128 query rows and
  128-key tiles a program. One TMA producer warp streams K and V tiles through a ring; the
  consumers run S = Q K^T and O += P V by ``warpgroup_mma`` with the product P_{j-1} V_{j-1}
  issued together with S_j, so that the softmax of S_j overlaps it (FA3's intra-warpgroup
  overlap). Variants: ``attn_ws1x8`` one 8-warp consumer (two warpgroups in one partition);
  ``attn_ws2`` two 4-warp consumer partitions of 64 rows each; ``attn_ws2pp`` the same with
  FA3's ping-pong (the two consumers take turns issuing their products, through two
  mbarriers); ``attn_nows`` the same consumer code without warp specialisation (the consumer
  issues the TMA loads itself, ``STAGES`` tiles ahead). Each checks output and LSE against an
  fp32 torch reference (N=4096 W=1024, N=8192 W=4096) and against ``msa_codegen.attention`` at
  N=131072 (every 16th row), then times both at B=1, H=16, N=131072, W=4096;
- ``flex``: FlexAttention with the sliding-window BlockMask at the same size, timed with ours;
- issue 22's leads toward 600 TF/s (``--stages issue22`` runs them after the backward):
  ``attn_ws2f`` attn_ws2 with the softmax scale folded into exp2's argument (one FFMA an
  element instead of an FMUL and an FADD); ``attn_ws2p`` attn_ws2 made persistent (one program
  an SM walking query tiles; the producer loads the next tile's Q and K/V under this tile's
  last product and epilogue; O leaves through its own buffer by an asynchronous TMA store);
  ``attn_ws2pf`` both; ``attn_ws2n256`` 256-key tiles (ring of 1; spills, see ``--aot``);
  ``attn_ws2x128`` (``--aot`` only) two consumers of 128 rows, which cannot fit in registers;
- ``bwd_dkdv``, ``bwd_dq``, ``flex_bwd``: the backward, in ``gluon_probe_bwd.py``.

Effective TFLOP/s = 4 D H pairs / time, pairs = W N - W (W-1) / 2 (docs/performance.md "FLOP
formulas"), also given as a fraction of the bf16 matmul rate measured in the same process.
The closing table shows stage, compiled, correct (max rel error), time / TFLOP/s and the
first lines of the error of a failed stage; $OUT/gluon_probe.json gets everything when OUT is
set. Not part of the package.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# Register budget of the warp-specialised kernels: 9 warps round up to 3 warpgroups; at
# maxnreg=168 the file holds 168 * 12 * 32 = 64512 registers; the 1-warp producer asks for 24,
# which leaves 240 a thread to the consumer warpgroups (setmaxnreg moves them).
WS_MAXNREG = 168
PRODUCER_REGS = gl.constexpr(24)
CONSUMER_REGS = gl.constexpr(240)


# --------------------------------------------------------------------------------------------
# stage copy: TMA in, through registers, TMA out
# --------------------------------------------------------------------------------------------
@gluon.jit
def copy_kernel(in_desc, out_desc):
    BM: gl.constexpr = in_desc.block_type.shape[0]
    BN: gl.constexpr = in_desc.block_type.shape[1]
    off_m = gl.program_id(0) * BM
    off_n = gl.program_id(1) * BN
    smem = gl.allocate_shared_memory(in_desc.dtype, [BM, BN], in_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, in_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(in_desc, [off_m, off_n], bar, smem)
    mbarrier.wait(bar, 0)
    mbarrier.invalidate(bar)
    # 4 warps, 8 contiguous bf16 a thread
    reg_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    # [BM, BN]
    b_x = smem.load(reg_layout)
    smem.store(b_x * 2.0)
    fence_async_shared()  # generic-proxy store before the async-proxy (TMA) read
    tma.async_copy_shared_to_global(out_desc, [off_m, off_n], smem)
    tma.store_wait(0)


# --------------------------------------------------------------------------------------------
# stage gemm: one warpgroup, C = A B^T, A [M, K], B [N, K] (K-major, like attention's K)
# --------------------------------------------------------------------------------------------
@gluon.jit
def gemm_kernel(a_desc, b_desc, c_desc, K):
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    off_m = gl.program_id(0) * BM
    off_n = gl.program_id(1) * BN
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [BM, BK], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [BN, BK], b_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)
    phase = 0
    for k in range(0, K, BK):
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_smem)
        tma.async_copy_global_to_shared(b_desc, [off_n, k], bar, b_smem)
        mbarrier.wait(bar, phase)
        phase ^= 1
        acc = warpgroup_mma(a_smem, b_smem.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, a_smem, b_smem))[0]
    mbarrier.invalidate(bar)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
    c_smem.store(acc)
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
    tma.store_wait(0)


# --------------------------------------------------------------------------------------------
# stage gemm_ws: 1-warp TMA producer + 8-warp wgmma consumer, STAGES-deep ring
# --------------------------------------------------------------------------------------------
@gluon.jit
def _gemm_ws_producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, K):
    BK: gl.constexpr = a_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    num_k = gl.cdiv(K, BK)
    for i in range(num_k):
        slot = i % STAGES
        phase = (i // STAGES) & 1
        # a fresh mbarrier counts as having completed the phase before phase 0
        mbarrier.wait(empty.index(slot), phase ^ 1)
        mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, i * BK], ready.index(slot), a_bufs.index(slot))
        tma.async_copy_global_to_shared(b_desc, [off_n, i * BK], ready.index(slot), b_bufs.index(slot))


@gluon.jit
def _gemm_ws_consumer(c_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, K):
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                         instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)
    num_k = gl.cdiv(K, BK)
    for i in range(num_k):
        slot = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(ready.index(slot), phase)
        a = a_bufs.index(slot)
        b = b_bufs.index(slot)
        acc = warpgroup_mma(a, b.permute((1, 0)), acc, is_async=True)
        # keep one product in flight; the one before it has finished reading its slot
        acc = warpgroup_mma_wait(1, deps=(acc, a, b))[0]
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
    tma.store_wait(0)


@gluon.jit
def gemm_ws_kernel(a_desc, b_desc, c_desc, K, STAGES: gl.constexpr):
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    off_m = gl.program_id(0) * BM
    off_n = gl.program_id(1) * BN
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_gemm_ws_consumer, (c_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, K)),
        (_gemm_ws_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, K)),
    ], [1], [PRODUCER_REGS])


# --------------------------------------------------------------------------------------------
# stage attn_*: causal sliding-window forward
#
#   program: 128 query rows [q0, q0 + 128) of one (batch, head); key tiles kb_lo .. kb_hi - 1:
#
#        keys ->   kb_lo                              kb_hi-1
#     q0       [ \\\\\\ | ######## ... ######## | #\      ]   \ = edge of the window (j > i - W)
#     q0+127   [    \\\ | ######## ... ######## | ####\   ]   # = all visible; masked tiles are
#                 masked                           masked       the first and the diagonal ones
#
# q, k, v, o are 2-D views [B*H*N, D] (N a multiple of 128, so no tile crosses a head).
# --------------------------------------------------------------------------------------------
@gluon.jit
def _attn_producer(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, row_base, kb_lo, kb_hi,
                   c_base=0):
    """Streams K and V tiles kb_lo .. kb_hi - 1 through the ring; c_base: tiles the ring has
    already carried (a persistent program's earlier work), so that slots and phases continue."""
    BN: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    for kb in range(kb_lo, kb_hi):
        c = c_base + kb - kb_lo
        slot = c % STAGES
        phase = (c // STAGES) & 1
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row_base + kb * BN, 0], k_ready.index(slot), k_bufs.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row_base + kb * BN, 0], v_ready.index(slot), v_bufs.index(slot))


@gluon.jit
def _attn_bounds(q0, N, W, BM: gl.constexpr, BN: gl.constexpr):
    """Key tiles of the query tile [q0, q0 + BM) (closed form, no mask tables): the band
    [kb_lo, kb_hi) and its unmasked middle [kb_full_lo, kb_full_hi)."""
    kb_lo = gl.maximum(q0 - W + 1, 0) // BN
    kb_hi = gl.cdiv(gl.minimum(q0 + BM, N), BN)
    kb_full_lo = gl.cdiv(gl.maximum(q0 + BM - W, 0), BN)  # first tile entirely inside every row's window
    kb_full_hi = (q0 + 1) // BN  # first tile reaching past the diagonal of row q0
    return kb_lo, kb_hi, kb_full_lo, kb_full_hi


@gluon.jit
def _attn_scores(s_acc, q0, kb, kb_full_lo, kb_full_hi, m_i, l_i, qk_scale, W,
                 ROW_OFF: gl.constexpr, BMC: gl.constexpr, BN: gl.constexpr, s_layout: gl.constexpr,
                 p_layout: gl.constexpr, FOLD: gl.constexpr = False):
    """Online-softmax step on one finished S tile: returns P (bf16, wgmma A-operand layout),
    the rescale factor of O, and the new running max and sum (log2 domain).
    FOLD: scale the row max instead of the tile, so that exp2's argument is one FFMA
    (s * scale - m, as FA3 does) instead of an FMUL feeding both the max and an FADD."""
    s = s_acc if FOLD else s_acc * qk_scale
    if (kb < kb_full_lo) | (kb >= kb_full_hi):
        # [BMC] rows, [BN] columns of this tile
        o_i = q0 + ROW_OFF + gl.arange(0, BMC, layout=gl.SliceLayout(1, s_layout))
        o_j = kb * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        delta = gl.expand_dims(o_i, 1) - gl.expand_dims(o_j, 0)
        m_vis = (delta >= 0) & (delta < W)
        s = gl.where(m_vis, s, -float("inf"))
    s_max = gl.max(s, axis=1)
    if FOLD:
        s_max = s_max * qk_scale  # qk_scale > 0: the max commutes with the scale
    m_new = gl.maximum(m_i, s_max)
    # a row with nothing visible so far keeps m = -inf: subtract 0 instead (no inf - inf)
    m_safe = gl.where(m_new > -float("inf"), m_new, 0.0)
    alpha = gl.exp2(m_i - m_safe)
    if FOLD:
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_safe, 1))
    else:
        p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    l_new = l_i * alpha + gl.sum(p, axis=1)
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    return p_op, alpha, m_new, l_new


@gluon.jit
def _attn_mainloop(q_smem, k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, pp_bars, q_empty,
                   row_base, q0, kb_lo, kb_hi, kb_full_lo, kb_full_hi, W, qk_scale, c_base,
                   ROW_OFF: gl.constexpr, NWARPS: gl.constexpr, ROLE: gl.constexpr, PINGPONG: gl.constexpr,
                   INLINE_LOADS: gl.constexpr, FOLD: gl.constexpr, RELEASE_Q: gl.constexpr):
    """The key loop of one query tile (Q already in q_smem): returns O (unnormalised, fp32),
    the running max and sum. c_base: ring tiles consumed before this tile (persistent programs);
    RELEASE_Q: arrive on q_empty once the last product reading Q has finished, so that the
    producer can load the next tile's Q while this one's last P V and epilogue run."""
    BMC: gl.constexpr = q_smem.type.shape[0]
    D: gl.constexpr = q_smem.type.shape[1]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NWARPS, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NWARPS, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    n_blocks = kb_hi - kb_lo

    s_zero = gl.zeros([BMC, BN], gl.float32, s_layout)
    o_acc = gl.zeros([BMC, D], gl.float32, o_layout)
    m_i = gl.full([BMC], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BMC], gl.float32, gl.SliceLayout(1, s_layout))

    # prologue: S_0 and its softmax (nothing to rescale yet)
    slot0 = c_base % STAGES
    mbarrier.wait(k_ready.index(slot0), (c_base // STAGES) & 1)
    k_buf = k_bufs.index(slot0)
    s_acc = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s_acc = warpgroup_mma_wait(0, deps=(s_acc, k_buf))[0]
    if RELEASE_Q:
        mbarrier.arrive(q_empty, pred=n_blocks == 1)
    if INLINE_LOADS:
        gl.thread_barrier()  # every warpgroup's product on this slot has finished
        if STAGES < n_blocks:
            mbarrier.expect(k_ready.index(0), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row_base + (kb_lo + STAGES) * BN, 0], k_ready.index(0), k_buf)
    else:
        mbarrier.arrive(k_empty.index(slot0))
    p_op, alpha, m_i, l_i = _attn_scores(s_acc, q0, kb_lo, kb_full_lo, kb_full_hi, m_i, l_i, qk_scale, W, ROW_OFF,
                                         BMC, BN, s_layout, p_layout, FOLD)

    # steady state: issue S_c and P_{c-1} V_{c-1}; softmax of S_c while the second runs
    for c in range(1, n_blocks):
        kb = kb_lo + c
        slot = (c_base + c) % STAGES
        phase = ((c_base + c) // STAGES) & 1
        pslot = (c_base + c - 1) % STAGES
        pphase = ((c_base + c - 1) // STAGES) & 1
        k_buf = k_bufs.index(slot)
        v_prev = v_bufs.index(pslot)
        mbarrier.wait(k_ready.index(slot), phase)
        mbarrier.wait(v_ready.index(pslot), pphase)
        if PINGPONG:
            # take turns issuing the products: consumer 0 goes first
            mbarrier.wait(pp_bars.index(ROLE), ((c - 1) & 1) ^ (1 - ROLE))
        p_prev = p_op
        s_acc = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        o_acc = warpgroup_mma(p_prev, v_prev, o_acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(pp_bars.index(1 - ROLE))
        # groups complete in order: with one left in flight, S_c is done
        s_acc = warpgroup_mma_wait(1, deps=(s_acc, k_buf))[0]
        if RELEASE_Q:
            mbarrier.arrive(q_empty, pred=c == n_blocks - 1)
        if INLINE_LOADS:
            gl.thread_barrier()
            if c + STAGES < n_blocks:
                mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [row_base + (kb + STAGES) * BN, 0], k_ready.index(slot),
                                                k_buf)
        else:
            mbarrier.arrive(k_empty.index(slot))
        p_op, alpha_c, m_i, l_i = _attn_scores(s_acc, q0, kb, kb_full_lo, kb_full_hi, m_i, l_i, qk_scale, W, ROW_OFF,
                                               BMC, BN, s_layout, p_layout, FOLD)
        o_acc = warpgroup_mma_wait(0, deps=(o_acc, v_prev, p_prev))[0]
        if INLINE_LOADS:
            gl.thread_barrier()
            if c - 1 + STAGES < n_blocks:
                mbarrier.expect(v_ready.index(pslot), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [row_base + (kb - 1 + STAGES) * BN, 0], v_ready.index(pslot),
                                                v_prev)
        else:
            mbarrier.arrive(v_empty.index(pslot))
        o_acc = o_acc * gl.expand_dims(gl.convert_layout(alpha_c, gl.SliceLayout(1, o_layout)), 1)

    # the last P V
    lslot = (c_base + n_blocks - 1) % STAGES
    lphase = ((c_base + n_blocks - 1) // STAGES) & 1
    v_last = v_bufs.index(lslot)
    mbarrier.wait(v_ready.index(lslot), lphase)
    o_acc = warpgroup_mma(p_op, v_last, o_acc, is_async=True)
    o_acc = warpgroup_mma_wait(0, deps=(o_acc, v_last, p_op))[0]
    if not INLINE_LOADS:
        mbarrier.arrive(v_empty.index(lslot))
    return o_acc, m_i, l_i


@gluon.jit
def _attn_epilogue(o_desc, o_smem, lse_ptr, o_acc, m_i, l_i, row_base, q0, N, ROW_OFF: gl.constexpr,
                   ASYNC_STORE: gl.constexpr):
    """O / l (zeros where nothing is visible), LSE = ln(sum exp(scaled score)) (-inf where empty),
    O through o_smem by TMA. ASYNC_STORE: leave the store in flight (the next tile's first wait
    on it is tma.store_wait before o_smem is written again)."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_acc.type.layout))
    inv_l = gl.where(l_o > 0.0, 1.0 / l_o, 0.0)
    o_out = (o_acc * gl.expand_dims(inv_l, 1)).to(o_desc.dtype)
    lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_i)) * 0.6931471805599453, -float("inf"))
    o_i = q0 + ROW_OFF + gl.arange(0, o_smem.type.shape[0], layout=l_i.type.layout)
    gl.store(lse_ptr + row_base + o_i, lse, mask=o_i < N)
    if ASYNC_STORE:
        tma.store_wait(0)  # the previous tile's store has finished reading o_smem
    o_smem.store(o_out)
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row_base + q0 + ROW_OFF, 0], o_smem)
    if not ASYNC_STORE:
        tma.store_wait(0)


@gluon.jit
def _attn_consumer(q_desc, k_desc, v_desc, o_desc, q_smem, q_bar, k_bufs, v_bufs, k_ready, v_ready, k_empty,
                   v_empty, pp_bars, lse_ptr, row_base, q0, kb_lo, kb_hi, kb_full_lo, kb_full_hi, N, W, qk_scale,
                   ROW_OFF: gl.constexpr, NWARPS: gl.constexpr, ROLE: gl.constexpr, PINGPONG: gl.constexpr,
                   INLINE_LOADS: gl.constexpr, FOLD: gl.constexpr):
    """One consumer of one query tile: rows [q0 + ROW_OFF, q0 + ROW_OFF + BMC) with BMC =
    q_smem's rows, NWARPS warps (4: one warpgroup; 8: two warpgroups stacked along the rows)."""
    # Q: this consumer's rows, loaded once by its own TMA
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row_base + q0 + ROW_OFF, 0], q_bar, q_smem)
    mbarrier.wait(q_bar, 0)
    o_acc, m_i, l_i = _attn_mainloop(q_smem, k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                                     pp_bars, q_bar, row_base, q0, kb_lo, kb_hi, kb_full_lo, kb_full_hi, W, qk_scale,
                                     0, ROW_OFF, NWARPS, ROLE, PINGPONG, INLINE_LOADS, FOLD, False)
    # Q's buffer is free (every product that read it has finished): stage O there
    _attn_epilogue(o_desc, q_smem, lse_ptr, o_acc, m_i, l_i, row_base, q0, N, ROW_OFF, False)


@gluon.jit
def _attn_consumer_worker(q_desc, k_desc, v_desc, o_desc, q_smem, q_bar, k_bufs, v_bufs, k_ready, v_ready, k_empty,
                          v_empty, pp_bars, lse_ptr, row_base, q0, kb_lo, kb_hi, kb_full_lo, kb_full_hi, N, W,
                          qk_scale, ROW_OFF: gl.constexpr, PINGPONG: gl.constexpr, FOLD: gl.constexpr):
    _attn_consumer(q_desc, k_desc, v_desc, o_desc, q_smem, q_bar, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                   pp_bars, lse_ptr, row_base, q0, kb_lo, kb_hi, kb_full_lo, kb_full_hi, N, W, qk_scale, ROW_OFF, 4, 1,
                   PINGPONG, False, FOLD)


# persistent form (MODE 3): program p takes tiles p, p + G, ... of the B*H*(N/BM) query tiles,
# query tiles of one head consecutively (neighbours share most of their K/V band in L2)
@gluon.jit
def _attn_tile(t, n_qb, N, W, BM: gl.constexpr, BN: gl.constexpr):
    q0 = (t % n_qb) * BM
    kb_lo, kb_hi, kb_full_lo, kb_full_hi = _attn_bounds(q0, N, W, BM, BN)
    return q0, (t // n_qb) * N, kb_lo, kb_hi, kb_full_lo, kb_full_hi


@gluon.jit
def _attn_producer_persistent(q_desc, k_desc, v_desc, q_smem, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready,
                              k_empty, v_empty, N, W, BH):
    """Loads each tile's Q (both consumers' rows, one barrier) once the last tile's S products
    are done, then streams its K/V: the next tile's loads run under this tile's tail."""
    BMC: gl.constexpr = q_desc.block_type.shape[0]
    BM: gl.constexpr = 2 * BMC
    BN: gl.constexpr = k_desc.block_type.shape[0]
    n_qb = N // BM
    c_base = 0
    it = 0
    for t in range(gl.program_id(0), BH * n_qb, gl.num_programs(0)):
        q0, row_base, kb_lo, kb_hi, kb_full_lo, kb_full_hi = _attn_tile(t, n_qb, N, W, BM, BN)
        mbarrier.wait(q_empty, (it & 1) ^ 1)
        mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row_base + q0, 0], q_ready, q_smem.index(0))
        tma.async_copy_global_to_shared(q_desc, [row_base + q0 + BMC, 0], q_ready, q_smem.index(1))
        _attn_producer(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, row_base, kb_lo, kb_hi,
                       c_base)
        c_base += kb_hi - kb_lo
        it += 1


@gluon.jit
def _attn_consumer_persistent(k_desc, v_desc, o_desc, q_smem, o_smem, q_ready, q_empty, k_bufs, v_bufs, k_ready,
                              v_ready, k_empty, v_empty, pp_bars, lse_ptr, N, W, BH, qk_scale, ROW_OFF: gl.constexpr,
                              FOLD: gl.constexpr):
    BMC: gl.constexpr = q_smem.type.shape[0]
    BM: gl.constexpr = 2 * BMC
    BN: gl.constexpr = k_desc.block_type.shape[0]
    n_qb = N // BM
    c_base = 0
    it = 0
    for t in range(gl.program_id(0), BH * n_qb, gl.num_programs(0)):
        q0, row_base, kb_lo, kb_hi, kb_full_lo, kb_full_hi = _attn_tile(t, n_qb, N, W, BM, BN)
        mbarrier.wait(q_ready, it & 1)
        o_acc, m_i, l_i = _attn_mainloop(q_smem, k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                                         pp_bars, q_empty, row_base, q0, kb_lo, kb_hi, kb_full_lo, kb_full_hi, W,
                                         qk_scale, c_base, ROW_OFF, 4, 0, False, False, FOLD, True)
        _attn_epilogue(o_desc, o_smem, lse_ptr, o_acc, m_i, l_i, row_base, q0, N, ROW_OFF, True)
        c_base += kb_hi - kb_lo
        it += 1
    tma.store_wait(0)


@gluon.jit
def _attn_consumer_persistent_worker(k_desc, v_desc, o_desc, q_smem, o_smem, q_ready, q_empty, k_bufs, v_bufs,
                                     k_ready, v_ready, k_empty, v_empty, pp_bars, lse_ptr, N, W, BH, qk_scale,
                                     FOLD: gl.constexpr):
    BMC: gl.constexpr = q_smem.type.shape[0]
    _attn_consumer_persistent(k_desc, v_desc, o_desc, q_smem, o_smem, q_ready, q_empty, k_bufs, v_bufs, k_ready,
                              v_ready, k_empty, v_empty, pp_bars, lse_ptr, N, W, BH, qk_scale, BMC, FOLD)


@gluon.jit
def attn_fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, N, W, BH, qk_scale,
                    STAGES: gl.constexpr, MODE: gl.constexpr, PINGPONG: gl.constexpr, FOLD: gl.constexpr):
    """MODE 0: no warp specialisation, one 8-warp partition issuing its own loads;
    MODE 1: 8-warp consumer (128 rows) + 1-warp producer;
    MODE 2: two 4-warp consumers (BMC rows each) + 1-warp producer;
    MODE 3: MODE 2 made persistent (grid: one program an SM), the producer loading the next
    tile's Q and K/V under this tile's tail, O staged in its own buffer and stored asynchronously."""
    BN: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    BMC: gl.constexpr = q_desc.block_type.shape[0]  # rows of one consumer
    NC: gl.constexpr = 1 if MODE < 2 else 2  # consumer partitions
    BM: gl.constexpr = NC * BMC if MODE >= 2 else 128

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NC, BMC, D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    pp_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=NC)  # every consumer releases every tile
        mbarrier.init(v_empty.index(s), count=NC)
    for i in gl.static_range(2):
        mbarrier.init(pp_bars.index(i), count=1)

    if MODE == 3:
        # q_bars[0]: Q loaded (one arrival: the producer's expect); q_bars[1]: Q free (both consumers)
        mbarrier.init(q_bars.index(0), count=1)
        mbarrier.init(q_bars.index(1), count=NC)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [NC, BMC, D], o_desc.layout)
        gl.warp_specialize([
            (_attn_consumer_persistent, (k_desc, v_desc, o_desc, q_smem.index(0), o_smem.index(0), q_bars.index(0),
                                         q_bars.index(1), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, pp_bars,
                                         lse_ptr, N, W, BH, qk_scale, 0, FOLD)),
            (_attn_consumer_persistent_worker, (k_desc, v_desc, o_desc, q_smem.index(1), o_smem.index(1),
                                                q_bars.index(0), q_bars.index(1), k_bufs, v_bufs, k_ready, v_ready,
                                                k_empty, v_empty, pp_bars, lse_ptr, N, W, BH, qk_scale, FOLD)),
            (_attn_producer_persistent, (q_desc, k_desc, v_desc, q_smem, q_bars.index(0), q_bars.index(1), k_bufs,
                                         v_bufs, k_ready, v_ready, k_empty, v_empty, N, W, BH)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        for i in gl.static_range(NC):
            mbarrier.init(q_bars.index(i), count=1)
        q0 = gl.program_id(0) * BM
        row_base = gl.program_id(1) * N
        kb_lo, kb_hi, kb_full_lo, kb_full_hi = _attn_bounds(q0, N, W, BM, BN)
        if MODE == 0:
            n_blocks = kb_hi - kb_lo
            for s in gl.static_range(STAGES):
                if s < n_blocks:
                    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(k_desc, [row_base + (kb_lo + s) * BN, 0], k_ready.index(s),
                                                    k_bufs.index(s))
                    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(v_desc, [row_base + (kb_lo + s) * BN, 0], v_ready.index(s),
                                                    v_bufs.index(s))
            _attn_consumer(q_desc, k_desc, v_desc, o_desc, q_smem.index(0), q_bars.index(0), k_bufs, v_bufs, k_ready,
                           v_ready, k_empty, v_empty, pp_bars, lse_ptr, row_base, q0, kb_lo, kb_hi, kb_full_lo,
                           kb_full_hi, N, W, qk_scale, 0, 8, 0, False, True, FOLD)
        elif MODE == 1:
            gl.warp_specialize([
                (_attn_consumer, (q_desc, k_desc, v_desc, o_desc, q_smem.index(0), q_bars.index(0), k_bufs, v_bufs,
                                  k_ready, v_ready, k_empty, v_empty, pp_bars, lse_ptr, row_base, q0, kb_lo, kb_hi,
                                  kb_full_lo, kb_full_hi, N, W, qk_scale, 0, 8, 0, False, False, FOLD)),
                (_attn_producer, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, row_base,
                                  kb_lo, kb_hi)),
            ], [1], [PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_attn_consumer, (q_desc, k_desc, v_desc, o_desc, q_smem.index(0), q_bars.index(0), k_bufs, v_bufs,
                                  k_ready, v_ready, k_empty, v_empty, pp_bars, lse_ptr, row_base, q0, kb_lo, kb_hi,
                                  kb_full_lo, kb_full_hi, N, W, qk_scale, 0, 4, 0, PINGPONG, False, FOLD)),
                (_attn_consumer_worker, (q_desc, k_desc, v_desc, o_desc, q_smem.index(1), q_bars.index(1), k_bufs,
                                         v_bufs, k_ready, v_ready, k_empty, v_empty, pp_bars, lse_ptr, row_base, q0,
                                         kb_lo, kb_hi, kb_full_lo, kb_full_hi, N, W, qk_scale, BMC, PINGPONG, FOLD)),
                (_attn_producer, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, row_base,
                                  kb_lo, kb_hi)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# attention variants: name -> MODE, PINGPONG, FOLD, num_warps of the kernel, rows a consumer,
# key tile, maxnreg, ring (K/V ring depth, when fixed); attn_ws2x128 is not in any GPU list
ATTN_VARIANTS = {
    "attn_ws1x8": dict(mode=1, pp=False, fold=False, nw=8, bmc=128, bn=128, maxnreg=WS_MAXNREG),
    "attn_ws2": dict(mode=2, pp=False, fold=False, nw=4, bmc=64, bn=128, maxnreg=WS_MAXNREG),
    "attn_ws2pp": dict(mode=2, pp=True, fold=False, nw=4, bmc=64, bn=128, maxnreg=WS_MAXNREG),
    "attn_nows": dict(mode=0, pp=False, fold=False, nw=8, bmc=128, bn=128, maxnreg=None),
    # issue 22's leads toward 600 TF/s
    "attn_ws2f": dict(mode=2, pp=False, fold=True, nw=4, bmc=64, bn=128, maxnreg=WS_MAXNREG),
    # persistent: ring of 2 (O's own buffer makes a ring of 3 need 262,536 bytes)
    "attn_ws2p": dict(mode=3, pp=False, fold=False, nw=4, bmc=64, bn=128, maxnreg=WS_MAXNREG, ring=2),
    "attn_ws2pf": dict(mode=3, pp=False, fold=True, nw=4, bmc=64, bn=128, maxnreg=WS_MAXNREG, ring=2),
    # 256-key tiles (ring of 1: two 64 KB slots per operand would pass 232 KB) and 128-row
    # consumers: S, O and the P in flight need 128 + 64 + 64 and 128 + 128 + 64 registers a thread
    "attn_ws2n256": dict(mode=2, pp=False, fold=True, nw=4, bmc=64, bn=256, maxnreg=WS_MAXNREG, ring=1),  # spills
    "attn_ws2x128": dict(mode=2, pp=False, fold=True, nw=4, bmc=128, bn=128, maxnreg=WS_MAXNREG, ring=2),
}
GEMM_WS = dict(BM=128, BN=256, BK=64, STAGES=3)
SMEM_LIMIT = 232448  # bytes of shared memory a block may use on sm_90


def _nvmma(shape, gdt):
    return gl.NVMMASharedLayout.get_default_for(shape, gdt)


# --------------------------------------------------------------------------------------------
# ahead-of-time compile for sm_90 (no GPU): shared memory and registers of every kernel
# --------------------------------------------------------------------------------------------
def aot_desc(dt, gdt, block):
    """The signature string of a bf16/fp32 tensor descriptor argument, for triton.compile."""
    return f"tensordesc<{dt}[{block[0]}, {block[1]}],{_nvmma(block, gdt)!r}>"


def aot_compile(name, fn, sig, consts, opts):
    """Compile one Gluon kernel for sm_90 without a GPU; returns (and prints) a report row:
    shared bytes, setmaxnreg targets, registers a thread and spills (cuobjdump), or the error."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    cs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    for k in consts:
        sig[k] = "constexpr"
    sig = {a: sig[a] for a in fn.arg_names}
    t0 = time.time()
    try:
        k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=cs), target=GPUTarget("cuda", 90, 32),
                           options=opts)
        md = k.metadata
        row = dict(stage=name, compiled=True, shared=md.shared, fits_smem=md.shared <= SMEM_LIMIT,
                   num_warps=md.num_warps, seconds=round(time.time() - t0, 1))
        asm = k.asm.get("cubin")
        if asm is not None:
            row["cubin_bytes"] = len(asm)
        ptx = k.asm.get("ptx", "")
        # register targets the warp-specialised partitions switch to
        pat = r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)"
        row["setmaxnreg"] = sorted({int(x) for x in re.findall(pat, ptx)})
        row["ptxas_regs"] = _ptxas_regs(k)
    except Exception as e:  # recorded, the next kernel still compiles
        row = dict(stage=name, compiled=False, error=f"{type(e).__name__}: {e}"[-3000:])
    print(json.dumps(row), flush=True)
    return row


def aot(only=None):
    """only: substrings of the kernel names to compile (all when None)."""
    import gluon_probe_bwd

    kernels = []
    bf = "bf16"
    blk = [128, 128]
    kernels.append(("copy", copy_kernel, dict(in_desc=aot_desc(bf, gl.bfloat16, blk),
                                              out_desc=aot_desc(bf, gl.bfloat16, blk)), {}, dict(num_warps=4)))
    kernels.append(("gemm", gemm_kernel, dict(a_desc=aot_desc(bf, gl.bfloat16, [128, 64]),
                                              b_desc=aot_desc(bf, gl.bfloat16, [128, 64]),
                                              c_desc=aot_desc("fp32", gl.float32, [128, 128]), K="i32"),
                    {}, dict(num_warps=4)))
    g = GEMM_WS
    kernels.append(("gemm_ws", gemm_ws_kernel, dict(a_desc=aot_desc(bf, gl.bfloat16, [g["BM"], g["BK"]]),
                                                    b_desc=aot_desc(bf, gl.bfloat16, [g["BN"], g["BK"]]),
                                                    c_desc=aot_desc(bf, gl.bfloat16, [g["BM"], g["BN"]]), K="i32"),
                    dict(STAGES=g["STAGES"]), dict(num_warps=8, maxnreg=WS_MAXNREG)))
    for name, v in ATTN_VARIANTS.items():
        for ring in ((v["ring"], ) if "ring" in v else (2, 3)):
            sig = dict(q_desc=aot_desc(bf, gl.bfloat16, [v["bmc"], 128]),
                       k_desc=aot_desc(bf, gl.bfloat16, [v["bn"], 128]),
                       v_desc=aot_desc(bf, gl.bfloat16, [v["bn"], 128]),
                       o_desc=aot_desc(bf, gl.bfloat16, [v["bmc"], 128]),
                       lse_ptr="*fp32", N="i32", W="i32", BH="i32", qk_scale="fp32")
            opts = dict(num_warps=v["nw"])
            if v["maxnreg"]:
                opts["maxnreg"] = v["maxnreg"]
            kernels.append((f"{name}/stages={ring}", attn_fwd_kernel, sig,
                            dict(STAGES=ring, MODE=v["mode"], PINGPONG=v["pp"], FOLD=v["fold"]), opts))
    kernels += gluon_probe_bwd.aot_kernels()
    return [aot_compile(*k) for k in kernels if only is None or any(o in k[0] for o in only)]


def _ptxas_regs(k):
    """Registers a thread at launch, spills (LOCAL bytes): cuobjdump on the cubin (Triton ships it)."""
    import shutil
    import tempfile
    import triton.backends.nvidia as nv
    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    tool = tool if os.path.exists(tool) else shutil.which("cuobjdump")
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    # ptxas spills go to the stack frame (STACK), not to LOCAL (local arrays): 2026-12-02 the
    # probe read LOCAL only and saw 0 bytes for a kernel with 366 spill stores
    m = re.search(r"REG:(\d+)\s+STACK:(\d+).*LOCAL:(\d+)", out)
    if not m:
        return None
    return dict(regs=int(m.group(1)), stack_bytes=int(m.group(2)), local_bytes=int(m.group(3)),
                spill_stores=len(re.findall(r"\bSTL\b", sass)), spill_loads=len(re.findall(r"\bLDL\b", sass)))


# --------------------------------------------------------------------------------------------
# GPU stages (each in its own process)
# --------------------------------------------------------------------------------------------
def _rel(a, b):
    a, b = a.float(), b.float()
    fin = torch.isfinite(b)
    if not torch.equal(fin, torch.isfinite(a)):
        return float("inf")
    a, b = a[fin], b[fin]
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _bench(fn, rep=300):
    return triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median")


def stage_copy():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    x = torch.randn(1000, 384, device="cuda", dtype=torch.bfloat16)  # ragged rows: TMA clips the edge
    y = torch.zeros_like(x)
    lay = _nvmma([128, 128], gl.bfloat16)
    xd = TensorDescriptor.from_tensor(x, [128, 128], lay)
    yd = TensorDescriptor.from_tensor(y, [128, 128], lay)
    copy_kernel[(triton.cdiv(1000, 128), 3)](xd, yd, num_warps=4)
    torch.cuda.synchronize()
    err = _rel(y, 2 * x)
    return dict(correct=err == 0.0, max_rel_err=err)


def stage_gemm():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    M, N, K = 512, 384, 320
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(M, N, device="cuda", dtype=torch.float32)
    ad = TensorDescriptor.from_tensor(a, [128, 64], _nvmma([128, 64], gl.bfloat16))
    bd = TensorDescriptor.from_tensor(b, [128, 64], _nvmma([128, 64], gl.bfloat16))
    cd = TensorDescriptor.from_tensor(c, [128, 128], _nvmma([128, 128], gl.float32))
    gemm_kernel[(M // 128, N // 128)](ad, bd, cd, K, num_warps=4)
    torch.cuda.synchronize()
    err = _rel(c, a.float() @ b.float().T)
    return dict(correct=err < 1e-5, max_rel_err=err)


def _gemm_ws(a, b, c, stages=GEMM_WS["STAGES"]):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    g = GEMM_WS
    ad = TensorDescriptor.from_tensor(a, [g["BM"], g["BK"]], _nvmma([g["BM"], g["BK"]], gl.bfloat16))
    bd = TensorDescriptor.from_tensor(b, [g["BN"], g["BK"]], _nvmma([g["BN"], g["BK"]], gl.bfloat16))
    cd = TensorDescriptor.from_tensor(c, [g["BM"], g["BN"]], _nvmma([g["BM"], g["BN"]], gl.bfloat16))
    grid = (triton.cdiv(a.shape[0], g["BM"]), triton.cdiv(b.shape[0], g["BN"]))
    gemm_ws_kernel[grid](ad, bd, cd, a.shape[1], stages, num_warps=8, maxnreg=WS_MAXNREG)


def stage_gemm_ws():
    M, N, K = 1000, 768, 1096  # ragged edges and a K tail (K a multiple of 8: TMA needs 16-byte row strides)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    _gemm_ws(a, b, c)
    torch.cuda.synchronize()
    err = _rel(c, a.float() @ b.float().T)
    res = dict(correct=err < 1e-2, max_rel_err=err)
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    _gemm_ws(a, b, c)
    torch.cuda.synchronize()
    res["err_8192"] = _rel(c[::64], (a[::64].float() @ b.float().T))
    res["correct"] = res["correct"] and res["err_8192"] < 1e-2
    res["max_rel_err"] = max(err, res["err_8192"])
    ms = _bench(lambda: _gemm_ws(a, b, c))
    ms_t = _bench(lambda: torch.matmul(a, b.T))
    res.update(ms=ms, tflops=2 * n ** 3 / ms * 1e-9, torch_ms=ms_t, torch_tflops=2 * n ** 3 / ms_t * 1e-9)
    return res


def attn_gluon(q, k, v, window, variant, stages):
    """q, k, v (B, H, N, D) contiguous bf16, N % 128 == 0, D == 128 -> out (B, H, N, D), lse (B, H, N) fp32."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    cfg = ATTN_VARIANTS[variant]
    bmc, bn = cfg["bmc"], cfg["bn"]
    B, H, N, D = q.shape
    assert D == 128 and N % 128 == 0 and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    q2, k2, v2, o2 = (t.view(B * H * N, D) for t in (q, k, v, out))
    qd = TensorDescriptor.from_tensor(q2, [bmc, D], _nvmma([bmc, D], gl.bfloat16))
    od = TensorDescriptor.from_tensor(o2, [bmc, D], _nvmma([bmc, D], gl.bfloat16))
    # K/V tiles past the end of a head read the next head's rows (or TMA's zeros at the end of
    # the tensor): they lie past the diagonal, so the window mask removes them
    kd = TensorDescriptor.from_tensor(k2, [bn, D], _nvmma([bn, D], gl.bfloat16))
    vd = TensorDescriptor.from_tensor(v2, [bn, D], _nvmma([bn, D], gl.bfloat16))
    qk_scale = D ** -0.5 * 1.4426950408889634
    kw = dict(num_warps=cfg["nw"])
    if cfg["maxnreg"]:
        kw["maxnreg"] = cfg["maxnreg"]
    bm = 2 * bmc if cfg["mode"] >= 2 else 128
    if cfg["mode"] == 3:
        grid = (min(torch.cuda.get_device_properties(q.device).multi_processor_count, B * H * (N // bm)), )
    else:
        grid = (N // bm, B * H)
    attn_fwd_kernel[grid](qd, kd, vd, od, lse, N, window, B * H, qk_scale, cfg.get("ring", stages), cfg["mode"],
                          cfg["pp"], cfg["fold"], **kw)
    return out, lse


def attn_reference(q, k, v, window):
    """fp32 dense reference: causal window, query i sees keys i - window < j <= i."""
    n, d = q.shape[2], q.shape[3]
    s = (q.float() @ k.float().transpose(-1, -2)) * d ** -0.5
    i = torch.arange(n, device=q.device)
    delta = i[:, None] - i[None, :]
    s = s.masked_fill(~((delta >= 0) & (delta < window)), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v.float(), lse


def _attn_flops(n, h, d, w):
    pairs = w * n - w * (w - 1) // 2  # causal window=W: W N - W (W-1) / 2 visible pairs a head
    return 4 * d * h * pairs


def _matmul_peak():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / _bench(lambda: a @ a, rep=200) * 1e-9


def stage_attn(variant, args):
    res = dict(variant=variant, stages=args.attn_stages)
    # correctness at small sizes (fp32 reference); a stage that fails here is not timed
    errs = {}
    # (8, 8192, 1024): 512 query tiles, several a program of the persistent forms (one SM each)
    for (h, n, w) in ((2, 4096, 1024), (1, 8192, 4096), (1, 384, 256), (8, 8192, 1024)):
        q, k, v = (torch.randn(1, h, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        o, lse = attn_gluon(q, k, v, w, variant, args.attn_stages)
        torch.cuda.synchronize()
        o_ref, lse_ref = attn_reference(q, k, v, w)
        errs[f"N={n},W={w}"] = dict(out=_rel(o, o_ref), lse=_rel(lse, lse_ref),
                                    bf16_floor=_rel(o_ref.to(torch.bfloat16), o_ref))
    res["errors"] = errs
    res["max_rel_err"] = max(max(e["out"], e["lse"]) for e in errs.values())
    res["correct"] = all(e["out"] < max(2 * e["bf16_floor"], 1e-2) and e["lse"] < 1e-3 for e in errs.values())
    if not res["correct"] and not args.time_anyway:
        return res
    _time_attn(res, args, lambda q, k, v: attn_gluon(q, k, v, args.window, variant, args.attn_stages))
    return res


def _time_attn(res, args, fn):
    import msa_codegen as msa
    h, n, d, w = args.heads, args.n, 128, args.window
    flops = _attn_flops(n, h, d, w)
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    res["peak_tflops"] = peak = _matmul_peak()
    with torch.no_grad():
        o_ours, lse_ours = msa.attention(q, k, v, f"window={w}", return_lse=True)
        o = fn(q, k, v)
        o = o[0] if isinstance(o, tuple) else o
        torch.cuda.synchronize()
        res["err_vs_msa_N131072"] = _rel(o[:, :, ::16], o_ours[:, :, ::16])
        res["agrees_with_msa"] = res["err_vs_msa_N131072"] < 1e-2
        del o, o_ours, lse_ours
        ms_ours = _bench(lambda: msa.attention(q, k, v, f"window={w}"), rep=args.rep)
        ms = _bench(lambda: fn(q, k, v), rep=args.rep)
    res.update(ms=ms, tflops=flops / ms * 1e-9, frac_peak=flops / ms * 1e-9 / peak, msa_ms=ms_ours,
               msa_tflops=flops / ms_ours * 1e-9, speedup_vs_msa=ms_ours / ms)


def stage_flex(args):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    w = args.window

    def mask_mod(b, h, q_idx, kv_idx):
        delta = q_idx - kv_idx
        return (delta >= 0) & (delta < w)

    bm = create_block_mask(mask_mod, None, None, args.n, args.n, device="cuda", _compile=True)
    flex = torch.compile(flex_attention, dynamic=False)
    res = dict(variant="flex")
    # small check of the peer itself
    q, k, v = (torch.randn(1, 2, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bms = create_block_mask(lambda b, h, qi, ki: ((qi - ki) >= 0) & ((qi - ki) < 1024), None, None, 4096, 4096,
                            device="cuda", _compile=True)
    with torch.no_grad():
        o = flex(q, k, v, block_mask=bms)
    res["max_rel_err"] = _rel(o, attn_reference(q, k, v, 1024)[0])
    res["correct"] = res["max_rel_err"] < 2e-2
    _time_attn(res, args, lambda q, k, v: flex(q, k, v, block_mask=bm))
    return res


# in order of what matters most, so that a run cut short still answers the question
STAGES = ["aot", "copy", "gemm", "gemm_ws", "attn_ws2", "attn_ws1x8", "attn_nows", "attn_ws2pp", "flex",
          "attn_ws2:3", "attn_ws1x8:3"]
# issue 22's second GPU run: the backward first, then the forward's leads toward 600 TF/s, the
# baseline attn_ws2 again in the same run, the peer's forward+backward, and the spilling 256-key tile
STAGES_ISSUE22 = ["bwd_dkdv", "bwd_dq", "attn_ws2pf", "attn_ws2p", "attn_ws2f", "attn_ws2", "flex_bwd", "attn_ws2n256"]


def run_stage(name, args):
    """name: a stage of STAGES; attention variants take ':S' for a K/V ring of S tiles (default 2)."""
    base, _, ring = name.partition(":")
    if base == "aot":
        rows = aot()
        bad = [r["stage"] for r in rows if not r["compiled"]]
        return dict(correct=not bad, kernels=rows, error=f"did not compile: {bad}" if bad else None)
    if base == "copy":
        return stage_copy()
    if base == "gemm":
        return stage_gemm()
    if base == "gemm_ws":
        return stage_gemm_ws()
    if base in ATTN_VARIANTS:
        args.attn_stages = int(ring or args.attn_stages)
        return stage_attn(base, args)
    if base == "flex":
        return stage_flex(args)
    if base in ("bwd_dkdv", "bwd_dq", "flex_bwd"):
        import gluon_probe_bwd
        return gluon_probe_bwd.stage_flex_bwd(args) if base == "flex_bwd" else gluon_probe_bwd.stage_bwd(base[4:], args)
    raise SystemExit(f"unknown stage {name!r}; expected one of {STAGES + STAGES_ISSUE22}")


def _child(args):
    torch.manual_seed(0)
    t0 = time.time()
    try:
        res = run_stage(args.stage, args)
        res["compiled"] = True
    except Exception as e:
        tb = traceback.format_exc()
        res = dict(compiled=False if _is_compile_error(e) else "?", correct=False, error=f"{type(e).__name__}: {e}",
                   traceback=tb[-4000:])
    res["stage"] = args.stage
    res["wall_s"] = round(time.time() - t0, 1)
    print("RESULT_JSON " + json.dumps(res, default=str), flush=True)


def _is_compile_error(e):
    from triton.compiler.errors import CompilationError
    return isinstance(e, CompilationError) or "PassManager" in str(e) or "ptxas" in str(e)


def _fmt_row(r):
    t = ""
    if r.get("ms") is not None:
        t = f"{r['ms']:.3f} ms"
        if r.get("tflops") is not None:
            t += f" {r['tflops']:.0f} TF/s"
        if r.get("msa_ms") is not None:
            t += f" (msa {r['msa_ms']:.3f} ms {r['msa_tflops']:.0f} TF/s, x{r['speedup_vs_msa']:.2f})"
        if r.get("msa_bwd_ms") is not None:
            t += f" (msa backward {r['msa_bwd_ms']:.3f} ms {r['msa_bwd_tflops']:.0f} TF/s effective)"
        if r.get("gluon_bwd_ms") is not None:
            t += (f"; Gluon backward {r['gluon_bwd_ms']:.3f} ms {r['gluon_bwd_tflops']:.0f} TF/s effective, "
                  f"x{r['msa_bwd_ms'] / r['gluon_bwd_ms']:.2f}; fwd+bwd Gluon {r['gluon_fwd_bwd_ms']:.3f} ms, "
                  f"msa {r['msa_fwd_bwd_ms']:.3f} ms")
        if r.get("torch_ms") is not None:
            t += f" (torch {r['torch_ms']:.3f} ms {r['torch_tflops']:.0f} TF/s)"
    err = r.get("max_rel_err")
    return (f"{r['stage']:<14} {str(r.get('compiled', '?')):<9} {str(r.get('correct', '?')):<6} "
            f"{'' if err is None else f'{err:.2e}':<9} {t}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", default=",".join(STAGES),
                    help=f"comma-separated stages (attention variants take ':3' for a 3-deep ring), or 'issue22' "
                    f"for {STAGES_ISSUE22}; the default is {STAGES}")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # child process: run one stage
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a stage (flex: twice)")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all stages; the rest are skipped")
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--attn-stages", type=int, default=2, help="K/V ring depth (2 or 3)")
    ap.add_argument("--rep", type=int, default=300, help="do_bench rep (ms) of the attention timings")
    ap.add_argument("--time-anyway", action="store_true", help="time attention variants that fail the check")
    ap.add_argument("--aot", action="store_true", help="compile every kernel for sm_90 without a GPU")
    ap.add_argument("--only", help="with --aot: comma-separated substrings of the kernel names to compile")
    args = ap.parse_args()
    if args.aot:
        aot(args.only.split(",") if args.only else None)
        return
    if args.stage:
        _child(args)
        return
    print(f"python {sys.version.split()[0]}, triton {triton.__version__}", flush=True)
    try:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    except Exception as e:
        print(f"torch/cuda: {e}")
    results = []
    out = os.environ.get("OUT")
    t_start = time.time()
    for name in (STAGES_ISSUE22 if args.stages == "issue22" else args.stages.split(",")):
        timeout = args.timeout * (2 if name.startswith("flex") else 1)  # torch.compile of the peer
        left = args.budget - (time.time() - t_start)
        if left < 30:
            r = dict(stage=name, compiled="?", correct=False, error=f"skipped: {args.budget:.0f} s budget spent")
            results.append(r)
            print(_fmt_row(r), flush=True)
            continue
        timeout = min(timeout, left)
        cmd = [sys.executable, os.path.abspath(__file__), "--stage", name, "--n", str(args.n), "--heads",
               str(args.heads), "--window", str(args.window), "--attn-stages", str(args.attn_stages), "--rep",
               str(args.rep)] + (["--time-anyway"] if args.time_anyway else [])
        print(f"--- stage {name}", flush=True)
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT_JSON ")]
            if line:
                r = json.loads(line[-1][len("RESULT_JSON "):])
            else:
                r = dict(stage=name, compiled="?", correct=False,
                         error=f"exit {p.returncode} without a result (fault?)",
                         traceback=(p.stdout[-2000:] + "\n" + p.stderr[-4000:]))
            r["returncode"] = p.returncode
            r["stderr_tail"] = p.stderr[-1500:]
        except subprocess.TimeoutExpired as e:
            so = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else str(e.stdout or "")
            se = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr or "")
            r = dict(stage=name, compiled="?", correct=False, error=f"timeout after {timeout:.0f} s (hang?)",
                     traceback=(so[-1500:] + "\n" + se[-1500:]))
        r["stage_wall_s"] = round(time.time() - t0, 1)
        results.append(r)
        print(_fmt_row(r), flush=True)
        if r.get("error"):
            print("    " + "\n    ".join(str(r["error"]).splitlines()[:6]), flush=True)
        if out:  # after every stage, so that a run cut short keeps what it measured
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "gluon_probe.json"), "w") as f:
                json.dump(dict(triton=triton.__version__, torch=torch.__version__, args=vars(args), results=results),
                          f, indent=1, default=str)
    print("\nstage          compiled  correct rel.err   time")
    for r in results:
        print(_fmt_row(r))
    for r in results:
        if r["stage"] == "aot" and r.get("kernels"):
            print("\nsm_90 compile (shared bytes, registers a thread at launch / setmaxnreg targets, spills):")
            for k in r["kernels"]:
                regs = k.get("ptxas_regs") or {}
                print(f"  {k['stage']:<22} {k.get('compiled')!s:<6} smem {k.get('shared', '-')!s:>7}  "
                      f"regs {regs.get('regs', '-')!s:>4} setmaxnreg {k.get('setmaxnreg', '-')}  "
                      f"stack {regs.get('stack_bytes', '-')} "
                      f"STL/LDL {regs.get('spill_stores', '-')}/{regs.get('spill_loads', '-')}")
    for r in results:
        if r.get("error"):
            print(f"\n[{r['stage']}] " + "\n  ".join(str(r["error"]).splitlines()[:8]))
            tb = str(r.get("traceback", "")).strip().splitlines()
            if tb:
                print("  ... " + "\n  ".join(tb[-8:]))
    if out:
        print(f"\nwrote {os.path.join(out, 'gluon_probe.json')}")


if __name__ == "__main__":
    # gluon_probe_bwd imports this module by name: let it find this instance, not load a second
    # copy whose kernels shadow these (2026-12-02: a second copy broke every --aot compile of this one)
    sys.modules.setdefault("gluon_probe", sys.modules[__name__])
    main()
