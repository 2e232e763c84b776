"""The launchers of the generated kernels: allocation, grids, strides, one launch per head group.

Layering (one kernel family): generated ``@triton.jit`` kernels (``render.load``, held by the
call's ``AttentionPlan``) -> ``forward`` / ``backward`` here -> ``autograd.py`` (the custom ops
and the eager autograd Function) -> ``api.attention``, which validates its arguments.
"""
from __future__ import annotations

import functools
import os

import torch

from ..config import LaunchConfig
from ..pattern.spec import Spec
from ..plan import AttentionPlan
from ..sparsity.tables import merged_block_tables, random_tables
from . import gluon as _gluon
from . import direct, schedule
from .schedule import cdiv
from .tma import descriptor_fault, positional_descriptors, use_tma

LOG2E = 1.4426950408889634


def _tables(spec: Spec, n: int, device, nk: int | None = None, block_indices=None, inverse: bool = True):
    """(table, inverse offsets, inverse query blocks, table strides, offset strides).

    The strides exist only in the kernels of a top-k plan (per batch and KV head tables). The
    forward reads only the table: ``inverse=False`` skips building the inverse of a top-k table.
    """
    if spec.topk:
        table, offs, inv = merged_block_tables(spec, n, n if nk is None else nk, block_indices, inverse)
        nkb = cdiv(n if nk is None else nk, spec.block)
        return table, offs, inv, (table.stride(0), table.stride(1)), (table.shape[1] * nkb, nkb)
    if spec.random:
        return (*random_tables(spec, n, device), (), ())
    d = direct.unused_pointer(device)
    return d, d, d, (), ()


#: launch options of every kernel: FP contraction on explicitly (the folded scale is one FFMA per
#: score; Triton 3.9 warns that its default turns it off in 3.10)
_LAUNCH = {"enable_fp_fusion": True}

#: a positive scale folded into the exponent of the forward's softmax (``_softmax_step``); tests
#: and benchmarks switch it off to cover and time the unfolded path that other scales take
FOLD_SCALE = True


def _pos_args(q_pos, k_pos, q_seg, k_seg, b, hq, hkv, nq, nk):
    """Kernel arguments of the positional kernels: the four row tensors and their (B, H, N) strides."""
    qp = q_pos.expand(b, hq, nq)
    kp = k_pos.expand(b, hkv, nk)
    qs = qp if q_seg is None else q_seg.expand(b, hq, nq)
    ks = kp if k_seg is None else k_seg.expand(b, hkv, nk)
    return (qp, kp, qs, ks, *qp.stride(), *kp.stride(), *qs.stride(), *ks.stride())


def _gluon_route(plan: AttentionPlan, q_pos, q: torch.Tensor, backward: bool = False) -> bool:
    """Whether a call of q's shape (B, Hq, N, D) asks for the Gluon family in this direction
    (kernels/gluon.py ``requested``, with the call's forward work for plain windows:
    ``window_flops``) and may take it: without run-time positions, or with packed documents'
    (cu_seqlens: every group's plan has ``documents``), which the family reads as document
    bounds."""
    kplans = [g.kernel_plan for g in plan.groups]
    if q_pos is not None and not all(kp.documents for kp in kplans):
        return False
    b, _, n, d = q.shape
    flops = None
    if _gluon.ENV not in os.environ:   # only the automatic choice looks at the call's size
        flops = _gluon.window_flops([(g.h1 - g.h0, g.kernel_plan) for g in plan.groups], b, n, d)
    return _gluon.requested(kplans, n, backward, d, flops)


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
def forward(q, k, v, plan: AttentionPlan, scale: float, cfg: LaunchConfig, q_pos=None, k_pos=None, q_seg=None,
            k_seg=None, block_indices=None):
    """(out, lse) of one call: one forward launch per head group of the plan, with ``cfg``'s
    forward parameters. The run-time tensors are ``sparsity.prepare``'s (None for a plain call).
    A call that asks for the Gluon family (``MSA_CODEGEN_GLUON=1``, or unset and a plan the
    automatic choice takes: kernels/gluon.py ``requested``) runs it when eligible (same outputs,
    so either backward runs on them); an ineligible one logs why, once."""
    if _gluon_route(plan, q_pos, q):
        why = _gluon.why_not(plan, q, k, v, scale) or _gluon.slower_reason([g.kernel_plan for g in plan.groups],
                                                                           q.shape[3])
        if why is None:
            return _gluon.forward(q, k, v, plan, scale, block_indices, q_pos)
        _gluon.note(plan, why)
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
    tma = (not positional or positional_descriptors()) and use_tma(q, k, v)
    # the scale folded into the exponent: positive scales only (a negative one turns maxima into minima)
    fold = FOLD_SCALE and scale > 0
    bd, prec = plan.block_d, plan.dot_precision
    for grp in plan.groups:
        h0, h1 = grp.h0, grp.h1
        kern = grp.kernels("fwd").msa_fwd
        rtab, _, _, tstr, _ = _tables(grp.spec, n, q.device, nk, block_indices, inverse=False)
        grid = (schedule.seq_tiles(grp.kernel_plan, n, c.block_m, positional), b * (h1 - h0))
        if positional:
            direct.launch(kern, grid,
                q, k, v, o, lse, rtab, *tstr, *_pos_args(q_pos, k_pos, q_seg, k_seg, b, hq, hkv, n, nk),
                *q.stride(), *k.stride(), *v.stride(), *o.stride(), lse.stride(0), lse.stride(1),
                h0, h1 - h0, group, n, nk, scale * LOG2E,
                HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                DOT_PREC=prec, TMA=tma, FOLD=fold,
                num_warps=c.num_warps, num_stages=c.num_stages, **_LAUNCH,
            )
            continue
        direct.launch(kern, grid,
            q, k, v, o, lse, rtab, *tstr,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), lse.stride(0), lse.stride(1),
            h0, h1 - h0, group, n, scale * LOG2E,
            HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
            DOT_PREC=prec, TMA=tma, FOLD=fold,
            num_warps=c.num_warps, num_stages=c.num_stages, **_LAUNCH,
        )
    return o, lse


