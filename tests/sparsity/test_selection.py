"""select_blocks (msa_codegen.sparsity.selection): its Triton kernels against the plain PyTorch
definition in float64 (sparsity.reference.select_blocks_reference).

On the CPU the kernels run in Triton's interpreter; the case marked ``gpu`` runs N=131072 in
bf16/fp16 on CUDA and bounds the extra memory. Random inputs are compared up to near-ties (the
kernel ranks scores of about float32's precision, the reference float64 ones): position by position, the reference
scores of the chosen blocks agree within a tolerance, and the -1 slots agree exactly. Integer
inputs make every score exact in both, so there the indices, ties included, must be equal.
"""
import pytest
import torch

import msa_codegen as msa
from msa_codegen.sparsity import selection
from msa_codegen.sparsity.reference import block_means_reference, block_scores_reference, select_blocks_reference

from helpers import run_sm90_script


def assert_selects_like_reference(idx, q, k, topk, block, causal, rtol=1e-5):
    """``idx`` is the reference's selection, up to the order of blocks whose float64 scores are
    within ``rtol`` of the largest score."""
    want = select_blocks_reference(q, k, topk, block, causal=causal).to(idx.device)
    assert idx.shape == want.shape and idx.dtype == torch.int32
    assert torch.equal(idx < 0, want < 0), "a different number of candidates"
    assert torch.equal(idx[..., 0], want[..., 0]), "the own block is not first"
    score = block_scores_reference(q, k, block).to(idx.device)
    score.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))

    def at(i):
        return torch.where(i >= 0, score.gather(-1, i.long().clamp(min=0)), 0.0)
    tol = rtol * score.nan_to_num(0.0, 0.0, 0.0).abs().max().item()
    got_s, want_s = at(idx), at(want)
    fin = want_s.isfinite()
    assert torch.equal(got_s.isfinite(), fin)
    assert (got_s[fin] - want_s[fin]).abs().max().item() <= tol if fin.any() else True, "a block scored lower"
    srt = idx.sort(-1).values
    assert not ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any(), "a block twice"
    return want


@pytest.mark.parametrize("n,hq,hkv,d,topk,block,causal", [
    pytest.param(1, 2, 1, 16, 3, 16, True, id="n1"),
    pytest.param(127, 4, 2, 32, 3, 16, True, id="n127-gqa"),
    pytest.param(129, 2, 2, 80, 4, 32, False, id="n129-d80-bidir"),
    pytest.param(1000, 6, 2, 64, 16, 32, True, id="n1000-gqa3-k16"),
    pytest.param(1000, 2, 1, 16, 40, 64, False, id="n1000-k-over-candidates-bidir"),
    pytest.param(301, 2, 1, 16, 30, 16, True, id="n301-k-over-candidates"),
    pytest.param(700, 2, 2, 256, 40, 16, True, id="n700-d256-k40-widened-tiles"),
])
def test_matches_float64_reference(n, hq, hkv, d, topk, block, causal, device):
    gen = torch.Generator().manual_seed(n * 7 + topk)
    q = torch.randn(2, hq, n, d, generator=gen)
    k = torch.randn(2, hkv, n, d, generator=gen)
    idx = msa.select_blocks(q.to(device), k.to(device), topk, block=block, causal=causal)
    assert_selects_like_reference(idx.cpu(), q, k, topk, block, causal)


