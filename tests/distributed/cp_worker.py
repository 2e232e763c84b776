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


class TinyAttention(torch.nn.Module):
    """q, k, v projections of ``x`` ``(B, n, model_dim)`` and one attention call: the parameters
    that data parallelism (FSDP on the other mesh dimension) reduces."""

    def __init__(self, case: dict, model_dim: int = 24):
        super().__init__()
        hq, hkv, d = case["Hq"], case["Hkv"], case["D"]
        g = torch.Generator().manual_seed(case["seed"] + 7)
        self.shape = (hq, hkv, d)
        self.wq = torch.nn.Parameter(torch.randn(hq * d, model_dim, generator=g) * model_dim ** -0.5)
        self.wk = torch.nn.Parameter(torch.randn(hkv * d, model_dim, generator=g) * model_dim ** -0.5)
        self.wv = torch.nn.Parameter(torch.randn(hkv * d, model_dim, generator=g) * model_dim ** -0.5)

    def forward(self, x, attend):
        hq, hkv, d = self.shape
        b, n, _ = x.shape
        q = (x @ self.wq.t()).view(b, n, hq, d).transpose(1, 2)
        k = (x @ self.wk.t()).view(b, n, hkv, d).transpose(1, 2)
        v = (x @ self.wv.t()).view(b, n, hkv, d).transpose(1, 2)
        return attend(q, k, v)


def model_inputs(case: dict, dp: int, model_dim: int = 24):
    """The full ``x`` ``(B, N, model_dim)`` and output cotangent of data-parallel group ``dp``."""
    g = torch.Generator().manual_seed(case["seed"] + 1000 * dp + 1)
    n = sum(case["lens"])
    x = torch.randn(case["B"], n, model_dim, generator=g)
    dout = torch.randn(case["B"], case["Hq"], n, case["D"], generator=g)
    return x, dout


def run_fsdp_case(case: dict, rank: int, mesh, dp: int, cp_rank: int):
    """FSDP2 (``fully_shard``, hybrid: replicated over "dp", sharded over "cp") around a module whose
    attention is context-parallel over "cp": every rank's parameter gradients, summed over the world."""
    import msa_codegen as msa
    from torch.distributed.fsdp import fully_shard

    model = TinyAttention(case)
    fully_shard(model, mesh=mesh)
    x, dout = model_inputs(case, dp)
    lens = case["lens"]
    s = sum(lens[:cp_rank])
    e = s + lens[cp_rank]
    out = model(x[:, s:e], lambda q, k, v: msa.context_parallel_attention(q, k, v, case["pattern"],
                                                                           group=(mesh, "cp")))
    (out * dout[:, :, s:e]).sum().backward()
    world = dist.get_world_size()
    # FSDP averages over the 2 x 2 ranks; the reference sums the loss over both data-parallel groups
    grads = {name: p.grad.full_tensor() * world for name, p in model.named_parameters()}
    return dict(out=out.detach(), grads=grads, traffic=msa.distributed.last_traffic(), dp=dp, cp_rank=cp_rank)


def run_fetch_case(case: dict, rank: int, dtype, device):
    """Only the exchange of a call (``halo.exchange_plan`` + ``exchange.fetch``, forward and backward),
    at lengths too long for the interpreter's kernels: the bytes a call moves, and that the fetched
    rows are the right ones."""
    import msa_codegen as msa
    from msa_codegen.distributed import exchange, halo

    comm = exchange.make_comm(None)
    lens = case["lens"]
    off = halo.offsets(lens)
    g = torch.Generator().manual_seed(case["seed"])
    k = torch.randn(case["B"], case["Hkv"], off[-1], case["D"], generator=g).to(dtype)
    plan = halo.exchange_plan(halo.needed_ranges(case["pattern"], lens, case["Hq"]), lens)
    mine = k[:, :, off[rank]:off[rank + 1]].clone().requires_grad_()
    v = (mine * 2).detach().requires_grad_()
    k_loc, v_loc = exchange.fetch([mine, v], [plan, plan], off, comm)
    rows = torch.cat([torch.arange(lo, hi) for _, lo, hi in plan[rank]])
    rows_ok = torch.equal(k_loc.detach(), k[:, :, rows]) and torch.equal(v_loc.detach(), 2 * k[:, :, rows])
    (k_loc.sum() + v_loc.sum()).backward()
    # every row's gradient counts the ranks that fetched it (its owner included)
    want = torch.zeros(off[-1])
    for r in range(len(lens)):
        for _, lo, hi in plan[r]:
            want[lo:hi] += 1
    grads_ok = bool((mine.grad == want[off[rank]:off[rank + 1]].view(1, 1, -1, 1)).all())
    return dict(traffic=msa.distributed.last_traffic(), rows_ok=rows_ok, grads_ok=grads_ok, dp=0, cp_rank=rank)


