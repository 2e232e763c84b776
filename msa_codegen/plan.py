"""The plan of a call: everything ``attention`` decides once per call key, in one cache.

A call key is (pattern as given, device, dtype, head dim, query heads, key/value heads,
sequence-length bucket, run-time kind). Its ``AttentionPlan`` holds the parsed pattern, the
head groups with their ``KernelPlan`` and loaded kernel modules, the launch configuration and
where it came from (``tuning.lookup``: a tuned row, else the heuristic default), and the
per-dtype / per-head-dim constants of the launches. The first call of a key builds it (parse,
lowering, one database lookup); every later call is one dictionary hit.

When the cache is invalidated: ``msa_codegen.tuning.reload()`` empties it (the tuner calls it
after it writes a row; call it after another process wrote the user database, or after
changing ``MSA_CODEGEN_HOME`` / ``MSA_CODEGEN_SHIPPED_DB``). ``use_config`` needs no
invalidation: an override is read on every call and wins over the plan's configuration.
"""
from __future__ import annotations

import dataclasses

import torch

from .config import LaunchConfig, as_list, length_bucket
from .kernels import render
from .kernels.schedule import block_d, dot_precision
from .pattern.lowering import KernelPlan, lower
from .pattern.spec import Pattern, Spec, parse
from .tuning import lookup as tuning_lookup


class HeadGroupPlan:
    """Query heads ``h0 <= h < h1`` of a call: their Spec, KernelPlan and kernel modules."""

    __slots__ = ("h0", "h1", "spec", "kernel_plan", "_modules")

    def __init__(self, h0: int, h1: int, spec: Spec, kernel_plan: KernelPlan):
        self.h0, self.h1, self.spec, self.kernel_plan = h0, h1, spec, kernel_plan
        self._modules: dict[str, object] = {}

    def kernels(self, direction: str):
        """The loaded module of one direction ("fwd" / "bwd"), loaded on first use."""
        mod = self._modules.get(direction)
        if mod is None:
            mod = self._modules[direction] = render.load(self.kernel_plan, direction)
        return mod

    def __repr__(self) -> str:
        return f"HeadGroupPlan(heads {self.h0}-{self.h1 - 1}, {self.spec}, {self.kernel_plan.describe()})"


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionPlan:
    """What every call of one key runs (see the module docstring)."""

    key: tuple
    pattern: Pattern
    pattern_text: str                 # canonical: what the custom ops and tuning rows carry
    groups: tuple[HeadGroupPlan, ...]
    head_groups: tuple[tuple[int, int, Spec], ...]   # (h0, h1, spec) per group: Pattern.head_groups's form
    resolution: object                # tuning.lookup.Resolution: the configs and their sources
    config: LaunchConfig
    config_list: tuple[int, ...]      # as_list(config), the custom ops' form
    block_d: int
    dot_precision: str
    positional: bool                  # rows carry positions (cu_seqlens, q_pos/k_pos, buckets)
    segments: bool                    # rows carry segments (documents, buckets)
    classes: bool                     # positions restart per document (cu_seqlens)
    has_topk: bool
    has_random: bool
    split_kv_heads: bool              # a KV head's query heads fall in two head groups
    _gluon: dict = dataclasses.field(default_factory=dict, repr=False)   # gluon_resolution's answer

    def gluon_resolution(self):
        """The Gluon family's knobs for this key (``tuning.lookup.gluon_lookup``: a row keyed by the
        hash of these head groups' Gluon kernels, else {}), looked up on the first Gluon launch."""
        res = self._gluon.get("res")
        if res is None:
            from .kernels import gluon

            pattern, device, dtype, head_dim, hq, hkv, bucket = self.key[:7]
            kplans = tuple(g.kernel_plan for g in self.groups)
            hashes = (gluon.kernel_hash(kplans, "fwd"), gluon.kernel_hash(kplans, "bwd"))
            res = self._gluon["res"] = tuning_lookup.gluon_lookup(device, self.pattern_text, head_dim, dtype,
                                                                  hq // hkv, max(bucket, 1), hashes)
        return res

    @property
    def source(self) -> str:
        """Where the configuration came from (``"heuristic default"``, ``"user db PATH (...)"``)."""
        return self.resolution.source


_PLANS: dict[tuple, AttentionPlan] = {}


def clear() -> None:
    """Forget every plan (``tuning.reload()`` calls this)."""
    _PLANS.clear()


tuning_lookup.on_reload(clear)


def plan_for(pattern: str | Pattern, device: torch.device, dtype: torch.dtype, head_dim: int, hq: int, hkv: int,
             seqlen: int, positional: bool = False, segments: bool = False, classes: bool = False,
             short_buckets: bool = False) -> AttentionPlan:
    """The plan of a call (built on the first call of its key). ``short_buckets``: the call's hash
    buckets are short (``heuristics.SHORT_BUCKET_KEYS``), which picks their launch default and no
    database row. Raises PatternError / ValueError for a pattern that does not parse or whose head
    groups do not cover ``hq`` heads."""
    key = (pattern, device, dtype, head_dim, hq, hkv, length_bucket(seqlen) if seqlen > 0 else 0,
           positional, segments, classes, bool(short_buckets))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _build(key)
    return plan


def _build(key: tuple) -> AttentionPlan:
    pattern, device, dtype, head_dim, hq, hkv, bucket, positional, segments, classes, short_buckets = key
    pat = parse(pattern)
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query heads must be a multiple of key/value heads, got Hq={hq}, Hkv={hkv}")
    groups = tuple(HeadGroupPlan(h0, h1, spec, lower(spec, positional=positional, segments=segments,
                                                      classes=classes))
                   for h0, h1, spec in pat.head_groups(hq))   # ValueError when they do not cover hq heads
    group = hq // hkv
    text = str(pat)
    res = tuning_lookup.lookup(device, text, head_dim, dtype, group, max(bucket, 1), buckets=short_buckets)
    cfg = res.config
    return AttentionPlan(
        key=key, pattern=pat, pattern_text=text, groups=groups,
        head_groups=tuple((g.h0, g.h1, g.spec) for g in groups), resolution=res, config=cfg,
        config_list=tuple(as_list(cfg)), block_d=block_d(head_dim), dot_precision=dot_precision(dtype),
        positional=bool(positional or segments), segments=bool(segments), classes=bool(classes),
        has_topk=any(g.spec.topk for g in groups), has_random=any(g.spec.random for g in groups),
        split_kv_heads=any(g.h0 % group or g.h1 % group for g in groups),
    )
