"""Run-time sparsity inputs (msa_codegen.sparsity.inputs; issue 5): cu_seqlens, q_pos/k_pos,
q_bucket/k_bucket, topk + block_indices, and hash_sort (sparsity.selection; select_blocks has
test_selection.py).

The kernels (Triton's interpreter on the CPU) are checked against the oracle: output, LSE, dq,
dk, dv; the cases marked ``gpu`` run larger shapes in fp16/bf16, against the dense fp64
``reference_attention`` with the same inputs (so N stays <= 8192 with a few heads: its N x N
tensors are a few GiB), the bound the larger of the dtype's floor and twice PyTorch's own
same-dtype error (``helpers.check_dynamic``).
"""

import unittest.mock

import pytest
import torch

import msa_codegen as msa
from msa_codegen.config import BwdConfig, FwdConfig, LaunchConfig, use_config
from msa_codegen.kernels import launch as launch_mod
from msa_codegen.kernels import tma as tma_mod
from msa_codegen.pattern.reference import relative_error

from helpers import bucket_inputs, check_dynamic, run_sm90_script, docs_inputs, pos_inputs, rel_err, topk_inputs, with_topk


def test_spec_topk_terms():
    s = msa.parse("block=64,topk=8,window=4").groups[0].spec
    assert s.topk == 8 and s.block == 64 and not s.dense
    assert str(msa.parse("block=64,topk=8,window=4")) == "window=4,topk=8,block=64"
    assert str(msa.parse("random=2,seed=3,topk=4,block=32")) == "random=2,seed=3,topk=4,block=32"
    assert str(msa.parse("topk=2,block=128")) == "topk=2"
    for bad, frag in [("topk=0", "topk"), ("topk=-1", "topk"), ("topk", "needs a value"),
                      ("block=64", "random or topk")]:
        with pytest.raises(msa.PatternError, match=frag):
            msa.parse(bad)


def test_hash_sort_roundtrip():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 50, 16, generator=gen)
    xs, pos, bkt, inv = msa.hash_sort(x, 6, seed=4)
    assert xs.shape == x.shape and pos.dtype == torch.int32 and bkt.dtype == torch.int32
    assert (bkt[..., 1:] >= bkt[..., :-1]).all() and int(bkt.max()) < 6
    same = bkt[..., 1:] == bkt[..., :-1]
    assert (pos[..., 1:] > pos[..., :-1])[same].all()
    assert torch.equal(xs.gather(2, inv[..., None].expand_as(xs)), x)
    assert torch.equal(x.gather(2, pos.long()[..., None].expand_as(x)), xs)
    _, _, bkt2, _ = msa.hash_sort(x, 6, seed=4)
    assert torch.equal(bkt, bkt2)
    with pytest.raises(ValueError, match="even"):
        msa.hash_sort(x, 5)


TOPK_PATTERNS = [
    "topk=3,block=16",
    "causal=false,topk=2,block=32",
    "window=9,topk=3,block=16",
    "window=6,dilation=3,sink=5,topk=2,block=16",
    "causal=false,window=5,dilation=2,global=4,topk=3,block=32",
    "random=2,seed=3,topk=3,block=16",
    "0-0:window=7;1-1:sink=3,topk=2,block=16",
]


@pytest.mark.parametrize("pattern", TOPK_PATTERNS)
def test_topk_fp32(pattern, device):
    check_dynamic(pattern, b=2, hq=2, hkv=1, nq=113, device=device, make=topk_inputs(pattern))


def test_topk_fp16_gqa_select_blocks(device):
    def make(b, hq, hkv, nq, nk, gen):
        g = torch.Generator().manual_seed(gen.randrange(1000))
        return {"block_indices": msa.select_blocks(torch.randn(b, hq, nq, 64, generator=g),
                                                   torch.randn(b, hkv, nk, 64, generator=g), 3, block=32)}
    check_dynamic("window=8,dilation=2,topk=3,block=32", b=1, hq=4, hkv=2, nq=200, d=64,
                  dtype=torch.float16, device=device, make=make)



