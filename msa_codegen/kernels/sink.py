"""The sink's share of the Gluon family (issue 22): Triton kernels for the (query, key) pairs
that a sink adds to a window.

A causal or bidirectional window with ``sink=S`` sees key j from query i when j is in i's window
or j < S. The backward is a sum over visible pairs, each pair's terms computed from the full
forward's LSE and delta (``msa_bwd_pre``): dQ_i += dS_ij K_j, dK_j += dS_ij Q_i, dV_j += P_ij dO_i.
So it splits over any partition of the pairs. The Gluon dK/dV and dQ kernels, rendered from the
sink plan, tile the window's band and take its pairs (the sink keys' in-window pairs among them);
``sink_bwd`` here takes the rest, the sink pairs outside the window (``_outside``; d the
dilation, delta = i - j):

    causal:        j < S, delta >= 0, and delta % d != 0 or delta / d >= W
    bidirectional: j < S, and |delta| % d != 0 or |delta| / d >= W

The forward of an undilated window holds its sink in the Gluon kernel. A dilated window's
residue classes run the window alone (a class's rows do not hold the other classes' sink keys),
and ``sink_fwd`` merges each row's sink pairs outside the window into its o and LSE by their
log-sum-exp, in place.

Every query contributes to the sink keys' dK / dV, so their sums run over the whole sequence:
one program per (chunk of rows, batch x query head, chunk of ``gluon.SINK_KEYS`` sink keys), its
keys' K, V, dK and dV resident, writing fp32 partial sums per chunk of rows that the launcher adds
up in a fixed order (deterministic), over the chunks and the GQA group, into dK / dV's first S
rows. A program's row tiles run as branch-free loops pipelined over ``gluon.SINK_BWD_STAGES`` (a
test of each tile, the loads under it, kept Triton from overlapping them with the products: 1.69
against 1.06 ms alone at ``window=4096,sink=64``, benchmarks/NOTES.md). dQ's extra terms are added
to the rows' dQ: from the fused form's fp32 copy into the output (``CONVERT``: every row, the
conversion the fused form needs anyway), or in place into the two-kernel form's dQ (rounded twice
in its dtype: once by the dQ kernel, once here). A sink of one key chunk does both in one launch;
a longer one's dQ terms sum over every chunk, so they take a second launch (``DQ`` without ``KV``)
whose row tiles loop over the chunks, loading each (from L2: the sink's K and V are small) and
recomputing its scores.

Loaded on first use (``kernels/gluon.py``), so that ``TRITON_INTERPRET`` set by the caller takes
effect. Names follow the house style: ``p_`` pointers, ``b_`` register blocks, ``m_`` masks,
``o_`` offsets, ``i_`` program ids.
"""
import triton
import triton.language as tl


