"""The Gluon family's fused backward against its two-kernel backward, through ``attention``, in one process (GPU).

    PYTHONPATH=$PWD python benchmarks/fused_ab.py [CASES] [--rounds 3] [--rep 300]
    bash benchmarks/run.sh fused-ab [CASES]

CASES: comma-separated names of ``msa_codegen.bench_dynamic`` cases (default
docs-w4096,docs-causal,topk16,topk16-gqa), or ``gqa-w4096``: msa-bench's plain ``window=4096``
row with GQA 32/8 at N=131072, run with ``MSA_CODEGEN_GLUON=1``. Each case's forward+backward
(``attention(...)`` then ``.backward``) is timed with ``attention(..., deterministic=False)``
(the fused backward where ``gluon.fused_reason`` allows it) and ``deterministic=True`` (the
two-kernel one), passed to every call of the case's closure. Not through PyTorch's
deterministic mode: that mode also fills every ``torch.empty`` with NaNs and swaps other
operations' algorithms, which cost the top-k GQA case 4% with the same kernels on both sides
(H200, 2026-12-04 13:46 UTC). ``--force``: the fused form even where ``fused_reason`` refuses
it (to measure those cases). Interleaved rounds, ``triton.testing.do_bench`` medians; the best
round per side and their ratio, one line a case.
"""
from __future__ import annotations

import argparse
import os
import warnings

import torch
import triton.testing

import msa_codegen
from msa_codegen import bench_dynamic as bd
from msa_codegen.bench import _spin_up
from msa_codegen.kernels import gluon

_attention = msa_codegen.attention
_det = {"value": True}


def attention(*args, **kwargs):
    """msa_codegen.attention with the side's ``deterministic`` (the cases' closures call this)."""
    return _attention(*args, deterministic=_det["value"], **kwargs)


def _plain_gqa():
    """msa-bench's gqa-w4096 row: the closure, its leaves."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 32, 131072, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(1, 8, 131072, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    return (lambda: attention(q, k, v, "window=4096")), (q, k, v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="?", default="docs-w4096,docs-causal,topk16,topk16-gqa")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--rep", type=int, default=300, help="do_bench's budget in ms (default 300)")
    ap.add_argument("--force", action="store_true", help="the fused form wherever this Triton has it")
    args = ap.parse_args(argv)
    bd.attention = attention   # the closures of bench_dynamic.build
    if args.force:
        real = gluon.fused_reason
        gluon.fused_reason = lambda kplans=(), group=1: real()
    warnings.filterwarnings("ignore")
    _spin_up(1.0)
    for name in args.cases.split(","):
        if name == "gqa-w4096":
            os.environ["MSA_CODEGEN_GLUON"] = "1"
            ours, grads = _plain_gqa()
        else:
            os.environ.pop("MSA_CODEGEN_GLUON", None)
            case = next((c for c in bd.CASES if c.name == name), None)
            if case is None:
                raise SystemExit(f"unknown case {name!r}: bench_dynamic's names or gqa-w4096")
            ours, _, grads, _ = bd.build(case, with_peers=False)
        g = torch.Generator(device="cuda").manual_seed(1)
        o = ours()
        do = torch.randn(o.shape, device="cuda", dtype=o.dtype, generator=g)

        def fwd_bwd():
            ours().backward(do)
            for t in grads:
                t.grad = None

        res = {True: [], False: []}
        for _ in range(args.rounds):
            for det in (False, True):
                _det["value"] = det
                fwd_bwd()
                res[det].append(triton.testing.do_bench(fwd_bwd, warmup=30, rep=args.rep, return_mode="median"))
        fused, two = min(res[False]), min(res[True])
        print(f"{name}: fused {fused:.3f} ms, two kernels {two:.3f} ms, ratio {fused / two:.3f}; rounds "
              f"{[round(x, 3) for x in res[False]]} / {[round(x, 3) for x in res[True]]}", flush=True)
        del ours, grads, o, do
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
