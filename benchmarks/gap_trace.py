"""The device timeline of a forward timed the way do_bench times it (GPU): each repetition
zeroes a 256 MB buffer (do_bench's L2 flush), records an event, calls the forward and records
another. The profiler's trace gives, per repetition, the idle time between the flush and the
first kernel, each kernel's duration, and the idle time after the last one; the events give
do_bench's figure. Ours and FlexAttention's, without and with grad inputs.

    PYTHONPATH=$PWD python3 benchmarks/gap_trace.py [--pattern window=4096] [--n 131072] [--heads 16]

Not part of the package: run 16 found do_bench 8.695 ms against 8.275 ms of kernels for our
forward (host_gap.py), and 10.877 against 10.714 for FlexAttention's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch


def _trace(name, fn, reps):
    cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    for _ in range(3):
        cache.zero_()
        fn()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            cache.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
    event_ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        evs = json.load(f)["traceEvents"]
    dev = sorted((e for e in evs if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e),
                 key=lambda e: e["ts"])
    # one repetition: a flush (the fill of `cache`, the only 256 MB fill) and what follows it
    fills = [i for i, e in enumerate(dev) if "fill" in e["name"].lower() or e.get("cat") == "gpu_memset"]
    longest = max(dev[i]["dur"] for i in fills)
    flush = [i for i in fills if dev[i]["dur"] >= longest / 2]   # not a small fill of the forward's own
    reps_ev = []
    for a, b in zip(flush, flush[1:] + [len(dev)]):
        reps_ev.append((dev[a], dev[a + 1:b]))
    rows = []
    for fl, ks in reps_ev:
        if not ks:
            continue
        fl_end = fl["ts"] + fl["dur"]
        rows.append((ks[0]["ts"] - fl_end, sum(k["dur"] for k in ks), ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"],
                     fl["dur"], [(k["name"][:48], k["dur"]) for k in ks]))
    med = lambda idx: statistics.median(r[idx] for r in rows) / 1000   # noqa: E731 (us -> ms)
    print(f"{name:10s} events {event_ms:8.3f} ms | gap after flush {med(0):6.3f} ms  kernels {med(1):8.3f} ms  "
          f"first start to last end {med(2):8.3f} ms  flush {med(3):6.3f} ms  ({len(rows)} reps)", flush=True)
    for kname, dur in rows[len(rows) // 2][4]:
        print(f"{'':10s}   {kname:48s} {dur / 1000:8.3f} ms")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pattern", default="window=4096")
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    from host_gap import run_cases   # beside this file: the same four forwards as host_gap.py

    run_cases(args.pattern, args.n, args.heads, lambda name, fn: _trace(name, fn, args.reps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
