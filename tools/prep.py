"""The preparation passes alone (kernels/quantize.py), with the bandwidth each reaches: the statistics
(K mean, V channel max), the quantization of Q, K (natural and token-major; per token and per 128-token block),
V (token-major) and dO (with delta), against a plain copy of the same bytes. Two times per pass: one call as the op
makes it (CUDA events around it: the Python launch cost shows when the GPU has nothing else queued) and the GPU time
alone (the same launches replayed from a CUDA graph), which is what they cost inside a busy training step.

    python tools/prep.py [--seqlens 4096 16384] [--head-dims 128 64] [--tiles 64x4 128x8]

``--tiles``: the quantization passes again with each (tokens x warps) program tile (quantize.QUANTIZE_TILE).
"""
import argparse

import torch

from sagebwd_hf.kernels.layout import SeqLayout
from sagebwd_hf.kernels import quantize as quantize_module
from sagebwd_hf.kernels.quantize import quantize, token_stats

from forward_kernels import add_shape_arguments, median_ms, print_versions


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(p, seqlens=[4096, 16384])
    p.add_argument("--tiles", nargs="+", default=[], help="quantization tiles to compare, TOKENSxWARPS (e.g. 128x8)")
    args = p.parse_args()
    print_versions()
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles] or [quantize_module.QUANTIZE_TILE]
    print(f"{'shape':<12} {'pass':<16} {'tile':>6} {'call ms':>7} {'GB/s':>6} | {'GPU ms':>7} {'GB/s':>6}")
    for d in args.head_dims:
        for n in args.seqlens:
            b, h = max(1, args.tokens // n), args.width // d
            x, o = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            lay = SeqLayout(b, n, None)
            mean, cu = token_stats(x, lay, abs_max=False)
            vmax, _ = token_stats(x, lay, abs_max=True)
            xb = x.numel() * 2          # bytes of one bf16 input
            passes = [   # (name, fn, bytes moved)
                ("copy", lambda: o.copy_(x), 2 * xb),
                ("K mean", lambda: token_stats(x, lay, abs_max=False), xb),
                ("V max", lambda: token_stats(x, lay, abs_max=True), xb),
                ("Q", lambda: quantize(x, lay), 1.5 * xb),
                ("K - mean, +T", lambda: quantize(x, lay, sub=mean, sub_cu=cu, sub_block=1 << 30, transposed=True),
                 2 * xb),
                # K's rule at head dims 64 and 128: one scale per 128 tokens (fixed 128-token x 8-warp programs)
                ("K block", lambda: quantize(x, lay, sub=mean, sub_cu=cu, sub_block=1 << 30, block_scale=True),
                 1.5 * xb),
                ("K block, +T", lambda: quantize(x, lay, sub=mean, sub_cu=cu, sub_block=1 << 30, transposed=True,
                                                 block_scale=True), 2 * xb),
                ("V T only", lambda: quantize(x, lay, channel_scale=vmax, natural=False, transposed=True), 1.5 * xb),
                ("dO T + delta", lambda: quantize(x, lay, natural=False, transposed=True, out_for_delta=o), 2.5 * xb),
            ]
            for name, fn, nbytes in passes:
                for tile in (tiles if name not in ("copy", "K mean", "V max", "K block", "K block, +T") else [None]):
                    if tile is not None:
                        quantize_module.QUANTIZE_TILE = tile
                    ms = median_ms(fn)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        fn()
                    gpu_ms = median_ms(graph.replay)
                    label = f"{tile[0]}x{tile[1]}" if tile else "-"
                    print(f"d{d}_n{n // 1024}k{'':<5} {name:<16} {label:>6} {ms:7.3f} {nbytes / ms * 1e-6:6.0f} | "
                          f"{gpu_ms:7.3f} {nbytes / gpu_ms * 1e-6:6.0f}", flush=True)


if __name__ == "__main__":
    main()
