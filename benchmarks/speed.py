"""Kernel-level speed: SageBwd against torch SDPA (cuDNN and flash backends), same inputs, same run.

TFLOP/s-equivalent: 4*B*H*N^2*D for the forward, 2.5x that for the backward, halved when causal.
Shapes keep B*N = 32K tokens and H*D = 2048. Our time is the whole op (quantization, smoothing,
transposes and kernels). Needs a CUDA GPU.

    python benchmarks/speed.py                       # D in {64, 128}, N in {1K, 4K}, causal and not
    python benchmarks/speed.py --seqlens 1024 2048 4096 8192 16384 --csv speed.csv
"""
import argparse
import csv

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from sagebwd_hf import sagebwd_attn_func

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def make_fn(name, causal, group):
    if name == "sagebwd":
        return lambda q, k, v: sagebwd_attn_func(q, k, v, causal=causal)

    def sdpa(q, k, v):
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        with sdpa_kernel(BACKENDS[name]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return sdpa


def bench(fn, q, k, v, do):
    """Median ms of forward, backward (from a fresh graph each time), forward+backward; peak GiB."""
    fwd = triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median")
    out = fn(q, k, v)
    bwd = triton.testing.do_bench(lambda: out.backward(do, retain_graph=True), warmup=25, rep=100,
                                  grad_to_none=[q, k, v], return_mode="median")
    del out
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()

    def step():
        fn(q, k, v).backward(do)
    both = triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=[q, k, v], return_mode="median")
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return fwd, bwd, both, peak


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--tokens", type=int, default=32768, help="B * N")
    p.add_argument("--width", type=int, default=2048, help="H * D")
    p.add_argument("--gqa", type=int, default=1, help="query heads per KV head")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--backends", nargs="+", default=["sagebwd", "cudnn", "flash"])
    p.add_argument("--csv", default=None)
    args = p.parse_args()

    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    rows = []
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    for d in args.head_dims:
        for n in args.seqlens:
            for causal in causals:
                b, h = max(1, args.tokens // n), args.width // d
                hk = h // args.gqa
                gen = torch.Generator(device="cuda").manual_seed(0)
                mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
                q, k, v, do = mk(b, h, n, d), mk(b, hk, n, d), mk(b, hk, n, d), mk(b, h, n, d)
                for x in (q, k, v):
                    x.requires_grad_()
                flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                for name in args.backends:
                    try:
                        fwd, bwd, both, peak = bench(make_fn(name, causal, args.gqa), q, k, v, do)
                    except RuntimeError as e:   # e.g. a backend that does not take this shape
                        print(f"  {name} D={d} N={n} causal={causal}: {str(e).splitlines()[0]}")
                        continue
                    rows.append(dict(backend=name, head_dim=d, seqlen=n, batch=b, heads=h, kv_heads=hk,
                                     causal=causal, fwd_ms=fwd, bwd_ms=bwd, fwd_bwd_ms=both,
                                     fwd_tflops=flops / fwd * 1e-9, bwd_tflops=2.5 * flops / bwd * 1e-9,
                                     fwd_bwd_tflops=3.5 * flops / both * 1e-9, peak_gib=peak))
                del q, k, v, do
                torch.cuda.empty_cache()

    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(f"{'backend':<8} {'D':>4} {'N':>6} {'causal':<6} {'fwd':>6} {'bwd':>6} {'f+b':>6} TFLOP/s   "
          f"{'x cudnn (f/b/f+b)':<20} {'x flash (f/b/f+b)':<20} peak GiB")
    for r in rows:
        ratios = []
        for ref in ("cudnn", "flash"):
            base = next((x for x in rows if x["backend"] == ref and x["head_dim"] == r["head_dim"]
                         and x["seqlen"] == r["seqlen"] and x["causal"] == r["causal"]), None)
            ratios.append("/".join(f"{base[k] / r[k]:.2f}" for k in ("fwd_ms", "bwd_ms", "fwd_bwd_ms"))
                          if base else "-")
        print(f"{r['backend']:<8} {r['head_dim']:>4} {r['seqlen']:>6} {str(r['causal']):<6} "
              f"{r['fwd_tflops']:>6.0f} {r['bwd_tflops']:>6.0f} {r['fwd_bwd_tflops']:>6.0f}           "
              f"{ratios[0]:<20} {ratios[1]:<20} {r['peak_gib']:.2f}")


if __name__ == "__main__":
    main()
