"""msa-bench rows for MSA (``msa_attention``): against dense causal SDPA flash and FlexAttention.

    python -m msa_codegen.bench_msa                          # every case
    python -m msa_codegen.bench_msa --cases msa-128k --reps-ms 400

Shape of issue 18: B=1, H=16, Hkv=2, Hp=4, Hpk=1, D=Dp=128, top_k=2048, block=128, bf16,
random inputs. Our times include the selection; the backward includes the teaching gradient
(the KL's gradient is 1, as when it is added to the loss). Peers:
- ``sdpa-flash-dense``: dense causal attention on the same q, k, v (GQA), the cost MSA avoids;
  at N >= 262144 timed once per direction (seconds per call), else with do_bench.
- ``flex-same-mask``: FlexAttention computing the same attention: a BlockMask of the union of
  each query block's selections, and a mask_mod reading the per-query selection (N <= 131072:
  its (Hp, N, N / block) table of booleans grows with N^2 / block).
Before timing, our output is compared with FlexAttention's (``max_rel_err``).
A breakdown row per case gives ms and TFLOP/s of each phase: selection, main forward, main
backward, teaching backward.

FLOPs: selection = Hp * N^2 / 2 * Dp * 2 (the causal proxy QK^T); main attention = 4 * D per
attended (query, key) pair per head forward, 2.5x that backward (FlashAttention's convention);
the teaching backward = proxy QK^T again plus its two gradient products: 3 * 2 * Dp per pair per
proxy head. Pairs are counted from the selection (own block partly visible).
"""
from __future__ import annotations

import dataclasses
import sys
import time

import torch

from .bench import _peak, _rel, _time, bench_main
from .msa import launch
from .msa.api import msa_attention


@dataclasses.dataclass
class MsaCase:
    name: str
    n: int
    h: int = 16
    hkv: int = 2
    hp: int = 4
    hpk: int = 1
    d: int = 128
    dp: int = 128
    top_k: int = 2048
    block: int = 128


CASES = [
    MsaCase("msa-16k", 16384),
    MsaCase("msa-32k", 32768),
    MsaCase("msa-128k", 131072),
    MsaCase("msa-512k", 524288),
]


