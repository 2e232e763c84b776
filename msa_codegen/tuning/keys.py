"""What a tuning row is keyed by, and the versions of what is running now.

Kept free of SQLAlchemy so that the hot path (``attention`` -> ``lookup_config``) imports it
cheaply; the database layer is imported only when a database file exists.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

DIRECTIONS = ("fwd", "bwd")
MIN_BUCKET = 1024

# dtype names as stored (torch's names without the "torch." prefix), and the short CLI spelling
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DTYPE_NAMES = tuple(DTYPES.values())


def bucket(seqlen: int) -> int:
    """The sequence-length bucket of a length: the power of two >= it, at least 1024."""
    n = int(seqlen)
    if n < 1:
        raise ValueError(f"sequence length must be >= 1, got {seqlen}")
    return max(MIN_BUCKET, 1 << (n - 1).bit_length())


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` / ``"bf16"`` / ``"bfloat16"`` -> ``"bfloat16"``."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).replace("torch.", "")
    else:
        name = DTYPES.get(str(dtype), str(dtype).replace("torch.", ""))
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of bf16, fp16, fp32 (bfloat16, float16, float32), got {dtype!r}")
    return name


def torch_dtype(dtype) -> torch.dtype:
    """``"bf16"`` / ``"bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16`` (see ``dtype_name``)."""
    return getattr(torch, dtype_name(dtype))


def canonical_pattern(pattern) -> str:
    from ..pattern.spec import parse

    return str(parse(pattern))


@functools.lru_cache(maxsize=1)
def triton_version() -> str:
    try:
        import triton
    except ImportError:   # pragma: no cover - triton is a dependency
        return "none"
    return str(triton.__version__)


def template_hash(pattern) -> str:
    """The kernel hash of a pattern (``codegen.kernel_hash``): rows are keyed by the very
    kernel sources they were measured on."""
    from ..kernels.render import kernel_hash

    return kernel_hash(canonical_pattern(pattern))


def is_current(pattern: str, triton: str, kernels: str) -> bool:
    """Whether a stored row (its pattern, Triton version and kernel hash) runs on this
    installation: same Triton, same generated kernels. A pattern that no longer parses is not."""
    if triton != triton_version():
        return False
    try:
        return kernels == template_hash(pattern)
    except ValueError:
        return False


def library_version() -> str:
    from .. import __version__

    return __version__


@dataclasses.dataclass(frozen=True)
class TuningKey:
    """The key of one row. ``bucket`` is already a bucket (see ``bucket``)."""

    gpu: str
    capability: str
    pattern: str          # canonical (str(parse(p)))
    direction: str        # "fwd" | "bwd"
    dtype: str            # "bfloat16" | "float16" | "float32"
    head_dim: int
    gqa_group: int
    bucket: int
    triton_version: str
    template_hash: str

    def __post_init__(self):
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")

    @classmethod
    def current(cls, gpu: str, capability: str, pattern, direction: str, dtype, head_dim: int, gqa_group: int,
                seqlen: int) -> "TuningKey":
        """The key of a problem on this installation (running Triton and templates)."""
        return cls(gpu, capability, canonical_pattern(pattern), direction, dtype_name(dtype), int(head_dim),
                   int(gqa_group), bucket(seqlen), triton_version(), template_hash(pattern))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def study_name(self) -> str:
        """Name of the Optuna study that tunes this key (shared by every process tuning it)."""
        return "msa|" + "|".join(
            [self.gpu, self.capability, self.pattern, self.direction, self.dtype, f"d{self.head_dim}",
             f"g{self.gqa_group}", f"n{self.bucket}", f"triton-{self.triton_version}", self.template_hash])


KEY_FIELDS = tuple(f.name for f in dataclasses.fields(TuningKey))
