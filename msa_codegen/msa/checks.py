"""Argument checks of the MSA entry points: errors say what was expected and what was given."""
from __future__ import annotations

import torch

from ..api import check_qkv
from ..pattern.spec import MSA_BLOCKS
from ..sparsity.inputs import check_doc_offsets

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCKS = MSA_BLOCKS   # the key-block sizes of MSA's kernels (the pattern term checks the same)


def _tensor(name: str, t, float64_ok=False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dims (B, heads, N, head_dim), got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES and not (float64_ok and t.dtype == torch.float64):
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    return t


def check_proxies(q_proxy, k_proxy, top_k, block, cu_seqlens, n=None, b=None, device=None, float64_ok=False) -> None:
    """Checks of ``msa_select``'s arguments (and the proxy half of ``msa_attention``'s)."""
    _tensor("q_proxy", q_proxy, float64_ok)
    _tensor("k_proxy", k_proxy, float64_ok)
    bq, hp, nq, dp = q_proxy.shape
    bk, hpk, nk, dpk = k_proxy.shape
    if q_proxy.dtype != k_proxy.dtype:
        raise TypeError(f"q_proxy and k_proxy must share one dtype, got {q_proxy.dtype} and {k_proxy.dtype}")
    if q_proxy.device != k_proxy.device or (device is not None and q_proxy.device != device):
        raise ValueError(f"all tensors must be on one device, got q_proxy on {q_proxy.device}, k_proxy on "
                         f"{k_proxy.device}" + (f", q on {device}" if device is not None else ""))
    if bq != bk or (b is not None and bq != b):
        raise ValueError(f"batch mismatch: q_proxy has B={bq}, k_proxy B={bk}" + (f", q B={b}" if b is not None else ""))
    if nq != nk or (n is not None and nq != n):
        raise ValueError(f"sequence length mismatch: q_proxy has N={nq}, k_proxy N={nk}"
                         + (f", q N={n}" if n is not None else ""))
    if dp != dpk:
        raise ValueError(f"proxy head dim mismatch: q_proxy has Dp={dp}, k_proxy Dp={dpk}")
    if not 16 <= dp <= 256:
        raise ValueError(f"proxy head dim must be between 16 and 256, got Dp={dp}")
    if hpk < 1 or hp % hpk:
        raise ValueError(f"proxy query heads must be a multiple of proxy key heads, got Hp={hp}, Hpk={hpk}")
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < block or top_k % block:
        raise ValueError(f"top_k counts tokens and must be a positive multiple of block={block}, got {top_k!r}")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (
                torch.int32, torch.int64):
            raise TypeError("cu_seqlens must be an int32/int64 tensor of shape (num_docs + 1,)")
        if bq != 1:
            raise ValueError(f"cu_seqlens packs documents along N and needs B=1, got B={bq}")
        if cu_seqlens.device != q_proxy.device:
            raise ValueError(f"cu_seqlens must be on {q_proxy.device}, got {cu_seqlens.device}")
        check_doc_offsets(cu_seqlens, nq)


def check_msa_inputs(q, k, v, q_proxy, k_proxy, top_k, block, cu_seqlens, float64_ok=False) -> None:
    """Checks of ``msa_attention``'s tensors: shapes, head counts, dtypes and devices (float64:
    the reference only)."""
    check_qkv(q, k, v, float64_ok=float64_ok)
    b, h, n, _ = q.shape
    check_proxies(q_proxy, k_proxy, top_k, block, cu_seqlens, n=n, b=b, device=q.device, float64_ok=float64_ok)
    hp = q_proxy.shape[1]
    if h % hp:
        raise ValueError(f"query heads must be a multiple of proxy heads, got H={h}, Hp={hp}")
