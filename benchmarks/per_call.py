"""What one attention call costs the host and the GPU, apart: for short sequences the op can be bound by
Python launch overhead rather than by its kernels, and CUDA events around a call (speed.py) cannot tell the two.

Per method and shape, for the forward and for forward + backward:
  host ms     Python time to issue one call while the GPU is kept busy (``torch.cuda._sleep``), so nothing
              waits on the device; a hidden device sync would show here as a huge number
  gpu ms      sum of the call's kernel times (torch.profiler)
  event ms    CUDA events around the call, as speed.py measures it (about max(host, gpu) when they overlap)
  launches    kernels per call
and the kernels of each sagebwd call by GPU time.

    python benchmarks/per_call.py [--shapes d128_n1k d128_n4k ...] [--causal both]
    python benchmarks/per_call.py --host-profile d128_n4k     # where the host time of sagebwd's calls goes
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import sagebwd_hf

SHAPES = {   # B*N = 32K tokens, H*D = 2048, as speed.py
    "d128_n1k": (32, 16, 1024, 128), "d128_n4k": (8, 16, 4096, 128), "d128_n16k": (2, 16, 16384, 128),
    "d64_n1k": (32, 32, 1024, 64), "d64_n4k": (8, 32, 4096, 64),
}


def methods(causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sage(q, k, v):
        return sagebwd_hf.sagebwd_attn_func(q, k, v, causal=causal)

    def sdpa(backend):
        def call(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return call
    return {"sagebwd": sage, "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "flash": sdpa(SDPBackend.FLASH_ATTENTION)}


def host_ms(call, reps):
    """Host time per call with the GPU busy for the whole loop (so no call waits on a kernel)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))    # ~1.5 s of GPU spinning at H100 clocks
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / reps


def event_ms(call, reps):
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times)


def kernels(call):
    """[(name, gpu ms, count)] of one call, by GPU time."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if t > 0 and e.count > 0:
            rows.append((e.key, t / 1e3, e.count))
    return sorted(rows, key=lambda r: -r[1])


def calls(shape, causal, method):
    """(forward, forward + backward) of ``method`` on fresh inputs of ``shape``, as closures."""
    b, h, n, d = SHAPES[shape]
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    fn = methods(causal)[method]

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def fwd_bwd():
        for x in (q, k, v):
            x.grad = None
        fn(q, k, v).backward(do)
    return fwd, fwd_bwd


def measure(shape, causal, args):
    rows = []
    for name in args.methods:
        fwd, fwd_bwd = calls(shape, causal, name)
        for _ in range(3):
            fwd_bwd()
        row = [shape + ("_causal" if causal else ""), name]
        for call in (fwd, fwd_bwd):
            ks = kernels(call)
            row += [host_ms(call, args.reps), sum(t for _, t, _ in ks), event_ms(call, args.reps),
                    sum(c for _, _, c in ks)]
            if name == "sagebwd":
                print(f"\n{row[0]} sagebwd {call.__name__}: kernels by GPU time")
                for kname, t, c in ks[:14]:
                    print(f"  {t:8.3f} ms  x{c:<3d} {kname[:110]}")
        rows.append(row)
    return rows


def host_profile(shape, reps=20, top=35):
    """cProfile of sagebwd's forward and forward + backward with the GPU kept busy (host work only)."""
    import cProfile
    import pstats
    fwd, fwd_bwd = calls(shape, False, "sagebwd")
    for call in (fwd, fwd_bwd):
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(3e9))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(reps):
            call()
        prof.disable()
        torch.cuda.synchronize()
        print(f"\n==== {shape} {call.__name__}: host profile over {reps} calls (times are totals)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(top)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["d128_n1k", "d128_n4k", "d64_n1k"], choices=sorted(SHAPES))
    ap.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    ap.add_argument("--methods", nargs="+", default=["sagebwd", "cudnn", "flash"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--host-profile", choices=sorted(SHAPES), help="cProfile sagebwd's calls on this shape, then stop")
    args = ap.parse_args()
    if args.host_profile:
        return host_profile(args.host_profile)
    torch.manual_seed(0)
    table = []
    for shape in args.shapes:
        for causal in {"no": [False], "yes": [True], "both": [False, True]}[args.causal]:
            table += measure(shape, causal, args)
            torch.cuda.empty_cache()
    print("\n| shape | method | fwd host ms | fwd gpu ms | fwd event ms | fwd launches "
          "| f+b host ms | f+b gpu ms | f+b event ms | f+b launches |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print("| " + " | ".join([r[0], r[1]] + [f"{x:.3f}" if isinstance(x, float) else str(x) for x in r[2:]])
              + " |")


if __name__ == "__main__":
    main()
