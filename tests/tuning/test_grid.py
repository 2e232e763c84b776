"""The shipped grid (msa_codegen.tuning.grid): which shapes it holds and in what order, what
``--list`` reports as filled, and the command's resume, shards, budget and export; on the CPU (the
GPU measurement itself is replaced by a stand-in that stores a row)."""
from __future__ import annotations

import dataclasses
import sqlite3

import pytest
import torch

from msa_codegen.pattern.spec import parse
from msa_codegen.tuning import grid
from msa_codegen.tuning.grid import BENCH_CASES as CASES
from msa_codegen.tuning.keys import bucket, triton_version
from msa_codegen.tuning.measure import representative_problem

from tuning_helpers import put, row, tmp_home  # noqa: F401 (tmp_home: autouse)

GRID_BUCKETS = {4096, 8192, 16384, 32768, 65536, 131072, 524288}


def _entry(family: str, pattern: str, seqlen: int) -> grid.Entry:
    matches = [e for e in grid.keys() if e.family == family and e.pattern == str(parse(pattern))
               and e.seqlen == seqlen]
    assert len(matches) == 1, (family, pattern, seqlen, matches)
    return matches[0]


def _rows_of(entry: grid.Entry, gpu="h200", capability="9.0", directions=("fwd", "bwd"), **kw) -> list[dict]:
    """Rows the lookup serves for ``entry`` on ``gpu`` (the running Triton and kernels), ``kw`` overriding."""
    out = []
    for direction, key in entry.keys(gpu, capability).items():
        if direction in directions:
            r = row(direction=direction)
            r.update(key.as_dict(), seqlen=entry.seqlen, batch=entry.gpu_batch, heads=entry.heads,
                     kv_heads=entry.kv_heads)
            r.update(kw)
            out.append(r)
    return out


# ---- what the grid holds --------------------------------------------------------------------------

def test_the_benchmark_cases_come_first_with_their_shapes():
    entries = grid.keys()
    bench = entries[:len(CASES)]
    assert [(e.pattern, e.head_dim, e.heads, e.kv_heads) for e in bench] == \
        [(str(parse(c.pattern)), c.d, c.hq, c.hkv) for c in CASES]
    # the 1M case is tuned at 512k (its nearest bucket serves 1M)
    assert [e.seqlen for e in bench] == [min(c.n, 524288) for c in CASES]
    assert all(e.family.startswith("bench:") for e in bench)
    assert not any(e.family.startswith("bench:") for e in entries[len(CASES):])


def test_the_grid_is_the_families_shapes_each_key_once():
    entries = grid.keys()
    assert 40 <= len(entries) <= 60, len(entries)
    assert len({e.ident() for e in entries}) == len(entries)
    assert {e.dtype for e in entries} == {"bf16"}
    assert {bucket(e.seqlen) for e in entries} <= GRID_BUCKETS
    by_family: dict[str, list[grid.Entry]] = {}
    for e in entries[len(CASES):]:
        by_family.setdefault(e.family, []).append(e)
    assert set(by_family) == set(grid.FAMILIES)
    # Llama-3 / Qwen-2.5: dense causal, D=128, GQA 4-8, at 4k, 8k and 32k
    for fam in ("llama3", "qwen2.5", "llama3-70b"):
        es = by_family[fam]
        assert {e.pattern for e in es} == {"causal"} and {e.head_dim for e in es} == {128}
        assert 4 <= es[0].group <= 8
    assert {e.seqlen for e in by_family["llama3"]} == {4096, 8192, 32768}
    assert {(e.heads, e.kv_heads) for e in by_family["qwen2.5"]} == {(28, 4)}
    # Mistral: window=4096, GQA 32/8, up to 512k (its 128k entry is msa-bench's gqa-w4096)
    mistral = by_family["mistral"]
    assert {e.pattern for e in mistral} == {"window=4096"} and {(e.heads, e.kv_heads) for e in mistral} == {(32, 8)}
    assert {e.seqlen for e in mistral} == {4096, 8192, 32768, 524288}
    gqa = next(e for e in entries if e.family == "bench:gqa-w4096")
    assert (gqa.pattern, gqa.group, gqa.seqlen) == ("window=4096", 4, 131072)
    # Gemma 2 / 3: local windows 1024 and 4096 and their global causal layers, D=256 and D=128, GQA 2
    gemma = by_family["gemma-d256"] + by_family["gemma-d128"]
    assert {e.head_dim for e in gemma} == {128, 256} and {e.group for e in gemma} == {2}
    assert {e.pattern for e in gemma} == {"window=1024", "window=4096", "causal"}
    assert {e.seqlen for e in gemma if e.pattern == "window=1024"} == {4096, 8192, 32768, 131072}
    # encoders: bidirectional windows of a few hundred, D=64, 12 heads, timed at B=8
    enc = by_family["encoder"]
    assert {e.pattern for e in enc} == {"causal=false,window=256", "causal=false,window=512"}
    assert {(e.head_dim, e.heads, e.kv_heads, e.batch) for e in enc} == {(64, 12, 12, 8)}
    assert {e.seqlen for e in enc} == {4096, 8192, 16384}


