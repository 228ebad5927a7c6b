"""The Hopper backward's dQ kernel (``_attn_bwd_dq_hopper_kernel``): one program per 128 queries of one (sequence,
head), walking the key tiles, as the forward does (backward_hopper.py's docstring says what it computes). What it
shares with the key-tile kernel is in backward_hopper_common.py.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from .backward_hopper_common import (HALF_N, STAGES, CallerRows, KeyScales, accumulate_product, no_tiles_unless,
                                     quantize_rows, sequence_bounds, store_rows)
from .hopper_common import (FLOAT_ROUND_BIAS, FLOAT_ROUND_BIAS_BITS, ItemMailbox, Scalar, Sequences, WorkItem,
                            aggregate, claim_item, free_phase, inside_sequences, key_band_mask, key_tiles, nan_max,
                            ring_phase, ring_slot, split_item, tanh_scores, tma_load, wgmma_layout)

BLOCK_M = gl.constexpr(128)   # queries per dQ program (two consumers); its key tile (the numerics): dq_key_tile


@aggregate
class DqDescriptors:
    """The TMA descriptors the dQ launch's loader reads: Q8 and dO (the item's own), K8 (S's operand), V (dP's) and
    K8^T (dQ's), and with ``QK_SPLIT`` Q8's, K8's and K8^T's channels past the first block (``q2``, ``k2``,
    ``kt2``)."""
    q: tma.tensor_descriptor
    do: tma.tensor_descriptor
    k: tma.tensor_descriptor
    v: tma.tensor_descriptor
    kt: tma.tensor_descriptor
    q2: tma.tensor_descriptor
    k2: tma.tensor_descriptor
    kt2: tma.tensor_descriptor


@aggregate
class ItemQueries:
    """A dQ work item's own tiles in shared memory, loaded once an item, both 64-query halves: Q8 (``q2``: the
    channels past the first block) and dO; ``ready`` once the loader's bytes landed, ``empty`` once both consumers
    are done with them."""
    q: gl.shared_memory_descriptor
    q2: gl.shared_memory_descriptor
    do: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor


@aggregate
class KeyRing:
    """The ``STAGES`` shared-memory buffers the dQ launch streams a key tile through: K8, V and K8^T (``k2`` /
    ``kt2``: the channels past the first block, else ``k`` / ``kt`` again), each stage ``ready`` once the loader's
    bytes landed, ``empty`` once both consumers are done with it."""
    k: gl.shared_memory_descriptor
    k2: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    kt: gl.shared_memory_descriptor
    kt2: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor


@aggregate
class DqRowInputs:
    """The per-query inputs [B, H, N] the dQ consumers read once an item: Q's scale (``QS``), lse, delta, the row
    shift under a cap (``SHIFT``) and the sinks' rowsum(dS) (``ROW_DS``), with their batch and head strides."""
    QS: gl.tensor
    LSE: gl.tensor
    DELTA: gl.tensor
    SHIFT: gl.tensor
    ROW_DS: gl.tensor
    s_qsb: Scalar
    s_qsh: Scalar


@aggregate
class DqOutput:
    """What the dQ launch writes: dQ [B, H, N, D] with its batch, head and token strides and the scale it is
    multiplied by (``out_scale``); and K's channel means ``KMEAN`` (head and batch strides) for ``ROW_TERM``."""
    DQ: gl.tensor
    s_dqb: Scalar
    s_dqh: Scalar
    s_dqt: Scalar
    out_scale: gl.tensor
    KMEAN: gl.tensor
    s_kmh: Scalar
    s_kmb: Scalar


@aggregate
class DqOptions:
    """The dQ launch's compile-time options (the module docstring says what each does); ``D1`` / ``D2``: Q's and K's
    two channel blocks (``QK_SPLIT``; else ``D2`` is ``D1``, unused)."""
    HEAD_DIM: gl.constexpr
    D1: gl.constexpr
    D2: gl.constexpr
    QK_SPLIT: gl.constexpr
    SOFTCAP: gl.constexpr
    ROW_TERM: gl.constexpr
    ROW_SUMS: gl.constexpr
    ORDER: gl.constexpr
    DYNAMIC: gl.constexpr


