"""The heuristic launch configuration of a call until a tuned one exists (``default_config``).

``plan.py`` asks ``tuning.lookup`` for a tuned row and falls back on these; the tuner measures
them as the baseline of its speedups.
"""
from __future__ import annotations

import functools

import torch

from .config import BwdConfig, FwdConfig, LaunchConfig
from .kernels.tma import tma_capable
from .pattern.spec import parse

# The interpreter runs programs one after another in numpy: small blocks keep tests quick and
# still cross block boundaries at test lengths.
INTERPRETER_CONFIG = LaunchConfig(FwdConfig(32, 32, 4, 1), BwdConfig(32, 32, 4, 1, 32, 32, 4, 1))


#: A window whose band (keys of one class a query row can see: the window causal, twice it in both
#: directions) is narrower than this runs its forward in 64 x 64 tiles on Hopper (default_config)
NARROW_BAND = 2048


@functools.lru_cache(maxsize=256)
def narrow_band(pattern: str | None) -> bool:
    """Every head group of the pattern is a window (with or without sink) whose band is below
    ``NARROW_BAND`` keys: a 128-row tile of such a window spends a large share of its few key
    blocks in masked edges and in the loop's pipeline start. False without a pattern."""
    if not pattern:
        return False
    for g in parse(pattern).groups:
        sp = g.spec
        if sp.window is None or sp.global_ or sp.random or sp.topk:
            return False
        if sp.window * (1 if sp.causal else 2) >= NARROW_BAND:
            return False
    return True


def default_config(device: torch.device, head_dim: int, dtype: torch.dtype,
                   capability: str | None = None, pattern: str | None = None) -> LaunchConfig:
    """Heuristic launch parameters until a tuned one exists (``capability``: of a named GPU, when
    it is not this machine's; ``pattern``: the call's, for the narrow-band forward rule).

    The fastest of hand sweeps on an H200 (benchmarks/sweep.py; the figures in docs/performance.md)
    for head dims 64 and 128; the others are the spill-free shapes of ptxas's report for sm_90.

    Blackwell (capability 10.x: B200, B100) gets the same tiles as Hopper, untimed: it has the same
    228 KiB of shared memory per SM (227 KiB per block, opt-in) and loads through the same tensor
    descriptors, so what fits and pipelines on an H200 is a sound start; an ahead-of-time compile for
    sm_100 checks that every default fits (tests/tuning/test_resources.py). ``msa-tune`` on a B200
    measures its own rows, by the same path as on an H200.
    """
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        return LaunchConfig(FwdConfig(64, 32, 4, 2), BwdConfig(16, 32, 4, 1, 32, 32, 4, 1))
    if head_dim <= 64:
        # window=4096 H=32 N=131072 on the LSE2 backward: dk/dv (64, 64, 4, 2)
        # 33.34 ms against 34.86 for (64, 64, 4, 3); forward (128, 64, 8, 3) 10.46 against 10.62
        # for (128, 64, 4, 3)
        return LaunchConfig(FwdConfig(128, 64, 8, 3), BwdConfig(64, 64, 4, 2, 64, 64, 4, 2))
    if head_dim <= 128:
        # Hopper and newer load K/V through tensor descriptors (kernels.tma.use_tma): 128-key blocks with
        # 3 stages measured 0.84x the time of the pointer loads' best (128, 64, 8, 3) on an H200
        # (a probe since removed; git history keeps benchmarks/ws_probe.py). A narrow band: (64, 64, 4, 3), 1.477 ms
        # against 1.699 for causal=false,window=512 H=16 N=65536; for window=4096 the
        # 128-key tiles stay ahead (9.14 against 9.43 ms). Capability 10 (Blackwell) takes the same
        # branch as 9: same shared memory per block, same descriptors (see the docstring)
        if not tma_capable(device, capability):
            fwd = FwdConfig(128, 64, 8, 3)
        elif narrow_band(pattern):
            fwd = FwdConfig(64, 64, 4, 3)
        else:
            fwd = FwdConfig(128, 128, 8, 3)
        # dk/dv (64, 64, 4, 2) with K/V held through descriptors: 30.38 ms against 31.81 for
        # (32, 64, 4, 2), window=4096 H=16 N=131072
        return LaunchConfig(fwd, BwdConfig(64, 64, 4, 2, 128, 64, 8, 3))
    # head dims above 128. Backward: window=4096 H=16 N=16384 D=256: dk/dv
    # (32, 64, 8, 2) with dq (128, 32, 8, 2) 12.00 ms, against 318 ms for the earlier
    # (16, 32, 4, 1) / (32, 32, 4, 1), which compiled without wgmma (11.30 with the band's dS
    # through scratch). Forward: the shape ptxas compiles without spills (not yet timed)
    return LaunchConfig(FwdConfig(64, 32, 8, 2), BwdConfig(32, 64, 8, 2, 128, 32, 8, 2))
