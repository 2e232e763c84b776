"""``msa-tune --pattern msa=T``: Optuna over MSA's launch parameters (``msa.launch.MsaConfig``).

Per direction one study (``TuningKey.study_name``, in the database file, as ``search``): "fwd"
tunes the selection's and the forward's fields (timed: ``msa_attention``'s forward, selection
included), "bwd" the backward's (timed: the backward of a retained forward graph). The heuristic
default (``msa.launch.default_config``) is measured first, as the baseline and the reference: each
candidate's outputs (fwd: out and the KL; bwd: the five gradients) must match the default's
(relative error below ``TOLERANCE``) before it is timed. What cannot fit is pruned before it
compiles (``why_excluded``). The winner is stored as an ordinary row: pattern ``msa=T[,block=B]``,
``gqa_group`` = H / Hp (query heads per proxy head), config = that direction's MsaConfig fields.
"""
from __future__ import annotations

import dataclasses
import datetime
import time

import torch

from ..kernels.schedule import pow2
from ..msa import launch
from ..msa.api import msa_attention
from .keys import MSA_FIELDS, TuningKey, library_version
from .lookup import reload
from .measure import interleaved, time_runner
from .search import RowResult

#: the knobs and their choices (the same on every device, so that processes sharing a study agree)
KNOBS = {
    "fwd": {"select_block_m": (32, 64, 128), "select_warps": (4, 8), "select_stages": (1, 2, 3),
            "fwd_rows": (64, 128), "fwd_warps": (4, 8), "fwd_stages": (1, 2, 3)},
    "bwd": {"bwd_rows": (64, 128), "bwd_block_n": (32, 64), "bwd_warps": (4, 8), "bwd_stages": (1, 2, 3)},
}
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 2e-2}


@dataclasses.dataclass(frozen=True)
class MsaProblem:
    """The problem timed: B=1, H query, Hkv key/value, Hp (= Hpk) proxy heads, N, D = Dp."""

    pattern: str          # canonical msa spec, e.g. "msa=2048"
    top_k: int
    block: int
    heads: int
    kv_heads: int
    proxy_heads: int
    seqlen: int
    head_dim: int
    dtype: torch.dtype
    device: str
    interpreter: bool

    @property
    def group(self) -> int:
        return self.heads // self.proxy_heads

    @property
    def tile_heads(self) -> int:
        """The heads of a tile's entry (``launch.Heads.tile_heads``), on which the stage limit depends."""
        return launch.Heads(self.heads, self.kv_heads, self.proxy_heads, self.proxy_heads).tile_heads

    def describe(self) -> str:
        return (f"msa_attention B=1 H={self.heads} Hkv={self.kv_heads} Hp={self.proxy_heads} N={self.seqlen} "
                f"D=Dp={self.head_dim} {str(self.dtype).replace('torch.', '')} top_k={self.top_k} "
                f"block={self.block}")


