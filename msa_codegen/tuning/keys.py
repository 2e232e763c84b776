"""What a tuning row is keyed by, and the versions of what is running now.

Kept free of SQLAlchemy: ``lookup`` imports it, and the database layer is imported only when
a database file exists. A row's kernel hash is ``kernels.render.kernel_hash`` of its pattern.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from ..config import BwdConfig, FwdConfig, length_bucket
from ..kernels.render import kernel_hash
from ..pattern.spec import parse
from ..version import __version__

DIRECTIONS = ("fwd", "bwd")

# dtype names as stored (torch's names without the "torch." prefix), and the short CLI spelling
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DTYPE_NAMES = tuple(DTYPES.values())


#: The sequence-length bucket of a length: the power of two >= it, at least 1024
bucket = length_bucket


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
    return str(parse(pattern))


@functools.lru_cache(maxsize=1)
def triton_version() -> str:
    return str(triton.__version__)


def is_current(pattern: str, triton: str, kernels: str) -> bool:
    """Whether a stored row (its pattern, Triton version and kernel hash) runs on this
    installation: same Triton, same generated kernels (a Gluon row's: either direction's, see
    ``gluon_hash``). A pattern that no longer parses is not."""
    if triton != triton_version():
        return False
    try:
        if is_gluon_hash(kernels):
            return kernels in (gluon_hash(pattern, "fwd"), gluon_hash(pattern, "bwd"))
        return kernels == kernel_hash(pattern)
    except ValueError:
        return False


def is_gluon_hash(kernels: str) -> bool:
    """Whether a row's kernel hash keys the Gluon family's kernels (``kernels.gluon.kernel_hash``):
    its config holds that family's knobs (``gluon_config_from_row``)."""
    return kernels.startswith("gluon-")


def gluon_hash(pattern, direction: str) -> str | None:
    """The kernel hash of a pattern's Gluon kernels of one direction for a plain call (no run-time
    positions), what ``msa-tune --family gluon`` keys its rows by; None when the family cannot
    run them (``kernels.gluon.kernel_hash``)."""
    from ..kernels import gluon
    from ..pattern.lowering import lower

    return gluon.kernel_hash(tuple(lower(g.spec) for g in parse(pattern).groups), direction)


def library_version() -> str:
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
    kernel_hash: str

    def __post_init__(self):
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")

    @classmethod
    def current(cls, gpu: str, capability: str, pattern, direction: str, dtype, head_dim: int, gqa_group: int,
                seqlen: int) -> "TuningKey":
        """The key of a problem on this installation (running Triton and kernels)."""
        return cls(gpu, capability, canonical_pattern(pattern), direction, dtype_name(dtype), int(head_dim),
                   int(gqa_group), bucket(seqlen), triton_version(), kernel_hash(pattern))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def study_name(self) -> str:
        """Name of the Optuna study that tunes this key (shared by every process tuning it)."""
        return "msa|" + "|".join(
            [self.gpu, self.capability, self.pattern, self.direction, self.dtype, f"d{self.head_dim}",
             f"g{self.gqa_group}", f"n{self.bucket}", f"triton-{self.triton_version}", self.kernel_hash])


KEY_FIELDS = tuple(f.name for f in dataclasses.fields(TuningKey))


#: The launch parameters an msa pattern's rows store (the fields of ``msa.launch.MsaConfig``, split by
#: direction; named here so that the lookup needs nothing of ``msa``). The selection runs in the forward.
MSA_FIELDS = {"fwd": ("select_block_m", "select_warps", "select_stages", "fwd_rows", "fwd_warps", "fwd_stages"),
              "bwd": ("bwd_rows", "bwd_block_n", "bwd_warps", "bwd_stages")}
#: fields added after rows were first stored: a row may lack them
_MSA_LATER_FIELDS = ("fwd_stages", "bwd_stages")


def is_msa_pattern(pattern) -> bool:
    """Whether a pattern is one msa head group (``msa=T[,block=B]``): its rows hold MsaConfig fields,
    and their ``gqa_group`` is H / Hp, the query heads per proxy head (what MSA's tiles depend on)."""
    try:
        groups = parse(pattern).groups
    except ValueError:
        return False
    return len(groups) == 1 and bool(groups[0].spec.msa)


def msa_config_from_row(direction: str, values) -> dict[str, int]:
    """The MsaConfig fields of one direction from a stored ``config`` dict (TypeError / ValueError if invalid)."""
    if not isinstance(values, dict):
        raise TypeError(f"config must be an object, got {type(values).__name__}")
    fields = MSA_FIELDS[direction]
    # rows stored before the main attention's stage counts were knobs lack them (the default then)
    required = set(fields) - set(_MSA_LATER_FIELDS)
    if not required <= set(values) <= set(fields):
        raise ValueError(f"expected the fields {sorted(fields)}, got {sorted(values)}")
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not name.endswith("_stages") and v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    return {name: values[name] for name in fields if name in values}


def row_config(pattern, direction: str, values, kernels: str = "", head_dim: int | None = None):
    """A stored row's config: the Gluon family's knobs (a dict) for a row of its kernels
    (``kernels``, the row's kernel hash), MsaConfig fields (a dict) for an msa pattern, else a
    FwdConfig / BwdConfig."""
    if is_gluon_hash(kernels):
        return gluon_config_from_row(direction, values, head_dim)
    if is_msa_pattern(pattern):
        return msa_config_from_row(direction, values)
    return config_from_row(direction, values)


def gluon_config_from_row(direction: str, values, head_dim: int | None = None) -> dict[str, int]:
    """The Gluon knobs of one direction from a stored ``config`` dict, every field set (TypeError /
    ValueError if invalid; ``kernels.gluon.check_config``, the stage choices of ``head_dim``)."""
    from ..kernels import gluon

    if isinstance(values, dict) and set(values) != set(gluon.FIELDS[direction]):
        raise ValueError(f"expected the fields {sorted(gluon.FIELDS[direction])}, got {sorted(values)}")
    return dict(gluon.check_config(direction, values, head_dim))


def config_from_row(direction: str, values) -> FwdConfig | BwdConfig:
    """The FwdConfig / BwdConfig of a stored ``config`` dict (TypeError / ValueError if invalid)."""
    if not isinstance(values, dict):
        raise TypeError(f"config must be an object, got {type(values).__name__}")
    cls = FwdConfig if direction == "fwd" else BwdConfig
    fields = {f.name for f in dataclasses.fields(cls)}
    if set(values) != fields:
        raise ValueError(f"expected the fields {sorted(fields)}, got {sorted(values)}")
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if name.startswith("block_") and v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if name.startswith("block_") and v < 16:
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    return cls(**values)
