"""One tuning problem: its inputs, the correctness check of a candidate, and its timing.

Every candidate is first run on a small problem (same pattern, dtype, head dim and GQA
group, a short length that crosses block boundaries) and compared with the float64
reference (forward: output and LSE; backward: dq, dk, dv). Only a candidate that passes is
timed, so a wrong configuration can never win.

Timing on a GPU: ``triton.testing.do_bench`` (the L2 cache is flushed before every
repetition), median and interquartile range. In Triton's interpreter: ``perf_counter``
medians of a few repetitions; these numbers say nothing about a GPU and are flagged so.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from .. import api
from ..config import LaunchConfig, use_config
from ..kernels import gluon
from ..pattern.reference import reference_attention
from ..pattern.reference import relative_error as _rel_err
from ..pattern.spec import parse
from .keys import bucket as _bucket
from .keys import dtype_name

# relative error (norm-wise) above which a candidate's result is wrong: a few times the
# error of a correct kernel in that dtype; a wrong configuration misses by O(1)
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}
CHECK_SEQLEN_GPU = 1024 + 61      # odd: partial blocks at the end
CHECK_SEQLEN_INTERPRETER = 64
TOKENS_PER_BATCH = 65536          # representative shape of a bucket: batch = max(1, TOKENS_PER_BATCH // N)
INTERP_MAX_SEQLEN = 64            # the reduced problem timed in Triton's interpreter


class WrongResult(Exception):
    """A candidate ran but its result differs from the float64 reference."""


def error_line(e: BaseException) -> str:
    """``Type: first line of the message``: how a failed candidate is recorded (at most 500 chars)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:500]


@dataclasses.dataclass(frozen=True)
class Problem:
    """The shape that is timed, and the key length it stands for."""

    pattern: str            # canonical
    batch: int
    heads: int
    kv_heads: int
    seqlen: int             # the length that is timed
    head_dim: int
    dtype: torch.dtype
    device: str             # "cuda" or "cpu" (the interpreter)
    key_seqlen: int         # the length whose bucket keys the stored row

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def bucket(self) -> int:
        return _bucket(self.key_seqlen)

    @property
    def interpreter(self) -> bool:
        return self.device != "cuda"

    @property
    def dilation(self) -> int:
        return max((spec.dilation if spec.window is not None else 1) for _, _, spec in
                   parse(self.pattern).head_groups(self.heads))

    def describe(self) -> str:
        return (f"B={self.batch} H={self.heads}/{self.kv_heads} N={self.seqlen} D={self.head_dim} "
                f"{dtype_name(self.dtype)}")

    def flops(self, direction: str) -> float | None:
        """Effective FLOPs (visible pairs only): 4 * D per pair and head forward, 2.5x that backward.
        None for patterns whose pairs are not counted in closed form (global, random)."""
        # imported here: msa_codegen.bench is a command (python -m), not loaded with the package
        from ..bench import attended_pairs

        try:
            pairs = sum(attended_pairs(spec, self.seqlen) * (h1 - h0)
                        for h0, h1, spec in parse(self.pattern).head_groups(self.heads))
        except ValueError:
            return None
        fwd = 4.0 * self.head_dim * pairs * self.batch
        return fwd if direction == "fwd" else 2.5 * fwd




