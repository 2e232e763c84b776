"""The pattern term ``msa=T``: ``attention`` runs ``msa_attention`` on the msa head group and the
pattern kernels on the other groups; ``render`` prints MSA's kernels; ``msa-tune`` refuses it.

CPU: the real kernels in Triton's interpreter, float32, small sizes (an MSA call takes seconds
there). Proxy inputs on a grid of quarters, as in test_msa_attention.py: exact scores, so the
selection does not hang on rounding.
"""
import pytest
import torch

import msa_codegen as msa
from msa_codegen.cli import main as cli
from msa_codegen.cli import tune as tune_cli
from msa_codegen.kernels.render import MSA_KERNELS, kernel_hash
from msa_codegen.tuning import lookup as tuning_lookup

N, D, DP = 130, 16, 16   # 3 key blocks of 64: top 128 tokens = 2 blocks, so selection matters


def grid(*shape, device="cpu"):
    return (torch.randint(-4, 5, shape, device=device).float() / 4).requires_grad_()


def inputs(device, h, hkv, hp, hpk):
    q = torch.randn(1, h, N, D, device=device, requires_grad=True)
    k, v = (torch.randn(1, hkv, N, D, device=device, requires_grad=True) for _ in range(2))
    return q, k, v, grid(1, hp, N, DP, device=device), grid(1, hpk, N, DP, device=device)


def grads(out, kl, leaves, g):
    ((out * g).sum() + 3.0 * kl).backward()
    got = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return got


def test_whole_pattern_is_msa_attention(device):
    q, k, v, qp, kp = leaves = inputs(device, 4, 2, 2, 1)
    g = torch.randn(q.shape, device=device)
    out, kl = msa.attention(q, k, v, "msa=128,block=64", q_proxy=qp, k_proxy=kp, return_kl=True)
    assert kl.dim() == 0 and kl.dtype == torch.float32 and kl.item() > 0
    ours = [out.detach(), kl.detach()] + grads(out, kl, leaves, g)
    ro, rkl = msa.msa_attention(q, k, v, qp, kp, 128, block=64, return_kl=True)
    ref = [ro.detach(), rkl.detach()] + grads(ro, rkl, leaves, g)
    for name, a, b in zip(["out", "kl", "dq", "dk", "dv", "dq_proxy", "dk_proxy"], ours, ref):
        assert torch.equal(a, b), name


def test_mixed_msa_and_window(device):
    # heads 0-3 MSA (their KV heads 0-1), heads 4-7 a window (KV heads 2-3); Hp=2 for 4 heads
    q, k, v, qp, kp = leaves = inputs(device, 8, 4, 2, 1)
    g = torch.randn(q.shape, device=device)
    out, kl = msa.attention(q, k, v, "0-3:msa=128,block=64;4-7:window=32", q_proxy=qp, k_proxy=kp,
                            scale=0.3)
    assert out.shape == q.shape and kl.item() == 0   # return_kl=False: zero, the gradient still flows
    ours = [out.detach()] + grads(out, kl, leaves, g)

    parts = [t.detach()[:, sl].clone().requires_grad_() for t, sl in
             ((q, slice(0, 4)), (k, slice(0, 2)), (v, slice(0, 2)), (q, slice(4, 8)), (k, slice(2, 4)),
              (v, slice(2, 4)))]
    qa, ka, va, qb, kb, vb = parts
    qp2, kp2 = (t.detach().clone().requires_grad_() for t in (qp, kp))
    oa, kla = msa.msa_attention(qa, ka, va, qp2, kp2, 128, block=64, scale=0.3)
    ob = msa.attention(qb, kb, vb, "window=32", scale=0.3)
    ((oa * g[:, :4]).sum() + (ob * g[:, 4:]).sum() + 3.0 * kla).backward()
    ref = [torch.cat([oa, ob], 1).detach(), torch.cat([qa.grad, qb.grad], 1), torch.cat([ka.grad, kb.grad], 1),
           torch.cat([va.grad, vb.grad], 1), qp2.grad, kp2.grad]
    for name, a, b in zip(["out", "dq", "dk", "dv", "dq_proxy", "dk_proxy"], ours, ref):
        assert torch.equal(a, b), name


