"""A/B of edits to the generated kernels, in one process (issue 4, run 15).

    PYTHONPATH=$PWD python3 benchmarks/variant_probe.py [--pattern window=4096] [--n 131072] [--heads 16]
        [--head-dim 128] [--rep 150] [--rounds 2] [--only NAME,...] [--templates DIR]

Renders the pattern's real forward and backward sources, applies each variant's text edits
(every edit must match, else the variant is reported as not applicable), loads the edited
module in place of the generated one and times ``msa_codegen.attention`` with it: forward, or
backward (``torch.autograd.grad`` of one forward) for the variants that edit the backward.
The unedited kernels are timed in every round too, so the ratios compare like with like; each
variant's output (or gradients) is checked against the unedited kernels' first. ``--templates
DIR`` adds two variants, the forward and the backward rendered from the templates in DIR (e.g. an
earlier commit's: ``git archive REV msa_codegen/templates | tar -x -C /tmp/old``), so a template
change is timed against its predecessor in one process; their kernels must take the same
arguments as today's. Not part of the package: it decides which template edit is worth making.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch
import triton.testing

# (name, direction, edits): an edit is (old, new) on the rendered source, or "diag_first"
_CONTRACTION = "tl.math.exp2(b_s * qk_scale - m_use[:, None])"
_FMA = "tl.math.exp2(tl.fma(b_s, qk_scale, -m_use[:, None]))"
VARIANTS = [
    ("fwd: scale not folded (ops.FOLD_SCALE=False)", "fwd", "nofold"),
    # run 15d measured the templates of then (tl.fma) against the contraction: 0.951-0.955x
    ("fwd: folded with tl.fma instead of the contraction", "fwd", [(_CONTRACTION, _FMA)]),
    ("fwd: folded in unmasked blocks only", "fwd",
     [(", FOLD=FOLD, SPAN=BLOCK_M + BLOCK_N, MASKED=True", ", FOLD=False, SPAN=BLOCK_M + BLOCK_N, MASKED=True")]),
    ("fwd: Q through pointers", "fwd",
     [("b_q = _load_tile(q_base, qd, a0, i, m_row, stride_qn, stride_qd, m_d, HEAD_DIM, BLOCK_D, TMA)",
       "b_q = _load_tile(q_base, qd, a0, i, m_row, stride_qn, stride_qd, m_d, HEAD_DIM, BLOCK_D, False)")]),
    ("fwd: diagonal block first, then band, then lower edge", "fwd", ["diag_first"]),
    # run 19: Triton 3.6 pipelines each loop on its own (mbarrier init, prefetch, drain), so a
    # window tile's three W loops (lower edge, band, diagonal) pay three pipeline fills; one loop
    # over the whole band with the mask under a run-time branch pays one
    ("fwd: one W loop, mask under a branch", "fwd", ["merge_fwd"]),
    ("bwd: dq one W loop, mask under a branch", "bwd", ["merge_dq"]),
    # run 20: in Triton 3.6 ``warp_specialize=True`` takes effect with 4 warps (a producer and two
    # consumer warpgroups splitting a 128-row tile); run it with such configs (ceiling_probe.py)
    ("fwd: warp-specialised loops", "fwd", [("    for blk in range(blk_lo, blk_hi):\n",
                                            "    for blk in tl.range(blk_lo, blk_hi, warp_specialize=True):\n")]),
    ("bwd: warp-specialised loops", "bwd", [("    for blk in range(blk_lo, blk_hi):\n",
                                            "    for blk in tl.range(blk_lo, blk_hi, warp_specialize=True):\n")]),
    # run 19a's "dk/dv one W loop" landed in 4f0de6f (bwd.py.jinja, SPLIT) for DIL 1; its edit
    # would now find nothing to merge
    # run 15's lead "causal band predicate" (no abs, no j < N) became run 16's PART tests in the
    # templates, one test per masked band block; its edits would now reach only the generic path
    # run 16's "LSE/delta through descriptors" landed in cb80dcc (run 17). Run 17 (SASS of the
    # unmasked dk/dv loop): 5 CTA barriers a block, one before each of the 4 TMA issues (Q, dO,
    # LSE2, delta); delta and LSE2 sit in one buffer (2, B, H, N_pad), so one 2-D descriptor over
    # both rows loads them with one TMA issue: one barrier fewer a block
    ("bwd: dk/dv delta and LSE2 through one 2-D descriptor", "bwd", [
        ("lse_base, delta_base, ds_d, ds_row, stride_qn", "lse_base, delta_base, stat_s, ds_d, ds_row, stride_qn"),
        ("lse_base, delta_base, ds_d, ds_row,\n               stride_qn",
         "lse_base, delta_base, stat_s, ds_d, ds_row,\n               stride_qn"),
        ("    i_hk = H_OFF // GROUP + pid_bh % HK\n",
         "    i_hk = H_OFF // GROUP + pid_bh % HK\n    stat_s = (tl.num_programs(1) // HK) * stride_lb\n"),
        ("""        lse_d = tl.make_tensor_descriptor(lse_base, shape=[N], strides=[1], block_shape=[BLOCK_M])
        delta_d = tl.make_tensor_descriptor(delta_base, shape=[N], strides=[1], block_shape=[BLOCK_M])
