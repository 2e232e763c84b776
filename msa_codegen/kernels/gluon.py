"""The Gluon family (Hopper, issue 22): eligibility, rendering, loading and the launchers.

A second forward kernel family behind the same plan: ``templates/gluon/fwd.py.jinja``, rendered
from a head group's ``KernelPlan``, written in Triton's Gluon (``triton.experimental.gluon``):
a persistent, warp-specialised kernel (a 1-warp TMA producer, two 4-warp ``warpgroup_mma``
consumers of 64 query rows each, mbarrier rings), derived from ``benchmarks/gluon_probe.py``'s
``attn_ws2pf`` (582 TFLOP/s against the Triton forward's 495 on the H200, causal
``window=4096``, D=128; benchmarks/NOTES.md "Gluon on Hopper"). Its outputs are the Triton
forward's: o in q's layout and the LSE (B, Hq, N) fp32 in natural-log units of the scaled
scores, so the Triton backward runs on them unchanged.

When it runs: ``MSA_CODEGEN_GLUON=1`` in the environment asks for it on every eligible call,
any other value never; unset, it is chosen automatically for plans of the top-k term alone, for
packed documents (cu_seqlens), for plain windows and for the forward of dense plans at D=128 on
a Triton where its GPU tests ran (``auto_reason``: measured 0.71-1.00x the Triton kernels' time
there).
The variable is read on every call. An asked-for call runs this family when ``why_not`` finds
nothing against it; otherwise the Triton kernels run and the reason is logged once per (plan,
reason) (logger ``msa_codegen.kernels.gluon``: a warning under ``MSA_CODEGEN_GLUON=1``, debug
under the automatic choice). ``describe`` gives
the same answer in words (``msa-codegen which``). Eligible: a CUDA GPU of capability 9.x, bf16 or
fp16, head dim 64 or 128, every head group a plain window or dense pattern, causal or not, with
or without ``sink``, a dilated window (a plain window on each residue class of the rows: one
launch a class on strided views, ``_classes``, N a multiple of the dilation; with a sink of at
most ``MAX_SINK`` keys, its pairs outside the window merged after by a Triton pass,
``_sink_fwd``), the
window or dense terms over packed documents (``cu_seqlens``: each
tile's band clipped to its rows' documents, ``doc_bounds``), or the ``topk=K`` term alone on
128-blocks (``pattern_reason``: the producer loads the blocks a tile's row of ``block_indices``
names), q/k/v/o rows addressable by TMA (``layout_reason``), a positive scale, Nq == Nk, no other
run-time positions or segments. Dense patterns without documents run here at D=128; at D=64
they are routed to the Triton forward (``slower_reason``: one shape measured). Causal dense
tiles are dealt out in pairs of rows (or by cost), causal windows' by the host's list
(``tile_list``), so that programs stay balanced (``tile_order``).
Launches go through ``direct.launch``.

The backward (``templates/gluon/bwd.py.jinja``, from ``benchmarks/gluon_probe_bwd.py``): a
warp-specialised dK/dV kernel (a program per 128 keys of a KV head, its GQA query heads summed
inside, no atomics) and a dQ kernel in the forward's layout, after the Triton stats pass
``msa_bwd_pre``; for a call that need not be deterministic (``attention(deterministic=...)``),
one fused kernel instead: the dK/dV kernel computes dQ too and adds it by TMA reduce-adds
(``fused_reason``). Run by ``launch.backward`` under the same variable when ``why_not_bwd`` finds
nothing against the call: causal or bidirectional windows, dilated or not, or with a sink of at
most ``MAX_SINK`` keys (the sink's pairs outside the window by a Triton pass, ``kernels/sink.py``),
dense over packed documents, top-k, Hopper, bf16 / fp16, head dim 64 or 128, layouts TMA addresses,
no KV head split between head groups.

Nothing here imports Gluon until a kernel is rendered or loaded: ``import msa_codegen`` works
on any Triton and without a GPU. ``api()`` feature-detects the names the template needs (they
moved between Triton 3.6 and 3.9). The rendered source is not part of ``render.kernel_hash``:
the family's own tuning rows (``msa-tune --family gluon``, ``tuning/gluon_search.py``) are keyed by
``kernel_hash`` here, and set its knobs (``FIELDS``: the forward's tile order, the rings'
depths); the launchers read them through the call's plan (``config``), or an override
(``use_gluon_config``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import heapq
import logging
import os
import threading

import torch
import triton

from ..pattern.lowering import KernelPlan
from ..version import __version__
from ..sparsity.inputs import TensorLRU
from ..sparsity.tables import inverse_table, merged_block_tables
from . import direct
from . import render as _render

ENV = "MSA_CODEGEN_GLUON"
TEMPLATE = "gluon/fwd.py.jinja"   # a family of its own: not among templates_digest's *.jinja
TEMPLATE_BWD = "gluon/bwd.py.jinja"
HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
BLOCK_MC = 64    # query rows of one consumer warpgroup (a program's tile: 2 x 64)
BLOCK_N = 128    # keys of one K/V tile
#: K/V ring depth by head dim: D=128 fits 2 slots beside Q and O's buffers (196,936 B of sm_90's
#: 232,448; 3 would need 262,536, the probe's figure), D=64 fits 3
RING = {64: 3, 128: 2}
#: registers a thread at launch: 9 warps round up to 3 warpgroups; the template's setmaxnreg
#: moves them from the producer (24) to the consumers (240)
MAXNREG = 168
REGS = (24, 240)
MAX_SEQLEN = 1 << 30   # the band arithmetic (q0 + WINDOW) stays inside int32
#: top-k slots a table row may have: the kernel counts a row's valid entries in an unrolled loop
TOPK_SLOTS = 64
#: backward tiles (the probe's, benchmarks/gluon_probe_bwd.py): dK/dV a program of 2 x 64 keys
#: streaming 64-query tiles of Q and dO; dQ a program of 2 x 64 rows streaming 128-key tiles
BWD_BLOCK_M = 64
BWD_RING = {64: 2, 128: 2}   # D=128: dQ's Q, dO and 2 x (K, V) slots take 196,608 B (probe); 3 would not fit

#: the most sink keys the Gluon family takes where the sink pass runs (the backward, the dilated
#: forward); a longer sink runs the Triton family there. The pass's time grows with the keys:
#: forward+backward at ``window=4096`` N=131072 H=16 D=128 0.85x / 0.90x the time with the
#: Triton backward at 128 / 256 keys (H200, Triton 3.6, 2026-12-06); longer sinks not measured
MAX_SINK = 256
#: sink keys a program of the sink pass holds (K, V, dK, dV in registers); a longer sink runs in
#: chunks of this many keys (``kernels/sink.py``)
SINK_KEYS = 64
_LONG_SINK = "the sink pass's work grows with the sink's keys"
#: the fused backward's sink of several key chunks: True (the default) runs one launch a chunk,
#: each adding to the fp32 dQ copy in place, its row loop pipelined (the last converting); False
#: the two-kernel form's two launches, the second converting, whose row loops are not pipelined.
#: H100, Triton 3.6, ``window=4096`` N=131072 H=16 D=128 (benchmarks/NOTES.md, "A long sink in
#: the fused backward"): the pass 2.47 against 3.34 ms of kernel time at 128 keys, 4.68 against
#: 5.66 at 256
SINK_CHUNK_LAUNCHES = True
#: programs the sink pass aims at (rows cut into chunks so that B x heads x chunks reach it)
SINK_PROGRAMS = 512
#: the dilated forward's sink merge (``sink_fwd``), query rows a tile
SINK_FWD_ROWS = 64
#: the backward's sink pass: query rows a tile by head dim, and the pipelining stages of its row
#: loops (``tl.range``'s num_stages). 64 rows at 3 stages ran the pass fastest of 64 rows at 1-3
#: stages (4 at D=64; at D=128 4 needs 280 KB of shared memory) and 32 rows at 2-4: alone at
#: ``window=4096,sink=64`` N=131072, fused form, 1.066 ms against 1.686 for the branchy loop
#: before; H=32 D=64 1.298 against 1.962 (H100, 2026-12-06; benchmarks/NOTES.md). At D=128 it
#: spills 2 / 1 stores / loads (two-kernel form 4 / 2; sm_90, Triton 3.6, ``aot_compile_sink``)
SINK_BWD_ROWS = {64: 64, 128: 64}
SINK_BWD_STAGES = 3
#: warps of both sink passes: at 4 ``sink_bwd`` spills at D=128 (150 / 144 stores / loads in the
#: fused form, sm_90, Triton 3.6, ``aot_compile_sink``); ``sink_fwd`` spills at neither, and its 8
#: were not timed against 4
SINK_WARPS = 8

log = logging.getLogger(__name__)
_lock = threading.Lock()
_modules: dict[tuple[KernelPlan, str], object] = {}
_noted: set[tuple] = set()


#: Triton versions (major.minor) on which the family passed its GPU tests (H200, Triton 3.6.0,
#: 2026-12-03). With ENV unset it runs automatically only there: elsewhere it is opt-in
GPU_TESTED = ("3.6",)


def requested(kplans=(), n: int | None = None, backward: bool = False, head_dim: int | None = None,
              flops: float | None = None) -> bool:
    """Whether a call of these head groups' plans (N rows, head dim D, ``flops`` of forward work:
    ``window_flops``; its forward, or its backward) asks for the Gluon family, read on every
    call (one process can time both families): ``MSA_CODEGEN_GLUON=1`` always (where eligible),
    any other value never; unset, the automatic choice (``auto_reason``)."""
    setting = os.environ.get(ENV)
    if setting is not None:
        return setting == "1"
    return auto_reason(kplans, n, backward, head_dim, flops) is None


#: the automatic choice takes the Gluon backward of packed documents from this length on: at
#: N=8192 (H=16, D=128) and N=4096 (H=12, D=64) its forward + backward measured 1.02-1.49x the
#: Triton kernels' time, at N=16384 0.70-0.76x (H200, Triton 3.6, 2026-12-04, one process; the
#: forward was faster at every length, 0.69-0.90x)
DOCS_BWD_MIN_N = 16384


def _plain_dense(kplan: KernelPlan) -> bool:
    """A dense plan without packed documents or top-k (no locality term at all)."""
    return kplan.dense and not kplan.has_window and not kplan.documents and not kplan.topk


@functools.lru_cache(maxsize=256)   # asked on every call's route (launch._gluon_route)
def _plain_window(kplan: KernelPlan) -> bool:
    """A plain window plan the family runs (``pattern_reason``): with or without a sink, dilated
    or not (its residue classes as strided views, ``_classes``); no run-time rows, top-k, global
    or random blocks."""
    return kplan.has_window and not (kplan.positional or kplan.segments) and pattern_reason(kplan) is None


#: the automatic choice takes plain-window calls of at least this much forward work
#: (``window_flops``) into the Gluon family. Below it the Gluon call's longer host path outweighs
#: its faster kernels. H100, Triton 3.6, 2026-12-05, forward+backward time, Gluon against Triton:
#: 1.24-1.54x at 3-30 GFLOP (``gluon_bench.py --shape``); through ``attention`` (msa-bench, D=64,
#: B=8, H=12) ``causal=false,window=256`` N=4096 (50 GFLOP) 1.18x, 512 at N=4096 (96 GFLOP)
#: 0.99x, 256 at N=8192 (101 GFLOP) 0.86x, 512 at N=8192 (200 GFLOP) 0.84x. (On an H200's host,
#: 12-05, the 50 GFLOP row ran at 0.84x: the crossing depends on the CPU.)
WINDOW_MIN_FLOPS = float(1 << 36)


def _band_pairs(kplan: KernelPlan, n: int) -> int:
    """Visible (query, key) pairs of one head of a plain window plan over N rows (a sink's keys
    are not counted): W keys a row up to its own, and W - 1 after it when bidirectional, clipped
    at the ends; a dilated window's on each residue class of the rows."""
    def band(rows: int) -> int:
        w = min(kplan.window, rows)
        left = w * rows - w * (w - 1) // 2
        return left if kplan.causal else 2 * left - rows

    dil = kplan.dilation
    return sum(band(len(range(c, n, dil))) for c in range(dil))


