"""The Gluon family's tuned knobs: rows keyed by the hash of its kernels (``kernels.gluon.
kernel_hash``), read by ``lookup.gluon_lookup`` only, applied by the launchers; the tuner's space
(``tuning.gluon_search``); ``msa-tune --family gluon``. On the CPU the launch is captured, not run;
the tuner itself runs on the H200 (the ``gpu`` test)."""
from __future__ import annotations

import pytest
import torch

from msa_codegen.cli import tune as tune_cli
from msa_codegen.kernels import direct, gluon
from msa_codegen.kernels.render import kernel_hash
from msa_codegen.pattern.lowering import CU_SEQLENS, lower
from msa_codegen.pattern.spec import parse
from msa_codegen.plan import plan_for
from msa_codegen.tuning import gluon_search, keys
from msa_codegen.tuning.database import TuningDB
from msa_codegen.tuning.lookup import gluon_lookup_for_gpu, lookup_for_gpu, reload
from msa_codegen.tuning.measure import Problem

from tuning_helpers import put, row, tmp_home  # noqa: F401  (tmp_home: the autouse fixture)

NAMES, WHY_NO_API = gluon.api()
needs_api = pytest.mark.skipif(NAMES is None, reason=f"no Gluon for Hopper here: {WHY_NO_API}")

WINDOW = "window=4096"


def _hashes(pattern: str) -> tuple:
    return keys.gluon_hash(pattern, "fwd"), keys.gluon_hash(pattern, "bwd")


def gluon_row(pattern=WINDOW, direction="fwd", config=None, **kw):
    config = config or ({"order": gluon.PAIRS, "stages": 2} if direction == "fwd" else {"stages": 2})
    return row(pattern=pattern, direction=direction, kernel_hash=keys.gluon_hash(pattern, direction),
               config=config, **kw)


@needs_api
def test_the_gluon_hash_keys_each_direction_apart_from_the_triton_kernels():
    fwd, bwd = _hashes(WINDOW)
    assert fwd.startswith("gluon-") and bwd.startswith("gluon-") and fwd != bwd
    assert kernel_hash(WINDOW) not in (fwd, bwd)
    assert keys.gluon_hash("window=4096", "fwd") == keys.gluon_hash("causal,window=4096", "fwd")   # canonical
    assert keys.gluon_hash("window=2048", "fwd") != fwd                                           # another plan
    # a direction the family cannot run has no hash: a sink over 256 keys runs the Triton backward
    assert keys.gluon_hash("window=4096,sink=300", "fwd") and keys.gluon_hash("window=4096,sink=300", "bwd") is None
    # a dilated window runs the plain window's kernels on its residue classes, with a sink too
    # (the sink's pairs outside the window are a Triton pass's); a sink's backward runs the
    # window's kernels: the same code (their rows stay apart by their pattern)
    assert keys.gluon_hash("window=4096,dilation=2", "fwd") == keys.gluon_hash("window=4096", "fwd")
    assert keys.gluon_hash("window=4096,dilation=2,sink=64", "fwd") == fwd
    assert keys.gluon_hash("window=4096,dilation=2,sink=64", "bwd") == keys.gluon_hash("window=4096,sink=64", "bwd") == bwd
    assert keys.is_current(WINDOW, keys.triton_version(), fwd) and keys.is_current(WINDOW, keys.triton_version(), bwd)
    assert not keys.is_current(WINDOW, keys.triton_version(), "gluon-0000000000000000")


