"""MSA against its float64 reference: selection, output, KL and every gradient.

CPU: the real kernels in Triton's interpreter, float32, small odd sizes. GPU (marker ``gpu``):
bfloat16 at larger N, and a small model trained for 10 steps with the kernels and with the
reference from identical weights.

Proxy inputs are drawn on a grid of quarters: their scores are exact in float32 and bfloat16
alike, so the selection is exactly the reference's (ties included, and there are many), and the
comparisons of the attention are not disturbed by near-ties decided differently.
"""
import math

import pytest
import torch

import msa_codegen as msa
from msa_codegen.msa import launch, reference_select

from helpers import run_sm90_script


def grid(*shape, device="cpu", dtype=torch.float32):
    return (torch.randint(-4, 5, shape, device=device).to(dtype) / 4)


def rel(a, b):
    """Relative error, with a floor of 1e-2 per element (RMS) (a gradient that is exactly zero, as
    dq at N=1, is then judged by its absolute rounding)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / (b.norm() + 1e-2 * b.numel() ** 0.5)).item()


def run_both(q, k, v, qp, kp, top_k, **kw):
    """Our (out, kl, grads) and the reference's, from one random output gradient and a KL weight."""
    g = torch.randn_like(q)
    w = 2.5
    leaves = (q, k, v, qp, kp)
    out, kl = msa.msa_attention(q, k, v, qp, kp, top_k, return_kl=True, **kw)
    ((out.float() * g.float()).sum() + w * kl).backward()
    ours = [out, kl] + [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    ro, rkl = msa.reference_msa(q, k, v, qp, kp, top_k, **kw)
    ((ro * g.double()).sum() + w * rkl).backward()
    ref = [ro, rkl] + [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return ours, ref


NAMES = ["out", "kl", "dq", "dk", "dv", "dq_proxy", "dk_proxy"]

# (N, H, Hkv, Hp, Hpk, D, Dp, block, top_k, documents)
CASES = [
    pytest.param(127, 4, 2, 2, 1, 32, 16, 64, 128, False, id="n127-gqa-hp2/1-block64"),
    pytest.param(200, 4, 4, 1, 1, 16, 32, 64, 64, False, id="n200-k1-proxy-spans-kv-heads"),
    pytest.param(257, 6, 3, 3, 3, 24, 16, 128, 256, False, id="n257-h6-dp16-d24-block128"),
    pytest.param(1, 2, 1, 2, 2, 16, 16, 64, 128, False, id="n1"),
    pytest.param(190, 4, 1, 4, 2, 32, 32, 64, 192, True, id="n190-docs-mqa"),
    pytest.param(129, 2, 2, 2, 1, 80, 48, 128, 128, False, id="n129-d80-dp48-k1"),
    pytest.param(100, 2, 1, 1, 1, 160, 32, 64, 128, False, id="n100-d160-key-sub-blocks"),
    # proxy groups of 3 heads over KV groups of 4: the second spans two KV heads (SPAN 2), the last
    # lies in the last KV head alone, whose second span step has no KV head to read
    pytest.param(177, 12, 3, 4, 2, 16, 32, 128, 384, False, id="n177-h12-kv3-hp4-last-group-in-the-last-kv-head"),
    # proxy groups of 6 heads over KV groups of 4: each spans two KV heads unevenly (4 + 2, 2 + 4
    # heads), so a program's tile starts at a head inside its group and holds fewer rows than GP
    pytest.param(150, 12, 3, 2, 1, 16, 16, 64, 128, False, id="n150-h12-kv3-hp2-uneven-spans"),
]


def _inputs(n, h, hkv, hp, hpk, d, dp, device, dtype):
    mk = lambda *s: torch.randn(*s, device=device, dtype=dtype)  # noqa: E731
    q, k, v = mk(1, h, n, d), mk(1, hkv, n, d), mk(1, hkv, n, d)
    qp, kp = grid(1, hp, n, dp, device=device, dtype=dtype), grid(1, hpk, n, dp, device=device, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, qp, kp)]


def _docs(n, device):
    return torch.tensor([0, n // 3, n // 3 + 5, n], dtype=torch.int32, device=device)


@pytest.mark.parametrize("n,h,hkv,hp,hpk,d,dp,block,top_k,docs", CASES)
@pytest.mark.parametrize("warmup", [False, True], ids=["selected", "warmup"])
def test_matches_reference(device, n, h, hkv, hp, hpk, d, dp, block, top_k, docs, warmup):
    if device.type == "cuda":
        pytest.skip("the GPU variant is test_gpu_bf16_matches_reference")
    q, k, v, qp, kp = _inputs(n, h, hkv, hp, hpk, d, dp, device, torch.float32)
    cu = _docs(n, device) if docs else None
    ours, ref = run_both(q, k, v, qp, kp, top_k, block=block, cu_seqlens=cu, warmup=warmup)
    errs = {name: rel(a, b) for name, a, b in zip(NAMES, ours, ref)}
    assert all(e < 1e-4 for e in errs.values()), errs
    if n > block:
        assert ours[1].item() > 0 and ours[5].abs().sum() > 0   # a KL that teaches something


@pytest.mark.parametrize("n,h,hkv,hp,hpk,rows", [
    # proxy groups of 6 over KV groups of 4 (shares 4 + 2, 2 + 4) in chunks of 2: the second chunk
    # of a 2-head share is empty
    pytest.param(150, 12, 3, 2, 1, 32, id="uneven-spans-in-chunks-of-2"),
    # 16 heads on one KV head at the default rows: forward chunks of 8, backward chunks of 4
    pytest.param(140, 16, 1, 1, 1, None, id="g16-default-rows"),
    # a share of 6 heads in chunks of 4 and 2
    pytest.param(130, 6, 1, 1, 1, 64, id="share-6-in-chunks-of-4"),
])
@pytest.mark.parametrize("apart", [pytest.param(False, id="one-launch"), pytest.param(True, id="two-launches")])
def test_head_chunks_match_reference(device, n, h, hkv, hp, hpk, rows, apart, monkeypatch):
    """A KV head's share of a proxy group larger than a tile's rows / 16 is cut into chunks, each
    its own program (``launch.head_chunk``); the exact KL's pass walks them in one. The backward
    of both gradients runs in one launch or, the teaching gradient apart, in two
    (``launch.teach_apart``)."""
    if device.type == "cuda":
        pytest.skip("the interpreter's check; the GPU runs the default rows' chunks in test_gpu_bf16_matches_reference "
                    "(n1100-g16-chunks)")
    calls = []
    real = launch.backward
    monkeypatch.setattr(launch, "teach_apart", lambda *a: apart)
    monkeypatch.setattr(launch, "backward", lambda do, *a, **kw: calls.append(do is not None) or real(do, *a, **kw))
    q, k, v, qp, kp = _inputs(n, h, hkv, hp, hpk, 16, 16, device, torch.float32)
    with launch.use_msa_config(launch.MsaConfig(fwd_rows=rows, bwd_rows=rows)):
        ours, ref = run_both(q, k, v, qp, kp, 128, block=64)
    errs = {name: rel(a, b) for name, a, b in zip(NAMES, ours, ref)}
    assert all(e < 1e-4 for e in errs.values()), errs
    assert ours[1].item() > 0 and ours[5].abs().sum() > 0
    assert calls == ([True, True, False] if apart else [True])   # the call, then main and teaching alone


def test_teaching_gradient_runs_apart_where_the_main_backward_chunks():
    """``launch.teach_apart``: the layouts whose main backward cuts a KV head's share into more
    chunks than the teaching gradient alone takes run it as a second launch (32 / 2 / 2: four
    chunks against one; 32 / 4 / 4: two against one); the bench's 16 / 2 / 4 (one chunk either
    way) and a group spanning KV heads (16 / 16 / 1) keep one launch."""
    def apart(h, hkv, hp):
        return launch.teach_apart(launch.Heads(h, hkv, hp, 1), 128, 128, 128, 16, False, False, torch.bfloat16)
    assert [apart(*layout) for layout in ((32, 2, 2), (32, 4, 4), (16, 2, 4), (16, 16, 1), (64, 1, 1))] == \
        [True, True, False, False, True]
    with launch.use_msa_config(launch.MsaConfig(bwd_rows=256)):       # 16 heads a chunk: one, as alone
        assert not apart(32, 2, 2)


@pytest.mark.parametrize("h", [pytest.param(16, id="g16-one-tile"), pytest.param(32, id="g32-two-chunks")])
def test_teaching_gradient_alone_matches_reference(device, h):
    """The KL's gradient without the main ones (a loss of kl alone: ``launch.backward`` without
    do) runs the teaching kernel on a KV head's whole share up to ``launch.TEACH_ROWS`` rows,
    where the main backward's 64 rows cut it into chunks of 4 heads: 16 heads on one KV head in
    one 256-row tile, 32 in two."""
    q, k, v, qp, kp = _inputs(140, h, 1, 1, 1, 16, 16, device, torch.float32)
    heads = launch.Heads(h, 1, 1, 1)
    assert launch.bwd_meta(heads, 16, 16, 64, 2, False, False, torch.float32, main=False)["CPS"] == h // 16
    _, kl = msa.msa_attention(q, k, v, qp, kp, 128, block=64, return_kl=True)
    (2.5 * kl).backward()
    ours = [qp.grad.clone(), kp.grad.clone()]
    assert q.grad is None and k.grad is None and v.grad is None
    qp.grad = kp.grad = None
    _, rkl = msa.reference_msa(q, k, v, qp, kp, 128, block=64)
    (2.5 * rkl).backward()
    errs = {name: rel(a, b) for name, a, b in zip(NAMES[5:], ours, [qp.grad, kp.grad])}
    assert all(e < 1e-4 for e in errs.values()), errs
    assert ours[0].abs().sum() > 0


@pytest.mark.parametrize("n,hp,hpk,dp,block,top_k,docs", [
    pytest.param(1, 1, 1, 16, 64, 192, False, id="n1"),
    pytest.param(300, 2, 1, 16, 64, 192, False, id="n300-hp2/1"),
    pytest.param(333, 2, 2, 64, 128, 256, True, id="n333-docs"),
    pytest.param(200, 1, 1, 16, 64, 1024, False, id="top_k-beyond-N"),
])
def test_select_matches_reference(device, n, hp, hpk, dp, block, top_k, docs):
    qp, kp = grid(1, hp, n, dp, device=device), grid(1, hpk, n, dp, device=device)
    cu = _docs(n, device) if docs else None
    idx = msa.msa_select(qp, kp, top_k, block, cu_seqlens=cu)
    assert idx.shape == (1, hp, n, top_k // block) and idx.dtype == torch.int32
    assert torch.equal(idx.cpu(), reference_select(qp, kp, top_k, block, cu_seqlens=cu).cpu())
    own = torch.arange(n, device=device) // block
    assert (idx == own[:, None]).any(-1).all()                # every query keeps its own block


def test_tiles_hold_one_kv_heads_share_of_a_proxy_group():
    """A tile's entry holds the heads of its proxy group that read one KV head: a group spanning
    several KV heads is split between programs, not padded to all of its heads (16 / 16 / 1 ran
    16 products a tile, one of them used, and 32 / 8 / 1 overflowed shared memory); a share
    larger than a tile's rows / 16 heads is split into chunks (16 heads made 256-row tiles)."""
    assert [launch.Heads(*hs).tile_heads for hs in
            [(16, 2, 4, 1), (16, 16, 1, 1), (32, 8, 1, 1), (32, 8, 4, 1), (12, 3, 2, 1), (12, 3, 4, 2), (16, 1, 1, 1)]] \
        == [4, 1, 4, 4, 4, 3, 16]
    assert [launch.Heads(*hs).span for hs in [(16, 2, 4, 1), (16, 16, 1, 1), (12, 3, 2, 1), (12, 3, 4, 2)]] == [1, 16, 2, 2]
    meta = launch.fwd_meta(launch.Heads(32, 8, 1, 1), 128, 128, 128, 16, False, False, torch.bfloat16)
    assert (meta["GP"], meta["BLOCK_Q"] * meta["GP"], launch.grid(7, meta)) == (4, 128, (7, 1, 8))
    # the exact KL's pass: a mean over the whole group, so one program walks the group's KV heads
    assert launch.grid(7, launch.pass2_meta(meta, True, True)) == (7, 1, 1)
    assert launch.grid(7, launch.pass2_meta(meta, True, False)) == (7, 1, 8)
    # a share above rows / 16 heads: chunks (forward 128 rows: 8 heads; backward 64 rows: 4)
    g16 = launch.Heads(32, 2, 2, 1)
    fwd = launch.fwd_meta(g16, 128, 128, 128, 16, False, False, torch.bfloat16)
    bwd = launch.bwd_meta(g16, 128, 128, 128, 16, False, False, torch.bfloat16)
    assert (fwd["GP"], fwd["BLOCK_Q"], fwd["CPS"], launch.grid(7, fwd), fwd["num_stages"]) == (8, 16, 2, (7, 1, 2), 3)
    assert (bwd["GP"], bwd["BLOCK_Q"], bwd["CPS"], bwd["num_stages"]) == (4, 16, 4, 3)
    assert launch.grid(7, bwd) == (7, 2, 4)                      # 64-key programs of a 128-key block
    assert launch.grid(7, launch.pass2_meta(fwd, False, True)) == (7, 1, 1)
    assert [launch.head_chunk(g, 64) for g in (1, 3, 4, 6, 16)] == [1, 3, 4, 4, 4]
    # the teaching gradient alone: the whole share in one tile up to TEACH_ROWS rows (chunks would
    # repeat the proxy's products), at the stages 256 rows allow even where a config asks for more
    teach = launch.bwd_meta(g16, 128, 128, 128, 16, False, False, torch.bfloat16, main=False)
    assert (teach["GP"], teach["BLOCK_Q"], teach["CPS"], teach["num_stages"]) == (16, 16, 1, 1)
    with launch.use_msa_config(launch.MsaConfig(bwd_stages=3)):
        assert launch.bwd_meta(g16, 128, 128, 128, 16, False, False, torch.bfloat16, main=False)["num_stages"] == 1
    g32 = launch.bwd_meta(launch.Heads(32, 1, 1, 1), 128, 128, 128, 16, False, False, torch.bfloat16, main=False)
    assert (g32["GP"], g32["CPS"]) == (16, 2)
    # a share that fits the main backward's rows keeps its tiles
    bench = launch.Heads(16, 2, 4, 1)
    assert launch.bwd_meta(bench, 128, 128, 128, 16, False, False, torch.bfloat16, main=False) == \
        launch.bwd_meta(bench, 128, 128, 128, 16, False, False, torch.bfloat16)
    # out + KL: half the entries where a tile has more than 16, else one stage (8 heads an entry)
    g4 = launch.fwd_meta(launch.Heads(16, 2, 4, 1), 128, 128, 128, 16, False, False, torch.bfloat16)
    g8 = launch.fwd_meta(launch.Heads(32, 4, 4, 1), 128, 128, 128, 16, False, False, torch.bfloat16)
    assert [(m["BLOCK_Q"], m["num_stages"]) for m in (launch.pass2_meta(g4, True, True),
                                                       launch.pass2_meta(g8, True, True))] == [(16, 3), (16, 1)]


def test_select_ties_go_to_the_lower_block(device):
    # every key has the same proxy score: the K chosen blocks are the own block and the lowest others
    n, block = 640, 64
    qp = torch.ones(1, 1, n, 16, device=device)
    kp = torch.ones(1, 1, n, 16, device=device)
    idx = msa.msa_select(qp, kp, 3 * block, block)
    i = 600                                                    # own block 9
    assert idx[0, 0, i].tolist() == [0, 1, 9]
    assert idx[0, 0, 70].tolist() == [0, 1, -1]                # only two blocks visible


def test_gradients_stay_on_their_side(device):
    q, k, v, qp, kp = _inputs(150, 4, 2, 2, 1, 16, 16, device, torch.float32)
    out, kl = msa.msa_attention(q, k, v, qp, kp, 128, block=64)
    assert kl.item() == 0.0                                    # without return_kl: a zero that teaches
    kl.backward(retain_graph=True)
    assert q.grad is None and k.grad is None and v.grad is None
    assert qp.grad.abs().sum() > 0 and kp.grad.abs().sum() > 0
    qp.grad = kp.grad = None
    out.sum().backward()
    assert qp.grad is None and kp.grad is None
    assert q.grad.abs().sum() > 0


def test_return_indices_is_msa_select(device):
    q, k, v, qp, kp = _inputs(130, 2, 1, 1, 1, 16, 16, device, torch.float32)
    _, _, idx = msa.msa_attention(q, k, v, qp, kp, 128, block=64, return_indices=True)
    assert torch.equal(idx, msa.msa_select(qp, kp, 128, 64))


@pytest.mark.parametrize("change,match", [
    (dict(h=6, hp=4), "multiple of proxy heads"),
    (dict(h=4, hkv=3), "multiple of key/value heads"),
    (dict(hp=2, hpk=3), "multiple of proxy key heads"),
    (dict(top_k=100), "multiple of block"),
    (dict(block=32), "block must be one of"),
    (dict(n_proxy=64), "sequence length mismatch"),
    (dict(b_proxy=2), "batch mismatch"),
])
def test_bad_input_says_what_was_expected(change, match):
    p = dict(h=4, hkv=2, hp=2, hpk=1, top_k=128, block=64, n_proxy=96, b_proxy=1)
    p.update(change)
    q = torch.randn(1, p["h"], 96, 16)
    k = v = torch.randn(1, p["hkv"], 96, 16)
    qp = torch.randn(p["b_proxy"], p["hp"], p["n_proxy"], 16)
    kp = torch.randn(p["b_proxy"], p["hpk"], p["n_proxy"], 16)
    with pytest.raises(ValueError, match=match):
        msa.msa_attention(q, k, v, qp, kp, p["top_k"], block=p["block"])


def test_bad_types():
    q = k = v = torch.randn(1, 2, 64, 16)
    qp = kp = torch.randn(1, 1, 64, 16)
    for flag in ("warmup", "return_kl", "return_indices"):
        with pytest.raises(TypeError, match=f"{flag} must be True or False, got 'yes'"):
            msa.msa_attention(q, k, v, qp, kp, 64, block=64, **{flag: "yes"})
    with pytest.raises(TypeError, match="q_proxy must be a torch.Tensor"):
        msa.msa_attention(q, k, v, None, torch.randn(1, 1, 64, 16), 64, block=64)
    with pytest.raises(TypeError, match="int32/int64"):
        msa.msa_attention(q, k, v, torch.randn(1, 1, 64, 16), torch.randn(1, 1, 64, 16), 64, block=64,
                          cu_seqlens=torch.tensor([0.0, 64.0]))


def test_kernels_compile_for_sm90(tmp_path):
    """The kernels through Triton's GPU compiler (sm_90, bundled ptxas) with the launchers' tile
    sizes, within shared memory; no GPU needed."""
    r = run_sm90_script("msa/aot_msa.py")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


# ---------------------------------------------------------------- GPU, bfloat16

@pytest.mark.gpu
@pytest.mark.parametrize("n,h,hkv,hp,hpk,d,dp,block,top_k,docs", [
    pytest.param(4096, 16, 2, 4, 1, 128, 128, 128, 1024, False, id="n4096-issue-heads"),
    pytest.param(3001, 8, 8, 2, 1, 64, 32, 64, 512, True, id="n3001-docs-d64-dp32"),
    pytest.param(2049, 4, 2, 1, 1, 256, 64, 128, 2048, False, id="n2049-d256-proxy-spans-kv"),
    pytest.param(1500, 12, 3, 4, 2, 64, 64, 128, 512, False, id="n1500-h12-kv3-hp4-last-group-in-the-last-kv-head"),
    # 16 heads on one KV head: the forward in two chunks of 8, the backward in four of 4, the exact
    # KL's pass walking them, warm-up's teaching gradient alone in one 256-row tile
    pytest.param(1100, 16, 1, 1, 1, 128, 64, 128, 512, False, id="n1100-g16-chunks"),
])
@pytest.mark.parametrize("warmup", [False, True], ids=["selected", "warmup"])
def test_gpu_bf16_matches_reference(n, h, hkv, hp, hpk, d, dp, block, top_k, docs, warmup):
    dev = torch.device("cuda")
    q, k, v, qp, kp = _inputs(n, h, hkv, hp, hpk, d, dp, dev, torch.bfloat16)
    cu = _docs(n, dev) if docs else None
    ours, ref = run_both(q, k, v, qp, kp, top_k, block=block, cu_seqlens=cu, warmup=warmup)
    errs = {name: rel(a, b) for name, a, b in zip(NAMES, ours, ref)}
    assert all(e < 2e-2 for e in errs.values()), errs


@pytest.mark.gpu
def test_gpu_select_at_32k_matches_reference():
    dev = torch.device("cuda")
    n = 32768
    qp, kp = grid(1, 1, n, 64, device=dev, dtype=torch.bfloat16), grid(1, 1, n, 64, device=dev, dtype=torch.bfloat16)
    idx = msa.msa_select(qp, kp, 2048, 128)
    assert torch.equal(idx, reference_select(qp, kp, 2048, 128))


def _rope(x, base=10000.0):
    n, d = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = torch.arange(n, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class _Layer(torch.nn.Module):
    """Main and proxy projections with RoPE, MSA, an output projection."""

    def __init__(self, dim=128, h=4, hkv=2, hp=2, hpk=1, d=32, dp=16):
        super().__init__()
        self.h, self.hkv, self.hp, self.hpk, self.d, self.dp = h, hkv, hp, hpk, d, dp
        self.wq = torch.nn.Linear(dim, h * d, bias=False)
        self.wk = torch.nn.Linear(dim, hkv * d, bias=False)
        self.wv = torch.nn.Linear(dim, hkv * d, bias=False)
        self.wqp = torch.nn.Linear(dim, hp * dp, bias=False)
        self.wkp = torch.nn.Linear(dim, hpk * dp, bias=False)
        self.wo = torch.nn.Linear(h * d, dim, bias=False)

    def forward(self, x, attn):
        b, n, _ = x.shape
        heads = lambda t, hh, dd: t.view(b, n, hh, dd).transpose(1, 2)  # noqa: E731
        q = _rope(heads(self.wq(x), self.h, self.d))
        k = _rope(heads(self.wk(x), self.hkv, self.d))
        v = heads(self.wv(x), self.hkv, self.d)
        qp = _rope(heads(self.wqp(x), self.hp, self.dp))
        kp = _rope(heads(self.wkp(x), self.hpk, self.dp))
        out, kl = attn(q, k, v, qp, kp)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1).to(x.dtype)), kl


@pytest.mark.gpu
def test_gpu_training_parity_10_steps():
    """10 Adam steps with the kernels (bf16) and with the float64 reference from the same weights."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    n, dim = 1024, 128
    x = torch.randn(1, n, dim, device=dev)
    target = torch.randn(1, n, dim, device=dev)
    base = _Layer(dim).to(dev)
    models = {"kernel": base, "reference": _Layer(dim).to(dev)}
    models["reference"].load_state_dict(base.state_dict())

    def kernel_attn(q, k, v, qp, kp):
        bf = lambda t: t.to(torch.bfloat16)  # noqa: E731
        return msa.msa_attention(bf(q), bf(k), bf(v), bf(qp), bf(kp), 256, block=64, return_kl=True)

    def reference_attn(q, k, v, qp, kp):
        # the reference on the same bf16-rounded inputs, computed in float64
        bf = lambda t: t.to(torch.bfloat16).to(torch.float64)  # noqa: E731
        return msa.reference_msa(bf(q), bf(k), bf(v), bf(qp), bf(kp), 256, block=64)

    attn = {"kernel": kernel_attn, "reference": reference_attn}
    opts = {name: torch.optim.Adam(m.parameters(), lr=1e-3) for name, m in models.items()}
    kls = {name: [] for name in models}
    for _ in range(10):
        for name, m in models.items():
            y, kl = m(x, attn[name])
            loss = torch.nn.functional.mse_loss(y.float(), target) + kl.float()
            opts[name].zero_grad()
            loss.backward()
            opts[name].step()
            kls[name].append(kl.item())
    for (pn, a), b in zip(models["kernel"].named_parameters(), models["reference"].parameters()):
        assert rel(a.detach(), b.detach()) < 1e-2, pn
    assert all(math.isclose(a, b, rel_tol=2e-2) for a, b in zip(kls["kernel"], kls["reference"])), kls
