"""Tile and band arithmetic of the launches: grids, padded head dims, the backward's scratch
and prefix chunks. Plain functions of integers and plans, no tensors.

``launch.py`` reads ``PREFIX_CHUNK_ROWS`` and calls ``ds_heads`` through this module, so a test
may lower the one (``monkeypatch.setattr(schedule, "PREFIX_CHUNK_ROWS", 64)``) or wrap the other
to see what the backward chose.
"""
from __future__ import annotations

import os

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def pow2(n: int) -> int:
    """The power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def block_d(head_dim: int) -> int:
    """The kernels' padded head dim: the power of two >= head_dim, at least 16."""
    return max(16, pow2(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for a dtype."""
    # fp32 inputs: full-precision products (tf32 would cost ~3e-4 relative error)
    return "ieee" if dtype == torch.float32 else "tf32"


PREFIX_CHUNK_ROWS = 8192


def prefix_chunk(n: int, prefix: int, row_elems: int, block_m: int) -> int:
    """Query rows per program of the prefix-key tiles of the dk/dv kernel.

    Short enough that those programs are no longer than the window tiles' (PREFIX_CHUNK_ROWS),
    long enough that the fp32 partial sums (chunks x prefix x B*H_kv*D x 8 bytes) stay under
    256 MiB.
    """
    most_chunks = max(1, (256 << 20) // (prefix * row_elems * 8))
    chunk = max(PREFIX_CHUNK_ROWS, cdiv(n, most_chunks))
    return cdiv(chunk, block_m) * block_m


def seq_tiles(plan, n: int, block: int, positional: bool) -> int:
    """Programs along a sequence of n rows: a tile of ``block`` rows of one residue class each.
    Dilated plans stride their tiles by class; positional plans do so only with index classes
    (``cu_seqlens``), otherwise their tiles are contiguous rows."""
    classes = 1 if positional and not plan.classes else plan.dilation
    return classes * cdiv(cdiv(n, classes), block)


#: Warps and pipeline stages of the dq kernel when it reads the band's dS tiles: its tile is then
#: the dk/dv kernel's query block x key tile, and its loop one product a block
DS_DQ_WARPS = 4
DS_DQ_STAGES = 3

#: Default for ``bwd_scratch_limit``: 0, the scratch path is opt-in (docs/performance.md)
BWD_SCRATCH_DEFAULT = 0


def bwd_scratch_limit() -> int:
    """Bytes the backward may allocate to pass the window band's dS from the dk/dv kernel to the
    dq kernel (``ds_heads``): the environment variable ``MSA_BWD_SCRATCH_BYTES``, else
    ``BWD_SCRATCH_DEFAULT`` (0: off, dq recomputes P and dP). Read at every backward.

    With a limit, plain window patterns (no global rows, random or top-k blocks) store the band's
    dS tiles (2 bytes per attended pair and head, about 1.1 GB per head at window=4096,
    N=131072) and dq runs one product a block instead of three; the heads go in chunks of whole
    KV heads that fit, and when one does not, dq recomputes. On an H200 (2026-12-01) the backward
    was 5% faster for window=4096 (median of five rounds), faster in one run and not in another for its dilation
    2 and causal=false,window=512, no faster with a sink, and slower for GQA 32/8 and head dim
    64: the dk/dv kernel's stores (+4 ms at window=4096) cost about what dq saves (-5 ms)."""
    raw = os.environ.get("MSA_BWD_SCRATCH_BYTES")
    if raw is None or raw == "":
        return BWD_SCRATCH_DEFAULT
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"MSA_BWD_SCRATCH_BYTES must be an integer number of bytes, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"MSA_BWD_SCRATCH_BYTES must be >= 0, got {value}")
    return value


def ds_slots(plan, n: int, block_m: int, block_n: int) -> int:
    """dS^T tiles (block_n keys x block_m queries) per key tile of the dk/dv kernel's W phase.

    The tile's band of query blocks starts at the block holding its first query row (the key
    tile's first key when causal, W - 1 class positions before it otherwise), at most
    block_m - 1 below that row, and ends W - 1 class positions past the tile's last key: at most
    block_n + W + block_m - 2 rows (causal) or block_n + 2W + block_m - 3, and never more blocks
    than the class has. The dq kernel finds its tile at slot (a0 - band start) / block_m: both
    kernels' W bands hold every block pair with a visible pair and the causal or window
    inequalities make the two ranges the same, so every slot dq reads was written."""
    w = plan.window
    span = block_n + w + block_m - 2 if plan.causal else block_n + 2 * w + block_m - 3
    return min(cdiv(span, block_m), cdiv(cdiv(n, plan.dilation), block_m))


def ds_heads(plan, positional: bool, b: int, n: int, h0: int, h1: int, group: int, block_m: int,
             block_n: int, itemsize: int):
    """(slots per key tile, elements per (batch, head), heads per chunk) for the backward that
    passes the band's dS from the dk/dv kernel to the dq kernel, or None: the plan has no
    banded W phase of the plain kernels, the limit (``bwd_scratch_limit()``) is 0, or one chunk
    of whole KV heads (``group`` query heads at batch ``b``) would exceed it."""
    if positional or not plan.ds_capable:
        return None
    limit = bwd_scratch_limit()
    if not limit:
        return None
    slots = ds_slots(plan, n, block_m, block_n)
    per_head = seq_tiles(plan, n, block_n, False) * slots * block_n * block_m
    fit = limit // (b * per_head * itemsize)
    if h0 % group or h1 % group:
        # a KV head whose query heads fall in two head groups: chunks would not hold whole KV
        # heads, so all of this group's heads in one, or none
        return (slots, per_head, h1 - h0) if fit >= h1 - h0 else None
    fit = fit // group * group
    if fit < 1:
        return None
    # equal chunks of whole KV heads: a short last chunk would leave most SMs idle in its launches
    chunks = cdiv(h1 - h0, fit)
    heads = min(fit, cdiv(cdiv(h1 - h0, chunks), group) * group)
    return slots, per_head, heads