def test_mixed_keeps_bnhd_layout(device):
    # the window group first, the msa group after it; q given as (B, N, H, D).transpose(1, 2)
    q = torch.randn(1, N, 4, D, device=device).transpose(1, 2)
    k, v = (torch.randn(1, N, 2, D, device=device).transpose(1, 2) for _ in range(2))
    qp, kp = grid(1, 1, N, DP, device=device), grid(1, 1, N, DP, device=device)
    with torch.no_grad():
        out, _ = msa.attention(q, k, v, "0-1:window=8;2-3:msa=64,block=64", q_proxy=qp, k_proxy=kp)
        a = msa.attention(q[:, :2], k[:, :1], v[:, :1], "window=8")
        b, _ = msa.msa_attention(q[:, 2:], k[:, 1:], v[:, 1:], qp, kp, 64, block=64)
    assert out.transpose(1, 2).is_contiguous()
    assert torch.equal(out, torch.cat([a, b], 1))


def test_mixed_with_documents(device):
    # cu_seqlens reaches both kinds of heads: documents restart the selection and the window
    q, k, v, qp, kp = (t.detach() for t in inputs(device, 4, 2, 1, 1))
    cu = torch.tensor([0, 70, N], dtype=torch.int32, device=device)
    with torch.no_grad():
        out, kl = msa.attention(q, k, v, "0-1:msa=64,block=64;2-3:window=8", q_proxy=qp, k_proxy=kp,
                                cu_seqlens=cu, return_kl=True)
        a, akl = msa.msa_attention(q[:, :2], k[:, :1], v[:, :1], qp, kp, 64, block=64, cu_seqlens=cu,
                                   return_kl=True)
        b = msa.attention(q[:, 2:], k[:, 1:], v[:, 1:], "window=8", cu_seqlens=cu)
    assert torch.equal(out, torch.cat([a, b], 1)) and torch.equal(kl, akl)


def _small(device, h=4, hkv=2, hp=1, hpk=1):
    return [t.detach() for t in inputs(device, h, hkv, hp, hpk)]


@pytest.mark.parametrize("pattern,kwargs,exc,needle", [
    ("0-1:msa=128;2-3:msa=256", {}, ValueError, "exactly one msa group"),
    ("0-0:msa=128;1-3:window=4", {}, ValueError, "whole KV groups"),
    ("0-2:msa=128;3-3:window=4", {}, ValueError, "whole KV groups"),
    ("msa=128", {"q_proxy": None}, ValueError, "missing: q_proxy"),
    ("msa=128", {"k_proxy": None}, ValueError, "missing: k_proxy"),
    ("msa=128", {"return_lse": True}, ValueError, "return_lse"),
    ("msa=128", {"q_pos": torch.arange(N)}, ValueError, "q_pos"),
    ("window=4", {}, ValueError, "has no msa term"),
    ("window=4", {"q_proxy": None, "k_proxy": None, "return_kl": True}, ValueError, "return_kl"),
    ("msa=128,window=4", {}, msa.PatternError, "window does not combine"),
    ("msa=128,causal=false", {}, msa.PatternError, "msa attention is causal"),
    ("msa=100", {}, msa.PatternError, "multiple of block"),
], ids=["two-msa-groups", "misaligned-kv-start", "misaligned-kv-end", "no-q-proxy", "no-k-proxy", "return-lse",
        "positions", "proxies-without-msa", "return-kl-without-msa", "msa-window", "msa-bidirectional",
        "msa-not-multiple"])
def test_errors(device, pattern, kwargs, exc, needle):
    q, k, v, qp, kp = _small(device)
    kw = {"q_proxy": qp, "k_proxy": kp, **kwargs}
    kw = {name: x for name, x in kw.items() if x is not None}
    with pytest.raises(exc, match=needle):
        msa.attention(q, k, v, pattern, **kw)


def test_proxy_heads_must_divide_the_group(device):
    q, k, v, _, _ = _small(device, h=8, hkv=4)
    qp, kp = grid(1, 3, N, DP, device=device), grid(1, 1, N, DP, device=device)
    with pytest.raises(ValueError, match="must divide 4, got Hp=3"):
        msa.attention(q, k, v, "0-3:msa=128;4-7:window=4", q_proxy=qp, k_proxy=kp)


