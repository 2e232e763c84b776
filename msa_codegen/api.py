"""The public entry points: ``attention`` and ``explain``.

``attention`` checks its arguments (errors say what was expected and what was given), takes
the call's plan (``plan.plan_for``: one dictionary hit after the first call of a key), checks
the run-time sparsity inputs (``sparsity.inputs.prepare``) and runs the eager autograd route,
or under torch.compile the custom op (``autograd.py``).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from . import config as _config
from .autograd import run, run_compiled
from .config import as_list
from .heuristics import SHORT_BUCKET_KEYS
from .kernels.render import interpreting
from .pattern.lowering import MAX_SEQLEN
from .pattern.spec import Pattern, parse
from .plan import plan_for
from .sparsity.inputs import prepare
from .tuning import lookup as tuning_lookup

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: ``attention(..., autotune=True)``'s tuner: ``tuning.auto`` installs ``ensure_tuned`` here when
#: the package is imported (the tuner runs ``attention``, so the core calls it through this hook
#: instead of importing it)
_autotuner = None


#: the route of patterns with an msa head group, ``(attention, resolution)``: ``msa.groups`` installs
#: them here when the package is imported (msa_codegen.msa imports this module: its warm-up runs
#: the dense causal kernels; the core reaches MSA through this hook instead of importing it)
_msa_route = None


def install_msa_route(attention_fn, resolution_fn) -> None:
    """Set what ``attention`` / ``explain`` call for a pattern with an ``msa`` group."""
    global _msa_route
    _msa_route = (attention_fn, resolution_fn)


def install_autotuner(fn) -> None:
    """Set the function ``attention(..., autotune=True)`` calls as ``fn(q, k, pattern_text)``."""
    global _autotuner
    _autotuner = fn


def check_qkv(q, k, v, lengths_may_differ=False, float64_ok=False) -> None:
    """The checks of q, k and v every entry point shares (``attention``, ``msa_attention`` and the
    references): 4-dim float tensors of one dtype and device, matching B and D, k and v alike,
    whole GQA groups, head dim 16..256. TypeError / ValueError say what was expected and what was
    given. ``float64_ok``: the float64 references accept float64."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (B, H, N, D), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES and not (float64_ok and t.dtype == torch.float64):
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


def check_location(t: torch.Tensor, what: str, alternative: str = "") -> None:
    """Kernels run on CUDA, or on the CPU in Triton's interpreter; ``alternative`` ends the CPU
    message (another way to get the result)."""
    if t.device.type == "cpu":
        if not interpreting():
            raise ValueError(
                f"{what} are CPU tensors, but the kernels run on CUDA: move them to a GPU, or set "
                "TRITON_INTERPRET=1 in the environment before msa_codegen loads its kernels to run them "
                f"in Triton's interpreter (slow; for tests){alternative}")
    elif t.device.type != "cuda":
        raise ValueError(f"unsupported device {t.device}: expected a CUDA device (or CPU with TRITON_INTERPRET=1)")


def check_device(t: torch.Tensor, what: str) -> None:
    """The attention kernels run on CUDA, or on the CPU in Triton's interpreter (not in bf16
    there: their products take the inputs' dtype)."""
    check_location(t, what)
    if t.device.type == "cpu" and t.dtype == torch.bfloat16:
        raise TypeError("bfloat16 is not supported in Triton's interpreter (its bf16 tl.dot is wrong as "
                        "of Triton 3.9); use float16 or float32 on the CPU, or a GPU")


def check_flags(**flags) -> None:
    """Raise TypeError unless each flag is True or False (``deterministic`` may also be None):
    ``bool("false")`` is True, so a string or a number would silently mean something else."""
    for name, value in flags.items():
        if not isinstance(value, bool) and not (name == "deterministic" and value is None):
            also = " or None" if name == "deterministic" else ""
            raise TypeError(f"{name} must be True or False{also}, got {value!r}")


