"""Kernel-level speed: SageBwd against torch SDPA (cuDNN and flash backends) and, when installed,
sageattention 1.0.6's forward, on the same inputs in the same run. Needs a CUDA GPU.

TFLOP/s-equivalent: 4*B*H*N^2*D for the forward, 2.5x that for the backward, 3.5x for forward+backward,
halved when causal (H = query heads); with V's own head dim Dv (MLA, --mla) the forward's two products count
2*B*H*N^2*(D + Dv) and the backward's five 2*B*H*N^2*(3D + 2Dv). Shapes keep B*N = 32K tokens and H*D = 2048
(MLA: 16 heads of Q/K 192 and V 128, DeepSeek V2/V3's). Our time is the whole
op per call (quantization, smoothing, transposes and kernels), forward with inputs that require grad.

Timing: CUDA events around each call, median of --reps or more (as many as fit in --budget-ms per mode,
at most --max-reps), after one untimed call that JIT-compiles and --warmup untimed calls. Backward is
timed alone: each rep runs an untimed forward first. Peak memory: max_memory_allocated over one
forward+backward, minus what was allocated before it (q, k, v, dO), so it counts the output, what the
forward saves, the gradients and the workspaces. "cos" is each method's output against SDPA's (flash,
else cuDNN): a broken kernel shows up as a low cosine instead of a fast time.

    python benchmarks/speed.py                      # full sweep: D {128,64} x N {1K..16K} x causal/not + 2 GQA
    python benchmarks/speed.py --quick              # D {128,64} x N {1K,4K} x causal/not
    python benchmarks/speed.py --shapes 'd128_n4k_*' 'gqa*' --csv speed.csv
    python benchmarks/speed.py --list-shapes        # shape names (for --shapes), no GPU needed
    python benchmarks/speed.py --quick --mla        # + MLA's head dims (192/128) at the same N, causal or not;
                                                    #   flash gets V zero-padded to 192 (it needs one head dim)
    python benchmarks/speed.py --quick --methods sagebwd sagebwd@fastest cudnn   # any precision as a method

sageattention: `pip install --no-deps sageattention==1.0.6` (pure Python + Triton; tools/device_run.sh installs a
carried wheel from .whl/). Its sageattn() subtracts the key mean from k in place: it gets its own copy.
"""
import argparse
import csv
import fnmatch
import math
import os
import statistics
import sys
from dataclasses import dataclass

FULL_SEQLENS = [1024, 2048, 4096, 8192, 16384]
QUICK_SEQLENS = [1024, 4096]
# (head_dim, query heads, kv heads, seqlen, causal): H*D = 2048 as the grid, B*N = 32K.
# The first is Llama-3-like (D=128, 4 queries per KV head); the second is Llama-3.2-1B's attention
# (32 query heads, 8 KV heads, D=64) at 8K, the e2e benchmark's main point.
GQA_SHAPES = [(128, 16, 4, 4096, True), (64, 32, 8, 8192, True)]
# --mla: DeepSeek V2/V3's attention heads: Q/K head dim 192, V's 128, 16 heads
MLA_HEADS, MLA_HEAD_DIMS = 16, (192, 128)
METHODS = ["sagebwd", "sagebwd_fast", "sagebwd_portable", "sagebwd_sinks", "sagebwd_softcap",
           "sagebwd_softcap_portable", "cudnn", "flash", "sageattn"]
# The model-zoo options on the same shapes: sinks (one logit per head, gpt-oss) and a soft cap of 50 (Gemma 2)
# on the default kernels (on Hopper both passes Gluon), the cap on the portable kernels alone too.
# Each is compared with the plain call on the same kernels. Their "cos" is against plain SDPA, which computes
# neither (a cap of 50 barely moves these scores; sinks rescale every row).
FEATURE_METHODS = {"sagebwd_sinks": "sagebwd", "sagebwd_softcap": "sagebwd",
                   "sagebwd_softcap_portable": "sagebwd_portable"}
