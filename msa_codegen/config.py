"""Launch configurations (block shapes, warps, pipeline depth) and ``use_config``.

A call's configuration comes from its plan (``plan.py``: a tuned row through
``tuning.lookup``, else ``heuristics.default_config``); ``use_config`` overrides both, for
tests and the tuner. Configurations are chosen per sequence-length bucket (``length_bucket``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    block_m1: int = 16    # dk/dv kernel: query block
    block_n1: int = 128   # dk/dv kernel: key tile
    num_warps1: int = 8
    num_stages1: int = 2
    block_m2: int = 64    # dq kernel: query tile
    block_n2: int = 64    # dq kernel: key block
    num_warps2: int = 8
    num_stages2: int = 2


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    fwd: FwdConfig
    bwd: BwdConfig

    def __post_init__(self):
        for name, value in {**dataclasses.asdict(self.fwd), **dataclasses.asdict(self.bwd)}.items():
            if name.startswith("block_") and (value < 16 or value & (value - 1)):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")


MIN_BUCKET = 1024


def length_bucket(seqlen: int) -> int:
    """The sequence-length bucket of a length (what plans and tuning rows are keyed by): the
    power of two >= it, at least 1024."""
    n = int(seqlen)
    if n < 1:
        raise ValueError(f"sequence length must be >= 1, got {seqlen}")
    return max(MIN_BUCKET, 1 << (n - 1).bit_length())


def as_list(cfg: LaunchConfig) -> list[int]:
    """The flat int list the custom ops carry (fwd fields, then bwd fields)."""
    return [getattr(part, f.name) for part in (cfg.fwd, cfg.bwd) for f in dataclasses.fields(part)]


def from_list(values) -> LaunchConfig:
    """Inverse of ``as_list``; an empty list means ``LaunchConfig(FwdConfig(), BwdConfig())``."""
    return _from_tuple(tuple(values))


@functools.lru_cache(maxsize=256)
def _from_tuple(values: tuple) -> LaunchConfig:
    # the custom ops convert their int list back on every launch: cached, the checks run once per list
    if not values:
        return LaunchConfig(FwdConfig(), BwdConfig())
    n = len(dataclasses.fields(FwdConfig))
    return LaunchConfig(FwdConfig(*values[:n]), BwdConfig(*values[n:]))


# A plain module global, not a ContextVar: torch.compile traces globals but breaks the graph
# on ContextVar.get (torch 2.13).
_override: LaunchConfig | None = None


def override() -> LaunchConfig | None:
    """The configuration forced by the innermost ``use_config`` block, or None."""
    return _override


@contextlib.contextmanager
def use_config(config: LaunchConfig):
    """Run ``attention`` with this launch configuration inside the block."""
    global _override
    previous, _override = _override, config
    try:
        yield config
    finally:
        _override = previous
