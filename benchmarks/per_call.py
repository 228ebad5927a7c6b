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

SHAPES = {   # (B, H, N, D[, KV heads]). B*N = 32K tokens, H*D = 2048, as speed.py; and gpu_proof.sh's batch
    "d128_n1k": (32, 16, 1024, 128), "d128_n4k": (8, 16, 4096, 128), "d128_n16k": (2, 16, 16384, 128),
    "d64_n1k": (32, 32, 1024, 64), "d64_n4k": (8, 32, 4096, 64),
    "proof": (8, 10, 1024, 64, 5),   # the 60m preset (10 query / 5 KV heads of 64) at 8 x 1024 tokens a step
}


def methods(causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sage(q, k, v):
        return sagebwd_hf.sagebwd_attn_func(q, k, v, causal=causal)

    def sage_fast(q, k, v):
        return sagebwd_hf.sagebwd_attn_func(q, k, v, causal=causal, precision="fast")

    def sdpa(backend):
        refuses_gqa = []

        def call(q, k, v):   # GQA through enable_gqa, or K/V repeated where the backend refuses it (as speed.py)
            group = q.shape[1] // k.shape[1]
            if group > 1 and refuses_gqa:
                k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            with sdpa_kernel(backend):
                try:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=group > 1)
                except RuntimeError:
                    if group == 1 or refuses_gqa:
                        raise
                    refuses_gqa.append(True)
            return call(q, k, v)
        return call
    return {"sagebwd": sage, "sagebwd_fast": sage_fast, "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
            "flash": sdpa(SDPBackend.FLASH_ATTENTION)}


def host_ms(call, reps, trials=5):
    """Host time per call with the GPU busy for the whole loop (so no call waits on a kernel): the least of
    ``trials`` loops of ``reps`` calls (the device machines' host timings vary by 2x from loop to loop)."""
    best = float("inf")
    for _ in range(trials):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(1e9))    # ~0.5 s of GPU spinning at H100 clocks
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
    return best * 1e3 / reps


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
    b, h, n, d, *kv = SHAPES[shape]
    hk = kv[0] if kv else h
    q, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
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


def host_profile(shape, reps=20, top=45):
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


def host_parts(shape, reps=20):
    """Host time of each piece of a causal sagebwd call (padded, head-major inputs; the Hopper kernels), the
    launch cache on and off: where the host time of ``host ms`` goes, without a profiler's own overhead."""
    from sagebwd_hf import interface as itf
    from sagebwd_hf.kernels import launch as launch_cache
    from sagebwd_hf.kernels.hopper_launch import launch_backward_hopper
    from sagebwd_hf.kernels.hopper_launch import launch_forward_hopper
    from sagebwd_hf.kernels.layout import SeqLayout
    from sagebwd_hf.kernels.quantize import quantize, quantize_qk, quantize_v

    b, h, n, d, *kv = SHAPES[shape]
    hk = kv[0] if kv else h
    q, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lay, scale, window = SeqLayout(b, n, None), d ** -0.5, (-1, 0)
    quant = quantize_qk(q, k, lay, lay, scale, True, False, v4=v)
    v8t, v_scale = quantize_v(v, lay, None, quant.v_scale)
    out, lse = itf._forward(q, k, v, None, None, n, n, scale, window, True, False, "triton")
    bquant = quantize_qk(q, k, lay, lay, scale, True, False, transposed=True)
    do_q = quantize(do, lay, natural=False, transposed=True, out_for_delta=out)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        sagebwd_hf.sagebwd_attn_func(*leaves, causal=True).backward(do)

    parts = {
        "torch.empty [B,H,N] fp32": lambda: torch.empty(b, h, n, device="cuda"),
        "fwd: quantize_qk (K mean + V scales, K, Q)": lambda: quantize_qk(q, k, lay, lay, scale, True, False, v4=v),
        "fwd: quantize_v": lambda: quantize_v(v, lay, None, quant.v_scale),
        "fwd: launch_forward_hopper": lambda: launch_forward_hopper(quant, v8t, v_scale, out, lse, lay, lay, h,
                                                                     h // hk, d, window),
        "fwd: interface._forward (no op)": lambda: itf._forward(q, k, v, None, None, n, n, scale, window, True,
                                                                False, "triton"),
        "fwd: sagebwd_attn_func, no grad": lambda: _no_grad(sagebwd_hf.sagebwd_attn_func, q, k, v, causal=True),
        "bwd: quantize_qk transposed": lambda: quantize_qk(q, k, lay, lay, scale, True, False, transposed=True),
        "bwd: quantize dO (+ delta)": lambda: quantize(do, lay, natural=False, transposed=True, out_for_delta=out),
        "bwd: launch_backward_hopper (dV, dK, dQ)": lambda: launch_backward_hopper(
            bquant, v, do, do_q.x8t, do_q.scale, lse, do_q.delta, *grads, h, hk, d, window, scale),
        "bwd: interface._backward (no op)": lambda: itf._backward(do, q, k, v, out, lse, None, None, n, n, scale,
                                                                   window, True, False, "triton"),
        "fwd: sagebwd_attn_func, grad (graph built, no backward)": lambda: sagebwd_hf.sagebwd_attn_func(
            *leaves, causal=True),
        "fwd+bwd through autograd": fwd_bwd,
        "fwd+bwd: an identity autograd.Function (the engine alone)": lambda: _Identity.apply(leaves[0]).backward(
            leaves[0].detach()),
    }
    print(f"\n{shape}: host us per call (GPU kept busy), launch cache on / off")
    for name, call in parts.items():
        row = []
        for enabled in (True, False):
            launch_cache.ENABLED = enabled
            call()
            row.append(host_ms(call, reps) * 1e3)
        print(f"  {row[0]:8.1f} {row[1]:8.1f}  {name}")
    launch_cache.ENABLED = True
    # the backward runs on autograd's device thread: time interface._backward there, inside fwd_bwd
    inner, real_backward = [], itf._backward

    def timed_backward(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real_backward(*args, **kwargs)
        finally:
            inner.append(time.perf_counter() - t0)
    itf._backward = timed_backward
    try:
        total = host_ms(fwd_bwd, reps) * 1e3
    finally:
        itf._backward = real_backward
    print(f"  {total:8.1f}           fwd+bwd through autograd, of which interface._backward on autograd's thread: "
          f"{statistics.median(inner) * 1e6:.1f}")


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _no_grad(fn, *args, **kwargs):
    with torch.no_grad():
        return fn(*args, **kwargs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["d128_n1k", "d128_n4k", "d64_n1k"], choices=sorted(SHAPES))
    ap.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    ap.add_argument("--methods", nargs="+", default=["sagebwd", "cudnn", "flash"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--host-profile", choices=sorted(SHAPES), help="cProfile sagebwd's calls on this shape, then stop")
    ap.add_argument("--host-parts", choices=sorted(SHAPES), help="host time of each piece of a call, then stop")
    args = ap.parse_args()
    if args.host_parts:
        return host_parts(args.host_parts)
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
