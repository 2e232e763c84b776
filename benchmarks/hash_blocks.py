"""Key blocks visited per forward on the Hash-sparse rows: ours against FlexAttention's block mask (CPU).

    python benchmarks/hash_blocks.py [--n 8192 16384] [--buckets 8] [--heads 16]

Our positional forward of a dense causal pattern with buckets runs, per 128-row query tile, the
blocks of BLOCK_N keys from the start of the tile's first bucket to the last row's position in
its last bucket (``_q_hull`` and ``_lower_bound`` in templates/_positions.py.jinja,
``positional_query_phases`` in _phases.py.jinja); the blocks that lie inside [f_lo, f_hi) of a
one-bucket tile run unmasked. FlexAttention visits the 128 x 128 blocks of its block mask with
any visible pair (full ones without mask_mod). Both are counted here on bench_dynamic's inputs
(its generator and seed, B=1, D=128, bf16, ``hash_inputs``; hashed on the CPU, so a bucket may
differ from the GPU's where bf16 products round differently), with the pairs they need, to tell
work from per-block cost.
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--buckets", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    a = ap.parse_args()
    for n in a.n:
        c = count(n, a.buckets, a.heads)
        ours, flex = c["ours_masked"] + c["ours_unmasked"], c["flex_partial"] + c["flex_full"]
        print(f"N={n}, {a.buckets} buckets, H={a.heads}: ours {ours} blocks ({c['ours_masked']} masked), "
              f"FlexAttention {flex} ({c['flex_partial']} partial); the visible pairs fill "
              f"{c['pairs_in_blocks']:.0f} blocks of 128 x 128")


if __name__ == "__main__":
    main()
