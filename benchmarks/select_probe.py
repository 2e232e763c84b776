"""Time select_blocks' kernels in their variants (GPU), to choose its defaults.

    PYTHONPATH=$PWD python benchmarks/select_probe.py                  # N = 131072 and 1048576
    PYTHONPATH=$PWD python benchmarks/select_probe.py --n 131072 --rep 200

bf16 q and k, B=1, H=16 (one KV head per query head), D=128, top-16 of 128-blocks, causal: the
shape of bench_dynamic's topk16 rows. Timed with triton.testing.do_bench (median, L2 flushed);
a variant that does not compile or run is reported and skipped. At each N:

- ``select``: each variant of ``block_select_kernel`` (rows per program BLOCK_M, candidates per
  step BLOCK_N, warps; the top's form: ``sort`` merge_top, ``insert`` insert_keys, ``pending``
  and ``threshold`` _pending_top; DOT_PREC; SPLIT runs merged by block_merge_kernel), its indices
  compared with the launcher's current form at that N (the first row of each N: the share of
  rows with the same indices, 100.00% = identical).
- ``means``: the block means of q and k, the launcher's two launches of block_means_kernel against
  block_means_pair_kernel's variants (one launch; ``PAIR_MEANS``): whether the means are
  bit-identical to the launcher's, and the share of rows whose indices (the launcher's selection
  on those means) are the same.
- ``call``: the whole ``select_blocks`` call, the launcher's defaults against the proposed ones
  (the fastest pair-means variant and, where rows are long, the fastest pending form whose
  indices were identical), indices compared.
"""
import argparse
import time

import torch
import triton.testing

from msa_codegen.sparsity import selection

#: the device (``--device cpu``: a smoke run of this script in Triton's interpreter, TRITON_INTERPRET=1,
#: at a small N; its times are the interpreter's, one call each)
DEV = "cuda"

# (form, BLOCK_M, BLOCK_N, num_warps, options) beyond the launcher's current form (timed first at
# each N); options override the launcher's constexprs (DOT_PREC tf32x3, SPLIT 1). The one-product
# tf32 row bounds what the products cost (its indices differ on some rows); the older variants
# (sort and insert at 16/64/128 rows, SPLIT 2/8, ieee products) were timed on 2026-12-03
# (docs/performance.md) and are in this file's history
# (at N=131072 the first is the 1M form; at 1M the current form is timed first anyway). Shared
# memory on sm_90, Triton 3.6: 224 KiB at 128 x 64 (one program an SM), 160 KiB at 64 x 64, 112
# KiB at 64 x 32 (two an SM)
VARIANTS = [("insert", 128, 64, 8, dict(FIRST_SORT=True)),
            ("pending", 128, 64, 8, {}), ("threshold", 128, 64, 8, {}),
            ("pending", 64, 64, 4, {}), ("pending", 64, 32, 4, {}), ("threshold", 64, 32, 4, {}),
            ("pending", 64, 64, 4, dict(SPLIT=4)),
            ("insert", 128, 64, 8, dict(FIRST_SORT=True, DOT_PREC="tf32"))]
# block_means_pair_kernel: _pair_meta's options (BLOCK_R rows a step, BLOCKS blocks a program,
# STEP_SUM sums each step's rows at once, num_warps); {} is the two-launch form's, in one launch
PAIR_MEANS = [{}, dict(BLOCKS=2), dict(STEP_SUM=True, BLOCK_R=128, num_warps=8),
              dict(STEP_SUM=True, BLOCK_R=32, num_warps=4), dict(STEP_SUM=True, BLOCK_R=64, num_warps=8),
              dict(STEP_SUM=True, BLOCK_R=32, num_warps=2, BLOCKS=2), dict(STEP_SUM=True, BLOCK_R=16, num_warps=4, BLOCKS=2)]


