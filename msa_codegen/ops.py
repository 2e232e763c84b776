"""Launchers, the torch.library custom ops and the public ``attention``.

Layering (one kernel family): generated ``@triton.jit`` kernels (codegen.load) -> launchers
``_fwd`` / ``_bwd`` (grid, allocation, strides, load path, one launch per head group) -> two
routes with one autograd rule (``_setup_context`` / ``_grads``): the custom ops
``msa_codegen::attention_fwd`` / ``attention_bwd`` with fake implementations, which torch.compile
traces, and ``_EagerAttention`` for eager calls (no dispatcher on the hot path) -> ``attention``
which validates its arguments.
"""
from __future__ import annotations

import functools
import math

import torch

from .kernels import render as codegen
from .config import LaunchConfig, bwd_scratch_limit, current_config_list, descriptor_fault, from_list, tma_capable
from .pattern.lowering import MAX_SEQLEN, lower
from .sparsity.inputs import prepare
from .pattern.spec import Pattern, Spec, parse
from .sparsity.tables import merged_block_tables, random_tables

LOG2E = 1.4426950408889634
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full-precision products (tf32 would cost ~3e-4 relative error)
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=256)
def _groups(pattern: str, num_heads: int, positional: bool = False, segments: bool = False, classes: bool = False):
    # every launch asks: cached (specs and plans are frozen), so the host path stays short
    return tuple((h0, h1, spec, lower(spec, positional=positional, segments=segments, classes=classes))
                 for h0, h1, spec in parse(pattern).head_groups(num_heads))


PREFIX_CHUNK_ROWS = 8192


