"""Chunked local attention (Llama 4's ``attention_chunk_size``) by each route the Transformers adapter can take, in
one run. Needs a CUDA GPU.

Rows of ``--seqlen`` tokens cut into chunks of ``--chunk`` (the last one shorter unless the chunk divides the row),
causal inside each chunk. Routes: ``split`` (the whole chunks as one padded batch, a shorter last chunk as one
more call, concatenated; an earlier route of the adapter), ``packed`` (every chunk a sequence
of one packed run through ``segmented_attention``: the adapter's route), and ``plain``: the
plain causal call on rows of one chunk (``B * N / C`` rows), the per-FLOP yardstick. Forward and
forward+backward ms (median of CUDA-event timings), TFLOP/s-equivalent (4*H*D*sum(c^2)/2 forward, 3.5x that for
both), and which kernels ran.

    python tools/chunked.py [--seqlen 20480] [--chunk 8192] [--batch 2] [--heads 16 40] [--kv-heads 16 8]
"""
import argparse

import torch

from sagebwd_hf import sagebwd_attn_func
from sagebwd_hf.segments import segmented_attention
from sagebwd_hf.transformers_integration import _dense

from packed import time_call   # (tools/ is the script's folder)


def split(q, k, v, size, op):
    """The whole chunks of ``[B, N, H, D]`` rows as one padded batch (a reshape of a slice: one copy), a shorter
    last chunk as one more call, concatenated."""
    whole = q.shape[1] // size * size
    outs = []
    if whole:
        rows = (x[:, :whole].reshape(-1, size, *x.shape[2:]) for x in (q, k, v))
        outs.append(_dense(*rows, op).reshape(q.shape[0], whole, *q.shape[2:3], -1))
    if whole < q.shape[1]:
        outs.append(_dense(q[:, whole:], k[:, whole:], v[:, whole:], op))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=20480)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", type=int, nargs="+", default=[16, 40])
    p.add_argument("--kv-heads", type=int, nargs="+", default=[16, 8])
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {__import__('triton').__version__}")
    print(f"{'heads':>7} {'route':<7} {'fwd ms':>8} {'TFLOP/s':>8} {'f+b ms':>8} {'TFLOP/s':>8} {'x plain':>8}  ran")
    b, n, c, d = args.batch, args.seqlen, args.chunk, args.head_dim
    chunks = [min(c, n - s) for s in range(0, n, c)]
    for h, hk in zip(args.heads, args.kv_heads):
        q, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ids = (torch.arange(n, device="cuda") // c).to(torch.int32)[None].expand(b, -1)
        op = dict(causal=True, softmax_scale=d ** -0.5)
        flops = 4.0 * h * d * b * sum(x * x for x in chunks) / 2
        plain_rate = None
        for route in ("plain", "split", "packed"):
            if route == "plain":   # rows of one whole chunk, [B', H, C, D]: the plain causal call's rate
                rows = b * n // c
                leaves = [torch.randn(rows, hh, c, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
                          for hh in (h, hk, hk)]
                grad = torch.randn(rows, h, c, d, device="cuda", dtype=torch.bfloat16)
                call = lambda: sagebwd_attn_func(*leaves, causal=True)  # noqa: E731
                route_flops = 4.0 * h * d * rows * c * c / 2
            else:
                leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
                grad = do
                route_flops = flops
                if route == "split":
                    call = lambda: split(*leaves, c, op)  # noqa: E731
                else:
                    call = lambda: segmented_attention(*leaves, None, ids, **op)  # noqa: E731
            f_ms, fb_ms, ran = time_call(call, leaves, grad)
            rate = 3.5 * route_flops / fb_ms * 1e-9
            plain_rate = plain_rate or rate
            print(f"{h:>3}/{hk:<3} {route:<7} {f_ms:8.3f} {route_flops / f_ms * 1e-9:8.0f} {fb_ms:8.3f} {rate:8.0f} "
                  f"{rate / plain_rate:8.2f}  {ran}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
