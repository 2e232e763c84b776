"""msa-codegen: look at what the compiler makes of a pattern, and run the example.

    msa-codegen demo                       # the README example (reduced, in the interpreter, without a GPU)
    msa-codegen render --pattern window=4096,dilation=2 --direction fwd
    msa-codegen mask --pattern window=3,dilation=2,sink=1 --seqlen 12
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _fail(msg: str) -> int:
    print(f"msa-codegen: error: {msg}", file=sys.stderr)
    return 2


def cmd_demo(args) -> int:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is loaded
    import msa_codegen as msa

    pattern = args.pattern
    if cuda:
        dev, dtype, (hq, hkv, n, d) = "cuda", torch.bfloat16, (16, 4, args.seqlen or 131072, 128)
    else:
        dev, dtype, (hq, hkv, n, d) = "cpu", torch.float32, (4, 1, args.seqlen or 512, 64)
        print("no CUDA GPU: running the generated kernels in Triton's interpreter at a reduced size")
    pat = msa.parse(pattern)
    print(f"pattern {str(pat)!r}: q (1, {hq}, {n}, {d}), k/v (1, {hkv}, {n}, {d}), {str(dtype)[6:]} on {dev}")
    q = torch.randn(1, hq, n, d, device=dev, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, hkv, n, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    t0 = time.perf_counter()
    out = msa.attention(q, k, v, pat)
    out.float().sum().backward()
    if cuda:
        torch.cuda.synchronize()
    print(f"forward + backward (first call, kernels compiled): {time.perf_counter() - t0:.2f} s")
    # check the first rows against the dense float64 reference
    m = min(n, 2048 if cuda else n)
    qs, ks, vs = (t.detach()[:, :, :m] for t in (q, k, v))
    ref = msa.reference_attention(qs, ks, vs, pat)
    small = msa.attention(qs, ks, vs, pat)
    err = ((small.double() - ref).norm() / ref.norm()).item()
    print(f"relative error against the float64 reference (first {m} positions): {err:.2e}")
    ok = err < (2e-2 if dtype == torch.bfloat16 else 1e-4)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def cmd_render(args) -> int:
    import msa_codegen as msa
    from msa_codegen import codegen
    from msa_codegen.lowering import lower

    pat = msa.parse(args.pattern)
    for group in pat.groups:
        if len(pat.groups) > 1:
            print(f"# ---- heads {group.heads} ----")
        print(codegen.render(lower(group.spec), args.direction), end="")
    return 0


def cmd_mask(args) -> int:
    import msa_codegen as msa

    m = msa.mask(args.pattern, args.seqlen, args.heads)
    for h in range(args.heads):
        if args.heads > 1:
            print(f"head {h}")
        for row in m[h].tolist():
            print("".join("#" if x else "." for x in row))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="msa-codegen", description="sparse attention patterns compiled to Triton")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="run the README example and check it against the reference")
    p.add_argument("--pattern", default="window=4096,dilation=2,sink=64", help="default: %(default)s")
    p.add_argument("--seqlen", type=int, default=None, help="default: 131072 on a GPU, 512 in the interpreter")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("render", help="print the generated Triton source of a pattern")
    p.add_argument("--pattern", required=True)
    p.add_argument("--direction", choices=("fwd", "bwd"), default="fwd", help="default: %(default)s")
    p.set_defaults(fn=cmd_render)
    p = sub.add_parser("mask", help="draw the element mask in ASCII ('#' = visible)")
    p.add_argument("--pattern", required=True)
    p.add_argument("--seqlen", type=int, default=16, help="default: %(default)s")
    p.add_argument("--heads", type=int, default=1, help="default: %(default)s")
    p.set_defaults(fn=cmd_mask)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:   # PatternError and argument errors: one line, no traceback
        return _fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