@aggregate
class QueryOperands:
    """Consumer's 64 queries of a dQ work item (``rows``) and what stays fixed over its key tiles: Q8 and dO as
    wgmma operands (``q8``, ``q8b`` past the first channel block, ``do16``), Q's scale (``q_scale``; with a cap
    ``cap_a`` and ``cap_b`` scale and shift the cap's argument), lse, delta, and where the item's K scales start
    (``KS + ks_off``)."""
    q8: gl.shared_memory_descriptor
    q8b: gl.shared_memory_descriptor
    do16: gl.shared_memory_descriptor
    rows: gl.tensor
    q_scale: gl.tensor
    cap_a: gl.tensor
    cap_b: gl.tensor
    lse: gl.tensor
    delta: gl.tensor
    KS: gl.tensor
    ks_off: gl.tensor


@gluon.jit
def _dq_item(seqs, t, BLOCK_K: gl.constexpr):
    """Work item ``t`` of the dQ launch: 128 queries of one (sequence, head), query tile fastest; with a causal
    mask the last query tiles, which see the most keys, come first (forward_hopper._work_item's order); its
    key-tile bounds: hopper_common.key_tiles (``t0``: K^T's column). An item past its sequence's queries (packed
    batches) runs no tiles."""
    pid_m, b, h = split_item(t, seqs.num_tiles, seqs.num_heads, seqs.MASK_RIGHT)
    bt, q0, k0, kt0, seqlen_q, seqlen_k = sequence_bounds(b, seqs)
    start_m = pid_m * BLOCK_M
    lo, full_lo, full_hi, hi = key_tiles(start_m, seqlen_q, seqlen_k, seqs.window_left, seqs.window_right,
                                          BLOCK_M, seqs.MASK_LEFT, seqs.MASK_RIGHT, BLOCK_K)
    if seqs.IS_VARLEN:
        lo, full_lo, full_hi, hi = no_tiles_unless(start_m < seqlen_q, lo, full_lo, full_hi, hi)
    return WorkItem(b, bt, h, h // seqs.group, start_m, q0, k0, kt0, seqlen_q, seqlen_k, lo, full_lo, full_hi, hi)


@gluon.jit
def _dq_loader(descs, own, ring, mailbox, COUNTER, seqs, caller, opts):
    """One warp, per work item (picked as the key-tile launches' loader picks them): posts it to the consumers,
    loads Q8 and dO (both halves) once they are done with the last item's; then per key tile of ``[lo, hi)``,
    through the ring whose count runs on across items: K8 (for S), V (for dP) and K8^T (dQ's B operand,
    token-contiguous as 8-bit wgmma wants it); ``QK_SPLIT``: Q8's, K8's and K8^T's channels past the first block
    as tiles of their own."""
    QK_SPLIT: gl.constexpr = opts.QK_SPLIT
    BLOCK_K: gl.constexpr = descs.k.block_type.shape[0]
    D1: gl.constexpr = descs.q.block_type.shape[1]
    q_bytes: gl.constexpr = (descs.q.block_type.nbytes + descs.do.block_type.nbytes
                             + (descs.q2.block_type.nbytes if QK_SPLIT else 0))
    nbytes: gl.constexpr = (descs.k.block_type.nbytes + descs.v.block_type.nbytes + descs.kt.block_type.nbytes
                            + (descs.k2.block_type.nbytes + descs.kt2.block_type.nbytes if QK_SPLIT else 0))
    i = seqs.num_items * 0
    j = seqs.num_items * 0
    t = gl.program_id(0) + j
    while t < seqs.num_items:
        item = _dq_item(seqs, t, BLOCK_K)
        bt = item.bt
        h = item.h
        hk = item.hk
        q0 = item.q0
        k0 = item.k0
        start_m = item.start
        # rows of the 2-D views the descriptors see: Q8 [B*H*Nq, D], K8 [B*Hk*Nk, D], K8^T [B*Hk*D, Nk_pad];
        # dO and V in the caller's memory (token_rows: row b*rb + h*rh + n, column h*ch)
        q_row = (bt * seqs.num_heads + h) * seqs.n_q + q0 + start_m
        k_row = (bt * seqs.num_kv_heads + hk) * seqs.n_k + k0
        kt_row = (bt * seqs.num_kv_heads + hk) * opts.HEAD_DIM
        do_row = bt * caller.do_rb + h * caller.do_rh + q0 + start_m
        v_row = bt * caller.v_rb + hk * caller.v_rh + k0
        mbarrier.wait(own.empty, free_phase(j, 1))   # a fresh barrier's previous phase counts as complete
        mailbox.post(t)
        mbarrier.expect(own.ready, 2 * q_bytes)
        for c in gl.static_range(2):
            tma_load(descs.q, [q_row + c * HALF_N, 0], own.ready, own.q.index(c))
            if QK_SPLIT:
                tma_load(descs.q2, [q_row + c * HALF_N, D1], own.ready, own.q2.index(c))
            tma_load(descs.do, [do_row + c * HALF_N, h * caller.do_ch], own.ready, own.do.index(c))
        for start_n in range(item.lo, item.hi, BLOCK_K):
            s = ring_slot(i, STAGES)
            mbarrier.wait(ring.empty.index(s), free_phase(i, STAGES))
            mbarrier.expect(ring.ready.index(s), nbytes)
            tma_load(descs.k, [k_row + start_n, 0], ring.ready.index(s), ring.k.index(s))
            tma_load(descs.v, [v_row + start_n, hk * caller.v_ch], ring.ready.index(s), ring.v.index(s))
            tma_load(descs.kt, [kt_row, item.t0 + start_n], ring.ready.index(s), ring.kt.index(s))
            if QK_SPLIT:
                tma_load(descs.k2, [k_row + start_n, D1], ring.ready.index(s), ring.k2.index(s))
                tma_load(descs.kt2, [kt_row + D1, item.t0 + start_n], ring.ready.index(s), ring.kt2.index(s))
            i += 1
        j += 1
        t = claim_item(t, COUNTER, opts.DYNAMIC)
    mbarrier.wait(own.empty, free_phase(j, 1))   # the consumers read the last item's index: the end may be posted
    mailbox.post(t)


@gluon.jit
def _quantized_product(acc, acc2, x, x_max, factor, b_smem, b2_smem, empty_bar, SPLIT: gl.constexpr,
                       ORDER: gl.constexpr, p_layout: gl.constexpr, o_layout: gl.constexpr):
    """``acc += factor * (x @ B)`` with ``x`` quantized per row, then ``B``'s ring stage released (``empty_bar``).
    ``SPLIT``: B's columns past the first block in ``b2_smem``, their product in ``acc2``."""
    x8, x_scale = quantize_rows(x, x_max, ORDER, p_layout, o_layout)
    acc = accumulate_product(acc, x8, x_scale * factor, b_smem)
    if SPLIT:
        acc2 = accumulate_product(acc2, x8, x_scale * factor, b2_smem)
    mbarrier.arrive(empty_bar, count=1)
    return acc, acc2


@gluon.jit
def _dq_tiles(acc, acc2, row_ds, it, ks, query_ops, ring, lo, hi, item, seqs, softcap2, MASKED: gl.constexpr, opts):
    """Key tiles ``[lo, hi)`` for one warpgroup's 64 queries: ``dQ += dS K`` (backward._dq_tile's numerics;
    ``QK_SPLIT``: K's channels past the first block into ``acc2``); with ``ROW_SUMS`` also
    ``row_ds += rowsum(dS)``. ``ks``: this tile's K scale, read a tile ahead (one per K_SCALE_BLOCK keys: a 64-key tile
    reads its block's)."""
    MASK_LEFT: gl.constexpr = seqs.MASK_LEFT
    MASK_RIGHT: gl.constexpr = seqs.MASK_RIGHT
    IS_VARLEN: gl.constexpr = seqs.IS_VARLEN
    SOFTCAP: gl.constexpr = opts.SOFTCAP
    BLOCK_K: gl.constexpr = ring.k.shape[1]
    s_layout: gl.constexpr = wgmma_layout(BLOCK_K, 32)
    dp_layout: gl.constexpr = wgmma_layout(BLOCK_K, 16)
    o_layout: gl.constexpr = wgmma_layout(opts.D1, 32)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    KS = query_ops.KS
    ks_off = query_ops.ks_off
    rows = query_ops.rows
    seqlen_k = item.seqlen_k
    offs_n = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([HALF_N, BLOCK_K], gl.int32, s_layout)
    dp_zero = gl.zeros([HALF_N, BLOCK_K], gl.float32, dp_layout)
    diag = seqlen_k - item.seqlen_q
    BAND: gl.constexpr = MASKED and (MASK_LEFT or MASK_RIGHT)
    # band-masked and packed loops: 32-bit key indices (forward_hopper._consume; packed masked loops took 1,043
    # instructions a tile at D=128 without, 911 padded)
    KS_PTR: gl.constexpr = BAND or IS_VARLEN
    ks_ptr = KS + ks_off + lo + BLOCK_K
    for start_n in range(lo, hi, BLOCK_K):
        s = ring_slot(it, STAGES)
        mbarrier.wait(ring.ready.index(s), ring_phase(it, STAGES))
        s_tok = warpgroup_mma(query_ops.q8, ring.k.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if opts.QK_SPLIT:    # the channels past the first block, into the same int32 scores
            s_tok = warpgroup_mma(query_ops.q8b, ring.k2.index(s).permute((1, 0)), s_tok, is_async=True)
        # dP = dO V^T in the input dtype (quantizing it would feed error into dS), beside S
        dp_tok = warpgroup_mma(query_ops.do16, ring.v.index(s).permute((1, 0)), dp_zero, use_acc=False,
                               is_async=True)
        if KS_PTR:
            ks_next = gl.load(ks_ptr, mask=start_n + BLOCK_K < seqlen_k, other=0.0)
            ks_ptr += BLOCK_K
        else:
            ks_next = gl.load(KS + ks_off + start_n + BLOCK_K, mask=start_n + BLOCK_K < seqlen_k, other=0.0)
        s_int, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, dp_tok))
        # x = 1.5 * 2^23 + S_int read as a float (quantize.int32_times); the tile's one K scale joins each row's
        # constants (per-key scales cost an FMA a score and 64 registers, which spilled at D=128)
        t = (s_int + FLOAT_ROUND_BIAS_BITS).to(gl.float32, bitcast=True)
        if SOFTCAP:   # capped scores as in the forward; tanh kept for the cap's derivative in dS
            t_mul = query_ops.cap_a * ks
            th = tanh_scores(gl.fma(t, t_mul[:, None], (query_ops.cap_b - t_mul * FLOAT_ROUND_BIAS)[:, None]))
            p = gl.exp2(gl.fma(th, softcap2, -query_ops.lse[:, None]))
        else:   # lse is +inf past the end: 0
            row_mul = query_ops.q_scale * ks
            p = gl.exp2(gl.fma(t, row_mul[:, None], (row_mul * -FLOAT_ROUND_BIAS - query_ops.lse)[:, None]))
        if BAND or (MASKED and IS_VARLEN):
            p = gl.where(key_band_mask(offs_n, rows, start_n, seqlen_k, diag, seqs.window_left, seqs.window_right,
                                         MASK_LEFT, MASK_RIGHT), p, 0.0)
        elif MASKED:
            p = gl.where(inside_sequences(rows[:, None], (start_n + offs_n)[None, :], item.seqlen_q, seqlen_k), p,
                         0.0)
        # dS, one scale per query over the tile (signed), times the tile's K scale
        x = p * (gl.convert_layout(dp, s_layout) - query_ops.delta[:, None])
        if SOFTCAP:   # dS with respect to the uncapped score
            x = x * (1.0 - th * th)
        if opts.ROW_SUMS:   # (no key past the end here: P is masked to 0 or the tile is inside the sequence)
            row_ds += gl.sum(x, 1)
        x_max = nan_max(gl.abs(x), 1)
        acc, acc2 = _quantized_product(acc, acc2, x, x_max, ks, ring.kt.index(s), ring.kt2.index(s),
                                       ring.empty.index(s), opts.QK_SPLIT, opts.ORDER, p_layout, o_layout)
        it += 1
        ks = ks_next
    return acc, acc2, row_ds, it, ks


