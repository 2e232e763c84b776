"""context_parallel_attention over Gloo with 2, 3 and 4 processes (and NCCL on two GPUs): every
rank's output and dq/dk/dv equal single-process ``attention`` on the gathered tensors, and the
bytes each rank moved equal the halo formula (``halo.traffic_bytes``), not the whole sequence.

One group of processes per world size runs all of that size's cases (``cp_worker.py``); each test
then compares one case. Shapes are tiny: every rank runs the kernels in Triton's interpreter.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import msa_codegen as msa
from msa_codegen.distributed import halo

sys.path.insert(0, str(Path(__file__).parent))
from cp_worker import TinyAttention, case_inputs, hf_inputs, hf_model, model_inputs  # noqa: E402

WORKER = Path(__file__).parent / "cp_worker.py"
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


_HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _case(name, pattern, lens, **kw):
    case = dict(name=name, pattern=pattern, lens=lens, B=1, Hq=2, Hkv=2, D=16, seed=len(name) * 7 + sum(lens))
    case.update(kw)
    return case


#: per world size, the cases its one group of processes runs (names unique across sizes)
CASES = {
    2: [
        _case("window", "window=24", [64, 64], local=True),
        _case("window_dilation_sink", "window=12,dilation=3,sink=5", [60, 68], local=True),
        _case("bidirectional_window", "causal=false,window=10,dilation=2", [64, 64], local=True),
        _case("gqa_mqa", "window=16,sink=3", [64, 64], Hq=4, Hkv=1, D=32),
        _case("dense_causal", "causal", [50, 46]),
        _case("topk_aligned", "topk=2,block=16", [64, 64], topk=(2, 16)),
        _case("random_replicated", "window=8,random=1,block=16,seed=3", [48, 48]),
        _case("device_mesh_1d", "window=20", [48, 48], mesh=[2]),
        _case("under_torch_compile", "window=24,sink=3", [32, 32], local=True, compile=True),
        _case("head_tail_dense_causal", "causal", [32, 32], layout="head_tail"),
        _case("head_tail_window_sink", "window=10,dilation=2,sink=3", [24, 24], layout="head_tail", Hq=4, Hkv=2),
        _case("head_tail_uneven", "causal", [32, 30], layout="head_tail", error="same even number of rows"),
        _case("mismatched_heads", "window=8", [32, 32], Hq_by_rank={"1": 1}, error="query heads Hq"),
        # what one rank alone gets wrong raises on every rank (no rank waits in a collective)
        _case("mismatched_dtype", "window=8", [32, 32], dtype_by_rank={"1": "float16"}, error="same dtype"),
        _case("seq_lens_wrong_on_one_rank", "window=8", [32, 32], pass_lens=True,
              seq_lens_by_rank={"1": [40, 24]}, error="seq_lens on rank 1 does not match"),
        _case("pattern_bad_on_one_rank", "window=8", [32, 32], pattern_by_rank={"1": "window=0"},
              error={"0": "rank 1 of the group rejected", "1": "window"}),
        _case("patterns_differ", "window=8", [32, 32], pattern_by_rank={"1": "window=9"},
              error="different patterns"),
        _case("every_rank_empty", "window=8", [0, 0], error="every rank holds zero tokens"),
        _case("halo_exceeds_sequence", "window=200,dilation=3,sink=7", [20, 28]),
        # the exchange alone at the lengths (too long for the interpreter's kernels)
        _case("traffic_1m_window4096_dilation2", "window=4096,dilation=2", [1 << 19, 1 << 19], Hq=1, Hkv=1, D=4,
              fetch_only=True, local=True),
        _case("traffic_1m_window4096_dilation2_sink64", "window=4096,dilation=2,sink=64", [1 << 19, 1 << 19], Hq=1,
              Hkv=1, D=4, fetch_only=True, local=True),
    ],
    3: [
        _case("uneven_explicit_lens", "window=20,dilation=2", [30, 70, 28], local=True, pass_lens=True),
        _case("head_groups", "0-1:window=6;2-3:causal=false,window=8,dilation=4,sink=2", [40, 40, 40], Hq=4),
        _case("halo_longer_than_slice", "window=30,dilation=3,sink=4", [40, 32, 40]),
        _case("sink_spans_ranks", "causal=false,window=4,sink=50", [32, 32, 32]),
        _case("global_term", "causal=false,window=4,global=10", [32, 32, 32]),
        _case("topk_unaligned_replicated", "window=4,topk=2,block=16", [40, 40, 40], topk=(2, 16)),
        _case("bidirectional_halo_exceeds_sequence", "causal=false,window=100,dilation=2", [16, 24, 12]),
        _case("head_tail_3_ranks", "0-1:causal;2-3:window=8,sink=2", [20, 20, 20], layout="head_tail", Hq=4),
    ] + ([
        # a Hugging Face model's attention layers (dense causal, then window=16) over the 3 ranks
        _case("hf_qwen2_context_parallel_group", "(the model's)", [20, 24, 18], hf=True),
    ] if _HAVE_TRANSFORMERS else []),
    4: [
        _case("halo_spans_three_ranks", "causal=false,window=12,dilation=6", [24, 24, 24, 24]),
        _case("zero_token_rank", "window=16,sink=2", [40, 0, 30, 26], local=True),
        _case("mesh_2d_cp_dim", "window=12,dilation=2", [48, 48], local=True, mesh=[2, 2]),
        # FSDP2 (hybrid: replicated over "dp", sharded over "cp") around context parallelism over "cp"
        _case("fsdp_dp_x_cp_mesh", "window=12,dilation=2,sink=3", [40, 40], Hq=4, Hkv=2, D=16, mesh=[2, 2],
              fsdp=True, local=True),
        _case("traffic_4_ranks_window4096_dilation2", "window=4096,dilation=2,sink=64", [1 << 18] * 4, Hq=1, Hkv=1,
              D=4, fetch_only=True, local=True),
    ],
}


def _launch(world: int, run_dir: Path, cases: list, backend: str = "gloo", dtype: str = "float32") -> Path:
    """Run ``cases`` on ``world`` worker processes; returns the directory of their results.

    A group in which a rank died by a signal, not by a Python error, runs once more in a fresh
    directory, with a warning that quotes the crash. Two CI runs on a 2-core machine lost the
    3-rank group so (one rank aborted with "terminate called without an active exception", no
    Python traceback); rerun 19 times beside 2 to 6 busy processes, the same group did not
    crash. A second crash, a Python error or a hang fails the test."""
    crash = _run_group(world, run_dir, cases, backend, dtype)
    if crash is not None and crash[0]:
        warnings.warn(f"{world} ranks: a rank crashed; the group ran again:\n{crash[1]}")
        run_dir = run_dir / "again"
        crash = _run_group(world, run_dir, cases, backend, dtype)
    if crash is not None:
        pytest.fail(crash[1])
    return run_dir


def _run_group(world, run_dir, cases, backend, dtype):
    """None if every rank exited 0, else (crashed by a signal, what to report)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "cases.json").write_text(json.dumps(dict(cases=cases, dtype=dtype)))
    # a crash dumps every thread's Python stack into the rank's log
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    if backend == "gloo":
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    logs = [open(run_dir / f"rank{r}.log", "w") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(run_dir), backend], env=env,
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world)]
    try:
        return _wait(procs, world, run_dir)
    finally:
        for f in logs:
            f.close()


