"""msa-bench rows for run-time sparsity (issue 5): documents, Hash-sparse, QK-sparse, top-k.

    python -m msa_codegen.bench_dynamic                      # every case
    python -m msa_codegen.bench_dynamic --cases docs-w4096,topk16 --reps-ms 400
    python -m msa_codegen.bench_dynamic --cases topk16 --rounds 5   # order rotated, medians

Each case builds its inputs once, checks our output against the peer that computes the same
mask (FlexAttention with the equivalent mask_mod / BlockMask) before timing, and times forward
and forward+backward with triton.testing.do_bench (median). Dense peers (SDPA's flash backend on
the uncompacted / unsorted sequence) compute a different, dense mask: they are the speed
baseline the methods are meant to beat, compared for time only. Rows are printed and appended
to the CSV of msa-bench (no TFLOP/s: the attended pairs of data-dependent masks are not
counted here). Preprocessing (hash_sort, select_blocks, compaction) is outside the timed region.

The top-k cases add a ``select_blocks`` row: its time (same do_bench), its extra peak memory (the
peak above what was allocated before the call), its share of our top-k forward, and how many
query blocks of KV head 0 it selects exactly as the float64 definition does
(``sparsity.reference``; near-ties may swap). Issue 19's bar: under 10% of the forward, O(N * K)
extra memory::

    python -m msa_codegen.bench_dynamic --cases topk16,topk16-1m
"""
from __future__ import annotations

import dataclasses
import random
import sys
import time

import torch

from .api import attention
from .bench import _peak, _rel, _time, bench_main, kernel_families, label_rows, settle
from .pattern.spec import parse
from .sparsity.inputs import CHECKED, PREPARED
from .sparsity.reference import select_blocks_reference
from .sparsity.selection import hash_sort, select_blocks


@dataclasses.dataclass
class DynCase:
    name: str
    kind: str        # docs | hash | qk | topk
    pattern: str
    n: int
    hq: int = 16
    hkv: int = 16
    d: int = 128
    one_doc: bool = False   # docs: one document spanning N (the positional kernels' own cost)


CASES = [
    DynCase("docs-w4096", "docs", "window=4096", 131072),
    DynCase("docs1-w4096", "docs", "window=4096", 131072, one_doc=True),
    DynCase("docs-causal", "docs", "causal", 131072),
    DynCase("hash8-8k", "hash", "causal", 8192),
    DynCase("hash8-16k", "hash", "causal", 16384),
    DynCase("qk-sparse-30", "qk", "causal", 32768),
    DynCase("topk16", "topk", "topk=16", 131072),
    DynCase("topk16-1m", "topk", "topk=16", 1048576),
    DynCase("topk16-gqa", "topk", "topk=16", 131072, hq=32, hkv=8),
]