def _check_inputs(q, k, v, scale, lengths_may_differ=False):
    """Raise TypeError / ValueError saying what was expected and what was given."""
    check_qkv(q, k, v, lengths_may_differ)
    n, nk = q.shape[2], k.shape[2]
    if max(n, nk) > MAX_SEQLEN:
        raise ValueError(f"sequence length must be at most {MAX_SEQLEN}, got {max(n, nk)}")
    check_device(q, "q, k and v")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")


def attention(q, k, v, pattern: str | Pattern = "causal", *, scale: float | None = None,
              return_lse: bool = False, deterministic: bool | None = None, cu_seqlens=None, q_pos=None, k_pos=None,
              q_bucket=None, k_bucket=None, block_indices=None, autotune: bool = False, q_proxy=None,
              k_proxy=None, proxy_scale: float | None = None, return_kl: bool = False):
    """Sparse attention through a pattern, with autograd.

    Args:
        q: ``(B, Hq, N, D)``, float16 / bfloat16 (float32 accepted), any strides: a ``(B, N, H, D)``
            tensor passed as ``.transpose(1, 2)`` is read in place.
        k, v: ``(B, Hkv, N, D)``, same dtype and device; Hq a multiple of Hkv (GQA / MQA, K and V
            are never copied).
        pattern: a pattern string (see ``msa_codegen.parse``) or a ``Pattern``; default dense causal.
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the natural-log log-sum-exp, float32 ``(B, Hq, N)`` (differentiable).
        deterministic: whether the backward must give bit-identical gradients from run to run.
            None (default): when ``torch.are_deterministic_algorithms_enabled()``. False allows
            the Gluon family's fused backward (Hopper, the plans whose backward runs there),
            which adds dQ up by TMA reductions in a varying order into an fp32 copy (4 more
            bytes of peak memory per element of q; 0.87x the two-kernel backward's time at
            ``window=4096``, N=131072, D=128; benchmarks/NOTES.md); every
            other backward is deterministic either way. An msa=T term's backward is not
            governed by it (its dQ is added by atomics).
        autotune: when no tuned row of this GPU and length bucket exists for the call's key, tune
            it now (once per process, a short budget, progress on stderr) and store the winner in
            the user database (``msa_codegen.tuning.auto``). Default off: tuning never happens
            implicitly.

    Run-time sparsity (each composes with any pattern; no gradient flows into them; see
    ``msa_codegen.sparsity.inputs`` for the exact semantics):
        cu_seqlens: int32 ``(num_docs + 1,)`` offsets of packed documents along N (B must be 1),
            from 0 to N, non-decreasing. Tokens see only their own document; the pattern's
            positions restart at every document (``sink=4``: each document's first 4 tokens)::

                cu_seqlens = [0, 3, 5], "causal"      k: 0 1 2 3 4
                                                q 0:  x . . . .
                                                q 1:  x x . . .
                                                q 2:  x x x . .
                                                q 3:  . . . x .
                                                q 4:  . . . x x

            One document (``[0, N]``) is the plain pattern and runs its kernels, after the same checks.
        q_pos, k_pos: int32/int64 ``(B, Hq, Nq)`` / ``(B, Hkv, Nk)`` or broadcastable (``(Nq,)``):
            original positions of compacted rows; the pattern is evaluated on them and Nq may
            differ from Nk (not with a ``random=R`` term, whose blocks are drawn over one length:
            ValueError). Non-decreasing along the sequence (blocks are skipped by position
            ranges).
        q_bucket, k_bucket: int32/int64, shaped like the positions: a query sees a key only when
            their buckets are equal. Rows sorted by (bucket, position) (``hash_sort`` does it).
            Buckets of at most ``heuristics.SHORT_BUCKET_KEYS`` keys on average run a launch
            default of their own and no tuning-database row (``explain(..., buckets=True)``).
        block_indices: int32 ``(B, Hkv, ceil(Nq / block), K)`` key-block ids per query block and
            KV head for the pattern term ``topk=K`` (-1 unused, any order, duplicates allowed);
            ``select_blocks`` computes them. Blocks are blocks of rows of the tensors as passed.

    MSA (the pattern term ``msa=T``, one head group of the pattern at most; see
    ``msa_codegen.msa_attention`` for the contract):
        q_proxy: ``(B, Hp, N, Dp)``, the proxy query heads of the msa group's query heads only
            (that group's head count a multiple of Hp); required with an msa term, refused without.
        k_proxy: ``(B, Hpk, N, Dp)``, Hp a multiple of Hpk; same rules.
        proxy_scale: the proxy scores' scale, default ``Dp ** -0.5``.
        return_kl: compute the KL's exact value (one more pass over the selected keys); without it
            the returned kl is 0 but still carries the teaching gradient.
        The msa group ``a-b`` runs ``msa_attention(q[:, a:b+1], k[:, a/g:(b+1)/g], v[...], q_proxy,
        k_proxy, top_k=T, block=..., scale=scale, cu_seqlens=cu_seqlens)`` with g = Hq / Hkv, so it
        must cover whole KV groups (a and b + 1 multiples of g); the other groups run the pattern
        kernels on their heads, and the outputs are joined along the heads in order. With an msa
        term: no return_lse, no q_pos / k_pos / buckets / block_indices, no torch.compile.

    Returns:
        the output ``(B, Hq, N, D)`` in q's dtype and layout (and the LSE). A query that sees no
        key gets a zero row and LSE ``-inf``, and its gradients are zero.

        With an msa term, ``(out, kl)``: kl is ``msa_attention``'s KL, a 0-dim float32 tensor. Add
        it to the loss: its gradient trains q_proxy and k_proxy only (q, k, v get out's gradients
        only). Its value is the exact KL only with ``return_kl=True``, else zero.

    Example::

        out = msa_codegen.attention(q, k, v, "window=4096,dilation=2,sink=64")
        out.sum().backward()

        # heads 0-7 MSA (top 2048 tokens, proxies for those heads), heads 8-15 a window
        out, kl = msa_codegen.attention(q, k, v, "0-7:msa=2048;8-15:window=4096",
                                        q_proxy=q_proxy, k_proxy=k_proxy)
        (task_loss(out) + kl).backward()
    """
    _check_inputs(q, k, v, scale, lengths_may_differ=q_pos is not None)
    check_flags(return_lse=return_lse, deterministic=deterministic, autotune=autotune, return_kl=return_kl)
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    scale = float(d ** -0.5 if scale is None else scale)
    # the run-time kind of the kernels: rows with positions (every run-time input but
    # block_indices), with segments (documents, buckets), with positions restarting per document
    positional = cu_seqlens is not None or q_pos is not None or q_bucket is not None
    segments = cu_seqlens is not None or q_bucket is not None
    classes = cu_seqlens is not None
    run_time = dict(cu_seqlens=cu_seqlens, q_pos=q_pos, k_pos=k_pos, q_bucket=q_bucket, k_bucket=k_bucket,
                    block_indices=block_indices)
    msa_inputs = q_proxy is not None or k_proxy is not None or proxy_scale is not None or return_kl
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if torch.compiler.is_compiling():
        if msa_inputs or _has_msa(pattern if isinstance(pattern, str) else str(pattern)):
            _refuse_msa_compiled()
        return _compiled(q, k, v, pattern, scale, return_lse, positional, segments, classes, run_time, deterministic)
    if parse(pattern).msa_groups:
        return _msa_route[0](q, k, v, pattern, scale, return_lse, autotune, run_time, q_proxy, k_proxy,
                             proxy_scale, return_kl)
    if msa_inputs:
        given = ", ".join(name for name, x in (("q_proxy", q_proxy), ("k_proxy", k_proxy),
                                               ("proxy_scale", proxy_scale), ("return_kl", return_kl or None))
                          if x is not None)
        raise ValueError(f"{given}: inputs of an msa=T pattern term, but pattern "
                         f"{str(parse(pattern))!r} has no msa term (e.g. '0-7:msa=2048;8-15:window=4096')")
    if _one_document(cu_seqlens, q_pos, q_bucket):
        # cu_seqlens = [0, N] is the plain pattern's mask: checked as any cu_seqlens (errors and
        # the once-per-version syncs alike), then run by the plain kernels, which took 0.87x the
        # positional ones' time on the H200 (benchmarks/NOTES.md, 2026-12-02)
        prepare(parse(pattern).head_groups(hq), b, hq, hkv, nq, nk, q.device, **run_time)
        run_time["cu_seqlens"] = None
        positional = segments = classes = False
    dyn, short = None, False
    if segments and not classes:
        # hash buckets: their mean length (checked once per tensor version) picks the launch default
        dyn = prepare(parse(pattern).head_groups(hq), b, hq, hkv, nq, nk, q.device, **run_time)
        short = dyn.bucket_keys <= SHORT_BUCKET_KEYS
    plan = plan_for(pattern, q.device, q.dtype, d, hq, hkv, nq, positional, segments, classes, short)
    dynamic = positional or block_indices is not None or plan.has_topk
    if autotune:
        if dynamic:
            raise ValueError("autotune=True tunes a pattern's own kernels; with run-time sparsity (cu_seqlens, "
                             "positions, buckets, topk) the kernels depend on the data: tune the plain pattern "
                             "(msa-tune --pattern ...) and call without autotune")
        _autotuner(q, k, plan.pattern_text)
        plan = plan_for(pattern, q.device, q.dtype, d, hq, hkv, nq, positional, segments, classes, short)
    forced = _config.override()
    cfg = plan.config if forced is None else forced
    if not dynamic:
        out, lse = run(q, k, v, plan, scale, cfg, deterministic=deterministic)
        return (out, lse) if return_lse else out
    if dyn is None:
        dyn = prepare(plan.head_groups, b, hq, hkv, nq, nk, q.device, **run_time)
    if dyn.positional and nq != nk and plan.has_random:
        raise ValueError(f"random=R needs q and k of one length, got Nq={nq}, Nk={nk}")
    # cu_seqlens: positions are rows minus the document start, so dilated tiles stay strided
    out, lse = run(q, k, v, plan, scale, cfg, dyn.q_pos, dyn.k_pos, dyn.q_seg, dyn.k_seg, dyn.block_indices,
                   deterministic)
    return (out, lse) if return_lse else out


