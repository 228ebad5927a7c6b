"""Host time of one attention call on a CPU, its launches stubbed: the op's own Python (argument checks, autograd,
layouts, allocations, launch arguments, TMA descriptors) without the GPU or Triton's launcher. Runs anywhere
(``TRITON_INTERPRET=1``; nothing is interpreted: every launch is recorded, not run); the Hopper path's host code
with dispatch answering as on an H100 (tests/launch_counting.py). Each stubbed launch still forms
kernels/launch.py's cache key from its arguments, the lookup a real launch makes first.

Paths (``--paths``): ``dense``, the op on a padded ``[B, H, N, D]`` batch (``--shape``); and the attention
function as Transformers calls it (``sagebwd_attention_forward``, a model's layer after the first: the same mask or
ids every call, as every layer of a forward gets them) on ``--lengths`` documents: ``padded``, one row each, right
padded, with the 2D padding mask; ``packed``, one row with restarting position_ids; ``cu_seq_lens``, that row with
the collator's cu_seq_lens_q/k and max_length_q/k. These run on real CPU tensors (the mask is read on the host):
their gathers and copies cost CPU time that a GPU's host does not spend, so ``--heads`` is small by default.
Each path also gives the device-to-host reads (tests/host_reads.py: each a GPU sync) of a call that finds its
mask cached (a later layer) and of one that does not (a forward's first layer).

    TRITON_INTERPRET=1 python tools/host_cpu.py [--paths dense padded packed cu_seq_lens] [--reps 200]
                                                     [--profile padded]

Prints µs a call (the least of 7 loops) for the forward and forward + backward, per path.
"""
import argparse
import cProfile
import os
import pstats
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch

from host_reads import counted_host_reads
from launch_counting import (TRANSFORMERS_PATHS, Launches, call, inputs, stubbed_launches,
                             transformers_call)
from sagebwd_hf.kernels import launch as launch_module, quantize


class KeyedLaunches(Launches):
    """Records a launch after forming kernels/launch.py's key, as the direct re-launch does before it launches."""

    def __call__(self, kernel, grid, *args, **kwargs):
        try:
            (id(kernel), 0, launch_module._key(args), tuple(kwargs.items())).__hash__()
        except launch_module._Uncached:
            pass
        super().__call__(kernel, grid, *args, **kwargs)


def best_us(fn, reps, trials=7):
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / reps * 1e6


# Documents of a padded micro-batch: mixed lengths as in benchmarks/packed_finetune.py (lognormal, mean 750), a
# tenth as long, so that the CPU's gathers, copies and fills of the tokens (on a GPU: launches, not host time) cost
# about what a launch costs the host, a few µs. The statistics' chunk is scaled alike (STATS_CHUNK below), so that
# the longest document takes the chunked statistics as most micro-batches there do (their longest past 512 tokens).
LENGTHS = [110, 30, 6, 70, 45, 13, 90, 21]
STATS_CHUNK = 64


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", nargs="+", default=["dense", *TRANSFORMERS_PATHS],
                    choices=["dense", *TRANSFORMERS_PATHS])
    ap.add_argument("--shape", type=int, nargs=4, default=[32, 16, 1024, 128], metavar=("B", "H", "N", "D"),
                    help="the dense path's batch")
    ap.add_argument("--kv-heads", type=int, default=None, help="the dense path's")
    ap.add_argument("--lengths", type=int, nargs="+", default=LENGTHS, help="documents of the Transformers paths")
    ap.add_argument("--heads", type=int, nargs=3, default=[2, 1, 64], metavar=("H", "HKV", "D"),
                    help="the Transformers paths' heads and head dim (their CPU copies grow with the heads)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--packed", action="store_true", help="the dense path as a packed batch (varlen)")
    ap.add_argument("--precision", default="accurate", help="the dense path's precision (a preset or rules)")
    ap.add_argument("--device", default="meta", choices=["meta", "cpu"],
                    help="the dense path's tensors: meta (default): tensors without data, so the op's torch ops "
                         "(fills, copies) cost only their dispatch, as they do on a GPU's host; cpu: real tensors "
                         "(a CPU copy of dQ then costs ms)")
    ap.add_argument("--profile", nargs="?", const="dense", default=None, choices=["dense", *TRANSFORMERS_PATHS],
                    help="cProfile the Hopper path's forward + backward of this path (default dense)")
    args = ap.parse_args()
    quantize.STATS_CHUNK = STATS_CHUNK   # (read at each call; the stubbed launches take it as an argument only)
    torch.set_num_threads(1)    # a GPU's host launches the copies; here they run, and threads only add noise
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    for path in args.paths:
        if path == "dense":
            cases = dense_cases(args)
        else:
            heads, kv_heads, head_dim = args.heads
            call, leaves, do = transformers_call(path, args.lengths, heads, kv_heads, head_dim)
            print(f"{path}: sagebwd_attention_forward, {len(args.lengths)} documents of {sum(args.lengths)} tokens "
                  f"(longest {max(args.lengths)}), H={heads} Hkv={kv_heads} D={head_dim}, causal, cpu tensors")
            cases = (call, leaves, do)
        measure(path, *cases, args)


def dense_cases(args):
    b, h, n, d = args.shape
    (q, k, v), cu, do = inputs(b, h, args.kv_heads or h, n, d, packed=args.packed)
    if args.device == "meta":
        assert not args.packed, "a packed batch's offsets are checked from their values: --device cpu"
        q, k, v = (x.detach().to("meta").requires_grad_() for x in (q, k, v))
        do = do.to("meta")
    print(f"dense: the op, B={b} H={h} N={n} D={d}{' packed' if args.packed else ''}, causal, {args.device} tensors, "
          f"precision {args.precision!r}")
    return (lambda fresh=False: call(q, k, v, cu, n, causal=True, precision=args.precision)), (q, k, v), do


def measure(path, run, leaves, do, args):
    # (the portable kernels compute precision="accurate" only)
    for hopper in (True, False) if path != "dense" or args.precision == "accurate" else (True,):
        keyed = KeyedLaunches()
        with stubbed_launches(hopper, keyed):

            def fwd():
                with torch.no_grad():
                    run()

            def fwd_bwd(fresh=False):
                run(fresh).backward(do)
                for x in leaves:
                    x.grad = None

            fwd_bwd()
            keyed.names.clear()
            with counted_host_reads() as reads:
                fwd_bwd()
            count = keyed.total
            with counted_host_reads() as first_reads:
                fwd_bwd(fresh=True)
            f_us, fb_us = best_us(fwd, args.reps), best_us(fwd_bwd, args.reps)
            print(f"  {'hopper' if hopper else 'portable':<9} fwd {f_us:7.1f} us   fwd+bwd {fb_us:7.1f} us   "
                  f"({count} launches a fwd+bwd; host reads: {sum(reads.values())} a later layer's, "
                  f"{sum(first_reads.values())} a first layer's {dict(first_reads)})")
            if args.profile == path and hopper:
                prof = cProfile.Profile()
                prof.runcall(lambda: [fwd_bwd() for _ in range(args.reps)])
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