@pytest.mark.parametrize("block_m,block_n", [(16, 64), (32, 16)])
@pytest.mark.parametrize("n,hq,hkv,d,topk,block,causal", [
    pytest.param(1000, 6, 2, 64, 16, 32, True, id="n1000-gqa3-k16"),
    pytest.param(1000, 2, 1, 16, 40, 64, False, id="n1000-k-over-candidates-bidir"),
    pytest.param(301, 2, 1, 16, 30, 16, True, id="n301-k-over-candidates"),
])
def test_insertion_form_matches_float64_reference(n, hq, hkv, d, topk, block, causal, block_m, block_n, device,
                                                  monkeypatch):
    """The running top kept unsorted and filled by insert_keys (INSERT), tiles wider than W
    included: the same selection as the reference, ties too."""
    meta = selection._select_meta
    monkeypatch.setattr(selection, "_select_meta", lambda *a: dict(meta(*a), INSERT=True, BLOCK_M=block_m,
                                                                  BLOCK_N=block_n))
    gen = torch.Generator().manual_seed(n * 7 + topk)
    q = torch.randn(2, hq, n, d, generator=gen)
    k = torch.randn(2, hkv, n, d, generator=gen)
    idx = msa.select_blocks(q.to(device), k.to(device), topk, block=block, causal=causal)
    assert_selects_like_reference(idx.cpu(), q, k, topk, block, causal)
    # ties: integer inputs, exact scores
    gen = torch.Generator().manual_seed(5)
    qi = torch.randint(-2, 3, (1, 2, 23 * 16 - 5, 32), generator=gen).float()
    pats = torch.randint(-2, 3, (3, 16, 32), generator=gen).float()
    ki = pats[torch.randint(0, 3, (23,), generator=gen)].reshape(1, 1, 23 * 16, 32)[:, :, :qi.shape[2]].contiguous()
    got = msa.select_blocks(qi.to(device), ki.to(device), 8, block=16, causal=causal)
    assert torch.equal(got.cpu(), select_blocks_reference(qi, ki, 8, 16, causal=causal))


