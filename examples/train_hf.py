"""Fine-tune a small randomly initialised Mistral-style causal LM (sliding-window attention on
every layer) through transformers, with msa's kernels or transformers' own attention.

    python examples/train_hf.py                                    # msa; GPU: bf16, 32k tokens
    python examples/train_hf.py --attn sdpa                        # same model, PyTorch SDPA
    python examples/train_hf.py --attn flex_attention              # transformers' FlexAttention path
    python examples/train_hf.py --attn msa --compile               # torch.compile(model), one graph
    python examples/train_hf.py --attn msa --pattern window=4096,dilation=2   # any msa pattern (msa only)

Prints the loss of every step, then tokens/s over the steps after the first (warm-up: kernel
compilation, autotuning caches) and, on a GPU, the peak memory. Without CUDA the kernels run in
Triton's interpreter: fp32 and a tiny model, so that it ends in about a minute.
"""
import argparse
import os
import sys
import time

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before msa_codegen loads any kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run from a checkout

import msa_codegen.integrations.transformers as msa_hf  # noqa: E402

GPU_DEFAULTS = dict(seqlen=32768, batch=1, layers=6, hidden=1024, heads=16, kv_heads=4, head_dim=64, window=4096,
                    vocab=32000, steps=10, dtype="bf16")
CPU_DEFAULTS = dict(seqlen=64, batch=1, layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, window=16,
                    vocab=128, steps=6, dtype="fp32")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv=None):
    d = GPU_DEFAULTS if HAS_CUDA else CPU_DEFAULTS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attn", default="msa", choices=["msa", "sdpa", "flex_attention", "eager"])
    p.add_argument("--seqlen", type=int, default=d["seqlen"])
    p.add_argument("--batch", type=int, default=d["batch"])
    p.add_argument("--steps", type=int, default=d["steps"])
    p.add_argument("--layers", type=int, default=d["layers"])
    p.add_argument("--hidden", type=int, default=d["hidden"])
    p.add_argument("--heads", type=int, default=d["heads"])
    p.add_argument("--kv-heads", type=int, default=d["kv_heads"])
    p.add_argument("--head-dim", type=int, default=d["head_dim"])
    p.add_argument("--window", type=int, default=d["window"], help="sliding window of every layer (0: dense causal)")
    p.add_argument("--vocab", type=int, default=d["vocab"])
    p.add_argument("--dtype", default=d["dtype"], choices=sorted(DTYPES))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--pattern", default=None, help="msa only: config.msa_pattern instead of the sliding window")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (fullgraph for msa)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from transformers import MistralConfig, MistralForCausalLM

    device = torch.device("cuda" if HAS_CUDA else "cpu")
    dtype = DTYPES[args.dtype]
    if not HAS_CUDA and dtype == torch.bfloat16 and args.attn == "msa":
        sys.exit("bf16 does not run in Triton's interpreter: use --dtype fp32 (or fp16) without a GPU")
    if not HAS_CUDA and args.attn == "flex_attention":
        sys.exit("FlexAttention has no backward on the CPU (torch raises NotImplementedError): --attn flex_attention "
                 "needs a GPU")
    if args.pattern and args.attn != "msa":
        sys.exit("--pattern is msa's own pattern language: only with --attn msa")
    msa_hf.register()

    cfg = MistralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                        num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                        max_position_embeddings=max(args.seqlen, 4096), sliding_window=args.window or None,
                        attention_dropout=0.0, use_cache=False)
    if args.pattern:
        cfg.msa_pattern = args.pattern
    if args.compile and args.attn == "msa":
        cfg.msa_packed_sequences = False   # position_ids are plain aranges here: one graph under compile
    torch.manual_seed(args.seed)
    model = MistralForCausalLM._from_config(cfg, attn_implementation=args.attn, dtype=dtype).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    what = args.pattern or (f"window={args.window}" if args.window else "causal")
    print(f"attn={args.attn} {what} layers={args.layers} hidden={args.hidden} heads={args.heads}/{args.kv_heads} "
          f"head_dim={args.head_dim} params={n_params / 1e6:.1f}M seqlen={args.seqlen} batch={args.batch} "
          f"dtype={args.dtype} device={device}{' compile' if args.compile else ''}"
          f"{' (Triton interpreter)' if not HAS_CUDA else ''}")
    run = torch.compile(model, fullgraph=args.attn == "msa") if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    # two fixed random batches, alternated: the loss can only go down by learning them
    g = torch.Generator().manual_seed(args.seed + 1)
    data = [torch.randint(0, args.vocab, (args.batch, args.seqlen), generator=g).to(device) for _ in range(2)]

    if HAS_CUDA:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.steps):
        x = data[step % 2]
        if HAS_CUDA:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = run(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if HAS_CUDA:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        print(f"step {step:3d}  loss {loss.item():.4f}  {times[-1] * 1e3:9.1f} ms", flush=True)

    tokens = args.batch * args.seqlen
    if len(times) > 1:
        rest = times[1:]
        print(f"throughput: {tokens * len(rest) / sum(rest):,.0f} tokens/s over steps 1-{len(times) - 1} "
              f"(step 0, warm-up: {times[0]:.2f} s)")
    if HAS_CUDA:
        print(f"peak memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
