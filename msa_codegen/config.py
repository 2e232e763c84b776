"""Launch configurations (block shapes, warps, pipeline depth) and their defaults.

The tuner (tuner/) searches these; until a tuned row exists the heuristic default below is
used. ``use_config`` overrides both, for tests and the tuner.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch


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


# A plain module global, not a ContextVar: torch.compile traces globals but breaks the graph
# on ContextVar.get (torch 2.13).
_override: LaunchConfig | None = None

# The interpreter runs programs one after another in numpy: small blocks keep tests quick and
# still cross block boundaries at test lengths.
_INTERPRETER = LaunchConfig(FwdConfig(32, 32, 4, 1), BwdConfig(32, 32, 4, 1, 32, 32, 4, 1))


def default_config(device: torch.device, head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    """Heuristic launch parameters until a tuned one exists.

    The fastest of a hand sweep on an H200 (benchmarks/sweep.py; numbers in benchmarks/NOTES.md)
    for head dim 128; the others are the spill-free shapes of ptxas's report for sm_90.
    """
    if device.type != "cuda":
        return _INTERPRETER
    if dtype == torch.float32:
        return LaunchConfig(FwdConfig(64, 32, 4, 2), BwdConfig(16, 32, 4, 1, 32, 32, 4, 1))
    if head_dim <= 64:
        return LaunchConfig(FwdConfig(128, 64, 4, 3), BwdConfig(32, 64, 4, 3, 64, 64, 4, 2))
    if head_dim <= 128:
        return LaunchConfig(FwdConfig(128, 64, 8, 3), BwdConfig(32, 64, 4, 2, 128, 64, 8, 3))
    return LaunchConfig(FwdConfig(64, 32, 4, 2), BwdConfig(16, 64, 4, 1, 32, 32, 4, 1))


def current_config(device: torch.device, head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    return _override if _override is not None else default_config(device, head_dim, dtype)


@contextlib.contextmanager
def use_config(config: LaunchConfig):
    """Run ``attention`` with this launch configuration inside the block."""
    global _override
    previous, _override = _override, config
    try:
        yield config
    finally:
        _override = previous
