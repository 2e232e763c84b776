"""The tuning database, the lookup order and the tuner, on the CPU (Triton's interpreter).

Databases live in tmp_path: MSA_CODEGEN_HOME points there (the default user database is
$MSA_CODEGEN_HOME/tuning.db) and MSA_CODEGEN_SHIPPED_DB at a file that exists only when a
test builds one.
"""
from __future__ import annotations

import dataclasses
import datetime
import sqlite3
import warnings

import pytest
import torch

import msa_codegen as msa
from msa_codegen.tuning import gpu as gpu_mod
from msa_codegen.tuning.keys import bucket
from msa_codegen.tuning.lookup import lookup_for_gpu, reload
from msa_codegen.tuning import lookup as lookup_mod
from msa_codegen.tuning.database import SchemaError, TuningDB
from msa_codegen.pattern.lowering import lower
from msa_codegen.pattern.spec import parse
from msa_codegen.tuning.keys import TuningKey, triton_version
from msa_codegen.config import BwdConfig, FwdConfig, LaunchConfig
from msa_codegen.heuristics import default_config
from msa_codegen.kernels.render import kernel_hash
from msa_codegen.plan import plan_for
from msa_codegen.tuning import space
from msa_codegen.tuning.measure import Problem
from msa_codegen.tuning.search import tune

from helpers import rel_err

FWD = {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}
BWD = {"block_m1": 16, "block_n1": 32, "num_warps1": 4, "num_stages1": 1,
       "block_m2": 32, "block_n2": 16, "num_warps2": 4, "num_stages2": 1}
PATTERN = "window=8,dilation=2"


@pytest.fixture(autouse=True)
def tmp_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("MSA_CODEGEN_HOME", str(home))
    monkeypatch.setenv("MSA_CODEGEN_SHIPPED_DB", str(tmp_path / "shipped.db"))
    monkeypatch.setenv("MSA_CODEGEN_DB_TIMEOUT", "0.2")
    reload(warnings_too=True)
    yield home
    reload(warnings_too=True)


def row(gpu="h200", capability="9.0", direction="fwd", bucket_=131072, config=None, **kw):
    base = dict(gpu=gpu, capability=capability, pattern=PATTERN, direction=direction, dtype="bfloat16",
                head_dim=128, gqa_group=1, bucket=bucket_, triton_version=triton_version(),
                template_hash=kernel_hash(PATTERN), config=dict(config or (FWD if direction == "fwd" else BWD)),
                median_ms=1.0, spread_ms=0.01, tflops=100.0, default_ms=1.2, trials=10, batch=1, heads=16,
                kv_heads=16, seqlen=bucket_, library_version=msa.__version__,
                created_at=datetime.datetime(2026, 12, 1), provenance="hand-made for a test")
    base.update(kw)
    return base


def put(path, *rows):
    with TuningDB(path) as db:
        for r in rows:
            db.put(r)
    reload()   # written outside the tuner: how this process sees the rows


def call_config(seqlen):
    """(config, source) of an attention call on the CPU (PATTERN, fp32, D=16, GQA group 2): its plan's."""
    plan = plan_for(PATTERN, torch.device("cpu"), torch.float32, 16, 2, 1, seqlen)
    return plan.config, plan.source


def which(gpu="h200", cap="9.0", seqlen=131072, **kw):
    return lookup_for_gpu(gpu, cap, PATTERN, 128, "bfloat16", 1, seqlen, cuda=True, **kw)


# ---- keys -------------------------------------------------------------------------------------

def test_bucket():
    assert [bucket(n) for n in (1, 64, 1024, 1025, 4096, 100_000, 131072, 131073)] == \
        [1024, 1024, 1024, 2048, 4096, 131072, 131072, 262144]
    with pytest.raises(ValueError):
        bucket(0)


