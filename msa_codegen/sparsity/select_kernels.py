"""Triton kernels of ``select_blocks``, and the running top-K keys that MSA's selection shares.

Loaded on first use (``selection._kernels``), so that ``TRITON_INTERPRET`` set by the caller
takes effect. Names follow the house style: ``p_`` pointers, ``b_`` register blocks, ``m_`` masks,
``o_`` offsets, ``i_`` program ids.

Candidate keys (``score_key``, ``own_key``, ``key_index``; also ``msa.kernels.msa_select_kernel``):
one int64 per (row, candidate block): the float32 score's order-preserving bits in the high half,
``0x7FFFFFFF - block`` in the low half. One integer comparison orders by score and, among equal
scores, prefers the lower block; ``-0.0`` counts as ``+0.0``. The own block's key has the largest
high half (above +inf): it always wins a slot and comes first. ``EMPTY`` (the smallest int64)
marks a slot or candidate that is not a block.

``block_means_pair_kernel``: q's means (over a block's rows and a KV head's group of query
heads) and k's in one launch, one program per (BLOCKS consecutive key blocks, batch x KV head,
q or k), summed in float32 from q and k in their own dtype: each is read once, nothing of its
size is made. A step reads BLOCK_R rows; with STEP_SUM (the launcher's form at the usual
shapes) each step's rows are summed at once into a [BLOCK_D] vector, the steps unrolled,
otherwise they are added into a [BLOCK_R, BLOCK_D] float32 sum across a loop of steps.

``block_select_kernel``: one program per (BLOCK_M query blocks, batch x KV head, run) keeps the W best
keys of each row in registers and walks the candidate blocks BLOCK_N at a time
(BLOCK_N = W unless the pooled keys' tile would not fit in shared memory), each tile's keys
from ``_tile_keys`` (``tl.dot`` of the pooled vectors). By default the top is kept sorted
descending: the tile's keys (widened to W with EMPTY) sorted ascending, the elementwise max with
the running top (the W largest of both, a bitonic sequence), a bitonic merge. With INSERT the
top is kept unsorted and a tile's keys go in by ``insert_keys`` (BLOCK_N may then exceed W),
one sort at the end: the same result, fewer steps per tile once a row's top has settled (the
launcher's form for long rows; ``benchmarks/select_probe.py`` times both); with FIRST_SORT a
run's first tile, where every key would enter, fills the top by one sort (``first_top``). With
SPLIT > 1 a row tile's candidates are SPLIT runs of tiles, one program each, whose kept keys go
to TOPS (int64 [batch x KV head, NB, SPLIT, W]) and ``block_merge_kernel`` merges them
(``merge_top``): more programs when there are too few rows to fill the GPU. Nothing
N/block x N/block is stored: the extra memory is the pooled vectors, the runs' kept keys and
the output.
"""
import triton
import triton.language as tl

#: the key of no candidate (the smallest int64): loses to every block
EMPTY = tl.constexpr(-9223372036854775807 - 1)


@triton.jit
def score_key(score, index):
    """int64 keys of float32 ``score`` for block ``index`` (broadcast together): larger is better,
    equal scores prefer the lower block."""
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    low = tl.full(score.shape, 0x7FFFFFFF, tl.int64) - index
    return (ordered.to(tl.int64) << 32) | low


@triton.jit
def own_key(key):
    """The key of the same block as ``key`` above every score: the own block, always kept, first."""
    return (key & 0xFFFFFFFF) | 0x7FFFFFFF00000000


@triton.jit
def key_index(key):
    """The block of a key (int32; meaningless for EMPTY)."""
    return (0x7FFFFFFF - (key & 0xFFFFFFFF)).to(tl.int32)


@triton.jit
def merge_top(top, keys):
    """``top`` [R, W] sorted descending and ``keys`` [R, W] in any order -> the W largest of both
    per row, sorted descending (W a power of two)."""
    # ascending against descending: the elementwise max holds the W largest and is bitonic
    return tl.bitonic_merge(tl.maximum(top, tl.sort(keys, dim=1)), dim=1, descending=True)


@triton.jit
def insert_keys(top, keys):
    """``top`` [R, W] in any order and ``keys`` [R, BN] -> the W largest of both per row, in any
    order, by insertion: each step puts every row's best remaining key in the place of its
    smallest kept key, if larger. As many steps as the most keys one row has above its smallest
    kept key: after the first tiles of a long row, zero to two, where ``merge_top`` always sorts
    the whole tile and merges. Keys of a row are distinct (the block is in the low half)."""
    W: tl.constexpr = top.shape[1]
    o_w = tl.arange(0, W)
    cand = tl.where(keys > tl.min(top, axis=1)[:, None], keys, EMPTY)
    steps = tl.max(tl.sum((cand != EMPTY).to(tl.int32), axis=1), axis=0)
    for _ in range(steps):
        best = tl.max(cand, axis=1)
        cand = tl.where(cand == best[:, None], EMPTY, cand)
        low = tl.min(top, axis=1)
        at = tl.argmin(top, axis=1)
        top = tl.where((o_w[None, :] == at[:, None]) & (best > low)[:, None], best[:, None], top)
    return top


