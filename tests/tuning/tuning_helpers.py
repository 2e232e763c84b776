"""Shared by the tuning tests: rows, databases in tmp_path, the problem the tuner tunes.

Databases live in tmp_path: ``tmp_home`` (autouse in every tuning test module that imports it)
points MSA_CODEGEN_HOME there (the default user database is $MSA_CODEGEN_HOME/tuning.db) and
MSA_CODEGEN_SHIPPED_DB at a file that exists only when a test builds one.
"""
from __future__ import annotations

import datetime
import sqlite3
import warnings

import pytest
import torch

import msa_codegen as msa
from msa_codegen.plan import plan_for
from msa_codegen.tuning.database import TuningDB
from msa_codegen.tuning.keys import TuningKey, triton_version
from msa_codegen.kernels.render import kernel_hash
from msa_codegen.tuning.lookup import lookup_for_gpu, reload
from msa_codegen.tuning.measure import Problem

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
                kernel_hash=kernel_hash(PATTERN), config=dict(config or (FWD if direction == "fwd" else BWD)),
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


# ---- the tuner: tune -> store -> load -----------------------------------------------------------

def _problem(n=48):
    return Problem(PATTERN, 1, 2, 1, n, 16, torch.float32, "cpu", n)


def _key(direction, n=48):
    return TuningKey.current("cpu-interpreter", "cpu", PATTERN, direction, torch.float32, 16, 2, n)


def _as_schema(path, version):
    """Turn a file of the current schema into what schema ``version`` (1 or 2) wrote: its version,
    the column's old name (template_hash) and that schema's key of the running kernels."""
    from msa_codegen.tuning.migrations import OLD_KEYS

    con = sqlite3.connect(path)
    con.execute(f"UPDATE msa_schema SET version = {version}")
    con.execute("ALTER TABLE msa_tuning RENAME COLUMN kernel_hash TO template_hash")
    for row_id, pattern in con.execute("SELECT id, pattern FROM msa_tuning").fetchall():
        con.execute("UPDATE msa_tuning SET template_hash = ? WHERE id = ?", (OLD_KEYS[version](pattern), row_id))
    con.commit()
    con.close()
