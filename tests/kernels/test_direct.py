"""kernels.direct: a compiled kernel is launched directly only under a signature that Triton
would specialize the same way; everything else goes through ``kern[grid](...)``.

The CPU tests drive ``direct.launch`` with a stand-in kernel and runtime (Triton's interpreter
has no compiled kernels); the ``gpu`` tests run the generated kernels both ways.
"""
import inspect
import types

import pytest
import torch

from msa_codegen.kernels import direct, gluon


class FakeCompiled:
    def __init__(self, kernel, n):
        self.kernel, self.n = kernel, n
        self.function, self.packed_metadata = f"function-{n}", f"metadata-{n}"

    def launch_metadata(self, grid, stream, *vals):
        return ("metadata", grid)

    @property
    def run(self):
        return lambda *a: self.kernel.log.append(("direct", self.n, a))


class FakeKernel:
    """``kern[grid](...)`` logs a JIT launch and returns a new compiled kernel."""

    def __init__(self):
        self.signature = inspect.signature(lambda x, y, n, scale, BLOCK, FLAG=False: None)
        self.pre_run_hooks = []
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.log.append(("jit", grid, args, kw))
            return FakeCompiled(self, len(self.log))
        return run


@pytest.fixture
def fake(monkeypatch):
    knobs = types.SimpleNamespace(
        runtime=types.SimpleNamespace(debug=False, launch_enter_hook="enter", launch_exit_hook="exit"),
        compilation=types.SimpleNamespace(instrumentation_mode=""))
    rt = direct._Runtime.__new__(direct._Runtime)
    rt.kernel_class, rt.knobs, rt.stream_of, rt.device = FakeKernel, knobs, (lambda d: 77), (lambda: 0)
    monkeypatch.setattr(direct, "_runtime", rt)
    monkeypatch.setattr(direct, "interpreting", lambda: False)
    monkeypatch.setattr(direct, "ENABLED", True)
    direct.clear()
    yield FakeKernel()
    direct.clear()


def kinds(kern):
    return [entry[0] for entry in kern.log]


def test_a_repeated_signature_launches_the_kept_kernel(fake):
    x, y = torch.randn(64), torch.randn(64)
    direct.launch(fake, (3, 2), x, y, 100, 0.5, BLOCK=16)
    assert kinds(fake) == ["jit"]
    x2, y2 = torch.randn(64), torch.randn(64)
    direct.launch(fake, (5, 1), x2, y2, 100, 0.25, BLOCK=16)
    assert kinds(fake) == ["jit", "direct"]
    _, n, a = fake.log[-1]
    assert n == 1   # the compiled kernel of the first launch
    # grid padded to three dims, the stream, the compiled kernel's function and metadata, the
    # launch metadata and hooks, then every parameter: the new tensors and float, the keyword,
    # the default of the one not given
    assert a[:9] == (5, 1, 1, 77, "function-1", "metadata-1", ("metadata", (5, 1)), "enter", "exit")
    assert a[9:11] == (x2, y2) and a[11:] == (100, 0.25, 16, False)


@pytest.mark.parametrize("change", ["int", "bool-for-int", "keyword", "dtype", "alignment", "device", "debug"])
def test_what_triton_specializes_on_takes_triton_s_path(fake, change, monkeypatch):
    x, y = torch.randn(64), torch.randn(64)
    direct.launch(fake, (1,), x, y, 16, 0.5, BLOCK=16)
    args, kw = [torch.randn(64), torch.randn(64), 16, 0.5], {"BLOCK": 16}
    if change == "int":
        args[2] = 17
    elif change == "bool-for-int":
        args[2] = True
        direct.launch(fake, (1,), x, y, 1, 0.5, BLOCK=16)   # 1 and True: two specializations
    elif change == "keyword":
        kw["BLOCK"] = 32
    elif change == "dtype":
        args[0] = torch.randn(64, dtype=torch.float64)
    elif change == "alignment":
        args[0] = torch.randn(65)[1:]   # 4 bytes past a 16-byte aligned base
        assert args[0].data_ptr() % 16 != 0
    elif change == "device":
        monkeypatch.setattr(direct._runtime, "device", lambda: 1)
    elif change == "debug":
        direct._runtime.knobs.runtime.debug = True
    direct.launch(fake, (1,), *args, **kw)
    assert kinds(fake)[-1] == "jit"
    direct.launch(fake, (1,), *args, **kw)   # and that signature is kept in turn
    assert kinds(fake)[-1] == "direct"


