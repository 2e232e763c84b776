"""Variants of the Gluon forward's (or backward's) template side by side in one process (GPU), for template changes.

    PYTHONPATH=$PWD python benchmarks/gluon_ab.py --variant old=/tmp/fwd_old.jinja [--variant new=PATH ...]
                                                  [--cases 0,1,2] [--rounds 5] [--rep 200]
    PYTHONPATH=$PWD python benchmarks/gluon_ab.py --variant old=PATH --render-only   # no GPU: each renders
    bash benchmarks/run.sh gluon-ab ARGS

The variant ``tree`` (always the first) is the template of this tree
(``msa_codegen/templates/gluon/fwd.py.jinja``); each ``--variant NAME=PATH`` is another file of
that template, e.g. ``git show HEAD~1:msa_codegen/templates/gluon/fwd.py.jinja > /tmp/old.jinja``.
Every variant renders through its own Jinja environment (the other templates from the tree) and
loads as its own kernel module, so one process times them all: ``kernels.gluon.forward`` per
case (bf16), each variant first checked against the pattern contract's float64 reference
(``reference_attention``) at small odd shapes (``window=256`` and ``causal``, N=1000, B=2, H=4,
D=128) and against the tree's output on the case itself, then timed in interleaved rounds (``triton.testing.do_bench`` medians; the best and the median
round). Effective TFLOP/s count the visible pairs. Cases 5 and 6 time the top-k and the
packed-documents forms of the forward (random causal block_indices; documents of 16000 rows), whose
kernels differ from the plain window's; case 7 a short causal window (`window=512`, five key
tiles a query tile). Each round starts at the next variant. One table last. How the Q-release change of
2026-12-04 was measured (docs/performance.md, "The Gluon family").

``--direction bwd``: the same for ``templates/gluon/bwd.py.jinja``. Each variant's fused backward
(``kernels.gluon.backward(..., fused=True)``) is checked against the float64 reference's
gradients (``window=256`` and ``causal=false,window=300``, N=1000), then timed on the cases the
Gluon backward takes (not dense ones; a sink's pass runs beside the kernels), beside the tree's two-kernel backward. The fused
backward's first variants (2026-12-04, morning) were measured by a script outside the tree with
this logic; this option first ran on a GPU that afternoon (docs/performance.md: the dS barrier).
"""
from __future__ import annotations

import argparse
import statistics

import jinja2
import torch

from msa_codegen.bench import _spin_up, _time, attended_pairs, topk_pairs
from msa_codegen.kernels import gluon
from msa_codegen.kernels import render as _render
from msa_codegen.pattern.reference import reference_attention, relative_error
from msa_codegen.pattern.spec import parse
from msa_codegen.plan import plan_for

#: (pattern, B, H, N, D[, documents' length]): 5 is the top-k form (causal, random block_indices,
#: each query block's 16 blocks at or before its own), 6 the packed-documents form (cu_seqlens of
#: equal documents, the last one shorter); the forward only (the variant's backward: no such rows)
CASES = [("window=4096", 1, 16, 131072, 128), ("causal", 1, 16, 16384, 128),
         ("causal=false,window=512", 1, 16, 65536, 128), ("window=4096,sink=64", 1, 16, 131072, 128),
         ("window=4096", 1, 32, 131072, 64), ("topk=16", 1, 16, 131072, 128),
         ("window=4096", 1, 16, 131072, 128, 16000), ("window=512", 1, 16, 65536, 128)]
CHECKS = [("window=256", 1000), ("causal", 1000)]
#: --direction bwd: the checks' patterns (windows the Gluon backward takes)
BWD_CHECKS = [("window=256", 1000), ("causal=false,window=300", 1000)]


def _env(text: str, template: str = gluon.TEMPLATE) -> jinja2.Environment:
    # the tree's environment, with one template's text replaced
    base = _render._env()
    return jinja2.Environment(
        loader=jinja2.ChoiceLoader([jinja2.DictLoader({template: text}), base.loader]),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
        autoescape=False)