def test_the_docs_give_the_grids_size_and_trials():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    n = len(grid.keys())
    assert f"{n} entries in priority order" in grid.__doc__ and f"{n} entries in" in " ".join(readme.split())
    trials = f"{grid.TRIALS['fwd']} forward and {grid.TRIALS['bwd']} backward"
    assert trials in " ".join(grid.__doc__.split()) and trials in " ".join(readme.split())


def test_every_family_has_an_entry_near_the_top():
    """A run stopped by its budget has filled each family's most-run shape: tier 1 comes first."""
    top = grid.keys()[:len(CASES) + 9]
    # (llama3-70b, GQA 64/8, is the Llama-3 family's second shape: tier 2)
    assert {e.family for e in top} == set(grid.FAMILIES) - {"llama3-70b"} | {e.family for e in top[:len(CASES)]}
    first = {}
    for idx, e in enumerate(grid.keys()):
        first.setdefault((e.family, e.pattern), idx)
    # the class the issue measured against FlexAttention leads the families
    assert first[("encoder", "causal=false,window=512")] == len(CASES)


def test_an_entry_is_timed_at_its_familys_batch_and_heads():
    enc = _entry("encoder", "causal=false,window=512", 4096)
    p = representative_problem(enc.pattern, enc.heads, enc.kv_heads, enc.seqlen, enc.head_dim, torch.bfloat16, True,
                               batch=enc.batch)
    assert (p.batch, p.heads, p.kv_heads, p.seqlen, p.head_dim) == (8, 12, 12, 4096, 64)
    assert "B=8" in enc.describe()
    # without a batch of its own, the representative problem's: 65536 // N, at least 1
    llama = _entry("llama3", "causal", 4096)
    assert llama.batch is None and llama.gpu_batch == 16
    assert representative_problem("causal", 32, 8, 4096, 128, torch.bfloat16, True).batch == 16
    assert representative_problem("causal", 32, 8, 524288, 128, torch.bfloat16, True).batch == 1
    with pytest.raises(ValueError, match="batch"):
        representative_problem("causal", 32, 8, 4096, 128, torch.bfloat16, True, batch=0)
    # the interpreter's reduced problem keeps batch 1
    assert representative_problem("causal", 32, 8, 4096, 128, torch.float16, False, batch=8).batch == 1


# ---- --list: what is filled -----------------------------------------------------------------------