def build(case: DynCase, device="cuda", dtype=torch.bfloat16, seed=0, with_peers=True):
    """Inputs and closures: ``(ours, {peer: (fn, same_mask)}, grads_of, note)``.

    ``ours()`` / ``fn()`` return the output; ``grads_of`` lists the leaf tensors to reset between
    timed backward passes.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    rnd = random.Random(seed)
    b, hq, hkv, n, d = 1, case.hq, case.hkv, case.n, case.d

    def leaf(h, length):
        return torch.randn(b, h, length, d, generator=g).to(device=device, dtype=dtype).requires_grad_()

    q, k, v = leaf(hq, n), leaf(hkv, n), leaf(hkv, n)
    peers = {}
    note = ""
    if case.kind == "docs":
        cu = torch.tensor([0, n], dtype=torch.int32) if case.one_doc else doc_offsets(n, 1024, 16384, rnd)
        cu = cu.to(device)
        note = "one document of N (cu_seqlens = [0, N])" if case.one_doc else f"{len(cu) - 1} documents of 1k-16k"

        def ours():
            return attention(q, k, v, case.pattern, cu_seqlens=cu)
        if case.one_doc and with_peers:
            # the same mask through the plain kernels: what the positional machinery costs
            peers["msa_codegen-plain"] = (lambda: attention(q, k, v, case.pattern), True)
        if device == "cuda" and with_peers:
            doc = torch.searchsorted(cu[1:].long(), torch.arange(n, device=device), right=True)
            w = msa_window(case.pattern)

            def mask_mod(bb, hh, qi, ki):
                return (doc[qi] == doc[ki]) & (qi >= ki) & (qi - ki < w)
            peers["flex-docmask"] = (_flex(mask_mod, q, k, v, n, n), True)
        grads = (q, k, v)
    elif case.kind == "hash":
        nb = 8
        qs, ks, vs, qp, kp, qb, kb = hash_inputs(q, k, v, nb)
        note = f"{nb} buckets, sorted inputs (hash_sort not timed)"

        def ours():
            return attention(qs, ks, vs, case.pattern, q_pos=qp, k_pos=kp, q_bucket=qb, k_bucket=kb)
        if device == "cuda" and with_peers:
            def mask_mod(bb, hh, qi, ki):
                return (qb[bb, hh, qi] == kb[bb, hh // (hq // hkv), ki]) & (kp[bb, hh // (hq // hkv), ki] <= qp[bb, hh, qi])
            peers["flex-hashmask"] = (_flex(mask_mod, qs, ks, vs, n, n), True)
            peers["sdpa-flash-dense"] = (_sdpa(q, k, v), False)
        grads = (qs, ks, vs, q, k, v)
    elif case.kind == "qk":
        keep = int(n * 0.7)

        def positions(h):
            return torch.stack([torch.randperm(n, generator=g)[:keep].sort().values for _ in range(b * h)]).view(b, h, keep)
        qp, kp = positions(hq).to(device), positions(hkv).to(device)
        qc = q.detach().gather(2, qp[..., None].expand(b, hq, keep, d)).requires_grad_()
        kc = k.detach().gather(2, kp[..., None].expand(b, hkv, keep, d)).requires_grad_()
        vc = v.detach().gather(2, kp[..., None].expand(b, hkv, keep, d)).requires_grad_()
        note = "30% of queries and keys dropped per head (compaction not timed)"

        def ours():
            return attention(qc, kc, vc, case.pattern, q_pos=qp, k_pos=kp)
        if device == "cuda" and with_peers:
            def mask_mod(bb, hh, qi, ki):
                return kp[bb, hh // (hq // hkv), ki] <= qp[bb, hh, qi]
            peers["flex-qkmask"] = (_flex(mask_mod, qc, kc, vc, keep, keep), True)
            peers["sdpa-flash-dense"] = (_sdpa(q, k, v), False)
        grads = (qc, kc, vc, q, k, v)
    elif case.kind == "topk":
        spec = parse(case.pattern).groups[0].spec
        idx = select_blocks(q.detach(), k.detach(), spec.topk, block=spec.block)
        note = f"select_blocks top-{spec.topk} of {spec.block}-blocks (not timed)"

        def ours():
            return attention(q, k, v, case.pattern, block_indices=idx)
        if device == "cuda" and with_peers:
            peers["flex-blockmask"] = (_flex_topk(idx, q, k, v, spec.block), True)
        grads = (q, k, v)
    else:
        raise ValueError(f"unknown kind {case.kind!r}")
    return ours, peers, grads, note


def doc_offsets(n: int, lo: int, hi: int, rnd: random.Random) -> torch.Tensor:
    """int32 cu_seqlens of documents of random lengths lo..hi (the last one what is left) filling n."""
    lens, left = [], n
    while left:
        lens.append(min(left, rnd.randint(lo, hi)))
        left -= lens[-1]
    return torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)


def hash_inputs(q, k, v, buckets: int):
    """The Hash-sparse rows' inputs: q, k, v sorted by LSH bucket (``hash_sort``, seed 1; v in k's
    order) as new leaves, and their positions and buckets: ``(qs, ks, vs, qp, kp, qb, kb)``."""
    qs, qp, qb, _ = hash_sort(q.detach(), buckets, seed=1)
    ks, kp, kb, _ = hash_sort(k.detach(), buckets, seed=1)
    vs = v.detach().gather(2, kp.long()[..., None].expand_as(v))
    qs, ks, vs = (t.contiguous().requires_grad_() for t in (qs, ks, vs))
    return qs, ks, vs, qp, kp, qb, kb


def msa_window(pattern: str) -> int:
    """The pattern's window (the whole document when it has none)."""
    w = parse(pattern).groups[0].spec.window
    return (1 << 30) if w is None else w


