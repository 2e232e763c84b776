"""The benchmark's own arithmetic, checked on the CPU: the peer's mask, the pair count, and the
note that names the kernel family that ran."""
import inspect

import pytest
import torch

import msa_codegen as msa
from msa_codegen.bench import _mask_mod, attended_pairs


@pytest.mark.parametrize("pattern", ["causal", "causal=false", "window=7", "window=7,dilation=2",
                                     "window=5,dilation=3,sink=4", "window=4,sink=6", "causal=false,window=5",
                                     "causal=false,window=4,dilation=3,sink=2", "window=1,sink=60"])
@pytest.mark.parametrize("n", [1, 37, 64])
def test_peer_mask_and_pair_count_match_the_contract(pattern, n):
    spec = msa.parse(pattern).groups[0].spec
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ref = msa.mask(pattern, n)[0]
    assert torch.equal(_mask_mod(spec)(0, 0, i, j).expand(n, n), ref)
    assert attended_pairs(spec, n) == int(ref.sum())


@pytest.mark.parametrize("n,block,k", [(1000, 128, 4), (700, 64, 3), (129, 128, 2)])
def test_topk_pairs_count_the_contracts_mask(n, block, k):
    """``bench.topk_pairs`` over random block_indices with -1 slots, repeats and later blocks,
    GQA 2: the contract's mask's pairs, one query head a KV head."""
    from msa_codegen.bench import topk_pairs
    g = torch.Generator().manual_seed(n)
    nb = -(-n // block)
    idx = torch.randint(-1, nb, (2, 3, nb, k), generator=g, dtype=torch.int32)
    idx[..., -1] = idx[..., 0]
    pattern = f"topk={k},block={block}"
    mask = msa.mask(pattern, n, 6, "cpu", num_kv_heads=3, batch=2, block_indices=idx)
    assert topk_pairs(idx, n, block) == int(mask[:, ::2].sum()) > 0


def test_kernel_families_names_what_ran(monkeypatch):
    """The note of our rows says which family ran each direction: spied on the Gluon launchers,
    restored afterwards."""
    from msa_codegen.bench import kernel_families
    from msa_codegen.kernels import gluon

    monkeypatch.setenv(gluon.ENV, "0")
    q, k, v = (torch.randn(1, 2, 40, 16, requires_grad=True) for _ in range(3))
    real_f, real_b = gluon.forward, gluon.backward
    line = kernel_families(lambda: msa.attention(q, k, v, "window=8").sum().backward())
    assert line == f"kernels: triton fwd, triton bwd ({gluon.ENV}=0)"
    assert (gluon.forward, gluon.backward) == (real_f, real_b)
    monkeypatch.setattr(gluon, "forward", lambda *a, **kw: "o")
    assert kernel_families(lambda: gluon.forward()).startswith("kernels: gluon fwd, triton bwd")
    monkeypatch.delenv(gluon.ENV)
    assert kernel_families(lambda: None).endswith(f"({gluon.ENV} unset: automatic)")


def _benchmark_module(name):
    import importlib.util
    import pathlib
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gluon_bench_shapes_parse():
    """benchmarks/gluon_bench.py --shape: the pattern keeps its commas, the dims their order;
    anything else is refused with the expected form."""
    parse_shape = _benchmark_module("gluon_bench").parse_shape
    case = parse_shape("causal=false,window=512@8x12x4096x64")
    assert (case.pattern, case.b, case.hq, case.hkv, case.n, case.d) == ("causal=false,window=512", 8, 12, 12, 4096, 64)
    for bad in ("window=4096", "window=4096@1x16x8192", "@1x1x1x1", "window=8@1x0x64x64", "window=8@axbxcxd"):
        with pytest.raises(SystemExit, match="PATTERN@BxHxNxD"):
            parse_shape(bad)


@pytest.mark.parametrize("pattern,n,doc_len", [("topk=4", 1000, None), ("topk=2,block=64", 700, None),
                                               ("window=300", 1000, 256), ("causal=false,window=100", 900, 200),
                                               ("causal", 515, 128)])
def test_gluon_ab_cases_count_the_contracts_pairs(pattern, n, doc_len):
    """benchmarks/gluon_ab.py's top-k and packed-documents cases: the pairs its TFLOP/s divide by
    are the contract's mask's, for the block_indices / cu_seqlens it draws (CPU: the launch is
    only built, not called)."""
    ab = _benchmark_module("gluon_ab")
    q = k = v = torch.zeros(1, 2, n, 64)
    _, pairs, label, inputs = ab._forward_of(pattern, q, k, v, doc_len, torch.Generator().manual_seed(n))
    assert set(inputs) == ({"block_indices"} if "topk" in pattern else {"cu_seqlens"})
    mask = msa.mask(pattern, n, 2, "cpu", num_kv_heads=2, batch=1, **inputs)
    assert pairs == int(mask[0, 0].sum()) == int(mask[0, 1].sum()) > 0, label


def test_cross_triton_emit_writes_each_kernel_once(tmp_path):
    """benchmarks/cross_triton.py emit (no GPU): a case's forward, dK/dV and dQ compiled for sm_90
    as a launch specialises them, a cubin and a JSON line each, keyed so that the GPU side finds
    them; a case that shares its kernels adds none; run refuses without a GPU."""
    import json

    from helpers import run_sm90_script

    script = "../benchmarks/cross_triton.py"   # run_sm90_script's paths are the tests folder's
    p = run_sm90_script(script, "emit", "--out", str(tmp_path), "--cases", "d64-w4096,d64-w4096")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "kernels.jsonl").read_text().splitlines()]
    assert sorted(r["name"] for r in rows) == ["msa_bwd_dkdv", "msa_bwd_dq", "msa_fwd"]
    for r in rows:
        assert (tmp_path / f"{r['key']}.cubin").stat().st_size > 0
        assert r["consts"]["HEAD_DIM"] == 64 and r["params"] and r["shared"] > 0, r
    p = run_sm90_script(script, "run", "--from", str(tmp_path))
    assert p.returncode != 0 and "needs a CUDA GPU" in p.stderr


