"""Launch a compiled kernel without Triton's per-launch binding.

``kern[grid](*args, **kw)`` goes through ``JITFunction.run`` on every launch: it specializes each
argument, builds the cache key from them, checks the kernel's globals and only then calls the
compiled kernel's launcher. Measured on the H200 machine (torch 2.11, Triton 3.6, 2026-12-03,
``causal=false,window=256`` B=8 H=12 N=4096 D=64): 37-89 us a launch of our kernels through
``JITFunction.run`` in a loop (88-123 us inside a forward+backward), against 10-23 us for the
launcher called directly; the four launches of a forward+backward took 0.42 of its 1.07 ms of
host time, which is longer than its kernels (0.90 ms).

``launch(kern, grid, *args, **kw)`` is ``kern[grid](*args, **kw)``. The first launch of a
*signature* goes through Triton (which compiles if it has to) and keeps the compiled kernel it
returns; later launches of that signature call its launcher. A signature is finer than
Triton's specialization, so a compiled kernel is reused only where Triton would have picked
the same one:

- every argument that is neither a tensor nor a float by value and type (Triton: an int's
  divisibility by 16, whether it is 1, its width; a bool or None is a constant); a float by its
  type (Triton passes it as fp32, unspecialized);
- every tensor by dtype and 16-byte alignment of its data pointer (what Triton specializes
  tensors on);
- every host-built tensor descriptor (the Gluon family's TMA descriptors) by its type, its
  tensor's dtype and alignment, its shape, strides, block shape, shared-memory layout and
  padding (Triton specializes on the dtype, block shape and layout; the compiled kernel's
  launcher builds the TMA descriptor from the object on every launch, as Triton's path does);
- the keyword arguments (constexprs and launch options) by value, the device, and the Triton
  knobs that enter its key (debug, instrumentation mode).

Triton's checks that this skips: the kernel's global values (the generated modules' globals
are constants) and pre-run hooks (a kernel with one always takes Triton's path). Launch hooks
(profilers) still see every launch. In Triton's interpreter (``TRITON_INTERPRET=1``) every launch
is ``kern[grid](...)``; ``MSA_CODEGEN_DIRECT_LAUNCH=0`` (read at import; benchmarks and tests set
``ENABLED``) does the same on a GPU.
"""
from __future__ import annotations

import functools
import operator
import os

import torch

from .render import interpreting

#: ``MSA_CODEGEN_DIRECT_LAUNCH=0``: every launch through ``JITFunction.run``
ENABLED = os.environ.get("MSA_CODEGEN_DIRECT_LAUNCH", "1") != "0"

#: signatures kept (a model's calls have a few dozen; past this many the table starts over)
MAX_ENTRIES = 4096

# signature -> (compiled kernel, the values of the parameters after the positional ones)
_compiled: dict = {}
# (kernel, number of positional args) -> getters of the tensors, the floats and the rest: where
# one call site's tensors and floats sit in its argument list, found on its first launch
_layouts: dict = {}


class _Runtime:
    """What a direct launch needs from Triton and torch, looked up once (tests put a fake here)."""

    def __init__(self):
        from triton import knobs
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction
        self.kernel_class = JITFunction
        self.knobs = knobs
        self.stream_of = driver.active.get_current_stream
        self.device = torch.cuda.current_device

    def options(self) -> tuple:
        # the knobs Triton adds to every launch's options (part of its cache key)
        c = self.knobs.compilation
        return (self.knobs.runtime.debug, c.instrumentation_mode, getattr(c, "fpsan_homomorphic_casts", None))


_runtime: _Runtime | None = None


def _getter(idx: list[int]):
    # a tuple of the args at idx (itemgetter of one index returns the item itself)
    if len(idx) > 1:
        return operator.itemgetter(*idx)
    return (lambda a: (a[idx[0]],)) if idx else (lambda a: ())


def _is_descriptor(a) -> bool:
    # a host-built tensor descriptor (Triton's or Gluon's TensorDescriptor): a tensor and a block
    return not isinstance(a, torch.Tensor) and hasattr(a, "base") and hasattr(a, "block_shape")