def _prefix_chunk(n: int, prefix: int, row_elems: int, block_m: int) -> int:
    """Query rows per program of the prefix-key tiles of the dk/dv kernel.

    Short enough that those programs are no longer than the window tiles' (PREFIX_CHUNK_ROWS),
    long enough that the fp32 partial sums (chunks x prefix x B*H_kv*D x 8 bytes) stay under
    256 MiB.
    """
    most_chunks = max(1, (256 << 20) // (prefix * row_elems * 8))
    chunk = max(PREFIX_CHUNK_ROWS, _cdiv(n, most_chunks))
    return _cdiv(chunk, block_m) * block_m


def _seq_tiles(plan, n: int, block: int, positional: bool) -> int:
    """Programs along a sequence of n rows: a tile of ``block`` rows of one residue class each.
    Dilated plans stride their tiles by class; positional plans do so only with index classes
    (``cu_seqlens``), otherwise their tiles are contiguous rows."""
    classes = 1 if positional and not plan.classes else plan.dilation
    return classes * _cdiv(_cdiv(n, classes), block)


#: Warps and pipeline stages of the dq kernel when it reads the band's dS tiles: its tile is then
#: the dk/dv kernel's query block x key tile, and its loop one product a block
DS_DQ_WARPS = 4
DS_DQ_STAGES = 3


def _ds_slots(plan, n: int, block_m: int, block_n: int) -> int:
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
    return min(_cdiv(span, block_m), _cdiv(_cdiv(n, plan.dilation), block_m))


def _ds_heads(plan, positional: bool, b: int, n: int, h0: int, h1: int, group: int, block_m: int,
              block_n: int, itemsize: int):
    """(slots per key tile, elements per (batch, head), heads per chunk) for the backward that
    passes the band's dS from the dk/dv kernel to the dq kernel, or None: the plan has no
    banded W phase of the plain kernels, the limit (``config.bwd_scratch_limit()``) is 0, or
    one chunk of whole KV heads (``group`` query heads at batch ``b``) would exceed it."""
    if positional or not plan.ds_capable:
        return None
    limit = bwd_scratch_limit()
    if not limit:
        return None
    slots = _ds_slots(plan, n, block_m, block_n)
    per_head = _seq_tiles(plan, n, block_n, False) * slots * block_n * block_m
    fit = limit // (b * per_head * itemsize)
    if h0 % group or h1 % group:
        # a KV head whose query heads fall in two head groups: chunks would not hold whole KV
        # heads, so all of this group's heads in one, or none
        return (slots, per_head, h1 - h0) if fit >= h1 - h0 else None
    fit = fit // group * group
    if fit < 1:
        return None
    # equal chunks of whole KV heads: a short last chunk would leave most SMs idle in its launches
    chunks = _cdiv(h1 - h0, fit)
    heads = min(fit, _cdiv(_cdiv(h1 - h0, chunks), group) * group)
    return slots, per_head, heads


@functools.lru_cache(maxsize=16)
def _dummy_on(device: str) -> torch.Tensor:
    return torch.zeros(2, dtype=torch.int32, device=device)


def _dummy(device) -> torch.Tensor:
    # the table argument of a plan without random / top-k blocks (never read): one per device,
    # not a fill kernel per call
    return _dummy_on(str(device))


def _tables(spec: Spec, n: int, device, nk: int | None = None, block_indices=None, inverse: bool = True):
    """(table, inverse offsets, inverse query blocks, table strides, offset strides).

    The strides exist only in the kernels of a top-k plan (per batch and KV head tables). The
    forward reads only the table: ``inverse=False`` skips building the inverse of a top-k table.
    """
    if spec.topk:
        table, offs, inv = merged_block_tables(spec, n, n if nk is None else nk, block_indices, inverse)
        nkb = _cdiv(n if nk is None else nk, spec.block)
        return table, offs, inv, (table.stride(0), table.stride(1)), (table.shape[1] * nkb, nkb)
    if spec.random:
        return (*random_tables(spec, n, device), (), ())
    d = _dummy(device)
    return d, d, d, (), ()


#: the streamed operands of the plain kernels (K/V of the forward and dq kernels, Q/dO of the
#: dk/dv kernel) through tensor descriptors (TMA on Hopper) where ``_use_tma`` allows; tests switch
#: it off to cover the pointer loads that other GPUs and layouts get
USE_TMA = True


#: launch options of every kernel: FP contraction on explicitly (the folded scale is one FFMA per
#: score; Triton 3.9 warns that its default turns it off in 3.10)
_LAUNCH = {"enable_fp_fusion": True}

#: a positive scale folded into the exponent of the forward's softmax (``_softmax_step``); tests
#: and benchmarks switch it off to cover and time the unfolded path that other scales take
FOLD_SCALE = True


def _tma_layout_ok(t: torch.Tensor) -> bool:
    """TMA's needs: unit stride along D, a 16-byte aligned base and 16-byte multiples as strides."""
    es = t.element_size()
    # (a broadcast gradient has stride 0 along N: no descriptor for that)
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st > 0 and st * es % 16 == 0 for st, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1))


@functools.lru_cache(maxsize=16)
def _has_tma(device_index: int) -> bool:
    # the same capability rule as the Hopper launch defaults, cached per device for the hot path
    return tma_capable(torch.device("cuda", device_index))


def _use_tma(*tensors: torch.Tensor) -> bool:
    """Tensor-descriptor loads of a kernel's operands: Hopper or newer (or Triton's interpreter,
    which runs the same code on the CPU), and layouts TMA can address for every one of them;
    else pointer loads."""
    if not USE_TMA:
        return False
    a = tensors[0]
    if a.device.type == "cuda":
        if not _has_tma(a.device.index if a.device.index is not None else torch.cuda.current_device()):
            return False
        if a.element_size() != 2:
            # fp32 on the GPU keeps pointer loads: descriptors were measured and tested on the
            # H200 with bf16 / fp16 only (the interpreter runs the descriptor code for every dtype)
            return False
    elif not codegen.interpreting():
        return False
    if not all(_tma_layout_ok(t) for t in tensors):
        return False
    _ensure_allocator()
    return True


