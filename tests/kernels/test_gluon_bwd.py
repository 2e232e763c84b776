"""The Gluon backward family (kernels/gluon.py, templates/gluon/bwd.py.jinja; issue 22).

CPU: rendering is deterministic, specialised by the plan and kept out of the Triton kernels'
hash; the eligibility rules (windows, a sink of at most 256 keys, no split KV heads); the rendered tiling
of both kernels run as Python over NumPy against the pattern's mask; the routing in
``launch.backward`` (an ineligible call runs the Triton backward and logs why once); the
launcher with its kernels replaced by a float64 model of them (the reference gradients); an
ahead-of-time compile for sm_90. ``gpu``: dq / dk / dv against the float64 reference on an
H100/H200, and through ``msa_codegen.attention(...).backward()`` with MSA_CODEGEN_GLUON=1
(spied: the Gluon backward ran).
"""
from __future__ import annotations

import ast
import logging
import random
import re

import numpy as np
import pytest
import torch
import triton

import msa_codegen as msa
from helpers import FLOOR, GLUON_NAMES as NAMES, SASS_OF, GlPointer as _Ptr, GlScalar as _I, chunked_reference, \
    gluon_docs, lowp_attention, make_inputs, random_gluon_case, rel_err, rendered_helpers, run_aot_source, \
    topk_inputs, \
    first_plan as _plan, needs_gluon_api as needs_api, WHY_NO_GLUON as WHY_NO_API
from msa_codegen.kernels import gluon, render as codegen
from msa_codegen.pattern.lowering import CU_SEQLENS
from msa_codegen.pattern.spec import parse
from msa_codegen.plan import plan_for


ELIGIBLE = ["window=4096", "window=1", "window=300", "causal=false,window=300", "causal=false,window=1", "topk=16",
            "causal=false,topk=3", "window=512,dilation=2", "causal=false,window=30,dilation=5", "window=512,sink=64",
            "causal=false,window=8,sink=1", "window=512,dilation=2,sink=64",
            "window=512,sink=65", "window=512,dilation=2,sink=256"]
NOT_ELIGIBLE = [("window=512,sink=257", "sink=257 > 256"), ("causal", "dense pattern"), ("causal=false", "dense pattern"),
                ("window=512,dilation=2,sink=257", "dilation=2 with sink=257 > 256"), ("window=64,topk=2", "topk=2 with window"),
                ("topk=2,block=64", "block=64"),
                ("causal=false,global=16", "global=16")]


# ---- CPU: rendering and eligibility ------------------------------------------------------------

@needs_api
def test_render_is_deterministic_python_and_specialised_by_the_plan():
    sources = {p: gluon.render(_plan(p), "bwd") for p in ELIGIBLE}
    assert all(gluon.render(_plan(p), "bwd") == s for p, s in sources.items())
    # every plan its own text, but a dilated window with a sink: its classes run the window alone
    assert len(set(sources.values())) == len(ELIGIBLE) - 2
    assert sources["window=512,dilation=2,sink=64"] == sources["window=512,dilation=2"]
    assert sources["window=512,dilation=2,sink=256"] == sources["window=512,dilation=2"]
    assert "(the sink)" in sources["window=512,sink=64"] and "(the sink)" not in sources["window=512,dilation=2"]
    for p, src in sources.items():
        ast.parse(src)
        assert src.startswith("# generated from msa_codegen/templates/gluon/bwd.py.jinja"), p
        assert "def msa_gluon_bwd_dkdv(" in src and "def msa_gluon_bwd_dq(" in src
        assert f"tma.{NAMES['tma_load']}(" in src and f"tma.{NAMES['tma_store']}(" in src
        # dK/dV of a KV head: its query heads summed inside the program, no atomics; the fused
        # form's dQ alone is added up, by one TMA reduce-add (3.9's wrapper or 3.6's builder op)
        assert "gl.atomic" not in src
        add = "_tma_add" if NAMES["tma_add"] == "builder" else f"tma.{NAMES['tma_add']}"
        assert src.count(f"{add}(dqa_desc, ") == 1
    assert "WINDOW = gl.constexpr(4096)" in sources["window=4096"]
    assert gluon.render(_plan("window=64"), "bwd") != gluon.render(_plan("window=64"))


def test_the_backward_template_stays_out_of_the_triton_kernels_hash():
    assert (codegen.TEMPLATE_DIR / gluon.TEMPLATE_BWD).is_file()
    assert gluon.TEMPLATE_BWD.startswith("gluon/")   # templates_digest reads TEMPLATE_DIR/*.jinja only
    assert "bwd.py.jinja" not in {p.name for p in codegen.TEMPLATE_DIR.glob("gluon*.jinja")}


@pytest.mark.parametrize("pattern", ELIGIBLE)
def test_windows_are_eligible(pattern):
    assert gluon.bwd_pattern_reason(_plan(pattern)) is None


@pytest.mark.parametrize("pattern,why", NOT_ELIGIBLE, ids=[p for p, _ in NOT_ELIGIBLE])
def test_render_refuses_a_plan_the_backward_does_not_run(pattern, why):
    assert why in gluon.bwd_pattern_reason(_plan(pattern))
    with pytest.raises(ValueError, match=re.escape(why)):
        gluon.render(_plan(pattern), "bwd")


def test_why_not_bwd_names_the_reason():
    q, k, v, _ = make_inputs(1, 4, 2, 64, 64, torch.float32, "cpu")
    plan = plan_for("window=16", q.device, q.dtype, 64, 4, 2, 64)
    assert "not a CUDA GPU" in gluon.why_not_bwd(plan, q, k, v)
    plan = plan_for("0-1:window=16;2-3:window=8,sink=300", q.device, q.dtype, 64, 4, 2, 64)
    assert gluon.why_not_bwd(plan, q, k, v).startswith("heads 2-3: sink=300")
    # query heads 0-2 and 3 of KV heads 0-1 (group 2): KV head 1 spans both groups
    plan = plan_for("0-2:window=16;3-3:window=8", q.device, q.dtype, 64, 4, 2, 64)
    assert "two head groups" in gluon.why_not_bwd(plan, q, k, v)


def test_describe_bwd_names_the_family_and_why(monkeypatch):
    monkeypatch.delenv(gluon.ENV, raising=False)
    line = gluon.describe_bwd([_plan("window=4096")], "9.0", torch.bfloat16, 128)
    assert line.startswith("backward kernels: triton") and gluon.ENV in line
    monkeypatch.setenv(gluon.ENV, "1")
    line = gluon.describe_bwd([_plan("window=4096")], "9.0", torch.bfloat16, 128)
    assert line.startswith("backward kernels: gluon" if NAMES else "backward kernels: triton"), line
    line = gluon.describe_bwd([_plan("window=64,sink=300")], "9.0", torch.bfloat16, 128)
    assert line.startswith(f"backward kernels: triton ({gluon.ENV}=1, but gluon is not eligible: sink=300")


@needs_api
def test_describe_bwd_says_which_calls_fuse(monkeypatch):
    """Under the Gluon backward, the line says whether a call that need not be deterministic runs
    one fused kernel: not for top-k with GQA (``fused_reason``), nor where this Triton's Gluon
    has no TMA reduce-add."""
    monkeypatch.setenv(gluon.ENV, "1")
    fused = "one fused kernel unless the call is deterministic"
    for pattern, group in (("window=4096", 1), ("window=4096", 4), ("topk=16", 1), ("topk=16", 4)):
        line = gluon.describe_bwd([_plan(pattern)], "9.0", torch.bfloat16, 128, group)
        assert line.startswith("backward kernels: gluon"), line
        why = gluon.fused_reason([_plan(pattern)], group)
        assert (fused in line) == (why is None) and (why is None or why in line), (pattern, group, line)
        if gluon.api()[0]["tma_add"] is not None:
            assert (why is None) == (pattern != "topk=16" or group == 1), (pattern, group, why)


