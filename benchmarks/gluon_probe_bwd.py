"""Probe (issue 22), backward half: the causal window backward in Gluon with warp specialisation.

Stages of ``benchmarks/gluon_probe.py`` (run through it, each in its own process):

- ``bwd_dkdv``: a key-tile-centred dK/dV kernel. A program owns 128 keys of one (batch, head),
  two 4-warp consumers 64 keys each (K and V resident in shared memory, dK and dV in
  registers); a 1-warp producer streams the 64-query tiles of the keys' window (Q and dO, one
  mbarrier a slot) through a ring. A consumer, per query tile: S^T = K Q^T and dP^T = V dO^T
  (``warpgroup_mma`` from shared memory), P^T = exp2(S^T scale - LSE2) (LSE2 and delta, per
  query column, put in shared memory by the producer), dV += P^T dO with P^T from registers,
  dS^T = P^T (dP^T - delta), dK += dS^T Q. No atomics: every dK/dV row has one owner;
- ``bwd_dq``: a query-tile-centred dQ kernel, the forward's layout: 128 query rows a program,
  two 64-row consumers with Q and dO resident, the forward's producer streaming K and V tiles;
  S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K.

Both are checked against float64 autograd of the dense masked attention (N=4096 W=1024,
N=8192 W=4096, N=384 W=256) beside PyTorch's own bf16 error on the same inputs, then timed at
B=1, H=16, N=131072 against ``msa_codegen.attention``'s backward (``torch.autograd.grad``, the
backward only) and its kernels one by one (torch.profiler). ``bwd_dq`` also times the whole
Gluon backward (delta pass + dK/dV + dQ) and the Gluon forward (attn_ws2) for forward+backward.
Effective TFLOP/s of a backward = 2.5 x the forward's 4 D H pairs (FlashAttention's
convention, docs/performance.md "FLOP formulas"); the kernels' own product rates count the
products they execute on visible pairs (dK/dV 4, dQ 3 of 2 D a pair). Not part of the package.
"""
from __future__ import annotations

import torch
import triton
from gluon_probe import (CONSUMER_REGS, PRODUCER_REGS, WS_MAXNREG, _attn_bounds, _attn_flops, _attn_producer, _bench,
                         _nvmma, _rel, aot_desc, attn_gluon)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = 1.4426950408889634
BWD = dict(BN=128, BM_DKDV=64, STAGES_DKDV=2, BM_DQ=128, BN_DQ=128, STAGES_DQ=2)


# --------------------------------------------------------------------------------------------
# dK/dV: one program = 128 keys [k0, k0 + 128) of one (batch, head); query tiles qb_lo .. qb_hi - 1
#
#     queries ->  qb_lo                                  qb_hi-1
#     key k0      [ \##### | ########## ... ########## | ###\     ]   \ = diagonal (i >= j) and
#     key k0+127  [     \# | ########## ... ########## | #######\ ]       window edge (i - j < W)
# --------------------------------------------------------------------------------------------
@gluon.jit
def _dkdv_bounds(k0, N, W, BM: gl.constexpr, BN: gl.constexpr):
    """Query tiles that see a key of [k0, k0 + BN) (query i sees key j when 0 <= i - j < W), and
    the unmasked middle [qb_full_lo, qb_full_hi): past the last key, within W of the first."""
    qb_lo = k0 // BM
    qb_hi = gl.cdiv(gl.minimum(k0 + BN - 1 + W, N), BM)
    qb_full_lo = gl.cdiv(k0 + BN - 1, BM)
    qb_full_hi = (k0 + W) // BM  # q0 + BM - 1 - k0 < W
    return qb_lo, qb_hi, qb_full_lo, qb_full_hi