SOFTCAP = 50.0
# sagebwd runs what the dispatch picks (SAGEBWD_KERNELS=gluon: the Gluon forward on Hopper); sagebwd_portable
# forces the tl.dot kernels. Not in the default list while the dispatch picks those anyway.
DEFAULT_METHODS = ["sagebwd", "cudnn", "flash", "sageattn"]
# sagebwd_fast: the same kernels with precision="fast" (sagebwd_hf.numerics: FP8 e4m3 P·V and P^T·dO, fixed P
# scales); its rows are summarized against cuDNN and against sagebwd (the accurate preset) of the same run
TRAIN_METHODS = {"sagebwd", "sagebwd_fast", "sagebwd_portable", "sagebwd_sinks", "sagebwd_softcap",
                 "sagebwd_softcap_portable", "cudnn", "flash", "efficient"}   # sageattn has no backward
REFS = ("cudnn", "flash")


@dataclass(frozen=True)
class Shape:
    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int
    kv_heads: int
    head_dim_v: int = 0     # V's head dim when it differs from Q's and K's (MLA)

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def name(self) -> str:
        n = f"{self.seqlen // 1024}k" if self.seqlen % 1024 == 0 else str(self.seqlen)
        gqa = f"gqa{self.heads}x{self.kv_heads}_" if self.kv_heads != self.heads else ""
        v = f"v{self.dv}" if self.dv != self.head_dim else ""
        return f"{gqa}d{self.head_dim}{v}_n{n}_{'causal' if self.causal else 'full'}"

    def _products(self, qk: int, pv: int) -> float:
        """FLOPs of ``qk`` products over Q/K's head dim and ``pv`` over V's, each 2*B*H*N^2*dim (causal: half)."""
        scale = 2.0 * self.batch * self.heads * self.seqlen ** 2 * (0.5 if self.causal else 1.0)
        return scale * (qk * self.head_dim + pv * self.dv)

    @property
    def flops(self) -> float:
        """Forward FLOP-equivalent: S = Q K^T and O = P V."""
        return self._products(1, 1)

    @property
    def bwd_flops(self) -> float:
        """Backward: S = Q K^T again, dP = dO V^T, dV = P^T dO, dK = dS^T Q, dQ = dS K (2.5x the forward when
        the head dims agree)."""
        return self._products(3, 2)


