"""`msa-codegen which` in this process: the plain note when a GPU has no tuned rows and the heuristic
defaults run (a GPU we cannot reach, b200, included), and no note when a row is served."""
from __future__ import annotations

import datetime

import pytest

import msa_codegen as msa
from msa_codegen.cli import main as cli
from msa_codegen.kernels.render import kernel_hash
from msa_codegen.tuning.database import TuningDB
from msa_codegen.tuning.keys import triton_version
from msa_codegen.tuning.lookup import reload

PATTERN = "window=4096,dilation=2,sink=300"   # the Triton kernels' alone (no Gluon knobs listed)
WHICH = ["which", "--pattern", PATTERN, "--seqlen", "131072", "--head-dim", "128", "--dtype", "bf16"]
FWD = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
BWD = {"block_m1": 64, "block_n1": 64, "num_warps1": 4, "num_stages1": 2,
       "block_m2": 128, "block_n2": 64, "num_warps2": 8, "num_stages2": 2}


@pytest.fixture(autouse=True)
def dbs(tmp_path, monkeypatch):
    monkeypatch.setenv("MSA_CODEGEN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MSA_CODEGEN_SHIPPED_DB", str(tmp_path / "shipped.db"))
    reload(warnings_too=True)
    yield tmp_path / "shipped.db"
    reload(warnings_too=True)


def _put(path, gpu="h200", capability="9.0", directions=("fwd", "bwd"), **kw):
    with TuningDB(path) as db:
        for d in directions:
            r = dict(gpu=gpu, capability=capability, pattern=PATTERN, direction=d, dtype="bfloat16", head_dim=128,
                     gqa_group=1, bucket=131072, triton_version=triton_version(), kernel_hash=kernel_hash(PATTERN),
                     config=dict(FWD if d == "fwd" else BWD), median_ms=1.0, spread_ms=0.01, tflops=100.0,
                     default_ms=1.1, trials=10, batch=1, heads=16, kv_heads=16, seqlen=131072,
                     library_version=msa.__version__, created_at=datetime.datetime(2026, 12, 1),
                     provenance="hand-made for a test")
            r.update(kw)
            db.put(r)
    reload()


def _which(capsys, *extra) -> tuple[str, str | None]:
    assert cli.main([*WHICH, *extra]) == 0
    out = capsys.readouterr().out
    notes = [ln for ln in out.splitlines() if ln.startswith("note:")]
    assert len(notes) <= 1, out
    return out, notes[0] if notes else None


def test_a_gpu_without_rows_is_named_and_its_defaults_said_to_run(capsys, dbs):
    out, note = _which(capsys, "--gpu", "b200")
    assert "on b200 (capability 10.0)" in out and out.count("from heuristic default") == 2
    assert note is not None and note.startswith("note: no tuned rows for b200 (capability 10.0) under Triton "
                                                f"{triton_version()}")
    assert "nor for any other GPU of capability 10.0" in note and "the heuristic defaults run for every shape" in note
    assert str(dbs) in note
    # H200 rows change nothing for a B200 (another capability)
    _put(dbs)
    out, note = _which(capsys, "--gpu", "NVIDIA B200")
    assert out.count("from heuristic default") == 2 and note.startswith("note: no tuned rows for b200")


def test_no_note_when_rows_are_served(capsys, dbs):
    _put(dbs)
    for gpu in ("h200", "h100"):   # an H100 through the same-capability step
        out, note = _which(capsys, "--gpu", gpu)
        assert "heuristic default" not in out and note is None, out


def test_rows_of_other_shapes_and_stale_rows_are_told_apart(capsys, dbs):
    _put(dbs, head_dim=64)                                  # another shape of this GPU
    _put(dbs, triton_version="0.0-other")                   # this shape, another Triton
    _put(dbs, gpu="h100", directions=("fwd",), head_dim=128, pattern="window=4096",
         kernel_hash=kernel_hash("window=4096"))           # another GPU of the capability, another pattern
    out, note = _which(capsys, "--gpu", "h200")
    assert out.count("from heuristic default") == 2
    assert note.startswith("note: bwd and fwd: no tuned row of this pattern, dtype, head dim and group for h200 or "
                           "capability 9.0 (any bucket): the heuristic default runs (2 rows of other shapes for h200, "
                           "1 for other GPUs of capability 9.0)"), note
    assert note.endswith(f"; 2 rows of this shape were measured under Triton 0.0-other (running {triton_version()}) "
                         "and are not used"), note
    # one direction tuned: the note names the other
    _put(dbs, directions=("fwd",))
    out, note = _which(capsys, "--gpu", "h200")
    assert out.count("from heuristic default") == 1 and note.startswith("note: bwd: no tuned row"), note
