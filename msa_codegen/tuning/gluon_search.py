"""``msa-tune --family gluon``: the Gluon family's knobs (Hopper; ``kernels.gluon.FIELDS``).

The space is small (the forward: tile order x K/V ring depth, at D=128 the order alone; the
backward: the ring depth, at D=128 one value), so every candidate is measured: no Optuna
study. Per key and direction:

1. the heuristic's knobs (``{}``: ``tile_order``, ``RING`` / ``BWD_RING``) are measured first,
   the baseline;
2. each candidate of ``space`` that ``why_excluded`` keeps is checked against the float64
   reference on a short odd length (``measure.Bench.check``, the Gluon family forced on), then
   timed on the bucket's representative shape; a compile error or a wrong result is recorded
   and skipped;
3. the best ``FINALISTS`` and the baseline are re-timed in interleaved rounds, and the fastest
   by median is stored, every field set (the baseline as the values it ran with).

The row is an ordinary row of the tuning database whose kernel hash is that of the pattern's
Gluon kernels of that direction (``keys.gluon_hash``): the Triton family's lookup never reads
it, and ``lookup.gluon_lookup`` reads only it. A row is tuned at one shape of its bucket: a
length of the bucket that cannot run its order (pairs need an even number of query tiles)
takes the heuristic's (``kernels.gluon.order_for``).
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
import time

from ..heuristics import default_config
from ..kernels import gluon
from ..pattern.lowering import lower
from ..pattern.spec import parse
from .keys import TuningKey, library_version
from .lookup import reload
from .measure import Bench, Problem, error_line, interleaved
from .search import FINALISTS, RowResult, _provenance

ROUNDS = 5


def kernel_plans(pattern: str) -> tuple:
    """The KernelPlans of a plain call of ``pattern`` (what ``keys.gluon_hash`` hashes)."""
    return tuple(lower(g.spec) for g in parse(pattern).groups)


def unavailable(problem: Problem, direction: str) -> str | None:
    """Why the family cannot run this problem's direction at all (None: it can): the device, the
    dtype and head dim, the pattern (``kernels.gluon``'s reasons)."""
    import torch

    if problem.interpreter or not torch.cuda.is_available():
        return "the Gluon family runs on a CUDA GPU of capability 9.x only (no CUDA GPU here)"
    kplans = kernel_plans(problem.pattern)
    why = gluon.device_reason(torch.device("cuda"), problem.dtype, problem.head_dim)
    if why:
        return why
    for kp in kplans:
        why = gluon.pattern_reason(kp) if direction == "fwd" else gluon.bwd_pattern_reason(kp)
        if why:
            return why
    if direction == "fwd":
        why = gluon.slower_reason(kplans, problem.head_dim)
        if why:
            return why
    return gluon.api()[1]


def _n_bh(problem: Problem, h0: int, h1: int) -> int:
    return problem.batch * (h1 - h0)


def _programs(tiles: int) -> int:
    """The forward's persistent programs: one a streaming multiprocessor (132 on an H100 / H200
    where no GPU is present: the order's validity does not depend on it)."""
    import torch

    sms = gluon._sm_count(torch.cuda.current_device()) if torch.cuda.is_available() else 132
    return min(sms, tiles)


def heuristic(direction: str, problem: Problem) -> dict:
    """The knobs the heuristic gives the timed shape, every field set (the first head group's
    tile order)."""
    d = problem.head_dim
    if direction == "bwd":
        return {"stages": gluon.BWD_RING[d]}
    n_qb = -(-problem.seqlen // (2 * gluon.BLOCK_MC))
    h0, h1, spec = parse(problem.pattern).head_groups(problem.heads)[0]
    n_bh = _n_bh(problem, h0, h1)
    programs = _programs(n_bh * n_qb)
    return {"order": gluon.tile_order(lower(spec), n_qb, n_bh, programs), "stages": gluon.RING[d]}


def space(direction: str, head_dim: int) -> list[dict]:
    """Every combination of the direction's knobs at ``head_dim`` (before ``why_excluded``)."""
    stages = gluon.STAGE_CHOICES[direction][head_dim]
    if direction == "bwd":
        return [{"stages": s} for s in stages]
    return [{"order": o, "stages": s} for o, s in itertools.product(gluon.ORDERS, stages)]


def why_excluded(direction: str, params: dict, problem: Problem) -> str | None:
    """Why a candidate is not measured on this problem (None: it is): an order one of the
    pattern's head groups cannot run at the timed shape (``kernels.gluon.order_for``)."""
    if direction == "bwd":
        return None
    n_qb = -(-problem.seqlen // (2 * gluon.BLOCK_MC))
    for h0, h1, spec in parse(problem.pattern).head_groups(problem.heads):
        n_bh = _n_bh(problem, h0, h1)
        _, why = gluon.order_for(params, lower(spec), n_qb, n_bh, _programs(n_bh * n_qb))
        if why:
            return f"order {gluon.ORDER_NAMES[params['order']]}: {why}"
    return None


@contextlib.contextmanager
def _count_runs(direction: str):
    """A one-element list counting the family's launches of ``direction`` inside the block."""
    name = "forward" if direction == "fwd" else "backward"
    real = getattr(gluon, name)
    count = [0]

    def spy(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    setattr(gluon, name, spy)
    try:
        yield count
    finally:
        setattr(gluon, name, real)


class GluonBench(Bench):
    """``measure.Bench`` with the Gluon family forced on (``family``) and a candidate's knobs (a
    dict) as the override; ``check`` also says when the family did not run."""

    family = "1"

    def __init__(self, problem: Problem, direction: str, rep_ms: int = 100):
        import torch

        self.launch_cfg = default_config(torch.device("cuda"), problem.head_dim, problem.dtype,
                                         pattern=problem.pattern)
        super().__init__(problem, direction, rep_ms=rep_ms)

    def _knobs(self, params: dict):
        return gluon.use_gluon_config(**{self.direction: params})

    def check(self, params: dict) -> float:
        with self._knobs(params), _count_runs(self.direction) as runs:
            err = super().check(self.launch_cfg)
        if not runs[0]:
            raise RuntimeError(f"the Gluon {self.direction} did not run on the check's problem (the log of "
                               f"msa_codegen.kernels.gluon says why)")
        return err

    def runner(self, params: dict):
        base = super().runner
        with self._knobs(params):
            run = base(self.launch_cfg)   # the backward's graph is made here, under the knobs

        def timed():
            with self._knobs(params):
                run()
        return timed


def tune_gluon(problem: Problem, direction: str, db_path, *, deadline: float | None = None, rep_ms: int = 100,
               rounds: int = ROUNDS, log=print) -> RowResult | None:
    """Measure every candidate of one direction for one key (``problem``'s bucket), store the
    winner in ``db_path`` (a faster stored row of the same shape is kept). None when nothing
    valid was measured; ValueError when the family cannot run the problem (``unavailable``)."""
    from . import gpu as _gpu
    from .database import TuningDB
    from .keys import dtype_name, gluon_hash, triton_version

    why = unavailable(problem, direction)
    if why:
        raise ValueError(f"the Gluon family cannot run {problem.pattern!r} {direction} here: {why}")
    kh = gluon_hash(problem.pattern, direction)
    name, cap = _gpu.current_gpu()
    key = TuningKey(name, cap, problem.pattern, direction, dtype_name(problem.dtype), problem.head_dim,
                    problem.group, problem.bucket, triton_version(), kh)
    bench = GluonBench(problem, direction, rep_ms=rep_ms)
    measured, failures, pruned = {}, [], 0
    base = heuristic(direction, problem)
    candidates = [{}] + [p for p in space(direction, problem.head_dim) if p != base]
    for params in candidates:
        if deadline is not None and time.monotonic() >= deadline and measured:
            break
        reason = why_excluded(direction, params, problem) if params else None
        label = _label(params)
        if reason:
            pruned += 1
            log(f"  {label}: not measured ({reason})")
            continue
        try:
            bench.check(params)
            med, spread, _ = bench.time(params)
        except Exception as e:   # compile errors, out of resources, wrong results
            failures.append(f"{label}: {error_line(e)}")
            pruned += 1
            log(f"  {label}: failed ({error_line(e)})")
            continue
        measured[_key(params)] = (med, spread, params)
        log(f"  {label}: {med:.4g} ms (spread {spread:.2g})")
    if not measured:
        return None
    order = sorted(measured, key=lambda k: measured[k][0])[:FINALISTS]
    if _key({}) in measured and _key({}) not in order:
        order.append(_key({}))
    if len(order) > 1 and rounds and not (deadline is not None and time.monotonic() >= deadline):
        timed = interleaved(lambda k: bench.time(measured[k][2], rep_ms=max(10, rep_ms // 2))[0], order, rounds)
    else:
        rounds = 0
        timed = {k: measured[k][:2] for k in order}
    win = min(order, key=lambda k: timed[k][0])
    med, spread = timed[win]
    config = dict(base, **measured[win][2])
    default_ms = timed[_key({})][0] if _key({}) in timed else None
    flops = problem.flops(direction)
    row = dict(key.as_dict(), config=config, median_ms=med, spread_ms=spread,
               tflops=flops / (med * 1e-3) / 1e12 if flops else None, default_ms=default_ms,
               trials=len(measured), batch=problem.batch, heads=problem.heads, kv_heads=problem.kv_heads,
               seqlen=problem.seqlen, library_version=library_version(),
               created_at=datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None, microsecond=0),
               provenance=_provenance(problem, True, rounds) + f"; msa-tune --family gluon, {len(measured)} "
                          f"candidates measured, the heuristic's knobs {_label(base)}")
    with TuningDB(db_path) as db:
        stored = db.put(row, keep_faster=True)
    reload()
    return RowResult(key, config, med, spread, default_ms, row["tflops"], len(measured), pruned, failures,
                           stored)


def _key(params: dict) -> tuple:
    return tuple(sorted(params.items()))


def _label(params: dict) -> str:
    if not params:
        return "heuristic"
    parts = []
    for k, v in params.items():
        parts.append(f"order={gluon.ORDER_NAMES[v]}" if k == "order" else f"{k}={v}")
    return " ".join(parts)

