"""Compile the preparation kernels (kernels/quantize.py) a call launches, for sm_90 on a machine without a GPU
(compile_offline.py's stand-in driver), from the op's own host code with every launch replaced by a warmup; prints
each kernel's registers, stack and local bytes (spills). Needs Triton 3.6.0's wheel (compile_offline.py says how).

    /tmp/t36/bin/python tools/compile_prep_offline.py [ROOT]     # ROOT: a tree of this repository (default: here)

An older tree (without prepare_forward) is compiled through its separate passes. ``--layouts`` (this tree) prints
the layouts of the row reductions (Q's ``q . mean(k)``, dO's delta) in the separate passes and in the pair
launch: the same layouts give the same summation order, so the same bits.
"""
import os
import re
import subprocess
import sys

LAYOUTS = "--layouts" in sys.argv
sys.argv = [a for a in sys.argv if a != "--layouts"]
ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
OUT = "/tmp/compile_prep_offline"
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # compile_offline.py beside this script, whatever ROOT
os.makedirs(OUT, exist_ok=True)

import torch  # noqa: E402
from compile_offline import OfflineDriver  # noqa: E402
from triton import knobs  # noqa: E402
from triton.runtime import driver  # noqa: E402

driver.set_active(OfflineDriver())
from sagebwd_hf.kernels import quantize as qz  # noqa: E402
from sagebwd_hf.kernels.layout import SeqLayout  # noqa: E402

seen = {}
ttgir = []


def warm(kernel, grid, *args, **kwargs):
    kwargs.setdefault("enable_fp_fusion", True)
    ck = kernel.warmup(*args, grid=grid, **kwargs)
    name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
    ttgir.append((name, ck.asm["ttgir"]))
    if LAYOUTS:
        return
    cub = os.path.join(OUT, f"{len(seen)}.cubin")
    open(cub, "wb").write(ck.asm["cubin"])
    res = subprocess.check_output([knobs.nvidia.cuobjdump.path, "-res-usage", cub], text=True)
    regs = re.search(r"REG:(\d+)", res).group(1)
    stack = re.search(r"STACK:(\d+)", res).group(1)
    local = re.search(r"LOCAL:(\d+)", res).group(1)
    seen[len(seen)] = (name, regs, stack, local)
    print(f"  {name:28s} regs {regs:>3} stack {stack} local {local}  warps {kwargs.get('num_warps')}")


qz.launch = warm


def bhnd(b, h, n, d):
    return torch.randn(b, n, h, d, dtype=torch.bfloat16).transpose(1, 2)


def row_reduction_layouts(text):
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*?>)$", text, re.M))
    found = re.findall(r'"tt\.reduce"\(%\w+\) <\{axis = 1 : i32\}>.*?\n(?:.*\n)*?.*?\}\) : \((tensor<[^>]*>)', text)
    return [layouts.get(t.split(", ")[-1].rstrip(">"), t) for t in found]


if LAYOUTS:
    for d in (64, 128):
        ttgir.clear()
        q, k, do, o = (bhnd(2, 16, 1024, d) for _ in range(4))
        lay = SeqLayout(2, 1024, None)
        qz.quantize(do, lay, natural=False, transposed=True, out_for_delta=o, operand_order=True)
        qz.quantize(q, lay, transposed=True, dot=(torch.zeros(16, 2, d), 1, 0.1), scaled=0.2, operand_order=True)
        qz.prepare_backward(q, k, do, o, lay, lay, d ** -0.5, True, False, row_shift=True, operand_order=True)
        named = {}
        for name, text in ttgir:
            named.setdefault(name, []).append(row_reduction_layouts(text))
        print(f"D={d} row reductions (max |x|, then the sum)")
        print("  dO alone:", *named["_quantize_kernel"][0], sep="\n    ")
        print("  Q alone: ", *named["_quantize_kernel"][1], sep="\n    ")
        print("  Q and dO in one launch:", *named["_quantize_pair_kernel"][0], sep="\n    ")
    sys.exit(0)

for d in (64, 128):
    b, h, n = 2, 16, 1024
    q, k, v, do, o = (bhnd(b, h, n, d) for _ in range(5))
    lay = SeqLayout(b, n, None)
    print(f"D={d} padded N={n}")
    if hasattr(qz, "prepare_forward"):
        print(" forward")
        qz.prepare_forward(q, k, v, lay, lay, d ** -0.5, True, False, v_operand_order=True,
                           zero_ints=torch.zeros(16, dtype=torch.int32))
        print(" backward")
        qz.prepare_backward(q, k, do, o, lay, lay, d ** -0.5, True, False, operand_order=True,
                            k_transposed=d != 64, zero_ints=torch.zeros(16, dtype=torch.int32),
                            zero_rows=torch.zeros(b, h, n, d) if d == 64 else None)
    else:
        print(" forward")
        quant = qz.quantize_qk(q, k, lay, lay, d ** -0.5, True, False, v4=v)
        qz.quantize_v(v, lay, None, quant.v_scale, operand_order=True)
        print(" backward")
        qz.quantize_qk(q, k, lay, lay, d ** -0.5, True, False, transposed=True, operand_order=True,
                       k_transposed=d != 64)
        qz.quantize(do, lay, natural=False, transposed=True, out_for_delta=o, operand_order=True)
