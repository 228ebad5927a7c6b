"""SageBwd forward on Hopper (sm_90), in Gluon: warp-specialized, TMA-fed, async INT8 wgmma.

Contract: forward.launch_forward's (hopper_launch.launch_forward_hopper launches it): the same numerics as the
portable kernel (forward.py) and ``sagebwd_hf.naive``: per-token Q scales, one K scale per ``BLOCK_N`` keys
(``constants.K_SCALE_BLOCK``, this kernel's key tile: one number a tile, folded into each row's constant), P
quantized per row of every key tile with that tile's row maximum mapped to 127, per-channel V scales applied at
the end. Head dims 64 and 128, and MLA's 192 for Q/K with 128 for V (``QK_SPLIT``: Q's and K's channels as two
power-of-two blocks); no Q-smoothing; padded or packed batches (V^T laid out by ``quantize.aligned_starts``:
TMA needs 16-byte aligned tile coordinates); ``SOFTCAP`` (``cap * tanh(s / cap)``, ``tanh.approx``) and sinks
(``SINK_MODE``) as compile-time options. ``PV_E4M3`` / ``P_STATIC`` compute the precision rules of those names
(sagebwd_hf.numerics; ``naive.sagebwd_forward_naive`` is their spec): P V in FP8 e4m3 (P converted two scores an
instruction, saturating; V^T in e4m3 with one scale per channel, ``quantize_v(..., e4m3=True)``), P's largest value in
a tile's row, or with ``P_STATIC`` the running row max, mapped to 448; off, the kernel is the accurate one unchanged.

Schedule (FlashAttention 3's):

* a work item is 128 query rows of one (sequence, head) (192 with three consumers); one program per SM takes
  items from an atomic counter (``DYNAMIC``; longest causal items first), or one program runs one item. An item
  past a short sequence's end runs no tiles.
* a loader warp picks the items, brings each item's Q once and its K / V^T int8 tiles through a ring of ``STAGES``
  shared-memory buffers by TMA (an mbarrier pair per buffer, or with ``NAMED_BARRIERS`` a hardware barrier per
  buffer that every consumer thread arrives at);
* two (or three, ``CONSUMERS``) consumer warpgroups of 64 query rows each run ``S = Q K^T`` and ``O += P V`` as
  async wgmma; with ``PINGPONG`` two consumers take turns to issue S, so one's softmax runs under the other's
  products. P goes to ``P V`` from registers (wgmma's A operand; with ``V_ORDER`` V^T's keys come in the order
  the registers hold P's, so no shuffles). dispatch.py picks consumers and turns per call.

Gluon's API moves between Triton releases: tested on ``constants.TESTED_TRITON``.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .hopper_common import (E4M3_MAX, FLOAT_ROUND_BIAS, FLOAT_ROUND_BIAS_BITS, INT8_MAX, KEEP_NAN, LOG2_127, LOG2_448,
                            LOG2E, TINY_SCALE, ItemMailbox, Scalar, Sequences, WorkItem, aggregate, as_operand,
                            claim_item, free_phase, inside_sequences, key_band_mask, key_tiles, moved_to_hopper_launch,
                            named_barrier, ring_phase, ring_slot, round_to_int8, split_item, tanh_scores, tma_load,
                            wgmma_layout)

HALF_M = gl.constexpr(64)     # query rows per consumer warpgroup (one wgmma M)
BLOCK_M = gl.constexpr(128)   # query rows per program: two consumers (three: 192, the ``consumers`` option)
BLOCK_N = gl.constexpr(128)   # keys per tile: part of the numerics (P's per-row scale is per tile), as forward.py;
                              # quantize.K_SCALE_BLOCK too (one K scale a tile)
STAGES = gl.constexpr(2)      # K / V^T buffers in flight
# Hardware barrier ids of the NAMED_BARRIERS schedule: the two turns, then one per ring buffer (Gluon's own
# partition barriers take ids 0-4)
TURN_BARRIER = gl.constexpr(8)
RELEASE_BARRIER = gl.constexpr(10)


@aggregate
class ForwardDescriptors:
    """The TMA descriptors the loader reads: Q8, K8 and V8^T, and (``QK_SPLIT``) Q8's and K8's channels past the
    first block as descriptors of their own (``q2``, ``k2``)."""
    q: tma.tensor_descriptor
    k: tma.tensor_descriptor
    vt: tma.tensor_descriptor
    q2: tma.tensor_descriptor
    k2: tma.tensor_descriptor


@aggregate
class QBuffers:
    """Each consumer's Q rows in shared memory (``q2``: the channels past the first block with ``QK_SPLIT``, else
    ``q`` again), ``ready`` once the loader's bytes landed, ``empty`` once every consumer is done with them."""
    q: gl.shared_memory_descriptor
    q2: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor


