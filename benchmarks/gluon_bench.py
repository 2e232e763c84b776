"""The Gluon family against the Triton one, in one process (issue 22).

    PYTHONPATH=$PWD python benchmarks/gluon_bench.py [--cases w4096,bidir-w512,w4096-s64] [--out FILE]
    PYTHONPATH=$PWD python benchmarks/gluon_bench.py --shape 'causal=false,window=256@8x12x8192x64' [--shape ...]

Per case of ``msa_codegen.bench.CASES`` (bf16, B=1, H=16, D=128; N=131072, dense causal 16k):
``msa_codegen.attention`` timed forward and forward + backward with MSA_CODEGEN_GLUON=0 and
=1 (the variable is read on every call, so both run in this process, interleaved: triton,
gluon, triton, gluon), after checking that the Gluon call really ran the Gluon kernel and that
its o and LSE agree with the Triton forward's, and likewise for the backward: with the variable
set, forward + backward runs the Gluon backward where ``why_not_bwd`` allows (windows without
sink; column "gluon bwd ran"), its dq / dk / dv checked against the Triton backward's first.
"bwd" columns are fwd+bwd minus fwd. Effective forward TFLOP/s = 4 D H pairs / time
(``msa_codegen.bench._flops``: visible pairs only). One JSON line per case as soon as it is done
(and appended to --out), so that a run cut short still reports what finished; the table last.

``--shape PATTERN@BxHxNxD`` (repeatable) times a shape outside msa-bench's cases instead (H query
and key/value heads): where the two families cross over for plain windows. Its 15 shapes of
2026-12-05 (B=8 N=4096 D=64 to N=32768 D=128: Gluon 0.73-1.00x the Triton time) made the
automatic choice take the Gluon family for them (benchmarks/NOTES.md).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

import torch

import msa_codegen as msa
from msa_codegen.bench import CASES, Case, _flops, _rel, _spin_up, _time
from msa_codegen.kernels import gluon
from msa_codegen.plan import plan_for

REPS_MS = 200


def _with(flag: bool, fn):
    def run():
        os.environ[gluon.ENV] = "1" if flag else "0"
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
    # correctness first: the Gluon calls ran the Gluon kernels, and agree with the Triton ones
    calls = {"fwd": [], "bwd": []}
    real_fwd, real_bwd = gluon.forward, gluon.backward
    gluon.forward = lambda *a, **kw: calls["fwd"].append(1) or real_fwd(*a, **kw)
    gluon.backward = lambda *a, **kw: calls["bwd"].append(1) or real_bwd(*a, **kw)
    do = torch.randn_like(q)
    try:
        with torch.no_grad():
            o_t, lse_t = _with(False, lambda: msa.attention(q, k, v, case.pattern, return_lse=True))()
            o_g, lse_g = _with(True, lambda: msa.attention(q, k, v, case.pattern, return_lse=True))()
        torch.cuda.synchronize()
        row["gluon_ran"] = calls["fwd"] == [1]
        row["rel_o"] = _rel(o_g, o_t)
        row["max_lse_diff"] = (lse_g - lse_t).abs().max().item()
        del o_t, lse_t, o_g, lse_g
        grads = {}
        for fam, flag in (("triton", False), ("gluon", True)):
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            grads[fam] = _with(flag, lambda: torch.autograd.grad(msa.attention(qg, kg, vg, case.pattern), (qg, kg, vg),
                                                                 do))()
        torch.cuda.synchronize()
    finally:
        gluon.forward, gluon.backward = real_fwd, real_bwd
    row["gluon_bwd_ran"] = calls["bwd"] == [1]
    row["why_not_bwd"] = gluon.why_not_bwd(plan, q, k, v)
    for i, name in enumerate(("dq", "dk", "dv")):
        row[f"rel_{name}"] = _rel(grads["gluon"][i], grads["triton"][i])
    del grads
    flops = _flops(case)

    def fwd():
        with torch.no_grad():
            msa.attention(q, k, v, case.pattern)

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

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
    for fam in ("triton", "gluon"):
        row[f"bwd_{fam}_ms"] = row[f"fwd_bwd_{fam}_ms"] - row[f"fwd_{fam}_ms"]
    row["bwd_ratio"] = row["bwd_gluon_ms"] / row["bwd_triton_ms"]
    row["fwd_triton_tflops"] = flops / row["fwd_triton_ms"] * 1e-9
    row["fwd_gluon_tflops"] = flops / row["fwd_gluon_ms"] * 1e-9
    return row


def parse_shape(text: str) -> Case:
    """``PATTERN@BxHxNxD`` as a Case named by its shape (H query and key/value heads)."""
    pattern, sep, dims = text.rpartition("@")
    try:
        b, h, n, d = (int(x) for x in dims.split("x"))
    except ValueError:
        b = h = n = d = 0
    if not sep or not pattern or min(b, h, n, d) <= 0:
        raise SystemExit(f"--shape {text!r}: expected PATTERN@BxHxNxD, e.g. 'window=4096@1x16x16384x128'")
    return Case(f"{pattern} B={b} H={h} D={d}", pattern, hq=h, hkv=h, n=n, d=d, b=b)


def table(rows) -> str:
    lines = ["| case | gluon fwd ran | gluon bwd ran | rel o / max LSE diff vs triton | rel dq / dk / dv vs triton | "
             "fwd triton ms (TF/s) | fwd gluon ms (TF/s) | gluon/triton fwd | bwd triton ms | bwd gluon ms | "
             "gluon/triton bwd | fwd+bwd triton ms | fwd+bwd gluon ms | gluon/triton fwd+bwd |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['error'][:200]} |")
            continue
        bwd_ran = "yes" if r.get("gluon_bwd_ran") else f"no ({r.get('why_not_bwd') or '?'})"
        lines.append(
            f"| {r['case']} (N={r['n']}) | {r['gluon_ran']} | {bwd_ran} | {r['rel_o']:.1e} / {r['max_lse_diff']:.1e} | "
            f"{r['rel_dq']:.1e} / {r['rel_dk']:.1e} / {r['rel_dv']:.1e} | "
            f"{r['fwd_triton_ms']:.3f} ({r['fwd_triton_tflops']:.0f}) | {r['fwd_gluon_ms']:.3f} "
            f"({r['fwd_gluon_tflops']:.0f}) | {r['fwd_ratio']:.3f} | {r['bwd_triton_ms']:.2f} | {r['bwd_gluon_ms']:.2f} | "
            f"{r['bwd_ratio']:.3f} | {r['fwd_bwd_triton_ms']:.2f} | {r['fwd_bwd_gluon_ms']:.2f} | "
            f"{r['fwd_bwd_ratio']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="w4096,bidir-w512,w4096-s64", help="default: %(default)s")
    ap.add_argument("--shape", action="append", default=[], metavar="PATTERN@BxHxNxD",
                    help="a shape of its own instead of --cases (repeatable)")
    ap.add_argument("--out", default=None, help="append one JSON line per case to this file")
    ap.add_argument("--table", default=None, help="print the table of a --out file and exit")
    ap.add_argument("--watchdog", type=float, default=0,
                    help="after this many seconds print every thread's traceback (a hung kernel shows where); "
                         "0: off (default)")
    args = ap.parse_args(argv)
    if args.watchdog > 0:
        faulthandler.dump_traceback_later(args.watchdog, exit=False)
    if args.table:
        with open(args.table) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return 0
    by_name = {c.name: c for c in CASES}
    cases = [parse_shape(s) for s in args.shape] or [by_name[name] for name in args.cases.split(",")]
    print(f"torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    _spin_up()
    rows, rc = [], 0
    for case in cases:
        t0 = time.time()
        try:
            row = run_case(case)
        except Exception as e:   # recorded; the next case still runs
            row, rc = dict(case=case.name, error=f"{type(e).__name__}: {e}"[-400:]), 1
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
