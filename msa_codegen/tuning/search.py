"""The search: Optuna (seeded TPE) over one direction's knobs for one key, winner stored.

One Optuna study per tuning key (``TuningKey.study_name``), kept in the tuning database file
itself through Optuna's RDBStorage (``sqlite:///PATH``, connect timeout): several processes
(one per GPU of a node) tuning the same key share its trials, ``load_if_exists=True``.

A trial: Optuna proposes a value per knob; the explicit filter (``space.why_excluded``)
prunes what cannot fit before anything compiles (near the shared-memory limit an ahead-of-time
compile for the GPU's target decides, ``tuning.resources``); the candidate is checked against the
float64 reference on a small problem; only then is it timed. A compile or launch failure,
or a wrong result, ends the trial as pruned with the reason in its user attributes, never
the tuner. The heuristic default is enqueued first, so it is always measured (the baseline), then a
few of its neighbours (``space.seeds``).
Afterwards the best few distinct configurations (and the default) are re-measured
interleaved, round after round, and the fastest by median is stored with the median and
interquartile range of those rounds.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import platform
import random
import socket
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from ..config import LaunchConfig
from ..heuristics import default_config
from . import gpu as _gpu
from . import precompile as _pre
from . import resources as _resources
from . import space as _space
from .progress import Progress, TuneStats
from .keys import TuningKey, library_version
from .lookup import reload
from .measure import Bench, Problem, WrongResult, error_line, interleaved

CONNECT_TIMEOUT_S = 120
FINALISTS = 3


@dataclasses.dataclass
class TuneResult:
    key: TuningKey
    problem: Problem
    config: dict              # the winner's fields of this direction
    median_ms: float
    spread_ms: float
    default_ms: float | None  # the heuristic default, re-measured in the same rounds
    tflops: float | None
    trials: int               # completed trials of the study
    pruned: int               # trials pruned in this process (filter, failures, wrong results)
    failures: list[str]       # reasons of the candidates that failed or were wrong (this process)
    stored: bool              # False when a faster row of the same shape was already stored
    meaningful: bool          # False in Triton's interpreter
    stats: TuneStats | None = None   # counts of this process: trials, pruned by kind, failed, best

    @property
    def speedup(self) -> float | None:
        return self.default_ms / self.median_ms if self.default_ms else None


@dataclasses.dataclass
class RowResult:
    """What the exhaustive and MSA tuners (``gluon_search``, ``msa_search``) stored for one key and
    direction: the winner's fields, its median and spread, the default's median in the same rounds."""

    key: TuningKey
    config: dict
    median_ms: float
    spread_ms: float
    default_ms: float | None
    tflops: float | None
    trials: int
    pruned: int
    failures: list
    stored: bool

    @property
    def speedup(self) -> float | None:
        return self.default_ms / self.median_ms if self.default_ms else None


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock on ``PATH.lock`` (POSIX): serializes the creation of Optuna's tables and
    of a study by several processes starting at once. Elsewhere a no-op."""
    try:
        import fcntl
    except ImportError:   # pragma: no cover - Windows
        yield
        return
    lock = Path(f"{path}.lock")
    with open(lock, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def storage_url(db_path: Path) -> str:
    return f"sqlite:///{Path(db_path).absolute()}"


def open_study(key: TuningKey, db_path: Path, seed: int):
    """The key's Optuna study in the database file (created or loaded), and its sampler's seed."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with _file_lock(db_path), warnings.catch_warnings():
        warnings.simplefilter("ignore", category=optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.RDBStorage(storage_url(db_path),
                                             engine_kwargs={"connect_args": {"timeout": CONNECT_TIMEOUT_S}})
        # the seed moves past the trials already in the study, so that a second process (or run)
        # does not replay the first one's proposals
        probe = optuna.load_study(study_name=key.study_name(), storage=storage) if _study_exists(storage, key) \
            else None
        offset = len(probe.trials) if probe is not None else 0
        sampler = optuna.samplers.TPESampler(seed=seed + offset, n_startup_trials=8, multivariate=True,
                                             constant_liar=True)
        study = optuna.create_study(study_name=key.study_name(), storage=storage, direction="minimize",
                                    sampler=sampler, load_if_exists=True)
    return study


def _study_exists(storage, key: TuningKey) -> bool:
    try:
        return any(s.study_name == key.study_name() for s in storage.get_all_studies())
    except Exception:
        return False


def _params_key(params: dict) -> tuple:
    return tuple(sorted((k, int(v)) for k, v in params.items()))


def _provenance(problem: Problem, meaningful: bool, rounds: int) -> str:

    who = f"msa-tune on {socket.gethostname()}"
    dev = _gpu.device_name() if not problem.interpreter else "Triton interpreter (CPU)"
    what = (f"{problem.describe()}; finalists re-measured interleaved over {rounds} rounds"
            + ("" if meaningful else "; TRITON_INTERPRET=1: timings NOT meaningful"))
    return f"{who} ({dev}; torch {torch.__version__}; python {platform.python_version()}): {what}"


def tune(problem: Problem, direction: str, key: TuningKey, db_path: Path, *, trials: int, seed: int = 0,
         progress: bool = True, finalists: int = FINALISTS, rounds: int | None = None,
         rep_ms: int = 100, on_trial: Callable[[int, float | None], None] | None = None,
         precompile: bool | None = None, jobs: int | None = None, deadline: float | None = None,
         stats: TuneStats | None = None) -> TuneResult | None:
    """Tune one direction of one key; store the winner in ``db_path``. None when nothing valid
    was measured (every candidate failed, the default included).

    ``precompile`` (default: on a GPU) asks the sampler for a batch of ``jobs`` candidates
    (default ``precompile.workers()``: the CPU cores, at most 16) and compiles them in parallel
    worker processes before checking and timing them here (``tuning.precompile``).

    Before anything compiles, candidates are pruned by the filter (``space.why_excluded``: the
    shared-memory estimate among others) and, where the estimate comes close to the device's
    limit, by an ahead-of-time compile for the GPU's target (``tuning.resources``). An out of
    resources error that still happens is a failed trial, counted in ``stats``, never printed.

    ``deadline`` (``time.monotonic()`` seconds): no trial starts after it; what finished is
    stored (the best trial's own timing when the finalists' rounds no longer fit). ``stats`` is
    filled in place (also when nothing valid was measured or the run is interrupted)."""
    import optuna
    from optuna.trial import TrialState

    from .database import TuningDB

    interp = problem.interpreter
    dev = torch.device(problem.device)
    env = _space.Env(head_dim=problem.head_dim, dtype=problem.dtype, seqlen=problem.seqlen,
                     dilation=problem.dilation, interpreter=interp,
                     smem_bytes=_space.device_smem_bytes(dev) if not interp else 1 << 30)
    knobs = _space.knobs(direction, interp)
    valid = _space.candidates(direction, env)
    default = default_config(dev, problem.head_dim, problem.dtype, pattern=problem.pattern)
    default_params = _space.params_of(direction, default)
    # our schema first: a foreign or newer file is refused before Optuna adds its tables to it
    TuningDB(db_path).close()
    bench = Bench(problem, direction, rep_ms=rep_ms)
    study = open_study(key, db_path, seed)

    def measured() -> dict[tuple, optuna.trial.FrozenTrial]:
        done = {}
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            if t.state == TrialState.COMPLETE or t.user_attrs.get("failure") or t.user_attrs.get("target_excluded"):
                # measured, failed, or over the target's shared memory (ahead-of-time compile)
                done[_params_key(t.params)] = t
        return done

    already = measured()
    for p in [default_params, *_space.seeds(direction, default_params, env)]:
        # the default (the baseline) and a few of its neighbours are measured first
        if _params_key(p) not in already:
            study.enqueue_trial(p, skip_if_exists=True)

    failures: list[str] = []
    checked_here: set[tuple] = set()   # candidates this process checked against the reference
    pruned = 0
    counted = 0
    attempts = 0
    max_attempts = 20 * trials + 50
    best = None
    misses = 0
    rng = random.Random(seed)
    everything = {_params_key(p) for p in valid} | {_params_key(default_params)}
    stats = stats if stats is not None else TuneStats(problem.bucket, direction, trials)
    bar = Progress(stats, enabled=progress)
    batch_size = 1
    if precompile if precompile is not None else not interp:
        batch_size = jobs if jobs is not None else _pre.workers()
    # the ahead-of-time verdict of borderline candidates (a GPU process: kernels not interpreted)
    aot = _target_checks(interp)
    capability = key.capability

    def out_of_time() -> bool:
        return deadline is not None and time.monotonic() >= deadline

    try:
        while counted < trials and attempts < max_attempts:
            if out_of_time():
                stats.budget_stop = True
                break
            done = measured()
            if everything <= set(done):   # every valid candidate (and the default) measured
                break
            batch = []   # (trial, params key, config) of candidates to measure
            while len(batch) < min(batch_size, trials - counted) and attempts < max_attempts:
                attempts += 1
                trial = study.ask()
                try:
                    params = {name: trial.suggest_categorical(name, list(choices)) for name, choices in knobs.items()}
                except optuna.exceptions.UpdateFinishedTrialError:
                    continue   # an enqueued trial another process took and finished
                pk = _params_key(params)
                is_default = pk == _params_key(default_params)
                reason = None if is_default else _space.why_excluded(direction, params, env)
                if reason is None and (pk in done or any(pk == b[1] for b in batch)):
                    reason = "already measured in this study"
                if reason is not None:
                    # pruned before compiling: costs nothing and is not counted as a trial
                    _settle(study, trial, excluded=reason)
                    pruned += 1
                    if reason != "already measured in this study":
                        if _space.is_smem_reason(reason):
                            stats.pruned_smem += 1
                        else:
                            stats.pruned_other += 1
                    misses += 1
                    if misses >= 5:
                        # the sampler keeps proposing what is excluded or measured (small or heavily
                        # constrained spaces): queue a valid candidate nobody measured yet
                        fresh = [p for p in valid if _params_key(p) not in done
                                 and all(_params_key(p) != b[1] for b in batch)]
                        if fresh:
                            study.enqueue_trial(rng.choice(fresh), skip_if_exists=True)
                        misses = 0
                    continue
                misses = 0
                batch.append((trial, pk, _space.with_params(direction, params, default), params, is_default))
            # close to the shared-memory limit: an ahead-of-time compile for the target decides
            near = [b for b in batch if aot and not b[4] and _space.borderline(direction, b[3], env)]
            if near:
                verdicts = _pre.shared_verdicts(problem, direction, [b[3] for b in near], limit=env.smem_bytes,
                                                capability=capability, n_workers=batch_size)
                for b, verdict in zip(near, verdicts):
                    if verdict.startswith("smem:"):
                        _settle(study, b[0], excluded=verdict[5:], target_excluded=True)
                        pruned += 1
                        stats.pruned_smem += 1
                        batch.remove(b)
                    # "error:...": the real compile below fails the same way and records it
                bar.update()
            batch = [b[:3] for b in batch]
            # compile the batch in parallel worker processes (nothing is timed meanwhile)
            compiled = (_pre.compile_all(problem, direction, [b[2] for b in batch], n_workers=batch_size)
                        if batch_size > 1 else [None] * len(batch))
            for i, ((trial, pk, cfg), compile_error) in enumerate(zip(batch, compiled)):
                if out_of_time():
                    # compiled but not started: left for a later run (not marked as a failure)
                    for t, _, _ in batch[i:]:
                        _settle(study, t, excluded="not timed: time budget spent")
                    stats.budget_stop = True
                    break
                counted += 1
                stats.trials += 1
                if compile_error is not None:
                    _fail(study, trial, compile_error, failures, stats)
                    pruned += 1
                    _bar_update(bar, best)
                    continue
                try:
                    err = bench.check(cfg)
                    checked_here.add(pk)
                    med, spread, _ = bench.time(cfg)
                except WrongResult as e:
                    _fail(study, trial, f"wrong result: {e}", failures, stats)
                    pruned += 1
                except Exception as e:   # compile errors, out of resources, launch failures
                    _fail(study, trial, error_line(e), failures, stats)
                    pruned += 1
                else:
                    _settle(study, trial, med, check_error=err, spread_ms=spread, meaningful=not interp)
                    best = med if best is None else min(best, med)
                    stats.best_ms = best
                    if on_trial:
                        on_trial(counted, best)
                _bar_update(bar, best)
    finally:
        _bar_close(bar)

    # ---- finalists: the best distinct completed configs of the study (all processes), and the default
    complete = sorted((t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                       if t.value is not None and set(t.params) == set(knobs)), key=lambda t: t.value)
    dpk = _params_key(default_params)
    chosen: dict[tuple, dict] = {}
    for t in complete:
        pk = _params_key(t.params)
        if len(chosen) < finalists and pk not in chosen and (
                pk == dpk or _space.why_excluded(direction, t.params, env) is None):
            chosen[pk] = {k: int(v) for k, v in t.params.items()}
    if any(_params_key(t.params) == dpk for t in complete):
        chosen.setdefault(dpk, default_params)   # the baseline of the speedup
    runners: dict[tuple, LaunchConfig] = {}
    for pk, params in chosen.items():
        cfg = _space.with_params(direction, params, default)
        if pk not in checked_here:
            # proposed and measured by another process (or an earlier run): checked here too
            try:
                bench.check(cfg)
            except Exception as e:
                failures.append(f"finalist {params}: {type(e).__name__}: {e}"[:500])
                continue
        runners[pk] = cfg
    if not runners:
        return None
    n_rounds = rounds if rounds is not None else (2 if interp else 5)
    order = list(runners)
    if out_of_time():
        # the budget is spent: the finalists keep the timings of their trials (no rounds)
        n_rounds = 0
        by_pk = {_params_key(t.params): t for t in complete}
        timed = {pk: (by_pk[pk].value, float(by_pk[pk].user_attrs.get("spread_ms", 0.0))) for pk in order}
    else:
        timed = interleaved(lambda pk: bench.time(runners[pk], rep_ms=max(10, rep_ms // 2))[0], order, n_rounds)
    win = min(order, key=lambda pk: timed[pk][0])
    med, spread = timed[win]
    default_ms = timed[dpk][0] if dpk in timed else None
    win = chosen[win]
    flops = problem.flops(direction)
    tflops = flops / med / 1e9 if flops else None
    n_trials = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    config = dict(win)
    row = dict(key.as_dict(), config=config, median_ms=med, spread_ms=spread, tflops=tflops, default_ms=default_ms,
               trials=n_trials, batch=problem.batch, heads=problem.heads, kv_heads=problem.kv_heads,
               seqlen=problem.seqlen, library_version=library_version(),
               created_at=datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None, microsecond=0),
               provenance=_provenance(problem, not interp, n_rounds))
    with TuningDB(db_path) as db:
        stored = db.put(row, keep_faster=True)
    reload()   # this process's next lookups and call plans see the new row
    stats.best_ms = med
    return TuneResult(key, problem, config, med, spread, default_ms, tflops, n_trials, pruned, failures, stored,
                      meaningful=not interp, stats=stats)


def _target_checks(interpreter: bool) -> bool:
    """Whether borderline candidates get an ahead-of-time compile for the target: a GPU process
    (kernels not interpreted) with Triton's NVIDIA backend."""
    return not interpreter and _resources.available()


def _settle(study, trial, value: float | None = None, **attrs) -> bool:
    """Record a trial: its user attributes, then complete (``value``) or pruned (None). False
    when another process sharing the study already finished it (two processes can be handed
    the same enqueued trial): then this process's result is dropped, the study keeps theirs."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    try:
        for name, v in attrs.items():
            trial.set_user_attr(name, v)
        if value is None:
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, value)
    except UpdateFinishedTrialError:
        return False
    return True


def _fail(study, trial, reason: str, failures: list[str], stats: TuneStats | None = None) -> None:
    reason = reason[:500]
    _settle(study, trial, failure=reason)
    failures.append(reason)
    if stats is not None:
        stats.failed += 1
        if _space.is_smem_reason(reason) or "OutOfResources" in reason:
            stats.out_of_resources += 1


# ---- progress (tuning.progress) ------------------------------------------------------------

def _bar_update(bar: Progress, best):
    bar.update()


def _bar_close(bar: Progress):
    bar.close()
