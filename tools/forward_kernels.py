"""Forward kernels alone, on the same quantized inputs: the portable tl.dot kernel and the Gluon (Hopper) kernel
(with launch variants), plus the quantization pass before them. Needs an sm_90 GPU for the Gluon rows.

Kernel-only TFLOP/s-equivalent (4*B*H*N^2*D, halved when causal), median of CUDA-event timings; every variant's
output is checked against the portable kernel's (relative L2) and the first variant's (largest difference: the
schedule variants compute the same numbers) before it is timed. ``--varlen only`` runs a packed
batch with uneven and empty sequences through each Gluon variant. ``--precision`` runs each Gluon variant once
per precision (sagebwd_hf.numerics: "accurate" or a forward the Gluon kernel computes, e.g. "pv_e4m3+p_static",
the forward of "fast"), its rows named ``variant/precision`` (the first precision's without the suffix): "x first"
is then the speed-up over the first variant's first precision, "relL2" the error against the portable kernel's
accurate output.

    python tools/forward_kernels.py [--seqlens 4096] [--head-dims 128 64]
    python tools/forward_kernels.py --variants gluon_order gluon_3c_order --precision accurate pv_e4m3+p_static
"""
import argparse
import statistics

import torch

from sagebwd_hf.interface import tile_configs
from sagebwd_hf.kernels import plan
from sagebwd_hf.kernels.forward import launch_forward
from sagebwd_hf.kernels.layout import SeqLayout
from sagebwd_hf.kernels.quantize import aligned_starts, quantize_qk, quantize_v
from sagebwd_hf.numerics import parse_precision, precision_name
from sagebwd_hf.testing import error_stats


def add_shape_arguments(parser, seqlens):
    """The shape grid every kernel benchmark here sweeps: B*N tokens and H*D fixed, N and D varied."""
    parser.add_argument("--seqlens", type=int, nargs="+", default=seqlens)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--width", type=int, default=2048)


def print_versions():
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {__import__('triton').__version__}")


def median_ms(fn, reps=30, warmup=3):
    for _ in range(warmup):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def prepare(q, k, v, layout_q, layout_k, operand_order=False, e4m3=False):
    quant = quantize_qk(q, k, layout_q, layout_k, q.shape[-1] ** -0.5, True, False, v4=v,
                        v_e4m3=e4m3)   # as the op does
    v8t, v_scale = quantize_v(v, layout_k, v_scale=quant.v_scale, operand_order=operand_order, e4m3=e4m3)
    return quant, v8t, v_scale


def rule_options(precision):
    """The Gluon launch's keywords for a precision's forward rule."""
    rules = parse_precision(precision)
    return dict(pv_e4m3=rules.pv_e4m3, p_static=rules.p_static)