def window_flops(groups, batch: int, n: int, head_dim: int) -> float | None:
    """Forward FLOPs (4 D per visible pair) of a call whose head groups are ``groups`` ((heads,
    kernel plan) pairs) over ``batch`` x N rows, when every plan is a plain window
    (``_plain_window``); None otherwise (the length rule is for plain windows only)."""
    if not groups or not all(_plain_window(kp) for _, kp in groups):
        return None
    return 4.0 * head_dim * batch * sum(heads * _band_pairs(kp, n) for heads, kp in groups)


def _gluon_dense(kplans, head_dim) -> bool:
    """Dense plans (no window, documents or top-k) whose forward runs faster in Gluon: D=128.
    H200, Triton 3.6, bf16, 2026-12-04, one process, against the Triton forward's time: causal
    in pairs of rows (``tile_order``) 0.66x / 0.81x / 0.90x / 0.90x at N=4096 / 8192 / 16384 /
    32768 (B=1, H=16), 0.86x at B=4 N=8192; by cost (an odd number of query tiles) 0.71-0.98x,
    head-major 0.93-1.21x; bidirectional N=16384 0.92x. D=64 (causal, H=32, N=16384): pairs
    0.96x, head-major 0.99x, by cost 1.01x: D=64 stays on Triton (one shape measured)."""
    return bool(kplans) and head_dim == 128 and all(map(_plain_dense, kplans))


def auto_reason(kplans, n: int | None = None, backward: bool = False, head_dim: int | None = None,
                flops: float | None = None) -> str | None:
    """Why the automatic choice (``MSA_CODEGEN_GLUON`` unset) keeps a call of these head groups'
    plans on the Triton kernels (None: it asks for the Gluon family), on a Triton where the
    family passed its GPU tests. Automatic: plans of the top-k term alone, of packed documents
    (cu_seqlens) and of plain windows (``_plain_window``: a sink allowed, or dilated), in any
    mix; the forward of dense plans at D=128 (``_gluon_dense``). Measured against the Triton
    family (H200, benchmarks/NOTES.md; forward / forward+backward time): top-k 0.75x / 0.75x
    (N=131072, 2026-12-03); documents of 1k-16k, ``window=4096``, 0.72-0.75x / 0.73-0.74x
    (2026-12-04), dense causal 0.89x / 0.79x; plain windows (2026-12-05) ``window=4096`` 0.85x /
    0.80x, 15 shapes from B=8 N=4096 D=64 to N=32768 D=128 0.75-1.00x / 0.73-1.00x, the short
    encoder rows (B=8, N=4096-8192, D=64) through ``attention`` 0.83-0.85x forward+backward;
    dilated windows (H100, 2026-12-06, msa-bench) ``window=4096,dilation=2`` 0.83x / 0.74x,
    ``dilation=4`` 0.81x / 0.77x; with ``sink=64`` 0.88x / 0.75x (H100, 2026-12-06); the Gluon
    backward of ``window=4096,sink=64`` (the sink pass) 0.86x the Triton backward's
    forward+backward time through ``attention``, equal (1.00x) at ``causal=false,window=256,sink=4``
    B=8 N=4096 D=64.
    Their backward is fused where the call need not be deterministic and the fp32 dQ copy is
    small enough (``fused_reason``), two Gluon kernels otherwise. Calls of plain windows alone
    under ``WINDOW_MIN_FLOPS`` of forward work (``flops``, ``window_flops``; a dilated window's
    launches are one a residue class: that much a class, d times as much in all) and short
    packed-document calls' backward (``DOCS_BWD_MIN_N``) take the Triton kernels. Dense plans
    have no Gluon backward without documents: the Triton backward runs on the Gluon forward's
    o and LSE. ``n``: the call's length, ``flops`` its work (None: not known, no length or
    size rule); ``head_dim`` None: not known (no dense plan is automatic)."""
    both = bool(kplans) and all(kp.topk or kp.documents or _plain_window(kp) for kp in kplans)   # both directions
    if not (both or _gluon_dense(kplans, head_dim)):
        return "automatic for top-k, packed-document (cu_seqlens), plain-window and dense D=128 plans only"
    if backward and not both:
        return "the forward only for dense plans (the family's dense backward needs packed documents)"
    dil = max((kp.dilation for kp in kplans), default=1)
    if flops is not None and flops < WINDOW_MIN_FLOPS * dil and all(map(_plain_window, kplans)):
        each = f", {dil} times that with dilation={dil} (a launch a residue class)" if dil > 1 else ""
        return (f"plain windows from {WINDOW_MIN_FLOPS / 1e9:.1f} GFLOP of forward work on{each} ({flops / 1e9:.3g} "
                f"here: the Triton kernels measured faster on short calls)")
    if backward and n is not None and n < DOCS_BWD_MIN_N and any(kp.documents for kp in kplans):
        return (f"the backward of packed documents is automatic from N={DOCS_BWD_MIN_N} on (N={n}: the "
                f"Triton backward measured faster)")
    version = ".".join(triton.__version__.split(".")[:2])
    if version not in GPU_TESTED:
        return (f"automatic only on Triton {', '.join(GPU_TESTED)}, where its GPU tests ran "
                f"(this is {triton.__version__})")
    return None


@contextlib.contextmanager
def forced(setting: str):
    """``MSA_CODEGEN_GLUON=setting`` inside the block ("1": every eligible call runs the family,
    "0": none does), then the variable as it was: what the tuners time is their own family's
    kernels, whatever the automatic choice would run."""
    before = os.environ.get(ENV)
    os.environ[ENV] = setting
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def _setting() -> str:
    """The words for how the family was asked for, or not: the variable's value or the automatic choice."""
    setting = os.environ.get(ENV)
    return f"{ENV}={setting}" if setting is not None else f"{ENV} unset: automatic"


@functools.lru_cache(maxsize=1)
def api() -> tuple[dict | None, str | None]:
    """(names, None) when this Triton's Gluon has what the template needs, else (None, why).

    Triton 3.6 names the TMA copies ``async_copy_global_to_shared`` / ``async_copy_shared_to_global``;
    3.9 keeps the first and replaces the second by ``async_store`` (checked 2026-12-03 on 3.6.0
    and 3.9.0): the newer names are used where they exist."""
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except Exception as e:   # an old Triton, a build without the NVIDIA backend, ...
        return None, f"this Triton ({triton.__version__}) has no usable Gluon for Hopper ({type(e).__name__}: {e})"
    missing = [name for mod, name in ((gl, "warp_specialize"), (gl, "NVMMADistributedLayout"),
                                      (gl, "NVMMASharedLayout"), (gl, "DotOperandLayout"),
                                      (hopper, "warpgroup_mma"), (hopper, "warpgroup_mma_wait"),
                                      (hopper, "fence_async_shared"), (mbarrier, "MBarrierLayout"),
                                      (tma, "store_wait"))
               if not hasattr(mod, name)]
    load = next((n for n in ("async_load", "async_copy_global_to_shared") if hasattr(tma, n)), None)
    store = next((n for n in ("async_store", "async_copy_shared_to_global") if hasattr(tma, n)), None)
    missing += [what for what, n in (("a TMA load", load), ("a TMA store", store)) if n is None]
    if missing:
        return None, f"this Triton's ({triton.__version__}) Gluon lacks {', '.join(missing)}"
    return {"tma_load": load, "tma_store": store, "tma_add": _tma_add_name(), "halves": _halves_compile()}, None


def _halves_compile() -> bool:
    """Whether the forward peels its half key tiles (the template's ``_halves``): Triton before
    3.9. Triton 3.9 (ptxas 13 for sm_90, run at ``--regAllocOptLevel=2``) compiles the peeled
    consumers with 12 spill stores / 37 loads, one reload a key tile in each loop, and that
    cubin ran `window=4096` 1.13x as long as 3.6's (``benchmarks/cross_triton.py``, H100,
    2026-12-06); 3.6 and 3.8 compile it without a spill."""
    return tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9)


def _tma_add_name() -> str | None:
    """How this Triton's Gluon issues a TMA reduce-add (the fused backward's dQ): 3.9's
    ``tma.async_atomic_add``; in 3.6 the builder's ``create_async_tma_reduce`` without a Gluon
    wrapper (``builder``: the template defines one); None: neither."""
    from triton.experimental.gluon.language.nvidia.hopper import tma

    if hasattr(tma, "async_atomic_add"):
        return "async_atomic_add"
    try:
        from triton._C.libtriton import gluon_ir, ir
    except ImportError:
        return None
    ok = hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce") and hasattr(ir, "DESCRIPTOR_REDUCE_KIND")
    return "builder" if ok else None


# ---- eligibility ----------------------------------------------------------------------------

def pattern_reason(kplan: KernelPlan) -> str | None:
    """Why one head group's plan cannot run this family (None: it can). Of the run-time inputs,
    packed documents (``cu_seqlens``: ``documents``) run here, with a window or dense, no sink: a
    tile's band is clipped to its rows' documents (``doc_bounds``)."""
    if kplan.positional or kplan.segments:
        if not kplan.documents:
            return "run-time positions or segments (q_pos/k_pos, buckets)"
        for name, value in (("topk", kplan.topk), ("sink", kplan.sink)):
            if value:
                return f"{name}={value} with cu_seqlens (documents run the window or dense terms alone here)"
    if kplan.topk:
        return topk_reason(kplan)
    if kplan.has_window and kplan.dilation != 1:
        # a dilated window is a plain window on each residue class of the rows, which the
        # launchers run as strided views (``_classes``); a document's rows span the classes, and
        # a sink's keys too: its pairs outside the window run in a pass of their own
        # (``_sink_fwd``), whose work grows with the sink's keys
        if kplan.documents:
            return f"dilation={kplan.dilation} with cu_seqlens (the residue classes run apart here)"
        if kplan.sink > MAX_SINK:
            return f"dilation={kplan.dilation} with sink={kplan.sink} > {MAX_SINK} ({_LONG_SINK})"
    for name, value in (("global", kplan.global_), ("random", kplan.random), ("topk", kplan.topk)):
        if value:
            return f"{name}={value}"
    if not (kplan.dense or kplan.has_window):
        return "sink without a window (no band)"
    return None