def test_an_ineligible_backward_runs_triton_and_logs_why_once(monkeypatch, caplog, device):
    """MSA_CODEGEN_GLUON=1 on a call the Gluon backward does not take (the interpreter on the
    CPU, or a sink longer than ``gluon.MAX_SINK`` on a GPU): the Triton backward runs, one log
    line says why."""
    monkeypatch.setenv(gluon.ENV, "1")
    ran = []
    monkeypatch.setattr(gluon, "backward", lambda *a, **kw: ran.append(1))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    pattern = "window=16,sink=257"
    q, k, v, _ = make_inputs(1, 2, 1, 290, 64, dtype, device)
    with caplog.at_level(logging.WARNING, logger=gluon.__name__):
        for _ in range(2):
            dq, = torch.autograd.grad(msa.attention(q, k, v, pattern).sum(), (q,))
    assert not ran
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    dq_ref, = torch.autograd.grad(msa.reference_attention(q64, k64, v64, pattern).sum(), (q64,))
    assert rel_err(dq, dq_ref) < FLOOR[dtype]
    lines = [r.getMessage() for r in caplog.records if r.name == gluon.__name__ and "backward" in r.getMessage()]
    assert len(lines) == 1 and "Triton backward runs" in lines[0], lines
    assert "sink=257" in lines[0]   # the pattern is checked first, on any device


# ---- CPU: the rendered tiling, run in Python ------------------------------------------------------

def _tiling(pattern, documents: bool = False) -> dict:
    """The rendered backward's tile helpers executed as Python over NumPy (``pattern``: its first
    head group's plan, or a KernelPlan; ``documents``: the plan of a call with cu_seqlens)."""
    if NAMES is None:
        pytest.skip(f"no Gluon for Hopper here: {WHY_NO_API}")
    helpers = ("_dkdv_bounds", "_key_rows", "_dq_bounds", "_query_keys", "_in_bounds", "_dkdv_list", "_dkdv_tile",
               "_table_row")
    kplan = _plan(pattern, documents) if isinstance(pattern, str) else pattern
    return rendered_helpers(gluon.render(kplan, "bwd"), helpers, ("WINDOW", "SLOTS"), "<gluon bwd tiling>")


def _check_tiling(pattern, n, note="", docs=None):
    """dK/dV: per 128-key tile, the 64-query tiles visited (each once), unmasked only where every
    pair is visible and inside N; dQ: per 128-row tile, the 128-key tiles likewise. Each union is
    the pattern's mask (keys of the stored rows), nothing past N. ``docs``: a random.Random, for
    packed documents of random lengths (cu_seqlens)."""
    ns = _tiling(pattern, documents=docs is not None)
    bm, bn = gluon.BWD_BLOCK_M, gluon.BLOCK_N
    want = msa.mask(pattern, n)[0].numpy()
    doc = ()
    if docs is not None:
        cu, flat, want = gluon_docs(pattern, n, docs, docs.choice([3, 40, 300]))
        doc = (_Ptr(flat),)
        note = f"{note} cu_seqlens {cu.tolist()}"
    got = np.zeros((n + bn, n + bn), dtype=bool)   # [query, key]
    for k0 in range(0, n, bn):
        qb_lo, qb_hi, full_lo, full_hi = (int(x) for x in ns["_dkdv_bounds"](k0, n, *doc, bm, bn))
        keys = np.arange(k0, k0 + bn)
        lo, hi = ns["_key_rows"](keys, n, *doc)
        for qb in range(qb_lo, qb_hi):
            queries = np.arange(qb * bm, qb * bm + bm)
            vis = ns["_in_bounds"](lo, hi, queries)    # [keys, queries]
            if full_lo <= qb < full_hi:   # keys past N: rows of dK / dV never stored
                assert vis[keys < n].all() and queries[-1] < n, (pattern, n, k0, qb, note)
            assert not vis[:, queries >= n].any(), (pattern, n, k0, qb, note)
            got[qb * bm:qb * bm + bm, k0:k0 + bn] |= vis.T
    assert np.array_equal(got[:n, :n], want), (pattern, n, "dkdv", np.argwhere(got[:n, :n] != want)[:5], note)
    got[:] = False
    for q0 in range(0, n, 2 * bm):
        kb_lo, kb_hi, full_lo, full_hi = (int(x) for x in ns["_dq_bounds"](q0, n, *doc, 2 * bm, bn))
        rows = np.arange(q0, min(q0 + 2 * bm, n))
        lo, hi = ns["_query_keys"](rows, n, *doc)
        for kb in range(kb_lo, kb_hi):
            keys = np.arange(kb * bn, kb * bn + bn)
            vis = ns["_in_bounds"](lo, hi, keys)       # [rows, keys]
            if full_lo <= kb < full_hi:
                assert vis.all() and keys[-1] < n, (pattern, n, q0, kb, note)
            got[q0:q0 + len(rows), kb * bn:kb * bn + bn] |= vis
    assert not got[:, n:].any(), (pattern, n, note)
    assert np.array_equal(got[:n, :n], want), (pattern, n, "dq", np.argwhere(got[:n, :n] != want)[:5], note)


TILING = [("window=1", (1, 127, 128, 129, 300)), ("window=100", (1, 129, 700)), ("window=128", (256, 300)),
          ("window=300", (129, 1000)), ("window=64", (63, 64, 65, 200)), ("causal=false,window=1", (129, 300)),
          ("causal=false,window=200", (1, 129, 1000)), ("causal=false,window=64", (65, 191, 500)),
          ("window=5000", (1000,)), ("causal=false,window=5000", (1000,))]


@pytest.mark.parametrize("pattern,lengths", TILING, ids=[p for p, _ in TILING])
def test_the_rendered_backward_tiling_covers_the_mask_exactly(pattern, lengths):
    for n in lengths:
        _check_tiling(pattern, n)


def test_the_rendered_backward_tiling_of_random_windows():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    for _ in range(10):
        pattern = ("causal=false," if rng.random() < 0.4 else "") + f"window={rng.randrange(1, 1500)}"
        _check_tiling(pattern, rng.randrange(1, 1300), f"seed {seed}")


DOC_TILING = [("window=1", (1, 129, 300)), ("window=100", (129, 700)), ("window=300", (1000,)),
              ("window=5000", (700,)), ("causal=false,window=1", (300,)), ("causal=false,window=64", (191, 500)),
              ("causal=false,window=200", (1, 129, 1000)), ("causal", (1, 129, 1000)), ("causal=false", (129, 700))]


@pytest.mark.parametrize("pattern,lengths", DOC_TILING, ids=[p for p, _ in DOC_TILING])
def test_the_rendered_document_backward_tiling_covers_the_mask_exactly(pattern, lengths):
    """Packed documents (cu_seqlens, lengths of 1 to 300 mixed): both kernels' bands clipped to
    the documents, their unions the pattern's mask with cu_seqlens."""
    seed = random.randrange(2**31)
    for _ in range(3):
        for n in lengths:
            _check_tiling(pattern, n, f"seed {seed}", docs=random.Random(seed))
        seed += 1


TOPK_TILING = [("topk=1", (1, 128, 129)), ("topk=3", (300, 1000)), ("causal=false,topk=2", (129, 700)),
               ("topk=16", (1000,))]


