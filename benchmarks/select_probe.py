"""Time select_blocks' kernels in their variants (GPU), to choose its defaults.

    PYTHONPATH=$PWD python benchmarks/select_probe.py                  # N = 131072 and 1048576
    PYTHONPATH=$PWD python benchmarks/select_probe.py --n 131072 --rep 200

bf16 q and k, B=1, H=16 (one KV head per query head; ``--heads 32 --kv-heads 8``: GQA 32/8),
D=128, top-16 of 128-blocks, causal: the shapes of bench_dynamic's topk16 rows. Timed with triton.testing.do_bench (median, L2 flushed);
a variant that does not compile or run is reported and skipped. At each N:

- ``select``: each variant of ``block_select_kernel`` (rows per program BLOCK_M, candidates per
  step BLOCK_N, warps; the top's form: ``sort`` merge_top, ``insert`` insert_keys; DOT_PREC;
  SPLIT runs merged by block_merge_kernel), its indices compared with the launcher's current
  form at that N (the first row of each N: the share of rows with the same indices, 100.00% =
  identical).
- ``means``: the block means of q and k by ``block_means_pair_kernel``, the launcher's options
  (``selection._means_meta``) against other explicit ones: whether the means are bit-identical
  to the launcher's, and the share of rows whose indices (the launcher's selection on those
  means) are the same.
- ``call``: the whole ``select_blocks`` call with the launcher's defaults and, if a means variant
  was faster than the launcher's, with that variant's options, indices compared.
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
# each N); options override the launcher's constexprs (DOT_PREC tf32x3, SPLIT 1): the short rows'
# form and the long rows' (at each N one of them is the launcher's), and a one-product tf32 row
# that bounds what the products cost (its indices differ on some rows). Other variants are in this
# file's history: sort and insert at 16/64/128 rows, SPLIT 2/8, ieee products (2026-12-03), and
# the removed forms of a sorted top with keys waiting at their tile column, with or without a
# bounding first pass (2026-12-04; docs/performance.md). Shared memory on sm_90, Triton 3.6: 224
# KiB at 128 x 64 (one program an SM)
VARIANTS = [("sort", 16, 16, 1, dict(SPLIT=4)),
            ("insert", 128, 64, 8, dict(FIRST_SORT=True)),
            ("insert", 128, 64, 8, dict(FIRST_SORT=True, DOT_PREC="tf32"))]
# block_means_pair_kernel's options beyond the launcher's (``_means_meta``; the D=128 block=128
# defaults: STEP_SUM, BLOCK_R=32, BLOCKS=2, 2 warps): BLOCK_R rows a step, BLOCKS blocks a program,
# STEP_SUM sums each step's rows at once, num_warps. The first is the former default (128-row
# steps added into a [128, 128] float32 sum on 4 warps), in one launch
MEANS = [dict(STEP_SUM=False, BLOCK_R=128, BLOCKS=1, num_warps=4), dict(STEP_SUM=False, BLOCK_R=128, BLOCKS=2, num_warps=4),
         dict(STEP_SUM=True, BLOCK_R=32, BLOCKS=1, num_warps=2), dict(STEP_SUM=True, BLOCK_R=32, BLOCKS=4, num_warps=2),
         dict(STEP_SUM=True, BLOCK_R=64, BLOCKS=2, num_warps=4)]


def _select_meta(form, bm, bn, warps, opts, base):
    """The kernel's constexprs for a variant: ``base`` (the launcher's) with the form's switches."""
    forms = dict(sort=dict(INSERT=False, FIRST_SORT=False), insert=dict(INSERT=True, FIRST_SORT=False))
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