def test_torch_compile_refuses(device):
    q, k, v, qp, kp = _small(device)

    def f(q, k, v, qp, kp):
        return msa.attention(q, k, v, "msa=128", q_proxy=qp, k_proxy=kp)[0]

    with pytest.raises(NotImplementedError, match="torch.compile"):
        torch.compile(f, backend="aot_eager")(q, k, v, qp, kp)
    with pytest.raises(NotImplementedError, match="torch.compile"):   # an msa pattern without proxies too
        torch.compile(lambda q, k, v: msa.attention(q, k, v, "msa=128"), backend="aot_eager")(q, k, v)
    # fullgraph=True: Dynamo raises its own error where the refusal would break the graph; it
    # quotes ours as the reason
    def g(q, k, v, qp, kp):   # a code object of its own: f's frame is cached with its graph break
        return msa.attention(q, k, v, "msa=128", q_proxy=qp, k_proxy=kp)[0]

    with pytest.raises(Exception, match="does not run under torch.compile yet"):
        torch.compile(g, backend="aot_eager", fullgraph=True)(q, k, v, qp, kp)


def test_kernel_hash_and_lookup_of_msa_patterns():
    mixed = "0-3:msa=128,block=64;4-7:window=32"
    assert kernel_hash("msa=2048") == kernel_hash("msa=128,block=64")   # one kernel module for every msa
    assert kernel_hash(mixed) not in (kernel_hash("window=32"), kernel_hash("msa=128"))
    res = tuning_lookup.lookup(torch.device("cpu"), mixed, 64, torch.float32, 2, 1000)
    assert res.source == tuning_lookup.HEURISTIC


def test_explain_msa(device):
    q, k, v, _, _ = _small(device, h=8, hkv=4)
    text = str(msa.explain(q, k, v, "0-3:msa=128,block=64;4-7:window=32"))
    assert "msa_codegen/msa/kernels.py" in text and "heuristic default" in text and "heads 4-7" in text
    assert "2 heads per proxy head" in text


def test_render_prints_msa_kernels(capsys):
    assert cli.main(["render", "--pattern", "0-3:msa=2048;4-7:window=32"]) == 0
    text = capsys.readouterr().out
    assert "shared by every msa pattern" in text
    assert MSA_KERNELS.read_text() in text
    assert "# ---- heads 4-7 ----" in text and "@triton.jit" in text.split("# ---- heads 4-7 ----")[1]


def test_which_msa(capsys):
    assert cli.main(["which", "--pattern", "msa=2048", "--seqlen", "4096", "--head-dim", "128",
                     "--dtype", "bf16", "--gpu", "h200"]) == 0
    text = capsys.readouterr().out
    assert "MsaConfig" in text and "heads per proxy head" in text and "heuristic default" in text


def test_msa_tune_refuses(capsys):
    assert tune_cli.main(["--pattern", "0-3:msa=2048;4-7:window=32", "--heads", "8"]) == 2
    err = capsys.readouterr().err
    assert "msa" in err and "on its own" in err


@pytest.mark.gpu
def test_gpu_bf16_mixed_msa_and_window_match_reference():
    """``msa=T`` through ``attention`` on the GPU, bfloat16, against the float64 references of both
    groups: heads 0-7 MSA (KV heads 0-1, two proxy heads), heads 8-15 a window (KV heads 2-3)."""
    from msa_codegen.pattern.reference import reference_attention
    from test_msa_attention import rel

    dev, n, d, dp = torch.device("cuda"), 3001, 128, 64
    gen = torch.Generator(device=dev).manual_seed(1)
    mk = lambda *s: torch.randn(*s, device=dev, generator=gen).bfloat16().requires_grad_()  # noqa: E731
    q, k, v = mk(1, 16, n, d), mk(1, 4, n, d), mk(1, 4, n, d)
    qp, kp = (grid(1, h, n, dp, device=dev).detach().bfloat16().requires_grad_() for h in (2, 1))
    leaves = (q, k, v, qp, kp)
    g = torch.randn(q.shape, device=dev, generator=gen)
    out, kl = msa.attention(q, k, v, "0-7:msa=512;8-15:window=512", q_proxy=qp, k_proxy=kp, return_kl=True)
    ours = [out.detach(), kl.detach()] + grads(out.float(), kl, leaves, g)

    ro, rkl = msa.reference_msa(q[:, :8], k[:, :2], v[:, :2], qp, kp, 512)
    rw = reference_attention(q[:, 8:], k[:, 2:], v[:, 2:], "window=512")
    ref = [torch.cat([ro, rw], 1).detach(), rkl.detach()] + grads(torch.cat([ro, rw], 1), rkl, leaves, g.double())
    errs = {name: rel(a, b) for name, a, b in zip(["out", "kl", "dq", "dk", "dv", "dq_proxy", "dk_proxy"], ours, ref)}
    assert all(e < 2e-2 for e in errs.values()), errs