@aggregate
class KVRing:
    """The ``STAGES`` shared-memory buffers of K tiles (``k2``: the channels past the first block with ``QK_SPLIT``,
    else ``k`` again) and V^T tiles, each stage ``ready`` once the loader's bytes landed and ``empty`` once every
    consumer is done with it (or, with ``NAMED_BARRIERS``, released at a hardware barrier instead)."""
    k: gl.shared_memory_descriptor
    k2: gl.shared_memory_descriptor
    vt: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor


@aggregate
class ForwardOptions:
    """The compile-time options every partition reads (the module docstring says what each does)."""
    HEAD_DIM_V: gl.constexpr
    QK_SPLIT: gl.constexpr
    CONSUMERS: gl.constexpr
    PINGPONG: gl.constexpr
    NAMED_BARRIERS: gl.constexpr
    V_ORDER: gl.constexpr
    SOFTCAP: gl.constexpr
    SINK_MODE: gl.constexpr
    DYNAMIC: gl.constexpr
    PV_E4M3: gl.constexpr
    P_STATIC: gl.constexpr
    WRITE_ROW_MAX: gl.constexpr


@gluon.jit
def _work_item(seqs, t, ROWS: gl.constexpr):
    """Work item ``t``: ``ROWS`` query rows of one (sequence, head). Items are numbered query tile fastest, so the
    programs running at once share a few heads' K and V in L2; with a causal (right) mask the last query tiles,
    which see the most keys, come first (FlashAttention 3's order: handed out in order, the long items start
    early and the short ones fill the tail). Its key-tile bounds: forward._key_tiles."""
    valid = t < seqs.num_items
    pid_m, b, h = split_item(t, seqs.num_tiles, seqs.num_heads, seqs.MASK_RIGHT)
    if seqs.IS_VARLEN:
        bc = gl.where(valid, b, 0)
        q0 = gl.load(seqs.CU_Q + bc)
        seqlen_q = gl.load(seqs.CU_Q + bc + 1) - q0
        k0 = gl.load(seqs.CU_K + bc)
        seqlen_k = gl.load(seqs.CU_K + bc + 1) - k0
        v0 = gl.load(seqs.CU_T + bc)        # V^T's own, 16-aligned, sequence starts (quantize.aligned_starts)
        bt = b * 0
    else:
        q0 = b * 0            # tensors, not constants: both branches must give one type
        seqlen_q = seqs.n_q + q0
        k0 = b * 0
        seqlen_k = seqs.n_k + k0
        v0 = k0
        bt = b
    start_m = pid_m * ROWS
    lo, full_lo, full_hi, hi = key_tiles(start_m, seqlen_q, seqlen_k, seqs.window_left, seqs.window_right,
                                          ROWS, seqs.MASK_LEFT, seqs.MASK_RIGHT, BLOCK_N)
    # An item past the end of its sequence (packed batches) runs no tiles. All four bounds go to 0: with a
    # window, such an item's lo can pass its hi, and then the loader (lo..hi) and the consumers' loops disagreed:
    # a hang.
    has_rows = (start_m < seqlen_q).to(gl.int32)
    return WorkItem(b, bt, h, h // seqs.group, start_m, q0, k0, v0, seqlen_q, seqlen_k,
                    lo * has_rows, full_lo * has_rows, full_hi * has_rows, hi * has_rows)


@aggregate
class ForwardScales:
    """The dequantization scales: Q's per token (``QS``), K's one a key tile (``KS``), V's per channel (``VS``),
    with their batch and head strides (``s_qsb``, ``s_qsh``, ...)."""
    QS: gl.tensor
    KS: gl.tensor
    VS: gl.tensor
    s_qsb: Scalar
    s_qsh: Scalar
    s_ksb: Scalar
    s_ksh: Scalar
    s_vsb: Scalar
    s_vsh: Scalar


@aggregate
class ForwardOutputs:
    """What the kernel writes: the output ``O`` [B, H, N, Dv] and the rows' base-2 log-sum-exps ``LSE`` [B, H, N],
    with their strides (batch, head, and token for O); with ``WRITE_ROW_MAX`` also each row's largest score
    ``ROW_MAX`` (LSE's frame and layout: the ds_bound rule's max P = exp2(m - lse))."""
    O: gl.tensor
    LSE: gl.tensor
    ROW_MAX: gl.tensor
    s_ob: Scalar
    s_oh: Scalar
    s_ot: Scalar
    s_lb: Scalar
    s_lh: Scalar


