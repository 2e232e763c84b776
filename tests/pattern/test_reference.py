"""The float64 dense reference and its mask (msa_codegen.pattern.reference): the mask's terms
element by element, and with run-time inputs against independent constructions."""
import random

import pytest
import torch

import msa_codegen as msa
from msa_codegen.pattern.reference import spec_mask

from helpers import _docs, _keep_sorted


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


# ---- the oracle ---------------------------------------------------------------------------

ORACLE_PATTERNS = ["causal", "causal=false", "window=5", "window=4,dilation=3,sink=2", "sink=3",
                   "causal=false,global=2,window=3", "causal=false,window=3,dilation=2,sink=1"]


@pytest.mark.parametrize("pattern", ORACLE_PATTERNS)
def test_mask_cu_seqlens_is_block_diagonal(pattern):
    gen = random.Random(0)
    n = 97
    cu = _docs(n, gen, max_len=30)
    m = msa.mask(pattern, n, 2, cu_seqlens=cu)
    assert m.shape == (1, 2, n, n)
    want = torch.zeros(n, n, dtype=torch.bool)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            want[a:b, a:b] = spec_mask(msa.parse(pattern).groups[0].spec, b - a)
    assert torch.equal(m[0, 0], want) and torch.equal(m[0, 1], want)


@pytest.mark.parametrize("pattern", ORACLE_PATTERNS)
def test_mask_positions_select_rows_and_columns(pattern):
    gen = random.Random(1)
    n = 80
    qp = _keep_sorted(n, 0.3, gen, 2, 2)
    kp = _keep_sorted(n, 0.5, gen, 2, 1)
    m = msa.mask(pattern, None, 2, q_pos=qp, k_pos=kp)
    assert m.shape == (2, 2, qp.shape[-1], kp.shape[-1])
    full = spec_mask(msa.parse(pattern).groups[0].spec, n)
    for b in range(2):
        for h in range(2):
            assert torch.equal(m[b, h], full[qp[b, h].long()][:, kp[b, 0].long()])


def test_mask_buckets_and_topk():
    gen = torch.Generator().manual_seed(3)
    n, blk = 70, 16
    qb = torch.randint(0, 3, (1, 2, n), generator=gen)
    kb = torch.randint(0, 3, (1, 1, n), generator=gen)
    m = msa.mask("window=9", n, 2, q_bucket=qb, k_bucket=kb)
    full = msa.mask("window=9", n, 2)
    assert torch.equal(m[0], full & (qb[0, :, :, None] == kb[0, :, None, :]))
    nb = -(-n // blk)
    idx = torch.randint(-1, nb, (1, 1, nb, 3), generator=gen, dtype=torch.int32)
    m = msa.mask(f"sink=2,topk=3,block={blk}", n, 2, block_indices=idx)
    i = torch.arange(n)
    chosen = torch.zeros(nb, nb, dtype=torch.bool)
    for r in range(nb):
        for c in idx[0, 0, r].tolist():
            if c >= 0:
                chosen[r, c] = True
    want = ((i[None, :] < 2) | chosen[i[:, None] // blk, i[None, :] // blk]) & (i[None, :] <= i[:, None])
    assert torch.equal(m[0, 0], want) and torch.equal(m[0, 1], want)
