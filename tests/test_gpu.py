"""GPU tests (marker gpu): bf16 and fp16 at lengths up to 32k and the README example at 128k.

The oracle is `chunked_reference` in float64 on the GPU; the bound is the larger of the dtype's
floor and twice the error of PyTorch's own computation in the same dtype.
"""
import pytest
import torch

import msa_codegen as msa

from helpers import FLOOR, chunked_reference, make_inputs, rel_err, spy_scratch

pytestmark = pytest.mark.gpu

CASES = [
    # pattern, N, D, dtype, Hq, Hkv
    ("causal", 4099, 128, torch.bfloat16, 8, 2),
    ("causal=false", 2047, 64, torch.float16, 4, 1),
    ("window=1024,dilation=2,sink=64", 32768, 128, torch.bfloat16, 8, 2),
    ("window=512,dilation=4", 16385, 64, torch.float16, 8, 2),
    ("window=300,sink=64", 32767, 64, torch.bfloat16, 8, 2),
    ("causal=false,window=512", 16384, 128, torch.bfloat16, 8, 2),
    ("causal=false,window=200,dilation=3", 9001, 128, torch.float16, 4, 4),
    ("causal=false,global=128,window=256,dilation=2", 8192, 128, torch.float16, 8, 2),
    ("causal=false,global=77,sink=5", 5000, 64, torch.bfloat16, 4, 1),
    ("window=256,random=4,block=128,seed=3", 16384, 128, torch.bfloat16, 8, 2),
    ("causal=false,random=4,block=64", 8192, 64, torch.float16, 8, 2),
    ("0-3:window=512;4-7:causal=false,window=1024,dilation=8", 16384, 128, torch.bfloat16, 8, 2),
    ("0-2:window=64,sink=16;3-7:causal", 6000, 64, torch.float16, 8, 2),
    ("window=4096,dilation=2,sink=64", 8192, 128, torch.bfloat16, 16, 4),
    ("window=4096", 32768, 128, torch.float16, 8, 2),
    ("window=2048,dilation=2", 32768, 80, torch.bfloat16, 4, 1),
    ("window=256,dilation=2,sink=16", 4096, 256, torch.bfloat16, 4, 1),
    ("causal=false,window=300,global=20", 3001, 192, torch.float16, 4, 2),
    ("window=1000", 8192, 96, torch.bfloat16, 8, 8),
]


def _check(pattern, n, d, dtype, hq, hkv, b=1):
    q, k, v, seed = make_inputs(b, hq, hkv, n, d, dtype, "cuda")
    out, lse = msa.attention(q, k, v, pattern, return_lse=True)
    do = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    ref = chunked_reference(q, k, v, pattern, do)
    low = chunked_reference(q, k, v, pattern, do, compute_dtype=dtype)
    names = ("out", "dq", "dk", "dv")
    ours = dict(zip(names, (out, dq, dk, dv)))
    refs = dict(zip(names, (ref[0], ref[2], ref[3], ref[4])))
    lows = dict(zip(names, (low[0], low[2], low[3], low[4])))
    errs = {x: rel_err(ours[x], refs[x]) for x in names}
    base = {x: rel_err(lows[x], refs[x]) for x in names}
    for x in names:
        bound = max(FLOOR[dtype], 2 * base[x])
        assert errs[x] <= bound, f"{x}: {errs[x]:.2e} > {bound:.2e} ({pattern}, N={n}, seed {seed}; ours {errs}, torch {base})"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref[1]))
    fin = torch.isfinite(ref[1])
    assert (lse[fin].double() - ref[1][fin]).abs().max().item() < 0.05
    return errs, base


@pytest.mark.parametrize("pattern,n,d,dtype,hq,hkv", CASES,
                         ids=[f"{c[0]}-N{c[1]}-D{c[2]}-{str(c[3])[6:]}-{c[4]}x{c[5]}" for c in CASES])
def test_gpu_pattern(pattern, n, d, dtype, hq, hkv):
    _check(pattern, n, d, dtype, hq, hkv)


def test_gpu_bnhd_layout():
    q, k, v, _ = make_inputs(2, 8, 2, 3000, 128, torch.bfloat16, "cuda", layout="bnhd")
    out = msa.attention(q, k, v, "window=256,dilation=2,sink=16")
    assert out.stride() == q.stride()
    ref = msa.reference_attention(q, k, v, "window=256,dilation=2,sink=16")
    assert rel_err(out, ref) < 1e-2


def test_readme_example():
    """The issue's example: B=1, 16/4 heads, N=131072, D=128, bf16, window=4096,dilation=2,sink=64."""
    _check("window=4096,dilation=2,sink=64", 131072, 128, torch.bfloat16, 16, 4)


