"""The generated kernels through their launchers (msa_codegen.kernels.launch) against the fp64
oracle: output, LSE, dq, dk, dv; descriptor and pointer loads (kernels.tma), the backward's
scratch and prefix chunks (kernels.schedule).

Without CUDA these run in Triton's interpreter (conftest.py), at small sizes; the cases marked
``gpu`` run larger shapes in bf16/fp16 on a GPU (bf16's tl.dot is wrong in the interpreter).
These are the Triton family's tests: ``MSA_CODEGEN_GLUON=0`` throughout (on Hopper the
automatic choice would run most plain patterns in the Gluon family, tested in test_gluon*.py),
except FlexAttention's comparison, which runs what ``attention`` chooses.
"""
import random

import pytest
import torch

import msa_codegen as msa
from msa_codegen.config import BwdConfig, FwdConfig, LaunchConfig, use_config
from msa_codegen.kernels import gluon, schedule
from msa_codegen.kernels import tma as tma_policy

from helpers import FLOOR, check_attention, check_dynamic, chunked_reference, make_inputs, random_case, rel_err, \
    spy_scratch, topk_inputs


@pytest.fixture(autouse=True)
def triton_family(monkeypatch):
    """The Triton kernels on every call (``MSA_CODEGEN_GLUON=0``)."""
    monkeypatch.setenv(gluon.ENV, "0")

# every term alone and in combination, both directions
PATTERNS = [
    "causal",
    "causal=false",
    "window=1",
    "window=17",
    "window=40,dilation=2",
    "window=9,dilation=3",
    "window=5,dilation=7",
    "sink=13",
    "window=24,sink=9",
    "window=16,dilation=2,sink=20",
    "window=6,dilation=4,sink=3",
    "causal=false,window=12",
    "causal=false,window=7,dilation=3",
    "causal=false,sink=5",
    "causal=false,global=6",
    "causal=false,global=40,window=4",
    "causal=false,global=3,sink=9,window=5,dilation=2",
    "random=2,block=16",
    "random=3,seed=7,block=32",
    "window=8,random=2,block=16",
    "window=8,dilation=2,sink=4,random=2,block=32,seed=11",
    "causal=false,random=2,block=16",
    "causal=false,window=3,dilation=4,global=5,random=3,block=32",
    "0-0:window=6;1-1:causal=false,window=9,dilation=2",
]


