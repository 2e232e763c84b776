"""The grid of the shipped tuning database, and the command that tunes it.

    python -m msa_codegen.tuner.grid --list [--db FILE] [--gpu h200]
    python -m msa_codegen.tuner.grid --db grid.db [--shard I/N] [--budget-s S] [--limit K]
    python -m msa_codegen.tuner.grid --db grid.db --export tuning.db
    python -m msa_codegen.tuner.grid --compare [--db FILE] [--rounds 5] [--budget-s S]

The grid (issue 20) is the shapes people run, 44 entries in priority order: the single-sequence
benchmark cases of ``msa-bench`` first (their 1M case tuned at 524288; its B=8 encoder cases are
the encoder family's entries), then typical configurations of current
model families (``FAMILIES``), bf16, each at the buckets it is run at (4k, 8k, 32k, 128k; 512k
where a family's pattern reaches it):

- Llama-3 / Qwen-2.5: dense ``causal``, D=128, GQA 32/8, 28/4 and 64/8;
- Mistral: ``window=4096``, GQA 32/8;
- Gemma 2 / 3: local ``window=4096`` (Gemma 2) and ``window=1024`` (Gemma 3) and the dense
  ``causal`` of their global layers, D=256 (GQA 16/8; 8/4 is the same key) and D=128 (GQA 32/16);
- encoders: bidirectional ``causal=false,window=256`` / ``512``, D=64, 12 heads (16 is the same
  key), B=8 at 4k-16k;
- the README's example, ``window=4096,dilation=2,sink=64`` GQA 16/4 at 128k.

``PLAN`` orders them in three tiers, so that a run stopped by its budget has filled the top:
every family's most-run shape, then their other common buckets, then the rest. Left out, and
served by the lookup's nearest bucket or the heuristic defaults: dense causal at 128k and beyond
(one backward at 128k takes most of a second, so a tuning run takes minutes: more than the grid
spends on ten entries), fp16, and the GQA groups not listed.

A row is keyed by GPU, pattern, direction, dtype, head dim, GQA group and bucket (and the Triton
and kernel versions, ``keys.TuningKey``): neither the batch nor the number of heads is part of
the key. Each entry is tuned for both directions on the representative problem of its bucket
(``measure.representative_problem``: batch 65536 // N, at least 1) with the heads of its family
and, where the family names one (the encoders' B=8), that batch; the row records the batch and
heads it was measured at, and serves every batch. Entries whose rows are already there (same
Triton, same kernel sources) are skipped, so the command resumes where a previous run stopped.
``--shard I/N`` takes every N-th entry (one process per GPU of a node, all writing to one
database). ``--budget-s`` stops starting new entries after S seconds.

Trials (``TRIALS``): 8 forward and 10 backward per entry (``msa-tune`` runs 40), each timed for
``REP_MS`` = 50 ms; the heuristic default and three of its neighbours are among them, and the
three best are then re-measured over 5 interleaved rounds, which decide the winner. Compiles take
most of an entry's time; the Triton cache serves entries that share a pattern and head dim.

``--list`` prints every entry and whether it is filled in ``--db`` (default: the shipped
``msa_codegen/data/tuning.db``) for ``--gpu`` (default ``h200``: the shipped rows are H200
rows; an H100 uses them through the lookup's same-capability step): ``filled`` when rows of
both directions exist that the lookup would serve for the entry's exact key on this
installation (this GPU and bucket, the running Triton and kernels, a valid config), ``fwd only``
/ ``bwd only``, ``stale`` when the only rows are of another Triton or other kernels, else ``-``.

The rows it stores are the measurements themselves (provenance names the device, shape and
date); the lookup serves other buckets of a measured entry through its nearest-bucket step.
``--export FILE`` writes a database holding the tuning rows only (no Optuna studies): the
shipped ``msa_codegen/data/tuning.db`` is made that way. ``--compare`` (a GPU) times every filled
entry's tuned config against the heuristic default in the same interleaved rounds, fresh inputs,
and prints each gain and the median and worst over all rows and over the rows off the
hand-swept benchmark shapes; an entry whose tuned config is the default is not timed (gain 1).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

from ..bench import CASES
from ..pattern.spec import parse
from . import gpu as _gpu
from .keys import DIRECTIONS, TuningKey, bucket, row_config, torch_dtype
from .measure import TOKENS_PER_BATCH, representative_problem
from .search import tune

#: msa-bench's cases at batch 1 (the encoder cases are the ``encoder`` family's entries)
BENCH_CASES = [c for c in CASES if c.b == 1]
TRIALS = {"fwd": 8, "bwd": 10}
REP_MS = 50                 # per trial; the finalists' rounds decide the winner
LIST_GPU = "h200"           # --list: the GPU whose rows count (the shipped rows are H200 rows)


@dataclasses.dataclass(frozen=True)
class Family:
    """The attention shape of a group of models: what an entry of the grid is timed at."""

    heads: int
    kv_heads: int
    head_dim: int
    batch: int | None       # None: the representative problem's (65536 // N, at least 1)
    models: str


# Heads and head dims as the models' configs give them (Hugging Face config.json). A row's key has
# the GQA group, not the heads: models of one group and head dim share rows.
FAMILIES: dict[str, Family] = {
    "llama3": Family(32, 8, 128, None, "Llama-3 / 3.1 8B, dense causal"),
    "qwen2.5": Family(28, 4, 128, None, "Qwen-2.5 7B, dense causal"),
    "llama3-70b": Family(64, 8, 128, None, "Llama-3 70B, Qwen-2.5 72B, dense causal"),
    "mistral": Family(32, 8, 128, None, "Mistral 7B, window=4096"),
    "gemma-d256": Family(16, 8, 256, None, "Gemma 2 9B, Gemma 3 4B / 12B (local windows, global causal)"),
    "gemma-d128": Family(32, 16, 128, None, "Gemma 2 27B, Gemma 3 27B (local windows, global causal)"),
    # Longformer / BigBird-sized encoders (12 heads of 64; BERT-large's 16 is the same key), the
    # batch they train at on 4k-16k tokens
    "encoder": Family(12, 12, 64, 8, "bidirectional local windows, BERT / Longformer-sized"),
    "readme": Family(16, 4, 128, None, "the README's example"),
}

BIDIR_512, BIDIR_256 = "causal=false,window=512", "causal=false,window=256"

# (family, pattern, sequence length), in priority order after the benchmark cases
PLAN: tuple[tuple[str, str, int], ...] = (
    # tier 1: each family's most-run shape
    ("encoder", BIDIR_512, 4096),
    ("encoder", BIDIR_256, 4096),
    ("llama3", "causal", 8192),
    ("qwen2.5", "causal", 32768),              # Qwen-2.5's native context
    ("mistral", "window=4096", 32768),
    ("gemma-d256", "window=1024", 32768),      # Gemma 3's local layers
    ("gemma-d256", "window=4096", 8192),       # Gemma 2's local layers (8k context)
    ("gemma-d128", "window=1024", 32768),
    ("readme", "window=4096,dilation=2,sink=64", 131072),
    # tier 2: the other common buckets
    ("encoder", BIDIR_512, 8192),
    ("encoder", BIDIR_256, 8192),
    ("llama3", "causal", 32768),
    ("qwen2.5", "causal", 8192),
    ("mistral", "window=4096", 8192),
    ("gemma-d256", "window=1024", 8192),
    ("gemma-d256", "window=1024", 131072),     # Gemma 3's 128k context
    ("gemma-d256", "causal", 8192),            # Gemma's global layers
    ("gemma-d128", "window=1024", 8192),
    ("gemma-d128", "window=1024", 131072),
    ("gemma-d128", "window=4096", 8192),       # Gemma 2 27B
    ("llama3-70b", "causal", 8192),
    # tier 3: the rest
    ("llama3", "causal", 4096),
    ("qwen2.5", "causal", 4096),
    ("llama3-70b", "causal", 32768),
    ("mistral", "window=4096", 4096),
    ("mistral", "window=4096", 524288),        # (128k: msa-bench's gqa-w4096, above)
    ("gemma-d256", "causal", 32768),
    ("gemma-d128", "causal", 8192),
    ("gemma-d128", "causal", 32768),
    ("gemma-d256", "window=1024", 4096),
    ("gemma-d128", "window=1024", 4096),
    ("gemma-d256", "window=4096", 4096),
    ("encoder", BIDIR_512, 16384),
    ("encoder", BIDIR_256, 16384),
)


@dataclasses.dataclass(frozen=True)
class Entry:
    pattern: str
    seqlen: int
    head_dim: int = 128
    dtype: str = "bf16"
    heads: int = 16
    kv_heads: int = 16
    batch: int | None = None    # None: the representative problem's (65536 // N, at least 1)
    family: str = ""

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def gpu_batch(self) -> int:
        """The batch timed on a GPU (``measure.representative_problem``)."""
        return self.batch if self.batch is not None else max(1, TOKENS_PER_BATCH // self.seqlen)

    def ident(self) -> tuple:
        """What the stored rows are keyed by (besides GPU, direction and versions)."""
        return (self.pattern, bucket(self.seqlen), self.head_dim, self.dtype, self.group)

    def describe(self) -> str:
        return (f"{self.pattern!r} N={self.seqlen} D={self.head_dim} {self.dtype} "
                f"H={self.heads}/{self.kv_heads} B={self.gpu_batch}")

    def keys(self, gpu: str, capability: str) -> dict[str, TuningKey]:
        """The key of each direction on this installation (running Triton and kernels)."""
        return {d: TuningKey.current(gpu, capability, self.pattern, d, torch_dtype(self.dtype), self.head_dim,
                                     self.group, self.seqlen) for d in DIRECTIONS}


def bench_entries() -> list[Entry]:
    """The shapes of msa-bench's single-sequence cases (their keys), first; its encoder cases
    (B=8) are the encoder family's entries, tuned at the family's batch."""
    out = []
    for c in BENCH_CASES:
        n = min(c.n, 524288)   # the 1M case is served by its nearest bucket (tuning at 1M costs minutes)
        out.append(Entry(str(parse(c.pattern)), n, c.d, "bf16", c.hq, c.hkv, family=f"bench:{c.name}"))
    return out


def family_entries() -> list[Entry]:
    """``PLAN`` as entries, in its order."""
    out = []
    for name, pattern, n in PLAN:
        f = FAMILIES[name]
        out.append(Entry(str(parse(pattern)), n, f.head_dim, "bf16", f.heads, f.kv_heads, f.batch, name))
    return out


def keys() -> list[Entry]:
    """Every entry, in priority order, without repeats (the first of a key is kept)."""
    seen, out = set(), []
    for e in bench_entries() + family_entries():
        if e.ident() not in seen:
            seen.add(e.ident())
            out.append(e)
    return out


# ---- what a database holds ------------------------------------------------------------------------

def served_row(rows: list[dict], key: TuningKey) -> dict | None:
    """The one of ``rows`` that the lookup serves for ``key`` at its exact step: this GPU and
    bucket, the running Triton and kernels (the key's), and a config it can use; else None."""
    want = key.as_dict()
    for r in rows:
        if all(r[f] == v for f, v in want.items()):
            try:
                row_config(r["pattern"], r["direction"], r["config"])
            except (TypeError, ValueError):
                continue   # the lookup skips a damaged row
            return r
    return None


def served(rows: list[dict], key: TuningKey) -> bool:
    """Whether the lookup serves ``key`` from one of ``rows`` (``served_row``)."""
    return served_row(rows, key) is not None


def entry_status(rows: list[dict], entry: Entry, gpu: str, capability: str) -> str:
    """``filled`` / ``fwd only`` / ``bwd only`` / ``stale (...)`` / ``-`` (see the module's docstring)."""
    ks = entry.keys(gpu, capability)
    have = [d for d in DIRECTIONS if served(rows, ks[d])]
    if len(have) == len(DIRECTIONS):
        return "filled"
    if have:
        return f"{have[0]} only"
    k = ks["fwd"]
    same = [r for r in rows if (r["gpu"], r["capability"], r["pattern"], r["dtype"], r["head_dim"], r["gqa_group"],
                                r["bucket"]) == (gpu, capability, k.pattern, k.dtype, k.head_dim, k.gqa_group,
                                                 k.bucket)]
    if same:
        other = sorted({r["triton_version"] for r in same if r["triton_version"] != k.triton_version})
        return f"stale (Triton {', '.join(other)})" if other else "stale (other kernels)"
    return "-"


def read_rows(db_path: Path, gpu: str | None = None) -> list[dict]:
    """The rows of ``db_path`` (of ``gpu`` when given); [] when it does not exist."""
    from .database import TuningDB
    from .lookup import shipped_db_path

    if not db_path.exists():
        return []
    # the shipped file read-only (immutable, as the lookup reads it); any other as the lookup reads a
    # user database, which sees what other shards are writing (WAL)
    mode = "ro" if db_path.absolute() == shipped_db_path() else "rw"
    with TuningDB(db_path, mode=mode, write=False) as db:
        return db.rows(gpu=gpu) if gpu is not None else db.rows()


def _missing(db_path: Path, entry: Entry, gpu: str, capability: str) -> list[str]:
    """Directions of ``entry`` that the database does not serve yet (``served``)."""
    rows = read_rows(db_path, gpu)
    ks = entry.keys(gpu, capability)
    return [d for d in DIRECTIONS if not served(rows, ks[d])]


def export_rows(src: Path, dst: Path) -> int:
    """A fresh database at ``dst`` fit to ship: the tuning rows of ``src`` only (no Optuna
    studies), rollback-journal mode (``database.write_shipped_copy``)."""
    from .database import write_shipped_copy

    return write_shipped_copy(src, dst)


def list_grid(db_path: Path, gpu: str, capability: str, out=None) -> int:
    """Print every entry and its status in ``db_path`` for ``gpu`` (to ``out``, default stdout);
    the number filled."""
    out = sys.stdout if out is None else out
    rows = read_rows(db_path, gpu)
    entries = keys()
    status = [entry_status(rows, e, gpu, capability) for e in entries]
    width = max(len(e.family) for e in entries)
    for idx, (e, s) in enumerate(zip(entries, status)):
        print(f"{idx:3d}  {e.family:<{width}}  {e.describe():<72}  {s}", file=out)
    filled = status.count("filled")
    partly = sum(s.endswith(" only") for s in status)
    stale = sum(s.startswith("stale") for s in status)
    print(f"{len(entries)} entries x 2 directions; {filled} filled, {partly} one direction only, {stale} only "
          f"stale rows, in {db_path} for {gpu} (capability {capability})", file=out)
    return filled


def run(db_path: Path, shard: tuple[int, int], budget_s: float, trials: dict[str, int], limit: int | None,
        rep_ms: int = REP_MS) -> int:

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
    print(f"[grid {i}/{n}] {len(mine)} entries for {gpu} ({cap}); trials fwd {trials['fwd']} bwd {trials['bwd']}, "
          f"{rep_ms} ms each; budget {budget_s:.0f} s; db {db_path}", flush=True)
    for idx, e in enumerate(mine):
        if time.monotonic() - t0 > budget_s:
            print(f"[grid {i}/{n}] budget spent after {done} entries ({skipped} already stored); "
                  f"{len(mine) - idx} not started", flush=True)
            break
        todo = _missing(db_path, e, gpu, cap)
        if not todo:
            skipped += 1
            continue
        entry_keys = e.keys(gpu, cap)
        problem = representative_problem(e.pattern, e.heads, e.kv_heads, e.seqlen, e.head_dim, torch_dtype(e.dtype),
                                         True, batch=e.batch)
        for direction in todo:
            key = entry_keys[direction]
            t1 = time.monotonic()
            try:
                r = tune(problem, direction, key, db_path, trials=trials[direction], progress=False, rep_ms=rep_ms)
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


@dataclasses.dataclass(frozen=True)
class Compared:
    """One filled entry and direction in ``compare``: the tuned and default medians (None when the
    tuned config is the default: nothing to time) over the same interleaved rounds."""
    entry: Entry
    direction: str
    tuned_ms: float | None
    default_ms: float | None

    @property
    def gain(self) -> float:
        """default time / tuned time (1.0 when they are the same config)."""
        return 1.0 if self.tuned_ms is None else self.default_ms / self.tuned_ms


def gain_summary(results: list[Compared]) -> str:
    """Median and worst gain over every compared row, and over the rows off the hand-swept
    benchmark shapes (``bench:`` entries), one line each."""
    def line(what, rs):
        if not rs:
            return f"{what}: none"
        worst = min(rs, key=lambda r: r.gain)
        return (f"{what}: {len(rs)} rows, median gain {statistics.median(r.gain for r in rs):.3f}x, "
                f"worst {worst.gain:.3f}x "
                f"({worst.entry.describe()} {worst.direction}), {sum(r.tuned_ms is None for r in rs)} are the default")
    off = [r for r in results if not r.entry.family.startswith("bench:")]
    return line("all filled rows", results) + "\n" + line("off the hand-swept shapes", off)


def compare(db_path: Path, rounds: int = 5, rep_ms: int = 2 * REP_MS, budget_s: float = float("inf"),
            limit: int | None = None, out=None) -> list[Compared] | None:
    """Tuned against default for every filled entry of ``db_path`` on this GPU: both configs timed
    in the same ``rounds`` interleaved rounds (``measure.interleaved``), fresh inputs, ``rep_ms``
    per timing; prints a row per entry and direction as it goes, then ``gain_summary``. None
    without a GPU."""
    out = out or sys.stdout
    if not torch.cuda.is_available():
        print("msa_codegen.tuner.grid: --compare times on a GPU; none here", file=sys.stderr)
        return None
    from ..heuristics import default_config
    from .measure import Bench, interleaved

    gpu, cap = _gpu.current_gpu()
    rows = read_rows(db_path, gpu)
    dev = torch.device("cuda")
    t0 = time.monotonic()
    results: list[Compared] = []
    print(f"[compare] {gpu} ({cap}), db {db_path}: tuned against default, {rounds} interleaved rounds of "
          f"{rep_ms} ms timings", file=out, flush=True)
    for e in keys():
        if limit is not None and len({r.entry for r in results}) >= limit:
            break
        if time.monotonic() - t0 > budget_s:
            print(f"[compare] budget spent after {len({r.entry for r in results})} entries", file=out, flush=True)
            break
        ks = e.keys(gpu, cap)
        mine = {d: served_row(rows, ks[d]) for d in DIRECTIONS}
        if not all(mine.values()):
            continue
        problem = representative_problem(e.pattern, e.heads, e.kv_heads, e.seqlen, e.head_dim, torch_dtype(e.dtype),
                                         True, batch=e.batch)
        default = default_config(dev, e.head_dim, torch_dtype(e.dtype), pattern=e.pattern)
        for d in DIRECTIONS:
            tuned = dataclasses.replace(default, **{d: row_config(e.pattern, d, mine[d]["config"])})
            if tuned == default:
                results.append(Compared(e, d, None, None))
                print(f"[compare] {e.describe()} {d}: the tuned config is the default", file=out, flush=True)
                continue
            bench = Bench(problem, d, rep_ms=rep_ms)
            cfgs = {"tuned": tuned, "default": default}
            timed = interleaved(lambda name: bench.time(cfgs[name], rep_ms=rep_ms)[0], list(cfgs), rounds)
            r = Compared(e, d, timed["tuned"][0], timed["default"][0])
            results.append(r)
            print(f"[compare] {e.describe()} {d}: tuned {r.tuned_ms:.4g} ms, default {r.default_ms:.4g} ms, "
                  f"gain {r.gain:.3f}x", file=out, flush=True)
            del bench
        torch.cuda.empty_cache()
    print(gain_summary(results), file=out, flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m msa_codegen.tuner.grid", description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default=None, help="tuning database to fill (resumes); --list: the one to show "
                    "(default there: the shipped msa_codegen/data/tuning.db)")
    ap.add_argument("--shard", default="0/1", help="I/N: every N-th entry starting at I (default: %(default)s)")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="stop starting entries after S seconds")
    ap.add_argument("--limit", type=int, default=None, help="at most this many entries of the shard")
    ap.add_argument("--trials-fwd", type=int, default=TRIALS["fwd"], help="default: %(default)s")
    ap.add_argument("--trials-bwd", type=int, default=TRIALS["bwd"], help="default: %(default)s")
    ap.add_argument("--rep-ms", type=int, default=REP_MS, help="timing of one trial in ms (default: %(default)s)")
    ap.add_argument("--list", action="store_true", help="print the entries in order, and which are filled in --db "
                    "for --gpu, and exit")
    ap.add_argument("--gpu", default=LIST_GPU, help="--list: the GPU whose rows count (default: %(default)s)")
    ap.add_argument("--export", default=None, metavar="FILE", help="write the rows of --db (no studies) to FILE")
    ap.add_argument("--compare", action="store_true", help="time every filled entry of --db (default: the shipped "
                    "database) tuned against the heuristic default in interleaved rounds, on this GPU")
    ap.add_argument("--rounds", type=int, default=5, help="--compare: interleaved rounds (default: %(default)s)")
    args = ap.parse_args(argv)
    from .progress import quiet_known_warnings

    quiet_known_warnings()
    if args.compare:
        from .lookup import shipped_db_path

        db = Path(args.db).absolute() if args.db else shipped_db_path()
        res = compare(db, rounds=args.rounds, rep_ms=2 * args.rep_ms, budget_s=args.budget_s, limit=args.limit)
        return 2 if res is None else 0
    if args.list:
        from .lookup import shipped_db_path

        gpu = _gpu.normalize(args.gpu)
        cap = _gpu.capability_of(gpu)
        if cap is None:
            ap.error(f"--gpu {args.gpu}: unknown GPU name (known: {', '.join(_gpu.KNOWN_GPUS)})")
        db = Path(args.db).absolute() if args.db else shipped_db_path()
        try:
            list_grid(db, gpu, cap)
        except Exception as exc:   # a foreign, newer or damaged file: one line
            from .database import describe_failure

            print(f"msa_codegen.tuner.grid: tuning database {db} is {describe_failure(exc)}", file=sys.stderr)
            return 2
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
    return run(db, (i, n), args.budget_s, {"fwd": args.trials_fwd, "bwd": args.trials_bwd}, args.limit, args.rep_ms)


if __name__ == "__main__":
    sys.exit(main())
