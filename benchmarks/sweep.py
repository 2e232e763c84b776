"""Time launch configurations of one case, forward and backward separately (GPU).

    python benchmarks/sweep.py --pattern window=4096,dilation=2 --n 131072 --heads 16 --head-dim 128

A quick hand sweep for picking heuristic defaults; the Optuna tuner is msa-tune.
``--hash-buckets K``: the Hash-sparse inputs of bench_dynamic (rows sorted by K LSH buckets, their
positions and buckets passed to ``attention``), e.g.
``--pattern causal --n 8192 --hash-buckets 8 --fwd "128,128,8,3;128,64,8,2;64,64,4,2"``.
A ``topk=K`` pattern gets bench_dynamic's inputs too: block indices from ``select_blocks`` on the
same q and k (not timed), e.g. ``--pattern topk=16 --dkdv "64,64,4,2;128,128,8,2" --dq "128,64,8,3"``.
"""
import argparse
import itertools
import os

import torch
import triton.testing

import msa_codegen as msa
from msa_codegen.bench import attended_pairs
from msa_codegen.config import BwdConfig, FwdConfig, LaunchConfig, use_config
from msa_codegen.heuristics import default_config
from msa_codegen.kernels import gluon

FWD = [FwdConfig(*c) for c in [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3),
                               (128, 64, 4, 3), (64, 128, 4, 2), (128, 64, 8, 4), (64, 64, 4, 4), (128, 128, 8, 3),
                               (128, 128, 4, 3), (64, 128, 4, 3)]]
