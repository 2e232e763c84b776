"""Which keys a rank needs under a pattern, and from whom: pure functions, no torch.distributed.

Context parallelism gives rank r the contiguous rows ``[start_r, end_r)`` of the sequence (its
*slice*). Its queries see, per head group of the pattern (DESIGN.md, "Pattern semantics"):

- ``window=W,dilation=d``: keys within ``reach = (W - 1) * d`` of a query, before it (causal) or
  on both sides (``causal=false``): ``[start - reach, end)`` or ``[start - reach, end + reach)``;
- ``sink=S``: keys ``[0, S)`` (causal: only those before the slice's end);
- ``global=G`` (bidirectional): keys ``[0, G)``, and every key when the slice holds a row < G;
- no locality term (dense), ``topk``: every key before the slice's end (causal) or every key;
- ``random`` (and ``topk`` when a slice does not start on a block boundary): blocks of *rows*
  keyed by the query block's index, which a slice cannot reproduce with positions: the call is
  *replicated* (every rank gathers q, k and v; see ``replicated``).

The rows a rank fetches are the union of those ranges over its head groups (K and V rows are
shared by every head, so the widest group decides) and its own slice, clipped to ``[0, N)``.
``exchange_plan`` splits each rank's ranges by owner; everything a rank receives in the forward
it sends back as gradients in the backward, so the traffic per direction is the same.

    >>> from msa_codegen.distributed.halo import fetched_rows
    >>> fetched_rows("window=8,dilation=2", [64, 64, 64])     # reach 14 rows to the left
    [0, 14, 14]
"""
from __future__ import annotations

from ..pattern.spec import Pattern, Spec, parse

Range = tuple[int, int]            # [lo, hi) of global rows
Segment = tuple[int, int, int]     # (owner rank, lo, hi)


def offsets(seq_lens: list[int]) -> list[int]:
    """``[0, n0, n0 + n1, ...]``: rank r holds rows ``[offsets[r], offsets[r + 1])``."""
    out = [0]
    for n in seq_lens:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"seq_lens must hold non-negative integers, got {seq_lens!r}")
        out.append(out[-1] + n)
    return out


LAYOUTS = ("contiguous", "head_tail")


def holdings(seq_lens: list[int], layout: str = "contiguous") -> list[list[Range]]:
    """Per rank, the global rows it holds, in the order of its local tensors.

    ``"contiguous"``: rank r holds ``[offsets[r], offsets[r + 1])``. ``"head_tail"`` (load balancing
    for causal attention): the sequence is cut into ``2P`` chunks of ``c = n_r / 2`` rows and rank r
    holds chunks r and ``2P - 1 - r``, back to back; every ``n_r`` must be the same even number::

        P = 2, N = 8 (c = 2):   rows   0 1 | 2 3 | 4 5 | 6 7
                                rank   0 0 | 1 1 | 1 1 | 0 0     rank 0: [0, 2) + [6, 8)
    """
    off = offsets(seq_lens)
    if layout == "contiguous":
        return [[(off[r], off[r + 1])] if seq_lens[r] else [] for r in range(len(seq_lens))]
    if layout != "head_tail":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    p = len(seq_lens)
    if len(set(seq_lens)) != 1 or seq_lens[0] % 2:
        raise ValueError(f"layout='head_tail' needs the same even number of rows on every rank (two chunks of "
                         f"n_r / 2), got slice lengths {seq_lens}")
    c = seq_lens[0] // 2
    return [[(r * c, (r + 1) * c), ((2 * p - 1 - r) * c, (2 * p - r) * c)] if c else [] for r in range(p)]


def union(ranges) -> list[Range]:
    """Sorted, disjoint, non-empty ranges covering the same rows as ``ranges``."""
    out: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def reach(spec: Spec) -> int:
    """How far a window reaches from its query: ``(W - 1) * d`` rows (0 without a window)."""
    return 0 if spec.window is None else (spec.window - 1) * spec.dilation


def replicated(pattern: str | Pattern, seq_lens: list[int], num_heads: int | None = None) -> bool:
    """True when a slice cannot evaluate the pattern with global positions, so every rank gathers
    q, k and v and computes the whole call (taking its own rows of the output).

    ``random`` picks key blocks per query block *index* among all query blocks; ``topk`` reads
    ``block_indices`` per query block of rows, which a slice reproduces only when it starts on a
    block boundary.
    """
    off = offsets(seq_lens)
    for s in _specs(pattern, num_heads):
        if s.random:
            return True
        if s.topk and any(off[r] % s.block for r in range(len(seq_lens)) if seq_lens[r]):
            return True
    return False


def spec_ranges(spec: Spec, start: int, end: int, n: int) -> list[Range]:
    """The key rows that queries ``[start, end)`` of an ``n``-row sequence see under one spec.

    Never empty for a non-empty slice: the slice's own rows are always included (their gradients
    belong to the rank anyway, and fetching them costs nothing).
    """
    if end <= start:
        return []
    last = end if spec.causal else n     # one past the last key any query of the slice may see
    if spec.dense or spec.topk or spec.random:
        return [(0, last)]
    ranges = [(start, end)]
    if spec.global_:                      # bidirectional by the grammar
        if start < spec.global_:
            return [(0, n)]
        ranges.append((0, min(spec.global_, n)))
    if spec.window is not None:
        r = reach(spec)
        ranges.append((max(0, start - r), end if spec.causal else min(n, end + r)))
    if spec.sink:
        ranges.append((0, min(spec.sink, last)))
    return union(ranges)