def _one_document(cu_seqlens, q_pos, q_bucket) -> bool:
    """A ``cu_seqlens`` of two offsets and no other row inputs: once checked (0 first, N last),
    one document of all N rows, whose positions are the rows themselves."""
    return (isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 and cu_seqlens.shape[0] == 2
            and q_pos is None and q_bucket is None)


_MSA_NOT_COMPILED = ("attention with an msa=T pattern term (q_proxy, k_proxy) does not run under torch.compile "
                     "yet: MSA's autograd Function and its selection are not traceable; call it outside the "
                     "compiled region (torch.compiler.disable) or run the other heads' pattern compiled")


@torch._dynamo.assume_constant_result
def _has_msa(pattern: str) -> bool:
    return bool(parse(pattern).msa_groups)


@torch._dynamo.disable(reason=_MSA_NOT_COMPILED)   # fullgraph=True: Dynamo's own error quotes it
def _refuse_msa_compiled():
    # run eagerly (a graph break), so that the error reaches the caller: a `raise` in traced code
    # makes Dynamo run the frame eagerly instead, where the msa route would run uncompiled
    raise NotImplementedError(_MSA_NOT_COMPILED)


@torch._dynamo.assume_constant_result
def _compiled_plan(pattern: str, device: str, dtype: str, head_dim: int, hq: int, hkv: int, seqlen: int,
                   positional: bool, segments: bool, classes: bool) -> tuple:
    # Called eagerly under torch.compile (its result is a constant of the graph): building a
    # plan parses, lowers and reads the tuning databases, none of which may be traced.
    # the buckets' lengths are data, unknown here: bucketed calls take the short buckets' default
    plan = plan_for(pattern, torch.device(device), getattr(torch, dtype), head_dim, hq, hkv, seqlen, positional,
                    segments, classes, segments and not classes)
    return plan.pattern_text, plan.config_list, plan.has_topk, plan.has_random


