"""What is pruned before compiling and how the tuner reports it (msa_codegen.tuning.space,
resources, progress, search): the shared-memory estimate against ahead-of-time compiles for
sm_90, the pruned and failed counts of a tuning run, its summary line and progress display."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from msa_codegen.tuning import precompile, resources, space
from msa_codegen.tuning.progress import Progress, TuneStats
from msa_codegen.tuning.search import tune

from tuning_helpers import _key, _problem, tmp_home  # noqa: F401 (tmp_home: autouse)

HAS_NVIDIA = importlib.util.find_spec("triton.backends.nvidia") is not None


# ---- the estimate ------------------------------------------------------------------------------

def test_estimate_counts_every_stage_and_prunes_what_cannot_fit():
    env = space.Env(head_dim=128, dtype=torch.bfloat16, seqlen=131072, dilation=2)
    # q (128 x 128) + 4 stages of k and v (2 x 128 x 128), bf16: 288 KiB, over sm_90's 227 KiB;
    # counting num_stages - 1 buffers (as before) let it through, and it failed at launch
    p = dict(block_m=128, block_n=128, num_warps=8, num_stages=4)
    assert space.smem_estimate("fwd", p, env) == 2 * 128 * (128 + 4 * 256) + space.SMEM_OVERHEAD
    assert space.is_smem_reason(space.why_excluded("fwd", p, env))
    # 3 stages: 230400 B compiled for sm_90, just under the limit: kept, and borderline
    p3 = dict(p, num_stages=3)
    assert space.why_excluded("fwd", p3, env) is None and space.borderline("fwd", p3, env)
    assert not space.borderline("fwd", dict(p, num_stages=1), env)
    assert space.is_smem_reason("OutOfResources: out of resource: shared memory, Required: 262144")


_AOT_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch
    from msa_codegen.tuning import resources, space
    out = []
    for d, p in json.loads(sys.argv[1]):
        env = space.Env(head_dim=d, dtype=torch.bfloat16, seqlen=8192, dilation=2)
        t0 = time.perf_counter()
        got = resources.candidate_shared("window=4096,dilation=2", "fwd", p, head_dim=d, dtype=torch.bfloat16,
                                         heads=16, kv_heads=16, seqlen=8192)
        why = resources.over_limit("window=4096,dilation=2", "fwd", p, limit=resources.SM90_SHARED_OPTIN,
                                   head_dim=d, dtype=torch.bfloat16, heads=16, kv_heads=16, seqlen=8192)
        out.append(dict(aot=got["fwd"], estimate=space.smem_estimate("fwd", p, env), why=why,
                        seconds=time.perf_counter() - t0))
    print(json.dumps(out))
""")


