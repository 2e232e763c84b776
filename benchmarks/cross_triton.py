"""The Triton family's kernels as another Triton compiles them, timed on this GPU beside this Triton's.

    python benchmarks/cross_triton.py emit --out DIR [--cases w4096,bidir-w512,dense-causal] [--family gluon]
    python benchmarks/cross_triton.py run --from DIR [--rounds 5] [--rep-ms 100]

The GPU image runs one Triton (3.6) while a fresh install resolves another (3.8 with torch 2.14.1,
3.9 with 2.15), and a Triton wheel does not fit what the device machine can carry. Their
compilers differ most in the backward (benchmarks/NOTES.md, "The Triton family's backward on the
Tritons a fresh install resolves"). This compares the compilers on the same GPU:

- ``emit`` (any machine, no GPU; run it in a virtual environment of the other Triton): for each
  msa-bench case (``msa_codegen.bench.CASES``), the forward and backward kernels that case
  launches at the heuristic's default configuration on sm_90 (``tuning.resources.launches``),
  compiled ahead of time as a launch specialises them (``resources._signature``: 16-byte aligned
  pointers, integers divisible by 16, unit strides constant), bf16. DIR gets each kernel's cubin
  and a JSON line of what it is (a few MB in all: carry DIR to the GPU).
- ``run`` (the GPU): each case's call once under that default configuration
  (``use_config``, ``MSA_CODEGEN_GLUON=0``), its launches recorded; per recorded launch of a
  kernel that DIR holds, three forms of it on the launch's own arguments: the kernel this
  process's Triton compiled for the call (``jit``), the same ahead-of-time compile by this
  Triton (``aot``: checks that the ahead-of-time specialisation times as the call's), and DIR's
  cubin loaded into that kernel's launcher (``other``; refused unless its parameters, shared
  memory and scratch match). Each form's outputs must equal the ``jit`` form's to the bit or
  within 1e-3 relative; then the forms are timed in interleaved rounds (``do_bench``'s median a
  round, the median of the rounds). Last, a table: ms per kernel and other / aot.

``--family gluon`` (emit): the cases' Gluon forward instead (``kernels/gluon.py``, the heuristic's
knobs: ``use_gluon_config(fwd={})``), its launch built as ``gluon.forward`` builds it for a GPU of
132 SMs (meta tensors, no GPU) and specialised as Triton's JIT specialises that launch (its own
binder, for sm_90). ``run`` reads the family from DIR: it records the case's real Gluon forward
launch, and compares the kernel this Triton's JIT compiled (``jit``), this Triton's compile of
the same emulated specialisation (``aot``; its cubin equal to the jit's shows the emulation
right) and DIR's (``other``). The Gluon source each Triton renders differs only in the API names
it has (``gluon.api``); a row is matched by ``gluon.kernel_hash``, which renders them alike.

Kernel time only: the host path is each Triton's own and is not compared here.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import inspect
import json
import os
import statistics
import sys
from pathlib import Path

import torch

DEFAULT_CASES = "w4096,bidir-w512,dense-causal,d64-w4096"
#: kernels compared (the stats pass, msa_bwd_pre, is element-wise and left out)
KERNELS = ("msa_fwd", "msa_bwd_dkdv", "msa_bwd_dq")


def _cases(names: str):
    from msa_codegen.bench import CASES

    by_name = {c.name: c for c in CASES}
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; msa-bench's: {', '.join(by_name)}")
    return [by_name[n] for n in names.split(",")]


def _default(case):
    from msa_codegen.heuristics import default_config

    return default_config(torch.device("cuda"), case.d, torch.bfloat16, capability="9.0", pattern=case.pattern)


def _launches(case):
    """(direction, label, kernel, constexprs, warps, stages) of the case's Triton-family launches."""
    from msa_codegen.tuning import resources

    cfg = _default(case)
    out = []
    for direction, params in (("fwd", cfg.fwd), ("bwd", cfg.bwd)):
        for label, kern, consts, warps, stages in resources.launches(
                case.pattern, direction, dataclasses.asdict(params), head_dim=case.d, dtype=torch.bfloat16,
                heads=case.hq, kv_heads=case.hkv, seqlen=case.n):
            # the kernel's own constexprs (launches names some that only other kernels take)
            names = inspect.signature(kern.fn).parameters
            out.append((direction, label, kern, {n: v for n, v in consts.items() if n in names}, warps, stages))
    return out


def _key(kern, consts: dict, warps: int, stages: int, group: int) -> str:
    """The same on both machines for the same kernel source and launch: the kernel's source text,
    its constexprs, warps, stages and GQA group."""
    h = hashlib.sha256(kern.src.encode())
    h.update(repr((kern.__name__, sorted(consts.items()), warps, stages, group == 1)).encode())
    return h.hexdigest()[:20]


