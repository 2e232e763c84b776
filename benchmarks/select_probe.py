"""Time select_blocks' selection kernel in its launch variants (GPU), to choose its defaults.

    PYTHONPATH=$PWD python benchmarks/select_probe.py                  # N = 131072 and 1048576
    PYTHONPATH=$PWD python benchmarks/select_probe.py --n 131072 --rep 200

bf16 q and k, B=1, H=16 (one KV head per query head), D=128, top-16 of 128-blocks, causal: the
shape of bench_dynamic's topk16 rows. The block means' kernel is timed in its variants (rows
summed per step, warps) for q and k together; each variant of ``block_select_kernel`` (rows per
program BLOCK_M, candidates per step BLOCK_N, warps, merge_top's sort-and-merge against
insert_keys's insertion, INSERT, the scores' product precision, DOT_PREC, and runs of a row tile's
candidates, SPLIT, merged by block_merge_kernel) is timed with
triton.testing.do_bench (median, L2 flushed) and its indices compared with float32 products'
(the first variant). A variant that does not compile is reported and skipped.
"""
import argparse

import torch
import triton.testing

from msa_codegen.sparsity import selection

# (INSERT, BLOCK_M, BLOCK_N, num_warps, options); the first is the reference the others' indices are
# compared with (float32 products, ``ieee``); the others take the launcher's DOT_PREC (tf32x3) unless
# given; the last (tf32, one product) bounds what the product costs. SPLIT: runs of a row tile's
# candidates, one program each, then block_merge_kernel (the launcher splits when row tiles are few)
VARIANTS = [(False, 16, 16, 1, dict(DOT_PREC="ieee")), (False, 16, 16, 1, {}), (False, 16, 16, 1, dict(SPLIT=2)),
            (False, 16, 16, 1, dict(SPLIT=4)), (False, 16, 16, 1, dict(SPLIT=8)), (False, 64, 16, 4, {}),
            (True, 16, 64, 2, {}), (True, 64, 64, 4, {}), (True, 128, 64, 8, {}), (True, 128, 64, 8, dict(FIRST_SORT=True)),
            (True, 64, 64, 4, dict(DOT_PREC="tf32"))]
# the block means' kernel: (rows summed per step BLOCK_R, num_warps); the first is the launcher's
MEANS = [(128, 4), (64, 4), (32, 4), (128, 8)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[131072, 1048576])
    ap.add_argument("--rep", type=int, default=300, help="do_bench's timing budget in ms (default 300)")
    a = ap.parse_args()
    h, d, topk, block = 16, 128, 16, 128
    kern = selection._kernels().block_select_kernel
    merge = selection._kernels().block_merge_kernel
    rows = []
    for n in a.n:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        means = []
        for br, warps in MEANS:
            meta = dict(selection._means_meta(d, block, 1), BLOCK_R=br, num_warps=warps)
            qm = torch.empty(1, h, triton.cdiv(n, block), d, device="cuda")

            def run_means():
                for x in (q, k):
                    selection._kernels().block_means_kernel[(qm.shape[2], h)](
                        x, qm, x.stride(0), x.stride(1), x.stride(2), n, qm.shape[2], h, **meta)
            run_means()
            torch.cuda.synchronize()
            ok = torch.equal(qm, selection._block_means(k, block))
            means.append((f"block means (q and k), {br} rows a step, {warps} warps",
                          triton.testing.do_bench(run_means, rep=a.rep, return_mode="median"),
                          "same as the launcher's" if ok else "DIFFERENT from the launcher's"))
        qm, km = selection._block_means(q, block), selection._block_means(k, block)
        del q, k
        nb = qm.shape[2]
        base = selection._select_meta(d, topk, True)
        ref = None
        for insert, bm, bn, warps, opts in VARIANTS:
            meta = dict(base, INSERT=insert, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, **opts)
            extra = ", ".join(f"{k}={v}" for k, v in opts.items() if k != "DOT_PREC")
            out = torch.full((1, h, nb, topk), -1, dtype=torch.int32, device="cuda")
            split = meta["SPLIT"]
            tops = torch.empty(h, nb, split, meta["W"], dtype=torch.int64, device="cuda")
            grid = (triton.cdiv(nb, bm), h, split)

            def run():
                kern[grid](qm, km, out, tops, nb, topk, topk, **meta)
                if split > 1:
                    merge[(triton.cdiv(nb, 64), h)](tops, out, nb, topk, topk, BLOCK_M=64, W=meta["W"], SPLIT=split,
                                                    num_warps=4)
            name = (f"{'insert' if insert else 'sort  '} {bm:3d} x {bn:3d}, {warps} warps, {meta['DOT_PREC']}"
                    + (f", {extra}" if extra else ""))
            try:
                run()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(run, rep=a.rep, return_mode="median")
            except Exception as e:   # reported, the next variant runs
                rows.append((n, name, float("nan"), f"failed: {type(e).__name__}: {str(e)[:80]}"))
                continue
            if ref is None:
                ref = out.clone()
            same = (out == ref).all(-1).float().mean().item()
            rows.append((n, name, ms, f"{100 * same:.2f}% of rows as the first (ieee)"))
        rows += [(n, *m) for m in means]
        del qm, km
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}: H={h} D={d} top-{topk} of {block}-blocks, causal; ms (median)")
    for n, name, ms, note in rows:
        print(f"N={n:8d}  {name:62s} {ms:9.3f} ms  {note}")


if __name__ == "__main__":
    main()
