"""Triton kernels of MSA: the fused selection, and the main attention over per-query selections.

Loaded on first use (``launch._kernels``), so that ``TRITON_INTERPRET`` set by the caller takes
effect. Names follow the house style: ``p_`` pointers, ``b_`` register blocks, ``m_`` masks,
``o_`` offsets, ``i_`` program ids; ``r_`` values per tile row, ``e_`` per entry.

Selection (``msa_select_kernel``): one program per (query tile, batch x proxy head) walks the key
blocks up to its own, scores each block by the max of its visible proxy scores, and keeps a
running top-K per query row in registers. A candidate is one int64 key: the score's
order-preserving int32 bits above ``0x7FFFFFFF - block``, so that one integer comparison orders
by score and, among equal scores, prefers the lower block (the keys of ``select_blocks``,
``sparsity.select_kernels``). Nothing N x N or N x N/block is stored.

Main attention (``msa_fwd_kernel``, ``msa_bwd_kernel``): key-block centred. A reverse index lists,
for every (batch, proxy head, key block), the queries that selected it; work items cut the lists
into pieces of at most W entries. A program loads its key block once and streams the gathered
queries through it, all main heads of the proxy group at once: the rows of a tile are
(entry, head) pairs, BQ entries x GP heads. Pass 1 writes each entry's partial LSE; pass 2, with
the merged LSE, adds P @ V into a float32 output (atomics: one query's K blocks live in K
programs) and, on request, the exact KL terms. The backward accumulates dK/dV (and the proxy's
dK) of its block in registers and adds dQ (and the proxy's dQ) per entry with atomics; the
teaching gradient is fused there, from the probabilities the backward computes anyway.
"""
import triton
import triton.language as tl

