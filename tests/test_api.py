"""The public API beyond the numbers (msa_codegen.api, msa_codegen.autograd): argument errors,
rows that see no key, torch.compile and the custom op."""
import pytest
import torch

import msa_codegen as msa
from msa_codegen.autograd import attention_fwd_op
from msa_codegen.sparsity import tables

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
    ("flag_string", TypeError, "deterministic must be True or False or None, got 'false'"),
    ("flag_int", TypeError, "return_lse must be True or False, got 1"),
    ("flag_autotune", TypeError, "autotune must be True or False, got 'no'"),
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
    elif case == "flag_string":
        # bool("false") is True: a string flag was once taken as deterministic=True
        kwargs["deterministic"] = "false"
    elif case == "flag_int":
        kwargs["return_lse"] = 1
    elif case == "flag_autotune":
        # autotune="no" used to start the tuner and write rows to the user's database
        kwargs["autotune"] = "no"
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
    tables.clear_cache()
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
        tables.clear_cache()


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


def test_readme_documents_every_public_name():
    """Each name in msa_codegen.__all__ appears in the README's text as code (`...name...`), so a
    new public name comes with its documentation (FwdConfig, BwdConfig, Spec and __version__ were
    exported without any until 2026-12-06)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    spans = re.findall(r"`([^`\n]+)`", readme)
    missing = [name for name in msa.__all__ if not any(re.search(rf"\b{re.escape(name)}\b", s) for s in spans)]
    assert not missing, f"public names the README never mentions as code: {missing}"