def test_cross_triton_emits_the_gluon_forward_as_its_launch_specialises_it(tmp_path):
    """benchmarks/cross_triton.py emit --family gluon (no GPU): the case's Gluon forward launch as
    gluon.forward builds it for 132 SMs (the causal window's listed order, one program an SM),
    compiled for sm_90 through Triton's own binder: the GPU side finds it by the kernel hash,
    and its parameters are the launch's less the constexprs and the ints Triton specialises to 1
    (GROUP, 16 query heads on 16 KV heads)."""
    import json

    from helpers import run_sm90_script

    from msa_codegen.kernels import gluon
    from msa_codegen.pattern.lowering import lower
    from msa_codegen.pattern.spec import parse

    p = run_sm90_script("../benchmarks/cross_triton.py", "emit", "--family", "gluon", "--out", str(tmp_path),
                        "--cases", "w4096")
    assert p.returncode == 0, p.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "kernels.jsonl").read_text().splitlines()]
    kplan = lower(parse("window=4096").groups[0].spec)
    assert row["key"] == gluon.kernel_hash((kplan,), "fwd") + "-w4096"
    assert row["family"] == "gluon" and row["name"] == "msa_gluon_fwd" and row["grid"] == [132]
    assert row["consts"] == {"STAGES": gluon.RING[128], "FOLD": True, "ORDER": gluon.LISTED}
    assert row["num_warps"] == 12 and 0 < row["shared"] <= 232448
    assert (tmp_path / f"{row['key']}.cubin").stat().st_size > 0
    # four TMA descriptors (a 128-byte aligned map and its shape / strides each) lead the parameters
    assert row["params"][:20] == [".align", ".u32", ".u32", ".u64", ".u64"] * 4, row["params"]
    # then O and LSE, 13 row / head strides, the tile list, H0, HS, HQ, N and the tile count (GROUP
    # = 1 is a constexpr), qk_scale, and the two scratch pointers Triton appends
    assert row["params"][20:] == [".u64"] * 2 + [".u32"] * 13 + [".u64"] + [".u32"] * 5 + [".f32", ".u64", ".u64"]


