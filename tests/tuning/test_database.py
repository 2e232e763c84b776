"""The tuning database (msa_codegen.tuning.database, keys, models, migrations, gpu): keys,
schema, rows, exports, the kernel hash and the migration of schema-1 and schema-2 files."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch

from msa_codegen.kernels.render import kernel_hash
from msa_codegen.pattern.lowering import lower
from msa_codegen.pattern.spec import parse
from msa_codegen.tuning import gpu as gpu_mod
from msa_codegen.tuning import lookup as lookup_mod
from msa_codegen.tuning.database import SchemaError, TuningDB
from msa_codegen.tuning.keys import bucket
from msa_codegen.tuning.lookup import reload

from tuning_helpers import FWD, PATTERN, _as_schema, call_config, put, row, tmp_home, which  # noqa: F401 (tmp_home: autouse)

DATA = Path(__file__).parent / "data"
SCHEMA_2_DB = DATA / "tuning_schema2.db"


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
    assert con.execute("SELECT app, version FROM msa_schema").fetchone() == ("msa-codegen-tuning", 3)
    cols = {r[1] for r in con.execute("PRAGMA table_info(msa_tuning)")}
    assert {"gpu", "capability", "pattern", "direction", "dtype", "head_dim", "gqa_group", "bucket", "triton_version",
            "kernel_hash", "config", "median_ms", "spread_ms", "tflops", "trials", "library_version", "created_at",
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


@pytest.mark.parametrize("version", [1, 2])
def test_an_old_user_db_is_rekeyed_on_open(tmp_home, version):
    """A user database of schema 1 (rows keyed by the old hash, comments included) or 2 (column
    template_hash, rows keyed by the kernels as schema 2 spelled them) is migrated the first time
    the lookup reads it: the column is kernel_hash, its rows run, the file is schema 3, and a row
    that matched no kernels stays stale."""
    path = tmp_home / "tuning.db"
    put(path, row(gpu="cpu-interpreter", capability="cpu", dtype="float32", head_dim=16, gqa_group=2, bucket_=1024,
                  config={**FWD, "block_m": 16, "num_stages": 1}),
        row(gpu="cpu-interpreter", capability="cpu", dtype="float32", head_dim=16, gqa_group=2, bucket_=4096))
    _as_schema(path, version)
    con = sqlite3.connect(path)
    con.execute("UPDATE msa_tuning SET template_hash = '0123456789abcdef' WHERE bucket = 4096")
    con.commit()
    con.close()
    reload()
    cfg, source = call_config(40)
    assert source.startswith("fwd: user db") and cfg.fwd.block_m == 16
    con = sqlite3.connect(path)
    assert con.execute("SELECT version FROM msa_schema").fetchone() == (3,)
    hashes = dict(con.execute("SELECT bucket, kernel_hash FROM msa_tuning").fetchall())
    con.close()
    assert hashes == {1024: kernel_hash(PATTERN), 4096: "0123456789abcdef"}


@pytest.mark.parametrize("version", [1, 2])
def test_an_old_export_is_rekeyed_on_import(tmp_path, version):
    from msa_codegen.tuning.migrations import kernel_hash_v1, kernel_hash_v2

    old_key = {1: kernel_hash_v1, 2: kernel_hash_v2}[version]
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    put(a, row(), row(direction="bwd"))
    with TuningDB(a) as db:
        doc = db.export()
    rows = [{**{k: v for k, v in r.items() if k != "kernel_hash"}, "template_hash": old_key(r["pattern"])}
            for r in doc["rows"]]
    doc = dict(doc, schema_version=version, rows=rows)
    with TuningDB(b) as db:
        assert db.import_(doc) == 2
        assert {r["kernel_hash"] for r in db.rows()} == {kernel_hash(PATTERN)}


def test_schema_2_file_migrates(tmp_home, monkeypatch):
    """A file schema 2 wrote (data/tuning_schema2.db: the shipped database of commit 420e367, six
    H200 rows) is refused read-only, migrated by a writable open (the column renamed, every row
    re-keyed to the running kernels, nothing else changed), and then its rows are chosen."""
    from msa_codegen.tuning.database import SchemaOutdated

    path = tmp_home / "tuning.db"
    path.parent.mkdir(parents=True)
    path.write_bytes(SCHEMA_2_DB.read_bytes())
    con = sqlite3.connect(path)
    con.row_factory = sqlite3.Row
    before = [dict(r) for r in con.execute("SELECT * FROM msa_tuning ORDER BY id")]
    con.close()
    assert len(before) == 6 and all(r["template_hash"] != kernel_hash(r["pattern"]) for r in before)
    with pytest.raises(SchemaOutdated):
        TuningDB(path, mode="ro")
    TuningDB(path).close()   # a writable open migrates
    con = sqlite3.connect(path)
    con.row_factory = sqlite3.Row
    assert con.execute("SELECT version FROM msa_schema").fetchone()[0] == 3
    after = [dict(r) for r in con.execute("SELECT * FROM msa_tuning ORDER BY id")]
    con.close()
    assert [r["kernel_hash"] for r in after] == [kernel_hash(r["pattern"]) for r in before]
    assert [{k: v for k, v in r.items() if k != "kernel_hash"} for r in after] == \
        [{k: v for k, v in r.items() if k != "template_hash"} for r in before]
    # the rows were measured with Triton 3.6.0: run as that version, the lookup chooses them
    monkeypatch.setattr(lookup_mod, "triton_version", lambda: before[0]["triton_version"])
    reload()
    res = lookup_mod.lookup_for_gpu("h200", "9.0", "window=4096", 128, "bfloat16", 1, 131072, cuda=True)
    assert res.fwd.source.startswith("user db") and res.bwd.source.startswith("user db")


def test_schema_2_key_of_the_running_kernels():
    """``kernel_hash_v2`` (the running kernels spelled as schema 2's templates wrote them) gives
    the key schema 2 gave: data/schema2_kernel_hashes.json holds ``kernel_hash`` of commit 420e367
    for 66 patterns (every term, the tuning grid's patterns). So the renames and the dropped
    constants are the only differences of the kernels' code, and the migration finds every row.
    Random and top-k plans are the exception: their blocks left of the query block have run
    unmasked since (branch topk-unmasked), other code than schema 2's rows were measured on, so
    their rows stay stale. So are dense plans without a prefix (``causal``, ``causal=false``):
    their kernels no longer hold the W phase's empty first loop (it made ptxas serialize the
    D=128 dq's wgmma)."""
    import json

    from msa_codegen.tuning.migrations import kernel_hash_v2

    expected = json.loads((DATA / "schema2_kernel_hashes.json").read_text())
    assert len(expected) == 66
    changed = {p for p in expected if any(g.spec.random or g.spec.topk for g in parse(p).groups)}
    assert len(changed) == 13
    changed |= {p for p in expected if all(lower(g.spec).dense and not lower(g.spec).prefix for g in parse(p).groups)}
    assert len(changed) == 15
    assert {p: kernel_hash_v2(p) for p in expected if p not in changed} == {
        p: h for p, h in expected.items() if p not in changed}
    assert not {p for p in changed if kernel_hash_v2(p) == expected[p]}
    assert not {p for p in expected if kernel_hash(p) == expected[p]}


def test_shipped_rows_are_for_the_current_kernels():
    """Every row of the shipped database was measured on the kernels this checkout generates: a
    template change orphans rows by their kernel hash, and then they must be re-tuned or removed
    (the README describes the shipped rows as current). The Gluon family's rows are keyed by the
    hash of its kernels of their direction (``keys.gluon_hash``, the same on every Triton)."""
    from msa_codegen.tuning.keys import gluon_hash, is_gluon_hash

    with TuningDB(lookup_mod.SHIPPED_DB, mode="ro") as db:
        rows = db.rows()
    stale = [(r["pattern"], r["direction"]) for r in rows
             if r["kernel_hash"] != (gluon_hash(r["pattern"], r["direction"]) if is_gluon_hash(r["kernel_hash"])
                                     else kernel_hash(r["pattern"]))]
    assert not stale, f"shipped rows measured on other kernels: {stale}"
    assert any(is_gluon_hash(r["kernel_hash"]) for r in rows)
