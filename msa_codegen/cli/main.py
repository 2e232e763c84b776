"""msa-codegen: look at what the compiler makes of a pattern, and run the example.

    msa-codegen demo                       # the README example (reduced, in the interpreter, without a GPU)
    msa-codegen render --pattern window=4096,dilation=2 --direction fwd
    msa-codegen render --pattern window=4096 --family gluon    # the Gluon forward (Hopper, MSA_CODEGEN_GLUON=1)
    msa-codegen render --pattern window=4096 --family gluon --direction bwd    # its backward (dK/dV, dQ)
    msa-codegen mask --pattern window=3,dilation=2,sink=1 --seqlen 12
    msa-codegen show --pattern window=64,dilation=2,sink=8 --seqlen 1024 --png mask.png
    msa-codegen which --pattern window=4096,dilation=2 --seqlen 131072 --head-dim 128 --dtype bf16
    msa-codegen db list|export|import|clear [--db PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from ..heuristics import default_config
from ..kernels import gluon as _gluon_family
from ..kernels import schedule
from ..kernels.render import MSA_KERNELS, render
from ..pattern.lowering import CU_SEQLENS, lower
from ..pattern.reference import mask, spec_mask
from ..pattern.spec import msa_split, parse
from ..tuning import gpu as _gpu
from ..tuning.database import open_db
from ..tuning.keys import DTYPES, dtype_name, is_current, is_gluon_hash, torch_dtype, triton_version
from ..tuning.lookup import gluon_lookup_for_gpu, lookup, lookup_for_gpu, shipped_db_path, user_db_path
from .tune import error_line, relaunch_in_interpreter


def _fail(msg: str) -> int:
    print(f"msa-codegen: error: {msg}", file=sys.stderr)
    return 2


#: where a demo that fails asks to be reported
REPORT = "please report it, with every line above, on the msa-codegen issue tracker"


def _versions() -> str:
    import platform

    import triton

    from ..version import __version__

    return (f"msa-codegen {__version__}, torch {torch.__version__}, Triton {triton.__version__}, "
            f"Python {platform.python_version()}")


def cmd_demo(args) -> int:
    """The README example: forward and backward of one pattern, checked against the float64
    reference (output and every gradient). Prints the versions first, so that a failure names them."""
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is loaded
    print(_versions())
    pattern = parse(args.pattern)   # a bad pattern is the caller's error: main reports it in one line
    if pattern.msa_groups:
        return _fail("the demo checks the pattern kernels against their element mask; msa=T has none (its "
                     "selection comes from proxy heads): see msa_codegen.msa_attention and reference_msa")
    try:
        ok = _demo(pattern, args.seqlen, cuda)
    except Exception as e:   # anything the kernels raise: one line, the versions above, where to report
        print(f"msa-codegen: demo failed: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        print(f"msa-codegen: {REPORT}", file=sys.stderr)
        if os.environ.get("MSA_CODEGEN_DEBUG"):
            raise
        return 1
    if not ok:
        print(f"msa-codegen: the demo's result does not match the reference: {REPORT}", file=sys.stderr)
    return 0 if ok else 1


def _demo(pat, seqlen: int | None, cuda: bool) -> bool:
    import msa_codegen as msa

    if cuda:
        dev, dtype, (hq, hkv, n, d) = "cuda", torch.bfloat16, (16, 4, seqlen or 131072, 128)
        print(f"GPU: {torch.cuda.get_device_name()}")
    else:
        dev, dtype, (hq, hkv, n, d) = "cpu", torch.float32, (4, 1, seqlen or 512, 64)
        print("no CUDA GPU: the generated kernels run in Triton's interpreter on the CPU, at a reduced size")
    print(f"pattern {str(pat)!r}: q (1, {hq}, {n}, {d}), k/v (1, {hkv}, {n}, {d}), {str(dtype)[6:]} on {dev}")

    def run(q, k, v, what):
        # forward and backward with a random output gradient; returns (out, that gradient)
        grad = torch.randn(q.shape, device=dev, dtype=dtype)
        t0 = time.perf_counter()
        out = msa.attention(q, k, v, pat)
        out.backward(grad)
        if cuda:
            torch.cuda.synchronize()
        print(f"{what}: {time.perf_counter() - t0:.2f} s")
        return out.detach(), grad

    q = torch.randn(1, hq, n, d, device=dev, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, hkv, n, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    out, grad = run(q, k, v, "forward + backward (first call, kernels compiled)")
    # the check against the dense float64 reference, output and every gradient: the whole sequence
    # in the interpreter; on a GPU its first m positions (a prefix of a sequence is a sequence too)
    m = min(n, 2048 if cuda else n)
    if m < n:
        q, k, v = (t.detach()[:, :, :m].clone().requires_grad_() for t in (q, k, v))
        out, grad = run(q, k, v, f"forward + backward of the first {m} positions")
    r_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = msa.reference_attention(*r_in, pat)
    ref.backward(grad.double())
    errors = {name: ((a.double() - b).norm() / b.norm()).item()
              for name, a, b in (("out", out, ref.detach()), ("dq", q.grad, r_in[0].grad),
                                 ("dk", k.grad, r_in[1].grad), ("dv", v.grad, r_in[2].grad))}
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    print(f"relative error against the float64 reference ({m} positions): "
          + ", ".join(f"{name} {e:.1e}" for name, e in errors.items()) + f" (tolerance {tol:.0e})")
    ok = all(e < tol for e in errors.values())
    print("OK: matches the float64 reference" if ok else "MISMATCH")
    return ok


def cmd_render(args) -> int:
    pat = parse(args.pattern)
    if args.family == "gluon":
        return _render_gluon(pat, args)
    if not pat.msa_groups:
        print(_launch_header(pat, args), end="")
    elif len(pat.msa_groups) < len(pat.groups):
        # attention runs the heads around the msa group as patterns of their own (msa_split): their launch
        for a, z, text in msa_split(pat, pat.groups[-1].last + 1)[1]:
            print(f"# heads {a}-{z - 1} run as {text!r}:")
            print(_launch_header(parse(text), args), end="")
    for group in pat.groups:
        if len(pat.groups) > 1:
            print(f"# ---- heads {group.heads} ----")
        if group.spec.msa:
            print(_msa_source(group.spec), end="")
        else:
            print(render(lower(group.spec, **_documents(args)), args.direction), end="")
    return 0


def _documents(args) -> dict:
    """``lower``'s run-time flags of a call with cu_seqlens (``--documents``), else none."""
    return CU_SEQLENS if getattr(args, "documents", False) else {}


