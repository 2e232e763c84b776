"""The templates: what a reader of a rendered kernel relies on, over a corpus of plans.

One template family renders both the plain kernels (closed-form tiles and ranges) and the
positional ones (plan.positional: run-time positions, segments, index classes). These tests
check the structure of what it renders, never whole sources: every source is Python, every
call of a loop function is a whole call that fits its definition, the plain and positional
kernels of one pattern share the pieces the family writes once, and the module constants are
read by some kernel.
"""
from __future__ import annotations

import ast
import functools
import re

import pytest

import msa_codegen as msa
from msa_codegen.kernels import render as codegen
from msa_codegen.pattern.lowering import lower

# every term and the combinations the other tests run; head groups split into specs
PATTERNS = [
    "causal", "causal=false", "window=16", "window=16,dilation=2", "window=16,dilation=3,sink=4",
    "window=16,sink=4", "causal=false,window=16", "causal=false,window=7,dilation=3",
    "causal=false,global=3", "causal=false,global=3,window=4", "causal=false,global=2,sink=5,window=3,dilation=2",
    "sink=4", "causal=false,sink=5", "random=2,block=16", "causal=false,global=3,random=2,block=64",
    "window=16,random=2,block=32", "window=8,dilation=3,sink=4,random=2,block=64", "topk=2,block=16",
    "sink=2,topk=3,block=16", "random=2,seed=3,topk=3,block=16", "causal=false,window=64,random=2,topk=3,block=128",
    "causal=false,window=5,dilation=2,global=4,topk=3,block=32", "0-1:window=16,sink=4;2-3:causal=false,global=4",
]
# the lowerings ops.py asks for: plain, q_pos/k_pos, buckets or documents, cu_seqlens (index classes)
VARIANTS = [{}, {"positional": True}, {"segments": True}, {"segments": True, "classes": True},
            {"positional": True, "classes": True}]
TEMPLATES = {"fwd.py.jinja", "bwd.py.jinja", "_common.py.jinja", "_phases.py.jinja", "_positions.py.jinja"}
# module constants no kernel reads: none (CAUSAL, DENSE and TOPK went with schema 3's re-key)
DEAD_KEPT: set[str] = set()


def _specs():
    return [g.spec for p in PATTERNS for g in msa.parse(p).groups]


@functools.lru_cache(maxsize=1)
def _corpus():
    plans = {}
    for spec in _specs():
        for v in VARIANTS:
            plans.setdefault(lower(spec, **v), None)
    return [(plan, d, codegen.render(plan, d)) for plan in plans for d in codegen.DIRECTIONS]


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}


def _id(plan, direction):
    return f"{direction}:{plan.describe()}"


def test_the_templates_are_one_family():
    assert {p.name for p in codegen.TEMPLATE_DIR.glob("*.jinja")} == TEMPLATES
    assert len({(p.positional, p.classes) for p, _, _ in _corpus()}) == 3   # every form renders
    assert len(_corpus()) > 150


def test_every_kernel_is_python_with_its_header():
    for plan, direction, src in _corpus():
        ast.parse(src)   # raises with the line on a syntax error
        assert src.startswith(f"# generated from msa_codegen/templates/{direction}.py.jinja"), _id(plan, direction)
        assert not re.search(r"\{\{|\{%|\{#|[ \t]+$", src, re.M), _id(plan, direction)


def test_loop_calls_are_whole_and_fit_their_functions():
    """Every call of a function of the module passes each parameter once, the constexpr flags by
    name: the loop calls are written whole (no half-open call pasted together from strings)."""
    calls = 0
    for plan, direction, src in _corpus():
        tree = ast.parse(src)
        funcs = _functions(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in funcs):
                continue
            params = [a.arg for a in funcs[node.func.id].args.args]
            given = params[:len(node.args)] + [k.arg for k in node.keywords]
            assert sorted(given) == sorted(params), (_id(plan, direction), node.func.id, ast.unparse(node))
            if node.func.id.endswith("_loop"):
                calls += 1
                names = {k.arg for k in node.keywords}
                assert {"MASKED"} <= names and ("PHASE" in names or node.func.id == "_dq_ds_loop"), ast.unparse(node)
    assert calls > 500