@pytest.mark.skipif(not HAS_NVIDIA, reason="needs triton.backends.nvidia (ahead-of-time compile for sm_90)")
def test_estimate_agrees_with_an_ahead_of_time_compile_for_sm90(tmp_path):
    """Two real candidates compiled for sm_90 on this CPU (a process without TRITON_INTERPRET),
    specialised as a launch is: the estimate is at most SMEM_OVERHEAD above the compiler's figure
    and never below it; the over-limit one is named with its bytes; the verdict is cached."""
    cands = [(64, dict(block_m=64, block_n=64, num_warps=4, num_stages=2)),
             (128, dict(block_m=128, block_n=128, num_warps=8, num_stages=4))]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(MSA_CODEGEN_HOME=str(tmp_path / "home"), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    p = subprocess.run([sys.executable, "-c", _AOT_SCRIPT, json.dumps(cands)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    small, big = json.loads(p.stdout.strip().splitlines()[-1])
    for r in (small, big):
        assert r["estimate"] - space.SMEM_OVERHEAD <= r["aot"] <= r["estimate"], r
    assert small["why"] is None
    assert big["aot"] > resources.SM90_SHARED_OPTIN and f"{big['aot']} B of shared memory" in big["why"]
    print(f"AOT sm_90: {small['seconds']:.1f} s and {big['seconds']:.1f} s per candidate")
    assert len(list((tmp_path / "home" / "smem-cache").glob("*.json"))) == 2


# ---- Blackwell (sm_100, sm_120): heuristic defaults, compiled ahead of time ---------------------

def test_blackwell_defaults_are_the_hopper_tiles():
    """Capability 10 (B200 / B100) gets Hopper's defaults (same shared memory per block, same
    tensor descriptors): every head-dim branch, dtype and the narrow-band forward."""
    from msa_codegen.heuristics import default_config
    from msa_codegen.kernels.tma import tma_capable

    cuda = torch.device("cuda")
    assert tma_capable(cuda, "10.0") and tma_capable(cuda, "9.0") and not tma_capable(cuda, "8.0")
    for d in (64, 128, 256):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for pattern in ("window=4096,dilation=2,sink=64", "causal=false,window=512", None):
                assert default_config(cuda, d, dtype, "10.0", pattern) == default_config(cuda, d, dtype, "9.0", pattern)
    # and they are not the pre-Hopper ones where those differ
    assert default_config(cuda, 128, torch.bfloat16, "10.0").fwd != default_config(cuda, 128, torch.bfloat16, "8.0").fwd
    assert resources.SM100_SHARED_OPTIN == resources.SM90_SHARED_OPTIN == 232448


def test_consumer_blackwell_defaults_are_the_ampere_tiles():
    """Capability 12 (RTX 50xx, RTX PRO 6000) has tensor descriptors but 99 KiB of shared memory per
    block, as 8.6 does: it gets 8.6's defaults, chosen by the shared memory, not the capability."""
    from msa_codegen.heuristics import default_config, hopper_sized, shared_optin
    from msa_codegen.kernels.tma import tma_capable

    cuda = torch.device("cuda")
    assert tma_capable(cuda, "12.0") and tma_capable(cuda, "12.1")
    assert shared_optin(cuda, "12.0") == shared_optin(cuda, "8.6") == resources.SM120_SHARED_OPTIN == 101376
    assert not hopper_sized(cuda, "12.0") and hopper_sized(cuda, "9.0") and hopper_sized(cuda, "10.0")
    assert hopper_sized(cuda, "11.0")   # not in the table: judged by its descriptors, as before
    for d in (64, 128, 256):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for pattern in ("window=4096,dilation=2,sink=64", "causal=false,window=512", None):
                for cap in ("12.0", "12.1"):
                    assert default_config(cuda, d, dtype, cap, pattern) == default_config(cuda, d, dtype, "8.6", pattern)
    assert default_config(cuda, 128, torch.bfloat16, "12.0").fwd != default_config(cuda, 128, torch.bfloat16, "9.0").fwd
    # float32 above D=128: smaller tiles under FP32_WIDE_SHARED (99 KiB), the same ones from 8.0's 163 KiB up
    wide = [default_config(cuda, 256, torch.float32, cap) for cap in ("8.0", "9.0", "12.0")]
    assert wide[0] == wide[1] != wide[2]


_DEFAULTS_SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys
    import torch, triton
    from triton.compiler import ASTSource
    from msa_codegen.heuristics import default_config
    from msa_codegen.tuning import resources
    capability, cases = sys.argv[1], json.loads(sys.argv[2])
    out = []
    for pattern, d, directions, dtype in cases:
        cfg = default_config(torch.device("cuda"), d, getattr(torch, dtype), capability, pattern)
        for direction in directions:
            params = dataclasses.asdict(cfg.fwd if direction == "fwd" else cfg.bwd)
            shared = resources.candidate_shared(pattern, direction, params, head_dim=d, dtype=getattr(torch, dtype),
                                                heads=16, kv_heads=4, seqlen=8192, capability=capability)
            out.append(dict(pattern=pattern, d=d, dtype=dtype, direction=direction, params=params, shared=shared))
    # the target really is the capability's: one kernel compiled as kernel_shared compiles it, its PTX
    # read back (and its K/V loads are TMA's bulk tensor copies)
    name, kern, consts, warps, stages = resources.launches("window=4096,dilation=2,sink=64", "fwd",
        dataclasses.asdict(default_config(torch.device("cuda"), 128, torch.bfloat16, capability).fwd), head_dim=128,
        dtype=torch.bfloat16, heads=16, kv_heads=4, seqlen=8192)[0]
    sig, cst, attrs = resources._signature(kern, consts, "bf16", 4)
    k = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=cst, attrs=attrs),
                       target=resources.target_of(capability), options=dict(num_warps=warps, num_stages=stages))
    target = [ln.split()[1] for ln in k.asm["ptx"].splitlines() if ln.startswith(".target")]
    print(json.dumps(dict(results=out, target=target, shared=k.metadata.shared, triton=triton.__version__,
                          tma="cp.async.bulk.tensor" in k.asm["ptx"])))
""")


def _ptxas_lacks(arch: int) -> str | None:
    """Why Triton's bundled ptxas for ``sm_<arch>`` cannot compile for it, or None when it can."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        path = get_ptxas(arch).path
        text = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60).stdout
    except Exception as e:   # another Triton layout, or no ptxas
        return f"cannot ask Triton's ptxas about sm_{arch}: {type(e).__name__}: {e}"
    return None if f"sm_{arch}" in text else f"Triton's bundled ptxas ({path}) does not list sm_{arch}"


