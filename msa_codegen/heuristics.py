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


#: Opt-in shared memory per thread block (bytes) by compute capability: the CUDA C++ Programming
#: Guide's table "Technical Specifications per Compute Capability" (maximum shared memory per thread
#: block): 99 KiB on 8.6, 8.9 and 12.x (RTX 30xx / 40xx / 50xx, RTX PRO 6000 Blackwell), 163 KiB on
#: 8.0 and 8.7, 227 KiB on 9.0 and 10.x. A GPU present is asked instead (``shared_optin``)
SHARED_OPTIN = {"8.0": 166912, "8.6": 101376, "8.7": 166912, "8.9": 101376, "9.0": 232448, "10.0": 232448,
                "10.3": 232448, "12.0": 101376, "12.1": 101376}
#: what Hopper's tiles were sized for (H100 / H200)
HOPPER_SHARED_OPTIN = SHARED_OPTIN["9.0"]


@functools.lru_cache(maxsize=16)
def _device_shared_optin(index: int) -> int | None:
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    return int(optin) if optin else SHARED_OPTIN.get(f"{props.major}.{props.minor}")


def shared_optin(device: torch.device, capability: str | None = None) -> int | None:
    """Opt-in shared memory per block (bytes) of a named ``"major.minor"`` capability (``SHARED_OPTIN``),
    else of the device (asked through torch); None when unknown (a capability not in the table, a CPU
    device, no visible GPU)."""
    if device.type != "cuda":
        return None
    if capability is not None:
        return SHARED_OPTIN.get(".".join(str(capability).split(".")[:2]))
    if not torch.cuda.is_available():
        return None
    return _device_shared_optin(device.index if device.index is not None else torch.cuda.current_device())


def hopper_sized(device: torch.device, capability: str | None = None) -> bool:
    """Tensor descriptors (``tma_capable``) and at least Hopper's shared memory per block: Hopper's
    large tiles fit. Capability 12 (consumer Blackwell) has descriptors but 99 KiB; a capability
    missing from ``SHARED_OPTIN`` is judged by its descriptors alone."""
    if not tma_capable(device, capability):
        return False
    smem = shared_optin(device, capability)
    return smem is None or smem >= HOPPER_SHARED_OPTIN


#: Bytes of shared memory per block that the float32 defaults above head dim 128 ask for (Triton 3.9,
#: pointer loads, sm_120: the forward 139,520, dq 131,072); GPUs with less get smaller tiles
FP32_WIDE_SHARED = 139520

#: Hash buckets of at most this many keys on average (``Dynamic.bucket_keys``) run the launch default
#: of short rows (``default_config(..., buckets=True)``); longer ones run as their pattern without
#: buckets. H200, causal, D=128, N=16384: the short-row tiles took 0.72x / 0.89x the forward time
#: of the dense ones at 512 / 2048 keys per bucket, 1.11x at 8192 (4096 not timed)
SHORT_BUCKET_KEYS = 4096

#: A window whose band (keys of one class a query row can see: the window causal, twice it in both
#: directions) is narrower than this runs its forward in 64 x 64 tiles on Hopper (default_config)
NARROW_BAND = 2048


@functools.lru_cache(maxsize=256)
def narrow_band(pattern: str | None) -> bool:
    """Every head group of the pattern is a window (with or without sink) whose band is below
    ``NARROW_BAND`` keys: a 128-row tile of such a window spends a large share of its few key
    blocks in masked edges and in the loop's pipeline start. False without a pattern."""
    return plain_window(pattern) and all(g.spec.window * (1 if g.spec.causal else 2) < NARROW_BAND
                                         for g in parse(pattern).groups)


@functools.lru_cache(maxsize=256)
def plain_window(pattern: str | None) -> bool:
    """Every head group of the pattern is a window (any width, dilation or sink) without global
    rows, random or top-k blocks. False without a pattern."""
    if not pattern:
        return False
    return all(g.spec.window is not None and not (g.spec.global_ or g.spec.random or g.spec.topk)
               for g in parse(pattern).groups)


