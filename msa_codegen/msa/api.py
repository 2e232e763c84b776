"""``msa_attention`` and ``msa_select``: MiniMax Sparse Attention with a learned proxy selection.

Layering: ``msa_attention`` checks its arguments -> ``_MsaFunction`` / ``_WarmupTeaching``
(autograd) -> ``launch`` (grids, buffers) -> ``kernels`` (Triton). ``reference.reference_msa``
is the float64 oracle of the same contract.
"""
from __future__ import annotations

import torch

from ..api import attention, check_device, check_flags   # warm-up runs the dense causal kernels of the static patterns
from . import launch
from .checks import check_msa_inputs, check_proxies


def msa_select(q_proxy, k_proxy, top_k: int = 2048, block: int = 128, *, proxy_scale: float | None = None,
               cu_seqlens=None) -> torch.Tensor:
    """The key blocks each query's proxy head selects (contract steps 1-2), fused in one Triton kernel.

    Args:
        q_proxy: ``(B, Hp, N, Dp)`` float16 / bfloat16 / float32.
        k_proxy: ``(B, Hpk, N, Dp)``, same dtype and device, Hp a multiple of Hpk.
        top_k: tokens to select per query, a multiple of ``block``; K = top_k // block blocks.
        block: key block size, 64 or 128.
        proxy_scale: default ``Dp ** -0.5``.
        cu_seqlens: int32 ``(docs + 1,)`` packed document offsets (B = 1).

    Returns:
        ``(B, Hp, N, K)`` int32 block ids, ascending per query, -1 in unused slots (a query
        with fewer than K visible blocks). Memory O(N K); nothing N x N is formed. Example::

            idx = msa_codegen.msa_select(q_proxy, k_proxy, top_k=2048)
    """
    check_proxies(q_proxy, k_proxy, top_k, block, cu_seqlens)
    check_device(q_proxy, "q_proxy and k_proxy")
    dp = q_proxy.shape[-1]
    proxy_scale = float(dp ** -0.5 if proxy_scale is None else proxy_scale)
    dstart = launch.doc_starts(cu_seqlens, q_proxy.shape[2], q_proxy.device)
    with torch.no_grad():
        return launch.select(q_proxy, k_proxy, top_k, block, proxy_scale, dstart)


class _MsaFunction(torch.autograd.Function):
    """Selection, main attention and (optionally) the exact KL; backward: main grads + teaching grads."""

    @staticmethod
    def forward(ctx, q, k, v, q_proxy, k_proxy, top_k, block, scale, proxy_scale, dstart, return_kl, cfg):
        heads = launch.Heads(q.shape[1], k.shape[1], q_proxy.shape[1], k_proxy.shape[1])
        with launch.running(cfg):
            idx = launch.select(q_proxy, k_proxy, top_k, block, proxy_scale, dstart)
            rev, items = launch.reverse_index(idx, launch.cdiv(q.shape[2], block))
            n_sel = idx.shape[-1]
            out, lse, lse_proxy, kl = launch.forward(
                q, k, v, q_proxy, k_proxy, items, rev, n_sel, heads, block, scale, proxy_scale, dstart,
                dense=False, with_out=True, with_kl=return_kl)
        if kl is None:
            kl = torch.zeros((), device=q.device, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, q_proxy, k_proxy, out, lse, lse_proxy, items, rev, dstart)
        ctx.meta = (n_sel, heads, block, scale, proxy_scale, cfg)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(idx)
        return out, kl, idx

    @staticmethod
    def backward(ctx, do, dkl, _didx):
        q, k, v, q_proxy, k_proxy, out, lse, lse_proxy, items, rev, dstart = ctx.saved_tensors
        n_sel, heads, block, scale, proxy_scale, cfg = ctx.meta
        with launch.running(cfg):
            grads = launch.backward(do, q, k, v, q_proxy, k_proxy, out, lse, lse_proxy, dkl, items, rev, n_sel,
                                    heads, block, scale, proxy_scale, dstart, dense=False)
        return (*grads, None, None, None, None, None, None, None)


