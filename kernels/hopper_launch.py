"""Host side of the Hopper (Gluon) kernels: TMA descriptors, grids and launch arguments, and the launches.

``launch_forward_hopper`` keeps forward.launch_forward's contract on forward_hopper's kernel;
``launch_backward_hopper`` keeps backward.launch_backward's on backward_hopper's (three launches, dV, dK and dQ,
each gradient written once; or with ``fused_dq`` the one launch, dQ added up by reduce-adds). ``*_hopper_args``
build ``(grid, args, kwargs)`` without launching (tools/compile_offline.py compiles from them). Inputs come
from quantize.quantize_qk / quantize_v / quantize; TMA needs 16-byte aligned bases, strides and, for packed
batches, token-major copies whose sequences start 16-aligned (``quantize.aligned_starts``).
"""
import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import backward_hopper, forward_hopper
from .constants import GLUON_HEAD_DIMS, K_BLOCK_HEAD_DIMS, K_SCALE_BLOCK, LOG2E, ONE_LAUNCH_QUERY_TILE
from .plan import (BACKWARD_CONSUMER_REGS, BACKWARD_LOADER_REGS, FORWARD_CONSUMER_REGS, FORWARD_LOADER_REGS,
                   dkdv_query_tile, dq_key_tile, gluon_forward_named_barriers, one_launch_dq_buffers)
from .launch import descriptor_key, launch
from .layout import cdiv, tma_addressable, token_rows


# ptxas's register allocator at its own default level. Triton 3.7 on passes ``--regAllocOptLevel=2`` to every
# ptxas call (its comment: a workaround for a ptxas 13.x bug), and from 3.9 sm_90 compiles with CUDA 13's ptxas
# (3.6-3.8: CUDA 12's, which ignores the level). At level 2 CUDA 13.4's ptxas spills more in the loops that run
# near the register budget: spill stores / loads in bytes, level 2 against ptxas's default, forward D=128 with three
# consumers 488 / 604 against 328 / 388, D=64 40 / 156 against 20 / 40, dQ D=128 160 / 248 against 104 / 132
# (causal 392 / 520 against 76 / 100). Level 4 is that default: cubins byte-identical to no flag for 13 kernel
# configurations (compile_offline.py, ptxas 13.4). None leaves Triton's choice.
PTXAS_REGALLOC_LEVEL = 4


@functools.lru_cache(maxsize=None)
def _ptx_options(level):
    try:
        from triton import knobs
        from triton.backends.nvidia.compiler import get_ptxas
        cuda13 = int(get_ptxas(90).version.split(".")[0]) >= 13
        theirs = knobs.nvidia.ptxas_options
    except Exception:   # another Triton layout: leave its options alone
        return None
    if level is None or not cuda13:
        return None
    # after ours, a user's PTXAS_OPTIONS (Triton's knob, which an explicit ptx_options replaces) still wins
    return " ".join(o for o in (f"--regAllocOptLevel={level}", theirs) if o)


def ptx_options():
    """The ``ptx_options`` of a Gluon launch (a Triton compile option): see PTXAS_REGALLOC_LEVEL."""
    return _ptx_options(PTXAS_REGALLOC_LEVEL)


@functools.lru_cache(maxsize=None)
def shared_layout(block_shape, dtype):
    """The swizzled shared-memory layout of a TMA tile (computing it costs ~8 us of host time a descriptor)."""
    assert all(b & (b - 1) == 0 and 0 < b <= 256 for b in block_shape), block_shape
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)


def tma_descriptor(base, shape, strides, block_shape, dtype=gl.int8):
    """Gluon's ``TensorDescriptor`` over ``base`` seen as ``shape`` / ``strides``, with the checks its constructor
    makes that the data needs (TMA faults on a base or stride that is not 16-byte aligned); the constructor's
    generic validation costs ~5 us of host time a descriptor, and a forward and backward build 16."""
    esize = base.element_size()
    if not (base.data_ptr() % 16 == 0 and strides[-1] == 1 and all([st * esize % 16 == 0 for st in strides[:-1]])
            and min(shape) > 0):
        raise ValueError(f"TMA cannot address this memory: base {base.data_ptr():#x}, shape {list(shape)}, "
                         f"strides {list(strides)}, {esize}-byte elements")
    block_shape = tuple(block_shape)
    kind = _descriptor_kinds.get((block_shape, id(dtype), base.dtype)) or _descriptor_kind(block_shape, dtype,
                                                                                           base.dtype)
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=base, shape=list(shape), strides=list(strides), block_shape=list(block_shape),
                         layout=kind[0], padding="zero", launch_key=kind[1])
    return desc


# (block shape, id of the Gluon dtype, the base's dtype) -> (shared layout, launch key, the Gluon dtype): a
# descriptor's kind, looked up without hashing the Gluon dtype (a Python __hash__); the entry holds the dtype, so
# its id is not reused while the entry stands
_descriptor_kinds = {}


def _descriptor_kind(block_shape, dtype, base_dtype):
    """(shared layout, kernels/launch.py's key) of a descriptor from tma_descriptor, made once per kind."""
    layout = shared_layout(block_shape, dtype)
    key = descriptor_key(base_dtype, block_shape, layout, "zero",
                         getattr(TensorDescriptor, "round_f32_to_tf32", None))   # (its default, as launch.py reads it)
    kind = _descriptor_kinds[(block_shape, id(dtype), base_dtype)] = (layout, key, dtype)
    return kind


