"""msa-tune in this process (Triton's interpreter, from conftest): --jobs and --budget-minutes,
the summary lines, what a budget or Ctrl-C leaves stored."""
from __future__ import annotations

import types

import pytest

from msa_codegen.cli import tune as cli
from msa_codegen.tuning import search
from msa_codegen.tuning.database import TuningDB
from msa_codegen.tuning.lookup import reload

SMALL = ["--pattern", "window=8,dilation=2", "--seqlen", "48", "--heads", "2", "--kv-heads", "1", "--head-dim",
         "16", "--dtype", "fp32", "--trials", "3"]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MSA_CODEGEN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MSA_CODEGEN_SHIPPED_DB", str(tmp_path / "none.db"))
    reload(warnings_too=True)
    yield tmp_path
    reload(warnings_too=True)


def _rows(db):
    with TuningDB(db) as t:
        return {(r["bucket"], r["direction"]) for r in t.rows()}


@pytest.mark.parametrize("argv, jobs, minutes", [([], None, None), (["--jobs", "4"], 4, None),
                                                 (["--jobs", "1", "--budget-minutes", "2.5"], 1, 2.5)],
                         ids=["defaults", "jobs-4", "jobs-1-budget"])
def test_jobs_and_budget_parse(argv, jobs, minutes):
    args = cli.build_parser().parse_args(["--pattern", "window=8", *argv])
    assert args.jobs == jobs and args.budget_minutes == minutes


@pytest.mark.parametrize("argv, msg", [(["--jobs", "0"], "positive integer"), (["--jobs", "x"], "positive integer"),
                                       (["--budget-minutes", "0"], "positive number"),
                                       (["--budget-minutes", "soon"], "number of minutes")],
                         ids=["jobs-0", "jobs-text", "budget-0", "budget-text"])
def test_bad_jobs_and_budget_are_one_line_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["--pattern", "window=8", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1


def test_precompile_workers_default_to_the_cores_at_most_16(monkeypatch):
    from msa_codegen.tuning import precompile

    for cores, want in ((2, 2), (16, 16), (64, 16)):
        monkeypatch.setattr(precompile.os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)), raising=False)
        assert precompile.workers() == want


def test_budget_stops_early_and_stores_what_finished(home, monkeypatch, capsys):
    """The budget runs out after the forward's first timed trial: the forward stores its best so
    far (that trial's own timing), the backward never starts, and both are said."""
    from msa_codegen.tuning import measure

    now = [1000.0]
    clock = types.SimpleNamespace(monotonic=lambda: now[0])
    monkeypatch.setattr(search, "time", clock)
    monkeypatch.setattr(cli, "time", clock)
    real_time = measure.Bench.time

    def timed(self, cfg, rep_ms=None):
        out = real_time(self, cfg, rep_ms)
        now[0] += 3600.0   # an hour per timing: the budget (1 minute) is spent after the first
        return out

    monkeypatch.setattr(measure.Bench, "time", timed)
    db = home / "tuning.db"
    assert cli.main([*SMALL, "--db", str(db), "--budget-minutes", "1"]) == 0
    out = capsys.readouterr().out
    assert "bucket 1024 fwd: 1 trials of 3, 0 pruned (shared memory), 0 failed, best " in out
    assert "budget spent" in out
    assert "not done: bucket 1024 fwd (stopped after 1 of 3 trials; best so far stored); bucket 1024 bwd" in out
    assert _rows(db) == {(1024, "fwd")}


def test_ctrl_c_keeps_finished_rows(home, monkeypatch, capsys):
    real_tune = search.tune

    def tune(problem, direction, *a, **kw):
        if direction == "bwd":
            raise KeyboardInterrupt
        return real_tune(problem, direction, *a, **kw)

    monkeypatch.setattr(search, "tune", tune)
    db = home / "tuning.db"
    assert cli.main([*SMALL, "--db", str(db)]) == 130
    captured = capsys.readouterr()
    assert "interrupted (finished rows are stored)" in captured.err
    assert "bucket 1024 fwd: 3 trials" in captured.out and "bucket 1024 bwd: 0 trials" in captured.out
    assert _rows(db) == {(1024, "fwd")}