""", """        st_d = tl.make_tensor_descriptor(delta_base, shape=[2, N], strides=[stat_s, 1], block_shape=[2, BLOCK_M])
"""),
        ("""            lse2 = lse_d.load([start + blk * BLOCK_M])
            delta = delta_d.load([start + blk * BLOCK_M])
""", """            delta, lse2 = tl.split(tl.trans(st_d.load([0, start + blk * BLOCK_M])))
""")]),
    # run 18 (the band's dS through scratch): where the dk/dv kernel's extra 3.8 ms go (18a:
    # 16.0 -> 19.8 ms with the TMA stores). The edits need the scratch path on: run with
    # MSA_BWD_SCRATCH_BYTES set (it was the default in 18a-18c)
    ("bwd: dS stores all to one slot (dq wrong; L2-resident writes)", "bwd",
     [("ds_d.store([ds_row + blk * BLOCK_N, 0], b_dst)", "ds_d.store([ds_row, 0], b_dst)")]),
    ("bwd: no dS stores (dq wrong)", "bwd",
     [("                ds_d.store([ds_row + blk * BLOCK_N, 0], b_dst)\n", "                pass\n")]),
    # 18c moved the store after the dk product's issue (dk/dv 19.8 -> 20.0 ms for window=4096);
    # 18e then found dilation 2 and causal=false,window=512 no faster than recomputing, where
    # 18a (store before it) had them 5-10% faster: both placements in one process
    ("bwd: dS store before the dk product's issue (run 18a)", "bwd", [
        ("""        dk = tl.dot(b_dst, b_q, dk, input_precision=DOT_PREC)
        if DS and PHASE == PH_W:
            # after the dk product is issued, so that the store overlaps it
            if TMA:
                # through shared memory: pointer stores would hold a 64-bit address per element
                # in registers, and the loop spilled (101 spill instructions, Triton 3.6)
                ds_d.store([ds_row + blk * BLOCK_N, 0], b_dst)
            else:
                tl.store(ds_d + (ds_row + blk * BLOCK_N + offs_n)[:, None].to(tl.int64) * BLOCK_M + offs_m[None, :], b_dst)
""", """        if DS and PHASE == PH_W:
            if TMA:
                ds_d.store([ds_row + blk * BLOCK_N, 0], b_dst)
            else:
                tl.store(ds_d + (ds_row + blk * BLOCK_N + offs_n)[:, None].to(tl.int64) * BLOCK_M + offs_m[None, :], b_dst)
        dk = tl.dot(b_dst, b_q, dk, input_precision=DOT_PREC)
""")]),
    ("bwd: dS through streaming pointer stores (.cs)", "bwd", [
        ("""            if TMA:
                ds_d = tl.make_tensor_descriptor(ds_base, shape=[tl.num_programs(0) * MAXB * BLOCK_N, BLOCK_M],
                                                 strides=[BLOCK_M, 1], block_shape=[BLOCK_N, BLOCK_M])
            else:
                ds_d = ds_base