def _compiled(q, k, v, pattern, scale, return_lse, positional, segments, classes, run_time, deterministic):
    """``attention`` under torch.compile: the custom op, with the plan's pattern and config as constants."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    text, config_list, has_topk, has_random = _compiled_plan(
        pattern if isinstance(pattern, str) else str(pattern), str(q.device), str(q.dtype).replace("torch.", ""),
        d, hq, hkv, nq, positional, segments, classes)
    forced = _config.override()
    config_list = list(config_list) if forced is None else as_list(forced)
    if not (positional or run_time["block_indices"] is not None or has_topk):
        out, lse = run_compiled(q, k, v, text, scale, config_list, deterministic=deterministic)
        return (out, lse) if return_lse else out
    dyn = prepare(parse(text).head_groups(hq), b, hq, hkv, nq, nk, q.device, **run_time)
    if dyn.positional and nq != nk and has_random:
        raise ValueError(f"random=R needs q and k of one length, got Nq={nq}, Nk={nk}")
    out, lse = run_compiled(q, k, v, text, scale, config_list, dyn.q_pos, dyn.k_pos, dyn.q_seg, dyn.k_seg,
                            dyn.block_indices, classes, deterministic)
    return (out, lse) if return_lse else out


def explain(q, k, v, pattern="causal", *, proxy_heads: int | None = None, buckets: bool = False):
    """Which launch configuration ``attention(q, k, v, pattern)`` runs, per direction, and why.

    Returns a ``Resolution``: ``.fwd`` / ``.bwd`` hold ``.config`` and ``.source`` (``"user db
    PATH (h200, bucket 131072)"``, ``"heuristic default"``, ...); ``str()`` prints it. For a
    pattern with an ``msa`` group, an ``MsaResolution``: MSA's kernels run with the tuning
    database's row of the group's ``msa=T`` spec (``.msa``, keyed by the group's query heads per proxy
    head: ``proxy_heads`` is the group's Hp, default one per key/value head) or the defaults of
    ``msa_codegen.msa.launch``, the other heads' pattern as above. ``buckets=True``: for a call
    that passes ``q_bucket`` / ``k_bucket`` whose buckets hold at most
    ``heuristics.SHORT_BUCKET_KEYS`` keys on average, which runs the heuristic default of short
    buckets and no database row (the tuner measures patterns without buckets); longer buckets run
    what ``buckets=False`` reports. Inside ``use_config(...)`` the forced configuration is
    reported. Example::

        >>> print(msa_codegen.explain(q, k, v, "window=4096,dilation=2"))   # doctest: +SKIP
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-dim tensor (B, H, N, D), got {getattr(t, 'shape', type(t))}")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query heads must be a multiple of key/value heads, got Hq={hq}, Hkv={hkv}")
    if parse(pattern).msa_groups:
        return _msa_route[1](pattern, hq, hkv, lambda text: explain(q, k, v, text),
                             lambda text, g: tuning_lookup.lookup(q.device, text, q.shape[-1], q.dtype, g,
                                                                  q.shape[2]), proxy_heads)
    res = tuning_lookup.lookup(q.device, pattern, q.shape[-1], q.dtype, hq // hkv, q.shape[2], buckets=buckets)
    forced = _config.override()
    if forced is not None:
        res = dataclasses.replace(res, fwd=tuning_lookup.Choice(forced.fwd, tuning_lookup.OVERRIDE),
                                  bwd=tuning_lookup.Choice(forced.bwd, tuning_lookup.OVERRIDE))
    return res
