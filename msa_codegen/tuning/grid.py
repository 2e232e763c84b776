"""The grid of the shipped tuning database, and the command that tunes it.

    python -m msa_codegen.tuner.grid --db grid.db [--shard I/N] [--budget-s S] [--list]

The grid (issue 3): windows 1024/4096/16384, dilation 1/2/4, with and without sink=64,
causal and ``causal=false``, head dims 64 and 128, bf16 and fp16, GQA groups 1 and 4,
buckets 4k to 1M; plus the benchmark cases of ``msa-bench`` (dense causal included).
``keys()`` lists it in priority order: the benchmark cases first, then the grid bucket by
bucket (131072 first), head dim 128 before 64, bf16 before fp16, GQA 1 before 4. Each entry
is tuned for both directions on the representative problem of its bucket (the shape
``msa-tune`` times, H=16 query heads) and stored in ``--db``; entries whose rows are already
there (same Triton, same kernel sources) are skipped, so the command resumes where a
previous run stopped. ``--shard I/N`` takes every N-th entry (one process per GPU of a node,
all writing to one database). ``--budget-s`` stops starting new entries after S seconds.

The rows it stores are the measurements themselves (provenance names the device, shape and
date); the lookup serves other buckets of a measured entry through its nearest-bucket step.
``--export FILE`` writes a database holding the tuning rows only (no Optuna studies): the
shipped ``msa_codegen/data/tuning.db`` is made that way.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from ..bench import CASES
from ..pattern.spec import parse
from . import gpu as _gpu
from .keys import DIRECTIONS, TuningKey, bucket, torch_dtype
from .measure import representative_problem
from .search import tune

WINDOWS = (4096, 1024, 16384)
DILATIONS = (1, 2, 4)
SINKS = (0, 64)
CAUSAL = (True, False)
HEAD_DIMS = (128, 64)
DTYPES = ("bf16", "fp16")
GROUPS = (1, 4)
BUCKETS = (131072, 32768, 8192, 524288, 16384, 65536, 4096, 262144, 1048576)
HEADS = 16
TRIALS = {"fwd": 10, "bwd": 12}


@dataclasses.dataclass(frozen=True)
class Entry:
    pattern: str
    seqlen: int
    head_dim: int = 128
    dtype: str = "bf16"
    heads: int = HEADS
    kv_heads: int = HEADS

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def describe(self) -> str:
        return (f"{self.pattern!r} N={self.seqlen} D={self.head_dim} {self.dtype} "
                f"H={self.heads}/{self.kv_heads}")


def grid_pattern(window: int, dilation: int, sink: int, causal: bool) -> str:

    terms = [] if causal else ["causal=false"]
    terms.append(f"window={window}")
    if dilation > 1:
        terms.append(f"dilation={dilation}")
    if sink:
        terms.append(f"sink={sink}")
    return str(parse(",".join(terms)))


def bench_entries() -> list[Entry]:
    """The shapes of msa-bench's cases (their keys), first."""

    out = []
    for c in CASES:
        n = min(c.n, 524288)   # the 1M case is served by its nearest bucket (tuning at 1M costs minutes)
        out.append(Entry(str(parse(c.pattern)), n, c.d, "bf16", c.hq, c.hkv))
    return out


