"""Plain PyTorch oracle: the dense element mask of a pattern and attention through it.

Both follow the pattern contract of the design card element by element and build an
N x N mask: use them at test sizes, never in training.
"""
from __future__ import annotations

import torch

from .spec import Pattern, Spec, parse
from .tables import random_block_mask


def spec_mask(spec: Spec, seqlen: int, device="cpu", rows: tuple[int, int] | None = None) -> torch.Tensor:
    """bool ``(seqlen, seqlen)``: ``[i, j]`` is True where query i sees key j under one spec.

    ``rows=(r0, r1)`` builds only the rows of queries r0..r1-1, ``(r1 - r0, seqlen)``.
    """
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


def mask(pattern: str | Pattern, seqlen: int, num_heads: int = 1, device="cpu") -> torch.Tensor:
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
    """
    pat = parse(pattern)
    if seqlen < 1:
        raise ValueError(f"seqlen must be >= 1, got {seqlen}")
    out = torch.empty(num_heads, seqlen, seqlen, dtype=torch.bool, device=device)
    for h0, h1, spec in pat.head_groups(num_heads):
        out[h0:h1] = spec_mask(spec, seqlen, device)
    return out


def reference_attention(q, k, v, pattern: str | Pattern = "causal", scale: float | None = None, return_lse: bool = False):
    """Attention through the dense mask, computed in float64 (any input dtype), differentiable.

    q ``(B, Hq, N, D)``, k and v ``(B, Hkv, N, D)`` with Hq a multiple of Hkv. Returns the output
    in float64 (and the natural-log LSE ``(B, Hq, N)`` float64 when ``return_lse``). A query that
    sees no key gets a zero row and LSE ``-inf``.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    group = hq // hkv
    q64, k64, v64 = q.double(), k.double(), v.double()
    k64 = k64.repeat_interleave(group, dim=1)
    v64 = v64.repeat_interleave(group, dim=1)
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