@aggregate
class ScoreTerms:
    """What the options add to the scores: with ``SOFTCAP`` the cap (``softcap2``, in log2 units) and the caller's
    per-row score shift ``SHIFT``; with ``SINK_MODE`` the heads' sinks ``SINKS`` and (mode 2) their per-row shift
    ``SINK_SHIFT`` (unused pointers stand in for absent ones)."""
    softcap2: gl.tensor
    SHIFT: gl.tensor
    SINKS: gl.tensor
    SINK_SHIFT: gl.tensor


@aggregate
class Turns:
    """A consumer's ping-pong turns (``PINGPONG``): the barrier it waits at for its turn to issue S (``mine``), the
    one it passes the turn on by (``other``), and whether it goes first (``FIRST``; with ``NAMED_BARRIERS``
    hardware barriers ``TURN_BARRIER + FIRST`` and ``+ 1 - FIRST`` instead)."""
    mine: gl.shared_memory_descriptor
    other: gl.shared_memory_descriptor
    FIRST: gl.constexpr


@aggregate
class RowConstants:
    """One warpgroup's 64 rows of a work item (``rows``) and what stays fixed over its key tiles: the scores' row
    scale ``q_scale`` (the cap with ``SOFTCAP``, then ``cap_a`` and ``cap_b`` scale and shift the cap's argument)
    and where the item's K scales start (``KS + ks_off``)."""
    rows: gl.tensor
    q_scale: gl.tensor
    cap_a: gl.tensor
    cap_b: gl.tensor
    KS: gl.tensor
    ks_off: gl.tensor


@gluon.jit
def _loader(descs, q_bufs, ring, mailbox, COUNTER, seqs, opts):
    """One warp: picks the program's work items (its program id first, then the next from ``COUNTER``, an atomic
    count of items handed out, with ``DYNAMIC``; else every ``num_programs``-th), tells the consumers which
    (``mailbox``), loads every consumer's Q rows once they are done with the last item's (the next Q lands while
    their epilogue runs), then every K / V^T tile of the item's ``[lo, hi)`` into the ring, whose count runs on
    across items (with ``QK_SPLIT``, Q's and K's channels past the first block as tiles of their own:
    qk_blocks). An item index past the last tells the consumers to stop. One Q buffer, indexed by constants: with
    two, picked by the item's parity, wgmma read the wrong Q rows on Triton 3.6 (a run-time index of the A
    operand's shared memory; masked calls gave relative L2 0.5 on an H100)."""
    CONSUMERS: gl.constexpr = opts.CONSUMERS
    QK_SPLIT: gl.constexpr = opts.QK_SPLIT
    ROWS: gl.constexpr = CONSUMERS * HALF_M
    D1: gl.constexpr = descs.q.block_type.shape[1]
    q_bytes: gl.constexpr = descs.q.block_type.nbytes + (descs.q2.block_type.nbytes if QK_SPLIT else 0)
    nbytes: gl.constexpr = (descs.k.block_type.nbytes + descs.vt.block_type.nbytes
                            + (descs.k2.block_type.nbytes if QK_SPLIT else 0))
    num_items = seqs.num_items
    i = num_items * 0
    j = num_items * 0
    t = gl.program_id(0) + j
    while t < num_items:
        item = _work_item(seqs, t, ROWS)
        # rows of the 2-D views the descriptors see: Q8 [B*H*Nq, D], K8 [B*Hk*Nk, D], V8T [B*Hk*D, Nk_pad]
        q_row = (item.bt * seqs.num_heads + item.h) * seqs.n_q + item.q0 + item.start
        k_row = (item.bt * seqs.num_kv_heads + item.hk) * seqs.n_k + item.k0
        v_row = (item.bt * seqs.num_kv_heads + item.hk) * opts.HEAD_DIM_V
        mbarrier.wait(q_bufs.empty, free_phase(j, 1))   # a fresh barrier's previous phase counts as complete
        mailbox.post(t)
        mbarrier.expect(q_bufs.ready, CONSUMERS * q_bytes)
        for c in gl.static_range(CONSUMERS):
            tma_load(descs.q, [q_row + c * HALF_M, 0], q_bufs.ready, q_bufs.q.index(c))
            if QK_SPLIT:
                tma_load(descs.q2, [q_row + c * HALF_M, D1], q_bufs.ready, q_bufs.q2.index(c))
        for start_n in range(item.lo, item.hi, BLOCK_N):
            s = ring_slot(i, STAGES)
            if opts.NAMED_BARRIERS:   # every consumer thread arrived when done with the buffer's last contents
                if i >= STAGES:
                    named_barrier(False, RELEASE_BARRIER + s, 32 + CONSUMERS * 128, 1)
            else:   # a fresh barrier's "previous phase" counts as complete: the first STAGES waits pass at once
                mbarrier.wait(ring.empty.index(s), free_phase(i, STAGES))
            mbarrier.expect(ring.ready.index(s), nbytes)
            tma_load(descs.k, [k_row + start_n, 0], ring.ready.index(s), ring.k.index(s))
            if QK_SPLIT:
                tma_load(descs.k2, [k_row + start_n, D1], ring.ready.index(s), ring.k2.index(s))
            tma_load(descs.vt, [v_row, item.t0 + start_n], ring.ready.index(s), ring.vt.index(s))
            i += 1
        j += 1
        t = claim_item(t, COUNTER, opts.DYNAMIC)
    mbarrier.wait(q_bufs.empty, free_phase(j, 1))   # the consumers read the last item's index: the end may be posted
    mailbox.post(t)


