"""The Hopper backward's key-tile kernel (``_attn_bwd_dkdv_hopper_kernel``): dV, dK, or with ``DO_DQ`` all three
gradients in one launch, dQ added up by TMA reduce-adds (backward_hopper.py's docstring says what each computes
and how the work is scheduled). What it shares with the dQ kernel is in backward_hopper_common.py.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .backward_hopper_common import (HALF_N, STAGES, CallerRows, KeyScales, accumulate_in_place, accumulate_product,
                                     no_tiles_unless, product_in_place, quantize_rows, running_scale, sequence_bounds,
                                     store_rows)
from .hopper_common import (E4M3_MAX, FLOAT_ROUND_BIAS, FLOAT_ROUND_BIAS_BITS, LOG2_448, TINY_SCALE, ItemMailbox,
                            Scalar, Sequences, WorkItem, aggregate, as_operand, ceil_to, claim_item, floor_to,
                            free_phase, inside_sequences, named_barrier, nan_max, ring_phase, ring_slot, split_item,
                            tanh_scores, tma_atomic_add, tma_load, wgmma_layout)

BLOCK_N = gl.constexpr(128)   # keys per program: two consumers
# per-query vectors the loader stages beside each query tile: one row each of vec_smem per stage
# (the rows a launch uses come first: ``KeyTileOptions.NVEC`` rows a stage, dO's scales and the shift only where read)
VQS, VLSE, VDELTA, VQSR, VDOS, VSHIFT = (gl.constexpr(i) for i in range(6))
# Hardware barrier ids of the one launch (Gluon's own take ids 0-4): consumer C's K operand for dQ is stored
# (_k_operand) on 9 + C; consumer C announces its dS^T tile of parity p on 11 + 2C + p (_dq_signal)
K_OPERAND_BARRIER = gl.constexpr(9)
DQ_SIGNALS = gl.constexpr(11)


@aggregate
class KeyTileDescriptors:
    """The TMA descriptors the key-tile launches' loader reads: Q8 (S^T's operand), Q8^T (dK's), dO (dP^T's),
    dO8^T (dV's), K8 and V (the item's own), and with ``QK_SPLIT`` Q8's, Q8^T's and K8's channels past the first
    block as descriptors of their own (``q2``, ``qt2``, ``k2``)."""
    q: tma.tensor_descriptor
    qt: tma.tensor_descriptor
    do: tma.tensor_descriptor
    dot: tma.tensor_descriptor
    k: tma.tensor_descriptor
    v: tma.tensor_descriptor
    q2: tma.tensor_descriptor
    qt2: tma.tensor_descriptor
    k2: tma.tensor_descriptor


@aggregate
class QueryRing:
    """The ``STAGES`` shared-memory buffers the key-tile launches stream a query tile through: Q8, Q8^T, dO, dO8^T
    (``q2`` / ``qt2``: the channels past the first block; a buffer a launch does not need is another one standing
    in), and the per-query vectors (``vec``: ``KeyTileOptions.NVEC`` rows a stage); each stage ``ready`` once the
    loader's bytes and vectors landed, ``empty`` once both consumers are done with it."""
    q: gl.shared_memory_descriptor
    q2: gl.shared_memory_descriptor
    qt: gl.shared_memory_descriptor
    qt2: gl.shared_memory_descriptor
    do: gl.shared_memory_descriptor
    dot: gl.shared_memory_descriptor
    vec: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor


@aggregate
class ItemKV:
    """A key-tile work item's own tiles in shared memory, loaded once an item, both 64-key halves: K8 (``k2``: the
    channels past the first block) and V (dK's dP^T); ``ready`` once the loader's bytes landed, ``empty`` once both
    consumers are done with them."""
    k: gl.shared_memory_descriptor
    k2: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor


@aggregate
class QueryVectors:
    """The per-query inputs [B, H, N] the key-tile launches' loader stages beside each query tile: Q's scale
    (``QS``), lse, dO's scale (``DOS``), delta, Q's raw scale (``QSR``), the row shift under a cap (``SHIFT``),
    their batch and head strides, and ``1 / cap`` (``inv_cap``). With ``P_STATIC`` ``DOS`` holds dO's scales per
    channel per query tile instead, ``[S, H, tiles, Dv]`` with sequence and head strides ``s_dtb``, ``s_dth``
    (else None). With ``DP_INT8``: dO's INT8 scales per token ``DPS`` (Q's strides) and V's INT8 scales ``VS``
    [B, Hk, N] (K's strides, one a key block), which the loader folds into dP^T's per-query vectors.
    """
    QS: gl.tensor
    LSE: gl.tensor
    DOS: gl.tensor
    DELTA: gl.tensor
    QSR: gl.tensor
    SHIFT: gl.tensor
    s_qsb: Scalar
    s_qsh: Scalar
    inv_cap: gl.tensor
    s_dtb: Scalar
    s_dth: Scalar
    DPS: gl.tensor
    VS: gl.tensor


@aggregate
class KeyGradients:
    """What the key-tile launches write: dV and dK [B, Hk, N, D] with their batch, head and token strides, and the
    softmax scale dK is multiplied by; with ``P_STATIC`` and ``IN_PLACE`` dO's channel maxima of each sequence and KV
    group ``DOS`` [S, H, Dv] (read at the group's first head) with sequence and head strides, which dV's columns take
    at the end; with ``DS_BOUND`` the channel maxima of Q times its rows' bounds ``QRS`` (DOS's layout), which dK's
    columns take at the end."""
    DV: gl.tensor
    s_dvb: Scalar
    s_dvh: Scalar
    s_dvt: Scalar
    DK: gl.tensor
    s_dkb: Scalar
    s_dkh: Scalar
    s_dkt: Scalar
    softmax_scale: gl.tensor
    DOS: gl.tensor
    s_dtb: Scalar
    s_dth: Scalar
    QRS: gl.tensor


@aggregate
class DqExchange:
    """The one launch's dQ (``DO_DQ``; otherwise buffers that exist stand in): the consumers' dS^T tiles (``ds``,
    two per consumer), dQ's B operand (``kb``: K as bf16 integers, by 64 keys and half the channels), the fp32
    buffers of the reduce-adds (``dq``) and the accumulator's descriptor (``desc``)."""
    ds: gl.shared_memory_descriptor
    kb: gl.shared_memory_descriptor
    dq: gl.shared_memory_descriptor
    desc: tma.tensor_descriptor


@aggregate
class KeyTileOptions:
    """The key-tile launches' compile-time options (the module docstring says what each does); ``D1`` / ``D2``:
    Q's and K's two channel blocks (``QK_SPLIT``; else ``D2`` is ``D1``, unused)."""
    HEAD_DIM: gl.constexpr
    HEAD_DIM_V: gl.constexpr
    D1: gl.constexpr
    D2: gl.constexpr
    QK_SPLIT: gl.constexpr
    DO_DK: gl.constexpr
    DO_DV: gl.constexpr
    DO_DQ: gl.constexpr
    FOLD: gl.constexpr
    SOFTCAP: gl.constexpr
    BLOCK_Q: gl.constexpr
    ORDER: gl.constexpr
    TILE_KS: gl.constexpr
    DYNAMIC: gl.constexpr
    PV_E4M3: gl.constexpr
    P_STATIC: gl.constexpr
    DK_E4M3: gl.constexpr
    IN_PLACE: gl.constexpr
    NVEC: gl.constexpr
    ASYNC: gl.constexpr
    DP_INT8: gl.constexpr
    DS_BOUND: gl.constexpr


