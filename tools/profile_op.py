"""Where one forward + backward of the op spends its time: each GPU kernel's time per step (torch.profiler), their
sum, the step's wall time, and the host's time to issue one step (timed behind queued GPU work), for one or more
precisions on one shape. Host time above the kernels' sum means steps back to back wait on the host (Python,
launches), not on the GPU.

    python tools/profile_op.py --head-dim 128 --seqlen 1024 --causal --precision fastest \\
        pv_e4m3+p_static+do_sequence+dk_e4m3+ds_bound

B·N and H·D are fixed (``--tokens``, ``--width``) as in benchmarks/speed.py. ``--documents``: one packed row of
``--tokens`` tokens in documents of benchmarks/packed_finetune.py's lognormal lengths, causal, through
``sagebwd_attn_varlen_func`` (``--kv-heads`` for GQA); the precision ``fa2-varlen`` is then FlashAttention 2's
varlen kernel as torch ships it, for comparison. Needs a CUDA GPU.
"""
import argparse
import collections
import os
import statistics
import sys
import time

import torch

FA2_VARLEN = "fa2-varlen"


def dense_step(precision, d, n, causal, tokens, width):
    """A padded ``[B, H, N, D]`` batch: its forward + backward, as a closure."""
    from sagebwd_hf import sagebwd_attn_func

    b, h = tokens // n, width // d
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()

    def step():
        for t in (q, k, v):
            t.grad = None     # (no gradient accumulation in the profile)
        sagebwd_attn_func(q, k, v, causal=causal, precision=precision).backward(do)
    return step, f"D={d} N={n} causal={causal} B={b} H={h}"


def documents_step(precision, d, tokens, width, kv_heads):
    """One packed row of lognormal documents, causal: its forward + backward, as a closure."""
    benchmarks = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    from packed_finetune import document_lengths
    from sagebwd_hf import sagebwd_attn_varlen_func

    lengths = document_lengths(tokens)
    h = width // d
    hkv = kv_heads or h
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    longest = max(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    for t in (q, k, v):
        t.requires_grad_()

    def attend():
        if precision == FA2_VARLEN:   # torch's op repeats no KV heads itself: GQA as FlashAttention 2 takes it
            return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, True, False)[0]
        return sagebwd_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True, precision=precision)

    def step():
        for t in (q, k, v):
            t.grad = None
        attend().backward(do)
    return step, f"D={d} {len(lengths)} documents of {tokens} tokens (longest {longest}) causal H={h} Hkv={hkv}"


def profile(precision, step, what, steps, top):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    host = []
    for _ in range(steps):            # the host's own time: a step issued behind ~20 ms of queued GPU work
        torch.cuda._sleep(40_000_000)
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    host = statistics.median(host) * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total, count = collections.defaultdict(float), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time_total
            count[e.name] += 1
    gpu = sum(total.values()) / steps / 1e3
    print(f"== {precision}  {what}: wall {wall:.3f} ms a step, host {host:.3f} ms, kernels "
          f"{gpu:.3f} ms ({len(total)} kinds, {sum(count.values()) // steps} launches a step)")
    for name, t in sorted(total.items(), key=lambda x: -x[1])[:top]:
        print(f"  {t / steps / 1e3:8.3f} ms  x{count[name] // steps:<2} {name[:100]}")
    return wall, host, gpu


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", nargs="+", default=["accurate"])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--tokens", type=int, default=32768, help="B·N")
    p.add_argument("--width", type=int, default=2048, help="H·D")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=14, help="kernels listed a precision")
    p.add_argument("--documents", action="store_true", help="one packed row of lognormal documents, causal")
    p.add_argument("--kv-heads", type=int, default=None, help="with --documents: KV heads (default: H)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_op.py needs a CUDA GPU")
    rows = []
    for name in args.precision:
        if args.documents:
            step, what = documents_step(name, args.head_dim, args.tokens, args.width, args.kv_heads)
        elif name == FA2_VARLEN:
            raise SystemExit(f"--precision {FA2_VARLEN} is a baseline of --documents only")
        else:
            step, what = dense_step(name, args.head_dim, args.seqlen, args.causal, args.tokens, args.width)
        rows.append((name, *profile(name, step, what, args.steps, args.top)))
    print("\n# precision: wall ms / host ms / kernels ms a step")
    for name, wall, host, gpu in rows:
        print(f"{name:<52} {wall:8.3f} {host:8.3f} {gpu:8.3f}")


if __name__ == "__main__":
    main()
