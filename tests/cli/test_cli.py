"""msa-tune and msa-codegen through subprocesses: the whole path, concurrency, every error.

Every command runs as `python -m ...` with MSA_CODEGEN_HOME in tmp_path and no shipped
database. Without CUDA, TRITON_INTERPRET=1 comes from conftest (except in the README test,
which checks that msa-tune sets it itself).
"""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import pytest
import torch

TUNE = [sys.executable, "-m", "msa_codegen.cli.tune"]
CODEGEN = [sys.executable, "-m", "msa_codegen.cli.main"]
PATTERN = "window=8,dilation=2"
SMALL = ["--pattern", PATTERN, "--seqlen", "48", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
         "--dtype", "fp32"]
WHICH = ["which", "--pattern", PATTERN, "--seqlen", "48", "--head-dim", "16", "--dtype", "fp32", "--heads", "2",
         "--kv-heads", "1"]


def _env(tmp_path, **extra):
    env = dict(os.environ, MSA_CODEGEN_HOME=str(tmp_path / "home"), MSA_CODEGEN_SHIPPED_DB=str(tmp_path / "none.db"),
               PYTHONUNBUFFERED="1")
    env.pop("MSA_CODEGEN_DEBUG", None)
    env.update(extra)
    return {key: value for key, value in env.items() if value is not None}   # None: unset


def run(cmd, tmp_path, timeout=240, **extra):
    return subprocess.run(cmd, env=_env(tmp_path, **extra), capture_output=True, text=True, timeout=timeout)


def _ok(p):
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stdout + p.stderr
    return p


# ---- the whole path -------------------------------------------------------------------------------

def test_tune_then_which_then_db(tmp_path):
    db = tmp_path / "t.db"
    p = _ok(run([*TUNE, *SMALL, "--trials", "2", "--db", str(db)], tmp_path))
    if not torch.cuda.is_available():
        assert "NOT meaningful" in p.stdout
    assert "speedup" in p.stdout and "TFLOP/s" in p.stdout   # the final table
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("1024 ")]
    assert [ln.split()[1] for ln in lines] == ["fwd", "bwd"]
    assert "best" in p.stderr   # the progress bar shows the best time so far

    p = _ok(run([*CODEGEN, *WHICH, "--db", str(db)], tmp_path))
    assert p.stdout.count(f"from user db {db}") == 2, p.stdout
    # without --db (and nothing in MSA_CODEGEN_HOME): the heuristic
    p = _ok(run([*CODEGEN, *WHICH], tmp_path))
    assert p.stdout.count("from heuristic default") == 2

    p = _ok(run([*CODEGEN, "db", "list", "--db", str(db)], tmp_path))
    assert "2 rows" in p.stdout and PATTERN in p.stdout
    export = tmp_path / "export.json"
    _ok(run([*CODEGEN, "db", "export", "--db", str(db), "--out", str(export)], tmp_path))
    doc = json.loads(export.read_text())
    assert doc["format"] == "msa-codegen-tuning" and len(doc["rows"]) == 2
    # import into the default user database ($MSA_CODEGEN_HOME/tuning.db): which finds it there
    p = _ok(run([*CODEGEN, "db", "import", str(export)], tmp_path))
    assert "imported 2 rows" in p.stdout
    p = _ok(run([*CODEGEN, *WHICH], tmp_path))
    assert p.stdout.count(f"from user db {tmp_path / 'home' / 'tuning.db'}") == 2
    p = _ok(run([*CODEGEN, "db", "clear", "--db", str(db)], tmp_path))
    assert "cleared 2 rows" in p.stdout and "studies" in p.stdout
    assert "0 rows" in _ok(run([*CODEGEN, "db", "list", "--db", str(db)], tmp_path)).stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path (no GPU)")
def test_readme_command_without_gpu(tmp_path):
    """`msa-tune --pattern P` alone, TRITON_INTERPRET unset: it runs in the interpreter, says the
    timings mean nothing, stores rows in $MSA_CODEGEN_HOME/tuning.db and exits 0."""
    env = _env(tmp_path)
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([*TUNE, "--pattern", "window=16"], env=env, capture_output=True, text=True, timeout=240)
    _ok(p)
    assert "NOT meaningful" in p.stdout and "cpu-interpreter" in p.stdout
    con = sqlite3.connect(tmp_path / "home" / "tuning.db")
    rows = con.execute("SELECT gpu, direction, bucket, head_dim, dtype FROM msa_tuning ORDER BY direction").fetchall()
    assert rows == [("cpu-interpreter", "bwd", 4096, 128, "float16"), ("cpu-interpreter", "fwd", 4096, 128, "float16")]


