"""Plain PyTorch oracle: the dense element mask of a pattern and attention through it.

Both follow the pattern contract of the design card element by element and build an
N x N mask: use them at test sizes, never in training.
"""
from __future__ import annotations

import torch

from .spec import Pattern, Spec, parse
from ..sparsity.inputs import Dynamic, normalize
from ..sparsity.tables import random_block_mask


def spec_mask(spec: Spec, seqlen: int, device="cpu", rows: tuple[int, int] | None = None) -> torch.Tensor:
    """bool ``(seqlen, seqlen)``: ``[i, j]`` is True where query i sees key j under one spec.

    ``rows=(r0, r1)`` builds only the rows of queries r0..r1-1, ``(r1 - r0, seqlen)``.
    """
    _no_msa(spec)
    r0, r1 = rows if rows is not None else (0, seqlen)
    i = torch.arange(r0, r1, device=device)[:, None]
    j = torch.arange(seqlen, device=device)[None, :]
    delta = i - j
    direction = delta >= 0 if spec.causal else torch.ones_like(delta, dtype=torch.bool)
    if spec.dense:
        return direction.expand(r1 - r0, seqlen).clone()
    local = torch.zeros(r1 - r0, seqlen, dtype=torch.bool, device=device)
    if spec.window is not None:
        d = spec.dilation
        local |= (delta.abs() % d == 0) & (delta.abs() // d < spec.window)
    if spec.sink:
        local |= j < spec.sink
    if spec.global_:
        local |= (i < spec.global_) | (j < spec.global_)
    if spec.random:
        blocks = random_block_mask(spec, seqlen).to(device)
        local |= blocks[i // spec.block, j // spec.block]
    return direction & local


def _no_msa(spec: Spec) -> None:
    if spec.msa:
        raise ValueError(f"msa={spec.msa} selects keys per query from proxy heads at run time: it has no fixed "
                         f"mask; its reference is msa_codegen.reference_msa")


def topk_block_mask(block_indices: torch.Tensor, nkb: int) -> torch.Tensor:
    """bool ``(B, Hkv, nqb, nkb)`` from ``block_indices`` ``(B, Hkv, nqb, K)`` (-1 = unused slot)."""
    bi = block_indices.to(torch.int64)
    out = torch.zeros(bi.shape[:3] + (nkb + 1,), dtype=torch.bool, device=bi.device)
    out.scatter_(3, torch.where(bi >= 0, bi, nkb), True)
    return out[..., :nkb]


def dynamic_spec_mask(spec: Spec, dyn: Dynamic, h0: int, h1: int, group: int, device="cpu") -> torch.Tensor:
    """bool ``(B|1, h1 - h0, Nq, Nk)``: one spec on query heads h0..h1-1 with run-time inputs.

    The element predicate on positions, within segments (documents / buckets); ``random`` and
    ``topk`` blocks are blocks of rows (see dynamic.py).
    """
    _no_msa(spec)
    nq, nk = dyn.nq, dyn.nk
    heads = torch.arange(h0, h1, device=device)
    qi = torch.arange(nq, device=device)
    kj = torch.arange(nk, device=device)

    def per_head(t, kv):   # (B|1, H|1, n) -> (B|1, h1 - h0, n)
        t = t.to(device=device, dtype=torch.int64)
        if t.shape[1] == 1:
            return t.expand(t.shape[0], h1 - h0, t.shape[2])
        return t[:, heads // group if kv else heads]

    if dyn.positional:
        ip = per_head(dyn.q_pos, False)[..., :, None]
        jp = per_head(dyn.k_pos, True)[..., None, :]
    else:
        ip, jp = qi[None, None, :, None], kj[None, None, None, :]
    delta = ip - jp
    direction = delta >= 0 if spec.causal else torch.ones_like(delta, dtype=torch.bool)
    if dyn.q_seg is not None:
        direction = direction & (per_head(dyn.q_seg, False)[..., :, None] == per_head(dyn.k_seg, True)[..., None, :])
    if spec.dense:
        return direction
    local = torch.zeros(torch.broadcast_shapes(delta.shape, (1, h1 - h0, nq, nk)), dtype=torch.bool, device=device)
    if spec.window is not None:
        d = spec.dilation
        local = local | ((delta.abs() % d == 0) & (delta.abs() // d < spec.window))
    if spec.sink:
        local = local | (jp < spec.sink)
    if spec.global_:
        local = local | (ip < spec.global_) | (jp < spec.global_)
    if spec.random:
        if nq != nk:
            raise ValueError(f"random=R needs q and k of one length, got Nq={nq}, Nk={nk}")
        blocks = random_block_mask(spec, nq).to(device)
        local = local | blocks[(qi // spec.block)[:, None], (kj // spec.block)[None, :]]
    if spec.topk:
        tb = topk_block_mask(dyn.block_indices.to(device), -(-nk // spec.block))   # (B, Hkv, nqb, nkb)
        tb = tb[:, heads // group]
        local = local | tb[:, :, (qi // spec.block)[:, None], (kj // spec.block)[None, :]]
    return direction & local


def _dyn_kwargs(kw) -> bool:
    return any(v is not None for v in kw.values())


def mask(pattern: str | Pattern, seqlen: int | None, num_heads: int = 1, device="cpu", *,
         num_kv_heads: int | None = None, batch: int | None = None, cu_seqlens=None, q_pos=None,
         k_pos=None, q_bucket=None, k_bucket=None, block_indices=None) -> torch.Tensor:
    """The dense element mask, bool ``(num_heads, seqlen, seqlen)``; ``[h, i, j]``: query i of head h sees key j.

    For inspection, plots and tests at small sizes (it is O(seqlen^2)). Example::

        >>> import msa_codegen as msa
        >>> msa.mask("window=2,dilation=2", 6)[0].int()
        tensor([[1, 0, 0, 0, 0, 0],
                [0, 1, 0, 0, 0, 0],
                [1, 0, 1, 0, 0, 0],
                [0, 1, 0, 1, 0, 0],
                [0, 0, 1, 0, 1, 0],
                [0, 0, 0, 1, 0, 1]], dtype=torch.int32)

    With any run-time input (``cu_seqlens``, ``q_pos``/``k_pos``, ``q_bucket``/``k_bucket``,
    ``block_indices``; see ``msa_codegen.attention`` and sparsity/inputs.py) the mask is
    ``(B, num_heads, Nq, Nk)``: ``B`` is ``batch`` or taken from the inputs (1 when they have no
    batch dimension), Nq and Nk from the positions (``seqlen`` may then be None),
    ``num_kv_heads`` (default: from the key-side inputs, else ``num_heads``) maps query heads to
    KV heads. Two packed documents, ``sink=1``::

        >>> cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        >>> msa.mask("sink=1,window=1", 5, cu_seqlens=cu)[0, 0].int()
        tensor([[1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [0, 0, 1, 0, 0],
                [0, 0, 1, 1, 0],
                [0, 0, 1, 0, 1]], dtype=torch.int32)
    """
    pat = parse(pattern)
    kw = dict(cu_seqlens=cu_seqlens, q_pos=q_pos, k_pos=k_pos, q_bucket=q_bucket, k_bucket=k_bucket,
              block_indices=block_indices)
    if not _dyn_kwargs(kw) and not any(g.spec.topk for g in pat.groups):
        if seqlen is None or seqlen < 1:
            raise ValueError(f"seqlen must be >= 1, got {seqlen}")
        out = torch.empty(num_heads, seqlen, seqlen, dtype=torch.bool, device=device)
        for h0, h1, spec in pat.head_groups(num_heads):
            out[h0:h1] = spec_mask(spec, seqlen, device)
        return out
    groups = pat.head_groups(num_heads)
    nq = nk = seqlen
    if q_pos is not None and k_pos is not None:
        nq, nk = q_pos.shape[-1], k_pos.shape[-1]
        if seqlen is not None and seqlen != nq:
            raise ValueError(f"seqlen={seqlen} does not match q_pos's length {nq}")
    if nq is None or nq < 1 or nk < 1:
        raise ValueError(f"seqlen must be >= 1 (or given by q_pos/k_pos), got {seqlen}")
    if num_kv_heads is None:
        kv_side = [t.shape[1] for t in (k_pos, k_bucket) if isinstance(t, torch.Tensor) and t.dim() >= 3]
        if isinstance(block_indices, torch.Tensor) and block_indices.dim() == 4:
            num_kv_heads = block_indices.shape[1]
        else:
            num_kv_heads = max(kv_side) if kv_side and max(kv_side) > 1 else num_heads
    if batch is None:
        sides = [t for t in (q_pos, k_pos, q_bucket, k_bucket, block_indices)
                 if isinstance(t, torch.Tensor) and t.dim() >= 3]
        batch = max([t.shape[0] for t in sides], default=1)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    dev = torch.device(device)
    dyn = normalize(groups, batch, num_heads, num_kv_heads, nq, nk, None, **kw)
    out = torch.empty(batch, num_heads, nq, nk, dtype=torch.bool, device=dev)
    for h0, h1, spec in groups:
        out[:, h0:h1] = dynamic_spec_mask(spec, dyn, h0, h1, num_heads // num_kv_heads, dev)
    return out


def reference_attention(q, k, v, pattern: str | Pattern = "causal", scale: float | None = None,
                        return_lse: bool = False, **dynamic):
    """Attention through the dense mask, computed in float64 (any input dtype), differentiable.

    q ``(B, Hq, Nq, D)``, k and v ``(B, Hkv, Nk, D)`` with Hq a multiple of Hkv (Nq == Nk unless
    q_pos/k_pos are given). Returns the output in float64 (and the natural-log LSE ``(B, Hq, Nq)``
    float64 when ``return_lse``). A query that sees no key gets a zero row and LSE ``-inf``.
    ``dynamic``: the run-time inputs of ``msa_codegen.attention`` (cu_seqlens, q_pos, k_pos,
    q_bucket, k_bucket, block_indices); no gradient flows into them.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    group = hq // hkv
    q64, k64, v64 = q.double(), k.double(), v.double()
    k64 = k64.repeat_interleave(group, dim=1)
    v64 = v64.repeat_interleave(group, dim=1)
    if _dyn_kwargs(dynamic) or any(g.spec.topk for g in parse(pattern).groups):
        m = mask(pattern, n, hq, q.device, num_kv_heads=hkv, batch=b, **dynamic)
    else:
        m = mask(pattern, n, hq, q.device)[None]
    s = torch.einsum("bhid,bhjd->bhij", q64, k64) * scale
    s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    any_visible = m.any(dim=-1)
    p = torch.exp(s - torch.where(any_visible, lse, torch.zeros_like(lse))[..., None])
    p = torch.where(m, p, torch.zeros_like(p))
    out = torch.einsum("bhij,bhjd->bhid", p, v64)
    if return_lse:
        return out, lse
    return out


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref||, in float64; inf if ``a`` has a non-finite value.

    A reference that is (near) zero, e.g. dq of a one-key window, is judged by its absolute
    error per element against the unit scale of the inputs (the denominator never drops below
    sqrt(numel)). Used by the tests and by the tuner's correctness gate.
    """
    a, ref = a.double(), ref.double()
    if not torch.isfinite(a).all():
        return float("inf")
    denom = max(ref.norm().item(), ref.numel() ** 0.5)
    return (a - ref).norm().item() / denom