def topk_reason(kplan: KernelPlan) -> str | None:
    """Why a top-k plan cannot run this family (None: it can): the term alone (no window, sink,
    global or random blocks beside it), causal or not, on 128-blocks (a query block is one
    program tile of 2 x 64 rows and a key block one 128-key tile), at most TOPK_SLOTS slots."""
    others = [name for name, value in (("window", kplan.has_window), ("sink", kplan.sink), ("global", kplan.global_),
                                       ("random", kplan.random)) if value]
    if others:
        return f"topk={kplan.topk} with {', '.join(others)} (the family runs the top-k term alone)"
    if kplan.rblock != BLOCK_N:
        return f"block={kplan.rblock} (top-k runs on {BLOCK_N}-blocks here)"
    if kplan.topk > TOPK_SLOTS:
        return f"topk={kplan.topk} (at most {TOPK_SLOTS} slots: a row's count is unrolled)"
    return None


def device_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why a device / dtype / head dim cannot run this family (None: they can)."""
    if device.type != "cuda":
        return f"device {device} is not a CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    return capability_reason(f"{major}.{minor}", dtype, head_dim)


def capability_reason(capability: str, dtype: torch.dtype, head_dim: int) -> str | None:
    if not str(capability).startswith("9."):
        return f"compute capability {capability} (the family is Hopper's, 9.x)"
    if dtype not in DTYPES:
        return f"dtype {str(dtype).replace('torch.', '')} (bf16 or fp16)"
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} ({' or '.join(map(str, HEAD_DIMS))})"
    return None


def _rows_view(x: torch.Tensor) -> tuple[tuple[int, int, int], int, int] | None:
    """How TMA sees x (B, H, N, D): a 2-D matrix [rows, cols] of row stride x.stride(2) whose rows
    n of (b, h) are row b * xb + h * xh + n at columns h * xhc .. h * xhc + D; ((xb, xh, xhc), rows,
    cols), or None when x's strides do not decompose so (the contiguous (B, H, N, D) layout, the
    (B, N, H, D) one transposed and slices of a packed last dim do)."""
    b, h, n, d = x.shape
    s0, s1, sn, sd = x.stride()
    if sd != 1 or sn < d:
        return None
    if b > 1 and s0 % sn:
        return None
    xb = s0 // sn if b > 1 else 0
    if h == 1:
        xh = xhc = 0
    elif s1 % sn == 0:
        xh, xhc = s1 // sn, 0
    elif s1 * (h - 1) + d <= sn:
        xh, xhc = 0, s1    # heads side by side within a row: (B, N, H, D) transposed
    else:
        return None
    return (xb, xh, xhc), (b - 1) * xb + (h - 1) * xh + n, (h - 1) * xhc + d


def layout_reason(*tensors: torch.Tensor) -> str | None:
    for name, x in zip("qkvo", tensors):
        view = _rows_view(x)
        if view is None:
            return f"{name}'s strides {tuple(x.stride())} (rows of one head at one stride, D contiguous)"
        elem = x.element_size()
        if x.data_ptr() % 16 or (x.stride(2) * elem) % 16:
            return f"{name} is not 16-byte aligned (TMA), base or row stride"
        if view[1] >= 1 << 31:
            return f"{name} spans {view[1]} rows (TMA coordinates are 32-bit)"
    return None


def _length_reason(kplans, n: int) -> str | None:
    """Why N rows cannot be split into the residue classes of these plans' dilations (None:
    every dilation divides N, or none is above 1)."""
    for dil in sorted({kp.dilation for kp in kplans} - {1}):
        if n % dil:
            return (f"dilation={dil} with N={n}, not a multiple of it (each residue class of the rows runs "
                    f"as a strided view)")
    return None


def _classes_reason(plan, *tensors: torch.Tensor) -> str | None:
    """Why a dilated head group's residue classes cannot run as strided views of the rows
    (``_classes``; None: they can, or no group is dilated): N a multiple of the dilation
    (``_length_reason``), and the views addressable by TMA (rows c, c + d, ... of one head at d
    times the row stride)."""
    kplans = [grp.kernel_plan for grp in plan.groups]
    why = _length_reason(kplans, tensors[0].shape[2])
    if why:
        return why
    for dil in sorted({kp.dilation for kp in kplans} - {1}):
        why = layout_reason(*(x[:, :, ::dil] for x in tensors))
        if why:
            return f"dilation={dil}, a residue class of the rows: {why}"
    return None


def _classes(dil: int, *tensors: torch.Tensor) -> list[tuple]:
    """Per residue class c of the rows (c = 0 .. dil - 1), the tensors' rows c, c + dil, ... as
    strided views (B, H, N / dil, D): a dilated window is a plain window on each class. One
    class, the tensors themselves, when dil is 1."""
    if dil == 1:
        return [tensors]
    return [tuple(x[:, :, c::dil] for x in tensors) for c in range(dil)]


def why_not(plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> str | None:
    """Why this call cannot run the Gluon forward (None: it runs it). ``plan``: its AttentionPlan."""
    why = _groups_reason(plan, pattern_reason) or _call_reason(q, k)
    if why:
        return why
    if not scale > 0:
        return f"scale {scale} (positive scales only)"
    return layout_reason(q, k, v) or _classes_reason(plan, q, k, v) or api()[1]


def _groups_reason(plan, reason) -> str | None:
    """The first head group's ``reason(kernel_plan)``, naming its heads when there are several."""
    for grp in plan.groups:
        why = reason(grp.kernel_plan)
        if why:
            return f"heads {grp.h0}-{grp.h1 - 1}: {why}" if len(plan.groups) > 1 else why
    return None


def _call_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """What both directions ask of a call's device, dtype, head dim and lengths."""
    why = device_reason(q.device, q.dtype, q.shape[-1])
    if why:
        return why
    if k.shape[2] != q.shape[2]:
        return f"Nq {q.shape[2]} != Nk {k.shape[2]}"
    if q.shape[2] >= MAX_SEQLEN:
        return f"N {q.shape[2]} >= {MAX_SEQLEN}"
    return None


def slower_reason(kplans, head_dim: int | None = None) -> str | None:
    """Why the Triton forward is the faster of the two for these head groups' plans at head dim
    ``head_dim`` (None: Gluon measured faster). ``why_not`` says what the family can run; this
    says where it pays. Dense plans without documents run faster in Gluon at D=128 only
    (``_gluon_dense``). Over packed documents the dense forward is the faster one: causal, 13
    documents of 1k-16k, N=131072, H=16, 11.54 ms against 13.46 (H200, Triton 3.6, 2026-12-04).
    The GPU tests run every dense kernel directly (``forward``)."""
    dense = [kp for kp in kplans if _plain_dense(kp)]
    if dense and not _gluon_dense(dense, head_dim):
        return (f"dense pattern (no window) at D={head_dim}: Gluon runs dense plans at D=128 only (at D=64 one "
                "shape measured, causal N=16384: 0.96-1.01x the Triton forward's time)")
    return None


def bwd_pattern_reason(kplan: KernelPlan) -> str | None:
    """Why one head group's plan cannot run the Gluon backward (None: it can): a causal or
    bidirectional window (dilated too: its residue classes), with a sink of at most ``MAX_SINK``
    keys (its pairs outside the window: ``_sink_pass``), or the forward's top-k plans
    (``topk_reason``), nothing else. Dense plans have no band to tile, except over packed
    documents (each document is the band)."""
    why = pattern_reason(kplan)
    if why:
        return why
    if kplan.topk:
        return None
    if kplan.sink > MAX_SINK:
        return f"sink={kplan.sink} > {MAX_SINK} ({_LONG_SINK})"
    if not (kplan.has_window or kplan.documents):
        return "dense pattern (no window): the Gluon backward tiles a window's band"
    return None