def _descriptor_scratch(size: int, alignment: int, stream):
    # on-device descriptors live in a small global scratch per program, taken from Triton's allocator
    return torch.empty(size, dtype=torch.int8, device="cpu" if codegen.interpreting() else "cuda")


def _ensure_allocator() -> None:
    """Give Triton an allocator for the descriptors' scratch unless the caller already set one."""
    import triton

    try:
        from triton.runtime._allocation import NullAllocator, _allocator
        unset = isinstance(_allocator.get(), NullAllocator)
    except (ImportError, AttributeError):   # another Triton layout: cannot tell, set ours
        unset = True
    if unset:
        triton.set_allocator(_descriptor_scratch)


def _pos_args(q_pos, k_pos, q_seg, k_seg, b, hq, hkv, nq, nk):
    """Kernel arguments of the positional kernels: the four row tensors and their (B, H, N) strides."""
    qp = q_pos.expand(b, hq, nq)
    kp = k_pos.expand(b, hkv, nk)
    qs = qp if q_seg is None else q_seg.expand(b, hq, nq)
    ks = kp if k_seg is None else k_seg.expand(b, hkv, nk)
    return (qp, kp, qs, ks, *qp.stride(), *kp.stride(), *qs.stride(), *ks.stride())


def _on_tensor_device(fn):
    """Run a launcher with its first tensor's GPU as the current device: Triton launches (and
    the descriptor scratch is allocated) on the current device, which need not be the inputs'."""
    @functools.wraps(fn)
    def run(t, *args, **kwargs):
        if t.device.type == "cuda" and t.device.index is not None and t.device.index != torch.cuda.current_device():
            with torch.cuda.device(t.device):
                return fn(t, *args, **kwargs)
        return fn(t, *args, **kwargs)
    return run


@_on_tensor_device
def _fwd(q, k, v, pattern: str, scale: float, cfg: LaunchConfig, q_pos=None, k_pos=None, q_seg=None,
         k_seg=None, block_indices=None, index_classes=False):
    b, hq, n, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    o = torch.empty_like(q)
    lse = torch.empty((b, hq, n), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    if nk == 0:   # nothing to see
        return o.zero_(), lse.fill_(float("-inf"))
    c = cfg.fwd
    positional = q_pos is not None
    tma = not positional and _use_tma(q, k, v)
    # the scale folded into the exponent: positive scales only (a negative one turns maxima into minima)
    fold = FOLD_SCALE and scale > 0
    for h0, h1, spec, plan in _groups(pattern, hq, positional, q_seg is not None, index_classes):
        kern = codegen.load(plan, "fwd").msa_fwd
        rtab, _, _, tstr, _ = _tables(spec, n, q.device, nk, block_indices, inverse=False)
        grid = (_seq_tiles(plan, n, c.block_m, positional), b * (h1 - h0))
        if positional:
            kern[grid](
                q, k, v, o, lse, rtab, *tstr, *_pos_args(q_pos, k_pos, q_seg, k_seg, b, hq, hkv, n, nk),
                *q.stride(), *k.stride(), *v.stride(), *o.stride(), lse.stride(0), lse.stride(1),
                h0, h1 - h0, group, n, nk, scale * LOG2E,
                HEAD_DIM=d, BLOCK_D=_block_d(d), BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                DOT_PREC=_dot_precision(q.dtype), FOLD=fold,
                num_warps=c.num_warps, num_stages=c.num_stages, **_LAUNCH,
            )
            continue
        kern[grid](
            q, k, v, o, lse, rtab, *tstr,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), lse.stride(0), lse.stride(1),
            h0, h1 - h0, group, n, scale * LOG2E,
            HEAD_DIM=d, BLOCK_D=_block_d(d), BLOCK_M=c.block_m, BLOCK_N=c.block_n,
            DOT_PREC=_dot_precision(q.dtype), TMA=tma, FOLD=fold,
            num_warps=c.num_warps, num_stages=c.num_stages, **_LAUNCH,
        )
    return o, lse


