"""Launch configurations (block shapes, warps, pipeline depth) and their defaults.

The tuner (tuner/) searches these; until a tuned row exists the heuristic default below is
used. ``use_config`` overrides both, for tests and the tuner.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

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


def descriptor_fault(bwd: BwdConfig) -> str | None:
    """Why a backward config cannot run on the descriptor (TMA) path, or None.

    dk/dv with 16-row query blocks and 4 pipeline stages stopped the H200 with "CUDA error:
    misaligned address" (a sticky error: the process's CUDA context is lost), while 16 rows with
    1-2 stages and 32 rows with 3-4 stages ran (benchmarks/NOTES.md, run 17, item 10). The cause,
    read from Triton 3.6's TTGIR: from 3 stages on, the LSE2 and delta tiles of the unmasked loop
    get num_stages - 1 shared-memory slots packed at their size, BLOCK_M1 * 4 bytes, and a TMA
    destination must be 128-byte aligned, so a 64-byte slot puts the next one off. The launcher
    raises this before launching and the tuner's filter drops these shapes."""
    if bwd.block_m1 < 32 and bwd.num_stages1 > 2:
        return (f"dk/dv block_m1={bwd.block_m1} with num_stages1={bwd.num_stages1}: query blocks under 32 "
                f"rows take at most 2 stages on the tensor-descriptor path (more faulted with a CUDA "
                f"misaligned address on an H200)")
    return None


#: Default for ``bwd_scratch_limit``: 0, the scratch path is opt-in (NOTES.md, run 18)
BWD_SCRATCH_DEFAULT = 0


def bwd_scratch_limit() -> int:
    """Bytes the backward may allocate to pass the window band's dS from the dk/dv kernel to the
    dq kernel (ops.py, ``_ds_heads``): the environment variable ``MSA_BWD_SCRATCH_BYTES``, else
    ``BWD_SCRATCH_DEFAULT`` (0: off, dq recomputes P and dP). Read at every backward.

    With a limit, plain window patterns (no global rows, random or top-k blocks) store the band's
    dS tiles (2 bytes per attended pair and head, about 1.1 GB per head at window=4096,
    N=131072) and dq runs one product a block instead of three; the heads go in chunks of whole
    KV heads that fit, and when one does not, dq recomputes. On an H200 (run 18) the backward
    was 5% faster for window=4096 (median of five rounds), faster in one run and not in another for its dilation
    2 and causal=false,window=512, no faster with a sink, and slower for GQA 32/8 and head dim
    64: the dk/dv kernel's stores (+4 ms at window=4096) cost about what dq saves (-5 ms)."""
    raw = os.environ.get("MSA_BWD_SCRATCH_BYTES")
    if raw is None or raw == "":
        return BWD_SCRATCH_DEFAULT
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"MSA_BWD_SCRATCH_BYTES must be an integer number of bytes, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"MSA_BWD_SCRATCH_BYTES must be >= 0, got {value}")
    return value


# A plain module global, not a ContextVar: torch.compile traces globals but breaks the graph
# on ContextVar.get (torch 2.13).
_override: LaunchConfig | None = None

# The interpreter runs programs one after another in numpy: small blocks keep tests quick and
# still cross block boundaries at test lengths.
_INTERPRETER = LaunchConfig(FwdConfig(32, 32, 4, 1), BwdConfig(32, 32, 4, 1, 32, 32, 4, 1))