""", """            ds_d = ds_base
"""),
        ("                ds_d.store([ds_row + blk * BLOCK_N, 0], b_dst)\n",
         "                tl.store(ds_d + (ds_row + blk * BLOCK_N + offs_n)[:, None].to(tl.int64) * BLOCK_M + offs_m[None, :], b_dst, cache_modifier='.cs')\n")]),
    ("bwd: dk/dv K/V through pointers", "bwd",
     [("b_k = _load_tile(k_base, kd, b0, j, (b0 + offs_n) < n_r, stride_kn, stride_kd, m_d, HEAD_DIM, BLOCK_D, TMA)",
       "b_k = _load_tile(k_base, kd, b0, j, (b0 + offs_n) < n_r, stride_kn, stride_kd, m_d, HEAD_DIM, BLOCK_D, False)"),
      ("b_v = _load_tile(v_base, vd, b0, j, (b0 + offs_n) < n_r, stride_vn, stride_vd, m_d, HEAD_DIM, BLOCK_D, TMA)",
       "b_v = _load_tile(v_base, vd, b0, j, (b0 + offs_n) < n_r, stride_vn, stride_vd, m_d, HEAD_DIM, BLOCK_D, False)")]),
    ("bwd: dq Q/dO through pointers", "bwd",
     [("b_q = _load_tile(q_base, qd, a0, i, m_row, stride_qn, stride_qd, m_d, HEAD_DIM, BLOCK_D, TMA)",
       "b_q = _load_tile(q_base, qd, a0, i, m_row, stride_qn, stride_qd, m_d, HEAD_DIM, BLOCK_D, False)"),
      ("b_do = _load_tile(do_base, dod, a0, i, m_row, stride_don, stride_dod, m_d, HEAD_DIM, BLOCK_D, TMA)",
       "b_do = _load_tile(do_base, dod, a0, i, m_row, stride_don, stride_dod, m_d, HEAD_DIM, BLOCK_D, False)")]),
]


def _diag_first(src: str) -> str:
    # the three W-phase calls of the forward: lower edge (masked), band, diagonal (masked) ->
    # diagonal, band, lower edge
    lines = src.split("\n")
    idx = [n for n, line in enumerate(lines) if "PHASE=PH_W," in line and "_fwd_loop(" in line]
    if len(idx) != 3:
        raise KeyError("three W-phase forward calls")
    lines[idx[0]], lines[idx[2]] = lines[idx[2]], lines[idx[0]]
    return "\n".join(lines)


def _merge_w(src: str, loop: str) -> str:
    # ``loop`` (_fwd_loop or _dq_loop) gains a copy, ``loop``_merged, taking the unmasked range
    # (k_lo, k_hi) and masking the other blocks under `if`; the three W-phase calls (lower edge,
    # band, diagonal) become one call over the whole band
    head = f"@triton.jit\ndef {loop}("
    a = src.index(head)
    b = src.index("\n\n\n", a)
    body = src[a:b].replace(f"def {loop}(", f"def {loop}_merged(k_lo, k_hi, ")
    if loop == "_fwd_loop":
        old = ("        if MASKED:\n            b_s = tl.where(_visible(i[:, None], j[None, :], N, PHASE, qb, kb, PART, SPAN), "
               "b_s, float(\"-inf\"))\n")
        new = ("        if (blk < k_lo) | (blk >= k_hi):\n            b_s = tl.where(_visible_all(i[:, None], j[None, :], N, "
               "PHASE, qb, kb), b_s, float(\"-inf\"))\n")
        body = body.replace("_softmax_step(b_s, m_i, l_i, acc, qk_scale, MASKED, FOLD)",
                            "_softmax_step(b_s, m_i, l_i, acc, qk_scale, True, FOLD)")
    else:
        old = ("        if MASKED:\n            b_p = tl.where(_visible(i[:, None], j[None, :], N, PHASE, qb, kb, PART, SPAN), "
               "b_p, 0.0)\n")
        new = ("        if (blk < k_lo) | (blk >= k_hi):\n            b_p = tl.where(_visible_all(i[:, None], j[None, :], N, "
               "PHASE, qb, kb), b_p, 0.0)\n")
    if old not in body:
        raise KeyError(f"{loop}: mask line")
    body = body.replace(old, new)
    src = src[:b] + "\n\n\n" + body + src[b:]
    lines = src.split("\n")
    idx = [n for n, line in enumerate(lines) if "PHASE=PH_W," in line and f" {loop}(" in line]
    if len(idx) != 3:
        raise KeyError(f"three W-phase {loop} calls")
    first = lines[idx[0]]
    # the lower edge's call runs blocks 0..k_lo: widen it to 0..n_blk and hand it the band
    if ", 0, k_lo, N," not in first:
        raise KeyError("lower edge call")
    first = first.replace(f" {loop}(", f" {loop}_merged(k_lo, k_hi, ").replace(", 0, k_lo, N,", ", 0, n_blk, N,")
    lines[idx[0]] = first
    for n in idx[1:][::-1]:
        del lines[n]
    return "\n".join(lines)


def _edit(src: str, edits) -> str:
    if isinstance(edits, tuple) and edits[0] == "templates":
        return edits[1]
    for e in edits:
        if e == "diag_first":
            src = _diag_first(src)
        elif e == "merge_fwd":
            src = _merge_w(src, "_fwd_loop")
        elif e == "merge_dq":
            src = _merge_w(src, "_dq_loop")
        else:
            if e[0] not in src:
                raise KeyError(e[0][:60])
            src = src.replace(e[0], e[1])
    return src


def _load_source(src: str, tag: str):
    path = Path(tempfile.mkdtemp()) / f"msa_variant_{tag}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"msa_variant_{tag}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pattern", default="window=4096")
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rep", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", help="comma-separated substrings of variant names")
    ap.add_argument("--templates", help="a directory of templates to time against today's (see above)")
    args = ap.parse_args(argv)
    import msa_codegen as msa
    from msa_codegen import codegen, ops
    from msa_codegen.lowering import lower

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(1, args.heads, args.n, args.head_dim, device=dev, dtype=torch.bfloat16, generator=g)
                   for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    plan = lower(msa.parse(args.pattern).groups[0].spec)
    originals = {d: codegen.load(plan, d) for d in codegen.DIRECTIONS}
    sources = {d: codegen.render(plan, d) for d in codegen.DIRECTIONS}

    def fwd():
        return msa.attention(q, k, v, args.pattern)

    out = fwd()

    def bwd():
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    ref = {"fwd": fwd().detach(), "bwd": [t.detach() for t in bwd()]}
    variants = [x for x in VARIANTS if not args.only or any(s in x[0] for s in args.only.split(","))]
    if args.templates:
        import jinja2

        env = codegen._env()
        env.loader = jinja2.FileSystemLoader(args.templates)
        meta = {"template_hash": "other", "version": msa.__version__}
        for d in codegen.DIRECTIONS:
            other = env.get_template(f"{d}.py.jinja").render(plan=plan, meta=meta)
            variants.append((f"{d}: the templates of {args.templates}", d, ("templates", other)))
    mods = {}
    for name, direction, edits in variants:
        if edits == "nofold":
            continue
        try:
            mods[name] = _load_source(_edit(sources[direction], edits), str(len(mods)))
        except KeyError as e:
            print(f"{name}: not applicable, edit not found: {e}", flush=True)

    def timed(direction):
        if direction == "fwd":
            return triton.testing.do_bench(fwd, rep=args.rep)
        return triton.testing.do_bench(bwd, rep=args.rep)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    print(f"{args.pattern} H={args.heads} N={args.n} D={args.head_dim}", flush=True)
    for rnd in range(args.rounds):
        base = {d: timed(d) for d in ("fwd", "bwd")}
        print(f"round {rnd}: unedited fwd {base['fwd']:8.3f} ms, bwd {base['bwd']:8.3f} ms", flush=True)
        for name, direction, edits in variants:
            if edits != "nofold" and name not in mods:
                continue
            key = (plan, direction, False)
            try:
                if edits == "nofold":
                    ops.FOLD_SCALE = False
                else:
                    codegen._modules[key] = mods[name]
                if direction == "fwd":
                    err = rel(fwd(), ref["fwd"])
                else:
                    err = max(rel(a, b) for a, b in zip(bwd(), ref["bwd"]))
                ms = timed(direction)
                print(f"  {name:60s} {ms:8.3f} ms  x{ms / base[direction]:6.3f}  err {err:.1e}", flush=True)
            except Exception as e:   # reported, never dropped
                print(f"  {name:60s} failed: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}",
                      flush=True)
            finally:
                ops.FOLD_SCALE = True
                codegen._modules[key] = originals[direction]
    return 0


if __name__ == "__main__":
    sys.exit(main())