@_on_tensor_device
def _bwd(do, q, k, v, o, lse, dlse, pattern: str, scale: float, cfg: LaunchConfig, q_pos=None, k_pos=None,
         q_seg=None, k_seg=None, block_indices=None, index_classes=False):
    b, hq, n, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    positional = q_pos is not None
    c = cfg.bwd
    bd = _block_d(d)
    prec = _dot_precision(q.dtype)
    # delta and the LSE in log2 units (msa_bwd_pre), rows padded to 16 bytes: the dk/dv kernel
    # streams them through descriptors
    lse = lse.contiguous()   # msa_bwd_pre reads it in dlse's layout
    n_pad = _cdiv(n, 4) * 4
    stats = torch.empty((2, b, hq, n_pad), dtype=torch.float32, device=q.device)
    delta, lse2 = stats[0, :, :, :n], stats[1, :, :, :n]
    if dlse is not None:
        # the gradient of a sum arrives expanded (stride 0): the kernel reads it in lse's layout
        dlse = dlse.to(torch.float32).contiguous()
    groups = _groups(pattern, hq, positional, q_seg is not None, index_classes)
    # the plain kernels read Q/dO and stream K/V (dq), read K/V and stream Q/dO (dk/dv) through
    # tensor descriptors where they can
    tma = {} if positional else {"TMA": _use_tma(q, k, v, do)}
    if tma.get("TMA"):
        why = descriptor_fault(c)
        if why:
            raise ValueError(why)
    # A KV head whose query heads fall in two head groups gets partial sums from two kernels:
    # then every group writes fp32 partials that are added in group order (deterministic).
    split = any(h0 % group or h1 % group for h0, h1, _, _ in groups)
    if split:
        dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for h0, h1, spec, plan in groups:
        mod = codegen.load(plan, "bwd")
        rtab, roff, rinv, tstr, rstr = _tables(spec, n, q.device, nk, block_indices)
        pos = _pos_args(q_pos, k_pos, q_seg, k_seg, b, hq, hkv, n, nk) if positional else ()
        hs = h1 - h0
        mod.msa_bwd_pre[(_cdiv(n, 64), b * hs)](
            o, do, dlse if dlse is not None else lse, lse, delta, lse2,
            *o.stride(), *do.stride(), lse.stride(0), lse.stride(1), delta.stride(0), delta.stride(1),
            h0, hs, n,
            HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=64, HAS_DLSE=dlse is not None, **_LAUNCH,
        )
        hk0, hk1 = h0 // group, (h1 - 1) // group + 1
        hks = hk1 - hk0
        if split:
            dk_out = torch.empty((b, hks, nk, d), dtype=torch.float32, device=k.device)
            dv_out = torch.empty_like(dk_out)
            kv_off = hk0
        else:
            dk_out, dv_out, kv_off = dk, dv, 0
        common = (q, k, v, do, lse2, delta)
        consts = dict(HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=c.block_m1, BLOCK_N=c.block_n1, DOT_PREC=prec,
                      num_warps=c.num_warps1, num_stages=c.num_stages1, **_LAUNCH)
        if positional:
            mod.msa_bwd_dq[(_seq_tiles(plan, n, c.block_m2, positional), b * hs)](
                q, k, v, do, lse2, delta, dq, rtab, *tstr, *pos,
                *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), delta.stride(0), delta.stride(1),
                h0, hs, group, n, nk, scale * LOG2E, scale,
                HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=c.block_m2, BLOCK_N=c.block_n2, DOT_PREC=prec,
                num_warps=c.num_warps2, num_stages=c.num_stages2, **_LAUNCH,
            )
            # one key tile per program owns every key (no prefix tiles): see the positional template
            mod.msa_bwd_dkdv[(_seq_tiles(plan, nk, c.block_n1, positional), b * hks)](
                *common, dk_out, dv_out, rtab, roff, rinv, *rstr, *pos,
                *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk_out.stride(), *dv_out.stride(),
                delta.stride(0), delta.stride(1), h0, hs, group, hks, kv_off, n, nk, scale * LOG2E, scale,
                **consts)
        else:
            # With room for it, the dk/dv kernel stores the W band's dS^T tiles and dq reads them
            # (one product a block instead of three), over chunks of whole KV heads; else dq
            # recomputes them (its own tiling: block_m2 x block_n2).
            ds = _ds_heads(plan, positional, b, n, h0, h1, group, c.block_m1, c.block_n1, q.element_size())
            if ds:
                slots, per_head, step = ds
                buf = torch.empty((b, step, per_head), dtype=q.dtype, device=q.device)
                ds_args = (buf, buf.stride(0), buf.stride(1), slots)
            else:
                step = hs
                ds_args = (_dummy(q.device), 0, 0, 0)
            # dq's tiles: the dk/dv kernel's when it reads their dS, else its own
            bm, bn = (c.block_m1, c.block_n1) if ds else (c.block_m2, c.block_n2)
            warps, stages = (DS_DQ_WARPS, DS_DQ_STAGES) if ds else (c.num_warps2, c.num_stages2)
            for c0 in range(h0, h1, step):
                c1 = min(h1, c0 + step)
                ck0, ck1 = c0 // group, (c1 - 1) // group + 1
                # dk/dv first: with ds, dq reads the tiles it writes (else the two are independent)
                mod.msa_bwd_dkdv[(_seq_tiles(plan, n, c.block_n1, positional), b * (ck1 - ck0))](
                    *common, dk_out, dv_out, rtab, roff, rinv, *rstr,
                    *q.stride(), *k.stride(), *v.stride(), *do.stride(), 0, *dk_out.stride(), 0,
                    *dv_out.stride(), delta.stride(0), delta.stride(1), *ds_args,
                    c0, c1 - c0, group, ck1 - ck0, kv_off, n, c.block_m1, scale * LOG2E, scale,
                    PREFIX_TILES=False, DS=bool(ds), **tma, **consts)
                mod.msa_bwd_dq[(_seq_tiles(plan, n, bm, positional), b * (c1 - c0))](
                    q, k, v, do, lse2, delta, dq, rtab, *tstr,
                    *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
                    delta.stride(0), delta.stride(1), *ds_args,
                    c0, c1 - c0, group, n, scale * LOG2E, scale,
                    HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=bm, BLOCK_N=bn, DOT_PREC=prec, DS=bool(ds), **tma,
                    num_warps=warps, num_stages=stages, **_LAUNCH,
                )
        if plan.prefix and not positional:
            p = min(plan.prefix, n)
            chunk = _prefix_chunk(n, p, b * hks * d, c.block_m1)
            n_chunks = _cdiv(n, chunk)
            part_k = torch.empty((n_chunks, b, hks, p, d), dtype=torch.float32, device=q.device)
            part_v = torch.empty_like(part_k)
            mod.msa_bwd_dkdv[(_cdiv(p, c.block_n1) * n_chunks, b * hks)](
                *common, part_k, part_v, rtab, roff, rinv, *rstr,
                *q.stride(), *k.stride(), *v.stride(), *do.stride(), *part_k.stride(), *part_v.stride(),
                delta.stride(0), delta.stride(1), _dummy(q.device), 0, 0, 0,
                h0, hs, group, hks, hk0, n, chunk, scale * LOG2E, scale,
                PREFIX_TILES=True, DS=False, **tma, **consts)
            # fixed summation order over the chunks: deterministic
            dk_out[:, hk0 - kv_off:hk1 - kv_off, :p] = part_k.sum(0).to(dk_out.dtype)
            dv_out[:, hk0 - kv_off:hk1 - kv_off, :p] = part_v.sum(0).to(dv_out.dtype)
        if split:
            dk_acc[:, hk0:hk1] += dk_out
            dv_acc[:, hk0:hk1] += dv_out
    if split:
        dk.copy_(dk_acc)
        dv.copy_(dv_acc)
    return dq, dk, dv