def _unmasked_mix(pattern):
    """block_indices that give every query block both kinds of key block: far left ones (the
    unmasked path when the tile lies in one query block), the diagonal block, its left
    neighbour (inside a window band), block 0 (sink / global columns), a block right of the
    diagonal (direction), -1 slots and a repeated id; the two batches differ."""
    def make(b, hq, hkv, nq, nk, gen):
        spec = msa.parse(pattern).groups[0].spec
        nqb, nkb = -(-nq // spec.block), -(-nk // spec.block)
        rows = []
        for qb in range(nqb):
            far = [gen.randrange(0, max(qb - 1, 1)), gen.randrange(0, max(qb - 1, 1))]
            row = [far[0], qb, max(qb - 1, 0), 0, min(qb + 1, nkb - 1), -1, far[1], far[0]]
            rows.append(row[:spec.topk])
        one = torch.tensor(rows, dtype=torch.int32)
        idx = torch.stack([one.roll(s_, dims=1) for s_ in range(b)])[:, None].expand(b, hkv, nqb, spec.topk)
        return {"block_indices": idx.contiguous()}
    return make


@pytest.mark.parametrize("pattern,n,cfg", [
    # block 64, query tiles of 32 rows (dk/dv: 32-row query blocks, 32-key tiles)
    ("window=40,sink=4,topk=8,block=64", 520,
     LaunchConfig(FwdConfig(32, 32, 4, 1), BwdConfig(32, 32, 4, 1, 32, 64, 4, 1))),
    ("causal=false,window=20,dilation=2,global=3,topk=7,block=64", 450,
     LaunchConfig(FwdConfig(32, 64, 4, 1), BwdConfig(16, 32, 4, 1, 32, 32, 4, 1))),
    # block 128: tiles of 64 and 32 rows; a dilated band (dk/dv key tiles of 2 x 32 positions)
    ("window=100,dilation=2,topk=6,block=128", 700,
     LaunchConfig(FwdConfig(64, 64, 4, 1), BwdConfig(32, 32, 4, 1, 64, 32, 4, 1))),
    ("topk=5,block=128", 600,
     LaunchConfig(FwdConfig(32, 128, 4, 1), BwdConfig(64, 64, 4, 1, 32, 64, 4, 1))),
    # tiles larger than the block: every block masked (the fallback)
    ("window=12,topk=4,block=16", 200,
     LaunchConfig(FwdConfig(32, 32, 4, 1), BwdConfig(32, 32, 4, 1, 32, 32, 4, 1))),
], ids=["sink-window-b64-bm32", "bidir-dil-global-b64", "dil-b128-bm64", "topk-only-b128", "b16-bm32-all-masked"])
def test_topk_unmasked_and_masked_blocks(pattern, n, cfg, device):
    """Top-k tables mixing blocks that run without a mask (left of the query block, past the
    prefix and the window band) with the diagonal block, band and sink blocks and -1 slots, in
    one call: out, LSE, dq, dk, dv against the float64 reference."""
    with use_config(cfg):
        check_dynamic(pattern, b=2, hq=2, hkv=1, nq=n, device=device, make=_unmasked_mix(pattern))


@pytest.mark.parametrize("pattern,n", [("window=16,random=3,seed=1,block=64", 400),
                                       ("causal=false,sink=5,window=10,random=2,seed=4,block=64", 330)],
                         ids=["random-causal", "random-bidir-sink"])
def test_random_unmasked_and_masked_blocks(pattern, n, device):
    """Random blocks take the same two paths as top-k blocks."""
    with use_config(LaunchConfig(FwdConfig(32, 32, 4, 1), BwdConfig(32, 32, 4, 1, 32, 64, 4, 1))):
        check_dynamic(pattern, b=1, hq=2, hkv=1, nq=n, device=device)


def test_fp16_topk_unmasked_blocks(device):
    with use_config(LaunchConfig(FwdConfig(32, 32, 4, 1), BwdConfig(32, 32, 4, 1, 32, 64, 4, 1))):
        check_dynamic("window=40,sink=4,topk=8,block=64", b=1, hq=2, hkv=1, nq=330, d=64, dtype=torch.float16,
                      device=device, make=_unmasked_mix("window=40,sink=4,topk=8,block=64"))


DOC_PATTERNS = [
    "causal",
    "causal=false",
    "window=7",
    "window=5,dilation=3",
    "sink=3",
    "window=6,dilation=2,sink=4",
    "causal=false,window=5,dilation=2",
    "causal=false,global=3,window=4",
    "causal=false,global=2,sink=5,window=3,dilation=2",
    "window=4,random=2,block=16",
    "window=5,topk=2,block=16",
]


@pytest.mark.parametrize("pattern", DOC_PATTERNS)
def test_cu_seqlens_fp32(pattern, device):
    check_dynamic(pattern, b=1, hq=2, hkv=1, nq=150, device=device, make=with_topk(pattern, docs_inputs(50)))


POS_PATTERNS = [
    "causal",
    "causal=false",
    "window=9",
    "window=6,dilation=3",
    "sink=4",
    "window=8,dilation=2,sink=5",
    "causal=false,window=6,dilation=2",
    "causal=false,global=4,window=5",
    "window=5,topk=2,block=16",
]


@pytest.mark.parametrize("pattern", POS_PATTERNS)
def test_positions_fp32(pattern, device):
    check_dynamic(pattern, b=2, hq=2, hkv=1, nq=90, nk=130, device=device, make=with_topk(pattern, pos_inputs()))


def test_positions_broadcast_1d_fp16(device):
    check_dynamic("window=24,dilation=2,sink=3", b=1, hq=4, hkv=2, nq=140, nk=100, d=64, dtype=torch.float16,
                  device=device, make=pos_inputs(shape="n"))


BUCKET_PATTERNS = ["causal", "causal=false", "window=20", "window=12,dilation=2,sink=3",
                   "causal=false,global=3,window=7", "sink=2,topk=2,block=16"]


@pytest.mark.parametrize("pattern", BUCKET_PATTERNS)
def test_buckets_with_positions_fp32(pattern, device):
    def make(b, hq, hkv, nq, nk, gen):
        out = bucket_inputs(3, with_pos=True)(b, hq, hkv, nq, nk, gen)
        if "topk" in pattern:
            out.update(topk_inputs(pattern)(b, hq, hkv, nq, nk, gen))
        return out
    check_dynamic(pattern, b=1, hq=2, hkv=1, nq=120, device=device, make=make)


def test_buckets_alone_fp32(device):
    check_dynamic("window=30", b=2, hq=2, hkv=2, nq=100, device=device, make=bucket_inputs(4))


def test_hash_sparse_three_lines_fp16(device):
    """SCFA's Hash-sparse attention through hash_sort, checked in the original order."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 150, 32, generator=gen).to(device=device, dtype=torch.float16).requires_grad_()
    k = torch.randn(1, 2, 150, 32, generator=gen).to(device=device, dtype=torch.float16).requires_grad_()
    v = torch.randn(1, 2, 150, 32, generator=gen).to(device=device, dtype=torch.float16).requires_grad_()
    qs, qp, qb, q_inv = msa.hash_sort(q, 4, seed=1)
    ks, kp, kb, _ = msa.hash_sort(k, 4, seed=1)
    vs = v.gather(2, kp.long()[..., None].expand_as(v))
    o = msa.attention(qs, ks, vs, "causal", q_pos=qp, k_pos=kp, q_bucket=qb, k_bucket=kb)
    o = o.gather(2, q_inv[..., None].expand_as(o))
    # oracle in the original order: buckets unsorted, positions = rows
    qb0 = qb.gather(2, q_inv.to(torch.int64))
    kb0 = kb.gather(2, torch.argsort(kp.long(), dim=-1))
    ref = msa.reference_attention(q, k, v, "causal", q_bucket=qb0, k_bucket=kb0)
    assert rel_err(o, ref) < 2e-3
    g = torch.autograd.grad(o.float().square().sum(), (q, k, v))
    rg = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b_ in zip(g, rg):
        assert rel_err(a, b_) < 5e-3


SMALL_TILES = [
    LaunchConfig(FwdConfig(16, 32, 4, 1), BwdConfig(16, 32, 4, 1, 32, 16, 4, 1)),
    LaunchConfig(FwdConfig(32, 16, 4, 1), BwdConfig(32, 16, 4, 1, 16, 32, 4, 1)),
]


def _kind_inputs(kind, pattern):
    """The run-time inputs of ``kind`` (documents of 60 rows, positions, 3 buckets with
    positions), with top-k block indices when the pattern has ``topk``: a ``make`` for check_dynamic."""
    def make(b, hq, hkv, nq, nk, gen):
        out = {"docs": docs_inputs(60), "pos": pos_inputs(), "buckets": bucket_inputs(3, True)}[kind](
            b, hq, hkv, nq, nk, gen)
        if "topk" in pattern:
            out.update(topk_inputs(pattern)(b, hq, hkv, nq, nk, gen))
        return out
    return make


@pytest.mark.parametrize("kind,pattern,cfg", [
    ("docs", "window=10,dilation=2,sink=3", SMALL_TILES[0]),
    ("docs", "causal=false,global=4,window=6,random=2,block=16", SMALL_TILES[1]),
    ("pos", "window=12,sink=5", SMALL_TILES[1]),
    ("pos", "causal=false,window=9,dilation=3", SMALL_TILES[0]),
    ("buckets", "window=15,dilation=2,sink=2", SMALL_TILES[0]),
    ("buckets", "causal=false,sink=3,topk=2,block=16", SMALL_TILES[1]),
], ids=["docs-bm16", "docs-global-random-bm32", "pos-bm32", "pos-bidir-dil-bm16", "buckets-bm16", "buckets-topk-bm32"])
def test_many_tiles(kind, pattern, cfg, device):
    """Small tiles: many tiles, each with its own binary-searched key / query range."""
    with use_config(cfg):
        check_dynamic(pattern, b=1, hq=2, hkv=1, nq=230, device=device, make=_kind_inputs(kind, pattern))


@pytest.mark.parametrize("pattern", ["window=10,dilation=2,sink=3", "causal=false,global=4,window=6,random=2,block=16",
                                     "window=8,topk=2,block=16"])
def test_one_document_runs_the_plain_kernels(pattern, device):
    """cu_seqlens = [0, N] is the plain pattern's mask: the call checks it as any cu_seqlens and
    runs the plain (not positional) plan, matching the float64 reference of the documents'
    contract; a bad two-offset cu_seqlens still raises."""
    from msa_codegen import api as api_mod

    seen = []
    real = api_mod.plan_for

    def spy(*args):
        seen.append(args[7:10])   # positional, segments, classes
        return real(*args)

    def one_doc(b, hq, hkv, nq, nk, gen):
        return {"cu_seqlens": torch.tensor([0, nq], dtype=torch.int32)}
    with unittest.mock.patch.object(api_mod, "plan_for", spy):
        check_dynamic(pattern, b=1, hq=2, hkv=1, nq=150, device=device, make=with_topk(pattern, one_doc))
    assert seen and all(flags == (False, False, False) for flags in seen), seen
    q = torch.randn(1, 2, 20, 32, device=device)
    with pytest.raises(ValueError, match="end at N=20"):
        msa.attention(q, q, q, pattern.split(",topk")[0], cu_seqlens=torch.tensor([0, 19], dtype=torch.int32, device=device))


def test_length_one_documents_and_empty_rows(device):
    """Every document of length 1, and a pattern under which some rows see nothing (zero, -inf)."""
    def make(b, hq, hkv, nq, nk, gen):
        return {"cu_seqlens": torch.arange(nq + 1, dtype=torch.int32)}
    check_dynamic("window=3", nq=40, device=device, make=make)
    # rows whose window and sink miss every kept key: zero output, -inf LSE, zero grads
    q = torch.randn(1, 1, 4, 32, device=device, requires_grad=True)
    k = torch.randn(1, 1, 3, 32, device=device, requires_grad=True)
    v = torch.randn(1, 1, 3, 32, device=device, requires_grad=True)
    qp = torch.tensor([0, 50, 51, 100], device=device)
    kp = torch.tensor([10, 49, 99], device=device)
    out, lse = msa.attention(q, k, v, "window=2,causal=false", q_pos=qp, k_pos=kp, return_lse=True)
    empty = torch.tensor([True, False, True, False], device=device)   # 0 and 51 have no key within 1
    assert torch.equal(torch.isneginf(lse[0, 0]), empty) and (out[0, 0, empty] == 0).all()
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert (dq[0, 0, empty] == 0).all() and torch.isfinite(dq).all()
    assert (dk[0, 0, 0] == 0).all() and (dv[0, 0, 0] == 0).all()   # key 10 is seen by nobody


# ---- errors -------------------------------------------------------------------------------

def _qkv(b=1, hq=2, hkv=1, n=20, nk=None, device="cpu"):
    g = torch.Generator().manual_seed(0)
    nk = n if nk is None else nk
    return (torch.randn(b, hq, n, 32, generator=g).to(device), torch.randn(b, hkv, nk, 32, generator=g).to(device),
            torch.randn(b, hkv, nk, 32, generator=g).to(device))


@pytest.mark.parametrize("kw,err,frag", [
    (dict(cu_seqlens=torch.tensor([0, 5, 20])), TypeError, "int32"),
    (dict(cu_seqlens=[0, 5, 20]), TypeError, "torch.Tensor"),
    (dict(cu_seqlens=torch.tensor([0, 12, 5, 20], dtype=torch.int32)), ValueError, "non-decreasing"),
    (dict(cu_seqlens=torch.tensor([1, 5, 20], dtype=torch.int32)), ValueError, "start at 0"),
    (dict(cu_seqlens=torch.tensor([0, 5, 19], dtype=torch.int32)), ValueError, "end at N=20"),
    (dict(cu_seqlens=torch.tensor([0, 25, 20], dtype=torch.int32)), ValueError, "past N=20"),
    (dict(cu_seqlens=torch.tensor([[0, 20]], dtype=torch.int32)), ValueError, "num_docs"),
    (dict(cu_seqlens=torch.tensor([0], dtype=torch.int32)), ValueError, "num_docs"),
    (dict(q_pos=torch.arange(20)), ValueError, "together"),
    (dict(q_pos=torch.arange(20).float(), k_pos=torch.arange(20)), TypeError, "int32 or int64"),
    (dict(q_pos=torch.arange(19), k_pos=torch.arange(20)), ValueError, "q_pos must have shape"),
    (dict(q_pos=torch.arange(20).expand(3, 20), k_pos=torch.arange(20)), ValueError, "q_pos must have shape"),
    (dict(q_pos=torch.arange(20).flip(0), k_pos=torch.arange(20)), ValueError, "non-decreasing"),
    (dict(q_pos=torch.arange(20) - 1, k_pos=torch.arange(20)), ValueError, "q_pos values"),
    (dict(q_bucket=torch.zeros(20, dtype=torch.int32)), ValueError, "together"),
    (dict(q_bucket=torch.tensor([1, 0] * 10), k_bucket=torch.zeros(20, dtype=torch.int32)), ValueError, "sorted"),
    (dict(q_bucket=torch.zeros(20, dtype=torch.int32), k_bucket=torch.zeros(20, dtype=torch.int32),
          cu_seqlens=torch.tensor([0, 20], dtype=torch.int32)), ValueError, "cannot be combined"),
    (dict(block_indices=torch.zeros(1, 1, 1, 1, dtype=torch.int32)), ValueError, "no topk"),
])
def test_errors(kw, err, frag):
    q, k, v = _qkv()
    with pytest.raises(err, match=frag):
        msa.attention(q, k, v, "window=4", **kw)
    if "cu_seqlens" in kw or "block_indices" in kw:   # the oracle checks the same things
        with pytest.raises(err, match=frag):
            msa.mask("window=4", 20, 2, **kw)


def _run_time_inputs(kind):
    """(pattern, run-time inputs) of one kind at N=24, fresh tensors each call."""
    if kind == "cu_seqlens":
        return "window=6", dict(cu_seqlens=torch.tensor([0, 7, 24], dtype=torch.int32))
    if kind == "positions":
        return "window=6", dict(q_pos=torch.arange(0, 48, 2), k_pos=torch.arange(0, 48, 2))
    if kind == "buckets":
        return "window=6", dict(q_bucket=torch.tensor([0] * 10 + [1] * 14),
                                k_bucket=torch.tensor([0] * 12 + [1] * 12))
    return "window=6,topk=1,block=16", dict(block_indices=torch.zeros(1, 1, 2, 1, dtype=torch.int32))


def _counting_checks(monkeypatch):
    """Every host-side check ``attention`` actually runs (not the ones it remembers), by name."""
    from msa_codegen.sparsity import inputs as dynamic

    ran = []
    real = dynamic.CHECKED.run

    def run(what, tensors, check):
        def counted():
            ran.append(what[0])
            check()
        real(what, tensors, counted)
    monkeypatch.setattr(dynamic.CHECKED, "run", run)
    dynamic.CHECKED.clear()
    dynamic.PREPARED.clear()
    return ran


@pytest.mark.parametrize("kind", ["cu_seqlens", "positions", "buckets", "topk"])
def test_prepared_inputs_are_reused_per_tensor_version(kind, monkeypatch):
    """A call with the same, unmodified run-time tensors gets the first call's normalised inputs
    without normalising again (no Python, no int32 copies or searchsorted on the device); an
    in-place write or a new tensor of the same values is normalised afresh, and the outputs agree."""
    from msa_codegen.sparsity import inputs as dynamic

    dynamic.PREPARED.clear()
    calls = []
    real = dynamic.normalize

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(dynamic, "normalize", counted)
    q, k, v = _qkv(n=24)
    pattern, kw = _run_time_inputs(kind)
    groups = msa.parse(pattern).head_groups(q.shape[1])
    first = dynamic.prepare(groups, 1, q.shape[1], k.shape[1], 24, 24, q.device, **kw)
    assert dynamic.prepare(groups, 1, q.shape[1], k.shape[1], 24, 24, q.device, **kw) is first
    assert len(calls) == 1
    out = msa.attention(q, k, v, pattern, **kw)
    assert len(calls) == 1, "attention normalised unchanged inputs again"
    for t in kw.values():
        t.add_(0)         # a new version: normalised again
    assert dynamic.prepare(groups, 1, q.shape[1], k.shape[1], 24, 24, q.device, **kw) is not first
    assert len(calls) == 2
    fresh = {name: t.clone() for name, t in kw.items()}   # same values, new tensors
    again = msa.attention(q, k, v, pattern, **fresh)
    assert len(calls) == 3
    assert torch.equal(out, again)


@pytest.mark.parametrize("kind", ["cu_seqlens", "positions", "buckets", "topk"])
def test_checks_run_once_per_tensor_version(kind, monkeypatch):
    """The host syncs of validation are paid once per set of inputs, again after an in-place
    write (version bump) or for a new tensor with the same values."""
    ran = _counting_checks(monkeypatch)
    q, k, v = _qkv(n=24)
    pattern, kw = _run_time_inputs(kind)
    first = msa.attention(q, k, v, pattern, **kw)
    n_first = len(ran)
    assert n_first >= 1
    again = msa.attention(q, k, v, pattern, **kw)
    assert len(ran) == n_first, f"checks re-ran on unchanged inputs: {ran}"
    assert torch.equal(first, again)
    for t in kw.values():
        t.add_(0)         # an in-place write, even of nothing, is a new version: checked again
    msa.attention(q, k, v, pattern, **kw)
    assert len(ran) == 2 * n_first
    kw = {name: t.clone() for name, t in kw.items()}   # same values, new tensors: checked again
    msa.attention(q, k, v, pattern, **kw)
    assert len(ran) == 3 * n_first


def test_remembered_check_does_not_hide_an_in_place_change():
    q, k, v = _qkv(n=20)
    cu = torch.tensor([0, 5, 20], dtype=torch.int32)
    msa.attention(q, k, v, "window=4", cu_seqlens=cu)
    cu[1] = 25           # now past N: the version moved, so the call must check again and fail
    with pytest.raises(ValueError, match="past N=20"):
        msa.attention(q, k, v, "window=4", cu_seqlens=cu)
    qp = torch.arange(20)
    msa.attention(q, k, v, "window=4", q_pos=qp, k_pos=torch.arange(20))
    qp[3] = 0            # unsorted now
    with pytest.raises(ValueError, match="non-decreasing"):
        msa.attention(q, k, v, "window=4", q_pos=qp, k_pos=torch.arange(20))


def test_oracle_never_remembers(monkeypatch):
    ran = _counting_checks(monkeypatch)
    cu = torch.tensor([0, 5, 20], dtype=torch.int32)
    msa.mask("window=4", 20, 1, cu_seqlens=cu)
    msa.mask("window=4", 20, 1, cu_seqlens=cu)
    assert ran == ["cu_seqlens", "cu_seqlens"]


def test_topk_errors():
    q, k, v = _qkv(n=40)
    with pytest.raises(ValueError, match="needs block_indices"):
        msa.attention(q, k, v, "topk=2,block=16")
    with pytest.raises(ValueError, match=r"\(1, 1, 3, 2\)"):
        msa.attention(q, k, v, "topk=2,block=16", block_indices=torch.zeros(1, 1, 3, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_indices values"):
        msa.attention(q, k, v, "topk=2,block=16", block_indices=torch.full((1, 1, 3, 2), 3, dtype=torch.int32))
    with pytest.raises(TypeError, match="block_indices"):
        msa.attention(q, k, v, "topk=2,block=16", block_indices=torch.zeros(1, 1, 3, 2))
    with pytest.raises(ValueError, match="same topk and block"):
        msa.attention(q, k, v, "0-0:topk=2,block=16;1-1:topk=3,block=16",
                      block_indices=torch.zeros(1, 1, 3, 2, dtype=torch.int32))


def test_batch_and_length_errors():
    q, k, v = _qkv(b=2)
    with pytest.raises(ValueError, match="batch size 1"):
        msa.attention(q, k, v, cu_seqlens=torch.tensor([0, 20], dtype=torch.int32))
    q, k, v = _qkv(n=20, nk=30)
    with pytest.raises(ValueError, match="q_pos and k_pos"):
        msa.attention(q, k, v)
    with pytest.raises(ValueError, match="random=R needs"):
        msa.attention(q, k, v, "random=1,block=16", q_pos=torch.arange(20), k_pos=torch.arange(30))


def test_plain_pattern_kernels_unchanged():
    """Run-time inputs add nothing to a plain pattern's plan (same key, same source)."""
    from msa_codegen.kernels import render as codegen
    from msa_codegen.pattern.lowering import lower
    for p in ["window=40,dilation=2,sink=4", "causal=false,global=3,random=2,block=64", "causal"]:
        spec = msa.parse(p).groups[0].spec
        plan = lower(spec)
        assert set(plan.as_dict()) == {"causal", "dense", "has_window", "window", "dilation", "sink", "global_",
                                       "prefix", "random", "rblock"}
        src = codegen.render(plan, "fwd") + codegen.render(plan, "bwd")
        for word in ("QPOS", "_lower_bound", "TOPK", "stride_tb"):
            assert word not in src


def test_cu_seqlens_fp16(device):
    check_dynamic("window=24,dilation=2,sink=4", b=1, hq=4, hkv=2, nq=220, d=64, dtype=torch.float16,
                  device=device, make=docs_inputs(90))


@pytest.mark.parametrize("kind", ["docs", "pos"])
def test_head_groups_gqa_split(kind, device):
    """Head groups (one KV head split across two groups) with run-time inputs, per-head positions."""
    pattern = "0-0:window=8;1-2:sink=4,window=3,dilation=2;3-3:causal=false,window=5"
    make = docs_inputs(40) if kind == "docs" else pos_inputs()
    check_dynamic(pattern, b=1, hq=4, hkv=2, nq=100, device=device, make=make)


def test_skipped_blocks_are_never_read(device):
    """Keys no query can see hold NaN: a kernel that visited their blocks would return NaN (0 * NaN).

    Checks that position ranges, bucket ranges and the top-k table really skip blocks.
    """
    cfg = LaunchConfig(FwdConfig(16, 16, 4, 1), BwdConfig(16, 16, 4, 1, 16, 16, 4, 1))
    g = torch.Generator().manual_seed(0)
    d = 32

    def run(pattern, nq, nk, bad, **kw):
        q = torch.randn(1, 1, nq, d, generator=g).to(device).requires_grad_()
        k = torch.randn(1, 1, nk, d, generator=g)
        v = torch.randn(1, 1, nk, d, generator=g)
        k[:, :, bad] = float("nan")
        v[:, :, bad] = float("nan")
        k, v = k.to(device).requires_grad_(), v.to(device).requires_grad_()
        with use_config(cfg):
            out = msa.attention(q, k, v, pattern, **kw)
            dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
        good = torch.ones(nk, dtype=torch.bool)
        good[bad] = False
        assert torch.isfinite(out).all() and torch.isfinite(dq).all()
        assert torch.isfinite(dk[:, :, good]).all() and torch.isfinite(dv[:, :, good]).all()

    # positions: 96 keys near 0, 64 far away (rows 96..159), 96 near 10000; queries near both ends
    kp = torch.cat([torch.arange(96), 5000 + torch.arange(64), 10000 + torch.arange(96)])
    qp = torch.cat([torch.arange(80), 10000 + torch.arange(80)])
    for pattern in ["window=16,sink=4", "causal=false,window=8,dilation=2"]:
        run(pattern, 160, 256, slice(96, 160), q_pos=qp, k_pos=kp)
    # buckets: keys of bucket 1 (rows 64..127) meet no query (queries have buckets 0 and 2)
    kb = torch.cat([torch.zeros(64), torch.ones(64), torch.full((64,), 2)]).int()
    qb = torch.cat([torch.zeros(48), torch.full((48,), 2)]).int()
    run("causal=false", 96, 192, slice(64, 128), q_pos=torch.arange(96) * 2, k_pos=torch.arange(192), q_bucket=qb,
        k_bucket=kb)
    # top-k: key block 1 (rows 16..31 at block=16) is never chosen
    idx = torch.tensor([[0, -1], [0, 0], [2, 0], [3, 2]], dtype=torch.int32).view(1, 1, 4, 2)
    run("topk=2,block=16", 64, 64, slice(16, 32), block_indices=idx)


@pytest.mark.parametrize("name", ["docs-w4096", "docs1-w4096", "hash8-8k", "qk-sparse-30", "topk16"])
def test_bench_dynamic_cases_build(name):
    """The benchmark cases build and run our side at a small size (the FlexAttention and SDPA
    peers need a GPU; our plain kernel, the peer of the one-document case, runs here)."""
    import dataclasses

    from msa_codegen import bench_dynamic

    case = dataclasses.replace([c for c in bench_dynamic.CASES if c.name == name][0], n=260, hq=2, hkv=2, d=32)
    ours, peers, grads, note = bench_dynamic.build(case, "cpu", torch.float32)
    out = ours()
    assert torch.isfinite(out).all() and note
    assert set(peers) == ({"msa_codegen-plain"} if case.one_doc else set())
    for fn, same_mask in peers.values():
        assert same_mask and rel_err(fn(), out) < 1e-5
    out.sum().backward()


def test_torch_compile_and_opcheck(device):
    """The run-time inputs pass through the custom op: torch.compile (with graph breaks at the
    host-side value checks) gives the eager result, and opcheck accepts the extended schema."""
    from msa_codegen.autograd import attention_fwd_op

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 40, 32, generator=g).to(device).requires_grad_()
    k = torch.randn(1, 1, 40, 32, generator=g).to(device).requires_grad_()
    v = torch.randn(1, 1, 40, 32, generator=g).to(device).requires_grad_()
    cu = torch.tensor([0, 7, 8, 40], dtype=torch.int32, device=device)

    def loss(q, k, v):
        return msa.attention(q, k, v, "window=8,sink=2", cu_seqlens=cu).square().sum()

    got = torch.compile(loss, backend="aot_eager")(q, k, v)
    assert torch.allclose(got, loss(q, k, v))
    pos = torch.arange(24, dtype=torch.int32, device=device).view(1, 1, 24)
    seg = torch.zeros(1, 1, 24, dtype=torch.int32, device=device)
    q, k, v = (torch.randn(1, h, 24, 32, generator=g).to(device) for h in (2, 1, 1))
    torch.library.opcheck(attention_fwd_op, (q, k, v, "window=8", 0.2, [], pos, pos, seg, seg, None),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration",
                                      "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("pattern,flags", [
    ("window=8,dilation=2,sink=4,random=2,topk=3,block=64", ("positional", "segments")),
    ("causal=false,sink=2,topk=4,block=64", ()),
    ("causal=false,window=8,dilation=3,sink=4,random=2,block=64", ("positional", "segments", "classes")),
    ("window=64,dilation=2,sink=4,topk=2,block=64", ("tma",)),
    ("causal=false,global=3,window=16,random=2,block=64", ("tma",)),
    ("window=64,dilation=2,sink=4", ("tma",)),
    ("window=64,dilation=2,sink=4,topk=2,block=64", ("positional", "segments", "tma")),
    ("causal", ("positional", "segments")),
    ("causal", ("positional", "segments", "tma", "launch")),
    ("causal=false", ("positional", "segments", "tma", "launch", "fp16", "group=2")),
    ("causal", ("positional", "segments", "tma", "launch", "hd=64")),
    ("window=4096,sink=64", ("positional", "segments", "tma", "launch")),
    ("causal=false,window=512,dilation=2,sink=4", ("positional", "segments", "classes", "tma", "launch")),
    ("window=256,sink=16,topk=4,block=64", ("positional", "segments", "tma", "launch")),
    ("causal", ("tma", "launch", "pipelined")),
    ("causal=false", ("tma", "launch", "fp16", "group=2", "pipelined")),
    ("topk=16,block=128", ("tma", "launch", "pipelined")),
    ("topk=16,block=128", ("tma", "launch", "hd=64", "pipelined")),
], ids=["pos-seg-all-terms", "plain-topk", "docs-classes-bidir", "tma-dilated-sink-topk", "tma-global-random",
        "tma-dilated-sink-scratch", "pos-seg-tma", "pos-seg-dense-hash", "launch-hash", "launch-hash-bidir",
        "launch-hash-d64", "launch-window-sink", "launch-classes-bidir", "launch-pos-topk-b64",
        "pipelined-dense", "pipelined-dense-bidir", "pipelined-topk", "pipelined-topk-d64"])