def test_cross_triton_matches_a_recorded_launch_to_its_kernel():
    """The GPU side's pairing of a recorded launch with an emitted kernel: by name, warps, stages
    and the kernel's own constexprs (``resources.launches`` names some that only other kernels
    take); another configuration's launch pairs with nothing."""
    ct = _benchmark_module("cross_triton")
    case = next(c for c in ct._cases("d64-w4096"))
    wanted = ct._wanted(case)
    assert sorted(entry[1].__name__ for entry in wanted.values()) == ["msa_bwd_dkdv", "msa_bwd_dq", "msa_fwd"]
    for (name, consts, warps, stages), entry in wanted.items():
        kern = entry[1]
        params = inspect.signature(kern.fn).parameters
        assert {n for n, _ in consts} <= set(params), "a constexpr the kernel does not take"
        # what the launcher passes: the kernel's constexprs and the launch options
        kw = dict(consts, num_warps=warps, num_stages=stages, enable_fp_fusion=True)
        assert ct._match(kern, kw, wanted) is entry
        assert ct._match(kern, dict(kw, num_stages=stages + 1), wanted) is None
        assert ct._match(kern, dict(kw, BLOCK_M=kw["BLOCK_M"] * 2), wanted) is None


def test_msa_ab_runs_each_variants_config(capsys, monkeypatch):
    """benchmarks/msa_ab.py on the CPU (interpreter): every variant's fields reach the launchers
    (the forward's tile rows and warps, the backward's key programs), its outputs and gradients
    match the default's, and the table has a row per phase and variant; bad variants are refused."""
    from msa_codegen.msa import launch

    ab = _benchmark_module("msa_ab")
    seen = []
    real_fwd, real_bwd = launch.fwd_meta, launch.bwd_meta
    monkeypatch.setattr(launch, "fwd_meta", lambda *a: seen.append(("fwd", m := real_fwd(*a))) or m)
    monkeypatch.setattr(launch, "bwd_meta", lambda *a, **kw: seen.append(("bwd", m := real_bwd(*a, **kw))) or m)
    rc = ab.main(["--device", "cpu", "--dtype", "float32", "--n", "200", "--heads", "4,2,2,1", "--head-dim", "32",
                  "--top-k", "128", "--block", "64", "--rounds", "1", "--phases", "fwd,bwd,two",
                  "--variant", "small=fwd_rows=32,fwd_warps=2,fwd_stages=1,bwd_block_n=16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    fwd = {(m["BLOCK_Q"], m["num_warps"], m["num_stages"]) for kind, m in seen if kind == "fwd"}
    bwd = {m["BLOCK_N"] for kind, m in seen if kind == "bwd"}
    assert (16, 2, 1) in fwd and (launch.FWD_ROWS // 2, 8, 3) in fwd, fwd   # G=2: rows / 2 entries
    assert {16, 64} <= bwd, bwd
    errs = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "max relative error" in line]
    assert len(errs) == 3 and max(errs) < 1e-5, out
    rows = [line for line in out.splitlines() if line.split(" |")[0] in ("| fwd", "| bwd", "| two")]
    assert len(rows) == 9 and all(name in out for name in ("| default |", "| small |", "| default-copy |")), out
    for bad in ("small", "x=fwd_rows", "x=rows=64", "x=fwd_rows=sixty", "default-copy=fwd_rows=64"):
        with pytest.raises(SystemExit):
            ab.main(["--device", "cpu", "--variant", bad])


def test_sink_ab_runs_each_variants_launch(capsys, monkeypatch):
    """benchmarks/sink_ab.py on the CPU (interpreter): each variant's rows and stages reach the sink
    pass's launch, a baseline copy of kernels/sink.py runs beside the tree's, every variant's dQ,
    dK, dV match the default's, the table has a row per form and variant, the tree's settings
    are restored after; bad variants are refused."""
    from msa_codegen.kernels import gluon, sink

    ab = _benchmark_module("sink_ab")
    seen = []
    real = gluon.direct.launch

    def spy(kern, grid, *a, **kw):
        seen.append((kern.fn.__module__ if hasattr(kern, "fn") else "", kw.get("BLOCK_M"), kw.get("STAGES")))
        return real(kern, grid, *a, **kw)
    monkeypatch.setattr(gluon.direct, "launch", spy)
    rows, stages = dict(gluon.SINK_BWD_ROWS), gluon.SINK_BWD_STAGES
    rc = ab.main(["--device", "cpu", "--n", "200", "--heads", "2", "--head-dim", "64", "--pattern",
                  "window=90,sink=20", "--variant", "32x2", "--baseline", sink.__file__, "--rounds", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert (32, 2) in {(m, st) for _, m, st in seen} and (rows[64], stages) in {(m, st) for _, m, st in seen}, seen
    assert any(mod == "sink_baseline" for mod, _, _ in seen), seen
    table = [line for line in out.splitlines() if line.startswith("| fused |") or line.startswith("| two-kernel |")]
    assert len(table) == 8, out
    assert all(float(line.split("|")[6]) < 1e-5 for line in table), out
    assert gluon.SINK_BWD_ROWS == rows and gluon.SINK_BWD_STAGES == stages
    import sys
    assert sys.modules["msa_codegen.kernels.sink"] is sink
    for bad in ("64", "64x0", "48x2", "axb"):
        with pytest.raises(SystemExit):
            ab.main(["--device", "cpu", "--variant", bad])


def test_power_probe_cases_and_samples():
    """benchmarks/power_probe.py's pure parts: case names resolve to msa-bench's cases in the
    order given (unknown or none refused), the samples inside a timing are those between its
    start and end, and the spread of none is a dash. On a machine without CUDA, main stops
    with the reason."""
    probe = _benchmark_module("power_probe")
    assert [c.name for c in probe.parse_cases("dense-causal,w4096")] == ["dense-causal", "w4096"]
    for bad in ("w4096,nope", ""):
        with pytest.raises(ValueError, match="msa-bench case names"):
            probe.parse_cases(bad)
    samples = [(0.5, 1980, 300.0), (1.0, 1500, 700.0), (1.5, 1410, 699.0), (2.5, 1980, 90.0)]
    clocks, power = probe.summarise(samples, 0.9, 2.0)
    assert clocks == [1500, 1410] and power == [700.0, 699.0]
    assert probe.spread(clocks) == "1410 / 1455 / 1500"
    assert probe.spread([]) == "-"
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            probe.main(["--cases", "w4096", "--rounds", "1"])


@pytest.mark.parametrize("base", [True, False], ids=["default-on", "default-off"])
def test_sink_ab_flips_the_long_sinks_chunk_launches(capsys, monkeypatch, base):
    """benchmarks/sink_ab.py --flip-chunk-launches on the CPU (interpreter): the fused form's sink
    of several key chunks with ``gluon.SINK_CHUNK_LAUNCHES`` flipped beside the tree's setting (a
    launch a chunk: KEY0 past 0 reaches a launch; two launches), the same dQ, dK, dV; the setting
    restored after."""
    from msa_codegen.kernels import gluon

    ab = _benchmark_module("sink_ab")
    seen = []
    real = gluon.direct.launch

    def spy(kern, grid, *a, **kw):
        seen.append(kw.get("KEY0"))
        return real(kern, grid, *a, **kw)
    monkeypatch.setattr(gluon.direct, "launch", spy)
    monkeypatch.setattr(gluon, "SINK_CHUNK_LAUNCHES", base)
    rc = ab.main(["--device", "cpu", "--n", "200", "--heads", "2", "--head-dim", "64", "--pattern",
                  "window=40,sink=100", "--forms", "fused", "--flip-chunk-launches", "--rounds", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert gluon.SINK_KEYS in seen, seen
    table = [line for line in out.splitlines() if line.startswith("| fused |")]
    flipped = f"chunk-launches {'off' if base else 'on'}"
    assert [line.split("|")[2].strip() for line in table] == ["default", "default-copy", flipped], out
    assert all(float(line.split("|")[6]) < 1e-5 for line in table), out
    assert gluon.SINK_CHUNK_LAUNCHES is base


def test_msa_ab_reverse_index_int32_matches_int64(capsys):
    """launch.reverse_index with 32-bit sort keys (the default) gives the 64-bit keys' reverse
    index exactly (unused slots, two batches, several proxy heads), and benchmarks/msa_ab.py
    --reverse-index, which times the two, reports it."""
    from msa_codegen.msa import launch

    ab = _benchmark_module("msa_ab")
    g = torch.Generator().manual_seed(3)
    n, nk, nb = 517, 4, 9
    idx = torch.randint(0, nb, (2, 3, n, nk), generator=g).sort(-1).values.to(torch.int32)
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    got, want = launch.reverse_index(idx, nb), launch.reverse_index(idx, nb, key_dtype=torch.int64)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    rc = ab.main(["--device", "cpu", "--dtype", "float32", "--n", "200", "--heads", "4,2,2,1", "--head-dim", "32",
                  "--top-k", "128", "--block", "64", "--rounds", "1", "--reverse-index"])
    out = capsys.readouterr().out
    assert rc == 0 and "int32 and int64 keys give identical outputs" in out and out.count("| int") == 3, out


def test_interleaved_rotates_the_order():
    from msa_codegen.bench import interleaved, rounds_note

    seen = []
    ms = {"a-fwd": iter([5.0, 1.0, 3.0]), "a-fb": iter([9.0, 7.0, 8.0]), "b-fwd": iter([2.0, 4.0, 6.0]),
          "b-fb": iter([1.0, 1.5, 0.5])}

    def timer(fn):
        seen.append(fn)
        return next(ms[fn])
    times, failed = interleaved({"a": ("a-fwd", "a-fb"), "b": ("b-fwd", "b-fb")}, 3, timer)
    assert seen == ["a-fwd", "a-fb", "b-fwd", "b-fb", "b-fwd", "b-fb", "a-fwd", "a-fb", "a-fwd", "a-fb", "b-fwd", "b-fb"]
    assert times == {"a": [[5.0, 1.0, 3.0], [9.0, 7.0, 8.0]], "b": [[2.0, 4.0, 6.0], [1.0, 1.5, 0.5]]}
    assert failed == {}
    assert rounds_note(times["b"]) == "; 3 rounds, the order rotated: fwd 2.000-6.000 ms, fwd+bwd 0.500-1.500 ms"


def test_interleaved_reports_a_failure_and_times_the_rest():
    from msa_codegen.bench import interleaved

    calls = []

    def timer(fn):
        calls.append(fn)
        if fn == "peer" and len(calls) > 2:
            raise RuntimeError("out of memory")
        return 1.0
    times, failed = interleaved({"ours": ("ours",), "peer": ("peer",)}, 3, timer)
    assert times == {"ours": [[1.0, 1.0, 1.0]]}
    assert failed == {"peer": "failed: RuntimeError: out of memory"}
    assert calls == ["ours", "peer", "peer", "ours", "ours"]
    assert interleaved({}, 3, timer) == ({}, {})


def test_msa_bench_offers_rounds(monkeypatch, capsys):
    from msa_codegen import bench

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
    assert "--rounds wants 1 or more" in capsys.readouterr().err


def _stand_ins(monkeypatch, module, timer):
    """A benchmark module's GPU-only pieces stood in on the CPU: ``timer(fn, reps_ms)`` for its
    timer, a peak-memory call that runs the forward+backward, a fixed kernel-family note."""
    monkeypatch.setattr(module, "_time", timer)
    monkeypatch.setattr(module, "_peak", lambda fb: (fb(), 0.5)[1])
    monkeypatch.setattr(module, "kernel_families", lambda fb: "kernels: test")
    monkeypatch.setattr(module.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(module.torch.cuda, "empty_cache", lambda: None)


@pytest.mark.parametrize("rounds", [1, 3])
def test_bench_dynamic_times_ours_and_each_peer(monkeypatch, rounds):
    """bench_dynamic.run_case end to end on the CPU with a stand-in timer: each implementation's
    check, the timing sequence (one round: each side's forward, then its forward+backward;
    ``rounds``: warm first, then the rotated rounds), the medians, the ratios and the notes."""
    from msa_codegen import bench_dynamic as bd

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 24, 8, generator=g, requires_grad=True)
    w = torch.randn(8, 8, generator=g)
    calls, log = {}, []

    def impl(name, scale=1.0, rows=24):
        def fn():
            calls[name] = calls.get(name, 0) + 1
            return (q[:, :, :rows] @ w) * scale
        fn.__name__ = name
        return fn
    ours = impl("ours")
    peers = {"peer-same": (impl("peer-same", 1.0 + 1e-4), True), "peer-dense": (impl("peer-dense", 3.0, 20), False)}
    monkeypatch.setattr(bd, "build", lambda case, device, dtype: (ours, peers, (q,), "a test case"))
    base = {"ours": 10.0, "cold": 10.5, "peer-same": 20.0, "peer-dense": 40.0}

    def timer(fn, reps_ms):
        # a forward+backward is fb(fn=...): its default names the forward it wraps
        fwd = fn.__defaults__[0] if fn.__name__ == "fb" else fn
        name = "cold" if fn.__name__ == "cold" else fwd.__name__
        kind = "fb" if fn.__name__ == "fb" else "fwd"
        log.append((name, kind))
        return base[name] * (3 if kind == "fb" else 1) + 0.1 * sum(1 for x in log if x == (name, kind))
    _stand_ins(monkeypatch, bd, timer)
    case = bd.DynCase("t", "docs", "window=8", 24, hq=2, hkv=2, d=8)
    rows = {r["impl"]: r for r in bd.run_case(case, 1, torch.float32, rounds=rounds)}
    assert {r["status"] for r in rows.values()} == {"ok"}, rows
    assert q.grad is None   # every forward+backward clears the grads it made
    if rounds == 1:
        assert log == [("ours", "fwd"), ("cold", "fwd"), ("ours", "fb"), ("peer-same", "fwd"), ("peer-same", "fb"),
                       ("peer-dense", "fwd"), ("peer-dense", "fb")]
    else:
        names = ["ours", "peer-same", "peer-dense"]
        order = [n for r in range(3) for n in names[r:] + names[:r]]
        assert log == [("cold", "fwd")] + [(n, kind) for n in order for kind in ("fwd", "fb")]
    med = 0.1 * (rounds + 1) / 2 if rounds > 1 else 0.1
    assert rows["msa_codegen"]["fwd_ms"] == pytest.approx(10.0 + med)
    assert rows["peer-dense"]["fwdbwd_ms"] == pytest.approx(120.0 + med)
    assert rows["peer-same"]["ratio_fwd"] == pytest.approx((10.0 + med) / (20.0 + med))
    assert rows["peer-same"]["max_rel_err"] == pytest.approx(1e-4, rel=1e-2)
    assert rows["peer-dense"]["note"].startswith("dense mask: speed only")
    note = rows["msa_codegen"]["note"]
    assert note.startswith(f"a test case; input checks {0.5 + 0.1 - med:.3f} ms, paid once per tensor version; "
                           "kernels: test"), note
    assert ("3 rounds, the order rotated: fwd 10.100-10.300 ms" in note) == (rounds == 3), note


def test_bench_dynamic_reports_a_peer_that_disagrees(monkeypatch):
    from msa_codegen import bench_dynamic as bd

    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    monkeypatch.setattr(bd, "build", lambda case, device, dtype: (lambda: q * 2, {"bad": (lambda: q * 3, True)},
                                                                  (q,), "n"))
    _stand_ins(monkeypatch, bd, lambda fn, reps_ms: 1.0)
    for rounds in (1, 2):
        rows = bd.run_case(bd.DynCase("t", "docs", "causal", 16, hq=2, hkv=2, d=8), 1, torch.float32, rounds=rounds)
        status = {r["impl"]: r["status"] for r in rows}
        assert status["msa_codegen"] == "ok" and status["bad"].startswith("failed: RuntimeError: output differs"), status
        assert "ratio_fwd" not in next(r for r in rows if r["impl"] == "bad")


@pytest.mark.parametrize("rounds", [1, 2])
def test_msa_bench_run_case_on_the_cpu(monkeypatch, rounds):
    """msa-bench's run_case end to end with the interpreter's kernels and SDPA on the CPU, the
    timer stood in: the check against the peer, both timing sequences, medians and ratios."""
    from msa_codegen import bench

    log = []

    def timer(fn, reps_ms):
        log.append(fn)
        return 2.0 + len(log)
    _stand_ins(monkeypatch, bench, timer)
    case = bench.Case("t", "causal", hq=2, hkv=1, n=40, d=16, peer="sdpa")
    rows = {r["impl"]: r for r in bench.run_case(case, 1, torch.float32, rounds=rounds, dev="cpu")}
    assert {r["status"] for r in rows.values()} == {"ok"}, rows
    assert rows["sdpa-flash"]["max_rel_err"] < 1e-4
    assert len(log) == 4 * rounds
    ours, peer = rows["msa_codegen"], rows["sdpa-flash"]
    if rounds == 1:   # ours: forward, forward+backward; then the peer's
        assert (ours["fwd_ms"], ours["fwdbwd_ms"], peer["fwd_ms"], peer["fwdbwd_ms"]) == (3.0, 4.0, 5.0, 6.0)
    else:             # round 0 ours first (3, 4; 5, 6), round 1 the peer first (7, 8; 9, 10)
        assert (ours["fwd_ms"], ours["fwdbwd_ms"], peer["fwd_ms"], peer["fwdbwd_ms"]) == (6.0, 7.0, 6.0, 7.0)
        assert "2 rounds, the order rotated: fwd 3.000-9.000 ms" in ours["note"]
    assert peer["ratio_fwd"] == pytest.approx(ours["fwd_ms"] / peer["fwd_ms"])
    assert ours["note"].startswith("peak/io ") and "kernels: test" in ours["note"]