def test_random_calls(device):
    """Fresh random calls (``random_case``: terms, head groups, lengths, head dims, GQA ratios,
    layouts, packed documents, top-k blocks, dtypes) against the float64 reference: output,
    LSE and every gradient. The seed that drew them is in a failure's message."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device.type == "cuda" else [])
    for _ in range(4):
        c = random_case(rng, dtypes)
        layout = rng.choice(["bhnd", "bnhd"])
        shape = dict(b=c["b"], hq=c["hq"], hkv=c["hkv"], d=c["d"], dtype=c["dtype"], device=device)
        try:
            if c["make"] is None:
                check_attention(c["pattern"], n=c["nq"], layout=layout, seed=c["seed"], **shape)
            else:
                check_dynamic(c["pattern"], nq=c["nq"], make=c["make"], seed=c["seed"], **shape)
        except Exception as e:
            raise AssertionError(f"random case of seed {seed}: {c['pattern']!r} {shape} N={c['nq']} "
                                 f"{layout if c['make'] is None else 'run-time inputs'}: {e}") from e


@pytest.mark.parametrize("pattern", PATTERNS)
def test_pattern_fp32(pattern, device):
    check_attention(pattern, n=129, d=32, dtype=torch.float32, device=device)


@pytest.mark.parametrize("pattern", ["causal", "window=24,dilation=2,sink=8", "causal=false,global=5,window=9",
                                     "window=16,random=2,block=32"])
def test_pattern_fp16(pattern, device):
    check_attention(pattern, n=200, d=64, dtype=torch.float16, device=device)


@pytest.mark.parametrize("n", [1, 2, 31, 127, 129, 333])
@pytest.mark.parametrize("pattern", ["causal", "window=20,dilation=3,sink=7", "causal=false,global=4,window=6"])
def test_lengths(pattern, n, device):
    check_attention(pattern, n=n, d=32, device=device)


@pytest.mark.parametrize("d", [16, 32, 64, 80, 200, 256])
def test_head_dims(d, device):
    check_attention("window=30,dilation=2,sink=5", n=150, d=d, device=device)


@pytest.mark.parametrize("hq,hkv", [(4, 1), (4, 2), (6, 3)], ids=["mqa-4:1", "gqa-4:2", "gqa-6:3"])
def test_gqa(hq, hkv, device):
    check_attention("window=20,dilation=2,sink=3", b=2, hq=hq, hkv=hkv, n=100, device=device)


@pytest.mark.parametrize("pattern", [
    "0-1:window=8;2-3:causal=false,window=5,dilation=2",     # groups aligned with KV heads
    "0-0:window=8;1-2:sink=4,window=3;3-3:causal",            # a KV head split across groups
])
def test_head_groups_gqa(pattern, device):
    check_attention(pattern, b=1, hq=4, hkv=2, n=90, device=device)


def test_strided_bnhd_layout(device):
    """(B, N, H, D) storage passed as .transpose(1, 2): read in place, output in the same layout."""
    check_attention("window=16,dilation=2,sink=4", b=2, hq=4, hkv=2, n=77, d=32, layout="bnhd", device=device)


@pytest.mark.parametrize("scale", [0.37, -0.5, 0.0])
def test_custom_scale(scale, device):
    """A positive scale is folded into the exponent (the row maxima are taken on raw scores); a
    negative or zero one takes the unfolded path, where a maximum of raw scores would be wrong."""
    check_attention("window=12,sink=3", n=64, scale=scale, device=device)
    check_attention("window=12,sink=3", n=64, scale=scale, dtype=torch.float16, device=device)


@pytest.mark.parametrize("cfg", [
    LaunchConfig(FwdConfig(16, 32, 4, 1), BwdConfig(16, 32, 4, 1, 32, 16, 4, 1)),
    LaunchConfig(FwdConfig(64, 16, 4, 1), BwdConfig(64, 16, 4, 1, 16, 64, 4, 1)),
], ids=["bm16-bn32", "bm64-bn16"])
@pytest.mark.parametrize("pattern", ["window=21,dilation=2,sink=5", "causal=false,global=9,window=7,random=2,block=16"])
def test_block_shapes(pattern, cfg, device):
    """Tiles smaller and larger than the window and the random blocks cross every edge case."""
    with use_config(cfg):
        check_attention(pattern, n=150, device=device)


def test_descriptor_path_refuses_a_faulting_backward_config():
    """dk/dv with 16-row query blocks and more than 2 stages faulted on the H200 (a sticky CUDA
    error): on the descriptor path (the interpreter runs it too) the backward refuses it by
    name before launching, and the forward of the same config still runs."""
    q, k, v, _ = make_inputs(1, 2, 1, 64, 16, torch.float32, "cpu")
    cfg = LaunchConfig(FwdConfig(32, 32, 4, 1), BwdConfig(16, 32, 4, 3, 32, 32, 4, 1))
    with use_config(cfg):
        out = msa.attention(q, k, v, "window=9")
        # a dense gradient: an expanded one (out.sum()) takes pointer loads, not the descriptors
        with pytest.raises(ValueError, match="block_m1=16 with num_stages1=3"):
            torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


# The causal W band's masked blocks test one condition when the window spans a query tile and a
# key block (WINDOW >= BLOCK_M + BLOCK_N in class positions; 64 under the interpreter's 32x32
# tiles, 48 under the 16x32 ones): just below and at that bound, with dilation, sink (the
# forward's lower edge keeps every test), random blocks, and two query heads per KV head (the
# dk/dv kernel's two passes).
@pytest.mark.parametrize("cfg", [None, LaunchConfig(FwdConfig(16, 32, 4, 1), BwdConfig(16, 32, 4, 1, 32, 16, 4, 1))],
                         ids=["default", "bm16-bn32"])
@pytest.mark.parametrize("pattern", ["window=47", "window=48", "window=63", "window=64", "window=90,dilation=2",
                                     "window=70,sink=5", "window=100,dilation=3,sink=7", "window=80,random=1,block=32"])
def test_band_parts(pattern, cfg, device):
    if cfg is None:
        check_attention(pattern, n=333, device=device)
    else:
        with use_config(cfg):
            check_attention(pattern, n=333, device=device)


def test_lse_gradient(device):
    """The returned LSE is differentiable: its gradient reaches q and k."""
    q, k, v, _ = make_inputs(1, 2, 1, 70, 32, torch.float32, device)
    out, lse = msa.attention(q, k, v, "window=9,sink=3", return_lse=True)
    ref, ref_lse = msa.reference_attention(q, k, v, "window=9,sink=3", return_lse=True)
    w = torch.randn_like(lse)
    g = torch.autograd.grad((out.sum() + (lse * w).sum()), (q, k, v))
    rg = torch.autograd.grad((ref.sum() + (ref_lse * w.double()).sum()), (q, k, v))
    for a, b_ in zip(g, rg):
        assert (a.double() - b_).norm() / b_.norm() < 1e-4


def test_gradient_through_the_lse_alone(device):
    """Only the LSE is used: the output's gradient arrives as None (not materialised zeros)."""
    q, k, v, _ = make_inputs(1, 2, 1, 70, 32, torch.float32, device)
    _, lse = msa.attention(q, k, v, "window=9,sink=3", return_lse=True)
    _, ref_lse = msa.reference_attention(q, k, v, "window=9,sink=3", return_lse=True)
    w = torch.randn_like(lse)
    g = torch.autograd.grad((lse * w).sum(), (q, k, v), allow_unused=True)
    rg = torch.autograd.grad((ref_lse * w.double()).sum(), (q, k, v), allow_unused=True)
    for a, b_ in zip(g, rg):
        want = torch.zeros_like(a, dtype=torch.float64) if b_ is None else b_   # v: no LSE gradient
        assert (a.double() - want).norm() <= 1e-4 * max(want.norm(), 1e-30) + (1e-6 if b_ is None else 0)


