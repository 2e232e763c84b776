"""Launchers of the MSA kernels: grids, work lists, buffers and strides.

``select`` runs the fused selection. ``reverse_index`` turns selections into per key block
lists of queries and cuts them into work items; ``dense_items`` does the same for warm-up, where
every query after a block's start reads it. ``forward`` / ``backward`` run the main attention and
the teaching signal on those items.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import torch

from ..config import length_bucket
from ..kernels.render import load_kernels
from ..kernels.schedule import block_d, cdiv, dot_precision, pow2
from ..pattern.spec import parse
from ..tuning import lookup as tuning_lookup

#: entries (query, proxy head) per work item: long lists (a block every query picks) are cut so
#: that no program walks much more than its share
ITEM_ENTRIES = 256
#: rows of a main-attention tile (entries x the proxy group's heads), forward and backward. H200,
#: N=131072, G=4 (2026-12-02 sweep): forward 128 rows 29.7 ms, 64 rows 38.3 ms; backward 64 rows with
#: 64-key programs 71.3 ms, with 32-key programs 107.3 ms, 128 rows 90.1 ms (8 warps each)
FWD_ROWS = 128
BWD_ROWS = 64
#: rows of a teaching-backward tile that runs alone (the KL's gradient without the main ones:
#: warm-up, or a call whose ``out`` has no gradient): up to a KV head's whole share of a proxy
#: group, where ``bwd_rows`` would cut it into chunks that each repeat the proxy's products and
#: its dQ atomics (H=32, Hkv=2, Hp=2 at N=32768, H100, 2026-12-06: 15.59 ms in four 64-row chunks
#: against 8.52 in one 256-row tile)
TEACH_ROWS = 256



@dataclass(frozen=True)
class MsaConfig:
    """Launch parameters of the MSA kernels; None: the heuristic default (see each launcher).

    ``select_block_m``: query rows per selection program; ``*_rows``: (entry, head) rows per
    main-attention tile; ``bwd_block_n``: keys per backward program; ``*_warps`` / ``*_stages``:
    Triton's num_warps / num_stages (the main attention's default stages: ``stages``).
    """
    select_block_m: int | None = None
    select_warps: int | None = None
    select_stages: int | None = None
    fwd_rows: int | None = None
    fwd_warps: int | None = None
    bwd_rows: int | None = None
    bwd_block_n: int | None = None
    bwd_warps: int | None = None
    fwd_stages: int | None = None
    bwd_stages: int | None = None


#: the use_msa_config override (None: none); it replaces the tuned config of a call entirely
_override: MsaConfig | None = None
#: the config of the msa_attention call whose kernels run now (``running``): a tuning database row
_active = MsaConfig()
#: the resolved config per call key (``call_config``), emptied by ``tuning.reload()``
_resolved: dict = {}
OVERRIDE = "use_msa_config override"
DEFAULTS = ("the MsaConfig defaults, swept on the H200: selection 128 query rows (fewer when K > 32), 8 warps, "
            "2 stages; forward tiles of 128 (entry, head) rows, 8 warps; backward tiles of 64 rows with 64-key "
            "programs (32 above head dim 128), 8 warps, the teaching gradient alone up to 256 rows (a launch "
            "of its own beside the main backward where that one cuts a share into more chunks); main "
            "attention 3 stages (1 above head dim 128 or above 128 rows)")


def _fields(cfg: MsaConfig) -> str:
    return " ".join(f"{k}={v}" for k, v in vars(cfg).items() if v is not None)


def describe(resolution=None) -> str:
    """What MSA's kernels run with, in words (``msa-codegen which`` and ``explain`` print it);
    ``resolution``: the tuning lookup's answer for the msa group (``call_config``)."""
    if _override is not None:
        cfg = f"a use_msa_config override ({_fields(_override) or 'every field the default'})"
        return f"MSA's kernels (msa_codegen/msa/kernels.py) run with {cfg}"
    if resolution is None:
        return f"MSA's kernels (msa_codegen/msa/kernels.py) run with {DEFAULTS}"
    lines = [f"MSA's kernels (msa_codegen/msa/kernels.py), tuning lookup (fields not set: {DEFAULTS}):"]
    lines.extend("  " + line for line in str(resolution).splitlines())
    return "\n".join(lines)


