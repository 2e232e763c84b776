"""The Gluon backward's sink pass (``kernels/sink.py``, ``sink_bwd``) alone, in launch variants, one process.

    PYTHONPATH=$PWD python benchmarks/sink_ab.py [--variant 64x3 --variant 32x2 ...] [--baseline OLD.py]
        [--pattern window=4096,sink=64] [--n 131072] [--heads 16] [--head-dim 128] [--forms fused,two-kernel]
        [--rounds 5] [--rep-ms 50] [--flip-chunk-launches]
    bash benchmarks/run.sh sink-ab ARGS

For experiments on the pass (benchmarks/NOTES.md, "The sink pass's row loops"). Per form of the
backward (``fused``: dQ's terms added as the pass converts the fused kernel's fp32 dQ copy;
``two-kernel``: added in place into dQ), one real ``gluon.backward`` of random bf16 inputs runs
first and records the pass's arguments; then each variant runs the pass alone on them:
``default`` (the tree's ``gluon.SINK_BWD_ROWS`` / ``SINK_BWD_STAGES``), ``default-copy`` (the same,
the noise control), each ``--variant ROWSxSTAGES`` and, with ``--baseline``, the ``sink_bwd`` of
another copy of ``kernels/sink.py`` (e.g. ``git show REV:msa_codegen/kernels/sink.py``) at the
tree's rows (stages too if it takes them); with ``--flip-chunk-launches``, the tree's pass with
``gluon.SINK_CHUNK_LAUNCHES`` flipped (``chunk-launches off``: a sink of several key chunks in the
fused form as two launches; ``on``: one launch a chunk, the default). Each variant's dQ, dK and
dV (fresh copies) are first
compared with the default's (relative error: the partial sums' order differs with the tile size,
so expect float32 rounding, not zero); then all are timed in interleaved rounds
(``triton.testing.do_bench`` medians with the L2 flushed; the median round and its interquartile
range). One table last.

Needs a Hopper GPU and a Triton whose Gluon the family runs on. ``--device cpu`` (set
TRITON_INTERPRET=1 before Python starts) runs the pass on synthetic statistics instead of a real
backward's, at small sizes: a smoke test; its wall-clock times mean nothing.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

from msa_codegen.bench import _rel, _time
from msa_codegen.kernels import gluon
from msa_codegen.plan import plan_for
from msa_codegen.tuning.measure import interleaved


def parse_variant(text: str) -> tuple[int, int]:
    """``ROWSxSTAGES`` (e.g. ``64x3``) -> (rows, stages): rows 16, 32, 64 or 128, stages >= 1."""
    rows, sep, stages = text.partition("x")
    try:
        r, s = int(rows), int(stages)
    except ValueError:
        r = s = 0
    if not sep or r not in (16, 32, 64, 128) or s < 1:
        raise ValueError(f"--variant wants ROWSxSTAGES with rows 16, 32, 64 or 128 and stages >= 1, got {text!r}")
    return r, s


def _load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("sink_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pass_arguments(pattern: str, form: str, n: int, h: int, d: int, device: str) -> tuple:
    """The arguments of ``gluon._sink_pass`` for one call: recorded from a real backward on a GPU;
    on the CPU, built from random inputs (statistics synthetic)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, do = (torch.randn(1, h, n, d, device=device, dtype=dtype) for _ in range(4))
    plan = plan_for(pattern, q.device, q.dtype, d, h, h, n)
    if len(plan.groups) != 1 or not plan.groups[0].kernel_plan.sink:
        raise SystemExit(f"--pattern wants one head group with a sink, got {pattern!r}")
    scale = d ** -0.5
    if device != "cuda":
        grp = plan.groups[0]
        lse2 = torch.randn(1, h, n, device=device) + 8.0
        delta = torch.randn(1, h, n, device=device)
        dq = torch.randn_like(q)
        dq_in = torch.randn(q.shape, device=device) if form == "fused" else dq
        return (grp, q, k, v, do, lse2, delta, dq_in, dq, torch.randn_like(k), torch.randn_like(v), scale)
    seen = []
    record = gluon._sink_pass

    def capture(*a):
        seen.append(a)
        return record(*a)

    o, lse = gluon.forward(q, k, v, plan, scale)
    gluon._sink_pass = capture
    try:
        gluon.backward(do, q, k, v, o, lse, None, plan, scale, fused=form == "fused")
    finally:
        gluon._sink_pass = record
    if len(seen) != 1:
        raise SystemExit(f"expected one sink pass, recorded {len(seen)}")
    return seen[0]