def _opts(opts):
    return ", ".join(f"{k}={v}" for k, v in opts.items())


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
    ap.add_argument("--kv-heads", type=int, default=0, help="k's heads, a divisor of --heads (default: --heads; "
                    "e.g. 8 with --heads 32 for bench_dynamic's GQA 32/8 row)")
    a = ap.parse_args()
    global DEV
    DEV = a.device
    h, d, topk, block = a.heads, 128, 16, 128
    hkv = a.kv_heads or h
    if h % hkv:
        raise SystemExit(f"--kv-heads {hkv} does not divide --heads {h}")
    rows = []
    orig_means = selection._means_meta
    for n in a.n:
        g = torch.Generator(device=DEV).manual_seed(0)
        q = torch.randn(1, h, n, d, device=DEV, dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, hkv, n, d, device=DEV, dtype=torch.bfloat16, generator=g)
        nb = triton.cdiv(n, block)
        qm, km = selection._block_means(q, k, block)
        # select: the launcher's form first, the reference of the others' indices
        base = selection._select_meta(d, topk, True, nb)
        # the launcher splits short rows' tiles into runs (select_blocks): time it as it launches
        split = 1 if base["INSERT"] else selection._split(triton.cdiv(nb, base["BLOCK_M"]) * hkv,
                                                          triton.cdiv(nb, base["BLOCK_N"]))
        cur = dict(base, SPLIT=split)
        run, ref = _select(qm, km, cur, topk)
        rows.append((n, "select", _name("insert" if base["INSERT"] else "sort", base["BLOCK_M"], base["BLOCK_N"],
                                        base["num_warps"], cur, dict(SPLIT=split)) + " *",
                     _bench(run, a.rep), "the launcher's (* = current)"))
        ref = ref.clone()
        for form, bm, bn, warps, opts in VARIANTS:
            meta = _select_meta(form, bm, bn, warps, opts, base)
            name = _name(form, bm, bn, warps, meta, opts)
            try:
                run, out = _select(qm, km, meta, topk)
                ms = _bench(run, a.rep)
            except Exception as e:   # reported, the next variant runs
                rows.append((n, "select", name, float("nan"), f"failed: {type(e).__name__}: {str(e)[:80]}"))
                continue
            rows.append((n, "select", name, ms, _same(out, ref)))
        # means: the launcher's options, then the others
        means_meta = selection._means_meta(d, block, h // hkv)
        launcher = {k: means_meta[k] for k in ("STEP_SUM", "BLOCK_R", "BLOCKS", "num_warps")}
        launcher_ms = _bench(lambda: selection._block_means(q, k, block), a.rep)
        rows.append((n, "means", "block_means_pair_kernel " + _opts(launcher) + " *", launcher_ms, "the launcher's"))
        best = None
        for opts in MEANS:
            name = "block_means_pair_kernel " + _opts(opts)
            meta = dict(means_meta, **opts)
            try:
                ms = _bench(lambda: selection._block_means(q, k, block, meta), a.rep)
                pm, pk = selection._block_means(q, k, block, meta)
            except Exception as e:
                rows.append((n, "means", name, float("nan"), f"failed: {type(e).__name__}: {str(e)[:80]}"))
                continue
            bits = torch.equal(pm, qm) and torch.equal(pk, km)
            run_p, out_p = _select(pm, pk, cur, topk)
            run_p()
            rows.append((n, "means", name, ms, ("means bit-identical, " if bits else "means differ in bits, ")
                         + _same(out_p, ref)))
            if ms < launcher_ms and (best is None or ms < best[0]):
                best = (ms, opts)
            del pm, pk
        # the whole call: the launcher's defaults, then with the fastest means variant if one beat them
        call = lambda: selection.select_blocks(q, k, topk, block=block)   # noqa: E731
        ref_call = call()
        rows.append((n, "call", "select_blocks, current defaults *", _bench(call, a.rep), "-"))
        if best is not None:
            selection._means_meta = lambda *args: dict(orig_means(*args), **best[1])
            try:
                prop = call()
                rows.append((n, "call", "select_blocks, means " + _opts(best[1]), _bench(call, a.rep),
                             _same(prop, ref_call)))
            finally:
                selection._means_meta = orig_means
        del q, k, qm, km
        if DEV == "cuda":
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print(f"\n{gpu}, torch {torch.__version__}, Triton {triton.__version__}: "
          f"H={h}/{hkv} D={d} bf16 top-{topk} of {block}-blocks, causal; ms (do_bench median)")
    for n, part, name, ms, note in rows:
        print(f"N={n:8d} {part:6s} {name:84s} {ms:8.3f}  {note}")


if __name__ == "__main__":
    main()