@pytest.mark.parametrize("raw,short", [
    ("NVIDIA H200", "h200"), ("NVIDIA GH200 480GB", "h200"), ("NVIDIA H200 NVL", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100"), ("NVIDIA B200", "b200"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A10G", "a10g"), ("NVIDIA L40S", "l40s"), ("NVIDIA L4", "l4"),
    ("Tesla T4", "t4"), ("NVIDIA GeForce RTX 4090", "rtx4090"), ("h100", "h100"), ("H200", "h200"),
    ("Some Future GPU X9", "some-future-gpu-x9"),
])
def test_gpu_names(raw, short):
    assert gpu_mod.normalize(raw) == short


def test_gpu_present():
    if torch.cuda.is_available():
        name, cap = gpu_mod.current_gpu()
        assert name and "." in cap
    else:
        assert gpu_mod.current_gpu() is None
        assert gpu_mod.gpu_of("cpu") == ("cpu-interpreter", "cpu")
    assert gpu_mod.capability_of("h100") == gpu_mod.capability_of("h200") == "9.0"


# ---- the database -----------------------------------------------------------------------------

def test_schema_wal_and_version(tmp_path):
    path = tmp_path / "t.db"
    put(path, row())
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert con.execute("SELECT app, version FROM msa_schema").fetchone() == ("msa-codegen-tuning", 2)
    cols = {r[1] for r in con.execute("PRAGMA table_info(msa_tuning)")}
    assert {"gpu", "capability", "pattern", "direction", "dtype", "head_dim", "gqa_group", "bucket", "triton_version",
            "template_hash", "config", "median_ms", "spread_ms", "tflops", "trials", "library_version", "created_at",
            "provenance"} <= cols
    con.execute("UPDATE msa_schema SET version = 99")
    con.commit()
    con.close()
    with pytest.raises(SchemaError, match="newer"):
        TuningDB(path)


def test_put_replaces_and_keeps_faster(tmp_path):
    path = tmp_path / "t.db"
    put(path, row(median_ms=2.0))
    with TuningDB(path) as db:
        assert not db.put(row(median_ms=3.0, config={**FWD, "block_m": 128}), keep_faster=True)
        assert db.rows()[0]["median_ms"] == 2.0
        assert db.put(row(median_ms=1.5, config={**FWD, "block_m": 128}), keep_faster=True)
        (r,) = db.rows()
        assert r["median_ms"] == 1.5 and r["config"]["block_m"] == 128
        with pytest.raises(ValueError, match="block_m"):
            db.put(row(config={**FWD, "block_m": 48}))


def test_export_import_roundtrip(tmp_path):
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    put(a, row(), row(direction="bwd"), row(gpu="h100", bucket_=4096))
    with TuningDB(a) as db:
        doc = db.export()
    with TuningDB(b) as db:
        assert db.import_(doc) == 3
        assert db.rows() == TuningDB(a, mode="ro").rows()
        with pytest.raises(ValueError, match="format"):
            db.import_({"rows": []})
        with pytest.raises(ValueError, match="missing field 'median_ms'"):
            bad = dict(doc, rows=[{k: v for k, v in doc["rows"][0].items() if k != "median_ms"}])
            db.import_(bad)


def test_shipped_copy(tmp_path, monkeypatch):
    """write_shipped_copy: only the tuning rows, rollback journal; read through mode=ro."""
    from msa_codegen.tuning.database import write_shipped_copy

    src, dst = tmp_path / "user.db", tmp_path / "shipped.db"
    put(src, row(), row(direction="bwd"))
    sqlite3.connect(src).execute("CREATE TABLE studies (study_id INTEGER)")   # as if Optuna had been there
    assert write_shipped_copy(src, dst) == 2
    con = sqlite3.connect(dst)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert "studies" not in {r[0] for r in con.execute("SELECT name FROM sqlite_master")}
    con.close()
    assert which().source == f"shipped db {dst} (h200, bucket 131072)"


# ---- heuristic defaults -----------------------------------------------------------------------