@aggregate
class KeyOperands:
    """Consumer ``C``'s 64 keys of a work item (``keys``): their int8 K as wgmma operands (``k8``, and ``k8b``
    past the first channel block), V (``v16``: the input dtype, INT8 with ``DP_INT8``), and their K scales with the
    add trick's offset (``k_scale``, ``k_bias``)."""
    k8: gl.shared_memory_descriptor
    k8b: gl.shared_memory_descriptor
    v16: gl.shared_memory_descriptor
    k_scale: gl.tensor
    k_bias: gl.tensor
    keys: gl.tensor
    C: gl.constexpr


@gluon.jit
def _query_tiles(start_n, seqlen_q, seqlen_k, window_left, window_right,
                 MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, BLOCK_Q: gl.constexpr):
    """backward._query_tiles (a Gluon kernel cannot call @triton.jit functions): query tiles that see the key
    tile at ``start_n``; ``[lo, full_lo)`` and ``[full_hi, hi)`` need the mask."""
    diag = seqlen_k - seqlen_q
    lo = seqlen_q * 0
    full_lo = lo
    hi = seqlen_q
    full_hi = ceil_to(seqlen_q, BLOCK_Q)
    if MASK_RIGHT:
        lo = floor_to(start_n - diag - window_right, BLOCK_Q)
        full_lo = ceil_to(start_n + BLOCK_N - 1 - diag - window_right, BLOCK_Q)
    if MASK_LEFT:
        hi = gl.minimum(hi, start_n + BLOCK_N - diag + window_left)
        full_hi = gl.minimum(full_hi, floor_to(start_n - diag + window_left + 1, BLOCK_Q))
    hi = ceil_to(hi, BLOCK_Q)
    lo = gl.minimum(lo, hi)
    full_lo = gl.minimum(gl.maximum(full_lo, lo), hi)
    full_hi = gl.minimum(gl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@gluon.jit
def _dkdv_item(seqs, t, BLOCK_Q: gl.constexpr):
    """Work item ``t`` of the key-tile launches: 128 keys of one (sequence, KV head), key tile fastest (with a
    causal mask the first key tiles, which the most queries see, come first: the longest items start early); its
    query-tile bounds: _query_tiles (``h`` is the KV head too; ``t0``: Q^T's and dO^T's column). An item past its
    sequence's keys (packed batches) runs no tiles."""
    pid_n, b, hk = split_item(t, seqs.num_tiles, seqs.num_kv_heads, False)
    bt, q0, k0, qt0, seqlen_q, seqlen_k = sequence_bounds(b, seqs)
    start_n = pid_n * BLOCK_N
    lo, full_lo, full_hi, hi = _query_tiles(start_n, seqlen_q, seqlen_k, seqs.window_left, seqs.window_right,
                                            seqs.MASK_LEFT, seqs.MASK_RIGHT, BLOCK_Q)
    if seqs.IS_VARLEN:
        lo, full_lo, full_hi, hi = no_tiles_unless(start_n < seqlen_k, lo, full_lo, full_hi, hi)
    return WorkItem(b, bt, hk, hk, start_n, q0, k0, qt0, seqlen_q, seqlen_k, lo, full_lo, full_hi, hi)


@gluon.jit
def _loader(descs, ring, own, mailbox, COUNTER, seqs, vectors, key_scales, caller, opts):
    """One warp, per work item (its program id first, then the next from ``COUNTER``, an atomic count of items
    handed out, with ``DYNAMIC``; else every ``num_programs``-th): posts the item to the consumers, loads K (and
    V for dK) once they are done with the last item's; then per query head of the group and query tile in
    ``[lo, hi)``, through the ring whose count runs on across items: Q8
    (for S^T), dO8^T (dV's operand), dO (dK's dP^T) and Q8^T (dK's operand), with the per-query vectors
    (q_scale, lse (+inf past the end), and dO's scale, delta, the raw Q scale as the products need them; with
    ``SOFTCAP`` q_scale and the row shift over the cap). ``QK_SPLIT``: Q's and K's channels past the first
    block (``D1``) as tiles of their own (Q8, K8 and Q8^T alike; hopper_launch.qk_blocks). ``TILE_KS``: the
    item's one K scale folded into those vectors (_key_tiles_bwd)."""
    QK_SPLIT: gl.constexpr = opts.QK_SPLIT
    DO_DK: gl.constexpr = opts.DO_DK
    DO_DV: gl.constexpr = opts.DO_DV
    FOLD: gl.constexpr = opts.FOLD
    SOFTCAP: gl.constexpr = opts.SOFTCAP
    TILE_KS: gl.constexpr = opts.TILE_KS
    BLOCK_Q: gl.constexpr = opts.BLOCK_Q
    D1: gl.constexpr = descs.q.block_type.shape[1]
    k_bytes: gl.constexpr = descs.k.block_type.nbytes + (descs.k2.block_type.nbytes if QK_SPLIT else 0)
    kv_bytes: gl.constexpr = k_bytes + (descs.v.block_type.nbytes if DO_DK else 0)
    q_bytes: gl.constexpr = descs.q.block_type.nbytes + (descs.q2.block_type.nbytes if QK_SPLIT else 0)
    qt_bytes: gl.constexpr = descs.qt.block_type.nbytes + (descs.qt2.block_type.nbytes if QK_SPLIT else 0)
    nbytes: gl.constexpr = (q_bytes + (descs.dot.block_type.nbytes if DO_DV else 0)
                            + (descs.do.block_type.nbytes + qt_bytes if DO_DK else 0))
    vec_layout: gl.constexpr = gl.BlockedLayout([BLOCK_Q // 32], [32], [1], [0])
    offs = gl.arange(0, BLOCK_Q, layout=vec_layout)
    i = seqs.num_items * 0
    j = seqs.num_items * 0
    t = gl.program_id(0) + j
    while t < seqs.num_items:
        item = _dkdv_item(seqs, t, BLOCK_Q)
        bt = item.bt
        hk = item.hk
        q0 = item.q0
        k0 = item.k0
        start_n = item.start
        # rows of the 2-D views the descriptors see: Q8 [B*H*Nq, D], Q8^T [B*H*D, Nq_pad], dO8^T [B*H*Dv, Nq_pad],
        # K8 [B*Hk*Nk, D]; dO and V in the caller's memory (token_rows: row b*rb + h*rh + n, column h*ch)
        q_head0 = bt * seqs.num_heads + hk * seqs.group
        k_row = (bt * seqs.num_kv_heads + hk) * seqs.n_k + k0 + start_n
        do_row0 = bt * caller.do_rb + (hk * seqs.group) * caller.do_rh + q0
        do_col0 = (hk * seqs.group) * caller.do_ch
        v_row = bt * caller.v_rb + hk * caller.v_rh + k0 + start_n
        v_col = hk * caller.v_ch
        vec_head0 = bt.to(gl.int64) * vectors.s_qsb + (hk * seqs.group) * vectors.s_qsh + q0
        if TILE_KS:   # the item's keys share one K scale (quantize.K_SCALE_BLOCK keys from the sequence's start)
            k_scale = gl.load(key_scales.KS + bt.to(gl.int64) * key_scales.s_ksb + hk * key_scales.s_ksh + k0
                              + start_n, mask=start_n < item.seqlen_k, other=0.0)
        if opts.DP_INT8:   # and one V scale (V's INT8 blocks are K's), times the 1 / 448 dS^T's math takes
            v_scale = gl.load(vectors.VS + bt.to(gl.int64) * key_scales.s_ksb + hk * key_scales.s_ksh + k0
                              + start_n, mask=start_n < item.seqlen_k, other=0.0) * (1.0 / E4M3_MAX)
        mbarrier.wait(own.empty, free_phase(j, 1))   # a fresh barrier's previous phase counts as complete
        mailbox.post(t)
        mbarrier.expect(own.ready, 2 * kv_bytes)
        for c in gl.static_range(2):
            tma_load(descs.k, [k_row + c * HALF_N, 0], own.ready, own.k.index(c))
            if QK_SPLIT:
                tma_load(descs.k2, [k_row + c * HALF_N, D1], own.ready, own.k2.index(c))
            if DO_DK:
                tma_load(descs.v, [v_row + c * HALF_N, v_col], own.ready, own.v.index(c))
        for g in range(seqs.group):
            for start_m in range(item.lo, item.hi, BLOCK_Q):
                s = ring_slot(i, STAGES)
                mbarrier.wait(ring.empty.index(s), free_phase(i, STAGES))
                mbarrier.expect(ring.ready.index(s), nbytes)
                q_row = (q_head0 + g) * seqs.n_q + q0 + start_m
                t_row = (q_head0 + g) * opts.HEAD_DIM    # Q8^T's rows: [B*H*D, Nq_pad]; dO8^T's: [B*H*Dv, Nq_pad]
                tma_load(descs.q, [q_row, 0], ring.ready.index(s), ring.q.index(s))
                if QK_SPLIT:
                    tma_load(descs.q2, [q_row, D1], ring.ready.index(s), ring.q2.index(s))
                if DO_DV:
                    tma_load(descs.dot, [(q_head0 + g) * opts.HEAD_DIM_V, item.t0 + start_m], ring.ready.index(s),
                             ring.dot.index(s))
                if DO_DK:
                    tma_load(descs.do, [do_row0 + g * caller.do_rh + start_m, do_col0 + g * caller.do_ch],
                             ring.ready.index(s), ring.do.index(s))
                    tma_load(descs.qt, [t_row, item.t0 + start_m], ring.ready.index(s), ring.qt.index(s))
                    if QK_SPLIT:
                        tma_load(descs.qt2, [t_row + D1, item.t0 + start_m], ring.ready.index(s), ring.qt2.index(s))
                rows = start_m + offs
                ok = rows < item.seqlen_q
                base = vec_head0 + g * vectors.s_qsh + rows
                q_scale = gl.load(vectors.QS + base, mask=ok, other=0.0)
                if SOFTCAP:   # the cap's argument: (s + shift) / cap, both terms over the cap
                    q_scale = q_scale * vectors.inv_cap
                    shift = gl.load(vectors.SHIFT + base, mask=ok, other=0.0) * vectors.inv_cap
                if TILE_KS:
                    q_scale = q_scale * k_scale
                if SOFTCAP:
                    if TILE_KS:   # the add trick's offset joins the shift: the cap's argument is one FMA
                        shift = gl.fma(q_scale, -FLOAT_ROUND_BIAS, shift)
                    ring.vec.index(opts.NVEC * s + VSHIFT).store(shift)
                ring.vec.index(opts.NVEC * s + VQS).store(q_scale)
                lse = gl.load(vectors.LSE + base, mask=ok, other=float("inf"))
                if DO_DV and opts.P_STATIC and opts.IN_PLACE:   # (dO's channel scales: the consumers' epilogue)
                    if FOLD or opts.ASYNC:
                        lse = lse - LOG2_448
                elif DO_DV and opts.P_STATIC:
                    # dO's scales per channel of this query tile (the row's first HEAD_DIM_V entries), with P^T's
                    # fixed 1/448; P^T = 448 p needs no per-query factor (FOLD: 448 into its exponent)
                    # (32-bit offsets: the scales number dO's elements / BLOCK_Q)
                    tile_row = (item.b * vectors.s_dtb + (hk * seqs.group + g) * vectors.s_dth
                                + (start_m // BLOCK_Q) * opts.HEAD_DIM_V)
                    tile_scales = gl.load(vectors.DOS + tile_row + offs, mask=offs < opts.HEAD_DIM_V, other=0.0)
                    ring.vec.index(opts.NVEC * s + VDOS).store(tile_scales * (1.0 / E4M3_MAX))
                    if FOLD:
                        lse = lse - LOG2_448
                elif DO_DV:
                    do_scale = gl.load(vectors.DOS + base, mask=ok, other=0.0)
                    ring.vec.index(opts.NVEC * s + VDOS).store(do_scale)
                    if FOLD:    # log2 of dO's scale folded into P^T's exponent (log2(0) - lse = -inf: P^T 0)
                        lse = lse - gl.log2(do_scale)
                if DO_DK:
                    delta = gl.load(vectors.DELTA + base, mask=ok, other=0.0)
                    if opts.ASYNC:   # P^T holds 448 p: dS^T = P^T (dP^T / 448 - delta / 448)
                        delta = delta * (1.0 / E4M3_MAX)
                    if opts.DP_INT8:
                        # dP^T / 448 - delta / 448 from the int32 sum read as 1.5 * 2^23 + sum (the add trick):
                        # (x - 1.5 * 2^23) * c - delta / 448, c = dO's scale * V's / 448: one FMA with c and
                        # -(1.5 * 2^23 c + delta / 448), which takes delta's row
                        dp_scale = gl.load(vectors.DPS + base, mask=ok, other=0.0) * v_scale
                        ring.vec.index(opts.NVEC * s + VDOS).store(dp_scale)
                        delta = gl.fma(dp_scale, -FLOAT_ROUND_BIAS, -delta)
                    ring.vec.index(opts.NVEC * s + VDELTA).store(delta)
                    qr_scale = gl.load(vectors.QSR + base, mask=ok, other=0.0)
                    if FOLD:    # dK alone: Q's scale into the exponent instead (dS^T = P^T (dP^T - delta) * it)
                        lse = lse - gl.log2(qr_scale)
                    else:
                        ring.vec.index(opts.NVEC * s + VQSR).store(qr_scale)
                if TILE_KS and not SOFTCAP:   # P^T's exponent offset: the add trick's, less lse
                    lse = gl.fma(q_scale, -FLOAT_ROUND_BIAS, -lse)
                ring.vec.index(opts.NVEC * s + VLSE).store(lse)
                mbarrier.arrive(ring.ready.index(s), count=1)     # the second of ready's two arrivals
                i += 1
        j += 1
        t = claim_item(t, COUNTER, opts.DYNAMIC)
    mbarrier.wait(own.empty, free_phase(j, 1))   # the consumers read the last item's index: the end may be posted
    mailbox.post(t)


@gluon.jit
def _query_band_mask(offs_m, keys, start_m, diag, window_left, window_right, MASK_LEFT: gl.constexpr,
                     MASK_RIGHT: gl.constexpr):
    """hopper_common.key_band_mask for (key row, query column) pairs of the query tile at ``start_m``, as bounds on
    the column (``offs_m``: 0..BLOCK_Q-1) per key, computed once a tile: one compare a score and bound. The
    sequences' ends need no mask here: a query past the end has lse +inf (P^T is 0), a key past the end has
    its dK and dV rows never stored. At least one of ``MASK_LEFT``, ``MASK_RIGHT``."""
    if MASK_RIGHT:   # k <= q + diag + window_right
        valid = offs_m[None, :] >= (keys - diag - window_right - start_m)[:, None]
        if MASK_LEFT:
            valid = valid & (offs_m[None, :] <= (keys - diag + window_left - start_m)[:, None])
    else:            # k >= q + diag - window_left
        valid = offs_m[None, :] <= (keys - diag + window_left - start_m)[:, None]
    return valid


@gluon.jit
def _e4m3_rows(x, x_max, ORDER: gl.constexpr, p_layout: gl.constexpr, o_layout: gl.constexpr):
    """``x`` (>= 0) in FP8 e4m3 per row (``x_max`` its row maxima, mapped to 448; converted two an instruction,
    saturating) as a wgmma A operand (quantize_rows's), and the row scales max / 448 in the product's row layout.
    448 / max is ``/``'s (div.full.f32, within 2 ulp, as quantize_rows's 127 / max): P^T's values already differ
    from the reference's by a few ulp (ex2.approx), so a correctly rounded quotient would not give its bytes."""
    inv = gl.where(x_max > TINY_SCALE, E4M3_MAX / x_max, 0.0)
    x8 = as_operand((x * inv[:, None]).to(gl.float8e4nv), ORDER, p_layout)
    return x8, gl.convert_layout(x_max * (1.0 / E4M3_MAX), gl.SliceLayout(1, o_layout))


@gluon.jit
def _accumulate_e4m3(acc, x8, x_scale, b_smem, PER_COLUMN: gl.constexpr):
    """``acc += (x8 @ B) * x_scale``, ``x8`` and ``B`` (shared memory) in e4m3: an e4m3 x e4m3 -> fp32 wgmma from
    zero (an FP8 wgmma chain keeps ~14 bits: forward_hopper), joined to the fp32 ``acc`` by one FMA. ``x_scale``:
    per row (moved to ``acc``'s row layout), or ``PER_COLUMN`` per column (in ``acc``'s column layout)."""
    o_layout: gl.constexpr = acc.type.layout
    x8 = gl.convert_layout(x8, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4), assert_trivial=True)
    prod = warpgroup_mma(x8, b_smem.permute((1, 0)), gl.zeros(acc.shape, gl.float32, o_layout), use_acc=False)
    if PER_COLUMN:
        acc = gl.fma(prod, x_scale[None, :], acc)
    else:
        acc = gl.fma(prod, gl.convert_layout(x_scale, gl.SliceLayout(1, o_layout), assert_trivial=True)[:, None], acc)
    return acc


@gluon.jit
def _key_tiles_bwd(dv_acc, dk_acc, dk2_acc, dv_scale, dk_scale, it, key_ops, ring, lo, hi, item, seqs, softcap2,
                   MASKED: gl.constexpr, opts, dq_x, dq_row, dq_scale):
    """Query tiles ``[lo, hi)`` of one head for one warpgroup's 64 keys: dV += P^T dO and/or dK += dS^T Q
    (``QK_SPLIT``: Q's channels past the first block into ``dk2_acc``). ``TILE_KS``: the item's keys share one K
    scale, which the loader folded into the per-query vectors with the add trick's offset (q_scale * k_scale and
    that times -1.5 * 2^23 less lse), so S^T's dequantization and P^T's exponent are one FMA a score.
    ``DO_DQ``: also dQ += dS K in the input dtype (_dq_signal, _dq_issue), reduce-added to an fp32 accumulator
    (_reduce_dq). ``DK_E4M3``: dS^T and Q^T in FP8 e4m3 (Q's per-token e4m3 scale folded into dS^T as in INT8).
    ``IN_PLACE`` (e4m3 products): dV and dK sum in their accumulators themselves, each key row in units of its
    latest tile's scale (``dv_scale``, ``dk_scale``; running_scale), applied once at the end."""
    BLOCK_Q: gl.constexpr = opts.BLOCK_Q
    QK_SPLIT: gl.constexpr = opts.QK_SPLIT
    DO_DK: gl.constexpr = opts.DO_DK
    DO_DV: gl.constexpr = opts.DO_DV
    DO_DQ: gl.constexpr = opts.DO_DQ
    FOLD: gl.constexpr = opts.FOLD
    SOFTCAP: gl.constexpr = opts.SOFTCAP
    TILE_KS: gl.constexpr = opts.TILE_KS
    ORDER: gl.constexpr = opts.ORDER
    PV_E4M3: gl.constexpr = opts.PV_E4M3
    P_STATIC: gl.constexpr = opts.P_STATIC
    DK_E4M3: gl.constexpr = opts.DK_E4M3
    IN_PLACE: gl.constexpr = opts.IN_PLACE
    ASYNC: gl.constexpr = opts.ASYNC
    DP_INT8: gl.constexpr = opts.DP_INT8
    DS_BOUND: gl.constexpr = opts.DS_BOUND
    gl.static_assert(PV_E4M3 or not P_STATIC, "a fixed P scale only with e4m3 P^T dO")
    gl.static_assert(not DP_INT8 or (ASYNC and DO_DQ), "an INT8 dP^T in the one launch's async tile only")
    gl.static_assert(not DS_BOUND or (ASYNC and DO_DQ and IN_PLACE and DK_E4M3),
                     "dS^T at each query's fixed scale in the one launch's async tile, dK in place, only")
    gl.static_assert(not IN_PLACE or ((not DO_DV or PV_E4M3) and (not DO_DK or DK_E4M3)),
                     "in place: e4m3 products")
    MASK_LEFT: gl.constexpr = seqs.MASK_LEFT
    MASK_RIGHT: gl.constexpr = seqs.MASK_RIGHT
    C: gl.constexpr = key_ops.C
    s_layout: gl.constexpr = wgmma_layout(BLOCK_Q, 32)
    dp_layout: gl.constexpr = wgmma_layout(BLOCK_Q, 16)
    o_layout: gl.constexpr = wgmma_layout(opts.D1, 32)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    keys = key_ops.keys
    seqlen_k = item.seqlen_k
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    offs_m = gl.arange(0, BLOCK_Q, layout=col_layout)
    s_zero = gl.zeros([HALF_N, BLOCK_Q], gl.int32, s_layout)
    dp_zero = gl.zeros([HALF_N, BLOCK_Q], gl.float32, dp_layout)
    DQ_COLS: gl.constexpr = dq_x.kb.shape[2]   # (a consumer's half of dQ's channels)
    dq_layout: gl.constexpr = wgmma_layout(DQ_COLS, 16)
    dq_zero = gl.zeros([BLOCK_Q, DQ_COLS], gl.float32, dq_layout)
    diag = seqlen_k - item.seqlen_q
    for start_m in range(lo, hi, BLOCK_Q):
        s = ring_slot(it, STAGES)
        mbarrier.wait(ring.ready.index(s), ring_phase(it, STAGES))
        st_tok = warpgroup_mma(key_ops.k8, ring.q.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if QK_SPLIT:    # the channels past the first block, into the same int32 scores
            st_tok = warpgroup_mma(key_ops.k8b, ring.q2.index(s).permute((1, 0)), st_tok, is_async=True)
        if DO_DK and DP_INT8:   # dP^T = V dO^T in INT8 (V one scale a key block, dO one a token), beside S^T
            dpt_tok = warpgroup_mma(key_ops.v16, ring.do.index(s).permute((1, 0)), s_zero, use_acc=False,
                                    is_async=True)
            st_int = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok, ))
        elif DO_DK:   # dP^T = V dO^T in the input dtype (quantizing it would feed error into dS), beside S^T
            dpt_tok = warpgroup_mma(key_ops.v16, ring.do.index(s).permute((1, 0)), dp_zero, use_acc=False,
                                    is_async=True)
            st_int = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok, ))   # P^T's math under dP^T's product
        else:
            st_int = warpgroup_mma_wait(num_outstanding=0, deps=(st_tok, ))
        q_scale = ring.vec.index(opts.NVEC * s + VQS).load(col_layout)
        lse = ring.vec.index(opts.NVEC * s + VLSE).load(col_layout)
        bits = (st_int + FLOAT_ROUND_BIAS_BITS).to(gl.float32, bitcast=True)
        if SOFTCAP:   # capped scores as in the forward; tanh kept for the cap's derivative in dS^T
            shift = ring.vec.index(opts.NVEC * s + VSHIFT).load(col_layout)
            if TILE_KS:   # (q_scale and shift hold the K scale and the add trick's offset: see the loader)
                tht = tanh_scores(gl.fma(bits, q_scale[None, :], shift[None, :]))
            else:
                tht = tanh_scores(gl.fma(gl.fma(bits, key_ops.k_scale[:, None], key_ops.k_bias[:, None]),
                                         q_scale[None, :], shift[None, :]))
            pt = gl.exp2(gl.fma(tht, softcap2, -lse[None, :]))
        elif TILE_KS:   # (q_scale holds q_scale * k_scale, lse the exponent's offset: see the loader)
            pt = gl.exp2(gl.fma(bits, q_scale[None, :], lse[None, :]))   # the offset is -inf past the end: 0
        else:
            st = gl.fma(bits, key_ops.k_scale[:, None], key_ops.k_bias[:, None])
            pt = gl.exp2(gl.fma(st, q_scale[None, :], -lse[None, :]))   # lse is +inf past the end: 0
        if DO_DQ:   # keys past the sequence's end: their dK and dV rows are never stored, but dQ sums over keys
            pt = gl.where((keys < seqlen_k)[:, None], pt, 0.0)
        if MASKED and (MASK_LEFT or MASK_RIGHT):   # (the sequences' ends: _query_band_mask)
            pt = gl.where(_query_band_mask(offs_m, keys, start_m, diag, seqs.window_left, seqs.window_right,
                                           MASK_LEFT, MASK_RIGHT), pt, 0.0)
        elif MASKED:   # no band: as before _query_band_mask (hopper_common.inside_sequences)
            pt = gl.where(inside_sequences((start_m + offs_m)[None, :], keys[:, None], item.seqlen_q, seqlen_k), pt,
                          0.0)
        # Each product's operand: the other operand's per-token scale folded in, then one scale per key over the
        # tile (backward._quantize_rows: unsigned for P^T, signed for dS^T). Both operands are quantized before
        # either product runs, so P^T, dP^T and dS^T in fp32 are dead by then. (Each per-query vector costs
        # registers: each is loaded where it is used. FOLD: dO's scale already sits in P^T's exponent.)
        if DO_DV:
            xv = pt
            if P_STATIC:   # P^T = 448 p straight to e4m3 (no per-key max); dO's scales are per channel
                if not (FOLD or ASYNC):
                    xv = xv * E4M3_MAX
                pv8 = as_operand(xv.to(gl.float8e4nv), ORDER, p_layout)
                if ASYNC:   # dV's product under dS^T's math
                    dv_tok = product_in_place(dv_acc, pv8, ring.dot.index(s), True)
            else:
                if not FOLD:
                    xv = xv * ring.vec.index(opts.NVEC * s + VDOS).load(col_layout)[None, :]
                if PV_E4M3:
                    pv8, pv_scale = _e4m3_rows(xv, nan_max(xv, 1), ORDER, p_layout, o_layout)
                else:
                    pv8, pv_scale = quantize_rows(xv, nan_max(xv, 1), ORDER, p_layout, o_layout)
        if DO_DK:
            dpt = warpgroup_mma_wait(num_outstanding=1 if ASYNC else 0, deps=(dpt_tok, ))
            delta = ring.vec.index(opts.NVEC * s + VDELTA).load(col_layout)
            if DP_INT8:   # (the loader's per-query pair: dP^T's scale and the offset with delta: see there)
                dp_scale = ring.vec.index(opts.NVEC * s + VDOS).load(col_layout)
                xk = pt * gl.fma((dpt + FLOAT_ROUND_BIAS_BITS).to(gl.float32, bitcast=True), dp_scale[None, :],
                                 delta[None, :])
            elif ASYNC:   # (P^T holds 448 p, delta / 448 the loader's: one FMA for the subtraction and the 1 / 448)
                xk = pt * gl.fma(gl.convert_layout(dpt, s_layout), 1.0 / E4M3_MAX, -delta[None, :])
            else:
                xk = pt * (gl.convert_layout(dpt, s_layout) - delta[None, :])
            if DO_DQ:   # dS^T itself (no FOLD, no cap here): stored and announced now, multiplied after dV's product
                if it % 2 == 0:   # (constant buffer indices: see _dq_issue)
                    _dq_signal(xk, dq_x.ds.index(C), C, it)
                else:
                    _dq_signal(xk, dq_x.ds.index(2 + C), C, it)
                xk = xk * ring.vec.index(opts.NVEC * s + VQSR).load(col_layout)[None, :]
            else:
                if not FOLD:   # (FOLD: Q's scale already sits in P^T's exponent)
                    xk = xk * ring.vec.index(opts.NVEC * s + VQSR).load(col_layout)[None, :]
                if SOFTCAP:   # dS^T with respect to the uncapped score: times 1 - tanh^2
                    xk = xk * (1.0 - tht * tht)
            if DS_BOUND:   # (VQSR holds 448 / each query's bound: dS^T straight to e4m3, no max, no rescale)
                ds8 = as_operand(xk.to(gl.float8e4nv), ORDER, p_layout)
                dk_tok = product_in_place(dk_acc, ds8, ring.qt.index(s), True)
            elif DK_E4M3:
                ds8, ds_scale = _e4m3_rows(xk, nan_max(gl.abs(xk), 1), ORDER, p_layout, o_layout)
            else:
                ds8, ds_scale = quantize_rows(xk, nan_max(gl.abs(xk), 1), ORDER, p_layout, o_layout)
            if ASYNC and not DS_BOUND:   # dK's product before the wait for the other consumer's dS^T
                dk_scale, factor = running_scale(dk_scale, ds_scale)
                dk_tok = accumulate_in_place(dk_acc, factor, ds8, ring.qt.index(s), True)
        if DO_DV and not ASYNC:   # (ASYNC: issued above)
            if P_STATIC and IN_PLACE:   # dO's channel scales hold for the sequence: applied once at the end
                dv_acc = product_in_place(dv_acc, pv8, ring.dot.index(s), False)
            elif P_STATIC:   # dO's channel scales of this tile (times 1/448: the loader's)
                dos_row = ring.vec.index(opts.NVEC * s + VDOS)
                if opts.HEAD_DIM_V < BLOCK_Q:
                    dos_row = dos_row.slice(0, opts.HEAD_DIM_V)
                dv_acc = _accumulate_e4m3(dv_acc, pv8, dos_row.load(gl.SliceLayout(0, dv_acc.type.layout)),
                                          ring.dot.index(s), True)
            elif IN_PLACE:
                dv_scale, factor = running_scale(dv_scale, pv_scale)
                dv_acc = accumulate_in_place(dv_acc, factor, pv8, ring.dot.index(s), False)
            elif PV_E4M3:
                dv_acc = _accumulate_e4m3(dv_acc, pv8, pv_scale, ring.dot.index(s), False)
            else:
                dv_acc = accumulate_product(dv_acc, pv8, pv_scale, ring.dot.index(s))
        if DO_DQ:   # the other consumer's dS^T of this tile is stored by now, or soon
            named_barrier(False, DQ_SIGNALS + 2 * (1 - C) + it % 2, 256, 4)
            if it % 2 == 0:
                dq_tok = _dq_issue(dq_x.ds.index(0), dq_x.ds.index(1), dq_x.kb.index(C), dq_x.kb.index(2 + C),
                                   dq_zero)
            else:
                dq_tok = _dq_issue(dq_x.ds.index(2), dq_x.ds.index(3), dq_x.kb.index(C), dq_x.kb.index(2 + C),
                                   dq_zero)
        if DO_DK and not ASYNC:
            if IN_PLACE:
                dk_scale, factor = running_scale(dk_scale, ds_scale)
                dk_acc = accumulate_in_place(dk_acc, factor, ds8, ring.qt.index(s), False)
                if QK_SPLIT:
                    dk2_acc = accumulate_in_place(dk2_acc, factor, ds8, ring.qt2.index(s), False)
            elif DK_E4M3:
                dk_acc = _accumulate_e4m3(dk_acc, ds8, ds_scale, ring.qt.index(s), False)
                if QK_SPLIT:
                    dk2_acc = _accumulate_e4m3(dk2_acc, ds8, ds_scale, ring.qt2.index(s), False)
            else:
                dk_acc = accumulate_product(dk_acc, ds8, ds_scale, ring.qt.index(s))
                if QK_SPLIT:
                    dk2_acc = accumulate_product(dk2_acc, ds8, ds_scale, ring.qt2.index(s))
        if ASYNC:
            dv_acc = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, ))
            dk_acc = warpgroup_mma_wait(num_outstanding=0, deps=(dk_tok, ))
        mbarrier.arrive(ring.empty.index(s), count=1)
        if DO_DQ:
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, )) * dq_scale
            _reduce_dq(dq, it, C, dq_x.dq, dq_x.desc, dq_row + start_m)
        it += 1
    return dv_acc, dk_acc, dk2_acc, dv_scale, dk_scale, it