def test_four_concurrent_tuners_share_one_db(tmp_path):
    db = tmp_path / "shared.db"
    args = [*TUNE, "--pattern", "window=4", "--seqlen", "32", "--heads", "1", "--head-dim", "16", "--dtype", "fp32",
            "--trials", "2", "--db", str(db)]
    env = _env(tmp_path)
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"exit {p.returncode}\n{out}\n{err[-3000:]}"
        assert "Traceback" not in out + err
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    rows = con.execute("SELECT direction, bucket FROM msa_tuning ORDER BY direction").fetchall()
    assert rows == [("bwd", 1024), ("fwd", 1024)]
    # one study per direction, shared by the four processes
    studies = con.execute("SELECT study_name FROM studies").fetchall()
    assert len(studies) == 2
    (n_trials,) = con.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'").fetchone()
    assert n_trials >= 4


# ---- errors: exit != 0, one line on stderr, no traceback ---------------------------------------

def _error_cases(tmp_path):
    foreign = tmp_path / "foreign.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE invoices (id INTEGER)")
    con.commit()
    con.close()
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"\x00\x01garbage" * 500)
    png = str(tmp_path / "x.png")
    no_mpl = ("import sys; sys.modules['matplotlib'] = None; from msa_codegen.cli.main import main; "
              f"sys.exit(main(['show', '--pattern', 'window=8', '--seqlen', '64', '--png', {png!r}]))")
    cases = {
        "tune bad pattern": ([*TUNE, "--pattern", "window=8,dilaton=2"], "dilaton"),
        "tune unknown gpu": ([*TUNE, "--pattern", "window=8", "--gpu", "zz9000"], "unknown GPU"),
        "tune foreign db": ([*TUNE, *SMALL, "--db", str(foreign)], "not an msa-codegen tuning database"),
        "tune damaged db": ([*TUNE, *SMALL, "--db", str(garbage)], "not a readable SQLite database"),
        "tune bad dtype": ([*TUNE, "--pattern", "window=8", "--dtype", "fp8"], "invalid choice"),
        "tune heads": ([*TUNE, "--pattern", "window=8", "--heads", "6", "--kv-heads", "4"], "multiple"),
        "which bad pattern": ([*CODEGEN, "which", "--pattern", "window=-1", "--seqlen", "64", "--head-dim", "64",
                               "--dtype", "bf16"], "window"),
        "which unknown gpu": ([*CODEGEN, "which", "--pattern", "window=8", "--seqlen", "64", "--head-dim", "64",
                               "--dtype", "bf16", "--gpu", "zz9000"], "unknown GPU"),
        "import missing file": ([*CODEGEN, "db", "import", str(tmp_path / "missing.json")], "missing.json"),
        "import not json": ([*CODEGEN, "db", "import", str(garbage)], "not JSON"),
        "list foreign db": ([*CODEGEN, "db", "list", "--db", str(foreign)], "not an msa-codegen tuning database"),
        "export missing db": ([*CODEGEN, "db", "export", "--db", str(tmp_path / "nope.db")], "nope.db"),
        "show bad pattern": ([*CODEGEN, "show", "--pattern", "sink=x", "--seqlen", "64", "--png",
                              str(tmp_path / "x.png")], "sink"),
        "show without matplotlib": ([sys.executable, "-c", no_mpl], "pip install msa-codegen[plot]"),
        "render bad head dim": ([*CODEGEN, "render", "--pattern", "window=8", "--head-dim", "8"], "--head-dim"),
    }
    if not torch.cuda.is_available():
        cases[NOT_PRESENT] = ([*TUNE, "--pattern", "window=8", "--gpu", "h100"], "no CUDA GPU")
    else:
        from msa_codegen.tuning.gpu import current_gpu

        other = "b200" if current_gpu()[0] != "b200" else "h100"
        cases[NOT_PRESENT] = ([*TUNE, "--pattern", "window=8", "--gpu", other], "the GPU present is")
    return cases


