"""GPU tests (marker gpu) of the run-time sparsity inputs (issue 5) at larger sizes, fp16/bf16.

The oracle is the dense fp64 ``reference_attention`` with the same inputs (so N stays <= 8192
with a few heads: its N x N tensors are a few GiB); the bound is the larger of the dtype's floor
and twice PyTorch's own same-dtype error (``check_dynamic`` in test_dynamic.py).
"""
import pytest
import torch

import msa_codegen as msa
from msa_codegen.pattern.reference import relative_error

from test_dynamic import bucket_inputs, check_dynamic, docs_inputs, pos_inputs, with_topk

pytestmark = pytest.mark.gpu


def _selected(topk, block, make=None):
    """block_indices from select_blocks on fresh inputs (MoBA gating), plus ``make``'s inputs."""
    def sel(b, hq, hkv, nq, nk, gen):
        out = make(b, hq, hkv, nq, nk, gen) if make else {}
        g = torch.Generator().manual_seed(gen.randrange(2**31))
        out["block_indices"] = msa.select_blocks(torch.randn(b, hq, nq, 64, generator=g),
                                                 torch.randn(b, hkv, nk, 64, generator=g), topk, block=block)
        return out
    return sel


CASES = [
    # id, pattern, inputs, (B, Hq, Hkv, Nq, Nk, D, dtype)
    ("docs-window", "window=512", docs_inputs(2048), (1, 8, 2, 8192, None, 128, torch.bfloat16)),
    ("docs-dil-sink", "window=256,dilation=2,sink=16", docs_inputs(3000), (1, 4, 1, 8192, None, 64, torch.bfloat16)),
    ("docs-causal", "causal", docs_inputs(1000), (1, 4, 2, 4099, None, 128, torch.float16)),
    ("docs-bidir-global", "causal=false,global=16,window=128", docs_inputs(700), (1, 4, 2, 4096, None, 128, torch.bfloat16)),
    ("docs-random", "window=64,random=2,block=128", docs_inputs(900), (1, 4, 2, 4096, None, 64, torch.bfloat16)),
    ("docs-topk", "window=128,topk=4,block=128", with_topk("window=128,topk=4,block=128", docs_inputs(1500)),
     (1, 4, 2, 6000, None, 128, torch.bfloat16)),
    ("pos-window-sink", "window=512,sink=32", pos_inputs(span=8192), (1, 4, 2, 6000, 5000, 128, torch.bfloat16)),
    ("pos-causal", "causal", pos_inputs(span=8192), (2, 4, 2, 5734, 5734, 64, torch.bfloat16)),
    ("pos-bidir-dil", "causal=false,window=300,dilation=3", pos_inputs(span=8192), (1, 4, 4, 4000, 4500, 64, torch.float16)),
    ("buckets-causal", "causal", bucket_inputs(8, with_pos=True), (1, 4, 4, 8192, None, 64, torch.bfloat16)),
    ("buckets-window", "window=1024,sink=8", bucket_inputs(8, with_pos=True), (1, 4, 2, 8192, None, 128, torch.bfloat16)),
    ("buckets-only", "causal=false", bucket_inputs(4), (1, 4, 2, 4096, None, 128, torch.float16)),
    ("topk-select", "topk=8,block=128", _selected(8, 128), (1, 8, 2, 8192, None, 128, torch.bfloat16)),
    ("topk-window-sink", "window=256,sink=16,topk=4,block=64", _selected(4, 64), (2, 4, 2, 8000, None, 128, torch.bfloat16)),
    ("topk-random-bidir", "causal=false,window=64,random=2,topk=3,block=128",
     with_topk("causal=false,window=64,random=2,topk=3,block=128", None), (1, 4, 1, 4096, None, 64, torch.float16)),
]


@pytest.mark.parametrize("pattern,make,shape", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_gpu_dynamic(pattern, make, shape):
    b, hq, hkv, nq, nk, d, dtype = shape
    check_dynamic(pattern, b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, dtype=dtype, device="cuda", make=make)


def test_gpu_hash_sparse_three_lines():
    """SCFA's Hash-sparse attention with hash_sort, compared in the original order."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8192, 64, generator=gen).to("cuda", torch.bfloat16).requires_grad_() for _ in range(3))
    qs, qp, qb, q_inv = msa.hash_sort(q, 8, seed=1)
    ks, kp, kb, _ = msa.hash_sort(k, 8, seed=1)
    vs = v.gather(2, kp.long()[..., None].expand_as(v))
    o = msa.attention(qs, ks, vs, "causal", q_pos=qp, k_pos=kp, q_bucket=qb, k_bucket=kb)
    o = o.gather(2, q_inv[..., None].expand_as(o))
    qb0 = qb.gather(2, q_inv)
    kb0 = kb.gather(2, torch.argsort(kp.long(), dim=-1))
    ref = msa.reference_attention(q, k, v, "causal", q_bucket=qb0, k_bucket=kb0)
    assert relative_error(o, ref) < 2e-2
