"""The one-launch Gluon backward (``part="dkdvq"``: dV, dK and dQ's reduce-adds from the key-tile programs) against
the three launches the op runs today, on the same quantized inputs. Needs an sm_90 GPU.

Per shape: the whole backward's kernels (ms) for the three launches and for the one launch at each query tile
asked (its fp32 dQ accumulator zeroed and scaled into dQ included), and each variant's gradients against a float64
reference (cosine, relative L2 per tensor) on a smaller shape with K outliers, as the accuracy bar asks.

    python tools/fused_backward.py [--shapes d64_n4k d64_n1k llama] [--variants block_q=64,dq_buffers=2]
        [--check-only] [--once]

``--once``: each variant once per shape and causality after one untimed call (no timing, no check): what a
profiler captures, e.g. ``ncu --kernel-name regex:dkdv --launch-skip 1 --launch-count 1 ... python
tools/fused_backward.py --once --shapes d64_n4k --variants block_q=64 --causal no``.
"""
import argparse

import torch
import torch.nn.functional as F

from sagebwd_hf.kernels import plan
from sagebwd_hf.kernels.forward import launch_forward
from sagebwd_hf.kernels.layout import SeqLayout
from sagebwd_hf.kernels.quantize import quantize, quantize_qk, quantize_v
from sagebwd_hf.interface import tile_configs
from sagebwd_hf.testing import error_stats

from forward_kernels import median_ms, print_versions

SHAPES = {   # (B, H, Hk, N, D): 32K tokens, H*D = 2048 (as benchmarks/speed.py); llama: Llama-3.2-1B's attention
    "d64_n1k": (32, 32, 32, 1024, 64), "d64_n4k": (8, 32, 32, 4096, 64), "d64_n16k": (2, 32, 32, 16384, 64),
    "llama": (4, 32, 8, 8192, 64), "d128_n1k": (32, 16, 16, 1024, 128), "d128_n4k": (8, 16, 16, 4096, 128),
    "llama8b": (4, 32, 8, 8192, 128),   # Llama-3-8B's attention (32 heads over 8 KV heads, head dim 128)
}


def inputs(b, h, hk, n, d, causal, outliers=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, do = (torch.randn(b, h, n, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(b, hk, n, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    if outliers:   # benchmarks/accuracy.py's K-outlier inputs: a large per-channel bias on K
        k = (k.float() + 8 * torch.randn(1, hk, 1, d, device="cuda", generator=g)).bfloat16()
    lay, window, scale = SeqLayout(b, n, None), ((-1, 0) if causal else (-1, -1)), d ** -0.5
    quant = quantize_qk(q, k, lay, lay, scale, True, False, transposed=True, operand_order=True)
    qf = quantize_qk(q, k, lay, lay, scale, True, False, v4=v)
    v8t, v_scale = quantize_v(v, lay, v_scale=qf.v_scale)
    out, lse = torch.empty_like(q), torch.empty(b, h, n, device="cuda")
    launch_forward(qf, v8t, v_scale, out, lse, lay, lay, h, h // hk, d, window, tile_configs(d, q.device)["fwd"])
    do_q = quantize(do, lay, natural=False, transposed=True, out_for_delta=out, operand_order=True)
    return dict(q=q, k=k, v=v, do=do, quant=quant, do_q=do_q, lse=lse, window=window, scale=scale, h=h, hk=hk, d=d)


def backward(x, variant=None):
    """dq, dk, dv: the three launches (``variant`` None) or the one launch with these tuning arguments."""
    from sagebwd_hf.kernels.hopper_launch import launch_backward_hopper
    q, k, v = x["q"], x["k"], x["v"]
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    extra = {} if variant is None else dict(variant, fused_dq=True)

    def run():
        launch_backward_hopper(x["quant"], v, x["do"], x["do_q"].x8t, x["do_q"].scale, x["lse"],
                               x["do_q"].delta, *grads, x["h"], x["hk"], x["d"], x["window"], x["scale"],
                               programs=plan.gluon_programs(q.device), operand_order=True, **extra)
    return run, grads


def reference(x):
    q, k, v = (x[n].double().requires_grad_() for n in "qkv")
    rep = x["h"] // x["hk"]
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                       is_causal=x["window"] == (-1, 0), scale=x["scale"])
    return torch.autograd.grad(o, (q, k, v), x["do"].double())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["d64_n1k", "d64_n4k", "llama"])
    p.add_argument("--variants", nargs="+", default=["block_q=64"],
                   help="tuning arguments of the one launch, KEY=VALUE[,KEY=VALUE] each (e.g. dq_buffers=2)")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--once", action="store_true", help="run each variant twice, untimed (for a profiler)")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    a = p.parse_args()
    print_versions()
    variants = [None] + [{k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))} for spec in a.variants]
    name = lambda bq: "3 launches" if bq is None else ",".join(f"{k[:4]}{v}" for k, v in bq.items())  # noqa: E731
    causals = {"both": (False, True), "yes": (True, ), "no": (False, )}[a.causal]
    if a.once:
        for shape in a.shapes:
            for causal in causals:
                x = inputs(*SHAPES[shape], causal)
                for bq in variants[1:]:
                    run, _ = backward(x, bq)
                    run()
                    run()
                    torch.cuda.synchronize()
                    print(f"{shape} causal={causal} {name(bq)}: ran twice", flush=True)
        return
    print("accuracy against float64 (K outliers), cos / relL2:")
    head_dims = sorted({SHAPES[shape][4] for shape in a.shapes})     # at each head dim the shapes ask for
    for d, hk, causal in () if a.skip_check else [(d, hk, c) for d in head_dims for hk, c in
                                                   ((4, False), (4, True), (1, True))]:
        x = inputs(2, 4, hk, 1000, d, causal, outliers=True, seed=hk + causal)
        ref = reference(x)
        for bq in variants:
            try:
                run, grads = backward(x, bq)
                run()
            except Exception as e:   # noqa: BLE001  (e.g. the one launch at head dim 128 on main: its shared memory)
                print(f"  d={d} hk={hk} causal={causal:d} {name(bq):<16} {type(e).__name__}: {str(e)[:120]}")
                continue
            stats = [error_stats(g, r) for g, r in zip(grads, ref)]
            print(f"  d={d} hk={hk} causal={causal:d} {name(bq):<16}" + "".join(
                f" {t} {c:.5f} / {r:.2e}" for t, (c, r) in zip(("dq", "dk", "dv"), stats)))
    if a.check_only:
        return
    print(f"{'shape':<18} " + " ".join(f"{name(bq):>24}" for bq in variants) + "  (ms; ratio to 3 launches; relL2 "
          "of dq/dk/dv against them)")
    for shape in a.shapes:
        b, h, hk, n, d = SHAPES[shape]
        for causal in causals:
            x = inputs(b, h, hk, n, d, causal)
            cells, base, base_grads = [], None, None
            for bq in variants:
                try:
                    run, grads = backward(x, bq)
                    run()
                    ms = median_ms(run, reps=20)
                except Exception as e:   # noqa: BLE001  a variant that does not compile or fit: say so
                    cells.append(f"{type(e).__name__:>16}")
                    continue
                if bq is None:
                    base, base_grads = ms, grads
                    cells.append(f"{ms:>16.3f}")
                else:
                    rel = "/".join(f"{error_stats(g, r)[1]:.1e}" for g, r in zip(grads, base_grads))
                    cells.append(f"{ms:>8.3f} {base / ms:.3f}x {rel}")
            print(f"{shape + (' causal' if causal else ''):<18} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