# Every head-dim branch, forward and backward (dk/dv, its prefix pass, dq), and the narrow-band
# forward where it has its own tiles (sm_120's narrow band is its plain forward: not compiled twice),
# bf16; on sm_120 also float32 at D=256, whose wide tiles only 99 KiB GPUs trade for smaller ones
_WINDOW_CASES = [("window=4096,dilation=2,sink=64", d, ["fwd", "bwd"], "bfloat16") for d in (64, 128, 256)]
_NARROW_CASE = ("causal=false,window=512,dilation=2,sink=64", 128, ["fwd"], "bfloat16")   # 64 x 64, Hopper-sized
_FP32_WIDE_CASE = ("window=4096,dilation=2,sink=64", 256, ["fwd", "bwd"], "float32")


@pytest.mark.skipif(not HAS_NVIDIA, reason="needs triton.backends.nvidia (ahead-of-time compile)")
@pytest.mark.parametrize("capability, limit, cases", [
    ("10.0", resources.SM100_SHARED_OPTIN, _WINDOW_CASES + [_NARROW_CASE]),
    ("12.0", resources.SM120_SHARED_OPTIN, _WINDOW_CASES + [_FP32_WIDE_CASE]),
], ids=["sm_100", "sm_120"])
def test_blackwell_defaults_compile_within_shared_memory(tmp_path, capability, limit, cases):
    """The window / dilation / sink kernels, forward and backward (dk/dv, its prefix pass, dq), with
    the capability's defaults of each head-dim branch, compiled for GPUTarget("cuda", 100 or 120, 32)
    on this CPU (Triton's bundled ptxas-blackwell: Triton 3.6's, CUDA 12.8, and 3.9's, CUDA 13.4,
    list sm_100 and sm_120), specialised as a launch is: each compiles, with its K/V through TMA, and
    asks for at most the shared memory per block of a B200 (227 KiB) or an RTX 50xx (99 KiB).
    Minutes each on a busy 2-core CPU (the backward's kernels dominate)."""
    if torch.cuda.is_available():
        pytest.skip("a CPU check: on a GPU machine the GPU tests run the kernels")
    arch = int(float(capability) * 10)
    why = _ptxas_lacks(arch)
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(MSA_CODEGEN_HOME=str(tmp_path / "home"), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    p = subprocess.run([sys.executable, "-c", _DEFAULTS_SCRIPT, capability, json.dumps(cases)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["target"] and all(t.startswith(f"sm_{arch}") for t in got["target"]), got["target"]
    assert got["tma"] and 0 < got["shared"] <= limit
    results = got["results"]
    assert len(results) == sum(len(c[2]) for c in cases)
    # Hopper-sized: 128-key forward tiles at D=128, 64-key ones at D=64 and D=256; 99 KiB: 64-key
    # ones at D=128
    fwd_keys = {64, 128} if limit >= resources.SM90_SHARED_OPTIN else {16, 32, 64}
    assert {r["params"]["block_n"] for r in results if r["direction"] == "fwd"} == fwd_keys
    for r in results:
        kernels = {"fwd"} if r["direction"] == "fwd" else {"dk/dv", "dk/dv prefix", "dq"}
        assert set(r["shared"]) == kernels, r
        assert all(0 < b <= limit for b in r["shared"].values()), r
    print(f"Triton {got['triton']}, sm_{arch}:", "; ".join(
        f"{r['pattern']} D={r['d']} {r['dtype']} {r['direction']}: {r['shared']}" for r in results))


def test_signature_specialises_as_a_launch():
    """Pointers and strides divisible by 16, the last dim's stride, the row stride of run-time
    positions and segments (contiguous int32 rows) and a GQA group of 1 constant, what the kernel
    does not specialise (N, H_OFF) left alone."""
    class P:
        def __init__(self, c):
            self.is_constexpr = c

    class K:
        arg_names = ["Q", "LSE", "QPOS", "stride_qn", "stride_qd", "stride_qph", "stride_qpn", "stride_ksn",
                     "GROUP", "N", "qk_scale", "BLOCK_M"]
        params = [P(False)] * 11 + [P(True)]
        do_not_specialize = ["N"]

    sig, consts, attrs = resources._signature(K, {"BLOCK_M": 64}, "bf16", group=1)
    assert sig == {"Q": "*bf16", "LSE": "*fp32", "QPOS": "*i32", "stride_qn": "i32", "stride_qd": "constexpr",
                   "stride_qph": "i32", "stride_qpn": "constexpr", "stride_ksn": "constexpr",
                   "GROUP": "constexpr", "N": "i32", "qk_scale": "fp32", "BLOCK_M": "constexpr"}
    assert consts == {(4,): 1, (6,): 1, (7,): 1, (8,): 1, (11,): 64}
    assert set(attrs) == {(0,), (1,), (2,), (3,), (5,)}


# ---- the tuner's counts, its summary line and progress -----------------------------------------

def test_pruned_and_failed_are_counted_not_printed(tmp_home, monkeypatch, capsys):
    """Candidates pruned for shared memory (by the estimate, and by an ahead-of-time verdict near
    the limit) are never compiled; an out-of-resources error at launch is a failed trial; all are
    counted in one summary line, and nothing is printed per trial."""
    from triton.runtime.errors import OutOfResources

    from msa_codegen.tuning import measure, search

    # in the interpreter nothing exceeds the (absent) limit: pretend that 16 x 16 tiles do (the
    # default, 32 x 32, is measured whatever the filter says)
    real_why = space.why_excluded

    def why(direction, params, env):
        if params.get("block_m") == 16 and params.get("block_n") == 16:
            return "fwd: about 300 KiB of shared memory per block, the device has 227"
        return real_why(direction, params, env)

    monkeypatch.setattr(space, "why_excluded", why)
    # 16 x 32 tiles are near the limit, and the compile for the target says they exceed it
    monkeypatch.setattr(search, "_target_checks", lambda interpreter: True)
    monkeypatch.setattr(space, "borderline", lambda d, p, env: p["block_m"] == 16 and p["block_n"] == 32)
    asked = []

    def verdicts(problem, direction, params_list, **kw):
        asked.extend(params_list)
        return ["smem:fwd: 240000 B of shared memory per block (compiled for the target)"] * len(params_list)

    monkeypatch.setattr(precompile, "shared_verdicts", verdicts)
    # 32 x 16 tiles compile but the launch runs out of shared memory
    real_check = measure.Bench.check
    timed = []

    def check(self, cfg):
        if cfg.fwd.block_m == 32 and cfg.fwd.block_n == 16:
            raise OutOfResources(262144, 232448, "shared memory")
        timed.append((cfg.fwd.block_m, cfg.fwd.block_n))
        return real_check(self, cfg)

    monkeypatch.setattr(measure.Bench, "check", check)
    stats = TuneStats(1024, "fwd", 4)
    res = tune(_problem(), "fwd", _key("fwd"), tmp_home / "tuning.db", trials=4, progress=False, stats=stats)
    assert res is not None and res.stats is stats and res.config["block_m"] == 32 and res.config["block_n"] == 32
    assert {(p["block_m"], p["block_n"]) for p in asked} == {(16, 32)}
    assert (16, 32) not in timed and (16, 16) not in timed
    assert stats.pruned_smem >= 1 and stats.failed == stats.out_of_resources == 1
    assert stats.trials == 2 and stats.best_ms == res.median_ms   # the default (32 x 32) and 32 x 16
    out = capsys.readouterr()
    assert "out of resource" not in (out.out + out.err).lower()
    line = stats.line()
    assert line.startswith(f"bucket 1024 fwd: 2 trials, {stats.pruned_smem} pruned (shared memory), 1 failed "
                           f"(1 out of resources), best ")
    assert line.endswith(" ms")


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_in_place_on_a_terminal_plain_lines_elsewhere():
    for stream in (_Tty(), io.StringIO()):
        stats = TuneStats(131072, "fwd", 8)
        bar = Progress(stats, stream=stream)
        for i in range(8):
            stats.trials, stats.best_ms = i + 1, 10.0 - i
            bar.update()
        bar.close()
        text = stream.getvalue()
        if isinstance(stream, _Tty):
            # one line rewritten in place, erased at the end (the caller prints the summary)
            assert "\n" not in text and text.count("\r") == 8 + 2 and text.endswith("\r")
        else:
            # a line per quarter of the trials: short CI logs (the caller prints the summary)
            assert [line.split()[0] for line in text.splitlines()] == ["[1/8]", "[3/8]", "[5/8]", "[7/8]"]
    assert TuneStats(8192, "bwd", 40, trials=12, failed=2, best_ms=1.5, budget_stop=True).line() == \
        "bucket 8192 bwd: 12 trials of 40, 0 pruned (shared memory), 2 failed, best 1.5 ms, budget spent"