def test_kernels_compile_for_sm90(pattern, flags, tmp_path):
    """The new kernels through Triton's GPU compiler (sm_90, bundled ptxas), no GPU needed.

    ``launch``: at the H200's default launch configuration for D=128 bf16, specialised as a launch
    is (aot_check.py). CI's oldest-pair job runs these too: with Triton 3.6, ptxas crashed on a
    positional forward that Triton 3.9 compiled, and the pipeliner failed on the positional dk/dv
    kernel of top-k / random blocks of 64 rows (launch-pos-topk-b64). The hash launches at head
    dims 128 and 64 and bidirectional in fp16 with GQA 2 (launch-hash, launch-hash-d64,
    launch-hash-bidir): variants of the dense positional kernels with one search fewer crashed
    3.6's ptxas at D=64 and in that fp16 dq only (docs/performance.md).

    ``pipelined``: ptxas must not serialize a kernel's wgmma (its C7511 / C7512 / C7515
    "wgmma.mma_async instructions are serialized"). Before the fix it did for the dense D=128 dq (Triton 3.6 and
    3.8; 3.9 did not) and for the top-k forward and dq at D=128 and 64 (3.6, 3.8, 3.9): loops
    compiled but never run at these launches (benchmarks/NOTES.md). A fresh Triton cache, so that
    ptxas runs and reports."""
    r = run_sm90_script("aot_check.py", pattern, *flags,
                        env={"MSA_CODEGEN_HOME": str(tmp_path), "TRITON_CACHE_DIR": str(tmp_path / "triton")})
    assert r.returncode == 0, r.stderr[-3000:]


