"""``attention(..., autotune=True)``: tune a missing key on first use, with a short budget.

A key (GPU, pattern, dtype, head dim, GQA group, length bucket; per direction) is missing
when no database row of this GPU and this bucket exists for it: the lookup would run a
nearest-bucket row, another GPU's row or the heuristic default. Then the key is tuned once
in this process, eagerly, on the representative problem of its bucket (the shape
``msa-tune`` times), with ``AUTOTUNE_TRIALS`` trials per missing direction, and the winner
is stored in the user database; the call then runs it. A key is attempted at most once per
process, whatever the outcome, so a failure never repeats on every step. Progress goes to
standard error.

Candidates compile in this process (no worker processes: spawning them would re-import the
user's main script). Under ``torch.compile`` nothing is tuned (the lookup is a constant of the graph): a warning
says so once, and the configuration the lookup gives is used.
"""
from __future__ import annotations

import sys
import threading
import warnings

import torch

from .. import api
from .. import config as _config
from .keys import TuningKey
from .lookup import lookup, reload, user_db_path
from .measure import representative_problem
from .search import tune

AUTOTUNE_TRIALS = 12

_attempted: set[tuple] = set()
_lock = threading.Lock()


def _missing(res) -> list[str]:
    out = []
    for direction in ("fwd", "bwd"):
        row = getattr(res, direction).row
        if not row or row["gpu"] != res.gpu or row["bucket"] != res.bucket:
            out.append(direction)
    return out


def ensure_tuned(q: torch.Tensor, k: torch.Tensor, pattern: str, *, trials: int | None = None) -> list:
    """Tune the missing directions of this call's key (once per process). Returns the
    ``TuneResult`` of each direction tuned now (empty when nothing was missing or tried)."""
    trials = AUTOTUNE_TRIALS if trials is None else trials
    if _config.override() is not None:
        return []   # use_config(...) decides; nothing to tune
    if torch.compiler.is_compiling():
        _warn_compiling()
        return []
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    res = lookup(q.device, pattern, d, q.dtype, hq // hkv, n)
    missing = _missing(res)
    if not missing:
        return []
    ident = (res.gpu, res.capability, res.pattern, res.dtype, res.head_dim, res.gqa_group, res.bucket)
    with _lock:
        if ident in _attempted:
            return []
        _attempted.add(ident)
        cuda = q.device.type == "cuda"
        problem = representative_problem(res.pattern, hq, hkv, n, d, q.dtype, cuda)
        db = user_db_path()
        print(f"msa_codegen: autotune: no tuned row of {res.pattern!r} ({res.dtype}, head dim {d}, GQA group "
              f"{hq // hkv}, bucket {res.bucket}) for {res.gpu}: tuning {', '.join(missing)} "
              f"({trials} trials each, {problem.describe()}) into {db}", file=sys.stderr, flush=True)
        results = []
        for direction in missing:
            key = TuningKey.current(res.gpu, res.capability, res.pattern, direction, q.dtype, d, hq // hkv, n)
            try:
                r = tune(problem, direction, key, db, trials=trials, precompile=False)
            except Exception as e:   # the call still runs, with what the lookup gives
                warnings.warn(f"msa_codegen: autotune of {res.pattern!r} {direction} failed "
                              f"({type(e).__name__}: {e}); using {getattr(res, direction).source}",
                              RuntimeWarning, stacklevel=3)
                continue
            if r is None:
                warnings.warn(f"msa_codegen: autotune of {res.pattern!r} {direction}: no candidate ran correctly; "
                              f"using {getattr(res, direction).source}", RuntimeWarning, stacklevel=3)
                continue
            print(f"msa_codegen: autotune: {direction} {r.config} {r.median_ms:.4g} ms"
                  + (f" ({r.speedup:.2f}x the default)" if r.speedup else ""), file=sys.stderr, flush=True)
            results.append(r)
        reload()
        return results


_warned_compiling = False


def _warn_compiling() -> None:
    global _warned_compiling
    if not _warned_compiling:
        _warned_compiling = True
        warnings.warn("msa_codegen: attention(..., autotune=True) inside torch.compile does not tune (the "
                      "configuration is a constant of the graph); call it once eagerly, or run msa-tune first",
                      RuntimeWarning, stacklevel=3)


def forget_attempts() -> None:
    """Let every key be tried again (tests)."""
    with _lock:
        _attempted.clear()


api.install_autotuner(ensure_tuned)