def _render_gluon(pat, args) -> int:
    """The Gluon forward (--direction fwd) or backward (bwd: dK/dV and dQ) of every head group
    (kernels/gluon.py), or why a group cannot have one."""
    bwd = args.direction == "bwd"
    why = _gluon_family.capability_reason("9.0", torch_dtype(args.dtype), args.head_dim)
    launch = (f"grids (cdiv(N, 128), B * heads), num_warps=4, maxnreg={_gluon_family.MAXNREG}, "
              f"STAGES={_gluon_family.BWD_RING.get(args.head_dim, '-')}; after the Triton stats pass msa_bwd_pre"
              if bwd else f"launched persistent, num_warps=4, maxnreg={_gluon_family.MAXNREG}, "
              f"STAGES={_gluon_family.RING.get(args.head_dim, '-')}, ORDER=gluon.tile_order's, FOLD=True")
    launch += "; a tuned row's ORDER / STAGES where one serves (msa-tune --family gluon; msa-codegen which)"
    print(f"# Gluon {'backward' if bwd else 'forward'} (kernels/gluon.py), run by attention on a 9.x GPU "
          f"where asked ({_gluon_family.ENV}=1, or unset: top-k, packed documents, plain windows and the "
          f"dense forward at D=128 on Triton {', '.join(_gluon_family.GPU_TESTED)}); "
          f"head dim {args.head_dim}, {DTYPES[args.dtype]}: "
          + ("eligible" if why is None else f"not eligible ({why})") + f"; {launch}\n")
    for group in pat.groups:
        if len(pat.groups) > 1:
            print(f"# ---- heads {group.heads} ----")
        kplan = None if group.spec.msa else lower(group.spec, **_documents(args))
        reason = (f"msa={group.spec.msa}" if kplan is None
                  else _gluon_family.bwd_pattern_reason(kplan) if bwd else _gluon_family.pattern_reason(kplan))
        if reason:
            print(f"# {group.spec}: no Gluon kernel ({reason}); the Triton kernels run it")
            continue
        if kplan.sink and (bwd or kplan.dilation > 1):
            runs = "each residue class of the rows runs the window's kernel below, then" if kplan.dilation > 1 else \
                "the kernels below take the window's pairs (with the sink keys' inside it), then"
            print(f"# {group.spec}: {runs} a Triton pass (msa_codegen/kernels/sink.py, "
                  f"{'sink_bwd' if bwd else 'sink_fwd'}) {'adds' if bwd else 'merges'} the sink's pairs outside the window")
        print(_gluon_family.render(kplan, args.direction), end="")
    return 0


