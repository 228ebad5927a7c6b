"""Compile a Gluon Hopper kernel (the forward, or the backward's dV, dK or dQ launch) for sm_90 on a machine
without a GPU, and dump what it became.

Triton asks its active driver for the target, the device and the stream before it compiles; a stand-in driver
answers ``GPUTarget("cuda", 90, 32)``, device 0 and stream 0, and the kernel is compiled through
``JITFunction.warmup`` (nothing is launched) from CPU tensors of the shapes, dtypes and strides the real call
passes (``hopper_launch.forward_hopper_args``, ``dkdv_hopper_args`` or ``dq_hopper_args`` builds the grid,
arguments and constexprs). Written to ``--out``: the TTGIR,
LLVM IR, PTX, cubin, ptxas's ``-v`` log, the SASS (``nvdisasm`` with line info: Triton's own SASS reader stops
at address 0xffff) and ``summary.json`` (registers, spills, ptxas's performance-loss notes, opcode counts, where
the STL / LDL spill traffic comes from in the source, and the innermost loop of each). Needs torch (a CPU build
will do) and Triton 3.6.0's wheel, which bundles ptxas / nvdisasm / cuobjdump (CUDA 12.8), the ones Triton uses on
the GPU machines too::

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install torch==2.13.0
    /tmp/t36/bin/pip install --no-deps triton==3.6.0
    /tmp/t36/bin/python tools/compile_offline.py --head-dim 128 --causal --out /tmp/sass_fwd \\
        [--kernel-file other_forward_hopper.py] [--kw '{"consumers": 3}']

``--kw``: extra keywords of the ``*_hopper_args`` builder (``consumers``, ``named_barriers``, ``programs``, ...);
``--kernel-file``: another copy of the kernel module (forward_hopper.py or backward_hopper.py), loaded as
``sagebwd_hf.kernels.<stem>``; the arguments are still built by hopper_launch. ``n_regs`` / ``n_spills``
are what ``CompiledKernel`` reports on a GPU (``n_spills``: stack + local bytes / 4), and the SASS is the one
an H100 compiles (both checked on one, Triton 3.6.0); ``spill_stores`` / ``spill_loads`` are ptxas's bytes.
"""
import argparse
import collections
import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import types
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")   # a CPU-only venv needs no NumPy

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402


class OfflineDriver:
    """What ``JITFunction.run`` / ``warmup`` and the compiler ask of the active driver, without a GPU."""
    target = GPUTarget("cuda", 90, 32)
    is_active = staticmethod(lambda: True)
    get_current_target = lambda self: self.target  # noqa: E731
    get_current_device = lambda self: 0  # noqa: E731
    get_current_stream = lambda self, device=None: 0  # noqa: E731
    get_device_capability = lambda self, device=None: divmod(self.target.arch, 10)  # noqa: E731
    get_active_torch_device = lambda self: torch.device("cpu")  # noqa: E731

    def map_python_to_cpp_type(self, ty):
        from triton.backends.nvidia.driver import ty_to_cpp
        return ty_to_cpp(ty)

    def get_benchmarker(self):
        raise RuntimeError("offline driver: nothing can run")


