"""GPU names as the tuning database keys them.

A CUDA device name ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB") is
normalized to a short name (``h200``, ``h100``, ``a100``); an unknown device becomes a
lowercase slug of its name. The compute capability is kept beside the name (``"9.0"``): rows
measured on another GPU of the same capability are the lookup's third choice.

Without CUDA the kernels run in Triton's interpreter; its "GPU" is ``cpu-interpreter``
with capability ``cpu`` (rows measured there are stored, but their timings mean nothing).
"""
from __future__ import annotations

import functools
import re

import torch

INTERPRETER = "cpu-interpreter"
INTERPRETER_CAPABILITY = "cpu"

# (regular expression on the lowercased device name, short name), first match wins: the
# more specific names come before the names they contain (a100 before a10, l40s before l40
# before l4). Any device whose name says H200 (GH200 included) is h200; likewise b200.
_RULES: tuple[tuple[str, str], ...] = (
    (r"b200", "b200"),
    (r"b100", "b100"),
    (r"h200", "h200"),
    (r"h100", "h100"),
    (r"h800", "h800"),
    (r"h20\b", "h20"),
    (r"a100", "a100"),
    (r"a800", "a800"),
    (r"a10g", "a10g"),
    (r"\ba10\b", "a10"),
    (r"a40\b", "a40"),
    (r"a30\b", "a30"),
    (r"l40s", "l40s"),
    (r"l40\b", "l40"),
    (r"\bl4\b", "l4"),
    (r"v100", "v100"),
    (r"\bt4\b", "t4"),
    (r"rtx\s*pro\s*6000", "rtx-pro-6000"),
    (r"rtx\s*(\d{4})", r"rtx\1"),
    (r"mi300x", "mi300x"),
    (r"mi250x?", "mi250"),
)

# Compute capability of the known names: lets ``msa-codegen which --gpu h100`` answer on a
# machine without that GPU (same-capability fallback included).
CAPABILITY: dict[str, str] = {
    "b200": "10.0", "b100": "10.0",
    "rtx5090": "12.0", "rtx-pro-6000": "12.0",   # consumer Blackwell: 99 KiB of shared memory per block
    "h200": "9.0", "h100": "9.0", "h800": "9.0", "h20": "9.0",
    "a100": "8.0", "a800": "8.0", "a30": "8.0",
    "a10g": "8.6", "a10": "8.6", "a40": "8.6",
    "l40s": "8.9", "l40": "8.9", "l4": "8.9", "rtx4090": "8.9",
    "v100": "7.0", "t4": "7.5",
    INTERPRETER: INTERPRETER_CAPABILITY,
}

KNOWN_GPUS: tuple[str, ...] = tuple(CAPABILITY)


def normalize(name: str) -> str:
    """Short GPU name of a device name: any "H200" device is ``h200``; unknown -> a lowercase slug."""
    text = " ".join(str(name).lower().replace("_", " ").split())
    if text in (INTERPRETER, "cpu", "interpreter"):
        return INTERPRETER
    for rule, short in _RULES:
        m = re.search(rule, text)
        if m:
            return m.expand(short)
    slug = re.sub(r"^(nvidia|amd|radeon)\s+", "", text)
    slug = re.sub(r"[^a-z0-9]+", "-", slug).strip("-")
    return slug or "unknown-gpu"


def is_known(name: str) -> bool:
    return normalize(name) in CAPABILITY


def capability_of(name: str) -> str | None:
    """Compute capability of a known GPU name (``"9.0"``), None when unknown."""
    return CAPABILITY.get(normalize(name))


@functools.lru_cache(maxsize=None)
def _cuda_gpu(index: int) -> tuple[str, str, str]:
    raw = torch.cuda.get_device_name(index)
    major, minor = torch.cuda.get_device_capability(index)
    return normalize(raw), f"{major}.{minor}", raw


def current_gpu(index: int | None = None) -> tuple[str, str] | None:
    """(short name, capability) of the current (or given) CUDA device; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    if index is None:
        index = torch.cuda.current_device()
    name, cap, _ = _cuda_gpu(index)
    return name, cap


def device_name(index: int | None = None) -> str | None:
    """The raw device name ("NVIDIA H200"), None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return _cuda_gpu(torch.cuda.current_device() if index is None else index)[2]


def gpu_of(device: torch.device | str) -> tuple[str, str]:
    """(short name, capability) the tuning database keys a tensor device by.

    A CUDA device -> its GPU; anything else (the CPU running Triton's interpreter) ->
    ``("cpu-interpreter", "cpu")``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        name, cap, _ = _cuda_gpu(device.index if device.index is not None else torch.cuda.current_device())
        return name, cap
    return INTERPRETER, INTERPRETER_CAPABILITY
