"""SageBwd backward on Hopper (sm_90), in Gluon: the dK and dV kernels. NOT YET RUN ON A GPU.

Written at the end of session 4 with no device time left; they compile for sm_90 (Triton 3.6) and nothing
dispatches to them. The next session's first GPU call checks them against ``backward.py``'s dV and dK
launches (``tests/test_backward_hopper.py``) before anything builds on them.

Same numerics as the portable key-tile kernel (``backward._dkdv_tile``) at its GPU query tile, 128 queries:
``S^T = K8 Q8^T`` in INT8 dequantized with the per-token K and Q scales, ``P^T = exp2(S^T - lse)``; then either
``dV += P^T dO`` in INT8 (dO's per-token scale folded into P^T, P^T quantized per key over each query tile), or
``dP^T = V dO^T`` in bf16/fp16, ``dS^T = P^T (dP^T - delta)`` and ``dK += dS^T Q`` in INT8 (Q's per-token scale
folded into dS^T, quantized per key). The schedule is the Gluon forward's (``forward_hopper.py``): one program
per 128 keys of one (sequence, KV head); a loader warp brings K (and V) once and, per query tile of every query
head of the group, the tile's operands and per-query vectors into a two-stage ring; two consumer warpgroups
of 64 keys each.

Why two launches (``DO_DK`` off: dV; on: dK), as the portable kernels do at D=128: INT8 wgmma accumulates in
int32 and the quantization scale changes per tile, so each product is dequantized through its own 64 int32
registers into an fp32 accumulator; dK and dV in one program need two accumulators, two products and dP^T at
once (over 300 registers per thread). dQ stays on the portable kernel for now.

Compiled state (Triton 3.6, sm_90, 240 registers per consumer): the dV kernel has no spills (14 spill
instructions outside the loop in the windowed D=128 variant); the dK kernel's tile loop is spill-free at
D=64 and spills at D=128 (about 30 spill loads and stores per 64x128 tile of ~1,140 instructions). Each
per-query vector (q_scale, lse, delta, raw Q scale) sits on the columns of the [64 keys x 128 queries] tiles,
32 values per thread, so they are loaded where used; at D=128 S^T/P^T, dP^T and the accumulator (64
registers each) leave too little beside them. Ways out, to measure: queries on the rows instead
(FlashAttention 3 computes S = Q K^T and moves P^T, dS^T through shared memory for the dV/dK products), or a
64-query tile (a numerics change: the per-key scales would cover 64 queries; the portable kernels and the
reference follow).

Padded batches, head dims 64 and 128, no Q-smoothing.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# the forward's Gluon helpers (Gluon functions call each other across modules; @triton.jit ones they cannot)
from .forward_hopper import _ceil_to, _floor_to, _round_to_int8, _tma_desc

HALF_N = gl.constexpr(64)     # keys per consumer warpgroup (one wgmma M)
BLOCK_N = gl.constexpr(128)   # keys per program: two consumers
BLOCK_M = gl.constexpr(128)   # queries per tile: part of the numerics (P^T's per-key scale), as backward.py's
STAGES = gl.constexpr(2)


@gluon.jit
def _query_tiles(start_n, seqlen_q, seqlen_k, window_left, window_right,
                 MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """backward._query_tiles (a Gluon kernel cannot call @triton.jit functions): query tiles that see the key
    tile at ``start_n``; ``[lo, full_lo)`` and ``[full_hi, hi)`` need the mask."""
    diag = seqlen_k - seqlen_q
    lo = seqlen_q * 0
    full_lo = lo
    hi = seqlen_q
    full_hi = _ceil_to(seqlen_q, BLOCK_M)
    if MASK_RIGHT:
        lo = _floor_to(start_n - diag - window_right, BLOCK_M)
        full_lo = _ceil_to(start_n + BLOCK_N - 1 - diag - window_right, BLOCK_M)
    if MASK_LEFT:
        hi = gl.minimum(hi, start_n + BLOCK_N - diag + window_left)
        full_hi = gl.minimum(full_hi, _floor_to(start_n - diag + window_left + 1, BLOCK_M))
    hi = _ceil_to(hi, BLOCK_M)
    lo = gl.minimum(lo, hi)
    full_lo = gl.minimum(gl.maximum(full_lo, lo), hi)
    full_hi = gl.minimum(gl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@gluon.jit
def _loader(q_desc, op_desc, do_desc, k_desc, v_desc, q_smem, op_smem, do_smem, k_smem, v_smem, vec_smem,
            k_bar, ready, empty, QS, LSE, VEC2, VEC3, k_row, q_head0, vec_head0, s_vech, n_q, group, seqlen_q,
            lo, hi, DO_DK: gl.constexpr):
    """One warp: K (and V for dK) once; then per query head of the group and query tile in ``[lo, hi)``: Q8,
    the second product's int8 operand (dO8^T for dV, Q8^T for dK), dO itself for dK's dP^T, and the
    per-query vectors (rows: q_scale, lse (+inf past the end), dO scale or delta, -, or the raw Q scale)."""
    kv_bytes: gl.constexpr = k_desc.block_type.nbytes + (v_desc.block_type.nbytes if DO_DK else 0)
    mbarrier.expect(k_bar, 2 * kv_bytes)
    tma.async_copy_global_to_shared(k_desc, [k_row, 0], k_bar, k_smem.index(0))
    tma.async_copy_global_to_shared(k_desc, [k_row + HALF_N, 0], k_bar, k_smem.index(1))
    if DO_DK:
        tma.async_copy_global_to_shared(v_desc, [k_row, 0], k_bar, v_smem.index(0))
        tma.async_copy_global_to_shared(v_desc, [k_row + HALF_N, 0], k_bar, v_smem.index(1))
    nbytes: gl.constexpr = (q_desc.block_type.nbytes + op_desc.block_type.nbytes
                            + (do_desc.block_type.nbytes if DO_DK else 0))
    vec_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    offs = gl.arange(0, BLOCK_M, layout=vec_layout)
    head_dim: gl.constexpr = op_desc.block_type.shape[0]
    i = 0
    for g in range(group):
        for start_m in range(lo, hi, BLOCK_M):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            q_row = (q_head0 + g) * n_q + start_m
            tma.async_copy_global_to_shared(q_desc, [q_row, 0], ready.index(s), q_smem.index(s))
            tma.async_copy_global_to_shared(op_desc, [(q_head0 + g) * head_dim, start_m], ready.index(s),
                                            op_smem.index(s))
            if DO_DK:
                tma.async_copy_global_to_shared(do_desc, [q_row, 0], ready.index(s), do_smem.index(s))
            rows = start_m + offs
            ok = rows < seqlen_q
            base = vec_head0 + g * s_vech + rows
            vec_smem.index(4 * s).store(gl.load(QS + base, mask=ok, other=0.0))
            vec_smem.index(4 * s + 1).store(gl.load(LSE + base, mask=ok, other=float("inf")))
            vec_smem.index(4 * s + 2).store(gl.load(VEC2 + base, mask=ok, other=0.0))
            if DO_DK:
                vec_smem.index(4 * s + 3).store(gl.load(VEC3 + base, mask=ok, other=0.0))
            mbarrier.arrive(ready.index(s), count=1)     # the second of ready's two arrivals
            i += 1


@gluon.jit
def _key_tiles_bwd(acc, it, k8, v16, k_scale, k_bias, q_smem, op_smem, do_smem, vec_smem, ready, empty, keys,
                   lo, hi, seqlen_q, seqlen_k, window_left, window_right,
                   MASKED: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, DO_DK: gl.constexpr,
                   s_layout: gl.constexpr, dp_layout: gl.constexpr, o_layout: gl.constexpr,
                   p_layout: gl.constexpr):
    """Query tiles ``[lo, hi)`` of one head for one warpgroup's 64 keys: dV += P^T dO, or dK += dS^T Q."""
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    offs_m = gl.arange(0, BLOCK_M, layout=col_layout)
    s_zero = gl.zeros([HALF_N, BLOCK_M], gl.int32, s_layout)
    dp_zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, dp_layout)
    o_zero = gl.zeros(acc.shape, gl.int32, o_layout)
    diag = seqlen_k - seqlen_q
    for start_m in range(lo, hi, BLOCK_M):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        st_tok = warpgroup_mma(k8, q_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if DO_DK:   # dP^T = V dO^T in the input dtype (quantizing it would feed error into dS), beside S^T
            dpt_tok = warpgroup_mma(v16, do_smem.index(s).permute((1, 0)), dp_zero, use_acc=False, is_async=True)
        q_scale = vec_smem.index(4 * s).load(col_layout)
        lse = vec_smem.index(4 * s + 1).load(col_layout)
        if DO_DK:
            st_int, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st_tok, dpt_tok))
        else:
            st_int = warpgroup_mma_wait(num_outstanding=0, deps=(st_tok, ))
        st = gl.fma((st_int + 0x4B400000).to(gl.float32, bitcast=True), k_scale[:, None], k_bias[:, None])
        pt = gl.exp2(gl.fma(st, q_scale[None, :], -lse[None, :]))   # lse is +inf past the end: 0
        if MASKED:
            r2 = (start_m + offs_m)[None, :]
            c2 = keys[:, None]
            valid = (r2 < seqlen_q) & (c2 < seqlen_k)
            if MASK_RIGHT:
                valid = valid & (c2 <= r2 + diag + window_right)
            if MASK_LEFT:
                valid = valid & (c2 >= r2 + diag - window_left)
            pt = gl.where(valid, pt, 0.0)
        # the other operand's per-token scale folded in, then one scale per key over the tile
        # (backward._quantize_rows: unsigned for P^T, signed for dS^T)
        # (each per-query vector costs 32 registers per thread: each is loaded where it is used)
        if DO_DK:
            delta = vec_smem.index(4 * s + 2).load(col_layout)
            x = pt * (gl.convert_layout(dpt, s_layout) - delta[None, :])
            qr_scale = vec_smem.index(4 * s + 3).load(col_layout)
            x = x * qr_scale[None, :]
            x_max = gl.max(gl.abs(x), 1)
        else:
            do_scale = vec_smem.index(4 * s + 2).load(col_layout)
            x = pt * do_scale[None, :]
            x_max = gl.max(x, 1)
        x8 = gl.convert_layout(_round_to_int8(x * gl.where(x_max > 1e-30, 127.0 / x_max, 0.0)[:, None]), p_layout)
        prod_tok = warpgroup_mma(x8, op_smem.index(s).permute((1, 0)), o_zero, use_acc=False, is_async=True)
        x_scale = gl.convert_layout(x_max * (1.0 / 127.0), gl.SliceLayout(1, o_layout))
        prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod_tok, ))
        mbarrier.arrive(empty.index(s), count=1)
        # float(prod) * x_scale by the forward's add trick (quantize.int32_times)
        acc = gl.fma((prod + 0x4B400000).to(gl.float32, bitcast=True), x_scale[:, None],
                     acc + (x_scale * -12582912.0)[:, None])
        it += 1
    return acc, it