FLEX_CASES = [
    ("window=4096", 8192, 16, 16, 128),
    ("window=4096,dilation=2", 8192, 16, 16, 128),
    ("window=4096,dilation=4", 8192, 16, 16, 128),
    ("window=4096,sink=64", 8192, 16, 16, 128),
    ("causal=false,window=512", 8192, 16, 16, 128),
    ("window=4096", 8192, 32, 8, 128),
    ("window=4096", 8192, 32, 32, 64),
]


@pytest.mark.parametrize("pattern,n,hq,hkv,d", FLEX_CASES,
                         ids=[f"{c[0]}-N{c[1]}-{c[2]}x{c[3]}-D{c[4]}" for c in FLEX_CASES])
def test_gpu_matches_flex_attention(pattern, n, hq, hkv, d):
    """FlexAttention with the same mask as a second oracle, at the benchmark shapes (shorter N)."""
    flex_mod = pytest.importorskip("torch.nn.attention.flex_attention")
    from msa_codegen.bench import _mask_mod

    q, k, v, seed = make_inputs(1, hq, hkv, n, d, torch.bfloat16, "cuda")
    spec = msa.parse(pattern).groups[0].spec
    bm = flex_mod.create_block_mask(_mask_mod(spec), None, None, n, n, device="cuda", _compile=True)
    flex = torch.compile(flex_mod.flex_attention, dynamic=False)
    ref = flex(q, k, v, block_mask=bm, enable_gqa=hq != hkv)
    out = msa.attention(q, k, v, pattern)
    do = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), do)
    rg = torch.autograd.grad(ref, (q, k, v), do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *g), (ref, *rg)):
        err = rel_err(a, b)
        assert err < 2e-2, f"{name}: {err:.2e} against FlexAttention ({pattern}, seed {seed})"


@pytest.mark.parametrize("d", [64, 128])
def test_gpu_pointer_loads_at_the_default_config(d):
    """A layout TMA cannot address (k and v 2 bytes off a 16-byte boundary) takes the pointer
    loads with the same default launch config as the descriptor path: it must fit the GPU and
    stay correct."""
    from msa_codegen.kernels import tma as tma_policy

    q, _, _, _ = make_inputs(1, 8, 2, 8192, d, torch.bfloat16, "cuda")

    def off():
        return torch.randn(2 * 8192 * d + 1, device="cuda").to(torch.bfloat16)[1:].view(1, 2, 8192, d).requires_grad_()
    k, v = off(), off()
    assert not tma_policy.use_tma(k, v)
    out = msa.attention(q, k, v, "window=1024,sink=16")
    ref = chunked_reference(q, k, v, "window=1024,sink=16", torch.randn_like(out))[0]
    assert rel_err(out, ref) <= FLOOR[torch.bfloat16]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_inputs_on_a_device_other_than_the_current_one():
    """Triton launches on the current device: the launchers switch to the inputs' device."""
    with torch.cuda.device(0):
        q, k, v, _ = make_inputs(1, 4, 2, 2048, 128, torch.bfloat16, "cuda:1")
        out = msa.attention(q, k, v, "window=256,sink=8")
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        assert out.device == dq.device == torch.device("cuda:1")
    do = torch.randn_like(out)
    ref = chunked_reference(q, k, v, "window=256,sink=8", do)
    assert rel_err(out, ref[0]) <= FLOOR[torch.bfloat16]



SCRATCH_CASES = [
    # pattern, N, D, dtype, Hq, Hkv: the backward with the band's dS through scratch
    ("window=4096", 16384, 128, torch.bfloat16, 8, 8),
    ("window=1024,dilation=2,sink=64", 16385, 128, torch.bfloat16, 8, 2),
    ("causal=false,window=512", 8192, 64, torch.float16, 4, 1),
    ("window=256,dilation=2,sink=16", 4096, 256, torch.bfloat16, 4, 1),
]


@pytest.mark.parametrize("pattern,n,d,dtype,hq,hkv", SCRATCH_CASES,
                         ids=[f"{c[0]}-N{c[1]}-D{c[2]}-{str(c[3])[6:]}-{c[4]}x{c[5]}" for c in SCRATCH_CASES])
def test_gpu_scratch_backward(pattern, n, d, dtype, hq, hkv, monkeypatch):
    """MSA_BWD_SCRATCH_BYTES: the dk/dv kernel stores the band's dS tiles through TMA and dq
    reads them, all heads in one chunk, then in chunks of half the KV heads: against the fp64
    reference, as the recomputing backward."""
    monkeypatch.setenv("MSA_BWD_SCRATCH_BYTES", str(1 << 40))
    seen = spy_scratch(monkeypatch)
    _check(pattern, n, d, dtype, hq, hkv)
    per_head = seen[-1][1]
    heads = (hq // hkv) * max(1, hkv // 2)
    monkeypatch.setenv("MSA_BWD_SCRATCH_BYTES", str(heads * per_head * 2))
    _check(pattern, n, d, dtype, hq, hkv)
    assert seen[-1][2] == heads
