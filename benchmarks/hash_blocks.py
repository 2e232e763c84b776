"""Key blocks visited per forward on the Hash-sparse rows: ours against FlexAttention's block mask (CPU).

    python benchmarks/hash_blocks.py [--n 8192 16384] [--buckets 8] [--heads 16]
    python benchmarks/hash_blocks.py --time [--n 8192 16384] [--rounds 3]          # GPU: the floor probe

Our positional forward of a dense causal pattern with buckets runs, per 128-row query tile, the
blocks of BLOCK_N keys from the start of the tile's first bucket to the last row's position in
its last bucket (``_q_hull`` and ``_lower_bound`` in templates/_positions.py.jinja,
``positional_query_phases`` in _phases.py.jinja); the blocks that lie inside [f_lo, f_hi) of a
one-bucket tile run unmasked. FlexAttention visits the 128 x 128 blocks of its block mask with
any visible pair (full ones without mask_mod). Both are counted here on bench_dynamic's inputs
(its generator and seed, B=1, D=128, bf16, ``hash_inputs``; hashed on the CPU, so a bucket may
differ from the GPU's where bf16 products round differently), with the pairs they need, to tell
work from per-block cost.

``--time`` (GPU) is the floor probe of issue 19's Hash-sparse rows. With q and k sorted by
(bucket, position), a query's visible keys are one range of the sorted keys, from its bucket's
start to its position: the block structure of causal packed documents, one document a bucket.
It times, in interleaved rounds of one process (``triton.testing.do_bench`` medians, the best
round kept), bench_dynamic's Hash-sparse call (our positional Triton kernels) and FlexAttention
on its mask, next to dense ``causal`` over B equal packed documents (``cu_seqlens``, one a
bucket) through the Triton kernels and through the Gluon family (``MSA_CODEGEN_GLUON=0`` / ``1``):
what the same number of causal blocks per tile costs without per-head ranges to search. For
each it also sums the profiler's kernel times of one forward+backward (host-bound when the timed
call takes longer than its kernels).
"""
import argparse
import math

import torch

from msa_codegen.bench_dynamic import hash_inputs


def count(n: int, buckets: int, heads: int, block_m: int = 128, block_n: int = 128, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(1, heads, n, 128, generator=g).to(torch.bfloat16) for _ in range(3))
    _, _, _, qp, kp, qb, kb = hash_inputs(q, k, v, buckets)
    ours_masked = ours_unmasked = flex_partial = flex_full = pairs = 0
    for h in range(heads):
        p, s, kpos, kseg = qp[0, h].long(), qb[0, h].long(), kp[0, h].long(), kb[0, h].long()
        keys = (kseg << 32) | kpos

        def lower_bound(seg, pos):
            return int(torch.searchsorted(keys, torch.tensor((seg << 32) | pos)))

        for a0 in range(0, n, block_m):
            a1 = min(a0 + block_m, n) - 1
            sa, pa, sb, pb = int(s[a0]), int(p[a0]), int(s[a1]), int(p[a1])
            w_lo, w_hi = lower_bound(sa, 0), lower_bound(sb, pb + 1)
            n_blk = math.ceil(max(w_hi - w_lo, 0) / block_n)
            f_lo = w_lo
            f_hi = min(lower_bound(sa, pa + 1), w_hi) if sa == sb else f_lo
            k_lo = min(math.ceil(max(f_lo - w_lo, 0) / block_n), n_blk)
            k_hi = min(max(max(f_hi - w_lo, 0) // block_n, k_lo), n_blk)
            ours_unmasked += k_hi - k_lo
            ours_masked += n_blk - (k_hi - k_lo)
            vis = (s[a0:a1 + 1, None] == kseg[None, :]) & (kpos[None, :] <= p[a0:a1 + 1, None])
            pairs += int(vis.sum())
            per_block = vis.view(a1 + 1 - a0, -1, block_n)
            any_b, all_b = per_block.any(0).any(-1), per_block.all(0).all(-1)
            flex_full += int(all_b.sum())
            flex_partial += int((any_b & ~all_b).sum())
    return dict(ours_masked=ours_masked, ours_unmasked=ours_unmasked, flex_partial=flex_partial, flex_full=flex_full,
                pairs_in_blocks=pairs / (block_m * block_n))


def _kernel_ms(fn, reps: int = 20) -> float:
    """The profiler's device time of the CUDA kernels of one call of ``fn`` (mean of ``reps``)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return us / reps / 1000


def time_floor(n: int, buckets: int, heads: int, rounds: int, reps_ms: int = 100) -> list[dict]:
    import os

    import msa_codegen as msa
    from msa_codegen.bench import _time
    from msa_codegen.bench_dynamic import DynCase, build
    from msa_codegen.kernels import gluon

    ours, peers, grads, _ = build(DynCase(f"hash{buckets}", "hash", "causal", n, hq=heads, hkv=heads), "cuda")
    flex = peers["flex-hashmask"][0]
    g = torch.Generator(device="cpu").manual_seed(1)
    q, k, v = (torch.randn(1, heads, n, 128, generator=g).to("cuda", torch.bfloat16).requires_grad_() for _ in range(3))
    cu = torch.linspace(0, n, buckets + 1).round().to(torch.int32).cuda()

    def docs():
        return msa.attention(q, k, v, "causal", cu_seqlens=cu)
    cases = [("ours, Hash-sparse (positional Triton)", ours, grads, None),
             ("FlexAttention, Hash-sparse mask", flex, grads, None),
             (f"{buckets} equal documents, Triton", docs, (q, k, v), "0"),
             (f"{buckets} equal documents, Gluon", docs, (q, k, v), "1")]
    do = torch.randn(1, heads, n, 128, device="cuda", dtype=torch.bfloat16)
    best = {name: [float("inf"), float("inf")] for name, *_ in cases}
    kernels = {}
    for r in range(rounds):
        for name, fn, leaves, family in cases:
            if family is None:
                os.environ.pop(gluon.ENV, None)
            else:
                os.environ[gluon.ENV] = family

            def fb(fn=fn, leaves=leaves):
                fn().backward(do)
                for t in leaves:
                    t.grad = None
            f = _time(fn, reps_ms)
            fbt = _time(fb, reps_ms)
            best[name] = [min(best[name][0], f), min(best[name][1], fbt)]
            if r == 0:
                kernels[name] = _kernel_ms(fb)
    os.environ.pop(gluon.ENV, None)
    return [dict(case=name, n=n, fwd_ms=best[name][0], fwdbwd_ms=best[name][1], kernels_ms=kernels[name])
            for name, *_ in cases]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--buckets", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--time", action="store_true", help="GPU: the floor probe (module docstring)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.time:
        rows = [r for n in a.n for r in time_floor(n, a.buckets, a.heads, a.rounds)]
        print("| N | case | fwd ms | fwd+bwd ms | kernels of a fwd+bwd, ms |")
        print("| --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['n']} | {r['case']} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | {r['kernels_ms']:.3f} |")
        return
    for n in a.n:
        c = count(n, a.buckets, a.heads)
        ours, flex = c["ours_masked"] + c["ours_unmasked"], c["flex_partial"] + c["flex_full"]
        print(f"N={n}, {a.buckets} buckets, H={a.heads}: ours {ours} blocks ({c['ours_masked']} masked), "
              f"FlexAttention {flex} ({c['flex_partial']} partial); the visible pairs fill "
              f"{c['pairs_in_blocks']:.0f} blocks of 128 x 128")


if __name__ == "__main__":
    main()
