"""Training throughput under context parallelism: one long sequence sharded over the GPUs of one host.

A Llama-3.2-1B-shaped model (benchmarks/e2e.py's: 1.24B parameters, 32/8 heads of 64, random init, bf16,
activation checkpointing) trains one sequence per step under torch's ``context_parallel`` (load-balanced causal
ring attention): forward, the chunked fused lm-head + cross-entropy of e2e.py, backward, gradients all-reduced,
AdamW. Tokens/s = sequence length / step time (the slowest rank's); peak memory is the largest rank's.

Attentions, each under the same context parallelism (the model is ``attn_implementation="sdpa"``; the ring calls
whichever SDPA kernel the backend picks):
  sdpa        torch's own choice (cuDNN on Hopper)
  sdpa-flash  SDPA's flash backend (FlashAttention 2)
  sagebwd     SDPA's flash backend with SageBwd active behind it (sagebwd_hf.sdpa_flash)

    torchrun --nproc_per_node 2 benchmarks/context_parallel.py --seqlens 65536 131072
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

IMPLS = ["sdpa", "sdpa-flash", "sagebwd"]


def _causal_without_mask(module, args, kwargs):
    kwargs["attention_mask"] = None
    kwargs["is_causal"] = True
    return args, kwargs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[65536, 131072])
    p.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS)
    p.add_argument("--steps", type=int, default=3, help="timed steps per (seqlen, impl)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--loss-chunk", type=int, default=4096)
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    import transformers
    import triton
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AutoModelForCausalLM, LlamaConfig

    from e2e import LLAMA_3_2_1B, fused_linear_cross_entropy
    from sagebwd_hf import sdpa_flash

    for var in ("SAGEBWD_POISON", "TRITON_INTERPRET"):
        os.environ.pop(var, None)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (world,))
    say = print if rank == 0 else (lambda *a, **k: None)

    cfg = LlamaConfig(**dict(LLAMA_3_2_1B, num_hidden_layers=args.layers))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    # What Accelerate does under context parallelism: the layers get no mask (a shard's load-balanced position ids
    # would read as packed sequences) and attend causally; the ring applies the causal pattern across shards.
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_pre_hook(_causal_without_mask, with_kwargs=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    fused_ce = fused_linear_cross_entropy(torch)
    say(f"# {torch.cuda.get_device_name()} x{world} | torch {torch.__version__} | triton {triton.__version__} | "
        f"transformers {transformers.__version__} | {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, "
        f"{args.layers} layers, activation checkpointing, one sequence a step", flush=True)

    def step(seq):
        gen = torch.Generator(device="cuda").manual_seed(seq)
        ids = torch.randint(0, cfg.vocab_size, (1, seq), device="cuda", generator=gen)
        labels = torch.randint(0, cfg.vocab_size, (1, seq), device="cuda", generator=gen)
        positions = torch.arange(seq, device="cuda")[None]
        with context_parallel(mesh, buffers=[ids, labels, positions], buffer_seq_dims=[1, 1, 1],
                              no_restore_buffers={ids, labels, positions}):
            h = model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
            loss = fused_ce(h.flatten(0, 1), model.lm_head.weight, labels.flatten(), args.loss_chunk)
            loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    rows = []
    for seq in args.seqlens:
        for impl in args.impls:
            backends = [SDPBackend.FLASH_ATTENTION] if impl != "sdpa" else [SDPBackend.CUDNN_ATTENTION,
                                                                           SDPBackend.FLASH_ATTENTION,
                                                                           SDPBackend.EFFICIENT_ATTENTION]
            if impl == "sagebwd":
                sdpa_flash.activate()
                sdpa_flash.reset_stats()
            torch.cuda.reset_peak_memory_stats()
            row = dict(seqlen=seq, impl=impl)
            try:
                with sdpa_kernel(backends):
                    for _ in range(args.warmup):
                        step(seq)
                    torch.cuda.synchronize()
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        loss = step(seq)
                    torch.cuda.synchronize()
                    dt = torch.tensor((time.perf_counter() - t0) / args.steps, device="cuda")
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device="cuda")
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                row.update(step_s=dt.item(), tokens_per_s=seq / dt.item(), peak_gib=peak.item(), loss=loss.item())
                if impl == "sagebwd":
                    row["sagebwd_calls"] = sdpa_flash.stats()
            except torch.cuda.OutOfMemoryError as exc:
                row["error"] = "OOM: " + str(exc).splitlines()[0][:100]
            finally:
                if impl == "sagebwd":
                    sdpa_flash.restore()
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            rows.append(row)
            say(f"  seq {seq:>7} {impl:<10} " + (row["error"] if "error" in row else
                f"{row['tokens_per_s'] / 1e3:6.2f} ktok/s  step {row['step_s']:6.2f} s  peak {row['peak_gib']:5.1f} GiB"
                f"  loss {row['loss']:.4f}" + (f"  {row['sagebwd_calls']}" if "sagebwd_calls" in row else "")),
                flush=True)

    say(f"\n== context parallelism x{world}: one sequence a step, tokens/s and peak GiB per GPU ==")
    say(f"{'seq':>7} {'impl':<10} {'ktok/s':>7} {'peak GiB':>8} {'x sdpa':>7} {'x flash':>7}")
    for r in rows:
        if "error" in r:
            say(f"{r['seqlen']:>7} {r['impl']:<10} {r['error']}")
            continue
        ref = {x["impl"]: x for x in rows if x["seqlen"] == r["seqlen"] and "tokens_per_s" in x}
        ratio = lambda name: f"{r['tokens_per_s'] / ref[name]['tokens_per_s']:.3f}" if name in ref else "-"  # noqa: E731
        say(f"{r['seqlen']:>7} {r['impl']:<10} {r['tokens_per_s'] / 1e3:>7.2f} {r['peak_gib']:>8.1f} "
            f"{ratio('sdpa'):>7} {ratio('sdpa-flash'):>7}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