@needs_api
def test_gluon_rows_are_read_by_the_gluon_lookup_only(tmp_home):
    put(tmp_home / "tuning.db", gluon_row(), gluon_row(direction="bwd", bucket_=32768),
        row(pattern=WINDOW, kernel_hash=kernel_hash(WINDOW)))
    res = gluon_lookup_for_gpu("h200", "9.0", WINDOW, 128, "bfloat16", 1, 131072, _hashes(WINDOW))
    assert res.fwd.config == {"order": gluon.PAIRS, "stages": 2} and "user db" in res.fwd.source
    assert res.bwd.config == {"stages": 2} and "nearest bucket 32768" in res.bwd.source
    assert "gluon fwd: order=2 stages=2" in str(res)
    # the Triton family's lookup reads its own row and never a Gluon one
    tri = lookup_for_gpu("h200", "9.0", WINDOW, 128, "bfloat16", 1, 131072, cuda=True)
    assert tri.fwd.config.block_m == 64 and tri.bwd.source.startswith("heuristic")
    # another GPU kind of the same capability: the row serves; another capability: the heuristic
    assert gluon_lookup_for_gpu("h100", "9.0", WINDOW, 128, "bfloat16", 1, 131072, _hashes(WINDOW)).fwd.row
    other = gluon_lookup_for_gpu("b200", "10.0", WINDOW, 128, "bfloat16", 1, 131072, _hashes(WINDOW))
    assert other.fwd.config == {} and other.fwd.source == "heuristic default"
    # rows of other kernels (a changed template: another hash) never run
    stale = gluon_lookup_for_gpu("h200", "9.0", WINDOW, 128, "bfloat16", 1, 131072, ("gluon-0", "gluon-1"))
    assert stale.fwd.config == {} and stale.bwd.config == {}


@needs_api
@pytest.mark.parametrize("config,direction,msg", [
    ({"order": 7, "stages": 2}, "fwd", "order must be one of"),
    ({"order": 0, "stages": 3}, "fwd", "stages must be one of (2,) at head dim 128"),
    ({"order": 0}, "fwd", "expected the fields"),
    ({"stages": 2, "order": 0}, "bwd", "expected the fields ['stages']"),
    ({"stages": True}, "bwd", "must be an integer"),
], ids=["order", "stages-d128", "missing", "unknown", "bool"])
def test_a_gluon_row_with_bad_knobs_is_refused(tmp_home, config, direction, msg):
    with TuningDB(tmp_home / "t.db") as db, pytest.raises(ValueError, match="not a valid") as err:
        db.put(gluon_row(direction=direction, config=config))
    assert msg in str(err.value)


def test_use_gluon_config_checks_and_restores():
    with pytest.raises(ValueError, match="unknown Gluon fwd knobs"):
        with gluon.use_gluon_config(fwd={"block_n": 64}):
            pass
    with gluon.use_gluon_config(fwd={"order": gluon.LISTED}):
        assert gluon._override == {"fwd": {"order": gluon.LISTED}}
        with gluon.use_gluon_config(bwd={"stages": 3}):
            assert gluon._override == {"fwd": {"order": gluon.LISTED}, "bwd": {"stages": 3}}
        assert gluon._override == {"fwd": {"order": gluon.LISTED}}
    assert gluon._override == {}