def hf_model(case: dict, attn_implementation: str):
    """A tiny Qwen2 (layer 0 dense causal, layer 1 a sliding window of 16), weights from the case's seed."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=100, use_cache=False, use_sliding_window=True,
                      sliding_window=16, max_window_layers=1)
    torch.manual_seed(case["seed"])
    return Qwen2ForCausalLM._from_config(cfg, attn_implementation=attn_implementation)


def hf_inputs(case: dict):
    """The whole sequence's token ids ``(1, N)`` and the logits' cotangent ``(1, N, vocab)``."""
    g = torch.Generator().manual_seed(case["seed"] + 1)
    n = sum(case["lens"])
    return torch.randint(0, 100, (1, n), generator=g), torch.randn(1, n, 100, generator=g)


def run_hf_case(case: dict, rank: int):
    """A Hugging Face model whose attention layers are context-parallel over the world
    (``register(..., context_parallel_group=)``): this rank's logits, and the parameter gradients
    summed over the ranks (what data parallelism's reduction would do)."""
    import msa_codegen.integrations.transformers as msa_hf

    msa_hf.register("msa_cp", context_parallel_group=dist.group.WORLD)
    model = hf_model(case, "msa_cp")
    ids, dlogits = hf_inputs(case)
    lens = case["lens"]
    s = sum(lens[:rank])
    e = s + lens[rank]
    logits = model(input_ids=ids[:, s:e], position_ids=torch.arange(s, e)[None]).logits
    (logits * dlogits[:, s:e]).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        grads[name] = p.grad
    return dict(out=logits.detach(), grads=grads, dp=0, cp_rank=rank)


def held_rows(case: dict, cp_rank: int) -> torch.Tensor:
    """The global rows rank ``cp_rank`` holds, in its local order (``halo.holdings``)."""
    from msa_codegen.distributed import halo

    held = halo.holdings(case["lens"], case.get("layout", "contiguous"))[cp_rank]
    return torch.cat([torch.arange(lo, hi) for lo, hi in held]) if held else torch.zeros(0, dtype=torch.long)


def run_case(case: dict, rank: int, world: int, dtype, device):
    import msa_codegen as msa

    if case.get("fetch_only"):
        return run_fetch_case(case, rank, dtype, device)
    if case.get("hf"):
        return run_hf_case(case, rank)
    group, cp_rank, dp = None, rank, 0
    if case.get("mesh"):
        from torch.distributed.device_mesh import init_device_mesh
        shape = tuple(case["mesh"])
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "cp")[-len(shape):])
        if len(shape) == 2:
            group, dp, cp_rank = (mesh, "cp"), rank // shape[1], rank % shape[1]
        else:
            group = mesh
    if case.get("fsdp"):
        return run_fsdp_case(case, rank, mesh, dp, cp_rank)
    q, k, v, dout, bi = case_inputs(case, dtype, device, dp)
    hq = case.get("Hq_by_rank", {}).get(str(rank), case["Hq"])
    rank_dtype = getattr(torch, case.get("dtype_by_rank", {}).get(str(rank), str(dtype).replace("torch.", "")))
    rows = held_rows(case, cp_rank)
    ql = q[:, :hq, rows].to(rank_dtype).clone().requires_grad_()
    kl, vl = (t[:, :, rows].to(rank_dtype).clone().requires_grad_() for t in (k, v))
    kwargs = dict(group=group, block_indices=bi)
    if case.get("layout"):
        kwargs["layout"] = case["layout"]
    if case.get("pass_lens"):
        kwargs["seq_lens"] = case.get("seq_lens_by_rank", {}).get(str(rank), case["lens"])
    pattern = case.get("pattern_by_rank", {}).get(str(rank), case["pattern"])
    fn = msa.context_parallel_attention
    if case.get("compile"):
        # torch.compile around the call (the default backend): the exchange and the host checks
        # break the graph, the kernels run as the custom op
        fn = torch.compile(fn)
    out = fn(ql, kl, vl, pattern, **kwargs)
    (out * dout[:, :hq, rows]).sum().backward()
    return dict(out=out.detach().cpu(), dq=ql.grad.cpu(), dk=kl.grad.cpu(), dv=vl.grad.cpu(),
                traffic=msa.distributed.last_traffic(), dp=dp, cp_rank=cp_rank, rows=rows)


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
    # every result is on disk: leave without the interpreter's teardown, where Gloo's worker
    # threads can still hold tensors and abort the process (pytorch/pytorch#179291 describes
    # such a SIGABRT; a rank in our CI aborted with "terminate called without an active
    # exception", at a point its log did not show)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
