"""Where the host time of a short call goes (docs/performance.md, "Short calls: the host path").

    python benchmarks/host_probe.py [--case enc-w256-4k] [--rounds 2] [--families triton,gluon]
    bash benchmarks/run.sh host [ARGS]

Host time is the time to issue calls while queued matmuls keep the GPU busy (so the GPU never
waits for the host and the host never waits for the GPU); "back to back" is the GPU time of the
same calls issued in a loop (the larger of host and kernel time). Printed per case:

0. with ``--families``, per kernel family (``MSA_CODEGEN_GLUON=0`` / ``=1``, which families ran
   each direction is spied): host, back-to-back and kernel time (torch.profiler: the sum of the
   call's kernels) of a forward and a forward+backward, and the call's kernels by name. Is a
   short call's slower Gluon backward its host path or its kernels (docs/performance.md)?
1. host and back-to-back time of a forward and a forward+backward, with direct launches
   (``kernels/direct.py``) on and off, in interleaved rounds;
2. the same with Triton's launch stubbed out (``JITFunction.run`` returns at once): our Python
   and autograd alone, next to an empty autograd Function of the same tensors;
3. per kernel of the call: one launch through ``JITFunction.run``, through the kept compiled
   kernel's launcher, and Triton's argument binding alone, in a loop.

Needs a CUDA GPU. Cases: the short ones of msa-bench and bench_dynamic.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

CASES = {
    # name: (pattern, B, H, N, D, hash buckets or 0, packed documents: of lengths (lo, hi), a count
    # of equal ones, or None)
    "enc-w256-4k": ("causal=false,window=256", 8, 12, 4096, 64, 0, None),
    "enc-w512-4k": ("causal=false,window=512", 8, 12, 4096, 64, 0, None),
    "hash8-8k": ("causal", 1, 16, 8192, 128, 8, None),
    # the short documents whose Gluon backward measured slower (2026-12-04)
    "docs-w4096-8k": ("window=4096", 1, 16, 8192, 128, 0, (512, 4096)),
    # the Hash-sparse floor probe's structure (benchmarks/hash_blocks.py --time): 8 equal documents
    "docs8-causal-8k": ("causal", 1, 16, 8192, 128, 0, 8),
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="enc-w256-4k", choices=sorted(CASES))
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of direct launches on / off")
    ap.add_argument("--families", default="", help="e.g. triton,gluon: step 0 for each (default: skip it)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_probe.py measures the launch path of a CUDA GPU: no GPU is visible")

    import triton
    import triton.runtime.jit as jit
    from triton import knobs

    import msa_codegen
    from msa_codegen.bench_dynamic import doc_offsets, hash_inputs
    from msa_codegen.kernels import direct

    pattern, b, h, n, d, buckets, docs = CASES[args.case]
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    extra = {}
    if docs:
        cu = (torch.linspace(0, n, docs + 1).round().to(torch.int32) if isinstance(docs, int)
              else doc_offsets(n, *docs, random.Random(0)))
        extra = dict(cu_seqlens=cu.cuda())
    if buckets:
        # bench_dynamic's Hash-sparse inputs: rows sorted by LSH bucket (hash_sort, not timed)
        q, k, v, qp, kp, qb, kb = hash_inputs(q, k, v, buckets)
        extra = dict(q_pos=qp, k_pos=kp, q_bucket=qb, k_bucket=kb)
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            msa_codegen.attention(q, k, v, pattern, **extra)

    def fwd_bwd():
        msa_codegen.attention(q, k, v, pattern, **extra).backward(do)

    def host_ms(fn, calls=40, reps=7):
        out = []
        for _ in range(reps):
            torch.cuda.synchronize()
            for _ in range(60):
                busy @ busy   # ~85 ms of queued GPU work on an H200
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            out.append((t1 - t0) / calls * 1e3)
        return statistics.median(out)

    def loop_ms(fn, calls=50):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / calls

    def kernels_ms(fn, calls=10):
        """(total, {kernel: ms}) of one call's GPU kernels, by torch.profiler."""
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        per = {e.key: e.self_device_time_total / 1e3 / calls for e in prof.key_averages()
               if e.self_device_time_total > 0}
        return sum(per.values()), per

    print(f"== {args.case}: {pattern!r} B={b} H={h} N={n} D={d}" + (f", {buckets} hash buckets" if buckets else "")
          + (f", {len(extra['cu_seqlens']) - 1} documents" if docs else ""))
    print(f"   {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}")

    # 0. per kernel family
    from msa_codegen.bench import kernel_families
    from msa_codegen.kernels import gluon

    for family in filter(None, args.families.split(",")):
        with gluon.forced({"triton": "0", "gluon": "1"}[family]):
            for _ in range(3):
                fwd_bwd()
            ran = kernel_families(fwd_bwd)
            k_f, _ = kernels_ms(fwd)
            k_fb, per = kernels_ms(fwd_bwd)
            print(f"0. {family} ({ran}): host fwd {host_ms(fwd):.3f} ms, fwd+bwd {host_ms(fwd_bwd):.3f} ms | back "
                  f"to back fwd {loop_ms(fwd):.3f} ms, fwd+bwd {loop_ms(fwd_bwd):.3f} ms | kernels fwd {k_f:.3f} "
                  f"ms, fwd+bwd {k_fb:.3f} ms")
        for name, ms in sorted(per.items(), key=lambda kv: -kv[1])[:8]:
            print(f"   {ms:8.3f} ms  {name[:100]}")

    for _ in range(5):
        fwd_bwd()
        fwd()
    torch.cuda.synchronize()

    # 1. direct launches on / off
    enabled = direct.ENABLED
    for r in range(args.rounds):
        for on in (True, False):
            direct.ENABLED = on
            fwd_bwd()
            fwd()
            print(f"1. round {r + 1}, direct launches {'on ' if on else 'off'}: host fwd {host_ms(fwd):.3f} ms, "
                  f"fwd+bwd {host_ms(fwd_bwd):.3f} ms | back to back fwd {loop_ms(fwd):.3f} ms, "
                  f"fwd+bwd {loop_ms(fwd_bwd):.3f} ms")
    direct.ENABLED = enabled

    # 2. launches stubbed out; an empty autograd Function
    real_run = jit.JITFunction.run
    jit.JITFunction.run = lambda self, *a, **kw: None
    try:
        stub_f, stub_fb = host_ms(fwd), host_ms(fwd_bwd)
    finally:
        jit.JITFunction.run = real_run

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            return torch.empty_like(q)

        @staticmethod
        def backward(ctx, g):
            return torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)

    empty = host_ms(lambda: Empty.apply(q, k, v).backward(do))
    print(f"2. Triton's launch stubbed out: host fwd {stub_f:.3f} ms, fwd+bwd {stub_fb:.3f} ms; "
          f"an empty autograd Function fwd+bwd {empty:.3f} ms")

    # 3. per kernel: one recorded launch of each, three ways
    seen = {}

    def record(self, *a, **kw):
        seen.setdefault(self.fn.__name__, (self, a, dict(kw)))
        return real_run(self, *a, **kw)

    jit.JITFunction.run = record
    try:
        direct.clear()
        fwd_bwd()
        torch.cuda.synchronize()
    finally:
        jit.JITFunction.run = real_run
    print("3. per launch, in a loop (us): JITFunction.run | compiled kernel's launcher | Triton's binding alone")
    for name, (fn, a, kw) in seen.items():
        grid = kw.pop("grid")
        kw.pop("warmup")
        binder = fn.device_caches[torch.cuda.current_device()][4]
        options = dict(kw, debug=knobs.runtime.debug, instrumentation_mode=knobs.compilation.instrumentation_mode)
        compiled = fn.run(*a, grid=grid, warmup=False, **kw)
        bound = list(binder(*a, **options)[0].values())
        stream = torch.cuda.current_stream().cuda_stream
        g = tuple(grid) + (1,) * (3 - len(grid))

        def through_triton():
            fn.run(*a, grid=grid, warmup=False, **kw)

        def launcher():
            compiled.run(*g, stream, compiled.function, compiled.packed_metadata,
                         compiled.launch_metadata(grid, stream, *bound), knobs.runtime.launch_enter_hook,
                         knobs.runtime.launch_exit_hook, *bound)

        times = [host_ms(f, calls=400) * 1e3 for f in (through_triton, launcher, lambda: binder(*a, **options))]
        print(f"   {name:14s} {len(a):3d} args: {times[0]:6.1f} | {times[1]:6.1f} | {times[2]:6.1f}")


if __name__ == "__main__":
    main()
