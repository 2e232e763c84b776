"""Backward with the window band's dS through scratch against dq recomputing it (GPU, run 18).

    PYTHONPATH=$PWD python3 benchmarks/ds_probe.py [--cases all|w4096] [--rounds 3] [--rep 200]
        [--dq-variants] [--profile]

For each benchmark case (issue 4's shapes): one forward, then ``torch.autograd.grad`` of it timed
with the scratch path on (``MSA_BWD_SCRATCH_BYTES`` unset: the default limit) and off (0), in
alternating rounds in one process (the backward drifts 5-8% between rounds, NOTES.md run 17).
The first round also reports the largest relative difference of dq, dk, dv between the paths.
``--dq-variants``: the dq kernel's warps and stages on the scratch path (ops.DS_DQ_WARPS /
DS_DQ_STAGES). ``--profile``: CUDA time per kernel of one backward on each path. Not part of
the package: it decides whether the scratch path is worth its memory.
"""
from __future__ import annotations

import argparse
import os

import torch
import triton.testing

import msa_codegen as msa
import msa_codegen.ops as ops

CASES = {
    "w4096": ("window=4096", 131072, 16, 16, 128),
    "dil2": ("window=4096,dilation=2", 131072, 16, 16, 128),
    "sink64": ("window=4096,sink=64", 131072, 16, 16, 128),
    "bidir512": ("causal=false,window=512", 65536, 16, 16, 128),
    "gqa": ("window=4096", 131072, 32, 8, 128),
    "d64": ("window=4096", 131072, 32, 32, 64),
}


def _set(on: bool):
    if on:
        os.environ.pop("MSA_BWD_SCRATCH_BYTES", None)
    else:
        os.environ["MSA_BWD_SCRATCH_BYTES"] = "0"


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _profile(fn):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if t:
            out.append((t / 3 / 1000, e.key))
    return sorted(out, reverse=True)[:5]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="all")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--dq-variants", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    names = list(CASES) if a.cases == "all" else a.cases.split("+")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    summary = []
    for name in names:
        pattern, n, hq, hkv, d = CASES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        v = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        do = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        out = msa.attention(q, k, v, pattern)

        def bwd():
            return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

        grads = {}
        for on in (False, True):
            _set(on)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            grads[on] = bwd()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            print(f"{name} scratch={'on ' if on else 'off'} first call done, backward peak +{peak:.2f} GiB", flush=True)
        diffs = " ".join(f"d{x} {_rel(grads[True][i], grads[False][i]):.1e}" for i, x in enumerate("qkv"))
        print(f"{name} {pattern} N={n} H={hq}/{hkv} D={d}: on vs off {diffs}", flush=True)
        del grads
        times = {False: [], True: []}
        for r in range(a.rounds):
            for on in (False, True):
                _set(on)
                times[on].append(triton.testing.do_bench(bwd, rep=a.rep, return_mode="median"))
            print(f"  round {r}: off {times[False][-1]:.3f} ms, on {times[True][-1]:.3f} ms", flush=True)
        off, on = (sorted(times[x])[len(times[x]) // 2] for x in (False, True))
        summary.append((name, off, on))
        if a.profile:
            for mode in (False, True):
                _set(mode)
                for ms, key in _profile(bwd):
                    print(f"  profile scratch={'on ' if mode else 'off'} {ms:8.3f} ms  {key[:70]}", flush=True)
        if a.dq_variants:
            _set(True)
            for warps, stages in [(4, 3), (4, 2), (4, 4), (8, 3), (8, 2)]:
                ops.DS_DQ_WARPS, ops.DS_DQ_STAGES = warps, stages
                ms = triton.testing.do_bench(bwd, rep=a.rep, return_mode="median")
                print(f"  dq on scratch warps={warps} stages={stages}: backward {ms:.3f} ms", flush=True)
            ops.DS_DQ_WARPS, ops.DS_DQ_STAGES = 4, 3
        del out, q, k, v, do
        torch.cuda.empty_cache()
    print("case       off ms    on ms   on/off")
    for name, off, on in summary:
        print(f"{name:9s} {off:8.3f} {on:8.3f} {on / off:8.3f}")


if __name__ == "__main__":
    main()
