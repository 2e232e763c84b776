"""Index tables of the block-granular terms (``random=R``).

A table is built once per (spec, sequence length, device) and cached: it holds, for every
query block of ``spec.block`` positions, the R key blocks that block also sees. Sizes are
O(N / block * R); nothing here is quadratic in N.
"""
from __future__ import annotations

import functools

import torch

from .spec import Spec


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


def random_block_mask(spec: Spec, seqlen: int) -> torch.Tensor:
    """bool ``(nb, nb)`` block mask of the random term (for the dense reference only: small N)."""
    table = random_block_table_cpu(spec, seqlen).to(torch.int64)
    nb = table.shape[0]
    out = torch.zeros((nb, nb + 1), dtype=torch.bool)
    out.scatter_(1, torch.where(table >= 0, table, nb), True)
    return out[:, :nb]