def why_excluded(direction: str, params: dict, problem: MsaProblem) -> str | None:
    """Why a candidate cannot run (pruned before it compiles), or None."""
    rows_name, stages_name = ("fwd_rows", "fwd_stages") if direction == "fwd" else ("bwd_rows", "bwd_stages")
    if not problem.interpreter:
        most = launch.tile_stages(problem.tile_heads, params[rows_name], problem.head_dim, problem.head_dim)
        if params[stages_name] > most:
            return (f"shared memory: {stages_name}={params[stages_name]} with {rows_name}={params[rows_name]} at "
                    f"{problem.tile_heads} heads per entry, head dim {problem.head_dim} (at most {most}, launch.tile_stages)")
    if direction == "fwd":
        if problem.block % params["select_block_m"]:
            return f"select_block_m={params['select_block_m']} does not divide block={problem.block}"
        n_sel = max(2, pow2(problem.top_k // problem.block))
        cap = launch.default_config(problem.block, problem.top_k // problem.block, problem.head_dim,
                                    problem.head_dim).select_block_m
        if n_sel > 32 and params["select_block_m"] > cap:
            return f"select_block_m={params['select_block_m']}: the running top-{n_sel} outgrows the registers"
        return None
    if params["bwd_block_n"] > problem.block:
        return f"bwd_block_n={params['bwd_block_n']} exceeds block={problem.block}"
    if not problem.interpreter and problem.head_dim >= 128 and params["bwd_rows"] == 128 \
            and params["bwd_block_n"] == 64:
        return ("shared memory: bwd_rows=128 with bwd_block_n=64 at head dim >= 128 asked 239-272 KB on the H200 "
                "(227 KiB available)")
    return None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class MsaBench:
    """Inputs of one problem; ``check`` against the default's outputs and ``time`` of a candidate."""

    def __init__(self, p: MsaProblem, direction: str, rep_ms: int = 100):
        self.p, self.direction, self.rep_ms = p, direction, rep_ms
        gen = torch.Generator(device="cpu").manual_seed(4321)
        dev = torch.device(p.device)

        def rnd(h):
            return torch.randn(1, h, p.seqlen, p.head_dim, generator=gen).to(dev, p.dtype).requires_grad_()

        self.inputs = (rnd(p.heads), rnd(p.kv_heads), rnd(p.kv_heads), rnd(p.proxy_heads), rnd(p.proxy_heads))
        self.do = torch.randn(1, p.heads, p.seqlen, p.head_dim, generator=gen).to(dev, p.dtype)
        self.default = launch.default_config(p.block, p.top_k // p.block, p.head_dim, p.head_dim, g=p.tile_heads)
        self.ref = self._outputs(self.default)

    def config(self, params: dict) -> launch.MsaConfig:
        return dataclasses.replace(self.default, **params)

    def _outputs(self, cfg) -> list[torch.Tensor]:
        with launch.use_msa_config(cfg):
            if self.direction == "fwd":
                with torch.no_grad():
                    out, kl = msa_attention(*self.inputs, self.p.top_k, block=self.p.block, return_kl=True)
                return [out, kl]
            out, kl = msa_attention(*self.inputs, self.p.top_k, block=self.p.block)
            return list(torch.autograd.grad((out, kl), self.inputs, (self.do, torch.ones_like(kl))))

    def check(self, cfg) -> float:
        """Largest relative error against the default's outputs; ValueError above the tolerance."""
        errs = [_rel(a, b) for a, b in zip(self._outputs(cfg), self.ref)]
        worst = max(errs)
        if not worst <= TOLERANCE[self.p.dtype]:
            raise ValueError(f"wrong result: relative error {worst:.3g} against the default "
                             f"(tolerance {TOLERANCE[self.p.dtype]:g})")
        return worst

    def runner(self, cfg):
        args, top_k, block = self.inputs, self.p.top_k, self.p.block
        if self.direction == "fwd":
            def run():
                with launch.use_msa_config(cfg), torch.no_grad():
                    msa_attention(*args, top_k, block=block)
            return run
        with launch.use_msa_config(cfg):   # the backward runs the config saved by this call
            out, kl = msa_attention(*args, top_k, block=block)
        grads = (self.do, torch.ones_like(kl))

        def run_bwd():
            torch.autograd.grad((out, kl), args, grads, retain_graph=True)
        return run_bwd

    def time(self, cfg, rep_ms: int | None = None) -> tuple[float, float]:
        """(median ms, interquartile range ms)."""
        med, iqr, _ = time_runner(self.runner(cfg), self.p.interpreter, 2, rep_ms or self.rep_ms)
        return med, iqr


def tune_msa(problem: MsaProblem, direction: str, key: TuningKey, db_path, *, trials: int, seed: int = 0,
             deadline: float | None = None, rep_ms: int = 100) -> RowResult | None:
    """Tune one direction's MsaConfig fields for one key; store the winner in ``db_path``. None when
    nothing valid was measured."""
    import optuna
    from optuna.trial import TrialState

    from .database import TuningDB
    from .search import FINALISTS, _params_key, _provenance, _settle, open_study

    TuningDB(db_path).close()   # our schema first
    knobs = KNOBS[direction]
    fields = MSA_FIELDS[direction]
    bench = MsaBench(problem, direction, rep_ms=rep_ms)
    default_params = {f: getattr(bench.default, f) for f in fields}
    default_ms, _ = bench.time(bench.default)
    measured = {_params_key(default_params): (default_ms, 0.0, default_params)}
    study = open_study(key, db_path, seed)
    failures, pruned, counted, attempts = [], 0, 0, 0
    while counted < trials and attempts < 20 * trials + 50:
        if deadline is not None and time.monotonic() >= deadline:
            break
        attempts += 1
        trial = study.ask()
        try:
            params = {name: trial.suggest_categorical(name, list(choices)) for name, choices in knobs.items()}
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
        pk = _params_key(params)
        reason = why_excluded(direction, params, problem)
        if reason is None and pk in measured:
            reason = "already measured"
        if reason is not None:
            _settle(study, trial, excluded=reason)
            pruned += 1
            if all(why_excluded(direction, dict(zip(knobs, c)), problem) is not None
                   or _params_key(dict(zip(knobs, c))) in measured for c in _product(knobs)):
                break   # the whole space is measured or excluded
            continue
        counted += 1
        cfg = bench.config(params)
        try:
            err = bench.check(cfg)
            med, spread = bench.time(cfg)
        except Exception as e:   # compile errors, out of resources, wrong results
            reason = f"{type(e).__name__}: {' '.join(str(e).split())}"[:500]
            _settle(study, trial, failure=reason)
            failures.append(reason)
            pruned += 1
            continue
        _settle(study, trial, med, check_error=err, spread_ms=spread, meaningful=not problem.interpreter)
        measured[pk] = (med, spread, params)
    # the finalists (the best few and the default) re-measured interleaved: one do_bench each is
    # too noisy to call a winner that differs from the default by a few tenths of a percent
    dpk = _params_key(default_params)
    order = sorted(measured, key=lambda pk: measured[pk][0])[:FINALISTS]
    order += [dpk] if dpk not in order else []
    n_rounds = 0 if deadline is not None and time.monotonic() >= deadline else (2 if problem.interpreter else 5)
    if n_rounds and len(order) > 1:
        timed = interleaved(lambda pk: bench.time(bench.config(measured[pk][2]), rep_ms=max(10, rep_ms // 2))[0],
                            order, n_rounds)
    else:
        n_rounds = 0
        timed = {pk: measured[pk][:2] for pk in order}
    win = min(order, key=lambda pk: timed[pk][0])
    (med, spread), config, default_ms = timed[win], measured[win][2], timed[dpk][0]
    n_trials = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    row = dict(key.as_dict(), config={f: int(config[f]) for f in fields}, median_ms=med, spread_ms=spread,
               tflops=None, default_ms=default_ms, trials=max(1, n_trials), batch=1, heads=problem.heads,
               kv_heads=problem.kv_heads, seqlen=problem.seqlen, library_version=library_version(),
               created_at=datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None, microsecond=0),
               provenance=_provenance(problem, not problem.interpreter, n_rounds))
    with TuningDB(db_path) as db:
        stored = db.put(row, keep_faster=True)
    reload()   # this process's next msa_attention calls see the row
    return RowResult(key, row["config"], med, spread, default_ms, None, n_trials, pruned, failures, stored)


def _product(knobs: dict):
    import itertools

    return itertools.product(*knobs.values())