DKDV = [(32, 64, 4, 2), (16, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (16, 128, 4, 2), (64, 32, 4, 2),
        (32, 64, 4, 3), (64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 1)]
DQ = [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 2), (128, 128, 8, 2), (128, 32, 8, 3)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pattern", default="window=4096,dilation=2")
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--fwd-only", action="store_true", help="only the forward configurations, no profile")
    ap.add_argument("--bwd-only", action="store_true", help="only the backward configurations")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-kernel profile of the default config")
    ap.add_argument("--pointers", action="store_true", help="K/V through pointer loads, not tensor descriptors")
    ap.add_argument("--fwd", help="forward configs to time instead of the built-in list: 'm,n,warps,stages;...'")
    ap.add_argument("--dkdv", help="dk/dv configs (block_m1,block_n1,warps,stages;...) instead of the built-in list")
    ap.add_argument("--dq", help="dq configs (block_m2,block_n2,warps,stages;...) instead of the built-in list")
    ap.add_argument("--hash-buckets", type=int, default=0,
                    help="Hash-sparse inputs: rows sorted by this many LSH buckets (bench_dynamic.hash_inputs)")
    a = ap.parse_args()
    os.environ[gluon.ENV] = "0"   # the configs swept are the Triton kernels' (the automatic choice may run Gluon)
    fwd_cfgs = [FwdConfig(*c) for c in _configs(a.fwd)] if a.fwd else FWD
    dkdv_cfgs = _configs(a.dkdv) if a.dkdv else DKDV
    dq_cfgs = _configs(a.dq) if a.dq else DQ
    if a.pointers:
        from msa_codegen.kernels.tma import use_descriptors

        use_descriptors(False).__enter__()   # for the whole run
    dev = torch.device("cuda")
    q, k, v, do = (torch.randn(a.batch, a.heads, a.n, a.head_dim, device=dev, dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    spec = msa.parse(a.pattern).groups[0].spec
    extra = {}
    if a.hash_buckets:
        from msa_codegen.bench_dynamic import hash_inputs

        q, k, v, qp, kp, qb, kb = hash_inputs(q, k, v, a.hash_buckets)
        extra = dict(q_pos=qp, k_pos=kp, q_bucket=qb, k_bucket=kb)
        pairs = hash_pairs(spec, qp, kp, qb, kb) / (a.batch * a.heads)
    elif spec.topk:
        from msa_codegen.sparsity.selection import select_blocks

        idx = select_blocks(q.detach(), k.detach(), spec.topk, block=spec.block)
        extra = dict(block_indices=idx)
        pairs = topk_pairs(idx, spec.block, a.n, spec.causal) / (a.batch * a.heads)
    else:
        pairs = attended_pairs(spec, a.n)
    flops = 4.0 * a.head_dim * a.heads * a.batch * pairs
    base = default_config(dev, a.head_dim, torch.bfloat16, pattern=str(msa.parse(a.pattern)),
                          buckets=bool(a.hash_buckets))
    what = f", {a.hash_buckets} hash buckets" if a.hash_buckets else ""
    print(f"{a.pattern} B={a.batch} H={a.heads} N={a.n} D={a.head_dim}{what}; default {base}")

    def attention(q, k, v, pattern):
        return msa.attention(q, k, v, pattern, **extra)
    rows = []
    for f in ([] if a.bwd_only else fwd_cfgs):
        cfg = LaunchConfig(f, base.bwd)
        try:
            with use_config(cfg):
                ms = triton.testing.do_bench(lambda: attention(q, k, v, a.pattern), rep=a.rep, return_mode="median")
            rows.append(("fwd", f, ms, flops / ms / 1e9))
        except Exception as e:
            rows.append(("fwd", f, float("nan"), str(e)[:60]))
    if not a.fwd_only:
        for m1, m2 in itertools.product(dkdv_cfgs, dq_cfgs[:1]):
            rows += _bwd(attention, q, k, v, do, a, base, m1, m2, flops)
        for m1, m2 in itertools.product(dkdv_cfgs[:1], dq_cfgs[1:]):
            rows += _bwd(attention, q, k, v, do, a, base, m1, m2, flops)
        if not a.no_profile:
            _profile(attention, q, k, v, do, a)
    for r in rows:
        print(f"{r[0]:4s} {str(r[1]):90s} {r[2]:9.3f} ms  {r[3] if isinstance(r[3], str) else f'{r[3]:6.1f} TF/s'}")


def _configs(text):
    return [tuple(int(x) for x in part.split(",")) for part in text.split(";") if part.strip()]


def hash_pairs(spec, qp, kp, qb, kb) -> float:
    """Visible (query, key) pairs over every batch and head of a dense pattern with buckets: keys
    of the query's bucket (at or before its position when causal), counted by binary search on
    the sorted (bucket, position) keys."""
    if not spec.dense:
        raise SystemExit("--hash-buckets counts the pairs of a dense pattern ('causal' or 'causal=false')")
    # q side (B, H, N), k side (B, Hkv, N): each query head searches its KV head's keys
    kkey = ((kb.long() << 32) | kp.long()).repeat_interleave(qb.shape[1] // kb.shape[1], dim=1).contiguous()
    qkey_hi = ((qb.long() << 32) | (qp.long() + 1)) if spec.causal else ((qb.long() + 1) << 32)
    lo = torch.searchsorted(kkey, (qb.long() << 32).contiguous())
    hi = torch.searchsorted(kkey, qkey_hi.contiguous())
    return float((hi - lo).sum())


def topk_pairs(idx, block: int, n: int, causal: bool) -> float:
    """Visible (query, key) pairs of the selected blocks, summed over the batch and the query heads
    (a selection of shape (B, Hkv, nb, K) is shared by the Hkv heads' query heads; ``--heads`` is
    the query heads, so GQA is not modelled here: Hkv = heads). -1 entries are empty slots; with
    ``causal`` a query block's own block counts its lower triangle and later blocks nothing."""
    nb = idx.shape[2]
    qb = torch.arange(nb, device=idx.device)[None, None, :, None]
    rows = torch.clamp(n - qb * block, max=block)                # query rows of the block
    full = (idx >= 0) & ((idx < qb) if causal else True)
    cols = torch.clamp(n - idx.clamp(min=0).long() * block, max=block)
    pairs = (full * rows * cols).sum()
    if causal:
        pairs = pairs + ((idx == qb) * rows * (rows + 1) // 2).sum()
    return float(pairs)


def _profile(attention, q, k, v, do, a):
    """CUDA time per kernel of one forward + backward with the default config."""
    from torch.profiler import ProfilerActivity, profile

    out = attention(q, k, v, a.pattern)
    torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            out = attention(q, k, v, a.pattern)
            torch.autograd.grad(out, (q, k, v), do)
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0):
            t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
            if t:
                times[e.key] = times.get(e.key, 0) + t / 3 / 1000
    for name, ms in sorted(times.items(), key=lambda x: -x[1])[:8]:
        print(f"  kernel {name[:60]:60s} {ms:8.3f} ms per fwd+bwd")


def _bwd(attention, q, k, v, do, a, base, m1, m2, flops):
    cfg = LaunchConfig(base.fwd, BwdConfig(*m1, *m2))
    try:
        with use_config(cfg):
            out = attention(q, k, v, a.pattern)
            ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                         rep=a.rep, return_mode="median")
        return [("bwd", cfg.bwd, ms, 2.5 * flops / ms / 1e9)]
    except Exception as e:
        return [("bwd", cfg.bwd, float("nan"), str(e)[:60])]


if __name__ == "__main__":
    main()
