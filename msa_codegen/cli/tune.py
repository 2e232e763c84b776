"""msa-tune: tune the launch parameters of a pattern on this GPU and store the winners.

    msa-tune --pattern window=4096,dilation=2
    msa-tune --pattern window=4096,dilation=2 --budget-minutes 5 --jobs 16
    msa-tune --pattern window=4096 --family gluon --seqlen 131072    # the Hopper kernels' knobs
    msa-tune --pattern msa=2048 --seqlen 131072 --heads 32 --kv-heads 8 --proxy-heads 8 --head-dim 128
    msa-tune --gpu auto --pattern "window=4096,sink=64" --seqlen 131072 --heads 32 --kv-heads 8 \\
             --head-dim 128 --dtype bf16 --direction both --trials 60 --db ~/tuning.db

Each --seqlen maps to a power-of-two bucket (at least 1024) and is timed at a representative
shape of that bucket (batch 65536 // N, at least 1). Without a GPU the same path runs in
Triton's interpreter on a reduced problem; its timings mean nothing (said so), but the rows
are stored (GPU "cpu-interpreter") and the exit code is 0.

Candidates that cannot fit the GPU's shared memory are pruned before they compile (an estimate
of the tiles; an ahead-of-time compile for the GPU's target near the limit); the others compile
in --jobs worker processes at a time. Each bucket and direction shows one progress line (updated
in place on a terminal) and ends with one summary line, e.g.

    bucket 131072 fwd: 16 trials, 7 pruned (shared memory), 0 failed, best 8.61 ms, 31 s

--budget-minutes M bounds the whole run: when M minutes are spent no trial starts; the best of
what finished is stored and what was not done is listed. Ctrl-C keeps the rows already stored.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

#: the default buckets on a GPU. Measured on the H200 (2026-12-02, `msa-tune --gpu h200 --pattern
#: window=4096,dilation=2`, 16 trials): 8192 fwd/bwd 31/27 s, 32768 10/21 s, 131072 20/31 s, and
#: 524288 fwd 56 s with its backward unfinished at the run's 305 s cut: the 512k bucket alone cost
#: about half of the run. Longer sequences are served by the lookup's nearest bucket (131072);
#: ``--seqlen 524288`` tunes them
GPU_SEQLENS = (8192, 32768, 131072)
CPU_SEQLENS = (4096,)
#: one batch of compile jobs on a 16-core machine. Measured on the H200 (2026-12-02): at 40 trials
#: the README's command spent 190 s on its first bucket (8192) and had not finished it; the grid's
#: buckets at 8-10 trials took 14-40 s a direction (N <= 131072, 16 jobs), and on every shape tuned
#: so far the heuristic default won or tied within 0.3%.
GPU_TRIALS = 16
CPU_TRIALS = 3
#: msa patterns in the interpreter: the sequence length timed (MSA's kernels are slow there)
INTERP_MSA_SEQLEN = 256
PROG = "msa-tune"


class UsageError(Exception):
    """A bad argument: one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, no usage block
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _seqlens(values: list[str]) -> list[int]:
    out = []
    for v in values:
        for part in str(v).replace(",", " ").split():
            try:
                n = int(part.replace("_", ""))
            except ValueError:
                raise UsageError(f"--seqlen: expected integers, got {part!r}") from None
            if n < 1:
                raise UsageError(f"--seqlen: lengths must be >= 1, got {n}")
            out.append(n)
    return out