from ..sparsity.select_kernels import EMPTY, key_index, own_key, score_key

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def msa_select_kernel(QP, KP, DSTART, IDX,
                      s_qb, s_qh, s_qn, s_kb, s_kh, s_kn,
                      N, scale,
                      HP: tl.constexpr, HP_PER_K: tl.constexpr, DP: tl.constexpr, BLOCK_DP: tl.constexpr,
                      BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_DOCS: tl.constexpr, DOT_PREC: tl.constexpr):
    # heaviest (last) query tiles first: the causal loop is longest there
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)
    i_bp = tl.program_id(1)
    i_b = i_bp // HP
    i_p = i_bp % HP
    i_pk = i_p // HP_PER_K
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < N
    o_d = tl.arange(0, BLOCK_DP)
    m_d = o_d < DP
    # [BLOCK_M, BLOCK_DP]
    b_q = tl.load(QP + i_b * s_qb + i_p * s_qh + o_m[:, None] * s_qn + o_d[None, :],
                  mask=m_m[:, None] & m_d[None, :], other=0.0)
    if HAS_DOCS:
        # [BLOCK_M] first position of each row's document
        b_start = tl.load(DSTART + o_m, mask=m_m, other=0)
        kb_lo = tl.min(tl.where(m_m, b_start, N), axis=0) // BLOCK
    else:
        b_start = tl.zeros([BLOCK_M], dtype=tl.int32)
        kb_lo = 0
    # BLOCK_M divides BLOCK: every row of the tile has the same own block
    kb_own = (i_m * BLOCK_M) // BLOCK
    o_s = tl.arange(0, BLOCK_K)
    # [BLOCK_M, BLOCK_K] int64 candidate keys: empty slots hold the smallest int64 and lose to any
    # real block; the padding slots past K hold the largest and are never replaced
    empty = tl.full([BLOCK_M, BLOCK_K], EMPTY, tl.int64)
    top = tl.where(o_s[None, :] < K, empty, tl.full([BLOCK_M, BLOCK_K], 9223372036854775807, tl.int64))
    p_k0 = KP + i_b * s_kb + i_pk * s_kh
    for kb in range(kb_lo, kb_own + 1):
        o_n = kb * BLOCK + tl.arange(0, BLOCK)
        # [BLOCK, BLOCK_DP]
        b_k = tl.load(p_k0 + o_n[:, None] * s_kn + o_d[None, :], mask=(o_n < N)[:, None] & m_d[None, :], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * scale
        m_s = (o_n[None, :] <= o_m[:, None]) & (o_n[None, :] >= b_start[:, None])
        b_s = tl.where(m_s, b_s, float("-inf"))
        # [BLOCK_M] the block's score per row
        b_max = tl.max(b_s, axis=1)
        key = score_key(b_max, kb)
        # the own block always wins a slot
        key = tl.where(kb == kb_own, own_key(key), tl.where(b_max > float("-inf"), key, EMPTY))
        # replace the row's smallest key (its first slot when several are empty) if the new one is larger
        b_min = tl.min(top, axis=1)
        slot = tl.min(tl.where(top == b_min[:, None], o_s[None, :], BLOCK_K), axis=1)
        top = tl.where((o_s[None, :] == slot[:, None]) & (key > b_min)[:, None], key[:, None], top)
    m_ok = (top > EMPTY) & (o_s[None, :] < K)
    b_blk = key_index(top)
    # ascending block ids, unused slots (-1) last
    b_blk = tl.sort(tl.where(m_ok, b_blk, 0x3FFFFFFF), dim=1)
    b_blk = tl.where(b_blk == 0x3FFFFFFF, -1, b_blk)
    p_idx = IDX + (i_bp * N + o_m[:, None]) * K + o_s[None, :]
    tl.store(p_idx, b_blk, mask=m_m[:, None] & (o_s[None, :] < K))


@triton.jit
def _rows(e_val, BLOCK_Q: tl.constexpr, GP: tl.constexpr):
    """[BLOCK_Q] per entry -> [BLOCK_Q * GP] per tile row (rows are entry-major)."""
    return tl.reshape(tl.broadcast_to(e_val[:, None], (BLOCK_Q, GP)), (BLOCK_Q * GP,))


@triton.jit
def _entries(ITEMS, REV, i_t, n_items, c, N, K: tl.constexpr, BLOCK_Q: tl.constexpr, DENSE: tl.constexpr):
    """Entries c .. c + BLOCK_Q of work item i_t: (flat selection position, query position, mask)."""
    start = tl.load(ITEMS + n_items + i_t)
    length = tl.load(ITEMS + 2 * n_items + i_t)
    o_e = c + tl.arange(0, BLOCK_Q)
    m_e = o_e < length
    if DENSE:
        # warm-up: an item is a run of consecutive queries
        e_i = start + o_e
        e_pos = e_i
    else:
        e_pos = tl.load(REV + start + o_e, mask=m_e, other=0)
        e_i = (e_pos // K) % N
    return e_pos, e_i, m_e


@triton.jit
def _chunk_heads(h0, c, G: tl.constexpr, G_KV: tl.constexpr, CH: tl.constexpr, CPS: tl.constexpr):
    """Chunk c of the proxy group of heads h0 .. h0 + G - 1: its KV head, first head and number of
    heads. The group's heads are cut where their KV head changes, and each KV head's share into
    CPS chunks of at most CH heads; a chunk past the end of its share has none."""
    kv = h0 // G_KV + c // CPS
    lo = tl.maximum(h0, kv * G_KV)
    hs = lo + (c % CPS) * CH
    return kv, hs, tl.minimum(tl.minimum(h0 + G, (kv + 1) * G_KV) - hs, CH)


@triton.jit
def _program_heads(h0, i_c, length, G: tl.constexpr, G_KV: tl.constexpr, CH: tl.constexpr, CPS: tl.constexpr,
                   ONE: tl.constexpr):
    """The program's chunk (``_chunk_heads`` of program axis 2, i_c): KV head, first head, number
    of heads, and how many of the work item's entries to walk (none for an empty chunk). ONE: the
    group is a single chunk (constants but for the KV head)."""
    if ONE:
        return h0 // G_KV, h0, G, length
    else:
        kv, hs, n_h = _chunk_heads(h0, i_c, G, G_KV, CH, CPS)
        return kv, hs, n_h, tl.where(n_h > 0, length, 0)


@triton.jit
def _fwd_heads(Q, LSE, LSE_PART, O32, b_k, b_v, s_qb, s_qh, s_qn, i_b, i_sub, h0, hs, n_h, e_pos, r_i, r_e, m_rk_e,
               N, qk_scale, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, SUB: tl.constexpr,
               PASS: tl.constexpr, WITH_OUT: tl.constexpr, WITH_KL: tl.constexpr, DOT_PREC: tl.constexpr):
    """One tile of the main heads hs .. hs + n_h - 1 (one KV head's keys b_k and values b_v): PASS 1
    stores their partial LSEs, PASS 2 adds P @ V into O32. Returns the probabilities summed over
    the tile's heads, [BLOCK_Q, BLOCK_N] (the teacher's share; zeros but for PASS 2 WITH_KL)."""
    M: tl.constexpr = BLOCK_Q * GP
    r_g = tl.arange(0, M) % GP
    r_h = hs + r_g
    r_m = r_e & (r_g < n_h)
    m_rk = m_rk_e & r_m[:, None]
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    # [M, BLOCK_D]
    b_q = tl.load(Q + i_b * s_qb + r_h[:, None] * s_qh + r_i[:, None] * s_qn + o_d[None, :],
                  mask=r_m[:, None] & m_d[None, :], other=0.0)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * qk_scale
    b_s = tl.where(m_rk, b_s, float("-inf"))
    b_t = tl.zeros([BLOCK_Q, BLOCK_N], dtype=tl.float32)
    if PASS == 1:
        b_m = tl.max(b_s, axis=1)
        b_m = tl.where(b_m == float("-inf"), 0.0, b_m)
        b_l = tl.sum(tl.exp2(b_s - b_m[:, None]), axis=1)
        tl.store(LSE_PART + (_rows(e_pos, BLOCK_Q, GP) * SUB + i_sub) * G + (r_h - h0),
                 (b_m + tl.log2(tl.where(b_l > 0, b_l, 1.0))) * LN2, mask=r_m & (b_l > 0))
    else:
        # [M] the merged LSE in log2 units
        r_lse = tl.load(LSE + ((i_b * H + r_h) * N + r_i), mask=r_m, other=0.0) * LOG2E
        b_pr = tl.exp2(b_s - r_lse[:, None])
        if WITH_OUT:
            b_o = tl.dot(b_pr.to(b_v.dtype), b_v, input_precision=DOT_PREC)
            tl.atomic_add(O32 + ((i_b * H + r_h[:, None]) * N + r_i[:, None]) * D + o_d[None, :], b_o,
                          mask=r_m[:, None] & m_d[None, :], sem="relaxed")
        if WITH_KL:
            b_t = tl.sum(tl.reshape(b_pr, (BLOCK_Q, GP, BLOCK_N)), axis=1)
    return b_t


@triton.jit
def _proxy_scores(QP, b_kp, s_pqb, s_pqh, s_pqn, i_b, i_p, e_i, m_e, m_ek, pk_scale, DP: tl.constexpr,
                  BLOCK_DP: tl.constexpr, DOT_PREC: tl.constexpr):
    """[BLOCK_Q, BLOCK_N] the proxy's scores of the entries' queries against the sub-block (log2
    units, -inf where not visible)."""
    o_dp = tl.arange(0, BLOCK_DP)
    # [BLOCK_Q, BLOCK_DP]
    b_qp = tl.load(QP + i_b * s_pqb + i_p * s_pqh + e_i[:, None] * s_pqn + o_dp[None, :],
                   mask=m_e[:, None] & (o_dp < DP)[None, :], other=0.0)
    b_sp = tl.dot(b_qp, tl.trans(b_kp), input_precision=DOT_PREC) * pk_scale
    return tl.where(m_ek, b_sp, float("-inf"))


@triton.jit
def _proxy_lse_part(QP, LSEP_PART, b_kp, s_pqb, s_pqh, s_pqn, i_b, i_p, i_sub, e_pos, e_i, m_e, m_ek, pk_scale,
                    DP: tl.constexpr, BLOCK_DP: tl.constexpr, SUB: tl.constexpr, DOT_PREC: tl.constexpr):
    """The proxy's partial LSE of each entry over the sub-block."""
    b_sp = _proxy_scores(QP, b_kp, s_pqb, s_pqh, s_pqn, i_b, i_p, e_i, m_e, m_ek, pk_scale, DP, BLOCK_DP, DOT_PREC)
    b_mp = tl.max(b_sp, axis=1)
    b_mp = tl.where(b_mp == float("-inf"), 0.0, b_mp)
    b_lp = tl.sum(tl.exp2(b_sp - b_mp[:, None]), axis=1)
    tl.store(LSEP_PART + e_pos * SUB + i_sub, (b_mp + tl.log2(tl.where(b_lp > 0, b_lp, 1.0))) * LN2, mask=m_e & (b_lp > 0))


@triton.jit
def msa_fwd_kernel(Q, K, V, QP, KP, DSTART, ITEMS, REV, LSE, LSEP, LSE_PART, LSEP_PART, O32, KL_ROWS,
                   s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
                   s_pqb, s_pqh, s_pqn, s_pkb, s_pkh, s_pkn,
                   N, NBLK, n_items, qk_scale, pk_scale,
                   H: tl.constexpr, HP: tl.constexpr, HP_PER_K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                   G_KV: tl.constexpr, SPAN: tl.constexpr, CH: tl.constexpr, CPS: tl.constexpr,
                   WHOLE_GROUP: tl.constexpr, KSEL: tl.constexpr,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, DP: tl.constexpr, BLOCK_DP: tl.constexpr,
                   BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
                   PASS: tl.constexpr, WITH_OUT: tl.constexpr, WITH_KL: tl.constexpr, HAS_DOCS: tl.constexpr,
                   DENSE: tl.constexpr, DOT_PREC: tl.constexpr):
    """PASS 1: partial LSEs (main heads and proxy) per entry. PASS 2: P @ V into O32 and the KL terms.

    Grid: (work item, BLOCK / BLOCK_N key sub-blocks, head chunks of a proxy group). A tile's rows
    are (entry, head) pairs over one chunk: at most CH heads of the group that read one KV head
    (GP, padded); SPAN KV heads a group, CPS chunks a KV head's share (``_chunk_heads``).
    WHOLE_GROUP (the KL with more than one chunk: its teacher is a mean over every head of the
    group) instead walks the chunks in one program, and the grid's third axis is 1. qk_scale /
    pk_scale are the main / proxy softmax scales times log2(e): scores in log2 units.
    """
    # the KL needs every head of the group in one program
    tl.static_assert(not WITH_KL or WHOLE_GROUP or SPAN * CPS == 1)
    SUB: tl.constexpr = BLOCK // BLOCK_N
    i_t = tl.program_id(0)
    i_sub = tl.program_id(1)
    i_c = tl.program_id(2)
    lst = tl.load(ITEMS + i_t)
    length = tl.load(ITEMS + 2 * n_items + i_t)
    i_bp = lst // NBLK
    kb = lst % NBLK
    i_b = i_bp // HP
    i_p = i_bp % HP
    i_pk = i_p // HP_PER_K
    h0 = i_p * G
    o_n = kb * BLOCK + i_sub * BLOCK_N + tl.arange(0, BLOCK_N)
    # (a scalar in a vector mask trips the interpreter: fold it into the bound)
    m_n = o_n < tl.where(length > 0, N, 0)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_dp = tl.arange(0, BLOCK_DP)
    m_dp = o_dp < DP
    kv, hs, n_h, n_end = _program_heads(h0, i_c, length, G, G_KV, CH, CPS, SPAN * CPS == 1)
    # an empty chunk reads no key
    m_kv = o_n < tl.where(n_end > 0, N, 0)
    if not WHOLE_GROUP:
        # [BLOCK_N, BLOCK_D] the sub-block's keys and values, read once for every gathered query
        b_k = tl.load(K + i_b * s_kb + kv * s_kh + o_n[:, None] * s_kn + o_d[None, :],
                      mask=m_kv[:, None] & m_d[None, :], other=0.0)
        b_v = b_k
        if PASS == 2 and WITH_OUT:
            b_v = tl.load(V + i_b * s_vb + kv * s_vh + o_n[:, None] * s_vn + o_d[None, :],
                          mask=m_kv[:, None] & m_d[None, :], other=0.0)
    if PASS == 1 or WITH_KL:
        # [BLOCK_N, BLOCK_DP]
        b_kp = tl.load(KP + i_b * s_pkb + i_pk * s_pkh + o_n[:, None] * s_pkn + o_dp[None, :],
                       mask=m_n[:, None] & m_dp[None, :], other=0.0)
    for c in range(0, n_end, BLOCK_Q):
        e_pos, e_i, m_e = _entries(ITEMS, REV, i_t, n_items, c, N, KSEL, BLOCK_Q, DENSE)
        if HAS_DOCS:
            e_start = tl.load(DSTART + e_i, mask=m_e, other=0)
        else:
            e_start = tl.zeros([BLOCK_Q], dtype=tl.int32)
        # [BLOCK_Q, BLOCK_N] the keys each entry's query may see in this block
        m_ek = (o_n[None, :] <= e_i[:, None]) & (o_n[None, :] >= e_start[:, None]) & m_e[:, None] & m_n[None, :]
        r_i = _rows(e_i, BLOCK_Q, GP)
        r_e = _rows(m_e, BLOCK_Q, GP)
        m_rk_e = tl.reshape(tl.broadcast_to(m_ek[:, None, :], (BLOCK_Q, GP, BLOCK_N)), (BLOCK_Q * GP, BLOCK_N))
        if WHOLE_GROUP:
            b_t = tl.zeros([BLOCK_Q, BLOCK_N], dtype=tl.float32)
            # a loop, not static_range: up to 16 copies of the tile otherwise
            for t in range(SPAN * CPS):
                kv_t, hs_t, n_t = _chunk_heads(h0, t, G, G_KV, CH, CPS)
                # an empty chunk (past the last KV head, too): zeros (P's zeros times garbage were NaN)
                m_nt = o_n < tl.where(n_t > 0, tl.where(length > 0, N, 0), 0)
                b_kt = tl.load(K + i_b * s_kb + kv_t * s_kh + o_n[:, None] * s_kn + o_d[None, :],
                               mask=m_nt[:, None] & m_d[None, :], other=0.0)
                b_vt = b_kt
                if WITH_OUT:
                    b_vt = tl.load(V + i_b * s_vb + kv_t * s_vh + o_n[:, None] * s_vn + o_d[None, :],
                                   mask=m_nt[:, None] & m_d[None, :], other=0.0)
                b_t += _fwd_heads(Q, LSE, LSE_PART, O32, b_kt, b_vt, s_qb, s_qh, s_qn, i_b, i_sub, h0, hs_t, n_t,
                                  e_pos, r_i, r_e, m_rk_e, N, qk_scale, H, G, GP, D, BLOCK_D, BLOCK_N, BLOCK_Q,
                                  SUB, PASS, WITH_OUT, WITH_KL, DOT_PREC)
        else:
            b_t = _fwd_heads(Q, LSE, LSE_PART, O32, b_k, b_v, s_qb, s_qh, s_qn, i_b, i_sub, h0, hs, n_h,
                             e_pos, r_i, r_e, m_rk_e, N, qk_scale, H, G, GP, D, BLOCK_D, BLOCK_N, BLOCK_Q,
                             SUB, PASS, WITH_OUT, WITH_KL, DOT_PREC)
        if PASS == 1:
            if SPAN * CPS == 1:
                _proxy_lse_part(QP, LSEP_PART, b_kp, s_pqb, s_pqh, s_pqn, i_b, i_p, i_sub, e_pos, e_i, m_e, m_ek,
                                pk_scale, DP, BLOCK_DP, SUB, DOT_PREC)
            elif i_c == 0:
                # once per entry: by the group's first chunk
                _proxy_lse_part(QP, LSEP_PART, b_kp, s_pqb, s_pqh, s_pqn, i_b, i_p, i_sub, e_pos, e_i, m_e, m_ek,
                                pk_scale, DP, BLOCK_DP, SUB, DOT_PREC)
        elif WITH_KL:
            b_sp = _proxy_scores(QP, b_kp, s_pqb, s_pqh, s_pqn, i_b, i_p, e_i, m_e, m_ek, pk_scale, DP, BLOCK_DP,
                                 DOT_PREC)
            # teacher: the mean probability over the proxy's main heads; student: softmax of the proxy
            b_t = b_t / G
            e_lsep = tl.load(LSEP + (i_bp * N + e_i), mask=m_e, other=0.0)
            b_logs = tl.where(m_ek, b_sp * LN2 - e_lsep[:, None], 0.0)
            b_kl = tl.where(b_t > 0, b_t * (tl.log(tl.where(b_t > 0, b_t, 1.0)) - b_logs), 0.0)
            tl.atomic_add(KL_ROWS + (i_bp * N + e_i), tl.sum(b_kl, axis=1), mask=m_e, sem="relaxed")


@triton.jit
def msa_bwd_kernel(Q, K, V, QP, KP, DO, DSTART, ITEMS, REV, LSE, DELTA, LSEP, KL_GRAD,
                   DQ, DK, DV, DQP, DKP,
                   s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
                   s_pqb, s_pqh, s_pqn, s_pkb, s_pkh, s_pkn, s_ob, s_oh, s_on,
                   N, NBLK, n_items, HKV, HPK, qk_scale, pk_scale, scale, p_scale,
                   H: tl.constexpr, HP: tl.constexpr, HP_PER_K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                   G_KV: tl.constexpr, SPAN: tl.constexpr, CH: tl.constexpr, CPS: tl.constexpr,
                   KSEL: tl.constexpr,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, DP: tl.constexpr, BLOCK_DP: tl.constexpr,
                   BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
                   MAIN: tl.constexpr, WITH_KL: tl.constexpr, HAS_DOCS: tl.constexpr, DENSE: tl.constexpr,
                   DOT_PREC: tl.constexpr):
    """dQ, dK, dV of the main heads (MAIN) and the teaching gradient's dQ, dK of the proxy (WITH_KL).

    Grid: (work item, BLOCK / BLOCK_N key sub-blocks, head chunks of a proxy group), the chunks as
    in ``msa_fwd_kernel``: the teaching gradient is linear in the teacher, so with several chunks
    each program adds its heads' share, and the group's first chunk the student's.
    """
    M: tl.constexpr = BLOCK_Q * GP
    i_t = tl.program_id(0)
    i_sub = tl.program_id(1)
    i_c = tl.program_id(2)
    lst = tl.load(ITEMS + i_t)
    length = tl.load(ITEMS + 2 * n_items + i_t)
    i_bp = lst // NBLK
    kb = lst % NBLK
    i_b = i_bp // HP
    i_p = i_bp % HP
    i_pk = i_p // HP_PER_K
    h0 = i_p * G
    i_kv, hs, n_h, n_end = _program_heads(h0, i_c, length, G, G_KV, CH, CPS, SPAN * CPS == 1)
    o_n = kb * BLOCK + i_sub * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < tl.where(length > 0, tl.where(i_kv < HKV, N, 0), 0)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_dp = tl.arange(0, BLOCK_DP)
    m_dp = o_dp < DP
    o_r = tl.arange(0, M)
    r_g = o_r % GP
    r_h = hs + r_g
    # [BLOCK_N, BLOCK_D]
    b_k = tl.load(K + i_b * s_kb + i_kv * s_kh + o_n[:, None] * s_kn + o_d[None, :],
                  mask=m_n[:, None] & m_d[None, :], other=0.0)
    b_v = tl.load(V + i_b * s_vb + i_kv * s_vh + o_n[:, None] * s_vn + o_d[None, :],
                  mask=m_n[:, None] & m_d[None, :], other=0.0)
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if WITH_KL:
        # [BLOCK_N, BLOCK_DP]
        b_kp = tl.load(KP + i_b * s_pkb + i_pk * s_pkh + o_n[:, None] * s_pkn + o_dp[None, :],
                       mask=m_n[:, None] & m_dp[None, :], other=0.0)
        b_dkp = tl.zeros([BLOCK_N, BLOCK_DP], dtype=tl.float32)
        c_kl = tl.load(KL_GRAD)
    for c in range(0, n_end, BLOCK_Q):
        e_pos, e_i, m_e = _entries(ITEMS, REV, i_t, n_items, c, N, KSEL, BLOCK_Q, DENSE)
        if HAS_DOCS:
            e_start = tl.load(DSTART + e_i, mask=m_e, other=0)
        else:
            e_start = tl.zeros([BLOCK_Q], dtype=tl.int32)
        m_ek = (o_n[None, :] <= e_i[:, None]) & (o_n[None, :] >= e_start[:, None]) & m_e[:, None] & m_n[None, :]
        r_i = _rows(e_i, BLOCK_Q, GP)
        r_m = _rows(m_e, BLOCK_Q, GP) & (r_g < n_h)
        m_rk = tl.reshape(tl.broadcast_to(m_ek[:, None, :], (BLOCK_Q, GP, BLOCK_N)), (M, BLOCK_N)) & r_m[:, None]
        r_off = (i_b * H + r_h) * N + r_i
        # [M, BLOCK_D]
        b_q = tl.load(Q + i_b * s_qb + r_h[:, None] * s_qh + r_i[:, None] * s_qn + o_d[None, :],
                      mask=r_m[:, None] & m_d[None, :], other=0.0)
        r_lse = tl.load(LSE + r_off, mask=r_m, other=0.0) * LOG2E
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * qk_scale
        b_pr = tl.where(m_rk, tl.exp2(b_s - r_lse[:, None]), 0.0)
        if MAIN:
            b_do = tl.load(DO + i_b * s_ob + r_h[:, None] * s_oh + r_i[:, None] * s_on + o_d[None, :],
                           mask=r_m[:, None] & m_d[None, :], other=0.0)
            r_delta = tl.load(DELTA + r_off, mask=r_m, other=0.0)
            b_dv += tl.dot(tl.trans(b_pr.to(b_do.dtype)), b_do, input_precision=DOT_PREC)
            b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
            b_ds = (b_pr * (b_dp - r_delta[:, None])).to(b_q.dtype)
            b_dk += tl.dot(tl.trans(b_ds), b_q, input_precision=DOT_PREC)
            b_dq = tl.dot(b_ds, b_k, input_precision=DOT_PREC) * scale
            tl.atomic_add(DQ + r_off[:, None] * D + o_d[None, :], b_dq, mask=r_m[:, None] & m_d[None, :], sem="relaxed")
        if WITH_KL:
            # [BLOCK_Q, BLOCK_DP], [BLOCK_Q, BLOCK_N]
            b_qp = tl.load(QP + i_b * s_pqb + i_p * s_pqh + e_i[:, None] * s_pqn + o_dp[None, :],
                           mask=m_e[:, None] & m_dp[None, :], other=0.0)
            e_lsep = tl.load(LSEP + (i_bp * N + e_i), mask=m_e, other=0.0) * LOG2E
            b_sp = tl.dot(b_qp, tl.trans(b_kp), input_precision=DOT_PREC) * pk_scale
            b_st = tl.where(m_ek, tl.exp2(b_sp - e_lsep[:, None]), 0.0)
            b_te = tl.sum(tl.reshape(b_pr, (BLOCK_Q, GP, BLOCK_N)), axis=1) / G
            # d kl / d proxy logit = student - teacher (times the mean's 1 / (B Hp N) and kl's gradient)
            b_dsp = (c_kl * (tl.where(i_c == 0, b_st, 0.0) - b_te)).to(b_qp.dtype)
            b_dkp += tl.dot(tl.trans(b_dsp), b_qp, input_precision=DOT_PREC)
            b_dqp = tl.dot(b_dsp, b_kp, input_precision=DOT_PREC) * p_scale
            tl.atomic_add(DQP + (i_bp * N + e_i)[:, None] * DP + o_dp[None, :], b_dqp,
                          mask=m_e[:, None] & m_dp[None, :], sem="relaxed")
    if MAIN:
        p_kv = ((i_b * HKV + i_kv) * N + o_n[:, None]) * D + o_d[None, :]
        tl.atomic_add(DK + p_kv, b_dk * scale, mask=m_n[:, None] & m_d[None, :], sem="relaxed")
        tl.atomic_add(DV + p_kv, b_dv, mask=m_n[:, None] & m_d[None, :], sem="relaxed")
    if WITH_KL:
        tl.atomic_add(DKP + ((i_b * HPK + i_pk) * N + o_n[:, None]) * DP + o_dp[None, :], b_dkp * p_scale,
                      mask=m_n[:, None] & m_dp[None, :], sem="relaxed")