def test_a_call_site_that_moves_its_tensors_is_laid_out_again(fake):
    x, y = torch.randn(64), torch.randn(64)
    direct.launch(fake, (1,), x, y, 16, 0.5, BLOCK=16)
    direct.launch(fake, (1,), x, None, 16, 0.5, BLOCK=16)   # None where a tensor was
    direct.launch(fake, (1,), x, None, 16, 0.5, BLOCK=16)
    direct.launch(fake, (1,), 3, y, 16, 0.5, BLOCK=16)      # an int where a tensor was
    direct.launch(fake, (1,), x, y, 16, 0.5, BLOCK=16)
    assert kinds(fake) == ["jit", "jit", "direct", "jit", "jit"]


class FakeDescriptor:
    """A host-built tensor descriptor as the Gluon launchers pass them (a dataclass with a tensor:
    neither hashable nor comparable by value)."""
    __hash__ = None

    def __init__(self, base, shape, strides, block_shape, layout, padding="zero"):
        self.base, self.shape, self.strides = base, shape, strides
        self.block_shape, self.layout, self.padding = block_shape, layout, padding


@pytest.mark.parametrize("change", ["none", "block", "layout", "strides", "shape", "dtype", "alignment", "padding"])
def test_a_descriptor_argument_is_keyed_by_what_its_launch_depends_on(fake, change):
    def desc(**kw):
        a = dict(base=torch.randn(64, 32), shape=[64, 32], strides=[32, 1], block_shape=[16, 32], layout="nvmma-128")
        a.update(kw)
        return FakeDescriptor(**a)
    y = torch.randn(64)
    direct.launch(fake, (1,), desc(), y, 16, 0.5, BLOCK=16)
    kw = {"none": {}, "block": dict(block_shape=[32, 32]), "layout": dict(layout="nvmma-64"),
          "strides": dict(strides=[48, 1]), "shape": dict(shape=[48, 32]),
          "dtype": dict(base=torch.randn(64, 32, dtype=torch.float64)),
          "alignment": dict(base=torch.randn(64 * 32 + 1)[1:].view(64, 32)), "padding": dict(padding="nan")}[change]
    d = desc(**kw)
    direct.launch(fake, (1,), d, y, 16, 0.5, BLOCK=16)
    assert kinds(fake)[-1] == ("direct" if change == "none" else "jit")
    direct.launch(fake, (1,), d, y, 16, 0.5, BLOCK=16)
    assert kinds(fake)[-1] == "direct"
    assert fake.log[-1][2][9] is d   # the launcher gets the descriptor object itself
    direct.launch(fake, (1,), 3, y, 16, 0.5, BLOCK=16)         # an int where the descriptor was
    direct.launch(fake, (1,), x := torch.randn(4), y, 16, 0.5, BLOCK=16)   # a tensor there
    direct.launch(fake, (1,), d, y, 16, 0.5, BLOCK=16)
    assert kinds(fake)[-3:] == ["jit", "jit", "jit"] and x is not None
    direct.launch(fake, (1,), desc(**kw), y, 16, 0.5, BLOCK=16)
    assert kinds(fake)[-1] == "direct"


def test_off_switch_interpreter_and_hooks_take_triton_s_path(fake, monkeypatch):
    x, y = torch.randn(64), torch.randn(64)
    for _ in range(2):
        direct.launch(fake, (1,), x, y, 16, 0.5, BLOCK=16)
    assert kinds(fake) == ["jit", "direct"]
    for setting in ("off", "interpreter", "pre-run hook", "other class"):
        with monkeypatch.context() as m:
            if setting == "off":
                m.setattr(direct, "ENABLED", False)
            elif setting == "interpreter":
                m.setattr(direct, "interpreting", lambda: True)
            elif setting == "pre-run hook":
                m.setattr(fake, "pre_run_hooks", [print])
            else:
                m.setattr(direct._runtime, "kernel_class", int)
            direct.launch(fake, (1,), x, y, 16, 0.5, BLOCK=16)
            assert kinds(fake)[-1] == "jit", setting


def test_the_table_is_bounded(fake, monkeypatch):
    monkeypatch.setattr(direct, "MAX_ENTRIES", 3)
    x, y = torch.randn(64), torch.randn(64)
    for n in range(5):
        direct.launch(fake, (1,), x, y, n, 0.5, BLOCK=16)
    assert len(direct._compiled) <= 3


# ---- on a GPU: the generated kernels ------------------------------------------------------