def _specs(pattern: str | Pattern, num_heads: int | None) -> list[Spec]:
    pat = parse(pattern)
    if num_heads is None:
        return [g.spec for g in pat.groups]
    return [s for _, _, s in pat.head_groups(num_heads)]


def needed_ranges(pattern: str | Pattern, seq_lens: list[int], num_heads: int | None = None,
                  layout: str = "contiguous") -> list[list[Range]]:
    """Per rank, the key rows it needs (own rows included): the union over head groups (and over
    the chunks it holds)."""
    n = sum(seq_lens)
    specs = _specs(pattern, num_heads)
    return [union(r for s in specs for lo, hi in held for r in spec_ranges(s, lo, hi, n))
            for held in holdings(seq_lens, layout)]


def split_by_owner(ranges: list[Range], off: list[int]) -> list[Segment]:
    """``ranges`` cut at the slice boundaries ``off``: ``(owner, lo, hi)`` in row order."""
    out = []
    for lo, hi in ranges:
        for owner in range(len(off) - 1):
            a, b = max(lo, off[owner]), min(hi, off[owner + 1])
            if a < b:
                out.append((owner, a, b))
    return out


def split_by_holder(ranges: list[Range], held: list[list[Range]], seq_lens: list[int]) -> list[tuple[int, int, int, int]]:
    """``ranges`` (global rows) cut by who holds them: ``(owner, lo, hi, at)`` in global row order,
    ``at`` being where row ``lo`` sits in the owner's stacked rows (``offsets(seq_lens)[owner]`` + its
    index in the owner's local tensor)."""
    off = offsets(seq_lens)
    pieces = []
    for owner, chunks in enumerate(held):
        base = off[owner]
        for clo, chi in chunks:
            for lo, hi in ranges:
                a, b = max(lo, clo), min(hi, chi)
                if a < b:
                    pieces.append((a, b, owner, base + a - clo))
            base += chi - clo
    return [(owner, a, b, at) for a, b, owner, at in sorted(pieces)]


def exchange_plan(needed: list[list[Range]], seq_lens: list[int], layout: str = "contiguous") -> list[list[Segment]]:
    """Per rank, the segments of its local key tensor in global row order, each with the rank that
    owns it: ``(owner, lo, hi)`` in *stacked local rows* (rank r's local row i is ``offsets[r] + i``),
    which are the global rows for the contiguous layout. ``exchange.fetch`` moves rows by these."""
    held = holdings(seq_lens, layout)
    return [[(owner, at, at + b - a) for owner, a, b, at in split_by_holder(r, held, seq_lens)] for r in needed]


def plan_positions(needed: list[list[Range]], seq_lens: list[int], layout: str = "contiguous") -> list[list[Range]]:
    """Per rank, the global rows of the segments of ``exchange_plan`` (the same order): its keys' positions."""
    held = holdings(seq_lens, layout)
    return [[(a, b) for _, a, b, _ in split_by_holder(r, held, seq_lens)] for r in needed]


def fetched_rows(pattern: str | Pattern, seq_lens: list[int], num_heads: int | None = None,
                 layout: str = "contiguous") -> list[int]:
    """Per rank, how many K/V rows it receives from other ranks in the forward (= sends back in the backward).

    The halo formula: for ``window=W,dilation=d`` alone, rank r with slice ``[s, e)`` of ``N`` rows
    receives ``min(s, (W-1)d)`` rows (causal) plus ``min(N - e, (W-1)d)`` (``causal=false``); sinks add
    the rows of ``[0, S)`` that are neither its own nor already in the halo. For a replicated pattern
    (``random``) it is ``N - n_r`` rows of K/V (and the same of q, see ``traffic_bytes``).
    """
    if replicated(pattern, seq_lens, num_heads):
        needed = [[(0, sum(seq_lens))] if n else [] for n in seq_lens]
    else:
        needed = needed_ranges(pattern, seq_lens, num_heads, layout)
    plan = exchange_plan(needed, seq_lens, layout)
    return [sum(hi - lo for owner, lo, hi in segs if owner != r) for r, segs in enumerate(plan)]


def traffic_bytes(pattern: str | Pattern, seq_lens: list[int], *, batch: int, q_heads: int, kv_heads: int,
                  head_dim: int, itemsize: int, layout: str = "contiguous") -> list[int]:
    """Per rank, the bytes it receives in the forward (K and V rows; and q rows when replicated).

    The backward sends the same number of bytes back (the gradients of those rows).
    """
    rows = fetched_rows(pattern, seq_lens, q_heads, layout)
    per_row = batch * head_dim * itemsize * 2 * kv_heads
    if replicated(pattern, seq_lens, q_heads):
        per_row += batch * head_dim * itemsize * q_heads
    return [r * per_row for r in rows]