def test_eager_calls_skip_the_dispatcher(device):
    """Eager calls go straight to the launchers (the custom ops' host cost decides short calls);
    torch.compile traces the custom ops (test_api / sparsity/test_inputs check those)."""
    q, k, v, _ = make_inputs(1, 2, 1, 40, 32, torch.float32, device)
    out = msa.attention(q, k, v, "window=9")
    assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"


def test_backward_is_deterministic(device):
    q, k, v, _ = make_inputs(1, 4, 2, 100, 32, torch.float32, device)
    runs = []
    for _ in range(2):
        out = msa.attention(q, k, v, "0-0:window=8;1-3:sink=4,window=3", deterministic=True)
        runs.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for a, b_ in zip(*runs):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("pattern", ["window=20,dilation=2,sink=37", "causal=false,global=7,sink=40,window=5",
                                     "sink=9,random=2,block=32", "0-0:sink=70;1-1:window=9,sink=3"])
def test_prefix_keys_split_over_query_chunks(pattern, device, monkeypatch):
    """The sink/global key tiles split their query rows over several programs (partial sums)."""
    monkeypatch.setattr(schedule, "PREFIX_CHUNK_ROWS", 64)
    assert schedule.prefix_chunk(300, 40, 64, 32) == 64
    check_attention(pattern, hq=2, hkv=1, n=300, device=device)


# ---- K/V loads: tensor descriptors (TMA) and pointers -------------------------------------------

@pytest.mark.parametrize("pattern", ["window=40", "window=30,dilation=3,sink=5", "causal=false,global=3,window=7",
                                     "sink=9,random=2,block=32", "0-1:sink=70;2-3:window=9,dilation=2",
                                     "window=8,topk=2,block=32"])
