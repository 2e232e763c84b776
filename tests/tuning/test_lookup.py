"""The lookup of launch configurations (msa_codegen.tuning.lookup) and the heuristic defaults
(msa_codegen.heuristics): the order of sources, caching until reload(), databases that cannot
be used (one warning, attention still runs)."""
from __future__ import annotations

import sqlite3

import pytest
import torch

import msa_codegen as msa
from msa_codegen.config import BwdConfig, FwdConfig, LaunchConfig
from msa_codegen.heuristics import default_config
from msa_codegen.tuning import lookup as lookup_mod
from msa_codegen.tuning.database import SchemaError, TuningDB
from msa_codegen.tuning.lookup import reload

from tuning_helpers import (BWD, FWD, PATTERN, _attention_still_runs, _warnings_of, call_config, put, row,  # noqa: F401
                            tmp_home, which)   # tmp_home: the autouse fixture


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
    # D=64 (encoder-sized heads): 64 x 64 forward tiles and 32-row dk/dv tiles on a narrow band
    enc = default_config(cuda, 64, bf16, "9.0", "causal=false,window=256")
    assert enc.fwd == FwdConfig(64, 64, 4, 2) and (enc.bwd.block_m1, enc.bwd.block_n1) == (32, 64)
    wide = default_config(cuda, 64, bf16, "9.0", "window=4096")
    assert wide.fwd == FwdConfig(128, 64, 8, 3) and (wide.bwd.block_m1, wide.bwd.block_n1) == (64, 64)
    assert default_config(cuda, 64, bf16, "8.0", "causal=false,window=256") == default_config(cuda, 64, bf16, "8.0")


def test_d256_window_backward_default():
    """Head dim 256 on Hopper: windows' backward runs dk/dv on three stages and dq in 128 x 32
    tiles on two (the tuner's winner on the shipped window rows); dense and other patterns, the
    forward, and GPUs with 99 KiB per block keep theirs."""
    from msa_codegen.heuristics import plain_window

    assert plain_window("window=1024") and plain_window("causal=false,window=512,sink=4")
    assert plain_window("window=4096,dilation=2")
    for p in ("causal", "causal=false,global=3,window=7", "window=512,random=2", "window=64,topk=2,block=64",
              "0-7:window=512;8-15:causal", None):
        assert not plain_window(p), p
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    win, dense = default_config(cuda, 256, bf16, "9.0", "window=1024"), default_config(cuda, 256, bf16, "9.0", "causal")
    assert win.bwd == BwdConfig(32, 64, 8, 3, 128, 32, 8, 2)
    assert dense.bwd == BwdConfig(32, 64, 8, 2, 128, 64, 8, 1) == default_config(cuda, 256, bf16, "9.0").bwd
    assert win.fwd == dense.fwd == FwdConfig(128, 64, 8, 2)
    assert default_config(cuda, 256, bf16, "12.0", "window=1024") == default_config(cuda, 256, bf16, "12.0")
    # head dims up to 128 are not affected
    assert default_config(cuda, 128, bf16, "9.0", "window=4096").bwd == default_config(cuda, 128, bf16, "9.0").bwd


def test_bucketed_rows_default_and_no_row(tmp_home, monkeypatch):
    """A call with short hash buckets: on Hopper at head dims 64 < D <= 128 the short-row tiles,
    in both directions, and no database row (the tuner measures patterns without buckets), for
    attention's plan and explain alike. Buckets longer than SHORT_BUCKET_KEYS on average run as
    the pattern (its rows, its default)."""
    from msa_codegen import api, plan as plan_mod
    from msa_codegen.sparsity.inputs import prepare

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    hashed = default_config(cuda, 128, bf16, "9.0", "causal", buckets=True)
    assert hashed == LaunchConfig(FwdConfig(64, 64, 4, 2), BwdConfig(32, 64, 4, 2, 64, 64, 4, 2))
    assert hashed != default_config(cuda, 128, bf16, "9.0", "causal")
    for d, cap in ((64, "9.0"), (256, "9.0"), (128, "8.0"), (128, "12.0")):
        assert default_config(cuda, d, bf16, cap, "causal", buckets=True) == default_config(cuda, d, bf16, cap,
                                                                                           "causal"), (d, cap)
    put(tmp_home / "tuning.db", row(), row(direction="bwd"))
    assert which().source.startswith("user db")
    res = which(buckets=True)
    assert res.source == "heuristic default" and res.config == default_config(cuda, 128, bf16, "9.0", PATTERN,
                                                                              buckets=True)
    # plans: short buckets take no row; long buckets and cu_seqlens keep it
    put(tmp_home / "tuning.db", row(gpu="cpu-interpreter", capability="cpu", dtype="float32", head_dim=16,
                                    gqa_group=2, bucket_=1024))
    cpu, f32 = torch.device("cpu"), torch.float32
    assert plan_mod.plan_for(PATTERN, cpu, f32, 16, 2, 1, 40, True, True, False, True).source == "heuristic default"
    for classes, short in ((False, False), (True, False)):
        plan = plan_mod.plan_for(PATTERN, cpu, f32, 16, 2, 1, 40, True, True, classes, short)
        assert plan.resolution.fwd.source.startswith("user db"), (classes, short)
    q, k = torch.randn(1, 2, 40, 16), torch.randn(1, 1, 40, 16)
    assert msa.explain(q, k, k, PATTERN).fwd.source.startswith("user db")
    assert msa.explain(q, k, k, PATTERN, buckets=True).source == "heuristic default"

    # the mean keys per bucket of a key row, and attention's choice from it
    groups = msa.parse(PATTERN).head_groups(2)
    qb = torch.tensor([0] * 13 + [1] * 7 + [3] * 20, dtype=torch.int32)   # 3 buckets in 40 rows
    kb = torch.stack([qb, torch.tensor([0] * 10 + [1] * 10 + [2] * 10 + [5] * 10, dtype=torch.int32)]).view(1, 2, 40)
    kb2 = kb[:, :1]
    assert prepare(groups, 1, 2, 1, 40, 40, None, q_bucket=qb, k_bucket=qb).bucket_keys == 40 / 3
    assert prepare(msa.parse(PATTERN).head_groups(4), 1, 4, 2, 40, 40, None, q_bucket=qb,
                   k_bucket=kb).bucket_keys == 80 / 7
    assert prepare(groups, 1, 2, 1, 40, 40, None, q_bucket=qb, k_bucket=kb2).bucket_keys == 40 / 3
    assert prepare(groups, 1, 2, 1, 40, 40, None, q_pos=torch.arange(40), k_pos=torch.arange(40)).bucket_keys == 0
    v = torch.randn(1, 1, 40, 16)
    for limit, short in ((4096, True), (13, False)):
        monkeypatch.setattr(api, "SHORT_BUCKET_KEYS", limit)
        plan_mod.clear()
        msa.attention(q, k, v, PATTERN, q_bucket=qb, k_bucket=qb)
        assert [key[-1] for key in plan_mod._PLANS] == [short], limit


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
    put(user, row(triton_version="0.0.1"), row(direction="bwd", kernel_hash="0123456789abcdef"))
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