def _distinct_buckets(seqlens: list[int]):
    """(N, its bucket) for each --seqlen whose bucket an earlier one did not take (one row a
    bucket: the first length of a bucket is the one timed)."""
    from ..tuning.keys import bucket

    seen = set()
    for n in seqlens:
        b = bucket(n)
        if b not in seen:
            seen.add(b)
            yield n, b


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of minutes, got {text!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of minutes, got {text}")
    return x


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description="tune msa-codegen launch parameters for a pattern on this GPU",
                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--gpu", default="auto", help="the target GPU (h100, h200, b200, a100, ...) or auto (the GPU "
                    "present); a target other than the GPU present is refused (default: auto)")
    ap.add_argument("--pattern", required=True, help="the sparsity pattern, e.g. window=4096,dilation=2")
    ap.add_argument("--seqlen", nargs="+", default=None, metavar="N",
                    help=f"sequence lengths, each tuned for its power-of-two bucket (default: "
                         f"{' '.join(map(str, GPU_SEQLENS))} on a GPU, {' '.join(map(str, CPU_SEQLENS))} "
                         f"in the interpreter)")
    ap.add_argument("--heads", type=int, default=16, help="query heads (default: %(default)s)")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads, no GQA)")
    ap.add_argument("--proxy-heads", type=int, default=None, metavar="HP",
                    help="msa patterns: proxy heads Hp (rows are keyed by H / Hp; default: --kv-heads)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim (default: %(default)s; msa patterns: "
                    "also the proxies' head dim)")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                    help="default: bf16 on a GPU, fp16 in the interpreter")
    ap.add_argument("--direction", choices=("fwd", "bwd", "both"), default="both", help="default: %(default)s")
    ap.add_argument("--trials", type=int, default=None,
                    help=f"measured trials per bucket and direction (default: {GPU_TRIALS} on a GPU, "
                         f"{CPU_TRIALS} in the interpreter)")
    ap.add_argument("--db", default=None, help="the tuning database (default: $MSA_CODEGEN_HOME/tuning.db)")
    ap.add_argument("--jobs", type=_positive_int, default=None, metavar="N",
                    help="candidates compiled in parallel worker processes (default: the CPU cores, at most "
                         "16; 1: compile in this process)")
    ap.add_argument("--family", choices=("triton", "gluon"), default="triton",
                    help="triton: the launch parameters of the kernels every GPU runs; gluon: the knobs of the "
                         "Hopper kernels (tile order, ring depth; `msa-codegen render --family gluon`), every "
                         "candidate measured (default: %(default)s)")
    ap.add_argument("--budget-minutes", type=_positive_float, default=None, metavar="M",
                    help="bound the whole run: after M minutes no trial starts, the best of what finished is "
                         "stored and what was not done is listed (default: no bound)")
    return ap


def _target(requested: str) -> tuple[str, str, bool]:
    """(gpu name, capability, cuda) to tune for; UsageError when it is not the GPU present."""
    import torch

    from ..tuning import gpu as _gpu

    present = _gpu.current_gpu() if torch.cuda.is_available() else None
    name, cap = present if present else (_gpu.INTERPRETER, _gpu.INTERPRETER_CAPABILITY)
    if requested.strip().lower() == "auto":
        return name, cap, present is not None
    want = _gpu.normalize(requested)
    if want == name:
        return name, cap, present is not None
    if not _gpu.is_known(want):
        raise UsageError(f"--gpu {requested}: unknown GPU name (known: {', '.join(_gpu.KNOWN_GPUS)}; or auto)")
    if present is None:
        raise UsageError(f"--gpu {want}: this machine has no CUDA GPU (only Triton's CPU interpreter, "
                         f"'{_gpu.INTERPRETER}'); tuning measures, so it runs on the target GPU: use --gpu auto, "
                         f"or run msa-tune on that GPU")
    raise UsageError(f"--gpu {want}: the GPU present is {name} ({_gpu.device_name()}, capability {cap}); tuning "
                     f"measures, so it runs on the target GPU only: use --gpu auto or --gpu {name}, or run "
                     f"msa-tune on that GPU")