@pytest.mark.parametrize("tma", [True, False], ids=["descriptors", "pointers"])
def test_descriptor_and_pointer_loads(pattern, tma, device, monkeypatch):
    """The plain forward reads K/V through tensor descriptors where TMA can (Hopper, and the
    interpreter runs the same code), else through pointers: both against the reference, with a
    head dim that pads BLOCK_D (columns past HEAD_DIM come back as zeros) and with GQA."""
    if tma and device == "cuda" and not tma_policy.device_has_tma(torch.cuda.current_device()):
        pytest.skip("no TMA before Hopper")
    with tma_policy.use_descriptors(tma):
        if "topk" in pattern:
            check_dynamic(pattern, b=1, hq=2, hkv=1, nq=100, device=device, make=topk_inputs(pattern))
            return
        check_attention(pattern, hq=4, hkv=2, n=131, d=24, dtype=torch.float16, device=device)
        check_attention(pattern, hq=4, hkv=4, n=97, d=32, device=device, layout="bnhd")


def test_descriptor_loads_need_aligned_layouts(device):
    """TMA needs 16-byte aligned bases and row strides: other layouts take the pointer loads,
    and give the reference's result."""
    if device == "cuda" and not tma_policy.device_has_tma(torch.cuda.current_device()):
        pytest.skip("no TMA before Hopper")
    q, k, v, _ = make_inputs(1, 2, 1, 50, 32, torch.float16, device)
    assert tma_policy.use_tma(k, v)
    # k's base 2 bytes past an aligned address
    k_off = torch.randn(50 * 32 + 1, device=device).to(torch.float16)[1:].view(1, 1, 50, 32).requires_grad_()
    assert not tma_policy.layout_ok(k_off) and not tma_policy.use_tma(k_off, v)
    # one unaligned operand of a kernel (here q of the forward) and none of them uses descriptors
    assert not tma_policy.use_tma(k_off, q, v) and tma_policy.use_tma(q, k, v)
    # head dim 20 in fp16: rows 40 bytes apart
    q20, k20, v20, _ = make_inputs(1, 2, 1, 50, 20, torch.float16, device)
    assert not tma_policy.use_tma(k20, v20)
    for args in ((q, k_off, v), (q20, k20, v20)):
        out = msa.attention(*args, "window=9,sink=2")
        ref = msa.reference_attention(*args, "window=9,sink=2")
        assert (out.double() - ref).norm() / ref.norm() < 5e-3


def test_the_descriptor_allocator_reaches_every_thread():
    """Triton keeps its allocator in a context variable: a thread of its own (the autograd
    engine's backward thread on a GPU) starts without the one set elsewhere, so the launch path
    sets it where it runs. A once-per-process flag broke every GPU backward with descriptors
    ("no allocator was set", H200, 2026-12-03) while the CPU suite, whose backward runs on the
    calling thread, passed."""
    import threading

    from triton.runtime._allocation import NullAllocator, _allocator

    tma_policy._ensure_allocator()
    assert not isinstance(_allocator.get(), NullAllocator)
    seen = []

    def worker():
        before = isinstance(_allocator.get(), NullAllocator)
        tma_policy._ensure_allocator()
        seen.append((before, isinstance(_allocator.get(), NullAllocator)))
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [(True, False)]


# ---- the window band's dS through scratch (MSA_BWD_SCRATCH_BYTES) -------------------------------

@pytest.mark.parametrize("pattern", ["window=40", "window=30,dilation=3,sink=5", "causal=false,window=7,sink=3",
                                     "window=20,dilation=2,sink=37", "causal=false,window=45,dilation=2",
                                     "window=70,sink=5"])
@pytest.mark.parametrize("tma", [True, False], ids=["descriptors", "pointers"])
def test_scratch_backward(pattern, tma, device, monkeypatch):
    """With a scratch limit the dk/dv kernel stores the band's dS^T tiles (TMA stores, or
    pointers) and dq reads them: one product a block. Against the reference with GQA, a padded
    head dim, fp16 and a transposed layout; keys below the prefix and past the sequence share
    tiles with the band's keys (the sink and odd lengths)."""
    if tma and device == "cuda" and not tma_policy.device_has_tma(torch.cuda.current_device()):
        pytest.skip("no TMA before Hopper")
    monkeypatch.setenv("MSA_BWD_SCRATCH_BYTES", str(1 << 30))
    seen = spy_scratch(monkeypatch)
    with tma_policy.use_descriptors(tma):
        check_attention(pattern, hq=4, hkv=2, n=131, d=24, dtype=torch.float16, device=device)
        check_attention(pattern, hq=4, hkv=4, n=97, d=32, device=device, layout="bnhd")
    assert seen and all(s is not None for s in seen)


