"""Where SageBwd's time goes, and which tile shapes are fastest: times each stage of the op alone
(quantization passes, forward kernel, the two backward kernels) for a few tile configurations.

    python tools/breakdown.py --head-dim 128 --seqlen 4096 [--causal]
"""
import argparse
import itertools

import torch
import triton

from sagebwd_hf.interface import tile_configs
from sagebwd_hf.kernels.backward import launch_backward
from sagebwd_hf.kernels.forward import launch_forward
from sagebwd_hf.kernels.layout import SeqLayout
from sagebwd_hf.kernels.quantize import quantize, quantize_qk, quantize_v


def _resources(kernel) -> str:
    """Registers, spills, and which matrix instructions the PTX holds (wgmma = Hopper's fast path)."""
    ptx = getattr(kernel, "asm", {}).get("ptx", "")
    counts = {name: ptx.count(token) for name, token in
              (("wgmma", "wgmma.mma_async"), ("mma.sync", "mma.sync"), ("local ld/st", ".local."))}
    return (f"{getattr(kernel, 'n_regs', '?')} regs, {getattr(kernel, 'n_spills', '?')} spills, "
            + ", ".join(f"{k} {v}" for k, v in counts.items()))


def _sass_histogram(kernel, path=None, top=18):
    """Static SASS opcode counts (the tile loop appears three times: masked edge, middle, masked edge).
    Conversions (F2I/I2F/F2F), MUFU (exp2), PRMT (byte shuffles for INT8 operands) and spills (LDL/STL) are
    the ones to watch beside the tensor-core instructions (HGMMA/IGMMA)."""
    import collections
    import re
    try:
        sass = kernel.asm["sass"]
    except Exception as e:   # noqa: BLE001  (needs cuobjdump, shipped with Triton's NVIDIA backend)
        return f"no SASS ({type(e).__name__}: {e})"
    if path:
        with open(path, "w") as f:
            f.write(sass)
    ops = collections.Counter()
    # cuobjdump lines: "/*0a90*/  @!P0 MUFU.EX2 R3, R4 ;"; Triton's own disassembly: "ctrl<TAB>@P0 EXIT;"
    for m in re.finditer(r"(?:/\*[0-9a-f]{4,}\*/\s+|\t)(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)", sass):
        op = m.group(1)
        ops[op.split(".")[0] if not op.startswith("MUFU") else op] += 1
    watch = ("MUFU.EX2", "F2I", "I2F", "F2F", "PRMT", "HGMMA", "IGMMA", "LDL", "STL", "STS", "LDS", "BAR")
    head = ", ".join(f"{k} {ops[k]}" for k in watch if ops[k])
    rest = ", ".join(f"{k} {v}" for k, v in ops.most_common(top) if k not in watch)
    return f"{sum(ops.values())} instructions | {head} | {rest}"


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--sweep", nargs="*", choices=["fwd", "dkdv", "dq"], default=None,
                   help="also time other tile configurations of these kernels (all three if none named)")
    p.add_argument("--sass", metavar="DIR", default=None,
                   help="write each kernel's SASS to DIR and print opcode counts")
    p.add_argument("--split-sweep", action="store_true",
                   help="time dV and dK as two launches (split_dkdv) over tile configurations")
    args = p.parse_args()
    d, n = args.head_dim, args.seqlen
    b, h = args.tokens // n, args.width // d
    gen = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q, k, v, do = mk(b, h, n, d), mk(b, h, n, d), mk(b, h, n, d), mk(b, h, n, d)
    lay = SeqLayout(b, n, None)
    scale = d ** -0.5
    window = (-1, 0) if args.causal else (-1, -1)
    flops = 4 * b * h * n * n * d * (0.5 if args.causal else 1.0)
    cfg = tile_configs(d, q.device)
    out = q.new_empty(b, n, h, d).transpose(1, 2)
    lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)

    print(f"# {torch.cuda.get_device_name()} B={b} H={h} N={n} D={d} causal={args.causal}; default tiles {cfg}")
    t_qk = ms(lambda: quantize_qk(q, k, lay, lay, scale, True, False))
    t_v = ms(lambda: quantize_v(v, lay))
    quant = quantize_qk(q, k, lay, lay, scale, True, False)
    v8t, v_scale = quantize_v(v, lay)

    def fwd(c):
        return launch_forward(quant, v8t, v_scale, out, lse, lay, lay, h, 1, d, window, c)
    t_f = ms(lambda: fwd(cfg["fwd"]))
    regs = _resources
    print(f"fwd kernel: {regs(fwd(cfg['fwd']))}")
    print(f"fwd prep: quantize_qk {t_qk:.3f} ms, quantize_v {t_v:.3f} ms | fwd kernel {t_f:.3f} ms "
          f"({flops / t_f * 1e-9:.0f} TFLOP/s kernel-only)")

    fwd(cfg["fwd"])
    t_qkt = ms(lambda: quantize_qk(q, k, lay, lay, scale, True, False, transposed=True))
    t_do = ms(lambda: quantize(do, lay, natural=False, transposed=True, out_for_delta=out))
    bq = quantize_qk(q, k, lay, lay, scale, True, False, transposed=True)
    dq4 = quantize(do, lay, natural=False, transposed=True, out_for_delta=out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def bwd(c_kv, c_q, kernels=("dkdv", "dq"), split=cfg["split_dkdv"]):
        return launch_backward(bq, bq.q8t, bq.q_scale_raw, bq.k8t, v, do, dq4.x8t, dq4.scale, lse,
                               dq4.delta, dq, dk, dv, lay, lay, h, h, d, window, scale, c_kv, c_q, kernels,
                               split_dkdv=split)
    t_kv = ms(lambda: bwd(cfg["dkdv"], cfg["dq"], ("dkdv",)))
    print("bwd kernels: " + ", ".join(f"{k}: {regs(v)}" for k, v in bwd(cfg["dkdv"], cfg["dq"]).items()))
    t_q = ms(lambda: bwd(cfg["dkdv"], cfg["dq"], ("dq",)))
    print(f"bwd prep: quantize_qk+T {t_qkt:.3f} ms, dO {t_do:.3f} ms | dkdv kernel {t_kv:.3f} ms, dq kernel "
          f"{t_q:.3f} ms ({2.5 * flops / (t_kv + t_q) * 1e-9:.0f} TFLOP/s kernels-only)")
    if args.sass:
        import os
        os.makedirs(args.sass, exist_ok=True)
        kernels = dict(fwd=fwd(cfg["fwd"]), **bwd(cfg["dkdv"], cfg["dq"]))
        for name, kern in kernels.items():
            print(f"SASS {name} D={d}: " + _sass_histogram(kern, os.path.join(args.sass, f"{name}_d{d}.sass")))
    bd = cfg["fwd"][2]
    if args.split_sweep:
        # dV alone and dK alone, each over tiles; the best pair must share BLOCK_M (it sets P's/dS's scales)
        t_fused = ms(lambda: bwd(cfg["dkdv"], cfg["dq"], ("dkdv",), split=False))
        print(f"split dK/dV (BM, BN, warps, stages): ms  [fused at default tiles: {t_fused:.3f} ms]")
        best = {}
        for bm, bn, w, st in itertools.product([64, 128], [64, 128], [4, 8], [1, 2]):
            c = (bm, bn, bd, w, st)
            for name in ("dv", "dk"):
                try:
                    kern = bwd(c, cfg["dq"], (name,), split=True)[name]
                    t = ms(lambda: bwd(c, cfg["dq"], (name,), split=True))
                    print(f"  {name} {bm:>3} {bn:>3} w{w} s{st}: {t:.3f} ms  ({regs(kern)})")
                    if t < best.get((name, bm), (float("inf"),))[0]:
                        best[(name, bm)] = (t, c)
                except Exception as e:   # noqa: BLE001  (a tile that does not compile: out of shared memory / registers)
                    print(f"  {name} {bm:>3} {bn:>3} w{w} s{st}: {type(e).__name__}")
        for bm in (64, 128):
            if ("dv", bm) in best and ("dk", bm) in best:
                (tv, cv), (tk, ck) = best[("dv", bm)], best[("dk", bm)]
                t = ms(lambda: bwd((cv, ck), cfg["dq"], ("dkdv",), split=True))
                print(f"best split at BM={bm}: dV {cv} {tv:.3f} ms + dK {ck} {tk:.3f} ms -> together {t:.3f} ms "
                      f"(fused {t_fused:.3f} ms, {t_fused / t:.2f}x)")
    if args.sweep is None:
        return
    sweep = set(args.sweep or ("fwd", "dkdv", "dq"))

    bd = cfg["fwd"][2]
    print("forward tiles (BM, BN, warps, stages): ms")
    for bm, bn, w, s in itertools.product([64, 128], [64, 128], [4, 8], [2, 3]):
        if "fwd" not in sweep:
            break
        try:
            t = ms(lambda: fwd((bm, bn, bd, w, s)))
            print(f"  fwd {bm:>3} {bn:>3} w{w} s{s}: {t:.3f} ms  {flops / t * 1e-9:.0f} TFLOP/s")
        except Exception as e:  # noqa: BLE001  (out of shared memory / registers)
            print(f"  fwd {bm} {bn} w{w} s{s}: {type(e).__name__}")
    print("backward tiles (BM, BN, warps, stages): ms")
    for bm, bn, w, s in itertools.product([32, 64, 128], [64, 128], [4, 8], [1, 2]):
        for name in sorted(sweep & {"dkdv", "dq"}):
            c = (bm, bn, bd, w, s)
            try:
                t = ms(lambda: bwd(c, c, (name,)))
                print(f"  {name:<4} {bm:>3} {bn:>3} w{w} s{s}: {t:.3f} ms")
            except Exception as e:   # noqa: BLE001  (a tile that does not compile: out of shared memory / registers)
                print(f"  {name:<4} {bm:>3} {bn:>3} w{w} s{s}: {type(e).__name__}")


if __name__ == "__main__":
    main()