def test_narrow_band_forward_default():
    """Windows whose band is below NARROW_BAND keys run the Hopper forward in 64 x 64 tiles; wide
    windows, dense patterns, global rows, random or top-k blocks and mixed groups keep 128 x 128,
    and GPUs without TMA their own default."""
    from msa_codegen.heuristics import narrow_band

    assert narrow_band("causal=false,window=512") and narrow_band("window=1024,sink=64")
    for p in ("window=4096", "causal=false,window=1024", "causal", "causal=false,global=3,window=7",
              "window=512,random=2", "0-7:window=512;8-15:window=8192", None):
        assert not narrow_band(p), p
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert default_config(cuda, 128, bf16, "9.0", "causal=false,window=512").fwd == FwdConfig(64, 64, 4, 3)
    assert default_config(cuda, 128, bf16, "9.0", "window=4096").fwd == FwdConfig(128, 128, 8, 3)
    assert default_config(cuda, 128, bf16, "9.0").fwd == FwdConfig(128, 128, 8, 3)
    assert default_config(cuda, 128, bf16, "8.0", "causal=false,window=512").fwd == FwdConfig(128, 64, 8, 3)
    # the backward is not affected
    assert (default_config(cuda, 128, bf16, "9.0", "causal=false,window=512").bwd
            == default_config(cuda, 128, bf16, "9.0").bwd)


# ---- lookup order -----------------------------------------------------------------------------

def test_lookup_order(tmp_home, tmp_path):
    user, shipped = tmp_home / "tuning.db", tmp_path / "shipped.db"
    heuristic = default_config(torch.device("cuda"), 128, torch.bfloat16, "9.0", PATTERN)   # which() asks for sm_90
    # nothing anywhere: the heuristic
    res = which()
    assert res.source == "heuristic default" and res.config == heuristic

    # the shipped database (opened read-only)
    put(shipped, row(config={**FWD, "num_stages": 3}))
    reload()
    res = which()
    assert res.fwd.source.startswith(f"shipped db {shipped}") and "h200, bucket 131072" in res.fwd.source
    assert res.fwd.config == FwdConfig(**{**FWD, "num_stages": 3})
    assert res.bwd.source == "heuristic default" and res.bwd.config == heuristic.bwd
    assert res.source == f"fwd: {res.fwd.source}; bwd: heuristic default"

    # the user database first (put() calls reload(): a changed file is read again after it)
    put(user, row(), row(direction="bwd"))
    res = which()
    assert res.fwd.source == f"user db {user} (h200, bucket 131072)" == res.source
    assert res.config == LaunchConfig(FwdConfig(**FWD), BwdConfig(**BWD))

    # same capability, another GPU: h100 uses the h200 rows of this bucket
    res = which(gpu="h100")
    assert "measured on h200, same capability 9.0, bucket 131072" in res.fwd.source
    assert res.fwd.source.startswith(f"user db {user}")
    # another capability: nothing
    assert which(gpu="a100", cap="8.0").source == "heuristic default"

    # nearest bucket: 524288 has no row; 131072 (h200) is the nearest
    res = which(seqlen=300_000)
    assert res.fwd.source == f"user db {user} (nearest bucket 131072 for 524288, measured on h200)"
    # an exact bucket on another GPU of the capability beats a nearer-bucket row of this GPU...
    put(user, row(gpu="h100", bucket_=524288, config={**FWD, "block_n": 64}))
    res = which(seqlen=524288)
    assert "measured on h100, same capability 9.0, bucket 524288" in res.fwd.source
    assert res.fwd.config.block_n == 64
    # ...and at equal distance this GPU's row beats the other GPU's (262144: 131072 and 524288)
    res = which(seqlen=262144)
    assert res.fwd.source == f"user db {user} (nearest bucket 131072 for 262144, measured on h200)"