@pytest.mark.gpu
def test_gpu_direct_launches_match_triton_s_and_skip_its_binding(monkeypatch):
    """Outputs and gradients bit-identical with and without direct launches; a repeated call
    launches without JITFunction.run; an unaligned view of the same shape (pointer loads, so
    only the alignment differs) gets its own compiled kernel and the right result."""
    import msa_codegen as msa
    from triton.runtime.jit import JITFunction
    from msa_codegen.kernels import tma as tma_policy
    from helpers import FLOOR, chunked_reference, make_inputs, rel_err

    monkeypatch.setenv(gluon.ENV, "0")   # the Triton kernels (test_gpu_gluon_launches_go_direct_and_match: Gluon's)
    pattern = "causal=false,window=200,sink=5"
    q, k, v, _ = make_inputs(2, 4, 2, 1500, 64, torch.bfloat16, "cuda")
    do = torch.randn_like(q)

    def run():
        out = msa.attention(q, k, v, pattern)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    calls = []
    real = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    direct.clear()
    first = run()
    n_first = len(calls)
    assert n_first >= 4   # forward, delta pass, dk/dv, dq (and the prefix tiles)
    again = run()
    assert len(calls) == n_first, "a repeated call went through JITFunction.run"
    monkeypatch.setattr(direct, "ENABLED", False)
    plain = run()
    for a, b, c in zip(first, again, plain):
        assert torch.equal(a, b) and torch.equal(a, c)
    monkeypatch.setattr(direct, "ENABLED", True)

    with tma_policy.use_descriptors(False):
        run()
        base = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
        q2 = base[1:].view(q.shape).copy_(q).requires_grad_()
        assert q2.data_ptr() % 16 != 0
        n_before = len(direct._compiled)
        out = msa.attention(q2, k, v, pattern)
        assert len(direct._compiled) > n_before
        ref = chunked_reference(q2, k, v, pattern, do)
        assert rel_err(out, ref[0]) <= FLOOR[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("pattern,docs", [("window=300", False), ("causal", True), ("topk=2", False)])
def test_gpu_gluon_launches_go_direct_and_match(monkeypatch, pattern, docs):
    """The Gluon family's launches (TMA descriptors among their arguments) through the kept
    compiled kernel: a repeated call goes without JITFunction.run and gives bit-identical
    outputs and gradients to Triton's path; a second tensor of another length gets its own
    kernel launch and a result that matches the reference."""
    import msa_codegen as msa
    from triton.runtime.jit import JITFunction
    from helpers import FLOOR, make_inputs, rel_err

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon family runs on compute capability 9.x only")
    monkeypatch.setenv(gluon.ENV, "1")

    def inputs(n):
        q, k, v, _ = make_inputs(1, 4, 2, n, 128, torch.bfloat16, "cuda")
        kw = {}
        if docs:
            kw["cu_seqlens"] = torch.tensor([0, n // 3, n // 3 + 7, n], dtype=torch.int32, device="cuda")
        if pattern.startswith("topk"):
            nb = -(-n // 128)
            rows = torch.stack([torch.arange(nb), torch.arange(nb) // 2], -1)   # own block, one before
            kw["block_indices"] = rows.to(torch.int32).expand(1, 2, nb, 2).contiguous().cuda()
        return q, k, v, torch.randn_like(q), kw

    q, k, v, do, kw = inputs(2000)
    ran = []
    real_f, real_b = gluon.forward, gluon.backward
    monkeypatch.setattr(gluon, "forward", lambda *a, **k: ran.append("f") or real_f(*a, **k))
    monkeypatch.setattr(gluon, "backward", lambda *a, **k: ran.append("b") or real_b(*a, **k))

    def run(q, k, v, do, kw):
        out = msa.attention(q, k, v, pattern, **kw)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    calls = []
    real = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    direct.clear()
    first = run(q, k, v, do, kw)
    assert ran == ["f", "b"]
    n_first = len(calls)
    again = run(q, k, v, do, kw)
    assert len(calls) == n_first, "a repeated Gluon call went through JITFunction.run"
    monkeypatch.setattr(direct, "ENABLED", False)
    plain = run(q, k, v, do, kw)
    for a, b, c in zip(first, again, plain):
        assert torch.equal(a, b) and torch.equal(a, c)
    monkeypatch.setattr(direct, "ENABLED", True)
    q2, k2, v2, do2, kw2 = inputs(1500)
    got = run(q2, k2, v2, do2, kw2)
    assert len(calls) > n_first
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q2, k2, v2))
    ref = msa.reference_attention(q64, k64, v64, pattern, **kw2)
    ref = (ref, *torch.autograd.grad(ref, (q64, k64, v64), do2.double()))
    for g, r in zip(got, ref):
        assert rel_err(g, r) <= FLOOR[torch.bfloat16]