def _with(a: tuple) -> tuple:
    """``a`` with fresh copies of dq_in, dq, dk, dv (the fused form's fp32 copy too: a sink of
    several key chunks adds to it in place)."""
    b = list(a)
    b[8], b[9], b[10] = a[8].clone(), a[9].clone(), a[10].clone()
    b[7] = b[8] if a[7] is a[8] else a[7].clone()
    return tuple(b)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", default=[], help="ROWSxSTAGES, e.g. 64x3 (repeatable)")
    ap.add_argument("--baseline", help="another copy of kernels/sink.py whose sink_bwd to time beside the tree's")
    ap.add_argument("--flip-chunk-launches", action="store_true",
                    help="also the tree's pass with gluon.SINK_CHUNK_LAUNCHES flipped (a long sink's fused form: "
                         "a launch a chunk, or two launches)")
    ap.add_argument("--pattern", default="window=4096,sink=64")
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--forms", default="fused,two-kernel")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep-ms", type=int, default=50)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    forms = args.forms.split(",")
    if any(f not in ("fused", "two-kernel") for f in forms):
        raise SystemExit(f"--forms: fused and / or two-kernel, got {args.forms!r}")
    d = args.head_dim
    import msa_codegen.kernels as kernels_pkg
    from msa_codegen.kernels import sink as tree_sink

    base_rows, base_stages = gluon.SINK_BWD_ROWS[d], gluon.SINK_BWD_STAGES
    variants = {"default": (tree_sink, base_rows, base_stages), "default-copy": (tree_sink, base_rows, base_stages)}
    for text in args.variant:
        try:
            variants[text] = (tree_sink, *parse_variant(text))
        except ValueError as e:
            ap.error(str(e))
    if args.baseline:
        variants[f"baseline {Path(args.baseline).name}"] = (_load_baseline(args.baseline), base_rows, base_stages)
    base_chunked = gluon.SINK_CHUNK_LAUNCHES
    flipped = f"chunk-launches {'off' if base_chunked else 'on'}"
    if args.flip_chunk_launches:
        variants[flipped] = (tree_sink, base_rows, base_stages)

    def use(name):
        mod, rows, stages = variants[name]
        kernels_pkg.sink = mod          # what _sink_pass imports (``from . import sink``)
        sys.modules["msa_codegen.kernels.sink"] = mod
        gluon.SINK_BWD_ROWS[d], gluon.SINK_BWD_STAGES = rows, stages
        gluon.SINK_CHUNK_LAUNCHES = (not base_chunked) if name == flipped else base_chunked

    def run_pass(a):
        if "STAGES" not in sys.modules["msa_codegen.kernels.sink"].sink_bwd.arg_names:
            # a copy from before the stages: the launcher's keyword goes unpassed
            launch = gluon.direct.launch
            gluon.direct.launch = lambda kern, grid, *x, STAGES=None, **kw: launch(kern, grid, *x, **kw)
            try:
                gluon._sink_pass(*a)
            finally:
                gluon.direct.launch = launch
        else:
            gluon._sink_pass(*a)

    if args.device == "cuda":
        timer = lambda fn: _time(fn, args.rep_ms)  # noqa: E731
    else:
        def timer(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    table = []
    try:
        for form in forms:
            a = pass_arguments(args.pattern, form, args.n, args.heads, d, args.device)
            outs = {}
            for name in variants:
                use(name)
                b = _with(a)
                run_pass(b)
                outs[name] = b[8:11]
            errs = {name: max(_rel(x, y) for x, y in zip(outs[name], outs["default"])) for name in variants}
            del outs

            def time_one(name, a=a):
                use(name)
                return timer(lambda: run_pass(a))
            res = interleaved(time_one, list(variants), args.rounds)
            for name, (med, iqr) in res.items():
                table.append((form, name, med, iqr, med / res["default"][0], errs[name]))
            del a
            if args.device == "cuda":
                torch.cuda.empty_cache()
    finally:
        use("default")
        kernels_pkg.sink = tree_sink
        sys.modules["msa_codegen.kernels.sink"] = tree_sink
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\n{args.pattern} N={args.n} H={args.heads} D={d} on {where}, the pass alone, {args.rounds} interleaved rounds")
    print("| form | variant | median ms | IQR ms | vs default | rel. error vs default |")
    print("| --- | --- | --- | --- | --- | --- |")
    for form, name, med, iqr, ratio, err in table:
        print(f"| {form} | {name} | {med:.3f} | {iqr:.3f} | {ratio:.3f}x | {err:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
