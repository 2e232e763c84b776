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
    block_m1: int = 64    # dk/dv kernel: query block
    block_n1: int = 64    # dk/dv kernel: key tile
    block_m2: int = 64    # dq kernel: query tile
    block_n2: int = 64    # dq kernel: key block
    num_warps: int = 4
    num_stages: int = 2


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
_INTERPRETER = LaunchConfig(FwdConfig(32, 32, 4, 1), BwdConfig(32, 32, 32, 32, 4, 1))


def default_config(device: torch.device, head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    if device.type != "cuda":
        return _INTERPRETER
    if head_dim <= 64:
        fwd = FwdConfig(128, 64, 4, 3)
    elif head_dim <= 128:
        fwd = FwdConfig(128, 64, 8, 3)
    else:
        fwd = FwdConfig(64, 32, 4, 2)
    if dtype == torch.float32:
        fwd = FwdConfig(64, 32, 4, 2)
        bwd = BwdConfig(32, 32, 32, 32, 4, 1)
    elif head_dim <= 128:
        bwd = BwdConfig(64, 64, 64, 64, 4, 2)
    else:
        bwd = BwdConfig(32, 32, 32, 32, 4, 1)
    return LaunchConfig(fwd, bwd)


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