@pytest.mark.parametrize("pattern,lengths", TOPK_TILING, ids=[p for p, _ in TOPK_TILING])
def test_the_rendered_topk_backward_tiling_covers_the_mask_exactly(pattern, lengths):
    """A top-k plan: dK/dV's 64-query tiles from the inverse of the compacted table and dQ's key
    tiles from its rows (each once), unmasked only where every pair is visible and inside N;
    each union is the pattern's mask for the same block_indices (random ids, -1 slots, repeats,
    later blocks, an all-empty row), nothing past N."""
    ns = _tiling(pattern)
    bm, bn = gluon.BWD_BLOCK_M, gluon.BLOCK_N
    spec = parse(pattern).groups[0].spec
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    for n in lengths:
        b, hkv = 2, 2
        idx = topk_inputs(pattern)(b, hkv, hkv, n, n, rng)["block_indices"]
        idx[1, 0, -1] = -1
        want = msa.mask(pattern, n, hkv, "cpu", num_kv_heads=hkv, batch=b, block_indices=idx).numpy()
        nkb = -(-n // bn)
        table = gluon.topk_rows(spec, idx, n)
        offsets, inverse = (x.numpy() for x in gluon.inverse_table(table, nkb))
        table = table.numpy()
        for bi in range(b):
            for kh in range(hkv):
                got = np.zeros((n + bn, n + bn), dtype=bool)   # [query, key]
                for k0 in range(0, n, bn):
                    inv, n_q = ns["_dkdv_list"](_I(k0), _I(bi), _I(kh), _Ptr(offsets), _Ptr(inverse), hkv * nkb, nkb,
                                                bn)
                    keys = np.arange(k0, k0 + bn)
                    lo, hi = ns["_key_rows"](keys, n)
                    seen = []
                    for t in range(int(n_q) * (bn // bm)):
                        r0, masked = ns["_dkdv_tile"](t, inv, k0, n, bm, bn)
                        r0 = int(r0)
                        seen.append(r0)
                        queries = np.arange(r0, r0 + bm)
                        vis = ns["_in_bounds"](lo, hi, queries)    # [keys, queries]
                        if not masked:
                            assert vis.all() and queries[-1] < n, (pattern, n, k0, r0, seed)
                        assert not vis[:, queries >= n].any(), (pattern, n, k0, r0, seed)
                        got[r0:r0 + bm, k0:k0 + bn] |= vis.T
                    assert len(seen) == len(set(seen)), (pattern, n, k0, seed)
                assert np.array_equal(got[:n, :n], want[bi, kh]), (pattern, n, "dkdv", seed)
                got[:] = False
                for q0 in range(0, n, 2 * bm):
                    row, n_valid = ns["_table_row"](_I(q0), _I(bi), _I(kh), _Ptr(table.reshape(-1)),
                                                 table.strides[0] // 4, table.strides[1] // 4, 2 * bm)
                    rows = np.arange(q0, min(q0 + 2 * bm, n))
                    lo, hi = ns["_query_keys"](rows, n)
                    for c in range(int(n_valid)):
                        kb = int(row.arr[row.off + c])
                        keys = np.arange(kb * bn, kb * bn + bn)
                        vis = ns["_in_bounds"](lo, hi, keys)       # [rows, keys]
                        diag = spec.causal and kb * bn == q0
                        if not (diag or kb * bn + bn > n):   # the kernel's unmasked tiles
                            assert vis.all(), (pattern, n, q0, kb, seed)
                        got[q0:q0 + len(rows), kb * bn:kb * bn + bn] |= vis
                assert not got[:, n:].any(), (pattern, n, seed)
                assert np.array_equal(got[:n, :n], want[bi, kh]), (pattern, n, "dq", seed)


# ---- CPU: the launcher through a model of the kernels ------------------------------------------

class _Desc:
    """What the model reads of a TMA descriptor: the 2-D view [rows, cols] and the block."""

    def __init__(self, x, rows, cols, block):
        self.view, self.block = x.as_strided((rows, cols), (x.stride(2), 1)), block

    def load(self, r, c):
        # [block] at (r, c); rows past the view read zeros (TMA)
        br, bc = self.block
        out = torch.zeros(br, bc, dtype=torch.float64, device=self.view.device)
        got = self.view[r:r + br, c:c + bc].double()
        out[:got.shape[0]] = got
        return out

    def store(self, r, c, x, n_rows):
        # the first n_rows rows of x (TMA: clipped at the view's end)
        n_rows = max(0, min(n_rows, self.view.shape[0] - r))
        self.view[r:r + n_rows, c:c + x.shape[1]] = x[:n_rows].to(self.view.dtype)


def _rows_of(x, off, n):
    """n floats of a (B, H, N) stats view from element offset off (the kernels' pointer reads)."""
    return torch.as_strided(x, (n,), (1,), x.storage_offset() + off).double()


class _Kernel:
    """kern[grid](*args, **kw) of a model that runs ``body(pid0, pid1, *args)`` per program."""

    def __init__(self, body):
        self.body = body

    def __getitem__(self, grid):
        def launch(*args, **kw):
            for p1 in range(grid[1]):
                for p0 in range(grid[0]):
                    self.body(p0, p1, *args, **{k: v for k, v in kw.items() if k == "FUSE"})
        return launch


def _model(pattern, documents=False):
    """The two backward kernels as float64 PyTorch over the rendered tiling helpers, reading and
    writing what the launcher passes (descriptors' 2-D views, row offsets, the stats rows; with
    ``documents``, the DOC array of document bounds)."""
    ns = _tiling(pattern, documents)
    bm, bnc = gluon.BWD_BLOCK_M, gluon.BLOCK_N // 2

    def split(rest, at_n):
        """(DOC as the helpers' extra arguments, the scalar arguments after it); N is the
        scalars' at_n-th."""
        if not documents:
            return (), rest
        doc = rest[0]
        assert doc.dtype == torch.int32 and doc.is_contiguous() and doc.shape == (2, rest[1 + at_n])
        return (_Ptr(doc.cpu().numpy().reshape(-1)),), rest[1:]

    def dkdv(p0, p1, qd, kd, vd, dod, dkd, dvd, dqad, DK, DV, LSE2, DELTA, q_b, q_h, q_hc, k_b, k_h, k_hc, v_b, v_h,
             v_hc, do_b, do_h, do_hc, dk_b, dk_h, dk_hc, dk_sn, dv_b, dv_h, dv_hc, dv_sn, s_b, s_h, *rest, FUSE):
        doc, (HK0, HKS, HQ, GROUP, N, qk_scale, sm_scale) = split(rest, 4)
        if FUSE:   # dQ added into fp32 (B, HQ, N, D) rows, the view [B * HQ * N, D] in [BM, D / 2] blocks
            assert dqad.view.dtype == torch.float32 and dqad.block == [bm, dqad.view.shape[1] // 2]
        assert (dk_sn, dv_sn) == (dkd.view.stride(0), dvd.view.stride(0))
        k0, b, kh = p0 * 2 * bnc, p1 // HKS, HK0 + p1 % HKS
        qb_lo, qb_hi, full_lo, full_hi = (int(x) for x in ns["_dkdv_bounds"](k0, N, *doc, bm, 2 * bnc))
        for off in (0, bnc):
            j0 = k0 + off
            kt, vt = kd.load(b * k_b + kh * k_h + j0, kh * k_hc), vd.load(b * v_b + kh * v_h + j0, kh * v_hc)
            dk, dv = torch.zeros_like(kt), torch.zeros_like(vt)
            for h in range(kh * GROUP, kh * GROUP + GROUP):
                for qb in range(qb_lo, qb_hi):
                    qt = qd.load(b * q_b + h * q_h + qb * bm, h * q_hc)
                    dot = dod.load(b * do_b + h * do_h + qb * bm, h * do_hc)
                    o_q = np.arange(qb * bm, qb * bm + bm)
                    valid = int(np.clip(N - qb * bm, 0, bm))
                    lse2, delta = (torch.zeros(bm, dtype=torch.float64, device=kt.device) for _ in range(2))
                    lse2[:valid] = _rows_of(LSE2, b * s_b + h * s_h + qb * bm, valid)
                    delta[:valid] = _rows_of(DELTA, b * s_b + h * s_h + qb * bm, valid)
                    pt = torch.exp2(kt @ qt.T * qk_scale - lse2[None, :])
                    key_tail = FUSE and j0 + bnc > N
                    if qb < full_lo or qb >= full_hi or key_tail:
                        lo, hi = ns["_key_rows"](np.arange(j0, j0 + bnc), N, *doc)
                        pt = torch.where(torch.from_numpy(ns["_in_bounds"](lo, hi, o_q)).to(pt.device), pt, 0.0)
                        if FUSE:   # keys past N read the next rows of the view: 0 for dQ
                            pt[max(N - j0, 0):] = 0.0
                    dv += pt @ dot
                    dst = pt * (vt @ dot.T - delta[None, :])
                    dk += dst @ qt
                    if FUSE:
                        row = (b * HQ + h) * N + qb * bm
                        dqad.view[row:row + valid] += (dst.T @ kt)[:valid].float() * sm_scale
            rows = bnc if j0 + bnc <= N else max(N - j0, 0)
            dkd.store(b * dk_b + kh * dk_h + j0, kh * dk_hc, dk * sm_scale, rows)
            dvd.store(b * dv_b + kh * dv_h + j0, kh * dv_hc, dv, rows)

    def dq(p0, p1, qd, kd, vd, dod, dqd, DQ, LSE2, DELTA, q_b, q_h, q_hc, k_b, k_h, k_hc, v_b, v_h, v_hc, do_b, do_h,
           do_hc, dq_b, dq_h, dq_hc, dq_sn, s_b, s_h, *rest):
        doc, (H0, HS, GROUP, N, qk_scale, sm_scale) = split(rest, 3)
        assert dq_sn == dqd.view.stride(0)
        bn = kd.block[0]
        q0, b, h = p0 * 2 * bm, p1 // HS, H0 + p1 % HS
        kh = h // GROUP
        kb_lo, kb_hi, full_lo, full_hi = (int(x) for x in ns["_dq_bounds"](q0, N, *doc, 2 * bm, bn))
        for off in (0, bm):
            i0 = q0 + off
            qt, dot = qd.load(b * q_b + h * q_h + i0, h * q_hc), dod.load(b * do_b + h * do_h + i0, h * do_hc)
            valid = int(np.clip(N - i0, 0, bm))
            lse2, delta = (torch.zeros(bm, dtype=torch.float64, device=qt.device) for _ in range(2))
            lse2[:valid] = _rows_of(LSE2, b * s_b + h * s_h + i0, valid)
            delta[:valid] = _rows_of(DELTA, b * s_b + h * s_h + i0, valid)
            acc = torch.zeros_like(qt)
            for kb in range(kb_lo, kb_hi):
                kt, vt = kd.load(b * k_b + kh * k_h + kb * bn, kh * k_hc), vd.load(b * v_b + kh * v_h + kb * bn, kh * v_hc)
                p = torch.exp2(qt @ kt.T * qk_scale - lse2[:, None])
                if kb < full_lo or kb >= full_hi:
                    lo, hi = ns["_query_keys"](np.arange(i0, i0 + bm), N, *doc)
                    vis = ns["_in_bounds"](lo, hi, np.arange(kb * bn, kb * bn + bn))
                    p = torch.where(torch.from_numpy(vis).to(p.device), p, 0.0)
                acc += (p * (dot @ vt.T - delta[:, None])) @ kt
            dqd.store(b * dq_b + h * dq_h + i0, h * dq_hc, acc * sm_scale, bm if i0 + bm <= N else valid)

    return type("M", (), {"msa_gluon_bwd_dkdv": _Kernel(dkdv), "msa_gluon_bwd_dq": _Kernel(dq)})


MODEL_CASES = [("window=100", 200, 2, 4, 2, "bhnd"), ("causal=false,window=70", 257, 1, 4, 1, "bnhd"),
               ("window=1", 130, 2, 2, 2, "bnhd"), ("causal=false,window=500", 200, 1, 3, 1, "bhnd"),
               # dilated: each residue class of the rows a plain window on strided views
               ("window=30,dilation=2", 400, 2, 4, 2, "bnhd"), ("causal=false,window=70,dilation=3", 390, 1, 3, 1, "bhnd"),
               # a sink: the pairs outside the window by the sink pass (kernels/sink.py, Triton: the
               # interpreter here), its dK / dV partial sums over several chunks of rows
               ("window=127,sink=7", 300, 2, 4, 2, "bnhd"), ("window=20,sink=50", 200, 1, 2, 1, "bhnd"),
               ("causal=false,window=63,sink=33", 257, 1, 4, 1, "bhnd"),
               ("causal=false,window=10,sink=64", 130, 2, 2, 2, "bnhd"),
               # a sink longer than the window in fewer rows than a tile: the pass's leading run
               # of tiles ends at N, not on a tile (found by the random cases below)
               ("causal=false,window=7,sink=19", 18, 2, 2, 1, "bhnd"),
               # a dilated window's sink: the classes' stats rows gathered in the rows' order for the pass
               ("window=30,dilation=2,sink=5", 400, 2, 4, 2, "bnhd"),
               ("causal=false,window=20,dilation=3,sink=64", 390, 1, 3, 1, "bhnd"),
               # a sink of several key chunks (gluon.SINK_KEYS): their dK / dV in a launch of their
               # own, then dQ's terms over every chunk; a chunk's keys past the sink or N
               ("window=50,sink=150", 300, 2, 4, 2, "bnhd"), ("causal=false,window=30,sink=130", 257, 1, 2, 1, "bhnd"),
               ("window=20,dilation=2,sink=100", 260, 1, 4, 2, "bnhd"), ("window=16,sink=256", 200, 1, 2, 2, "bhnd"),
               # ... whose rows all see their sink keys inside the window (N <= W): dQ only converted
               ("window=300,sink=100", 250, 1, 2, 1, "bnhd"),
               # head groups: a sink's beside a plain window's (the fused form converts the sink
               # group's dQ in its pass and copies the others'), a dilated one's with a sink
               ("0-1:window=30,sink=5;2-3:causal=false,window=20", 200, 2, 4, 2, "bnhd"),
               ("0-1:window=16;2-3:window=40;4-7:window=12,dilation=2,sink=3", 100, 1, 8, 4, "bhnd")]


@pytest.mark.parametrize("fused", [False, True], ids=["two-kernels", "fused"])
@pytest.mark.parametrize("pattern,n,b,hq,hkv,layout", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_the_launcher_through_a_model_of_the_kernels(monkeypatch, device, pattern, n, b, hq, hkv, layout, fused):
    """gluon.backward with its kernels replaced by a float64 model that reads and writes exactly
    what the launcher passes (TMA views and coordinates, stats rows, GQA heads, tails past N; with
    a gradient into the LSE in the (B, N, H, D) cases) and
    tiles by the rendered helpers: the reference gradients, in q/k/v's layout. Checks the
    launcher's plumbing and the kernels' algorithm; the Gluon code itself runs on the GPU only
    (the stats pass runs in Triton's interpreter on the CPU, or on the GPU)."""
    if NAMES is None:
        pytest.skip(f"no Gluon for Hopper here: {WHY_NO_API}")
    monkeypatch.setattr(gluon, "_descriptor", lambda x, rows, cols, block: _Desc(x, rows, cols, block))
    # each head group's model tiles by its own plan (the launcher loads one a group)
    monkeypatch.setattr(gluon, "load", lambda kplan, direction="fwd": _model(kplan))
    d = 64
    q, k, v, seed = make_inputs(b, hq, hkv, n, d, torch.float32, device, layout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, lse = msa.reference_attention(q64, k64, v64, pattern, return_lse=True)
    do = torch.randn(out.shape, dtype=torch.float64, device=device)
    # a gradient into the returned LSE too (return_lse): msa_bwd_pre folds it into delta
    dlse = torch.randn(lse.shape, dtype=torch.float64, device=device) if layout == "bnhd" else None
    ref = torch.autograd.grad((out, lse) if dlse is not None else out, (q64, k64, v64),
                              (do, dlse) if dlse is not None else do)
    plan = plan_for(pattern, q.device, q.dtype, d, hq, hkv, n)
    with torch.no_grad():
        got = gluon.backward(do.float(), q, k, v, out.detach().float(), lse.detach().float(),
                             None if dlse is None else dlse.float(), plan, d ** -0.5, fused=fused)
    for name, g, r, x in zip(("dq", "dk", "dv"), got, ref, (q, k, v)):
        assert g.stride() == x.stride(), name
        err = rel_err(g, r)
        assert err < FLOOR[torch.float32], f"{name}: {err:.2e}, seed {seed}"


def test_the_launcher_through_a_model_of_random_plans(monkeypatch, device):
    """As above, for fresh random calls (``helpers.random_gluon_case``); the case and seed are in the
    message."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    for _ in range(3):
        case = random_gluon_case(rng, 400, gluon.MAX_SINK)
        with monkeypatch.context() as m:
            try:
                test_the_launcher_through_a_model_of_the_kernels(m, device, **case)
            except AssertionError as e:
                raise AssertionError(f"{case}, seed {seed}: {e}") from None


LONG_SINKS = [c for c in MODEL_CASES if max(map(int, re.findall(r"sink=(\d+)", c[0])), default=0) > gluon.SINK_KEYS]


@pytest.mark.parametrize("pattern,n,b,hq,hkv,layout", LONG_SINKS, ids=[c[0] for c in LONG_SINKS])
def test_the_fused_long_sink_in_two_launches(monkeypatch, device, pattern, n, b, hq, hkv, layout):
    """``gluon.SINK_CHUNK_LAUNCHES`` off: the fused form's sink of several key chunks as the
    two-kernel form's two launches (every chunk's dK / dV, then dQ's terms over the chunks, the
    second converting the fp32 copy), through the model. The default, one launch a chunk, runs in
    the test above."""
    monkeypatch.setattr(gluon, "SINK_CHUNK_LAUNCHES", False)
    test_the_launcher_through_a_model_of_the_kernels(monkeypatch, device, pattern, n, b, hq, hkv, layout, True)


@pytest.mark.parametrize("fused", [False, True], ids=["two-kernels", "fused"])
@pytest.mark.parametrize("pattern", ["window=95,sink=40", "causal=false,window=40,sink=41"])
def test_the_sink_pass_at_32_rows_a_tile(monkeypatch, device, pattern, fused):
    """The sink pass with 32-row tiles (``gluon.SINK_BWD_ROWS``), through the same model, at D=64.
    The bidirectional case's first tile (rows 0-31) ends before its window reaches a sink key
    but row 0 sees key 40: only the pass's leading run of tiles (a sink longer than the window)
    holds that pair, which 64-row tiles cannot show with a sink of at most 64 keys."""
    monkeypatch.setitem(gluon.SINK_BWD_ROWS, 64, 32)
    test_the_launcher_through_a_model_of_the_kernels(monkeypatch, device, pattern, 230, 2, 4, 2, "bnhd", fused)


MODEL_DOC_CASES = [("window=100", 300, 4, 2, "bhnd", 80), ("causal", 257, 2, 1, "bnhd", 120),
                   ("causal=false,window=70", 200, 3, 1, "bhnd", 60), ("causal=false", 200, 2, 2, "bnhd", 100)]


@pytest.mark.parametrize("fused", [False, True], ids=["two-kernels", "fused"])
@pytest.mark.parametrize("pattern,n,hq,hkv,layout,max_len", MODEL_DOC_CASES, ids=[c[0] for c in MODEL_DOC_CASES])
def test_the_documents_launcher_through_a_model_of_the_kernels(monkeypatch, device, pattern, n, hq, hkv, layout,
                                                               max_len, fused):
    """As above for packed documents (cu_seqlens, lengths 1 to max_len, length-1 documents mixed
    in): the launcher builds the document bounds from the positions ``attention`` derives and
    passes them to both kernels; the model tiles by the rendered document helpers. The
    reference gradients with cu_seqlens."""
    from helpers import _docs
    from msa_codegen.sparsity.inputs import normalize

    if NAMES is None:
        pytest.skip(f"no Gluon for Hopper here: {WHY_NO_API}")
    monkeypatch.setattr(gluon, "_descriptor", lambda x, rows, cols, block: _Desc(x, rows, cols, block))
    monkeypatch.setattr(gluon, "load", lambda kplan, direction="fwd": _model(pattern, documents=True))
    d = 64
    q, k, v, seed = make_inputs(1, hq, hkv, n, d, torch.float32, device, layout)
    cu = _docs(n, random.Random(seed), max_len=max_len).to(device)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, lse = msa.reference_attention(q64, k64, v64, pattern, return_lse=True, cu_seqlens=cu)
    do = torch.randn(out.shape, dtype=torch.float64, device=device)
    ref = torch.autograd.grad(out, (q64, k64, v64), do)
    plan = plan_for(pattern, q.device, q.dtype, d, hq, hkv, n, **CU_SEQLENS)
    dyn = normalize(plan.head_groups, 1, hq, hkv, n, n, q.device, cu_seqlens=cu)
    with torch.no_grad():
        got = gluon.backward(do.float(), q, k, v, out.detach().float(), lse.detach().float(), None, plan,
                             d ** -0.5, q_pos=dyn.q_pos, fused=fused)
    for name, g, r, x in zip(("dq", "dk", "dv"), got, ref, (q, k, v)):
        assert g.stride() == x.stride(), name
        err = rel_err(g, r)
        assert err < FLOOR[torch.float32], f"{name}: {err:.2e}, seed {seed}, cu_seqlens {cu.tolist()}"


def test_the_documents_launcher_through_a_model_of_random_plans(monkeypatch, device):
    """As above, for fresh random calls: direction, a window or none, N, GQA, layout, form and
    the longest document; the case and seed are in the message."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    for _ in range(3):
        terms = [] if rng.random() < 0.6 else ["causal=false"]
        window = rng.choice([None, 1, 7, 30, 100, 500])
        if window:
            terms.append(f"window={window}")
        hkv = rng.choice([1, 2])
        case = dict(pattern=",".join(terms) or "causal", n=rng.randint(1, 300), hq=hkv * rng.choice([1, 2, 3]), hkv=hkv,
                    layout=rng.choice(["bhnd", "bnhd"]), max_len=rng.randint(1, 150), fused=rng.random() < 0.5)
        with monkeypatch.context() as m:
            try:
                test_the_documents_launcher_through_a_model_of_the_kernels(m, device, **case)
            except AssertionError as e:
                raise AssertionError(f"{case}, seed {seed}: {e}") from None


_AOT = """
import json, sys, torch
from msa_codegen.kernels import gluon
from msa_codegen.pattern.lowering import lower
from msa_codegen.pattern.spec import parse
out = []
for pattern, dtype, d in json.loads(sys.argv[1]):
    ks = gluon.aot_compile_bwd(lower(parse(pattern).groups[0].spec), getattr(torch, dtype), d)
    out.append({name: dict(shared=k.metadata.shared, cubin=len(k.asm["cubin"]),
                           tma_reduce="cp.reduce.async.bulk.tensor" in k.asm["ptx"]) for name, k in ks.items()})
print(json.dumps(out))
"""


@needs_api
def test_ahead_of_time_compile_for_sm90(tmp_path):
    """The backward kernels (dK/dV, dQ, and the fused dK/dV/dQ form) compile for sm_90 without a
    GPU, within its shared memory; only the fused form adds dQ up, by a TMA reduce-add (on
    Triton 3.6 through the template's own wrapper of the builder's operation: CI's oldest-pair
    job runs this test there)."""
    pytest.importorskip("triton.backends.nvidia")
    cases = [("window=256", "bfloat16", 128), ("causal=false,window=64", "float16", 64), ("topk=4", "bfloat16", 128)]
    rows = run_aot_source(_AOT, cases, tmp_path)
    for (_, _, d), row in zip(cases, rows):
        ring = gluon.BWD_RING[d]
        # dK/dV: K, V (128 keys) and the Q / dO ring of 64-row tiles; dQ: Q, dO (128 rows), K/V ring
        assert (2 * 128 + 2 * ring * 64) * d * 2 <= row["dkdv"]["shared"] <= 232448, row
        assert (2 * 128 + 2 * ring * 128) * d * 2 <= row["dq"]["shared"] <= 232448, row
        # fused: the dS^T halves of each ring slot (bf16 [64, 64] x 2) and two fp32 [64, D/2] dQ stages
        fused_extra = ring * 2 * 64 * 64 * 2 + 2 * 64 * (d // 2) * 4
        assert row["dkdv"]["shared"] + fused_extra <= row["fused"]["shared"] <= 232448, row
        assert all(row[k]["cubin"] > 0 for k in ("dkdv", "dq", "fused"))
        assert row["fused"]["tma_reduce"] and not row["dkdv"]["tma_reduce"] and not row["dq"]["tma_reduce"]


_AOT_SINK = """
import json, sys, torch
from msa_codegen.kernels import gluon
from msa_codegen.pattern.lowering import lower
from msa_codegen.pattern.spec import parse
out = []
for pattern, dtype, d in json.loads(sys.argv[1]):
    ks = gluon.aot_compile_sink(lower(parse(pattern).groups[0].spec), getattr(torch, dtype), d)
    out.append({name: dict(shared=k.metadata.shared, cubin=len(k.asm["cubin"]), cp_async="cp.async" in k.asm["ptx"])
                for name, k in ks.items()})
print(json.dumps(out))
"""


def test_the_sink_passes_compile_for_sm90(tmp_path):
    """The sink passes (``kernels/sink.py``) at the launchers' constexprs and warps compile for
    sm_90 without a GPU, within its shared memory: the backward's row loops pipelined over
    ``gluon.SINK_BWD_STAGES`` (asynchronous copies in its PTX; at 4 stages the fused form's
    64-row tiles at D=128 need 280 KB and would fail at launch); a sink of several key chunks in
    its three launches (the chunks' dK / dV, dQ's terms over them)."""
    pytest.importorskip("triton.backends.nvidia")
    cases = [("window=4096,sink=64", "bfloat16", 128), ("causal=false,window=300,dilation=3,sink=9", "float16", 64),
             ("window=4096,dilation=2,sink=256", "bfloat16", 128), ("causal=false,window=300,sink=100", "float16", 64)]
    rows = run_aot_source(_AOT_SINK, cases, tmp_path)
    for (pattern, _, d), row in zip(cases, rows):
        long = int(pattern.rpartition("=")[2]) > gluon.SINK_KEYS
        forms = ("fwd", "bwd", "convert") + (("kv", "chunk", "chunk-convert") if long else ())
        assert sorted(row) == sorted(forms), row
        assert all(0 < row[k]["shared"] <= 232448 and row[k]["cubin"] > 0 for k in forms), row
        if gluon.SINK_BWD_STAGES > 1:
            # the row loops pipelined (a long sink's dQ launch: its loop over the chunks)
            assert all(row[k]["cp_async"] for k in forms if k != "fwd"), row
        # the fused form's stages hold its fp32 dQ rows besides q and dO
        assert row["convert"]["shared"] > row["bwd"]["shared"] or long, row
        assert not long or row["chunk-convert"]["shared"] > row["kv"]["shared"], row


_SPILLS = SASS_OF + """
import json, sys, torch
from msa_codegen.kernels import gluon
from msa_codegen.pattern.lowering import lower
from msa_codegen.pattern.spec import parse
out = []
for pattern in json.loads(sys.argv[1]):
    out.append({name: sass_counts(sass_of(k))
                for name, k in gluon.aot_compile_bwd(lower(parse(pattern).groups[0].spec), torch.bfloat16, 128).items()})
print(json.dumps(out))
"""


@needs_api
def test_backward_spills_on_the_gpu_images_triton(tmp_path):
    """On Triton 3.6 (the H200 image's; CI's oldest-pair job runs this test there) the D=128
    window backward compiles for sm_90 with dK/dV and dQ free of spills and the fused kernel at
    most 2 / 2 (on its masked path): it spilled 21 / 31 loop-invariant scalars until dS^T came
    before dV's product (docs/performance.md, "The fused kernel's spills, removed"). Triton 3.9's
    ptxas spills the fused kernel more (32 / 47, unmeasured on a GPU), so the budget is 3.6's."""
    pytest.importorskip("triton.backends.nvidia")
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"the budget is Triton 3.6's (this is {triton.__version__})")
    rows = run_aot_source(_SPILLS, ["window=4096", "causal=false,window=512"], tmp_path, timeout=600)
    for row in rows:
        assert all(row[k]["hgmma"] > 0 for k in ("dkdv", "dq", "fused")), row
        assert all(row[k]["stores"] == row[k]["loads"] == 0 for k in ("dkdv", "dq")), row
        assert row["fused"]["stores"] <= 2 and row["fused"]["loads"] <= 2, row


# ---- GPU: against the float64 reference ---------------------------------------------------------

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon family runs on compute capability 9.x only")

BF, FP = torch.bfloat16, torch.float16
# N not a multiple of 128 (1000, 4133) and a multiple (8192); D 64 / 128; GQA 4/1 and 16/16;
# bf16 / fp16; one compile per (pattern, D, dtype)
GPU_CASES = [("window=256", 1000, 128, 4, 1, BF), ("window=4096", 8192, 128, 16, 16, BF),
             ("window=4096", 4133, 128, 4, 1, FP), ("window=1", 4133, 64, 16, 16, FP),
             ("causal=false,window=300", 1000, 128, 4, 1, BF), ("causal=false,window=300", 8192, 128, 16, 16, BF),
             ("causal=false,window=300", 4133, 64, 16, 16, FP),
             # dilated: the residue classes of the rows (N a multiple of the dilation), each a plain window
             ("window=256,dilation=2", 1000, 128, 4, 1, BF), ("window=4096,dilation=2", 8192, 128, 16, 16, BF),
             ("causal=false,window=300,dilation=4", 4132, 64, 16, 16, FP),
             # a sink: its pairs outside the window by the Triton sink pass (kernels/sink.py)
             ("window=256,sink=64", 1000, 128, 4, 1, BF), ("window=4096,sink=64", 8192, 128, 16, 16, BF),
             ("causal=false,window=300,sink=5", 4133, 64, 16, 16, FP), ("window=100,sink=37", 4133, 128, 4, 2, FP),
             ("window=256,dilation=2,sink=64", 1000, 128, 4, 1, BF), ("causal=false,window=300,dilation=3,sink=9", 4134, 64, 16, 16, FP),
             # a sink of several key chunks (gluon.SINK_KEYS): their dK / dV, then dQ's terms over them
             ("window=256,sink=200", 1000, 128, 4, 1, BF), ("window=4096,sink=256", 8192, 128, 16, 16, BF),
             ("causal=false,window=300,dilation=3,sink=130", 4134, 64, 16, 16, FP)]


def _ids(cases):
    return [f"{c[0]}-N{c[1]}-D{c[2]}-{c[3]}x{c[4]}-{str(c[5])[6:]}" for c in cases]


def _bound(dtype, base):
    return max(FLOOR[dtype], 2 * base)


def _check_grads(got, ref, low, dtype, what):
    for name, g, i in zip(("dq", "dk", "dv"), got, (2, 3, 4)):
        err, base = rel_err(g, ref[i]), rel_err(low[i], ref[i])
        assert err <= _bound(dtype, base), f"{name}: {err:.2e} (torch {base:.2e}), {what}"


@pytest.mark.gpu
@needs_hopper
@needs_api
@pytest.mark.parametrize("fused", [False, True], ids=["two-kernels", "fused"])
@pytest.mark.parametrize("pattern,n,d,hq,hkv,dtype", GPU_CASES, ids=_ids(GPU_CASES))
def test_gpu_backward_matches_the_reference(pattern, n, d, hq, hkv, dtype, fused):
    q, k, v, seed = make_inputs(1, hq, hkv, n, d, dtype, "cuda")
    scale = d ** -0.5
    plan = plan_for(pattern, q.device, dtype, d, hq, hkv, n)
    assert gluon.why_not_bwd(plan, q, k, v) is None
    do = torch.randn_like(q)
    with torch.no_grad():
        o, lse = gluon.forward(q, k, v, plan, scale)
        dq, dk, dv = gluon.backward(do, q, k, v, o, lse, None, plan, scale, fused=fused)
    torch.cuda.synchronize()
    assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), v.stride())
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype,) * 3
    ref = chunked_reference(q, k, v, pattern, do)
    low = chunked_reference(q, k, v, pattern, do, compute_dtype=dtype)
    _check_grads((dq, dk, dv), ref, low, dtype, f"seed {seed}")


@pytest.mark.gpu
@needs_hopper
@needs_api
def test_gpu_random_backward_patterns_shapes_and_layouts():
    """Fresh random calls (``helpers.random_gluon_case``: direction, window, dilation, sink, head groups,
    GQA, batch, layout, form) at lengths up to 3000, head dim 64 or 128, bf16 or fp16, against
    the float64 reference and PyTorch's own error; the case and seed are in the message."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    for _ in range(4):
        case = random_gluon_case(rng, 3000, gluon.MAX_SINK)
        d, dtype = rng.choice([64, 128]), rng.choice([BF, FP])
        pattern, n, hq, hkv = case["pattern"], case["n"], case["hq"], case["hkv"]
        q, k, v, _ = make_inputs(case["b"], hq, hkv, n, d, dtype, "cuda", case["layout"], seed=rng.randrange(2**31))
        what = f"{case} D={d} {str(dtype)[6:]}, seed {seed}"
        scale = d ** -0.5
        plan = plan_for(pattern, q.device, dtype, d, hq, hkv, n)
        assert gluon.why_not_bwd(plan, q, k, v) is None, what
        do = torch.randn_like(q)
        with torch.no_grad():
            o, lse = gluon.forward(q, k, v, plan, scale)
            got = gluon.backward(do, q, k, v, o, lse, None, plan, scale, fused=case["fused"])
        assert tuple(g.stride() for g in got) == (q.stride(), k.stride(), v.stride()), what
        ref = chunked_reference(q, k, v, pattern, do)
        low = chunked_reference(q, k, v, pattern, do, compute_dtype=dtype)
        _check_grads(got, ref, low, dtype, what)


@pytest.mark.gpu
@needs_hopper
@needs_api
@pytest.mark.parametrize("deterministic", [True, False])
def test_gpu_attention_backward_runs_gluon_with_the_variable(monkeypatch, deterministic):
    """msa_codegen.attention(...).backward() with MSA_CODEGEN_GLUON=1 on (B, N, H, D) inputs
    (transposed views), B=2, GQA 4/1: the Gluon backward runs (spied; fused exactly when not
    deterministic) and gives the reference gradients, for a random dO and for the stride-0 dO of
    a sum."""
    monkeypatch.setenv(gluon.ENV, "1")
    calls = []
    real = gluon.backward
    monkeypatch.setattr(gluon, "backward", lambda *a, fused=False, **kw: calls.append(int(fused) + 1) or real(
        *a, fused=fused, **kw))
    pattern, dtype = "causal=false,window=200", BF
    q, k, v, seed = make_inputs(2, 4, 1, 1500, 128, dtype, "cuda", layout="bnhd")
    out = msa.attention(q, k, v, pattern, deterministic=deterministic)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    # 2: the fused form, where the call need not be deterministic and the plan takes it
    ran = 1 if deterministic or gluon.fused_reason([_plan(pattern)], 4) else 2
    assert calls == [ran], "the Gluon backward did not run, or not in the asked-for form"
    assert [g.stride() for g in got] == [x.stride() for x in (q, k, v)]
    ref = chunked_reference(q, k, v, pattern, do)
    low = chunked_reference(q, k, v, pattern, do, compute_dtype=dtype)
    _check_grads(got, ref, low, dtype, f"random dO, seed {seed}")
    got = torch.autograd.grad(out.sum(), (q, k, v))
    assert calls == [ran, ran]
    ones = torch.ones_like(out)
    ref = chunked_reference(q, k, v, pattern, ones)
    low = chunked_reference(q, k, v, pattern, ones, compute_dtype=dtype)
    _check_grads(got, ref, low, dtype, f"dO of a sum, seed {seed}")


# top-k: random ids with -1 slots, repeats and (causal) later blocks, one query block selecting nothing
TOPK_CASES = [("topk=16", 4096 + 37, 128, 4, 1, BF), ("topk=3", 1000, 64, 16, 16, FP),
              ("causal=false,topk=5", 4096 + 37, 128, 4, 2, BF), ("causal=false,topk=2", 1000, 64, 2, 1, FP)]


@pytest.mark.gpu
@needs_hopper
@needs_api
@pytest.mark.parametrize("fused", [False, True], ids=["two-kernels", "fused"])
@pytest.mark.parametrize("pattern,n,d,hq,hkv,dtype", TOPK_CASES, ids=_ids(TOPK_CASES))
def test_gpu_topk_backward_matches_the_reference(pattern, n, d, hq, hkv, dtype, fused):
    q, k, v, seed = make_inputs(1, hq, hkv, n, d, dtype, "cuda")
    idx = topk_inputs(pattern)(1, hq, hkv, n, n, random.Random(seed))["block_indices"]
    idx[0, 0, 1] = -1
    idx = idx.cuda()
    scale = d ** -0.5
    plan = plan_for(pattern, q.device, dtype, d, hq, hkv, n)
    assert gluon.why_not_bwd(plan, q, k, v) is None
    do = torch.randn_like(q)
    with torch.no_grad():
        o, lse = gluon.forward(q, k, v, plan, scale, idx)
        dq, dk, dv = gluon.backward(do, q, k, v, o, lse, None, plan, scale, idx, fused=fused)
    torch.cuda.synchronize()
    assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), v.stride())
    qr, kr, vr = (x.detach().requires_grad_() for x in (q, k, v))
    ref = msa.reference_attention(qr, kr, vr, pattern, block_indices=idx)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), do.double())
    mask = msa.mask(pattern, n, hq, q.device, num_kv_heads=hkv, batch=1, block_indices=idx)
    low = lowp_attention(qr, kr, vr, mask, scale)
    low_grads = torch.autograd.grad(low, (qr, kr, vr), do)
    _check_grads((dq, dk, dv), (None, None, *ref_grads), (None, None, *low_grads), dtype, f"seed {seed}")
    assert not dq[0, 0, 128:256].any()   # the query block that selected nothing


# ---- the fused backward's switch: deterministic ------------------------------------------------

@pytest.mark.parametrize("flag,torch_mode,fused", [(None, False, True), (None, True, False), (False, True, True),
                                                   (True, False, False)])
def test_deterministic_picks_the_fused_backward(monkeypatch, flag, torch_mode, fused):
    """``attention(deterministic=flag)`` reaches the Gluon backward as ``fused=not deterministic``,
    None meaning ``torch.are_deterministic_algorithms_enabled()`` at the call; on the eager
    route and through the custom ops (what torch.compile traces). The Gluon backward is made
    eligible and replaced by a spy; the forward runs the Triton kernels."""
    from msa_codegen import autograd
    from msa_codegen.kernels import launch

    seen = []

    def spy(do, q, k, v, *a, fused=False, **kw):
        seen.append(fused)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(launch, "_gluon_route", lambda plan, q_pos, q, backward=False: backward)
    monkeypatch.setattr(gluon, "why_not_bwd", lambda *a: None)
    monkeypatch.setattr(gluon, "fused_reason", lambda *a, **kw: None)
    monkeypatch.setattr(gluon, "backward", spy)
    pattern = "window=16"
    q, k, v, _ = make_inputs(1, 2, 1, 40, 16, torch.float32, "cpu")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(torch_mode)
    try:
        torch.autograd.grad(msa.attention(q, k, v, pattern, deterministic=flag).sum(), (q, k, v))
        plan = plan_for(pattern, q.device, q.dtype, 16, 2, 1, 40)
        det = torch_mode if flag is None else flag
        out, _ = autograd.run_compiled(q, k, v, plan.pattern_text, 16 ** -0.5, plan.config_list, deterministic=det)
        torch.autograd.grad(out.sum(), (q, k, v))
    finally:
        torch.use_deterministic_algorithms(before)
    assert seen == [fused, fused]


def _spy_backward_form(monkeypatch) -> list:
    """Every backward goes to the Gluon launcher, replaced by a spy: the list of the ``fused``
    flags it was called with (zero gradients returned)."""
    from msa_codegen.kernels import launch

    seen = []
    monkeypatch.setattr(launch, "_gluon_route", lambda plan, q_pos, q, backward=False: backward)
    monkeypatch.setattr(gluon, "why_not_bwd", lambda *a: None)
    monkeypatch.setattr(gluon, "backward", lambda do, q, k, v, *a, fused=False, **kw: seen.append(fused) or (
        torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)))
    return seen


def test_fused_reason_and_a_triton_without_a_tma_reduce(monkeypatch):
    """``fused_reason``: GQA top-k keeps the two kernels (measured slower fused); on a Triton whose
    Gluon has no TMA reduce-add it says so and ``deterministic=False`` runs the two-kernel backward
    (``fused=False``)."""
    if NAMES is None:
        pytest.skip(f"no Gluon for Hopper here: {WHY_NO_API}")
    assert gluon.fused_reason([_plan("topk=16")], 4).startswith("top-k with 4 query heads a KV head")
    assert gluon.fused_reason([_plan("topk=16")], 1) is None and gluon.fused_reason([_plan("window=64")], 4) is None
    monkeypatch.setattr(gluon, "api", lambda: ({**NAMES, "tma_add": None}, None))
    assert "no TMA reduce-add" in gluon.fused_reason()
    seen = _spy_backward_form(monkeypatch)
    q, k, v, _ = make_inputs(1, 2, 1, 40, 16, torch.float32, "cpu")
    torch.autograd.grad(msa.attention(q, k, v, "window=16", deterministic=False).sum(), (q, k, v))
    assert seen == [False]


def test_a_large_dq_copy_takes_the_two_kernels(monkeypatch):
    """``fused_reason`` with the call's size: an fp32 dQ copy over ``FUSED_DQ_MAX_BYTES`` keeps the
    two kernels (peak memory), at the limit the fused form runs; ``attention(deterministic=False)``
    passes q's size (here a limit lowered to the test's q, 2 x 40 x 16 elements)."""
    if NAMES is None:
        pytest.skip(f"no Gluon for Hopper here: {WHY_NO_API}")
    if NAMES["tma_add"] is None:
        pytest.skip("this Triton's Gluon has no TMA reduce-add")
    window = [_plan("window=4096")]
    limit = gluon.FUSED_DQ_MAX_BYTES
    assert gluon.fused_reason(window, 1, limit // 4) is None
    why = gluon.fused_reason(window, 1, limit // 4 + 1)
    assert why is not None and "fp32 dQ copy" in why
    # the bench rows at N=131072 keep the fused form (D=128: 16 and 32 query heads), N=1M does not
    assert gluon.fused_reason(window, 4, 32 * 131072 * 128) is None
    assert gluon.fused_reason(window, 1, 16 * (1 << 20) * 128) is not None
    seen = _spy_backward_form(monkeypatch)
    q, k, v, _ = make_inputs(1, 2, 1, 40, 16, torch.float32, "cpu")
    for limit, fused in ((4 * q.numel(), True), (4 * q.numel() - 1, False)):
        monkeypatch.setattr(gluon, "FUSED_DQ_MAX_BYTES", limit)
        torch.autograd.grad(msa.attention(q, k, v, "window=16", deterministic=False).sum(), (q, k, v))
        assert seen[-1] is fused, limit


@needs_api
@pytest.mark.parametrize("fused", [False, True], ids=["two-kernels", "fused"])
def test_the_backward_host_path_launches_what_each_form_needs(monkeypatch, fused):
    """``gluon.backward``'s host path with the launches recorded instead of run (CPU tensors):
    the stats pass, dK/dV, and dQ unless fused; the fused dK/dV gets the zeroed fp32 copy's
    descriptor, whose contents become dq; no descriptor is built that no launch takes."""
    launched, built = [], []
    monkeypatch.setattr(gluon.direct, "launch", lambda kern, grid, *args, **kw: launched.append(
        (getattr(kern, "__name__", None) or kern.fn.__name__, grid, args, kw)))
    real_descriptor = gluon._descriptor
    monkeypatch.setattr(gluon, "_descriptor", lambda *a, **kw: built.append(real_descriptor(*a, **kw)) or built[-1])
    b, hq, hkv, n, d = 2, 4, 2, 300, 64
    q, k, v, _ = make_inputs(b, hq, hkv, n, d, torch.float32, "cpu")
    do, o = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(b, hq, n)
    plan = plan_for("window=100", q.device, q.dtype, d, hq, hkv, n)
    dq, dk, dv = gluon.backward(do, q, k, v, o, lse, None, plan, d ** -0.5, fused=fused)
    names = [name for name, *_ in launched]
    assert names == (["msa_bwd_pre", "msa_gluon_bwd_dkdv"] if fused else
                     ["msa_bwd_pre", "msa_gluon_bwd_dkdv", "msa_gluon_bwd_dq"]), names
    assert [kw["FUSE"] for name, _, _, kw in launched if name == "msa_gluon_bwd_dkdv"] == [fused]
    taken = {id(a) for *_, args, _ in launched for a in args}
    assert all(id(x) in taken for x in built), "a descriptor no launch takes"
    copies = [x for x in built if list(x.block_shape) == [gluon.BWD_BLOCK_M, d // 2]]   # the fp32 copy's halves
    assert len(copies) == int(fused) and all(x.base.dtype == torch.float32 for x in copies)
    if fused:
        assert not dq.any()   # the zeroed copy, which the recorded launches did not add to
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
