"""Accuracy of SageBwd against exact attention, with bf16 SDPA's own error beside it.

For O, dQ, dK, dV: cosine similarity and relative L2 against float64 attention (float32 with --ref-fp32),
on plain Gaussian inputs and on inputs whose K has channel outliers; SageBwd without K-smoothing beside
it shows what the smoothing buys. The bar: O and dV cosine >= 0.999, dQ and dK cosine >= 0.99
(with K-smoothing, the default).

    python benchmarks/accuracy.py                      # GPU: D=128, N=4096; CPU: a small shape
    python benchmarks/accuracy.py --check --csv out.csv
    python benchmarks/accuracy.py --softcap 20 --sinks    # Gemma 2's cap / gpt-oss's sinks, on both sides
    python benchmarks/accuracy.py --device cpu --seqlen 2048 --inputs k_outliers \
        --precision accurate,fast,pv_e4m3,p_static,ds_tile     # numerics presets and single rules

``--precision`` takes presets and rules (sagebwd_hf.numerics) joined by commas, one set of rows each. On a GPU the
Hopper kernels compute "accurate", "fast" and "pv_e4m3"; for the rules only the PyTorch path computes (``ds_tile``,
``p_static`` alone) add ``--backend naive``.

With --softcap or --sinks, the bf16 baseline is eager attention (attention_exact) in the input dtype: SDPA
computes neither.
"""
import argparse
import csv
import os
import platform
import sys

import torch
import torch.nn.functional as F

from sagebwd_hf import attention_stats, reset_attention_stats, sagebwd_attn_func
from sagebwd_hf.naive import attention_exact
from sagebwd_hf.testing import compare, make_qkv, run_with_grads

BAR = {"O": 0.999, "dV": 0.999, "dQ": 0.99, "dK": 0.99}


def sdpa(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def main():
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8 if cuda else 2)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--seqlen", type=int, default=4096 if cuda else 512)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--outlier", type=float, default=10.0, help="K channel offset, in standard deviations")
    p.add_argument("--ref-fp32", action="store_true", help="float32 reference instead of float64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", default=None)
    p.add_argument("--check", action="store_true", help="exit 1 if the bar is missed")
    p.add_argument("--softcap", type=float, default=0.0, help="logit soft-capping (Gemma 2 uses 50)")
    p.add_argument("--sinks", action="store_true", help="attention sinks: one N(0, 2^2) logit per head")
    p.add_argument("--precision", default="accurate",
                   help="comma-separated presets or rules: accurate, fast, pv_e4m3, p_static, ds_tile, "
                        "pv_e4m3+ds_tile, ...")
    p.add_argument("--inputs", default="gaussian,k_outliers", help="comma-separated: gaussian, k_outliers")
    p.add_argument("--backend", default=None, choices=["naive", "triton"],
                   help="force the op's backend (default: Triton on CUDA, PyTorch on CPU)")
    p.add_argument("--deterministic", action="store_true",
                   help="the deterministic backward (deterministic=True); default: the op's default (fast on Hopper "
                        "at head dim 64: the one launch)")
    args = p.parse_args()

    dtype = getattr(torch, args.dtype)
    ref_dtype = torch.float32 if args.ref_fp32 else torch.float64
    kv_heads = args.kv_heads or args.heads
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    import triton
    print(f"# device {device_name} | torch {torch.__version__} | triton {triton.__version__} | "
          f"B={args.batch} H={args.heads}/{kv_heads} N={args.seqlen} D={args.head_dim} {args.dtype} | "
          f"reference {ref_dtype} | Triton interpreter: {os.environ.get('TRITON_INTERPRET') == '1'} | "
          f"softcap {args.softcap:g} | sinks {args.sinks} | backend {args.backend or 'default'}")
    extras = bool(args.softcap) or args.sinks
    gen = torch.Generator().manual_seed(args.seed + 1)
    sinks = (torch.randn(args.heads, generator=gen) * 2.0).to(args.device) if args.sinks else None

    def exact(q, k, v, causal, dtype):
        return attention_exact(q.to(dtype), k.to(dtype), v.to(dtype), None, (-1, 0) if causal else (-1, -1), dtype,
                               softcap=args.softcap, sinks=sinks)[0]

    rows = []
    precisions = args.precision.split(",")
    for inputs in args.inputs.split(","):
        for causal in (False, True):
            q, k, v, do = make_qkv(args.batch, args.heads, kv_heads, args.seqlen, args.seqlen, args.head_dim,
                                   dtype, args.device, k_outliers=args.outlier if inputs == "k_outliers" else 0.0,
                                   seed=args.seed)
            ref = run_with_grads(lambda a, b, c: exact(a, b, c, causal, ref_dtype), q.to(ref_dtype),
                                 k.to(ref_dtype), v.to(ref_dtype), do.to(ref_dtype))
            base = compare(run_with_grads((lambda a, b, c: exact(a, b, c, causal, dtype)) if extras else
                                          (lambda a, b, c: sdpa(a, b, c, causal)), q, k, v, do), ref)
            for precision in precisions:
                opts = dict(causal=causal, softcap=args.softcap, sinks=sinks, deterministic=args.deterministic or None,
                            precision=precision, backend=args.backend)
                reset_attention_stats()
                ours = compare(run_with_grads(lambda a, b, c: sagebwd_attn_func(a, b, c, **opts), q, k, v, do), ref)
                backward = "+".join(sorted(n for n in attention_stats()["kernels"] if n.startswith("bwd_")))
                plain = compare(run_with_grads(lambda a, b, c: sagebwd_attn_func(a, b, c, k_smoothing=False, **opts),
                                               q, k, v, do), ref)
                for name in ("O", "dQ", "dK", "dV"):
                    rows.append(dict(inputs=inputs, causal=causal, precision=precision, tensor=name, backward=backward,
                                     sagebwd_cos=ours[name][0], sagebwd_rel_l2=ours[name][1],
                                     sdpa_bf16_cos=base[name][0], sdpa_bf16_rel_l2=base[name][1],
                                     no_k_smoothing_cos=plain[name][0], no_k_smoothing_rel_l2=plain[name][1],
                                     bar_cos=BAR[name], meets_bar=ours[name][0] >= BAR[name]))
            del ref
            if args.device == "cuda":
                torch.cuda.empty_cache()

    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(f"# backward kernels: {', '.join(sorted(set(r['backward'] for r in rows)))}")
    print(f"{'inputs':<11} {'causal':<6} {'precision':<16} {'tensor':<6} {'sagebwd cos':>11} {'rel L2':>8}   "
          f"{'sdpa ' + {'bfloat16': 'bf16', 'float16': 'fp16'}[args.dtype] + ' cos':>13} {'rel L2':>8}   "
          f"{'no K-smooth cos':>15} {'rel L2':>8}   bar")
    for r in rows:
        print(f"{r['inputs']:<11} {str(r['causal']):<6} {r['precision']:<16} {r['tensor']:<6} "
              f"{r['sagebwd_cos']:>11.5f} {r['sagebwd_rel_l2']:>8.4f}   "
              f"{r['sdpa_bf16_cos']:>13.5f} {r['sdpa_bf16_rel_l2']:>8.4f}   "
              f"{r['no_k_smoothing_cos']:>15.5f} {r['no_k_smoothing_rel_l2']:>8.4f}   "
              f">={r['bar_cos']} {'ok' if r['meets_bar'] else 'MISSED'}")
    missed = [r for r in rows if not r["meets_bar"]]
    if args.check and missed:
        print(f"{len(missed)} rows miss the bar", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