def keys() -> list[Entry]:
    """Every entry, in priority order, without repeats."""
    seen, out = set(), []

    def add(e: Entry):

        ident = (e.pattern, bucket(e.seqlen), e.head_dim, e.dtype, e.group)
        if ident not in seen:
            seen.add(ident)
            out.append(e)

    for e in bench_entries():
        add(e)
    for n in BUCKETS:
        for group in GROUPS:
            for dtype in DTYPES:
                for d in HEAD_DIMS:
                    for causal in CAUSAL:
                        for w in WINDOWS:
                            for dil in DILATIONS:
                                for sink in SINKS:
                                    add(Entry(grid_pattern(w, dil, sink, causal), n, d, dtype, HEADS,
                                              HEADS // group))
    return out


def _missing(db_path: Path, keys_: dict[str, TuningKey]) -> list[str]:
    """Directions whose key has no row in the database yet (running Triton and kernels)."""
    from .database import TuningDB

    if not db_path.exists():
        return list(keys_)
    with TuningDB(db_path) as db:
        return [d for d, k in keys_.items() if not db.rows(**k.as_dict())]


def export_rows(src: Path, dst: Path) -> int:
    """A fresh database at ``dst`` fit to ship: the tuning rows of ``src`` only (no Optuna
    studies), rollback-journal mode (``database.write_shipped_copy``)."""
    from .database import write_shipped_copy

    return write_shipped_copy(src, dst)


def run(db_path: Path, shard: tuple[int, int], budget_s: float, trials: dict[str, int], limit: int | None) -> int:

    if not torch.cuda.is_available():
        print("msa_codegen.tuner.grid: the shipped grid is measured on a GPU; none here", file=sys.stderr)
        return 2
    gpu, cap = _gpu.current_gpu()
    i, n = shard
    mine = keys()[i::n]
    if limit is not None:
        mine = mine[:limit]
    t0 = time.monotonic()
    done = skipped = 0
    print(f"[grid {i}/{n}] {len(mine)} entries for {gpu} ({cap}); budget {budget_s:.0f} s; db {db_path}", flush=True)
    for idx, e in enumerate(mine):
        if time.monotonic() - t0 > budget_s:
            print(f"[grid {i}/{n}] budget spent after {done} entries ({skipped} already stored); "
                  f"{len(mine) - idx} not started", flush=True)
            break
        entry_keys = {d: TuningKey.current(gpu, cap, e.pattern, d, torch_dtype(e.dtype), e.head_dim, e.group,
                                           e.seqlen) for d in DIRECTIONS}
        todo = _missing(db_path, entry_keys)
        if not todo:
            skipped += 1
            continue
        problem = representative_problem(e.pattern, e.heads, e.kv_heads, e.seqlen, e.head_dim, torch_dtype(e.dtype),
                                         True)
        for direction in todo:
            key = entry_keys[direction]
            t1 = time.monotonic()
            try:
                r = tune(problem, direction, key, db_path, trials=trials[direction], progress=False)
            except Exception as exc:   # one entry's failure does not end the grid
                print(f"[grid {i}/{n}] {e.describe()} {direction}: FAILED {type(exc).__name__}: {exc}", flush=True)
                continue
            if r is None:
                print(f"[grid {i}/{n}] {e.describe()} {direction}: nothing valid measured", flush=True)
                continue
            print(f"[grid {i}/{n}] {e.describe()} {direction}: {r.config} {r.median_ms:.4g} ms "
                  f"(default {r.default_ms:.4g} ms, {r.speedup:.3f}x) {r.tflops or 0:.0f} TFLOP/s, "
                  f"{r.trials} trials, {len(r.failures)} failed, {time.monotonic() - t1:.0f} s", flush=True)
        done += 1
        torch.cuda.empty_cache()
    print(f"[grid {i}/{n}] finished: {done} entries tuned, {skipped} already stored, "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m msa_codegen.tuner.grid", description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default=None, help="tuning database to fill (resumes)")
    ap.add_argument("--shard", default="0/1", help="I/N: every N-th entry starting at I (default: %(default)s)")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="stop starting entries after S seconds")
    ap.add_argument("--limit", type=int, default=None, help="at most this many entries of the shard")
    ap.add_argument("--trials-fwd", type=int, default=TRIALS["fwd"])
    ap.add_argument("--trials-bwd", type=int, default=TRIALS["bwd"])
    ap.add_argument("--list", action="store_true", help="print the entries in order and exit")
    ap.add_argument("--export", default=None, metavar="FILE", help="write the rows of --db (no studies) to FILE")
    args = ap.parse_args(argv)
    if args.list:
        for idx, e in enumerate(keys()):
            print(f"{idx:5d}  {e.describe()}")
        print(f"{len(keys())} entries x 2 directions")
        return 0
    if args.db is None:
        ap.error("--db is required")
    db = Path(args.db).absolute()
    if args.export:
        print(f"exported {export_rows(db, Path(args.export).absolute())} rows to {args.export}")
        return 0
    try:
        i, n = (int(x) for x in args.shard.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        ap.error(f"--shard: expected I/N with 0 <= I < N, got {args.shard!r}")
    return run(db, (i, n), args.budget_s, {"fwd": args.trials_fwd, "bwd": args.trials_bwd}, args.limit)


if __name__ == "__main__":
    sys.exit(main())