def test_lookup_config_and_explain_are_wired(tmp_home):
    """attention's path (its plan, plan.plan_for) and explain() read the same lookup."""
    q = torch.randn(1, 2, 40, 16)
    k = torch.randn(1, 1, 40, 16)
    cfg, source = call_config(40)
    assert source == "heuristic default" and cfg == default_config(torch.device("cpu"), 16, torch.float32)
    put(tmp_home / "tuning.db", row(gpu="cpu-interpreter", capability="cpu", dtype="float32", head_dim=16,
                                    gqa_group=2, bucket_=1024, config={**FWD, "block_m": 16, "num_stages": 1}))
    cfg, source = call_config(40)
    assert source == f"fwd: user db {tmp_home / 'tuning.db'} (cpu-interpreter, bucket 1024); bwd: heuristic default"
    assert cfg.fwd.block_m == 16
    ex = msa.explain(q, k, k, PATTERN)
    assert ex.fwd.config.block_m == 16 and ex.fwd.source.startswith("user db")
    text = str(ex)
    assert "block_m=16" in text and "heuristic default" in text and "bucket 1024" in text
    forced = LaunchConfig(FwdConfig(32, 16, 4, 1), BwdConfig(16, 16, 4, 1, 16, 16, 4, 1))
    with msa.use_config(forced):
        ex = msa.explain(q, k, k, PATTERN)
    assert ex.config == forced and ex.source == "use_config override"


def test_lookup_is_cached(tmp_home, monkeypatch):
    put(tmp_home / "tuning.db", row())
    calls = []
    real = lookup_mod._read_rows
    monkeypatch.setattr(lookup_mod, "_read_rows", lambda *a: calls.append(a) or real(*a))
    for _ in range(5):
        assert which().fwd.source.startswith("user db")
    assert len(calls) == 2   # once per database (user, shipped), not once per call
    put(tmp_home / "tuning.db", row(config={**FWD, "block_m": 128}))
    assert which().fwd.config.block_m == 128 and len(calls) == 4   # a written file is read again


def test_stale_and_invalid_rows_are_skipped(tmp_home):
    user = tmp_home / "tuning.db"
    put(user, row(triton_version="0.0.1"), row(direction="bwd", template_hash="0123456789abcdef"))
    assert which().source == "heuristic default"
    # a hand-edited row whose config does not build never runs
    put(user, row(bucket_=4096))
    con = sqlite3.connect(user)
    con.execute("""UPDATE msa_tuning SET config = '{"block_m": 48, "block_n": 32, "num_warps": 4, "num_stages": 2}'
                   WHERE bucket = 4096""")
    con.commit()
    con.close()
    reload()
    assert which().source == "heuristic default"
    assert which(seqlen=4096).source == "heuristic default"


# ---- databases that cannot be used: one warning, attention still runs --------------------------

def _attention_still_runs():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 40, 16)
    k, v = torch.randn(1, 1, 40, 16), torch.randn(1, 1, 40, 16)
    out = msa.attention(q, k, v, PATTERN)
    assert rel_err(out, msa.reference_attention(q, k, v, PATTERN)) < 1e-4


def _warnings_of(fn, times=2):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(times):
            fn()
            reload()   # look again: the warning must still come only once
    return [w for w in caught if issubclass(w.category, RuntimeWarning) and "tuning database" in str(w.message)]


def test_damaged_db(tmp_home):
    path = tmp_home / "tuning.db"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"this is not an sqlite file\x00\xff" * 100)
    caught = _warnings_of(_attention_still_runs)
    assert len(caught) == 1
    assert str(path) in str(caught[0].message) and "damaged" in str(caught[0].message)
    assert call_config(40)[1] == "heuristic default"


def test_foreign_db(tmp_home):
    path = tmp_home / "tuning.db"
    path.parent.mkdir(parents=True)
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    con.execute("INSERT INTO customers (name) VALUES ('x')")
    con.commit()
    con.close()
    caught = _warnings_of(_attention_still_runs)
    assert len(caught) == 1 and "not an msa-codegen tuning database" in str(caught[0].message)
    with pytest.raises(SchemaError, match="customers"):
        TuningDB(path)
    assert sqlite3.connect(path).execute("SELECT name FROM customers").fetchone() == ("x",)   # untouched


def test_newer_schema_db(tmp_home):
    path = tmp_home / "tuning.db"
    put(path, row(gpu="cpu-interpreter", capability="cpu", dtype="float32", head_dim=16, gqa_group=2, bucket_=1024))
    con = sqlite3.connect(path)
    con.execute("UPDATE msa_schema SET version = 7")
    con.commit()
    con.close()
    caught = _warnings_of(_attention_still_runs)
    assert len(caught) == 1 and "newer" in str(caught[0].message)