# ---- custom ops ---------------------------------------------------------------------------

@torch.library.custom_op("msa_codegen::attention_fwd", mutates_args=())
def attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: str, scale: float,
                     config: list[int], q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
                     q_seg: torch.Tensor | None = None, k_seg: torch.Tensor | None = None,
                     block_indices: torch.Tensor | None = None,
                     index_classes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd(q, k, v, pattern, scale, from_list(config), q_pos, k_pos, q_seg, k_seg, block_indices, index_classes)


@attention_fwd_op.register_fake
def _(q, k, v, pattern, scale, config, q_pos=None, k_pos=None, q_seg=None, k_seg=None, block_indices=None,
      index_classes=False):
    b, hq, n, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, hq, n), dtype=torch.float32)


@torch.library.custom_op("msa_codegen::attention_bwd", mutates_args=())
def attention_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                     lse: torch.Tensor, dlse: torch.Tensor | None, pattern: str, scale: float,
                     config: list[int], q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
                     q_seg: torch.Tensor | None = None, k_seg: torch.Tensor | None = None,
                     block_indices: torch.Tensor | None = None,
                     index_classes: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd(do, q, k, v, o, lse, dlse, pattern, scale, from_list(config), q_pos, k_pos, q_seg, k_seg,
                block_indices, index_classes)


