"""One rank of a context-parallel test run: ``python cp_worker.py RANK WORLD RUN_DIR BACKEND``.

Reads ``RUN_DIR/cases.json`` (written by test_context_parallel.py), runs every case in order on
its slice of inputs that every rank (and the test) builds from the case's seed, and saves its
output, gradients and measured traffic to ``RUN_DIR/<case>.<rank>.pt``. A case whose call raises
records the message instead (the error cases expect it on every rank).

Run as a script, not through multiprocessing, so that TRITON_INTERPRET (set by the parent in the
environment) is in place before msa_codegen loads, and nothing depends on how pytest imported
the test module.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist


def case_inputs(case: dict, dtype: torch.dtype, device, dp: int = 0):
    """The full (gathered) q, k, v, the output's cotangent and the topk table of a case."""
    g = torch.Generator().manual_seed(case["seed"] + 1000 * dp)
    n = sum(case["lens"])
    b, hq, hkv, d = case["B"], case["Hq"], case["Hkv"], case["D"]
    q = torch.randn(b, hq, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g)
    dout = torch.randn(b, hq, n, d, generator=g)
    bi = None
    if case.get("topk"):
        kk, blk = case["topk"]
        nb = -(-n // blk)
        bi = torch.randint(-1, nb, (b, hkv, nb, kk), generator=g, dtype=torch.int32)
    to = dict(device=device, dtype=dtype)
    return q.to(**to), k.to(**to), v.to(**to), dout.to(**to), (None if bi is None else bi.to(device))


def run_case(case: dict, rank: int, world: int, dtype, device):
    import msa_codegen as msa

    group, cp_rank, dp = None, rank, 0
    if case.get("mesh"):
        from torch.distributed.device_mesh import init_device_mesh
        shape = tuple(case["mesh"])
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "cp")[-len(shape):])
        if len(shape) == 2:
            group, dp, cp_rank = (mesh, "cp"), rank // shape[1], rank % shape[1]
        else:
            group = mesh
    lens = case["lens"]
    s = sum(lens[:cp_rank])
    e = s + lens[cp_rank]
    q, k, v, dout, bi = case_inputs(case, dtype, device, dp)
    hq = case.get("Hq_by_rank", {}).get(str(rank), case["Hq"])
    ql = q[:, :hq, s:e].clone().requires_grad_()
    kl, vl = (t[:, :, s:e].clone().requires_grad_() for t in (k, v))
    kwargs = dict(group=group, block_indices=bi)
    if case.get("pass_lens"):
        kwargs["seq_lens"] = lens
    fn = msa.context_parallel_attention
    if case.get("compile"):
        # torch.compile around the call (the default backend): the exchange and the host checks
        # break the graph, the kernels run as the custom op
        fn = torch.compile(fn)
    out = fn(ql, kl, vl, case["pattern"], **kwargs)
    (out * dout[:, :hq, s:e]).sum().backward()
    return dict(out=out.detach().cpu(), dq=ql.grad.cpu(), dk=kl.grad.cpu(), dv=vl.grad.cpu(),
                traffic=msa.distributed.last_traffic(), dp=dp, cp_rank=cp_rank)


def main() -> None:
    rank, world, run_dir, backend = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    with open(os.path.join(run_dir, "cases.json")) as f:
        spec = json.load(f)
    dtype = getattr(torch, spec["dtype"])
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{os.path.join(run_dir, 'store')}", rank=rank,
                            world_size=world)
    try:
        for case in spec["cases"]:
            try:
                result = run_case(case, rank, world, dtype, device)
            except Exception as exc:   # the error cases expect one on every rank; the test reports others
                result = dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            torch.save(result, os.path.join(run_dir, f"{case['name']}.{rank}.pt"))
            if "error" in result and not case.get("error"):
                # the other ranks may be waiting for this one in a collective: stop here, loudly
                print(result["traceback"], file=sys.stderr, flush=True)
                os._exit(3)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