def check_varlen(variants, precisions=("accurate", )):
    """A varlen batch with uneven and empty sequences through every Gluon variant (a crash or a mismatch)."""
    from sagebwd_hf.kernels import hopper_launch as fh

    lengths = [300, 0, 1, 129, 128, 517]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    total, h, hk, d = int(cu[-1]), 4, 2, 128
    q, k, v = (torch.randn(1, n, total, d, device="cuda", dtype=torch.bfloat16) for n in (h, hk, hk))
    lay = SeqLayout(len(lengths), max(lengths), cu)
    quant, v8t, v_scale = prepare(q, k, v, lay, lay)
    ref = torch.full_like(q, float("nan"))
    lse = torch.empty(q.shape[:3], device="cuda")
    launch_forward(quant, v8t, v_scale, ref, lse, lay, lay, h, h // hk, d, (-1, 0), tile_configs(d, q.device)["fwd"])
    starts = aligned_starts(lay)            # the Gluon kernel's V^T layout for packed batches
    for precision in precisions:
        rule = rule_options(precision)
        v_aligned = {order: quantize_v(v, lay, starts, operand_order=order, e4m3=rule["pv_e4m3"])
                     for order in (False, True)}
        for name, kw in variants.items():
            out = torch.full_like(q, float("nan"))
            v8t_kw, v_scale_kw = v_aligned[kw.get("v_operand_order", False)]
            fh.launch_forward_hopper(quant, v8t_kw, v_scale_kw, out, lse, lay, lay, h, h // hk, d, (-1, 0),
                                     v_starts=starts, **kw, **rule)
            torch.cuda.synchronize()
            label = name if precision == precisions[0] else f"{name}/{precision}"
            print(f"varlen {label}: rel L2 vs portable {error_stats(out, ref)[1]:.2e}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(p, seqlens=[4096])
    p.add_argument("--varlen", choices=["only", "skip", "first"], default="skip",
                   help="the varlen check alone (a crash then takes no timing with it), not at all, or first")
    p.add_argument("--variants", nargs="+", default=None, help="Gluon launch variants to run (default: all)")
    p.add_argument("--precision", nargs="+", default=["accurate"],
                   help="the forward rules to run each Gluon variant with (sagebwd_hf.numerics' presets or rules "
                        "joined by '+'; default accurate)")
    args = p.parse_args()
    precisions = [precision_name(parse_precision(x)) for x in args.precision]
    from sagebwd_hf.kernels import hopper_launch as fh

    variants = {"gluon": {}, "gluon_pingpong": dict(pingpong=True), "gluon_no_pingpong": dict(pingpong=False),
                # three consumer warpgroups (192 query rows a program, 160 registers each)
                "gluon_3c": dict(consumers=3),
                # hardware named barriers for the turns and the buffer releases (no partition-wide bar.sync
                # before each mbarrier arrival)
                "gluon_named": dict(named_barriers=True), "gluon_3c_named": dict(consumers=3, named_barriers=True),
                # one program a work item instead of the op's persistent programs (one per SM)
                "gluon_per_item": dict(programs=None),
                # P V's keys in the order P's registers hold them (V^T permuted to match: no shuffles)
                "gluon_order": dict(v_operand_order=True), "gluon_3c_order": dict(consumers=3, v_operand_order=True)}
    # every variant on the op's schedule unless it says otherwise
    programs = plan.gluon_programs(torch.device("cuda"))
    variants = {k: dict(dict(programs=programs), **v) for k, v in variants.items()
                if args.variants is None or k in args.variants}
    print_versions()

    if args.varlen != "skip":
        check_varlen(variants, precisions)
    if args.varlen == "only":
        return

    print(f"{'shape':<22} {'quant ms':>8} | {'kernel':<21} {'ms':>7} {'TFLOP/s':>8} {'x port':>6} {'relL2':>8} "
          f"{'x first':>7} {'maxdiff':>8}")
    for d in args.head_dims:
        for n in args.seqlens:
            for causal in (False, True):
                b, h = max(1, args.tokens // n), args.width // d
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                lay = SeqLayout(b, n, None)
                quant_ms = median_ms(lambda: prepare(q, k, v, lay, lay))
                quant, v8t, v_scale = prepare(q, k, v, lay, lay)
                # each precision's V: (natural order, operand order) of (V^T, scales)
                v_inputs = {}
                for precision in precisions:
                    e4m3 = rule_options(precision)["pv_e4m3"]
                    quant_p = prepare(q, k, v, lay, lay, e4m3=e4m3)[0]
                    v_inputs[precision] = tuple(quantize_v(v, lay, v_scale=quant_p.v_scale, operand_order=order,
                                                           e4m3=e4m3) for order in (False, True))
                lse = torch.empty(b, h, n, device="cuda")
                window = (-1, 0) if causal else (-1, -1)
                flops = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
                ref = torch.empty_like(q)
                cfg = tile_configs(d, q.device)["fwd"]
                port = lambda: launch_forward(quant, v8t, v_scale, ref, lse, lay, lay, h, 1, d, window, cfg)  # noqa
                port_ms = median_ms(port)
                shape = f"d{d}_n{n // 1024}k_{'causal' if causal else 'full'}"
                print(f"{shape:<22} {quant_ms:8.3f} | {'portable':<21} {port_ms:7.3f} {flops / port_ms * 1e-9:8.0f}")
                first = first_ms = None
                for name, kw in variants.items():
                    for precision in precisions:
                        out = torch.full_like(q, float("nan"))
                        v8t_kw, v_scale_kw = v_inputs[precision][bool(kw.get("v_operand_order"))]
                        rule = rule_options(precision)
                        run = lambda: fh.launch_forward_hopper(  # noqa: E731
                            quant, v8t_kw, v_scale_kw, out, lse, lay, lay, h, 1, d, window, **kw, **rule)
                        run()
                        rel = error_stats(out, ref)[1]
                        ms = median_ms(run)
                        if first is None:
                            first, first_ms = out.clone(), ms
                        diff = (out.float() - first.float()).abs().max().item()
                        label = name if precision == precisions[0] else f"{name}/{precision}"
                        print(f"{'':<22} {'':>8} | {label:<21} {ms:7.3f} {flops / ms * 1e-9:8.0f} "
                              f"{port_ms / ms:6.2f} {rel:8.1e} {first_ms / ms:7.3f} {diff:8.1e}", flush=True)


if __name__ == "__main__":
    main()
