"""Where a forward's time goes besides its kernel (GPU): do_bench of the call, of a CUDA-graph
replay of it, the profiler's kernel time, the host time per call, and any call that
synchronises the host with the GPU (torch's sync debug mode), ours and FlexAttention's.

    PYTHONPATH=$PWD python3 benchmarks/host_gap.py [--pattern window=4096] [--n 131072] [--heads 16]

Not part of the package: run 16 asked why msa-bench's forward (8.80 ms) exceeds the profiler's
msa_fwd (8.34 ms) by 5%.
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch
import triton.testing


def _kernel_ms(fn, reps=5):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        total += t
    return total / reps / 1000


def _report(name, fn, rep):
    fn()
    torch.cuda.synchronize()
    plain = triton.testing.do_bench(fn, rep=rep, return_mode="median")
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            fn()
        graph = triton.testing.do_bench(g.replay, rep=rep, return_mode="median")
    except Exception as e:   # reported, never dropped
        graph = float("nan")
        print(f"{name}: graph capture failed: {type(e).__name__}: {str(e)[:120]}")
    kern = _kernel_ms(fn)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        fn()
    host = (time.perf_counter() - t0) / 20 * 1000
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fn()
    torch.cuda.set_sync_debug_mode("default")
    syncs = [str(x.message).splitlines()[0][:100] for x in w if "synchron" in str(x.message).lower()]
    torch.cuda.synchronize()
    print(f"{name:12s} do_bench {plain:8.3f} ms  graph {graph:8.3f} ms  kernels {kern:8.3f} ms  "
          f"host/call {host:7.3f} ms  syncs {len(syncs)} {syncs[:2]}", flush=True)


def run_cases(pattern: str, n: int, heads: int, report) -> None:
    """``report(name, fn)`` for the forward of ours and of FlexAttention (compiled, block mask
    built beforehand) on one bf16 case, D=128: without grad, then with grad inputs."""
    import msa_codegen as msa
    from msa_codegen.bench import _mask_mod
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dev = "cuda"
    q, k, v = (torch.randn(1, heads, n, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    spec = msa.parse(pattern).groups[0].spec
    bm = create_block_mask(_mask_mod(spec), None, None, n, n, device=dev, _compile=True)
    flex = torch.compile(flex_attention, dynamic=False)
    with torch.no_grad():
        report("ours", lambda: msa.attention(q, k, v, pattern))
        report("flex", lambda: flex(q, k, v, block_mask=bm))
    for t in (q, k, v):
        t.requires_grad_()
    report("ours+grad", lambda: msa.attention(q, k, v, pattern))
    report("flex+grad", lambda: flex(q, k, v, block_mask=bm))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pattern", default="window=4096")
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rep", type=int, default=150)
    args = ap.parse_args(argv)
    run_cases(args.pattern, args.n, args.heads, lambda name, fn: _report(name, fn, args.rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
