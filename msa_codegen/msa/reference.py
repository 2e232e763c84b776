"""The float64 PyTorch reference of MSA (MiniMax Sparse Attention): the tests' oracle.

Read it next to the contract in the README ("MSA"); every step is one of its numbered steps.
It builds N x N score matrices, so it is for small N only.
"""
from __future__ import annotations

import torch

from .checks import check_msa_inputs


def _doc_ids(n: int, cu_seqlens, device) -> torch.Tensor:
    """Document id of every position, ``(N,)`` (all zeros without ``cu_seqlens``)."""
    if cu_seqlens is None:
        return torch.zeros(n, dtype=torch.long, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    return torch.searchsorted(cu[1:], torch.arange(n, device=device), right=True)


def _visible(n: int, cu_seqlens, device) -> torch.Tensor:
    """``(N, N)`` bool: key j is causal for query i and in its document."""
    pos = torch.arange(n, device=device)
    doc = _doc_ids(n, cu_seqlens, device)
    return (pos[None, :] <= pos[:, None]) & (doc[None, :] == doc[:, None])


def _proxy_scores(q_proxy, k_proxy, proxy_scale, visible):
    """Step 1: ``(B, Hp, N, N)`` float64 proxy scores, -inf where key j is not visible."""
    hp, hpk = q_proxy.shape[1], k_proxy.shape[1]
    kp = k_proxy.double().repeat_interleave(hp // hpk, dim=1)
    s = proxy_scale * (q_proxy.double() @ kp.transpose(-1, -2))
    return s.masked_fill(~visible, float("-inf"))


def reference_select(q_proxy, k_proxy, top_k: int, block: int = 128, proxy_scale=None, cu_seqlens=None):
    """Step 2 in float64: ``(B, Hp, N, K)`` int32 selected key blocks per query, ascending, -1 unused.

    A block's score for query i is the max of its visible proxy scores; the query's own block
    is always kept; then the K best, ties to the lower block index.
    """
    b, hp, n, dp = q_proxy.shape
    nk = top_k // block
    proxy_scale = dp ** -0.5 if proxy_scale is None else proxy_scale
    s = _proxy_scores(q_proxy, k_proxy, proxy_scale, _visible(n, cu_seqlens, q_proxy.device))
    nblk = -(-n // block)
    pad = nblk * block - n
    s = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
    score = s.view(b, hp, n, nblk, block).amax(dim=-1)                # (B, Hp, N, NB)
    own = torch.arange(n, device=s.device) // block
    score[..., torch.arange(n, device=s.device), own] = float("inf")
    # stable descending sort: equal scores keep ascending block order, so ties go to the lower index
    order = torch.sort(score, dim=-1, descending=True, stable=True)
    take = min(nk, nblk)
    idx = order.indices[..., :take]
    ok = order.values[..., :take] > float("-inf")
    idx = torch.where(ok, idx, torch.full_like(idx, nblk))           # unused slots sort last
    idx = torch.sort(idx, dim=-1).values
    idx = torch.where(idx == nblk, torch.full_like(idx, -1), idx)
    if take < nk:
        idx = torch.nn.functional.pad(idx, (0, nk - take), value=-1)
    return idx.to(torch.int32)


def _seen(idx, n: int, block: int, visible) -> torch.Tensor:
    """``(B, Hp, N, N)`` bool: query i of proxy head p sees key j (step 3's mask, per proxy head)."""
    b, hp = idx.shape[:2]
    nblk = -(-n // block)
    chosen = torch.zeros(b, hp, n, nblk + 1, dtype=torch.bool, device=idx.device)
    chosen.scatter_(-1, torch.where(idx < 0, nblk, idx).long(), True)
    kblock = torch.arange(n, device=idx.device) // block
    return chosen[..., kblock] & visible


def reference_msa(q, k, v, q_proxy, k_proxy, top_k: int, *, block: int = 128, scale=None, proxy_scale=None,
                  warmup: bool = False, cu_seqlens=None):
    """MSA in float64, steps 1-6 of the contract: returns ``(out, kl)``.

    ``out`` ``(B, H, N, D)`` float64 is differentiable in q, k, v; ``kl`` (0-dim float64) in
    q_proxy and k_proxy only (the teacher is detached). Inputs of any float dtype.
    """
    check_msa_inputs(q, k, v, q_proxy, k_proxy, top_k, block, cu_seqlens, float64_ok=True)
    b, h, n, d = q.shape
    hkv, hp, dp = k.shape[1], q_proxy.shape[1], q_proxy.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    proxy_scale = dp ** -0.5 if proxy_scale is None else proxy_scale
    visible = _visible(n, cu_seqlens, q.device)
    if warmup:
        seen = visible.expand(b, hp, n, n)
    else:
        seen = _seen(reference_select(q_proxy, k_proxy, top_k, block, proxy_scale, cu_seqlens), n, block, visible)
    seen_h = seen.repeat_interleave(h // hp, dim=1)                    # (B, H, N, N)
    kk = k.double().repeat_interleave(h // hkv, dim=1)
    vv = v.double().repeat_interleave(h // hkv, dim=1)
    logits = (scale * (q.double() @ kk.transpose(-1, -2))).masked_fill(~seen_h, float("-inf"))
    probs = torch.softmax(logits, dim=-1)                              # step 3
    out = probs @ vv
    teacher = probs.detach().view(b, hp, h // hp, n, n).mean(dim=2)    # step 4
    s = _proxy_scores(q_proxy, k_proxy, proxy_scale, seen)
    log_student = torch.log_softmax(s, dim=-1)
    terms = torch.xlogy(teacher, teacher) - teacher * log_student.masked_fill(~seen, 0.0)
    kl = terms.sum(dim=-1).mean()
    return out, kl
