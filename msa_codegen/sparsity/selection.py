"""Data-dependent selection helpers that produce the run-time inputs of ``attention``.

- ``select_blocks``: MoBA/NSA-style gating, key blocks per query block for ``topk=K``.
- ``hash_sort``: LSH buckets (random rotations, argmax over ``[xR, -xR]``) and the sort by
  bucket that SCFA's Hash-sparse attention runs on.

Both are plain PyTorch; no gradient flows through them. ``select_blocks`` reads q and k once and
holds, beyond its output, the pooled blocks (O(N / block * D)) and one chunk of block scores
(``SCORE_ELEMS``).
"""
from __future__ import annotations

import torch

__all__ = ["select_blocks", "hash_sort"]

#: scores held at once by select_blocks (its query blocks are processed in chunks)
SCORE_ELEMS = 1 << 24


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_x(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have 4 dims (B, H, N, D), got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def _block_means(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, H, N, D) -> (B, H, ceil(N / block), D) float32 means over blocks (the last one may be short).

    The sums accumulate in float32 inside the reduction (``sum(dtype=...)``) over a view of x:
    no float32 or padded copy of x is made, so the extra memory is that of the result. (A copy
    of q in float32, padded, was 2.3 GiB of select_blocks' peak at N=131072, H=16, D=128.)
    """
    b, h, n, d = x.shape
    full = n // block
    parts = []
    if full:
        parts.append(x[:, :, :full * block].reshape(b, h, full, block, d).sum(3, dtype=torch.float32) / block)
    if n % block:
        tail = x[:, :, full * block:]
        parts.append(tail.sum(2, keepdim=True, dtype=torch.float32) / tail.shape[2])
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]


@torch.no_grad()
def select_blocks(q: torch.Tensor, k: torch.Tensor, topk: int, block: int = 128, *, causal: bool = True) -> torch.Tensor:
    """Key blocks for the ``topk=K`` term, scored by mean-pooled keys against mean-pooled queries.

    Args:
        q: ``(B, Hq, N, D)``; the queries of a KV head's GQA group and of a query block are
            averaged into one vector.
        k: ``(B, Hkv, N, D)``, Hq a multiple of Hkv; each key block is averaged into one vector.
        topk: K >= 1, slots per query block.
        block: block size, the ``block=`` of the pattern (default 128).
        causal: only key blocks at or before the query block are candidates.

    Returns:
        int32 ``(B, Hkv, ceil(N / block), K)``: per query block, its own block (always kept) and
        the highest-scoring other candidates, best first; -1 where fewer than K blocks are
        candidates. Pass it as ``block_indices`` with the pattern term ``topk=K,block=...``.

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
    nb = _cdiv(n, block)
    qm = _block_means(q, block).view(b, hkv, hq // hkv, nb, d).mean(2)   # (B, Hkv, nb, D)
    km = _block_means(k, block)                                        # (B, Hkv, nb, D)
    kk = min(topk, nb)
    out = torch.full((b, hkv, nb, topk), -1, dtype=torch.int32, device=q.device)
    cols = torch.arange(nb, device=q.device)
    # query blocks in chunks: the scores stay O(chunk * nb) per head (N = 1M, block 128: nb = 8192)
    chunk = max(1, min(nb, SCORE_ELEMS // max(1, b * hkv * nb)))
    for r0 in range(0, nb, chunk):
        rows = torch.arange(r0, min(nb, r0 + chunk), device=q.device)
        score = qm[:, :, rows] @ km.transpose(-1, -2)                 # (B, Hkv, rows, nb)
        if causal:
            score = score.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        score[..., torch.arange(len(rows), device=q.device), rows] = float("inf")   # the own block is always kept
        val, idx = score.topk(kk, dim=-1)
        out[:, :, rows, :kk] = torch.where(val == float("-inf"), -1, idx).to(torch.int32)
    return out


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