@triton.jit
def _outside(o_i, o_s, m_i, m_s, WINDOW: tl.constexpr, DILATION: tl.constexpr, CAUSAL: tl.constexpr):
    """[rows, keys]: the sink pairs outside the window (rows and keys inside N and the sink):
    delta = i - j; the window holds |delta| % DILATION == 0 and |delta| / DILATION < WINDOW
    (causal: delta >= 0), the sink j <= i when causal."""
    delta = o_i[:, None] - o_s[None, :]
    if CAUSAL:
        dist = delta
        m_x = delta >= 0
    else:
        dist = tl.abs(delta)
        m_x = dist >= 0
    if DILATION == 1:
        m_x = m_x & (dist >= WINDOW)
    else:
        m_x = m_x & ((dist % DILATION != 0) | (dist // DILATION >= WINDOW))
    return m_x & m_i[:, None] & m_s[None, :]


@triton.jit
def _program(K, V, stride_kb, stride_kh, stride_vb, stride_vh, pid_bh, H0, HS, GROUP,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program's batch and query head (program id ``pid_bh`` of B * HS, heads from H0), its
    column offsets and mask, and K / V at the first row of KV head h // GROUP:
    (i_b, i_h, o_d, m_d, p_k, p_v)."""
    i_b = pid_bh // HS
    i_h = H0 + pid_bh % HS
    i_hk = i_h // GROUP
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    p_k = K + tl.cast(i_b, tl.int64) * stride_kb + tl.cast(i_hk, tl.int64) * stride_kh
    p_v = V + tl.cast(i_b, tl.int64) * stride_vb + tl.cast(i_hk, tl.int64) * stride_vh
    return i_b, i_h, o_d, m_d, p_k, p_v


@triton.jit
def _sink_keys(p_k, p_v, stride_kn, stride_vn, KEY0, N, o_d, m_d,
               SINK: tl.constexpr, BLOCK_S: tl.constexpr):
    """Sink keys [KEY0, KEY0 + BLOCK_S) of one KV head (``p_k`` / ``p_v`` at its first row): their
    offsets and mask, and their K and V [BLOCK_S, BLOCK_D] (rows past S or N read zeros):
    (o_s, m_s, b_k, b_v)."""
    o_s = KEY0 + tl.arange(0, BLOCK_S)
    m_s = o_s < tl.minimum(SINK, N)
    m_sd = m_s[:, None] & m_d[None, :]
    b_k = tl.load(p_k + o_s[:, None] * stride_kn + o_d[None, :], mask=m_sd, other=0.0)
    b_v = tl.load(p_v + o_s[:, None] * stride_vn + o_d[None, :], mask=m_sd, other=0.0)
    return o_s, m_s, b_k, b_v


@triton.jit
def _fwd_tile(r0, r_hi, p_q, p_o, p_l, p_k, p_v, stride_qn, stride_on, stride_kn, stride_vn, N, o_d, m_d,
              o_s, m_s, b_k, b_v, qk_scale, SINK: tl.constexpr, WINDOW: tl.constexpr, DILATION: tl.constexpr,
              CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
              N_KC: tl.constexpr, DOT_PREC: tl.constexpr):
    """Rows [r0, r0 + BLOCK_M) (those under r_hi) of ``sink_fwd``: their sink pairs outside the
    window merged into o and the LSE. One chunk of keys: held (o_s, b_k, b_v); N_KC: each loaded."""
    o_i = r0 + tl.arange(0, BLOCK_M)
    m_i = o_i < r_hi
    m_id = m_i[:, None] & m_d[None, :]
    o_row = o_i[:, None].to(tl.int64)
    b_q = tl.load(p_q + o_row * stride_qn + o_d[None, :], mask=m_id, other=0.0)
    if N_KC == 1:
        # [BLOCK_M, BLOCK_S] scores in log2 units, -inf outside the sink's extra pairs
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * qk_scale
        b_s = tl.where(_outside(o_i, o_s, m_i, m_s, WINDOW, DILATION, CAUSAL), b_s, float("-inf"))
        r_mx = tl.max(b_s, 1)
        r_mx_safe = tl.where(r_mx == float("-inf"), 0.0, r_mx)
        b_p = tl.exp2(b_s - r_mx_safe[:, None])
        r_lx = tl.sum(b_p, 1)
        b_ox = tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC)
    else:
        # the chunks folded by an online softmax: running max (-inf: no pair yet), sum, P V
        r_mx = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        r_lx = tl.zeros([BLOCK_M], dtype=tl.float32)
        b_ox = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for i_kc in tl.range(0, N_KC):
            o_c, m_c, b_kc, b_vc = _sink_keys(p_k, p_v, stride_kn, stride_vn, i_kc * BLOCK_S, N, o_d, m_d,
                                              SINK, BLOCK_S)
            b_s = tl.dot(b_q, tl.trans(b_kc), input_precision=DOT_PREC) * qk_scale
            b_s = tl.where(_outside(o_i, o_c, m_i, m_c, WINDOW, DILATION, CAUSAL), b_s, float("-inf"))
            r_new = tl.maximum(r_mx, tl.max(b_s, 1))
            r_safe = tl.where(r_new == float("-inf"), 0.0, r_new)
            r_alpha = tl.exp2(r_mx - r_safe)     # 0 while no pair was seen
            b_p = tl.exp2(b_s - r_safe[:, None])
            r_lx = r_lx * r_alpha + tl.sum(b_p, 1)
            b_ox = b_ox * r_alpha[:, None] + tl.dot(b_p.to(b_vc.dtype), b_vc, input_precision=DOT_PREC)
            r_mx = r_new
        r_mx_safe = tl.where(r_mx == float("-inf"), 0.0, r_mx)
    # merge: the window's (o_w, lse_w) and the extra pairs' (b_ox / r_lx, r_mx + log2 r_lx)
    r_lw = tl.load(p_l + o_i, mask=m_i, other=float("-inf")) * 1.4426950408889634
    r_m = tl.maximum(r_lw, tl.where(r_lx > 0, r_mx_safe, float("-inf")))
    r_m = tl.where(r_m == float("-inf"), 0.0, r_m)
    r_aw = tl.exp2(r_lw - r_m)              # 0 where the window saw nothing
    r_ax = tl.exp2(r_mx_safe - r_m)         # scales b_p's rows
    r_den = r_aw + r_ax * r_lx
    r_seen = r_den > 0                     # false only on rows past N (masked)
    r_inv = tl.where(r_seen, 1.0 / tl.where(r_seen, r_den, 1.0), 0.0)
    b_o = tl.load(p_o + o_row * stride_on + o_d[None, :], mask=m_id, other=0.0).to(tl.float32)
    b_o = (b_o * r_aw[:, None] + b_ox * r_ax[:, None]) * r_inv[:, None]
    tl.store(p_o + o_row * stride_on + o_d[None, :], b_o.to(p_o.dtype.element_ty), mask=m_id)
    r_lse = tl.where(r_seen, (r_m + tl.log2(tl.where(r_seen, r_den, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(p_l + o_i, r_lse, mask=m_i)


@triton.jit
def sink_fwd(Q, K, V, O, LSE, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
             stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on, stride_lb, stride_lh,
             H0, HS, GROUP, N, CHUNK, qk_scale,
             SINK: tl.constexpr, WINDOW: tl.constexpr, DILATION: tl.constexpr, CAUSAL: tl.constexpr,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
             N_KC: tl.constexpr, DOT_PREC: tl.constexpr):
    # grid: (chunks of CHUNK rows, B * HS). O and LSE (natural log) hold the window's attention of
    # the rows (the Gluon forward's); each row's sink pairs outside the window are merged into
    # them by their log-sum-exp, in place. Rows as in sink_bwd. The sink's keys in N_KC chunks of
    # BLOCK_S: one chunk held in registers for every row tile; several loaded by each row tile
    # (from L2) and folded by an online softmax.
    i_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b, i_h, o_d, m_d, p_k, p_v = _program(K, V, stride_kb, stride_kh, stride_vb, stride_vh, pid_bh, H0, HS, GROUP,
                                            HEAD_DIM, BLOCK_D)
    p_q = Q + tl.cast(i_b, tl.int64) * stride_qb + tl.cast(i_h, tl.int64) * stride_qh
    p_o = O + tl.cast(i_b, tl.int64) * stride_ob + tl.cast(i_h, tl.int64) * stride_oh
    p_l = LSE + tl.cast(i_b, tl.int64) * stride_lb + tl.cast(i_h, tl.int64) * stride_lh
    r_lo = i_c * CHUNK
    r_hi = tl.minimum(r_lo + CHUNK, N)
    if N_KC == 1:
        o_s, m_s, b_k, b_v = _sink_keys(p_k, p_v, stride_kn, stride_vn, 0, N, o_d, m_d, SINK, BLOCK_S)
        for r0 in range(r_lo, r_hi, BLOCK_M):
            _fwd_tile(r0, r_hi, p_q, p_o, p_l, p_k, p_v, stride_qn, stride_on, stride_kn, stride_vn, N, o_d, m_d,
                      o_s, m_s, b_k, b_v, qk_scale, SINK, WINDOW, DILATION, CAUSAL, BLOCK_M, BLOCK_D, BLOCK_S, N_KC,
                      DOT_PREC)
    else:
        # the row loop not pipelined: copies of every chunk's loads would not fit in shared memory
        for r0 in tl.range(r_lo, r_hi, BLOCK_M, num_stages=1):
            _fwd_tile(r0, r_hi, p_q, p_o, p_l, p_k, p_v, stride_qn, stride_on, stride_kn, stride_vn, N, o_d, m_d,
                      0, 0, 0, 0, qk_scale, SINK, WINDOW, DILATION, CAUSAL, BLOCK_M, BLOCK_D, BLOCK_S, N_KC,
                      DOT_PREC)


@triton.jit
def _sink_tile(r0, r_hi, p_q, p_do, p_in, p_out, p_k, p_v, LSE2, DELTA, s_row, stride_qn, stride_don, stride_in,
               stride_on, stride_kn, stride_vn, N, o_d, m_d, o_s, m_s, b_k, b_v, b_dk, b_dv, qk_scale, sm_scale,
               SINK: tl.constexpr, WINDOW: tl.constexpr, DILATION: tl.constexpr, CAUSAL: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, DQ: tl.constexpr, KV: tl.constexpr,
               N_KC: tl.constexpr, DOT_PREC: tl.constexpr):
    """Rows [r0, r0 + BLOCK_M) (those under r_hi) of the sink pass: their sink pairs outside the
    window. KV: with the keys held (o_s, b_k, b_v), adds their dK, dV terms to b_dk, b_dv. DQ: adds
    dQ's terms to the rows' DQ_IN and stores them to DQ_OUT; without KV, over the N_KC chunks of
    BLOCK_S sink keys, each loaded here. Returns b_dk, b_dv."""
    o_i = r0 + tl.arange(0, BLOCK_M)
    m_i = o_i < r_hi
    m_id = m_i[:, None] & m_d[None, :]
    o_row = o_i[:, None].to(tl.int64)
    if DQ:
        b_dq = tl.load(p_in + o_row * stride_in + o_d[None, :], mask=m_id, other=0.0).to(tl.float32)
    b_q = tl.load(p_q + o_row * stride_qn + o_d[None, :], mask=m_id, other=0.0)
    b_do = tl.load(p_do + o_row * stride_don + o_d[None, :], mask=m_id, other=0.0)
    b_lse2 = tl.load(LSE2 + s_row + o_i, mask=m_i, other=0.0)
    b_delta = tl.load(DELTA + s_row + o_i, mask=m_i, other=0.0)
    if KV:
        # [BLOCK_M, BLOCK_S] the sink pairs outside the window
        m_x = _outside(o_i, o_s, m_i, m_s, WINDOW, DILATION, CAUSAL)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
        b_p = tl.where(m_x, tl.exp2(b_s * qk_scale - b_lse2[:, None]), 0.0)
        b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision=DOT_PREC)
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
        b_ds = (b_p * (b_dp - b_delta[:, None])).to(b_q.dtype)
        if DQ:
            b_dq += tl.dot(b_ds, b_k, input_precision=DOT_PREC) * sm_scale
        b_dk += tl.dot(tl.trans(b_ds), b_q, input_precision=DOT_PREC)
    else:
        # dQ's terms over every chunk: a loop, not unrolled (unrolled under the pipelined row loop,
        # every chunk's loads took 541 KB of shared memory at sink=256, D=128, sm_90); Triton
        # pipelines this loop's loads, and the row loop around it not at all
        for i_kc in tl.range(0, N_KC):
            o_c, m_c, b_kc, b_vc = _sink_keys(p_k, p_v, stride_kn, stride_vn, i_kc * BLOCK_S, N, o_d, m_d,
                                              SINK, BLOCK_S)
            m_x = _outside(o_i, o_c, m_i, m_c, WINDOW, DILATION, CAUSAL)
            b_s = tl.dot(b_q, tl.trans(b_kc), input_precision=DOT_PREC)
            b_p = tl.where(m_x, tl.exp2(b_s * qk_scale - b_lse2[:, None]), 0.0)
            b_dp = tl.dot(b_do, tl.trans(b_vc), input_precision=DOT_PREC)
            b_ds = (b_p * (b_dp - b_delta[:, None])).to(b_q.dtype)
            b_dq += tl.dot(b_ds, b_kc, input_precision=DOT_PREC) * sm_scale
    if DQ:
        tl.store(p_out + o_row * stride_on + o_d[None, :], b_dq.to(p_out.dtype.element_ty), mask=m_id)
    return b_dk, b_dv


@triton.jit
def sink_bwd(Q, K, V, DO, LSE2, DELTA, DQ_IN, DQ_OUT, PK, PV,
             stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
             stride_dob, stride_doh, stride_don, stride_lb, stride_lh,
             stride_ib, stride_ih, stride_in, stride_ob, stride_oh, stride_on,
             H0, HS, GROUP, N, ROW0, CHUNK, qk_scale, sm_scale,
             SINK: tl.constexpr, WINDOW: tl.constexpr, DILATION: tl.constexpr, CAUSAL: tl.constexpr,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
             CONVERT: tl.constexpr, STAGES: tl.constexpr, DQ: tl.constexpr, KV: tl.constexpr,
             N_KC: tl.constexpr, KEY0: tl.constexpr, DOT_PREC: tl.constexpr):
    # grid: (chunks of CHUNK rows from ROW0, B * HS, key chunks). Query head h = H0 + pid % HS reads
    # KV head h // GROUP. Rows of q, do, dq: (b, h, i) at b * stride_xb + h * stride_xh + i *
    # stride_xn, the last dim contiguous; LSE2 / DELTA rows at (stride_lb, stride_lh).
    # Forms: DQ and KV, one chunk of keys from KEY0 (N_KC = 1; the whole sink when it is one
    # chunk; the fused form runs a longer sink as one such launch a chunk, dQ's fp32 copy added
    # to in place, the last converting); KV alone, program id 2 the key chunk [i * BLOCK_S, ...)
    # it holds; DQ alone, over N_KC chunks, each loaded by every row tile (the two-kernel form's
    # longer sink: the KV launch, then this). KV: PK / PV, fp32 [chunks, B * HS, key chunks *
    # BLOCK_S, BLOCK_D] contiguous, take the program's partial dK / dV of its sink keys.
    i_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_kc = tl.program_id(2)
    i_b, i_h, o_d, m_d, p_k, p_v = _program(K, V, stride_kb, stride_kh, stride_vb, stride_vh, pid_bh, H0, HS, GROUP,
                                            HEAD_DIM, BLOCK_D)
    p_q = Q + tl.cast(i_b, tl.int64) * stride_qb + tl.cast(i_h, tl.int64) * stride_qh
    p_do = DO + tl.cast(i_b, tl.int64) * stride_dob + tl.cast(i_h, tl.int64) * stride_doh
    p_in = DQ_IN + tl.cast(i_b, tl.int64) * stride_ib + tl.cast(i_h, tl.int64) * stride_ih
    p_out = DQ_OUT + tl.cast(i_b, tl.int64) * stride_ob + tl.cast(i_h, tl.int64) * stride_oh
    s_row = tl.cast(i_b, tl.int64) * stride_lb + tl.cast(i_h, tl.int64) * stride_lh
    if KV:
        # with DQ the launch's chunk from KEY0 (the whole sink from 0 when it is one chunk), else
        # this program's
        key0 = KEY0 if DQ else i_kc * BLOCK_S
        o_s, m_s, b_k, b_v = _sink_keys(p_k, p_v, stride_kn, stride_vn, key0, N, o_d, m_d, SINK, BLOCK_S)
        b_dk = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
        b_dv = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    else:   # each row tile loads the chunks (_sink_tile); these are placeholders
        o_s = 0
        m_s = 0
        b_k = 0
        b_v = 0
        b_dk = tl.zeros([1], dtype=tl.float32)
        b_dv = tl.zeros([1], dtype=tl.float32)
    r_lo = ROW0 + i_c * CHUNK
    r_hi = tl.minimum(r_lo + CHUNK, N)
    # The chunk's tiles of BLOCK_M rows, r_lo + k * BLOCK_M, in three runs, each loop branch-free so
    # that its loads pipeline over STAGES: [r_lo, t_a) and [t_b, r_hi) see a sink key outside their window,
    # [t_a, t_b) do not (their dQ only converted, CONVERT). Dilated: every tile (a row sees the
    # sink keys of other residue classes; a tile with none adds zeros). Undilated: a tile whose
    # last row r_last = min(r0 + BLOCK_M, N) - 1 reaches W, and bidirectional also one whose
    # first row r0 is W or more before the last sink key (of the whole sink: a key chunk's
    # tiles past its own last key add zeros).
    t_a = r_lo
    t_b = r_lo
    if DILATION == 1:
        if not CAUSAL:
            t_a = tl.minimum(r_lo + tl.cdiv(tl.maximum(tl.minimum(SINK, N) - WINDOW - r_lo, 0), BLOCK_M) * BLOCK_M,
                             r_hi)
        t_b = tl.minimum(r_lo + tl.cdiv(tl.maximum(WINDOW - BLOCK_M + 1 - r_lo, 0), BLOCK_M) * BLOCK_M, r_hi)
        t_b = tl.maximum(t_b, t_a)
    if CONVERT:
        for r0 in tl.range(t_a, t_b, BLOCK_M, num_stages=STAGES):
            o_i = r0 + tl.arange(0, BLOCK_M)
            m_id = (o_i < r_hi)[:, None] & m_d[None, :]
            o_row = o_i[:, None].to(tl.int64)
            b_dq = tl.load(p_in + o_row * stride_in + o_d[None, :], mask=m_id, other=0.0)
            tl.store(p_out + o_row * stride_on + o_d[None, :], b_dq.to(DQ_OUT.dtype.element_ty), mask=m_id)
    # the extra tiles as one loop (one copy of its body): [r_lo, t_a), then [t_b, r_hi); t_a is
    # a tile's start or r_hi, so its run has cdiv tiles
    n_a = tl.cdiv(t_a - r_lo, BLOCK_M)
    n_x = n_a + tl.cdiv(r_hi - t_b, BLOCK_M)
    for i_t in tl.range(0, n_x, num_stages=STAGES if KV else 1):
        r0 = r_lo + i_t * BLOCK_M + tl.where(i_t >= n_a, t_b - t_a, 0)
        b_dk, b_dv = _sink_tile(r0, r_hi, p_q, p_do, p_in, p_out, p_k, p_v, LSE2, DELTA, s_row, stride_qn,
                                stride_don, stride_in, stride_on, stride_kn, stride_vn, N, o_d, m_d, o_s, m_s,
                                b_k, b_v, b_dk, b_dv, qk_scale, sm_scale, SINK, WINDOW, DILATION, CAUSAL, BLOCK_M,
                                BLOCK_S, DQ, KV, N_KC, DOT_PREC)
    if KV:
        if DQ:
            part = (tl.cast(i_c, tl.int64) * tl.num_programs(1) + pid_bh) * (BLOCK_S * BLOCK_D)
        else:
            part = (((tl.cast(i_c, tl.int64) * tl.num_programs(1) + pid_bh) * tl.num_programs(2) + i_kc)
                    * (BLOCK_S * BLOCK_D))
        o_sd = tl.arange(0, BLOCK_S)[:, None] * BLOCK_D + o_d[None, :]
        tl.store(PK + part + o_sd, b_dk * sm_scale)
        tl.store(PV + part + o_sd, b_dv)