def relaunch_in_interpreter(module: str, argv) -> int | None:
    """Without CUDA the kernels run in Triton's interpreter, which must be chosen before triton
    is imported (``import msa_codegen`` already imports it, through torch._dynamo): run the
    command again in a child process with ``TRITON_INTERPRET=1``. Returns its exit code, or
    None when no relaunch is needed (a GPU, or the interpreter already set)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    import torch

    if torch.cuda.is_available():
        return None
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
        return None
    argv = list(sys.argv[1:] if argv is None else argv)
    return subprocess.call([sys.executable, "-m", module, *argv], env=dict(os.environ, TRITON_INTERPRET="1"))


def run(args) -> int:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("no CUDA GPU and TRITON_INTERPRET is not set (msa-tune sets it itself when run as "
                           "a command)")

    # imported here, after the interpreter was chosen (relaunch_in_interpreter): importing the
    # package imports triton
    from ..pattern.lowering import MAX_SEQLEN
    from ..pattern.spec import parse
    from ..tuning.database import open_db
    from ..tuning.keys import TuningKey, torch_dtype
    from ..tuning.lookup import user_db_path

    name, cap, _ = _target(args.gpu)
    pat = parse(args.pattern)                      # PatternError: one line
    pattern = str(pat)
    heads = args.heads
    kv_heads = args.kv_heads if args.kv_heads is not None else heads
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise UsageError(f"--heads must be a positive multiple of --kv-heads, got {heads} and {kv_heads}")
    if pat.msa_groups and len(pat.groups) > 1:
        raise UsageError(f"--pattern: tune the msa group on its own (--pattern {pat.msa_groups[0].spec} "
                         f"--heads/--proxy-heads of that group) and the other head groups as a pattern of their own "
                         f"(msa-codegen which shows what runs)")
    if not pat.msa_groups:
        pat.head_groups(heads)                         # the head groups must cover --heads
    if any(g.spec.topk for g in pat.groups):
        raise UsageError("--pattern: topk=K selects blocks from run-time data (block_indices); tune the "
                         "pattern without topk, whose launch configuration the top-k kernels use")
    if not 16 <= args.head_dim <= 256:
        raise UsageError(f"--head-dim must be between 16 and 256, got {args.head_dim}")
    seqlens = _seqlens(args.seqlen) if args.seqlen else list(GPU_SEQLENS if cuda else CPU_SEQLENS)
    for n in seqlens:
        if n > MAX_SEQLEN:
            raise UsageError(f"--seqlen: at most {MAX_SEQLEN}, got {n}")
    trials = args.trials if args.trials is not None else (GPU_TRIALS if cuda else CPU_TRIALS)
    if trials < 1:
        raise UsageError(f"--trials must be >= 1, got {trials}")
    dtype_flag = args.dtype or ("bf16" if cuda else "fp16")
    if not cuda and dtype_flag == "bf16":
        print("note: Triton's interpreter has no correct bf16 dot (Triton 3.9); tuning fp16 instead "
              "(rows are stored as float16)")
        dtype_flag = "fp16"
    dtype = torch_dtype(dtype_flag)
    directions = ("fwd", "bwd") if args.direction == "both" else (args.direction,)
    db_path = user_db_path(args.db)
    open_db(db_path).close()                       # a foreign / newer / damaged file: refused now
    if args.family == "gluon":
        if pat.msa_groups:
            raise UsageError("--family gluon: msa patterns run MSA's own kernels (tune them without --family)")
        if not cuda:
            raise UsageError("--family gluon: the Gluon kernels run on a CUDA GPU of capability 9.x; this machine "
                             "has none (Triton's interpreter does not run them)")
        return _run_gluon(args, pattern, heads, kv_heads, seqlens, dtype, dtype_flag, directions, db_path)
    if pat.msa_groups:
        return _run_msa(args, pat, name, cap, cuda, heads, kv_heads, seqlens, trials, dtype, dtype_flag, directions,
                        db_path)

    from ..tuning import precompile
    from ..tuning.measure import INTERP_MAX_SEQLEN, representative_problem
    from ..tuning.progress import TuneStats
    from ..tuning.search import tune

    started = time.monotonic()
    deadline = started + 60 * args.budget_minutes if args.budget_minutes is not None else None
    jobs = args.jobs if args.jobs is not None else precompile.workers()

    if not cuda:
        print(f"no CUDA GPU: tuning in Triton's interpreter on the CPU, reduced problem (N <= {INTERP_MAX_SEQLEN}, "
              f"{trials} trials). These timings are NOT meaningful for any GPU; they exercise the whole path. "
              f"Rows are stored under GPU '{name}'.")
    print(f"tuning {pattern!r} on {name} (capability {cap}), {dtype_flag}, head dim {args.head_dim}, "
          f"heads {heads}/{kv_heads}, {', '.join(directions)}; database {db_path}")
    print(f"{trials} trials per bucket and direction, "
          + (f"{jobs} compile job{'s' if jobs > 1 else ''}" if cuda else "no compile jobs (the interpreter)")
          + (f", budget {args.budget_minutes:g} min" if deadline is not None else ""), flush=True)

    results, missing, not_done = [], [], []
    for n, b in _distinct_buckets(seqlens):
        problem = representative_problem(pattern, heads, kv_heads, n, args.head_dim, dtype, cuda)
        for direction in directions:
            key = TuningKey.current(name, cap, pattern, direction, dtype, args.head_dim, heads // kv_heads, n)
            if deadline is not None and time.monotonic() >= deadline:
                not_done.append(f"bucket {b} {direction}")
                continue
            print(f"[bucket {b}, {direction}] timing {problem.describe()}", flush=True)
            stats = TuneStats(b, direction, trials)
            t0 = time.monotonic()
            try:
                res = tune(problem, direction, key, db_path, trials=trials, jobs=jobs, deadline=deadline,
                           stats=stats, precompile=None if jobs > 1 else False)
            finally:
                stats.seconds = time.monotonic() - t0
                print(stats.line(), flush=True)   # also when interrupted: what this bucket did
            if res is None:
                if stats.budget_stop and stats.trials == 0:
                    not_done.append(f"bucket {b} {direction}")
                    continue
                missing.append(f"bucket {b} {direction}")
                print(f"  no valid configuration measured for bucket {b} {direction} (every candidate failed)",
                      file=sys.stderr)
                continue
            if stats.budget_stop:
                not_done.append(f"bucket {b} {direction} (stopped after {stats.trials} of {trials} trials; best "
                                f"so far stored)")
            results.append(res)
    budget = (f"budget of {args.budget_minutes:g} min spent after {(time.monotonic() - started) / 60:.1f} min; "
              f"not done: {'; '.join(not_done)} (run again to continue: finished trials are kept)"
              if not_done else None)
    return _report(results, cuda, db_path, f"--pattern {pattern!r} --seqlen N ...", missing, budget)


def _run_msa(args, pat, name, cap, cuda, heads, kv_heads, seqlens, trials, dtype, dtype_flag, directions,
             db_path) -> int:
    """msa-tune of an msa pattern: MsaConfig's fields per direction (``tuning.msa_search``)."""
    from ..tuning.keys import TuningKey
    from ..tuning.msa_search import MsaProblem, tune_msa

    spec = pat.groups[0].spec
    hp = args.proxy_heads if args.proxy_heads is not None else kv_heads
    if hp < 1 or heads % hp:
        raise UsageError(f"--proxy-heads must divide --heads, got {hp} and {heads}")
    pattern = str(pat)
    deadline = time.monotonic() + 60 * args.budget_minutes if args.budget_minutes is not None else None
    if not cuda:
        print(f"no CUDA GPU: tuning in Triton's interpreter on the CPU, reduced problem (N <= {INTERP_MSA_SEQLEN}, "
              f"{trials} trials). These timings are NOT meaningful for any GPU; they exercise the whole path. "
              f"Rows are stored under GPU '{name}'.")
    print(f"tuning {pattern!r} (MSA's kernels, MsaConfig) on {name} (capability {cap}), {dtype_flag}, head dim "
          f"{args.head_dim}, heads {heads}/{kv_heads}, proxy heads {hp} ({heads // hp} heads per proxy head), "
          f"{', '.join(directions)}; database {db_path}", flush=True)
    results, missing = [], []
    for n, b in _distinct_buckets(seqlens):
        timed_n = n if cuda else min(n, INTERP_MSA_SEQLEN)
        problem = MsaProblem(pattern, spec.msa, spec.block, heads, kv_heads, hp, timed_n, args.head_dim, dtype,
                             "cuda" if cuda else "cpu", not cuda)
        for direction in directions:
            key = TuningKey.current(name, cap, pattern, direction, dtype, args.head_dim, heads // hp, n)
            print(f"[bucket {b}, {direction}] timing {problem.describe()}", flush=True)
            t0 = time.monotonic()
            res = tune_msa(problem, direction, key, db_path, trials=trials, deadline=deadline)
            if res is None:
                missing.append(f"bucket {b} {direction}")
                continue
            # the pattern tuner's summary line (progress.TuneStats.line), in MSA's counts: its
            # pruned are the excluded, repeated and failed candidates together
            print(f"bucket {b} {direction}: {res.trials} trials, {res.pruned} pruned, {len(res.failures)} failed, "
                  f"best {res.median_ms:.4g} ms, {time.monotonic() - t0:.0f} s", flush=True)
            results.append(res)
    return _report(results, cuda, db_path, f"--pattern {pattern!r} --seqlen N --heads {heads} --proxy-heads {hp} ...",
                   missing)


def _run_gluon(args, pattern, heads, kv_heads, seqlens, dtype, dtype_flag, directions, db_path) -> int:
    """msa-tune --family gluon: every candidate of the Gluon knobs per bucket and direction
    (``tuning.gluon_search``)."""
    from ..tuning.gluon_search import heuristic, space, tune_gluon, unavailable
    from ..tuning.measure import representative_problem

    deadline = time.monotonic() + 60 * args.budget_minutes if args.budget_minutes is not None else None
    print(f"tuning {pattern!r} (the Gluon kernels' knobs) on this GPU, {dtype_flag}, head dim {args.head_dim}, "
          f"heads {heads}/{kv_heads}, {', '.join(directions)}; database {db_path}", flush=True)
    results, missing, not_done = [], [], []
    for n, b in _distinct_buckets(seqlens):
        problem = representative_problem(pattern, heads, kv_heads, n, args.head_dim, dtype, True)
        for direction in directions:
            why = unavailable(problem, direction)
            if why:
                raise UsageError(f"--family gluon: the Gluon {direction} does not run {pattern!r} at head dim "
                                 f"{args.head_dim}, {dtype_flag}: {why}")
            cands = space(direction, args.head_dim)
            if len(cands) == 1:
                print(f"bucket {b} {direction}: one candidate at head dim {args.head_dim} "
                      f"({' '.join(f'{k}={v}' for k, v in heuristic(direction, problem).items())}): nothing to tune",
                      flush=True)
                continue
            if deadline is not None and time.monotonic() >= deadline:
                not_done.append(f"bucket {b} {direction}")
                continue
            print(f"[bucket {b}, {direction}] timing {problem.describe()}, {len(cands)} candidates", flush=True)
            t0 = time.monotonic()
            res = tune_gluon(problem, direction, db_path, deadline=deadline,
                             log=lambda line: print(line, flush=True))
            if res is None:
                missing.append(f"bucket {b} {direction}")
                continue
            print(f"bucket {b} {direction}: {res.trials} measured, {res.pruned} not measured or failed, best "
                  f"{res.median_ms:.4g} ms, {time.monotonic() - t0:.0f} s", flush=True)
            results.append(res)
    budget = (f"budget of {args.budget_minutes:g} min spent; not done: {'; '.join(not_done)}" if not_done else None)
    return _report(results, True, db_path, f"--pattern {pattern!r} --seqlen N --head-dim {args.head_dim} ...",
                   missing, budget)


def _report(results, cuda: bool, db_path, which_args: str, missing: list[str], budget: str | None = None) -> int:
    """The end of a run: the table, where the rows went, what the budget left undone, the exit code."""
    print()
    print(table(results))
    if not cuda:
        print("\n(Triton interpreter: the times above are NOT meaningful for any GPU.)")
    print(f"\nstored in {db_path}; `msa-codegen which {which_args}` shows what runs")
    if budget:
        print(budget)
    if missing:
        print(f"{PROG}: error: nothing valid measured for {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


def _fmt_cfg(cfg: dict) -> str:
    short = {"block_": "", "num_warps": "w", "num_stages": "s"}
    parts = []
    for k, v in cfg.items():
        for a, b in short.items():
            k = k.replace(a, b)
        parts.append(f"{k}={v}")
    return " ".join(parts)


def table(results) -> str:
    rows = [("bucket", "dir", "config", "median ms", "spread ms", "TFLOP/s", "default ms", "speedup", "trials", "")]
    for r in results:
        rows.append((str(r.key.bucket), r.key.direction, _fmt_cfg(r.config), f"{r.median_ms:.4g}",
                     f"{r.spread_ms:.2g}", f"{r.tflops:.3g}" if r.tflops is not None else "-",
                     f"{r.default_ms:.4g}" if r.default_ms is not None else "-",
                     f"{r.speedup:.2f}x" if r.speedup is not None else "-", str(r.trials),
                     "" if r.stored else "(kept faster stored row)"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    code = relaunch_in_interpreter("msa_codegen.cli.tune", argv)
    if code is not None:
        return code
    from ..tuning.progress import quiet_known_warnings

    quiet_known_warnings()
    try:
        return run(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted (finished rows are stored)", file=sys.stderr)
        return 130
    except Exception as e:   # one line, no traceback (MSA_CODEGEN_DEBUG=1 shows it)
        if os.environ.get("MSA_CODEGEN_DEBUG"):
            raise
        code, msg = error_line(e)
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return code


def error_line(e: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) of an error that ends a command."""
    from ..tuning.database import DatabaseUnusable, SchemaError
    from ..tuning.database import describe_failure

    if isinstance(e, DatabaseUnusable):
        return 1, " ".join(str(e).split())
    if getattr(e, "orig", None) is not None or type(e).__module__.startswith(("sqlalchemy", "sqlite3")):
        return 1, "tuning database: " + " ".join(describe_failure(e).split())
    msg = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, FileNotFoundError) and e.filename:
        return 2, f"no such file: {e.filename}"
    if isinstance(e, (ValueError, SchemaError, FileNotFoundError, PermissionError, IsADirectoryError)):
        return 2, msg
    return 1, f"{type(e).__name__}: {msg}"


if __name__ == "__main__":
    sys.exit(main())
