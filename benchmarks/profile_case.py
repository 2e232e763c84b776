"""Where the time of one benchmark case goes: GPU kernels vs the host path (torch.profiler).

    PYTHONPATH=$PWD python3 benchmarks/profile_case.py hash8-8k [docs-w4096 ...] [--iters 20]

For each case of ``msa_codegen.bench_dynamic`` (or ``msa_codegen.bench``) it runs our forward and
forward+backward ``--iters`` times under the profiler, after a warm-up, and prints per iteration:
the wall time, the summed GPU time of every kernel, and the kernels by GPU time. Wall time well
above the kernels' sum means the host path (Python, launches, syncs) is what is measured.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile


def _kernels(prof, iters):
    rows = []
    for e in prof.key_averages():
        dev_t = getattr(e, "device_time_total", None)
        if dev_t is None:
            dev_t = getattr(e, "cuda_time_total", 0)
        if dev_t and e.key and not e.key.startswith(("aten::", "cuda", "Memcpy", "ProfilerStep")) \
                and e.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((dev_t / iters / 1000.0, e.count // iters, e.key))
    return sorted(rows, reverse=True)


def profile_fn(label, fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters * 1000
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    ks = _kernels(prof, iters)
    total = sum(k[0] for k in ks)
    print(f"  {label}: wall {wall:.3f} ms/iter, GPU kernels {total:.3f} ms/iter ({total / wall:.0%} of wall)")
    for ms, count, name in ks[:8]:
        print(f"      {ms:8.3f} ms  x{count:<3d} {name[:110]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    from msa_codegen import bench_dynamic

    by_name = {c.name: c for c in bench_dynamic.CASES}
    for name in args.cases:
        if name not in by_name:
            print(f"[{name}] unknown case (known: {', '.join(by_name)})")
            continue
        ours, _, grads, note = bench_dynamic.build(by_name[name], "cuda", torch.bfloat16, with_peers=False)
        print(f"[{name}] {note}")
        out = ours()
        do = torch.randn_like(out)
        del out

        def fb():
            ours().backward(do)
            for t in grads:
                t.grad = None
        profile_fn("fwd", ours, args.iters)
        profile_fn("fwd+bwd", fb, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