def test_an_order_a_shape_cannot_run_falls_back_and_says_why():
    dense, window = (lower(parse(p).groups[0].spec) for p in ("causal", WINDOW))
    docs = lower(parse(WINDOW).groups[0].spec, **CU_SEQLENS)
    assert gluon.order_for({}, dense, 128, 16, 132) == (gluon.PAIRS, None)
    assert gluon.order_for({"order": gluon.LISTED}, dense, 128, 16, 132) == (gluon.LISTED, None)
    assert gluon.order_for({"order": gluon.HEAD_MAJOR}, window, 1024, 16, 132) == (gluon.HEAD_MAJOR, None)
    order, why = gluon.order_for({"order": gluon.PAIRS}, dense, 129, 16, 132)
    assert order == gluon.tile_order(dense, 129, 16, 132) and "even number of query tiles" in why
    order, why = gluon.order_for({"order": gluon.LISTED}, docs, 64, 1, 64)
    assert order == gluon.HEAD_MAJOR and "documents or top-k" in why
    order, why = gluon.order_for({"order": gluon.LISTED}, window, 1024, 128, 132)
    assert order == gluon.tile_order(window, 1024, 128, 132) and "LIST_MAX_TILES" in why
    topk = lower(parse("topk=16").groups[0].spec)
    assert gluon.order_for({"order": gluon.GROUPED}, topk, 1024, 32, 132) == (gluon.GROUPED, None)
    order, why = gluon.order_for({"order": gluon.GROUPED}, topk, 1024, 6, 132, group_aligned=False)
    assert order == gluon.HEAD_MAJOR and "aligned to the GQA group" in why
    order, why = gluon.order_for({"order": gluon.GROUPED}, window, 1024, 16, 132)
    assert order == gluon.tile_order(window, 1024, 16, 132) and "top-k plans' order" in why
    # no row: top-k with GQA takes grouped where the head group is aligned, else head-major (as MHA)
    assert gluon.order_for({}, topk, 1024, 32, 132, group=4) == (gluon.GROUPED, None)
    assert gluon.order_for({}, topk, 1024, 6, 132, group_aligned=False, group=4) == (gluon.HEAD_MAJOR, None)
    assert gluon.order_for({}, topk, 1024, 32, 132) == (gluon.HEAD_MAJOR, None)
    # a row's order the shape cannot run falls back to that same default
    order, why = gluon.order_for({"order": gluon.LISTED}, topk, 1024, 32, 132, group=4)
    assert order == gluon.GROUPED and "documents or top-k" in why


def _problem(pattern, n, d=128, batch=1):
    return Problem(pattern, batch, 16, 16, n, d, torch.bfloat16, "cuda", n)


def test_the_tuner_space_and_what_it_leaves_out():
    assert gluon_search.space("fwd", 128) == [{"order": o, "stages": 2} for o in gluon.ORDERS]
    assert gluon_search.space("bwd", 128) == [{"stages": 2}]
    assert len(gluon_search.space("fwd", 64)) == 5 * 4 and len(gluon_search.space("bwd", 64)) == 4
    # grouped is the top-k plans' order, which the tuner does not take (block_indices are data)
    assert "top-k" in gluon_search.why_excluded("fwd", {"order": gluon.GROUPED, "stages": 2}, _problem(WINDOW, 131072))
    # pairs at an odd number of query tiles a head
    odd = _problem("causal", 16384 + 128)
    assert "even number" in gluon_search.why_excluded("fwd", {"order": gluon.PAIRS, "stages": 2}, odd)
    assert gluon_search.why_excluded("fwd", {"order": gluon.LISTED, "stages": 2}, odd) is None
    assert gluon_search.why_excluded("bwd", {"stages": 2}, odd) is None
    # the heuristic's knobs, every field set
    assert gluon_search.heuristic("fwd", _problem("causal", 16384)) == {"order": gluon.PAIRS, "stages": 2}
    assert gluon_search.heuristic("fwd", _problem(WINDOW, 131072)) == {"order": gluon.LISTED, "stages": 2}
    assert gluon_search.heuristic("fwd", _problem("causal=false,window=512", 65536)) == {"order": gluon.HEAD_MAJOR,
                                                                                         "stages": 2}
    assert gluon_search.heuristic("bwd", _problem(WINDOW, 16384, d=64)) == {"stages": gluon.BWD_RING[64]}
    # every candidate of the space passes the row check (what the tuner stores can be stored)
    for direction in ("fwd", "bwd"):
        for d in gluon.HEAD_DIMS:
            for params in gluon_search.space(direction, d):
                assert keys.gluon_config_from_row(direction, params, d) == params