@attention_bwd_op.register_fake
def _(do, q, k, v, o, lse, dlse, pattern, scale, config, q_pos=None, k_pos=None, q_seg=None, k_seg=None,
      block_indices=None, index_classes=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, pattern, scale, config, *dyn = inputs
    dyn = dyn + [None] * (6 - len(dyn))
    dyn, classes = dyn[:5], bool(dyn[5])
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, *(t if t is not None else torch.empty(0) for t in dyn))
    ctx.has_dyn = [t is not None for t in dyn]
    ctx.pattern, ctx.scale, ctx.config, ctx.classes = pattern, scale, config, classes


def _grads(ctx, do, dlse, direct: bool):
    """The gradients of both routes: through the backward custom op, or (``direct``, the eager
    Function) straight to the launcher."""
    q, k, v, o, lse, *dyn = ctx.saved_tensors
    dyn = [t if has else None for t, has in zip(dyn, ctx.has_dyn)]
    if do is None:
        do = torch.zeros_like(o)
    if direct:
        dq, dk, dv = _bwd(do, q, k, v, o, lse, dlse, ctx.pattern, ctx.scale, from_list(ctx.config), *dyn,
                          ctx.classes)
    else:
        dq, dk, dv = attention_bwd_op(do, q, k, v, o, lse, dlse, ctx.pattern, ctx.scale, ctx.config, *dyn,
                                      ctx.classes)
    # no gradient into positions, segments or block indices
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _backward(ctx, do, dlse):
    return _grads(ctx, do, dlse, direct=False)