@gluon.jit
def _consume(acc, m_i, l_i, it, ks, q, q2, ring, turns, row_consts, lo, hi, item, seqs, MASKED: gl.constexpr,
             opts):
    """Key tiles ``[lo, hi)`` for one warpgroup's 64 rows, each S = Q K^T waited for before its softmax.
    ``ks``: this tile's K scale, read a tile ahead (global-load latency stalled the loop when read after S).

    PINGPONG: the two warpgroups take turns to issue S (``turns``), FlashAttention 3's
    scheduler barrier, so one's softmax tends to run under the other's products. (FlashAttention 3's
    in-warpgroup overlap, the next tile's S issued before this tile's softmax or once its P V is issued,
    measured 0.49-0.94x on an H100: unrolled by two so each in-flight S keeps its registers, the
    loop each warpgroup runs doubles and the instruction cache misses; docs/history.md.)"""
    MASK_LEFT: gl.constexpr = seqs.MASK_LEFT
    MASK_RIGHT: gl.constexpr = seqs.MASK_RIGHT
    IS_VARLEN: gl.constexpr = seqs.IS_VARLEN
    PINGPONG: gl.constexpr = opts.PINGPONG
    NAMED_BARRIERS: gl.constexpr = opts.NAMED_BARRIERS
    FIRST: gl.constexpr = turns.FIRST
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N, 32)
    o_layout: gl.constexpr = wgmma_layout(opts.HEAD_DIM_V, 32)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    KS = row_consts.KS
    ks_off = row_consts.ks_off
    rows = row_consts.rows
    q_scale = row_consts.q_scale
    seqlen_k = item.seqlen_k
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.int32, s_layout)
    PV_E4M3: gl.constexpr = opts.PV_E4M3
    P_STATIC: gl.constexpr = opts.P_STATIC
    gl.static_assert(PV_E4M3 or not P_STATIC, "a fixed P scale only with e4m3 P V")
    if PV_E4M3:
        o_zero = gl.zeros(acc.shape, gl.float32, o_layout)
    else:
        o_zero = gl.zeros(acc.shape, gl.int32, o_layout)
    diag = seqlen_k - item.seqlen_q
    # In band-masked loops the next tile's K scale comes through a pointer of its own: with start_n in the
    # address, LLVM widened the loop counter to 64 bits, and every key index and mask compare with it (a masked
    # tile at D=64 causal: 1,039 instructions a thread, 945 without the widening, 842 with key_band_mask).
    # Elsewhere the address keeps start_n: a kernel without a band compiles as it did before (see inside_sequences).
    # Packed batches too: there the key offset is a loaded sequence start, and the widening came back in every
    # loop (an unmasked tile at D=128 reloaded two spilled registers, a masked one 1,099 instructions against 859).
    BAND: gl.constexpr = MASKED and (MASK_LEFT or MASK_RIGHT)
    KS_PTR: gl.constexpr = BAND or IS_VARLEN
    if KS_PTR:
        ks_ptr = KS + ks_off + lo + BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        s = ring_slot(it, STAGES)
        mbarrier.wait(ring.ready.index(s), ring_phase(it, STAGES))
        if PINGPONG:
            if NAMED_BARRIERS:
                named_barrier(False, TURN_BARRIER + FIRST, 256, 4)
            else:
                mbarrier.wait(turns.mine, ring_phase(it, 1) ^ FIRST)
        s_tok = warpgroup_mma(q, ring.k.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if opts.QK_SPLIT:    # the channels past the first power-of-two block, into the same int32 scores
            s_tok = warpgroup_mma(q2, ring.k2.index(s).permute((1, 0)), s_tok, is_async=True)
        if PINGPONG:
            if NAMED_BARRIERS:
                named_barrier(True, TURN_BARRIER + 1 - FIRST, 256, 4)
            else:
                mbarrier.arrive(turns.other, count=1)
        if KS_PTR:
            ks_next = gl.load(ks_ptr, mask=start_n + BLOCK_N < seqlen_k, other=0.0)
            ks_ptr += BLOCK_N
        else:
            cols = start_n + offs_n
            ks_next = gl.load(KS + ks_off + start_n + BLOCK_N, mask=start_n + BLOCK_N < seqlen_k, other=0.0)
        # The scores as x = 1.5 * 2^23 + S_int read as a float (quantize.int32_times), scaled per row: the K
        # scale is one number a tile, so it joins the row's Q scale (a per-key scale cost one FMA a score).
        s_int = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        t = (s_int + FLOAT_ROUND_BIAS_BITS).to(gl.float32, bitcast=True)
        # with a cap: tanh((s + shift) / cap), s = ks * (x - 1.5 * 2^23), and q_scale is the cap (forward._fwd_tile)
        if opts.SOFTCAP:
            t_mul = row_consts.cap_a * ks
            t = tanh_scores(gl.fma(t, t_mul[:, None], (row_consts.cap_b - t_mul * FLOAT_ROUND_BIAS)[:, None]))
            row_mul = q_scale
            row_add = q_scale * 0.0
        else:   # floored: with an all-zero K tile (scale 0) a masked score would be -inf * 0
            row_mul = gl.maximum(q_scale * ks, 1e-37, propagate_nan=KEEP_NAN)
            row_add = row_mul * -FLOAT_ROUND_BIAS
        if BAND or (MASKED and IS_VARLEN):
            t = gl.where(key_band_mask(offs_n, rows, start_n, seqlen_k, diag, seqs.window_left, seqs.window_right,
                                         MASK_LEFT, MASK_RIGHT), t, float("-inf"))
        elif MASKED:
            t = gl.where(inside_sequences(rows[:, None], cols[None, :], item.seqlen_q, seqlen_k), t, float("-inf"))
        tile_max = gl.fma(gl.max(t, 1), row_mul, row_add)
        m_new = gl.maximum(m_i, tile_max)
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_ref)
        if P_STATIC:   # P relative to the running max, which maps to 448: P's scale is 1 / 448 in every tile
            e_ref = m_ref - LOG2_448
        elif PV_E4M3:
            e_ref = gl.where(tile_max == float("-inf"), 0.0, tile_max - LOG2_448)
        else:
            e_ref = gl.where(tile_max == float("-inf"), 0.0, tile_max - LOG2_127)
        e = gl.exp2(gl.fma(t, row_mul[:, None], (row_add - e_ref)[:, None]))
        if P_STATIC:
            # The accumulator and the row sum hold 448 times O's and l's sums (the epilogue's 1 / l cancels it):
            # one FMA an output adds the tile's product. (Each tile's product starts from zero: a wgmma chain
            # accumulates in the tensor core's own precision, ~14 bits with FP8 operands (DeepSeek-V3's report),
            # so the running sum over a long sequence stays in fp32 registers.)
            p8 = as_operand(e.to(gl.float8e4nv), opts.V_ORDER, p_layout)
            pv_tok = warpgroup_mma(p8, ring.vt.index(s).permute((1, 0)), o_zero, use_acc=False, is_async=True)
            l_i = l_i * alpha + gl.sum(e, 1)
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
            pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv_tok, ))
        elif PV_E4M3:
            # P's scale per row of the tile, as in INT8: the tile's row maximum maps to 448
            p_scale = gl.exp2(tile_max - m_ref) * (1.0 / E4M3_MAX)
            p8 = as_operand(e.to(gl.float8e4nv), opts.V_ORDER, p_layout)
            pv_tok = warpgroup_mma(p8, ring.vt.index(s).permute((1, 0)), o_zero, use_acc=False, is_async=True)
            l_i = l_i * alpha + gl.sum(e, 1) * p_scale
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
            p_scale_o = gl.convert_layout(p_scale, gl.SliceLayout(1, o_layout))
            acc = acc * alpha_o[:, None]
            pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv_tok, ))
        else:
            p_scale = gl.exp2(tile_max - m_ref) * (1.0 / INT8_MAX)
            p8 = as_operand(round_to_int8(e), opts.V_ORDER, p_layout)
            pv_tok = warpgroup_mma(p8, ring.vt.index(s).permute((1, 0)), o_zero, use_acc=False, is_async=True)
            # while P V runs: the row sum, and the rescaled accumulator less the int32_times offset
            l_i = l_i * alpha + gl.sum(e, 1) * p_scale
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
            p_scale_o = gl.convert_layout(p_scale, gl.SliceLayout(1, o_layout))
            acc = gl.fma(acc, alpha_o[:, None], (p_scale_o * -FLOAT_ROUND_BIAS)[:, None])
            pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv_tok, ))
        if NAMED_BARRIERS:
            named_barrier(True, RELEASE_BARRIER + s, 32 + opts.CONSUMERS * 128, 4)
        else:
            mbarrier.arrive(ring.empty.index(s), count=1)
        it += 1
        if not PV_E4M3:
            acc = gl.fma((pv + FLOAT_ROUND_BIAS_BITS).to(gl.float32, bitcast=True), p_scale_o[:, None], acc)
        elif P_STATIC:
            acc = gl.fma(acc, alpha_o[:, None], pv)
        else:
            acc = gl.fma(pv, p_scale_o[:, None], acc)
        m_i = m_new
        ks = ks_next
    return acc, m_i, l_i, it, ks


