"""msa-tune on an msa pattern: rows of MsaConfig fields, and msa_attention running them."""
import dataclasses

import pytest
import torch

import msa_codegen as msa
from msa_codegen.cli import main as cli
from msa_codegen.cli import tune as tune_cli
from msa_codegen.msa import launch
from msa_codegen.tuning import lookup as tuning_lookup
from msa_codegen.tuning.database import TuningDB
from msa_codegen.tuning.keys import MSA_FIELDS

PATTERN = "msa=128,block=64"


def test_msa_fields_are_msaconfig():
    assert set(MSA_FIELDS["fwd"]) | set(MSA_FIELDS["bwd"]) == {f.name for f in dataclasses.fields(launch.MsaConfig)}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    db = tmp_path_factory.mktemp("msatune") / "tuning.db"
    # float16 on a GPU too, so that the rows are the ones the float16 calls below look up
    code = tune_cli.main(["--pattern", PATTERN, "--seqlen", "128", "--heads", "2", "--kv-heads", "1",
                          "--proxy-heads", "1", "--head-dim", "16", "--dtype", "fp16", "--trials", "2",
                          "--db", str(db)])
    assert code == 0
    tuning_lookup.reload()
    return db


def _inputs(device, n=128):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, n, 16, generator=g)
    k, v = (torch.randn(1, 1, n, 16, generator=g) for _ in range(2))
    qp, kp = (torch.randn(1, 1, n, 16, generator=g) for _ in range(2))
    return tuple(t.half().to(device) for t in (q, k, v, qp, kp))   # the rows are float16


def test_tune_writes_rows_and_attention_uses_them(tuned, monkeypatch, device):
    with TuningDB(tuned) as db:
        rows = db.rows()
    assert {r["direction"] for r in rows} == {"fwd", "bwd"}
    assert all(r["pattern"] == PATTERN and r["gqa_group"] == 2 and r["head_dim"] == 16 for r in rows)
    fwd = next(r for r in rows if r["direction"] == "fwd")
    # the finalists are re-measured interleaved against the default, which the row keeps
    assert all("interleaved over" in r["provenance"] and r["default_ms"] > 0 for r in rows)
    assert set(fwd["config"]) == set(MSA_FIELDS["fwd"])
    monkeypatch.setenv("MSA_CODEGEN_HOME", str(tuned.parent))   # the user db is $MSA_CODEGEN_HOME/tuning.db
    tuning_lookup.reload()
    seen = []
    orig = launch.select_meta

    def spy(*a, **kw):
        meta = orig(*a, **kw)
        seen.append((meta["BLOCK_M"], meta["num_warps"], meta["num_stages"]))
        return meta

    monkeypatch.setattr(launch, "select_meta", spy)
    q, k, v, qp, kp = _inputs(device)
    msa.msa_attention(q, k, v, qp, kp, 128, block=64)
    want = (fwd["config"]["select_block_m"], fwd["config"]["select_warps"], fwd["config"]["select_stages"])
    assert seen[-1] == want
    cfg, res = launch.call_config(q.device, 128, 64, 16, q.dtype, 2, 128)
    assert "user db" in res.fwd.source and "user db" in res.bwd.source
    text = str(msa.explain(q, k, v, PATTERN, proxy_heads=1))
    assert "user db" in text
    # use_msa_config overrides the row
    with launch.use_msa_config(launch.MsaConfig(select_block_m=16, select_warps=2, select_stages=1)):
        msa.msa_attention(q, k, v, qp, kp, 128, block=64)
        assert "use_msa_config override" in str(msa.explain(q, k, v, PATTERN, proxy_heads=1))
    assert seen[-1] == (16, 2, 1)
    # another kernel hash: ignored
    with TuningDB(tuned) as db:
        db.clear()
        for r in rows:
            db.put(dict(r, kernel_hash="0" * 16))
    assert launch.call_config(q.device, 128, 64, 16, q.dtype, 2, 128)[1].fwd.source != tuning_lookup.HEURISTIC
    tuning_lookup.reload()   # clears the cache of resolved calls
    cfg, res = launch.call_config(q.device, 128, 64, 16, q.dtype, 2, 128)
    assert res.source == tuning_lookup.HEURISTIC and cfg == launch.MsaConfig()
    msa.msa_attention(q, k, v, qp, kp, 128, block=64)
    assert seen[-1] == (64, 8, 2)