torch.library.register_autograd("msa_codegen::attention_fwd", _backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The eager route of ``attention``: the same launchers as the custom ops, without the
    dispatcher. Measured on a CPU with the kernels stubbed out: the custom op costs ~100 us of
    host time per forward with autograd against ~13 us for the launcher alone, and a call whose
    kernels take a few hundred microseconds is timed by its host path. torch.compile traces the
    custom ops instead (``attention`` picks the route), so graphs keep their fake tensors and
    opcheck-tested schema."""

    @staticmethod
    def forward(ctx, q, k, v, pattern, scale, config, q_pos, k_pos, q_seg, k_seg, block_indices, index_classes):
        out = _fwd(q, k, v, pattern, scale, from_list(config), q_pos, k_pos, q_seg, k_seg, block_indices,
                   index_classes)
        _setup_context(ctx, (q, k, v, pattern, scale, config, q_pos, k_pos, q_seg, k_seg, block_indices,
                             index_classes), out)
        ctx.set_materialize_grads(False)   # an unused output (the LSE, mostly) gets None, not zeros
        return out

    @staticmethod
    def backward(ctx, do, dlse):
        return _grads(ctx, do, dlse, direct=True)


def _run(q, k, v, pattern: str, scale: float, config: list[int], q_pos=None, k_pos=None, q_seg=None,
         k_seg=None, block_indices=None, index_classes=False):
    """(out, lse) through the custom op when torch.compile traces, else the eager Function."""
    if torch.compiler.is_compiling():
        return attention_fwd_op(q, k, v, pattern, scale, config, q_pos, k_pos, q_seg, k_seg, block_indices,
                                index_classes)
    return _EagerAttention.apply(q, k, v, pattern, scale, config, q_pos, k_pos, q_seg, k_seg, block_indices,
                                 index_classes)


# ---- public API ---------------------------------------------------------------------------

def _check_inputs(q, k, v, scale, lengths_may_differ=False):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (B, H, N, D), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, hq, n, d = q.shape
    bk, hkv, nk, dk = k.shape
    if bk != b:
        raise ValueError(f"batch mismatch: q has B={b}, k and v have B={bk}")
    if nk != n and not lengths_may_differ:
        raise ValueError(f"sequence length mismatch: q has N={n}, k and v have N={nk} "
                         f"(different lengths need q_pos and k_pos)")
    if dk != d:
        raise ValueError(f"head dim mismatch: q has D={d}, k and v have D={dk}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query heads must be a multiple of key/value heads, got Hq={hq}, Hkv={hkv}")
    if not 16 <= d <= 256:
        raise ValueError(f"head dim must be between 16 and 256, got {d}")
    if max(n, nk) > MAX_SEQLEN:
        raise ValueError(f"sequence length must be at most {MAX_SEQLEN}, got {max(n, nk)}")
    if q.device.type == "cpu":
        if not codegen.interpreting():
            raise ValueError(
                "q, k and v are CPU tensors, but the kernels run on CUDA: move them to a GPU, or set "
                "TRITON_INTERPRET=1 in the environment before msa_codegen loads its kernels to run them "
                "in Triton's interpreter (slow; for tests)")
        if q.dtype == torch.bfloat16:
            raise TypeError("bfloat16 is not supported in Triton's interpreter (its bf16 tl.dot is wrong as "
                            "of Triton 3.9); use float16 or float32 on the CPU, or a GPU")
    elif q.device.type != "cuda":
        raise ValueError(f"unsupported device {q.device}: expected a CUDA device (or CPU with TRITON_INTERPRET=1)")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")


def attention(q, k, v, pattern: str | Pattern = "causal", *, scale: float | None = None,
              return_lse: bool = False, deterministic: bool = True, cu_seqlens=None, q_pos=None, k_pos=None,
              q_bucket=None, k_bucket=None, block_indices=None, autotune: bool = False):
    """Sparse attention through a pattern, with autograd.

    Args:
        q: ``(B, Hq, N, D)``, float16 / bfloat16 (float32 accepted), any strides: a ``(B, N, H, D)``
            tensor passed as ``.transpose(1, 2)`` is read in place.
        k, v: ``(B, Hkv, N, D)``, same dtype and device; Hq a multiple of Hkv (GQA / MQA, K and V
            are never copied).
        pattern: a pattern string (see ``msa_codegen.parse``) or a ``Pattern``; default dense causal.
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the natural-log log-sum-exp, float32 ``(B, Hq, N)`` (differentiable).
        deterministic: the backward never uses atomics, so it is always deterministic; the flag
            is accepted for API compatibility.
        autotune: when no tuned row of this GPU and length bucket exists for the call's key, tune
            it now (once per process, a short budget, progress on stderr) and store the winner in
            the user database (``msa_codegen.tuning.auto``). Default off: tuning never happens
            implicitly.

    Run-time sparsity (each composes with any pattern; no gradient flows into them; see
    ``msa_codegen.dynamic`` for the exact semantics):
        cu_seqlens: int32 ``(num_docs + 1,)`` offsets of packed documents along N (B must be 1),
            from 0 to N, non-decreasing. Tokens see only their own document; the pattern's
            positions restart at every document (``sink=4``: each document's first 4 tokens)::

                cu_seqlens = [0, 3, 5], "causal"      k: 0 1 2 3 4
                                                q 0:  x . . . .
                                                q 1:  x x . . .
                                                q 2:  x x x . .
                                                q 3:  . . . x .
                                                q 4:  . . . x x
        q_pos, k_pos: int32/int64 ``(B, Hq, Nq)`` / ``(B, Hkv, Nk)`` or broadcastable (``(Nq,)``):
            original positions of compacted rows; the pattern is evaluated on them and Nq may
            differ from Nk. Non-decreasing along the sequence (blocks are skipped by position
            ranges).
        q_bucket, k_bucket: int32/int64, shaped like the positions: a query sees a key only when
            their buckets are equal. Rows sorted by (bucket, position) (``hash_sort`` does it).
        block_indices: int32 ``(B, Hkv, ceil(Nq / block), K)`` key-block ids per query block and
            KV head for the pattern term ``topk=K`` (-1 unused, any order, duplicates allowed);
            ``select_blocks`` computes them. Blocks are blocks of rows of the tensors as passed.

    Returns:
        the output ``(B, Hq, N, D)`` in q's dtype and layout (and the LSE). A query that sees no
        key gets a zero row and LSE ``-inf``, and its gradients are zero.

    Example::

        out = msa_codegen.attention(q, k, v, "window=4096,dilation=2,sink=64")
        out.sum().backward()
    """
    _check_inputs(q, k, v, scale, lengths_may_differ=q_pos is not None)
    pat = parse(pattern)
    groups = pat.head_groups(q.shape[1])   # raises ValueError when the groups do not cover every query head
    d = q.shape[-1]
    scale = float(d ** -0.5 if scale is None else scale)
    kw = dict(cu_seqlens=cu_seqlens, q_pos=q_pos, k_pos=k_pos, q_bucket=q_bucket, k_bucket=k_bucket,
              block_indices=block_indices)
    dynamic = any(t is not None for t in kw.values()) or any(spec.topk for _, _, spec in groups)
    if autotune:
        if dynamic:
            raise ValueError("autotune=True tunes a pattern's own kernels; with run-time sparsity (cu_seqlens, "
                             "positions, buckets, topk) the kernels depend on the data: tune the plain pattern "
                             "(msa-tune --pattern ...) and call without autotune")
        from .tuning.auto import ensure_tuned

        ensure_tuned(q, k, str(pat))
    cfg = current_config_list(q.device, d, q.dtype, str(pat), q.shape[1] // k.shape[1], q.shape[2])
    if not dynamic:
        out, lse = _run(q, k, v, str(pat), scale, cfg)
        return (out, lse) if return_lse else out
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    dyn = prepare(groups, b, hq, hkv, nq, nk, q.device, **kw)
    if dyn.positional and nq != nk and any(s.random for _, _, s in groups):
        raise ValueError(f"random=R needs q and k of one length, got Nq={nq}, Nk={nk}")
    # cu_seqlens: positions are rows minus the document start, so dilated tiles stay strided
    out, lse = _run(q, k, v, str(pat), scale, cfg, dyn.q_pos, dyn.k_pos, dyn.q_seg, dyn.k_seg,
                                dyn.block_indices, cu_seqlens is not None)
    return (out, lse) if return_lse else out