@needs_api
def test_the_forward_launches_with_the_tuned_knobs(tmp_home, monkeypatch):
    """The full path on the CPU: a row of this machine's GPU name (the interpreter's) -> the plan's
    Gluon lookup -> gluon.forward's launch (captured): its ORDER and STAGES; an override wins; a
    row's order the call's shape cannot run falls back to tile_order's."""
    launched = []
    monkeypatch.setattr(direct, "launch", lambda kern, grid, *args, **kw: launched.append(kw))
    monkeypatch.setattr(gluon, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    pattern, n = "causal", 16384
    put(tmp_home / "tuning.db", gluon_row(pattern=pattern, gpu="cpu-interpreter", capability="cpu", bucket_=n,
                                          config={"order": gluon.LISTED, "stages": 2}))

    def run(length):
        q = torch.randn(1, 16, length, 128, dtype=torch.bfloat16)
        plan = plan_for(pattern, q.device, q.dtype, 128, 16, 16, length)
        gluon.forward(q, q, q, plan, 0.1)
        return launched[-1]

    kw = run(n)
    assert (kw["ORDER"], kw["STAGES"]) == (gluon.LISTED, 2)
    with gluon.use_gluon_config(fwd={"order": gluon.BY_COST}):
        assert run(n)["ORDER"] == gluon.BY_COST
    with gluon.use_gluon_config(fwd={}):
        assert run(n)["ORDER"] == gluon.PAIRS   # the heuristic's
    reload()
    assert run(n)["ORDER"] == gluon.LISTED
    # another length of the bucket: the list is built for any length
    assert run(n - 128)["ORDER"] == gluon.LISTED
    with gluon.use_gluon_config(fwd={"order": gluon.PAIRS}):
        assert run(n - 128)["ORDER"] == gluon.tile_order(lower(parse(pattern).groups[0].spec), 127, 16, 132)


def test_msa_tune_family_gluon_without_a_gpu_is_one_clear_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert tune_cli.main(["--pattern", WINDOW, "--family", "gluon", "--db", str(tmp_path / "t.db")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("msa-tune: error: --family gluon: the Gluon kernels run on a CUDA GPU")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tune_gluon_stores_a_row_the_forward_runs(tmp_home, monkeypatch):
    """On a Hopper GPU: every forward candidate of a short causal window is checked against the
    float64 reference and timed, the winner is stored under the Gluon hash, and the next call
    launches with its order."""
    if gluon.device_reason(torch.device("cuda"), torch.bfloat16, 128):
        pytest.skip(gluon.device_reason(torch.device("cuda"), torch.bfloat16, 128))
    db = tmp_home / "tuning.db"
    problem = Problem("window=1024", 1, 16, 16, 8192, 128, torch.bfloat16, "cuda", 8192)
    lines = []
    res = gluon_search.tune_gluon(problem, "fwd", db, rep_ms=20, rounds=2, log=lines.append)
    assert res is not None and res.stored and not res.failures, (res, lines)
    assert res.trials == 4 and res.default_ms > 0   # the heuristic and the three other orders
    with TuningDB(db) as t:
        (stored,) = [r for r in t.rows() if r["kernel_hash"].startswith("gluon-")]
    assert stored["config"] == res.config and stored["kernel_hash"] == keys.gluon_hash("window=1024", "fwd")
    launched = []
    real = direct.launch

    def spy(kern, grid, *args, **kw):
        launched.append(kw)
        return real(kern, grid, *args, **kw)

    monkeypatch.setattr(direct, "launch", spy)
    monkeypatch.setenv(gluon.ENV, "1")
    q = torch.randn(1, 16, 8192, 128, device="cuda", dtype=torch.bfloat16)
    import msa_codegen as msa

    msa.attention(q, q, q, "window=1024")
    gl = [kw for kw in launched if "ORDER" in kw]
    assert gl and gl[-1]["ORDER"] == res.config["order"]


@needs_api
def test_db_list_names_the_gluon_knobs(tmp_home, capsys):
    from msa_codegen.cli import main as codegen_cli

    db = tmp_home / "listed.db"
    put(db, gluon_row(), row(pattern=WINDOW, kernel_hash=kernel_hash(WINDOW)))
    assert codegen_cli.main(["db", "list", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "gluon order=2 stages=2" in out and "64,32,4,2" in out and "stale (" not in out