def test_locked_db(tmp_home):
    path = tmp_home / "tuning.db"
    put(path, row(gpu="cpu-interpreter", capability="cpu", dtype="float32", head_dim=16, gqa_group=2, bucket_=1024))
    other = sqlite3.connect(path, isolation_level=None)
    # WAL: a writer holding its transaction does not block lookups (readers never wait)
    other.execute("BEGIN EXCLUSIVE")
    assert _warnings_of(_attention_still_runs, times=1) == []
    assert call_config(40)[1].startswith("fwd: user db")
    other.execute("ROLLBACK")
    # a rollback-journal file under an exclusive transaction blocks everyone: reported, bypassed
    other.execute("PRAGMA journal_mode = DELETE")
    other.execute("BEGIN EXCLUSIVE")
    other.execute("DELETE FROM msa_tuning")
    try:
        reload()
        caught = _warnings_of(_attention_still_runs)
        assert len(caught) == 1 and "locked" in str(caught[0].message)
        assert call_config(40)[1] == "heuristic default"
    finally:
        other.execute("ROLLBACK")
        other.close()


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


# ---- the tuner: tune -> store -> load -----------------------------------------------------------

def _problem(n=48):
    return Problem(PATTERN, 1, 2, 1, n, 16, torch.float32, "cpu", n)


def _key(direction, n=48):
    return TuningKey.current("cpu-interpreter", "cpu", PATTERN, direction, torch.float32, 16, 2, n)


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


def test_rows_are_keyed_by_the_kernel_sources_of_their_pattern(monkeypatch):
    from msa_codegen.kernels import render as codegen

    # same kernels (canonical spellings of one pattern) -> same key; other kernels -> another
    assert kernel_hash("window=8,dilation=2") == kernel_hash("dilation=2,window=8,causal")
    assert len({kernel_hash(p) for p in ("window=8,dilation=2", "window=16", "causal", "causal=false",
                                            "window=8,sink=4", "0-1:window=8;2-3:causal")}) == 6
    # the header line (template hash, library version) is not part of it: a change of the
    # templates that leaves a pattern's kernels alone keeps its rows
    before = codegen.kernel_hash.__wrapped__("window=8,dilation=2")
    monkeypatch.setattr(codegen, "templates_digest", lambda: "another-template")
    assert "another-template" in codegen.render(lower(parse("window=8,dilation=2").groups[0].spec), "fwd")
    assert codegen.kernel_hash.__wrapped__("window=8,dilation=2") == before


def test_a_comment_in_the_kernels_keeps_the_key(monkeypatch):
    """The key hashes the kernels' code: comments and blank lines added to the rendered text (a
    comment edit in a template) leave it; a change of code does not."""
    from msa_codegen.kernels import render as codegen

    real = codegen.render
    before = codegen.kernel_hash.__wrapped__("window=8,dilation=2")
    commented = lambda plan, d: real(plan, d).replace("\n", "\n    # a note, and a blank line\n\n", 3)   # noqa: E731
    monkeypatch.setattr(codegen, "render", commented)
    assert codegen.kernel_hash.__wrapped__("window=8,dilation=2") == before
    monkeypatch.setattr(codegen, "render", lambda plan, d: real(plan, d) + "EXTRA = 1\n")
    assert codegen.kernel_hash.__wrapped__("window=8,dilation=2") != before
    assert codegen.code_only("x = '#not a comment'  # a comment\n\n  \ny = 2\n") == "x = '#not a comment'\ny = 2\n"


def _as_schema_1(path):
    """Turn a schema-2 file into what schema 1 wrote: its version and the old kernel hashes."""
    from msa_codegen.tuning.migrations import kernel_hash_v1

    con = sqlite3.connect(path)
    con.execute("UPDATE msa_schema SET version = 1")
    for row_id, pattern in con.execute("SELECT id, pattern FROM msa_tuning").fetchall():
        con.execute("UPDATE msa_tuning SET template_hash = ? WHERE id = ?", (kernel_hash_v1(pattern), row_id))
    con.commit()
    con.close()