def _descriptor_key(d) -> tuple:
    return (type(d), d.base.dtype, d.base.data_ptr() % 16 == 0, tuple(d.shape), tuple(d.strides),
            tuple(d.block_shape), getattr(d, "layout", None), getattr(d, "padding", None),
            getattr(d, "round_f32_to_tf32", None))


def _split(args) -> tuple:
    """Getters of a call site's tensors, floats, tensor descriptors and other arguments, by position."""
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    floats = [i for i, a in enumerate(args) if type(a) is float]
    descs = [i for i, a in enumerate(args) if _is_descriptor(a)]
    taken = set(tensors + floats + descs)
    return (_getter(tensors), _getter(floats), _getter([i for i in range(len(args)) if i not in taken]),
            _getter(descs))


def signature(kern, args, kw, layout, device, options) -> tuple:
    """The key a launch's compiled kernel is kept under (module docstring); ``layout`` is
    ``_split(args)`` of the call site. Values with their types: 1, True and 1.0 are three keys,
    as they are three specializations for Triton; a float by its type alone (Triton passes it
    as fp32, unspecialized)."""
    get_t, get_f, get_r, get_d = layout
    rest = get_r(args)
    tensors = tuple((t.dtype, t.data_ptr() % 16 == 0) for t in get_t(args))
    return (kern, len(args), device, rest, tuple(map(type, rest)), tuple(map(type, get_f(args))), tensors,
            tuple(map(_descriptor_key, get_d(args))), tuple(kw.items()), tuple(map(type, kw.values())), options)


def _tail(kern, nargs: int, kw) -> tuple:
    """The values of the parameters after the positional ones, in signature order (the launcher
    takes every parameter): the keyword's value, else the parameter's default."""
    params = list(kern.signature.parameters.values())[nargs:]
    return tuple(kw[p.name] if p.name in kw else p.default for p in params)


def launch(kern, grid, *args, **kw) -> None:
    """``kern[grid](*args, **kw)``, through the kept compiled kernel once its signature has run."""
    global _runtime
    if not ENABLED or interpreting():
        kern[grid](*args, **kw)
        return
    if _runtime is None:
        _runtime = _Runtime()
    rt = _runtime
    if (not isinstance(kern, rt.kernel_class) or kern.pre_run_hooks
            or getattr(rt.knobs.runtime, "add_stages_inspection_hook", None) is not None):
        kern[grid](*args, **kw)
        return
    device, options = rt.device(), rt.options()
    layout = _layouts.get((kern, len(args)))
    hit = None
    if layout is not None:
        try:
            hit = _compiled.get(signature(kern, args, kw, layout, device, options))
        except (AttributeError, TypeError):   # a non-tensor where the call site had a tensor, a
            pass                               # descriptor where it had a value: lay it out again
    if hit is None:
        compiled = kern[grid](*args, **kw)
        layout = _layouts[(kern, len(args))] = _split(args)
        if len(_compiled) >= MAX_ENTRIES:
            _compiled.clear()
        _compiled[signature(kern, args, kw, layout, device, options)] = (compiled, _tail(kern, len(args), kw))
        return
    compiled, tail = hit
    stream = rt.stream_of(device)
    vals = (*args, *tail)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    enter, leave = rt.knobs.runtime.launch_enter_hook, rt.knobs.runtime.launch_exit_hook
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid, stream, *vals), enter, leave, *vals)


@functools.lru_cache(maxsize=16)
def unused_pointer(device) -> torch.Tensor:
    """An int32 tensor for a pointer argument the launched kernel never reads (a table of a plan
    without random / top-k blocks, the tile list of a closed order): one per device, not a fill
    kernel per call (keyed by the device object: str() of it on every launch was measurable host
    time)."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def clear() -> None:
    """Forget every kept kernel and call-site layout (tests)."""
    _compiled.clear()
    _layouts.clear()
