"""MSA launch configs side by side in one process: the main attention's phases under ``MsaConfig`` variants.

    PYTHONPATH=$PWD python benchmarks/msa_ab.py --variant two=fwd_rows=64,fwd_warps=4,fwd_stages=1 \\
        [--variant NAME=FIELD=VALUE,...] [--n 131072] [--phases fwd,bwd,teach,both,one,two] [--rounds 5] [--rep-ms 300]
    bash benchmarks/run.sh msa-ab ARGS

For experiments on the MSA kernels' launch parameters (benchmarks/NOTES.md, "The MSA main forward's
loop"): ``default`` (``MsaConfig()``: the heuristic default, no tuning row), each ``--variant``
(fields of ``msa_codegen.msa.launch.MsaConfig``; the others keep their default) and
``default-copy``, a second copy of the default as the noise control. The inputs are msa-bench's
shape (B=1, H=16, Hkv=2, Hp=4, Hpk=1, D=Dp=128, top_k=2048, block=128, bf16, random; ``--n``,
``--heads``, ``--top-k``, ``--block`` change it); one selection and one reverse index serve every
variant, so only the main attention's kernels differ:
- ``fwd``: the main forward, both passes and the LSE merge (``launch.forward``, output, no KL);
- ``bwd``: the main backward (``launch.backward`` with ``do``, no teaching gradient);
- ``teach``: the teaching backward alone (the KL's gradient 1), as warm-up runs it;
- ``both``: the main and teaching gradients, as a training step's backward runs them (one launch,
  or two where ``launch.teach_apart`` says so);
- ``one`` / ``two``: the same forced into one launch / two (main, then the teaching gradient alone).
Each variant's output, LSE and gradients are first compared with the default's (relative error; the
atomics' order differs between configs, so expect float32 rounding, not zero), then each phase is
timed in interleaved rounds (``triton.testing.do_bench`` medians with the L2 flushed; the median
round and its interquartile range). Effective TFLOP/s count the selected pairs as msa-bench does.
One table last. ``--device cpu`` runs the same on the CPU for a smoke test (set TRITON_INTERPRET=1
before Python starts; wall-clock timing, meaningless as a figure).

``--reverse-index``: instead, the reverse index of the same selection as the library builds it
(``launch.reverse_index``: int32 sort keys) against the same with ``key_dtype=torch.int64`` (CUDA's
stable sort is a radix sort over every bit of the key) and a copy of the first; the
outputs must be identical (benchmarks/NOTES.md, "The reverse index's sort keys").
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from msa_codegen.bench import _rel, _time
from msa_codegen.bench_msa import _pairs
from msa_codegen.msa import launch
from msa_codegen.msa.api import msa_attention
from msa_codegen.tuning.measure import interleaved

PHASES = ("fwd", "bwd", "teach", "both", "one", "two")


def parse_variant(text: str) -> tuple[str, launch.MsaConfig]:
    """``NAME=FIELD=VALUE,FIELD=VALUE`` -> (NAME, MsaConfig); unknown fields or non-integers raise."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--variant wants NAME=FIELD=VALUE[,FIELD=VALUE...], got {text!r}")
    known = {f.name for f in dataclasses.fields(launch.MsaConfig)}
    fields = {}
    for part in rest.split(","):
        key, sep, value = part.partition("=")
        if key not in known or not sep:
            raise ValueError(f"--variant {name}: {part!r} is not FIELD=VALUE with FIELD one of {sorted(known)}")
        try:
            fields[key] = int(value)
        except ValueError:
            raise ValueError(f"--variant {name}: {key} must be an integer, got {value!r}") from None
    return name, launch.MsaConfig(**fields)