NOT_PRESENT = "tune --gpu not the GPU present"
ERROR_CASES = ["tune bad pattern", "tune unknown gpu", "tune foreign db", "tune damaged db", "tune bad dtype",
               "tune heads", "which bad pattern", "which unknown gpu", "import missing file", "import not json",
               "list foreign db", "export missing db", "show bad pattern", "show without matplotlib", "render bad head dim",
               NOT_PRESENT]


@pytest.fixture(scope="module")
def error_results(tmp_path_factory):
    """Every error case, run concurrently (each is mostly Python start-up)."""
    tmp_path = tmp_path_factory.mktemp("errors")
    env = _env(tmp_path)
    cases = _error_cases(tmp_path)
    assert sorted(cases) == sorted(ERROR_CASES)
    procs = {name: (subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), want)
             for name, (cmd, want) in cases.items()}
    results = {}
    for name, (p, want) in procs.items():
        out, err = p.communicate(timeout=240)
        results[name] = (p.returncode, out, err, want)
    return results


@pytest.mark.parametrize("case", ERROR_CASES)
def test_errors_one_line(case, error_results):
    code, out, err, want = error_results[case]
    assert code != 0, f"{case}: exit 0\n{out}\n{err}"
    assert "Traceback" not in out + err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"{case}: expected one line on stderr, got:\n{err}"
    assert want in lines[0], lines[0]
    if case in (NOT_PRESENT, "show without matplotlib", "tune unknown gpu", "which unknown gpu"):
        assert code == 2
    if case == NOT_PRESENT and not torch.cuda.is_available():
        assert "h100" in lines[0] and "cpu-interpreter" in lines[0]   # names both


