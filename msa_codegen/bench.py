"""msa-bench: our kernels against FlexAttention and SDPA's flash backend, side by side.

    python -m msa_codegen.bench                 # every case of the table in BENCHMARKS.md
    python -m msa_codegen.bench --cases w4096,w4096-d2 --rounds 5

For each case the inputs are built once; our output is checked against the peer's before
anything is timed; forward and forward+backward are timed with triton.testing.do_bench
(median, L2 flushed between repetitions), ours and then the peer, or with ``--rounds R`` in R
rounds whose order rotates, the medians kept; peak memory is read around one forward+backward.
One row per case and implementation is printed and appended to benchmarks/results.csv with
the GPU, versions, date and command. A peer that is missing or fails is reported as such.

FLOPs: each attended (query, key) pair costs two dot products of length D in the forward
(QK^T and PV), 2 FLOP per multiply-add: 4 * D per pair per head. The backward recomputes
QK^T and computes dV, dP, dQ, dK: 2.5x the forward, the convention of FlashAttention's
benchmarks. Effective TFLOP/s = those FLOPs / time, so skipped work does not count.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from .api import attention
from .pattern.spec import Spec, parse
from .version import __version__

CSV_FIELDS = ["date", "gpu", "torch", "triton", "msa_codegen", "case", "pattern", "impl", "B", "Hq", "Hkv", "N", "D",
              "dtype", "fwd_ms", "fwdbwd_ms", "fwd_tflops", "fwdbwd_tflops", "peak_gib", "setup_s",
              "ratio_fwd", "ratio_fwdbwd", "max_rel_err", "status", "note", "command"]


@dataclasses.dataclass
class Case:
    name: str
    pattern: str
    hq: int = 16
    hkv: int = 16
    n: int = 131072
    d: int = 128
    b: int = 1
    peer: str = "flex"     # "flex" or "sdpa"
    reps_ms: int = 0       # at least this timing budget (long cases need several repetitions)
    dense_ratio: bool = False   # also extrapolate dense causal SDPA to this length


CASES = [
    Case("w4096", "window=4096"),
    Case("w4096-d2", "window=4096,dilation=2"),
    Case("w4096-d4", "window=4096,dilation=4"),
    Case("w4096-s64", "window=4096,sink=64"),
    Case("w4096-d2-s64", "window=4096,dilation=2,sink=64"),   # the README's example
    Case("bidir-w512", "causal=false,window=512", n=65536),
    Case("gqa-w4096", "window=4096", hq=32, hkv=8),
    Case("d64-w4096", "window=4096", hq=32, hkv=32, d=64),
    Case("dense-causal", "causal", n=16384, peer="sdpa"),
    Case("w4096-1M", "window=4096", n=1 << 20, reps_ms=3000, dense_ratio=True),
    # encoder-sized bidirectional windows (BERT / Longformer heads): short sequences, large batch
    Case("enc-w256-4k", "causal=false,window=256", hq=12, hkv=12, n=4096, d=64, b=8),
    Case("enc-w512-4k", "causal=false,window=512", hq=12, hkv=12, n=4096, d=64, b=8),
    Case("enc-w256-8k", "causal=false,window=256", hq=12, hkv=12, n=8192, d=64, b=8),
    Case("enc-w512-8k", "causal=false,window=512", hq=12, hkv=12, n=8192, d=64, b=8),
]


def attended_pairs(spec: Spec, n: int) -> int:
    """Number of visible (query, key) pairs of one head, in O(N) (window/sink/dense terms)."""
    i = torch.arange(n, dtype=torch.float64)
    if spec.dense:
        return n * (n + 1) // 2 if spec.causal else n * n
    if spec.global_ or spec.random:
        raise ValueError("attended_pairs: global and random terms are not counted in closed form")
    total = torch.zeros(n, dtype=torch.float64)
    if spec.window is not None:
        w, d = spec.window, spec.dilation
        total += torch.clamp(torch.floor(i / d) + 1, max=w)
        if not spec.causal:
            total += torch.clamp(torch.floor((n - 1 - i) / d) + 1, max=w) - 1
    if spec.sink:
        s = spec.sink
        visible_sink = torch.clamp(i + 1, max=s) if spec.causal else torch.full_like(i, min(s, n))
        if spec.window is not None:
            # sink keys already inside the window: j = i - t*d < s with 0 <= t < w (and j >= 0)
            w, d = spec.window, spec.dilation
            t_min = torch.clamp(torch.floor((i - s) / d) + 1, min=0)
            t_max = torch.clamp(torch.floor(i / d), max=w - 1)
            overlap = torch.clamp(t_max - t_min + 1, min=0)
            if not spec.causal:
                # keys right of the query inside the sink: j = i + t*d < s, 1 <= t < w
                t_hi = torch.clamp(torch.ceil((s - i) / d) - 1, max=w - 1)
                overlap += torch.clamp(t_hi, min=0)
            visible_sink = visible_sink - overlap
        total += visible_sink
    return int(total.sum().item())


def topk_pairs(block_indices: torch.Tensor, n: int, block: int) -> int:
    """Visible (query, key) pairs of a causal ``topk=K`` pattern alone, summed over the batch and
    KV heads of ``block_indices`` (B, Hkv, n_qb, K), one query head a KV head: each query block's
    distinct valid entries (-1 and later blocks see nothing), its own block causally."""
    idx = block_indices.to("cpu", torch.int64)
    rows = torch.arange(idx.shape[2]).view(1, 1, -1, 1)
    sorted_idx = idx.sort(dim=-1).values
    first = torch.ones_like(sorted_idx, dtype=torch.bool)
    first[..., 1:] = sorted_idx[..., 1:] != sorted_idx[..., :-1]
    keep = first & (sorted_idx >= 0) & (sorted_idx <= rows)
    q_rows = (n - rows * block).clamp(max=block)
    k_cols = (n - sorted_idx.clamp(min=0) * block).clamp(max=block)
    pairs = torch.where(sorted_idx == rows, q_rows * (q_rows + 1) // 2, q_rows * k_cols)
    return int(torch.where(keep, pairs, 0).sum())


def _flops(case: Case) -> float:
    specs = [spec for _, _, spec in parse(case.pattern).head_groups(case.hq)]
    pairs = sum(attended_pairs(s, case.n) * (h1 - h0) for (h0, h1, s) in parse(case.pattern).head_groups(case.hq))
    del specs
    return 4.0 * case.d * pairs * case.b


def _mask_mod(spec: Spec):
    w = spec.window
    d = spec.dilation
    s = spec.sink
    causal = spec.causal
    dense = spec.dense

    span = None if w is None else w * d

    # the cheapest exact form we found: no abs or division on the causal path (the peer
    # evaluates this on every element of its partial blocks, so its cost is the peer's cost)
    def mask_mod(b, h, q_idx, kv_idx):
        delta = q_idx - kv_idx
        if dense:
            return delta >= 0 if causal else delta == delta
        if span is not None:
            local = delta < span
            local = local & (delta >= 0) if causal else local & (delta > -span)
            if d > 1:
                local = local & (delta % d == 0)
        else:
            local = delta != delta
        if s:
            sink = kv_idx < s
            local = local | (sink & (delta >= 0) if causal else sink)
        return local

    return mask_mod


def _time(fn, reps_ms: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(25, reps_ms // 4), rep=reps_ms, return_mode="median"))


def interleaved(work: dict, rounds: int, timer) -> tuple[dict, dict]:
    """Time each name's callables (``work``: name -> callables, in their order) in ``rounds``
    rounds, the names' order rotated one place each round (``timer(fn)`` -> ms). Returns {name:
    [each callable's ms, a list over the rounds]} and {name: the failure that stopped its
    timings}."""
    names = list(work)
    times = {name: [[] for _ in work[name]] for name in names}
    failed = {}
    for r in range(rounds if names else 0):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name in failed:
                continue
            try:
                for fn, ms in zip(work[name], times[name]):
                    ms.append(timer(fn))
            except Exception as e:   # reported in the name's row, never dropped
                failed[name] = f"failed: {type(e).__name__}: {e}"[:200]
    return {n: times[n] for n in names if n not in failed}, failed


def rounds_note(times) -> str:
    """The row note's account of interleaved rounds: their count and each timing's range."""
    (fwd, fwdbwd) = times
    return (f"; {len(fwd)} rounds, the order rotated: fwd {min(fwd):.3f}-{max(fwd):.3f} ms, "
            f"fwd+bwd {min(fwdbwd):.3f}-{max(fwdbwd):.3f} ms")


def settle(work: dict, times: dict, rounds: int, timer) -> tuple[dict, list]:
    """Each name's (forward ms, forward+backward ms, the rounds' note), and a row for each name
    whose rounds failed: with one round the ``times`` already taken ({name: [[fwd ms], [fwd+bwd
    ms]]}), else ``rounds`` rotated rounds of ``work`` (``interleaved``) and their medians."""
    failed = {}
    if rounds > 1:
        times, failed = interleaved(work, rounds, timer)
    done = {name: (*(statistics.median(t) for t in times[name]), rounds_note(times[name]) if rounds > 1 else "")
            for name in work if name not in failed}
    return done, [dict(impl=name, status=status) for name, status in failed.items()]


def _spin_up(seconds: float = 0.5) -> None:
    """Keep the GPU busy with matrix products for ``seconds`` before the first case, so that the
    first case is not timed while the clocks are still rising from idle (the first case of a
    process measured up to 1.17x its later value: BENCHMARKS.md, the encoder rows)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    del a