def _timer(device: str, rep_ms: int):
    if device == "cuda":
        return lambda fn: _time(fn, rep_ms)

    def wall(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/msa_ab.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", default=[], help="NAME=FIELD=VALUE[,FIELD=VALUE...] (repeatable)")
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--heads", default="16,2,4,1", help="H,Hkv,Hp,Hpk (default 16,2,4,1)")
    ap.add_argument("--head-dim", type=int, default=128, help="D = Dp")
    ap.add_argument("--top-k", type=int, default=2048)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep-ms", type=int, default=300)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--reverse-index", action="store_true",
                    help="time the reverse index's sort keys at 64 / 32 bits instead of MsaConfig variants")
    args = ap.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    bad = sorted(set(phases) - set(PHASES))
    if bad:
        ap.error(f"unknown phase(s) {bad}; known: {list(PHASES)}")
    try:
        variants = {"default": launch.MsaConfig()}
        for text in args.variant:
            name, cfg = parse_variant(text)
            if name in variants or name == "default-copy":
                raise ValueError(f"--variant {name}: the name is taken")
            variants[name] = cfg
        variants["default-copy"] = launch.MsaConfig()
        h, hkv, hp, hpk = (int(x) for x in args.heads.split(","))
    except ValueError as e:
        ap.error(str(e))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/msa_ab.py: needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2

    dev, dtype, d, n, block = args.device, getattr(torch, args.dtype), args.head_dim, args.n, args.block
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda *s: torch.randn(*s, device=dev, dtype=dtype, generator=g)  # noqa: E731
    q, k, v = mk(1, h, n, d), mk(1, hkv, n, d), mk(1, hkv, n, d)
    qp, kp = mk(1, hp, n, d), mk(1, hpk, n, d)
    do = mk(1, h, n, d)
    heads = launch.Heads(h, hkv, hp, hpk)
    scale = pscale = d ** -0.5
    with torch.no_grad():
        _, _, idx = msa_attention(q, k, v, qp, kp, args.top_k, block=block, return_indices=True)
    n_blocks = -(-n // block)
    if args.reverse_index:
        return _reverse_index_ab(idx, n_blocks, _timer(dev, args.rep_ms), args.rounds)
    rev, items = launch.reverse_index(idx, n_blocks)
    nsel = idx.shape[-1]
    one = torch.ones((), device=dev)
    pairs = _pairs(idx, block)      # msa-bench's count: attended pairs per proxy head, summed
    main_flops = 4 * d * pairs * (h // hp)
    flops = {"fwd": main_flops, "bwd": 2.5 * main_flops, "teach": 6 * d * pairs}
    flops["both"] = flops["one"] = flops["two"] = flops["bwd"] + flops["teach"]

    def fwd():
        return launch.forward(q, k, v, qp, kp, items, rev, nsel, heads, block, scale, pscale, None,
                              dense=False, with_out=True, with_kl=False)

    runs, ref = {}, None
    for name, cfg in variants.items():
        with launch.use_msa_config(cfg), torch.no_grad():
            out, lse, lsep, _ = fwd()
            grads = launch.backward(do, q, k, v, qp, kp, out, lse, lsep, one, items, rev, nsel, heads, block, scale,
                                    pscale, None, dense=False)
        got = [out, lse, lsep, *[t for t in grads if t is not None]]
        if ref is None:
            ref = got
        err = max(_rel(a, b) for a, b in zip(got, ref))
        print(f"{name}: {launch._fields(cfg) or 'the defaults'}; max relative error against default {err:.2e}",
              flush=True)
        runs[name] = {
            "fwd": fwd,
            "bwd": lambda out=out, lse=lse, lsep=lsep: launch.backward(
                do, q, k, v, qp, kp, out, lse, lsep, None, items, rev, nsel, heads, block, scale, pscale, None,
                dense=False),
            "teach": lambda out=out, lse=lse, lsep=lsep: launch.backward(
                None, q, k, v, qp, kp, out, lse, lsep, one, items, rev, nsel, heads, block, scale, pscale, None,
                dense=False),
        }
        for phase, apart in (("both", None), ("one", False), ("two", True)):
            runs[name][phase] = lambda out=out, lse=lse, lsep=lsep, apart=apart: launch.backward(
                do, q, k, v, qp, kp, out, lse, lsep, one, items, rev, nsel, heads, block, scale, pscale, None,
                dense=False, apart=apart)
    timer = _timer(dev, args.rep_ms)
    table = []
    for phase in phases:
        def time_one(name, phase=phase):
            with launch.use_msa_config(variants[name]), torch.no_grad():
                return timer(runs[name][phase])
        res = interleaved(time_one, list(variants), args.rounds)
        base = res["default"][0]
        for name, (med, iqr) in res.items():
            table.append((phase, name, med, iqr, med / base, flops[phase] / med * 1e-9))
    shape = (f"N={n} H={h}/{hkv} Hp={hp}/{hpk} D=Dp={d} top_k={args.top_k} block={block} {args.dtype} on "
             f"{torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, {args.rounds} interleaved rounds")
    print(f"\n{shape}\n| phase | variant | median ms | IQR ms | vs default | TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for phase, name, med, iqr, ratio, tf in table:
        print(f"| {phase} | {name} | {med:.3f} | {iqr:.3f} | {ratio:.3f}x | {tf:.0f} |")
    return 0


def _reverse_index_ab(idx, n_blocks: int, timer, rounds: int) -> int:
    fns = {"int32 (tree)": lambda: launch.reverse_index(idx, n_blocks),
           "int64": lambda: launch.reverse_index(idx, n_blocks, key_dtype=torch.int64),
           "int32 copy": lambda: launch.reverse_index(idx, n_blocks)}
    (rev, items), (rev64, items64) = fns["int32 (tree)"](), fns["int64"]()
    same = torch.equal(rev, rev64) and torch.equal(items, items64)
    print(f"reverse index of {idx.numel()} selection entries, {tuple(idx.shape)}: int32 and int64 keys give "
          f"{'identical' if same else 'DIFFERENT'} outputs")
    if not same:
        return 1
    res = interleaved(lambda name: timer(fns[name]), list(fns), rounds)
    base = res["int32 (tree)"][0]
    print(f"\n| keys | median ms | IQR ms | vs tree |\n| --- | --- | --- | --- |")
    for name, (med, iqr) in res.items():
        print(f"| {name} | {med:.3f} | {iqr:.3f} | {med / base:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
