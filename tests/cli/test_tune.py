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


# ---- a GPU we cannot reach: the same path as on an H200 ---------------------------------------------

class _WouldTime(Exception):
    """Raised by the stand-in of ``search.tune``: the point where tuning needs the GPU."""


def _path_to_the_gpu(monkeypatch, raw_name: str, capability: str, argv: list[str]) -> tuple[dict, str]:
    """Run msa-tune as on a machine whose GPU is ``raw_name``, up to the first measurement: what
    ``search.tune`` is asked (the problem, key and options), and what was printed before it."""
    import io
    import contextlib

    import torch

    from msa_codegen.tuning import gpu as _gpu

    asked = {}

    def stand_in(problem, direction, key, db_path, **kw):
        asked.update(problem=problem, direction=direction, key=key, db=db_path, **kw)
        raise _WouldTime(f"would time {problem.describe()} on {key.gpu} now")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_gpu, "current_gpu", lambda index=None: (_gpu.normalize(raw_name), capability))
    monkeypatch.setattr(_gpu, "device_name", lambda index=None: raw_name)
    monkeypatch.setattr(search, "tune", stand_in)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(_WouldTime):
        cli.run(cli.build_parser().parse_args(argv))
    return asked, out.getvalue()


@pytest.mark.parametrize("raw, cap, flag", [("NVIDIA B200", "10.0", "b200"), ("NVIDIA B200", "10.0", "auto"),
                                            ("NVIDIA GB300 Superchip", "10.3", "auto")],
                         ids=["b200", "b200-auto", "unknown-name-auto"])
def test_a_gpu_we_cannot_reach_takes_the_h200_path(home, monkeypatch, raw, cap, flag):
    """msa-tune --gpu b200 (or auto, or a GPU whose name we do not know) on such a machine asks the
    tuner exactly what it asks on an H200 (the README's command: same buckets, problem, trials, jobs,
    compile-ahead), but for its own GPU name and capability; nothing H200-specific on the way."""
    argv = ["--pattern", "window=4096,dilation=2", "--db", str(home / "t.db")]
    h200, h200_out = _path_to_the_gpu(monkeypatch, "NVIDIA H200", "9.0", ["--gpu", "h200", *argv])
    other, other_out = _path_to_the_gpu(monkeypatch, raw, cap, ["--gpu", flag, *argv])
    name = {"NVIDIA B200": "b200"}.get(raw, "gb300-superchip")
    assert other["key"].gpu == name and other["key"].capability == cap
    assert h200["key"].gpu == "h200" and h200["key"].capability == "9.0"
    same = lambda asked: {k: v for k, v in asked.items() if k != "key"}  # noqa: E731
    assert same(other) == same(h200)
    key_fields = lambda k: {f: v for f, v in k.as_dict().items() if f not in ("gpu", "capability")}  # noqa: E731
    assert key_fields(other["key"]) == key_fields(h200["key"])
    p = other["problem"]
    assert (p.device, p.seqlen, p.batch, str(p.dtype), other["direction"], other["trials"]) == \
        ("cuda", 8192, 8, "torch.bfloat16", "fwd", cli.GPU_TRIALS)
    assert other_out.replace(name, "GPU").replace(cap, "CAP") == h200_out.replace("h200", "GPU").replace("9.0", "CAP")
    assert f"on {name} (capability {cap})" in other_out


def test_gpu_b200_without_cuda_is_one_clear_line(home, capsys):
    """Here (no CUDA): --gpu b200 is refused before anything runs, naming both machines."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli.main(["--gpu", "b200", "--pattern", "window=4096,dilation=2", "--db", str(home / "t.db")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("msa-tune: error: --gpu b200: this machine has no CUDA GPU")
    assert "cpu-interpreter" in err[0] and "run msa-tune on that GPU" in err[0]
    assert not (home / "t.db").exists()