def tma_desc_2d(x2d, block_shape, dtype=gl.int8):
    """A TMA descriptor over a 2-D view: int8 tiles here, bf16/fp16 ones too in backward_hopper."""
    return tma_descriptor(x2d, x2d.shape, x2d.stride(), block_shape, dtype)


def tma_desc_rows(x, block_shape, dtype=gl.int8):
    """``tma_desc_2d(x.reshape(-1, x.shape[-1]), ...)``: a descriptor over ``x``'s rows of its last dim. Over a
    contiguous ``x`` (our own tensors) it is made from ``x`` itself, without the 2-D view: the same address, shape
    and strides (a descriptor reads only its base's address and dtype), one torch op (~1 us of host time) less,
    and a forward and backward make 12."""
    last = x.shape[-1]
    if not (last and x.is_contiguous()):
        return tma_desc_2d(x.reshape(-1, last), block_shape, dtype)
    return tma_descriptor(x, [x.numel() // last, last], [last, 1], block_shape, dtype)


def qk_blocks(head_dim):
    """Q's and K's channels as (first, second) power-of-two blocks (Gluon tiles have power-of-two shapes):
    192 (MLA) -> (128, 64); 64 or 128 -> (that, 0)."""
    first = min(head_dim, 128)
    assert head_dim - first in (0, 64), head_dim
    return first, head_dim - first


# int32s a call's zeroed work counters take: one a launch, 16 bytes apart (a pointer Triton specializes as 16-byte
# aligned, as a fresh allocation is), for the three backward launches; the op has the preparation pass zero them
COUNTER_STRIDE = 4
COUNTER_INTS = 16


def counter_slot(counters, launch_index):
    """The work counter of a call's ``launch_index``-th Gluon launch in ``counters`` (COUNTER_INTS zeroed int32s)."""
    return None if counters is None else counters[launch_index * COUNTER_STRIDE:launch_index * COUNTER_STRIDE + 1]


def persistent_grid(num_items, programs, stand_in, counter=None):
    """(grid, counter, dynamic) of a launch over ``num_items`` work items: ``programs`` persistent programs that
    take items from a zeroed int32 counter of the items handed out past each program's first (``dynamic``), when
    that is fewer than the items; else one program an item (``stand_in``: a tensor passed as the unused counter).
    ``counter``: a zeroed int32 (``counter_slot``) to use, instead of zeroing a new one (a launch)."""
    if not (programs and programs < num_items):
        return (num_items, ), stand_in, False
    if counter is None:
        counter = torch.zeros(1, dtype=torch.int32, device=stand_in.device)
    return (programs, ), counter, True


def forward_hopper_args(quant, v8t, v_scale, out4, lse, layout_q, layout_k, num_heads, group, head_dim,
                        window, v_starts=None, consumers=2, consumer_regs=None, loader_regs=FORWARD_LOADER_REGS,
                        pingpong=None,
                        sinks=None, sink_shift=None, softcap=0.0, shift=None, named_barriers=None,
                        programs=None, v_operand_order=False, counter=None, pv_e4m3=False, p_static=False,
                        row_max=None):
    """(grid, args, kwargs) of the kernel for forward.launch_forward's contract (``sinks``, ``sink_shift``,
    ``softcap``, ``shift`` as there). ``pingpong`` defaults to on at V's head dim 128 and off at 64; the op
    passes ``plan.gluon_forward_pingpong``'s choice (off is faster for short unmasked calls and MLA's head
    dims).
    ``named_barriers``: the turns and the buffer releases on hardware named barriers, each thread arriving for
    itself, instead of mbarriers (whose one-thread arrivals Gluon precedes with a ``bar.sync`` of the warpgroup:
    three of a tile's four go); default on at V's head dim 128, where kernels alone ran 1.00-1.05x faster with two
    consumers and 1.01-1.04x with three (H100), off at 64 (0.98-1.03x).
    ``programs``: launch this many programs (``plan.gluon_programs``: one per SM), each taking work
    items (the query rows of one sequence and head) from an atomic counter until none is left, so the next item's
    Q and first K / V tiles load while this one's epilogue runs, and causal calls' items of unequal length balance
    (a static round-robin did not); None (or at least one per item): one program per work item.
    ``v_operand_order``: ``v8t`` from ``quantize_v(..., operand_order=True)`` (each 16 keys in the order P's
    registers hold them, so P goes to ``P V`` without shuffles: kernels alone 1.01-1.11x, H200); the op's.
    ``counter``: the work counter, zeroed (``persistent_grid``'s).
    ``pv_e4m3`` (sagebwd_hf.numerics' rule): ``P V`` in FP8 e4m3, ``v8t`` holding e4m3 bytes and ``v_scale`` each
    channel's max |v| (``quantize_v(..., e4m3=True)``); ``p_static`` (with ``pv_e4m3``): P's scale fixed, the
    running row max mapped to 448. ``row_max`` (``lse``'s layout, fp32): also each row's largest score in lse's frame
    (the ds_bound rule's backward reads max P = exp2(row_max - lse))."""
    assert row_max is None or (row_max.shape == lse.shape and row_max.stride() == lse.stride())
    if p_static and not pv_e4m3:
        raise ValueError("the forward kernel takes p_static only with pv_e4m3 (a fixed INT8 P scale is not built)")
    assert sink_shift is None or (sinks is not None and sink_shift.stride() == lse.stride())
    assert not softcap or (shift is not None and shift.stride() == lse.stride())
    assert not (softcap and sink_shift is not None), "capped scores are already the caller's"
    if consumers not in (2, 3):
        raise ValueError(f"consumers must be 2 or 3, got {consumers!r}")
    if pingpong is None:
        pingpong = out4.shape[3] == 128 and consumers == 2
    if named_barriers is None:
        named_barriers = gluon_forward_named_barriers(out4.shape[3])
    if consumer_regs is None:
        consumer_regs = FORWARD_CONSUMER_REGS[consumers]
    q8, k8, q_scale, k_scale = quant.q8, quant.k8, quant.q_scale, quant.k_scale
    head_dim_v = out4.shape[3]
    assert quant.q_mean is None and (head_dim, head_dim_v) in GLUON_HEAD_DIMS and out4.stride(3) == 1
    assert head_dim in K_BLOCK_HEAD_DIMS and K_SCALE_BLOCK == forward_hopper.BLOCK_N.value, "one K scale a key tile"
    bsz, hq, n_q, d = q8.shape
    hk, n_k = k8.shape[1], k8.shape[2]
    d1, d2 = qk_blocks(d)
    q_desc = tma_desc_rows(q8, [forward_hopper.HALF_M.value, d1])
    k_desc = tma_desc_rows(k8, [forward_hopper.BLOCK_N.value, d1])
    q2_desc = tma_desc_rows(q8, [forward_hopper.HALF_M.value, d2]) if d2 else q_desc
    k2_desc = tma_desc_rows(k8, [forward_hopper.BLOCK_N.value, d2]) if d2 else k_desc
    if pv_e4m3:   # the same bytes' layout, read as e4m3 (the wgmma's operand types come from the descriptor)
        vt_desc = tma_desc_rows(v8t.view(torch.float8_e4m3fn), [head_dim_v, forward_hopper.BLOCK_N.value],
                                gl.float8e4nv)
    else:
        vt_desc = tma_desc_rows(v8t, [head_dim_v, forward_hopper.BLOCK_N.value])
    cu_q = layout_q.cu_seqlens if layout_q.is_varlen else q_scale
    cu_k = layout_k.cu_seqlens if layout_k.is_varlen else q_scale
    if layout_k.is_varlen and v_starts is None:
        raise ValueError("packed batches need v8t laid out with quantize.aligned_starts, passed as v_starts")
    num_m = cdiv(layout_q.max_len, consumers * forward_hopper.HALF_M.value)
    num_items = num_m * layout_q.num_seqs * num_heads
    grid, counter, dynamic = persistent_grid(num_items, programs, lse, counter)
    return grid, (
        q_desc, k_desc, vt_desc, q2_desc, k2_desc, q_scale, k_scale, v_scale, out4, lse, cu_q, cu_k,
        v_starts if v_starts is not None else cu_k, sinks if sinks is not None else lse,
        sink_shift if sink_shift is not None else lse, shift if softcap else lse, counter,
        row_max if row_max is not None else lse, q_scale.stride(0), q_scale.stride(1), k_scale.stride(0),
        k_scale.stride(1),
        v_scale.stride(0), v_scale.stride(1), *out4.stride()[:3], lse.stride(0), lse.stride(1),
        n_q, n_k, num_heads, hk, group, window[0], window[1], float(softcap) * LOG2E, num_items, num_m,
    ), dict(IS_VARLEN=layout_q.is_varlen, MASK_LEFT=window[0] >= 0, MASK_RIGHT=window[1] >= 0,
            HEAD_DIM_V=head_dim_v, QK_SPLIT=bool(d2), CONSUMERS=consumers, CONSUMER_REGS=consumer_regs,
            LOADER_REGS=loader_regs, PINGPONG=pingpong,
            SINK_MODE=0 if sinks is None else 2 if sink_shift is not None else 1,
            V_ORDER=v_operand_order,
            SOFTCAP=bool(softcap), NAMED_BARRIERS=bool(named_barriers), DYNAMIC=dynamic,
            PV_E4M3=bool(pv_e4m3), P_STATIC=bool(p_static), WRITE_ROW_MAX=row_max is not None, num_warps=4,
            ptx_options=ptx_options())


def launch_forward_hopper(quant, v8t, v_scale, out4, lse, layout_q, layout_k, num_heads, group, head_dim, window,
                          **tuning):
    """forward.launch_forward's contract on the Gluon kernel: ``out4`` ``[B, Hq, N, D]`` (any strides) and
    ``lse`` ``[B, Hq, N]`` fp32 are written. Needs (head_dim, V's) in ``GLUON_HEAD_DIMS`` and no Q-smoothing; a packed
    batch needs ``v8t`` from ``quantize_v(..., t_starts=aligned_starts(layout_k))`` and those starts as ``v_starts``."""
    grid, args, kwargs = forward_hopper_args(quant, v8t, v_scale, out4, lse, layout_q, layout_k, num_heads, group,
                                             head_dim, window, **tuning)
    return launch(forward_hopper._attn_fwd_hopper_kernel, grid, *args, **kwargs)




def _packed(packing, bsz, n_q, n_k, stand_in):
    """(CU_Q, CU_K, CU_T, IS_VARLEN, sequences, longest query and key sequences) of a launch: ``packing`` is None
    (a padded batch) or (layout_q, layout_k, t_starts): a packed batch's SeqLayouts and its token-major copy's
    16-aligned sequence starts (quantize.aligned_starts of layout_q for the key-tile launches' Q^T and dO^T,
    of layout_k for dQ's K^T)."""
    if packing is None:
        return stand_in, stand_in, stand_in, False, bsz, n_q, n_k
    layout_q, layout_k, t_starts = packing
    assert layout_q.is_varlen and layout_k.is_varlen and layout_q.num_seqs == layout_k.num_seqs and bsz == 1
    return (layout_q.cu_seqlens, layout_k.cu_seqlens, t_starts, True, layout_q.num_seqs, layout_q.max_len,
            layout_k.max_len)


def _caller_desc(x4, block_shape, dtype):
    """A descriptor over a caller's tensor in its own memory (``layout.token_rows``), and its row/column
    coordinates for the kernel."""
    rows = token_rows(x4)
    if rows is None:    # (tma_addressable's copy, without asking token_rows twice of memory it addresses)
        x4 = x4.contiguous()
        rows = token_rows(x4)
    shape, strides, coords = rows
    return tma_descriptor(x4, shape, strides, block_shape, dtype), coords


def dkdv_hopper_args(part, quant, lse, do4, do8t, do_scale, delta, v4, dv4, dk4, group, head_dim, window,
                     softmax_scale, consumer_regs=BACKWARD_CONSUMER_REGS, loader_regs=BACKWARD_LOADER_REGS, fold=None,
                     block_q=None, softcap=0.0, shift=None, programs=None, operand_order=False, packing=None,
                     tile_ks=None, dq_acc=None, dq_buffers=None, counter=None, pv_e4m3=False,
                     p_static=False, q_e4m3=None, in_place=False, dp_int8=None, ds_bound=None):
    """(grid, args, kwargs) of one key-tile launch, ``part`` "dv", "dk", "dkdv" (both: S^T and dP^T once) or "dkdvq"
    (the one launch): ``[B, H, N, D]``
    tensors as ``backward.launch_backward`` takes them (``quant`` from ``quantize_qk(..., transposed=True)``;
    ``softcap`` and ``shift`` as there); ``dv4`` / ``dk4`` may be None where not written. ``operand_order``:
    ``do8t`` and ``quant.q8t`` hold each 16 queries in quantize's operand order, so P^T and dS^T feed their
    products from the registers as they are (no shuffles). ``packing``: None for a padded batch, or for a packed
    one ([1, H, T, D]) ``(layout_q, layout_k, t_starts)``, ``do8t`` and ``q8t`` laid out with ``t_starts``
    (``quantize.aligned_starts(layout_q)``). ``tile_ks`` (default: wherever it applies, head dims with one K scale
    a key block): the loader folds the item's K scale into the per-query vectors, one FMA a score less in S^T's
    dequantization (with a cap: in the cap's argument). ``part="dkdvq"``: dV and dK, and dQ added to ``dq_acc``
    (fp32, ``[B, H, N, D]`` contiguous, zeroed) by reduce-adds (backward_hopper._reduce_dq; dS K in the input
    dtype: backward_hopper._k_operand). ``counter``: the work counter, zeroed (``persistent_grid``'s).
    ``pv_e4m3`` (sagebwd_hf.numerics' rule; parts "dv" and "dkdvq"): dV = P^T dO in FP8 e4m3, ``do8t`` holding dO's
    e4m3 bytes and ``do_scale`` its per-token scales max / 448 (``quantize(..., e4m3=True)``), P^T's largest value
    per key over the query tile mapped to 448; with ``p_static`` P^T = 448 p (no per-key max) and ``do_scale``
    dO's scales per channel per query tile, ``[S, H, tiles, Dv]`` (``quantize(..., e4m3=True,
    channel_tile=block_q)``). ``q_e4m3`` (the dk_e4m3 rule): (Q^T's FP8 e4m3 bytes, in an int8 tensor laid out as
    ``quant.q8t``, and Q's per-token scales max / 448, ``quantize(..., transposed=True, e4m3=True)``'s): dK =
    dS^T Q in e4m3. ``in_place`` (e4m3 products: ``pv_e4m3``, ``q_e4m3``): dV and dK sum in their accumulators
    in place, each key row in units of its latest tile's scale (backward_hopper_common.running_scale); with
    ``p_static`` ``do_scale`` holds dO's channel maxima of each sequence and KV group instead, ``[S, H, Dv]``
    (the do_sequence rule: quantize.quantize_do_sequence), and dV needs no rescaling. ``dp_int8`` (the one launch
    with that rule, in place with ``p_static``): ``(dO8, its per-token scales, V8, its scales)`` from
    ``quantize_do_sequence(..., natural_int8=True)`` and ``quantize(v4, natural=True, block_scale=True)``: dP^T = V
    dO^T in INT8 instead of the input dtype. ``ds_bound`` (the one launch with that rule, in place with
    ``p_static``): the channel maxima of Q times its rows' bounds ``[S, H, D]`` (``do_scale``'s layout), with
    ``q_e4m3`` = (that product's e4m3 bytes, 448 / each row's bound) from ``ds_bound.prepare_ds_bound``: dS^T
    goes to e4m3 at each query's fixed scale, and dK's columns take the maxima at the end."""
    head_dim_v = v4.shape[3]
    assert part in ("dv", "dk", "dkdv", "dkdvq") and (head_dim, head_dim_v) in GLUON_HEAD_DIMS
    do_dv, do_dk, do_dq = part != "dk", part != "dv", part == "dkdvq"
    if p_static and not pv_e4m3:
        raise ValueError("the key-tile kernel takes p_static only with pv_e4m3 (a fixed INT8 P scale is not built)")
    if pv_e4m3 and not do_dv:
        raise ValueError(f"pv_e4m3 is a rule of dV's product: part {part!r} computes none")
    if q_e4m3 is not None and not do_dk:
        raise ValueError(f"q_e4m3 is a rule of dK's product: part {part!r} computes none")
    if in_place and not ((not do_dv or pv_e4m3) and (not do_dk or q_e4m3 is not None)):
        raise ValueError("in_place sums e4m3 products: pv_e4m3 (dV) and q_e4m3 (dK)")
    if fold is None:    # dV alone 1.09-1.12x with it (H100); dK alone 1.00-1.03x (H200)
        fold = part in ("dv", "dk")
    assert not (fold and do_dv and do_dk), "FOLD scales P^T by one product's scale: the other needs it unscaled"
    assert not (do_dq and softcap), "a cap's K-smoothing row term needs dS's row sums, which the one launch lacks"
    for name, given in (("dp_int8", dp_int8), ("ds_bound", ds_bound)):
        if given is not None and not (do_dq and p_static and in_place and q_e4m3 is not None):
            raise ValueError(f"{name} is a rule of the one launch (part 'dkdvq') with dV and dK in place "
                             "(p_static, in_place, q_e4m3)")
    if ds_bound is not None:   # read with dO's channel maxima's strides
        assert ds_bound.shape == do_scale.shape and ds_bound.stride() == do_scale.stride()
    block_q = block_q or (ONE_LAUNCH_QUERY_TILE if do_dv and do_dk else dkdv_query_tile(head_dim))
    can_tile_ks = head_dim in K_BLOCK_HEAD_DIMS and K_SCALE_BLOCK == backward_hopper.BLOCK_N.value
    tile_ks = can_tile_ks if tile_ks is None else bool(tile_ks)
    assert can_tile_ks or not tile_ks, "tile_ks needs one K scale a key tile"
    assert quant.q_mean is None, "no Q-smoothing on this path"
    q8, k8, q_scale, k_scale = quant.q8, quant.k8, quant.q_scale, quant.k_scale
    bsz, hq, n_q, d = q8.shape
    hk, n_k = k8.shape[1], k8.shape[2]
    q_scale_raw = quant.q_scale_raw if q_e4m3 is None else q_e4m3[1]
    shift = shift if softcap else lse
    tile_strides = (None, None)
    if p_static and in_place and do_dv:   # dO's channel maxima of each sequence and KV group, [S, H, Dv]
        num_seqs = packing[0].num_seqs if packing is not None else bsz
        assert do_scale.shape == (num_seqs, hq, head_dim_v) and do_scale.stride(2) == 1
        tile_strides = do_scale.stride()[:2]
    elif p_static:   # dO's scales per channel of each query tile: a tile's Dv of them fill a vector row
        num_seqs = packing[0].num_seqs if packing is not None else bsz
        assert do_scale.shape[:2] == (num_seqs, hq) and do_scale.shape[3] == head_dim_v <= block_q
        assert do_scale.stride(3) == 1 and do_scale.stride(2) == head_dim_v
        tile_strides = do_scale.stride()[:2]
    # dO's scales are dV's alone: the dK part gets (and never reads) whichever dV's rule prepared
    for t in (lse, delta, q_scale_raw, shift) + ((do_scale, ) if do_dv and not p_static else ()):
        assert t.stride() == q_scale.stride(), "the per-query vectors share one layout"
    io_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[do4.dtype]
    d1, d2 = qk_blocks(d)
    q_desc = tma_desc_rows(q8, [block_q, d1], gl.int8)
    k_desc = tma_desc_rows(k8, [backward_hopper.HALF_N.value, d1], gl.int8)
    q2_desc = tma_desc_rows(q8, [block_q, d2], gl.int8) if d2 else q_desc
    k2_desc = tma_desc_rows(k8, [backward_hopper.HALF_N.value, d2], gl.int8) if d2 else k_desc
    if pv_e4m3:   # the same bytes' layout, read as e4m3 (the wgmma's operand types come from the descriptor)
        dot_desc = tma_desc_rows(do8t.view(torch.float8_e4m3fn), [head_dim_v, block_q], gl.float8e4nv)
    else:
        dot_desc = tma_desc_rows(do8t, [head_dim_v, block_q], gl.int8) if do_dv else q_desc
    if do_dk:
        qt, qt_type = (quant.q8t, gl.int8) if q_e4m3 is None else (q_e4m3[0].view(torch.float8_e4m3fn),
                                                                   gl.float8e4nv)
        qt_desc = tma_desc_rows(qt, [d1, block_q], qt_type)
        qt2_desc = tma_desc_rows(qt, [d2, block_q], qt_type) if d2 else qt_desc
        if dp_int8 is not None:   # dO and V in INT8, dO's scales per token, V's per key block (K's strides)
            do8, do8_scale, v8, v8_scale = dp_int8
            assert do8.shape == do4.shape and v8.shape == v4.shape and do8.dtype == v8.dtype == torch.int8
            assert do8_scale.stride() == q_scale.stride() and v8_scale.stride() == quant.k_scale.stride()
            do_desc, do_coords = _caller_desc(do8, [block_q, head_dim_v], gl.int8)
            v_desc, v_coords = _caller_desc(v8, [backward_hopper.HALF_N.value, head_dim_v], gl.int8)
        else:
            do_desc, do_coords = _caller_desc(do4, [block_q, head_dim_v], io_dtype)
            v_desc, v_coords = _caller_desc(v4, [backward_hopper.HALF_N.value, head_dim_v], io_dtype)
    else:
        qt_desc, qt2_desc, do_desc, v_desc = q_desc, q_desc, q_desc, k_desc          # unused
        do_coords = v_coords = (0, 0, 0)
    if do_dq:
        assert not d2 and tile_ks and dq_acc is not None and dq_acc.dtype == torch.float32
        assert dq_acc.shape == q8.shape and dq_acc.is_contiguous()
        dq_desc = tma_desc_2d(dq_acc.view(-1, head_dim), [block_q, head_dim // 2], gl.float32)
    else:
        dq_desc = k_desc       # unused
    dv4 = dv4 if do_dv else dk4
    dk4 = dk4 if do_dk else dv4
    assert dv4.stride(3) == 1 and dk4.stride(3) == 1
    cu_q, cu_k, cu_qt, varlen, num_seqs, _, max_k = _packed(packing, bsz, n_q, n_k, lse)
    num_n = cdiv(max_k, backward_hopper.BLOCK_N.value)
    num_items = num_n * num_seqs * hk
    grid, counter, dynamic = persistent_grid(num_items, programs, lse, counter)
    return grid, (
        q_desc, qt_desc, do_desc, dot_desc, k_desc, v_desc, q2_desc, qt2_desc, k2_desc, dq_desc, q_scale, lse,
        do_scale, delta, q_scale_raw, shift, k_scale, dv4, dk4, counter, cu_q, cu_k, cu_qt, q_scale.stride(0),
        q_scale.stride(1), k_scale.stride(0), k_scale.stride(1),
        *dv4.stride()[:3], *dk4.stride()[:3], *tile_strides, *do_coords, *v_coords,
        lse if dp_int8 is None else dp_int8[1], lse if dp_int8 is None else dp_int8[3],
        lse if ds_bound is None else ds_bound, n_q, n_k, hq, hk, group,
        window[0],
        window[1],
        softmax_scale, float(softcap) * LOG2E if softcap else 1.0, num_items, num_n,
    ), dict(IS_VARLEN=varlen, MASK_LEFT=window[0] >= 0, MASK_RIGHT=window[1] >= 0, HEAD_DIM=head_dim,
            HEAD_DIM_V=head_dim_v,
            QK_SPLIT=bool(d2), DO_DK=do_dk, DO_DV=do_dv,
            CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, FOLD=fold, SOFTCAP=bool(softcap),
            BLOCK_Q=block_q, DYNAMIC=dynamic, ORDER=operand_order, TILE_KS=tile_ks,
            DO_DQ=do_dq,
            DQ_BUFFERS=dq_buffers or one_launch_dq_buffers(head_dim), PV_E4M3=bool(pv_e4m3), P_STATIC=bool(p_static),
            DK_E4M3=q_e4m3 is not None,
            IN_PLACE=bool(in_place), DP_INT8=dp_int8 is not None, DS_BOUND=ds_bound is not None, num_warps=4,
            ptx_options=ptx_options())


def launch_dkdv_hopper(part, quant, lse, do4, do8t, do_scale, delta, v4, dv4, dk4, group, head_dim, window,
                       softmax_scale, **tuning):
    """dV (``part="dv"``), dK (``"dk"``) or, with dQ added to ``dq_acc``, all three (``"dkdvq"``) into ``dv4`` /
    ``dk4`` ``[B, Hk, N, D]``."""
    grid, args, kwargs = dkdv_hopper_args(part, quant, lse, do4, do8t, do_scale, delta, v4, dv4, dk4, group,
                                          head_dim, window, softmax_scale, **tuning)
    return launch(backward_hopper._attn_bwd_dkdv_hopper_kernel, grid, *args, **kwargs)


def dq_hopper_args(quant, lse, do4, delta, v4, dq4, group, head_dim, window, softmax_scale,
                   consumer_regs=BACKWARD_CONSUMER_REGS, loader_regs=BACKWARD_LOADER_REGS, softcap=0.0, shift=None,
                   row_ds=None, k_mean=None, programs=None, operand_order=False, packing=None, counter=None):
    """(grid, args, kwargs) of the dQ launch: ``[B, H, N, D]`` tensors as ``backward.launch_backward`` takes them
    (``quant`` from ``quantize_qk(..., transposed=True)``, whose ``k8t`` is dQ's B operand; ``softcap``, ``shift``,
    ``row_ds``, ``k_mean`` as there). ``operand_order``: ``k8t`` holds each 16 keys in quantize's operand order
    (dkdv_hopper_args's). ``packing``: as dkdv_hopper_args's, its ``t_starts`` ``k8t``'s
    (``quantize.aligned_starts(layout_k)``). ``counter``: the work counter, zeroed (``persistent_grid``'s)."""
    head_dim_v = v4.shape[3]
    assert (head_dim, head_dim_v) in GLUON_HEAD_DIMS and dq4.stride(3) == 1
    block_k = dq_key_tile(head_dim)
    assert head_dim in K_BLOCK_HEAD_DIMS and K_SCALE_BLOCK % block_k == 0, "one K scale a key tile"
    assert quant.q_mean is None, "no Q-smoothing on this path"
    q8, k8, k8t, q_scale, k_scale = quant.q8, quant.k8, quant.k8t, quant.q_scale, quant.k_scale
    bsz, hq, n_q, d = q8.shape
    hk, n_k = k8.shape[1], k8.shape[2]
    assert not softcap or shift is not None
    row_sums = k_mean is not None and (bool(softcap) or row_ds is None)    # the kernel's own, else the sinks'
    shift = shift if softcap else lse
    row_ds = lse if row_sums or k_mean is None else row_ds
    for t in (lse, delta, shift, row_ds):
        assert t.stride() == q_scale.stride(), "the per-query vectors share one layout"
    io_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[do4.dtype]
    d1, d2 = qk_blocks(d)
    q_desc = tma_desc_rows(q8, [backward_hopper.HALF_N.value, d1], gl.int8)
    do_desc, do_coords = _caller_desc(do4, [backward_hopper.HALF_N.value, head_dim_v], io_dtype)
    k_desc = tma_desc_rows(k8, [block_k, d1], gl.int8)
    v_desc, v_coords = _caller_desc(v4, [block_k, head_dim_v], io_dtype)
    kt_desc = tma_desc_rows(k8t, [d1, block_k], gl.int8)
    q2_desc = tma_desc_rows(q8, [backward_hopper.HALF_N.value, d2], gl.int8) if d2 else q_desc
    k2_desc = tma_desc_rows(k8, [block_k, d2], gl.int8) if d2 else k_desc
    kt2_desc = tma_desc_rows(k8t, [d2, block_k], gl.int8) if d2 else kt_desc
    cu_q, cu_k, cu_kt, varlen, num_seqs, max_q, _ = _packed(packing, bsz, n_q, n_k, lse)
    if k_mean is not None:   # one mean a sequence (packed: the sequences', not the one batch's)
        assert k_mean.shape == (hk, num_seqs, d) and k_mean.stride(2) == 1 and k_mean.dtype == torch.float32
    num_m = cdiv(max_q, backward_hopper.BLOCK_M.value)
    num_items = num_m * num_seqs * hq
    grid, counter, dynamic = persistent_grid(num_items, programs, lse, counter)
    return grid, (
        q_desc, do_desc, k_desc, v_desc, kt_desc, q2_desc, k2_desc, kt2_desc, q_scale, lse, delta, shift, row_ds,
        lse if k_mean is None else k_mean, k_scale, dq4, counter, cu_q, cu_k, cu_kt,
        q_scale.stride(0), q_scale.stride(1), k_scale.stride(0), k_scale.stride(1),
        *((0, 0) if k_mean is None else k_mean.stride()[:2]), *dq4.stride()[:3],
        *do_coords, *v_coords, n_q, n_k, hq, hk, group, window[0], window[1], softmax_scale,
        float(softcap) * LOG2E if softcap else 1.0, num_items, num_m,
    ), dict(IS_VARLEN=varlen, MASK_LEFT=window[0] >= 0, MASK_RIGHT=window[1] >= 0, HEAD_DIM=head_dim,
            QK_SPLIT=bool(d2), CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, SOFTCAP=bool(softcap),
            ROW_TERM=k_mean is not None, ROW_SUMS=row_sums, DYNAMIC=dynamic, ORDER=operand_order, num_warps=4,
            ptx_options=ptx_options())


def launch_dq_hopper(quant, lse, do4, delta, v4, dq4, group, head_dim, window, softmax_scale, **tuning):
    """dQ into ``dq4`` ``[B, H, N, D]`` (any strides with a contiguous last dim) on the Gluon kernel."""
    grid, args, kwargs = dq_hopper_args(quant, lse, do4, delta, v4, dq4, group, head_dim, window, softmax_scale,
                                        **tuning)
    return launch(backward_hopper._attn_bwd_dq_hopper_kernel, grid, *args, **kwargs)


def _add_sinks_row_term(dq_acc, row_ds, k_mean, group, softmax_scale, packing):
    """The dQ launch's ``ROW_TERM`` for sinks after the one launch: ``dq_acc += scale * row_ds * mean(k)``, row_ds
    the sink's share of each row's rowsum(dS) (given), k_mean ``[Hk, sequences, D]``, each query head reading its
    KV head's mean (no copy per query head) and each token its sequence's."""
    b, h, n, d = dq_acc.shape
    hk = h // group
    if packing is None:
        assert k_mean.shape == (hk, b, d), k_mean.shape
        mean = k_mean.permute(1, 0, 2).reshape(b, hk, 1, 1, d)
    else:   # one [1, H, T, D] batch: each token's sequence
        assert k_mean.shape == (hk, packing[0].num_seqs, d), k_mean.shape
        mean = k_mean[:, packing[0].seq_ids(n, dq_acc.device)].reshape(1, hk, 1, n, d)
    dq_acc.view(b, hk, group, n, d).addcmul_(row_ds.reshape(b, hk, group, n, 1), mean, value=softmax_scale)


def launch_backward_hopper(quant, v4, do4, do8t, do_scale, lse, delta, dq4, dk4, dv4, num_heads, num_kv_heads,
                           head_dim, window, softmax_scale, softcap=0.0, shift=None, row_ds=None,
                           k_mean=None, packing=None, fused_dq=False, counters=None, dq_acc=None, pv_e4m3=False,
                           p_static=False, fused_dkdv=False, q_e4m3=None, in_place=False, dp_int8=None,
                           ds_bound=None, **tuning):
    """backward.launch_backward's contract on the Gluon kernels, without Q-smoothing: dV, dK and dQ as three
    launches, each gradient written once (deterministic). ``softcap`` > 0: capped scores
    (``shift`` as the forward's); ``k_mean``, ``row_ds``: as there. ``packing``: None for a padded batch; for a
    packed one ``(layout_q, layout_k, q_starts, k_starts)``, the token-major copies (``do8t``, ``q8t``; ``k8t``)
    laid out with those starts (``quantize.aligned_starts``). ``fused_dq``: one launch instead (``part="dkdvq"``,
    64-query tiles), dQ added up by reduce-adds in fp32, so not bit-identical run to run; no cap (the sinks'
    K-smoothing term is added after it: _add_sinks_row_term); ``dq4`` None: the fp32 dQ is returned instead of
    copied into it (the caller frees the launch's inputs first). ``counters``: COUNTER_INTS zeroed int32s, the
    launches' work counters (``counter_slot``), instead of one zeroed a launch; ``dq_acc``: the one launch's fp32 dQ
    accumulator, zeroed (``[B, H, N, D]`` contiguous), instead of one zeroed here. ``pv_e4m3``, ``p_static``: dV's
    rule (dkdv_hopper_args'; ``do8t`` and ``do_scale`` as it takes them). ``fused_dkdv``: dV and dK in one launch
    (64-query tiles: S^T and dP^T once), then the dQ launch. ``q_e4m3``, ``in_place``: dK's rule and the
    accumulation (dkdv_hopper_args'); ``dp_int8``: the one launch's dP^T in INT8, ``ds_bound``: its dS^T at each
    query's fixed scale (both dkdv_hopper_args')."""
    if (dp_int8 is not None or ds_bound is not None) and not fused_dq:
        raise ValueError("dp_int8 and ds_bound: only the one launch (fused_dq) computes them")
    group = num_heads // num_kv_heads
    common = (group, head_dim, window, softmax_scale)
    lse = lse.contiguous()      # the per-query vectors are read with q_scale's strides
    key_tiles_packing = dq_packing = None
    if packing is not None:
        layout_q, layout_k, q_starts, k_starts = packing
        key_tiles_packing, dq_packing = (layout_q, layout_k, q_starts), (layout_q, layout_k, k_starts)
    tuning = dict(tuning, softcap=softcap, shift=shift)
    do4, v4 = tma_addressable(do4), tma_addressable(v4)     # a copy, if one is needed, once for all launches
    if fused_dq:   # one launch: dQ by reduce-adds of dS K from the key-tile programs (not deterministic)
        if dq_acc is None:
            dq_acc = torch.zeros(quant.q8.shape, dtype=torch.float32, device=quant.q8.device)
        launch_dkdv_hopper("dkdvq", quant, lse, do4, do8t, do_scale, delta, v4, dv4, dk4, *common,
                           packing=key_tiles_packing, dq_acc=dq_acc, counter=counter_slot(counters, 0),
                           pv_e4m3=pv_e4m3, p_static=p_static, q_e4m3=q_e4m3, in_place=in_place, dp_int8=dp_int8,
                           ds_bound=ds_bound, **tuning)
        if k_mean is not None:   # (its key-tile programs cannot sum dS's rows: the sinks' only, given)
            assert row_ds is not None, "the one launch takes the sinks' row term, not its own row sums"
            _add_sinks_row_term(dq_acc, row_ds, k_mean, group, softmax_scale, packing)
        if dq4 is None:
            return dq_acc
        dq4.copy_(dq_acc)
        return None
    if fused_dkdv:
        launch_dkdv_hopper("dkdv", quant, lse, do4, do8t, do_scale, delta, v4, dv4, dk4, *common,
                           packing=key_tiles_packing, counter=counter_slot(counters, 0), pv_e4m3=pv_e4m3,
                           p_static=p_static, q_e4m3=q_e4m3, in_place=in_place, **tuning)
    else:
        launch_dkdv_hopper("dv", quant, lse, do4, do8t, do_scale, delta, v4, dv4, None, *common,
                           packing=key_tiles_packing, counter=counter_slot(counters, 0), pv_e4m3=pv_e4m3,
                           p_static=p_static, in_place=in_place, **tuning)
        launch_dkdv_hopper("dk", quant, lse, do4, do8t, do_scale, delta, v4, None, dk4, *common,
                           packing=key_tiles_packing, counter=counter_slot(counters, 1), q_e4m3=q_e4m3,
                           in_place=in_place, **tuning)
    launch_dq_hopper(quant, lse, do4, delta, v4, dq4, *common, row_ds=row_ds, k_mean=k_mean, packing=dq_packing,
                     counter=counter_slot(counters, 2),
                     **{key: value for key, value in tuning.items() if key not in ("fold", "block_q", "tile_ks")})
