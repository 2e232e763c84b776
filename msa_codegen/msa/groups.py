"""The pattern term ``msa=T``: ``attention`` on a pattern with an msa head group, and what it runs.

``attention`` checks its arguments and hands such a pattern to ``attention_with_msa`` (installed
in ``api`` when this package is imported, as the autotuner is: this package imports ``api``):
``msa_attention`` runs the msa group's query heads with the K/V heads they read, the pattern
kernels run the heads before and after it as patterns of their own (``pattern.spec.msa_split``),
and the outputs are joined along the heads in order.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import api
from ..pattern.spec import msa_split, parse
from . import launch
from .api import msa_attention


def attention_with_msa(q, k, v, pattern, scale, return_lse, autotune, run_time, q_proxy, k_proxy, proxy_scale,
                       return_kl):
    """``attention`` (its arguments checked) of a pattern with an msa head group: ``msa_attention``
    on that group's heads, the pattern kernels on the runs of other heads before and after it,
    joined along the heads. Returns ``(out, kl)``."""
    if return_lse:
        raise ValueError("return_lse is not available with an msa=T pattern term (attention returns (out, kl)); "
                         "call without return_lse")
    dynamic = [name for name in ("q_pos", "k_pos", "q_bucket", "k_bucket", "block_indices")
               if run_time[name] is not None]
    if dynamic:
        raise ValueError(f"{', '.join(dynamic)}: not available with an msa=T pattern term (MSA takes cu_seqlens "
                         f"only)")
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    (h0, h1, spec), runs = msa_split(pattern, hq)   # ValueError: not one msa group, heads not covered
    missing = [name for name, x in (("q_proxy", q_proxy), ("k_proxy", k_proxy)) if x is None]
    if missing:
        raise ValueError(f"the msa={spec.msa} term of heads {h0}-{h1 - 1} needs q_proxy (B, Hp, N, Dp) and k_proxy "
                         f"(B, Hpk, N, Dp) for those heads; missing: {', '.join(missing)}")
    if h0 % g or h1 % g:
        raise ValueError(f"the msa group (heads {h0}-{h1 - 1}) must cover whole KV groups: with Hq={hq} and "
                         f"Hkv={hkv} each key/value head serves {g} query heads, so its first head and last head "
                         f"+ 1 must be multiples of {g} (got {h0} and {h1})")
    if isinstance(q_proxy, torch.Tensor) and q_proxy.dim() == 4 and (h1 - h0) % q_proxy.shape[1]:
        raise ValueError(f"q_proxy serves the msa group's {h1 - h0} query heads ({h0}-{h1 - 1}): its head count "
                         f"must divide {h1 - h0}, got Hp={q_proxy.shape[1]}")
    cu_seqlens = run_time["cu_seqlens"]
    out_msa, kl = msa_attention(q[:, h0:h1], k[:, h0 // g:h1 // g], v[:, h0 // g:h1 // g], q_proxy, k_proxy,
                                spec.msa, block=spec.block, scale=scale, proxy_scale=proxy_scale,
                                cu_seqlens=cu_seqlens, return_kl=return_kl)
    pieces = []
    for a, z, text in runs:
        out = api.attention(q[:, a:z], k[:, a // g:z // g], v[:, a // g:z // g], text, scale=scale,
                            cu_seqlens=cu_seqlens, autotune=autotune)
        pieces.append((a, out))
    pieces.append((h0, out_msa))
    pieces.sort(key=lambda p: p[0])
    return _join_heads([p[1] for p in pieces], q), kl


def _join_heads(outs: list, q: torch.Tensor) -> torch.Tensor:
    """The head slices' outputs as one ``(B, Hq, N, D)`` tensor, in q's layout when q is a
    ``(B, N, H, D)`` tensor seen as ``.transpose(1, 2)``."""
    if len(outs) == 1:
        return outs[0]
    if q.shape[1] > 1 and q.transpose(1, 2).is_contiguous():
        return torch.cat([o.transpose(1, 2) for o in outs], dim=2).transpose(1, 2)
    return torch.cat(outs, dim=1)


@dataclasses.dataclass(frozen=True)
class MsaResolution:
    """What a pattern with an msa head group runs: MSA's kernels on that group, with the launch
    parameters the tuning database gives its spec (``msa``: a ``Resolution`` of the pattern
    ``msa=T[,block=B]``, keyed by H / Hp heads per proxy head; None when not looked up) unless a
    ``use_msa_config`` override is active, and per run of other heads the ``Resolution`` of its own
    pattern (which the tuning database answers as for any pattern)."""

    pattern: str
    msa_heads: tuple[int, int]         # first, last (inclusive)
    msa_spec: str
    msa_launch: str                    # msa.launch.describe(msa)
    others: tuple                      # ((first, last, pattern of those heads, Resolution), ...)
    msa: object = None                 # tuning.lookup.Resolution of msa_spec, or None
    overridden: bool = False           # a use_msa_config override was active

    @property
    def source(self) -> str:
        if self.overridden:
            return launch.OVERRIDE
        return self.msa.source if self.msa is not None else "msa_codegen.msa.launch defaults"

    def __str__(self) -> str:
        a, z = self.msa_heads
        lines = [f"pattern {self.pattern!r}",
                 f"heads {a}-{z} ({self.msa_spec}): {self.msa_launch}"]
        for first, last, text, res in self.others:
            lines.append(f"heads {first}-{last} ({text}, renumbered from head 0):")
            lines.extend("  " + line for line in str(res).splitlines())
        return "\n".join(lines)


def msa_resolution(pattern, hq: int, hkv: int, resolve, msa_resolve=None, proxy_heads: int | None = None
                   ) -> MsaResolution:
    """The ``MsaResolution`` of a pattern with one msa group on ``hq`` query heads; ``resolve(text)``
    gives the Resolution of the other heads' pattern (``tuning.lookup`` for a device or a GPU);
    ``msa_resolve(spec, g)`` the msa group's, with ``g`` = its query heads per proxy head (``proxy_heads``
    of the group; default one proxy head per key/value head of the group)."""
    (h0, h1, spec), runs = msa_split(pattern, hq)
    res = None
    if msa_resolve is not None:
        hp = proxy_heads if proxy_heads is not None else max(1, (h1 - h0) // max(1, hq // hkv))
        if hp < 1 or (h1 - h0) % hp:
            raise ValueError(f"proxy heads must divide the msa group's {h1 - h0} query heads, got {hp}")
        res = msa_resolve(str(spec), (h1 - h0) // hp)
    return MsaResolution(str(parse(pattern)), (h0, h1 - 1), str(spec), launch.describe(res),
                         tuple((a, z - 1, text, resolve(text)) for a, z, text in runs), res,
                         launch._override is not None)


api.install_msa_route(attention_with_msa, msa_resolution)