@pytest.mark.parametrize("cfg", [
    LaunchConfig(FwdConfig(16, 32, 4, 1), BwdConfig(16, 32, 4, 1, 32, 16, 4, 1)),
    LaunchConfig(FwdConfig(64, 16, 4, 1), BwdConfig(64, 16, 4, 1, 16, 64, 4, 1)),
], ids=["bm16-bn32", "bm64-bn16"])
@pytest.mark.parametrize("pattern", ["window=21,dilation=2,sink=5", "causal=false,window=40"])
def test_scratch_backward_block_shapes(pattern, cfg, device, monkeypatch):
    """dq's tiles on the scratch path are the dk/dv kernel's (block_m1 x block_n1), taller and
    wider than each other and than the window."""
    monkeypatch.setenv("MSA_BWD_SCRATCH_BYTES", str(1 << 30))
    seen = spy_scratch(monkeypatch)
    with use_config(cfg):
        check_attention(pattern, n=150, device=device)
    assert seen and all(s is not None for s in seen)


def test_scratch_backward_chunks_heads_and_falls_back(device, monkeypatch):
    """A limit of two KV heads' tiles: chunks of whole KV heads, each its own dk/dv and dq
    launches; below one KV head's tiles, and with the limit 0 (the default), dq recomputes."""
    from msa_codegen.pattern.lowering import lower
    from msa_codegen.plan import plan_for

    b, hq, hkv, n = 2, 6, 3, 100
    cfg = plan_for("causal", torch.device(device), torch.float32, 32, 1, 1, 0).config
    plan = lower(msa.parse("window=20").groups[0].spec)
    per_head = schedule.seq_tiles(plan, n, cfg.bwd.block_n1, False) * schedule.ds_slots(plan, n, cfg.bwd.block_m1, cfg.bwd.block_n1) \
        * cfg.bwd.block_n1 * cfg.bwd.block_m1
    seen = spy_scratch(monkeypatch)
    for limit, want in [(2 * 2 * b * per_head * 4, 4), (2 * b * per_head * 4 - 1, None), (0, None)]:
        monkeypatch.setenv("MSA_BWD_SCRATCH_BYTES", str(limit))
        check_attention("window=20", b=b, hq=hq, hkv=hkv, n=n, device=device)
        got = seen[-1]
        assert (got and got[2]) == want, (limit, got)
    monkeypatch.delenv("MSA_BWD_SCRATCH_BYTES")
    check_attention("window=20", b=1, hq=2, hkv=1, n=n, device=device)
    assert seen[-1] is None


def test_scratch_backward_head_groups(device, monkeypatch):
    """Head groups whose KV head is shared (partial dk/dv sums per group) each take the scratch
    path in one chunk."""
    monkeypatch.setenv("MSA_BWD_SCRATCH_BYTES", str(1 << 30))
    seen = spy_scratch(monkeypatch)
    check_attention("0-0:window=8;1-3:sink=4,window=3", hq=4, hkv=2, n=100, device=device)
    assert [s is not None for s in seen] == [True, True]


def test_scratch_limit_must_be_a_byte_count(monkeypatch):
    from msa_codegen.kernels.schedule import bwd_scratch_limit

    monkeypatch.setenv("MSA_BWD_SCRATCH_BYTES", "8GiB")
    with pytest.raises(ValueError, match="integer number of bytes"):
        bwd_scratch_limit()
    monkeypatch.setenv("MSA_BWD_SCRATCH_BYTES", "-1")
    with pytest.raises(ValueError, match=">= 0"):
        bwd_scratch_limit()
    monkeypatch.setenv("MSA_BWD_SCRATCH_BYTES", "")
    assert bwd_scratch_limit() == 0