@gluon.jit
def _bwd_consumer(k8, v16, first, q_smem, op_smem, do_smem, vec_smem, k_bar, ready, empty, KS, OUT, ks_off,
                  out_off, s_ot, seqlen_q, seqlen_k, window_left, window_right, group, lo, full_lo, full_hi, hi,
                  out_scale, HEAD_DIM: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                  DO_DK: gl.constexpr):
    """One warpgroup: keys ``[first, first + 64)`` (their int8 K in ``k8``, V in ``v16``) against every query
    tile of every query head of the group; writes their dV or dK rows."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 32])
    dp_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    keys = first + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    k_scale = gl.load(KS + ks_off + keys, mask=keys < seqlen_k, other=0.0)
    k_bias = k_scale * -12582912.0
    acc = gl.zeros([HALF_N, HEAD_DIM], gl.float32, o_layout)
    mbarrier.wait(k_bar, 0)
    it = lo * 0
    for g in range(group):
        acc, it = _key_tiles_bwd(acc, it, k8, v16, k_scale, k_bias, q_smem, op_smem, do_smem, vec_smem, ready,
                                 empty, keys, lo, full_lo, seqlen_q, seqlen_k, window_left, window_right, True,
                                 MASK_LEFT, MASK_RIGHT, DO_DK, s_layout, dp_layout, o_layout, p_layout)
        acc, it = _key_tiles_bwd(acc, it, k8, v16, k_scale, k_bias, q_smem, op_smem, do_smem, vec_smem, ready,
                                 empty, keys, full_lo, full_hi, seqlen_q, seqlen_k, window_left, window_right, False,
                                 MASK_LEFT, MASK_RIGHT, DO_DK, s_layout, dp_layout, o_layout, p_layout)
        acc, it = _key_tiles_bwd(acc, it, k8, v16, k_scale, k_bias, q_smem, op_smem, do_smem, vec_smem, ready,
                                 empty, keys, full_hi, hi, seqlen_q, seqlen_k, window_left, window_right, True,
                                 MASK_LEFT, MASK_RIGHT, DO_DK, s_layout, dp_layout, o_layout, p_layout)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    keys_o = gl.convert_layout(keys, gl.SliceLayout(1, o_layout))
    ptrs = OUT + out_off + keys_o.to(gl.int64)[:, None] * s_ot + offs_d[None, :]
    gl.store(ptrs, (acc * out_scale).to(OUT.dtype.element_ty), mask=(keys_o < seqlen_k)[:, None])


@gluon.jit
def _attn_bwd_dkdv_hopper_kernel(
    q_desc, op_desc, do_desc, k_desc, v_desc, QS, LSE, VEC2, VEC3, KS, OUT,
    s_qsb, s_qsh, s_ksb, s_ksh, s_ob, s_oh, s_ot,
    n_q, n_k, num_heads, num_kv_heads, group, window_left, window_right, out_scale,
    MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, HEAD_DIM: gl.constexpr, DO_DK: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):
    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // num_kv_heads
    hk = pid_bh % num_kv_heads
    seqlen_q = n_q + b * 0
    seqlen_k = n_k + b * 0
    start_n = pid_n * BLOCK_N
    lo, full_lo, full_hi, hi = _query_tiles(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                            MASK_LEFT, MASK_RIGHT)
    # rows of the 2-D views the descriptors see: Q8 and dO [B*H*Nq, D], dO8^T / Q8^T [B*H*D, Nq_pad],
    # K8 and V [B*Hk*Nk, D]
    q_head0 = b * num_heads + hk * group
    k_row = (b * num_kv_heads + hk) * n_k + start_n

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    op_smem = gl.allocate_shared_memory(op_desc.dtype, [STAGES] + op_desc.block_type.shape, op_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    if DO_DK:
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    else:   # unused: one small buffer stands in
        do_smem = op_smem
        v_smem = k_smem
    vec_smem = gl.allocate_shared_memory(gl.float32, [4 * STAGES, BLOCK_M],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(k_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=2)      # the TMA bytes and the per-query vectors
        mbarrier.init(empty.index(i), count=2)      # both consumers release a buffer

    vec_head0 = b.to(gl.int64) * s_qsb + (hk * group) * s_qsh
    ks_off = b.to(gl.int64) * s_ksb + hk * s_ksh
    out_off = b.to(gl.int64) * s_ob + hk.to(gl.int64) * s_oh
    gl.warp_specialize([
        (_bwd_consumer, (k_smem.index(0), v_smem.index(0), start_n, q_smem, op_smem, do_smem, vec_smem, k_bar,
                         ready, empty, KS, OUT, ks_off, out_off, s_ot, seqlen_q, seqlen_k, window_left,
                         window_right, group, lo, full_lo, full_hi, hi, out_scale, HEAD_DIM, MASK_LEFT, MASK_RIGHT,
                         DO_DK)),
        (_bwd_consumer, (k_smem.index(1), v_smem.index(1), start_n + HALF_N, q_smem, op_smem, do_smem, vec_smem,
                         k_bar, ready, empty, KS, OUT, ks_off, out_off, s_ot, seqlen_q, seqlen_k, window_left,
                         window_right, group, lo, full_lo, full_hi, hi, out_scale, HEAD_DIM, MASK_LEFT, MASK_RIGHT,
                         DO_DK)),
        (_loader, (q_desc, op_desc, do_desc, k_desc, v_desc, q_smem, op_smem, do_smem, k_smem, v_smem, vec_smem,
                   k_bar, ready, empty, QS, LSE, VEC2, VEC3, k_row, q_head0, vec_head0, s_qsh, n_q, group,
                   seqlen_q, lo, hi, DO_DK)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def _rows(x4):
    """``[B, H, N, D]`` as ``[B*H*N, D]`` for a descriptor (a copy when the view has other strides)."""
    return x4.reshape(-1, x4.shape[-1])


def dkdv_hopper_args(part, quant, lse, do4, do8t, do_scale, delta, v4, out4, num_heads, group, head_dim,
                     window, softmax_scale, consumer_regs=240, loader_regs=32):
    """(grid, args, kwargs) of one launch, ``part`` "dv" or "dk": padded ``[B, H, N, D]`` tensors as
    ``backward.launch_backward`` takes them (``quant`` from ``quantize_qk(..., transposed=True)``)."""
    import torch
    import triton

    assert part in ("dv", "dk") and head_dim in (64, 128) and out4.stride(3) == 1
    assert quant["q_mean"] is None, "no Q-smoothing on this path"
    q8, k8, q_scale, k_scale = quant["q8"], quant["k8"], quant["q_scale"], quant["k_scale"]
    bsz, hq, n_q, d = q8.shape
    hk, n_k = k8.shape[1], k8.shape[2]
    dk = part == "dk"
    vec2, vec3 = (delta, quant["q_scale_raw"]) if dk else (do_scale, q_scale)
    for t in (lse, vec2, vec3):
        assert t.stride() == q_scale.stride(), "the per-query vectors share one layout"
    q_desc = _tma_desc(_rows(q8), [BLOCK_M.value, d], gl.int8)
    op = quant["q8t"] if dk else do8t
    op_desc = _tma_desc(op.reshape(-1, op.shape[-1]), [d, BLOCK_M.value], gl.int8)
    k_desc = _tma_desc(_rows(k8), [HALF_N.value, d], gl.int8)
    if dk:
        io_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[do4.dtype]
        do_desc = _tma_desc(_rows(do4), [BLOCK_M.value, d], io_dtype)
        v_desc = _tma_desc(_rows(v4), [HALF_N.value, d], io_dtype)
    else:
        do_desc, v_desc = q_desc, k_desc          # unused
    grid = (triton.cdiv(n_k, BLOCK_N.value), bsz * hk)
    return grid, (
        q_desc, op_desc, do_desc, k_desc, v_desc, q_scale, lse, vec2, vec3, k_scale, out4,
        q_scale.stride(0), q_scale.stride(1), k_scale.stride(0), k_scale.stride(1), *out4.stride()[:3],
        n_q, n_k, hq, hk, group, window[0], window[1], softmax_scale if dk else 1.0,
    ), dict(MASK_LEFT=window[0] >= 0, MASK_RIGHT=window[1] >= 0, HEAD_DIM=head_dim, DO_DK=dk,
            CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, num_warps=4)


def launch_dkdv_hopper(part, quant, lse, do4, do8t, do_scale, delta, v4, out4, num_heads, group, head_dim,
                       window, softmax_scale, **tuning):
    """dV (``part="dv"``) or dK (``"dk"``) into ``out4`` ``[B, Hk, N, D]`` on the Gluon kernel."""
    grid, args, kwargs = dkdv_hopper_args(part, quant, lse, do4, do8t, do_scale, delta, v4, out4, num_heads,
                                          group, head_dim, window, softmax_scale, **tuning)
    return _attn_bwd_dkdv_hopper_kernel[grid](*args, **kwargs)
