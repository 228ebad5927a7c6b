"""The backward kernels alone, on the same quantized inputs: the portable launches against the Gluon (Hopper)
ones in kernels/backward_hopper.py, one at a time (dv, dk, dq) and all of them ("bwd": as the op runs them).
Needs an sm_90 GPU.

TFLOP/s-equivalent per launch: dV counts 2 products (S^T, dV), dK 3 (S^T, dP^T, dK), dQ 3 (S, dP, dQ), the
whole backward 5 (the usual count), each 2*B*H*N^2*D, halved when causal. Median of CUDA-event timings; each
Gluon result is checked against the portable one (relative L2) before it is timed.

    python tools/backward_kernels.py [--seqlens 4096 16384] [--head-dims 128 64] [--parts dv dk dq bwd]
        [--variant block_q=64 --variant programs=0 --variant operand_order=1]
        [--precision accurate pv_e4m3 pv_e4m3+p_static]

``--precision``: the Gluon dv and bwd launches once per precision (sagebwd_hf.numerics: "accurate" or a rule the
Gluon backward computes, dV = P^T dO in FP8 e4m3; dk and dq are the same kernels in every such rule, timed once), on
dO prepared for it (e4m3 per token, or with p_static per channel per 128-query tile), rows named ``part/precision``
for all but the first; "x first" is the speed-up over the first precision's row of the same part and variant, and
"relL2" stays against the portable accurate kernels (the rule's own error, ~3e-2, for e4m3).

The Gluon launches run the op's schedule (one persistent program per SM); ``--variant programs=0`` times one
program a work item.

A variant with other tile rules (block_q) has other numerics: its relL2 against the portable kernels grows.
"""
import argparse

import torch

from sagebwd_hf.interface import tile_configs
from sagebwd_hf.kernels import plan
from sagebwd_hf.kernels.backward import launch_backward
from sagebwd_hf.kernels.forward import launch_forward
from sagebwd_hf.kernels.layout import SeqLayout
from sagebwd_hf.kernels.quantize import quantize, quantize_qk, quantize_v
from sagebwd_hf.numerics import ACCURATE, parse_precision, precision_name
from sagebwd_hf.testing import error_stats