@pytest.mark.parametrize("causal", [True, False])
def test_scratch_slots_cover_both_bands(causal):
    """The slot arithmetic of the scratch path, in Python: the dk/dv kernel's W band of every
    key tile fits the row of schedule.ds_slots slots, and every key block of every dq tile's band
    finds its tile at a slot that the key tile's band wrote (the kernels' own formulas)."""
    import itertools

    from msa_codegen.pattern.lowering import lower

    cdiv = schedule.cdiv
    for w, dil, n, bm, bn, prefix in itertools.product([1, 5, 16, 40, 100], [1, 3], [1, 33, 200],
                                                       [16, 32, 64], [16, 64], [0, 7]):
        spec = msa.parse(f"causal={str(causal).lower()},window={w},dilation={dil}" + (f",sink={prefix}" if prefix else "")).groups[0].spec
        plan = lower(spec)
        slots = schedule.ds_slots(plan, n, bm, bn)
        for r in range(dil):
            n_r = (n - r + dil - 1) // dil
            own = (max(prefix - r, 0) + dil - 1) // dil

            def dkdv_band(b0):
                lo_edge = b0 if causal else max(b0 - w + 1, 0)
                hi_edge = min(b0 + bn + w - 1, n_r)
                lo = lo_edge // bm * bm
                return lo, cdiv(max(hi_edge - lo, 0), bm)

            for b0 in range(0, n_r, bn):
                assert dkdv_band(b0)[1] <= slots, (w, dil, n, bm, bn, b0)
            for a0 in range(0, n_r, bm):
                lo_edge = max(a0 - w + 1, own)
                hi_edge = min(a0 + bm, n_r) if causal else min(a0 + bm + w - 1, n_r)
                lo = max(lo_edge, 0) // bn * bn
                for blk in range(cdiv(max(hi_edge - lo, 0), bn)):
                    b0 = lo + blk * bn
                    q_lo, n_q = dkdv_band(b0)
                    assert q_lo % bm == 0 and 0 <= (a0 - q_lo) // bm < n_q, (w, dil, n, bm, bn, a0, b0)


# ---- on the GPU: larger shapes, bf16 / fp16 -----------------------------------------------------


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
    ("causal", 3001, 256, torch.bfloat16, 4, 2),
    ("window=1024", 8191, 256, torch.float16, 4, 4),
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


@pytest.mark.gpu
@pytest.mark.parametrize("pattern,n,d,dtype,hq,hkv", CASES,
                         ids=[f"{c[0]}-N{c[1]}-D{c[2]}-{str(c[3])[6:]}-{c[4]}x{c[5]}" for c in CASES])
def test_gpu_pattern(pattern, n, d, dtype, hq, hkv):
    _check(pattern, n, d, dtype, hq, hkv)


@pytest.mark.gpu
def test_gpu_bnhd_layout():
    q, k, v, _ = make_inputs(2, 8, 2, 3000, 128, torch.bfloat16, "cuda", layout="bnhd")
    out = msa.attention(q, k, v, "window=256,dilation=2,sink=16")
    assert out.stride() == q.stride()
    ref = msa.reference_attention(q, k, v, "window=256,dilation=2,sink=16")
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("pattern,n,hq,hkv,d", FLEX_CASES,
                         ids=[f"{c[0]}-N{c[1]}-{c[2]}x{c[3]}-D{c[4]}" for c in FLEX_CASES])
@pytest.mark.parametrize("family", [None, "0"], ids=["automatic", "triton"])
def test_gpu_matches_flex_attention(pattern, n, hq, hkv, d, family, monkeypatch):
    """FlexAttention with the same mask as a second oracle, at the benchmark shapes (shorter N):
    the family ``attention`` chooses (``MSA_CODEGEN_GLUON`` unset) and the Triton one."""
    if family is None:
        monkeypatch.delenv(gluon.ENV)
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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
    ("window=1024", 8191, 256, torch.float16, 4, 4),
]


@pytest.mark.gpu
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
