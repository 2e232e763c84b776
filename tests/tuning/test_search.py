"""The tuner (msa_codegen.tuning.search, space, measure, precompile, grid, auto): tune -> store ->
load, failures pruned, the search space, the shipped grid, autotune; on the CPU in Triton's
interpreter (the GPU cases marked gpu)."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import msa_codegen as msa
from msa_codegen.config import BwdConfig, FwdConfig, LaunchConfig
from msa_codegen.heuristics import default_config
from msa_codegen.tuning import space
from msa_codegen.tuning.database import TuningDB
from msa_codegen.tuning.keys import TuningKey, bucket
from msa_codegen.tuning.search import tune

from helpers import rel_err
from tuning_helpers import PATTERN, _key, _problem, call_config, tmp_home  # noqa: F401 (tmp_home: autouse)


# ---- the search space --------------------------------------------------------------------------

def test_space_and_filter():
    gpu_env = space.Env(head_dim=128, dtype=torch.bfloat16, seqlen=131072)
    fwd = space.candidates("fwd", gpu_env)
    assert 0 < len(fwd) < len(space.space("fwd", False)) == 5 * 5 * 2 * 5
    for direction in ("fwd", "bwd"):
        # the heuristic default of a GPU is worth measuring
        params = space.params_of(direction, default_config(torch.device("cuda"), 128, torch.bfloat16))
        assert space.why_excluded(direction, params, gpu_env) is None
    why = space.why_excluded("fwd", dict(block_m=256, block_n=256, num_warps=4, num_stages=5), gpu_env)
    assert "shared memory" in why
    why = space.why_excluded("fwd", dict(block_m=256, block_n=128, num_warps=4, num_stages=1), gpu_env)
    assert "accumulator" in why
    short = space.Env(head_dim=64, dtype=torch.bfloat16, seqlen=100, dilation=2)
    assert "longer than" in space.why_excluded("fwd", dict(block_m=128, block_n=128, num_warps=4, num_stages=2), short)
    # 16-row dk/dv blocks with more than 2 stages faulted on the H200's descriptor path (run 17)
    bwd = dict(block_m1=16, block_n1=64, num_warps1=4, num_stages1=4, block_m2=128, block_n2=64, num_warps2=8,
               num_stages2=3)
    assert "misaligned" in space.why_excluded("bwd", bwd, gpu_env)
    assert space.why_excluded("bwd", {**bwd, "num_stages1": 2}, gpu_env) is None
    assert space.why_excluded("bwd", {**bwd, "block_m1": 32}, gpu_env) is None
    interp = space.Env(head_dim=16, dtype=torch.float32, seqlen=64, interpreter=True)
    assert {(p["block_m"], p["block_n"]) for p in space.candidates("fwd", interp)} == {(16, 16), (16, 32), (32, 16),
                                                                                         (32, 32)}
    assert len(space.candidates("bwd", interp)) == 16


def test_seeds_reach_the_doubled_tiles():
    """The seeds measured first include both blocks doubled with one stage fewer: from the former
    D=256 forward default (64, 32, 8, 3) that is (128, 64, 8, 2), 2.4x faster on the H200, which
    8 trials from the other neighbours did not reach. Every seed passes the filter."""
    env = space.Env(head_dim=256, dtype=torch.bfloat16, seqlen=8192)
    old = dict(block_m=64, block_n=32, num_warps=8, num_stages=3)
    got = space.seeds("fwd", old, env)
    assert dict(block_m=128, block_n=64, num_warps=8, num_stages=2) in got
    assert old not in got and len(got) == len({tuple(sorted(p.items())) for p in got})
    assert all(space.why_excluded("fwd", p, env) is None for p in got)
    bwd = space.params_of("bwd", default_config(torch.device("cuda"), 128, torch.bfloat16))
    assert all(space.why_excluded("bwd", p, space.Env(head_dim=128, dtype=torch.bfloat16, seqlen=8192)) is None
               for p in space.seeds("bwd", bwd, space.Env(head_dim=128, dtype=torch.bfloat16, seqlen=8192)))


def test_tune_store_load(tmp_home):
    db = tmp_home / "tuning.db"
    results = {d: tune(_problem(), d, _key(d), db, trials=2, progress=False) for d in ("fwd", "bwd")}
    for d, res in results.items():
        assert res is not None and res.stored and not res.meaningful
        assert res.median_ms > 0 and res.default_ms is not None and res.trials >= 2
    with TuningDB(db) as tdb:
        rows = {r["direction"]: r for r in tdb.rows()}
        assert tdb.integrity_check() == "ok"
    assert set(rows) == {"fwd", "bwd"}
    assert rows["fwd"]["config"] == results["fwd"].config and rows["bwd"]["config"] == results["bwd"].config
    assert "NOT meaningful" in rows["fwd"]["provenance"] and rows["fwd"]["bucket"] == 1024
    # what attention will run: the stored rows, from the user database
    cfg, source = call_config(48)
    assert source == f"user db {db} (cpu-interpreter, bucket 1024)"
    assert cfg == LaunchConfig(FwdConfig(**rows["fwd"]["config"]), BwdConfig(**rows["bwd"]["config"]))
    # and it runs correctly with them, forward and backward
    q = torch.randn(1, 2, 48, 16, requires_grad=True)
    k, v = (torch.randn(1, 1, 48, 16, requires_grad=True) for _ in range(2))
    out = msa.attention(q, k, v, PATTERN)
    out.sum().backward()
    ref = msa.reference_attention(q, k, v, PATTERN)
    assert rel_err(out, ref) < 1e-4
    # a second run shares the study (load_if_exists) and does not repeat what was measured
    again = tune(_problem(), "fwd", _key("fwd"), db, trials=2, progress=False)
    assert again.trials >= results["fwd"].trials


def test_failures_are_pruned_and_wrong_configs_never_win(tmp_home, monkeypatch):
    """A candidate that does not compile/launch and one whose result is wrong are pruned trials,
    never the winner, never a crash."""
    import optuna

    real = msa.attention

    def flaky(q, k, v, pattern="causal", **kw):
        cfg = msa.config.override()
        if cfg is not None and cfg.fwd.block_n == 16:
            raise RuntimeError("out of resources: shared memory (simulated)")
        out = real(q, k, v, pattern, **kw)
        if cfg is not None and cfg.fwd.block_m == 16:   # silently wrong
            return (out[0] + 1.0, out[1]) if isinstance(out, tuple) else out + 1.0
        return out

    monkeypatch.setattr(msa.api, "attention", flaky)   # what the tuner's measurements call
    db = tmp_home / "tuning.db"
    res = tune(_problem(), "fwd", _key("fwd"), db, trials=4, progress=False)
    assert res is not None
    assert res.config == {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 1}
    study = optuna.load_study(study_name=_key("fwd").study_name(), storage=f"sqlite:///{db}")
    failures = {(t.params["block_m"], t.params["block_n"]): t.user_attrs["failure"]
                for t in study.trials if "failure" in t.user_attrs}
    assert all(t.state == optuna.trial.TrialState.PRUNED for t in study.trials if "failure" in t.user_attrs)
    assert "simulated" in failures[(32, 16)]
    assert "wrong result" in failures[(16, 32)]
    with TuningDB(db) as tdb:
        (r,) = tdb.rows()
    assert r["config"]["block_m"] == 32 and r["config"]["block_n"] == 32


def test_autotune_tunes_a_missing_key_once_and_attention_runs_it(tmp_home, capsys):
    from msa_codegen.tuning import auto

    auto.forget_attempts()
    q = torch.randn(1, 2, 40, 16, requires_grad=True)
    k, v = (torch.randn(1, 1, 40, 16, requires_grad=True) for _ in range(2))
    assert msa.explain(q, k, v, PATTERN).source == "heuristic default"
    tuned = auto.ensure_tuned(q, k, PATTERN, trials=2)
    assert {r.key.direction for r in tuned} == {"fwd", "bwd"}
    assert "autotune: no tuned row" in capsys.readouterr().err
    res = msa.explain(q, k, v, PATTERN)
    assert res.fwd.source.startswith("user db") and res.bwd.source.startswith("user db")
    assert dataclasses.asdict(res.fwd.config) == next(r.config for r in tuned if r.key.direction == "fwd")
    # the key is present now: attention(..., autotune=True) tunes nothing more and is correct
    out = msa.attention(q, k, v, PATTERN, autotune=True)
    out.sum().backward()
    assert capsys.readouterr().err == ""
    assert rel_err(out, msa.reference_attention(q, k, v, PATTERN)) < 1e-4
    # run-time sparsity makes the kernels data-dependent: autotune refuses it clearly
    with pytest.raises(ValueError, match="autotune=True tunes a pattern's own kernels"):
        msa.attention(q, k, v, PATTERN, autotune=True, cu_seqlens=torch.tensor([0, 10, 40], dtype=torch.int32))
    # a key is attempted once per process, whatever happened
    assert auto.ensure_tuned(q[:, :, :30], k[:, :, :30], "window=4", trials=1) != []
    assert auto.ensure_tuned(q[:, :, :30], k[:, :, :30], "window=4", trials=1) == []
    auto.forget_attempts()


# ---- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_tuned_config_is_no_slower_than_the_default_and_attention_runs_it(tmp_home):
    """Tune one pattern on this GPU (short budget), then time the stored winner against the
    heuristic default in fresh interleaved rounds (not the tuner's own numbers) and check that
    attention() resolves to the stored row and stays correct with it."""
    from msa_codegen.tuning import gpu as _gpu
    from msa_codegen.tuning.measure import Bench
    from msa_codegen.tuning.measure import representative_problem

    pattern, n, d, dtype = "window=1024,dilation=2", 16384, 128, torch.bfloat16
    name, cap = _gpu.current_gpu()
    db = tmp_home / "tuning.db"
    problem = representative_problem(pattern, 8, 8, n, d, dtype, True)
    res = tune(problem, "fwd", TuningKey.current(name, cap, pattern, "fwd", dtype, d, 1, n), db, trials=8,
               progress=False)
    assert res is not None and res.stored and res.meaningful
    q = torch.randn(1, 8, n, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, 8, n, d, device="cuda", dtype=dtype) for _ in range(2))
    chosen = msa.explain(q, k, v, pattern)
    assert chosen.fwd.source == f"user db {db} ({name}, bucket {bucket(n)})"
    assert dataclasses.asdict(chosen.fwd.config) == res.config
    default = default_config(torch.device("cuda"), d, dtype)
    tuned = LaunchConfig(chosen.fwd.config, default.bwd)
    bench = Bench(problem, "fwd", rep_ms=100)
    t_tuned, t_default = [], []
    for _ in range(5):
        t_tuned.append(bench.time(tuned)[0])
        t_default.append(bench.time(default)[0])
    med_t, med_d = sorted(t_tuned)[2], sorted(t_default)[2]
    print(f"tuned {res.config}: {med_t:.4f} ms; default {dataclasses.asdict(default.fwd)}: {med_d:.4f} ms")
    assert med_t <= 1.03 * med_d, (med_t, med_d)
    from helpers import chunked_reference

    out = msa.attention(q, k, v, pattern)   # runs the stored row (resolved above)
    ref = chunked_reference(q, k, v, pattern, torch.randn_like(q))[0]
    assert rel_err(out, ref) < 1e-2


def test_precompiled_batches_run_in_workers_and_their_failures_are_pruned(tmp_home, monkeypatch):
    """Batches compiled by worker processes (spawned, in the interpreter here): the whole tune
    path still stores a checked winner, and a candidate whose compile failed in a worker is a
    pruned trial with that error, never timed."""
    import optuna

    from msa_codegen.config import as_list
    from msa_codegen.tuning import precompile

    assert precompile.warm_seqlen(131072) == 1024 and precompile.warm_seqlen(131075) == 1027
    assert precompile.warm_seqlen(300) == 300
    # real spawned workers run both directions of two candidates
    small = LaunchConfig(FwdConfig(16, 16, 4, 1), BwdConfig(16, 16, 4, 1, 16, 16, 4, 1))
    for direction in ("fwd", "bwd"):
        errors = precompile.compile_all(_problem(), direction,
                                        [small, default_config(torch.device("cpu"), 16, torch.float32)], n_workers=2)
        assert errors == [None, None]
    precompile.shutdown()
    # what a worker reports when a candidate cannot run: its error, one line
    err = precompile._warm("window=0", [(2, 1, 40)], 16, "float32", "cpu", "fwd", as_list(small))
    assert err is not None and err.startswith("PatternError") and "\n" not in err, err
    seen = []

    def fake_compile_all(problem, direction, configs, n_workers=None):
        seen.append([as_list(c) for c in configs])
        return ["CompilationError: simulated" if c.fwd.block_n == 16 else None for c in configs]

    monkeypatch.setattr(precompile, "compile_all", fake_compile_all)
    monkeypatch.setattr(precompile, "workers", lambda: 3)
    db = tmp_home / "tuning.db"
    res = tune(_problem(), "fwd", _key("fwd"), db, trials=4, progress=False, precompile=True)
    assert res is not None and res.config["block_n"] == 32
    assert seen and max(len(b) for b in seen) <= 3 and sum(len(b) for b in seen) == 4
    study = optuna.load_study(study_name=_key("fwd").study_name(), storage=f"sqlite:///{db}")
    failed = [t for t in study.trials if "failure" in t.user_attrs]
    assert failed and all("simulated" in t.user_attrs["failure"] and t.params["block_n"] == 16 for t in failed)
    assert all("spread_ms" not in t.user_attrs for t in failed)   # never timed


def test_a_trial_another_process_finished_is_dropped_not_a_crash(tmp_home):
    """Two processes sharing a study can be handed the same enqueued trial; the one that
    reports second gets its result dropped (the study keeps the first), it does not crash."""
    from msa_codegen.tuning.search import _fail, _settle, open_study

    db = tmp_home / "tuning.db"
    TuningDB(db).close()
    study = open_study(_key("fwd"), db, seed=0)
    study.enqueue_trial({"x": 1})
    trial = study.ask()
    other = open_study(_key("fwd"), db, seed=0)
    other.tell(trial.number, 2.0)   # "another process" finishes it first
    assert _settle(study, trial, 1.0, spread_ms=0.1) is False
    failures = []
    _fail(study, trial, "CompilationError: simulated", failures)   # no exception either
    assert failures == ["CompilationError: simulated"]
    (t,) = study.get_trials(deepcopy=False)
    assert t.value == 2.0 and "spread_ms" not in t.user_attrs
    trial2 = study.ask()
    assert _settle(study, trial2, 3.0, spread_ms=0.2) is True


def test_workers_warm_the_timed_and_the_check_specialisations(monkeypatch):
    """Each worker runs a candidate at the timed length's specialisation and at the correctness
    check's shape (an odd length: another compile), so that the tuner's process compiles neither."""
    from concurrent.futures import Future

    from msa_codegen import api
    from msa_codegen.config import as_list
    from msa_codegen.tuning import precompile
    from msa_codegen.tuning.measure import Problem, check_shape

    problem = Problem("window=64", 8, 16, 4, 8192, 32, torch.float32, "cuda", 8192)
    submitted = []

    class Pool:
        def submit(self, fn, *args):
            submitted.append(args)
            f = Future()
            f.set_result(None)
            return f

    monkeypatch.setattr(precompile, "_get_pool", lambda n: Pool())
    cfg = default_config(torch.device("cpu"), 32, torch.float32)
    assert precompile.compile_all(problem, "bwd", [cfg, cfg], n_workers=2) == [None, None]
    shapes = submitted[0][1]
    assert shapes == [(16, 4, 1024), check_shape(problem)] and check_shape(problem) == (4, 1, 1085)
    # the worker runs every shape it is given (here in this process, the kernels stubbed)
    ran = []

    def fake_attention(q, k, v, pattern, **kw):
        ran.append((q.shape[1], k.shape[1], q.shape[2]))
        return q * (k.sum() + v.sum())

    monkeypatch.setattr(api, "attention", fake_attention)
    assert precompile._warm("window=64", shapes, 32, "float32", "cpu", "bwd", as_list(cfg)) is None
    assert ran == shapes


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_the_triton_tuner_times_the_triton_kernels_where_gluon_is_automatic(monkeypatch, direction):
    """``measure.Bench`` checks and times with ``MSA_CODEGEN_GLUON=0`` (its configs are the Triton
    kernels'), also where the automatic choice would run the Gluon family (a plain window on the
    tested Triton), and leaves the variable as it was; the Gluon tuner's bench forces "1"."""
    from msa_codegen.kernels import gluon
    from msa_codegen.tuning import measure
    from msa_codegen.tuning.gluon_search import GluonBench

    monkeypatch.delenv(gluon.ENV, raising=False)
    monkeypatch.setattr(gluon.triton, "__version__", "3.6.0")
    from msa_codegen.plan import plan_for

    kplans = [g.kernel_plan for g in plan_for("window=16", torch.device("cpu"), torch.float32, 16, 2, 1, 64).groups]
    assert gluon.requested(kplans, 64, direction == "bwd", 16)   # what attention would ask for
    seen = []
    real = measure.api.attention
    monkeypatch.setattr(measure.api, "attention",
                        lambda *a, **kw: seen.append(os.environ.get(gluon.ENV)) or real(*a, **kw))
    bench = measure.Bench(measure.Problem("window=16", 1, 2, 1, 64, 16, torch.float32, "cpu", 64), direction)
    cfg = default_config(torch.device("cpu"), 16, torch.float32)
    bench.check(cfg)
    run = bench.runner(cfg)
    if direction == "bwd":   # the backward reads the variable when it runs
        monkeypatch.setattr(gluon, "requested", lambda *a, **kw: seen.append(os.environ.get(gluon.ENV)) or False)
    run()
    assert seen and set(seen) == {"0"} and gluon.ENV not in os.environ, seen
    assert GluonBench.family == "1" and measure.Bench.family == "0"
