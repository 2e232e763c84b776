"""Public API beyond the numbers: argument errors, torch.compile, the kernel cache, tables, mask."""
import os

import pytest
import torch

import msa_codegen as msa
from msa_codegen.kernels import render as codegen
from msa_codegen.sparsity import tables
from msa_codegen.pattern.lowering import lower
from msa_codegen.autograd import attention_fwd_op

from helpers import make_inputs, rel_err


def _qkv(device, b=1, hq=2, hkv=1, n=32, d=32, dtype=torch.float32):
    return [torch.randn(b, h, n, d, device=device, dtype=dtype) for h in (hq, hkv, hkv)]


# ---- bad input: a clear error, never a crash or a silent wrong answer -----------------------

@pytest.mark.parametrize("case,exc,match", [
    ("rank", ValueError, "4 dims"),
    ("batch", ValueError, "batch mismatch"),
    ("length", ValueError, "sequence length mismatch"),
    ("head_dim", ValueError, "head dim mismatch"),
    ("gqa", ValueError, "multiple of key/value heads"),
    ("int_dtype", TypeError, "float16, bfloat16 or float32"),
    ("mixed_dtype", TypeError, "share one dtype"),
    ("kv_shape", ValueError, "k and v must have the same shape"),
    ("small_head_dim", ValueError, "between 16 and 256"),
    ("large_head_dim", ValueError, "between 16 and 256"),
    ("not_tensor", TypeError, "torch.Tensor"),
    ("heads_uncovered", ValueError, "uncovered"),
    ("bad_pattern", msa.PatternError, "window"),
    ("bad_scale", ValueError, "scale"),
])
def test_bad_input(case, exc, match, device):
    q, k, v = _qkv(device)
    kwargs = {}
    pattern = "window=8"
    if case == "rank":
        q = q[0]
    elif case == "batch":
        k, v = _qkv(device, b=2)[1:]
    elif case == "length":
        k, v = _qkv(device, n=31)[1:]
    elif case == "head_dim":
        k, v = _qkv(device, d=64)[1:]
    elif case == "gqa":
        q = _qkv(device, hq=3, hkv=2)[0]
        k, v = _qkv(device, hq=3, hkv=2)[1:]
    elif case == "int_dtype":
        q, k, v = (t.to(torch.int32) for t in (q, k, v))
    elif case == "mixed_dtype":
        k = k.half()
    elif case == "kv_shape":
        v = _qkv(device, hkv=2)[2]
    elif case == "small_head_dim":
        q, k, v = _qkv(device, d=8)
    elif case == "large_head_dim":
        q, k, v = _qkv(device, n=4, d=288)
    elif case == "not_tensor":
        q = q.tolist()
    elif case == "heads_uncovered":
        pattern = "0-0:window=8"
    elif case == "bad_pattern":
        pattern = "window=0"
    elif case == "bad_scale":
        kwargs["scale"] = float("nan")
    with pytest.raises(exc, match=match):
        msa.attention(q, k, v, pattern, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path without a GPU")
def test_cpu_without_interpreter_says_how(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _qkv("cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        msa.attention(q, k, v)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only")
def test_bf16_refused_in_interpreter():
    q, k, v = _qkv("cpu", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="interpreter"):
        msa.attention(q, k, v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs two devices")
def test_tensors_on_different_devices():
    q, k, v = _qkv("cuda")
    with pytest.raises(ValueError, match="one device"):
        msa.attention(q, k.cpu(), v)


# ---- rows that see no key --------------------------------------------------------------------

def test_query_without_visible_key(device, monkeypatch):
    """Zero output, -inf LSE and zero gradients, never NaN (forced through an empty random row)."""
    real = tables.random_block_table_cpu

    def holes(spec, seqlen):
        t = real(spec, seqlen)
        t[1::2] = -1            # every other query block draws nothing
        return t

    monkeypatch.setattr(tables, "random_block_table_cpu", holes)
    tables._random_tables.cache_clear()
    try:
        pattern = "causal=false,random=1,block=16"
        q, k, v, _ = make_inputs(1, 2, 1, 64, 32, torch.float32, device)
        out, lse = msa.attention(q, k, v, pattern, return_lse=True)
        ref, ref_lse = msa.reference_attention(q, k, v, pattern, return_lse=True)
        blind = ~msa.mask(pattern, 64, 2).any(-1)[None]
        assert blind.any()
        assert torch.isneginf(lse[blind.to(lse.device)]).all() and torch.isfinite(lse[~blind.to(lse.device)]).all()
        assert (out[blind.to(out.device)] == 0).all()
        assert rel_err(out, ref) < 1e-4
        dq, dk, dv = torch.autograd.grad(out.sum() + lse[~blind.to(lse.device)].sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
        assert (dq[blind.to(dq.device)] == 0).all()
    finally:
        tables._random_tables.cache_clear()


# ---- torch.compile and the custom op ---------------------------------------------------------

def test_torch_compile_fullgraph(device):
    """attention is a torch.library custom op: a compiled model does not break its graph."""
    q, k, v, _ = make_inputs(1, 2, 1, 40, 32, torch.float32, device)

    def loss(q, k, v):
        return msa.attention(q, k, v, "window=8,sink=2").square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v)
    g = torch.autograd.grad(got, (q, k, v))
    want = loss(q, k, v)
    w = torch.autograd.grad(want, (q, k, v))
    assert torch.allclose(got, want)
    for a, b in zip(g, w):
        assert torch.allclose(a, b)


def test_opcheck(device):
    q, k, v, _ = make_inputs(1, 2, 1, 24, 32, torch.float32, device)
    torch.library.opcheck(attention_fwd_op, (q, k, v, "window=8", 0.2, []),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration",
                                      "test_aot_dispatch_dynamic"))


# ---- the compiler: templates, files on disk ---------------------------------------------------

def test_render_is_generated_and_plan_only():
    plan = lower(msa.parse("window=4096,dilation=2,sink=64").groups[0].spec)
    src = codegen.render(plan, "fwd")
    assert src.startswith("# generated from msa_codegen/templates/fwd.py.jinja")
    assert "WINDOW = tl.constexpr(4096)" in src and "DIL = tl.constexpr(2)" in src
    assert "SINK = tl.constexpr(64)" in src
    compile(src, "fwd", "exec")
    compile(codegen.render(plan, "bwd"), "bwd", "exec")


def test_band_parts_rendered():
    """Which masked W-band loops are told their side of the band (one test there, test_attention's
    test_band_parts checks the results): causal plans only; the forward's lower edge keeps every
    test when prefix columns border it; the dk/dv kernel runs a W band of contiguous rows as one
    loop (SPLIT: the mask only outside the unmasked blocks, every test there) in the pass over
    the heads that follows the masked blocks, and a dilated band's edges among those."""
    def parts(pattern, direction):
        src = codegen.render(lower(msa.parse(pattern).groups[0].spec), direction)
        return [line.split("PART=")[1].rstrip(")") for line in src.splitlines()
                if "PHASE=PH_W" in line and "MASKED=True" in line]
    assert parts("window=4096", "fwd") == ["PART_EDGE", "PART_DIAG"]
    assert parts("window=4096,sink=64", "fwd") == ["PART_ANY", "PART_DIAG"]
    assert parts("causal=false,window=512", "fwd") == ["PART_ANY", "PART_ANY"]
    # dq's loops, then the dk/dv kernel's: one loop over a band of contiguous rows; a dilated
    # band's lower (diagonal) and upper (far edge) blocks, its inside in the second pass
    assert parts("causal", "bwd") == ["PART_EDGE", "PART_DIAG", "PART_ANY"]
    assert parts("window=4096,dilation=2", "bwd") == ["PART_EDGE", "PART_DIAG", "PART_DIAG", "PART_EDGE"]

    def dkdv(pattern):
        src = codegen.render(lower(msa.parse(pattern).groups[0].spec), "bwd")
        return src[src.index("def msa_bwd_dkdv"):]
    for pattern, passes in (("window=4096", 1), ("window=4096,sink=64", 2)):
        body = dkdv(pattern)
        w = [line for line in body.splitlines() if "PHASE=PH_W" in line]
        assert len(w) == 1 and "MASKED=True, SPLIT=True" in w[0] and ", 0, n_blk, N, qk_scale, 0, 0, k_lo, k_hi," in w[0]
        assert body.count("for i_h in range(") == passes
        assert body.rindex("for i_h in range(") < body.index("PHASE=PH_W")
        assert body.count("SPLIT=True") == 1   # the prefix tiles' P^T band keeps its three loops
    body = dkdv("window=4096,dilation=2")
    assert "SPLIT=True" not in body and body.count("for i_h in range(") == 2
    assert body.index("MASKED=True, SPLIT=False, PHASE=PH_W") < body.rindex("for i_h in range(") < \
        body.index("MASKED=False, SPLIT=False, PHASE=PH_W")


def test_plan_admits_only_ints_and_bools():
    plan = lower(msa.parse("causal=false,global=3,random=2,seed=5,block=64").groups[0].spec)
    assert all(type(v) in (int, bool) for v in plan.as_dict().values())


def test_kernel_file_written_once_and_repaired(tmp_path, monkeypatch):
    monkeypatch.setenv("MSA_CODEGEN_HOME", str(tmp_path))
    plan = lower(msa.parse("window=33,dilation=3").groups[0].spec)
    path = codegen.kernel_file(plan, "fwd")
    assert path.parent == tmp_path / "kernels"
    text = path.read_text()
    mtime = path.stat().st_mtime_ns
    assert codegen.kernel_file(plan, "fwd") == path and path.stat().st_mtime_ns == mtime   # not rewritten
    for damage in (text[: len(text) // 2], text.replace("WINDOW", "WINDOX"), "", "\x00garbage"):
        path.write_text(damage)
        assert codegen.kernel_file(plan, "fwd") == path
        assert path.read_text() == text
    assert not list(path.parent.glob("*.tmp"))


def test_distinct_plans_distinct_files(tmp_path, monkeypatch):
    monkeypatch.setenv("MSA_CODEGEN_HOME", str(tmp_path))
    a = codegen.kernel_file(lower(msa.parse("window=8").groups[0].spec), "fwd")
    b = codegen.kernel_file(lower(msa.parse("window=9").groups[0].spec), "fwd")
    c = codegen.kernel_file(lower(msa.parse("window=8").groups[0].spec), "bwd")
    assert len({a, b, c}) == 3


def test_changing_length_reuses_the_kernel(device):
    """Lengths are not specialised: a new N does not compile or load another kernel."""
    q, k, v = _qkv(device, n=50)
    msa.attention(q, k, v, "window=5,sink=2")
    before = codegen.loaded_modules()
    for n in (17, 64, 99):
        q, k, v = _qkv(device, n=n)
        msa.attention(q, k, v, "window=5,sink=2")
    assert codegen.loaded_modules() == before


# ---- tables and the dense mask ----------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_random_table(causal):
    spec = msa.parse(("" if causal else "causal=false,") + "random=3,seed=5,block=16").groups[0].spec
    t = tables.random_block_table_cpu(spec, 16 * 40 + 3)
    assert t.shape == (41, 3) and t.dtype == torch.int32
    assert torch.equal(t, tables.random_block_table_cpu(spec, 16 * 40 + 3))    # reproducible
    for qb, row in enumerate(t.tolist()):
        used = [x for x in row if x >= 0]
        assert len(set(used)) == len(used)
        limit = qb + 1 if causal else 41
        assert all(0 <= x < limit for x in used)
        assert len(used) == min(3, limit)
    other = msa.parse(("" if causal else "causal=false,") + "random=3,seed=6,block=16").groups[0].spec
    assert not torch.equal(t, tables.random_block_table_cpu(other, 16 * 40 + 3))


def test_mask_docstring_example():
    want = torch.tensor([[1, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                         [0, 1, 0, 1, 0, 0], [0, 0, 1, 0, 1, 0], [0, 0, 0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(msa.mask("window=2,dilation=2", 6)[0], want)


def test_mask_terms_elementwise():
    n = 40
    m = msa.mask("causal=false,global=3,sink=5,window=4,dilation=3", n)[0]
    for i in range(n):
        for j in range(n):
            d = abs(i - j)
            want = (d % 3 == 0 and d // 3 < 4) or j < 5 or i < 3 or j < 3
            assert bool(m[i, j]) == want, (i, j)
    c = msa.mask("window=4,sink=2", n)[0]
    assert not c.triu(1).any()
    g = msa.mask("0-1:window=2;2-2:causal", n, 3)
    assert torch.equal(g[2], torch.ones(n, n, dtype=torch.bool).tril())
    assert torch.equal(g[0], g[1])