def _tail(fn: ast.FunctionDef, first: str) -> list[str]:
    """The statements of a function from the one whose source starts with ``first`` on."""
    body = [ast.unparse(s) for s in fn.body]
    start = next(k for k, s in enumerate(body) if s.startswith(first))
    return body[start:]


def _skeleton(loop: ast.For) -> list[str]:
    """A loop's body without its loads and its mask: what plain and positional loops share."""
    out = []
    for s in loop.body:
        text = ast.unparse(s)
        if re.search(r"_load_pair|_load_rows|^(m_j|m_i|o_k|o_v|o_q|o_do) = ", text):
            continue
        out.append(text.split("\n")[0] if isinstance(s, ast.If) else text)
    return out


@pytest.mark.parametrize("pattern", ["window=16,dilation=2,sink=4", "causal=false,global=3,window=4",
                                     "random=2,seed=3,topk=3,block=16", "causal"])
def test_plain_and_positional_kernels_share_the_family_pieces(pattern):
    spec = msa.parse(pattern).groups[0].spec
    for other in ({"positional": True}, {"segments": True, "classes": True}):
        plain, pos = lower(spec), lower(spec, **other)
        fa, fb = (_functions(ast.parse(codegen.render(p, "fwd"))) for p in (plain, pos))
        ba, bb = (_functions(ast.parse(codegen.render(p, "bwd"))) for p in (plain, pos))
        # the forward's epilogue and every kernel's program ids
        assert _tail(fa["msa_fwd"], "seen = ") == _tail(fb["msa_fwd"], "seen = ")
        assert len(_tail(fa["msa_fwd"], "seen = ")) == 7
        for a, b, name in ((fa, fb, "msa_fwd"), (ba, bb, "msa_bwd_dq"), (ba, bb, "msa_bwd_dkdv")):
            assert [ast.unparse(s) for s in a[name].body[:4]] == [ast.unparse(s) for s in b[name].body[:4]]
        assert _tail(ba["msa_bwd_dq"], "dq = dq * sm_scale")[0] == _tail(bb["msa_bwd_dq"], "dq = dq * sm_scale")[0]
        assert ast.dump(ba["msa_bwd_pre"]) == ast.dump(bb["msa_bwd_pre"])
        # the loops: the same scores, softmax / dS steps and accumulation around their loads and masks
        for a, b, name in ((fa, fb, "_fwd_loop"), (ba, bb, "_dq_loop"), (ba, bb, "_dkdv_loop")):
            la = next(s for s in a[name].body if isinstance(s, ast.For))
            lb = next(s for s in b[name].body if isinstance(s, ast.For))
            sa, sb = _skeleton(la), _skeleton(lb)
            shared = [s for s in sa if s in sb]
            assert len(shared) >= 5, (name, sa, sb)
        # plain kernels carry no positional parameter; both take TMA (the positional ones for
        # their loops' range descriptors, kernels.tma.use_positional_descriptors)
        params_a, params_b = ([a.arg for a in f["msa_fwd"].args.args] for f in (fa, fb))
        assert "QPOS" not in params_a and "TMA" in params_a
        assert "QPOS" in params_b and "TMA" in params_b
        assert "_range_descriptors" in fb and "_range_descriptors" not in fa
        assert "_lower_bound" in fb and "_lower_bound" not in fa


def test_module_constants_are_read_by_some_kernel():
    """A constant the templates emit is read by the kernels of at least one plan (no dead
    switches such as a CAUSAL the templates decide instead), DEAD_KEPT apart."""
    defined, read = set(), set()
    for plan, direction, src in _corpus():
        tree = ast.parse(src)
        consts = {t.targets[0].id for t in tree.body if isinstance(t, ast.Assign)}
        defined |= consts
        loads = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
        read |= consts & set(loads)
    assert defined - read == DEAD_KEPT


def test_every_macro_is_used():
    sources = {p.name: p.read_text() for p in codegen.TEMPLATE_DIR.glob("*.jinja")}
    text = "\n".join(sources.values())
    for name in re.findall(r"\{% macro (\w+)\(", text):
        uses = len(re.findall(r"\b%s\b" % name, text))
        assert uses >= 2, f"macro {name} is never called"
