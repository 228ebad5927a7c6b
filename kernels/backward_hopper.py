"""SageBwd backward on Hopper (sm_90), in Gluon: first piece, the dV kernel. NOT YET RUN ON A GPU.

Written at the end of session 4 with no device time left; it compiles for sm_90 (Triton 3.6) and nothing
dispatches to it. The next session's first GPU call checks it against ``backward.py``'s dV launch
(``tests/test_backward_hopper.py``) before anything else builds on it.

Same numerics as the portable dV launch (``backward._dkdv_tile`` with ``DO_DV``) at its GPU tile, 128 queries:
``S^T = K8 Q8^T`` in INT8 dequantized with the per-token K and Q scales, ``P^T = exp2(S^T - lse)``, then
``dV += P^T dO`` in INT8 with dO's per-token scale folded into P^T and P^T quantized per key over each
128-query tile. The schedule is the Gluon forward's (``forward_hopper.py``): one program per 128 keys of one
(sequence, KV head); a loader warp brings the K tile once and, per query tile of every query head of the
group, Q8, dO8^T and the tile's per-query vectors (q_scale, lse, dO scale) into a two-stage ring; two
consumer warpgroups of 64 keys each. Registers per consumer thread: S/P^T 64, P^T int8 16, the int32 product
64, the dV accumulator 64.

Why dV alone first: INT8 wgmma accumulates in int32 and P^T's scale changes per tile, so every product is
dequantized into an fp32 accumulator through its own 64 int32 registers; dV and dK together need two
accumulators, two products and dP^T at once (over 300 registers). The portable kernels split them at D=128
for the same reason (``interface.tile_configs``). A dK kernel (S^T, dP^T = V dO^T in bf16, dS^T, dK += dS^T Q
in INT8) follows the same plan; dQ stays on the portable kernel until both are proven.

Padded batches, head dims 64 and 128, no Q-smoothing.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

HALF_N = gl.constexpr(64)     # keys per consumer warpgroup (one wgmma M)
BLOCK_N = gl.constexpr(128)   # keys per program: two consumers
BLOCK_M = gl.constexpr(128)   # queries per tile: part of the numerics (P^T's per-key scale), as backward.py's
STAGES = gl.constexpr(2)


@gluon.jit
def _round_to_int8(x):
    return (x + 12582912.0).to(gl.int32, bitcast=True).to(gl.int8)


@gluon.jit
def _floor_to(x, BLOCK: gl.constexpr):
    return (gl.maximum(x, 0) // BLOCK) * BLOCK


@gluon.jit
def _ceil_to(x, BLOCK: gl.constexpr):
    return ((gl.maximum(x, 0) + BLOCK - 1) // BLOCK) * BLOCK


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
def _loader(q_desc, dot_desc, k_desc, q_smem, do_smem, k_smem, vec_smem, k_bar, ready, empty,
            QS, LSE, DOS, k_row, q_head0, do_head0, vec_head0, s_qh, s_doh, s_vech, n_q, group, seqlen_q,
            lo, hi):
    """One warp: the K tile once, then per query head of the group and query tile in ``[lo, hi)``: Q8,
    dO8^T and the per-query vectors (row 0 q_scale, 1 lse with +inf past the end, 2 dO scale)."""
    mbarrier.expect(k_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [k_row, 0], k_bar, k_smem.index(0))
    tma.async_copy_global_to_shared(k_desc, [k_row + HALF_N, 0], k_bar, k_smem.index(1))
    nbytes: gl.constexpr = q_desc.block_type.nbytes + dot_desc.block_type.nbytes
    vec_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    offs = gl.arange(0, BLOCK_M, layout=vec_layout)
    i = 0
    for g in range(group):
        for start_m in range(lo, hi, BLOCK_M):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(q_desc, [(q_head0 + g) * n_q + start_m, 0], ready.index(s),
                                            q_smem.index(s))
            tma.async_copy_global_to_shared(dot_desc, [(do_head0 + g) * dot_desc.block_type.shape[0], start_m],
                                            ready.index(s), do_smem.index(s))
            rows = start_m + offs
            ok = rows < seqlen_q
            base = vec_head0 + g * s_vech + rows
            vec_smem.index(3 * s).store(gl.load(QS + base, mask=ok, other=0.0))
            vec_smem.index(3 * s + 1).store(gl.load(LSE + base, mask=ok, other=float("inf")))
            vec_smem.index(3 * s + 2).store(gl.load(DOS + base, mask=ok, other=0.0))
            mbarrier.arrive(ready.index(s), count=1)     # the second of ready's two arrivals
            i += 1


@gluon.jit
def _dv_tiles(dv, it, k8, k_scale, k_bias, q_smem, do_smem, vec_smem, ready, empty, keys, lo, hi,
              seqlen_q, seqlen_k, window_left, window_right,
              MASKED: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
              s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Query tiles ``[lo, hi)`` of one head for one warpgroup's 64 keys: dV += P^T dO."""
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    offs_m = gl.arange(0, BLOCK_M, layout=col_layout)
    s_zero = gl.zeros([HALF_N, BLOCK_M], gl.int32, s_layout)
    o_zero = gl.zeros(dv.shape, gl.int32, o_layout)
    diag = seqlen_k - seqlen_q
    for start_m in range(lo, hi, BLOCK_M):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        st_tok = warpgroup_mma(k8, q_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        q_scale = vec_smem.index(3 * s).load(col_layout)
        lse = vec_smem.index(3 * s + 1).load(col_layout)
        do_scale = vec_smem.index(3 * s + 2).load(col_layout)
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
        # P^T with dO's per-token scale folded in, quantized per key over the tile (backward._quantize_rows)
        pd = pt * do_scale[None, :]
        p_max = gl.max(pd, 1)
        p8 = gl.convert_layout(_round_to_int8(pd * gl.where(p_max > 1e-30, 127.0 / p_max, 0.0)[:, None]),
                               p_layout)
        dv_tok = warpgroup_mma(p8, do_smem.index(s).permute((1, 0)), o_zero, use_acc=False, is_async=True)
        p_scale = gl.convert_layout(p_max * (1.0 / 127.0), gl.SliceLayout(1, o_layout))
        dv_int = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, ))
        mbarrier.arrive(empty.index(s), count=1)
        # float(dv_int) * p_scale by the forward's add trick (quantize.int32_times)
        dv = gl.fma((dv_int + 0x4B400000).to(gl.float32, bitcast=True), p_scale[:, None],
                    dv + (p_scale * -12582912.0)[:, None])
        it += 1
    return dv, it


