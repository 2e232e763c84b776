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
round). Effective TFLOP/s count the visible pairs. One table last. How the Q-release change of
2026-12-04 was measured (docs/performance.md, "The Gluon family").

``--direction bwd``: the same for ``templates/gluon/bwd.py.jinja``. Each variant's fused backward
(``kernels.gluon.backward(..., fused=True)``) is checked against the float64 reference's
gradients (``window=256`` and ``causal=false,window=300``, N=1000), then timed on the cases the
Gluon backward takes (no sink, no dense), beside the tree's two-kernel backward. The fused
backward's first variants (2026-12-04, morning) were measured by a script outside the tree with
this logic; this option first ran on a GPU that afternoon (docs/performance.md: the dS barrier).
"""
from __future__ import annotations

import argparse
import statistics

import jinja2
import torch

from msa_codegen.bench import _spin_up, _time, attended_pairs
from msa_codegen.kernels import gluon
from msa_codegen.kernels import render as _render
from msa_codegen.pattern.reference import reference_attention, relative_error
from msa_codegen.pattern.spec import parse
from msa_codegen.plan import plan_for

#: (pattern, B, H, N, D)
CASES = [("window=4096", 1, 16, 131072, 128), ("causal", 1, 16, 16384, 128), ("causal=false,window=512", 1, 16, 65536, 128),
         ("window=4096,sink=64", 1, 16, 131072, 128), ("window=4096", 1, 32, 131072, 64)]
CHECKS = [("window=256", 1000), ("causal", 1000)]
#: --direction bwd: the checks' patterns (the Gluon backward's: windows without sink)
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
        skipped = [c[0] for c in cases if gluon.bwd_pattern_reason(lower(parse(c[0]).groups[0].spec))]
        if skipped:
            print(f"not the Gluon backward's, skipped: {', '.join(skipped)}")
        cases = [c for c in cases if c[0] not in skipped]
        checks = BWD_CHECKS
    variants = Variants(texts, template)
    try:
        if args.render_only:
            from msa_codegen.pattern.lowering import lower
            for name in texts:
                variants.use(name)
                for pattern, *_ in cases + [(p, 0, 0, 0, 0) for p, _ in checks]:
                    source = gluon.render(lower(parse(pattern).groups[0].spec), args.direction)
                    print(f"{name}: {pattern} renders ({len(source)} characters)")
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
    for pattern, b, h, n, d in cases:
        q, k, v = (torch.randn(b, h, n, d, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
        plan = plan_for(pattern, q.device, q.dtype, d, h, h, n)
        scale = d ** -0.5
        outs = {}
        for name in names:
            variants.use(name)
            outs[name] = gluon.forward(q, k, v, plan, scale)[0]
        runs = [(name, name) for name in names]
        times = _interleaved(variants, runs, lambda name: (lambda: gluon.forward(q, k, v, plan, scale)), rounds, rep)
        flops = 4.0 * d * h * b * attended_pairs(parse(pattern).groups[0].spec, n)
        rows += _rows(f"{pattern} B={b} H={h} N={n} D={d}", times, outs, flops)
    _table(rows, "variant", "TF/s (best)", "max abs diff vs tree")
    return 0


def _interleaved(variants: Variants, runs, call, rounds: int, rep: int) -> dict:
    """{label: the rounds' ms}: each (label, variant) of ``runs`` timed by ``call(label)``'s
    closure with its variant in use, rounds interleaved (a drift of the clocks hits every run)."""
    times = {label: [] for label, _ in runs}
    for _ in range(rounds):
        for label, name in runs:
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