def _wait(procs, world, run_dir):
    # a rank that fails leaves the others waiting in a collective: stop them all at the first failure
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p in procs):
        failed = [r for r, p in enumerate(procs) if p.poll()]
        hung = not failed and time.monotonic() > deadline
        if failed or hung:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            break
        time.sleep(0.2)
    else:   # every rank ended by itself
        failed, hung = [r for r, p in enumerate(procs) if p.returncode], False
    if not failed and not hung:
        return None
    logs = [(run_dir / f"rank{r}.log").read_text() for r in range(world)]
    what = f"rank {failed[0]} exited with {procs[failed[0]].returncode}" if failed else \
        f"no finish within {TIMEOUT_S}s (a hang?)"
    report = f"{world} ranks: {what}:\n" + "\n".join(f"--- rank {r}\n{log[-3000:]}" for r, log in enumerate(logs))
    return bool(failed) and procs[failed[0]].returncode < 0, report


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The run directory of each world size, launched on first use."""
    done = {}

    def get(world):
        if world not in done:
            run_dir = tmp_path_factory.mktemp(f"cp{world}")
            done[world] = None
            done[world] = _launch(world, run_dir, CASES[world])
        if done[world] is None:
            pytest.fail(f"the run with {world} ranks failed (see its first test)")
        return done[world]
    return get


def _load(run_dir: Path, case: dict, world: int) -> list[dict]:
    return [torch.load(run_dir / f"{case['name']}.{r}.pt") for r in range(world)]


def _reference(case, dtype=torch.float32, device="cpu", dp=0):
    q, k, v, dout, bi = case_inputs(case, dtype, device, dp)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = msa.attention(q, k, v, case["pattern"], block_indices=bi)
    (out * dout).sum().backward()
    return dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


def _check_fsdp(results: list[dict], case: dict, atol: float) -> None:
    """Outputs per data-parallel group, and parameter gradients summed over both groups."""
    grads = {}
    for dp in sorted({r["dp"] for r in results}):
        model = TinyAttention(case)
        x, dout = model_inputs(case, dp)
        out = model(x, lambda q, k, v: msa.attention(q, k, v, case["pattern"]))
        (out * dout).sum().backward()
        ranks = sorted((r for r in results if r["dp"] == dp), key=lambda r: r["cp_rank"])
        got = torch.cat([r["out"] for r in ranks], dim=2)
        assert (got - out.detach()).abs().max() <= atol * max(1.0, out.abs().max().item())
        for name, p in model.named_parameters():
            grads[name] = grads.get(name, 0) + p.grad
    for res in results:
        for name, want in grads.items():
            err = (res["grads"][name] - want).abs().max().item()
            assert err <= atol * max(1.0, want.abs().max().item()), f"{name}: max error {err}"


def _check_hf(results: list[dict], case: dict, atol: float) -> None:
    """Every rank's logits and the summed parameter gradients against the model's own eager attention
    on the whole sequence."""
    model = hf_model(case, "eager")
    ids, dlogits = hf_inputs(case)
    logits = model(input_ids=ids).logits
    (logits * dlogits).sum().backward()
    got = torch.cat([r["out"] for r in sorted(results, key=lambda r: r["cp_rank"])], dim=1)
    assert (got - logits.detach()).abs().max() <= atol * max(1.0, logits.abs().max().item())
    for res in results:
        for name, p in model.named_parameters():
            err = (res["grads"][name] - p.grad).abs().max().item()
            assert err <= atol * max(1.0, p.grad.abs().max().item()), f"{name}: max error {err}"


def _check(results: list[dict], case: dict, atol: float, dtype=torch.float32, device="cpu") -> None:
    groups = sorted({r["dp"] for r in results})
    for dp in groups:
        ranks = sorted((r for r in results if r["dp"] == dp), key=lambda r: r["cp_rank"])
        ref = _reference(case, dtype, device, dp)
        for name in ("out", "dq", "dk", "dv"):
            want = ref[name].float().cpu()
            got = torch.full_like(want, float("nan"))   # every row must come from some rank
            for r in ranks:
                got[:, :, r["rows"]] = r[name].float()
            err = (got - want).abs().max().item()
            assert err <= atol * max(1.0, want.abs().max().item()), f"{case['name']} {name}: max error {err}"


def _ids():
    return [f"P{w}-{c['name']}" for w, cs in CASES.items() for c in cs]


@pytest.mark.parametrize("world,case", [(w, c) for w, cs in CASES.items() for c in cs], ids=_ids())
def test_matches_single_process(runs, world, case):
    results = _load(runs(world), case, world)
    if case.get("error"):
        for r, res in enumerate(results):
            assert "error" in res, f"rank {r} did not raise"
            want = case["error"] if isinstance(case["error"], str) else case["error"][str(r)]
            assert want in res["error"], (r, res["error"])
        return
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}: {res['traceback']}"
    if case.get("fetch_only"):
        assert all(r["rows_ok"] and r["grads_ok"] for r in results)
    elif case.get("hf"):
        _check_hf(results, case, atol=1e-4)
        return   # the traffic of a model's last layer: not one pattern to hold it against
    elif case.get("fsdp"):
        _check_fsdp(results, case, atol=1e-4)
    else:
        _check(results, case, atol=1e-4)
    # traffic: what the formula says each rank receives and sends back, in both directions
    want = halo.traffic_bytes(case["pattern"], case["lens"], batch=case["B"], q_heads=case["Hq"],
                              kv_heads=case["Hkv"], head_dim=case["D"], itemsize=4,
                              layout=case.get("layout", "contiguous"))
    for res in results:
        t, w = res["traffic"], want[res["cp_rank"]]
        assert t["forward_received"] == w == t["backward_sent"], (case["name"], res["cp_rank"], t, w)
    sent = sum(r["traffic"]["forward_sent"] for r in results if r["dp"] == 0)
    assert sent == sum(want), (case["name"], sent, want)
    if case.get("local"):
        # a local pattern moves less than an all-gather of K/V would (N - n_r rows to every rank)
        per_row = case["B"] * case["Hkv"] * case["D"] * 4 * 2
        n = sum(case["lens"])
        assert all(w < (n - ln) * per_row for w, ln in zip(want, case["lens"]) if w), (want, case["lens"])


# --- the halo formula, without processes ------------------------------------------------------


@pytest.mark.parametrize("pattern,lens,want", [
    ("window=8,dilation=2", [64, 64, 64], [[(0, 64)], [(50, 128)], [(114, 192)]]),
    ("causal=false,window=8,dilation=2", [64, 64], [[(0, 78)], [(50, 128)]]),
    ("window=4,sink=3", [10, 10, 10], [[(0, 10)], [(0, 3), (7, 20)], [(0, 3), (17, 30)]]),
    ("window=100", [10, 10, 10], [[(0, 10)], [(0, 20)], [(0, 30)]]),            # reach past the start: clipped
    ("causal=false,window=100", [10, 10], [[(0, 20)], [(0, 20)]]),             # and past the end
    ("causal", [10, 0, 10], [[(0, 10)], [], [(0, 20)]]),                         # dense; a rank with no rows
    ("causal=false,global=5", [10, 10], [[(0, 20)], [(0, 5), (10, 20)]]),
    ("0-1:window=3;2-3:causal=false,window=2,dilation=5", [20, 20], [[(0, 25)], [(15, 40)]]),
], ids=["dilated", "bidirectional", "sink", "clip-left", "clip-both", "dense-empty", "global", "head-groups"])
def test_needed_ranges(pattern, lens, want):
    heads = 4 if ":" in pattern else None
    assert halo.needed_ranges(pattern, lens, heads) == want


def test_fetched_rows_formula():
    w, d, s, n = 9, 3, 4, 200   # reach 24
    lens = [50, 50, 50, 50]
    starts = [0, 50, 100, 150]
    assert halo.fetched_rows(f"window={w},dilation={d}", lens) == [min(st, (w - 1) * d) for st in starts]
    assert halo.fetched_rows(f"causal=false,window={w},dilation={d}", lens) == [
        min(st, (w - 1) * d) + min(n - st - 50, (w - 1) * d) for st in starts]
    # sinks that are not already in the halo or the slice
    assert halo.fetched_rows(f"window={w},dilation={d},sink={s}", lens) == [0, 24 + 4, 24 + 4, 24 + 4]
    # a halo longer than a slice spans several ranks, and never more than what lies before
    assert halo.fetched_rows("window=80", [20, 20, 20, 20, 20]) == [0, 20, 40, 60, 79]
    assert halo.exchange_plan(halo.needed_ranges("window=30", [20, 20, 20]), [20, 20, 20])[2] == [
        (0, 11, 20), (1, 20, 40), (2, 40, 60)]


def test_head_tail_balances_dense_causal():
    """Head-tail: rank r holds chunks r and 2P-1-r; every rank computes the same number of causal
    (query, key) pairs, where contiguous slices give the last rank 2P-1 times the first's."""
    lens = [64] * 4

    def pairs(layout):   # per rank: sum over its queries of the keys at or before them
        return [sum((hi * (hi + 1) - lo * (lo + 1)) // 2 for lo, hi in held) for held in halo.holdings(lens, layout)]
    assert halo.holdings(lens, "head_tail") == [[(0, 32), (224, 256)], [(32, 64), (192, 224)],
                                                [(64, 96), (160, 192)], [(96, 128), (128, 160)]]
    assert len(set(pairs("head_tail"))) == 1
    contiguous = pairs("contiguous")
    assert contiguous[-1] > 6 * contiguous[0]
    # the rows rank 1 fetches for dense causal: everything before its tail chunk's end, less its own
    assert halo.fetched_rows("causal", lens, layout="head_tail") == [256 - 64, 224 - 64, 192 - 64, 160 - 64]
    plan = halo.exchange_plan(halo.needed_ranges("causal", lens, layout="head_tail"), lens, "head_tail")
    # in stacked local rows: rank 1's chunk 6 ([192, 224)) is its local rows [32, 64), i.e. [96, 128)
    assert plan[1][-1] == (1, 96, 128) and plan[1][0] == (0, 0, 32)
    with pytest.raises(ValueError, match="even"):
        halo.holdings([32, 30], "head_tail")


def test_replicated_when_rows_of_blocks_cannot_be_kept():
    assert halo.replicated("window=8,random=2,block=16", [32, 32])
    assert not halo.replicated("topk=2,block=16", [32, 32])
    assert halo.replicated("topk=2,block=16", [40, 24])
    assert halo.fetched_rows("random=1,block=16", [32, 0, 32]) == [32, 0, 32]
    assert halo.traffic_bytes("random=1,block=16", [32, 32], batch=1, q_heads=4, kv_heads=2, head_dim=16,
                              itemsize=2) == [32 * 16 * 2 * (2 * 2 + 4)] * 2


FAKE_WORKER = """
import os, sys
rank, run_dir = int(sys.argv[1]), sys.argv[3]
how = open(os.path.join(os.path.dirname(__file__), "how")).read().split()
crashes = how[0] == "always" or (how[0] == "once" and not run_dir.endswith("again"))
if rank == 1 and crashes:
    if how[1] == "hang":
        import time
        time.sleep(60)
    os.abort() if how[1] == "abort" else sys.exit(3)
open(os.path.join(run_dir, f"c.{rank}.pt"), "w").write(run_dir)
"""


@pytest.mark.parametrize("how", ["once abort", "always abort", "once error", "once hang", "never -"])
def test_launch_reruns_a_group_once_after_a_crash(tmp_path, monkeypatch, how):
    """The group runs again, with a warning, when a rank dies by a signal; not after a Python
    error or a hang (whose ranks it kills), and never twice."""
    worker = tmp_path / "worker.py"
    worker.write_text(FAKE_WORKER)
    monkeypatch.setattr(sys.modules[__name__], "WORKER", worker)
    monkeypatch.setattr(sys.modules[__name__], "TIMEOUT_S", 3)
    (tmp_path / "how").write_text(how)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if how in ("once abort", "never -"):
            run_dir = _launch(2, tmp_path / "run", [])
            assert [Path(run_dir, f"c.{r}.pt").read_text() for r in range(2)] == [str(run_dir)] * 2
            assert run_dir.name == ("again" if how == "once abort" else "run")
        else:
            want = "no finish within 3s" if how == "once hang" else r"rank 1 exited with (-6|3)"
            with pytest.raises(pytest.fail.Exception, match=want):
                _launch(2, tmp_path / "run", [])
    reran = [w for w in seen if "the group ran again" in str(w.message)]
    assert len(reran) == (1 if how.endswith("abort") else 0)
    assert (tmp_path / "run" / "again").exists() == how.endswith("abort")


def test_resolve_group_rejects_mesh_dim_without_mesh():
    with pytest.raises(ValueError, match="DeviceMesh"):
        msa.distributed.resolve_group(None, mesh_dim=0)


# --- two GPUs over NCCL, bf16 -------------------------------------------------------------------

GPU_CASES = [
    _case("gpu_window_dilation_sink", "window=256,dilation=2,sink=64", [1024, 1024], Hq=4, Hkv=2, D=64),
    _case("gpu_bidirectional_uneven", "causal=false,window=300,dilation=3", [700, 1348], Hq=4, Hkv=4, D=128),
    _case("gpu_head_groups", "0-1:window=64;2-3:window=512,dilation=4,sink=16", [1024, 1024], Hq=4, Hkv=2, D=64),
    _case("gpu_random_replicated", "window=64,random=2,block=128", [1024, 1024], Hq=2, Hkv=2, D=64),
]


@pytest.mark.gpu2
def test_nccl_bf16_matches_one_gpu(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    run_dir = _launch(2, tmp_path, GPU_CASES, backend="nccl", dtype="bfloat16")
    for case in GPU_CASES:
        results = _load(run_dir, case, 2)
        for res in results:
            assert "error" not in res, res["traceback"]
        # both sides are bf16 kernels: they differ by the rounding of a different summation order
        _check(results, case, atol=3e-2, dtype=torch.bfloat16, device="cuda:0")
