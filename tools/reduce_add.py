"""What dQ's fp32 reduce-adds would cost a one-kernel backward (the one launch's design question). Needs a CUDA GPU.

In FlashAttention 3's schedule each key-tile program adds its share of dQ, a ``[BQ, D]`` fp32 tile per query
tile it visits, into a global dQ accumulator; the traffic is ``(N / BLOCK_N) * N * D * 4`` bytes a head (half of
it causal). This times exactly that traffic with nothing else: programs of ``BLOCK_N`` keys per (batch, head)
adding ones by ``tl.atomic_add`` (relaxed), against the same tiles written by ``tl.store`` (no reduction), and
checks the sums. Compare with the dQ launch of ``tools/backward_kernels.py`` at the same shape.

    python tools/reduce_add.py [--tokens 32768] [--heads 32] [--head-dim 64] [--seqlens 4096 8192]
"""
import argparse

import torch
import triton
import triton.language as tl

from forward_kernels import median_ms   # (tools/ is the script's folder)


@triton.jit
def _dq_traffic(DQ, n, D: tl.constexpr, BQ: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                ATOMIC: tl.constexpr):
    pid_n = tl.program_id(0)
    base = DQ + tl.program_id(1).to(tl.int64) * n * D
    ones = tl.full([BQ, D], 1.0, tl.float32)
    first = pid_n * BLOCK_N if CAUSAL else 0     # causal: the query tiles at or after the key tile
    for q0 in range(first, n, BQ):
        offs = (q0 + tl.arange(0, BQ))[:, None] * D + tl.arange(0, D)[None, :]
        if ATOMIC:
            tl.atomic_add(base + offs, ones, sem="relaxed")
        else:
            tl.store(base + offs, ones)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--block-n", type=int, nargs="+", default=[128, 256])
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    print(f"{'N':>6} {'B*H':>5} {'D':>4} {'BLOCK_N':>7} {'causal':>6} {'GB':>7} {'atomic ms':>10} {'TB/s':>6} "
          f"{'store ms':>9} {'TB/s':>6}")
    d, bq = args.head_dim, 64
    for n in args.seqlens:
        bh = args.tokens // n * args.heads
        dq = torch.zeros(bh, n, d, device="cuda", dtype=torch.float32)
        for block_n in args.block_n:
            for causal in (False, True):
                grid = (triton.cdiv(n, block_n), bh)
                tiles = sum(triton.cdiv(n - (i * block_n if causal else 0), bq) for i in range(grid[0]))
                gbytes = tiles * bq * d * 4 * bh / 1e9

                def run(atomic):
                    _dq_traffic[grid](dq, n, D=d, BQ=bq, BLOCK_N=block_n, CAUSAL=causal, ATOMIC=atomic, num_warps=4)
                dq.zero_()
                run(True)
                want = (torch.arange(n, device="cuda") // block_n + 1 if causal else
                        torch.full((n,), grid[0], device="cuda")).float()
                assert torch.equal(dq[0, :, 0], want), "reduce-add sums"
                ms_atomic, ms_store = median_ms(lambda: run(True)), median_ms(lambda: run(False))
                print(f"{n:>6} {bh:>5} {d:>4} {block_n:>7} {str(causal):>6} {gbytes:7.2f} {ms_atomic:10.3f} "
                      f"{gbytes / ms_atomic:6.2f} {ms_store:9.3f} {gbytes / ms_store:6.2f}", flush=True)
        dq = None   # freed before the next length's buffer (run() above reads dq from this scope)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