@gluon.jit
def _consumer(C: gl.constexpr, turns, q_bufs, ring, mailbox, seqs, scales, outputs, terms, opts):
    """One warpgroup: rows ``[C * 64, C * 64 + 64)`` of each of the program's work items against all their key
    tiles, then the item's epilogue (its Q buffer released first, so the loader refills it meanwhile)."""
    HEAD_DIM_V: gl.constexpr = opts.HEAD_DIM_V
    SOFTCAP: gl.constexpr = opts.SOFTCAP
    SINK_MODE: gl.constexpr = opts.SINK_MODE
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N, 32)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM_V, 32)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    ROWS: gl.constexpr = opts.CONSUMERS * HALF_M
    O = outputs.O
    num_items = seqs.num_items

    if opts.PINGPONG and opts.NAMED_BARRIERS and turns.FIRST == 0:   # the other warpgroup's first turn
        named_barrier(True, TURN_BARRIER + 1, 256, 4)
    it = num_items * 0      # the ring's tile count, run on across items as the loader's
    j = num_items * 0
    t = mailbox.next(j)      # the loader's pick: past the last item means stop
    while t < num_items:
        item = _work_item(seqs, t, ROWS)
        bq = item.bt
        h = item.h
        q0 = item.q0
        qs_off = bq.to(gl.int64) * scales.s_qsb + h * scales.s_qsh + q0
        ks_off = item.bt.to(gl.int64) * scales.s_ksb + item.hk * scales.s_ksh + item.k0
        vs_off = item.b.to(gl.int64) * scales.s_vsb + item.hk * scales.s_vsh
        o_off = bq.to(gl.int64) * outputs.s_ob + h.to(gl.int64) * outputs.s_oh + q0.to(gl.int64) * outputs.s_ot
        lse_off = bq.to(gl.int64) * outputs.s_lb + h * outputs.s_lh + q0
        rows = item.start + C * HALF_M + gl.arange(0, HALF_M, layout=row_layout)
        m_ok = rows < item.seqlen_q
        # kept above zero: masked (-inf) scores are scaled by it, and an all-zero row has scale 0 (a NaN stays)
        q_scale = gl.maximum(gl.load(scales.QS + qs_off + rows, mask=m_ok, other=0.0), TINY_SCALE,
                             propagate_nan=KEEP_NAN)
        cap_a = q_scale     # unused unless SOFTCAP
        cap_b = q_scale
        if SOFTCAP:   # the score's dequantization and the shift back to the caller's scores, both over the cap
            inv_cap = 1.0 / terms.softcap2
            cap_a = q_scale * inv_cap
            cap_b = gl.load(terms.SHIFT + lse_off + rows, mask=m_ok, other=0.0) * inv_cap
            q_scale = gl.full([HALF_M], 0.0, gl.float32, row_layout) + terms.softcap2
        m_i = gl.full([HALF_M], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([HALF_M], gl.float32, row_layout)
        acc = gl.zeros([HALF_M, HEAD_DIM_V], gl.float32, o_layout)
        lo = item.lo
        hi = item.hi
        ks = gl.load(scales.KS + ks_off + lo, mask=lo < hi, other=0.0)

        mbarrier.wait(q_bufs.ready, ring_phase(j, 1))
        q = q_bufs.q.index(C)
        q2 = q_bufs.q2.index(C)
        row_consts = RowConstants(rows, q_scale, cap_a, cap_b, scales.KS, ks_off)
        # masked left edge, unmasked middle, masked right edge
        acc, m_i, l_i, it, ks = _consume(acc, m_i, l_i, it, ks, q, q2, ring, turns, row_consts, lo, item.full_lo,
                                         item, seqs, True, opts)
        acc, m_i, l_i, it, ks = _consume(acc, m_i, l_i, it, ks, q, q2, ring, turns, row_consts, item.full_lo,
                                         item.full_hi, item, seqs, False, opts)
        acc, m_i, l_i, it, ks = _consume(acc, m_i, l_i, it, ks, q, q2, ring, turns, row_consts, item.full_hi, hi,
                                         item, seqs, True, opts)
        mbarrier.arrive(q_bufs.empty, count=1)     # every S of the item was waited for: the next Q may land

        has_keys = l_i != 0.0   # (a NaN row sum stays NaN: forward.py)
        if opts.P_STATIC:   # l_i (and the accumulator) hold 448 times the sums
            lse = gl.where(has_keys, m_i + (gl.log2(l_i) - LOG2_448), float("inf"))
        else:
            lse = gl.where(has_keys, m_i + gl.log2(l_i), float("inf"))   # +inf: the backward's exp2(s - lse) is 0
        inv_l = gl.where(has_keys, 1.0 / l_i, 0.0)
        if SINK_MODE > 0:   # the head's sink joins the denominator, as in forward.py's epilogue
            sink_row = gl.full([HALF_M], 0.0, gl.float32, row_layout) + gl.load(terms.SINKS + h).to(gl.float32)
            if SINK_MODE == 2:
                sink_row = sink_row - gl.load(terms.SINK_SHIFT + lse_off + rows, mask=m_ok, other=0.0)
            sink2 = sink_row * LOG2E
            top = gl.maximum(lse, sink2)
            new_lse = top + gl.log2(gl.exp2(lse - top) + gl.exp2(sink2 - top))
            inv_l = gl.where(has_keys, gl.exp2(lse - new_lse) / l_i, 0.0)
            lse = gl.where(has_keys, new_lse, lse)
        gl.store(outputs.LSE + lse_off + rows, lse, mask=m_ok)
        if opts.WRITE_ROW_MAX:
            gl.store(outputs.ROW_MAX + lse_off + rows, m_i, mask=m_ok)
        inv_l = gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout))
        offs_d = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, o_layout))
        v_scale = gl.load(scales.VS + vs_off + offs_d)
        if opts.PV_E4M3:   # VS holds each channel's max |v| (quantize_v's e4m3): its scale is max / 448
            v_scale = v_scale * (1.0 / E4M3_MAX)
        out = acc * inv_l[:, None] * v_scale[None, :]
        rows_o = gl.convert_layout(rows, gl.SliceLayout(1, o_layout))
        # 64-bit token offsets: a [B, H, N, D] output can pass 2^31 elements
        ptrs = O + o_off + rows_o.to(gl.int64)[:, None] * outputs.s_ot + offs_d[None, :]
        gl.store(ptrs, out.to(O.dtype.element_ty), mask=(rows_o < item.seqlen_q)[:, None])
        j += 1
        t = mailbox.next(j)