def representative_problem(pattern: str, heads: int, kv_heads: int, seqlen: int, head_dim: int,
                           dtype: torch.dtype, cuda: bool, batch: int | None = None) -> Problem:
    """The problem timed for the bucket of ``seqlen``: on a GPU that length with ``batch``, by
    default ``TOKENS_PER_BATCH // seqlen`` (at least 1); in the interpreter a reduced one (N <= 64,
    batch 1, one key/value head unless the pattern has head groups). Its rows are keyed by
    ``seqlen``; neither the batch nor the number of heads is part of the key (a row records them)."""
    pattern = str(parse(pattern))
    if cuda:
        b = max(1, TOKENS_PER_BATCH // seqlen) if batch is None else int(batch)
        if b < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        return Problem(pattern, b, heads, kv_heads, seqlen, head_dim, dtype, "cuda", seqlen)
    hq, hkv = (heads, kv_heads) if parse(pattern).grouped else (heads // kv_heads, 1)
    return Problem(pattern, 1, hq, hkv, min(seqlen, INTERP_MAX_SEQLEN), head_dim, dtype, "cpu", seqlen)


def check_shape(problem: Problem) -> tuple[int, int, int]:
    """(query heads, key/value heads, N) of the problem a candidate is checked on (batch 1): the
    pattern's head groups need every query head; otherwise one key/value head and its group of
    query heads suffice. N is short and odd (partial blocks at the end)."""
    hq, hkv = (problem.heads, problem.kv_heads) if parse(problem.pattern).grouped else (problem.group, 1)
    n = min(problem.seqlen, CHECK_SEQLEN_INTERPRETER if problem.interpreter else CHECK_SEQLEN_GPU)
    return hq, hkv, n


def _lse_err(lse: torch.Tensor, ref: torch.Tensor) -> float:
    lse, ref = lse.double(), ref.double()
    dead = torch.isinf(ref)
    if not torch.equal(torch.isinf(lse) & (lse < 0), dead):
        return float("inf")
    if dead.all():
        return 0.0
    return (lse[~dead] - ref[~dead]).abs().max().item()


def _inputs(b, hq, hkv, n, d, dtype, device, seed, grad):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(b, hkv, n, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(b, hkv, n, d, generator=g).to(device=device, dtype=dtype)
    do = torch.randn(b, hq, n, d, generator=g).to(device=device, dtype=dtype)
    if grad:
        for t in (q, k, v):
            t.requires_grad_()
    return q, k, v, do


class Bench:
    """Inputs of one problem and direction; ``check`` and ``time`` of candidate configs, with
    ``MSA_CODEGEN_GLUON`` set to ``family`` ("0": the Triton kernels, whose launch parameters the
    configs are, also where the automatic choice would run the Gluon family)."""

    family = "0"

    def __init__(self, problem: Problem, direction: str, *, reps: int | None = None, rep_ms: int = 100):
        self.p, self.direction = problem, direction
        self.tolerance = TOLERANCE[problem.dtype]
        self.rep_ms = rep_ms
        self.reps = reps if reps is not None else (2 if problem.interpreter else 0)
        p = problem
        hq, hkv, n_check = check_shape(p)
        self.check_inputs = _inputs(1, hq, hkv, n_check, p.head_dim, p.dtype, p.device, seed=1234, grad=True)
        q, k, v, do = self.check_inputs
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        out, lse = reference_attention(q64, k64, v64, p.pattern, return_lse=True)
        dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), do.double())
        self.ref = {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}
        # the timed problem
        self.inputs = _inputs(p.batch, p.heads, p.kv_heads, p.seqlen, p.head_dim, p.dtype, p.device, seed=4321,
                              grad=direction == "bwd")

    # ---- correctness
    def check(self, cfg: LaunchConfig) -> float:
        """Largest error against the reference (relative norm; LSE absolute). WrongResult above
        the tolerance; compile and launch errors propagate."""
        q, k, v, do = self.check_inputs
        with use_config(cfg), gluon.forced(self.family):
            if self.direction == "fwd":
                with torch.no_grad():
                    out, lse = api.attention(q, k, v, self.p.pattern, return_lse=True)
                errs = {"out": _rel_err(out, self.ref["out"]), "lse": _lse_err(lse, self.ref["lse"])}
            else:
                out = api.attention(q, k, v, self.p.pattern)
                dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
                errs = {"dq": _rel_err(dq, self.ref["dq"]), "dk": _rel_err(dk, self.ref["dk"]),
                        "dv": _rel_err(dv, self.ref["dv"])}
        self._sync()
        worst = max(errs, key=errs.get)
        if not errs[worst] <= self.tolerance:
            raise WrongResult(f"{worst} differs from the float64 reference: error {errs[worst]:.3g} "
                              f"(tolerance {self.tolerance:g})")
        return errs[worst]

    # ---- timing
    def _sync(self):
        if not self.p.interpreter:
            torch.cuda.synchronize()

    def runner(self, cfg: LaunchConfig):
        """A no-argument function running the timed direction once with ``cfg``."""
        q, k, v, do = self.inputs
        pattern = self.p.pattern
        if self.direction == "fwd":
            def run():
                with use_config(cfg), gluon.forced(self.family), torch.no_grad():
                    api.attention(q, k, v, pattern)
            return run
        with use_config(cfg), gluon.forced(self.family):
            out = api.attention(q, k, v, pattern)   # the backward runs the config saved by this call

        def run_bwd():
            with gluon.forced(self.family):
                torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        return run_bwd

    def time(self, cfg: LaunchConfig, rep_ms: int | None = None) -> tuple[float, float, list[float]]:
        """(median ms, interquartile range ms, samples) of one candidate."""
        return time_runner(self.runner(cfg), self.p.interpreter, self.reps if rep_ms is None else 1,
                           self.rep_ms if rep_ms is None else rep_ms)


def time_runner(fn, interpreter: bool, reps: int, rep_ms: int) -> tuple[float, float, list[float]]:
    """(median ms, interquartile range ms, samples) of ``fn()``: in the interpreter ``reps`` wall-clock
    runs (nothing is compiled there: no warm-up), on a GPU one warm-up call (compile) and then
    ``triton.testing.do_bench`` for ``rep_ms``. The pattern tuner and the MSA tuner time with it."""
    if interpreter:
        samples = []
        for _ in range(max(1, reps)):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples), _iqr(samples), samples
    import triton.testing

    fn()   # compile / warm up outside the measurement
    torch.cuda.synchronize()
    q25, q50, q75 = triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, quantiles=[0.25, 0.5, 0.75],
                                            return_mode="median")
    return float(q50), float(q75 - q25), [float(q50)]


def _iqr(samples: list[float]) -> float:
    if len(samples) < 2:
        return 0.0
    qs = statistics.quantiles(samples, n=4, method="inclusive")
    return qs[2] - qs[0]


def median_iqr(samples: list[float]) -> tuple[float, float]:
    return statistics.median(samples), _iqr(samples)


def interleaved(time_one, keys: list, rounds: int) -> dict:
    """{key: (median ms, interquartile range ms)} over ``rounds`` rounds; every round times each key
    once (``time_one(key)`` -> ms), starting at a different one, so that a drift of the clocks or
    of the GPU's temperature spreads over all keys alike. How both tuners pick their winner."""
    samples = {key: [] for key in keys}
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            samples[key].append(time_one(key))
    return {key: median_iqr(samples[key]) for key in keys}