def _positional_run(kind, pattern, cfg, device, descriptors):
    """check_dynamic on ``kind``'s inputs with the positional kernels' descriptors on or off;
    returns what each launch's ``use_tma`` answered (empty when it was never asked)."""
    launched = []
    real = tma_mod.use_tma

    def spy(*ts):
        launched.append(real(*ts))
        return launched[-1]
    with use_config(cfg), tma_mod.use_positional_descriptors(descriptors), \
            unittest.mock.patch.object(launch_mod, "use_tma", spy):
        check_dynamic(pattern, b=1, hq=2, hkv=1, nq=230, device=device, make=_kind_inputs(kind, pattern))
    return launched


@pytest.mark.parametrize("kind,pattern,cfg", [
    ("docs", "window=10,dilation=2,sink=3", SMALL_TILES[0]),
    ("docs", "causal", SMALL_TILES[1]),
    ("pos", "causal=false,window=9,dilation=3", SMALL_TILES[0]),
    ("buckets", "causal=false,sink=3,topk=2,block=16", SMALL_TILES[1]),
], ids=["docs-dil-sink-bm16", "docs-causal-bm32", "pos-bidir-dil-bm16", "buckets-topk-bm32"])
def test_positional_descriptors(kind, pattern, cfg, device):
    """The positional kernels with their loops' K/V (forward, dq) and Q/dO (dk/dv) through
    descriptors over each loop call's rows (the default, use_positional_descriptors): rows past a
    range arrive as zeros, as the pointer loads' masked rows."""
    launched = _positional_run(kind, pattern, cfg, device, descriptors=True)
    assert launched and all(launched)   # the descriptor path ran (forward and backward)