class Variants:
    """The variants' environments and kernel modules; ``use(name)`` makes ``kernels.gluon`` render
    and load that variant's kernels until the next call."""

    def __init__(self, texts: dict[str, str], template: str = gluon.TEMPLATE):
        self.envs = {name: _env(text, template) for name, text in texts.items()}
        self.modules = {name: {} for name in texts}
        self.real_env, self.real_modules = _render._env, gluon._modules

    def use(self, name: str) -> None:
        env = self.envs[name]
        _render._env = lambda: env
        gluon._modules = self.modules[name]

    def restore(self) -> None:
        _render._env, gluon._modules = self.real_env, self.real_modules


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=PATH",
                    help="a file of the forward template, or of the backward's with --direction bwd (repeatable)")
    ap.add_argument("--direction", choices=("fwd", "bwd"), default="fwd",
                    help="bwd: the backward's template; each variant's fused backward is timed, and the tree's "
                         "two kernels as a row of their own (the cases the Gluon backward takes)")
    ap.add_argument("--cases", default="0,1,2", help="indices into CASES (default 0,1,2)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--rep", type=int, default=200, help="do_bench's budget in ms (default 200)")
    ap.add_argument("--render-only", action="store_true", help="render every variant for every case (no GPU)")
    args = ap.parse_args(argv)
    template = gluon.TEMPLATE if args.direction == "fwd" else gluon.TEMPLATE_BWD
    texts = {"tree": (_render.TEMPLATE_DIR / template).read_text()}
    for item in args.variant:
        name, sep, path = item.partition("=")
        if not sep or not name or name in texts:
            raise SystemExit(f"--variant {item!r}: expected a new NAME=PATH")
        texts[name] = open(path).read()
    cases = [CASES[int(i)] for i in args.cases.split(",")]
    checks = CHECKS
    if args.direction == "bwd":
        from msa_codegen.pattern.lowering import lower
        # not the Gluon backward's, or a top-k or documents case (their run-time inputs: forward only)
        skipped = [c for c in cases if gluon.bwd_pattern_reason(lower(parse(c[0]).groups[0].spec))
                   or len(c) > 5 or parse(c[0]).groups[0].spec.topk]
        if skipped:
            print(f"not timed by --direction bwd, skipped: {', '.join(map(str, skipped))}")
        cases = [c for c in cases if c not in skipped]
        checks = BWD_CHECKS
    variants = Variants(texts, template)
    try:
        if args.render_only:
            from msa_codegen.pattern.lowering import CU_SEQLENS, lower
            for name in texts:
                variants.use(name)
                for pattern, _, _, _, _, *docs in cases + [(p, 0, 0, 0, 0) for p, _ in checks]:
                    spec = parse(pattern).groups[0].spec
                    source = gluon.render(lower(spec, **(CU_SEQLENS if docs else {})), args.direction)
                    print(f"{name}: {pattern}{' over documents' if docs else ''} renders ({len(source)} characters)")
            return 0
        if not torch.cuda.is_available():
            raise SystemExit("gluon_ab.py times GPU kernels: no GPU is visible (--render-only renders)")
        run = _run if args.direction == "fwd" else _run_bwd
        return run(variants, list(texts), cases, args.rounds, args.rep)
    finally:
        variants.restore()