@gluon.jit
def _dkdv_producer(q_desc, do_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, lse2_ptr, delta_ptr,
                   row_base, qb_lo, qb_hi):
    """Per query tile: Q and dO by TMA, LSE2 and delta by plain loads into shared memory (64
    floats each; in the consumers' registers they would take 32 of the 240 a thread), then an
    arrival on the slot's ready barrier (count 2: the TMA bytes and this)."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    vec_layout: gl.constexpr = gl.BlockedLayout([BM // 32], [32], [1], [0])  # one warp
    for qb in range(qb_lo, qb_hi):
        c = qb - qb_lo
        slot = c % STAGES
        mbarrier.wait(empty.index(slot), ((c // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row_base + qb * BM, 0], ready.index(slot), q_bufs.index(slot))
        tma.async_copy_global_to_shared(do_desc, [row_base + qb * BM, 0], ready.index(slot), do_bufs.index(slot))
        o_q = row_base + qb * BM + gl.arange(0, BM, layout=vec_layout)
        lse_bufs.index(slot).store(gl.load(lse2_ptr + o_q))
        delta_bufs.index(slot).store(gl.load(delta_ptr + o_q))
        mbarrier.arrive(ready.index(slot))  # release: the stores above are seen after the wait


@gluon.jit
def _dkdv_consumer(k_desc, v_desc, dk_desc, dv_desc, k_smem, v_smem, kv_bar, q_bufs, do_bufs, lse_bufs, delta_bufs,
                   ready, empty, row_base, k0, qb_lo, qb_hi, qb_full_lo, qb_full_hi, W, qk_scale, sm_scale,
                   ROW_OFF: gl.constexpr):
    """Keys [k0 + ROW_OFF, k0 + ROW_OFF + BNC), BNC = k_smem's rows, one warpgroup."""
    BNC: gl.constexpr = k_smem.type.shape[0]
    D: gl.constexpr = k_smem.type.shape[1]
    BM: gl.constexpr = q_bufs.type.shape[1]
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BM, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row_base + k0 + ROW_OFF, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [row_base + k0 + ROW_OFF, 0], kv_bar, v_smem)
    mbarrier.wait(kv_bar, 0)

    s_zero = gl.zeros([BNC, BM], gl.float32, s_layout)
    dk = gl.zeros([BNC, D], gl.float32, acc_layout)
    dv = gl.zeros([BNC, D], gl.float32, acc_layout)
    o_key = k0 + ROW_OFF + gl.arange(0, BNC, layout=gl.SliceLayout(1, s_layout))
    for qb in range(qb_lo, qb_hi):
        c = qb - qb_lo
        slot = c % STAGES
        mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
        q_t = q_bufs.index(slot)
        do_t = do_bufs.index(slot)
        # [BNC, BM] S^T = K Q^T, dP^T = V dO^T
        st = warpgroup_mma(k_smem, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_smem, do_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=(st, k_smem, q_t))[0]
        # [BM] log2-domain LSE of the tile's queries
        b_lse2 = lse_bufs.index(slot).load(col_layout)
        pt = gl.exp2(st * qk_scale - gl.expand_dims(b_lse2, 0))
        if (qb < qb_full_lo) | (qb >= qb_full_hi):
            o_q = qb * BM + gl.arange(0, BM, layout=col_layout)
            d_ij = gl.expand_dims(o_q, 0) - gl.expand_dims(o_key, 1)  # query - key
            pt = gl.where((d_ij >= 0) & (d_ij < W), pt, 0.0)
        pt_op = gl.convert_layout(pt.to(gl.bfloat16), op_layout)
        dv = warpgroup_mma(pt_op, do_t, dv, is_async=True)
        # in order: S^T, dP^T, dV; with one left in flight dP^T is done
        dpt = warpgroup_mma_wait(1, deps=(dpt, v_smem, do_t))[0]
        b_delta = delta_bufs.index(slot).load(col_layout)  # [BM] rowsum(dO * O)
        dst_op = gl.convert_layout((pt * (dpt - gl.expand_dims(b_delta, 0))).to(gl.bfloat16), op_layout)
        dk = warpgroup_mma(dst_op, q_t, dk, is_async=True)
        done = warpgroup_mma_wait(0, deps=(dv, dk, q_t, do_t, pt_op, dst_op))
        dv = done[0]
        dk = done[1]
        mbarrier.arrive(empty.index(slot))

    # K and V are no longer read: stage dK (scaled back from the log2 domain's scale) and dV there
    k_smem.store((dk * sm_scale).to(dk_desc.dtype))
    v_smem.store(dv.to(dv_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [row_base + k0 + ROW_OFF, 0], k_smem)
    tma.async_copy_shared_to_global(dv_desc, [row_base + k0 + ROW_OFF, 0], v_smem)
    tma.store_wait(0)


@gluon.jit
def _dkdv_consumer_worker(k_desc, v_desc, dk_desc, dv_desc, k_smem, v_smem, kv_bar, q_bufs, do_bufs, lse_bufs,
                          delta_bufs, ready, empty, row_base, k0, qb_lo, qb_hi, qb_full_lo, qb_full_hi, W, qk_scale,
                          sm_scale):
    BNC: gl.constexpr = k_smem.type.shape[0]
    _dkdv_consumer(k_desc, v_desc, dk_desc, dv_desc, k_smem, v_smem, kv_bar, q_bufs, do_bufs, lse_bufs, delta_bufs,
                   ready, empty, row_base, k0, qb_lo, qb_hi, qb_full_lo, qb_full_hi, W, qk_scale, sm_scale, BNC)


@gluon.jit
def attn_bwd_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_ptr, delta_ptr, N, W, qk_scale,
                         sm_scale, STAGES: gl.constexpr):
    BNC: gl.constexpr = k_desc.block_type.shape[0]  # keys of one consumer
    BN: gl.constexpr = 2 * BNC
    BM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    k0 = gl.program_id(0) * BN
    row_base = gl.program_id(1) * N
    qb_lo, qb_hi, qb_full_lo, qb_full_hi = _dkdv_bounds(k0, N, W, BM, BN)

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BNC, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, BNC, D], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BM, D], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BM, D], do_desc.layout)
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # order of the 1-D slots
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BM], vec_smem)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BM], vec_smem)
    kv_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_bars.index(i), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=2)  # the producer's expect (TMA bytes) and its arrive (LSE2, delta)
        mbarrier.init(empty.index(s), count=2)  # both consumers release every tile
    gl.warp_specialize([
        (_dkdv_consumer, (k_desc, v_desc, dk_desc, dv_desc, k_smem.index(0), v_smem.index(0), kv_bars.index(0), q_bufs,
                          do_bufs, lse_bufs, delta_bufs, ready, empty, row_base, k0, qb_lo, qb_hi, qb_full_lo,
                          qb_full_hi, W, qk_scale, sm_scale, 0)),
        (_dkdv_consumer_worker, (k_desc, v_desc, dk_desc, dv_desc, k_smem.index(1), v_smem.index(1), kv_bars.index(1),
                                 q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, row_base, k0, qb_lo, qb_hi,
                                 qb_full_lo, qb_full_hi, W, qk_scale, sm_scale)),
        (_dkdv_producer, (q_desc, do_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, lse2_ptr, delta_ptr,
                          row_base, qb_lo, qb_hi)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------------
# dQ: one program = 128 query rows, the forward's key band (_attn_bounds) and K/V producer
# --------------------------------------------------------------------------------------------
@gluon.jit
def _dq_consumer(q_desc, k_desc, do_desc, dq_desc, q_smem, do_smem, qd_bar, k_bufs, v_bufs, k_ready, v_ready,
                 k_empty, v_empty, lse2_ptr, delta_ptr, row_base, q0, kb_lo, kb_hi, kb_full_lo, kb_full_hi, W,
                 qk_scale, sm_scale, ROW_OFF: gl.constexpr):
    """Rows [q0 + ROW_OFF, q0 + ROW_OFF + BMC), BMC = q_smem's rows, one warpgroup."""
    BMC: gl.constexpr = q_smem.type.shape[0]
    D: gl.constexpr = q_smem.type.shape[1]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    mbarrier.expect(qd_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row_base + q0 + ROW_OFF, 0], qd_bar, q_smem)
    tma.async_copy_global_to_shared(do_desc, [row_base + q0 + ROW_OFF, 0], qd_bar, do_smem)
    o_i = q0 + ROW_OFF + gl.arange(0, BMC, layout=row_layout)
    # [BMC] the rows' log2-domain LSE and delta
    b_lse2 = gl.load(lse2_ptr + row_base + o_i)
    b_delta = gl.load(delta_ptr + row_base + o_i)
    mbarrier.wait(qd_bar, 0)

    s_zero = gl.zeros([BMC, BN], gl.float32, s_layout)
    dq = gl.zeros([BMC, D], gl.float32, acc_layout)
    for c in range(kb_hi - kb_lo):
        kb = kb_lo + c
        slot = c % STAGES
        phase = (c // STAGES) & 1
        k_buf = k_bufs.index(slot)
        v_buf = v_bufs.index(slot)
        mbarrier.wait(k_ready.index(slot), phase)
        mbarrier.wait(v_ready.index(slot), phase)
        # [BMC, BN] S = Q K^T, dP = dO V^T
        s = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_smem, v_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, q_smem, k_buf))[0]
        p = gl.exp2(s * qk_scale - gl.expand_dims(b_lse2, 1))
        if (kb < kb_full_lo) | (kb >= kb_full_hi):
            o_j = kb * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            d_ij = gl.expand_dims(o_i, 1) - gl.expand_dims(o_j, 0)
            p = gl.where((d_ij >= 0) & (d_ij < W), p, 0.0)
        dp = warpgroup_mma_wait(0, deps=(dp, do_smem, v_buf))[0]
        mbarrier.arrive(v_empty.index(slot))
        ds_op = gl.convert_layout((p * (dp - gl.expand_dims(b_delta, 1))).to(gl.bfloat16), op_layout)
        dq = warpgroup_mma(ds_op, k_buf, dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq, k_buf, ds_op))[0]
        mbarrier.arrive(k_empty.index(slot))

    q_smem.store((dq * sm_scale).to(dq_desc.dtype))  # Q is no longer read
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [row_base + q0 + ROW_OFF, 0], q_smem)
    tma.store_wait(0)