def test_which_msa_reports_rows(tuned, capsys):
    assert cli.main(["which", "--pattern", PATTERN, "--seqlen", "128", "--head-dim", "16", "--dtype", "fp16",
                     "--heads", "2", "--kv-heads", "1", "--proxy-heads", "1", "--db", str(tuned)]) == 0
    out = capsys.readouterr().out
    assert "2 heads per proxy head" in out


def test_stage_counts_follow_the_rows_and_can_be_set():
    """The main attention's stage counts: 3 where shared memory allows, 1 above head dim 128 or
    128 rows (launch.stages); the tuner's default fills them in from G; a config sets them; the
    tuner never proposes more than fit; rows stored before they were fields still load."""
    from msa_codegen.tuning.keys import msa_config_from_row
    from msa_codegen.tuning.msa_search import MsaProblem, why_excluded

    cfg = launch.default_config(128, 16, 128, 128, g=4)          # 32 x 4 forward rows, 16 x 4 backward
    assert (cfg.fwd_stages, cfg.bwd_stages) == (3, 3)
    cfg = launch.default_config(128, 16, 128, 128, g=16)         # chunks of 8 / 4 heads: 128 / 64 rows
    assert (cfg.fwd_stages, cfg.bwd_stages) == (3, 3)
    assert launch.tile_stages(16, 256, 128, 128) == 1             # 16 entries x 16 heads
    assert launch.default_config(64, 16, 256, 256, g=2).fwd_stages == 1
    assert launch.default_config(128, 16, 128, 128).fwd_stages is None   # without G: the launchers derive it
    heads = launch.Heads(16, 2, 4, 1)
    assert launch.fwd_meta(heads, 128, 128, 128, 16, False, False, torch.bfloat16)["num_stages"] == 3
    with launch.use_msa_config(launch.MsaConfig(fwd_rows=64, fwd_warps=4, fwd_stages=1, bwd_stages=2)):
        meta = launch.fwd_meta(heads, 128, 128, 128, 16, False, False, torch.bfloat16)
        assert (meta["num_stages"], meta["num_warps"], meta["BLOCK_Q"] * meta["GP"]) == (1, 4, 64)
        assert launch.bwd_meta(heads, 128, 128, 128, 16, False, False, torch.bfloat16)["num_stages"] == 2

    def problem(heads, proxy_heads, d, interpreter=False, kv_heads=2):
        return MsaProblem("msa=2048", 2048, 128, heads, kv_heads, proxy_heads, 131072, d, torch.bfloat16, "cuda",
                          interpreter)

    fwd = dict(select_block_m=128, select_warps=8, select_stages=2, fwd_rows=128, fwd_warps=8)
    assert why_excluded("fwd", dict(fwd, fwd_stages=3), problem(16, 4, 128)) is None
    # 16 heads on one KV head: chunks of 8 heads, 16 x 8 = 128 rows
    assert why_excluded("fwd", dict(fwd, fwd_stages=3), problem(16, 1, 128, kv_heads=1)) is None
    assert "shared memory" in why_excluded("bwd", dict(bwd_rows=64, bwd_block_n=32, bwd_warps=8, bwd_stages=3),
                                           problem(16, 4, 256))
    assert why_excluded("fwd", dict(fwd, fwd_stages=3), problem(16, 1, 128, interpreter=True)) is None
    old = dict(fwd)   # a row of an earlier version: no fwd_stages
    assert msa_config_from_row("fwd", old) == old
    assert msa_config_from_row("fwd", dict(fwd, fwd_stages=3))["fwd_stages"] == 3
    with pytest.raises(ValueError, match="expected the fields"):
        msa_config_from_row("fwd", dict(fwd, bwd_stages=3))