def _msa_source(spec) -> str:
    """MSA's kernel module, headed by what specialises it (its source is not rendered per pattern)."""
    return (f"# {spec}: MSA's kernels, msa_codegen/msa/kernels.py as shipped (selection, forward and backward). "
            f"They are shared by every msa pattern and specialised by constexprs: the head layout (H, Hp, Hpk, "
            f"Hkv), the head dims, block={spec.block} and K={spec.msa // spec.block} key blocks per query; "
            f"launch parameters from msa_codegen.msa.launch (MsaConfig)\n" + MSA_KERNELS.read_text())


def _launch_header(pat, args) -> str:
    """Comment lines: the constexprs and launch config a call with this head dim / dtype /
    length gets (the source itself is the same for every head dim and dtype)."""
    d = args.head_dim
    if not 16 <= d <= 256:
        raise ValueError(f"--head-dim must be between 16 and 256, got {d}")
    if args.seqlen < 1:
        raise ValueError(f"--seqlen must be >= 1, got {args.seqlen}")
    dtype = torch_dtype(args.dtype)
    block_d, prec = schedule.block_d(d), schedule.dot_precision(dtype)
    if torch.cuda.is_available():
        res = lookup(torch.device("cuda"), str(pat), d, dtype, 1, args.seqlen)
        cfg, source = res.config, res.source
    else:
        cfg, source = default_config(torch.device("cuda"), d, dtype, pattern=str(pat)), \
            "heuristic default for a GPU (none here)"
    c = dataclasses.asdict(cfg.fwd if args.direction == "fwd" else cfg.bwd)
    # TMA: the plain kernels' operands through tensor descriptors (kernels.tma.use_tma); FOLD: the
    # forward's scale folded into the exponent (kernels.launch.forward)
    tma = "TMA=True on compute capability >= 9 for bf16/fp16 with 16-byte aligned layouts, else False"
    if args.direction == "fwd":
        tma += "; FOLD=True for a positive scale, else False"
    return (f"# launched for head dim {d}, {DTYPES[args.dtype]}, N={args.seqlen}: HEAD_DIM={d} BLOCK_D={block_d} "
            f"DOT_PREC={prec!r} {tma}\n# {args.direction} config: {' '.join(f'{k}={v}' for k, v in c.items())} "
            f"({source})\n")


def cmd_mask(args) -> int:
    m = mask(args.pattern, args.seqlen, args.heads)
    for h in range(args.heads):
        if args.heads > 1:
            print(f"head {h}")
        for row in m[h].tolist():
            print("".join("#" if x else "." for x in row))
    return 0


SHOW_MAX_SEQLEN = 8192


def _one_line_error(parser):
    def error(message):   # argparse errors: one line, no usage block
        print(f"{parser.prog}: error: {message} (see {parser.prog} --help)", file=sys.stderr)
        sys.exit(2)
    return error