def test_list_says_which_entries_the_lookup_would_serve(tmp_path, capsys):
    db = tmp_path / "grid.db"
    full, half, stale, other_gpu, broken = (
        _entry("encoder", "causal=false,window=512", 4096), _entry("llama3", "causal", 8192),
        _entry("mistral", "window=4096", 32768), _entry("gemma-d256", "window=1024", 32768),
        _entry("qwen2.5", "causal", 32768))
    put(db, *_rows_of(full), *_rows_of(half, directions=("fwd",)),
        *_rows_of(stale, triton_version="0.0-other"),
        *_rows_of(other_gpu, gpu="h100"),
        *_rows_of(broken),
        # another bucket of an entry does not fill it (the lookup's nearest bucket is not the key)
        *_rows_of(dataclasses.replace(full, seqlen=2048)))
    # a hand-edited row whose config the lookup cannot use (the database refuses to store one)
    con = sqlite3.connect(db)
    con.execute("""UPDATE msa_tuning SET config = '{"block_m": 48, "block_n": 32, "num_warps": 4, "num_stages": 2}'
                   WHERE pattern = 'causal' AND gqa_group = 7 AND bucket = 32768 AND direction = 'fwd'""")
    con.commit()
    con.close()
    rows = grid.read_rows(db, "h200")
    assert grid.entry_status(rows, full, "h200", "9.0") == "filled"
    assert grid.entry_status(rows, half, "h200", "9.0") == "fwd only"
    assert grid.entry_status(rows, stale, "h200", "9.0") == "stale (Triton 0.0-other)"
    assert grid.entry_status(rows, other_gpu, "h200", "9.0") == "-"
    assert grid.entry_status(grid.read_rows(db, "h100"), other_gpu, "h100", "9.0") == "filled"
    assert grid.entry_status(rows, broken, "h200", "9.0") == "bwd only"   # fwd: a config the lookup cannot use
    assert grid.entry_status(rows, _entry("encoder", "causal=false,window=512", 8192), "h200", "9.0") == "-"

    assert grid.main(["--list", "--db", str(db)]) == 0
    out = capsys.readouterr().out.splitlines()
    entries = grid.keys()
    assert len(out) == len(entries) + 1
    for idx, e in enumerate(entries):
        assert out[idx].split()[0] == str(idx) and e.describe() in out[idx], (idx, out[idx])
    assert out[entries.index(full)].endswith("filled")
    assert out[entries.index(half)].endswith("fwd only")
    assert out[entries.index(stale)].endswith("stale (Triton 0.0-other)")
    assert out[entries.index(broken)].endswith("bwd only")
    assert out[-1] == (f"{len(entries)} entries x 2 directions; 1 filled, 2 one direction only, 1 only stale rows, "
                       f"in {db} for h200 (capability 9.0)")
    assert grid.main(["--list", "--db", str(db), "--gpu", "H100 80GB HBM3"]) == 0
    assert "; 1 filled," in capsys.readouterr().out