@contextlib.contextmanager
def use_msa_config(cfg: MsaConfig):
    """Run the MSA kernels with ``cfg``'s launch parameters inside the block (sweeps, tests). It
    replaces a tuning database row entirely: fields left None take the heuristic default."""
    global _override
    if not isinstance(cfg, MsaConfig):
        raise TypeError(f"use_msa_config needs an MsaConfig, got {type(cfg).__name__}")
    before, _override = _override, cfg
    try:
        yield cfg
    finally:
        _override = before


@contextlib.contextmanager
def running(cfg: MsaConfig):
    """Launch the kernels inside the block with ``cfg`` (a call's tuned config; an override wins)."""
    global _active
    before, _active = _active, cfg
    try:
        yield cfg
    finally:
        _active = before


def spec_text(top_k: int, block: int) -> str:
    """The canonical msa pattern of a call: what its tuning rows are keyed by (``msa=2048``)."""
    return str(parse(f"msa={top_k},block={block}"))


def call_config(device, top_k: int, block: int, d: int, dtype, g: int, n: int):
    """``(MsaConfig, Resolution)`` of a call: the tuning database's row for (device, dtype, head dim
    D, G = H / Hp heads per proxy head, N's bucket, top_k, block), else the defaults. Resolved once
    per key (``tuning.lookup``, the core's one question to the database); ``tuning.reload()`` forgets."""
    key = (str(device), str(dtype), int(d), int(g), length_bucket(n), int(top_k), int(block))
    hit = _resolved.get(key)
    if hit is None:
        res = tuning_lookup.lookup(device, spec_text(top_k, block), d, dtype, g, n)
        hit = _resolved[key] = (MsaConfig(**res.fwd.config, **res.bwd.config), res)
    return hit


tuning_lookup.on_reload(_resolved.clear)


def _pick(name: str, default: int) -> int:
    value = getattr(_override if _override is not None else _active, name)
    return default if value is None else value


def default_config(block: int, n_sel: int, d: int, dp: int, g: int | None = None) -> MsaConfig:
    """The heuristic default of every field: what the launchers pick when nothing is set (and the
    tuner's baseline). The stage counts depend on the tile's rows, so on the heads of a tile's
    entry (``Heads.tile_heads``: G = H / Hp unless a proxy group spans several KV heads): given
    ``g``, they are filled in (``stages``); without it they stay None, and the launchers derive
    them from the rows they pick.

    H200, N=131072, G=4, K=16 (2026-12-02 sweep): selection 128 rows, 8 warps, 2 stages 20.1 ms,
    against 27.3 ms with 64 rows, 4 warps, 3 stages; the running top-K lives in registers, so fewer
    rows per tile as K grows. Forward tiles (FWD_ROWS), backward tiles and 64-key programs
    (BWD_ROWS); above head dim 128, 32 keys keep dK, dV and the proxy's dK within registers and
    shared memory.
    """
    block_k = max(2, pow2(n_sel))
    cfg = MsaConfig(select_block_m=min(block, 128 if block_k <= 32 else 64 if block_k <= 64 else
                                       32 if block_k <= 128 else 16),
                    select_warps=8, select_stages=2, fwd_rows=FWD_ROWS, fwd_warps=8, bwd_rows=BWD_ROWS,
                    bwd_block_n=min(block, 64 if max(d, dp) <= 128 else 32), bwd_warps=8)
    if g is None:
        return cfg
    return dataclasses.replace(cfg, fwd_stages=tile_stages(g, cfg.fwd_rows, d, dp),
                               bwd_stages=tile_stages(g, cfg.bwd_rows, d, dp))


def kernels():
    """The kernel module, imported on first use (TRITON_INTERPRET is read when kernels are defined)."""
    return load_kernels(".kernels", __package__)


