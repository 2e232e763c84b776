"""Context-parallel forward+backward time per rank against one GPU, and bytes moved against the halo.

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py --n 1048576 \
        --pattern window=4096,dilation=2 --heads 16 --head-dim 128 [--csv benchmarks/context_parallel.csv]

Every rank times ``context_parallel_attention`` on its N/P slice (NCCL, bf16); rank 0 then
times single-GPU ``attention`` on the whole sequence (when it fits) and prints the ratio. The issue's
bar: 2 GPUs at most 0.55x of one GPU's forward+backward time. Not run in CI.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os

import torch
import torch.distributed as dist
import triton
import triton.testing

import msa_codegen as msa
from msa_codegen.distributed import halo


def _fwd_bwd(fn, q, k, v, dout):
    def step():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(dout)
    return step


def _time_ms(step, reps_ms: int, barrier: bool) -> float:
    step()   # compile, warm the plan cache
    torch.cuda.synchronize()
    if barrier:
        dist.barrier()
    return triton.testing.do_bench(step, warmup=25, rep=reps_ms)


def bench_context_parallel(n: int = 1 << 20, pattern: str = "window=4096,dilation=2", heads: int = 16,
                           kv_heads: int | None = None, head_dim: int = 128, reps_ms: int = 500,
                           single: bool = True) -> dict:
    """One measurement on the current process group (call after ``init_process_group("nccl")``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    kv_heads = kv_heads or heads
    lens = [n // world + (r < n % world) for r in range(world)]
    s = sum(lens[:rank])
    g = torch.Generator(device=device).manual_seed(rank)

    def rand(h, m):
        return torch.randn(1, h, m, head_dim, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()

    q, k, v = rand(heads, lens[rank]), rand(kv_heads, lens[rank]), rand(kv_heads, lens[rank])
    dout = torch.randn_like(q)
    cp_ms = _time_ms(_fwd_bwd(lambda a, b, c: msa.context_parallel_attention(a, b, c, pattern), q, k, v, dout),
                     reps_ms, barrier=True)
    traffic = msa.distributed.last_traffic()
    want = halo.traffic_bytes(pattern, lens, batch=1, q_heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                              itemsize=2)[rank]
    row = dict(rank=rank, world=world, n=n, start=s, pattern=pattern, heads=heads, kv_heads=kv_heads,
               head_dim=head_dim, cp_ms=round(cp_ms, 3), fwd_received=traffic["forward_received"],
               bwd_sent=traffic["backward_sent"], halo_bytes=want,
               allgather_bytes=(n - lens[rank]) * 2 * kv_heads * head_dim * 2)
    times = [None] * world
    dist.all_gather_object(times, cp_ms)
    row["cp_ms_max"] = round(max(times), 3)
    del q, k, v, dout
    if single and rank == 0:
        torch.cuda.empty_cache()
        try:
            q, k, v = rand(heads, n), rand(kv_heads, n), rand(kv_heads, n)
            one_ms = _time_ms(_fwd_bwd(lambda a, b, c: msa.attention(a, b, c, pattern), q, k, v, torch.randn_like(q)),
                              reps_ms, barrier=False)
            row["one_gpu_ms"] = round(one_ms, 3)
            row["ratio"] = round(row["cp_ms_max"] / one_ms, 4)
        except torch.cuda.OutOfMemoryError:
            row["one_gpu_ms"] = "oom"
    dist.barrier()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1 << 20)
    ap.add_argument("--pattern", default="window=4096,dilation=2")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps-ms", type=int, default=500)
    ap.add_argument("--no-single", action="store_true", help="skip the one-GPU baseline")
    ap.add_argument("--csv", default=None, help="append rank 0's row to this CSV")
    args = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    try:
        row = bench_context_parallel(args.n, args.pattern, args.heads, args.kv_heads, args.head_dim, args.reps_ms,
                                     not args.no_single)
        print(row, flush=True)
        if args.csv and row["rank"] == 0:
            row = dict(date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), gpu=torch.cuda.get_device_name(),
                       torch=torch.__version__, triton=triton.__version__, msa_codegen=msa.__version__, **row)
            new = not os.path.exists(args.csv)
            with open(args.csv, "a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(row))
                if new:
                    w.writeheader()
                w.writerow(row)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
