"""Context-parallel sparse attention: the sequence sharded over the ranks of a process group.

Rank r holds the contiguous rows ``[start_r, end_r)`` of q, k and v. A call:

1. all-gathers a few integers per rank (slice length, shapes, dtype): the lengths (``seq_lens``,
   when given, is checked against them), and the same clear error on every rank when shapes
   disagree;
2. fetches the K/V rows the rank's queries can see from their owners (``halo.py`` says which:
   a window's halo, the sinks, the first G rows of ``global=G`` (everything for a rank holding
   a global row), everything for dense and top-k), one batch of P2P ops;
3. runs the single-device kernels on (local queries, fetched keys) with ``q_pos`` / ``k_pos``
   set to the global rows, so the pattern is evaluated in global coordinates;
4. in the backward, the kernels' dK/dV of fetched rows go back to their owners (``exchange.py``).

Patterns a slice cannot evaluate with positions (``random``; ``topk`` with slices that do not
start on a block boundary) are *replicated*: every rank fetches all of q, k and v, runs the whole
call and keeps its rows of the output; the gradients flow back the same way.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.distributed as dist

from ..api import _check_inputs, attention
from ..pattern.spec import Pattern, parse
from . import halo
from .exchange import Comm, fetch, make_comm

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}


def resolve_group(group, mesh_dim=None):
    """A ProcessGroup from ``group``: None (the default group), a ProcessGroup, a DeviceMesh (with
    ``mesh_dim`` unless it is 1-D) or a ``(DeviceMesh, dim)`` pair."""
    if isinstance(group, tuple):
        if len(group) != 2:
            raise ValueError(f"group as a tuple must be (DeviceMesh, mesh_dim), got {len(group)} items")
        group, mesh_dim = group
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:   # pragma: no cover - torch without device_mesh
        DeviceMesh = ()
    if DeviceMesh and isinstance(group, DeviceMesh):
        if mesh_dim is None and group.ndim != 1:
            raise ValueError(f"group is a {group.ndim}-D DeviceMesh: say which dimension holds the sequence "
                             f"(mesh_dim=, one of {group.mesh_dim_names or tuple(range(group.ndim))})")
        return group.get_group(mesh_dim) if mesh_dim is not None else group.get_group()
    if mesh_dim is not None:
        raise ValueError("mesh_dim is only meaningful when group is a DeviceMesh")
    return group


def _fingerprint(text: str) -> int:
    """A stable small integer standing for ``text`` (the same on every rank), never 0."""
    return zlib.crc32(text.encode()) + 1


def _gather_meta(q, k, comm: Comm, *, failed: bool, pattern_fp: int, lens_fp: int) -> list[list[int]]:
    """Every rank's ``[N_local, B, Hq, Hkv, D, dtype code, failed, pattern, seq_lens]``: one all-gather.

    ``failed``: this rank's own argument checks raised; ``pattern`` / ``seq_lens``: fingerprints of
    the pattern and of the ``seq_lens`` it was given (0: none given).
    """
    shapes = list(q.shape) if q.dim() == 4 else [-1] * 4
    b, hq, n, d = shapes
    hkv = k.shape[1] if k.dim() == 4 else -1
    mine = torch.tensor([n, b, hq, hkv, d, _DTYPE_CODES.get(q.dtype, 0), int(failed), pattern_fp, lens_fp],
                        dtype=torch.int64, device=q.device)
    out = [torch.empty_like(mine) for _ in range(comm.size)]
    dist.all_gather(out, mine, group=comm.group)
    return [t.tolist() for t in out]


def _check_meta(meta: list[list[int]], seq_lens, me: int, local_error: Exception | None) -> list[int]:
    """The slice lengths; else the error, raised on every rank alike (what one rank alone rejected,
    shapes or dtypes that disagree, different patterns, a ``seq_lens`` that does not match)."""
    def raise_failed(failed):
        if local_error is not None:
            raise local_error
        raise ValueError(f"context_parallel_attention: rank{'s' if len(failed) > 1 else ''} "
                         f"{', '.join(map(str, failed))} of the group rejected their arguments (their error says "
                         f"why); no rank ran the call")

    failed = [r for r, m in enumerate(meta) if m[6]]
    if any(m[0] < 0 for m in meta):   # not a 4-dim tensor: its shape says nothing to compare
        raise_failed(failed)
    names = ("batch size B", "query heads Hq", "key/value heads Hkv", "head dim D", "dtype")
    for col, name in enumerate(names, start=1):
        values = [m[col] for m in meta]
        if len(set(values)) > 1:
            if name == "dtype":
                codes = {c: str(t).replace("torch.", "") for t, c in _DTYPE_CODES.items()}
                values = [codes.get(x, "other") for x in values]
            raise ValueError(f"context_parallel_attention: every rank must pass the same {name}, got {values} "
                             f"(rank by rank)")
    if failed:   # after the comparisons: a mismatch names every rank's value, which says more
        raise_failed(failed)
    if len({m[7] for m in meta}) > 1:
        raise ValueError("context_parallel_attention: the ranks passed different patterns or layouts (every rank "
                         "must pass the same ones)")
    lens = [m[0] for m in meta]
    given = {m[8] for m in meta} - {0}
    if given and given != {_fingerprint(repr(lens))}:
        # every rank sees the same fingerprints, so every rank raises; the ranks whose seq_lens differ
        wrong = [r for r, m in enumerate(meta) if m[8] not in (0, _fingerprint(repr(lens)))]
        mine = f" (this rank's: {[int(x) for x in seq_lens]})" if me in wrong else ""
        raise ValueError(f"context_parallel_attention: seq_lens on rank{'s' if len(wrong) > 1 else ''} "
                         f"{', '.join(map(str, wrong))} does not match the slices the ranks hold (lengths {lens})"
                         f"{mine}")
    if sum(lens) == 0:
        raise ValueError("context_parallel_attention: every rank holds zero tokens")
    return lens


def context_parallel_attention(q, k, v, pattern: str | Pattern = "causal", group=None, seq_lens=None, *,
                               mesh_dim=None, scale: float | None = None, return_lse: bool = False,
                               block_indices=None, layout: str = "contiguous"):
    """Sparse attention over a sequence sharded in contiguous slices across a process group.

    Args:
        q: ``(B, Hq, n_r, D)``, this rank's rows ``[start_r, start_r + n_r)`` of the queries (rank r
            of the group holds the r-th slice; ``n_r`` may differ between ranks and may be 0).
        k, v: ``(B, Hkv, n_r, D)``, the same rows of the keys and values; same dtype and device.
        pattern: a pattern string or ``Pattern`` (``msa_codegen.parse``), evaluated on global positions.
        group: a ProcessGroup (default: the default group), a DeviceMesh (1-D, or with ``mesh_dim``),
            or a ``(DeviceMesh, mesh_dim)`` pair. NCCL for CUDA tensors, Gloo for CPU tensors.
        seq_lens: every rank's ``n_r``, in rank order; checked against the slices. Default: read
            from the one small all-gather every call makes.
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the float32 LSE ``(B, Hq, n_r)`` of this rank's queries.
        layout: ``"contiguous"`` (default): rank r holds rows ``[start_r, start_r + n_r)``.
            ``"head_tail"``: load balancing for causal attention: the sequence is cut into 2P
            chunks of ``n_r / 2`` rows and rank r holds chunks r and ``2P - 1 - r`` back to back
            (q, k, v and the output alike; every ``n_r`` the same even number; no random/topk
            terms). Each rank then computes the same number of (query, key) pairs of a dense
            causal pattern, where the contiguous layout gives the last rank ``2P - 1`` times the
            first's; the K/V it fetches are the same all-gather-like rows (``halo.holdings``).
        block_indices: for ``topk=K``: the *global* int32 ``(B, Hkv, ceil(N / block), K)`` table, the
            same on every rank.

    Returns:
        this rank's rows of ``msa_codegen.attention`` on the gathered sequence, ``(B, Hq, n_r, D)``
        (and the LSE). Differentiable in q, k and v: the backward returns this rank's dq, dk, dv,
        including the gradients other ranks computed for its keys.

    Collective: every rank of the group must call it with the same pattern, and run the backward
    when any rank does. Traffic per rank: ``halo.traffic_bytes``; measured: ``last_traffic()``.

    Example::

        # torchrun --nproc-per-node 2 ...; each rank holds N/2 tokens
        out = msa_codegen.context_parallel_attention(q, k, v, "window=4096,dilation=2,sink=64")
        out.sum().backward()
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    comm = make_comm(resolve_group(group, mesh_dim))
    # A rank that raised before a collective would leave the others waiting in it: every check of
    # this rank's own arguments is made first, its outcome goes into the one all-gather, and then
    # every rank raises (the rank at fault its own error, the others one that names it).
    local_error, pattern_fp = None, 0
    try:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(f"{name} must be a 4-dim tensor (B, H, n_r, D), got {tuple(t.shape)}")
        pattern = parse(pattern)
        if layout not in halo.LAYOUTS:
            raise ValueError(f"layout must be one of {halo.LAYOUTS}, got {layout!r}")
        pattern_fp = _fingerprint(f"{pattern}|{layout}")
        if pattern.msa_groups:
            raise ValueError(f"pattern {str(pattern)!r}: msa=T is not available in context_parallel_attention yet "
                             f"(MSA's per-query selection reads every earlier key block); run msa_attention or "
                             f"attention on the gathered sequence")
        _check_inputs(q, k, v, scale, lengths_may_differ=False)
        pattern.head_groups(q.shape[1])
        lens_fp = 0 if seq_lens is None else _fingerprint(repr([int(x) for x in seq_lens]))
    except (ValueError, TypeError) as exc:   # PatternError is a ValueError
        local_error, lens_fp = exc, 0
    meta = _gather_meta(q, k, comm, failed=local_error is not None, pattern_fp=pattern_fp, lens_fp=lens_fp)
    lens = _check_meta(meta, seq_lens, comm.rank, local_error)
    b, hq, n_me, d = q.shape
    off = halo.offsets(lens)
    n = off[-1]
    me = comm.rank
    scale = float(d ** -0.5 if scale is None else scale)

    held = halo.holdings(lens, layout)   # head_tail with uneven slices raises here, on every rank alike
    if layout != "contiguous" and (halo.replicated(pattern, lens, hq)
                                   or any(s.topk for _, _, s in pattern.head_groups(hq))):
        raise ValueError(f"layout={layout!r} does not take random or topk terms (pattern {str(pattern)!r}): "
                         f"their blocks are rows of the contiguous sequence")
    if halo.replicated(pattern, lens, hq):
        whole = [[(0, n)] if ln else [] for ln in lens]
        plan = halo.exchange_plan(whole, lens)
        q_all, k_all, v_all = fetch([q, k, v], [plan, plan, plan], off, comm)
        if n_me == 0:
            return _empty(q, k, v, return_lse)
        res = attention(q_all, k_all, v_all, pattern, scale=scale, return_lse=return_lse,
                        block_indices=block_indices)
        s, e = off[me], off[me + 1]
        if return_lse:
            return res[0][:, :, s:e], res[1][:, :, s:e]
        return res[:, :, s:e]

    needed = halo.needed_ranges(pattern, lens, hq, layout)
    plan = halo.exchange_plan(needed, lens, layout)
    k_loc, v_loc = fetch([k, v], [plan, plan], off, comm)
    if n_me == 0:
        return _empty(q, k, v, return_lse)

    def positions(ranges):
        return torch.cat([torch.arange(lo, hi, device=q.device, dtype=torch.int32) for lo, hi in ranges])
    q_pos = positions(held[me])
    k_pos = positions(halo.plan_positions(needed, lens, layout)[me])
    local_bi = None
    if block_indices is not None:
        local_bi = _local_block_indices(pattern, hq, block_indices, off[me], n_me, k_loc.shape[2])
    return attention(q, k_loc, v_loc, pattern, scale=scale, return_lse=return_lse, q_pos=q_pos, k_pos=k_pos,
                     block_indices=local_bi)


def _local_block_indices(pattern: Pattern, hq: int, block_indices, start: int, n_me: int, nk: int):
    """The rows of the global ``block_indices`` for a slice starting on a block boundary.

    The fetched keys are rows ``[0, nk)`` (a topk term needs every key before the slice's end), so
    key block ids stay global; ids past them (causal: blocks after every query of the slice, which
    no query sees) become -1, unused.
    """
    blocks = {s.block for _, _, s in pattern.head_groups(hq) if s.topk}
    if not blocks:
        return block_indices   # attention() says that no topk term wants them
    blk = blocks.pop()
    first = start // blk
    local = block_indices[:, :, first:first + math.ceil(n_me / blk)]
    return torch.where(local < math.ceil(nk / blk), local, torch.full_like(local, -1))


def _empty(q, k, v, return_lse):
    """The output of a rank that holds no tokens, still attached to q, k and v (zero gradients)."""
    out = q.clone() + (k.sum() + v.sum()) * 0
    if return_lse:
        return out, q.new_empty(q.shape[:3], dtype=torch.float32)
    return out
