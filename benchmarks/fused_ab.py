"""The Gluon family's fused backward against its two-kernel backward, through ``attention``, in one process (GPU).

    PYTHONPATH=$PWD python benchmarks/fused_ab.py [CASES] [--rounds 3] [--rep 300]
    bash benchmarks/run.sh fused-ab [CASES]

CASES: comma-separated names of ``msa_codegen.bench_dynamic`` cases (default
docs-w4096,docs-causal,topk16,topk16-gqa), or of msa-bench's cases (``msa_codegen.bench``:
``gqa-w4096``, ``enc-w256-4k``, ...: plain patterns, run with ``MSA_CODEGEN_GLUON=1``). Each
case's forward+backward (``attention(...)`` then ``.backward``) is timed with
``attention(..., deterministic=False)`` (the fused backward where ``gluon.fused_reason`` allows
it) and ``deterministic=True`` (the two-kernel one), passed to every call of the case's closure;
msa-bench's cases add a third side, the Triton family (``MSA_CODEGEN_GLUON=0``), so that one
process says which backward a plain window should take by default. Not through PyTorch's
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
from msa_codegen import bench
from msa_codegen import bench_dynamic as bd
from msa_codegen.bench import _spin_up
from msa_codegen.kernels import gluon

_attention = msa_codegen.attention
_det = {"value": True}


def attention(*args, **kwargs):
    """msa_codegen.attention with the side's ``deterministic`` (the cases' closures call this)."""
    return _attention(*args, deterministic=_det["value"], **kwargs)


def _plain(case: bench.Case):
    """An msa-bench row (bf16): the closure, its leaves."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(case.b, case.hq, case.n, case.d, device="cuda", dtype=torch.bfloat16,
                    generator=g).requires_grad_()
    k, v = (torch.randn(case.b, case.hkv, case.n, case.d, device="cuda", dtype=torch.bfloat16,
                        generator=g).requires_grad_() for _ in range(2))
    return (lambda: attention(q, k, v, case.pattern)), (q, k, v)


def _side(side) -> None:
    """Set one side's ``deterministic`` and ``MSA_CODEGEN_GLUON`` (read on every call)."""
    _, deterministic, setting = side
    _det["value"] = deterministic
    if setting is None:
        os.environ.pop("MSA_CODEGEN_GLUON", None)
    else:
        os.environ["MSA_CODEGEN_GLUON"] = setting


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
        gluon.fused_reason = lambda *a, **kw: real()
    warnings.filterwarnings("ignore")
    _spin_up(1.0)
    plain = {c.name: c for c in bench.CASES}
    for name in args.cases.split(","):
        # the sides: (label, deterministic, MSA_CODEGEN_GLUON or None for unset)
        if name in plain:
            sides = [("fused", False, "1"), ("two kernels", True, "1"), ("triton", True, "0")]
            ours, grads = _plain(plain[name])
        else:
            sides = [("fused", False, None), ("two kernels", True, None)]
            case = next((c for c in bd.CASES if c.name == name), None)
            if case is None:
                raise SystemExit(f"unknown case {name!r}: the names of bench_dynamic's or msa-bench's cases")
            ours, _, grads, _ = bd.build(case, with_peers=False)
        _side(sides[0])
        g = torch.Generator(device="cuda").manual_seed(1)
        o = ours()
        do = torch.randn(o.shape, device="cuda", dtype=o.dtype, generator=g)

        def fwd_bwd():
            ours().backward(do)
            for t in grads:
                t.grad = None

        res = {side[0]: [] for side in sides}
        for _ in range(args.rounds):
            for side in sides:
                _side(side)
                fwd_bwd()
                res[side[0]].append(triton.testing.do_bench(fwd_bwd, warmup=30, rep=args.rep, return_mode="median"))
        best = {label: min(times) for label, times in res.items()}
        fused, two = best["fused"], best["two kernels"]
        line = f"{name}: fused {fused:.3f} ms, two kernels {two:.3f} ms, ratio {fused / two:.3f}"
        if "triton" in best:
            line += (f"; Triton family {best['triton']:.3f} ms (fused / Triton {fused / best['triton']:.3f}, "
                     f"two kernels / Triton {two / best['triton']:.3f})")
        rounds = " / ".join(str([round(x, 3) for x in times]) for times in res.values())
        print(f"{line}; rounds {rounds}", flush=True)
        del ours, grads, o, do
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