def test_list_reads_the_shipped_database_by_default(tmp_path, monkeypatch, capsys):
    shipped = tmp_path / "shipped.db"            # tmp_home points MSA_CODEGEN_SHIPPED_DB here
    e = grid.keys()[0]
    put(shipped, *_rows_of(e))
    assert grid.main(["--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("filled") and f"in {shipped} for h200" in out[-1]
    # a file that is not a tuning database: one line on stderr, exit code 2
    (tmp_path / "junk.db").write_text("not a database")
    assert grid.main(["--list", "--db", str(tmp_path / "junk.db")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "junk.db is damaged" in err
    with pytest.raises(SystemExit):
        grid.main(["--list", "--gpu", "no-such-gpu"])


# ---- the command: shards, resume, budget, export -------------------------------------------------

@pytest.fixture
def fake_gpu(monkeypatch):
    """``run`` as on an H200, each direction 'tuned' by storing a row: the calls are recorded."""
    calls = []

    def fake_tune(problem, direction, key, db_path, *, trials, progress, rep_ms):
        calls.append(dict(problem=problem, direction=direction, key=key, trials=trials, rep_ms=rep_ms))
        r = row(direction=direction)
        r.update(key.as_dict(), batch=problem.batch, heads=problem.heads, kv_heads=problem.kv_heads,
                 seqlen=problem.seqlen)
        put(db_path, r)
        return None   # "nothing valid measured": the row above is what a real run stores

    monkeypatch.setattr(grid.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(grid.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(grid._gpu, "current_gpu", lambda index=None: ("h200", "9.0"))
    monkeypatch.setattr(grid, "tune", fake_tune)
    return calls


def test_run_takes_its_shard_in_order_and_resumes(tmp_path, fake_gpu, capsys):
    db = tmp_path / "grid.db"
    entries = grid.keys()
    assert grid.main(["--db", str(db), "--shard", "1/4", "--limit", "3"]) == 0
    mine = entries[1::4][:3]
    assert [(c["key"].pattern, c["key"].bucket, c["key"].head_dim, c["key"].gqa_group) for c in fake_gpu] == \
        [(e.pattern, bucket(e.seqlen), e.head_dim, e.group) for e in mine for _ in range(2)]
    assert [c["direction"] for c in fake_gpu] == ["fwd", "bwd"] * 3
    assert {(c["trials"], c["rep_ms"]) for c in fake_gpu if c["direction"] == "fwd"} == {(grid.TRIALS["fwd"],
                                                                                           grid.REP_MS)}
    assert {c["trials"] for c in fake_gpu if c["direction"] == "bwd"} == {grid.TRIALS["bwd"]}
    rows = grid.read_rows(db, "h200")
    assert all(grid.entry_status(rows, e, "h200", "9.0") == "filled" for e in mine)
    # a second run skips what is stored and goes on (its limit counts skipped entries too)
    fake_gpu.clear()
    assert grid.main(["--db", str(db), "--shard", "1/4", "--limit", "4", "--trials-fwd", "2"]) == 0
    assert len(fake_gpu) == 2 and fake_gpu[0]["key"].pattern == entries[1::4][3].pattern
    assert fake_gpu[0]["trials"] == 2
    assert "1 entries tuned, 3 already stored" in capsys.readouterr().out
    # a missing direction is tuned alone
    fake_gpu.clear()
    con = sqlite3.connect(db)
    con.execute("DELETE FROM msa_tuning WHERE direction = 'bwd' AND pattern = ? AND bucket = ? AND head_dim = ?",
                (mine[0].pattern, bucket(mine[0].seqlen), mine[0].head_dim))
    con.commit()
    con.close()
    assert grid.main(["--db", str(db), "--shard", "1/4", "--limit", "4"]) == 0
    assert [(c["key"].pattern, c["direction"]) for c in fake_gpu] == [(mine[0].pattern, "bwd")]


def test_run_times_the_encoders_at_batch_8(tmp_path, fake_gpu):
    entries = grid.keys()
    idx = entries.index(_entry("encoder", "causal=false,window=512", 4096))
    assert grid.main(["--db", str(tmp_path / "grid.db"), "--shard", f"{idx}/{len(entries)}"]) == 0
    p = fake_gpu[0]["problem"]
    assert (p.batch, p.heads, p.kv_heads, p.seqlen, p.head_dim, p.dtype) == (8, 12, 12, 4096, 64, torch.bfloat16)
    assert p.pattern == "causal=false,window=512"


def test_budget_and_export(tmp_path, fake_gpu, capsys):
    src, dst = tmp_path / "grid.db", tmp_path / "ship.db"
    assert grid.main(["--db", str(src), "--budget-s", "0"]) == 0
    assert not fake_gpu and "budget spent after 0 entries" in capsys.readouterr().out
    assert grid.main(["--db", str(src), "--limit", "1"]) == 0 and len(fake_gpu) == 2
    # --export keeps the tuning rows only (no Optuna tables)
    assert grid.main(["--db", str(src), "--export", str(dst)]) == 0
    assert "exported 2 rows" in capsys.readouterr().out
    con = sqlite3.connect(dst)
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    n = con.execute("SELECT count(*) FROM msa_tuning WHERE triton_version = ?", (triton_version(),)).fetchone()[0]
    con.close()
    assert "msa_tuning" in tables and "studies" not in tables and n == 2
    with pytest.raises(SystemExit):
        grid.main(["--db", str(src), "--shard", "4/4"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_measuring_needs_a_gpu(tmp_path, capsys):
    assert grid.main(["--db", str(tmp_path / "grid.db")]) == 2
    assert "measured on a GPU; none here" in capsys.readouterr().err


def test_compare_times_tuned_against_default_interleaved(tmp_path, monkeypatch, capsys):
    """``--compare``: every filled entry's tuned config against the heuristic default in the same
    rounds (a stand-in bench: the tuned configs take 1.0 ms, the default 1.25 ms, except that one
    entry's backward is slower tuned); a config equal to the default is not timed."""
    from msa_codegen.config import BwdConfig, FwdConfig, LaunchConfig
    from msa_codegen.tuning import measure

    from tuning_helpers import BWD, FWD

    # the helper's rows hold FWD / BWD: the default here, so that the first entry is untuned
    default = LaunchConfig(FwdConfig(**FWD), BwdConfig(**BWD))
    other_fwd = dict(block_m=64, block_n=64, num_warps=4, num_stages=2)
    other_bwd = dict(block_m1=32, block_n1=64, num_warps1=4, num_stages1=2, block_m2=64, block_n2=64,
                     num_warps2=4, num_stages2=2)
    e_bench = grid.keys()[0]                                   # a hand-swept shape: default rows
    e_fam = _entry("encoder", "causal=false,window=512", 4096)  # off them: other configs
    e_slow = _entry("encoder", "causal=false,window=256", 4096)
    db = tmp_path / "grid.db"
    put(db, *_rows_of(e_bench),
        *[r | {"config": other_fwd if r["direction"] == "fwd" else other_bwd} for r in _rows_of(e_fam)],
        *[r | {"config": other_fwd if r["direction"] == "fwd" else other_bwd} for r in _rows_of(e_slow)])
    timed = []

    class StandIn:
        def __init__(self, problem, direction, rep_ms):
            self.problem, self.direction = problem, direction

        def time(self, cfg, rep_ms=None):
            timed.append((self.problem.pattern, self.direction, cfg == default))
            slow = self.problem.pattern == e_slow.pattern and self.direction == "bwd"
            return (1.25 if cfg == default else (1.5 if slow else 1.0)), 0.0, []

    monkeypatch.setattr(grid.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(grid.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(grid._gpu, "current_gpu", lambda index=None: ("h200", "9.0"))
    monkeypatch.setattr(measure, "Bench", StandIn)
    import msa_codegen.heuristics as heur
    monkeypatch.setattr(heur, "default_config", lambda *a, **k: default)
    res = grid.compare(db, rounds=3, rep_ms=10)
    out = capsys.readouterr().out
    assert [(r.entry, r.direction) for r in res] == [(e, d) for e in (e_bench, e_fam, e_slow) for d in ("fwd", "bwd")]
    assert [r.gain for r in res[:2]] == [1.0, 1.0] and res[0].tuned_ms is None
    assert [round(r.gain, 3) for r in res[2:]] == [1.25, 1.25, 1.25, round(1.25 / 1.5, 3)]
    # the default is not timed where it is the tuned config; elsewhere both, three rounds each
    assert not any(p == e_bench.pattern for p, _, _ in timed)
    assert len(timed) == 4 * 2 * 3 and sum(d for _, _, d in timed) == 4 * 3
    assert "the tuned config is the default" in out
    assert "all filled rows: 6 rows, median gain 1.125x, worst 0.833x" in out
    assert "off the hand-swept shapes: 4 rows, median gain 1.250x, worst 0.833x" in out
