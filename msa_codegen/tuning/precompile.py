"""Compile a batch of candidate configurations in parallel before they are timed.

A trial's cost on a GPU is mostly Triton's compile of the candidate's kernels (seconds for
the forward, more for the three backward kernels), not its timing (a few hundred ms). The
tuner therefore asks the sampler for a batch of candidates, has worker processes run each
once on a small problem (which compiles it into Triton's on-disk cache) all at the same
time, and only then checks and times them one after another in its own process, where the
kernels load from that cache. Nothing is timed while the workers run.

The small problem keeps what Triton specialises a kernel on: the same heads, head dim,
dtype and pattern, and a length with the timed length's remainder mod 16 (strides and
lengths divisible by 16 or not alike), so that the cache entry is the one the timed launch
looks up. Were it not, the timed launch would compile again: slower, never wrong. The worker
also runs the candidate on the correctness check's problem (``measure.check_shape``), whose odd
length is another specialisation: left to the tuner's process, it was compiled there, serially,
once per trial.

A candidate that fails to compile or launch in a worker is reported as failed with that
error, without being retried in the tuner's process.
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import multiprocessing
import os

import torch

from .. import api
from ..config import as_list, from_list, use_config
from ..kernels import gluon
from .keys import dtype_name
from .measure import check_shape, error_line

_pool: cf.ProcessPoolExecutor | None = None
_pool_size = 0
WARM_SEQLEN = 1024


MAX_WORKERS = 16


def workers() -> int:
    """Worker processes by default: one per CPU core, at most MAX_WORKERS (the H200 machine has
    16 cores; a compile is one single-threaded LLVM + ptxas run, so a core each is what helps)."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else (os.cpu_count() or 1)))


def _get_pool(n: int) -> cf.ProcessPoolExecutor:
    global _pool, _pool_size
    if _pool is None or _pool_size != n:
        shutdown()
        # spawn: a fresh interpreter per worker (CUDA cannot be forked once initialised)
        _pool = cf.ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("spawn"))
        _pool_size = n
    return _pool


def shutdown() -> None:
    global _pool
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)
        _pool = None


atexit.register(shutdown)


def warm_seqlen(seqlen: int) -> int:
    """A short length that Triton specialises like ``seqlen`` (same remainder mod 16)."""
    if seqlen <= WARM_SEQLEN + 16:
        return seqlen
    return WARM_SEQLEN + seqlen % 16


def _warm(pattern: str, shapes: list[tuple[int, int, int]], head_dim: int, dtype_name: str, device: str,
          direction: str, cfg_values: list[int]) -> str | None:
    """(In a worker.) Run one candidate once per (heads, kv_heads, N) shape; None, or the error
    that stopped it."""
    try:
        dtype = getattr(torch, dtype_name)
        g = torch.Generator(device="cpu").manual_seed(7)
        for heads, kv_heads, seqlen in shapes:
            q = torch.randn(1, heads, seqlen, head_dim, generator=g).to(device=device, dtype=dtype)
            k = torch.randn(1, kv_heads, seqlen, head_dim, generator=g).to(device=device, dtype=dtype)
            v = torch.randn(1, kv_heads, seqlen, head_dim, generator=g).to(device=device, dtype=dtype)
            with use_config(from_list(cfg_values)), gluon.forced("0"):   # the Triton kernels of the config
                if direction == "fwd":
                    with torch.no_grad():
                        api.attention(q, k, v, pattern, return_lse=True)
                else:
                    for t in (q, k, v):
                        t.requires_grad_()
                    out = api.attention(q, k, v, pattern)
                    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        if device == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as e:   # compile errors, out of resources: the candidate fails
        return error_line(e)


def compile_all(problem, direction: str, configs: list, n_workers: int | None = None) -> list[str | None]:
    """Run every config once in parallel worker processes; per config None or its error."""
    if not configs:
        return []
    pool = _get_pool(n_workers or workers())
    # the timed launch's specialisation and the correctness check's (``measure.check_shape``: an
    # odd length, so another compile), both in the worker: the tuner's process then loads both
    shapes = [(problem.heads, problem.kv_heads, warm_seqlen(problem.seqlen)), check_shape(problem)]
    futures = [pool.submit(_warm, problem.pattern, shapes, problem.head_dim,
                           dtype_name(problem.dtype), problem.device, direction, as_list(cfg)) for cfg in configs]
    out = []
    for f in futures:
        try:
            out.append(f.result())
        except cf.process.BrokenProcessPool:
            # a worker died (killed by the OS, say): not the candidate's fault; the tuner's own
            # process compiles it, and the next batch gets a fresh pool
            out.append(None)
            shutdown()
    return out


def shared_verdicts(problem, direction: str, params_list: list[dict], *, limit: int, capability: str,
                    n_workers: int | None = None) -> list[str]:
    """Ahead-of-time compiles for the target (``tuning.resources``) of candidates, in parallel
    worker processes: per candidate ``"ok"``, ``"smem:<why>"`` (over ``limit``) or
    ``"error:<compile error>"``."""
    from . import resources

    if not params_list:
        return []
    kw = dict(head_dim=problem.head_dim, dtype=problem.dtype, heads=problem.heads, kv_heads=problem.kv_heads,
              seqlen=problem.seqlen, capability=capability)
    jobs = [(problem.pattern, direction, p, limit, kw) for p in params_list]
    if (n_workers or workers()) <= 1:
        return [resources._verdict_worker(j)[0] for j in jobs]
    pool = _get_pool(n_workers or workers())
    futures = [pool.submit(resources._verdict_worker, j) for j in jobs]
    out = []
    for f in futures:
        try:
            out.append(f.result()[0])
        except cf.process.BrokenProcessPool:
            out.append("ok")   # not the candidate's fault: the real compile decides
            shutdown()
    return out
