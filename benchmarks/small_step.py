"""A small model's training step, eager against ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), SageBwd
against SDPA: at small batches each attention call is bound by the host's Python and launches
(``per_call.py``), which a captured graph replays without. Needs a CUDA GPU.

Per implementation and mode: ms a step (forward + backward, no optimizer; median of the timed steps), and the
compiled step's loss and gradients against the eager step's on the same batch (relative L2).

    python benchmarks/small_step.py [--layers 12] [--batch 8] [--seq 1024] [--modes eager reduce-overhead]
"""
import argparse
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import sagebwd_hf  # registers attn_implementation="sagebwd"


def build(impl, layers):
    # examples/common/models.py's 60m preset (gpu_proof.sh's model) with the embedded tokenizer's 2K vocabulary
    config = AutoConfig.for_model("llama", vocab_size=2048, hidden_size=640, intermediate_size=1728,
                                  num_hidden_layers=layers, num_attention_heads=10, num_key_value_heads=5,
                                  head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.bfloat16).cuda()
    # the batches here are not packed: without the host read of position_ids a compiled step can be captured
    sagebwd_hf.configure(model, packed_position_ids=False)
    return model


def step(fn, model, ids):
    model.zero_grad(set_to_none=True)
    out = fn(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    # (copies: a CUDA-graph replay overwrites its outputs)
    return out.loss.detach().float().clone(), torch.cat([p.grad.flatten().float() for p in model.parameters()])


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--impls", nargs="+", default=["sagebwd", "sdpa"])
    p.add_argument("--modes", nargs="+", default=["eager", "reduce-overhead"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    ids = torch.randint(0, 2048, (a.batch, a.seq), generator=torch.Generator().manual_seed(0)).cuda()
    rows = []
    for impl in a.impls:
        model = build(impl, a.layers)
        eager_loss, eager_grads = step(model, model, ids)
        for mode in a.modes:
            torch._dynamo.reset()
            fn = model if mode == "eager" else torch.compile(model, mode=mode)
            t0 = time.perf_counter()
            for _ in range(a.warmup):
                torch.compiler.cudagraph_mark_step_begin()
                loss, grads = step(fn, model, ids)
            torch.cuda.synchronize()
            warm_s = time.perf_counter() - t0
            times = []
            for _ in range(a.steps):
                torch.compiler.cudagraph_mark_step_begin()
                t = time.perf_counter()
                step(fn, model, ids)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t) * 1e3)
            ms = statistics.median(times)
            rows.append((impl, mode, ms, rel(loss, eager_loss), rel(grads, eager_grads), warm_s))
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            print(f"{impl:8} {mode:16} {ms:8.2f} ms a step  loss rel {rows[-1][3]:.2e}  grads rel "
                  f"{rows[-1][4]:.2e}  (warm-up {warm_s:.0f} s; graphs compiled so far {graphs})", flush=True)
        del model
    base = {mode: ms for impl, mode, ms, *_ in rows if impl == "sdpa"}
    print(f"\n{'impl':8} {'mode':16} {'ms/step':>8} {'x sdpa':>7}  (sdpa of the same mode; >1: faster)")
    for impl, mode, ms, *_ in rows:
        print(f"{impl:8} {mode:16} {ms:8.2f} {base.get(mode, float('nan')) / ms:7.3f}")


if __name__ == "__main__":
    main()