@pytest.mark.parametrize("kind,pattern,cfg", [
    ("docs", "window=10,dilation=2,sink=3", SMALL_TILES[0]),
    ("buckets", "causal=false,sink=3,topk=2,block=16", SMALL_TILES[1]),
], ids=["docs-dil-sink-bm16", "buckets-topk-bm32"])
def test_positional_pointer_loads(kind, pattern, cfg, device):
    """use_positional_descriptors(False) (MSA_CODEGEN_POSITIONAL_TMA=0): the positional kernels
    load through pointers, never asking for descriptors, with the same result."""
    assert not _positional_run(kind, pattern, cfg, device, descriptors=False)


def test_repeated_positions(device):
    """Non-decreasing (not strictly increasing) positions: several rows may share a position."""
    def make(b, hq, hkv, nq, nk, gen):
        return {"q_pos": torch.tensor(sorted(gen.randrange(60) for _ in range(nq))),
                "k_pos": torch.tensor(sorted(gen.randrange(60) for _ in range(nk)))}
    with use_config(SMALL_TILES[0]):
        check_dynamic("window=5,sink=2", nq=90, nk=110, device=device, make=make)


@pytest.mark.parametrize("kind,pattern", [
    ("docs", "window=40,sink=3"),
    ("docs", "causal"),
    ("docs", "causal=false,window=30"),
    ("docs", "causal=false"),
    ("pos", "window=45"),
    ("buckets", "causal=false,global=2,window=36"),
], ids=["docs-window-sink", "docs-causal", "docs-bidir-window", "docs-bidir", "pos-window", "buckets-global"])
def test_unmasked_interior_blocks(kind, pattern, device):
    """Long segments and windows wider than the key blocks: the forward and dq skip the mask on
    blocks that every row of a tile sees."""
    def make(b, hq, hkv, nq, nk, gen):
        if kind == "docs":
            lens, left = [], nq
            while left:
                lens.append(min(left, gen.randint(50, 120)))
                left -= lens[-1]
            return {"cu_seqlens": torch.tensor([0] + lens).cumsum(0).to(torch.int32)}
        if kind == "pos":
            return pos_inputs(span=int(nq * 1.2))(b, hq, hkv, nq, nk, gen)
        return bucket_inputs(2, with_pos=True)(b, hq, hkv, nq, nk, gen)
    with use_config(SMALL_TILES[0]):
        check_dynamic(pattern, b=1, hq=2, hkv=1, nq=240, device=device, make=make)


