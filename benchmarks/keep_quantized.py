"""What handing the forward's INT8 Q and K to the backward saves: fwd+bwd of ``sagebwd_attn_func`` with the
forward keeping them (the default when a backward will run) against the backward quantizing Q and K again
(the K mean, Q and K with their token-major copies), in one process on the same inputs.

    python benchmarks/keep_quantized.py [--seqlens 4096 16384] [--head-dims 128 64]
"""
import argparse
from unittest import mock

import torch

from sagebwd_hf import interface, sagebwd_attn_func

from forward_kernels import median_ms


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--width", type=int, default=2048)
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {__import__('triton').__version__}")
    print(f"{'shape':<22} | {'recompute ms':>12} {'kept ms':>8} {'speed-up':>8} | peak GiB recompute / kept")
    for d in args.head_dims:
        for n in args.seqlens:
            for causal in (False, True):
                b, h = max(1, args.tokens // n), args.width // d
                q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=i < 3)
                               for i in range(4))

                def step():
                    out = sagebwd_attn_func(q, k, v, causal=causal)
                    return torch.autograd.grad(out, (q, k, v), do)

                results = {}
                for name, keep in (("recompute", False), ("kept", True)):
                    with mock.patch.object(interface, "_keeps_quantized", lambda *a, _keep=keep: _keep):
                        step()
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        base = torch.cuda.memory_allocated()
                        ms = median_ms(step)
                        results[name] = (ms, (torch.cuda.max_memory_allocated() - base) / 2 ** 30)
                shape = f"d{d}_n{n // 1024}k_{'causal' if causal else 'full'}"
                (r_ms, r_mem), (k_ms, k_mem) = results["recompute"], results["kept"]
                print(f"{shape:<22} | {r_ms:12.3f} {k_ms:8.3f} {r_ms / k_ms:7.3f}x | {r_mem:.2f} / {k_mem:.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
