"""Tensor-descriptor (TMA) loads: when the plain kernels' streamed operands use them.

The streamed operands of the plain kernels (K/V of the forward and dq kernels, Q/dO of the
dk/dv kernel) go through tensor descriptors on Hopper or newer, and in Triton's interpreter
(which runs the same code on the CPU), for layouts TMA can address; otherwise pointer loads.
``use_descriptors(False)`` switches descriptors off inside a block: tests use it to cover the
pointer loads that other GPUs and layouts get.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton

from ..config import BwdConfig
from .render import interpreting

# a plain module global (read on every launch), switched by ``use_descriptors``
_enabled = True
# the positional kernels' descriptors: on unless the environment variable
# MSA_CODEGEN_POSITIONAL_TMA=0 (or ``use_positional_descriptors(False)``) asks for pointer loads
_positional = os.environ.get("MSA_CODEGEN_POSITIONAL_TMA", "1") != "0"


@contextlib.contextmanager
def use_descriptors(enabled: bool):
    """Inside the block, the plain kernels use tensor descriptors only if ``enabled`` (and the
    device and layouts allow them); ``use_descriptors(False)`` forces pointer loads."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    try:
        yield
    finally:
        _enabled = previous


@contextlib.contextmanager
def use_positional_descriptors(enabled: bool):
    """Inside the block, the positional kernels (run-time positions or segments) stream their
    K/V (forward, dq) and Q/dO (dk/dv) through tensor descriptors over each loop call's rows
    where ``use_tma`` allows, if ``enabled``, else through pointer loads. On by default (the
    H200's 13-document rows: forward 0.89x, forward+backward 0.93x the pointer loads' time,
    2026-12-02, benchmarks/NOTES.md); ``MSA_CODEGEN_POSITIONAL_TMA=0`` turns it off for a process."""
    global _positional
    previous, _positional = _positional, bool(enabled)
    try:
        yield
    finally:
        _positional = previous


def positional_descriptors() -> bool:
    """Whether the positional kernels may use descriptors (``use_positional_descriptors``)."""
    return _positional


def tma_capable(device: torch.device, capability: str | None = None) -> bool:
    """Compute capability 9 or newer (tensor descriptors / TMA): the given ``"major.minor"``, else
    the device's; False for a CPU device or without a visible GPU.

    Consumer Blackwell (12.x) included: it has TMA, and Triton (3.6, 3.9) lowers descriptors to
    bulk tensor copies from capability 9 up (below, it rewrites them to pointer loads); an
    ahead-of-time compile for sm_120 checks it (tests/tuning/test_resources.py). Its shared memory
    is another matter: ``heuristics.hopper_sized``."""
    if device.type != "cuda":
        return False
    if capability is not None:
        try:
            return int(str(capability).split(".")[0]) >= 9
        except ValueError:
            return False
    if not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.lru_cache(maxsize=16)
def device_has_tma(device_index: int) -> bool:
    """``tma_capable`` of a CUDA device by index, cached for the launch path."""
    return tma_capable(torch.device("cuda", device_index))


def layout_ok(t: torch.Tensor) -> bool:
    """TMA's needs: unit stride along D, a 16-byte aligned base and 16-byte multiples as strides."""
    es = t.element_size()
    if t.shape[-1] * es % 16 == 0 and t.is_contiguous():
        # the common case, on every launch: a contiguous tensor's strides are multiples of its
        # last dim, so that one row being 16-byte sized is enough
        return t.data_ptr() % 16 == 0
    # (a broadcast gradient has stride 0 along N: no descriptor for that)
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st > 0 and st * es % 16 == 0 for st, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1))


def use_tma(*tensors: torch.Tensor) -> bool:
    """Tensor-descriptor loads of a kernel's operands: Hopper or newer (or Triton's interpreter),
    and layouts TMA can address for every one of them; else pointer loads."""
    if not _enabled:
        return False
    a = tensors[0]
    if a.device.type == "cuda":
        if not device_has_tma(a.device.index if a.device.index is not None else torch.cuda.current_device()):
            return False
        if a.element_size() != 2:
            # fp32 on the GPU keeps pointer loads: descriptors were measured and tested on the
            # H200 with bf16 / fp16 only (the interpreter runs the descriptor code for every dtype)
            return False
    elif not interpreting():
        return False
    if not all(layout_ok(t) for t in tensors):
        return False
    _ensure_allocator()
    return True


def descriptor_fault(bwd: BwdConfig) -> str | None:
    """Why a backward config cannot run on the descriptor (TMA) path, or None.

    dk/dv with 16-row query blocks and 4 pipeline stages stopped the H200 with "CUDA error:
    misaligned address" (a sticky error: the process's CUDA context is lost), while 16 rows with
    1-2 stages and 32 rows with 3-4 stages ran (H200, 2026-12-01; commit 30de50e). The cause,
    read from Triton 3.6's TTGIR: from 3 stages on, the LSE2 and delta tiles of the unmasked loop
    get num_stages - 1 shared-memory slots packed at their size, BLOCK_M1 * 4 bytes, and a TMA
    destination must be 128-byte aligned, so a 64-byte slot puts the next one off. The launcher
    raises this before launching and the tuner's filter drops these shapes."""
    if bwd.block_m1 < 32 and bwd.num_stages1 > 2:
        return (f"dk/dv block_m1={bwd.block_m1} with num_stages1={bwd.num_stages1}: query blocks under 32 "
                f"rows take at most 2 stages on the tensor-descriptor path (more faulted with a CUDA "
                f"misaligned address on an H200)")
    return None


def _descriptor_scratch(size: int, alignment: int, stream):
    # on-device descriptors live in a small global scratch per program, taken from Triton's allocator
    return torch.empty(size, dtype=torch.int8, device="cpu" if interpreting() else "cuda")


def _ensure_allocator() -> None:
    """Give Triton an allocator for the descriptors' scratch unless the caller already set one.
    Checked on every launch, not once: Triton keeps the allocator in a context variable, so the
    autograd engine's backward thread needs its own (a once-per-process flag failed there)."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
        unset = isinstance(_allocator.get(), NullAllocator)
    except (ImportError, AttributeError):   # another Triton layout: cannot tell, set ours
        unset = True
    if unset:
        triton.set_allocator(_descriptor_scratch)