@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_split_runs_match_float64_reference(causal, split, device, monkeypatch):
    """A row tile's candidates in ``split`` runs, one program each, merged by block_merge_kernel
    (the launcher splits when row tiles are too few to fill the GPU): the reference's selection,
    with runs of unequal length and empty ones (the first row tiles have one candidate tile)."""
    assert selection._split(64 * 16, 64) == 4 and selection._split(512 * 16, 512) == 1
    monkeypatch.setattr(selection, "_split", lambda programs, tiles: split)
    gen = torch.Generator().manual_seed(3 + split)
    q = torch.randn(2, 3, 83 * 8 - 5, 16, generator=gen)
    k = torch.randn(2, 1, 83 * 8 - 5, 16, generator=gen)
    idx = msa.select_blocks(q.to(device), k.to(device), 5, block=8, causal=causal)
    assert_selects_like_reference(idx.cpu(), q, k, 5, 8, causal)
    # ties: integer inputs, exact scores, the lower block first across runs too
    qi = torch.randint(-2, 3, (1, 2, 40 * 16, 32), generator=gen).float()
    pats = torch.randint(-2, 3, (3, 16, 32), generator=gen).float()
    ki = pats[torch.randint(0, 3, (40,), generator=gen)].reshape(1, 1, 40 * 16, 32).contiguous()
    got = msa.select_blocks(qi.to(device), ki.to(device), 8, block=16, causal=causal)
    assert torch.equal(got.cpu(), select_blocks_reference(qi, ki, 8, 16, causal=causal))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_long_rows_form(causal, device, monkeypatch):
    """From LONG_SELECT blocks on, top-16 inserts from wide tiles into 128 rows of an unsorted top
    (lowered here to 100 blocks): the reference's selection, over several row and key tiles."""
    assert selection._select_meta(128, 16, True, selection.LONG_SELECT)["INSERT"]
    assert not selection._select_meta(128, 16, True, selection.LONG_SELECT - 1)["INSERT"]
    assert not selection._select_meta(128, 32, True, selection.LONG_SELECT)["INSERT"]
    monkeypatch.setattr(selection, "LONG_SELECT", 100)
    assert selection._select_meta(32, 16, causal, 300)["BLOCK_M"] == 128
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 2, 300 * 8 - 3, 32, generator=gen)
    k = torch.randn(1, 1, 300 * 8 - 3, 32, generator=gen)
    idx = msa.select_blocks(q.to(device), k.to(device), 16, block=8, causal=causal)
    assert_selects_like_reference(idx.cpu(), q, k, 16, 8, causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_ties_go_to_the_lower_block(causal, device):
    """Integer inputs with few distinct key blocks: many exactly equal scores, exact in float32
    and float64 alike. Equal scores list the lower block first, as the reference's stable sort."""
    gen = torch.Generator().manual_seed(5)
    nb, block, d = 23, 16, 32
    q = torch.randint(-2, 3, (1, 4, nb * block - 5, d), generator=gen).float()
    # key blocks drawn from three patterns: equal block means
    pats = torch.randint(-2, 3, (3, block, d), generator=gen).float()
    k = pats[torch.randint(0, 3, (2 * nb,), generator=gen)].reshape(1, 2, nb * block, d)[:, :, :q.shape[2]]
    idx = msa.select_blocks(q.to(device), k.contiguous().to(device), 8, block=block, causal=causal)
    want = select_blocks_reference(q, k, 8, block, causal=causal)
    assert torch.equal(idx.cpu(), want)
    # there were ties to break
    assert (block_scores_reference(q, k, block).sort(-1).values.diff(dim=-1) == 0).any()


def test_structure():
    """Own block first, causal candidates only, -1 padding, all blocks when K covers them."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 100, 16, generator=gen)
    k = torch.randn(2, 2, 100, 16, generator=gen)
    idx = msa.select_blocks(q, k, 3, block=16)
    nb = 7
    assert idx.shape == (2, 2, nb, 3) and idx.dtype == torch.int32
    own = torch.arange(nb)
    assert torch.equal(idx[..., 0].long(), own.expand(2, 2, nb))   # own block first
    valid = idx >= 0
    assert (idx[valid].long() <= own[None, None, :, None].expand_as(idx)[valid]).all()   # causal
    assert torch.equal(valid.sum(-1), torch.minimum(own + 1, torch.tensor(3)).expand(2, 2, nb))
    full = msa.select_blocks(q, k, 7, block=16, causal=False)
    assert (full >= 0).all() and torch.equal(full.sort(-1).values, own.expand(2, 2, nb, nb).to(torch.int32))


def test_block_means_launcher_form():
    """The means' form timed fastest at D=128, 128-blocks (H200, select_probe.py, 2026-12-04): 32-row
    steps summed at once on 2 warps, two blocks a program; other shapes' forms within a step of
    4096 elements and 8 unrolled steps a program."""
    meta = selection._means_meta(128, 128, 1)
    assert {k: meta[k] for k in ("STEP_SUM", "BLOCK_R", "BLOCKS", "num_warps")} == \
        dict(STEP_SUM=True, BLOCK_R=32, BLOCKS=2, num_warps=2)
    for d, block in ((256, 128), (256, 64), (64, 256), (128, 256), (128, 16), (512, 128), (256, 256), (128, 1024)):
        m = selection._means_meta(d, block, 4)
        if m["STEP_SUM"]:
            assert m["BLOCK_R"] * m["BLOCK_D"] <= 8192 and m["BLOCKS"] * -(-block // m["BLOCK_R"]) <= 8, (d, block, m)
        else:
            assert m["BLOCK_R"] * m["BLOCK_D"] <= 16384 and m["BLOCKS"] == 1, (d, block, m)


@pytest.mark.parametrize("n,b,hq,hkv,d,block,dtype,step_sum,grid_y", [
    pytest.param(1, 2, 2, 1, 128, 128, torch.bfloat16, True, None, id="n1-d128-b128"),
    # 2 steps of 32 rows a block, 2 blocks a program: 5 blocks, the last short, a program past the end
    pytest.param(301, 2, 6, 2, 128, 64, torch.float16, True, None, id="n301-d128-b64-gqa3"),
    # a block of 1.5 steps (rows of the next block masked), D padded to 128
    pytest.param(200, 1, 4, 2, 80, 48, torch.float32, True, None, id="n200-d80-b48-gqa2"),
    # 8 steps of 16 rows, one block a program; batches in 3 launches (grid's second dimension 2 x Hkv)
    pytest.param(301, 3, 1, 1, 256, 128, torch.bfloat16, True, 2, id="n301-d256-b128-chunks"),
    # 16 steps of 16 rows: the loop of 64-row steps
    pytest.param(301, 1, 3, 1, 256, 256, torch.float16, False, None, id="n301-d256-b256-loop"),
])
def test_block_means_match_float64(n, b, hq, hkv, d, block, dtype, step_sum, grid_y, monkeypatch):
    """The pooled vectors select_blocks scores, as its launcher computes them: float32 means of q
    over a block's rows (the last one short) and a GQA group's heads, and of k, against float64."""
    assert selection._means_meta(d, block, hq // hkv)["STEP_SUM"] == step_sum
    if grid_y:
        monkeypatch.setattr(selection, "MAX_GRID_Y", grid_y)
    gen = torch.Generator().manual_seed(n + d)
    q = torch.randn(b, hq, n, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    qm, km = selection._block_means(q, k, block)
    nb = -(-n // block)
    want_q = block_means_reference(q, block).view(b, hkv, hq // hkv, nb, d).mean(2)
    assert qm.dtype == km.dtype == torch.float32 and qm.shape == km.shape == (b, hkv, nb, d)
    assert torch.allclose(qm.double(), want_q, rtol=1e-6, atol=1e-6)
    assert torch.allclose(km.double(), block_means_reference(k, block), rtol=1e-6, atol=1e-6)


def test_too_many_slots(monkeypatch):
    q = torch.randn(1, 1, 64, 16)
    monkeypatch.setattr(selection, "MAX_SLOTS", 2)
    with pytest.raises(ValueError, match="at most 2 blocks"):
        msa.select_blocks(q, q, 3, block=16)
    assert msa.select_blocks(q, q, 3, block=32).shape == (1, 1, 2, 3)   # 2 candidates: fits


def test_kernels_compile_for_sm90():
    """Both kernels through Triton's GPU compiler (sm_90, bundled ptxas) with the launchers'
    parameters, within shared memory; no GPU needed."""
    r = run_sm90_script("sparsity/aot_select.py", timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hq,hkv,causal", [(16, 16, True), (16, 4, False)], ids=["mha-causal", "gqa4-bidir"])
def test_gpu_matches_reference_and_memory(dtype, hq, hkv, causal):
    """N=131072, D=128, top-16 in bf16/fp16 against the float64 definition, and the extra peak
    memory: the output, the two float32 pooled tensors and the runs' kept keys (int64, at most 8
    runs of W=16 per query block), within 1 MiB of allocator rounding."""
    dev = torch.device("cuda")
    n, d, topk, block = 131072, 128, 16, 128
    gen = torch.Generator(device=dev).manual_seed(3)
    q = torch.randn(1, hq, n, d, device=dev, generator=gen).to(dtype)
    k = torch.randn(1, hkv, n, d, device=dev, generator=gen).to(dtype)
    msa.select_blocks(q, k, topk, block=block, causal=causal)   # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    idx = msa.select_blocks(q, k, topk, block=block, causal=causal)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    nb = n // block
    bound = 2 * hkv * nb * d * 4 + hkv * nb * topk * 4 + hkv * nb * 8 * 16 * 8 + (1 << 20)
    assert extra <= bound, f"{extra / 2**20:.1f} MiB extra, bound {bound / 2**20:.1f} MiB"
    assert_selects_like_reference(idx, q, k, topk, block, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_gpu_long_rows_match_reference(causal):
    """N=524288 with 128-blocks: 4096 blocks, the long-rows form (insertion from 64-wide tiles into
    128 rows, each run's first tile sorted), bf16 with GQA 2, against the float64 definition."""
    dev = torch.device("cuda")
    n, d, topk, block = 524288, 128, 16, 128
    assert selection._select_meta(d, topk, causal, n // block)["INSERT"]
    gen = torch.Generator(device=dev).manual_seed(7)
    q = torch.randn(1, 4, n, d, device=dev, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 2, n, d, device=dev, generator=gen).to(torch.bfloat16)
    idx = msa.select_blocks(q, k, topk, block=block, causal=causal)
    assert_selects_like_reference(idx, q, k, topk, block, causal)