@pytest.mark.parametrize("pattern", [
    "causal=false,window=5,dilation=3,sink=4",
    "window=7,dilation=2,sink=2,topk=2,block=16",
    "causal=false,window=6,dilation=3,random=2,block=16",
])
def test_cu_seqlens_dilated_class_tiles(pattern, device):
    """cu_seqlens with dilation: strided tiles of row classes (sinks of every document, random and
    top-k blocks on top), small tiles so that tiles cross many documents."""
    def make(b, hq, hkv, nq, nk, gen):
        out = docs_inputs(45)(b, hq, hkv, nq, nk, gen)
        if "topk" in pattern:
            out.update(topk_inputs(pattern)(b, hq, hkv, nq, nk, gen))
        return out
    with use_config(SMALL_TILES[1]):
        check_dynamic(pattern, b=1, hq=2, hkv=1, nq=200, device=device, make=make)


# ---- on the GPU: larger shapes, bf16 / fp16 -----------------------------------------------------


def _selected(topk, block, make=None):
    """block_indices from select_blocks on fresh inputs (MoBA gating), plus ``make``'s inputs."""
    def sel(b, hq, hkv, nq, nk, gen):
        out = make(b, hq, hkv, nq, nk, gen) if make else {}
        g = torch.Generator().manual_seed(gen.randrange(2**31))
        dev = "cuda" if torch.cuda.is_available() else "cpu"   # select_blocks' kernels run where its inputs are
        out["block_indices"] = msa.select_blocks(torch.randn(b, hq, nq, 64, generator=g).to(dev),
                                                 torch.randn(b, hkv, nk, 64, generator=g).to(dev), topk,
                                                 block=block).cpu()
        return out
    return sel


