"""Index tables of the block-granular terms (``random=R``).

A table is built once per (spec, sequence length, device) and cached: it holds, for every
query block of ``spec.block`` positions, the R key blocks that block also sees. Sizes are
O(N / block * R); nothing here is quadratic in N.
"""
from __future__ import annotations

import functools

import torch

from ..pattern.spec import Spec


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def random_block_table_cpu(spec: Spec, seqlen: int) -> torch.Tensor:
    """int32 ``(ceil(seqlen / block), random)``: key-block ids per query block, ``-1`` for unused slots.

    Causal: a query block ``qb`` draws among the key blocks ``0..qb`` (its own included), so the
    first ``random`` blocks see all earlier blocks and pad the rest with -1. Bidirectional: among
    all key blocks. The R ids of a row are distinct. The draw uses Floyd's subset sampling,
    vectorised over rows, from a CPU generator seeded with ``spec.seed``: the same table on any
    machine and device for the same (spec, seqlen).
    """
    r = spec.random
    nb = _cdiv(seqlen, spec.block)
    gen = torch.Generator().manual_seed(spec.seed)
    rows = torch.arange(nb, dtype=torch.int64)
    # number of candidate key blocks per query block
    cand = rows + 1 if spec.causal else torch.full((nb,), nb, dtype=torch.int64)
    table = torch.full((nb, r), -1, dtype=torch.int64)
    few = cand <= r
    # rows with at most r candidates see all of them
    slot = torch.arange(r, dtype=torch.int64)
    table = torch.where(few[:, None] & (slot[None, :] < cand[:, None]), slot[None, :].expand(nb, r), table)
    # Floyd: for t in cand-r .. cand-1 pick x uniform in [0, t]; if x was already chosen take t
    u = torch.rand((r, nb), generator=gen, dtype=torch.float64)
    many = ~few
    for step in range(r):
        t = cand - r + step
        x = torch.minimum((u[step] * (t + 1).to(torch.float64)).floor().to(torch.int64), t)
        taken = (table[:, :step] == x[:, None]).any(dim=1) if step else torch.zeros(nb, dtype=torch.bool)
        x = torch.where(taken, t, x)
        table[:, step] = torch.where(many, x, table[:, step])
    return table.to(torch.int32)


@functools.lru_cache(maxsize=64)
def _random_tables(spec: Spec, seqlen: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    table = random_block_table_cpu(spec, seqlen)
    nb = table.shape[0]
    # inverse (CSR): for each key block, the query blocks that chose it, for the key-centric backward
    qb = torch.arange(nb, dtype=torch.int64)[:, None].expand_as(table).reshape(-1)
    kb = table.reshape(-1).to(torch.int64)
    keep = kb >= 0
    qb, kb = qb[keep], kb[keep]
    order = torch.argsort(kb * nb + qb)
    counts = torch.bincount(kb, minlength=nb)
    offsets = torch.zeros(nb + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(counts, 0)
    inv = qb[order].to(torch.int32)
    if inv.numel() == 0:
        inv = torch.zeros(1, dtype=torch.int32)
    dev = torch.device(device)
    return (table.contiguous().to(dev), offsets.to(torch.int32).to(dev), inv.to(dev))


def random_tables(spec: Spec, seqlen: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(table, inverse offsets, inverse query blocks) on ``device``, cached per (spec, seqlen, device)."""
    return _random_tables(spec, seqlen, str(device))


def clear_cache() -> None:
    """Forget the tables ``random_tables`` has built (for callers that replace how they are drawn)."""
    _random_tables.cache_clear()


def random_block_mask(spec: Spec, seqlen: int) -> torch.Tensor:
    """bool ``(nb, nb)`` block mask of the random term (for the dense reference only: small N)."""
    table = random_block_table_cpu(spec, seqlen).to(torch.int64)
    nb = table.shape[0]
    out = torch.zeros((nb, nb + 1), dtype=torch.bool)
    out.scatter_(1, torch.where(table >= 0, table, nb), True)
    return out[:, :nb]


def merged_block_tables(spec: Spec, nq: int, nk: int, block_indices: torch.Tensor, inverse: bool = True):
    """The random + top-k block tables of one spec, per batch and KV head, built on the device.

    ``block_indices`` int32 ``(B, Hkv, ceil(nq / block), K)`` (-1 unused, any order, duplicates
    allowed). Returns ``(table, offsets, inverse)``: ``table`` int32 ``(B, Hkv, nqb, R + K)``, each
    row sorted with every repeated id replaced by -1 (so the kernels never count a pair twice);
    ``offsets`` int32 ``(B, Hkv, nkb + 1)`` and ``inverse`` int32: for key block kb of (b, hk), the
    query blocks that chose it are ``inverse[offsets[b, hk, kb]:offsets[b, hk, kb + 1]]``
    (offsets are global into ``inverse``). O(B * Hkv * nqb * (R + K)); no host sync.
    ``inverse=False`` (the forward, which reads only the table) returns None for both.
    """
    b, hkv, nqb, _ = block_indices.shape
    nkb = _cdiv(nk, spec.block)
    dev = block_indices.device
    table = block_indices.to(torch.int32)
    if spec.random:
        rtab = random_tables(spec, nq, dev)[0]
        table = torch.cat([rtab.expand(b, hkv, nqb, spec.random), table], dim=-1)
    table = table.sort(dim=-1).values
    dup = torch.zeros_like(table, dtype=torch.bool)
    dup[..., 1:] = table[..., 1:] == table[..., :-1]
    table = table.masked_fill(dup, -1).contiguous()
    if not inverse:
        return table, None, None
    return (table, *inverse_table(table, nkb))


def inverse_table(table: torch.Tensor, nkb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(offsets, inverse)`` of a block table int32 ``(B, Hkv, nqb, slots)`` (-1 unused, no id
    twice in a row) over ``nkb`` key blocks: for key block kb of (b, hk), the query blocks whose
    row names it are ``inverse[offsets[(b * Hkv + hk) * nkb + kb] : offsets[... + 1]]``, ascending.
    ``offsets`` int32 ``(B * Hkv * nkb + 1)``; no host sync."""
    b, hkv, nqb, slots = table.shape
    dev = table.device
    nbh = b * hkv
    bh = torch.arange(nbh, device=dev).view(nbh, 1, 1).expand(nbh, nqb, slots).reshape(-1)
    qb = torch.arange(nqb, device=dev).view(1, nqb, 1).expand(nbh, nqb, slots).reshape(-1)
    kb = table.reshape(-1).to(torch.int64)
    total = nbh * nkb
    key = torch.where(kb >= 0, bh * nkb + kb, total)      # unused slots sort last
    order = torch.argsort(key * nqb + qb)
    inverse = qb[order].to(torch.int32)
    counts = torch.bincount(key, minlength=total + 1)[:total]
    offsets = torch.zeros(total + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(counts, 0)
    return offsets.to(torch.int32), inverse
