"""Lowering: one head group's Spec -> KernelPlan, the only input of the templates.

Every decision about which loops (phases) a kernel runs and which predicate terms it
evaluates is made here, in Python; the templates only print what the plan says. A plan
holds validated integers and booleans only, so nothing from the user's string can reach
generated code.

Phases of the query-centric kernels (forward, dq), by which pairs (i, j) each one owns, so
that no pair is counted twice:
  G  rows i < global: every key (bidirectional only)
  P  rows i >= global, keys j < prefix = max(sink, global): the sink/global columns
  W  rows i >= global, keys j >= prefix of the query's dilation class: the window band
     (dense patterns: the whole causal triangle / full rows)
  R  random and top-k blocks (top-k: one table per batch and KV head), pairs no structured
     term already covers; duplicates within a table row are removed before the launch
The key-centric kernel (dk, dv) runs the transposes of the same phases with the same owners.

With run-time positions (``positional``: cu_seqlens, q_pos/k_pos, buckets; see sparsity/inputs.py) the
kernels take their positional form (plan.positional): tiles are plain row ranges, a tile's key
(query) range is found by a 64-ary search over the sorted (segment, position) keys of the rows, and the
phases are P (the sink/global columns of the tile's first segment), W (one contiguous range
after it holding every other pair the structured terms show; blocks that every row sees run
unmasked) and R (random / top-k blocks of rows). Dilation is then evaluated by the predicate,
except with cu_seqlens (``classes``): positions are rows minus the document start, so the tiles
stay strided by row class as in the plain kernels, W covers the window band of the class and P
the sink columns of every document a tile touches.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import types

from .spec import Spec

# Windows wider than this act like unbounded ones for every length the kernels accept; the
# clamp keeps index arithmetic (a0 + BLOCK + W) inside int32.
MAX_SEQLEN = 1 << 30
_WINDOW_CLAMP = 1 << 30


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    causal: bool
    dense: bool          # no locality term: the W phase covers the causal triangle / all keys
    has_window: bool
    window: int          # in positions of the dilation class (0 when no window)
    dilation: int        # residue classes the query/key tiles are split into
    sink: int
    global_: int         # rows and columns i, j < global_ see and are seen by everything (Spec.global_)
    prefix: int          # keys j < prefix are owned by the P phase
    random: int
    rblock: int
    # Fields below exist only for run-time sparsity (issue 5); at their defaults they are left out
    # of as_dict(), so a plain pattern's plan key and rendered source do not change.
    topk: int = 0              # slots of the top-k term: block_indices per (batch, KV head)
    positional: bool = False   # rows carry positions (cu_seqlens, q_pos/k_pos, buckets): no dilation tiles
    segments: bool = False     # rows carry segments (documents / buckets): visible only within one
    classes: bool = False      # positions are row - document start (cu_seqlens): dilated tiles by row class
    documents: bool = False    # the segments are packed documents (cu_seqlens): contiguous row ranges

    @property
    def has_w_phase(self) -> bool:
        return self.dense or self.has_window

    @property
    def pos_w_phase(self) -> bool:
        """Positional kernels search a W range: the structured terms show keys past the P range."""
        return self.dense or self.has_window or bool(self.prefix)

    @property
    def pos_w_unmasked(self) -> bool:
        """Positional W ranges without index classes have an unmasked middle: keys every row of
        a tile of one segment sees (dense, or an undilated window)."""
        return self.dense or (self.has_window and self.dilation == 1)

    @property
    def dkdv_w_split(self) -> bool:
        """The dk/dv kernel runs a W band of contiguous rows (DIL 1) as one loop (SPLIT), in the
        pass over the heads that follows the masked blocks; a dilated band keeps three loops."""
        return self.has_w_phase and self.dilation == 1 and not self.positional

    @property
    def dkdv_passes(self) -> tuple[str, ...]:
        """The dk/dv kernel's passes over the query heads: 'edges' (masked blocks: the other
        phases, a dilated band's edges) then 'band' (the bands); positional kernels: one, 'all'."""
        if self.positional:
            return ("all",)
        edges = self.global_ or self.prefix or self.random or self.topk or (self.has_w_phase and not self.dkdv_w_split)
        bands = self.has_w_phase or self.prefix
        return (("edges",) if edges or not bands else ()) + (("band",) if bands else ())

    @property
    def ds_capable(self) -> bool:
        """The backward may pass the window band's dS from the dk/dv kernel to the dq kernel
        through a scratch buffer (kernels/launch.py) instead of recomputing it: plain kernels of a banded
        window, no global rows, random or top-k blocks (the band then covers every pair both
        kernels' W phases hold)."""
        return (self.has_window and not self.dense and not self.global_ and not self.random
                and not self.topk and not self.positional)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name, default in _OPTIONAL_FIELDS.items():
            if d[name] == default:
                del d[name]
        return d

    def key(self) -> str:
        """Stable short hash of the plan (part of the rendered file name)."""
        blob = json.dumps(self.as_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def describe(self) -> str:
        return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.as_dict().items())


_OPTIONAL_FIELDS = {"topk": 0, "positional": False, "segments": False, "classes": False, "documents": False}

#: ``lower``'s (and ``plan_for``'s) run-time flags of a call with ``cu_seqlens`` (packed
#: documents), as ``api.attention`` derives them: ``lower(spec, **CU_SEQLENS)``
CU_SEQLENS = types.MappingProxyType(dict(positional=True, segments=True, classes=True))


def lower(spec: Spec, *, positional: bool = False, segments: bool = False, classes: bool = False) -> KernelPlan:
    """The plan of one spec; ``positional`` / ``segments``: run-time positions / segments are given.

    ``classes``: the positions are the row minus its document's start (cu_seqlens), so a dilated
    window's residue classes are residue classes of rows and the tiles can stay strided, as in
    the plain kernels (global rows see whole documents across classes: not with ``global``).
    The plan's ``documents`` says so for every pattern (the Gluon family reads a document's rows
    as one range); its ``classes`` only where the strided tiles apply.
    """
    if spec.msa:
        # an msa group's kernels are msa_codegen/msa/kernels.py, shared by every msa pattern
        raise ValueError(f"msa={spec.msa} is not lowered to the pattern templates: it runs MSA's own kernels "
                         f"(msa_codegen.msa)")
    has_window = spec.window is not None
    window = min(spec.window, _WINDOW_CLAMP) if has_window else 0
    global_ = 0 if spec.causal else spec.global_
    plan = KernelPlan(
        causal=bool(spec.causal),
        dense=bool(spec.dense),
        has_window=has_window,
        window=int(window),
        dilation=int(spec.dilation) if has_window else 1,
        sink=int(spec.sink),
        global_=int(global_),
        prefix=int(max(spec.sink, global_)),
        random=int(spec.random),
        rblock=int(spec.block) if spec.random or spec.topk else 1,
        topk=int(spec.topk),
        positional=bool(positional or segments),
        segments=bool(segments),
        classes=bool(classes and (positional or segments) and has_window and spec.dilation > 1
                     and not global_),
        documents=bool(classes and segments),
    )
    for name, value in plan.as_dict().items():
        if type(value) not in (int, bool):
            raise TypeError(f"plan field {name} must be int or bool, got {type(value).__name__}")
    return plan