def default_config(device: torch.device, head_dim: int, dtype: torch.dtype,
                   capability: str | None = None, pattern: str | None = None,
                   buckets: bool = False) -> LaunchConfig:
    """Heuristic launch parameters until a tuned one exists (``capability``: of a named GPU, when
    it is not this machine's; ``pattern``: the call's, for the narrow-band forward rule;
    ``buckets``: the call passes ``q_bucket`` / ``k_bucket`` whose buckets are short
    (``SHORT_BUCKET_KEYS``): its rows see only their bucket).

    The fastest of hand sweeps on an H200 (benchmarks/sweep.py; the figures in docs/performance.md)
    for head dims 64 and 128; the others are the spill-free shapes of ptxas's report for sm_90.

    Blackwell (capability 10.x: B200, B100) gets the same tiles as Hopper, untimed: it has the same
    228 KiB of shared memory per SM (227 KiB per block, opt-in) and loads through the same tensor
    descriptors, so what fits and pipelines on an H200 is a sound start; an ahead-of-time compile for
    sm_100 checks that every default fits (tests/tuning/test_resources.py). ``msa-tune`` on a B200
    measures its own rows, by the same path as on an H200.

    The choice follows the shared memory per block (``hopper_sized``), not a list of capabilities:
    consumer Blackwell (capability 12.x: RTX 50xx, RTX PRO 6000) has tensor descriptors but 99 KiB
    per block, like Ampere / Ada (8.6, 8.9), and gets their tiles, untimed; Hopper's D=128 forward
    asks for 131,104 B there (Triton 3.9, sm_120 with descriptors). An ahead-of-time compile for
    sm_120 checks that every default fits.
    """
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        smem = shared_optin(device, capability)
        if head_dim > 128 and smem is not None and smem < FP32_WIDE_SHARED:
            # 99 KiB per block (8.6, 8.9, 12.x), compiled for sm_120 by Triton 3.9: forward 67,712 B,
            # dk/dv 100,352 B, dq 98,304 B (untimed)
            return LaunchConfig(FwdConfig(32, 16, 4, 2), BwdConfig(16, 32, 4, 1, 16, 32, 4, 1))
        return LaunchConfig(FwdConfig(64, 32, 4, 2), BwdConfig(16, 32, 4, 1, 32, 32, 4, 1))
    if head_dim <= 64:
        # window=4096 H=32 N=131072 on the LSE2 backward: dk/dv (64, 64, 4, 2)
        # 33.34 ms against 34.86 for (64, 64, 4, 3); forward (128, 64, 8, 3) 10.46 against 10.62
        # for (128, 64, 4, 3)
        if hopper_sized(device, capability) and narrow_band(pattern):
            # encoder-sized bands (causal=false,window=256, B=8 H=12 N=4096, H200): forward
            # (64, 64, 4, 2) 0.215 ms against 0.239 for (64, 64, 4, 3) and 0.261 for (128, 64, 8, 3);
            # dk/dv (32, 64, 4, 2) 0.680 ms of backward against 0.723 for (64, 64, 4, 2)
            return LaunchConfig(FwdConfig(64, 64, 4, 2), BwdConfig(32, 64, 4, 2, 64, 64, 4, 2))
        return LaunchConfig(FwdConfig(128, 64, 8, 3), BwdConfig(64, 64, 4, 2, 64, 64, 4, 2))
    if head_dim <= 128:
        # Hopper and newer load K/V through tensor descriptors (kernels.tma.use_tma): 128-key blocks with
        # 3 stages measured 0.84x the time of the pointer loads' best (128, 64, 8, 3) on an H200
        # (a probe since removed; git history keeps benchmarks/ws_probe.py). A narrow band: (64, 64, 4, 3), 1.477 ms
        # against 1.699 for causal=false,window=512 H=16 N=65536; for window=4096 the
        # 128-key tiles stay ahead (9.14 against 9.43 ms). Capability 10 (Blackwell) takes the same
        # branch as 9: same shared memory per block, same descriptors; 12 (99 KiB per block) takes
        # the pointer loads' tiles, which fit it with descriptors too (see the docstring)
        if buckets and hopper_sized(device, capability):
            # Hash-sparse rows (a query sees the keys of its bucket only: short rows, like a narrow
            # band): causal, 8 buckets, B=1 H=16 D=128 (H200, bf16, benchmarks/sweep.py
            # --hash-buckets 8, 2026-12-03): forward (64, 64, 4, 2) 0.215 ms against 0.270 for
            # (128, 128, 8, 3) at N=8192, 0.565 against 0.636 at N=16384; backward at N=8192
            # dk/dv (32, 64, 4, 2) 0.612 against 0.632 for (64, 64, 4, 2), dq (64, 64, 4, 2) 0.587
            # against 0.632 for (128, 64, 8, 3). Windows, sinks and other terms with buckets take
            # it untimed (their rows are no longer than the bucket either)
            return LaunchConfig(FwdConfig(64, 64, 4, 2), BwdConfig(32, 64, 4, 2, 64, 64, 4, 2))
        if not hopper_sized(device, capability):
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
    # through scratch). Forward with Hopper's shared memory: 128 x 64 tiles on two stages, the
    # fastest of seven tile configurations at four problems of D=256 B=8 H=16 (H200, bf16,
    # benchmarks/sweep.py, 2026-12-02):
    # window=4096 N=8192 6.39 ms against 15.56 for the former (64, 32, 8, 3), 12.62 for
    # (64, 64, 8, 2), 8.36 for (128, 32, 8, 2); window=1024 2.56 against 5.77; causal 8.47 against
    # 20.09; window=1024 N=32768 B=2 2.67 against 6.06. GPUs with 99 KiB per block keep the
    # spill-free 64 x 32.
    # dq: a window's dq reads the dS tiles of the dk/dv kernel in that kernel's tiles
    # (schedule.ds_heads), so its own tiles run only where that path does not (dense patterns,
    # run-time positions, scratch too small). There, on Hopper, 128 x 64 on one stage: dense
    # causal N=8192 B=8 H=16/8 D=256 backward 51.42 ms against 143.94 for (128, 32, 8, 2) (the
    # tuner's row, H200, 2026-12-02); Triton 3.6's sm_90 SASS of that dq loop: 55-58 spill
    # instructions against 254.
    # Windows (``plain_window``): dk/dv on three stages and dq (128, 32, 8, 2), the tuner's winner
    # on 4 of the shipped grid's 6 D=256 window backward rows (H200, bf16, H=16/8, 2026-12-03),
    # timed against the default above in 5 interleaved rounds (``tuner.grid --compare``):
    # window=1024 N=8192 B=8 12.89 ms against 14.43, N=32768 B=2 13.46 against 15.17, N=131072
    # B=1 27.08 against 30.57; window=4096 N=8192 B=8 34.52 against 39.02 (1.12-1.13x). At N=4096
    # the winner was (64, 64, 8, 2) / (128, 16, 8, 3) (1.17x / 1.21x), not timed against this one.
    # Dilated, sink and bidirectional windows take it untimed (the rows are causal plain windows).
    if hopper_sized(device, capability):
        if plain_window(pattern):
            return LaunchConfig(FwdConfig(128, 64, 8, 2), BwdConfig(32, 64, 8, 3, 128, 32, 8, 2))
        return LaunchConfig(FwdConfig(128, 64, 8, 2), BwdConfig(32, 64, 8, 2, 128, 64, 8, 1))
    return LaunchConfig(FwdConfig(64, 32, 8, 2), BwdConfig(32, 64, 8, 2, 128, 32, 8, 2))