@gluon.jit
def _attn_fwd_hopper_kernel(
    q_desc, k_desc, vt_desc, q2_desc, k2_desc, QS, KS, VS, O, LSE, CU_Q, CU_K, CU_VT, SINKS, SINK_SHIFT, SHIFT,
    COUNTER, ROW_MAX,
    s_qsb, s_qsh, s_ksb, s_ksh, s_vsb, s_vsh, s_ob, s_oh, s_ot, s_lb, s_lh,
    n_q, n_k, num_heads, num_kv_heads, group, window_left, window_right, softcap2, num_items, num_m,
    IS_VARLEN: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, HEAD_DIM_V: gl.constexpr,
    QK_SPLIT: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
    PINGPONG: gl.constexpr, SINK_MODE: gl.constexpr, V_ORDER: gl.constexpr,
    SOFTCAP: gl.constexpr, NAMED_BARRIERS: gl.constexpr, DYNAMIC: gl.constexpr,
    PV_E4M3: gl.constexpr = False, P_STATIC: gl.constexpr = False, WRITE_ROW_MAX: gl.constexpr = False,
):
    # each consumer's Q rows, the K / V^T ring
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(vt_desc.dtype, [STAGES] + vt_desc.block_type.shape, vt_desc.layout)
    if QK_SPLIT:
        q2_smem = gl.allocate_shared_memory(q2_desc.dtype, [CONSUMERS] + q2_desc.block_type.shape, q2_desc.layout)
        k2_smem = gl.allocate_shared_memory(k2_desc.dtype, [STAGES] + k2_desc.block_type.shape, k2_desc.layout)
    else:   # unused: buffers that exist stand in
        q2_smem = q_smem
        k2_smem = k_smem
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    item_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    item_smem = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    mbarrier.init(q_ready, count=1)      # the TMA bytes
    mbarrier.init(q_empty, count=CONSUMERS)     # every consumer releases Q
    mbarrier.init(item_bar, count=1)      # the loader posted the next item's index in item_smem
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)      # the TMA bytes
        mbarrier.init(empty.index(i), count=CONSUMERS)     # every consumer releases a buffer

    descs = ForwardDescriptors(q_desc, k_desc, vt_desc, q2_desc, k2_desc)
    q_bufs = QBuffers(q_smem, q2_smem, q_ready, q_empty)
    ring = KVRing(k_smem, k2_smem, v_smem, ready, empty)
    mailbox = ItemMailbox(item_smem, item_bar)
    seqs = Sequences(CU_Q, CU_K, CU_VT, n_q, n_k, num_heads, num_kv_heads, group, window_left, window_right,
                     num_items, num_m, IS_VARLEN, MASK_LEFT, MASK_RIGHT)
    scales = ForwardScales(QS, KS, VS, s_qsb, s_qsh, s_ksb, s_ksh, s_vsb, s_vsh)
    outputs = ForwardOutputs(O, LSE, ROW_MAX, s_ob, s_oh, s_ot, s_lb, s_lh)
    terms = ScoreTerms(softcap2, SHIFT, SINKS, SINK_SHIFT)
    opts = ForwardOptions(HEAD_DIM_V, QK_SPLIT, CONSUMERS, PINGPONG, NAMED_BARRIERS, V_ORDER, SOFTCAP, SINK_MODE,
                          DYNAMIC, PV_E4M3, P_STATIC, WRITE_ROW_MAX)
    # (the partition list must be written in the call: one built beforehand and extended for a third consumer
    # does not compile on Triton 3.6, "cannot convert JITFunction to tensor", hence one call per consumer count;
    # constexprs such as the consumer index go into each tuple literally)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (0, Turns(turn.index(0), turn.index(1), 1), q_bufs, ring, mailbox, seqs, scales, outputs,
                         terms, opts)),
            (_consumer, (1, Turns(turn.index(1), turn.index(0), 0), q_bufs, ring, mailbox, seqs, scales, outputs,
                         terms, opts)),
            (_loader, (descs, q_bufs, ring, mailbox, COUNTER, seqs, opts)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    else:   # three: 192 rows a program, no turns (FlashAttention 3's head-dim-64 tile)
        gl.static_assert(CONSUMERS == 3 and not PINGPONG, "2 consumer warpgroups, or 3 without ping-pong")
        gl.warp_specialize([
            (_consumer, (0, Turns(turn.index(0), turn.index(1), 1), q_bufs, ring, mailbox, seqs, scales, outputs,
                         terms, opts)),
            (_consumer, (1, Turns(turn.index(1), turn.index(0), 0), q_bufs, ring, mailbox, seqs, scales, outputs,
                         terms, opts)),
            (_consumer, (2, Turns(turn.index(0), turn.index(1), 0), q_bufs, ring, mailbox, seqs, scales, outputs,
                         terms, opts)),
            (_loader, (descs, q_bufs, ring, mailbox, COUNTER, seqs, opts)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])


__getattr__ = moved_to_hopper_launch(__name__, (
    'forward_hopper_args', 'launch_forward_hopper', 'persistent_grid', 'ptx_options', 'qk_blocks', 'shared_layout',
    'tma_descriptor'))