def why_not_bwd(plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why this call's backward cannot run the Gluon kernels (None: it runs them). A gradient of
    the returned LSE is fine: msa_bwd_pre folds it into delta. dO of any strides is copied to a
    layout TMA reads; dq / dk / dv are allocated so."""
    why = _groups_reason(plan, bwd_pattern_reason)
    if why:
        return why
    if plan.split_kv_heads:
        return "a KV head's query heads fall in two head groups (dK/dV partial sums)"
    return _call_reason(q, k) or layout_reason(q, k, v) or _classes_reason(plan, q, k, v) or api()[1]


#: the fused backward's fp32 copy of dQ (4 bytes an element of q) at most this size: above it
#: the two Gluon kernels run, so that a long call's peak memory stays near 1.2x its tensors' bytes
#: (the fused form's is about 1.45x; 8 GiB more at N=1M, H=16, D=128). 2 GiB keeps the fused form
#: at N=131072 with 32 query heads of D=128.
FUSED_DQ_MAX_BYTES = 2 << 30


def fused_reason(kplans=(), group: int = 1, q_numel: int | None = None) -> str | None:
    """Why a call of these head groups' plans, ``group`` query heads a KV head, ``q_numel``
    elements of q (None: not known, no size rule), takes the two-kernel backward when it need not
    be deterministic (None: the fused form runs, ``backward(fused=True)``): a Triton whose Gluon
    has no TMA reduce-add (it adds dQ by them); an fp32 dQ copy over ``FUSED_DQ_MAX_BYTES``; or a
    top-k plan with GQA, where the fused form measured 1.04x the two kernels' time (``topk=16``,
    32/8 heads, N=131072; H200, Triton 3.6, 2026-12-04), with the two-kernel side slowed by up to
    4% by the measurement itself (BENCHMARKS.md; not re-timed without that bias). Measured faster
    elsewhere: 0.87-0.95x the two kernels' backward on windows; forward + backward 0.927x on
    packed documents (``window=4096``) and 0.961x on ``topk=16`` without GQA
    (``benchmarks/fused_ab.py``, 2026-12-04 16:46 UTC)."""
    names, why = api()
    if names is None:
        return why
    if names["tma_add"] is None:
        return f"this Triton's ({triton.__version__}) Gluon has no TMA reduce-add"
    if q_numel is not None and 4 * q_numel > FUSED_DQ_MAX_BYTES:
        return (f"its fp32 dQ copy would take {4 * q_numel / 2**30:.2f} GiB (the fused form runs up to "
                f"{FUSED_DQ_MAX_BYTES / 2**30:g} GiB)")
    if group > 1 and any(kp.topk for kp in kplans):
        return f"top-k with {group} query heads a KV head: the fused backward measured slower there"
    return None


def note(plan, why: str, family: str = "forward") -> None:
    """Log once per (plan, reason, family) that the Triton kernels run instead of the requested
    Gluon ones; family: forward or backward. A warning when ``MSA_CODEGEN_GLUON=1`` asked for
    them; at debug level when the automatic choice did (a CPU tensor, another GPU, a layout:
    nothing the caller asked for is refused)."""
    key = (plan.key, why, family)
    if key not in _noted:
        _noted.add(key)
        level = logging.WARNING if os.environ.get(ENV) == "1" else logging.DEBUG
        log.log(level, "%s: the Triton %s runs for %r (%s): %s", _setting(), family, plan.pattern_text,
                str(plan.key[2]).replace("torch.", ""), why)


def describe(groups, capability: str, dtype: torch.dtype, head_dim: int, flops: float | None = None,
             n: int | None = None) -> str:
    """One line for ``msa-codegen which``: the forward family a call of these head groups' plans
    (``flops`` of forward work, ``window_flops``; None: not known; ``n`` rows, for a dilated
    window's residue classes: None, not known) runs on this capability / dtype / head dim, and
    why not Gluon."""
    why = next((pattern_reason(kp) for kp in groups if pattern_reason(kp)), None)
    why = why or (n is not None and _length_reason(groups, n)) or None
    why = why or slower_reason(groups, head_dim) or capability_reason(capability, dtype, head_dim) or api()[1]
    return _describe("forward", groups, why, head_dim, flops, n)


def _describe(family: str, groups, why: str | None, head_dim: int | None = None, flops: float | None = None,
              n: int | None = None) -> str:
    if not requested(groups, head_dim=head_dim, flops=flops):
        state = "eligible" if why is None else f"not eligible: {why}"
        setting = os.environ.get(ENV)
        asked = (f"{ENV}={setting}" if setting is not None
                 else f"{ENV} is not set, {auto_reason(groups, head_dim=head_dim, flops=flops)}")
        return f"{family} kernels: triton ({asked}; gluon {state})"
    if why is None:
        short = ""
        if flops is None and os.environ.get(ENV) is None and groups and all(map(_plain_window, groups)):
            short = f"; plain-window calls under {WINDOW_MIN_FLOPS / 1e9:.1f} GFLOP of forward work run triton"
        # N unknown: a dilated window's residue classes may not divide it
        dilated = n is None and any(kp.dilation > 1 for kp in groups)
        classes = ", or N not a multiple of the dilation," if dilated else ""
        return (f"{family} kernels: gluon ({_setting()}; inputs whose strides TMA cannot address{classes} run "
                f"triton{short})")
    return f"{family} kernels: triton ({_setting()}, but gluon is not eligible: {why})"


def describe_bwd(groups, capability: str, dtype: torch.dtype, head_dim: int, group: int = 1,
                 flops: float | None = None, q_numel: int | None = None, n: int | None = None) -> str:
    """``describe``'s line for the backward: the family of dq / dk / dv, and why not Gluon; for
    the Gluon backward, whether a call that need not be deterministic runs it as one fused
    kernel (``fused_reason``, ``group`` query heads a KV head, ``q_numel`` elements of q: None,
    not known)."""
    why = next((bwd_pattern_reason(kp) for kp in groups if bwd_pattern_reason(kp)), None)
    why = why or (n is not None and _length_reason(groups, n)) or None
    why = why or capability_reason(capability, dtype, head_dim) or api()[1]
    line = _describe("backward", groups, why, head_dim, flops, n)
    if line.startswith("backward kernels: gluon"):
        not_fused = fused_reason(groups, group, q_numel)
        line += ("; one fused kernel unless the call is deterministic" if not_fused is None
                 else f"; two kernels (dK/dV, dQ) even where the call need not be deterministic: {not_fused}")
        if not_fused is None and q_numel is None:
            line += f" and its fp32 dQ copy takes at most {FUSED_DQ_MAX_BYTES / 2**30:g} GiB"
    return line


# ---- rendering and loading ------------------------------------------------------------------

def render(kplan: KernelPlan, direction: str = "fwd", names: dict | None = None) -> str:
    """The Gluon source of one head group's plan, its forward (``fwd``) or backward (``bwd``:
    dK/dV and dQ); raises ValueError when the plan is not eligible or this Triton's Gluon lacks
    what the kernel needs. ``names``: the API names rendered in (default: ``api()``'s). A dilated
    window with a sink renders the kernels its residue classes run (``_class_plan``: the window
    alone; the sink's pairs are ``kernels/sink.py``'s)."""
    why = pattern_reason(kplan) if direction == "fwd" else bwd_pattern_reason(kplan)
    if why:
        what = "this plan" if direction == "fwd" else "this plan's backward"
        raise ValueError(f"the Gluon family does not run {what}: {why}")
    if names is None:
        names, why = api()
        if names is None:
            raise ValueError(why)
    meta = {"version": __version__, "triton": triton.__version__}
    template = TEMPLATE if direction == "fwd" else TEMPLATE_BWD
    return _render._env().get_template(template).render(plan=_class_plan(kplan), meta=meta, api=names,
                                                          maxnreg=MAXNREG, regs=REGS)


def load(kplan: KernelPlan, direction: str = "fwd"):
    """The loaded module of a plan's Gluon kernels (``fwd`` or ``bwd``), written under
    ``render.home()/kernels`` (named by a hash of its source) and kept in memory."""
    key = (kplan, triton.__version__, direction)
    mod = _modules.get(key)
    if mod is not None:
        return mod
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            body = render(kplan, direction)
            digest = hashlib.sha256(body.encode()).hexdigest()
            path = _render.home() / "kernels" / f"msa_gluon_{direction}_{digest[:20]}.py"
            text = f"{_render._DIGEST_PREFIX}{digest}\n{body}"
            if not _render._read_valid(path):
                _render._write_atomic(path, text)
            mod = _modules[key] = _render.import_file(f"msa_codegen_kernels.{path.stem}", path)
    return mod


# ---- launcher -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _smem_layout(block: tuple[int, int], dtype: torch.dtype):
    """The NVMMA shared layout of a TMA block (computing it took 4 us a descriptor, on every call);
    bf16 / fp16 operands, fp32 for the fused backward's copy of dQ."""
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


@functools.lru_cache(maxsize=1)
def _descriptor_class():
    """(Gluon's Hopper TensorDescriptor, the values of its fields with defaults), the second None
    when its fields are not the five this module fills plus defaulted ones (a Triton that
    changed the class: every descriptor then goes through its constructor)."""
    import dataclasses

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    fields = dataclasses.fields(TensorDescriptor)
    required = {f.name for f in fields if f.default is dataclasses.MISSING}
    if required != {"base", "shape", "strides", "block_shape", "layout"} or any(
            f.default_factory is not dataclasses.MISSING for f in fields):
        return TensorDescriptor, None
    return TensorDescriptor, {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}


def _descriptor(x: torch.Tensor, rows: int, cols: int, block: list[int]):
    """x's TMA descriptor as a 2-D view [rows, cols] of row stride x.stride(2) (``_rows_view``).
    Built without the dataclass's ``__post_init__``: its checks (ranks, the last stride 1, 16-byte
    alignment of the base and the row stride, the block shape) are ``layout_reason``'s, which
    every tensor a launcher passes here has met. A descriptor took 2.4 us through the
    constructor, 1.1 this way (our CPU, Triton 3.9; 13 descriptors a forward + backward)."""
    cls, defaults = _descriptor_class()
    layout = _smem_layout(tuple(block), x.dtype)
    # rows past the tensor's end read TMA's zeros (the last tile of the last head)
    if defaults is None:
        return cls(x, [rows, cols], [x.stride(2), 1], block, layout)
    desc = cls.__new__(cls)
    desc.__dict__.update(defaults, base=x, shape=[rows, cols], strides=[x.stride(2), 1], block_shape=list(block),
                         layout=layout)
    return desc


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


#: ``doc_bounds``' results by the q_pos tensor they were made from (one per step's cu_seqlens)
_DOC_BOUNDS = TensorLRU(8)


def doc_bounds(q_pos: torch.Tensor, n: int) -> torch.Tensor:
    """Packed documents as the Gluon kernels read them: int32 [2, n], contiguous, row i's
    document being rows [out[0, i], out[1, i]). ``q_pos``: positions relative to the document
    start, as ``sparsity.prepare`` makes them from cu_seqlens (broadcasts to (1, 1, n)). O(n)
    device work, no host sync; kept per q_pos tensor (and version), so the layers of a step that
    share one cu_seqlens build it once."""
    key = (id(q_pos), q_pos._version, n, str(q_pos.device))
    out = _DOC_BOUNDS.get(key, (q_pos,))
    if out is not None:
        return out
    pos = q_pos.reshape(-1)
    if pos.numel() != n:
        raise ValueError(f"packed documents' positions must be one row of N={n}, got shape {tuple(q_pos.shape)}")
    rows = torch.arange(n, device=q_pos.device, dtype=torch.int32)
    lo = rows - pos.to(torch.int32)
    # the end of row i's document: the first later row that starts one (position 0), else n
    starts = torch.where(lo[1:] == rows[1:], rows[1:], n)
    ends = torch.cat([starts, starts.new_full((1,), n)])
    hi = ends.flip(0).cummin(0).values.flip(0)
    out = torch.stack([lo, hi]).contiguous()
    _DOC_BOUNDS.put(key, (q_pos,), out)
    return out


def topk_rows(spec, block_indices: torch.Tensor, n: int) -> torch.Tensor:
    """The top-k table as the Gluon forward reads it: int32 (B, Hkv, cdiv(n, 128), K), contiguous,
    each row's distinct block ids first in descending order, then -1; causal: without the ids
    after the row's own block (they hide every pair). O(B * Hkv * n / 128 * K), no host sync."""
    table = merged_block_tables(spec, n, n, block_indices, inverse=False)[0]
    if spec.causal:
        qb = torch.arange(table.shape[2], device=table.device, dtype=table.dtype)[:, None]
        table = table.masked_fill(table > qb, -1)
    return table.sort(dim=-1, descending=True).values.contiguous()


#: the template's tile orders (``_tile``'s ORDER)
HEAD_MAJOR, BY_COST, PAIRS, LISTED, GROUPED = 0, 1, 2, 3, 4
#: the listed order's model (``tile_list``): a tile's prologue and epilogue cost about one key
#: tile; its last TAIL_ROUNDS x G tiles are dealt costliest first. Above LIST_MAX_TILES tiles the
#: closed orders run: building the list takes about 0.7 us a tile on our CPU (once per shape:
#: 43 ms at the limit), and there head-major leaves its most loaded program within 0.4% of the
#: mean in the model (``window=4096``: 1.012 at 16384 tiles, 1.003-1.004 at 65536)
TILE_OVERHEAD = 1.0
TAIL_ROUNDS = 4
LIST_MAX_TILES = 1 << 16
#: without pairs (an odd number of query tiles a head), causal dense tiles are dealt by cost
#: when the head-major order would leave its most loaded program this far above the mean: at a
#: predicted 1.57-1.63 (B=1, H=16, N=4096-16384, D=128) by cost took 0.77-0.82x the head-major
#: time, at 1.04-1.08 (N=32768; D=64 H=32 N=16384; B=4 N=8192) 0.96x, 1.03x and 1.06x (the
#: head-major order keeps a head's K/V in L2 for the programs running it; H200, Triton 3.6,
#: bf16, 2026-12-04)
LPT_IMBALANCE = 1.15


@functools.lru_cache(maxsize=256)
def head_major_imbalance(n_qb: int, n_bh: int, programs: int) -> float:
    """The most loaded program's key tiles over the mean, for a causal dense forward of n_bh
    (batch, head) pairs of n_qb query tiles dealt head-major (a tile of row r walks r + 1 key
    tiles; program p takes tiles p, p + programs, ...)."""
    t = torch.arange(n_qb * n_bh, dtype=torch.int64)
    loads = torch.bincount(t % programs, weights=(n_qb - t % n_qb).double(), minlength=programs)
    return float(loads.max() / loads.mean())


def tile_costs(kplan: KernelPlan, n: int) -> list[int]:
    """Key tiles each query tile of a plain plan walks (the template's ``_bounds``: sink tiles
    before the band, then the band), by query tile row; plans without documents or top-k."""
    bm, bn = 2 * BLOCK_MC, BLOCK_N
    window = kplan.window if kplan.has_window else 1 << 30
    sink_tiles = -(-min(kplan.sink, n) // bn)
    costs = []
    for q0 in range(0, n, bm):
        kb_lo = max(q0 - window + 1, 0) // bn
        kb_hi = -(-min(q0 + bm, n) // bn) if kplan.causal else -(-min(q0 + bm - 1 + window, n) // bn)
        n_sink = min(sink_tiles, kb_hi) if kplan.causal else sink_tiles
        if n_sink >= kb_lo:   # the sink touches the band: one range from key 0
            kb_hi, kb_lo, n_sink = max(kb_hi, n_sink), 0, 0
        costs.append(n_sink + kb_hi - kb_lo)
    return costs


def tile_list(kplan: KernelPlan, n: int, n_bh: int, programs: int) -> torch.Tensor:
    """The listed order (ORDER 3) of a plain plan's forward over n_bh (batch, head) pairs on
    ``programs`` programs, a new int32 tensor on the CPU: entries 0 .. programs are each program's run of
    the list (program p takes list[t] for t in starts[p] .. starts[p + 1] - 1), then the list,
    tile codes bh * n_qb + row, program by program.
    Dealt as a dynamic scheduler would deal them under a cost model (``tile_costs`` plus
    ``TILE_OVERHEAD``): tiles in head-major order (a head's tiles consecutive, last row first,
    so that the programs running at once share a head's K/V in L2), each to the program that
    becomes free first, the last ``TAIL_ROUNDS`` x programs of them costliest first. The model's
    most loaded program over the mean: ``window=4096`` N=131072 H=16 1.003 (head-major 1.012),
    causal N=16384 H=16 1.003 (pairs 1.031); ``tile_order`` says where it is used."""
    cost = tile_costs(kplan, n)
    n_qb = len(cost)
    order = [bh * n_qb + row for bh in range(n_bh) for row in range(n_qb - 1, -1, -1)]
    tail = min(len(order), TAIL_ROUNDS * programs)
    if tail:
        order[-tail:] = sorted(order[-tail:], key=lambda code: -cost[code % n_qb])
    free = [(0.0, p) for p in range(programs)]
    runs = [[] for _ in range(programs)]
    for code in order:
        load, p = heapq.heappop(free)
        runs[p].append(code)
        heapq.heappush(free, (load + cost[code % n_qb] + TILE_OVERHEAD, p))
    starts = [0]
    for run in runs:
        starts.append(starts[-1] + len(run))
    return torch.tensor(starts + [code for run in runs for code in run], dtype=torch.int32)


@functools.lru_cache(maxsize=64)
def _tile_list_on(kplan: KernelPlan, n: int, n_bh: int, programs: int, device: torch.device) -> torch.Tensor:
    """``tile_list`` on the device, built once per shape."""
    return tile_list(kplan, n, n_bh, programs).to(device)


def tile_order(kplan: KernelPlan, n_qb: int, n_bh: int, programs: int, group: int = 1) -> int:
    """The order the forward deals its n_bh x n_qb tiles to its programs (the template's
    ``_tile``): head-major, except for top-k plans with GQA and for causal dense plans (no
    window, documents or top-k), whose query tiles cost in proportion to their row.

    Top-k with GQA (``group``: the GQA group when the head group is aligned to it, else 1):
    grouped, a KV head's query heads consecutive on each row, so that one round's programs load
    a selection's K/V blocks together. H200, Triton 3.6, bf16, 2026-12-05 03:25 UTC, ``python
    benchmarks/gluon_orders.py --cases 9`` (``topk=16``, GQA 32/8, N=131072, D=128,
    ``select_blocks``' indices): grouped 7.320 ms, head-major 7.969, the Triton forward 10.378.

    Causal dense plans: pairs of rows (r, n_qb - 1 - r) of one head when n_qb is even, else by
    cost where head-major would be unbalanced (``LPT_IMBALANCE``; with 132 programs over heads
    of 128 tiles, N=16384, head-major gives the first programs the longest row of every head).
    H200, Triton 3.6, bf16, 2026-12-04
    07:39 UTC, one process, forward ms, head-major / by cost / pairs (Triton's forward): B=1
    H=16 D=128 N=4096 0.170 / 0.130 / 0.121 (0.182), N=8192 0.613 / 0.493 / 0.465 (0.571),
    N=16384 2.460 / 1.933 / 1.839 (2.034), N=32768 7.948 / 7.744 / 7.154 (7.937); B=4 N=8192
    2.035 / 2.101 / 1.895 (2.197); D=64 H=32 N=16384 2.540 / 2.597 / 2.461 (2.566).
    Causal windows (no sink, documents or top-k) take the host's list (``tile_list``), up to
    ``LIST_MAX_TILES`` tiles. H200, Triton 3.6, bf16, 2026-12-04 16:14-16:18 UTC, ``bash
    benchmarks/run.sh gluon-orders``, best of 3 and of 7 interleaved rounds, forward ms,
    head-major / listed: ``window=4096`` N=131072 H=16 7.452 / 7.353;
    ``causal=false,window=512`` N=65536 1.114 / 1.128 and 1.118 / 1.126; causal dense N=16384
    pairs 1.807 / 1.909 and 1.839 / 1.898, N=8192 pairs 0.475 / 0.456 and 0.480 / 0.462. Only
    the first matched the list's cost model (1.012 -> 1.003 for the most loaded program against
    the mean; pairs 1.031 -> 1.003 at N=16384 did not pay), so the others keep the closed
    orders. With a sink the consumers spill at D=128 under the list (sm_90, Triton 3.6: the
    loop's end, one STL and one LDL a tile)."""
    if kplan.topk:
        return GROUPED if group > 1 else HEAD_MAJOR
    if (kplan.causal and kplan.has_window and not (kplan.documents or kplan.sink)
            and n_qb * n_bh <= LIST_MAX_TILES):
        return LISTED
    if not (kplan.causal and _plain_dense(kplan)):
        return HEAD_MAJOR
    if n_qb % 2 == 0:
        return PAIRS
    return BY_COST if head_major_imbalance(n_qb, n_bh, programs) > LPT_IMBALANCE else HEAD_MAJOR


# ---- the tuned knobs (tuning/gluon_search.py) ----------------------------------------------

#: the knobs a tuning row of this family sets, per direction (``keys.gluon_config_from_row``
#: checks a row's values): ``order``, the forward's tile order (``_tile``'s ORDER); ``stages``,
#: the depth of the forward's K/V ring, or of both backward kernels' streamed rings. A field a
#: row does not set (no row: none) takes the heuristic's value: ``tile_order``, ``RING``,
#: ``BWD_RING``.
FIELDS = {"fwd": ("order", "stages"), "bwd": ("stages",)}
ORDERS = (HEAD_MAJOR, BY_COST, PAIRS, LISTED, GROUPED)
ORDER_NAMES = {HEAD_MAJOR: "head-major", BY_COST: "by cost", PAIRS: "pairs", LISTED: "listed",
               GROUPED: "grouped"}
#: ring depths whose kernels fit sm_90's 232,448 B of shared memory a block, by direction and head
#: dim (``aot_compile`` / ``aot_compile_bwd`` for sm_90 on Triton 3.6, bf16, 2026-12-04): forward
#: D=64 98,680 / 131,496 / 164,264 / 197,080 B at 2-5 slots, D=128 196,984 at 2 and 262,568 at
#: 3; backward, the largest of its kernels (fused dK/dV, dQ), D=64 116,240 / 149,568 / 182,848 /
#: 216,176 at 2-5, D=128 198,160 at 2 and 262,616 at 3
STAGE_CHOICES = {"fwd": {64: (2, 3, 4, 5), 128: (2,)}, "bwd": {64: (2, 3, 4, 5), 128: (2,)}}

#: ``use_gluon_config``'s override, by direction (tuning and tests)
_override: dict = {}


@contextlib.contextmanager
def use_gluon_config(fwd: dict | None = None, bwd: dict | None = None):
    """Run the Gluon kernels with these knobs inside the block (the tuner's candidates, tests):
    ``{"order": 2, "stages": 2}`` for the forward, ``{"stages": 2}`` for the backward; a
    direction given replaces its tuning row entirely (fields left out take the heuristic's
    value), one left None keeps the row."""
    for direction, cfg in (("fwd", fwd), ("bwd", bwd)):
        if cfg is not None:
            check_config(direction, cfg)
    before = dict(_override)
    _override.update({d: dict(c) for d, c in (("fwd", fwd), ("bwd", bwd)) if c is not None})
    try:
        yield
    finally:
        _override.clear()
        _override.update(before)


def check_config(direction: str, cfg: dict, head_dim: int | None = None) -> dict:
    """``cfg`` when its fields are knobs of ``direction`` with values of their choices (for
    ``head_dim`` when given), else ValueError / TypeError."""
    if not isinstance(cfg, dict):
        raise TypeError(f"a Gluon {direction} config must be a dict, got {type(cfg).__name__}")
    unknown = set(cfg) - set(FIELDS[direction])
    if unknown:
        raise ValueError(f"unknown Gluon {direction} knobs {sorted(unknown)} (the knobs: {list(FIELDS[direction])})")
    for name, value in cfg.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"Gluon knob {name} must be an integer, got {value!r}")
    if "order" in cfg and cfg["order"] not in ORDERS:
        raise ValueError(f"Gluon knob order must be one of {ORDERS} ({', '.join(ORDER_NAMES.values())}), "
                         f"got {cfg['order']}")
    if "stages" in cfg:
        allowed = (STAGE_CHOICES[direction].get(head_dim, ()) if head_dim is not None
                   else sorted({s for by_d in STAGE_CHOICES[direction].values() for s in by_d}))
        if cfg["stages"] not in allowed:
            raise ValueError(f"Gluon knob stages must be one of {tuple(allowed)}"
                             + (f" at head dim {head_dim}" if head_dim is not None else "") + f", got {cfg['stages']}")
    return cfg


def config(plan, direction: str) -> tuple[dict, str]:
    """(knobs, where they came from) of a call's Gluon kernels in one direction: the override
    (``use_gluon_config``), else the plan's tuning row (``plan.gluon_resolution``), else {} (the
    heuristic's values)."""
    cfg = _override.get(direction)
    if cfg is not None:
        return cfg, "use_gluon_config override"
    choice = getattr(plan.gluon_resolution(), direction)
    return choice.config, choice.source


def order_for(cfg: dict, kplan: KernelPlan, n_qb: int, n_bh: int, programs: int,
              group_aligned: bool = True, group: int = 1) -> tuple[int, str | None]:
    """(order, why the config's is not it) of one launch: the config's ``order`` where this shape
    can run it, else ``tile_order``'s (``group``: the call's GQA group). Pairs need an even
    number of query tiles a head; the list is built for plans without documents or top-k, up to
    ``LIST_MAX_TILES`` tiles; grouped is rendered for top-k plans only and needs the head group's
    first head and head count to be multiples of the GQA group (``group_aligned``). A row is tuned
    for one shape of its length bucket; other lengths of the bucket can lack what it needs."""
    want = cfg.get("order")
    default = tile_order(kplan, n_qb, n_bh, programs, group if group_aligned else 1)
    if want is None:
        return default, None
    why = None
    if want == PAIRS and n_qb % 2:
        why = f"pairs need an even number of query tiles a head ({n_qb})"
    elif want == LISTED and (kplan.documents or kplan.topk):
        why = "the list is built for plans without documents or top-k"
    elif want == LISTED and n_qb * n_bh > LIST_MAX_TILES:
        why = f"{n_qb * n_bh} tiles, above LIST_MAX_TILES ({LIST_MAX_TILES})"
    elif want == GROUPED and not kplan.topk:
        why = "grouped is the top-k plans' order"
    elif want == GROUPED and not group_aligned:
        why = "grouped needs the head group aligned to the GQA group"
    if why:
        return default, why
    return want, None


#: the names ``kernel_hash`` renders in place of ``api()``'s; the forward's half key tiles on, as
#: Triton before 3.9 renders them (a row of 3.9, keyed by its Triton version too, runs the kernel
#: that version renders)
_HASH_NAMES = {"tma_load": "tma_load", "tma_store": "tma_store", "tma_add": "tma_add", "halves": True}


@functools.lru_cache(maxsize=256)
def kernel_hash(kplans: tuple[KernelPlan, ...], direction: str) -> str | None:
    """The key of this family's tuning rows for a call of these head groups' plans: ``"gluon-"``
    and a hash of their rendered Gluon kernels of one direction, comments and blank lines left
    out (as ``render.kernel_hash``), so that a row never runs on other kernels and never mixes
    with the Triton family's rows. Rendered with the API's names as placeholders
    (``_HASH_NAMES``): the names a Triton version has are decided by its version, which keys
    the rows too, so the hash is the same on every Triton (a CPU machine on Triton 3.9 checks the
    shipped rows of Triton 3.6). None when a head group cannot run this direction in Gluon."""
    h = hashlib.sha256(f"msa-codegen gluon {direction} v1".encode())
    for kplan in kplans:
        try:
            body = render(kplan, direction, _HASH_NAMES)
        except ValueError:
            return None
        h.update(_render.code_only(body).encode())
        h.update(b"\0")
    return "gluon-" + h.hexdigest()[:16]


def _doc_args(plan, q_pos, n) -> tuple:
    """The kernels' DOC argument of a plan of packed documents (``doc_bounds``), else ()."""
    if not any(g.kernel_plan.documents for g in plan.groups):
        return ()
    if q_pos is None:
        raise ValueError(f"{plan.pattern_text!r}: a plan of packed documents needs their positions (q_pos)")
    return (doc_bounds(q_pos, n),)


def forward(q, k, v, plan, scale: float, block_indices: torch.Tensor | None = None, q_pos: torch.Tensor | None = None):
    """(o, lse) of one call by the Gluon kernel, one persistent launch per head group (a dilated
    group's: one per residue class of the rows, ``_classes``); the caller has checked
    ``why_not(plan, q, k, v, scale) is None``. o: q's shape, dtype and (dense) layout;
    lse: (B, Hq, N) fp32, natural log of the sum of exp(scale * q.k) over the visible keys.
    ``block_indices``: a top-k plan's, as ``attention`` takes them (compacted by ``topk_rows``);
    ``q_pos``: packed documents' positions (``sparsity.prepare``'s, from cu_seqlens)."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    o = torch.empty_like(q)
    lse = torch.empty((b, hq, n), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    why = layout_reason(o)
    if why:   # empty_like of a non-dense q: contiguous, which TMA addresses
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    group = hq // hkv
    qk_scale = scale * 1.4426950408889634
    sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
    doc = _doc_args(plan, q_pos, n)
    cfg, _ = config(plan, "fwd")
    stages = cfg.get("stages", RING[d])
    args = {}   # (dilation, class): its descriptors and row offsets, shared by the head groups
    for grp in plan.groups:
        dil = grp.kernel_plan.dilation
        # a dilated window's classes run the window alone; its sink is merged after (``_sink_fwd``)
        kplan = _class_plan(grp.kernel_plan)
        kern = load(kplan).msa_gluon_fwd
        hs = grp.h1 - grp.h0
        n_c = n // dil   # rows of a residue class (N is a multiple of the dilation: why_not)
        n_qb = -(-n_c // (2 * BLOCK_MC))
        tiles = b * hs * n_qb
        targs = doc
        if grp.kernel_plan.topk:
            if block_indices is None:
                raise ValueError(f"{plan.pattern_text!r}: a top-k plan needs block_indices")
            table = topk_rows(grp.spec, block_indices, n)
            targs = (table, table.stride(0), table.stride(1))
        programs = min(sms, tiles)
        order, _ = order_for(cfg, kplan, n_qb, b * hs, programs, grp.h0 % group == 0 and hs % group == 0, group)
        tl = _tile_list_on(kplan, n_c, b * hs, programs, q.device) if order == LISTED else direct.unused_pointer(q.device)
        # a class's LSE rows are strided in lse: the kernel writes them contiguous, copied after
        lse_c = lse if dil == 1 else torch.empty((b, hq, n_c), dtype=torch.float32, device=q.device)
        for c, views in enumerate(_classes(dil, q, k, v, o)):
            if (dil, c) not in args:
                args[dil, c] = _fwd_args(*views)
            descs, rows = args[dil, c]
            direct.launch(
                kern, (programs,), *descs, lse_c, *rows, *targs, tl, grp.h0, hs, hq, group, n_c, tiles, qk_scale,
                STAGES=stages, FOLD=True, ORDER=order, num_warps=4, maxnreg=MAXNREG,
            )
            if dil > 1:
                lse[:, grp.h0:grp.h1, c::dil] = lse_c[:, grp.h0:grp.h1]
        if kplan is not grp.kernel_plan:
            _sink_fwd(grp, q, k, v, o, lse, scale)
    return o, lse


def _class_plan(kplan: KernelPlan) -> KernelPlan:
    """The plan a residue class's launch runs: a dilated window's without its sink (a class's
    rows do not hold the other classes' sink keys: ``_sink_fwd`` and ``_sink_pass`` add them);
    any other plan as it is."""
    if kplan.dilation > 1 and kplan.sink:
        return dataclasses.replace(kplan, sink=0, prefix=0)
    return kplan


def _sink_chunks(rows: int, programs: int) -> tuple[int, int]:
    """(chunk, chunks): ``rows`` cut into chunks of whole 64-row tiles so that ``programs``
    (batch x heads) programs a chunk make about ``SINK_PROGRAMS`` in all."""
    per = max(1, SINK_PROGRAMS // programs)
    chunk = -(-rows // (per * 64)) * 64
    return chunk, -(-rows // chunk)


def _sink_consts(kplan: KernelPlan, q: torch.Tensor) -> dict:
    """The constexprs both sink passes (``kernels/sink.py``) take from a head group's plan and q."""
    d = q.shape[3]
    block_s = min(SINK_KEYS, max(16, triton.next_power_of_2(kplan.sink)))
    return dict(SINK=kplan.sink, WINDOW=kplan.window, DILATION=kplan.dilation, CAUSAL=kplan.causal, HEAD_DIM=d,
                BLOCK_D=d, BLOCK_S=block_s, N_KC=-(-kplan.sink // block_s),
                DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32")


def _sink_fwd(grp, q, k, v, o, lse, scale: float) -> None:
    """A dilated head group's sink pairs outside its window (``kernels/sink.py``, ``sink_fwd``):
    merged into the rows' o and LSE (the classes' window attention) by their log-sum-exp, in
    place (o rounded twice in its dtype: by the forward kernel, then here)."""
    from . import sink as sink_kernels

    b, hq, n, _ = q.shape
    h0, hs = grp.h0, grp.h1 - grp.h0
    chunk, chunks = _sink_chunks(n, b * hs)
    direct.launch(
        sink_kernels.sink_fwd, (chunks, b * hs), q, k, v, o, lse, *[x.stride(i) for x in (q, k, v, o) for i in range(3)],
        lse.stride(0), lse.stride(1), h0, hs, hq // k.shape[1], n, chunk, scale * 1.4426950408889634,
        **_sink_consts(grp.kernel_plan, q), BLOCK_M=SINK_FWD_ROWS, num_warps=SINK_WARPS,
    )


def _fwd_args(q, k, v, o) -> tuple[tuple, tuple]:
    """The forward kernel's arguments around LSE for these (B, H, N, D) tensors or residue-class
    views: (the four descriptors and o; the row offsets of each and o's row stride)."""
    d = q.shape[3]
    (qb, qh, qhc), *q_view = _rows_view(q)
    (kb, kh, khc), *k_view = _rows_view(k)
    (vb, vh, vhc), *v_view = _rows_view(v)
    (ob, oh, ohc), *o_view = _rows_view(o)
    qd = _descriptor(q, *q_view, [BLOCK_MC, d])
    od = _descriptor(o, *o_view, [BLOCK_MC, d])
    kd = _descriptor(k, *k_view, [BLOCK_N, d])
    vd = _descriptor(v, *v_view, [BLOCK_N, d])
    return (qd, kd, vd, od, o), (qb, qh, qhc, kb, kh, khc, vb, vh, vhc, ob, oh, ohc, o.stride(2))


def _dense_like(x: torch.Tensor) -> torch.Tensor:
    """An output of x's shape and dtype in x's layout when TMA addresses it (empty_like keeps a
    dense tensor's strides, as the Triton backward returns them), else contiguous."""
    y = torch.empty_like(x)
    return y if layout_reason(y) is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)


def backward(do, q, k, v, o, lse, dlse, plan, scale: float, block_indices: torch.Tensor | None = None,
             q_pos: torch.Tensor | None = None, fused: bool = False):
    """(dq, dk, dv) of one call by the Gluon kernels; the caller has checked
    ``why_not_bwd(plan, q, k, v) is None`` (and ``fused_reason() is None`` for ``fused``). Per head
    group (a dilated group's per residue class of the rows, ``_classes``, on strided views): the
    Triton stats pass (``msa_bwd_pre`` of the group's Triton module, launched as
    ``launch.backward`` launches it: delta, LSE2 in log2 units, rows padded to 16 bytes), then the
    dK/dV kernel (a program per 128 keys of a KV head, its GROUP query heads summed inside: no
    atomics, deterministic) and the dQ kernel. ``fused``: the dK/dV kernel computes dQ as well
    (5 products a tile instead of 7) and adds it into a zeroed fp32 copy by TMA reduce-adds, in
    an order that varies (not deterministic); the dQ kernel does not run. A top-k
    plan's dK/dV walks the inverse of the compacted table (``topk_rows``, ``inverse_table``), its
    dQ the table's rows; packed documents clip both kernels' bands (``q_pos``, as ``forward``)."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    dq, dk, dv = _dense_like(q), _dense_like(k), _dense_like(v)
    if q.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if layout_reason(do) or _classes_reason(plan, do):   # e.g. the stride-0 gradient of a sum
        do = do.contiguous()
    lse = lse.contiguous()   # msa_bwd_pre reads it in dlse's layout
    if dlse is not None:
        # the gradient of a sum arrives expanded (stride 0): the kernel reads it in lse's layout
        dlse = dlse.to(torch.float32).contiguous()
    qk_scale = scale * 1.4426950408889634
    doc = _doc_args(plan, q_pos, n)
    stages = config(plan, "bwd")[0].get("stages", BWD_RING[d])
    # fused: dQ accumulates in fp32 inside the dK/dV kernel (TMA reductions), the dQ kernel is not run
    dqa = torch.zeros((b, hq, n, d), dtype=torch.float32, device=q.device) if fused else None
    tensors = (q, k, v, o, do, dq, dk, dv) + ((dqa,) if fused else ())
    shared = {}   # (dilation, class): what its head groups share (``_bwd_args``)
    for grp in plan.groups:
        h0, h1 = grp.h0, grp.h1
        hs = h1 - h0
        dil = grp.kernel_plan.dilation
        n_c = n // dil   # rows of a residue class (N is a multiple of the dilation: why_not_bwd)
        n_tiles = -(-n_c // BLOCK_N)
        mod = load(_class_plan(grp.kernel_plan), "bwd")   # a dilated window's sink: ``_sink_pass``
        hk0 = h0 // group
        hks = (h1 - 1) // group + 1 - hk0
        kv_args = q_args = doc
        if grp.kernel_plan.topk:
            if block_indices is None:
                raise ValueError(f"{plan.pattern_text!r}: a top-k plan needs block_indices")
            table = topk_rows(grp.spec, block_indices, n)
            offsets, inverse = inverse_table(table, n_tiles)
            kv_args = (offsets, inverse, table.shape[1] * n_tiles, n_tiles)
            q_args = (table, table.stride(0), table.stride(1))
        for c, views in enumerate(_classes(dil, *tensors)):
            if (dil, c) not in shared:
                shared[dil, c] = _bwd_args(views, lse, dlse, dil, c, fused)
            a = shared[dil, c]
            qc, kc, vc, oc, doc_, dqc, dkc, dvc = views[:8]
            delta, lse2, rows = a["delta"], a["lse2"], a["rows"]
            direct.launch(
                grp.kernels("bwd").msa_bwd_pre, (-(-n_c // 64), b * hs),
                oc, doc_, a["dlse"] if dlse is not None else a["lse"], a["lse"], delta, lse2,
                *oc.stride(), *doc_.stride(), a["lse"].stride(0), a["lse"].stride(1), delta.stride(0),
                delta.stride(1), h0, hs, n_c,
                HEAD_DIM=d, BLOCK_D=plan.block_d, BLOCK_M=64, HAS_DLSE=dlse is not None, enable_fp_fusion=True,
            )
            direct.launch(
                mod.msa_gluon_bwd_dkdv, (n_tiles, b * hks), a["qd"], a["kd2"], a["vd2"], a["dod"], a["dkd"],
                a["dvd"], a["dqad"] if fused else a["dkd"], dkc, dvc, lse2, delta,
                *rows["q"], *rows["k"], *rows["v"], *rows["do"], *rows["dk"], dkc.stride(2), *rows["dv"],
                dvc.stride(2), delta.stride(0), delta.stride(1), *kv_args, hk0, hks, hq, group, n_c, qk_scale, scale,
                STAGES=stages, FUSE=fused, num_warps=4, maxnreg=MAXNREG,
            )
            if fused:
                continue
            direct.launch(
                mod.msa_gluon_bwd_dq, (n_tiles, b * hs), a["qd"], a["kd"], a["vd"], a["dod"], a["dqd"], dqc, lse2,
                delta, *rows["q"], *rows["k"], *rows["v"], *rows["do"], *rows["dq"], dqc.stride(2),
                delta.stride(0), delta.stride(1), *q_args, h0, hs, group, n_c, qk_scale, scale,
                STAGES=stages, num_warps=4, maxnreg=MAXNREG,
            )
        if grp.kernel_plan.sink:
            if dil == 1:
                lse2, delta = shared[1, 0]["lse2"], shared[1, 0]["delta"]
            else:   # the classes' stats rows of the group's heads, in the rows' order
                delta, lse2 = torch.empty((2, b, hq, n), dtype=torch.float32, device=q.device)
                for c in range(dil):
                    delta[:, h0:h1, c::dil] = shared[dil, c]["delta"][:, h0:h1]
                    lse2[:, h0:h1, c::dil] = shared[dil, c]["lse2"][:, h0:h1]
            _sink_pass(grp, q, k, v, do, lse2, delta, dqa if fused else dq, dq, dk, dv, scale)
    if fused:
        # the sink pass converted its heads' rows (``_sink_pass``)
        for h0, h1 in _spans([(g.h0, g.h1) for g in plan.groups if not g.kernel_plan.sink]):
            dq[:, h0:h1].copy_(dqa[:, h0:h1])
    return dq, dk, dv


def _spans(ranges) -> list[tuple[int, int]]:
    """Adjacent [h0, h1) ranges merged (one copy for a plan's undivided heads)."""
    out = []
    for h0, h1 in sorted(ranges):
        if out and out[-1][1] == h0:
            out[-1] = (out[-1][0], h1)
        else:
            out.append((h0, h1))
    return out


def _sink_pass(grp, q, k, v, do, lse2, delta, dq_in, dq, dk, dv, scale: float) -> None:
    """The pairs a head group's sink adds outside its window (``kernels/sink.py``): their dQ terms
    added to ``dq_in``'s rows of the group's heads and written to ``dq`` (from the fused form's
    fp32 copy every row, converted; from the two-kernel form's dQ, ``dq_in is dq``, the rows
    that have such pairs), their dK / dV summed over the chunks' partial sums and the GQA group in
    a fixed order and added to dK / dV's first S rows. A sink of several key chunks
    (``SINK_KEYS``): one launch for every chunk's dK / dV, then one for dQ's terms over the
    chunks (the fused form's converting); with ``SINK_CHUNK_LAUNCHES`` the fused form runs one
    launch a chunk instead, in place on the fp32 copy, the last converting."""
    from . import sink as sink_kernels

    kp = grp.kernel_plan
    b, hq, n, d = q.shape
    group = hq // k.shape[1]
    h0, hs = grp.h0, grp.h1 - grp.h0
    convert = dq_in is not dq
    # rows that see a sink key outside their window: causal undilated from row W on (else any)
    first = 0 if not kp.causal or kp.dilation > 1 else min(kp.window, n)
    row0 = 0 if convert else first
    if row0 >= n:
        return
    consts = _sink_consts(kp, q)
    s = min(kp.sink, n)
    strides = [x.stride(i) for x in (q, k, v, do) for i in range(3)]

    def launch(row0, key_chunks, dq_terms, kv, key0=0, dq_out=dq, convert=convert):
        """One launch over rows [row0, N): ``key_chunks`` chunks of sink keys from ``key0`` (with
        dQ's terms, one chunk, or all of them without ``kv``). Returns its fp32 partial dK / dV
        summed over its chunks of rows, [2, B x heads, key chunks x BLOCK_S, D], when ``kv``
        (zeros without a launch when no row is left)."""
        if row0 >= n:
            return (torch.zeros((2, b * hs, key_chunks * consts["BLOCK_S"], d), dtype=torch.float32, device=q.device)
                    if kv else None)
        chunk, chunks = _sink_chunks(n - row0, b * hs * key_chunks)
        parts = (torch.empty((2, chunks, b * hs, key_chunks * consts["BLOCK_S"], d), dtype=torch.float32,
                             device=q.device) if kv else None)
        direct.launch(
            sink_kernels.sink_bwd, (chunks, b * hs, key_chunks), q, k, v, do, lse2, delta, dq_in, dq_out,
            parts[0] if kv else lse2, parts[1] if kv else lse2,
            *strides, lse2.stride(0), lse2.stride(1), *dq_in.stride()[:3], *dq_out.stride()[:3],
            h0, hs, group, n, row0, chunk, scale * 1.4426950408889634, scale,
            **dict(consts, N_KC=1 if kv else consts["N_KC"]), BLOCK_M=SINK_BWD_ROWS[d],
            CONVERT=convert and dq_terms, STAGES=SINK_BWD_STAGES, DQ=dq_terms, KV=kv, KEY0=key0,
            num_warps=SINK_WARPS,
        )
        return parts.sum(1) if kv else None

    n_kc = -(-s // consts["BLOCK_S"])   # key chunks inside N
    if consts["N_KC"] == 1:   # one launch: dQ's terms and the keys' dK / dV
        sums = launch(row0, 1, True, True)
    elif convert and SINK_CHUNK_LAUNCHES:
        # the fused form: a launch a chunk, each adding its dQ terms to the fp32 copy in place (a
        # row's in one program: deterministic), the last converting every row
        sums = torch.cat([launch(0 if c == n_kc - 1 else first, 1, True, True, key0=c * consts["BLOCK_S"],
                                 dq_out=dq if c == n_kc - 1 else dq_in, convert=c == n_kc - 1)
                          for c in range(n_kc)], 2)
    else:   # the chunks' dK / dV (from the first row that sees a sink key), then dQ's terms
        sums = launch(first, n_kc, False, True)
        launch(row0, 1, True, False)
    # [2, B, KV heads of the group, S, D]: over the query heads of each KV head
    sums = sums.view(2, b, hs // group, group, sums.shape[2], d).sum(3)[:, :, :, :s]
    hk0 = h0 // group
    for x, add in zip((dk, dv), sums):
        rows = x[:, hk0:hk0 + hs // group, :s]
        rows.copy_(rows.float() + add)


def _bwd_args(views, lse, dlse, dil: int, c: int, fused: bool) -> dict:
    """What the backward's head groups of one residue class (the whole call at dilation 1) share:
    the class's LSE rows (and their gradient's) contiguous, as the stats pass reads them; its
    stats rows (delta, LSE2, padded to 16 bytes); the views' row offsets (``rows``) and
    descriptors. ``views``: q, k, v, o, do, dq, dk, dv (and the fused form's fp32 dQ) of the
    class (``_classes``)."""
    qc, kc, vc, _, doc_, dqc, dkc, dvc = views[:8]
    b, hq, n_c, d = qc.shape
    stats = torch.empty((2, b, hq, -(-n_c // 4) * 4), dtype=torch.float32, device=qc.device)
    a = {"lse": lse if dil == 1 else lse[:, :, c::dil].contiguous(),
         "dlse": dlse if dil == 1 or dlse is None else dlse[:, :, c::dil].contiguous(),
         "delta": stats[0, :, :, :n_c], "lse2": stats[1, :, :, :n_c]}
    views_rows = {name: _rows_view(x) for name, x in (("q", qc), ("k", kc), ("v", vc), ("do", doc_), ("dq", dqc),
                                                       ("dk", dkc), ("dv", dvc))}
    a["rows"] = {name: view[0] for name, view in views_rows.items()}
    # Q, dO, dQ: 64-row tiles in both kernels; K, V: 128-key tiles (dQ), 64-key halves (dK/dV).
    # The fused form runs no dQ kernel: its dQ, K and V descriptors are not built (host time)
    a["qd"], a["dod"] = (_descriptor(x, *views_rows[name][1:], [BWD_BLOCK_M, d])
                         for name, x in (("q", qc), ("do", doc_)))
    a["kd2"], a["vd2"], a["dkd"], a["dvd"] = (_descriptor(x, *views_rows[name][1:], [BLOCK_N // 2, d])
                                              for name, x in (("k", kc), ("v", vc), ("dk", dkc), ("dv", dvc)))
    if fused:   # the fp32 dQ's 2-D view [B * Hq * N, D] (of the class's rows)
        a["dqad"] = _descriptor(views[8], b * hq * n_c, d, [BWD_BLOCK_M, d // 2])
    else:
        a["dqd"] = _descriptor(dqc, *views_rows["dq"][1:], [BWD_BLOCK_M, d])
        a["kd"], a["vd"] = (_descriptor(x, *views_rows[name][1:], [BLOCK_N, d]) for name, x in (("k", kc), ("v", vc)))
    return a


# ---- ahead-of-time compile (no GPU needed) --------------------------------------------------

_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _aot_descriptor(dtype: torch.dtype, rows: int, head_dim: int) -> str:
    """The signature type of a [rows, head_dim] TMA block descriptor, as a launch specialises it."""
    return f"tensordesc<{_SHORT[dtype]}[{rows}, {head_dim}],{_smem_layout((rows, head_dim), dtype)!r}>"


def aot_compile(kplan: KernelPlan, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, arch: int = 90,
                stages: int | None = None, order: int | None = None):
    """The plan's kernel compiled for sm_{arch} without a GPU (Triton's bundled ptxas), as a
    launch specialises it: a CompiledKernel (``.metadata.shared``, ``.asm['cubin']``). Run it in
    a process without TRITON_INTERPRET."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kern = load(kplan).msa_gluon_fwd
    short = _SHORT[dtype]

    def desc(rows):
        return _aot_descriptor(dtype, rows, head_dim)

    # ORDER: the tile order of a call of N=16384, H=16 on 132 SMs
    consts = dict(STAGES=stages or RING[head_dim], FOLD=True,
                  ORDER=tile_order(kplan, 128, 16, 132) if order is None else order)
    sig = dict(q_desc=desc(BLOCK_MC), k_desc=desc(BLOCK_N), v_desc=desc(BLOCK_N), o_desc=desc(BLOCK_MC),
               O=f"*{short}", LSE="*fp32", T="*i32", DOC="*i32", TL="*i32", qk_scale="fp32")
    sig = {a: ("constexpr" if a in consts else sig.get(a, "i32")) for a in kern.arg_names}
    cs = {(kern.arg_names.index(a),): value for a, value in consts.items()}
    return triton.compile(GluonASTSource(fn=kern, signature=sig, constexprs=cs), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=4, maxnreg=MAXNREG))


def aot_compile_bwd(kplan: KernelPlan, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, arch: int = 90,
                    stages: int | None = None):
    """``aot_compile`` for the backward: {"dkdv": ..., "fused": ..., "dq": CompiledKernel}."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    mod = load(kplan, "bwd")
    short = _SHORT[dtype]

    def desc(rows):
        return _aot_descriptor(dtype, rows, head_dim)

    out = {}
    kv_rows = dict(dkdv=BLOCK_N // 2, fused=BLOCK_N // 2, dq=BLOCK_N)
    for name, kern in (("dkdv", mod.msa_gluon_bwd_dkdv), ("fused", mod.msa_gluon_bwd_dkdv), ("dq", mod.msa_gluon_bwd_dq)):
        sig = dict(q_desc=desc(BWD_BLOCK_M), do_desc=desc(BWD_BLOCK_M), dq_desc=desc(BWD_BLOCK_M),
                   k_desc=desc(kv_rows[name]), v_desc=desc(kv_rows[name]), dk_desc=desc(BLOCK_N // 2),
                   dv_desc=desc(BLOCK_N // 2), DQ=f"*{short}", DK=f"*{short}", DV=f"*{short}",
                   dqa_desc=(_aot_descriptor(torch.float32, BWD_BLOCK_M, head_dim // 2) if name == "fused"
                             else desc(BLOCK_N // 2)),
                   LSE2="*fp32", DELTA="*fp32", T="*i32", OFFS="*i32", INV="*i32", DOC="*i32", qk_scale="fp32",
                   sm_scale="fp32")
        consts = dict(STAGES=stages or BWD_RING[head_dim], FUSE=name == "fused")
        consts = {a: value for a, value in consts.items() if a in kern.arg_names}
        sig = {a: ("constexpr" if a in consts else sig.get(a, "i32")) for a in kern.arg_names}
        cs = {(kern.arg_names.index(a),): value for a, value in consts.items()}
        out[name] = triton.compile(GluonASTSource(fn=kern, signature=sig, constexprs=cs),
                                   target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4, maxnreg=MAXNREG))
    return out


def aot_compile_sink(kplan: KernelPlan, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128,
                     arch: int = 90) -> dict:
    """The sink passes (``kernels/sink.py``) of a plan with a sink compiled for sm_{arch} without a
    GPU, with the constexprs and warps the launchers give them: {"fwd": ``sink_fwd``, "bwd": the
    two-kernel form's ``sink_bwd``, "convert": the fused form's}; for a sink of several key chunks
    ``sink_bwd``'s launches are {"kv": the chunks' dK / dV, "bwd" / "convert": dQ's terms over
    the chunks, "chunk" / "chunk-convert": ``SINK_CHUNK_LAUNCHES``' launch of a middle chunk (in
    place on the fp32 copy) and of the last}. Run it in a process without TRITON_INTERPRET."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import sink as sink_kernels

    short = _SHORT[dtype]
    fp32 = ("LSE", "LSE2", "DELTA", "PK", "PV")
    consts = _sink_consts(kplan, torch.empty((1, 1, 1, head_dim), dtype=dtype, device="meta"))
    out = {}
    one = consts["N_KC"] == 1
    rows = dict(BLOCK_M=SINK_BWD_ROWS[head_dim], STAGES=SINK_BWD_STAGES, KEY0=0)
    # dQ's terms (over every chunk: N_KC is the plan's), with the keys' dK / dV when one chunk
    dq = dict(rows, DQ=True, KV=one)
    forms = [("fwd", sink_kernels.sink_fwd, dict(BLOCK_M=SINK_FWD_ROWS)),
             ("bwd", sink_kernels.sink_bwd, dict(dq, CONVERT=False)),
             ("convert", sink_kernels.sink_bwd, dict(dq, CONVERT=True))]
    if not one:   # launches of one chunk: the chunks' dK / dV; the fused form's launches a chunk
        # (``SINK_CHUNK_LAUNCHES``: a middle chunk's, the last's)
        chunk = dict(rows, KV=True, N_KC=1)
        last = (consts["N_KC"] - 1) * consts["BLOCK_S"]
        forms += [("kv", sink_kernels.sink_bwd, dict(chunk, DQ=False, CONVERT=False)),
                  ("chunk", sink_kernels.sink_bwd, dict(chunk, DQ=True, CONVERT=False, KEY0=consts["BLOCK_S"])),
                  ("chunk-convert", sink_kernels.sink_bwd, dict(chunk, DQ=True, CONVERT=True, KEY0=last))]
    for name, kern, extra in forms:
        cx = dict(consts, **extra)
        # as a launch on torch's tensors specialises it: pointers 16-byte aligned, strides and
        # the chunk multiples of 16 (the loads that can be pipelined then are)
        sig, attrs = {}, {}
        for i, a in enumerate(kern.arg_names):
            if a in cx:
                sig[a] = "constexpr"
            elif a in ("qk_scale", "sm_scale"):
                sig[a] = "fp32"
            elif a in ("H0", "HS", "GROUP", "N", "ROW0"):
                sig[a] = "i32"
            else:
                fused = extra.get("CONVERT") or name == "chunk"   # reads the fp32 copy
                sig[a] = ("i32" if a.startswith("stride_") or a == "CHUNK" else
                          "*fp32" if a in fp32 or (a == "DQ_IN" and fused) or (a == "DQ_OUT" and name == "chunk")
                          else f"*{short}")
                attrs[(i,)] = [["tt.divisibility", 16]]
        cs = {(kern.arg_names.index(a),): value for a, value in cx.items()}
        out[name] = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=cs, attrs=attrs),
                                   target=GPUTarget("cuda", arch, 32), options=dict(num_warps=SINK_WARPS))
    return out
