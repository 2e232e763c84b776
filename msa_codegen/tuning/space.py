"""The search space of the launch knobs, per direction, and what is pruned before compiling.

The knobs are the fields of ``FwdConfig`` / ``BwdConfig`` (the template's launch parameters:
block shapes, warps, pipeline stages; the backward has two kernels, dk/dv (``*1``) and dq
(``*2``)). ``knobs`` gives each knob's choices; ``space`` is the full product as a
comprehension; ``why_excluded`` is the explicit filter that removes, before anything is
compiled, what cannot fit or cannot help. The heuristic default is always measured (it is
the baseline of the speedup), whatever the filter says.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from ..config import BwdConfig, FwdConfig, LaunchConfig
from ..kernels import schedule
from ..kernels.tma import descriptor_fault

BLOCKS = (16, 32, 64, 128, 256)
WARPS = (4, 8)
STAGES = (1, 2, 3, 4, 5)
# Triton's interpreter runs a program as numpy arrays, one program after another: warps and
# pipeline stages do not exist there and large blocks only cost time, so its space is small
# (the timings mean nothing; the point is to exercise the whole path).
INTERP_BLOCKS = (16, 32)
INTERP_WARPS = (4,)
INTERP_STAGES = (1,)

REGISTERS_PER_THREAD = 255
# fp32 accumulator values per thread above which a kernel certainly spills: the accumulators
# may take three quarters of the registers; addresses, masks and the loaded tiles need the rest
ACC_REGISTER_BUDGET = 192


@dataclasses.dataclass(frozen=True)
class Env:
    """What the filter needs to know about the problem and the device."""

    head_dim: int
    dtype: torch.dtype
    seqlen: int                 # the length that is timed
    dilation: int = 1           # largest dilation of the pattern's head groups
    interpreter: bool = False
    smem_bytes: int = 232448    # shared memory per block (opt-in) of the device; H100/H200's default

    @property
    def block_d(self) -> int:
        return schedule.block_d(self.head_dim)

    @property
    def esize(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def class_len(self) -> int:
        """Rows of one dilation class: what a tile of the window phase spans."""
        return -(-self.seqlen // self.dilation)


def knobs(direction: str, interpreter: bool) -> dict[str, tuple[int, ...]]:
    """Each knob of a direction and its choices (fixed per device kind, so that every process
    sharing a study asks Optuna the same distributions)."""
    blocks, warps, stages = (INTERP_BLOCKS, INTERP_WARPS, INTERP_STAGES) if interpreter else (BLOCKS, WARPS, STAGES)
    if direction == "fwd":
        return {"block_m": blocks, "block_n": blocks, "num_warps": warps, "num_stages": stages}
    if direction == "bwd":
        return {"block_m1": blocks, "block_n1": blocks, "num_warps1": warps, "num_stages1": stages,
                "block_m2": blocks, "block_n2": blocks, "num_warps2": warps, "num_stages2": stages}
    raise ValueError(f"direction must be fwd or bwd, got {direction!r}")


def space(direction: str, interpreter: bool) -> list[dict[str, int]]:
    """Every combination of the knobs (before the filter)."""
    k = knobs(direction, interpreter)
    if direction == "fwd":
        return [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
                for bm in k["block_m"] for bn in k["block_n"] for w in k["num_warps"] for s in k["num_stages"]]
    return [dict(block_m1=bm1, block_n1=bn1, num_warps1=w1, num_stages1=s1,
                 block_m2=bm2, block_n2=bn2, num_warps2=w2, num_stages2=s2)
            for bm1, bn1, w1, s1 in itertools.product(k["block_m1"], k["block_n1"], k["num_warps1"], k["num_stages1"])
            for bm2, bn2, w2, s2 in itertools.product(k["block_m2"], k["block_n2"], k["num_warps2"], k["num_stages2"])]


# Shared memory of a kernel: esize * BLOCK_D * (resident rows + streamed rows * num_stages), plus
# at most SMEM_OVERHEAD bytes (barriers, small scratch). Checked against ahead-of-time compiles
# for sm_90 with the launch's divisibility specialisation (Triton 3.9, 2026-12-02; window=4096,
# dilation 2 and sink=64, D 64 and 128, bf16): 20 candidates of both directions, the tiles alone
# within 0-2064 B below the compiler's figure every time (the most: sink=64's prefix dk/dv). An earlier version counted
# num_stages - 1 buffers: it let through candidates that then failed at launch (issue 20: 17 of
# them in one msa-tune run on the H200).
SMEM_OVERHEAD = 3072
# Candidates whose estimate lies within this many bytes below the device's limit are borderline:
# the tuner asks an ahead-of-time compile for the target (``tuning.resources``) before compiling
# them for real, where that compile is available.
SMEM_BORDERLINE = 16384


def _buffers(stages: int) -> int:
    # Triton's pipeliner allocates num_stages buffers of each streamed (TMA-loaded) tile
    return max(1, stages)


def _smem(env: Env, resident_rows: int, streamed_rows: int, stages: int) -> int:
    return env.esize * env.block_d * (resident_rows + streamed_rows * _buffers(stages)) + SMEM_OVERHEAD


def _kernel_tiles(direction: str, params: dict[str, int]) -> list[tuple[str, int, int, int]]:
    """(kernel, resident rows, streamed rows per stage, stages) of each kernel of a candidate."""
    if direction == "fwd":
        # fwd: q tile resident, k and v blocks streamed
        return [("fwd", params["block_m"], 2 * params["block_n"], params["num_stages"])]
    # dk/dv: k, v tile resident, q and do blocks streamed; dq: q, do resident, k and v streamed
    return [("dk/dv", 2 * params["block_n1"], 2 * params["block_m1"], params["num_stages1"]),
            ("dq", 2 * params["block_m2"], 2 * params["block_n2"], params["num_stages2"])]


def smem_estimate(direction: str, params: dict[str, int], env: Env) -> int:
    """Estimated shared memory (bytes) of the largest kernel of a candidate."""
    return max(_smem(env, r, s, st) for _, r, s, st in _kernel_tiles(direction, params))


def borderline(direction: str, params: dict[str, int], env: Env) -> bool:
    """Whether a candidate the filter keeps comes within SMEM_BORDERLINE bytes of the device's
    limit: worth an ahead-of-time compile for the target before a real one."""
    if env.interpreter:
        return False
    return smem_estimate(direction, params, env) > env.smem_bytes - SMEM_BORDERLINE


def is_smem_reason(reason: str | None) -> bool:
    """Whether a reason of ``why_excluded`` (or a launch error) is about shared memory."""
    return bool(reason) and ("shared memory" in reason or "OutOfResources" in reason
                             or "out of resource" in reason.lower())


def _kernel_exclusion(env: Env, block_m: int, block_n: int, warps: int, stages: int, *,
                      resident_rows: int, streamed_rows: int, acc_values: int, what: str) -> str | None:
    """The exclusions common to the three kernels (one query-or-key tile against streamed blocks).

    resident_rows: rows of [*, BLOCK_D] tiles loaded once per program (q of a query tile; k, v
    of a key tile); streamed_rows: rows loaded per pipelined block; acc_values: fp32 values of
    the accumulators and score tiles a program keeps live.
    """
    if env.interpreter:
        # the interpreter: only the small space exists (see INTERP_*)
        if block_m not in INTERP_BLOCKS or block_n not in INTERP_BLOCKS or stages not in INTERP_STAGES:
            return f"{what}: the interpreter runs small blocks and one stage only"
        return None
    cap = max(16, 1 << (env.class_len - 1).bit_length())
    if min(block_m, block_n) > cap:
        # a tile longer than the sequence (of one dilation class) only computes padding
        return f"{what}: blocks {block_m}x{block_n} longer than the {env.class_len} rows of a dilation class"
    smem = _smem(env, resident_rows, streamed_rows, stages)
    if smem > env.smem_bytes:
        # the tiles of the pipeline do not fit the shared memory of one block: compile error
        return f"{what}: about {smem // 1024} KiB of shared memory per block, the device has {env.smem_bytes // 1024}"
    threads = 32 * warps
    if acc_values / threads > ACC_REGISTER_BUDGET:
        # accumulators alone take most of the 255 registers of a thread: heavy spills
        return f"{what}: {acc_values // threads} fp32 accumulator values per thread (> {ACC_REGISTER_BUDGET})"
    if block_m * block_n < 2 * threads:
        # fewer than two score values per thread: lanes idle, and the same blocks with fewer
        # warps do the same work
        return f"{what}: {block_m}x{block_n} tile too small for {warps} warps"
    return None


def why_excluded(direction: str, params: dict[str, int], env: Env) -> str | None:
    """Why a combination is pruned before compiling, or None when it is worth measuring."""
    bd = env.block_d
    if direction == "fwd":
        bm, bn, w, s = params["block_m"], params["block_n"], params["num_warps"], params["num_stages"]
        # fwd: q tile resident, k and v blocks streamed; acc (BM x D), scores and probabilities (BM x BN)
        return _kernel_exclusion(env, bm, bn, w, s, resident_rows=bm, streamed_rows=2 * bn,
                                 acc_values=bm * bd + 2 * bm * bn, what="fwd")
    bm1, bn1, w1, s1 = params["block_m1"], params["block_n1"], params["num_warps1"], params["num_stages1"]
    # shapes the launcher refuses on the descriptor path (a CUDA fault on the H200), dropped on
    # every device: 16-row dk/dv blocks timed slower than 32- and 64-row ones wherever they were
    # timed (sweep logs of runs 1, 2, 15a and 17h)
    fault = descriptor_fault(BwdConfig(**params))
    if fault:
        return fault
    # dk/dv: k, v tile resident, q and do blocks streamed; dk, dv (BN x D), p and dp (BM x BN)
    why = _kernel_exclusion(env, bm1, bn1, w1, s1, resident_rows=2 * bn1, streamed_rows=2 * bm1,
                            acc_values=2 * bn1 * bd + 2 * bm1 * bn1, what="dk/dv")
    if why:
        return why
    bm2, bn2, w2, s2 = params["block_m2"], params["block_n2"], params["num_warps2"], params["num_stages2"]
    # dq: q, do tile resident, k and v blocks streamed; dq (BM x D), p and dp (BM x BN)
    return _kernel_exclusion(env, bm2, bn2, w2, s2, resident_rows=2 * bm2, streamed_rows=2 * bn2,
                             acc_values=bm2 * bd + 2 * bm2 * bn2, what="dq")


def candidates(direction: str, env: Env) -> list[dict[str, int]]:
    """The space after the filter."""
    return [p for p in space(direction, env.interpreter) if why_excluded(direction, p, env) is None]


def _clamp(knob: str, value: int, choices: dict[str, tuple[int, ...]]) -> int:
    opts = choices[knob]
    return min(opts, key=lambda o: abs(o - value))


def seeds(direction: str, default: dict[str, int], env: Env, count: int = 4) -> list[dict[str, int]]:
    """Neighbours of the default worth measuring first (the sweeps' runners-up were of these
    kinds): the key block doubled with one stage fewer, both blocks doubled with one stage fewer
    (the D=256 forward's best, 2.4x a default of half its tiles on the H200), the query block
    halved on 4 warps, one stage more. Each kernel of the backward is varied on its own. Only
    those the filter keeps."""
    ch = knobs(direction, env.interpreter)
    kernels = [("", "block_m", "block_n", "num_warps", "num_stages")] if direction == "fwd" else [
        ("1", "block_m1", "block_n1", "num_warps1", "num_stages1"),
        ("2", "block_m2", "block_n2", "num_warps2", "num_stages2")]
    out = []
    for move in range(4):
        for _, bm, bn, w, st in kernels:
            p = dict(default)
            if move == 0:
                p[bn], p[st] = _clamp(bn, p[bn] * 2, ch), _clamp(st, p[st] - 1, ch)
            elif move == 1:
                p[bm], p[bn] = _clamp(bm, p[bm] * 2, ch), _clamp(bn, p[bn] * 2, ch)
                p[st] = _clamp(st, p[st] - 1, ch)
            elif move == 2:
                p[bm], p[w] = _clamp(bm, p[bm] // 2, ch), _clamp(w, 4, ch)
            else:
                p[st] = _clamp(st, p[st] + 1, ch)
            if p != default and p not in out and why_excluded(direction, p, env) is None:
                out.append(p)
    return out[:count]


def params_of(direction: str, cfg: LaunchConfig) -> dict[str, int]:
    return dataclasses.asdict(cfg.fwd if direction == "fwd" else cfg.bwd)


def with_params(direction: str, params: dict[str, int], base: LaunchConfig) -> LaunchConfig:
    """``base`` with one direction's fields replaced."""
    if direction == "fwd":
        return LaunchConfig(FwdConfig(**params), base.bwd)
    return LaunchConfig(base.fwd, BwdConfig(**params))


def device_smem_bytes(device: torch.device) -> int:
    """Opt-in shared memory per block of a CUDA device (Triton's driver, else torch, else 228 KiB)."""
    try:
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
        return int(props["max_shared_mem"])
    except Exception:
        pass
    try:
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "shared_memory_per_block_optin", 0) or 232448)
    except Exception:
        return 232448