@gluon.jit
def _dv_consumer(k8, first, q_smem, do_smem, vec_smem, k_bar, ready, empty, KS, DV, ks_off, dv_off, s_dvt,
                 seqlen_q, seqlen_k, window_left, window_right, group, lo, full_lo, full_hi, hi,
                 HEAD_DIM: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """One warpgroup: keys ``[first, first + 64)`` (their int8 K in ``k8``) against every query tile."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    keys = first + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    k_scale = gl.load(KS + ks_off + keys, mask=keys < seqlen_k, other=0.0)
    k_bias = k_scale * -12582912.0
    dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, o_layout)
    mbarrier.wait(k_bar, 0)
    it = lo * 0
    for g in range(group):
        dv, it = _dv_tiles(dv, it, k8, k_scale, k_bias, q_smem, do_smem, vec_smem, ready, empty, keys, lo, full_lo,
                           seqlen_q, seqlen_k, window_left, window_right, True, MASK_LEFT, MASK_RIGHT,
                           s_layout, o_layout, p_layout)
        dv, it = _dv_tiles(dv, it, k8, k_scale, k_bias, q_smem, do_smem, vec_smem, ready, empty, keys, full_lo,
                           full_hi, seqlen_q, seqlen_k, window_left, window_right, False, MASK_LEFT, MASK_RIGHT,
                           s_layout, o_layout, p_layout)
        dv, it = _dv_tiles(dv, it, k8, k_scale, k_bias, q_smem, do_smem, vec_smem, ready, empty, keys, full_hi, hi,
                           seqlen_q, seqlen_k, window_left, window_right, True, MASK_LEFT, MASK_RIGHT,
                           s_layout, o_layout, p_layout)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    keys_o = gl.convert_layout(keys, gl.SliceLayout(1, o_layout))
    ptrs = DV + dv_off + keys_o.to(gl.int64)[:, None] * s_dvt + offs_d[None, :]
    gl.store(ptrs, dv.to(DV.dtype.element_ty), mask=(keys_o < seqlen_k)[:, None])


@gluon.jit
def _attn_bwd_dv_hopper_kernel(
    q_desc, dot_desc, k_desc, QS, LSE, DOS, KS, DV,
    s_qsb, s_qsh, s_ksb, s_ksh, s_dvb, s_dvh, s_dvt,
    n_q, n_k, num_heads, num_kv_heads, group, window_left, window_right,
    MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, HEAD_DIM: gl.constexpr,
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
    # rows of the 2-D views the descriptors see: Q8 [B*H*Nq, D], dO8^T [B*H*D, Nq_pad], K8 [B*Hk*Nk, D]
    q_head0 = b * num_heads + hk * group
    k_row = (b * num_kv_heads + hk) * n_k + start_n

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dot_desc.dtype, [STAGES] + dot_desc.block_type.shape, dot_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    vec_smem = gl.allocate_shared_memory(gl.float32, [3 * STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(k_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=2)      # the TMA bytes and the per-query vectors
        mbarrier.init(empty.index(i), count=2)      # both consumers release a buffer

    vec_head0 = b.to(gl.int64) * s_qsb + (hk * group) * s_qsh
    ks_off = b.to(gl.int64) * s_ksb + hk * s_ksh
    dv_off = b.to(gl.int64) * s_dvb + hk.to(gl.int64) * s_dvh
    gl.warp_specialize([
        (_dv_consumer, (k_smem.index(0), start_n, q_smem, do_smem, vec_smem, k_bar, ready, empty, KS, DV, ks_off,
                        dv_off, s_dvt, seqlen_q, seqlen_k, window_left, window_right, group, lo, full_lo, full_hi,
                        hi, HEAD_DIM, MASK_LEFT, MASK_RIGHT)),
        (_dv_consumer, (k_smem.index(1), start_n + HALF_N, q_smem, do_smem, vec_smem, k_bar, ready, empty, KS,
                        DV, ks_off, dv_off, s_dvt, seqlen_q, seqlen_k, window_left, window_right, group, lo,
                        full_lo, full_hi, hi, HEAD_DIM, MASK_LEFT, MASK_RIGHT)),
        (_loader, (q_desc, dot_desc, k_desc, q_smem, do_smem, k_smem, vec_smem, k_bar, ready, empty,
                   QS, LSE, DOS, k_row, q_head0, q_head0, vec_head0, s_qsh, s_qsh, s_qsh, n_q, group, seqlen_q,
                   lo, hi)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def _int8_desc(x2d, block_shape):
    layout = gl.NVMMASharedLayout.get_default_for(block_shape, gl.int8)
    return TensorDescriptor(x2d, list(x2d.shape), list(x2d.stride()), block_shape, layout)


def dv_hopper_args(q8, q_scale, lse, do8t, do_scale, k8, k_scale, dv4, num_heads, group, head_dim, window,
                   consumer_regs=240, loader_regs=32):
    """(grid, args, kwargs) of the dV kernel: padded ``[B, H, N, D]`` tensors as ``backward.launch_backward``
    takes them (``q_scale`` with softmax scale and log2(e) folded in, ``do8t`` token-contiguous)."""
    import triton

    assert head_dim in (64, 128) and dv4.stride(3) == 1
    bsz, hq, n_q, d = q8.shape
    hk, n_k = k8.shape[1], k8.shape[2]
    for t in (q_scale, lse, do_scale):
        assert t.stride() == q_scale.stride(), "the per-query vectors share one layout"
    q_desc = _int8_desc(q8.reshape(-1, d), [BLOCK_M.value, d])
    dot_desc = _int8_desc(do8t.reshape(-1, do8t.shape[-1]), [d, BLOCK_M.value])
    k_desc = _int8_desc(k8.reshape(-1, d), [HALF_N.value, d])
    grid = (triton.cdiv(n_k, BLOCK_N.value), bsz * hk)
    return grid, (
        q_desc, dot_desc, k_desc, q_scale, lse, do_scale, k_scale, dv4,
        q_scale.stride(0), q_scale.stride(1), k_scale.stride(0), k_scale.stride(1), *dv4.stride()[:3],
        n_q, n_k, hq, hk, group, window[0], window[1],
    ), dict(MASK_LEFT=window[0] >= 0, MASK_RIGHT=window[1] >= 0, HEAD_DIM=head_dim,
            CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, num_warps=4)


def launch_dv_hopper(q8, q_scale, lse, do8t, do_scale, k8, k_scale, dv4, num_heads, group, head_dim, window,
                     **tuning):
    """dV (``dv4`` ``[B, Hk, N, D]``, any strides with a contiguous last dim) on the Gluon kernel."""
    grid, args, kwargs = dv_hopper_args(q8, q_scale, lse, do8t, do_scale, k8, k_scale, dv4, num_heads, group,
                                        head_dim, window, **tuning)
    return _attn_bwd_dv_hopper_kernel[grid](*args, **kwargs)