@gluon.jit
def _add_row_term(acc, row_ds, KMEAN, COL0: gl.constexpr):
    """``acc + row_ds[:, None] * KMEAN[COL0 : COL0 + width]``, in ``acc``'s layout."""
    o_layout: gl.constexpr = acc.type.layout
    k_mean = gl.load(KMEAN + COL0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, o_layout)))
    return gl.fma(gl.convert_layout(row_ds, gl.SliceLayout(1, o_layout))[:, None], k_mean[None, :], acc)


@gluon.jit
def _dq_consumer(C: gl.constexpr, q8, q8b, do16, own, ring, mailbox, seqs, row_inputs, key_scales, out, softcap2,
                 opts):
    """One warpgroup, per work item the loader posts: queries ``[start_m + C * 64, ... + 64)`` against every key
    tile; writes their dQ rows (Q and dO released first, so the loader brings the next item's meanwhile)."""
    D1: gl.constexpr = opts.D1
    D2: gl.constexpr = opts.D2
    QK_SPLIT: gl.constexpr = opts.QK_SPLIT
    SOFTCAP: gl.constexpr = opts.SOFTCAP
    BLOCK_K: gl.constexpr = ring.k.shape[1]
    s_layout: gl.constexpr = wgmma_layout(BLOCK_K, 32)
    o_layout: gl.constexpr = wgmma_layout(D1, 32)
    o2_layout: gl.constexpr = wgmma_layout(D2, 32)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    num_items = seqs.num_items
    KS = key_scales.KS
    it = num_items * 0      # the ring's tile count, run on across items as the loader's
    j = num_items * 0
    t = mailbox.next(j)
    while t < num_items:
        item = _dq_item(seqs, t, BLOCK_K)
        bt = item.bt
        h = item.h
        hk = item.hk
        q0 = item.q0
        seqlen_q = item.seqlen_q
        lo = item.lo
        hi = item.hi
        vec_off = bt.to(gl.int64) * row_inputs.s_qsb + h * row_inputs.s_qsh + q0
        ks_off = bt.to(gl.int64) * key_scales.s_ksb + hk * key_scales.s_ksh + item.k0
        rows = item.start + C * HALF_N + gl.arange(0, HALF_N, layout=row_layout)
        m_ok = rows < seqlen_q
        q_scale = gl.load(row_inputs.QS + vec_off + rows, mask=m_ok, other=0.0)
        lse = gl.load(row_inputs.LSE + vec_off + rows, mask=m_ok, other=float("inf"))
        delta = gl.load(row_inputs.DELTA + vec_off + rows, mask=m_ok, other=0.0)
        cap_a = q_scale     # unused unless SOFTCAP
        cap_b = q_scale
        if SOFTCAP:
            inv_cap = 1.0 / softcap2
            cap_a = q_scale * inv_cap
            cap_b = gl.load(row_inputs.SHIFT + vec_off + rows, mask=m_ok, other=0.0) * inv_cap
        row_ds = gl.zeros([HALF_N], gl.float32, row_layout)
        acc = gl.zeros([HALF_N, D1], gl.float32, o_layout)
        acc2 = gl.zeros([HALF_N, D2], gl.float32, o2_layout)
        ks = gl.load(KS + ks_off + lo, mask=lo < hi, other=0.0)
        mbarrier.wait(own.ready, ring_phase(j, 1))
        query_ops = QueryOperands(q8, q8b, do16, rows, q_scale, cap_a, cap_b, lse, delta, KS, ks_off)
        acc, acc2, row_ds, it, ks = _dq_tiles(acc, acc2, row_ds, it, ks, query_ops, ring, lo, item.full_lo, item,
                                              seqs, softcap2, True, opts)
        acc, acc2, row_ds, it, ks = _dq_tiles(acc, acc2, row_ds, it, ks, query_ops, ring, item.full_lo,
                                              item.full_hi, item, seqs, softcap2, False, opts)
        acc, acc2, row_ds, it, ks = _dq_tiles(acc, acc2, row_ds, it, ks, query_ops, ring, item.full_hi, hi, item,
                                              seqs, softcap2, True, opts)
        mbarrier.arrive(own.empty, count=1)     # every product with this item's Q and dO was waited for
        if opts.ROW_TERM:   # dQ += rowsum(dS) mean(k): the kernel's own row sums (ROW_SUMS), else the sinks' (given)
            if not opts.ROW_SUMS:
                row_ds = gl.load(row_inputs.ROW_DS + vec_off + rows, mask=m_ok, other=0.0)
            km_off = hk * out.s_kmh + item.b * out.s_kmb
            acc = _add_row_term(acc, row_ds, out.KMEAN + km_off, 0)
            if QK_SPLIT:
                acc2 = _add_row_term(acc2, row_ds, out.KMEAN + km_off, D1)
        dq_off = bt.to(gl.int64) * out.s_dqb + h.to(gl.int64) * out.s_dqh + q0.to(gl.int64) * out.s_dqt
        store_rows(acc, rows, seqlen_q, out.DQ, dq_off, out.s_dqt, out.out_scale, 0)
        if QK_SPLIT:
            store_rows(acc2, rows, seqlen_q, out.DQ, dq_off, out.s_dqt, out.out_scale, D1)
        j += 1
        t = mailbox.next(j)