GPU_CASES = [
    # id, pattern, inputs, (B, Hq, Hkv, Nq, Nk, D, dtype)
    ("docs-window", "window=512", docs_inputs(2048), (1, 8, 2, 8192, None, 128, torch.bfloat16)),
    ("docs-dil-sink", "window=256,dilation=2,sink=16", docs_inputs(3000), (1, 4, 1, 8192, None, 64, torch.bfloat16)),
    ("docs-causal", "causal", docs_inputs(1000), (1, 4, 2, 4099, None, 128, torch.float16)),
    ("docs-d256", "window=1024,sink=16", docs_inputs(1500), (1, 4, 2, 5000, None, 256, torch.bfloat16)),
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
    ("topk-d256", "topk=4,block=64", _selected(4, 64), (1, 4, 2, 3000, None, 256, torch.bfloat16)),
    ("topk-window-sink", "window=256,sink=16,topk=4,block=64", _selected(4, 64), (2, 4, 2, 8000, None, 128, torch.bfloat16)),
    ("topk-random-bidir", "causal=false,window=64,random=2,topk=3,block=128",
     with_topk("causal=false,window=64,random=2,topk=3,block=128", None), (1, 4, 1, 4096, None, 64, torch.float16)),
    # positional tiles with blocks no larger than the dk/dv kernel's query tiles (64 at D <= 128):
    # the R^T loop call is one block (Triton 3.6 failed to compile it until it was kept unpipelined)
    ("pos-topk-b64", "window=256,sink=16,topk=4,block=64",
     with_topk("window=256,sink=16,topk=4,block=64", pos_inputs(span=8192)), (1, 4, 2, 3000, 3000, 128, torch.bfloat16)),
    ("buckets-random-b64", "causal=false,window=64,random=2,block=64", bucket_inputs(4, with_pos=True),
     (1, 4, 2, 4096, None, 64, torch.bfloat16)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("pattern,make,shape", [c[1:] for c in GPU_CASES], ids=[c[0] for c in GPU_CASES])
def test_gpu_dynamic(pattern, make, shape):
    b, hq, hkv, nq, nk, d, dtype = shape
    check_dynamic(pattern, b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, dtype=dtype, device="cuda", make=make)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern,make,shape", [c[1:] for c in GPU_CASES if c[0].startswith(("docs", "pos", "buckets"))],
                         ids=[c[0] for c in GPU_CASES if c[0].startswith(("docs", "pos", "buckets"))])
def test_gpu_dynamic_positional_pointers(pattern, make, shape):
    """The positional cases again with pointer loads (use_positional_descriptors(False))."""
    b, hq, hkv, nq, nk, d, dtype = shape
    with tma_mod.use_positional_descriptors(False):
        check_dynamic(pattern, b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, dtype=dtype, device="cuda", make=make)


@pytest.mark.gpu
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
