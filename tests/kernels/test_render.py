"""The compiler (msa_codegen.kernels.render): templates, files on disk, loaded modules."""
import torch

import msa_codegen as msa
from msa_codegen.kernels import render as codegen
from msa_codegen.pattern.lowering import lower


def _qkv(device, b=1, hq=2, hkv=1, n=32, d=32, dtype=torch.float32):
    return [torch.randn(b, h, n, d, device=device, dtype=dtype) for h in (hq, hkv, hkv)]


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
    """Which masked W-band loops are told their side of the band (one test there, test_launch's
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
    # a dense plan without prefix has no lower edge (its band starts at key 0), so that loop is
    # not rendered: compiled and never run, it made ptxas serialize the D=128 dq's wgmma
    assert parts("causal", "fwd") == ["PART_DIAG"]
    # dq's loops, then the dk/dv kernel's: one loop over a band of contiguous rows; a dilated
    # band's lower (diagonal) and upper (far edge) blocks, its inside in the second pass
    assert parts("causal", "bwd") == ["PART_DIAG", "PART_ANY"]
    assert parts("window=4096,dilation=2", "bwd") == ["PART_EDGE", "PART_DIAG", "PART_DIAG", "PART_EDGE"]

    def dkdv(pattern):
        src = codegen.render(lower(msa.parse(pattern).groups[0].spec), "bwd")
        return src[src.index("def msa_bwd_dkdv"):]
    for pattern, passes in (("window=4096", 1), ("window=4096,sink=64", 2)):
        body = dkdv(pattern)
        w = [line for line in body.splitlines() if "PHASE=PH_W" in line]
        assert len(w) == 1 and "MASKED=True, SPLIT=True" in w[0] and ", 0, n_blk, N, qk_scale, 0, 0, qb_lo, qb_hi," in w[0]
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
