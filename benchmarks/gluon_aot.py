"""The Gluon family compiled for sm_90 without a GPU: shared memory, registers, spills.

    PYTHONPATH=$PWD python benchmarks/gluon_aot.py [PATTERN ...] [--dtypes bf16,fp16] [--head-dims 64,128]
                                                  [--directions fwd,bwd] [--documents]

One JSON line per (pattern, dtype, head dim, kernel: fwd, or the backward's dkdv and dq; the
backward's patterns are those the Gluon backward takes, the others are skipped; a sink's pass is
plain Triton, not compiled here): shared bytes (the kernel's, sm_90 allows 232,448),
registers a thread at launch, the cubin's stack bytes and its spill stores / loads (STL / LDL,
``gluon_probe._ptxas_regs``: cuobjdump on the cubin). Run it in a process without
TRITON_INTERPRET, with the Triton the GPU runs (the H200 image: 3.6). ``--documents``: the
plans of calls with cu_seqlens (packed documents).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from msa_codegen.kernels import gluon  # noqa: E402
from msa_codegen.pattern.lowering import CU_SEQLENS, lower  # noqa: E402
from msa_codegen.pattern.spec import parse  # noqa: E402

PATTERNS = ["window=4096", "causal", "causal=false", "causal=false,window=512", "window=4096,sink=64",
            "causal=false,window=512,sink=64", "window=1"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("patterns", nargs="*", default=PATTERNS, help="default: " + " ".join(PATTERNS))
    ap.add_argument("--dtypes", default="bf16,fp16", help="default: %(default)s")
    ap.add_argument("--head-dims", default="128,64", help="default: %(default)s")
    ap.add_argument("--directions", default="fwd,bwd", help="default: %(default)s")
    ap.add_argument("--documents", action="store_true", help="the plans of calls with cu_seqlens")
    args = ap.parse_args(argv)
    docs = CU_SEQLENS if args.documents else {}
    from gluon_probe import _ptxas_regs

    rc = 0
    for direction in args.directions.split(","):
        for pattern in args.patterns:
            kplan = lower(parse(pattern).groups[0].spec, **docs)
            if direction == "bwd" and gluon.bwd_pattern_reason(kplan):
                continue
            for dt in args.dtypes.split(","):
                for d in map(int, args.head_dims.split(",")):
                    t0 = time.time()
                    try:
                        if direction == "fwd":
                            kernels = {"fwd": gluon.aot_compile(kplan, DTYPES[dt], d)}
                        else:
                            kernels = gluon.aot_compile_bwd(kplan, DTYPES[dt], d)
                        rows = [dict(kernel=name, shared=k.metadata.shared, **(_ptxas_regs(k) or {}))
                                for name, k in kernels.items()]
                    except Exception as e:   # recorded, the next one still compiles
                        rows, rc = [dict(kernel=direction, error=f"{type(e).__name__}: {e}"[-2000:])], 1
                    for row in rows:
                        row = dict(pattern=pattern + (" (cu_seqlens)" if docs else ""), dtype=dt, head_dim=d, **row,
                                   seconds=round(time.time() - t0, 1))
                        print(json.dumps(row), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
