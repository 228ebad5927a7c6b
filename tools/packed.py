"""Packed batches (``sagebwd_attn_varlen_func``) against the same sequences padded, in one run. Needs a CUDA GPU.

A packed batch of equal sequences does the padded batch's work, so its time per FLOP shows what packing costs
(the items past short sequences' ends, the 16-aligned token-major copies); uneven lengths show the real case
(SFT with packing, Llama 4's chunks with a shorter last one). Per shape and kernel family (``SAGEBWD_KERNELS``
auto, i.e. Gluon on Hopper, and triton): forward and forward+backward ms (median of CUDA-event timings) and
TFLOP/s-equivalent (4*H*sum(n_i^2)*D forward, 3.5x that for both, halved when causal), and which kernels ran.

    python tools/packed.py [--head-dims 128 64] [--tokens 32768] [--kernels auto]
"""
import argparse
import os

import torch

from sagebwd_hf import attention_stats, reset_attention_stats, sagebwd_attn_func, sagebwd_attn_varlen_func

from forward_kernels import median_ms   # (tools/ is the script's folder)


def time_call(call, leaves, grad):
    """(forward ms, forward+backward ms, the kernel families that ran) of ``call()`` on the tensors ``leaves``."""
    def fwd():
        with torch.no_grad():
            call()

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        call().backward(grad)
    reset_attention_stats()
    fwd_bwd()
    ran = ",".join(sorted(attention_stats()["kernels"]))
    return median_ms(fwd), median_ms(fwd_bwd), ran


def shapes(tokens):
    """(name, sequence lengths) summing to about ``tokens``."""
    return [("8x4K equal", [4096] * (tokens // 4096)),
            ("uneven 0.3K-6K", [(t * 2654435761 % 5800) + 300 for t in range(1, 64)]),
            ("chunks 8K + 4K", [8192, 8192, 8192, 4096])]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--width", type=int, default=2048, help="H * D (query heads)")
    p.add_argument("--kv-heads", type=int, default=None, help="default: as many as the query heads")
    p.add_argument("--kernels", nargs="+", default=["auto", "triton"], choices=["auto", "triton"],
                   help="kernel families (SAGEBWD_KERNELS) to time")
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {__import__('triton').__version__}")
    print(f"{'shape':<16} {'D':>3} {'causal':>6} {'layout':<7} {'kernels':<8} {'fwd ms':>8} {'TFLOP/s':>8} "
          f"{'f+b ms':>8} {'TFLOP/s':>8}  ran")
    for d in args.head_dims:
        h = args.width // d
        hk = args.kv_heads or h
        for name, lengths in shapes(args.tokens):
            lengths = [n for n in lengths if n > 0]
            total = sum(lengths)
            while total > args.tokens * 1.25:       # keep the batch near --tokens
                total -= lengths.pop()
            cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
            q, do = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(total, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            for causal in (False, True):
                flops = 4.0 * h * d * sum(n * n for n in lengths) * (0.5 if causal else 1.0)
                for kernels in args.kernels:
                    os.environ["SAGEBWD_KERNELS"] = kernels
                    for layout in ("packed", "padded"):
                        if layout == "packed":
                            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
                            call = lambda: sagebwd_attn_varlen_func(*leaves, cu, cu, max(lengths),  # noqa: E731
                                                                    max(lengths), causal=causal)
                            grad = do
                        elif len(set(lengths)) == 1:   # equal lengths: the same tokens as a [B, H, N, D] batch
                            b, n = len(lengths), lengths[0]
                            leaves = [x.detach().view(b, n, *x.shape[1:]).transpose(1, 2).clone().requires_grad_()
                                      for x in (q, k, v)]
                            call = lambda: sagebwd_attn_func(*leaves, causal=causal)  # noqa: E731
                            grad = do.view(b, n, h, d).transpose(1, 2)
                        else:
                            continue
                        f_ms, fb_ms, ran = time_call(call, leaves, grad)
                        print(f"{name:<16} {d:>3} {str(causal):>6} {layout:<7} {kernels:<8} {f_ms:8.3f} "
                              f"{flops / f_ms * 1e-9:8.0f} {fb_ms:8.3f} {3.5 * flops / fb_ms * 1e-9:8.0f}  {ran}",
                              flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
