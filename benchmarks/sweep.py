"""Time launch configurations of one case, forward and backward separately (GPU).

    python benchmarks/sweep.py --pattern window=4096,dilation=2 --n 131072 --heads 16 --head-dim 128

A quick hand sweep for picking heuristic defaults; the Optuna tuner is msa-tune.
"""
import argparse
import itertools

import torch
import triton.testing

import msa_codegen as msa
from msa_codegen.bench import attended_pairs
from msa_codegen.config import BwdConfig, FwdConfig, LaunchConfig, default_config, use_config

FWD = [FwdConfig(*c) for c in [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3),
                               (128, 64, 4, 3), (64, 128, 4, 2)]]
DKDV = [(16, 128, 8, 2), (32, 128, 8, 2), (32, 64, 8, 2), (16, 64, 4, 2), (64, 64, 8, 1), (32, 64, 4, 2)]
DQ = [(64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 1), (64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pattern", default="window=4096,dilation=2")
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rep", type=int, default=200)
    a = ap.parse_args()
    dev = torch.device("cuda")
    q, k, v, do = (torch.randn(1, a.heads, a.n, a.head_dim, device=dev, dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    spec = msa.parse(a.pattern).groups[0].spec
    flops = 4.0 * a.head_dim * a.heads * attended_pairs(spec, a.n)
    base = default_config(dev, a.head_dim, torch.bfloat16)
    print(f"{a.pattern} H={a.heads} N={a.n} D={a.head_dim}; default {base}")
    rows = []
    for f in FWD:
        cfg = LaunchConfig(f, base.bwd)
        try:
            with use_config(cfg):
                ms = triton.testing.do_bench(lambda: msa.attention(q, k, v, a.pattern), rep=a.rep, return_mode="median")
            rows.append(("fwd", f, ms, flops / ms / 1e9))
        except Exception as e:
            rows.append(("fwd", f, float("nan"), str(e)[:60]))
    for m1, m2 in itertools.product(DKDV, DQ[:1]):
        rows += _bwd(q, k, v, do, a, base, m1, m2, flops)
    for m1, m2 in itertools.product(DKDV[:1], DQ[1:]):
        rows += _bwd(q, k, v, do, a, base, m1, m2, flops)
    for r in rows:
        print(f"{r[0]:4s} {str(r[1]):90s} {r[2]:9.3f} ms  {r[3] if isinstance(r[3], str) else f'{r[3]:6.1f} TF/s'}")


def _bwd(q, k, v, do, a, base, m1, m2, flops):
    cfg = LaunchConfig(base.fwd, BwdConfig(*m1, *m2))
    try:
        with use_config(cfg):
            out = msa.attention(q, k, v, a.pattern)
            ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                         rep=a.rep, return_mode="median")
        return [("bwd", cfg.bwd, ms, 2.5 * flops / ms / 1e9)]
    except Exception as e:
        return [("bwd", cfg.bwd, float("nan"), str(e)[:60])]


if __name__ == "__main__":
    main()