def _flex(mask_mod, q, k, v, nq, nk):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    bm = create_block_mask(mask_mod, q.shape[0], q.shape[1], nq, nk, device=q.device, _compile=True)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    flex = torch.compile(flex_attention, dynamic=False)
    gqa = q.shape[1] != k.shape[1]
    return lambda: flex(q, k, v, block_mask=bm, enable_gqa=gqa)


def _flex_topk(idx, q, k, v, blk):
    """FlexAttention on the chosen blocks, its BlockMask built from the indices (O(N / block * K)
    memory per row of blocks, no N x N mask evaluation): chosen blocks left of the diagonal are
    full blocks, the diagonal block is partial with the causal mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    b, hq, n, _ = q.shape
    group = hq // k.shape[1]
    nblk = -(-n // blk)
    chosen = torch.zeros(b, idx.shape[1], nblk, nblk + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(3, torch.where(idx >= 0, idx, nblk).long(), True)
    chosen = chosen[..., :nblk].repeat_interleave(group, dim=1)       # (B, Hq, nqb, nkb)
    qb = torch.arange(nblk, device=q.device)
    below = qb[None, :] < qb[:, None]                                   # key block left of the diagonal
    full = chosen & below
    partial = chosen & (qb[None, :] == qb[:, None])

    def ordered(m):
        num = m.sum(-1, dtype=torch.int32)
        indices = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num, indices
    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)

    def causal(bb, hh, qi, ki):
        return qi >= ki
    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=blk, mask_mod=causal,
                                  seq_lengths=(n, n))
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda: flex(q, k, v, block_mask=bm, enable_gqa=group > 1)


def _sdpa(q, k, v):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return run


def run_case(case: DynCase, reps_ms: int, dtype=torch.bfloat16, rounds: int = 1):
    """Rows of one case: ours and each peer, checked against ours and timed (forward, then
    forward+backward), ours first. ``rounds`` > 1 times them after all are checked and warm, in
    that many rounds, the implementations' order rotated each round; a row holds the medians
    over the rounds and its note their ranges (msa-bench's ``--rounds``, ``bench.interleaved``)."""
    rows = []
    t0 = time.perf_counter()
    try:
        ours, peers, grads, note = build(case, "cuda", dtype)
    except Exception as e:   # reported, never silently dropped
        return [dict(impl="setup", status=f"failed: {type(e).__name__}: {e}"[:200], case=case.name)]
    out = ours()
    torch.cuda.synchronize()
    setup = time.perf_counter() - t0
    sample = out[:, :, ::16].detach().clone()
    do = torch.randn_like(out)
    del out
    work = {}    # name: (forward, forward+backward)
    fields = {}  # name: the row's other fields
    times = {}   # one round: name -> [[forward ms], [forward+backward ms]]
    cold_ms = None
    for name, fn, same in [("msa_codegen", ours, True)] + [(p, f, s) for p, (f, s) in peers.items()]:
        try:
            o = fn()
            err = _rel(o[:, :, ::16], sample) if name != "msa_codegen" and same else 0.0
            if name != "msa_codegen" and same and not err < 2e-2:
                raise RuntimeError(f"output differs from ours: rel err {err:.2e}")
            dd = do if o.shape == do.shape else torch.randn_like(o)
            del o

            def fb(fn=fn, dd=dd):
                fn().backward(dd)
                for t in grads:
                    t.grad = None
            if rounds == 1:
                fwd_ms = _time(fn, reps_ms)
            if name == "msa_codegen":
                # the host checks of the inputs (syncs) are remembered per tensor version, so the
                # timed calls skip them, as every layer after the first of a step does; their
                # cost: the same call with nothing remembered, less the forward's time
                def cold(fn=fn):
                    CHECKED.clear()
                    PREPARED.clear()
                    return fn()
                cold_ms = _time(cold, reps_ms)
            fb()
            if rounds == 1:
                times[name] = [[fwd_ms], [_time(fb, reps_ms)]]
            peak = _peak(fb)
            family = f"; {kernel_families(fb)}" if name == "msa_codegen" else ""
            work[name] = (fn, fb)
            fields[name] = dict(peak_gib=peak, max_rel_err=err, family=family, same=same)
        except Exception as e:
            rows.append(dict(impl=name, status=f"failed: {type(e).__name__}: {e}"[:200]))
        torch.cuda.empty_cache()
    results = {}
    timed, failed = settle(work, times, rounds, lambda fn: _time(fn, reps_ms))
    rows += failed
    for name, (fwd_ms, fwdbwd_ms, order) in timed.items():
        row = fields[name]
        results[name] = (fwd_ms, fwdbwd_ms)
        if name == "msa_codegen":
            what = (f"{note}; input checks {cold_ms - fwd_ms:.3f} ms, paid once per tensor version"
                    f"{row['family']}")
        else:
            what = "same mask" if row["same"] else "dense mask: speed only"
        rows.append(dict(impl=name, fwd_ms=fwd_ms, fwdbwd_ms=fwdbwd_ms, peak_gib=row["peak_gib"],
                         setup_s=setup if name == "msa_codegen" else 0.0, max_rel_err=row["max_rel_err"],
                         status="ok", note=what + order))
    if case.kind == "topk":
        rows.append(select_row(case, dtype, reps_ms, results.get("msa_codegen")))
    label_rows(rows, case, results, dtype)
    return rows


def select_row(case: DynCase, dtype, reps_ms: int, ours=None) -> dict:
    """select_blocks on the case's shapes: time, extra peak GiB, share of our forward, agreement."""
    try:
        spec = parse(case.pattern).groups[0].spec
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(1, case.hq, case.n, case.d, device="cuda", generator=g).to(dtype)
        k = torch.randn(1, case.hkv, case.n, case.d, device="cuda", generator=g).to(dtype)

        def run():
            return select_blocks(q, k, spec.topk, block=spec.block)
        idx = run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        idx = run()
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - before) / 2**30
        ms = _time(run, reps_ms)
        group = case.hq // case.hkv
        ref = select_blocks_reference(q[:, :group], k[:, :1], spec.topk, spec.block)
        agree = (idx[:, :1] == ref).all(-1).float().mean().item()
        share = f"{100 * ms / ours[0]:.1f}% of our top-k forward ({ours[0]:.3f} ms)" if ours else "no forward time"
        note = (f"select_blocks top-{spec.topk} of {spec.block}-blocks: {share}; extra peak {extra:.3f} GiB; "
                f"{100 * agree:.2f}% of KV head 0's query blocks as the float64 reference")
        status = "ok" if agree >= 0.99 else f"failed: {100 * agree:.2f}% of rows as the float64 reference"
        return dict(impl="select_blocks", fwd_ms=ms, peak_gib=extra, status=status, note=note)
    except Exception as e:   # reported, never silently dropped
        return dict(impl="select_blocks", status=f"failed: {type(e).__name__}: {e}"[:200])


def _fmt(r) -> str:
    if r.get("status") != "ok":
        return f"{r['impl']:18s} {r.get('status')}"
    if r["impl"] == "select_blocks":
        return f"{r['impl']:18s} time {r['fwd_ms']:7.3f} ms | extra peak {r['peak_gib']:6.3f} GiB | {r['note']}"
    s = f"{r['impl']:18s} fwd {r['fwd_ms']:8.3f} ms | fwd+bwd {r['fwdbwd_ms']:8.3f} ms | peak {r['peak_gib']:6.2f} GiB"
    if "ratio_fwd" in r:
        s += f" | ours/peer fwd {r['ratio_fwd']:.3f} fwd+bwd {r['ratio_fwdbwd']:.3f}"
    return s + f" | {r.get('note', '')}"


def main(argv=None):
    return bench_main("python -m msa_codegen.bench_dynamic", CASES, run_case, _fmt,
                      lambda c: f"{c.kind} {c.pattern} H={c.hq}/{c.hkv} N={c.n} D={c.d}", argv, rounds=True)


if __name__ == "__main__":
    sys.exit(main())