def cmd_show(args) -> int:
    pat = parse(args.pattern)
    if not 1 <= args.seqlen <= SHOW_MAX_SEQLEN:
        raise ValueError(f"--seqlen must be between 1 and {SHOW_MAX_SEQLEN} to draw the mask, got {args.seqlen}")
    for name in ("block_m", "block_n"):
        v = getattr(args, name)
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    heads = args.heads if args.heads is not None else (pat.groups[-1].last + 1 if pat.grouped else 1)
    groups = pat.head_groups(heads)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError:
        return _fail("msa-codegen show needs matplotlib: pip install msa-codegen[plot]")
    import torch


    n = args.seqlen
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 5.2 * len(groups)), squeeze=False)
    for row, (h0, h1, spec) in enumerate(groups):
        m = spec_mask(spec, n)
        heads_txt = f"heads {h0}-{h1 - 1}: " if pat.grouped else ""
        ax = axes[row][0]
        ax.imshow(m.numpy(), cmap=ListedColormap(["white", "tab:blue"]), interpolation="nearest", vmin=0, vmax=1)
        ax.set_title(f"{heads_txt}{spec}\nelement mask, N={n}: {m.float().mean().item():.2%} visible", fontsize=10)
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
        # the kernels' view: queries and keys of one dilation class are a contiguous tile
        d = spec.dilation if spec.window is not None else 1
        perm = torch.cat([torch.arange(r, n, d) for r in range(min(d, n))])
        pm = m[perm][:, perm]
        bm, bn = args.block_m, args.block_n
        tq, tk = -(-n // bm), -(-n // bn)
        pad = torch.zeros(tq * bm, tk * bn, dtype=torch.bool)
        valid = torch.zeros_like(pad)
        pad[:n, :n] = pm
        valid[:n, :n] = True
        seen = pad.view(tq, bm, tk, bn).sum((1, 3))
        size = valid.view(tq, bm, tk, bn).sum((1, 3))
        state = torch.where(seen == 0, 0, torch.where(seen == size, 2, 1))   # skipped, partial, full
        ax = axes[row][1]
        ax.imshow(state.numpy(), cmap=ListedColormap(["white", "tab:orange", "tab:green"]), vmin=0, vmax=2,
                  interpolation="nearest", aspect="auto")
        computed = (state > 0).float().mean().item()
        ax.set_title(f"block schedule {bm}x{bn}{f', grouped by residue mod {d}' if d > 1 else ''}\n"
                     f"full (green) {(state == 2).sum().item()}, partial (orange) {(state == 1).sum().item()}, "
                     f"skipped {(state == 0).sum().item()}: {computed:.1%} computed", fontsize=10)
        ax.set_xlabel(f"key block ({bn})")
        ax.set_ylabel(f"query tile ({bm})")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    plt.close(fig)
    print(f"wrote {args.png}")
    return 0


def cmd_which(args) -> int:
    pat = parse(args.pattern)
    if args.seqlen < 1:
        raise ValueError(f"--seqlen must be >= 1, got {args.seqlen}")
    if not 16 <= args.head_dim <= 256:
        raise ValueError(f"--head-dim must be between 16 and 256, got {args.head_dim}")
    heads = args.heads if args.heads is not None else args.kv_heads
    kv = args.kv_heads if args.kv_heads is not None else heads
    group = 1
    if heads is not None:
        if heads < 1 or kv < 1 or heads % kv:
            raise ValueError(f"--heads must be a positive multiple of --kv-heads, got {heads} and {kv}")
        pat.head_groups(heads)
        group = heads // kv
    if args.gpu.strip().lower() == "auto":
        present = _gpu.current_gpu()
        name, cap = present if present else (_gpu.INTERPRETER, _gpu.INTERPRETER_CAPABILITY)
    else:
        name = _gpu.normalize(args.gpu)
        present = _gpu.current_gpu()
        if present and present[0] == name:
            cap = present[1]
        else:
            cap = _gpu.capability_of(name)
            if cap is None:
                raise ValueError(f"--gpu {args.gpu}: unknown GPU name (known: {', '.join(_gpu.KNOWN_GPUS)}; or auto)")
    if pat.msa_groups:
        from ..msa.groups import msa_resolution

        hq = heads if heads is not None else (pat.groups[-1].last + 1 if pat.grouped else 1)
        res = msa_resolution(pat, hq, hq // group, lambda text: lookup_for_gpu(
            name, cap, text, args.head_dim, dtype_name(args.dtype), group, args.seqlen, db=args.db),
            lambda text, g: lookup_for_gpu(name, cap, text, args.head_dim, dtype_name(args.dtype), g, args.seqlen,
                                           db=args.db), args.proxy_heads)
    else:
        res = lookup_for_gpu(name, cap, pat, args.head_dim, dtype_name(args.dtype), group, args.seqlen, db=args.db)
    print(res)
    if not pat.msa_groups:
        kplans = [lower(g.spec, **_documents(args)) for g in pat.groups]
        # with --heads, the call's size (B=1) for the automatic choice's size rules
        flops = q_numel = None
        if heads is not None:
            sized = [(h1 - h0, lower(spec, **_documents(args))) for h0, h1, spec in pat.head_groups(heads)]
            flops = _gluon_family.window_flops(sized, 1, args.seqlen, args.head_dim)
            q_numel = heads * args.seqlen * args.head_dim
        print(_gluon_family.describe(kplans, cap, torch_dtype(args.dtype), args.head_dim, flops, args.seqlen))
        print(_gluon_family.describe_bwd(kplans, cap, torch_dtype(args.dtype), args.head_dim, group, flops, q_numel,
                                         args.seqlen))
        hashes = (_gluon_family.kernel_hash(tuple(kplans), "fwd"), _gluon_family.kernel_hash(tuple(kplans), "bwd"))
        if cap.startswith("9.") and hashes != (None, None):
            print(gluon_lookup_for_gpu(name, cap, pat, args.head_dim, dtype_name(args.dtype), group, args.seqlen,
                                       hashes, db=args.db))
    note = _defaults_note(res, name, cap, args.db)
    if note:
        print(note)
    return 0


