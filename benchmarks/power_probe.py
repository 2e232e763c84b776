"""Our forward against the card's own bf16 matrix rate, with the SM clock and board power sampled
inside the timing, one process.

    PYTHONPATH=$PWD python benchmarks/power_probe.py [--cases w4096,dense-causal] [--mm 8192]
        [--rounds 5] [--rep-ms 1500]
    bash benchmarks/run.sh power ARGS

Why (benchmarks/NOTES.md, "The forward against the card's own matrix rate"): issue 22's forward
bar is a figure in TFLOP/s, and the same kernel ran 4-5% slower on an H200 than on H100s whose
``nvidia-smi`` clocks, sampled every 250 ms, looked alike. Timed back to back for long enough,
a card reaches its power limit and slows; msa-bench's short timings mostly miss that regime.

Alternately, ``--rounds`` times: ``torch.mm`` of two ``--mm`` square bf16 matrices and each case
of ``msa_codegen.bench.CASES`` named in ``--cases`` (``msa_codegen.attention`` forward, bf16), each
a ``triton.testing.do_bench`` median over ``--rep-ms`` (L2 flushed between repetitions), while a
thread reads the SM clock and the board power through NVML (``pynvml``) every ~5 ms. One line a
timing as it finishes (its clock and power samples: min / median / max), then a table: the
median time over the rounds, effective TFLOP/s (visible pairs only, ``msa_codegen.bench._flops``),
each case's ratio to the matrix rate, the clock and power medians over all its samples. The first
round runs from a cooler card; with ``--rounds`` >= 3 the median sits in the sustained regime.
NVML's clock is the reported one: on an H100 (2026-12-06) the product's time stayed within 3%
while the reported clock went from 1980 to 1410-1515 MHz, so read it beside the times, not as
the SMs' rate. Needs a CUDA GPU and ``pynvml`` (nvidia-ml-py); NVML's device is taken at CUDA's
current index, which names the same card on a one-GPU machine (elsewhere set
``CUDA_DEVICE_ORDER=PCI_BUS_ID``).
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

#: seconds between two NVML reads (the reads themselves take some microseconds)
PERIOD_S = 0.005


def summarise(samples: list[tuple[float, int, float]], t0: float, t1: float) -> tuple[list[int], list[float]]:
    """The clock (MHz) and power (W) samples ``(time, clock, power)`` read between t0 and t1."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    return [s[1] for s in inside], [s[2] for s in inside]


def spread(values: list) -> str:
    """``min / median / max`` of the values, or ``-`` when there are none."""
    if not values:
        return "-"
    return f"{min(values):.0f} / {statistics.median(values):.0f} / {max(values):.0f}"


def parse_cases(text: str):
    """msa-bench cases by name (comma-separated), in the order given."""
    from msa_codegen.bench import CASES
    by_name = {c.name: c for c in CASES}
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        raise ValueError(f"--cases wants msa-bench case names ({', '.join(by_name)}), got {text!r}")
    return [by_name[n] for n in names]


class Sampler:
    """NVML reads of the SM clock and the board power every ``PERIOD_S`` on a thread."""

    def __init__(self):
        try:
            import pynvml
        except ImportError as e:
            raise SystemExit(f"power_probe reads the clock through NVML: pip install nvidia-ml-py ({e})") from e
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        self.read = lambda: (time.perf_counter(), pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                             pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
        self.samples: list[tuple[float, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.samples.append(self.read())
            time.sleep(PERIOD_S)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="w4096,dense-causal", help="msa-bench case names (default w4096,dense-causal)")
    ap.add_argument("--mm", type=int, default=8192, help="size of the square bf16 product (default 8192)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep-ms", type=int, default=1500, help="do_bench's budget a timing (default 1500)")
    args = ap.parse_args(argv)
    try:
        cases = parse_cases(args.cases)
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit("power_probe needs a CUDA GPU")
    import triton.testing

    import msa_codegen as msa
    from msa_codegen.bench import _flops

    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(args.mm, args.mm, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    work = {"mm": (lambda: torch.mm(a, b), 2.0 * args.mm ** 3)}
    for case in cases:
        q = torch.randn(case.b, case.hq, case.n, case.d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(case.b, case.hkv, case.n, case.d, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        work[case.name] = (lambda q=q, k=k, v=v, p=case.pattern: msa.attention(q, k, v, p), _flops(case))
        work[case.name][0]()   # compiled before the timings
    torch.cuda.synchronize()
    keys = list(work)
    times = {key: [] for key in keys}
    clocks = {key: [] for key in keys}
    power = {key: [] for key in keys}
    with Sampler() as sampler:
        for r in range(args.rounds):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                t0 = time.perf_counter()
                ms = triton.testing.do_bench(work[key][0], warmup=50, rep=args.rep_ms, return_mode="median")
                c, p = summarise(sampler.samples, t0, time.perf_counter())
                times[key].append(ms)
                clocks[key] += c
                power[key] += p
                print(f"round {r} {key}: {ms:.4f} ms, clock {spread(c)} MHz, power {spread(p)} W ({len(c)} samples)",
                      flush=True)
    rate = {key: work[key][1] / statistics.median(times[key]) / 1e9 for key in keys}
    print(f"\n{torch.cuda.get_device_name()}, {args.rounds} rounds of {args.rep_ms} ms, product {args.mm}^3 bf16")
    print("| what | median ms | TFLOP/s | / matrix rate | clock median MHz | power median W |")
    print("| --- | --- | --- | --- | --- | --- |")
    for key in keys:
        c, p = clocks[key], power[key]
        print(f"| {key} | {statistics.median(times[key]):.4f} | {rate[key]:.0f} | {rate[key] / rate['mm']:.3f} | "
              f"{statistics.median(c) if c else '-'} | {statistics.median(p) if p else float('nan'):.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
