"""One forward and one backward of a case, for Nsight Compute (GPU; run 16).

    ncu --clock-control none --kernel-name regex:'msa_(fwd|bwd_dq|bwd_dkdv)' --launch-count 3 \\
        --section SpeedOfLight --section WarpStateStats ... python3 benchmarks/ncu_case.py [--pattern window=4096] [--n 32768]

The kernels compile on the first call, which is also the profiled one (Triton launches nothing
else of ours before it); a shorter N than the benchmark's keeps ncu's kernel replays short while
each program does the same work as at N=131072 (the window's tiles past the first ones are alike).
"""
import argparse

import torch

import msa_codegen as msa

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--pattern", default="window=4096")
ap.add_argument("--n", type=int, default=32768)
ap.add_argument("--heads", type=int, default=16)
ap.add_argument("--kv-heads", type=int, default=0)
ap.add_argument("--head-dim", type=int, default=128)
a = ap.parse_args()
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(1, a.heads, a.n, a.head_dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
k, v = (torch.randn(1, a.kv_heads or a.heads, a.n, a.head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        .requires_grad_() for _ in range(2))
out = msa.attention(q, k, v, a.pattern)
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
print("done", a.pattern, a.n, flush=True)