def _resolutions(res) -> list:
    """The lookup's answers behind what ``which`` prints (an msa pattern: its group's and the other heads')."""
    if hasattr(res, "others"):
        return ([res.msa] if res.msa is not None else []) + [r for *_, r in res.others]
    return [res]


def _defaults_note(res, name: str, cap: str, db) -> str | None:
    """One plain line when a heuristic default runs: whether this GPU (or its capability) has tuned
    rows at all on this installation, and rows of this shape that are not used (other Triton or kernels)."""
    from ..tuning.database import TuningDB
    from ..tuning.lookup import HEURISTIC

    heuristic = [r for r in _resolutions(res) if HEURISTIC in (r.fwd.source, r.bwd.source)]
    if not heuristic:
        return None
    tv = triton_version()
    rows, paths = [], []
    for path, mode in ((user_db_path(db), "rw"), (shipped_db_path(), "ro")):
        paths.append(str(path))
        if not path.exists():
            continue
        try:
            with TuningDB(path, mode=mode, write=False) as t:
                rows += [r for r in t.rows() if r["gpu"] == name or r["capability"] == cap]
        except Exception:
            continue   # the lookup has warned about this file
    current = [r for r in rows if is_current(r["pattern"], r["triton_version"], r["kernel_hash"])]
    mine = [r for r in current if r["gpu"] == name]
    same_cap = [r for r in current if r["gpu"] != name and r["capability"] == cap]
    where = f"in the user database ({paths[0]}) or the shipped one ({paths[1]})"
    if not mine and not same_cap:
        interp = name == _gpu.INTERPRETER
        line = (f"note: no tuned rows for {name} (capability {cap}) under Triton {tv} and these kernels {where}"
                + ("" if interp else f", nor for any other GPU of capability {cap}")
                + f": the heuristic defaults run for every shape on {name} (msa-tune "
                + ("without a GPU stores rows for it)" if interp else "run on that GPU measures its rows)"))
    else:
        dirs = sorted({d for r in heuristic for d in ("fwd", "bwd") if getattr(r, d).source == HEURISTIC})
        line = (f"note: {' and '.join(dirs)}: no tuned row of this pattern, dtype, head dim and group for {name} or "
                f"capability {cap} (any bucket): the heuristic default runs ({len(mine)} rows of other shapes for "
                f"{name}, {len(same_cap)} for other GPUs of capability {cap})")
    stale = [r for r in rows if r not in current and any(
        (r["capability"], r["pattern"], r["dtype"], r["head_dim"], r["gqa_group"])
        == (cap, h.pattern, h.dtype, h.head_dim, h.gqa_group) for h in heuristic)]
    if stale:
        others = sorted({r["triton_version"] for r in stale if r["triton_version"] != tv})
        why = f"under Triton {', '.join(others)} (running {tv})" if others else "for other kernels"
        line += f"; {len(stale)} rows of this shape were measured {why} and are not used"
    return line


def _open_db(path, mode="rw"):
    return open_db(path, mode=mode)


def cmd_db_list(args) -> int:
    path = shipped_db_path() if args.shipped else user_db_path(args.db)
    label = "shipped db" if args.shipped else "user db"
    if not path.exists():
        print(f"{label} {path}: no such file (0 rows)")
        return 0
    with _open_db(path, "ro" if args.shipped else "rw") as db:
        rows = db.rows()
    print(f"{label} {path}: {len(rows)} rows (running: triton {triton_version()}; a row is stale when its Triton "
          f"version or the hash of its pattern's kernel sources differs)")
    if not rows:
        return 0
    table = [("gpu", "cap", "pattern", "dir", "dtype", "D", "g", "bucket", "config", "ms", "TF/s", "trials",
              "date", "")]
    for r in rows:
        stale = not is_current(r["pattern"], r["triton_version"], r["kernel_hash"])
        table.append((r["gpu"], r["capability"], r["pattern"], r["direction"], r["dtype"], str(r["head_dim"]),
                      str(r["gqa_group"]), str(r["bucket"]), _config_cell(r),
                      f"{r['median_ms']:.4g}", f"{r['tflops']:.3g}" if r["tflops"] is not None else "-",
                      str(r["trials"]), str(r["created_at"])[:10],
                      f"stale (triton {r['triton_version']}, kernels {r['kernel_hash']})" if stale else ""))
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip())
    return 0