def load_module(kernel_file, stem_of_default="forward_hopper"):
    """The repo's kernel module, or another copy of it loaded inside sagebwd_hf.kernels (relative imports work)."""
    if "sagebwd_hf" not in sys.modules:   # its __init__ imports transformers: only its package path is needed
        pkg = types.ModuleType("sagebwd_hf")
        pkg.__path__ = [os.path.join(ROOT, "sagebwd_hf"), ROOT]    # kernels/ resolves as sagebwd_hf.kernels
        sys.modules["sagebwd_hf"] = pkg
    if kernel_file is None:
        return importlib.import_module(f"sagebwd_hf.kernels.{stem_of_default}")
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(kernel_file))[0])
    name = f"sagebwd_hf.kernels.{stem}"
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(kernel_file))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def make_inputs(mod, a):
    """CPU tensors laid out as quantize_qk / quantize_v lay them out for a padded batch: the forward's launch
    arguments, or with ``--kernel dv | dk | dkdvq | dq`` the backward's (``mod``: hopper_launch)."""
    from sagebwd_hf.kernels.layout import SeqLayout
    b, h, hk, n, d, dv = a.batch, a.heads, a.kv_heads or a.heads, a.seqlen, a.head_dim, a.head_dim_v or a.head_dim
    num_seqs, max_len = b, n
    if a.packed:    # one [1, H, T, D] batch of a.batch sequences of a.seqlen tokens (what compiles is the same)
        lay_packed = SeqLayout(b, n, torch.arange(b + 1, dtype=torch.int32) * n)
        starts = torch.arange(b + 1, dtype=torch.int32) * (-(-n // 16) * 16)
        b, n = 1, b * n + 15 * b
    npad = -(-n // 16) * 16
    from sagebwd_hf.kernels.quantize import QuantizedQK
    quant = QuantizedQK(q8=torch.empty(b, h, n, d, dtype=torch.int8), q_scale=torch.empty(b, h, n),
                        q_scale_raw=torch.empty(b, h, n), v_scale=None,
                        q8t=torch.empty(b, h, d, npad, dtype=torch.int8), k8=torch.empty(b, hk, n, d, dtype=torch.int8),
                        k_scale=torch.empty(b, hk, n), k8t=torch.empty(b, hk, d, npad, dtype=torch.int8),
                        q_mean=None, q_mean_cu=None, k_mean=None, q_shift=None)
    v8t = torch.empty(b, hk, dv, npad, dtype=torch.int8)
    v_scale = torch.empty(hk, b, dv).transpose(0, 1)          # [S, Hk, Dv] view of [Hk, S, Dv]
    out4 = torch.empty(b, h, n, dv, dtype=torch.bfloat16)
    lse = torch.empty(b, h, n)
    layout = SeqLayout(b, n, None)
    window = (-1, 0) if a.causal else (-1, -1)
    kw = json.loads(a.kw)
    from sagebwd_hf.numerics import parse_precision
    rules = parse_precision(a.precision)
    if rules.pv_e4m3 or rules.p_static:   # (the kernels' rules: the builders refuse the others)
        kw.update(pv_e4m3=rules.pv_e4m3, p_static=rules.p_static)
    if a.kernel == "fwd":
        if a.softcap:   # a capped call: the cap and the row shift (lse's layout) as interface passes them
            kw.update(softcap=a.softcap, shift=torch.empty(b, h, n))
        if a.packed:
            kw["v_starts"] = starts
            layout = lay_packed
        if rules.ds_bound:   # the row maxima the ds_bound rule's backward reads (lse's layout)
            kw.update(row_max=torch.empty_like(lse))
        return mod.forward_hopper_args(quant, v8t, v_scale, out4, lse, layout, layout, h, h // hk, d, window, **kw)
    if a.packed:
        kw["packing"] = (lay_packed, lay_packed, starts)
    do4 = torch.empty(b, h, n, dv, dtype=torch.bfloat16)
    v4 = torch.empty(b, hk, n, dv, dtype=torch.bfloat16)
    vec = lambda: torch.empty(b, h, n)  # noqa: E731   per-query vectors, q_scale's layout
    if a.softcap:   # a capped call: the cap and the row shift (q_scale's layout) as interface passes them
        kw.update(softcap=a.softcap, shift=vec())
    if a.kernel == "dq":
        if a.row_sums:   # a shard of a row's keys: K's means for the row term, the kernel's own dS sums
            kw.update(k_mean=torch.empty(hk, b, d))
        return mod.dq_hopper_args(quant, lse, do4, vec(), v4, torch.empty(b, h, n, d, dtype=torch.bfloat16),
                                  h // hk, d, window, d ** -0.5, **kw)
    do8t = torch.empty(b, h, dv, npad, dtype=torch.int8)
    do_scale = vec()
    if rules.do_sequence:   # dO's channel maxima per sequence and KV group [S, H, Dv]
        do_scale = torch.empty(num_seqs, h, dv)
    elif rules.p_static:   # dO's scales per channel per query tile [S, H, tiles, Dv] (quantize's channel_tile)
        block_q = kw.get("block_q") or (mod.ONE_LAUNCH_QUERY_TILE if a.kernel in ("dkdv", "dkdvq")
                                        else mod.dkdv_query_tile(d))
        do_scale = torch.empty(num_seqs, h, -(-max_len // block_q), dv)
    grads = torch.empty(b, hk, n, dv, dtype=torch.bfloat16), torch.empty(b, hk, n, d, dtype=torch.bfloat16)
    if a.kernel == "dkdvq":
        kw.update(dq_acc=torch.empty(b, h, n, d))
    if rules.dk_e4m3 and a.kernel != "dv":   # dK's product in e4m3: Q^T's e4m3 bytes (as q8t), per-token scales
        kw.update(q_e4m3=(torch.empty_like(quant.q8t), vec()))
    if rules.in_place:
        kw.update(in_place=True)
    if rules.dp_int8:   # dP^T in INT8: dO's and V's INT8 copies, dO's per-token scales, V's (K's layout)
        kw.update(dp_int8=(torch.empty(b, h, n, dv, dtype=torch.int8), vec(),
                           torch.empty(b, hk, n, dv, dtype=torch.int8), torch.empty_like(quant.k_scale)))
    if rules.ds_bound:   # dK's dS at each query's fixed scale: Q times the bounds' channel maxima (do_scale's layout)
        kw.update(ds_bound=torch.empty_like(do_scale))
    return mod.dkdv_hopper_args(a.kernel, quant, lse, do4, do8t, do_scale, vec(), v4, grads[0], grads[1], h // hk, d,
                                window, d ** -0.5, **kw)


SASS_RE = re.compile(r"^\s*(?:/\*([0-9a-f]+)\*/)?\s*(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)[^;]*;")
LINE_RE = re.compile(r'//## File "([^"]+)", line (\d+)')


def sass_summary(sass_text, src_lines):
    """Opcode counts; each STL / LDL with the source line it carries (innermost function: Triton's PTX has no
    inlining info) and the innermost loop (a backward branch's span) it sits in, if any."""
    ops, spills, where, labels, pending, branches, exits = collections.Counter(), [], None, {}, [], [], []
    for i, line in enumerate(sass_text.splitlines()):
        m = LINE_RE.search(line)
        if m:
            f, ln = os.path.basename(m.group(1)), int(m.group(2))
            where = f"{f}:{ln} {src_lines.get((f, ln), '')}".strip()
            continue
        if re.match(r"^\.L_x_\d+:", line):
            pending.append(line[:-1])
            continue
        m = SASS_RE.match(line)
        if not m or m.group(1) is None:
            continue
        addr, op = int(m.group(1), 16), m.group(3).split(".")[0]
        labels.update((lab, addr) for lab in pending)
        pending = []
        ops[op] += 1
        if op == "EXIT":
            exits.append(addr)
        if op == "BRA" and (t := re.search(r"\(\.L_x_\d+\)", line)):
            branches.append((addr, t.group(0)[1:-1]))
        if op in ("STL", "LDL"):
            spills.append(dict(sass_line=i + 1, addr=addr, op=op, text=" ".join(line.split()), source=where))
    last_exit = max(exits, default=1 << 62)   # past it: out-of-line mbarrier-wait retries branching back, no loops
    loops = [(labels[t], a) for a, t in branches if labels.get(t, a + 1) <= a <= last_exit]
    for sp in spills:
        inner = min((lp for lp in loops if lp[0] <= sp["addr"] <= lp[1]), key=lambda lp: lp[1] - lp[0], default=None)
        sp["loop"] = f"{inner[0]:#x}-{inner[1]:#x} ({(inner[1] - inner[0]) // 16 + 1} instr)" if inner else None
        sp["addr"] = hex(sp["addr"])
    by_src = collections.Counter((sp["op"], sp["source"], sp["loop"]) for sp in spills)
    return ops, spills, by_src, [f"{a:#x}-{b:#x} ({(b - a) // 16 + 1} instr)" for a, b in sorted(set(loops))]


def tile_loops(sass_text, loops, min_instr=300):
    """The innermost loops of at least ``min_instr`` instructions (a kernel's tile loops: every consumer
    warpgroup has its own copy), each with its opcode counts (full mnemonics: ``MUFU.EX2``, ``IGMMA...``)."""
    spans = [tuple(int(x, 16) for x in lp.split(" ")[0].split("-")) for lp in loops]
    inner = [(a, b) for a, b in spans if (b - a) // 16 + 1 >= min_instr
             and not any((a, b) != (c, d) and a <= c and d <= b for c, d in spans)]
    counts = {span: collections.Counter() for span in inner}
    for line in sass_text.splitlines():
        m = SASS_RE.match(line)
        if not m or m.group(1) is None:
            continue
        addr = int(m.group(1), 16)
        for a, b in inner:
            if a <= addr <= b:
                counts[a, b][m.group(3)] += 1
    return {f"{a:#x}-{b:#x} ({(b - a) // 16 + 1} instr)": dict(c.most_common()) for (a, b), c in counts.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--head-dim-v", type=int, default=None)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--kernel", choices=["fwd", "dv", "dk", "dkdv", "dkdvq", "dq"], default="fwd",
                   help="the forward, or one backward launch (backward_hopper; dkdvq: the one launch, dV, dK and "
                        "dQ by reduce-adds)")
    p.add_argument("--kernel-file", default=None)
    p.add_argument("--packed", action="store_true", help="a packed batch (--batch sequences of --seqlen tokens)")
    p.add_argument("--kw", default="{}", help="JSON dict of extra keywords of the *_hopper_args builder")
    p.add_argument("--softcap", type=float, default=0.0, help="a capped call (e.g. 50)")
    p.add_argument("--row-sums", action="store_true",
                   help="dq: a shard of each row's keys (K-smoothing's row term from the kernel's own dS sums)")
    p.add_argument("--precision", default="accurate",
                   help="fwd, dv, dk, dkdv, dkdvq: the numerics rule the kernel computes (sagebwd_hf.numerics: "
                        "accurate, pv_e4m3, pv_e4m3+p_static, ... +dk_e4m3, +do_sequence, +dp_int8, +ds_bound)")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    driver.set_active(OfflineDriver())
    mod = load_module(a.kernel_file, "forward_hopper" if a.kernel == "fwd" else "backward_hopper")
    grid, args, kwargs = make_inputs(importlib.import_module("sagebwd_hf.kernels.hopper_launch"), a)
    knobs.nvidia.dump_ptxas_log = True        # ptxas's -v log (spill bytes) is printed: captured below
    knobs.compilation.always_compile = True   # a cache hit would skip ptxas and its log
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn = {"fwd": "_attn_fwd_hopper_kernel", "dq": "_attn_bwd_dq_hopper_kernel"}.get(a.kernel,
                                                                                        "_attn_bwd_dkdv_hopper_kernel")
        ck = getattr(mod, fn).warmup(*args, grid=grid, **kwargs)
    ptxas_log = buf.getvalue()

    os.makedirs(a.out, exist_ok=True)
    for ext in ("ttir", "ttgir", "llir", "ptx"):
        if ext in ck.asm:
            with open(os.path.join(a.out, f"kernel.{ext}"), "w") as f:
                f.write(ck.asm[ext])
    cubin = os.path.join(a.out, "kernel.cubin")
    with open(cubin, "wb") as f:
        f.write(ck.asm["cubin"])
    with open(os.path.join(a.out, "ptxas.log"), "w") as f:
        f.write(ptxas_log)
    nvdisasm = knobs.nvidia.nvdisasm.path
    sass = subprocess.check_output([nvdisasm, "-c", "-gi", cubin], text=True)
    with open(os.path.join(a.out, "kernel.sass"), "w") as f:
        f.write(sass)
    res = subprocess.check_output([knobs.nvidia.cuobjdump.path, "-res-usage", cubin], text=True)
    # CompiledKernel.n_spills is CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES / 4: the stack frame (where spills go) + LOCAL
    local = int(re.search(r"LOCAL:(\d+)", res).group(1)) + int(re.search(r"STACK:(\d+)", res).group(1))
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
    # ptxas's "Potential Performance Loss" notes: async wgmmas serialized for want of registers (C7510-C7512), a
    # register split (setmaxnreg) ignored (C7507); such a kernel runs, slower than its spill count says
    losses = re.findall(r"Potential Performance Loss: ([^\n]*)", ptxas_log)

    src_file = mod.__file__
    src_lines = {}
    for path in (src_file, importlib.import_module("sagebwd_hf.kernels.hopper_common").__file__):
        fn = "?"
        with open(path) as f:
            for i, t in enumerate(f):
                fn = t.split("def ", 1)[1].split("(")[0] if t.startswith("def ") else fn
                src_lines[(os.path.basename(path), i + 1)] = f"[{fn}] {t.strip()[:70]}"
    ops, spills, by_src, loops = sass_summary(sass, src_lines)
    summary = dict(
        kernel_file=src_file, triton=triton.__version__, grid=list(grid),
        constexprs=kwargs, shared=ck.metadata.shared,
        n_regs=regs, n_spills=local // 4, local_bytes=local,
        stack_frame=int(m.group(1)) if m else None, spill_stores=int(m.group(2)) if m else None,
        spill_loads=int(m.group(3)) if m else None, performance_losses=losses,
        instructions=sum(ops.values()), STL=ops["STL"], LDL=ops["LDL"],
        opcodes=dict(ops.most_common()),
        spills_by_source=[dict(op=k[0], source=k[1], loop=k[2], count=c) for k, c in by_src.most_common()],
        spills=spills, loops=loops, tile_loops=tile_loops(sass, loops))
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"{os.path.basename(src_file)} {a.kernel} D={a.head_dim} causal={a.causal} precision={a.precision} "
          f"kw={a.kw}: n_regs {regs}, "
          f"n_spills {local // 4} (ptxas: {m.group(0) if m else '?'}), shared {ck.metadata.shared} B, "
          f"{summary['instructions']} SASS instructions, STL {ops['STL']}, LDL {ops['LDL']} -> {a.out}")
    for text in losses:
        print(f"  ptxas: {text}")
    for s in summary["spills_by_source"][:12]:
        print(f"  {s['count']:4d} {s['op']}  {s['source']}  [loop {s['loop']}]")
    for span, c in summary["tile_loops"].items():
        print(f"  tile loop {span}: " + ", ".join(f"{op} {n}" for op, n in list(c.items())[:10]))


if __name__ == "__main__":
    main()