def _last_stride_one(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def doc_starts(cu_seqlens, n: int, device) -> torch.Tensor | None:
    """``(N,)`` int32: the first position of each position's document (None without documents)."""
    if cu_seqlens is None:
        return None
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    doc = torch.searchsorted(cu[1:], torch.arange(n, device=device), right=True)
    return cu[doc].to(torch.int32)


@dataclass(frozen=True)
class Heads:
    """Head layout: H main, Hkv key/value, Hp proxy, Hpk proxy key heads; G = H / Hp heads per proxy."""
    h: int
    hkv: int
    hp: int
    hpk: int

    @property
    def g(self) -> int:
        return self.h // self.hp

    @property
    def g_kv(self) -> int:
        return self.h // self.hkv

    @functools.cached_property
    def span(self) -> int:
        """How many KV heads one proxy group's main heads read (1 when proxy groups nest in KV groups)."""
        return max((p * self.g + self.g - 1) // self.g_kv - (p * self.g) // self.g_kv + 1 for p in range(self.hp))

    @functools.cached_property
    def tile_heads(self) -> int:
        """The most heads of one proxy group that read one KV head: the heads of a tile's entry
        (G when proxy groups nest in KV groups; fewer when a group spans several KV heads, whose
        programs each take one KV head's share)."""
        g, gk = self.g, self.g_kv
        return max(min(p * g + g, (kv + 1) * gk) - max(p * g, kv * gk)
                   for p in range(self.hp) for kv in range(p * g // gk, (p * g + g - 1) // gk + 1))


def select(q_proxy, k_proxy, top_k: int, block: int, proxy_scale: float, dstart) -> torch.Tensor:
    """``(B, Hp, N, K)`` int32 selected key blocks per query, ascending, -1 unused (contract step 2)."""
    b, hp, n, dp = q_proxy.shape
    hpk = k_proxy.shape[1]
    nk = top_k // block
    qp, kp = _last_stride_one(q_proxy), _last_stride_one(k_proxy)
    idx = torch.empty(b, hp, n, nk, dtype=torch.int32, device=q_proxy.device)
    meta = select_meta(hp, hpk, dp, block, nk, dstart is not None, q_proxy.dtype)
    kernels().msa_select_kernel[(cdiv(n, meta["BLOCK_M"]), b * hp)](
        qp, kp, dstart if dstart is not None else idx, idx,
        qp.stride(0), qp.stride(1), qp.stride(2), kp.stride(0), kp.stride(1), kp.stride(2),
        n, float(proxy_scale), **meta)
    return idx


def select_meta(hp: int, hpk: int, dp: int, block: int, n_sel: int, has_docs: bool, dtype) -> dict:
    """The selection kernel's constexprs and launch options."""
    default = default_config(block, n_sel, dp, dp)
    block_m = _pick("select_block_m", default.select_block_m)
    if block % block_m:
        raise ValueError(f"select_block_m={block_m} must divide block={block}")
    return dict(HP=hp, HP_PER_K=hp // hpk, DP=dp, BLOCK_DP=block_d(dp), BLOCK=block, BLOCK_M=block_m, K=n_sel,
                BLOCK_K=max(2, pow2(n_sel)), HAS_DOCS=has_docs, DOT_PREC=dot_precision(dtype),
                num_warps=_pick("select_warps", default.select_warps),
                num_stages=_pick("select_stages", default.select_stages))


def _items(counts: torch.Tensor, base: torch.Tensor, bound: int) -> torch.Tensor:
    """Work items over lists (``counts`` entries from ``base``): ``(3, T)`` int32 rows (list, start,
    length), at most ``ITEM_ENTRIES`` entries each. T is ``bound``, an upper limit known without
    reading the counts back (no host sync); the spare items have length 0."""
    n_lists = counts.numel()
    per = (counts + ITEM_ENTRIES - 1) // ITEM_ENTRIES
    ends = torch.cumsum(per, 0)
    t = torch.arange(bound, device=counts.device)
    lst = torch.searchsorted(ends, t, right=True).clamp_(max=n_lists - 1)
    first = ends[lst] - per[lst]
    start = base[lst] + (t - first) * ITEM_ENTRIES
    length = (base[lst] + counts[lst] - start).clamp_(0, ITEM_ENTRIES)
    length = torch.where(t < ends[-1], length, torch.zeros_like(length))
    return torch.stack([lst, start, length]).to(torch.int32).contiguous()


def reverse_index(idx: torch.Tensor, n_blocks: int, key_dtype=torch.int32) -> tuple[torch.Tensor, torch.Tensor]:
    """For each (batch x proxy head, key block): the selection entries that chose it.

    Returns ``rev`` (flat positions ``((b * Hp + p) * N + i) * K + slot`` into ``idx``, grouped by
    list, queries ascending within a list) and the work items over it. O(N K) memory.
    ``key_dtype``: the sort keys' type. int64 gives the same outputs; CUDA's stable sort is a radix
    sort over every bit of the key, so int32 halves its passes: 1.066 against 1.831 ms at N=131072
    (H100, 2026-12-06, ``benchmarks/msa_ab.py --reverse-index``).
    """
    b, hp, n, nk = idx.shape
    total = idx.numel()
    if total >= 2 ** 31:
        raise ValueError(f"B * Hp * N * K = {total} selection entries: at most 2**31 - 1 are supported")
    flat = idx.reshape(-1).to(key_dtype)
    pos = torch.arange(total, device=idx.device, dtype=key_dtype)
    n_lists = b * hp * n_blocks
    list_of = torch.where(flat >= 0, (pos // (n * nk)) * n_blocks + flat, torch.full_like(flat, n_lists))
    _, order = torch.sort(list_of, stable=True)
    counts = torch.bincount(list_of, minlength=n_lists + 1)[:n_lists]
    base = torch.cumsum(counts, 0) - counts
    bound = cdiv(total, ITEM_ENTRIES) + n_lists
    return order.to(torch.int32), _items(counts, base, bound)


def dense_items(b: int, hp: int, n: int, block: int, cu_seqlens, device) -> torch.Tensor:
    """Warm-up's work items: key block kb is read by queries kb * block .. end of its last key's document."""
    n_blocks = cdiv(n, block)
    lo = torch.arange(n_blocks, device=device) * block
    if cu_seqlens is None:
        hi = torch.full_like(lo, n)
    else:
        cu = cu_seqlens.long()
        last = (lo + block).clamp(max=n) - 1
        hi = cu[torch.searchsorted(cu[1:], last, right=True) + 1]
    counts = (hi - lo).repeat(b * hp)
    base = lo.repeat(b * hp)
    bound = b * hp * (cdiv(n * n_blocks, ITEM_ENTRIES) + n_blocks)
    return _items(counts, base, bound)


def _strides(t: torch.Tensor):
    return t.stride(0), t.stride(1), t.stride(2)


def stages(d: int, dp: int, rows: int) -> int:
    """The main attention's default software pipelining depth of the gathered loads, within the
    227 KiB of shared memory: above head dim 128, three stages overflow it (Triton 3.6 on the H200
    asked for 262 KiB); so do tiles of 256 rows (``fwd_rows=256``) at two or three stages (1.2 MB
    asked, sm_90 compile of Triton 3.6), and fit at one (112 KiB). The most a config may set."""
    return 1 if max(d, dp) > 128 or rows > 128 else 3


def tile_stages(g: int, rows: int, d: int, dp: int) -> int:
    """``stages`` of the tile that a ``*_rows`` setting gives at ``g`` heads per entry
    (``Heads.tile_heads``)."""
    entries, gp = tile_entries(g, rows)
    return stages(d, dp, entries * gp)


def head_chunk(g: int, rows: int) -> int:
    """Heads per tile entry for ``rows``-row tiles when a KV head's share of a proxy group has
    ``g`` heads: a tile holds at least 16 entries (the teaching gradient's products run over the
    entries), so a larger share is cut into chunks of rows / 16 heads, each its own program."""
    return max(1, min(g, rows // 16))


def tile_entries(g: int, rows: int) -> tuple[int, int]:
    """Entries per tile and the heads per entry (``head_chunk``) padded to a power of two."""
    gp = pow2(head_chunk(g, rows))
    return max(16, rows // gp), gp


def _chunks(heads: Heads, rows: int) -> dict:
    """The kernels' head-chunk constexprs: KV heads a proxy group spans, heads a chunk, chunks a
    KV head's share."""
    ch = head_chunk(heads.tile_heads, rows)
    return dict(SPAN=heads.span, CH=ch, CPS=cdiv(heads.tile_heads, ch))


def forward(q, k, v, q_proxy, k_proxy, items, rev, n_sel: int, heads: Heads, block: int, scale: float,
            proxy_scale: float, dstart, *, dense: bool, with_out: bool, with_kl: bool, lse=None, lse_proxy=None):
    """The main attention forward over work items.

    Without ``lse``: pass 1 (partial LSEs) then the merge, then pass 2. Returns ``(out, lse,
    lse_proxy, kl)``: out ``(B, H, N, D)`` in q's dtype (None unless ``with_out``), the natural-log
    LSEs ``(B, H, N)`` / ``(B, Hp, N)`` float32, and the exact KL (None unless ``with_kl``).
    """
    b, h, n, d = q.shape
    dp = q_proxy.shape[-1]
    dev = q.device
    n_items = items.shape[1]
    consts = fwd_meta(heads, d, dp, block, n_sel, dstart is not None, dense, q.dtype)
    sub = block // consts["BLOCK_N"]
    log2e = 1.4426950408889634
    rev_arg = rev if rev is not None else items
    ds_arg = dstart if dstart is not None else items
    args = lambda lse_, lsep_, lp, lpp, o32, klr: (  # noqa: E731
        q, k, v, q_proxy, k_proxy, ds_arg, items, rev_arg, lse_, lsep_, lp, lpp, o32, klr,
        *_strides(q), *_strides(k), *_strides(v), *_strides(q_proxy), *_strides(k_proxy),
        n, cdiv(n, block), n_items, scale * log2e, proxy_scale * log2e)
    fwd = kernels().msa_fwd_kernel
    if lse is None:
        lse_part = torch.full((b, heads.hp, n, n_sel * sub, heads.g), float("-inf"), device=dev)
        lsep_part = torch.full((b, heads.hp, n, n_sel * sub), float("-inf"), device=dev)
        fwd[grid(n_items, consts)](*args(lse_part, lsep_part, lse_part, lsep_part, lse_part, lse_part),
                                   PASS=1, WITH_OUT=False, WITH_KL=False, **consts)
        lse = torch.logsumexp(lse_part, dim=3).permute(0, 1, 3, 2).reshape(b, h, n).contiguous()
        lse_proxy = torch.logsumexp(lsep_part, dim=3).contiguous()
        del lse_part, lsep_part
    o32 = torch.zeros(b, h, n, d, device=dev, dtype=torch.float32) if with_out else lse
    kl_rows = torch.zeros(b, heads.hp, n, device=dev, dtype=torch.float32) if with_kl else lse
    if with_out or with_kl:
        meta2 = pass2_meta(consts, with_out, with_kl)
        fwd[grid(n_items, meta2)](*args(lse, lse_proxy, lse, lse, o32, kl_rows), **meta2)
    out = o32.to(q.dtype) if with_out else None
    kl = kl_rows.sum() / (b * heads.hp * n) if with_kl else None
    return out, lse, lse_proxy, kl


def fwd_meta(heads: Heads, d: int, dp: int, block: int, n_sel: int, has_docs: bool, dense: bool, dtype) -> dict:
    """The forward kernel's constexprs (but PASS / WITH_OUT / WITH_KL) and launch options."""
    default = default_config(block, n_sel, d, dp)
    rows = _pick("fwd_rows", default.fwd_rows)
    bq, gp = tile_entries(heads.tile_heads, rows)
    # the whole key block per program up to head dims of 128; above, K, V and the proxy's K of a
    # 128-key block overflow shared memory: sub-blocks of 32 keys, each its own program
    block_n = block if max(d, dp) <= 128 else 32
    return dict(H=heads.h, HP=heads.hp, HP_PER_K=heads.hp // heads.hpk, G=heads.g, GP=gp, G_KV=heads.g_kv,
                **_chunks(heads, rows), WHOLE_GROUP=False, KSEL=n_sel, D=d, BLOCK_D=block_d(d), DP=dp,
                BLOCK_DP=block_d(dp), BLOCK=block, BLOCK_N=block_n, BLOCK_Q=bq, HAS_DOCS=has_docs, DENSE=dense,
                DOT_PREC=dot_precision(dtype), num_warps=_pick("fwd_warps", default.fwd_warps),
                num_stages=_pick("fwd_stages", stages(d, dp, bq * gp)))


def pass2_meta(meta: dict, with_out: bool, with_kl: bool) -> dict:
    """The forward's second pass: P @ V and / or the KL terms. With both, 128-row tiles outgrow
    shared memory (Triton 3.6, sm_90: 238592 B at three stages, 238336 B at two): half the
    entries, or, where a tile has only its 16 (8 heads an entry), one stage (131072 B)."""
    # the KL's teacher is a mean over every head of a proxy group: a group of several chunks
    # walks them in one program (the grid's third axis 1, ``grid``); the K / V loads of that
    # walk pipelined past shared memory (sm_90, Triton 3.9: 295424 B at three stages, H=16/16,
    # Hp=1), so it runs at one stage
    whole = with_kl and meta["SPAN"] * meta["CPS"] > 1
    out = dict(meta, PASS=2, WITH_OUT=with_out, WITH_KL=with_kl, WHOLE_GROUP=whole)
    if whole:
        out["num_stages"] = 1
    if with_out and with_kl:
        if meta["BLOCK_Q"] > 16:
            out["BLOCK_Q"] = meta["BLOCK_Q"] // 2
        else:
            out["num_stages"] = 1
    return out


def grid(n_items: int, meta: dict) -> tuple[int, int, int]:
    """The main attention's grid for ``meta`` (a forward pass's or the backward's): work items, key
    sub-blocks, head chunks (one program walking them all where the forward's ``WHOLE_GROUP``)."""
    return n_items, meta["BLOCK"] // meta["BLOCK_N"], 1 if meta.get("WHOLE_GROUP") else meta["SPAN"] * meta["CPS"]


def bwd_meta(heads: Heads, d: int, dp: int, block: int, n_sel: int, has_docs: bool, dense: bool, dtype,
             main: bool = True) -> dict:
    """The backward kernel's constexprs (but MAIN / WITH_KL) and launch options; ``main`` False:
    the teaching gradient alone, whose tiles hold up to ``TEACH_ROWS`` rows (a KV head's share of
    the proxy group in one chunk) at no more stages than ``stages`` allows them."""
    default = default_config(block, n_sel, d, dp)
    rows = _pick("bwd_rows", default.bwd_rows)
    if not main:
        rows = max(rows, min(TEACH_ROWS, 16 * heads.tile_heads))
    bq, gp = tile_entries(heads.tile_heads, rows)
    most = stages(d, dp, bq * gp)
    block_n = min(block, _pick("bwd_block_n", default.bwd_block_n))
    return dict(H=heads.h, HP=heads.hp, HP_PER_K=heads.hp // heads.hpk, G=heads.g, GP=gp, G_KV=heads.g_kv,
                **_chunks(heads, rows), KSEL=n_sel, D=d, BLOCK_D=block_d(d), DP=dp, BLOCK_DP=block_d(dp), BLOCK=block,
                BLOCK_N=block_n, BLOCK_Q=bq, HAS_DOCS=has_docs, DENSE=dense, DOT_PREC=dot_precision(dtype),
                num_warps=_pick("bwd_warps", default.bwd_warps),
                num_stages=_pick("bwd_stages", most) if main else min(_pick("bwd_stages", most), most))


def teach_apart(heads: Heads, d: int, dp: int, block: int, n_sel: int, has_docs: bool, dense: bool, dtype) -> bool:
    """Whether a backward of both gradients runs the teaching one as a launch of its own: where the
    main backward's tiles cut a KV head's share of a proxy group into more chunks than the teaching
    gradient alone takes (``bwd_meta(main=False)``). Each chunk of the one launch repeats the
    proxy's products; the second launch repeats the main scores instead (H=32, Hkv=2, Hp=2 at
    N=32768, H100, 2026-12-06: one launch 34.78 ms, main 25.49 + teaching alone 8.48)."""
    args = (heads, d, dp, block, n_sel, has_docs, dense, dtype)
    return bwd_meta(*args)["CPS"] > bwd_meta(*args, main=False)["CPS"]


def backward(do, q, k, v, q_proxy, k_proxy, out, lse, lse_proxy, kl_grad, items, rev, n_sel: int, heads: Heads,
             block: int, scale: float, proxy_scale: float, dstart, *, dense: bool, apart: bool | None = None):
    """Gradients: dq, dk, dv from ``do`` (None: skipped) and dq_proxy, dk_proxy from ``kl_grad``
    (the KL's incoming gradient, a 0-dim tensor; None: skipped). Float32 accumulators, atomics.
    With both, ``apart`` says whether the teaching gradient runs as a second launch (None: as
    ``teach_apart`` rules)."""
    b, h, n, d = q.shape
    dp = q_proxy.shape[-1]
    dev = q.device
    main, teach = do is not None, kl_grad is not None
    if main and teach:
        if apart is None:
            apart = teach_apart(heads, d, dp, block, n_sel, dstart is not None, dense, q.dtype)
        if apart:
            common = (q, k, v, q_proxy, k_proxy, out, lse, lse_proxy)
            rest = (items, rev, n_sel, heads, block, scale, proxy_scale, dstart)
            grads = backward(do, *common, None, *rest, dense=dense)
            return grads[:3] + backward(None, *common, kl_grad, *rest, dense=dense)[3:]
    n_items = items.shape[1]
    f32 = dict(device=dev, dtype=torch.float32)
    dq = torch.zeros(b, h, n, d, **f32) if main else lse
    dk = torch.zeros(b, heads.hkv, n, d, **f32) if main else lse
    dv = torch.zeros(b, heads.hkv, n, d, **f32) if main else lse
    dqp = torch.zeros(b, heads.hp, n, dp, **f32) if teach else lse
    dkp = torch.zeros(b, heads.hpk, n, dp, **f32) if teach else lse
    if main:
        do = _last_stride_one(do)
        delta = (do.float() * out.float()).sum(-1).contiguous()
    else:
        do, delta = q, lse
    c_kl = (kl_grad.float() / (b * heads.hp * n)).reshape(1) if teach else lse
    meta = bwd_meta(heads, d, dp, block, n_sel, dstart is not None, dense, q.dtype, main)
    log2e = 1.4426950408889634
    kernels().msa_bwd_kernel[grid(n_items, meta)](
        q, k, v, q_proxy, k_proxy, do, dstart if dstart is not None else items, items,
        rev if rev is not None else items, lse, delta, lse_proxy, c_kl, dq, dk, dv, dqp, dkp,
        *_strides(q), *_strides(k), *_strides(v), *_strides(q_proxy), *_strides(k_proxy), *_strides(do),
        n, cdiv(n, block), n_items, heads.hkv, heads.hpk, scale * log2e, proxy_scale * log2e, scale, proxy_scale,
        MAIN=main, WITH_KL=teach, **meta)
    grads = [None] * 5
    if main:
        grads[:3] = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)]
    if teach:
        grads[3:] = [dqp.to(q_proxy.dtype), dkp.to(k_proxy.dtype)]
    return grads