def _config_cell(row: dict) -> str:
    """A row's config in ``db list``: the Triton family's values comma-separated (its fields in
    order), the Gluon family's named (``gluon order=3 stages=2``)."""
    if is_gluon_hash(row["kernel_hash"]):
        return "gluon " + " ".join(f"{k}={v}" for k, v in row["config"].items())
    return ",".join(str(v) for v in row["config"].values())


def cmd_db_export(args) -> int:
    path = user_db_path(args.db)
    if not path.exists():
        raise FileNotFoundError(2, "no tuning database", str(path))
    with _open_db(path) as db:
        doc = db.export()
    text = json.dumps(doc, indent=1, sort_keys=False) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"exported {len(doc['rows'])} rows of {path} to {args.out}")
    return 0


def cmd_db_import(args) -> int:
    if args.file == "-":
        text = sys.stdin.read()
    else:
        with open(args.file) as f:   # FileNotFoundError: one line
            text = f.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{args.file}: not JSON ({e})") from None
    path = user_db_path(args.db)
    with _open_db(path, "rwc") as db:
        n = db.import_(doc)
    print(f"imported {n} rows into {path}")
    return 0


def _study_is_current(name: str) -> bool:
    """Whether a tuner study (``TuningKey.study_name``) is of the running Triton and kernels."""
    parts = name.split("|")   # the pattern is the 4th field; the last two are the versions
    if len(parts) < 4:
        return False
    return parts[-2].startswith("triton-") and is_current(parts[3], parts[-2][len("triton-"):], parts[-1])