from forward_kernels import add_shape_arguments, median_ms, print_versions


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(p, seqlens=[4096, 16384])
    p.add_argument("--parts", nargs="+", default=["dv", "dk", "dq", "bwd"])
    p.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="also time the Gluon launches with these tuning arguments (e.g. pingpong=1), printed as "
                        "speed-ups over the default")
    p.add_argument("--precision", nargs="+", default=["accurate"],
                   help="the Gluon dv and bwd launches once per precision: accurate, pv_e4m3, pv_e4m3+p_static")
    args = p.parse_args()
    precisions = [precision_name(parse_precision(x)) for x in args.precision]
    from sagebwd_hf.interface import GLUON_BACKWARD_RULES
    for precision in precisions:
        if parse_precision(precision) not in (ACCURATE, ) + GLUON_BACKWARD_RULES:
            p.error(f"--precision {precision}: the Gluon backward computes accurate, pv_e4m3, pv_e4m3+p_static")
    variants = [(v, {k: int(x) for k, x in (kv.split("=") for kv in v.split(","))}) for v in args.variant]
    from sagebwd_hf.kernels.hopper_launch import launch_backward_hopper, launch_dkdv_hopper, launch_dq_hopper

    print_versions()
    print(f"{'shape':<22} {'part':<21} | {'portable ms':>11} {'TFLOP/s':>8} | {'gluon ms':>9} {'TFLOP/s':>8} "
          f"{'x port':>6} {'relL2':>8} {'x first':>7}")
    for d in args.head_dims:
        for n in args.seqlens:
            for causal in (False, True):
                b, h = max(1, args.tokens // n), args.width // d
                q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                lay, window, scale = SeqLayout(b, n, None), ((-1, 0) if causal else (-1, -1)), d ** -0.5
                cfg = tile_configs(d, q.device)
                quant = quantize_qk(q, k, lay, lay, scale, True, False, transposed=True)
                v8t, v_scale = quantize_v(v, lay)
                out, lse = torch.empty_like(q), torch.empty(b, h, n, device="cuda")
                launch_forward(quant, v8t, v_scale, out, lse, lay, lay, h, 1, d, window, cfg["fwd"])
                do_q = quantize(do, lay, natural=False, transposed=True, out_for_delta=out)
                # the token-major copies in the operand order the op gives its Gluon launches (operand_order=1)
                quant_ordered = quantize_qk(q, k, lay, lay, scale, True, False, transposed=True, operand_order=True)
                do8t_ordered = quantize(do, lay, natural=False, transposed=True, operand_order=True).x8t
                # each precision's dO: {operand order: (dO8^T, its scales)} (e4m3 with the pv_e4m3 rule; with
                # p_static its scales per channel per query tile, the Gluon dV launch's 128 queries)
                do_inputs = {}
                for precision in precisions:
                    rules = parse_precision(precision)
                    if rules == ACCURATE:
                        do_inputs[precision] = {False: (do_q.x8t, do_q.scale), True: (do8t_ordered, do_q.scale)}
                        continue
                    do_inputs[precision] = {}
                    for order in (False, True):
                        x = quantize(do, lay, natural=False, transposed=True, operand_order=order, e4m3=True,
                                     channel_tile=128 if rules.p_static else None)
                        do_inputs[precision][order] = (x.x8t, x.scale)
                grads = {"dq": torch.empty_like(q), "dk": torch.empty_like(k), "dv": torch.empty_like(v)}
                shape = f"d{d}_n{n // 1024}k_{'causal' if causal else 'full'}"
                # "bwd": all launches as the op runs them (portable: its configured split), 5 products
                for part, products in (("dv", 2), ("dk", 3), ("dq", 3), ("bwd", 5)):
                    if part not in args.parts:
                        continue
                    flops = 2.0 * products * b * h * n * n * d * (0.5 if causal else 1.0)
                    port = lambda: launch_backward(  # noqa: E731
                        quant, quant.q8t, quant.q_scale_raw, quant.k8t, v, do, do_q.x8t, do_q.scale,
                        lse, do_q.delta, grads["dq"], grads["dk"], grads["dv"], lay, lay, h, h, d, window, scale,
                        cfg["dkdv"], cfg["dq"], kernels={"bwd": ("dkdv", "dq")}.get(part, (part,)),
                        split_dkdv=cfg["split_dkdv"] if part == "bwd" else True)
                    port_ms = median_ms(port)
                    got = {name: torch.full_like(t, float("nan")) for name, t in grads.items()}
                    first = {}
                    for precision in precisions if part in ("dv", "bwd") else precisions[:1]:
                        rules = parse_precision(precision)
                        rule = dict(pv_e4m3=rules.pv_e4m3, p_static=rules.p_static) if rules != ACCURATE else {}
                        label = part if precision == precisions[0] else f"{part}/{precision}"

                        def gluon(**tuning):
                            # the op's schedule (persistent programs) unless a variant says programs=0: one an item
                            tuning.setdefault("programs", plan.gluon_programs(q.device))
                            tuning["operand_order"] = order = bool(tuning.get("operand_order", 0))
                            qx = quant_ordered if order else quant
                            do8t, do_scale = do_inputs[precision][order]
                            if part == "bwd":
                                return lambda: launch_backward_hopper(
                                    qx, v, do, do8t, do_scale, lse, do_q.delta, got["dq"], got["dk"],
                                    got["dv"], h, h, d, window, scale, **rule, **tuning)
                            if part == "dq":
                                tuning.pop("fold", None)        # dV/dK options
                                tuning.pop("block_q", None)
                                tuning.pop("tile_ks", None)
                                return lambda: launch_dq_hopper(
                                    qx, lse, do, do_q.delta, v, got["dq"], 1, d, window, scale, **tuning)
                            return lambda: launch_dkdv_hopper(
                                part, qx, lse, do, do8t, do_scale, do_q.delta, v, got["dv"], got["dk"],
                                1, d, window, scale, **(rule if part == "dv" else {}), **tuning)
                        run = gluon()
                        run()
                        checked = {"bwd": ("dq", "dk", "dv")}.get(part, (part,))
                        rel = max(error_stats(got[name], grads[name])[1] for name in checked)
                        ms = median_ms(run)
                        first.setdefault(None, ms)
                        extra = f" {first[None] / ms:7.2f}"
                        for key, tuning in variants:
                            alt = gluon(**dict(tuning))
                            alt()
                            alt_rel = max(error_stats(got[name], grads[name])[1] for name in checked)
                            alt_ms = median_ms(alt)
                            first.setdefault(key, alt_ms)
                            extra += f" | {key} {ms / alt_ms:5.2f}x {alt_rel:7.1e} x first {first[key] / alt_ms:5.2f}"
                        print(f"{shape:<22} {label:<21} | {port_ms:11.3f} {flops / port_ms * 1e-9:8.0f} | {ms:9.3f} "
                              f"{flops / ms * 1e-9:8.0f} {port_ms / ms:6.2f} {rel:8.1e}{extra}", flush=True)


if __name__ == "__main__":
    main()
