"""The Gluon forward family against the Triton one, in one process (issue 22).

    PYTHONPATH=$PWD python benchmarks/gluon_bench.py [--cases w4096,w4096-s64,dense-causal] [--out FILE]

Per case of ``msa_codegen.bench.CASES`` (bf16, B=1, H=16, D=128; N=131072, dense causal 16k):
``msa_codegen.attention`` timed forward and forward + backward with MSA_CODEGEN_GLUON unset and
set (the variable is read on every call, so both run in this process, interleaved: triton,
gluon, triton, gluon), after checking that the Gluon call really ran the Gluon kernel and that
its o and LSE agree with the Triton forward's. Effective forward TFLOP/s = 4 D H pairs / time
(``msa_codegen.bench._flops``: visible pairs only). One JSON line per case as soon as it is done
(and appended to --out), so that a run cut short still reports what finished; the table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import msa_codegen as msa
from msa_codegen.bench import CASES, _flops, _rel, _spin_up, _time
from msa_codegen.kernels import gluon
from msa_codegen.plan import plan_for

REPS_MS = 200


def _with(flag: bool, fn):
    def run():
        if flag:
            os.environ[gluon.ENV] = "1"
        else:
            os.environ.pop(gluon.ENV, None)
        return fn()
    return run


def run_case(case) -> dict:
    row = dict(case=case.name, pattern=case.pattern, n=case.n, hq=case.hq, hkv=case.hkv, d=case.d)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(case.b, case.hq, case.n, case.d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(case.b, case.hkv, case.n, case.d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    plan = plan_for(case.pattern, q.device, q.dtype, case.d, case.hq, case.hkv, case.n)
    why = gluon.why_not(plan, q, k, v, case.d ** -0.5)
    if why:
        row["error"] = f"not eligible: {why}"
        return row
    # correctness first: the Gluon call ran the Gluon kernel, and agrees with the Triton one
    calls = []
    real = gluon.forward
    gluon.forward = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        with torch.no_grad():
            o_t, lse_t = _with(False, lambda: msa.attention(q, k, v, case.pattern, return_lse=True))()
            o_g, lse_g = _with(True, lambda: msa.attention(q, k, v, case.pattern, return_lse=True))()
    finally:
        gluon.forward = real
    torch.cuda.synchronize()
    row["gluon_ran"] = calls == [1]
    row["rel_o"] = _rel(o_g, o_t)
    row["max_lse_diff"] = (lse_g - lse_t).abs().max().item()
    del o_t, lse_t, o_g, lse_g
    flops = _flops(case)

    def fwd():
        with torch.no_grad():
            msa.attention(q, k, v, case.pattern)

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)

    def fwd_bwd():
        out = msa.attention(qg, kg, vg, case.pattern)
        torch.autograd.grad(out, (qg, kg, vg), do)

    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        times = {"triton": [], "gluon": []}
        for _ in range(2):   # interleaved: a drift of the clocks hits both
            for fam, flag in (("triton", False), ("gluon", True)):
                times[fam].append(_time(_with(flag, fn), REPS_MS))
        for fam in times:
            row[f"{name}_{fam}_ms"] = min(times[fam])
        row[f"{name}_ratio"] = row[f"{name}_gluon_ms"] / row[f"{name}_triton_ms"]
    row["fwd_triton_tflops"] = flops / row["fwd_triton_ms"] * 1e-9
    row["fwd_gluon_tflops"] = flops / row["fwd_gluon_ms"] * 1e-9
    return row


def table(rows) -> str:
    lines = ["| case | gluon ran | rel o / max LSE diff vs triton | fwd triton ms (TF/s) | fwd gluon ms (TF/s) | "
             "gluon/triton fwd | fwd+bwd triton ms | fwd+bwd gluon ms | gluon/triton fwd+bwd |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['error'][:200]} |")
            continue
        lines.append(
            f"| {r['case']} (N={r['n']}) | {r['gluon_ran']} | {r['rel_o']:.1e} / {r['max_lse_diff']:.1e} | "
            f"{r['fwd_triton_ms']:.3f} ({r['fwd_triton_tflops']:.0f}) | {r['fwd_gluon_ms']:.3f} "
            f"({r['fwd_gluon_tflops']:.0f}) | {r['fwd_ratio']:.3f} | {r['fwd_bwd_triton_ms']:.3f} | "
            f"{r['fwd_bwd_gluon_ms']:.3f} | {r['fwd_bwd_ratio']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="w4096,w4096-s64,dense-causal", help="default: %(default)s")
    ap.add_argument("--out", default=None, help="append one JSON line per case to this file")
    ap.add_argument("--table", default=None, help="print the table of a --out file and exit")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return 0
    by_name = {c.name: c for c in CASES}
    print(f"torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    _spin_up()
    rows, rc = [], 0
    for name in args.cases.split(","):
        t0 = time.time()
        try:
            row = run_case(by_name[name])
        except Exception as e:   # recorded; the next case still runs
            row, rc = dict(case=name, error=f"{type(e).__name__}: {e}"[-400:]), 1
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        torch.cuda.empty_cache()
    print(table(rows))
    return rc


if __name__ == "__main__":
    sys.exit(main())