def cmd_db_clear(args) -> int:
    path = user_db_path(args.db)
    if not path.exists():
        print(f"user db {path}: no such file (nothing to clear)")
        return 0
    import sqlalchemy

    with _open_db(path) as db:
        n = db.clear(stale_only=args.stale)
        has_studies = "studies" in sqlalchemy.inspect(db.engine).get_table_names()
    studies = 0
    if has_studies:   # the tuner's Optuna studies live in the same file
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        url = f"sqlite:///{path}"
        for name in optuna.get_all_study_names(storage=url):
            if name.startswith("msa|") and not (args.stale and _study_is_current(name)):
                optuna.delete_study(study_name=name, storage=url)
                studies += 1
    print(f"cleared {n} rows{f' and {studies} tuner studies' if studies else ''} from {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="msa-codegen", description="sparse attention patterns compiled to Triton")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="run the README example and check it against the reference")
    p.add_argument("--pattern", default="window=4096,dilation=2,sink=64", help="default: %(default)s")
    p.add_argument("--seqlen", type=int, default=None, help="default: 131072 on a GPU, 512 in the interpreter")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("render", help="print the generated Triton source of a pattern")
    p.add_argument("--pattern", required=True)
    p.add_argument("--direction", choices=("fwd", "bwd"), default="fwd", help="default: %(default)s")
    p.add_argument("--head-dim", type=int, default=128,
                   help="head dim of the launch shown in the header (the source is the same for all); "
                        "default: %(default)s")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="default: %(default)s")
    p.add_argument("--seqlen", type=int, default=131072, help="length of the launch shown; default: %(default)s")
    p.add_argument("--family", choices=("triton", "gluon"), default="triton",
                   help="triton: the kernels every GPU runs; gluon: the Hopper kernels (plain window terms, "
                        "packed documents, top-k, the dense forward; on by default on the GPU-tested Triton for "
                        "top-k, packed documents, plain windows of at least 2^36 FLOPs and the dense forward at "
                        "D=128 (msa-codegen which says which), MSA_CODEGEN_GLUON=1 elsewhere) "
                        "(default: %(default)s)")
    p.add_argument("--documents", action="store_true",
                   help="the kernels of calls that pass cu_seqlens (packed documents)")
    p.set_defaults(fn=cmd_render)
    p = sub.add_parser("mask", help="draw the element mask in ASCII ('#' = visible)")
    p.add_argument("--pattern", required=True)
    p.add_argument("--seqlen", type=int, default=16, help="default: %(default)s")
    p.add_argument("--heads", type=int, default=1, help="default: %(default)s")
    p.set_defaults(fn=cmd_mask)

    p = sub.add_parser("show", help="draw the element mask and the block schedule to a PNG (needs matplotlib)")
    p.add_argument("--pattern", required=True)
    p.add_argument("--seqlen", type=int, required=True, help=f"at most {SHOW_MAX_SEQLEN}")
    p.add_argument("--png", required=True, help="the image file to write")
    p.add_argument("--heads", type=int, default=None,
                   help="query heads (grouped patterns: default the last head named)")
    p.add_argument("--block-m", type=int, default=128, help="query tile of the block view (default: %(default)s)")
    p.add_argument("--block-n", type=int, default=64, help="key block of the block view (default: %(default)s)")
    p.set_defaults(fn=cmd_show)

    p = sub.add_parser("which", help="which launch configuration runs for a shape, and where it comes from")
    p.add_argument("--pattern", required=True)
    p.add_argument("--seqlen", type=int, required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), required=True)
    p.add_argument("--heads", type=int, default=None, help="query heads (default: GQA group 1)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--proxy-heads", type=int, default=None, help="msa patterns: the msa group's proxy heads Hp "
                   "(rows are keyed by its query heads per proxy head; default: one per key/value head)")
    p.add_argument("--gpu", default="auto", help="a GPU name (h100, h200, ...) or auto: the GPU present, else "
                   "Triton's interpreter (default: auto)")
    p.add_argument("--db", default=None, help="the user database (default: $MSA_CODEGEN_HOME/tuning.db)")
    p.add_argument("--documents", action="store_true", help="calls pass cu_seqlens (packed documents): "
                                                             "the kernel families such calls run")
    p.set_defaults(fn=cmd_which)

    p = sub.add_parser("db", help="the tuning database: list, export, import, clear")
    dbsub = p.add_subparsers(dest="db_cmd", required=True)
    q = dbsub.add_parser("list", help="print the rows (user database; --shipped: the shipped one)")
    q.add_argument("--db", default=None, help="default: $MSA_CODEGEN_HOME/tuning.db")
    q.add_argument("--shipped", action="store_true", help="list the shipped database instead")
    q.set_defaults(fn=cmd_db_list)
    q = dbsub.add_parser("export", help="write the rows as JSON (stdout, or --out FILE)")
    q.add_argument("--db", default=None, help="default: $MSA_CODEGEN_HOME/tuning.db")
    q.add_argument("--out", default="-", help="file to write (default: stdout)")
    q.set_defaults(fn=cmd_db_export)
    q = dbsub.add_parser("import", help="add the rows of a JSON export (rows of the same key are replaced)")
    q.add_argument("file", help="a JSON file written by `msa-codegen db export` (- for stdin)")
    q.add_argument("--db", default=None, help="default: $MSA_CODEGEN_HOME/tuning.db")
    q.set_defaults(fn=cmd_db_import)
    q = dbsub.add_parser("clear", help="delete the rows (and the tuner's Optuna studies)")
    q.add_argument("--db", default=None, help="default: $MSA_CODEGEN_HOME/tuning.db")
    q.add_argument("--stale", action="store_true", help="only the rows of other Triton versions or kernels")
    q.set_defaults(fn=cmd_db_clear)
    for sp in (ap, *sub.choices.values(), *dbsub.choices.values()):
        sp.error = _one_line_error(sp)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "demo":
        # without CUDA the interpreter must be chosen before triton is imported, and importing
        # msa_codegen already imports it (through torch._dynamo): the demo reruns itself with
        # TRITON_INTERPRET=1 when needed
        code = relaunch_in_interpreter("msa_codegen.cli.main", argv)
        if code is not None:
            return code
    try:
        return args.fn(args)
    except ValueError as e:   # PatternError and argument errors: one line, no traceback
        return _fail(str(e))
    except KeyboardInterrupt:
        return _fail("interrupted")
    except Exception as e:   # database and file errors: one line (MSA_CODEGEN_DEBUG=1 shows the traceback)
        if os.environ.get("MSA_CODEGEN_DEBUG"):
            raise
        code, msg = error_line(e)
        print(f"msa-codegen: error: {msg}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