def _select_meta(form, bm, bn, warps, opts, base):
    """The kernel's constexprs for a variant: ``base`` (the launcher's) with the form's switches."""
    forms = dict(sort=dict(INSERT=False, FIRST_SORT=False, PENDING=False, THRESHOLD=False),
                 insert=dict(INSERT=True, FIRST_SORT=False, PENDING=False, THRESHOLD=False),
                 pending=dict(INSERT=False, FIRST_SORT=False, PENDING=True, THRESHOLD=False),
                 threshold=dict(INSERT=False, FIRST_SORT=False, PENDING=True, THRESHOLD=True))
    return {**base, **forms[form], "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, **opts}


def _select(qm, km, meta, topk):
    """A runner of the selection kernel (and the merge of split runs) with ``meta``, and its output."""
    kern, merge = selection._kernels().block_select_kernel, selection._kernels().block_merge_kernel
    h, nb = qm.shape[1], qm.shape[2]
    out = torch.full((1, h, nb, topk), -1, dtype=torch.int32, device=DEV)
    split = meta["SPLIT"]
    tops = torch.empty(h, nb, split, meta["W"], dtype=torch.int64, device=DEV)
    grid = (triton.cdiv(nb, meta["BLOCK_M"]), h, split)

    def run():
        kern[grid](qm, km, out, tops, nb, topk, topk, **meta)
        if split > 1:
            merge[(triton.cdiv(nb, 64), h)](tops, out, nb, topk, topk, BLOCK_M=64, W=meta["W"], SPLIT=split,
                                            num_warps=4)
    return run, out


def _name(form, bm, bn, warps, meta, opts):
    extra = ", ".join(f"{k}={v}" for k, v in opts.items() if k not in ("DOT_PREC", "FIRST_SORT"))
    first = ", first sort" if meta.get("FIRST_SORT") else ""
    return f"{form:9s} {bm:3d} x {bn:3d}, {warps} warps, {meta['DOT_PREC']}{first}" + (f", {extra}" if extra else "")


def _same(out, ref):
    return f"{100 * (out == ref).all(-1).float().mean().item():.2f}% rows same"


def _bench(fn, rep):
    fn()
    if DEV != "cuda":
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, rep=rep, return_mode="median")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[131072, 1048576])
    ap.add_argument("--rep", type=int, default=200, help="do_bench's timing budget in ms (default 200)")
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu: a smoke run in the interpreter")
    ap.add_argument("--heads", type=int, default=16, help="H of q and k (default 16)")
    a = ap.parse_args()
    global DEV
    DEV = a.device
    h, d, topk, block = a.heads, 128, 16, 128
    rows = []
    orig_meta = selection._select_meta
    for n in a.n:
        g = torch.Generator(device=DEV).manual_seed(0)
        q = torch.randn(1, h, n, d, device=DEV, dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, h, n, d, device=DEV, dtype=torch.bfloat16, generator=g)
        nb = triton.cdiv(n, block)
        qm, km = selection._block_means(q, block), selection._block_means(k, block)
        # select: the launcher's form first, the reference of the others' indices
        base = selection._select_meta(d, topk, True, nb)
        # the launcher splits short rows' tiles into runs (select_blocks): time it as it launches
        split = 1 if base["INSERT"] else selection._split(triton.cdiv(nb, base["BLOCK_M"]) * h,
                                                          triton.cdiv(nb, base["BLOCK_N"]))
        cur = dict(base, SPLIT=split)
        run, ref = _select(qm, km, cur, topk)
        rows.append((n, "select", _name("insert" if base["INSERT"] else "sort", base["BLOCK_M"], base["BLOCK_N"],
                                        base["num_warps"], cur, dict(SPLIT=split)) + " *",
                     _bench(run, a.rep), "the launcher's (* = current)"))
        ref = ref.clone()
        best_long = None
        for form, bm, bn, warps, opts in VARIANTS:
            meta = _select_meta(form, bm, bn, warps, opts, base)
            name = _name(form, bm, bn, warps, meta, opts)
            try:
                run, out = _select(qm, km, meta, topk)
                ms = _bench(run, a.rep)
            except Exception as e:   # reported, the next variant runs
                rows.append((n, "select", name, float("nan"), f"failed: {type(e).__name__}: {str(e)[:80]}"))
                continue
            same = torch.equal(out, ref)
            rows.append((n, "select", name, ms, _same(out, ref)))
            if form in ("pending", "threshold") and same and meta["SPLIT"] == 1 and (best_long is None or ms < best_long[0]):
                best_long = (ms, name, {k: meta[k] for k in ("INSERT", "FIRST_SORT", "PENDING", "THRESHOLD", "BLOCK_M",
                                                            "BLOCK_N", "num_warps")})
        # means: two launches (the launcher's) against the pair kernel's variants

        def two_launches():
            selection._block_means(q, block)
            selection._block_means(k, block)
        rows.append((n, "means", "block_means_kernel x 2 (q, k), 128 rows, 4 warps *", _bench(two_launches, a.rep),
                     "the launcher's"))
        best_pair = None
        for opts in PAIR_MEANS:
            name = "pair " + (", ".join(f"{k}={v}" for k, v in opts.items()) or "as the launcher's, one launch")
            try:
                ms = _bench(lambda: selection._block_means_pair(q, k, block, opts), a.rep)
                pm, pk = selection._block_means_pair(q, k, block, opts)
            except Exception as e:
                rows.append((n, "means", name, float("nan"), f"failed: {type(e).__name__}: {str(e)[:80]}"))
                continue
            bits = torch.equal(pm, qm) and torch.equal(pk, km)
            run_p, out_p = _select(pm, pk, base, topk)
            run_p()
            rows.append((n, "means", name, ms, ("means bit-identical, " if bits else "means differ in bits, ")
                         + _same(out_p, ref)))
            if best_pair is None or ms < best_pair[0]:
                best_pair = (ms, opts)
            del pm, pk
        # the whole call: the launcher's defaults, then the proposed ones
        call = lambda: selection.select_blocks(q, k, topk, block=block)   # noqa: E731
        ref_call = call()
        rows.append((n, "call", "select_blocks, current defaults *", _bench(call, a.rep), "-"))
        if best_pair is not None:
            selection.PAIR_MEANS = best_pair[1]
        long_name = "the launcher's"
        if best_long is not None and nb >= selection.LONG_SELECT:
            # the long rows' form as the fastest identical pending variant (tiles and warps included)
            orig, long_name = selection._select_meta, best_long[1]
            selection._select_meta = lambda *args: dict(orig(*args), **best_long[2]) if orig(*args)["INSERT"] else orig(*args)
        try:
            prop = call()
            rows.append((n, "call", f"select_blocks, means: pair {selection.PAIR_MEANS}, select: {long_name}",
                         _bench(call, a.rep), _same(prop, ref_call)))
        finally:
            selection.PAIR_MEANS = None
            selection._select_meta = orig_meta
        del q, k, qm, km
        torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print(f"\n{gpu}, torch {torch.__version__}, Triton {triton.__version__}: "
          f"H={h} D={d} bf16 top-{topk} of {block}-blocks, causal; ms (do_bench median)")
    for n, part, name, ms, note in rows:
        print(f"N={n:8d} {part:6s} {name:66s} {ms:8.3f}  {note}")


if __name__ == "__main__":
    main()