def build_shapes(args) -> list:
    seqlens = args.seqlens or (QUICK_SEQLENS if args.quick else FULL_SEQLENS)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    shapes = []
    for d in args.head_dims:
        for n in seqlens:
            for causal in causals:
                h = args.width // d
                if h % args.gqa:
                    sys.exit(f"--gqa {args.gqa} does not divide {h} heads at D={d}")
                shapes.append(Shape(d, n, causal, max(1, args.tokens // n), h, h // args.gqa))
    if not (args.quick or args.no_gqa_shapes):
        for d, h, hk, n, causal in GQA_SHAPES:
            if causal in causals:
                shapes.append(Shape(d, n, causal, max(1, args.tokens // n), h, hk))
    if args.mla:
        for n in seqlens:
            for causal in causals:
                shapes.append(Shape(MLA_HEAD_DIMS[0], n, causal, max(1, args.tokens // n), MLA_HEADS, MLA_HEADS,
                                    MLA_HEAD_DIMS[1]))
    if args.shapes:
        def keep(name):
            return any(fnmatch.fnmatch(name, p.lower()) or (not any(c in p for c in "*?[") and p.lower() in name)
                       for p in args.shapes)
        shapes = [s for s in shapes if keep(s.name)]
    return list(dict.fromkeys(shapes))


# ---------------------------------------------------------------------------------------------------
# Methods: each gives fn(q, k, v) -> out [B, H, N, D]
# ---------------------------------------------------------------------------------------------------

def make_method(name, shape, torch, F, ctx):
    """Returns (fn, note). SDPA gets GQA through enable_gqa; a backend that refuses it gets K/V repeated
    (the repeat and its backward then count in its time, as they would in a model)."""
    causal, group = shape.causal, shape.heads // shape.kv_heads
    if name == "sagebwd":
        return (lambda q, k, v: ctx["sagebwd_attn_func"](q, k, v, causal=causal)), ""
    if name == "sagebwd_fast":
        return (lambda q, k, v: ctx["sagebwd_attn_func"](q, k, v, causal=causal, precision="fast")), ""
    if name.startswith("sagebwd@"):   # any precision (sagebwd_hf.numerics), e.g. sagebwd@pv_e4m3+dk_e4m3
        precision = name.split("@", 1)[1]
        return (lambda q, k, v: ctx["sagebwd_attn_func"](q, k, v, causal=causal, precision=precision)), ""
    if name == "sagebwd_sinks":
        sinks = torch.randn(shape.heads, device="cuda", requires_grad=True)   # its gradient is computed too
        return (lambda q, k, v: ctx["sagebwd_attn_func"](q, k, v, causal=causal, sinks=sinks)), ""
    if name == "sagebwd_softcap":
        return (lambda q, k, v: ctx["sagebwd_attn_func"](q, k, v, causal=causal, softcap=SOFTCAP)), ""
    if name == "sagebwd_softcap_portable":
        def softcap_portable(q, k, v):
            return ctx["sagebwd_attn_func"](q, k, v, causal=causal, softcap=SOFTCAP)
        softcap_portable.kernels = "triton"
        return softcap_portable, ""
    if name == "sagebwd_portable":
        def portable(q, k, v):
            return ctx["sagebwd_attn_func"](q, k, v, causal=causal)
        portable.kernels = "triton"   # SAGEBWD_KERNELS for all of bench(): the backward reads it too
        return portable, ""
    if name == "sageattn":
        sageattn = ctx["sageattn"]
        kcopy = {}

        def sa(q, k, v):   # forward only; sageattn mutates k (k -= mean): a private copy, made once
            if "k" not in kcopy:
                kcopy["k"] = k.detach().clone()
            with torch.no_grad():
                return sageattn(q.detach(), kcopy["k"], v.detach(), tensor_layout="HND", is_causal=causal)
        return sa, ""
    backend = ctx["backends"][name]
    sdpa_kernel = ctx["sdpa_kernel"]

    def native(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=group > 1)

    if shape.dv != shape.head_dim:
        def padded(q, k, v):    # one head dim for all three (FlashAttention 2): V zero-padded, O sliced
            v = F.pad(v, (0, shape.head_dim - shape.dv))
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)[..., :shape.dv]
        return (native, padded) if name == "cudnn" else (padded, "")

    def repeated(q, k, v):
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if group == 1:
        return native, ""
    return native, repeated


def time_ms(torch, call, reps, warmup, pre=None):
    """Median ms of call(pre()) over reps, CUDA events around the call only."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i in range(warmup + reps):
        state = pre() if pre is not None else None
        if i >= warmup:
            ev[i - warmup][0].record()
        call(state)
        if i >= warmup:
            ev[i - warmup][1].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def bench(torch, fn, train, q, k, v, do, args):
    """{fwd_ms, bwd_ms, fwd_bwd_ms, peak_gib, out} for one method on one shape (with ``fn.kernels`` as
    SAGEBWD_KERNELS, which the dispatch reads on every forward and backward)."""
    kernels = getattr(fn, "kernels", None)
    if kernels is None:
        return _bench(torch, fn, train, q, k, v, do, args)
    before = os.environ.get("SAGEBWD_KERNELS")
    os.environ["SAGEBWD_KERNELS"] = kernels
    try:
        return _bench(torch, fn, train, q, k, v, do, args)
    finally:
        os.environ.pop("SAGEBWD_KERNELS")
        if before is not None:
            os.environ["SAGEBWD_KERNELS"] = before


def _bench(torch, fn, train, q, k, v, do, args):
    leaves = (q, k, v)

    def clear():
        for x in leaves:
            x.grad = None

    def fwd(_):
        fn(q, k, v)

    def fwd_bwd(_):
        fn(q, k, v).backward(do)

    def fresh_out():
        clear()
        return fn(q, k, v)

    def bwd(out):
        out.backward(do)

    main, main_pre = (fwd_bwd, clear) if train else (fwd, None)
    time_ms(torch, main, 1, 1, main_pre)                 # compile + first-call work, untimed
    est = time_ms(torch, main, 1, 0, main_pre)
    reps = min(args.max_reps, max(args.reps, math.ceil(args.budget_ms / max(est, 1e-3))))
    res = {"fwd_ms": time_ms(torch, fwd, reps, args.warmup), "reps": reps}
    if train:
        res["bwd_ms"] = time_ms(torch, bwd, reps, args.warmup, fresh_out)
        res["fwd_bwd_ms"] = time_ms(torch, fwd_bwd, reps, args.warmup, clear)
    clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if train:
        fn(q, k, v).backward(do)
    else:
        fn(q, k, v)
    torch.cuda.synchronize()
    res["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    clear()
    with torch.no_grad():
        res["out"] = fn(q, k, v).float()
    return res


def spin_up(torch, seconds=1.0):
    """Clocks up before the first timed call: bf16 matrix products for about `seconds`."""
    import time
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def cosine(a, b) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------

def fmt(x, spec=".0f", width=5):
    return f"{x:{width}{spec}}" if isinstance(x, (int, float)) and x == x else f"{'-':>{width}}"


def ratio(rows, shape_name, method, ref, key):
    r = rows.get((shape_name, method))
    b = rows.get((shape_name, ref))
    if not r or not b or not r.get(key) or not b.get(key):
        return float("nan")
    return b[key] / r[key]


def print_summary(rows_list, shapes, meta):
    rows = {(r["shape"], r["method"]): r for r in rows_list}
    print(f"\n== summary: {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | "
          f"sageattention {meta['sageattention']} | B*N tokens fixed, bf16; TFLOP/s-equivalent ==")
    print(f"{'shape':<24} {'sagebwd TFLOP/s':^17} | {'f+b TFLOP/s':^11} | {'sa fwd':>6} | {'fwd x':>5} | "
          f"{'sagebwd x cuDNN':^16} | {'sagebwd x flash':^16} | {'peak GiB':^16} | cos")
    print(f"{'':<24} {'fwd':>5} {'bwd':>5} {'f+b':>5} | {'cudnn':>5} {'flash':>5} | {'':>6} | {'port':>5} | "
          f"{'fwd':>4} {'bwd':>5} {'f+b':>5} | {'fwd':>4} {'bwd':>5} {'f+b':>5} | {'sage':>4} {'cudnn':>5} "
          f"{'flash':>5} |")
    for s in shapes:
        sb = rows.get((s.name, "sagebwd"), {})
        g = lambda m, k: rows.get((s.name, m), {}).get(k, float("nan"))  # noqa: E731
        rc = [ratio(rows, s.name, "sagebwd", "cudnn", k) for k in ("fwd_ms", "bwd_ms", "fwd_bwd_ms")]
        rf = [ratio(rows, s.name, "sagebwd", "flash", k) for k in ("fwd_ms", "bwd_ms", "fwd_bwd_ms")]
        print(f"{s.name:<24} {fmt(sb.get('fwd_tflops'))} {fmt(sb.get('bwd_tflops'))} "
              f"{fmt(sb.get('fwd_bwd_tflops'))} | {fmt(g('cudnn', 'fwd_bwd_tflops'))} "
              f"{fmt(g('flash', 'fwd_bwd_tflops'))} | {fmt(g('sageattn', 'fwd_tflops'), width=6)} | "
              f"{fmt(ratio(rows, s.name, 'sagebwd', 'sagebwd_portable', 'fwd_ms'), '.2f')} | "
              f"{fmt(rc[0], '.2f', 4)} {fmt(rc[1], '.2f')} {fmt(rc[2], '.2f')} | "
              f"{fmt(rf[0], '.2f', 4)} {fmt(rf[1], '.2f')} {fmt(rf[2], '.2f')} | "
              f"{fmt(sb.get('peak_gib'), '.2f', 4)} {fmt(g('cudnn', 'peak_gib'), '.2f', 5)} "
              f"{fmt(g('flash', 'peak_gib'), '.2f', 5)} | {fmt(sb.get('out_cos'), '.4f', 6)}")
    print_targets(rows, shapes)
    print_fast(rows, shapes)
    print_features(rows, shapes)
    print_mla(rows, shapes)


def print_fast(rows, shapes):
    """The fast preset against cuDNN and against the accurate preset (time ratios, above 1 faster)."""
    if not any((s.name, "sagebwd_fast") in rows for s in shapes):
        return
    print("precision='fast' (fwd / bwd / f+b): x cuDNN | x accurate | peak GiB")
    for s in shapes:
        if (s.name, "sagebwd_fast") not in rows:
            continue
        keys = ("fwd_ms", "bwd_ms", "fwd_bwd_ms")
        rc = " ".join(fmt(ratio(rows, s.name, "sagebwd_fast", "cudnn", k), ".2f") for k in keys)
        ra = " ".join(fmt(ratio(rows, s.name, "sagebwd_fast", "sagebwd", k), ".2f") for k in keys)
        print(f"  {s.name:<24} {rc} | {ra} | {fmt(rows[(s.name, 'sagebwd_fast')].get('peak_gib'), '.2f', 5)}")


def print_mla(rows, shapes):
    """MLA's head dims against the plain D=128 shape of the same N and mask (the target: within 5% of its
    throughput per FLOP), each method against its own plain run."""
    pairs = [(s, next((p for p in shapes if p.head_dim == 128 and p.dv == 128 and p.heads == p.kv_heads
                       and (p.seqlen, p.causal) == (s.seqlen, s.causal)), None))
             for s in shapes if s.dv != s.head_dim]
    if not pairs:
        return
    print("MLA (TFLOP/s per FLOP against the plain D=128 shape of the same N; fwd / bwd / f+b):")
    for s, plain in pairs:
        for m in ("sagebwd", "sagebwd_portable", "cudnn", "flash"):
            r = rows.get((s.name, m))
            b = rows.get((plain.name, m)) if plain else None
            if not r:
                continue
            per_flop = [(r.get(k) or float("nan")) / b[k] if b and b.get(k) else float("nan")
                        for k in ("fwd_tflops", "bwd_tflops", "fwd_bwd_tflops")]
            print(f"  {s.name:<24} {m:<17} TFLOP/s {fmt(r.get('fwd_tflops'))} {fmt(r.get('bwd_tflops'))} "
                  f"{fmt(r.get('fwd_bwd_tflops'))} | x plain {' '.join(fmt(x, '.2f') for x in per_flop)} | "
                  f"f+b x cuDNN {fmt(ratio(rows, s.name, m, 'cudnn', 'fwd_bwd_ms'), '.2f')}")


def print_features(rows, shapes):
    """Each model-zoo option against the plain call it runs on (same FLOPs, so time ratios are throughput
    per FLOP ratios): plain / option, 1.00 = free."""
    measured = [m for m in FEATURE_METHODS if any((s.name, m) in rows for s in shapes)]
    if not measured:
        return
    print("options (throughput per FLOP against the plain call on the same kernels, and against the default):")
    for m in measured:
        base = FEATURE_METHODS[m]
        for s in shapes:
            if (s.name, m) not in rows:
                continue
            same = [ratio(rows, s.name, m, base, k) for k in ("fwd_ms", "bwd_ms", "fwd_bwd_ms")]
            dflt = ratio(rows, s.name, m, "sagebwd", "fwd_bwd_ms")
            print(f"  {m:<24} {s.name:<24} x {base:<16} fwd {fmt(same[0], '.2f')} bwd {fmt(same[1], '.2f')} "
                  f"f+b {fmt(same[2], '.2f')} | f+b x sagebwd {fmt(dflt, '.2f')}")


def print_targets(rows, shapes):
    """The kernel-level targets, each with its worst shape."""
    def worst(pred, ref, key):
        vals = [(ratio(rows, s.name, "sagebwd", ref, key), s.name) for s in shapes if pred(s)]
        vals = [v for v in vals if v[0] == v[0]]
        return min(vals) if vals else None

    d128 = lambda s: s.head_dim == 128 and s.seqlen >= 4096   # noqa: E731
    d64 = lambda s: s.head_dim == 64 and s.seqlen >= 4096     # noqa: E731
    every = lambda s: True                                    # noqa: E731
    checks = [("D=128 N>=4K fwd+bwd >= 1.20x cuDNN", d128, "cudnn", "fwd_bwd_ms", 1.2),
              ("D=128 N>=4K fwd     >= 1.15x cuDNN", d128, "cudnn", "fwd_ms", 1.15),
              ("D=64  N>=4K fwd+bwd >= 1.67x flash", d64, "flash", "fwd_bwd_ms", 1.67),
              ("D=64  N>=4K fwd+bwd >= 1.00x cuDNN", d64, "cudnn", "fwd_bwd_ms", 1.0),
              ("all shapes  fwd+bwd >= 1.00x flash", every, "flash", "fwd_bwd_ms", 1.0),
              ("all shapes  fwd     >= 1.00x flash", every, "flash", "fwd_ms", 1.0),
              ("all shapes  bwd     >= 1.00x flash", every, "flash", "bwd_ms", 1.0)]
    print("targets (worst shape):")
    for label, pred, ref, key, bar in checks:
        w = worst(pred, ref, key)
        if w is None:
            print(f"  {label}: not measured")
        else:
            print(f"  {label}: {'PASS' if w[0] >= bar else 'FAIL'}  worst {w[0]:.2f}x at {w[1]}")
    mem = [(rows[(s.name, 'flash')]['peak_gib'] - rows[(s.name, 'sagebwd')]['peak_gib'], s.name)
           for s in shapes if (s.name, "flash") in rows and (s.name, "sagebwd") in rows]
    if mem:
        m = min(mem)
        print(f"  peak memory <= flash's: {'PASS' if m[0] >= 0 else 'FAIL'}  "
              f"worst margin {m[0]:+.3f} GiB at {m[1]}")


# ---------------------------------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N in {1K, 4K}, no GQA shapes (the old default)")
    p.add_argument("--shapes", nargs="+", metavar="GLOB",
                   help="keep shapes whose name matches a glob (or contains the text), e.g. 'd128_*causal' gqa")
    p.add_argument("--list-shapes", action="store_true", help="print the selected shape names and exit")
    p.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    p.add_argument("--seqlens", type=int, nargs="+", default=None, help="default 1K..16K (--quick: 1K 4K)")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--tokens", type=int, default=32768, help="B * N")
    p.add_argument("--width", type=int, default=2048, help="H * D (query heads)")
    p.add_argument("--gqa", type=int, default=1, help="query heads per KV head for the grid shapes")
    p.add_argument("--no-gqa-shapes", action="store_true", help="leave out the two extra GQA shapes")
    p.add_argument("--mla", action="store_true", help="add MLA's head dims (Q/K 192, V 128, 16 heads) at each N")
    p.add_argument("--methods", "--backends", nargs="+", default=DEFAULT_METHODS,
                   help=f"of {METHODS + ['efficient']} (sageattn is skipped when not installed), or sagebwd@PRECISION "
                        "(any preset or rules joined by '+')")
    p.add_argument("--reps", type=int, default=10, help="fewest timed reps per mode")
    p.add_argument("--max-reps", type=int, default=50)
    p.add_argument("--budget-ms", type=float, default=100.0, help="more reps while they fit in this")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before each timed mode")
    p.add_argument("--csv", default=None)
    args = p.parse_args()
    shapes = build_shapes(args)
    if args.list_shapes:
        print("\n".join(f"{s.name:<26} B={s.batch} H={s.heads} Hkv={s.kv_heads} N={s.seqlen} D={s.head_dim} "
                        f"Dv={s.dv}" for s in shapes))
        return
    if not shapes:
        sys.exit("no shape matches --shapes")
    bad = [m for m in args.methods if m not in METHODS + ["efficient"] and not m.startswith("sagebwd@")]
    if bad:
        sys.exit(f"unknown method(s) {bad}; choose from {METHODS + ['efficient']}")

    import torch
    if not torch.cuda.is_available():
        sys.exit("speed.py needs a CUDA GPU (torch.cuda.is_available() is False); run it on the device machine")
    for var in ("SAGEBWD_POISON", "TRITON_INTERPRET"):   # test settings that would slow or break timing
        if os.environ.pop(var, None):
            print(f"# note: unset {var} for timing")
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ctx = {"sdpa_kernel": sdpa_kernel,
           "backends": {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION}}
    methods = list(args.methods)
    if any(m.startswith("sagebwd") for m in methods):
        from sagebwd_hf import sagebwd_attn_func
        ctx["sagebwd_attn_func"] = sagebwd_attn_func
    sa_version = "-"
    if "sageattn" in methods:
        try:
            from importlib.metadata import version
            from sageattention import sageattn
            ctx["sageattn"] = sageattn
            sa_version = version("sageattention")
        except Exception as e:  # noqa: BLE001  (not installed, or fails to import)
            print(f"# sageattn skipped: {type(e).__name__}: {e} (pip install --no-deps sageattention==1.0.6)")
            methods.remove("sageattn")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "sageattention": sa_version}
    print("# " + " | ".join(f"{k} {v}" for k, v in meta.items()))
    print(f"# {len(shapes)} shapes x {methods}; reps >= {args.reps} (<= {args.max_reps}), median, "
          f"warmup {args.warmup}")

    spin_up(torch)

    rows = []
    for s in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda *sz: torch.randn(*sz, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
        b, h, hk, n, d = s.batch, s.heads, s.kv_heads, s.seqlen, s.head_dim
        q, k, v, do = mk(b, h, n, d), mk(b, hk, n, d), mk(b, hk, n, s.dv), mk(b, h, n, s.dv)
        for x in (q, k, v):
            x.requires_grad_()
        results = {}
        for name in methods:
            fn, fallback = make_method(name, s, torch, F, ctx)
            note = ""
            try:
                try:
                    res = bench(torch, fn, name in TRAIN_METHODS or name.startswith("sagebwd@"), q, k, v, do, args)
                except RuntimeError as e:
                    if not fallback:
                        raise
                    note = f"repeat_kv ({str(e).splitlines()[0][:60]})"
                    res = bench(torch, fallback, True, q, k, v, do, args)
            except Exception as e:  # noqa: BLE001  (a backend that refuses the shape, OOM, a compile error)
                print(f"  {s.name} {name}: skipped, {type(e).__name__}: {str(e).splitlines()[0][:150]}")
                for x in (q, k, v):
                    x.grad = None
                torch.cuda.empty_cache()
                continue
            res["note"] = note
            results[name] = res
        ref = next((results[r]["out"] for r in ("flash", "cudnn") if r in results), None)
        for name, res in results.items():
            out = res.pop("out")
            row = dict(meta, shape=s.name, method=name, batch=b, heads=h, kv_heads=hk, seqlen=n, head_dim=d,
                       head_dim_v=s.dv, causal=s.causal, reps=res["reps"], fwd_ms=res["fwd_ms"],
                       bwd_ms=res.get("bwd_ms"), fwd_bwd_ms=res.get("fwd_bwd_ms"),
                       fwd_tflops=s.flops / res["fwd_ms"] * 1e-9,
                       bwd_tflops=s.bwd_flops / res["bwd_ms"] * 1e-9 if res.get("bwd_ms") else None,
                       fwd_bwd_tflops=((s.flops + s.bwd_flops) / res["fwd_bwd_ms"] * 1e-9
                                       if res.get("fwd_bwd_ms") else None),
                       peak_gib=res["peak_gib"], out_cos=cosine(out, ref) if ref is not None else None,
                       note=res["note"] + ("" if name in TRAIN_METHODS or name.startswith("sagebwd@") else
                                           "forward only"))
            for r in REFS:
                for key in ("fwd_ms", "bwd_ms", "fwd_bwd_ms"):
                    rr = results.get(r, {}).get(key)
                    row[f"x_{r}_{key[:-3]}"] = rr / row[key] if rr and row[key] else None
            rows.append(row)
            print(f"  {s.name:<24} {name:<9} fwd {row['fwd_ms']:8.3f} ms  bwd {fmt(row['bwd_ms'], '.3f', 8)} ms  "
                  f"f+b {fmt(row['fwd_bwd_ms'], '.3f', 8)} ms  TFLOP/s {fmt(row['fwd_tflops'], width=4)}/"
                  f"{fmt(row['bwd_tflops'], width=3)}/{fmt(row['fwd_bwd_tflops'], width=3)}  "
                  f"peak {row['peak_gib']:.2f} GiB  cos {fmt(row['out_cos'], '.5f', 7)}  "
                  f"x{res['reps']} {row['note']}", flush=True)
            if name == "sagebwd" and row["out_cos"] is not None and row["out_cos"] < 0.99:
                print(f"  WARNING: {s.name} sagebwd output cosine {row['out_cos']:.4f} against SDPA")
        del q, k, v, do, results, ref
        torch.cuda.empty_cache()
        write_csv(args.csv, rows)    # after every shape: a run stopped early keeps what it measured

    if args.csv and rows:
        print(f"# wrote {args.csv}")
    print_summary(rows, shapes, meta)


def write_csv(path, rows):
    if not path or not rows:
        return
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
