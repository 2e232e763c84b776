"""Plain PyTorch definitions of the selection helpers, for tests and benchmark checks.

``select_blocks_reference`` is what ``selection.select_blocks`` computes, written for reading:
the pooled vectors in ``dtype`` (float64 by default), the full (N / block)^2 score matrix per
head, a stable sort. It holds O(B * Hkv * (N / block)^2) scores: not for long sequences.
"""
from __future__ import annotations

import torch


def block_means_reference(x: torch.Tensor, block: int, dtype=torch.float64) -> torch.Tensor:
    """(B, H, N, D) -> (B, H, ceil(N / block), D): the mean of each block's rows (the last may be short)."""
    n = x.shape[2]
    return torch.stack([x[:, :, i:i + block].to(dtype).mean(2) for i in range(0, n, block)], dim=2)


def block_scores_reference(q, k, block: int, dtype=torch.float64) -> torch.Tensor:
    """(B, Hkv, nb, nb): pooled query block (mean over the GQA group too) . pooled key block."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    qm = block_means_reference(q, block, dtype)
    qm = qm.view(b, hkv, hq // hkv, qm.shape[2], d).mean(2)
    return qm @ block_means_reference(k, block, dtype).transpose(-1, -2)


@torch.no_grad()
def select_blocks_reference(q, k, topk: int, block: int = 128, *, causal: bool = True,
                            dtype=torch.float64) -> torch.Tensor:
    """int32 (B, Hkv, nb, K): own block first, then the other candidates by score, best first,
    equal scores in ascending block order; -1 past the candidates."""
    score = block_scores_reference(q, k, block, dtype)
    nb = score.shape[-1]
    rows = torch.arange(nb, device=score.device)
    if causal:
        score = score.masked_fill(rows[None, :] > rows[:, None], float("-inf"))
    score[..., rows, rows] = float("inf")
    # stable: among equal scores the lower block first
    val, idx = torch.sort(score, dim=-1, descending=True, stable=True)
    idx = torch.where(val == float("-inf"), -1, idx).to(torch.int32)
    out = torch.full((*score.shape[:-1], topk), -1, dtype=torch.int32, device=score.device)
    kk = min(topk, nb)
    out[..., :kk] = idx[..., :kk]
    return out