@gluon.jit
def _attn_bwd_dq_hopper_kernel(
    q_desc, do_desc, k_desc, v_desc, kt_desc, q2_desc, k2_desc, kt2_desc, QS, LSE, DELTA, SHIFT, ROW_DS, KMEAN, KS,
    DQ, COUNTER, CU_Q, CU_K, CU_KT, s_qsb, s_qsh, s_ksb, s_ksh, s_kmh, s_kmb, s_dqb, s_dqh, s_dqt, do_rb, do_rh, do_ch,
    v_rb, v_rh, v_ch, n_q, n_k, num_heads, num_kv_heads, group, window_left, window_right, out_scale, softcap2,
    num_items, num_m, IS_VARLEN: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
    HEAD_DIM: gl.constexpr, QK_SPLIT: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, SOFTCAP: gl.constexpr, ROW_TERM: gl.constexpr,
    ROW_SUMS: gl.constexpr, DYNAMIC: gl.constexpr, ORDER: gl.constexpr,
):
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    kt_smem = gl.allocate_shared_memory(kt_desc.dtype, [STAGES] + kt_desc.block_type.shape, kt_desc.layout)
    if QK_SPLIT:
        q2_smem = gl.allocate_shared_memory(q2_desc.dtype, [2] + q2_desc.block_type.shape, q2_desc.layout)
        k2_smem = gl.allocate_shared_memory(k2_desc.dtype, [STAGES] + k2_desc.block_type.shape, k2_desc.layout)
        kt2_smem = gl.allocate_shared_memory(kt2_desc.dtype, [STAGES] + kt2_desc.block_type.shape, kt2_desc.layout)
    else:   # unused: buffers that exist stand in
        q2_smem = q_smem
        k2_smem = k_smem
        kt2_smem = kt_smem
    D1: gl.constexpr = q_desc.block_type.shape[1]
    D2: gl.constexpr = q2_desc.block_type.shape[1] if QK_SPLIT else D1    # (unused without the split)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    item_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    item_smem = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)     # the TMA bytes
    mbarrier.init(q_empty, count=2)     # both consumers release Q and dO
    mbarrier.init(item_bar, count=1)    # the loader posted the next item in item_smem
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)      # the TMA bytes
        mbarrier.init(empty.index(i), count=2)      # both consumers release a buffer

    descs = DqDescriptors(q_desc, do_desc, k_desc, v_desc, kt_desc, q2_desc, k2_desc, kt2_desc)
    own = ItemQueries(q_smem, q2_smem, do_smem, q_ready, q_empty)
    ring = KeyRing(k_smem, k2_smem, v_smem, kt_smem, kt2_smem, ready, empty)
    mailbox = ItemMailbox(item_smem, item_bar)
    seqs = Sequences(CU_Q, CU_K, CU_KT, n_q, n_k, num_heads, num_kv_heads, group, window_left, window_right,
                     num_items, num_m, IS_VARLEN, MASK_LEFT, MASK_RIGHT)
    row_inputs = DqRowInputs(QS, LSE, DELTA, SHIFT, ROW_DS, s_qsb, s_qsh)
    key_scales = KeyScales(KS, s_ksb, s_ksh)
    out = DqOutput(DQ, s_dqb, s_dqh, s_dqt, out_scale, KMEAN, s_kmh, s_kmb)
    opts = DqOptions(HEAD_DIM, D1, D2, QK_SPLIT, SOFTCAP, ROW_TERM, ROW_SUMS, ORDER, DYNAMIC)
    gl.warp_specialize([
        (_dq_consumer, (0, q_smem.index(0), q2_smem.index(0), do_smem.index(0), own, ring, mailbox, seqs, row_inputs,
                        key_scales, out, softcap2, opts)),
        (_dq_consumer, (1, q_smem.index(1), q2_smem.index(1), do_smem.index(1), own, ring, mailbox, seqs, row_inputs,
                        key_scales, out, softcap2, opts)),
        (_dq_loader, (descs, own, ring, mailbox, COUNTER, seqs, CallerRows(do_rb, do_rh, do_ch, v_rb, v_rh, v_ch),
                      opts)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