def _compile(kern, consts: dict, warps: int, stages: int, group: int):
    import triton
    from triton.compiler import ASTSource

    from msa_codegen.tuning import resources

    sig, cst, attrs = resources._signature(kern, consts, "bf16", group)
    return triton.compile(ASTSource(fn=kern, signature=sig, constexprs=cst, attrs=attrs),
                          target=resources.target_of("9.0"),
                          options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": True})


def _params(compiled) -> list[str]:
    """The kernel's PTX parameter types, in order (the launch ABI both compiles must share)."""
    import re

    m = re.search(r"\.entry\s+\w+\((.*?)\)", compiled.asm["ptx"], re.S)
    return re.findall(r"\.param\s+(\.\w+)", m.group(1)) if m else []


def emit(out: Path, names: str) -> int:
    import triton

    out.mkdir(parents=True, exist_ok=True)
    index = out / "kernels.jsonl"
    seen = set()
    with index.open("w") as f:
        for case in _cases(names):
            group = case.hq // case.hkv
            for direction, label, kern, consts, warps, stages in _launches(case):
                if kern.__name__ not in KERNELS:
                    continue
                key = _key(kern, consts, warps, stages, group)
                if key in seen:
                    continue
                seen.add(key)
                k = _compile(kern, consts, warps, stages, group)
                (out / f"{key}.cubin").write_bytes(k.asm["cubin"])
                row = dict(key=key, case=case.name, direction=direction, label=label, name=k.name,
                           consts=consts, warps=warps, stages=stages, group=group,
                           shared=k.metadata.shared, global_scratch_size=k.metadata.global_scratch_size,
                           profile_scratch_size=getattr(k.metadata, "profile_scratch_size", 0),
                           params=_params(k), triton=triton.__version__)
                f.write(json.dumps(row) + "\n")
                print(f"[emit] {case.name} {label}: {k.name} {consts} warps {warps} stages {stages}, "
                      f"shared {k.metadata.shared} B", flush=True)
    print(f"wrote {len(seen)} kernels (Triton {triton.__version__}) to {out}")
    return 0


# ---- the Gluon family ----------------------------------------------------------------------

#: the SMs of the GPUs the Gluon forward's launch is built for (H100 SXM and H200 both have 132)
GLUON_SMS = 132


def _gluon_launch(case, device: str = "meta"):
    """(kernel plan, (kern, grid, args, kw)) of the case's Gluon forward launch as
    ``gluon.forward`` makes it at the heuristic's knobs: on ``device`` "meta" without a GPU (the
    SM count ``GLUON_SMS``), on "cuda" with the GPU's, the launch then also run."""
    from msa_codegen.kernels import direct, gluon
    from msa_codegen.plan import plan_for

    dev = torch.device(device)
    plan = plan_for(case.pattern, dev, torch.bfloat16, case.d, case.hq, case.hkv, case.n)
    if len(plan.groups) != 1:
        raise SystemExit(f"{case.name}: {len(plan.groups)} head groups (one Gluon launch each); one is compared")
    why = gluon.pattern_reason(plan.groups[0].kernel_plan)
    if why:
        raise SystemExit(f"{case.name}: not a Gluon plan ({why})")
    g = torch.Generator(device=dev).manual_seed(0) if device == "cuda" else None
    q = torch.randn(case.b, case.hq, case.n, case.d, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(case.b, case.hkv, case.n, case.d, device=dev, dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    seen = []
    real_launch, real_sms, real_current = direct.launch, gluon._sm_count, torch.cuda.current_device

    def spy(kern, grid, *args, **kw):
        seen.append((kern, tuple(grid), args, dict(kw)))
        if device != "meta":
            real_launch(kern, grid, *args, **kw)

    direct.launch = spy
    if device == "meta":
        gluon._sm_count = lambda index: GLUON_SMS
        torch.cuda.current_device = lambda: 0
    try:
        with gluon.use_gluon_config(fwd={}):
            gluon.forward(q, k, v, plan, case.d ** -0.5)
    finally:
        direct.launch, gluon._sm_count, torch.cuda.current_device = real_launch, real_sms, real_current
    (launch,) = seen
    return plan.groups[0].kernel_plan, launch


def _gluon_compile(kern, args, kw, arch: int = 90):
    """``kern[grid](*args, **kw)``'s kernel compiled for sm_{arch} without launching it: the
    signature, constexprs and attributes from this Triton's own binder, as its JIT makes them."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    kw = dict(kw)
    kw["debug"] = kw.get("debug", kern.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):
        kw["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kern.signature, kern.params, backend)
    bound, specialization, options = binder(*args, **kw)
    options, signature, constexprs, attrs = kern._pack_args(backend, kw, bound, specialization, options)
    return triton.compile(GluonASTSource(kern, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def emit_gluon(out: Path, names: str) -> int:
    import triton

    from msa_codegen.kernels import gluon

    out.mkdir(parents=True, exist_ok=True)
    with (out / "kernels.jsonl").open("w") as f:
        for case in _cases(names):
            kplan, (kern, grid, args, kw) = _gluon_launch(case)
            key = gluon.kernel_hash((kplan,), "fwd") + "-" + case.name
            k = _gluon_compile(kern, args, kw)
            (out / f"{key}.cubin").write_bytes(k.asm["cubin"])
            consts = {n: kw[n] for n in ("STAGES", "FOLD", "ORDER") if n in kw}
            row = dict(family="gluon", key=key, case=case.name, direction="fwd", label="gluon fwd", name=k.name,
                       consts=consts, grid=list(grid), shared=k.metadata.shared, num_warps=k.metadata.num_warps,
                       global_scratch_size=k.metadata.global_scratch_size,
                       profile_scratch_size=getattr(k.metadata, "profile_scratch_size", 0),
                       params=_params(k), triton=triton.__version__)
            f.write(json.dumps(row) + "\n")
            print(f"[emit] {case.name}: {k.name} {consts} grid {grid}, shared {k.metadata.shared} B", flush=True)
    return 0


def run_gluon(src: Path, rows: list[dict], names: str | None, rounds: int, rep_ms: int) -> list[tuple]:
    """``run`` for DIR's Gluon forwards: the table's rows."""
    from msa_codegen.kernels import gluon

    by_case = {r["case"]: r for r in rows}
    table = []
    for case in _cases(names or ",".join(by_case)):
        row = by_case.get(case.name)
        kplan, (kern, grid, args, kw) = _gluon_launch(case, "cuda")
        key = gluon.kernel_hash((kplan,), "fwd") + "-" + case.name
        if row is None or row["key"] != key:
            print(f"[{case.name}] gluon fwd: not in {src} for this tree's kernel ({key}); emit it again", flush=True)
            continue
        if list(grid) != row["grid"] or {n: kw.get(n) for n in row["consts"]} != row["consts"]:
            print(f"[{case.name}] gluon fwd: launched as grid {grid} {kw}, emitted for {row['grid']} "
                  f"{row['consts']}; not compared", flush=True)
            continue
        jit = kern[grid](*args, **kw)   # this Triton's JIT: the kept kernel of the launch above
        aot = _gluon_compile(kern, args, kw)
        if row["num_warps"] != aot.metadata.num_warps:
            print(f"[{case.name}] gluon fwd: {row['num_warps']} warps in all against {aot.metadata.num_warps}; "
                  f"not compared", flush=True)
            continue
        same = aot.asm["cubin"] == jit.asm["cubin"]
        other, why = _other(aot, (src / f"{row['key']}.cubin").read_bytes(), row)
        if other is None:
            print(f"[{case.name}] gluon fwd: the other binary cannot run in this launcher: {why}", flush=True)
            continue
        forms = dict(jit=_runner(jit, kern, grid, args, kw), aot=_runner(aot, kern, grid, args, kw),
                     other=_runner(other, kern, grid, args, kw))
        checked = _checked_times(f"[{case.name}] gluon fwd", forms, args, rounds, rep_ms)
        if checked is None:
            continue
        diff, t = checked
        print(f"[{case.name}] gluon fwd: " + ", ".join(f"{n} {ms:.4f} ms" for n, ms in t.items())
              + f"; other / aot {t['other'] / t['aot']:.3f}; aot cubin {'==' if same else '!='} jit's; "
              f"differences {diff}; registers jit {jit.n_regs} other {other.n_regs}, spills jit "
              f"{jit.n_spills} other {other.n_spills}", flush=True)
        table.append((case.name, "gluon fwd", t["jit"], t["aot"], t["other"], t["other"] / t["aot"]))
    return table


# ---- the GPU side --------------------------------------------------------------------------

def _record(case):
    """The case's forward + backward once at the default configuration on the Triton family: the
    launches (kernel, grid, args, kwargs) in order, and the call's kept compiled kernels."""
    import msa_codegen as msa
    from msa_codegen.config import use_config
    from msa_codegen.kernels import direct, gluon

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(case.b, case.hq, case.n, case.d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(case.b, case.hkv, case.n, case.d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    launches = []
    real = direct.launch

    def spy(kern, grid, *args, **kw):
        launches.append((kern, tuple(grid), args, dict(kw)))
        return real(kern, grid, *args, **kw)

    direct.launch = spy
    try:
        with gluon.forced("0"), use_config(_default(case)):
            o = msa.attention(q, k, v, case.pattern)
            o.backward(torch.randn_like(o))
        torch.cuda.synchronize()
    finally:
        direct.launch = real
    return launches, (q, k, v, o)


def _wanted(case) -> dict:
    """The case's compared launches by (kernel name, constexprs, warps, stages): (label, kernel,
    constexprs)."""
    return {(kern.__name__, tuple(sorted(consts.items())), warps, stages): (label, kern, consts)
            for _, label, kern, consts, warps, stages in _launches(case) if kern.__name__ in KERNELS}


def _match(kern, kw: dict, wanted: dict):
    """The entry of ``wanted`` a recorded launch ``kern[grid](..., **kw)`` is, or None: same kernel
    name, warps and stages, and every constexpr of the entry at the launch's value (given, else
    the parameter's default)."""
    name = getattr(kern, "__name__", "")
    defaults = {p.name: p.default for p in inspect.signature(kern.fn).parameters.values()}
    return next((entry for (n, cs, w, s), entry in wanted.items()
                 if n == name and w == kw.get("num_warps") and s == kw.get("num_stages")
                 and all(kw.get(a, defaults.get(a, inspect.Parameter.empty)) == b for a, b in cs)), None)


def _vals(kern, args, kw):
    from msa_codegen.kernels import direct

    return (*args, *direct._tail(kern, len(args), kw))


def _runner(compiled, kern, grid, args, kw):
    from triton import knobs
    from triton.runtime import driver

    vals = _vals(kern, args, kw)
    g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    stream = driver.active.get_current_stream(torch.cuda.current_device())
    run = compiled.run   # loads the binary on first use

    def launch():
        run(*g, stream, compiled.function, compiled.packed_metadata, None, knobs.runtime.launch_enter_hook,
            knobs.runtime.launch_exit_hook, *vals)
    return launch


def _other(aot, cubin: bytes, row: dict):
    """``aot`` with the other Triton's binary in its place (same launcher), or (None, why)."""
    from triton.runtime import driver

    if row["params"] != _params(aot):
        return None, "its parameters differ"
    for field in ("global_scratch_size", "profile_scratch_size"):
        if row[field] != getattr(aot.metadata, field, 0):
            return None, f"{field} {row[field]} against {getattr(aot.metadata, field, 0)}"
    aot.run   # this Triton's launcher and binary, loaded
    other = copy.copy(aot)
    other.kernel = cubin
    other.module, other.function, other.n_regs, other.n_spills, _ = driver.active.utils.load_binary(
        aot.name, cubin, row["shared"], torch.cuda.current_device())
    other.packed_metadata = (aot.metadata.num_warps, aot.metadata.num_ctas, row["shared"])
    return other, None


def _tensors(args) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor) and a.is_cuda]


def _same_outputs(forms: dict, args) -> dict:
    """Per form: the largest relative difference of any tensor argument from the ``jit`` form's after
    one launch from the same state (0.0: bit for bit)."""
    tensors = _tensors(args)
    start = [t.detach().clone() for t in tensors]
    after = {}
    for name, launch in forms.items():
        for t, s in zip(tensors, start):
            t.data.copy_(s)
        launch()
        torch.cuda.synchronize()
        after[name] = [t.detach().clone() for t in tensors]
    for t, s in zip(tensors, start):
        t.data.copy_(s)
    ref = after["jit"]
    diff = {}
    for name, outs in after.items():
        worst = 0.0
        for a, b in zip(outs, ref):
            if torch.equal(a, b):
                continue
            a64, b64 = a.double(), b.double()
            worst = max(worst, ((a64 - b64).norm() / b64.norm().clamp_min(1e-30)).item())
        diff[name] = worst
    return diff


def _time(forms: dict, rounds: int, rep_ms: int) -> dict:
    """Per form, the median over ``rounds`` interleaved rounds of ``triton.testing.do_bench``'s
    median (``rep_ms`` of launches a round, the L2 cache flushed before each)."""
    import triton.testing

    times = {name: [] for name in forms}
    for _ in range(rounds):
        for name, launch in forms.items():
            times[name].append(triton.testing.do_bench(launch, warmup=max(5, rep_ms // 4), rep=rep_ms,
                                                       return_mode="median"))
    return {name: statistics.median(ts) for name, ts in times.items()}


def _checked_times(tag: str, forms: dict, args, rounds: int, rep_ms: int):
    """(differences from the ``jit`` form's outputs, times) of the forms, or None, said under
    ``tag``, where a form's outputs differ by more than 1e-3 relative (then nothing is timed)."""
    diff = _same_outputs(forms, args)
    bad = {n: d for n, d in diff.items() if d > 1e-3}
    if bad:
        print(f"{tag}: outputs differ from the call's kernel: {bad}; not timed", flush=True)
        return None
    return diff, _time(forms, rounds, rep_ms)


def run(src: Path, names: str | None, rounds: int, rep_ms: int) -> int:
    import triton

    from msa_codegen.kernels import direct

    rows = [json.loads(line) for line in (src / "kernels.jsonl").read_text().splitlines() if line.strip()]
    by_key = {r["key"]: r for r in rows}
    other_version = rows[0]["triton"] if rows else "?"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__} against "
          f"{other_version} (from {src})", flush=True)
    gluon_rows = [r for r in rows if r.get("family") == "gluon"]
    table = run_gluon(src, gluon_rows, names, rounds, rep_ms) if gluon_rows else []
    names = names or ",".join(dict.fromkeys(r["case"] for r in rows))
    for case in ([] if gluon_rows else _cases(names)):
        group = case.hq // case.hkv
        launches, keep = _record(case)
        wanted = _wanted(case)
        done = set()
        for kern, grid, args, kw in launches:
            match = _match(kern, kw, wanted)
            if match is None or match[0] in done:
                continue
            label, _, c = match
            done.add(label)
            key = _key(kern, c, kw.get("num_warps"), kw.get("num_stages"), group)
            row = by_key.get(key)
            if row is None:
                print(f"[{case.name}] {label}: not in {src} (emit this case with the other Triton)", flush=True)
                continue
            jit = next((ck for sig, (ck, _) in direct._compiled.items() if sig[0] is kern
                        and sig[1] == len(args) and dict(sig[8]) == kw), None)
            aot = _compile(kern, c, kw.get("num_warps"), kw.get("num_stages"), group)
            other, why = _other(aot, (src / f"{key}.cubin").read_bytes(), row)
            if other is None:
                print(f"[{case.name}] {label}: the other binary cannot run in this launcher: {why}", flush=True)
                continue
            forms = {"jit": _runner(jit, kern, grid, args, kw)} if jit is not None else {}
            forms.update(aot=_runner(aot, kern, grid, args, kw), other=_runner(other, kern, grid, args, kw))
            if "jit" not in forms:
                forms = {"jit": forms.pop("aot"), "other": forms["other"]}
            checked = _checked_times(f"[{case.name}] {label}", forms, args, rounds, rep_ms)
            if checked is None:
                continue
            diff, t = checked
            base = t.get("aot", t["jit"])
            print(f"[{case.name}] {label}: " + ", ".join(f"{n} {ms:.4f} ms" for n, ms in t.items())
                  + f"; other / aot {t['other'] / base:.3f}; differences {diff}", flush=True)
            table.append((case.name, label, t.get("jit"), t.get("aot"), t["other"], t["other"] / base))
        del keep
        torch.cuda.empty_cache()
    print(f"\n| case | kernel | jit ms ({triton.__version__}) | aot ms ({triton.__version__}) | other ms "
          f"({other_version}) | other / aot |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, label, j, a, o, r in table:
        print(f"| {name} | {label} | {'-' if j is None else f'{j:.4f}'} | {'-' if a is None else f'{a:.4f}'} "
              f"| {o:.4f} | {r:.3f} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("emit", help="compile the cases' kernels with this Triton for sm_90 (no GPU)")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--cases", default=None, help=f"default: {DEFAULT_CASES}; with --family gluon: w4096,dense-causal")
    e.add_argument("--family", choices=("triton", "gluon"), default="triton")
    r = sub.add_parser("run", help="time DIR's kernels against this Triton's on this GPU")
    r.add_argument("--from", dest="src", type=Path, required=True)
    r.add_argument("--cases", default=None, help="default: every case DIR holds")
    r.add_argument("--rounds", type=int, default=5)
    r.add_argument("--rep-ms", type=int, default=100, help="timing budget of one form in one round")
    args = ap.parse_args(argv)
    if args.cmd == "emit" and args.family == "gluon":
        return emit_gluon(args.out, args.cases or "w4096,dense-causal")
    if args.cmd == "emit":
        return emit(args.out, args.cases or DEFAULT_CASES)
    if not torch.cuda.is_available():
        raise SystemExit("run needs a CUDA GPU")
    return run(args.src, args.cases, args.rounds, args.rep_ms)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