@triton.jit
def first_top(keys, W: tl.constexpr):
    """[R, BN] keys (BN a multiple of W) -> the W largest per row, sorted descending: the first
    W of the sorted row are, slot by slot, the largest of its BN / W runs of W."""
    R: tl.constexpr = keys.shape[0]
    BN: tl.constexpr = keys.shape[1]
    srt = tl.sort(keys, dim=1, descending=True)
    return tl.max(tl.reshape(srt, (R, BN // W, W)), axis=1)


@triton.jit
def _widen(key, W: tl.constexpr):
    """[R, BN] -> [R, W] (BN divides W): each key once, EMPTY in the other slots."""
    R: tl.constexpr = key.shape[0]
    BN: tl.constexpr = key.shape[1]
    wide = tl.reshape(tl.broadcast_to(key[:, :, None], (R, BN, W // BN)), (R, W))
    return tl.where((tl.arange(0, W) % (W // BN) == 0)[None, :], wide, EMPTY)


@triton.jit
def _block_rows(p_x, s_n, n0, r0, o_r, o_d, m_d, N, BLOCK: tl.constexpr):
    """Rows n0 + r0 + o_r of a block (at most BLOCK from n0, before N) of the head at ``p_x``,
    columns ``o_d``: [BLOCK_R, BLOCK_D] float32, zeros where masked."""
    o_n = n0 + r0 + o_r
    m_n = (r0 + o_r < BLOCK) & (o_n < N)
    b_x = tl.load(p_x + o_n.to(tl.int64)[:, None] * s_n + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0.0)
    return b_x.to(tl.float32)


@triton.jit
def _block_mean(X, OUT, s_b, s_h, s_n, N, NB, HO, i_c, i_bo, G,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
                STEP_SUM: tl.constexpr):
    """OUT[b, ho, i_c] = the mean of block ``i_c`` of X's heads ho * G ... ho * G + G - 1 (i_bo = b * HO + ho).
    STEP_SUM: each step's BLOCK_R rows summed at once into a [BLOCK_D] vector (steps unrolled, so
    their loads can all be in flight; no [BLOCK_R, BLOCK_D] float32 sum held across steps);
    otherwise a loop of steps adds them into a [BLOCK_R, BLOCK_D] float32 sum. Nothing is stored
    for a block past the last (``i_c >= NB``)."""
    i_b = i_bo // HO
    i_o = i_bo % HO
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_r = tl.arange(0, BLOCK_R)
    n0 = i_c * BLOCK
    # int64: q of 16 heads x 1M rows x 128 is 2^31 elements
    p_x0 = X + i_b.to(tl.int64) * s_b + (i_o * G).to(tl.int64) * s_h
    if STEP_SUM:
        b_sum = tl.zeros([BLOCK_D], dtype=tl.float32)
        for g in range(G):
            for r0 in tl.static_range(0, BLOCK, BLOCK_R):
                b_sum += tl.sum(_block_rows(p_x0 + g * s_h, s_n, n0, r0, o_r, o_d, m_d, N, BLOCK), axis=0)
    else:
        b_acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for g in range(G):
            for r0 in range(0, BLOCK, BLOCK_R):
                b_acc += _block_rows(p_x0 + g * s_h, s_n, n0, r0, o_r, o_d, m_d, N, BLOCK)
        b_sum = tl.sum(b_acc, axis=0)
    if n0 < N:
        rows = tl.minimum(N - n0, BLOCK)
        tl.store(OUT + (i_bo.to(tl.int64) * NB + i_c) * D + o_d, b_sum / (rows * G).to(tl.float32), mask=m_d)


@triton.jit
def block_means_pair_kernel(Q, K, QM, KM, s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, N, NB, HO, BHO,
                            G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCKS: tl.constexpr, STEP_SUM: tl.constexpr):
    # the means of q (G heads a group) and of k in one launch: programs (i_c, i_x) with i_x < BHO
    # (= batch x KV heads) pool q, the others k, each the blocks i_c * BLOCKS ... i_c * BLOCKS +
    # BLOCKS - 1 (unrolled)
    i_c = tl.program_id(0)
    i_x = tl.program_id(1)
    if i_x < BHO:
        for c in tl.static_range(BLOCKS):
            _block_mean(Q, QM, s_qb, s_qh, s_qn, N, NB, HO, i_c * BLOCKS + c, i_x, G,
                        D, BLOCK_D, BLOCK, BLOCK_R, STEP_SUM)
    else:
        for c in tl.static_range(BLOCKS):
            _block_mean(K, KM, s_kb, s_kh, s_kn, N, NB, HO, i_c * BLOCKS + c, i_x - BHO, 1,
                        D, BLOCK_D, BLOCK, BLOCK_R, STEP_SUM)


@triton.jit
def _tile_keys(b_q, p_k0, c0, o_m, NB, D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               DOT_PREC: tl.constexpr):
    """The keys [BLOCK_M, BLOCK_N] of rows ``o_m`` (pooled queries ``b_q`` [BLOCK_M, BLOCK_D]) for
    candidate blocks c0 ... c0 + BLOCK_N - 1 (pooled keys at ``p_k0``, D a row): EMPTY where not
    a candidate, the own block's key above every score."""
    BLOCK_D: tl.constexpr = b_q.shape[1]
    o_d = tl.arange(0, BLOCK_D)
    o_n = c0 + tl.arange(0, BLOCK_N)
    m_n = o_n < NB
    # [BLOCK_N, BLOCK_D] pooled keys
    b_k = tl.load(p_k0 + o_n[:, None] * D + o_d[None, :], mask=m_n[:, None] & (o_d < D)[None, :], other=0.0)
    # [BLOCK_M, BLOCK_N]
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
    m_s = m_n[None, :] & (b_s > float("-inf"))
    if CAUSAL:
        m_s = m_s & (o_n[None, :] <= o_m[:, None])
    key = score_key(b_s, o_n[None, :])
    return tl.where(o_n[None, :] == o_m[:, None], own_key(key), tl.where(m_s, key, EMPTY))


@triton.jit
def block_select_kernel(QM, KM, IDX, TOPS, NB, K_OUT, s_o,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        W: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, INSERT: tl.constexpr,
                        SPLIT: tl.constexpr, FIRST_SORT: tl.constexpr):
    tl.static_assert(not FIRST_SORT or (INSERT and BLOCK_N >= W), "FIRST_SORT sorts an insertion tile of >= W keys")
    # heaviest (last) row tiles first when causal: their loop is longest
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)
    i_bh = tl.program_id(1)
    i_s = tl.program_id(2)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < NB
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_w = tl.arange(0, W)
    p_q = QM + (i_bh.to(tl.int64) * NB + o_m[:, None]) * D + o_d[None, :]
    p_k0 = KM + i_bh.to(tl.int64) * NB * D
    # [BLOCK_M, BLOCK_D] pooled queries
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)
    # [BLOCK_M, W] the best keys so far: descending (merge_top), any order (INSERT: insert_keys,
    # sorted once at the end)
    top = tl.full([BLOCK_M, W], EMPTY, tl.int64)
    if CAUSAL:
        hi = tl.minimum(NB, (i_m + 1) * BLOCK_M)
    else:
        hi = NB
    # SPLIT programs share a row tile's candidates, in runs of whole tiles
    per = ((hi + BLOCK_N - 1) // BLOCK_N + SPLIT - 1) // SPLIT * BLOCK_N
    lo = i_s * per
    hi = tl.minimum(hi, lo + per)
    for c0 in range(lo, hi, BLOCK_N):
        key = _tile_keys(b_q, p_k0, c0, o_m, NB, D, BLOCK_N, CAUSAL, DOT_PREC)
        if INSERT:
            if FIRST_SORT:
                # the run's first tile by one sort instead of BLOCK_N insertion steps
                if c0 == lo:
                    top = first_top(key, W)
                else:
                    top = insert_keys(top, key)
            else:
                top = insert_keys(top, key)
        else:
            if BLOCK_N < W:
                key = _widen(key, W)
            top = merge_top(top, key)
    if INSERT:
        top = tl.sort(top, dim=1, descending=True)
    if SPLIT == 1:
        _store_indices(IDX, top, i_bh, o_m, NB, K_OUT, s_o)
    else:
        # this run's best keys, for block_merge_kernel
        p_t = TOPS + ((i_bh.to(tl.int64) * NB + o_m[:, None]) * SPLIT + i_s) * W + o_w[None, :]
        tl.store(p_t, top, mask=m_m[:, None])


@triton.jit
def _store_indices(IDX, top, i_bh, o_m, NB, K_OUT, s_o):
    """Rows ``o_m``' kept keys ``top`` [BLOCK_M, W], sorted descending, as block indices (-1: none)."""
    W: tl.constexpr = top.shape[1]
    o_w = tl.arange(0, W)
    b_idx = tl.where(top == EMPTY, -1, key_index(top))
    p_o = IDX + (i_bh.to(tl.int64) * NB + o_m[:, None]) * s_o + o_w[None, :]
    tl.store(p_o, b_idx, mask=(o_m < NB)[:, None] & (o_w[None, :] < K_OUT))


@triton.jit
def block_merge_kernel(TOPS, IDX, NB, K_OUT, s_o, BLOCK_M: tl.constexpr, W: tl.constexpr, SPLIT: tl.constexpr):
    # the SPLIT runs' kept keys of BLOCK_M rows -> the W best, as block_select_kernel stores them
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < NB
    p_t = TOPS + (i_bh.to(tl.int64) * NB + o_m[:, None]) * SPLIT * W + tl.arange(0, W)[None, :]
    top = tl.load(p_t, mask=m_m[:, None], other=EMPTY)
    for i_s in tl.static_range(1, SPLIT):
        top = merge_top(top, tl.load(p_t + i_s * W, mask=m_m[:, None], other=EMPTY))
    _store_indices(IDX, top, i_bh, o_m, NB, K_OUT, s_o)
