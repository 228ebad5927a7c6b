"""Host time of one attention call on a CPU, its launches stubbed: the op's own Python (argument checks, autograd,
layouts, allocations, launch arguments, TMA descriptors) without the GPU or Triton's launcher. Runs anywhere
(``TRITON_INTERPRET=1``; nothing is interpreted: every launch is recorded, not run); the Hopper path's host code
with dispatch answering as on an H100 (tests/launch_counting.py). Each stubbed launch still forms
kernels/launch.py's cache key from its arguments, the lookup a real launch makes first.

    TRITON_INTERPRET=1 python benchmarks/host_cpu.py [--shape 32 16 1024 128] [--reps 200] [--profile]

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

import torch  # noqa: E402

from launch_counting import Launches, call, inputs, stubbed_launches  # noqa: E402
from sagebwd_hf.kernels import launch as launch_module  # noqa: E402


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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=4, default=[32, 16, 1024, 128], metavar=("B", "H", "N", "D"))
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--packed", action="store_true")
    ap.add_argument("--device", default="meta", choices=["meta", "cpu"],
                    help="meta (default): tensors without data, so the op's torch ops (fills, copies) cost only their "
                         "dispatch, as they do on a GPU's host; cpu: real tensors (a CPU copy of dQ then costs ms)")
    ap.add_argument("--profile", action="store_true", help="cProfile the Hopper path's forward + backward")
    args = ap.parse_args()
    b, h, n, d = args.shape
    (q, k, v), cu, do = inputs(b, h, args.kv_heads or h, n, d, packed=args.packed)
    if args.device == "meta":
        assert not args.packed, "a packed batch's offsets are checked from their values: --device cpu"
        q, k, v = (x.detach().to("meta").requires_grad_() for x in (q, k, v))
        do = do.to("meta")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; shape B={b} H={h} "
          f"N={n} D={d}{' packed' if args.packed else ''}, causal, {args.device} tensors")
    for hopper in (True, False):
        keyed = KeyedLaunches()
        with stubbed_launches(hopper, keyed):

            def fwd():
                with torch.no_grad():
                    call(q, k, v, cu, n, causal=True)

            def fwd_bwd():
                call(q, k, v, cu, n, causal=True).backward(do)
                q.grad = k.grad = v.grad = None

            fwd_bwd()
            keyed.names.clear()
            fwd_bwd()
            count = keyed.total
            f_us, fb_us = best_us(fwd, args.reps), best_us(fwd_bwd, args.reps)
            print(f"{'hopper' if hopper else 'portable':<9} fwd {f_us:7.1f} us   fwd+bwd {fb_us:7.1f} us   "
                  f"({count} launches a fwd+bwd)")
            if args.profile and hopper:
                prof = cProfile.Profile()
                prof.runcall(lambda: [fwd_bwd() for _ in range(args.reps)])
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