def _peak(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def kernel_families(fn) -> str:
    """Which kernel family ran one call of ``fn`` (our forward + backward), each direction: a spy
    on the Gluon family's launchers, which ``kernels/launch.py`` calls where that family runs;
    with how it was asked for (``MSA_CODEGEN_GLUON``). For the CSV's note: a row then says which
    kernels it timed."""
    from .kernels import gluon

    ran = []
    real_f, real_b = gluon.forward, gluon.backward

    def spy_f(*a, **kw):
        ran.append("fwd")
        return real_f(*a, **kw)

    def spy_b(*a, **kw):
        ran.append("bwd-fused" if kw.get("fused") else "bwd")
        return real_b(*a, **kw)

    gluon.forward, gluon.backward = spy_f, spy_b
    try:
        fn()
    finally:
        gluon.forward, gluon.backward = real_f, real_b
    fam = {d: "gluon" if d in ran else "triton" for d in ("fwd", "bwd")}
    if "bwd-fused" in ran:
        fam["bwd"] = "gluon fused"
    return f"kernels: {fam['fwd']} fwd, {fam['bwd']} bwd ({gluon._setting()})"


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def label_rows(rows, case, results, dtype) -> None:
    """Give every row its case, shapes and dtype, and each peer row the ratios ours/peer of the
    ``results`` {impl: (fwd_ms, fwdbwd_ms)} (msa-bench and bench_dynamic)."""
    ours = results.get("msa_codegen")
    for row in rows:
        row.update(case=case.name, pattern=case.pattern, B=getattr(case, "b", 1), Hq=case.hq, Hkv=case.hkv, N=case.n, D=case.d,
                   dtype=str(dtype).replace("torch.", ""))
        if ours and row["impl"] in results and row["impl"] != "msa_codegen":
            row["ratio_fwd"] = ours[0] / results[row["impl"]][0]
            row["ratio_fwdbwd"] = ours[1] / results[row["impl"]][1]


def run_case(case: Case, reps_ms: int, dtype=torch.bfloat16, rounds: int = 1, dev: str = "cuda"):
    """Rows of one case: ours and its peer, each checked against ours and timed (forward, then
    forward+backward), ours first. ``rounds`` > 1 times them after both are checked and warm, in
    that many rounds, the implementations' order rotated each round (ours first in the even
    rounds); a row holds the medians over the rounds. Under a power cap a card slows after a
    second of load, so with one round the side timed first runs on a cooler card
    (docs/performance.md, "msa-bench's order"). One round times each side as msa-bench always
    did: its forward before its first forward+backward. ``dev``: where the tensors live (the
    CPU only in tests, with the timer stood in)."""
    reps_ms = max(reps_ms, case.reps_ms)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(case.b, case.hq, case.n, case.d, device=dev, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(case.b, case.hkv, case.n, case.d, device=dev, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(case.b, case.hkv, case.n, case.d, device=dev, dtype=dtype, generator=g).requires_grad_()
    do = torch.randn(case.b, case.hq, case.n, case.d, device=dev, dtype=dtype, generator=g)
    flops_fwd = _flops(case)
    rows = []
    # the bytes the memory bar is stated in: q, k, v, o, do, dq, dk, dv and the LSE
    io_gib = ((4 * q.numel() + 4 * k.numel()) * q.element_size() + q.numel() // case.d * 4) / 2**30

    def ours_fwd():
        return attention(q, k, v, case.pattern)

    t0 = time.perf_counter()
    out = ours_fwd()
    torch.cuda.synchronize()
    setup = time.perf_counter() - t0

    def fwdbwd(f):
        # one forward+backward, the grads cleared after it (none accumulate between calls)
        def run():
            f().backward(do)
            for t in (q, k, v):
                t.grad = None
        return run

    peers = {}
    if case.peer == "sdpa":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F

        def sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=case.hq != case.hkv)
        peers["sdpa-flash"] = (sdpa, 0.0)
    else:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            spec = parse(case.pattern).groups[0].spec
            t0 = time.perf_counter()
            # _compile=True builds the block mask without materialising the N x N element mask
            # (the eager path asks for 16-128 GiB at N=131072)
            bm = create_block_mask(_mask_mod(spec), None, None, case.n, case.n, device=dev, _compile=True)
            torch.cuda.synchronize()
            build = time.perf_counter() - t0
            # static shapes per case: after a second shape torch.compile would switch to a
            # dynamic-shape kernel, which made the peer up to 3x slower in our first runs
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            flex = torch.compile(flex_attention, dynamic=False)

            def flex_run():
                return flex(q, k, v, block_mask=bm, enable_gqa=case.hq != case.hkv)
            peers["flex"] = (flex_run, build)
        except Exception as e:  # reported, never silently dropped
            rows.append(dict(impl="flex", status=f"failed: {type(e).__name__}: {e}"[:200]))

    results = {}
    impls = [("msa_codegen", ours_fwd, setup)] + [(name, f, s) for name, (f, s) in peers.items()]
    # keep every 16th query row of our output for the comparison with the peer, and free the
    # rest, so that peak memory counts only q, k, v, do and what the measured call allocates
    ours_sample = out[:, :, ::16].clone()
    del out
    work = {}    # name: (forward, forward+backward)
    fields = {}  # name: the row's other fields
    times = {}   # one round: name -> [[forward ms], [forward+backward ms]], timed as before --rounds
    for name, f, s in impls:
        try:
            o = f()
            err = _rel(o[:, :, ::16], ours_sample) if name != "msa_codegen" else 0.0
            del o
            if name != "msa_codegen" and not (err < 2e-2):
                raise RuntimeError(f"output differs from ours: rel err {err:.2e}")
            fb = fwdbwd(f)
            if rounds == 1:
                fwd_ms = _time(f, reps_ms)
                fb()
                times[name] = [[fwd_ms], [_time(fb, reps_ms)]]
            else:
                fb()
            peak = _peak(fb)
            family = f"; {kernel_families(fb)}" if name == "msa_codegen" else ""
            work[name] = (f, fb)
            fields[name] = dict(peak_gib=peak, setup_s=s, max_rel_err=err, family=family)
        except Exception as e:
            rows.append(dict(impl=name, status=f"failed: {type(e).__name__}: {e}"[:200]))
        torch.cuda.empty_cache()
    timed, failed = settle(work, times, rounds, lambda fn: _time(fn, reps_ms))
    rows += failed
    for name, (fwd_ms, fwdbwd_ms, order) in timed.items():
        row = fields[name]
        results[name] = (fwd_ms, fwdbwd_ms)
        rows.append(dict(impl=name, fwd_ms=fwd_ms, fwdbwd_ms=fwdbwd_ms,
                         fwd_tflops=flops_fwd / fwd_ms / 1e9, fwdbwd_tflops=3.5 * flops_fwd / fwdbwd_ms / 1e9,
                         peak_gib=row["peak_gib"], setup_s=row["setup_s"], max_rel_err=row["max_rel_err"],
                         status="ok", note=f"peak/io {row['peak_gib'] / io_gib:.2f}{row['family']}{order}"))
    ours = results.get("msa_codegen")
    if case.dense_ratio and ours:
        rows.append(_dense_extrapolation(case, ours, dtype))
    label_rows(rows, case, results, dtype)
    del q, k, v, do, ours_sample
    torch.cuda.empty_cache()
    return rows


def _dense_extrapolation(case: Case, ours, dtype) -> dict:
    """SDPA flash dense causal fwd+bwd at 131072 and 262144, extrapolated as a * N^2 + b * N."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    times = {}
    try:
        for n in (131072, 262144):
            q, k, v, do = (torch.randn(1, case.hq, n, case.d, device="cuda", dtype=dtype) for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_()

            def run():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                o.backward(do)
                for t in (q, k, v):
                    t.grad = None
            times[n] = _time(run, 8000)
            del q, k, v, do
            torch.cuda.empty_cache()
        (n1, t1), (n2, t2) = sorted(times.items())
        a = (t2 / n2 - t1 / n1) / (n2 - n1)
        b = t1 / n1 - a * n1
        est = a * case.n ** 2 + b * case.n
        return dict(impl="sdpa-dense-extrapolated", fwdbwd_ms=est, status="ok-extrapolated",
                    note=f"SDPA flash dense causal fwd+bwd {t1:.0f} ms at {n1}, {t2:.0f} ms at {n2}; "
                         f"ours/dense at N={case.n}: {ours[1] / est:.4f}")
    except Exception as e:
        return dict(impl="sdpa-dense-extrapolated", status=f"failed: {type(e).__name__}: {e}"[:200])


def bench_main(prog: str, cases, run_case, fmt, describe, argv=None, summary=None, rounds=False) -> int:
    """The command of a benchmark module: pick cases, run them, print rows, append the CSV.

    ``run_case(case, reps_ms)`` returns row dicts, ``fmt(row)`` prints one, ``describe(case)``
    heads a case, ``summary(rows)`` (optional) prints a table at the end. ``rounds``: the module's
    ``run_case`` takes ``rounds=`` (interleaved timing rounds), offered as ``--rounds``.
    """
    ap = argparse.ArgumentParser(prog=prog, description=sys.modules[run_case.__module__].__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="all", help="comma-separated case names (default: all): "
                    + ",".join(c.name for c in cases))
    ap.add_argument("--reps-ms", type=int, default=400, help="timing budget per measurement in ms (default 400)")
    ap.add_argument("--csv", default="benchmarks/results.csv", help="CSV to append to (default benchmarks/results.csv)")
    if rounds:
        ap.add_argument("--rounds", type=int, default=1,
                        help="time ours and the peers in this many rounds, their order rotated each round, "
                             "and keep the medians (default 1: ours, then each peer)")
    args = ap.parse_args(argv)
    if rounds and args.rounds < 1:
        ap.error("--rounds wants 1 or more")
    extra = dict(rounds=args.rounds) if rounds else {}
    if not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA GPU", file=sys.stderr)
        return 2
    wanted = None if args.cases == "all" else set(args.cases.split(","))
    unknown = (wanted or set()) - {c.name for c in cases}
    if unknown:
        print(f"{prog}: unknown case(s) {sorted(unknown)}; known: {[c.name for c in cases]}", file=sys.stderr)
        return 2
    import triton

    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                msa_codegen=__version__, command=" ".join(shlex.quote(a) for a in sys.argv))
    all_rows = []
    _spin_up()
    for case in cases:
        if wanted and case.name not in wanted:
            continue
        print(f"[{case.name}] {describe(case)}", flush=True)
        for r in run_case(case, args.reps_ms, **extra):
            r.update(meta)
            print("   ", fmt(r), flush=True)
            all_rows.append(r)
    path = Path(args.csv)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            w.writeheader()
        for r in all_rows:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items() if k in CSV_FIELDS})
    if summary is not None:
        print("\n" + summary(all_rows))
    return 0


def main(argv=None):
    return bench_main("msa-bench", CASES, run_case, _fmt,
                      lambda c: f"{c.pattern} B={c.b} H={c.hq}/{c.hkv} N={c.n} D={c.d}", argv, summary=table,
                      rounds=True)


def _fmt(r) -> str:
    if r.get("status") == "ok-extrapolated":
        return f"{r['impl']:12s} {r['note']}"
    if r.get("status") != "ok":
        return f"{r['impl']:12s} {r.get('status')}"
    s = (f"{r['impl']:12s} fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:6.1f} TF/s | fwd+bwd {r['fwdbwd_ms']:8.3f} ms "
         f"{r['fwdbwd_tflops']:6.1f} TF/s | peak {r['peak_gib']:6.2f} GiB | setup {r['setup_s']:.2f} s")
    if "ratio_fwd" in r:
        s += f" | ours/peer fwd {r['ratio_fwd']:.3f} fwd+bwd {r['ratio_fwdbwd']:.3f} | err {r['max_rel_err']:.1e}"
    return s + f" | {r.get('note', '')}"


def table(rows) -> str:
    out = ["| case | impl | fwd ms | fwd TF/s | fwd+bwd ms | fwd+bwd TF/s | peak GiB | ours/peer fwd | ours/peer fwd+bwd |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.get("status") == "ok-extrapolated":
            out.append(f"| {r['case']} | {r['impl']} | | | {r['fwdbwd_ms']:.0f} | | | | {r['note']} |")
            continue
        if r.get("status") != "ok":
            out.append(f"| {r['case']} | {r['impl']} | {r.get('status')} | | | | | | |")
            continue
        ratios = (f"{r['ratio_fwd']:.3f} | {r['ratio_fwdbwd']:.3f}" if "ratio_fwd" in r
                  else "- | -")   # our own row: the ratios are on the peers' rows
        out.append(f"| {r['case']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.0f} | {r['fwdbwd_ms']:.2f} | "
                   f"{r['fwdbwd_tflops']:.0f} | {r['peak_gib']:.2f} | {ratios} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
