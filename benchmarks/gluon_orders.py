"""The Gluon forward's tile orders side by side (GPU; docs/performance.md, "The Gluon family": the
dense forward, and the listed order).

    PYTHONPATH=$PWD python benchmarks/gluon_orders.py [--cases 0,3] [--rep 150] [--rounds 3]
    bash benchmarks/run.sh gluon-orders [ARGS]

Per case (bf16; causal B=1 H=16 D=128 at N=4096-32768, B=4 N=8192, D=64 H=32 N=16384,
bidirectional N=16384, and the windows `window=4096` N=131072 and `causal=false,window=512`
N=65536; ``topk=16`` N=131072 with GQA 32/8, block_indices from ``select_blocks``): the Triton
forward (``msa_codegen.attention`` with MSA_CODEGEN_GLUON=0) and ``kernels.gluon.forward`` in each
order of the template's ``_tile`` (``gluon.HEAD_MAJOR``, ``BY_COST``, ``PAIRS``: the last two for
causal dense plans, pairs with an even number of query tiles a head only; ``LISTED``, the host's
list, for every case but top-k; ``GROUPED``, a KV head's query heads together on each row, for
top-k), each checked against the Triton forward's o and LSE first, then timed in interleaved
rounds (``triton.testing.do_bench`` medians, the best round kept). Effective TFLOP/s count the
visible pairs (4 * D * H * B * pairs). The order the launcher picks (a tuned row's, else
``gluon.tile_order``'s) is marked. One table last.
"""
from __future__ import annotations

import argparse
import os

import torch

import msa_codegen as msa
from msa_codegen.bench import _rel, _spin_up, _time, attended_pairs, topk_pairs
from msa_codegen.kernels import gluon
from msa_codegen.plan import plan_for

#: (pattern, B, H, N, D[, KV heads])
CASES = [("causal", 1, 16, 16384, 128), ("causal", 1, 16, 4096, 128), ("causal", 1, 16, 8192, 128),
         ("causal", 1, 16, 32768, 128), ("causal", 4, 16, 8192, 128), ("causal", 1, 32, 16384, 64),
         ("causal=false", 1, 16, 16384, 128), ("window=4096", 1, 16, 131072, 128),
         ("causal=false,window=512", 1, 16, 65536, 128), ("topk=16", 1, 32, 131072, 128, 8)]
NAMES = gluon.ORDER_NAMES


def run_case(pattern: str, b: int, h: int, n: int, d: int, hkv: int | None = None, *, rep: int, rounds: int) -> dict:
    hkv = hkv or h
    q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    plan = plan_for(pattern, q.device, q.dtype, d, h, hkv, n)
    spec = plan.groups[0].spec
    idx = msa.select_blocks(q, k, spec.topk, block=spec.block) if spec.topk else None
    extra = {} if idx is None else {"block_indices": idx}
    scale = d ** -0.5
    os.environ[gluon.ENV] = "0"
    with torch.no_grad():
        o_t, lse_t = msa.attention(q, k, v, pattern, return_lse=True, **extra)
    n_qb = -(-n // (2 * gluon.BLOCK_MC))
    orders = [gluon.HEAD_MAJOR]
    if pattern == "causal":
        orders += [gluon.BY_COST] + ([gluon.PAIRS] if n_qb % 2 == 0 else [])
    orders.append(gluon.GROUPED if spec.topk else gluon.LISTED)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    picked, _ = gluon.order_for(gluon.config(plan, "fwd")[0], plan.groups[0].kernel_plan, n_qb, b * h,
                                min(sms, b * h * n_qb), group=h // hkv)   # a tuned row's order, else tile_order's
    row = dict(case=f"{pattern} B={b} H={h}/{hkv} N={n} D={d}", picked=NAMES[picked], ms={}, check={})
    fns = {"triton": lambda: msa.attention(q, k, v, pattern, **extra)}

    def order_fn(order):
        def run():
            # the order as a use_gluon_config override: a tuned row of the shape would win over a
            # patched tile_order
            with gluon.use_gluon_config(fwd={"order": order}):
                return gluon.forward(q, k, v, plan, scale, idx)
        return run

    with torch.no_grad():
        for order in orders:
            fns[NAMES[order]] = order_fn(order)
            o_g, lse_g = fns[NAMES[order]]()
            row["check"][NAMES[order]] = (_rel(o_g, o_t), (lse_g - lse_t).abs().max().item())
        times = {name: [] for name in fns}
        for _ in range(rounds):   # interleaved: a drift of the clocks hits every variant
            for name, fn in fns.items():
                times[name].append(_time(fn, rep))
    pairs = topk_pairs(idx, n, spec.block) * (h // hkv) if spec.topk else attended_pairs(spec, n) * h * b
    flops = 4.0 * d * pairs
    row["ms"] = {name: min(t) for name, t in times.items()}
    row["tflops"] = {name: flops / ms * 1e-9 for name, ms in row["ms"].items()}
    os.environ.pop(gluon.ENV, None)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(str(i) for i in range(len(CASES))),
                    help="indices into CASES (default: all)")
    ap.add_argument("--rep", type=int, default=150, help="do_bench's budget in ms (default 150)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gluon_orders.py times GPU kernels: no GPU is visible")
    _spin_up(1.0)
    rows = []
    for i in args.cases.split(","):
        row = run_case(*CASES[int(i)], rep=args.rep, rounds=args.rounds)
        print(row, flush=True)
        rows.append(row)
    print("\n| case | launcher's order | Triton ms (TF/s) | head-major | by cost | pairs | listed | grouped | "
          "rel o / max LSE diff vs Triton |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        cell = {name: f"{ms:.3f} ({r['tflops'][name]:.0f})" for name, ms in r["ms"].items()}
        checks = "; ".join(f"{name} {a:.1e} / {b:.1e}" for name, (a, b) in r["check"].items())
        print(f"| {r['case']} | {r['picked']} | {cell['triton']} | {cell.get('head-major', '-')} | "
              f"{cell.get('by cost', '-')} | {cell.get('pairs', '-')} | {cell.get('listed', '-')} | "
              f"{cell.get('grouped', '-')} | {checks} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
