"""Data-dependent selection helpers that produce the run-time inputs of ``attention``.

- ``select_blocks``: MoBA/NSA-style gating, key blocks per query block for ``topk=K``; two Triton
  kernels (``select_kernels``): the block means of q and k (one launch), then a running top-K
  per query block.
- ``hash_sort``: LSH buckets (random rotations, argmax over ``[xR, -xR]``) and the sort by
  bucket that SCFA's Hash-sparse attention runs on; plain PyTorch.

No gradient flows through them. ``select_blocks`` reads q and k once and holds, beyond its
output (O(N / block * K)), the pooled blocks (O(N / block * D), float32) and, for short
sequences, the kept keys of split runs (O(N / block * K)); its plain PyTorch definition is
``reference.select_blocks_reference``.
"""
from __future__ import annotations

import torch

from ..kernels.schedule import block_d, cdiv, pow2

__all__ = ["select_blocks", "hash_sort"]

#: most blocks kept per query block: the running top lives in registers (W=1024 at D=256 asks
#: for 176 KiB of shared memory on sm_90, Triton 3.6; 2048 would not fit in its 227)
MAX_SLOTS = 1024


def _kernels():
    """The kernel module, imported on first use (TRITON_INTERPRET is read when kernels are defined)."""
    from ..kernels.render import load_kernels

    return load_kernels(".select_kernels", __package__)