@_on_tensor_device
def backward(do, q, k, v, o, lse, dlse, plan: AttentionPlan, scale: float, cfg: LaunchConfig, q_pos=None,
             k_pos=None, q_seg=None, k_seg=None, block_indices=None, deterministic: bool = True):
    """(dq, dk, dv) of one call: per head group the stats pass (msa_bwd_pre), the dk/dv and the dq
    kernels (and the prefix-key tiles), with ``cfg``'s backward parameters; deterministic.
    A call that asks for the Gluon family (as ``forward``) runs its backward when eligible
    (kernels/gluon.py: the same stats pass, then its dK/dV and dQ kernels, or with
    ``deterministic=False`` its fused form: dQ added by TMA reductions in a varying order); an
    ineligible one logs why, once."""
    if _gluon_route(plan, q_pos, q, backward=True):
        why = _gluon.why_not_bwd(plan, q, k, v)
        if why is None:
            fused = not deterministic and _gluon.fused_reason([g.kernel_plan for g in plan.groups],
                                                              q.shape[1] // k.shape[1], q.numel()) is None
            return _gluon.backward(do, q, k, v, o, lse, dlse, plan, scale, block_indices, q_pos, fused=fused)
        _gluon.note(plan, why, "backward")
    b, hq, n, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    positional = q_pos is not None
    c = cfg.bwd
    bd, prec = plan.block_d, plan.dot_precision
    # delta and the LSE in log2 units (msa_bwd_pre), rows padded to 16 bytes: the dk/dv kernel
    # streams them through descriptors
    lse = lse.contiguous()   # msa_bwd_pre reads it in dlse's layout
    n_pad = cdiv(n, 4) * 4
    stats = torch.empty((2, b, hq, n_pad), dtype=torch.float32, device=q.device)
    delta, lse2 = stats[0, :, :, :n], stats[1, :, :, :n]
    if dlse is not None:
        # the gradient of a sum arrives expanded (stride 0): the kernel reads it in lse's layout
        dlse = dlse.to(torch.float32).contiguous()
    # the plain kernels read Q/dO and stream K/V (dq), read K/V and stream Q/dO (dk/dv) through
    # tensor descriptors where they can
    tma = {"TMA": (not positional or positional_descriptors()) and use_tma(q, k, v, do)}
    if tma.get("TMA"):
        why = descriptor_fault(c)
        if why:
            raise ValueError(why)
    # A KV head whose query heads fall in two head groups gets partial sums from two kernels:
    # then every group writes fp32 partials that are added in group order (deterministic).
    split = plan.split_kv_heads
    if split:
        dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for grp in plan.groups:
        h0, h1, kplan = grp.h0, grp.h1, grp.kernel_plan
        mod = grp.kernels("bwd")
        rtab, roff, rinv, tstr, rstr = _tables(grp.spec, n, q.device, nk, block_indices)
        pos = _pos_args(q_pos, k_pos, q_seg, k_seg, b, hq, hkv, n, nk) if positional else ()
        hs = h1 - h0
        direct.launch(mod.msa_bwd_pre, (cdiv(n, 64), b * hs),
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
            direct.launch(mod.msa_bwd_dq, (schedule.seq_tiles(kplan, n, c.block_m2, positional), b * hs),
                q, k, v, do, lse2, delta, dq, rtab, *tstr, *pos,
                *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), delta.stride(0), delta.stride(1),
                h0, hs, group, n, nk, scale * LOG2E, scale,
                HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=c.block_m2, BLOCK_N=c.block_n2, DOT_PREC=prec, **tma,
                num_warps=c.num_warps2, num_stages=c.num_stages2, **_LAUNCH,
            )
            # one key tile per program owns every key (no prefix tiles): see the positional template
            direct.launch(mod.msa_bwd_dkdv, (schedule.seq_tiles(kplan, nk, c.block_n1, positional), b * hks),
                *common, dk_out, dv_out, rtab, roff, rinv, *rstr, *pos,
                *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk_out.stride(), *dv_out.stride(),
                delta.stride(0), delta.stride(1), h0, hs, group, hks, kv_off, n, nk, scale * LOG2E, scale,
                **consts, **tma)
        else:
            # With room for it, the dk/dv kernel stores the W band's dS^T tiles and dq reads them
            # (one product a block instead of three), over chunks of whole KV heads; else dq
            # recomputes them (its own tiling: block_m2 x block_n2).
            ds = schedule.ds_heads(kplan, positional, b, n, h0, h1, group, c.block_m1, c.block_n1, q.element_size())
            if ds:
                slots, per_head, step = ds
                buf = torch.empty((b, step, per_head), dtype=q.dtype, device=q.device)
                ds_args = (buf, buf.stride(0), buf.stride(1), slots)
            else:
                step = hs
                ds_args = (direct.unused_pointer(q.device), 0, 0, 0)
            # dq's tiles: the dk/dv kernel's when it reads their dS, else its own
            bm, bn = (c.block_m1, c.block_n1) if ds else (c.block_m2, c.block_n2)
            warps, stages = (schedule.DS_DQ_WARPS, schedule.DS_DQ_STAGES) if ds else (c.num_warps2, c.num_stages2)
            for c0 in range(h0, h1, step):
                c1 = min(h1, c0 + step)
                ck0, ck1 = c0 // group, (c1 - 1) // group + 1
                # dk/dv first: with ds, dq reads the tiles it writes (else the two are independent)
                direct.launch(mod.msa_bwd_dkdv, (schedule.seq_tiles(kplan, n, c.block_n1, positional), b * (ck1 - ck0)),
                    *common, dk_out, dv_out, rtab, roff, rinv, *rstr,
                    *q.stride(), *k.stride(), *v.stride(), *do.stride(), 0, *dk_out.stride(), 0,
                    *dv_out.stride(), delta.stride(0), delta.stride(1), *ds_args,
                    c0, c1 - c0, group, ck1 - ck0, kv_off, n, c.block_m1, scale * LOG2E, scale,
                    PREFIX_TILES=False, DS=bool(ds), **tma, **consts)
                direct.launch(mod.msa_bwd_dq, (schedule.seq_tiles(kplan, n, bm, positional), b * (c1 - c0)),
                    q, k, v, do, lse2, delta, dq, rtab, *tstr,
                    *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
                    delta.stride(0), delta.stride(1), *ds_args,
                    c0, c1 - c0, group, n, scale * LOG2E, scale,
                    HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=bm, BLOCK_N=bn, DOT_PREC=prec, DS=bool(ds), **tma,
                    num_warps=warps, num_stages=stages, **_LAUNCH,
                )
        if kplan.prefix and not positional:
            p = min(kplan.prefix, n)
            chunk = schedule.prefix_chunk(n, p, b * hks * d, c.block_m1)
            n_chunks = cdiv(n, chunk)
            part_k = torch.empty((n_chunks, b, hks, p, d), dtype=torch.float32, device=q.device)
            part_v = torch.empty_like(part_k)
            direct.launch(mod.msa_bwd_dkdv, (cdiv(p, c.block_n1) * n_chunks, b * hks),
                *common, part_k, part_v, rtab, roff, rinv, *rstr,
                *q.stride(), *k.stride(), *v.stride(), *do.stride(), *part_k.stride(), *part_v.stride(),
                delta.stride(0), delta.stride(1), direct.unused_pointer(q.device), 0, 0, 0,
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
