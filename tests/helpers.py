"""Shared by the kernel tests: inputs, error metric, the check against the fp64 oracle."""
from __future__ import annotations

import ast
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import msa_codegen as msa
from msa_codegen.kernels import gluon as _gluon
from msa_codegen.pattern.lowering import CU_SEQLENS, lower
from msa_codegen.pattern.reference import relative_error
from msa_codegen.pattern.spec import parse

# relative-error floors per dtype; the bound is max(floor, 2 x PyTorch's own same-dtype error)
FLOOR = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}

rel_err = relative_error


def make_inputs(b, hq, hkv, n, d, dtype, device, layout="bhnd", seed=None):
    """Fresh random q, k, v (never zeros), requires_grad; `layout="bnhd"` gives transposed views."""
    seed = random.randrange(2**31) if seed is None else seed
    g = torch.Generator(device="cpu").manual_seed(seed)

    def one(h):
        if layout == "bnhd":
            t = torch.randn(b, n, h, d, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
        else:
            t = torch.randn(b, h, n, d, generator=g).to(device=device, dtype=dtype)
        return t.requires_grad_()

    return one(hq), one(hkv), one(hkv), seed


def lowp_attention(q, k, v, mask, scale):
    """PyTorch's own attention in the inputs' dtype (the baseline error of that dtype)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype)
    return p @ v


def check_attention(pattern, b=1, hq=2, hkv=1, n=129, d=32, dtype=torch.float32, device="cpu",
                    layout="bhnd", scale=None, seed=None):
    q, k, v, seed = make_inputs(b, hq, hkv, n, d, dtype, device, layout, seed)
    out, lse = msa.attention(q, k, v, pattern, scale=scale, return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape and out.stride() == q.stride()
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, n)
    ref, ref_lse = msa.reference_attention(q, k, v, pattern, scale=scale, return_lse=True)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())

    mask = msa.mask(pattern, n, hq, device)[None] if dtype != torch.float32 else None
    return assert_matches_reference(pattern, seed, q, k, v, do, mask, d ** -0.5 if scale is None else scale,
                                    (out, lse, grads), (ref, ref_lse, ref_grads))


def assert_matches_reference(pattern, seed, q, k, v, do, mask, scale, got, want):
    """Kernel results ``got = (out, lse, (dq, dk, dv))`` against the fp64 ``want`` (same layout).

    Bounds: the dtype's floor, or twice the error of PyTorch's own computation in the inputs'
    dtype on ``mask`` (low precision only); the same -inf LSE rows, finite LSE within 10x the
    floor. Returns the relative errors.
    """
    (out, lse, grads), (ref, ref_lse, ref_grads) = got, want
    dtype = q.dtype
    floor = FLOOR[dtype]
    base = {}
    if dtype != torch.float32:
        low = lowp_attention(q, k, v, mask, scale)
        low_grads = torch.autograd.grad(low, (q, k, v), do)
        base = {"out": rel_err(low, ref), **{f"d{x}": rel_err(g_, r_) for x, g_, r_ in zip("qkv", low_grads, ref_grads)}}
    errs = {"out": rel_err(out, ref), **{f"d{x}": rel_err(g_, r_) for x, g_, r_ in zip("qkv", grads, ref_grads)}}
    for name, err in errs.items():
        bound = max(floor, 2 * base.get(name, 0.0))
        assert err <= bound, f"{name}: rel err {err:.2e} > {bound:.2e} (pattern {pattern!r}, seed {seed}, errs {errs}, torch {base})"
    # LSE: same -inf rows, close elsewhere
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"LSE -inf rows differ (seed {seed})"
    fin = torch.isfinite(ref_lse)
    lse_err = (lse[fin].double() - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    assert lse_err <= 10 * floor, f"LSE abs err {lse_err:.2e} (pattern {pattern!r}, seed {seed})"
    return errs


def chunked_reference(q, k, v, pattern, do, scale=None, compute_dtype=torch.float64, rows=None):
    """out, lse, dq, dk, dv of masked attention, row chunk by row chunk, touching only the key
    columns a chunk can see: the oracle at lengths where an N x N mask does not fit.

    With ``compute_dtype`` = the inputs' dtype it is PyTorch's own low-precision computation of
    the same thing (the baseline of the "no worse than twice PyTorch's error" rule).
    """
    from msa_codegen.pattern.reference import spec_mask

    b, hq, n, d = q.shape
    group = hq // k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    if rows is None:   # keep a chunk's (B, H, rows, N) score block near 1 GiB of fp64
        rows = max(16, min(1024, 2**27 // (b * hq * n)))
    acc = torch.float64 if compute_dtype == torch.float64 else torch.float32
    cq, ck, cv, cdo = (t.detach().to(compute_dtype) for t in (q, k, v, do))
    out = torch.zeros(b, hq, n, d, dtype=acc, device=q.device)
    lse = torch.full((b, hq, n), float("-inf"), dtype=acc, device=q.device)
    dq = torch.zeros_like(out)
    dk = torch.zeros(b, hq, n, d, dtype=acc, device=q.device)   # per query head, summed per group below
    dv = torch.zeros_like(dk)
    groups = msa.parse(pattern).head_groups(hq)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        m = torch.empty(hq, r1 - r0, n, dtype=torch.bool, device=q.device)
        for h0, h1, spec in groups:
            m[h0:h1] = spec_mask(spec, n, q.device, rows=(r0, r1))
        cols = m.any(dim=(0, 1)).nonzero().squeeze(1)
        if cols.numel() == 0:
            continue
        mc = m[:, :, cols][None]
        kc = ck[:, :, cols].repeat_interleave(group, 1)
        vc = cv[:, :, cols].repeat_interleave(group, 1)
        qc, doc = cq[:, :, r0:r1], cdo[:, :, r0:r1]
        s = (qc @ kc.transpose(-1, -2)).to(acc) * scale
        s = s.masked_fill(~mc, float("-inf"))
        l_ = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isfinite(l_), l_, 0)[..., None]).masked_fill(~mc, 0)
        o = (p.to(compute_dtype) @ vc).to(acc)
        out[:, :, r0:r1] = o
        lse[:, :, r0:r1] = l_
        dp = (doc @ vc.transpose(-1, -2)).to(acc)
        delta = (o.to(compute_dtype).to(acc) * doc.to(acc)).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq[:, :, r0:r1] = (ds.to(compute_dtype) @ kc).to(acc) * scale
        dk[:, :, cols] += (ds.transpose(-1, -2).to(compute_dtype) @ qc).to(acc) * scale
        dv[:, :, cols] += (p.transpose(-1, -2).to(compute_dtype) @ doc).to(acc)
    dk = dk.view(b, hq // group, group, n, d).sum(2)
    dv = dv.view(b, hq // group, group, n, d).sum(2)
    return out, lse, dq, dk, dv


def spy_scratch(monkeypatch):
    """The results of kernels.schedule.ds_heads, one per head group and backward, as a list that
    grows (None: dq recomputed the band; else (slots, elements per head, heads per chunk))."""
    from msa_codegen.kernels import schedule

    seen = []
    real = schedule.ds_heads

    def spy(*args):
        seen.append(real(*args))
        return seen[-1]

    monkeypatch.setattr(schedule, "ds_heads", spy)
    return seen


# ---- run-time sparsity inputs (shared by sparsity/test_inputs.py and kernels/test_launch.py) ----

def _docs(n, gen, max_len=40, ones=True):
    """Random document lengths summing to n, with length-1 documents mixed in."""
    lens, left = [], n
    while left:
        ln = 1 if ones and gen.random() < 0.25 else gen.randint(1, max_len)
        ln = min(ln, left)
        lens.append(ln)
        left -= ln
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    return cu


def gluon_docs(pattern, n, gen, max_len):
    """Packed documents as the Gluon kernels read them: (cu_seqlens, the flat DOC array the
    launcher passes, its mask (H=1)). The positions come from ``sparsity.prepare``'s path
    (``normalize``); the bounds from ``gluon.doc_bounds``, checked here against cu_seqlens."""
    from msa_codegen.kernels import gluon
    from msa_codegen.sparsity.inputs import normalize

    cu = _docs(n, gen, max_len=max_len)
    dyn = normalize(msa.parse(pattern).head_groups(1), 1, 1, 1, n, n, cu_seqlens=cu)
    doc = gluon.doc_bounds(dyn.q_pos, n)
    assert doc.shape == (2, n) and doc.dtype == torch.int32 and doc.is_contiguous()
    seg = torch.searchsorted(cu[1:].long(), torch.arange(n), right=True)
    assert torch.equal(doc[0].long(), cu[seg].long()) and torch.equal(doc[1].long(), cu[seg + 1].long())
    return cu, doc.numpy().reshape(-1), msa.mask(pattern, n, cu_seqlens=cu)[0, 0].numpy()


def _keep_sorted(n, frac, gen, b=1, h=1):
    """(b, h, n') sorted positions in 0..n-1 keeping about 1 - frac of them (same count per row)."""
    m = max(1, round(n * (1 - frac)))
    rows = [sorted(gen.sample(range(n), m)) for _ in range(b * h)]
    return torch.tensor(rows, dtype=torch.int32).view(b, h, m)


# ---- the kernels against the oracle --------------------------------------------------------

def check_dynamic(pattern, b=1, hq=2, hkv=1, nq=129, nk=None, d=32, dtype=torch.float32, device="cpu",
                  make=None, seed=None):
    """Kernel vs fp64 oracle (out, LSE, dq, dk, dv) with run-time inputs ``make(b, hq, hkv, nq, nk, gen)``."""
    nk = nq if nk is None else nk
    seed = random.randrange(2**31) if seed is None else seed
    gen = random.Random(seed)
    tg = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=tg).to(device=device, dtype=dtype).requires_grad_()
    k = torch.randn(b, hkv, nk, d, generator=tg).to(device=device, dtype=dtype).requires_grad_()
    v = torch.randn(b, hkv, nk, d, generator=tg).to(device=device, dtype=dtype).requires_grad_()
    dyn = make(b, hq, hkv, nq, nk, gen) if make else {}
    dyn = {name: (t.to(device) if isinstance(t, torch.Tensor) else t) for name, t in dyn.items()}
    out, lse = msa.attention(q, k, v, pattern, return_lse=True, **dyn)
    assert out.shape == q.shape and lse.shape == (b, hq, nq)
    ref, ref_lse = msa.reference_attention(q, k, v, pattern, return_lse=True, **dyn)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
    mask = msa.mask(pattern, nq, hq, device, num_kv_heads=hkv, batch=b, **dyn) if dtype != torch.float32 else None
    return assert_matches_reference(pattern, seed, q, k, v, do, mask, d ** -0.5, (out, lse, grads),
                                    (ref, ref_lse, ref_grads))


def random_gluon_case(rng: random.Random, n_max: int, max_sink: int) -> dict:
    """A random call of a plain pattern the Gluon family takes in both directions: direction,
    window, dilation (N a multiple of it), a sink of up to ``max_sink`` keys, sometimes a second
    head group (on a KV head's boundary); GQA, batch, layout, and the backward's form."""
    def pattern(dil):
        terms = [] if rng.random() < 0.6 else ["causal=false"]
        terms.append(f"window={rng.choice([1, 7, 30, 64, 127, 200, 500])}")
        if dil > 1:
            terms.append(f"dilation={dil}")
        if rng.random() < 0.5:
            terms.append(f"sink={rng.randint(1, max_sink)}")
        return ",".join(terms)
    dil = rng.choice([1, 1, 2, 3])
    hkv = rng.choice([1, 2])
    group = rng.choice([1, 2, 3])
    hq = hkv * group
    text = pattern(dil)
    if hkv == 2 and rng.random() < 0.4:   # two head groups, one a KV head
        text = f"0-{group - 1}:{text};{group}-{hq - 1}:{pattern(rng.choice([1, dil]))}"
    return dict(pattern=text, n=dil * rng.randint(1, n_max // dil), b=rng.choice([1, 2]), hq=hq, hkv=hkv,
                layout=rng.choice(["bhnd", "bnhd"]), fused=rng.random() < 0.5)


def random_pattern(rng: random.Random, n: int) -> str:
    """A random pattern of one head group over N rows: either direction; one to three of window
    (with a dilation sometimes), sink, global (bidirectional), random and top-k blocks of 16-128,
    or dense. Edge cases come up: windows of 1 and of N, sinks and globals past N."""
    causal = rng.random() < 0.6
    terms = [] if causal else ["causal=false"]
    kinds = rng.sample(["window", "sink", "global", "random", "topk", "dense"], rng.randint(1, 3))
    if "dense" in kinds:
        return ",".join(terms) or "causal"
    if "window" in kinds or not ({"global", "random", "topk"} & set(kinds)) or ("global" in kinds and causal):
        terms.append(f"window={rng.randint(1, max(1, n))}")
        if rng.random() < 0.4:
            terms.append(f"dilation={rng.randint(2, 5)}")
    if "sink" in kinds:
        terms.append(f"sink={rng.randint(1, 12)}")
    if "global" in kinds and not causal:
        terms.append(f"global={rng.randint(1, 12)}")
    if "random" in kinds:
        terms.append(f"random={rng.randint(1, 3)},seed={rng.randint(0, 99)}")
    if "topk" in kinds:
        terms.append(f"topk={rng.randint(1, 4)}")
    if "random" in kinds or "topk" in kinds:
        terms.append(f"block={rng.choice([16, 32, 64, 128])}")
    return ",".join(terms)


def random_case(rng: random.Random, dtypes) -> dict:
    """One random call: a pattern (``random_pattern``, sometimes two of them as two head groups),
    N 1-260, B 1-2, GQA 1-3 over 1-2 KV heads, head dim 16-72 (not only powers of two), a dtype of
    ``dtypes``, and ``make``: the run-time inputs for ``check_dynamic`` (packed documents
    sometimes, block_indices when the pattern has top-k), None for a plain ``check_attention``."""
    n = rng.randint(1, 260)
    hkv = rng.choice([1, 1, 2])
    hq = hkv * rng.choice([1, 2, 3])
    pattern = random_pattern(rng, n)
    if hq >= 2 and "topk" not in pattern and rng.random() < 0.3:
        other = random_pattern(rng, n)
        if "topk" not in other:
            cut = rng.randint(0, hq - 2)
            pattern = f"0-{cut}:{pattern};{cut + 1}-{hq - 1}:{other}"
    docs = "topk" not in pattern and "global" not in pattern and "random" not in pattern and rng.random() < 0.25
    make = (topk_inputs(pattern) if "topk" in pattern
            else docs_inputs(max_len=rng.randint(3, 60)) if docs else None)
    return dict(pattern=pattern, b=1 if docs else rng.choice([1, 1, 2]), hq=hq, hkv=hkv, nq=n,
                d=rng.choice([16, 24, 32, 40, 64, 72]), dtype=rng.choice(dtypes), make=make,
                seed=rng.randrange(2**31))


def _blk(pattern):
    return msa.parse(pattern).groups[-1].spec.block


def topk_inputs(pattern, dup=True):
    """Random block_indices for the pattern's topk term: -1 slots and (with dup) repeated ids."""
    def make(b, hq, hkv, nq, nk, gen):
        spec = [g.spec for g in msa.parse(pattern).groups if g.spec.topk][0]
        nqb, nkb = -(-nq // spec.block), -(-nk // spec.block)
        idx = torch.tensor([[[[gen.randrange(-1, nkb) for _ in range(spec.topk)] for _ in range(nqb)]
                             for _ in range(hkv)] for _ in range(b)], dtype=torch.int32)
        if dup and spec.topk > 1:
            idx[..., -1] = idx[..., 0]
        return {"block_indices": idx}
    return make


def with_topk(pattern, make):
    """``make``'s inputs (none when None), plus block_indices when the pattern has a topk term."""
    def both(b, hq, hkv, nq, nk, gen):
        out = make(b, hq, hkv, nq, nk, gen) if make else {}
        if "topk" in pattern:
            out.update(topk_inputs(pattern)(b, hq, hkv, nq, nk, gen))
        return out
    return both


def docs_inputs(max_len=40):
    def make(b, hq, hkv, nq, nk, gen):
        return {"cu_seqlens": _docs(nq, gen, max_len=max_len)}
    return make


def pos_inputs(frac_q=0.3, frac_k=0.3, span=None, shape="bhn"):
    """Positions of a compacted sequence: per head, sorted, about frac of the tokens dropped."""
    def make(b, hq, hkv, nq, nk, gen):
        full = span or max(nq, nk) * 2
        if shape == "n":
            return {"q_pos": torch.tensor(sorted(gen.sample(range(full), nq)), dtype=torch.int64),
                    "k_pos": torch.tensor(sorted(gen.sample(range(full), nk)), dtype=torch.int64)}
        qp = torch.tensor([sorted(gen.sample(range(full), nq)) for _ in range(b * hq)], dtype=torch.int32)
        kp = torch.tensor([sorted(gen.sample(range(full), nk)) for _ in range(b * hkv)], dtype=torch.int32)
        return {"q_pos": qp.view(b, hq, nq), "k_pos": kp.view(b, hkv, nk)}
    return make


def bucket_inputs(nb=3, with_pos=False):
    """Buckets sorted along the sequence (positions increasing inside a bucket), as hash_sort gives."""
    def make(b, hq, hkv, nq, nk, gen):
        def side(h, n):
            rows_b, rows_p = [], []
            for _ in range(b * h):
                bk = sorted(gen.randrange(nb) for _ in range(n))
                pos = list(range(n))
                gen.shuffle(pos)
                # positions increasing inside each bucket
                out_p, start = [], 0
                chunks = {}
                for x in bk:
                    chunks[x] = chunks.get(x, 0) + 1
                for x in sorted(chunks):
                    out_p += sorted(pos[start:start + chunks[x]])
                    start += chunks[x]
                rows_b.append(bk)
                rows_p.append(out_p)
            return (torch.tensor(rows_b, dtype=torch.int32).view(b, h, n),
                    torch.tensor(rows_p, dtype=torch.int32).view(b, h, n))
        qb, qp = side(hq, nq)
        kb, kp = side(hkv, nk)
        out = {"q_bucket": qb, "k_bucket": kb}
        if with_pos:
            out.update(q_pos=qp, k_pos=kp)
        return out
    return make


def run_sm90_script(*args, env=None, timeout=600) -> subprocess.CompletedProcess:
    """``python tests/ARGS...`` in a process without TRITON_INTERPRET (the sm_90 compile checks:
    the GPU compiler with its bundled ptxas, no GPU needed); skips where they cannot run."""
    pytest.importorskip("triton.backends.nvidia")
    if torch.cuda.is_available():
        pytest.skip("the GPU tests compile them for the real device")
    tests = os.path.dirname(os.path.abspath(__file__))
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full["PYTHONPATH"] = os.pathsep.join([os.path.dirname(tests), full.get("PYTHONPATH", "")])
    full.update(env or {})
    return subprocess.run([sys.executable, os.path.join(tests, args[0]), *args[1:]], env=full,
                          capture_output=True, text=True, timeout=timeout)


#: the start of a ``run_aot_source`` script that reads SASS: ``sass_of(kernel)``, a compiled
#: kernel's SASS text (cuobjdump, which Triton ships), and ``sass_counts(sass)``, its products and
#: spill instructions
SASS_OF = """
import os, re, subprocess, tempfile
import triton.backends.nvidia as _nv


def sass_of(k):
    tool = os.path.join(os.path.dirname(_nv.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def sass_counts(sass):
    return dict(hgmma=len(re.findall(r"\\bHGMMA\\b", sass)), stores=len(re.findall(r"\\bSTL\\b", sass)),
                loads=len(re.findall(r"\\bLDL\\b", sass)))
"""


def run_aot_source(source: str, cases, tmp_path, timeout: int = 300) -> list:
    """``python -c source json(cases)`` without TRITON_INTERPRET, with its own codegen home and
    Triton cache under ``tmp_path``: the Gluon kernels' sm_90 compiles (no GPU needed). Returns
    the JSON list the script prints last."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(MSA_CODEGEN_HOME=str(tmp_path / "home"), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    p = subprocess.run([sys.executable, "-c", source, json.dumps(cases)], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---- the Gluon templates' tile helpers, run as Python over NumPy (tests/kernels/test_gluon*.py) ----

class GlScalar(int):
    """A scalar of the rendered helpers: an int with Gluon's ``.to`` (a no-op here)."""
    def to(self, _dtype):
        return self

    def __ge__(self, other):
        return GlScalar(int(self) >= other)


class GlPointer:
    """A pointer into a NumPy array, or a block of them: ``+`` moves it (by a scalar or an
    array of offsets), ``gl.load`` reads it."""
    def __init__(self, arr, off=0):
        self.arr, self.off = arr, off

    def __add__(self, off):
        if isinstance(off, np.ndarray):
            return GlPointer(self.arr, self.off + off)
        return GlPointer(self.arr, self.off + int(off))


def _gl_load(p, mask=None, other=None):
    """``gl.load``: a scalar, or a block read where ``mask`` holds (``other`` elsewhere; the
    masked-off offsets are never read, as on the GPU)."""
    if not isinstance(p.off, np.ndarray):
        assert mask is None
        return GlScalar(p.arr[p.off])
    ok = np.ones(p.off.shape, dtype=bool) if mask is None else mask
    assert (p.off[ok] >= 0).all() and (p.off[ok] < p.arr.size).all(), "a load outside the array"
    return np.where(ok, p.arr[np.where(ok, p.off, 0)], other)


class _GlNumpy:
    """The few Gluon scalar/array builtins the tile helpers use, on NumPy."""
    constexpr = staticmethod(lambda x: x)
    maximum, minimum, where, expand_dims, zeros_like = np.maximum, np.minimum, np.where, np.expand_dims, np.zeros_like
    cdiv = staticmethod(lambda a, b: -(-a // b))
    static_range = range
    int32 = int64 = None
    load = staticmethod(_gl_load)


class GlArray(np.ndarray):
    """A register tensor of the rendered softmax: a NumPy array with Gluon's ``.to`` (a cast)."""
    def to(self, dtype):
        return self.astype(dtype).view(GlArray)


def _gl_array(x):
    return x.view(GlArray) if isinstance(x, np.ndarray) else x


class GlNumpyTensors(_GlNumpy):
    """``_GlNumpy`` plus the tensor builtins of the forward's ``_softmax`` (reductions along an
    axis, exp2, layouts as no-ops); results stay ``GlArray`` so that ``.to`` works on them."""
    where = staticmethod(lambda c, a, b: _gl_array(np.where(c, a, b)))
    maximum = staticmethod(lambda a, b: _gl_array(np.maximum(a, b)))
    expand_dims = staticmethod(lambda x, axis: _gl_array(np.expand_dims(x, axis)))
    max = staticmethod(lambda x, axis: _gl_array(np.max(x, axis=axis)))
    sum = staticmethod(lambda x, axis: _gl_array(np.sum(x, axis=axis)))
    exp2 = staticmethod(lambda x: _gl_array(np.exp2(x)))
    arange = staticmethod(lambda start, end, layout=None: np.arange(start, end))
    SliceLayout = staticmethod(lambda dim, parent: None)
    convert_layout = staticmethod(lambda x, layout: x)


#: (names, why not) of this Triton's Gluon for Hopper (``gluon.api``), and the Gluon tests' mark
#: for what needs it
GLUON_NAMES, WHY_NO_GLUON = _gluon.api()
needs_gluon_api = pytest.mark.skipif(GLUON_NAMES is None, reason=f"no Gluon for Hopper here: {WHY_NO_GLUON}")


def first_plan(pattern: str, documents: bool = False):
    """The kernel plan of a pattern's first head group; ``documents``: as a call with cu_seqlens
    lowers it."""
    spec = parse(pattern).groups[0].spec
    return lower(spec, **CU_SEQLENS) if documents else lower(spec)


def rendered_helpers(src: str, functions, constants, name: str = "<gluon tiling>", gl=_GlNumpy) -> dict:
    """The named top-level functions and constant assignments of a rendered Gluon source,
    executed as Python over NumPy (``gluon.jit`` a no-op): the schedule the GPU runs, on the CPU.
    ``gl``: the builtins' stand-in (``GlNumpyTensors`` for the softmax's tensor code)."""
    tree = ast.parse(src)
    keep = [n for n in tree.body
            if (isinstance(n, ast.FunctionDef) and n.name in functions)
            or (isinstance(n, ast.Assign) and n.targets[0].id in constants)]
    ns = {"gl": gl, "gluon": type("G", (), {"jit": staticmethod(lambda f: f)})}
    exec(compile(ast.Module(body=keep, type_ignores=[]), name, "exec"), ns)
    return ns