def _check_x(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have 4 dims (B, H, N, D), got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def _check_device(x: torch.Tensor) -> None:
    """select_blocks' kernels run on CUDA, or on the CPU in Triton's interpreter (bfloat16 included:
    their products are of the float32 means)."""
    from ..api import check_location

    check_location(x, "select_blocks' q and k",
                   "; or use msa_codegen.sparsity.reference.select_blocks_reference (plain PyTorch)")


#: CUDA's limit on a grid's second dimension
MAX_GRID_Y = 65535


def _block_means(q: torch.Tensor, k: torch.Tensor, block: int, meta: dict | None = None):
    """q (B, Hq, N, D) and k (B, Hkv, N, D) -> their block means, each (B, Hkv, ceil(N / block), D)
    float32: q's over each block's rows (the last block may be short) and over each KV head's
    group of Hq / Hkv consecutive query heads, k's over each block's rows.

    One launch of ``block_means_pair_kernel`` (``meta``: its constexprs and launch options,
    by default ``_means_meta``'s) reads q and k once, in their own dtype, and sums in float32: no
    float32 or padded copy is made, so the extra memory is that of the result. (A float32 padded
    copy of q was 2.3 GiB of select_blocks' peak at N=131072, H=16, D=128, per issue 19.)
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    nb = cdiv(n, block)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    qm = torch.empty(b, hkv, nb, d, dtype=torch.float32, device=q.device)
    km = torch.empty(b, hkv, nb, d, dtype=torch.float32, device=q.device)
    if qm.numel():
        meta = meta or _means_meta(d, block, hq // hkv)
        # q's and k's programs share the grid's second dimension (at most MAX_GRID_Y): batches in
        # chunks (views: the strides and the outputs' layout per batch are unchanged)
        step = max(1, MAX_GRID_Y // (2 * hkv))
        for b0 in range(0, b, step):
            b1 = min(b, b0 + step)
            _kernels().block_means_pair_kernel[(cdiv(nb, meta["BLOCKS"]), 2 * (b1 - b0) * hkv)](
                q[b0:b1], k[b0:b1], qm[b0:b1], km[b0:b1], q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2), n, nb, hkv, (b1 - b0) * hkv, **meta)
    return qm, km


def _means_meta(d: int, block: int, group: int) -> dict:
    """``block_means_pair_kernel``'s constexprs and launch options: rows read BLOCK_R a step,
    BLOCKS blocks a program, STEP_SUM (each step's rows summed at once, steps unrolled)."""
    bd = block_d(d)
    # H200, torch 2.11, Triton 3.6, bf16, B=1, H=16, D=128, block 128, group 1, q and k
    # (benchmarks/select_probe.py --n 131072 1048576 --rep 200, 2026-12-04 07:29 UTC, do_bench
    # median): 32-row steps summed at once on 2 warps, two blocks a program, 0.277 / 2.086 ms at
    # N=131072 / 1048576, against 0.319 / 2.100 for the former two launches of 128-row steps added
    # into a [128, 128] float32 sum on 4 warps (0.302 / 2.235 as one launch; two blocks a program
    # 0.290 / 2.228); per-step sums of 128 rows on 8 warps 0.371 / 2.818, of 32 rows on 4 warps
    # 0.643 / 5.070, of 64 on 8 warps 0.647 / 5.098, of 16 on 4 warps, two blocks 1.267 / 9.965.
    # The means' bits differ from the former's (the order of the sums), the indices were the same
    # on 100.00% of the rows at N=131072; the whole call 0.418 ms there against 0.459.
    # Elsewhere (not timed): a step of as many elements (BLOCK_R x BLOCK_D = 4096, 16 rows at
    # D=256) on 2 warps per 4096, unrolled 8 steps at most a program (two blocks at most 4 steps
    # each, else one block of at most 8); blocks of more steps (block > 256 at D <= 128, > 128 at
    # D=256) by the former loop of 128-row steps on 4 warps, not unrolled
    rows = max(16, min(4096 // bd, pow2(block)))
    steps = cdiv(block, rows)
    if steps <= 8:
        return dict(G=group, D=d, BLOCK_D=bd, BLOCK=block, BLOCK_R=rows, BLOCKS=2 if steps <= 4 else 1,
                    STEP_SUM=True, num_warps=max(2, rows * bd // 2048))
    # the float32 sum [BLOCK_R, BLOCK_D] within 16K elements, 128 registers a thread on 4 warps
    return dict(G=group, D=d, BLOCK_D=bd, BLOCK=block, BLOCK_R=min(128, 16384 // bd), BLOCKS=1, STEP_SUM=False,
                num_warps=4)


#: query blocks from which top-16 selection inserts into an unsorted top over wide tiles
LONG_SELECT = 4096


def _select_meta(d: int, slots: int, causal: bool, nb: int = 0) -> dict:
    """The selection kernel's constexprs and launch options for ``slots`` kept keys per row and
    ``nb`` blocks.

    W (kept keys and candidates per step) is the power of two >= slots, at least 16 (tl.dot's
    smallest N). The running top and the tile's keys are [BLOCK_M, W] int64 in registers, so
    fewer rows per program as W grows. Scores are products of the float32 means on the tensor
    cores in three tf32 parts (``tf32x3``), about float32's precision: at N=131072 (random
    bf16 q and k) 99.99% of the rows chose what float32 products (``ieee``) chose, the rest
    differing only among near-equal scores; ``ieee`` took 3x as long.
    """
    w = max(16, pow2(slots))
    bd = block_d(d)
    # sm_90, Triton 3.6, ptxas -v (2026-12, offline): no spills with these rows and warps; W=32
    # with 4 warps spilled 1.8 KB, W=64 with 4 warps 2.5 KB
    # W=16 (H200, H=16, D=128, top-16, benchmarks/select_probe.py, 2026-12-03): 16 rows on one
    # warp, sorting and merging each tile of 16, was fastest at N=131072 (0.196 ms; ieee
    # products 0.579); at N=1048576, 128 rows on 8 warps inserting from tiles of 64 (5.48 ms;
    # the 16-row form 6.62, skipping tiles that change nothing 6.35; 5.12 with each run's first
    # tile sorted, FIRST_SORT). Sorting only tiles with more than 4 insertions, or the product 32
    # columns at a time, did not pay. Nor (2026-12-04 07:29 UTC, same shape, --rep 200) a sorted
    # top with a tile's entering keys waiting at their column until two meet (at 1M, 128 x 64 on 8
    # warps 6.488 ms, 64 x 32 on 4 warps 5.288, against 5.232 inserting; at N=131072 0.245 at best
    # against 0.141), nor that after a first pass bounding each row's 16th key (7.429 / 0.315 at
    # best); both were removed
    block_m = 16 if w <= 16 else 64 if w <= 32 else 32 if w <= 64 else 16
    # the pooled keys' float32 tile [BLOCK_N, BLOCK_D] within 32 KiB of shared memory (K=256 at
    # D=256 asked for 311 KiB with BLOCK_N = W, sm_90 has 227)
    block_n = max(16, min(w, 8192 // bd))
    warps, insert = (1 if w <= 16 else 8), False
    if w <= 16 and nb >= LONG_SELECT:
        # D=256: 64 rows (128 asked for 320 KiB of shared memory)
        block_m, block_n, warps, insert = (128 if bd <= 128 else 64), max(16, min(64, 8192 // bd)), 8, True
    return dict(D=d, BLOCK_D=bd, BLOCK_M=block_m, BLOCK_N=block_n, W=w, CAUSAL=causal, DOT_PREC="tf32x3",
                INSERT=insert, SPLIT=1, FIRST_SORT=insert, num_warps=warps, num_stages=2)


@torch.no_grad()
def select_blocks(q: torch.Tensor, k: torch.Tensor, topk: int, block: int = 128, *, causal: bool = True) -> torch.Tensor:
    """Key blocks for the ``topk=K`` term, scored by mean-pooled keys against mean-pooled queries.

    Args:
        q: ``(B, Hq, N, D)`` float (fp32, fp16, bf16); the queries of a KV head's GQA group and of
            a query block are averaged into one vector (float32).
        k: ``(B, Hkv, N, D)``, Hq a multiple of Hkv; each key block is averaged into one vector.
        topk: K >= 1, slots per query block.
        block: block size, the ``block=`` of the pattern (default 128).
        causal: only key blocks at or before the query block are candidates.

    Returns:
        int32 ``(B, Hkv, ceil(N / block), K)``: per query block, its own block (always kept) and
        the highest-scoring other candidates, best first; among equal scores the lower block
        first; -1 where fewer than K blocks are candidates. Pass it as ``block_indices`` with
        the pattern term ``topk=K,block=...``. Scores are dot products of the float32 means at
        about float32's precision (three tf32 tensor-core products), so blocks whose scores
        differ by less than that may be ranked either way (``reference.select_blocks_reference``
        is the plain PyTorch definition).

    Runs on CUDA (or in Triton's interpreter on the CPU); keeps at most ``MAX_SLOTS`` (1024)
    blocks per query block. Extra memory beyond the output: the pooled vectors,
    ``2 * B * Hkv * ceil(N / block) * D`` float32, and for K <= 16 when query blocks are few
    enough that their candidates are split into runs (at most 8), each run's kept keys, at most
    ``8 * B * Hkv * ceil(N / block) * 16`` int64; nothing N x N / block.

    Example::

        idx = msa_codegen.select_blocks(q, k, 16, block=128)
        out = msa_codegen.attention(q, k, v, "topk=16", block_indices=idx)
    """
    _check_x("q", q)
    _check_x("k", k)
    for name, val in (("topk", topk), ("block", block)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    b, hq, n, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or k.shape[2] != n:
        raise ValueError(f"k must be (B, Hkv, N, D) = ({b}, Hkv, {n}, {d}), got {tuple(k.shape)}")
    hkv = k.shape[1]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query heads must be a multiple of key heads, got Hq={hq}, Hkv={hkv}")
    if k.device != q.device:
        raise ValueError(f"q and k must be on one device, got {q.device} and {k.device}")
    _check_device(q)
    nb = cdiv(n, block)
    if min(topk, nb) > MAX_SLOTS:
        raise ValueError(f"select_blocks keeps at most {MAX_SLOTS} blocks per query block, got topk={topk} "
                         f"with {nb} blocks of {block}: use a larger block")
    out = torch.full((b, hkv, nb, topk), -1, dtype=torch.int32, device=q.device)
    if out.numel() == 0:
        return out
    qm, km = _block_means(q, k, block)                                 # (B, Hkv, nb, D) each
    # a row has at most nb candidates: slots past them stay -1
    meta = _select_meta(d, min(topk, nb), causal, nb)
    row_tiles = cdiv(nb, meta["BLOCK_M"])
    # (measured for W=16 only, where the kept keys of the runs are few)
    split = _split(row_tiles * b * hkv, cdiv(nb, meta["BLOCK_N"])) if meta["W"] <= 16 and not meta["INSERT"] else 1
    kern = _kernels()
    # runs of one row tile's candidates: their kept keys, merged by block_merge_kernel
    tops = torch.empty(b * hkv, nb, split, meta["W"], dtype=torch.int64, device=q.device) if split > 1 else out
    kern.block_select_kernel[(row_tiles, b * hkv, split)](qm, km, out, tops, nb, min(topk, meta["W"]), topk,
                                                          **dict(meta, SPLIT=split))
    if split > 1:
        kern.block_merge_kernel[(cdiv(nb, 64), b * hkv)](tops, out, nb, min(topk, meta["W"]), topk, BLOCK_M=64,
                                                         W=meta["W"], SPLIT=split, num_warps=4)
    return out


#: programs the selection aims for: one-warp programs of 16 rows, about 32 on each of the H200's
#: 132 SMs; fewer leave the time to the longest row's chain of tiles
SELECT_PROGRAMS = 4096


def _split(programs: int, tiles: int) -> int:
    """Runs per row tile (a power of two, at most 8) that bring ``programs`` row tiles near
    SELECT_PROGRAMS, each run at least 8 of the longest row's ``tiles`` candidate tiles."""
    split = 1
    while split < 8 and programs * split * 2 <= SELECT_PROGRAMS and tiles >= 16 * split:
        split *= 2
    return split


@torch.no_grad()
def hash_sort(x: torch.Tensor, num_buckets: int, *, seed: int = 0, rotations: torch.Tensor | None = None):
    """LSH buckets of ``x`` and ``x`` sorted by bucket (SCFA's Hash-sparse attention).

    Buckets are ``argmax([x R, -x R])`` for a random Gaussian rotation ``R`` of shape
    ``(D, num_buckets // 2)`` drawn on the CPU from ``seed`` (the same for every head and call
    with the same seed and D, so queries and keys hashed with one seed share their buckets), or
    the given ``rotations``. Rows are sorted by bucket, stably, so positions stay increasing
    inside a bucket, which is the order the kernels need.

    Args:
        x: ``(B, H, N, D)`` float.
        num_buckets: even, >= 2.

    Returns:
        ``(x_sorted, positions, buckets, inverse)``: ``x_sorted`` ``(B, H, N, D)`` (a gather,
        differentiable), ``positions`` int32 ``(B, H, N)`` original row of each sorted row,
        ``buckets`` int32 ``(B, H, N)`` sorted buckets, ``inverse`` int64 ``(B, H, N)`` with
        ``y_sorted.gather(2, inverse[..., None].expand_as(y_sorted))`` restoring original order.

    Example (Hash-sparse attention)::

        qs, qp, qb, q_inv = msa_codegen.hash_sort(q, 8, seed=1)
        ks, kp, kb, _ = msa_codegen.hash_sort(k, 8, seed=1)
        vs = v.gather(2, kp.long()[..., None].expand_as(v))
        o = msa_codegen.attention(qs, ks, vs, "causal", q_pos=qp, k_pos=kp, q_bucket=qb, k_bucket=kb)
        o = o.gather(2, q_inv[..., None].expand_as(o))
    """
    _check_x("x", x)
    if not isinstance(num_buckets, int) or isinstance(num_buckets, bool) or num_buckets < 2 or num_buckets % 2:
        raise ValueError(f"num_buckets must be an even int >= 2, got {num_buckets!r}")
    b, h, n, d = x.shape
    if rotations is None:
        gen = torch.Generator().manual_seed(int(seed))
        rotations = torch.randn(d, num_buckets // 2, generator=gen, dtype=torch.float32)
    elif tuple(rotations.shape) != (d, num_buckets // 2):
        raise ValueError(f"rotations must have shape (D, num_buckets // 2) = ({d}, {num_buckets // 2}), "
                         f"got {tuple(rotations.shape)}")
    xr = x.detach().float() @ rotations.to(device=x.device, dtype=torch.float32)
    buckets = torch.cat([xr, -xr], dim=-1).argmax(-1)                  # (B, H, N)
    order = torch.sort(buckets, dim=-1, stable=True).indices          # (B, H, N)
    inverse = torch.empty_like(order)
    inverse.scatter_(2, order, torch.arange(n, device=x.device).expand_as(order))
    with torch.enable_grad():
        x_sorted = x.gather(2, order[..., None].expand(b, h, n, d))
    return x_sorted, order.to(torch.int32), buckets.gather(2, order).to(torch.int32), inverse