def _run(variants: Variants, names: list[str], cases, rounds: int, rep: int) -> int:
    _spin_up(1.0)
    g = torch.Generator(device="cpu").manual_seed(0)
    for pattern, n in CHECKS:
        q, k, v = (torch.randn(2, 4, n, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
        plan = plan_for(pattern, q.device, q.dtype, 128, 4, 4, n)
        ref = reference_attention(q, k, v, pattern, 128 ** -0.5)
        for name in names:
            variants.use(name)
            o, _ = gluon.forward(q, k, v, plan, 128 ** -0.5)
            print(f"check {pattern} N={n} {name}: relative error against float64 {relative_error(o, ref):.3e}", flush=True)
    rows = []
    for pattern, b, h, n, d, *docs in cases:
        q, k, v = (torch.randn(b, h, n, d, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
        fwd, pairs, label, _ = _forward_of(pattern, q, k, v, docs[0] if docs else None, g)
        outs = {}
        for name in names:
            variants.use(name)
            outs[name] = fwd()[0]
        runs = [(name, name) for name in names]
        times = _interleaved(variants, runs, lambda name: fwd, rounds, rep)
        rows += _rows(f"{label} B={b} H={h} N={n} D={d}", times, outs, 4.0 * d * h * b * pairs)
    _table(rows, "variant", "TF/s (best)", "max abs diff vs tree")
    return 0


def _forward_of(pattern: str, q, k, v, doc_len: int | None, g: torch.Generator):
    """(a closure of one Gluon forward of the case, the visible pairs a head, the case's label, its
    run-time inputs as ``attention`` takes them: block_indices or cu_seqlens).
    A top-k pattern gets random block_indices (causal: each query block's K distinct blocks at or
    before its own, fewer where there are fewer); doc_len packs documents of that length
    (``sparsity.prepare``'s positions, as ``attention(cu_seqlens=...)`` passes them). Pairs
    from the float64 reference's own mask would take O(N^2): counted from the same rule instead."""
    b, h, n, d = q.shape
    spec = parse(pattern).groups[0].spec
    scale = d ** -0.5
    if spec.topk:
        nb = -(-n // spec.block)
        idx = torch.full((b, h, nb, spec.topk), -1, dtype=torch.int32)
        for r in range(nb):
            picks = torch.randperm(r + 1, generator=g)[:spec.topk]
            idx[:, :, r, :len(picks)] = picks.to(torch.int32)
        pairs = topk_pairs(idx, n, spec.block) // (b * h)   # every head picks alike
        idx = idx.to(q.device)
        plan = plan_for(pattern, q.device, q.dtype, d, h, h, n)
        return (lambda: gluon.forward(q, k, v, plan, scale, idx)), pairs, f"{pattern} (random causal blocks)", \
            {"block_indices": idx}
    if doc_len is not None:
        from msa_codegen.pattern.lowering import CU_SEQLENS
        from msa_codegen.sparsity.inputs import normalize
        cu = torch.tensor(list(range(0, n, doc_len)) + [n], dtype=torch.int32, device=q.device)
        dyn = normalize(parse(pattern).head_groups(h), b, h, h, n, n, cu_seqlens=cu)
        plan = plan_for(pattern, q.device, q.dtype, d, h, h, n, **CU_SEQLENS)
        pairs = sum(attended_pairs(spec, hi - lo) for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()))
        return ((lambda: gluon.forward(q, k, v, plan, scale, None, dyn.q_pos)), pairs,
                f"{pattern}, documents of {doc_len}", {"cu_seqlens": cu})
    plan = plan_for(pattern, q.device, q.dtype, d, h, h, n)
    return (lambda: gluon.forward(q, k, v, plan, scale)), attended_pairs(spec, n), pattern, {}


def _interleaved(variants: Variants, runs, call, rounds: int, rep: int) -> dict:
    """{label: the rounds' ms}: each (label, variant) of ``runs`` timed by ``call(label)``'s
    closure with its variant in use, rounds interleaved (a drift of the clocks hits every run),
    each round starting at the next run (no run always first)."""
    times = {label: [] for label, _ in runs}
    for r in range(rounds):
        for label, name in runs[r % len(runs):] + runs[:r % len(runs)]:
            variants.use(name)
            times[label].append(_time(call(label), rep))
    return times


def _rows(case: str, times: dict, outs: dict, flops: float) -> list:
    """One row a run: best and median ms, TFLOP/s at the best, max |difference| of its output
    from the first run's; printed as they come."""
    first = next(iter(outs.values())).float()
    rows = []
    for label, ms in times.items():
        best, med = min(ms), statistics.median(ms)
        rows.append((case, label, best, med, flops / best * 1e-9, (outs[label].float() - first).abs().max().item()))
        print(rows[-1], flush=True)
    return rows


def _table(rows: list, run: str, tflops: str, diff: str) -> None:
    print(f"\n| case | {run} | best ms | median ms | {tflops} | {diff} |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case, label, best, med, tf, d in rows:
        print(f"| {case} | {label} | {best:.3f} | {med:.3f} | {tf:.0f} | {d:.1e} |")


def _run_bwd(variants: Variants, names: list[str], cases, rounds: int, rep: int) -> int:
    """--direction bwd: each variant's fused backward (``gluon.backward(..., fused=True)``) checked
    against the float64 reference's gradients, then timed with the tree's two kernels beside it."""
    _spin_up(1.0)
    g = torch.Generator(device="cpu").manual_seed(0)
    for pattern, n in BWD_CHECKS:
        q, k, v, do = (torch.randn(2, 4, n, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
        plan = plan_for(pattern, q.device, q.dtype, 128, 4, 4, n)
        leaves = [x.double().requires_grad_() for x in (q, k, v)]
        ref = torch.autograd.grad(reference_attention(*leaves, pattern, 128 ** -0.5), leaves, do.double())
        o, lse = gluon.forward(q, k, v, plan, 128 ** -0.5)
        for name in names:
            variants.use(name)
            got = gluon.backward(do, q, k, v, o, lse, None, plan, 128 ** -0.5, fused=True)
            errs = ", ".join(f"{w} {relative_error(x, r):.3e}" for w, x, r in zip(("dq", "dk", "dv"), got, ref))
            print(f"check {pattern} N={n} {name} (fused): relative error against float64 {errs}", flush=True)
    rows = []
    fused = {"tree, two kernels": False, **{name: True for name in names}}
    runs = [("tree, two kernels", "tree")] + [(name, name) for name in names]
    for pattern, b, h, n, d in cases:
        q, k, v, do = (torch.randn(b, h, n, d, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
        plan = plan_for(pattern, q.device, q.dtype, d, h, h, n)
        scale = d ** -0.5
        o, lse = gluon.forward(q, k, v, plan, scale)

        def call(label):
            return lambda: gluon.backward(do, q, k, v, o, lse, None, plan, scale, fused=fused[label])

        dq = {}
        for label, name in runs:
            variants.use(name)
            dq[label] = call(label)()[0]
        times = _interleaved(variants, runs, call, rounds, rep)
        flops = 2.5 * 4.0 * d * h * b * attended_pairs(parse(pattern).groups[0].spec, n)
        rows += _rows(f"{pattern} B={b} H={h} N={n} D={d}", times, dq, flops)
    _table(rows, "backward", "TF/s (best, 2.5x the forward)", "max abs dq diff vs two kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