class _WarmupTeaching(torch.autograd.Function):
    """Warm-up's teaching signal over all causal keys: the KL (exact or zero) and its proxy gradients."""

    @staticmethod
    def forward(ctx, q_proxy, k_proxy, q, k, v, lse, block, scale, proxy_scale, cu_seqlens, dstart, return_kl):
        heads = launch.Heads(q.shape[1], k.shape[1], q_proxy.shape[1], k_proxy.shape[1])
        _, lse_proxy = attention(q_proxy, k_proxy, k_proxy, "causal", scale=proxy_scale, return_lse=True,
                                 cu_seqlens=cu_seqlens)
        items = launch.dense_items(q.shape[0], heads.hp, q.shape[2], block, cu_seqlens, q.device)
        if return_kl:
            _, _, _, kl = launch.forward(q, k, v, q_proxy, k_proxy, items, None, 1, heads, block, scale, proxy_scale,
                                         dstart, dense=True, with_out=False, with_kl=True, lse=lse,
                                         lse_proxy=lse_proxy)
        else:
            kl = torch.zeros((), device=q.device, dtype=torch.float32)
        ctx.save_for_backward(q_proxy, k_proxy, q, k, v, lse, lse_proxy, items, dstart)
        ctx.meta = (heads, block, scale, proxy_scale)
        return kl

    @staticmethod
    def backward(ctx, dkl):
        q_proxy, k_proxy, q, k, v, lse, lse_proxy, items, dstart = ctx.saved_tensors
        heads, block, scale, proxy_scale = ctx.meta
        grads = launch.backward(None, q, k, v, q_proxy, k_proxy, None, lse, lse_proxy, dkl, items, None, 1, heads,
                                block, scale, proxy_scale, dstart, dense=True)
        return (grads[3], grads[4]) + (None,) * 10


def msa_attention(q, k, v, q_proxy, k_proxy, top_k: int = 2048, *, block: int = 128, scale: float | None = None,
                  proxy_scale: float | None = None, warmup: bool = False, cu_seqlens=None, return_kl: bool = False,
                  return_indices: bool = False):
    """MiniMax Sparse Attention: proxy heads choose top-k key blocks per query; a KL teaches them.

    Args:
        q: ``(B, H, N, D)``; k, v: ``(B, Hkv, N, D)``; H a multiple of Hkv. float16 / bfloat16 on
            the GPU (float32 accepted).
        q_proxy: ``(B, Hp, N, Dp)``; k_proxy: ``(B, Hpk, N, Dp)``; H a multiple of Hp, Hp of Hpk.
            Main head h reads proxy head ``h // (H / Hp)``; Dp may differ from D.
        top_k: tokens each query attends to, a multiple of ``block`` (K = top_k // block blocks,
            its own block included).
        block: 64 or 128. scale: default ``D ** -0.5``. proxy_scale: default ``Dp ** -0.5``.
        warmup: dense causal main attention, and the proxies taught over all causal keys (MSA's
            kernels with their default launch parameters there, or a use_msa_config override).
        cu_seqlens: int32 ``(docs + 1,)`` offsets of packed documents (B = 1); nothing crosses a
            document boundary.
        return_kl: compute the KL's exact value (one more pass over the selected keys: the proxy
            scores and main probabilities again, without P @ V). Without it the returned ``kl``
            is a zero that still carries the teaching gradient.
        return_indices: also return the selection, ``(B, Hp, N, K)`` int32 (as ``msa_select``).

    Launch parameters (``msa.launch.MsaConfig``): a ``use_msa_config`` override, else the tuning
    database's row of pattern ``msa=top_k,block=B`` for this device, dtype, head dim D, H / Hp heads
    per proxy head and N's bucket (``msa-tune``; same precedence as ``attention``), else the
    defaults; resolved once per key, until ``tuning.reload()``.

    Returns:
        ``(out, kl)``: out ``(B, H, N, D)`` in q's dtype; kl a 0-dim float32 tensor. Add kl to the
        loss: its gradient reaches q_proxy and k_proxy only; q, k, v get out's gradients only.
        Example::

            out, kl = msa_codegen.msa_attention(q, k, v, q_proxy, k_proxy, top_k=2048)
            (task_loss(out) + kl).backward()
    """
    check_msa_inputs(q, k, v, q_proxy, k_proxy, top_k, block, cu_seqlens)
    check_flags(warmup=warmup, return_kl=return_kl, return_indices=return_indices)
    check_device(q, "q, k, v and the proxies")
    d, dp = q.shape[-1], q_proxy.shape[-1]
    scale = float(d ** -0.5 if scale is None else scale)
    proxy_scale = float(dp ** -0.5 if proxy_scale is None else proxy_scale)
    dstart = launch.doc_starts(cu_seqlens, q.shape[2], q.device)
    if warmup:
        if return_indices:
            raise ValueError("warmup=True selects nothing: return_indices needs warmup=False")
        out, lse = attention(q, k, v, "causal", scale=scale, return_lse=True, cu_seqlens=cu_seqlens)
        kl = _WarmupTeaching.apply(q_proxy, k_proxy, q.detach(), k.detach(), v.detach(), lse.detach(), block,
                                   scale, proxy_scale, cu_seqlens, dstart, return_kl)
        return out, kl
    # the launch parameters: the tuning database's row for this call key (once per key), else the defaults;
    # a use_msa_config override wins (launch._pick)
    cfg, _ = launch.call_config(q.device, top_k, block, d, q.dtype, q.shape[1] // q_proxy.shape[1], q.shape[2])
    out, kl, idx = _MsaFunction.apply(q, k, v, q_proxy, k_proxy, top_k, block, scale, proxy_scale, dstart, return_kl,
                                      cfg)
    return (out, kl, idx) if return_indices else (out, kl)