@gluon.jit
def _k_operand(k_smem, kb_smem, C: gl.constexpr):
    """dQ's B operand for this consumer: the item's int8 K (both 64-key halves, K-smoothed as the scores use it)
    as bf16 integers (exact), this consumer's half of the channels; the item's one K scale multiplies the product.
    Once an item: the consumer's own buffers, so its own warps' barrier suffices."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    H: gl.constexpr = kb_smem.shape[2]
    for h in gl.static_range(2):
        k = k_smem.index(h).load(layout).to(kb_smem.dtype)
        lower, upper = gl.split(gl.permute(gl.reshape(k, [HALF_N, 2, H]), (0, 2, 1)))
        if C == 0:
            kb_smem.index(2 * h + C).store(lower)
        else:
            kb_smem.index(2 * h + C).store(upper)
    fence_async_shared()
    named_barrier(False, K_OPERAND_BARRIER + C, 128, 4)


@gluon.jit
def _dq_signal(ds, mine, C: gl.constexpr, it):
    """This warpgroup's dS^T tile into ``mine``, announced to the other consumer by ``bar.arrive`` (no
    wait): each waits (``bar.sync``) for the other's only once its own dV product ran, so the two drift apart by
    up to a tile instead of meeting at every tile, and one's softmax work runs under the other's products. Two
    hardware barriers a consumer, by the tile's parity: a consumer arrives at one again only two tiles on, past
    its wait for the other's arrival of the tile between, which the other makes after its whole previous tile
    (its dQ product of it waited for, so the buffer it read may be rewritten)."""
    mine.store(ds.to(mine.dtype))
    fence_async_shared()
    named_barrier(True, DQ_SIGNALS + 2 * C + it % 2, 256, 4)


@gluon.jit
def _dq_issue(half0, half1, kb0, kb1, dq_zero):
    """This consumer's share of the tile's dQ (its half of the channels, over the program's 128 keys)
    ``dS_0 K_0 + dS_1 K_1``, issued async in the input dtype once both consumers' dS^T halves are stored: a 16-bit
    A operand may be read transposed from shared memory (an 8-bit one may not: dQ in INT8 inside this program
    cost 2,686 instructions a tile). Buffers by constant index: a run-time index of a wgmma A operand's shared
    memory read wrong rows on Triton 3.6."""
    tok = warpgroup_mma(half0.permute((1, 0)), kb0, dq_zero, use_acc=False, is_async=True)
    return warpgroup_mma(half1.permute((1, 0)), kb1, tok, is_async=True)


@gluon.jit
def _reduce_dq(dq, it, C: gl.constexpr, dq_smem, dq_desc, row):
    """This consumer's share of a tile's dQ added to the fp32 accumulator by one TMA reduce-add from shared
    memory (``cp.reduce.async.bulk.tensor``: the copy engine does the adds, the warps go on). A ring of buffers a
    consumer; before one is rewritten its reduce-add must have read it (Gluon syncs the warpgroup after the wait
    and before the copy is issued). Rows past a sequence's end add zeros (their dS is 0) to the next head's or
    sequence's rows. (Each thread adding its own values, ``red.global.add``, the one-launch backward ran 0.89x the
    three launches at D=64 N=4K; one warp adding them for the consumers 0.37x; without any adds 1.26x: H100,
    docs/history.md.)"""
    BUFFERS: gl.constexpr = dq_smem.shape[0] // 2
    buf = dq_smem.index(BUFFERS * C + it % BUFFERS)
    tma.store_wait(BUFFERS - 1)
    buf.store(dq)
    fence_async_shared()
    tma_atomic_add(dq_desc, [row, C * dq.shape[1]], buf)


@gluon.jit
def _bwd_consumer(C: gl.constexpr, k8, k8b, v16, own, ring, mailbox, seqs, key_scales, grads, softcap2, dq_x, opts):
    """One warpgroup, per work item the loader posts: keys ``[start_n + C * 64, ... + 64)`` (their int8 K in
    ``k8``, and ``k8b`` past the first ``D1`` channels with ``QK_SPLIT``; V in ``v16``) against every query tile
    of every query head of the group; writes their dV and/or dK rows (K released first, so the loader brings the
    next item's meanwhile)."""
    D1: gl.constexpr = opts.D1
    D2: gl.constexpr = opts.D2
    QK_SPLIT: gl.constexpr = opts.QK_SPLIT
    s_layout: gl.constexpr = wgmma_layout(opts.BLOCK_Q, 32)
    dv_layout: gl.constexpr = wgmma_layout(opts.HEAD_DIM_V, 32)
    dk_layout: gl.constexpr = wgmma_layout(D1, 32)
    dk2_layout: gl.constexpr = wgmma_layout(D2, 32)
    num_items = seqs.num_items
    KS = key_scales.KS
    softmax_scale = grads.softmax_scale
    it = num_items * 0      # the ring's tile count, run on across items as the loader's
    j = num_items * 0
    t = mailbox.next(j)
    while t < num_items:
        item = _dkdv_item(seqs, t, opts.BLOCK_Q)
        bt = item.bt
        hk = item.hk
        k0 = item.k0
        start_n = item.start
        seqlen_k = item.seqlen_k
        ks_off = bt.to(gl.int64) * key_scales.s_ksb + hk * key_scales.s_ksh + k0
        keys = start_n + C * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
        k_scale = gl.load(KS + ks_off + keys, mask=keys < seqlen_k, other=0.0)
        k_bias = k_scale * -FLOAT_ROUND_BIAS
        dv_acc = gl.zeros([HALF_N, opts.HEAD_DIM_V], gl.float32, dv_layout)
        dk_acc = gl.zeros([HALF_N, D1], gl.float32, dk_layout)
        dk2_acc = gl.zeros([HALF_N, D2], gl.float32, dk2_layout)
        # (IN_PLACE: each key row's scale, the units its accumulator holds)
        dv_scale = gl.zeros([HALF_N], gl.float32, gl.SliceLayout(1, dv_layout))
        dk_scale = gl.zeros([HALF_N], gl.float32, gl.SliceLayout(1, dk_layout))
        mbarrier.wait(own.ready, ring_phase(j, 1))
        # the item's one K scale (TILE_KS) and the softmax scale, on both consumers' dQ products: from its first key,
        # not this consumer's (whose keys may all lie past the sequence's end)
        dq_scale = gl.load(KS + ks_off + start_n, mask=start_n < seqlen_k, other=0.0) * softmax_scale
        if opts.DO_DQ:
            _k_operand(own.k, dq_x.kb, C)
        key_ops = KeyOperands(k8, k8b, v16, k_scale, k_bias, keys, C)
        group = seqs.group
        for g in range(group):
            dq_row = (bt * seqs.num_kv_heads * group + hk * group + g) * seqs.n_q + item.q0   # (DO_DQ: dQ's rows)
            dv_acc, dk_acc, dk2_acc, dv_scale, dk_scale, it = _key_tiles_bwd(
                dv_acc, dk_acc, dk2_acc, dv_scale, dk_scale, it, key_ops, ring, item.lo, item.full_lo, item, seqs,
                softcap2, True, opts, dq_x, dq_row, dq_scale)
            dv_acc, dk_acc, dk2_acc, dv_scale, dk_scale, it = _key_tiles_bwd(
                dv_acc, dk_acc, dk2_acc, dv_scale, dk_scale, it, key_ops, ring, item.full_lo, item.full_hi, item,
                seqs, softcap2, False, opts, dq_x, dq_row, dq_scale)
            dv_acc, dk_acc, dk2_acc, dv_scale, dk_scale, it = _key_tiles_bwd(
                dv_acc, dk_acc, dk2_acc, dv_scale, dk_scale, it, key_ops, ring, item.full_hi, item.hi, item, seqs,
                softcap2, True, opts, dq_x, dq_row, dq_scale)
        mbarrier.arrive(own.empty, count=1)     # every product with this item's K and V was waited for
        if opts.IN_PLACE:   # each key row's accumulator in units of its last scale
            if opts.P_STATIC:   # P^T = 448 p; dO's channel scales of the sequence and KV group (at its first head)
                offs_dv = gl.arange(0, opts.HEAD_DIM_V, layout=gl.SliceLayout(0, dv_layout))
                dos = gl.load(grads.DOS + item.b * grads.s_dtb + hk * seqs.group * grads.s_dth + offs_dv)
                dv_acc = dv_acc * (dos * (1.0 / (E4M3_MAX * E4M3_MAX)))[None, :]
            else:
                dv_acc = dv_acc * dv_scale[:, None]
            if opts.DS_BOUND:   # dS^T at 448 / each query's bound, Q times it at 448 / its channel's max: both after
                offs_dk = gl.arange(0, D1, layout=gl.SliceLayout(0, dk_layout))
                qrs = gl.load(grads.QRS + item.b * grads.s_dtb + hk * seqs.group * grads.s_dth + offs_dk)
                dk_acc = dk_acc * (qrs * (1.0 / (E4M3_MAX * E4M3_MAX)))[None, :]
            else:
                dk_acc = dk_acc * dk_scale[:, None]
            if QK_SPLIT:
                dk2_scale = gl.convert_layout(dk_scale, gl.SliceLayout(1, dk2_layout), assert_trivial=True)
                dk2_acc = dk2_acc * dk2_scale[:, None]
        if opts.DO_DV:
            dv_off = bt.to(gl.int64) * grads.s_dvb + hk.to(gl.int64) * grads.s_dvh + k0.to(gl.int64) * grads.s_dvt
            store_rows(dv_acc, keys, seqlen_k, grads.DV, dv_off, grads.s_dvt, 1.0, 0)
        if opts.DO_DK:
            dk_off = bt.to(gl.int64) * grads.s_dkb + hk.to(gl.int64) * grads.s_dkh + k0.to(gl.int64) * grads.s_dkt
            store_rows(dk_acc, keys, seqlen_k, grads.DK, dk_off, grads.s_dkt, softmax_scale, 0)
            if QK_SPLIT:
                store_rows(dk2_acc, keys, seqlen_k, grads.DK, dk_off, grads.s_dkt, softmax_scale, D1)
        j += 1
        t = mailbox.next(j)
    if opts.DO_DQ:   # the last reduce-adds read their buffers before the program's memory goes
        tma.store_wait(0)


@gluon.jit
def _attn_bwd_dkdv_hopper_kernel(
    q_desc, qt_desc, do_desc, dot_desc, k_desc, v_desc, q2_desc, qt2_desc, k2_desc, dq_desc, QS, LSE, DOS, DELTA, QSR,
    SHIFT, KS, DV, DK, COUNTER, CU_Q, CU_K, CU_QT, s_qsb, s_qsh, s_ksb, s_ksh, s_dvb, s_dvh, s_dvt, s_dkb, s_dkh, s_dkt,
    s_dtb, s_dth, do_rb, do_rh, do_ch, v_rb, v_rh, v_ch, DPS, VS, QRS, n_q, n_k, num_heads, num_kv_heads, group,
    window_left, window_right, softmax_scale, softcap2, num_items, num_n, IS_VARLEN: gl.constexpr,
    MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, HEAD_DIM: gl.constexpr,
    HEAD_DIM_V: gl.constexpr, QK_SPLIT: gl.constexpr, DO_DK: gl.constexpr, DO_DV: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, FOLD: gl.constexpr, SOFTCAP: gl.constexpr,
    BLOCK_Q: gl.constexpr, DYNAMIC: gl.constexpr, ORDER: gl.constexpr, TILE_KS: gl.constexpr,
    DO_DQ: gl.constexpr, DQ_BUFFERS: gl.constexpr, PV_E4M3: gl.constexpr = False, P_STATIC: gl.constexpr = False,
    DK_E4M3: gl.constexpr = False, IN_PLACE: gl.constexpr = False, DP_INT8: gl.constexpr = False,
    DS_BOUND: gl.constexpr = False,
):
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    if DO_DV:
        dot_smem = gl.allocate_shared_memory(dot_desc.dtype, [STAGES] + dot_desc.block_type.shape, dot_desc.layout)
    else:   # unused: a buffer that exists stands in
        dot_smem = q_smem
    if DO_DK:
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        qt_smem = gl.allocate_shared_memory(qt_desc.dtype, [STAGES] + qt_desc.block_type.shape, qt_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    else:
        do_smem = q_smem
        qt_smem = q_smem
        v_smem = k_smem
    if QK_SPLIT:
        q2_smem = gl.allocate_shared_memory(q2_desc.dtype, [STAGES] + q2_desc.block_type.shape, q2_desc.layout)
        k2_smem = gl.allocate_shared_memory(k2_desc.dtype, [2] + k2_desc.block_type.shape, k2_desc.layout)
        if DO_DK:
            qt2_smem = gl.allocate_shared_memory(qt2_desc.dtype, [STAGES] + qt2_desc.block_type.shape,
                                                 qt2_desc.layout)
        else:
            qt2_smem = q2_smem
    else:
        q2_smem = q_smem
        k2_smem = k_smem
        qt2_smem = q_smem
    D1: gl.constexpr = q_desc.block_type.shape[1]
    D2: gl.constexpr = q2_desc.block_type.shape[1] if QK_SPLIT else D1    # (unused without the split)
    if DO_DQ:   # dQ's B operand (_k_operand): by 64 keys and half the channels; dS^T tiles, two per consumer
        IO: gl.constexpr = DV.dtype.element_ty    # (the gradients' dtype: dO's descriptor is INT8 with DP_INT8)
        kb_smem = gl.allocate_shared_memory(IO, [4, HALF_N, HEAD_DIM // 2],
                                            gl.NVMMASharedLayout.get_default_for([HALF_N, HEAD_DIM // 2], IO))
        ds_smem = gl.allocate_shared_memory(IO, [4, HALF_N, BLOCK_Q],
                                            gl.NVMMASharedLayout.get_default_for([HALF_N, BLOCK_Q], IO))
        # each consumer's share of a tile's dQ, DQ_BUFFERS each (_reduce_dq)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2 * DQ_BUFFERS] + dq_desc.block_type.shape,
                                            dq_desc.layout)
    else:
        kb_smem = v_smem
        ds_smem = v_smem
        dq_smem = v_smem
    # per-query vector rows a stage: VQS..VQSR always, dO's scales where staged per tile, the shift under a cap
    NVEC: gl.constexpr = 6 if SOFTCAP else (5 if (DO_DV and not (P_STATIC and IN_PLACE)) or DP_INT8 else 4)
    # dV and dK in place with P at its fixed scale: both products run async, each issued as soon as its operand is
    # ready (dV's before dS^T's math, dK's before the wait for the other consumer's dS^T), waited for at the tile's
    # end; P^T = 448 p straight from the exponent (its 1 / 448 joins dP^T - delta, one FMA)
    ASYNC: gl.constexpr = IN_PLACE and P_STATIC and DO_DV and DO_DK and not QK_SPLIT
    vec_smem = gl.allocate_shared_memory(gl.float32, [NVEC * STAGES, BLOCK_Q],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    k_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    item_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    item_smem = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(k_ready, count=1)     # the TMA bytes
    mbarrier.init(k_empty, count=2)     # both consumers release K and V
    mbarrier.init(item_bar, count=1)    # the loader posted the next item in item_smem
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=2)      # the TMA bytes and the per-query vectors
        mbarrier.init(empty.index(i), count=2)      # both consumers release a buffer

    descs = KeyTileDescriptors(q_desc, qt_desc, do_desc, dot_desc, k_desc, v_desc, q2_desc, qt2_desc, k2_desc)
    ring = QueryRing(q_smem, q2_smem, qt_smem, qt2_smem, do_smem, dot_smem, vec_smem, ready, empty)
    own = ItemKV(k_smem, k2_smem, v_smem, k_ready, k_empty)
    mailbox = ItemMailbox(item_smem, item_bar)
    seqs = Sequences(CU_Q, CU_K, CU_QT, n_q, n_k, num_heads, num_kv_heads, group, window_left, window_right,
                     num_items, num_n, IS_VARLEN, MASK_LEFT, MASK_RIGHT)
    key_scales = KeyScales(KS, s_ksb, s_ksh)
    grads = KeyGradients(DV, s_dvb, s_dvh, s_dvt, DK, s_dkb, s_dkh, s_dkt, softmax_scale, DOS, s_dtb, s_dth, QRS)
    dq_x = DqExchange(ds_smem, kb_smem, dq_smem, dq_desc)
    opts = KeyTileOptions(HEAD_DIM, HEAD_DIM_V, D1, D2, QK_SPLIT, DO_DK, DO_DV, DO_DQ, FOLD, SOFTCAP, BLOCK_Q, ORDER,
                          TILE_KS, DYNAMIC, PV_E4M3, P_STATIC, DK_E4M3, IN_PLACE, NVEC, ASYNC, DP_INT8,
                          DS_BOUND)
    # (K and V by constant indices: a run-time index of a wgmma operand's shared memory read wrong rows,
    # forward_hopper)
    gl.warp_specialize([
        (_bwd_consumer, (0, k_smem.index(0), k2_smem.index(0), v_smem.index(0), own, ring, mailbox, seqs, key_scales,
                         grads, softcap2, dq_x, opts)),
        (_bwd_consumer, (1, k_smem.index(1), k2_smem.index(1), v_smem.index(1), own, ring, mailbox, seqs, key_scales,
                         grads, softcap2, dq_x, opts)),
        (_loader, (descs, ring, own, mailbox, COUNTER, seqs,
                   QueryVectors(QS, LSE, DOS, DELTA, QSR, SHIFT, s_qsb, s_qsh, 1.0 / softcap2, s_dtb, s_dth, DPS, VS),
                   key_scales,
                   CallerRows(do_rb, do_rh, do_ch, v_rb, v_rh, v_ch), opts)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
