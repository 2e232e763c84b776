"""The sink's share of the Gluon backward (issue 22): a Triton kernel for the (query, key) pairs
that a sink adds to a window.

A causal or bidirectional window with ``sink=S`` sees key j from query i when j is in i's window
or j < S. The backward is a sum over visible pairs, each pair's terms computed from the full
forward's LSE and delta (``msa_bwd_pre``): dQ_i += dS_ij K_j, dK_j += dS_ij Q_i, dV_j += P_ij dO_i.
So it splits over any partition of the pairs. The Gluon dK/dV and dQ kernels, rendered from the
sink plan, tile the window's band and take its pairs (the sink keys' in-window pairs among them);
``sink_bwd`` here takes the rest, the sink pairs outside the window:

    causal:        j < S and j <= i - W
    bidirectional: j < S and |i - j| >= W

Every query contributes to the sink keys' dK / dV, so their sums run over the whole sequence:
one program per (chunk of rows, batch x query head), all S <= ``gluon.MAX_SINK`` sink keys resident,
writing fp32 partial sums per chunk that the launcher adds up in a fixed order (deterministic),
over the chunks and the GQA group, into dK / dV's first S rows. dQ's extra terms are added to the
rows' dQ in the same pass: from the fused form's fp32 copy into the output (``CONVERT``: every
row, the conversion the fused form needs anyway), or in place into the two-kernel form's dQ
(rounded twice in its dtype: once by the dQ kernel, once here).

Loaded on first use (``kernels/gluon.py``), so that ``TRITON_INTERPRET`` set by the caller takes
effect. Names follow the house style: ``p_`` pointers, ``b_`` register blocks, ``m_`` masks,
``o_`` offsets, ``i_`` program ids.
"""
import triton
import triton.language as tl


@triton.jit
def sink_bwd(Q, K, V, DO, LSE2, DELTA, DQ_IN, DQ_OUT, PK, PV,
             stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
             stride_dob, stride_doh, stride_don, stride_lb, stride_lh,
             stride_ib, stride_ih, stride_in, stride_ob, stride_oh, stride_on,
             H0, HS, GROUP, N, ROW0, CHUNK, qk_scale, sm_scale,
             SINK: tl.constexpr, WINDOW: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, CONVERT: tl.constexpr,
             DOT_PREC: tl.constexpr):
    # grid: (chunks of CHUNK rows from ROW0, B * HS). Query head h = H0 + pid % HS reads KV head
    # h // GROUP. Rows of q, do, dq: (b, h, i) at b * stride_xb + h * stride_xh + i * stride_xn, the
    # last dim contiguous; LSE2 / DELTA rows at (stride_lb, stride_lh). PK / PV: fp32
    # [chunks, B * HS, BLOCK_S, BLOCK_D] contiguous, this program's partial dK / dV of the sink keys.
    i_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = pid_bh // HS
    i_h = H0 + pid_bh % HS
    i_hk = i_h // GROUP
    o_s = tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    # [BLOCK_S, BLOCK_D] the sink keys (rows past S or N read zeros, masked below)
    m_s = o_s < tl.minimum(SINK, N)
    m_sd = m_s[:, None] & m_d[None, :]
    p_k = K + tl.cast(i_b, tl.int64) * stride_kb + tl.cast(i_hk, tl.int64) * stride_kh
    p_v = V + tl.cast(i_b, tl.int64) * stride_vb + tl.cast(i_hk, tl.int64) * stride_vh
    b_k = tl.load(p_k + o_s[:, None] * stride_kn + o_d[None, :], mask=m_sd, other=0.0)
    b_v = tl.load(p_v + o_s[:, None] * stride_vn + o_d[None, :], mask=m_sd, other=0.0)
    b_dk = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    p_q = Q + tl.cast(i_b, tl.int64) * stride_qb + tl.cast(i_h, tl.int64) * stride_qh
    p_do = DO + tl.cast(i_b, tl.int64) * stride_dob + tl.cast(i_h, tl.int64) * stride_doh
    p_in = DQ_IN + tl.cast(i_b, tl.int64) * stride_ib + tl.cast(i_h, tl.int64) * stride_ih
    p_out = DQ_OUT + tl.cast(i_b, tl.int64) * stride_ob + tl.cast(i_h, tl.int64) * stride_oh
    s_row = tl.cast(i_b, tl.int64) * stride_lb + tl.cast(i_h, tl.int64) * stride_lh
    last_key = tl.minimum(SINK, N) - 1
    r_lo = ROW0 + i_c * CHUNK
    r_hi = tl.minimum(r_lo + CHUNK, N)
    for r0 in range(r_lo, r_hi, BLOCK_M):
        # does a row of [r0, r0 + BLOCK_M) see a sink key outside its window?
        r_last = tl.minimum(r0 + BLOCK_M, N) - 1
        if CAUSAL:
            extra = r_last - WINDOW >= 0
        else:
            extra = (r_last >= WINDOW) | (last_key - r0 >= WINDOW)
        if extra | CONVERT:
            o_i = r0 + tl.arange(0, BLOCK_M)
            m_i = o_i < r_hi
            m_id = m_i[:, None] & m_d[None, :]
            o_row = o_i[:, None].to(tl.int64)
            b_dq = tl.load(p_in + o_row * stride_in + o_d[None, :], mask=m_id, other=0.0).to(tl.float32)
            if extra:
                b_q = tl.load(p_q + o_row * stride_qn + o_d[None, :], mask=m_id, other=0.0)
                b_do = tl.load(p_do + o_row * stride_don + o_d[None, :], mask=m_id, other=0.0)
                b_lse2 = tl.load(LSE2 + s_row + o_i, mask=m_i, other=0.0)
                b_delta = tl.load(DELTA + s_row + o_i, mask=m_i, other=0.0)
                # [BLOCK_M, BLOCK_S] the sink pairs outside the window
                delta_ij = o_i[:, None] - o_s[None, :]
                if CAUSAL:
                    m_x = delta_ij >= WINDOW
                else:
                    m_x = (delta_ij >= WINDOW) | (delta_ij <= -WINDOW)
                m_x = m_x & m_i[:, None] & m_s[None, :]
                b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
                b_p = tl.where(m_x, tl.exp2(b_s * qk_scale - b_lse2[:, None]), 0.0)
                b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
                b_ds = b_p * (b_dp - b_delta[:, None])
                b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision=DOT_PREC)
                b_dk += tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q, input_precision=DOT_PREC)
                b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=DOT_PREC) * sm_scale
            tl.store(p_out + o_row * stride_on + o_d[None, :], b_dq.to(DQ_OUT.dtype.element_ty), mask=m_id)
    part = (tl.cast(i_c, tl.int64) * tl.num_programs(1) + pid_bh) * (BLOCK_S * BLOCK_D)
    o_sd = o_s[:, None] * BLOCK_D + o_d[None, :]
    tl.store(PK + part + o_sd, b_dk * sm_scale)
    tl.store(PV + part + o_sd, b_dv)