@gluon.jit
def _dq_consumer_worker(q_desc, k_desc, do_desc, dq_desc, q_smem, do_smem, qd_bar, k_bufs, v_bufs, k_ready, v_ready,
                        k_empty, v_empty, lse2_ptr, delta_ptr, row_base, q0, kb_lo, kb_hi, kb_full_lo, kb_full_hi, W,
                        qk_scale, sm_scale):
    BMC: gl.constexpr = q_smem.type.shape[0]
    _dq_consumer(q_desc, k_desc, do_desc, dq_desc, q_smem, do_smem, qd_bar, k_bufs, v_bufs, k_ready, v_ready, k_empty,
                 v_empty, lse2_ptr, delta_ptr, row_base, q0, kb_lo, kb_hi, kb_full_lo, kb_full_hi, W, qk_scale,
                 sm_scale, BMC)


@gluon.jit
def attn_bwd_dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, lse2_ptr, delta_ptr, N, W, qk_scale, sm_scale,
                       STAGES: gl.constexpr):
    BMC: gl.constexpr = q_desc.block_type.shape[0]
    BM: gl.constexpr = 2 * BMC
    BN: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    q0 = gl.program_id(0) * BM
    row_base = gl.program_id(1) * N
    kb_lo, kb_hi, kb_full_lo, kb_full_hi = _attn_bounds(q0, N, W, BM, BN)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BMC, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [2, BMC, D], do_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
    qd_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(qd_bars.index(i), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)
        mbarrier.init(v_empty.index(s), count=2)
    gl.warp_specialize([
        (_dq_consumer, (q_desc, k_desc, do_desc, dq_desc, q_smem.index(0), do_smem.index(0), qd_bars.index(0), k_bufs,
                        v_bufs, k_ready, v_ready, k_empty, v_empty, lse2_ptr, delta_ptr, row_base, q0, kb_lo, kb_hi,
                        kb_full_lo, kb_full_hi, W, qk_scale, sm_scale, 0)),
        (_dq_consumer_worker, (q_desc, k_desc, do_desc, dq_desc, q_smem.index(1), do_smem.index(1), qd_bars.index(1),
                               k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, lse2_ptr, delta_ptr, row_base, q0,
                               kb_lo, kb_hi, kb_full_lo, kb_full_hi, W, qk_scale, sm_scale)),
        (_attn_producer, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, row_base, kb_lo, kb_hi)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def aot_kernels():
    """(name, kernel, signature, constexprs, options) of the backward kernels, for gluon_probe.aot."""
    bf, g = "bf16", BWD
    rows = []
    for stages in (2, 3):
        half = [g["BN"] // 2, 128]
        sig = dict(q_desc=aot_desc(bf, gl.bfloat16, [g["BM_DKDV"], 128]), k_desc=aot_desc(bf, gl.bfloat16, half),
                   v_desc=aot_desc(bf, gl.bfloat16, half), do_desc=aot_desc(bf, gl.bfloat16, [g["BM_DKDV"], 128]),
                   dk_desc=aot_desc(bf, gl.bfloat16, half), dv_desc=aot_desc(bf, gl.bfloat16, half),
                   lse2_ptr="*fp32", delta_ptr="*fp32", N="i32", W="i32", qk_scale="fp32", sm_scale="fp32")
        rows.append((f"bwd_dkdv/stages={stages}", attn_bwd_dkdv_kernel, sig, dict(STAGES=stages),
                     dict(num_warps=4, maxnreg=WS_MAXNREG)))
    rows_half = [g["BM_DQ"] // 2, 128]
    sig = dict(q_desc=aot_desc(bf, gl.bfloat16, rows_half), k_desc=aot_desc(bf, gl.bfloat16, [g["BN_DQ"], 128]),
               v_desc=aot_desc(bf, gl.bfloat16, [g["BN_DQ"], 128]), do_desc=aot_desc(bf, gl.bfloat16, rows_half),
               dq_desc=aot_desc(bf, gl.bfloat16, rows_half), lse2_ptr="*fp32", delta_ptr="*fp32", N="i32", W="i32",
               qk_scale="fp32", sm_scale="fp32")
    rows.append(("bwd_dq/stages=2", attn_bwd_dq_kernel, sig, dict(STAGES=g["STAGES_DQ"]),
                 dict(num_warps=4, maxnreg=WS_MAXNREG)))
    return rows


# --------------------------------------------------------------------------------------------
# host side (GPU stages)
# --------------------------------------------------------------------------------------------
def bwd_prep(o, do, lse):
    """The delta pass: LSE in the log2 domain and delta = rowsum(dO * O), both fp32 (B*H*N)."""
    return (lse.float() * LOG2E).reshape(-1).contiguous(), (o.float() * do.float()).sum(-1).reshape(-1).contiguous()


def _descs(tensors, block):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    lay = _nvmma(block, gl.bfloat16)
    return [TensorDescriptor.from_tensor(t.view(-1, t.shape[-1]), block, lay) for t in tensors]


def attn_bwd_dkdv(q, k, v, do, lse2, delta, window, stages=BWD["STAGES_DKDV"]):
    """q, k, v, do (B, H, N, D) bf16 contiguous, N % 128 == 0, D == 128 -> dk, dv."""
    B, H, N, D = q.shape
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    qd, dod = _descs((q, do), [BWD["BM_DKDV"], D])
    kd, vd, dkd, dvd = _descs((k, v, dk, dv), [BWD["BN"] // 2, D])
    attn_bwd_dkdv_kernel[(N // BWD["BN"], B * H)](qd, kd, vd, dod, dkd, dvd, lse2, delta, N, window, D ** -0.5 * LOG2E,
                                                  D ** -0.5, stages, num_warps=4, maxnreg=WS_MAXNREG)
    return dk, dv


def attn_bwd_dq(q, k, v, do, lse2, delta, window):
    B, H, N, D = q.shape
    dq = torch.empty_like(q)
    qd, dod, dqd = _descs((q, do, dq), [BWD["BM_DQ"] // 2, D])
    kd, vd = _descs((k, v), [BWD["BN_DQ"], D])
    attn_bwd_dq_kernel[(N // BWD["BM_DQ"], B * H)](qd, kd, vd, dod, dqd, lse2, delta, N, window, D ** -0.5 * LOG2E,
                                                   D ** -0.5, BWD["STAGES_DQ"], num_warps=4, maxnreg=WS_MAXNREG)
    return dq


def window_attention(q, k, v, window):
    """Dense reference in the inputs' dtype: query i sees keys i - window < j <= i; (out, lse)."""
    n, d = q.shape[2], q.shape[3]
    s = (q @ k.transpose(-1, -2)) * d ** -0.5
    i = torch.arange(n, device=q.device)
    delta = i[:, None] - i[None, :]
    s = s.masked_fill(~((delta >= 0) & (delta < window)), float("-inf"))
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def _grads(q, k, v, do, window, dtype):
    qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    o, lse = window_attention(qq, kk, vv, window)
    return (o, lse) + torch.autograd.grad(o, (qq, kk, vv), do.to(dtype))


def _check(kind, window_sizes=((2, 4096, 1024), (1, 8192, 4096), (1, 384, 256))):
    """Errors of the Gluon gradients (kind: dkdv or dq) against float64 autograd, beside PyTorch's
    own bf16 autograd on the same inputs; correct if within 2x PyTorch's (or 5e-3)."""
    errs, ok = {}, True
    for (h, n, w) in window_sizes:
        q, k, v, do = (torch.randn(1, h, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        o64, lse64, dq64, dk64, dv64 = _grads(q, k, v, do, w, torch.float64)
        _, _, dq16, dk16, dv16 = _grads(q, k, v, do, w, torch.bfloat16)
        lse2, delta = bwd_prep(o64.to(torch.bfloat16), do, lse64)
        if kind == "dkdv":
            got = dict(zip(("dk", "dv"), attn_bwd_dkdv(q, k, v, do, lse2, delta, w)))
        else:
            got = dict(dq=attn_bwd_dq(q, k, v, do, lse2, delta, w))
        torch.cuda.synchronize()
        ref, torch16 = dict(dq=dq64, dk=dk64, dv=dv64), dict(dq=dq16, dk=dk16, dv=dv16)
        e = {}
        for name, t in got.items():
            e[name] = _rel(t, ref[name])
            e[name + "_torch_bf16"] = _rel(torch16[name], ref[name])
            ok = ok and e[name] <= max(2 * e[name + "_torch_bf16"], 5e-3)
        errs[f"N={n},W={w}"] = e
        del o64, dq64, dk64, dv64, dq16, dk16, dv16
    max_err = max(v for e in errs.values() for k_, v in e.items() if "torch" not in k_)
    return dict(errors=errs, correct=ok, max_rel_err=max_err)


def _ours_backward(res, args, q, k, v, do):
    """Our backward at the timing size: do_bench of autograd.grad (backward only) and its kernels."""
    import msa_codegen as msa
    from ceiling_probe import _kernels
    from torch.profiler import ProfilerActivity, profile
    pattern = f"window={args.window}"
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = msa.attention(qq, kk, vv, pattern, return_lse=True)
    grads = torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)
    res["msa_bwd_ms"] = _bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True), rep=args.rep)
    res["msa_fwd_ms"] = _bench(lambda: msa.attention(q, k, v, pattern), rep=args.rep)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)
        torch.cuda.synchronize()
    res["msa_bwd_kernels"] = [dict(ms=round(t, 3), launches=c, name=name[:80]) for t, c, name in _kernels(prof, 5)
                              if t > 0.05]
    return out.detach(), lse.detach(), grads


def stage_bwd(kind, args):
    """kind dkdv or dq: check at small sizes, then time at B=1, H=args.heads, N=args.n against ours."""
    res = dict(variant=f"bwd_{kind}")
    res.update(_check(kind))
    if not res["correct"] and not args.time_anyway:
        return res
    h, n, d, w = args.heads, args.n, 128, args.window
    fwd_flops = _attn_flops(n, h, d, w)
    pairs_flops = fwd_flops // 2  # 2 D H pairs: one product's FLOPs on visible pairs
    q, k, v, do = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse, (dq_o, dk_o, dv_o) = _ours_backward(res, args, q, k, v, do)
    lse2, delta = bwd_prep(out, do, lse)
    res["prep_ms"] = _bench(lambda: bwd_prep(out, do, lse), rep=args.rep)
    if kind == "dkdv":
        dk, dv = attn_bwd_dkdv(q, k, v, do, lse2, delta, w)
        torch.cuda.synchronize()
        res["err_vs_msa_N131072"] = max(_rel(dk[:, :, ::16], dk_o[:, :, ::16]), _rel(dv[:, :, ::16], dv_o[:, :, ::16]))
        ms = _bench(lambda: attn_bwd_dkdv(q, k, v, do, lse2, delta, w), rep=args.rep)
        res.update(ms=ms, product_tflops=4 * pairs_flops / ms * 1e-9)
    else:
        dq = attn_bwd_dq(q, k, v, do, lse2, delta, w)
        torch.cuda.synchronize()
        res["err_vs_msa_N131072"] = _rel(dq[:, :, ::16], dq_o[:, :, ::16])
        ms = _bench(lambda: attn_bwd_dq(q, k, v, do, lse2, delta, w), rep=args.rep)
        res.update(ms=ms, product_tflops=3 * pairs_flops / ms * 1e-9)

        def gluon_bwd():
            l2, dl = bwd_prep(out, do, lse)
            attn_bwd_dkdv(q, k, v, do, l2, dl, w)
            attn_bwd_dq(q, k, v, do, l2, dl, w)

        res["gluon_bwd_ms"] = _bench(gluon_bwd, rep=args.rep)
        res["gluon_bwd_tflops"] = 2.5 * fwd_flops / res["gluon_bwd_ms"] * 1e-9
        res["gluon_fwd_ms"] = _bench(lambda: attn_gluon(q, k, v, w, "attn_ws2", 2), rep=args.rep)
        res["gluon_fwd_bwd_ms"] = res["gluon_fwd_ms"] + res["gluon_bwd_ms"]
        res["msa_fwd_bwd_ms"] = res["msa_fwd_ms"] + res["msa_bwd_ms"]
    res["msa_bwd_tflops"] = 2.5 * fwd_flops / res["msa_bwd_ms"] * 1e-9
    res["tflops"] = res["product_tflops"]  # of the products this kernel executes; ours' kernels: msa_bwd_kernels
    return res


def stage_flex_bwd(args):
    """FlexAttention's forward+backward (sliding-window BlockMask), the peer of issue 22's 0.72x bar."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    h, n, d, w = args.heads, args.n, 128, args.window
    bm = create_block_mask(lambda b, h_, qi, ki: ((qi - ki) >= 0) & ((qi - ki) < w), None, None, n, n, device="cuda",
                           _compile=True)
    flex = torch.compile(flex_attention, dynamic=False)
    q, k, v, do = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))

    def fwd_bwd():
        o = flex(qq, kk, vv, block_mask=bm)
        torch.autograd.grad(o, (qq, kk, vv), do)

    fwd_bwd()
    with torch.no_grad():
        fwd_ms = _bench(lambda: flex(q, k, v, block_mask=bm), rep=args.rep)
    ms = _bench(fwd_bwd, rep=args.rep)
    flops = 3.5 * _attn_flops(n, h, d, w)
    return dict(variant="flex_bwd", correct=True, ms=ms, tflops=flops / ms * 1e-9, flex_fwd_ms=fwd_ms,
                flex_bwd_ms=ms - fwd_ms, bar_0_72x_ms=0.72 * ms)