def test_show_png(tmp_path):
    pytest.importorskip("matplotlib")
    from msa_codegen.cli.main import main

    png = tmp_path / "mask.png"
    assert main(["show", "--pattern", "window=16,dilation=2,sink=4", "--seqlen", "256", "--png", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_render_and_which_name_the_gluon_family(tmp_path):
    """--family gluon prints the Gluon forward (or, per head group, why the Triton kernels run
    it); which says which forward family runs, with MSA_CODEGEN_GLUON set or not."""
    from msa_codegen.kernels import gluon

    p = _ok(run([*CODEGEN, "render", "--pattern", "0-7:window=64,dilation=2,sink=257;8-15:window=4096,sink=64",
                 "--family", "gluon"], tmp_path))
    lines = p.stdout.splitlines()
    assert lines[0].startswith("# Gluon forward") and "head dim 128, bfloat16: eligible" in lines[0]
    assert ("# window=64,dilation=2,sink=257: no Gluon kernel (dilation=2 with sink=257 > 256 (the sink pass's work "
            "grows with the sink's keys)); the Triton kernels run it") in lines
    if gluon.api()[0] is not None:
        assert "# generated from msa_codegen/templates/gluon/fwd.py.jinja" in p.stdout and "def msa_gluon_fwd(" in p.stdout
    p = _ok(run([*CODEGEN, "render", "--pattern", "0-7:window=64,sink=300;8-15:causal=false,window=64", "--family",
                 "gluon", "--direction", "bwd"], tmp_path))
    lines = p.stdout.splitlines()
    assert lines[0].startswith("# Gluon backward") and "eligible" in lines[0]
    assert any(line.startswith("# window=64,sink=300: no Gluon kernel (sink=300 > 256") for line in lines)
    if gluon.api()[0] is not None:
        assert "# generated from msa_codegen/templates/gluon/bwd.py.jinja" in p.stdout
        assert "def msa_gluon_bwd_dkdv(" in p.stdout and "def msa_gluon_bwd_dq(" in p.stdout
    # a sink's pairs outside the window: the Triton pass named beside the kernels it follows
    for pattern, direction, name in (("window=64,sink=8", "bwd", "sink_bwd"), ("window=64,dilation=2,sink=8", "fwd",
                                                                              "sink_fwd")):
        p = _ok(run([*CODEGEN, "render", "--pattern", pattern, "--family", "gluon", "--direction", direction], tmp_path))
        assert any(line.startswith(f"# {pattern}: ") and f"kernels/sink.py, {name})" in line
                   for line in p.stdout.splitlines()), (pattern, p.stdout[:600])
    which = ["which", "--pattern", "window=4096", "--seqlen", "4096", "--head-dim", "128", "--dtype", "bf16",
             "--gpu", "h200"]
    p = _ok(run([*CODEGEN, *which], tmp_path, MSA_CODEGEN_GLUON="0"))
    assert "forward kernels: triton (MSA_CODEGEN_GLUON=0; gluon eligible)" in p.stdout
    assert "backward kernels: triton (MSA_CODEGEN_GLUON=0; gluon eligible)" in p.stdout
    # unset, with --heads: a call of 4096 rows, 4 heads at D=128 (a few GFLOP) stays on Triton by its size
    p = _ok(run([*CODEGEN, *which, "--heads", "4"], tmp_path, MSA_CODEGEN_GLUON=None))
    assert "forward kernels: triton (MSA_CODEGEN_GLUON is not set, plain windows from" in p.stdout
    p = _ok(run([*CODEGEN, *which[:2], "window=4096,dilation=2,sink=300", *which[3:]], tmp_path, MSA_CODEGEN_GLUON="1"))
    why = "dilation=2 with sink=300 > 256 (the sink pass's work grows with the sink's keys)"
    assert f"forward kernels: triton (MSA_CODEGEN_GLUON=1, but gluon is not eligible: {why})" in p.stdout
    assert f"backward kernels: triton (MSA_CODEGEN_GLUON=1, but gluon is not eligible: {why})" in p.stdout
    # a dilated window, with a sink of up to 256 keys or without one: eligible (its residue classes)
    for pattern in ("window=4096,dilation=2", "window=4096,dilation=2,sink=64", "window=4096,dilation=2,sink=256"):
        p = _ok(run([*CODEGEN, *which[:2], pattern, *which[3:]], tmp_path, MSA_CODEGEN_GLUON="0"))
        assert "forward kernels: triton (MSA_CODEGEN_GLUON=0; gluon eligible)" in p.stdout, pattern
        assert "backward kernels: triton (MSA_CODEGEN_GLUON=0; gluon eligible)" in p.stdout, pattern
    p = _ok(run([*CODEGEN, "render", "--pattern", "causal=false,window=64", "--family", "gluon", "--direction",
                 "bwd", "--documents"], tmp_path))
    if gluon.api()[0] is not None:
        assert "def _dkdv_bounds(k0, N, DOC," in p.stdout and "both in one document" in p.stdout
    p = _ok(run([*CODEGEN, "render", "--pattern", "window=64", "--documents"], tmp_path))
    assert "positional=1" in p.stdout and "documents=1" in p.stdout
    # packed documents: eligible; a sink with cu_seqlens is not
    p = _ok(run([*CODEGEN, *which[:2], "causal", *which[3:], "--documents"], tmp_path, MSA_CODEGEN_GLUON="0"))
    assert "forward kernels: triton (MSA_CODEGEN_GLUON=0; gluon eligible)" in p.stdout
    assert "backward kernels: triton (MSA_CODEGEN_GLUON=0; gluon eligible)" in p.stdout
    p = _ok(run([*CODEGEN, *which[:2], "window=64,sink=4", *which[3:], "--documents"], tmp_path,
                MSA_CODEGEN_GLUON="1"))
    assert "gluon is not eligible: sink=4 with cu_seqlens" in p.stdout


def test_render_names_the_launch_of_a_head_dim_and_dtype(tmp_path):
    p = _ok(run([*CODEGEN, "render", "--pattern", "window=64,dilation=2", "--direction", "bwd", "--head-dim", "80",
                 "--dtype", "fp16"], tmp_path))
    first, second, third = p.stdout.splitlines()[:3]
    assert "head dim 80, float16" in first and "BLOCK_D=128" in first and "DOT_PREC='tf32'" in first
    assert "TMA=True on compute capability >= 9" in first
    assert second.startswith("# bwd config: block_m1=") and "(" in second
    assert third.startswith("# generated from msa_codegen/templates/bwd.py.jinja")
    assert "def msa_bwd_dkdv" in p.stdout and "FOLD" not in first
    p = _ok(run([*CODEGEN, "render", "--pattern", "window=64", "--head-dim", "64"], tmp_path))
    assert "FOLD=True for a positive scale" in p.stdout.splitlines()[0]
