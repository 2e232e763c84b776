"""Registers, spills and loop bodies of the generated kernels for sm_90, without a GPU.

    python benchmarks/sass_report.py [--pattern window=4096] [--kernel msa_bwd_dkdv] [--config 64,64,4,2]
        [--head-dim 128] [--ds] [--dump FILE]

Compiles one generated kernel (bf16, tensor descriptors on) for an sm_90 target with the Triton
that is installed (its bundled ptxas) and prints ptxas's register count and stack bytes, then,
for every loop that issues wgmma (HGMMA), its length in instructions, the local-memory spill
instructions in it, where each HGMMA shape reads its A operand (registers or shared memory),
the waits for products in flight (``WARPGROUP.DEPBAR``: one after every HGMMA means ptxas
serialized the wgmma pipeline) and, when forward branches inside it give an iteration more than
one path (a masked block's own branch), the shortest and longest path. To see what the GPU image compiles, install its Triton beside the project's, e.g.
``pip install --no-deps --target /tmp/t36 triton==3.6.0`` and run with
``PYTHONPATH=/tmp/t36:$PWD``. Not part of the package: it turns a suspicion about register
pressure into numbers before a GPU run. Needs tests/aot_check.py (its ``compile_kernel``).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def report(compiled, label: str, dump: str | None = None) -> None:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", f.name], capture_output=True, text=True).stdout
    if dump:
        Path(dump).write_text(sass)
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    at = {a: n for n, (a, _) in enumerate(ins)}
    regs = " ".join(re.findall(r"(REG:\d+|STACK:\d+)", usage))
    print(f"{label}: {regs}, shared {compiled.metadata.shared} B, {len(ins)} instructions", flush=True)
    for n, (a, text) in enumerate(ins):
        target = re.findall(r"0x([0-9a-f]+)", text) if "BRA" in text else []
        if not target or int(target[-1], 16) >= a or int(target[-1], 16) not in at:
            continue
        start = int(target[-1], 16)
        span = ins[at[start]:n + 1]
        body = [t for _, t in span]
        ops = collections.Counter((t.split()[1] if t.startswith("@") else t.split()[0]) for t in body)
        if not any(k.startswith("HGMMA") for k in ops):
            continue
        # innermost loops only: one holding another backward branch into itself is an outer loop
        if any("BRA" in t and re.findall(r"0x([0-9a-f]+)", t) and start <= int(re.findall(r"0x([0-9a-f]+)", t)[-1], 16) < b
               for b, t in span[:-1]):
            continue
        spills = sum(v for k, v in ops.items() if k.startswith(("STL", "LDL")))
        sources = collections.Counter()
        for t in body:
            m = re.match(r"(?:@!?U?P\w+\s+)?(HGMMA\.\S+)\s+R\d+,\s*(\S+?),", t)
            if m:
                sources[(m.group(1), "smem" if m.group(2).startswith("gdesc") else "registers")] += 1
        src = ", ".join(f"{shape} A from {where} x{c}" for (shape, where), c in sorted(sources.items()))
        lo, hi = _path_lengths(span)
        paths = f"; paths through it {lo} to {hi} instructions" if lo != hi else ""
        # ptxas's serialized wgmma (its C7511 / C7515): a wait after every product
        hgmma = sum(v for k, v in ops.items() if k.startswith("HGMMA"))
        waits = ops.get("WARPGROUP.DEPBAR.LE", 0)
        serial = " (every HGMMA waits: serialized)" if waits >= hgmma else ""
        print(f"  loop of {len(body)} instructions: {spills} spill loads/stores, {ops.get('MUFU.EX2', 0)} MUFU.EX2, "
              f"{ops.get('FSEL', 0)} FSEL; {src}; {waits} waits for {hgmma} HGMMA{serial}{paths}", flush=True)


def _path_lengths(span) -> tuple[int, int]:
    """The fewest and the most instructions an iteration of a loop (``span``: its (address,
    instruction) pairs, head to back edge) issues, over its forward branches taken or not (an
    unconditional one always taken): a loop whose masked blocks take a branch of their own has
    two, the unmasked iteration being the short one. Predicated instructions count as issued."""
    at = {a: i for i, (a, _) in enumerate(span)}
    lengths = set()

    def walk(i, issued, depth):
        while i < len(span):
            issued += 1
            text = span[i][1]
            if i == len(span) - 1:
                lengths.add(issued)
                return
            target = re.findall(r"0x([0-9a-f]+)", text) if "BRA" in text else []
            if target and int(target[-1], 16) in at and at[int(target[-1], 16)] > i:
                if depth < 12:   # at most 2^12 paths
                    walk(at[int(target[-1], 16)], issued, depth + 1)
                if not text.startswith("@"):
                    return
            i += 1

    walk(0, 0, 0)
    return (min(lengths), max(lengths)) if lengths else (len(span), len(span))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pattern", default="window=4096")
    ap.add_argument("--kernel", default="msa_bwd_dkdv", choices=["msa_fwd", "msa_bwd_dq", "msa_bwd_dkdv"])
    ap.add_argument("--config", default="64,64,4,2", help="block_m,block_n,warps,stages of that kernel")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dump", help="also write the whole SASS listing to this file")
    ap.add_argument("--ds", action="store_true", help="the backward that passes the band's dS through scratch "
                    "(dk/dv stores it, dq reads it)")
    ap.add_argument("--positional", action="store_true", help="the kernels with run-time positions (q_pos / k_pos)")
    ap.add_argument("--segments", action="store_true", help="with segments too (cu_seqlens, buckets): implies "
                    "--positional")
    args = ap.parse_args(argv)
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent / "tests")]
    import msa_codegen as msa
    from aot_check import compile_kernel
    from msa_codegen.kernels import render as codegen
    from msa_codegen.kernels.schedule import block_d as _block_d
    from msa_codegen.pattern.lowering import lower

    plan = lower(msa.parse(args.pattern).groups[0].spec, positional=args.positional or args.segments,
                 segments=args.segments)
    direction = "fwd" if args.kernel == "msa_fwd" else "bwd"
    src = codegen.render(plan, direction)
    label = (f"{args.kernel} {args.pattern}{' (segments)' if args.segments else ' (positions)' if args.positional else ''}"
             f" D={args.head_dim} config {args.config}")
    path = Path(tempfile.mkdtemp()) / f"msa_sass_{direction}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    bm, bn, warps, stages = (int(x) for x in args.config.split(","))
    d = args.head_dim
    consts = dict(HEAD_DIM=d, BLOCK_D=_block_d(d), BLOCK_M=bm, BLOCK_N=bn, DOT_PREC="tf32", TMA=True, FOLD=True,
                  PREFIX_TILES=False, DS=args.ds)
    if args.ds:
        label += ", dS through scratch"
    print(f"Triton {triton.__version__}, sm_90", flush=True)
    report(compile_kernel(getattr(mod, args.kernel), constexprs=consts,
                          options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True)), label, args.dump)
    return 0


if __name__ == "__main__":
    sys.exit(main())