def test_schema_1_user_db_is_rekeyed_on_open(tmp_home):
    """A user database of schema 1 (rows keyed by the old hash, comments included) is migrated
    the first time the lookup reads it: its rows run, the file is schema 2, and a row that
    matched no kernels stays stale."""
    path = tmp_home / "tuning.db"
    put(path, row(gpu="cpu-interpreter", capability="cpu", dtype="float32", head_dim=16, gqa_group=2, bucket_=1024,
                  config={**FWD, "block_m": 16, "num_stages": 1}),
        row(gpu="cpu-interpreter", capability="cpu", dtype="float32", head_dim=16, gqa_group=2, bucket_=4096))
    _as_schema_1(path)
    con = sqlite3.connect(path)
    con.execute("UPDATE msa_tuning SET template_hash = '0123456789abcdef' WHERE bucket = 4096")
    con.commit()
    con.close()
    reload()
    cfg, source = call_config(40)
    assert source.startswith("fwd: user db") and cfg.fwd.block_m == 16
    con = sqlite3.connect(path)
    assert con.execute("SELECT version FROM msa_schema").fetchone() == (2,)
    hashes = dict(con.execute("SELECT bucket, template_hash FROM msa_tuning").fetchall())
    con.close()
    assert hashes == {1024: kernel_hash(PATTERN), 4096: "0123456789abcdef"}


def test_schema_1_export_is_rekeyed_on_import(tmp_path):
    from msa_codegen.tuning.migrations import kernel_hash_v1

    a, b = tmp_path / "a.db", tmp_path / "b.db"
    put(a, row(), row(direction="bwd"))
    with TuningDB(a) as db:
        doc = db.export()
    doc = dict(doc, schema_version=1, rows=[dict(r, template_hash=kernel_hash_v1(r["pattern"])) for r in doc["rows"]])
    with TuningDB(b) as db:
        assert db.import_(doc) == 2
        assert {r["template_hash"] for r in db.rows()} == {kernel_hash(PATTERN)}


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


def test_shipped_grid_lists_the_issue_grid_after_the_benchmark_cases(tmp_path):
    from msa_codegen.bench import CASES
    from msa_codegen.tuning import grid

    entries = grid.keys()
    assert [e.pattern for e in entries[:len(CASES)]] == [str(parse(c.pattern)) for c in CASES]
    # 3 windows x 3 dilations x 2 sinks x 2 directions of causality x 2 head dims x 2 dtypes x
    # 2 GQA groups x 9 buckets, each once (bench cases that fall on the grid are not repeated)
    on_grid = {(e.pattern, bucket(e.seqlen), e.head_dim, e.dtype, e.group) for e in entries}
    assert len(on_grid) == len(entries)
    assert len([e for e in entries if e.heads == grid.HEADS]) >= 3 * 3 * 2 * 2 * 2 * 2 * 2 * 9
    assert grid.grid_pattern(4096, 2, 64, False) == str(parse("causal=false,window=4096,dilation=2,sink=64"))
    # --export keeps the tuning rows only (no Optuna tables)
    src, dst = tmp_path / "src.db", tmp_path / "dst.db"
    put(src, row(), row(direction="bwd"))
    assert grid.export_rows(src, dst) == 2
    con = sqlite3.connect(dst)
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    con.close()
    assert "msa_tuning" in tables and "studies" not in tables
    if not torch.cuda.is_available():
        assert grid.main(["--db", str(src)]) == 2   # measuring needs a GPU


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
    err = precompile._warm("window=0", 2, 1, 40, 16, "float32", "cpu", "fwd", as_list(small))
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


def test_shipped_rows_are_for_the_current_kernels():
    """Every row of the shipped database was measured on the kernels this checkout generates: a
    template change orphans rows by their kernel hash, and then they must be re-tuned or removed
    (the README describes the shipped rows as current)."""
    with TuningDB(lookup_mod.SHIPPED_DB, mode="ro") as db:
        rows = db.rows()
    stale = [(r["pattern"], r["direction"]) for r in rows if r["template_hash"] != kernel_hash(r["pattern"])]
    assert not stale, f"shipped rows measured on other kernels: {stale}"