def tma_capable(device: torch.device, capability: str | None = None) -> bool:
    """Compute capability 9 or newer (tensor descriptors / TMA): the given ``"major.minor"``, else
    the device's; False for a CPU device or without a visible GPU."""
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
    from .pattern.spec import parse

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

    The fastest of hand sweeps on an H200 (benchmarks/sweep.py; numbers in benchmarks/NOTES.md)
    for head dims 64 and 128; the others are the spill-free shapes of ptxas's report for sm_90.
    """
    if device.type != "cuda":
        return _INTERPRETER
    if dtype == torch.float32:
        return LaunchConfig(FwdConfig(64, 32, 4, 2), BwdConfig(16, 32, 4, 1, 32, 32, 4, 1))
    if head_dim <= 64:
        # window=4096 H=32 N=131072 on the LSE2 backward (NOTES.md run 17): dk/dv (64, 64, 4, 2)
        # 33.34 ms against 34.86 for (64, 64, 4, 3); forward (128, 64, 8, 3) 10.46 against 10.62
        # for (128, 64, 4, 3)
        return LaunchConfig(FwdConfig(128, 64, 8, 3), BwdConfig(64, 64, 4, 2, 64, 64, 4, 2))
    if head_dim <= 128:
        # Hopper and newer load K/V through tensor descriptors (ops._use_tma): 128-key blocks with
        # 3 stages measured 0.84x the time of the pointer loads' best (128, 64, 8, 3) on an H200
        # (benchmarks/ws_probe.py, NOTES.md run 11). A narrow band: (64, 64, 4, 3), 1.477 ms
        # against 1.699 for causal=false,window=512 H=16 N=65536 (run 15); for window=4096 the
        # 128-key tiles stay ahead (9.14 against 9.43 ms)
        if not tma_capable(device, capability):
            fwd = FwdConfig(128, 64, 8, 3)
        elif narrow_band(pattern):
            fwd = FwdConfig(64, 64, 4, 3)
        else:
            fwd = FwdConfig(128, 128, 8, 3)
        # dk/dv (64, 64, 4, 2) with K/V held through descriptors: 30.38 ms against 31.81 for
        # (32, 64, 4, 2), window=4096 H=16 N=131072 (NOTES.md run 15)
        return LaunchConfig(fwd, BwdConfig(64, 64, 4, 2, 128, 64, 8, 3))
    # head dims above 128. Backward: window=4096 H=16 N=16384 D=256 (NOTES.md run 18): dk/dv
    # (32, 64, 8, 2) with dq (128, 32, 8, 2) 12.00 ms, against 318 ms (run 17h) for the earlier
    # (16, 32, 4, 1) / (32, 32, 4, 1), which compiled without wgmma (11.30 with the band's dS
    # through scratch). Forward: the shape ptxas compiles without spills (not yet timed)
    return LaunchConfig(FwdConfig(64, 32, 8, 2), BwdConfig(32, 64, 8, 2, 128, 32, 8, 2))


def as_list(cfg: LaunchConfig) -> list[int]:
    """The flat int list the custom ops carry (fwd fields, then bwd fields)."""
    return [getattr(part, f.name) for part in (cfg.fwd, cfg.bwd) for f in dataclasses.fields(part)]


def from_list(values) -> LaunchConfig:
    """Inverse of ``as_list``; an empty list means the heuristic default of a GPU."""
    return _from_tuple(tuple(values))


@functools.lru_cache(maxsize=256)
def _from_tuple(values: tuple) -> LaunchConfig:
    # every launch converts the ops' int list back: cached, the dataclass checks run once per list
    if not values:
        return LaunchConfig(FwdConfig(), BwdConfig())
    n = len(dataclasses.fields(FwdConfig))
    return LaunchConfig(FwdConfig(*values[:n]), BwdConfig(*values[n:]))


@torch._dynamo.assume_constant_result
def _resolve(device: str, pattern: str, head_dim: int, dtype: str, group: int, seqlen: int) -> tuple:
    # Called eagerly even under torch.compile (its result is a constant of the graph): the
    # lookup reads files and must not be traced.
    return tuple(as_list(lookup_config(torch.device(device), pattern, head_dim, getattr(torch, dtype), group, seqlen)[0]))


def lookup_config(device: torch.device, pattern: str, head_dim: int, dtype: torch.dtype, group: int,
                  seqlen: int) -> tuple[LaunchConfig, str]:
    """(config, where it came from) for one call: tuned rows first (cache/), else the heuristic.

    Order per direction: user database, shipped database, same compute capability on another
    GPU, nearest length bucket, heuristic default (``msa_codegen.cache.lookup``). Cached in
    memory: after the first call of a shape no database is read again until a file changes.
    """
    from .tuning.lookup import resolve_for_device

    res = resolve_for_device(device, pattern, head_dim, dtype, group, seqlen if seqlen and seqlen > 0 else 1)
    return res.config, res.source


def current_config_list(device: torch.device, head_dim: int, dtype: torch.dtype, pattern: str = "causal",
                        group: int = 1, seqlen: int = 0) -> list[int]:
    """``as_list`` of the configuration ``attention`` uses: ``use_config``'s if set, else the
    lookup's. Traceable by torch.compile (no dataclass introspection on this path)."""
    if _override is not None:
        return as_list(_override)
    return list(_resolve(str(device), pattern, head_dim, str(dtype).replace("torch.", ""), group, seqlen))


def current_config(device: torch.device, head_dim: int, dtype: torch.dtype, pattern: str = "causal",
                   group: int = 1, seqlen: int = 0) -> LaunchConfig:
    """The launch configuration ``attention`` uses (see ``current_config_list``)."""
    return from_list(current_config_list(device, head_dim, dtype, pattern, group, seqlen))


@contextlib.contextmanager
def use_config(config: LaunchConfig):
    """Run ``attention`` with this launch configuration inside the block."""
    global _override
    previous, _override = _override, config
    try:
        yield config
    finally:
        _override = previous