def _inputs(case: MsaCase, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    q, k, v = mk(1, case.h, case.n, case.d), mk(1, case.hkv, case.n, case.d), mk(1, case.hkv, case.n, case.d)
    qp, kp = mk(1, case.hp, case.n, case.dp), mk(1, case.hpk, case.n, case.dp)
    return [t.requires_grad_() for t in (q, k, v, qp, kp)]


def _pairs(idx: torch.Tensor, block: int) -> float:
    """Attended (query, key) pairs per proxy head summed over heads: full blocks, the own block partly."""
    n = idx.shape[2]
    i = torch.arange(n, device=idx.device)
    chosen = (idx >= 0).sum(-1).double()                       # (B, Hp, N)
    own = (i % block + 1).double()
    return float(((chosen - 1) * block + own).sum())


def _timed_once(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _flex_peer(q, k, v, idx, case: MsaCase):
    """FlexAttention on the same attention: union BlockMask per query block, per-query mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    b, hp, n, nk = idx.shape
    blk, g = case.block, case.h // case.hp
    nb = -(-n // blk)
    chosen = torch.zeros(b, hp, n, nb + 1, dtype=torch.bool, device=idx.device)
    chosen.scatter_(-1, torch.where(idx < 0, nb, idx).long(), True)
    chosen = chosen[..., :nb]
    pad = nb * blk - n
    union = torch.nn.functional.pad(chosen, (0, 0, 0, pad)).view(b, hp, nb, blk, nb).any(dim=3)
    union = union.repeat_interleave(g, dim=1)                  # (B, H, NQB, NB)
    kv_num = union.sum(-1).to(torch.int32)
    kv_idx = torch.argsort((~union).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    full_num = torch.zeros_like(kv_num)
    full_idx = torch.zeros_like(kv_idx)

    def mask_mod(bi, hi, qi, ki):
        return (ki <= qi) & chosen[bi, hi // g, qi, ki // blk]

    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=blk, mask_mod=mask_mod,
                                  seq_lengths=(n, n))
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda: flex(q, k, v, block_mask=bm, enable_gqa=True), float(union.sum()) / case.h


def _sdpa(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return run


def run_case(case: MsaCase, reps_ms: int, dtype=torch.bfloat16):
    q, k, v, qp, kp = _inputs(case, dtype)
    leaves = (q, k, v, qp, kp)
    do = torch.randn_like(q)

    def reset():
        for t in leaves:
            t.grad = None

    def ours():
        return msa_attention(q, k, v, qp, kp, case.top_k, block=case.block)

    def ours_fb():
        out, kl = ours()
        torch.autograd.backward((out, kl), (do, torch.ones_like(kl)))
        reset()

    t0 = time.perf_counter()
    with torch.no_grad():
        out, _, idx = msa_attention(q, k, v, qp, kp, case.top_k, block=case.block, return_indices=True)
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0
    pairs = _pairs(idx, case.block)
    g = case.h // case.hp
    main_flops = 4 * case.d * pairs * g
    sel_flops = case.hp * case.n * case.n / 2 * case.dp * 2
    teach_flops = 6 * case.dp * pairs
    rows = []
    with torch.no_grad():
        fwd_ms = _time(ours, reps_ms)
    fb_ms = _time(ours_fb, reps_ms)
    peak = _peak(ours_fb)
    base = dict(impl="msa_codegen", status="ok", fwd_ms=fwd_ms, fwdbwd_ms=fb_ms, peak_gib=peak, setup_s=setup_s,
                fwd_tflops=(sel_flops + main_flops) / fwd_ms * 1e-9,
                fwdbwd_tflops=(sel_flops + 3.5 * main_flops + teach_flops) / fb_ms * 1e-9)
    rows.append(base)
    # the phases, each timed alone on the same inputs
    heads = launch.Heads(case.h, case.hkv, case.hp, case.hpk)
    scale, pscale = case.d ** -0.5, case.dp ** -0.5
    with torch.no_grad():
        sel_ms = _time(lambda: launch.select(qp, kp, case.top_k, case.block, pscale, None), reps_ms)
        rev, items = launch.reverse_index(idx, -(-case.n // case.block))
        rev_ms = _time(lambda: launch.reverse_index(idx, -(-case.n // case.block)), reps_ms)
        nsel = idx.shape[-1]
        fwd_main_ms = _time(lambda: launch.forward(q, k, v, qp, kp, items, rev, nsel, heads, case.block, scale,
                                                   pscale, None, dense=False, with_out=True, with_kl=False), reps_ms)
        _, lse, lsep, _ = launch.forward(q, k, v, qp, kp, items, rev, nsel, heads, case.block, scale, pscale, None,
                                         dense=False, with_out=True, with_kl=False)
        kl_ms = _time(lambda: launch.forward(q, k, v, qp, kp, items, rev, nsel, heads, case.block, scale, pscale,
                                             None, dense=False, with_out=False, with_kl=True, lse=lse,
                                             lse_proxy=lsep), reps_ms)
        one = torch.ones((), device="cuda")
        bwd_main_ms = _time(lambda: launch.backward(do, q, k, v, qp, kp, out, lse, lsep, None, items, rev, nsel,
                                                    heads, case.block, scale, pscale, None, dense=False), reps_ms)
        bwd_teach_ms = _time(lambda: launch.backward(None, q, k, v, qp, kp, out, lse, lsep, one, items, rev, nsel,
                                                     heads, case.block, scale, pscale, None, dense=False), reps_ms)
    note = (f"selection {sel_ms:.2f} ms ({sel_flops / sel_ms * 1e-9:.0f} TF/s); reverse index {rev_ms:.2f} ms; "
            f"main fwd {fwd_main_ms:.2f} ms ({main_flops / fwd_main_ms * 1e-9:.0f} TF/s); "
            f"exact-KL pass {kl_ms:.2f} ms; main bwd {bwd_main_ms:.2f} ms "
            f"({2.5 * main_flops / bwd_main_ms * 1e-9:.0f} TF/s); teaching bwd {bwd_teach_ms:.2f} ms")
    rows.append(dict(impl="msa-breakdown", status="info", note=note))
    results = {"msa_codegen": (fwd_ms, fb_ms)}
    # dense causal SDPA on the same q, k, v
    try:
        sd = _sdpa(q, k, v)

        def sd_fb():
            o = sd()
            o.backward(do)
            reset()
        if case.n >= 262144:
            with torch.no_grad():
                sd()
                s_f = _timed_once(sd)
            s_fb = _timed_once(sd_fb)
        else:
            with torch.no_grad():
                s_f = _time(sd, reps_ms)
            s_fb = _time(sd_fb, reps_ms)
        dense_flops = 4 * case.d * case.h * case.n * (case.n + 1) / 2
        rows.append(dict(impl="sdpa-flash-dense", status="ok", fwd_ms=s_f, fwdbwd_ms=s_fb,
                         fwd_tflops=dense_flops / s_f * 1e-9, fwdbwd_tflops=3.5 * dense_flops / s_fb * 1e-9,
                         note="dense causal: a different (full) mask, compared for time"))
        results["sdpa-flash-dense"] = (s_f, s_fb)
    except Exception as e:   # a peer that fails is reported, not fatal
        rows.append(dict(impl="sdpa-flash-dense", status=f"failed: {type(e).__name__}: {e}"[:200]))
    torch.cuda.empty_cache()
    if case.n <= 131072:
        try:
            flex, union_blocks = _flex_peer(q, k, v, idx, case)
            with torch.no_grad():
                ref = flex()
            err = _rel(out, ref)

            def fx_fb():
                o = flex()
                o.backward(do)
                reset()
            with torch.no_grad():
                f_f = _time(flex, reps_ms)
            f_fb = _time(fx_fb, reps_ms)
            rows.append(dict(impl="flex-same-mask", status="ok", fwd_ms=f_f, fwdbwd_ms=f_fb,
                             fwd_tflops=main_flops / f_f * 1e-9, fwdbwd_tflops=3.5 * main_flops / f_fb * 1e-9,
                             max_rel_err=err, peak_gib=_peak(fx_fb),
                             note=f"union BlockMask: {union_blocks:.0f} blocks per head "
                                  f"(the selection holds {pairs / case.hp / case.block:.0f})"))
            results["flex-same-mask"] = (f_f, f_fb)
        except Exception as e:
            rows.append(dict(impl="flex-same-mask", status=f"failed: {type(e).__name__}: {e}"[:200]))
    for r in rows:
        r.update(case=case.name, pattern=f"msa top_k={case.top_k} block={case.block} Hp={case.hp}/{case.hpk}",
                 B=1, Hq=case.h, Hkv=case.hkv, N=case.n, D=case.d, dtype=str(dtype).replace("torch.", ""))
        if r["impl"] in results and r["impl"] != "msa_codegen":
            r["ratio_fwd"] = fwd_ms / results[r["impl"]][0]
            r["ratio_fwdbwd"] = fb_ms / results[r["impl"]][1]
    return rows


def _fmt(r) -> str:
    if r.get("status") == "info":
        return f"{r['impl']:16s} {r['note']}"
    if r.get("status") != "ok":
        return f"{r['impl']:16s} {r.get('status')}"
    s = f"{r['impl']:16s} fwd {r['fwd_ms']:9.2f} ms | fwd+bwd {r['fwdbwd_ms']:9.2f} ms"
    if "peak_gib" in r:
        s += f" | peak {r['peak_gib']:.2f} GiB"
    if "ratio_fwd" in r:
        s += f" | ours/peer fwd {r['ratio_fwd']:.3f} fwd+bwd {r['ratio_fwdbwd']:.3f}"
    if "max_rel_err" in r:
        s += f" | err {r['max_rel_err']:.1e}"
    return s + (f" | {r['note']}" if r.get("note") else "")


def table(rows) -> str:
    out = ["| case | impl | fwd ms | fwd+bwd ms | peak GiB | ours/peer fwd | ours/peer fwd+bwd |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.get("status") != "ok":
            continue
        ratios = f"{r['ratio_fwd']:.3f} | {r['ratio_fwdbwd']:.3f}" if "ratio_fwd" in r else "- | -"
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else ""
        out.append(f"| {r['case']} | {r['impl']} | {r['fwd_ms']:.2f} | {r['fwdbwd_ms']:.2f} | {peak} | {ratios} |")
    return "\n".join(out)


def main(argv=None):
    return bench_main("python -m msa_codegen.bench_msa", CASES, run_case, _fmt,
                      lambda c: f"H={c.h}/{c.hkv} Hp={c.hp}/{c.hpk} N={c.n} D={c.d} Dp={c.dp} top_k={c.top_k}",
                      argv, summary=table)


if __name__ == "__main__":
    sys.exit(main())
