"""SageBwd forward on Hopper (sm_90), in Gluon: warp-specialized, TMA-fed, async INT8 wgmma.

The same numerics as ``forward.py`` (the portable ``tl.dot`` kernel, and ``sagebwd_hf.naive``): per-token Q
scales, one K scale per 128 keys (``quantize.K_SCALE_BLOCK``, this kernel's key tile: one number a tile, folded
into each row's constant), P quantized per row of every BLOCK_N-key tile with that tile's row maximum mapped to
127, per-channel V scales applied at the end. Only the schedule differs, FlashAttention 3's:

* a work item is 128 query rows of one (sequence, head) (192 with three consumers); one program per SM takes
  items from an atomic counter (``programs``; FlashAttention 3's persistent schedule, longest causal items first)
  or one program runs one item. A program has three partitions: a loader warp that picks the items and brings
  each item's Q once and its K / V^T int8 tiles through a ring of ``STAGES`` shared-memory buffers by TMA (an
  mbarrier pair per buffer: ``ready`` when the bytes landed, ``empty`` when both consumers are done with it; or,
  with ``NAMED_BARRIERS``, a hardware barrier per buffer that every consumer thread arrives at), and two
  consumer warpgroups of 64 query rows each. Each consumer runs ``S = Q K^T`` and ``O += P V`` as async
  wgmma; while one warpgroup does its softmax the other's products can use the tensor cores.
* ``P`` goes to ``P V`` from registers (wgmma's A operand); V^T tiles are token-contiguous, as 8-bit wgmma
  wants its B operand K-major.
* the two consumers take turns to issue ``S = Q K^T`` (``PINGPONG``: ``dispatch.gluon_forward_pingpong`` says
  when); each reads the next tile's K scale one tile ahead, so it never waits on a global load mid-tile.
* ``consumers=3``: three consumer warpgroups (192 query rows a program, no turns, 160 registers each),
  FlashAttention 3's tile for head dim 64: spill-free there, a few spilled registers a tile at 128, faster at
  both without a mask (``dispatch.gluon_forward_consumers`` says when).

Status (docs/speed_notes.md, session 4, H100): kernel-only 1.16-1.26x the portable kernel at D=128 (4K-16K
keys), 1.02-1.09x at D=64; the default on Hopper through ``dispatch.py`` (for every length since session 21:
``GLUON_MIN_KEYS_D128``). Packed batches: TMA needs a 16-byte aligned innermost tile coordinate, so
this kernel reads V^T laid out by ``quantize.aligned_starts`` there; and items past a short sequence's end run
no tiles (tests/test_dispatch.py and the Transformers packing tests on an H100, session 5).

``SOFTCAP``: the scores capped as in forward.py (the K-smoothing shift added back, then ``cap * tanh(s / cap)``
with PTX's ``tanh.approx``), a compile-time option of the same kernel.

Head dims 64 and 128, and MLA's 192 for Q/K with 128 for V (``QK_SPLIT``: Q's and K's channels as two
power-of-two blocks, ``qk_blocks``); no Q-smoothing. Gluon's API moves between Triton releases; this file is
tested on the versions listed in ``dispatch.GLUON_TESTED``.
"""
import functools

import torch

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .dispatch import GLUON_HEAD_DIMS as HEAD_DIMS   # (Q/K, V) head dim pairs: see qk_blocks for 192
from .launch import launch
from .layout import cdiv
from .quantize import K_BLOCK_HEAD_DIMS, K_SCALE_BLOCK, LOG2E

# The TMA load is ``async_load`` from Triton 3.8 on (3.9 removed the old name); 3.6 and 3.7 have only
# ``async_copy_global_to_shared``. Same arguments in all four.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

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


HALF_M = gl.constexpr(64)     # query rows per consumer warpgroup (one wgmma M)
BLOCK_M = gl.constexpr(128)   # query rows per program: two consumers (three: 192, the ``consumers`` option)
BLOCK_N = gl.constexpr(128)   # keys per tile: part of the numerics (P's per-row scale is per tile), as forward.py;
                              # quantize.K_SCALE_BLOCK too (one K scale a tile)
STAGES = gl.constexpr(2)      # K / V^T buffers in flight
# Hardware barrier ids of the NAMED_BARRIERS schedule: the two turns, then one per ring buffer (Gluon's own
# partition barriers take ids 0-4)
TURN_BARRIER = gl.constexpr(8)
RELEASE_BARRIER = gl.constexpr(10)
LOG2_127 = gl.constexpr(6.988684686772166)


@gluon.constexpr_function
def wgmma_layout(n, k):
    """The register layout of one warpgroup's wgmma result ``[64 rows, n]`` (``k``: the instruction's depth, 32
    for 8-bit operands, 16 for 16-bit ones); every product's layout in these kernels and backward_hopper's."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, k])


# _round_to_int8 and _key_tiles repeat quantize.py's and forward.py's arithmetic (the S dequantization too, inline:
# quantize.int32_times): a Gluon kernel cannot call @triton.jit functions.

@gluon.jit
def _round_to_int8(x):
    return (x + 12582912.0).to(gl.int32, bitcast=True).to(gl.int8)


@gluon.jit
def _tanh_scores(y):
    """forward.tanh_scores in Gluon: ``tanh.approx.f32``, one MUFU op (the reasons there)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [y], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _operand_order(p):
    """A [64, 128] wgmma accumulator tile relabelled so that each thread's registers are, unchanged, the 8-bit
    A operand (k_width 4) of a product over its columns. In a 16-column group a thread holds accumulator
    columns {2t, 2t+1, 2t+8, 2t+9} (t: lane % 4) and the operand wants k = 4t..4t+3, so k's bits (k0, k1, k2, k3)
    are column bits (c0, c3, c1, c2): column c = sigma(k). Converting without the relabel costs shuffles and
    selects (16 SHFL, 16 SEL and 16 PRMT a tile at D=128); with it, the other operand's keys must come in
    sigma's order: quantize writes V^T so (``operand_order``), and the backward's token-major copies."""
    x = gl.reshape(p, [p.shape[0], p.shape[1] // 16, 2, 2, 2, 2])      # (row, c >> 4, c3, c2, c1, c0)
    return gl.reshape(gl.permute(x, (0, 1, 3, 4, 2, 5)), [p.shape[0], p.shape[1]])


@gluon.jit
def _as_operand(x8, ORDER: gl.constexpr, p_layout: gl.constexpr):
    """An int8 accumulator-layout tile as the wgmma A operand ``p_layout``: with ``ORDER`` read from its
    registers as they are (_operand_order; the other operand's tokens permuted to match), else moved by shuffles."""
    if ORDER:
        return gl.convert_layout(_operand_order(x8), p_layout, assert_trivial=True)
    return gl.convert_layout(x8, p_layout)


@gluon.jit
def _floor_to(x, BLOCK: gl.constexpr):
    return (gl.maximum(x, 0) // BLOCK) * BLOCK


@gluon.jit
def _ceil_to(x, BLOCK: gl.constexpr):
    return ((gl.maximum(x, 0) + BLOCK - 1) // BLOCK) * BLOCK


@gluon.jit
def _key_tiles(start_m, seqlen_q, seqlen_k, window_left, window_right,
               ROWS: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, BLOCK: gl.constexpr):
    """forward._key_tiles for ``ROWS`` query rows and ``BLOCK``-key tiles (keys past the end always masked):
    ``[lo, full_lo)`` and ``[full_hi, hi)`` need the mask, ``[full_lo, full_hi)`` does not."""
    diag = seqlen_k - seqlen_q
    hi = seqlen_k
    full_hi = _floor_to(seqlen_k, BLOCK)
    lo = seqlen_k * 0           # a tensor either way: partitions take no Python ints
    full_lo = lo
    if MASK_RIGHT:
        hi = gl.minimum(hi, start_m + ROWS + diag + window_right)
        full_hi = gl.minimum(full_hi, _floor_to(start_m + diag + window_right + 1, BLOCK))
    if MASK_LEFT:
        lo = _floor_to(start_m + diag - window_left, BLOCK)
        full_lo = _ceil_to(start_m + ROWS - 1 + diag - window_left, BLOCK)
    hi = _ceil_to(hi, BLOCK)
    full_lo = gl.minimum(gl.maximum(full_lo, lo), hi)
    full_hi = gl.minimum(gl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@gluon.jit
def _inside(r2, c2, seqlen_q, seqlen_k):
    """Which (query row ``r2``, key ``c2``) pairs lie inside both sequences: the mask of a kernel without a window
    band, whose masked tiles are the sequences' last ones (the form that kernel had before _tile_band_mask: with
    it, the unmasked tile loops of kernels without a band measured 1-3% slower, H100, though their loops kept
    their instruction counts)."""
    return (r2 < seqlen_q) & (c2 < seqlen_k)


@gluon.jit
def _tile_band_mask(offs_n, rows, start_n, seqlen_k, diag, window_left, window_right,
                    MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """Which (query row, key) pairs of the key tile at ``start_n`` a row sees (``offs_n``: the tile's columns
    0..BLOCK-1; forward._score_mask's rule: keys inside the sequence and the window band, bottom-right aligned by
    ``diag = seqlen_k - seqlen_q``), in the form that costs one compare a score and bound: every bound on a key is
    a bound on its column, per row (the band's edge, the sequence's last key) computed once a tile. Rows past the
    query sequence are not masked: nothing of theirs is stored (the outputs' and lse's stores are masked), and
    in the backward their lse is +inf (P is 0)."""
    last = rows * 0 + (seqlen_k - 1 - start_n)
    if MASK_RIGHT:
        last = gl.minimum(last, rows + diag + window_right - start_n)
    valid = offs_n[None, :] <= last[:, None]
    if MASK_LEFT:
        valid = valid & (offs_n[None, :] >= (rows + diag - window_left - start_n)[:, None])
    return valid


@gluon.jit
def _named_barrier(ARRIVE: gl.constexpr, bar_id, threads, WARPS: gl.constexpr):
    """``bar.arrive`` (ARRIVE) or ``bar.sync`` on hardware barrier ``bar_id`` (``threads`` take part in all) by
    every thread of this WARPS-warp partition. Each thread signals for itself: an mbarrier arrival is one thread's,
    so Gluon syncs the partition before it (a ``bar.sync`` of its warps per arrival)."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    op: gl.constexpr = "bar.arrive" if ARRIVE else "bar.sync"
    ids = gl.full([32 * WARPS], 0, gl.int32, one) + bar_id
    counts = gl.full([32 * WARPS], 0, gl.int32, one) + threads
    gl.inline_asm_elementwise(op + " $1, $2; mov.u32 $0, 0;", "=r,r,r", [ids, counts], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _split_item(t, num_tiles, num_heads, LONGEST_FIRST: gl.constexpr):
    """Work item ``t``, numbered tile fastest, as (tile, sequence, head); ``LONGEST_FIRST`` reverses the tiles
    (a causal call's last query tiles see the most keys)."""
    tile = t % num_tiles
    if LONGEST_FIRST:
        tile = num_tiles - 1 - tile
    bh = t // num_tiles
    return tile, bh // num_heads, bh % num_heads


@gluon.jit
def _work_item(t, num_items, num_m, CU_Q, CU_K, CU_VT, n_q, n_k, num_heads, group, window_left, window_right,
               IS_VARLEN: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, ROWS: gl.constexpr):
    """Work item ``t``: ``ROWS`` query rows of one (sequence, head). Items are numbered query tile fastest, so the
    programs running at once share a few heads' K and V in L2; with a causal (right) mask the last query tiles,
    which see the most keys, come first (FlashAttention 3's order: handed out in order, the long items start
    early and the short ones fill the tail). Returns its sequence, head, token starts, lengths and key-tile
    bounds (forward._key_tiles)."""
    valid = t < num_items
    pid_m, b, h = _split_item(t, num_m, num_heads, MASK_RIGHT)
    if IS_VARLEN:
        bc = gl.where(valid, b, 0)
        q0 = gl.load(CU_Q + bc)
        seqlen_q = gl.load(CU_Q + bc + 1) - q0
        k0 = gl.load(CU_K + bc)
        seqlen_k = gl.load(CU_K + bc + 1) - k0
        v0 = gl.load(CU_VT + bc)        # V^T's own, 16-aligned, sequence starts (quantize.aligned_starts)
        bq = b * 0
        bk = b * 0
    else:
        q0 = b * 0            # tensors, not constants: both branches must give one type
        seqlen_q = n_q + q0
        k0 = b * 0
        seqlen_k = n_k + k0
        v0 = k0
        bq = b
        bk = b
    start_m = pid_m * ROWS
    lo, full_lo, full_hi, hi = _key_tiles(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                          ROWS, MASK_LEFT, MASK_RIGHT, BLOCK_N)
    # An item past the end of its sequence (packed batches) runs no tiles. All four bounds go to 0: with a
    # window, such an item's lo can pass its hi, and then the loader (lo..hi) and the consumers' loops disagreed:
    # a hang.
    has_rows = (start_m < seqlen_q).to(gl.int32)
    return (b, h, h // group, bq, bk, q0, k0, v0, seqlen_q, seqlen_k, start_m,
            lo * has_rows, full_lo * has_rows, full_hi * has_rows, hi * has_rows)


@gluon.jit
def _post_item(item_smem, item_bar, t):
    """The loader tells the consumers which work item comes next (past the last: stop)."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    item_smem.store(gl.full([1], 0, gl.int32, one) + t)
    mbarrier.arrive(item_bar, count=1)


@gluon.jit
def _next_item(item_smem, item_bar, j):
    """A consumer warpgroup waits for the loader's ``j``-th posted item and reads its index."""
    mbarrier.wait(item_bar, j & 1)
    return gl.max(item_smem.load(gl.BlockedLayout([1], [32], [4], [0])), 0)


@gluon.jit
def _claim_item(t, COUNTER, DYNAMIC: gl.constexpr):
    """The loader's next work item after ``t``: with ``DYNAMIC`` the next one handed out (``COUNTER`` counts the
    items taken past each program's first, which is its program id), else ``t`` plus the number of programs."""
    if DYNAMIC:
        return gl.num_programs(0) + gl.atomic_add(COUNTER, 1)
    return t + gl.num_programs(0)


@gluon.jit
def _loader(q_desc, k_desc, vt_desc, q2_desc, k2_desc, q_smem, k_smem, v_smem, q2_smem, k2_smem, q_ready, q_empty,
            ready, empty, item_smem, item_bar, COUNTER, CU_Q, CU_K, CU_VT, n_q, n_k, num_heads, num_kv_heads, group,
            window_left, window_right, num_items, num_m, IS_VARLEN: gl.constexpr, MASK_LEFT: gl.constexpr,
            MASK_RIGHT: gl.constexpr, HEAD_DIM_V: gl.constexpr, QK_SPLIT: gl.constexpr,
            NAMED_BARRIERS: gl.constexpr, DYNAMIC: gl.constexpr):
    """One warp: picks the program's work items (its program id first, then the next from ``COUNTER``, an atomic
    count of items handed out, with ``DYNAMIC``; else every ``num_programs``-th), tells the consumers which
    (``item_smem``, ``item_bar``), loads every consumer's Q rows once they are done with the last item's (the
    next Q lands while their epilogue runs), then every K / V^T tile of the item's ``[lo, hi)`` into the ring,
    whose count runs on across items (with ``QK_SPLIT``, Q's and K's channels past the first block as tiles of
    their own: qk_blocks). An item index past the last tells the consumers to stop. One Q buffer, indexed by
    constants: with two, picked by the item's parity, wgmma read the wrong Q rows on Triton 3.6 (a run-time index
    of the A operand's shared memory; masked calls gave relative L2 0.5, H100, session 20)."""
    CONSUMERS: gl.constexpr = q_smem.shape[0]
    ROWS: gl.constexpr = CONSUMERS * HALF_M
    D1: gl.constexpr = q_desc.block_type.shape[1]
    q_bytes: gl.constexpr = q_desc.block_type.nbytes + (q2_desc.block_type.nbytes if QK_SPLIT else 0)
    nbytes: gl.constexpr = (k_desc.block_type.nbytes + vt_desc.block_type.nbytes
                            + (k2_desc.block_type.nbytes if QK_SPLIT else 0))
    i = num_items * 0
    j = num_items * 0
    t = gl.program_id(0) + j
    while t < num_items:
        (b, h, hk, bq, bk, q0, k0, v0, seqlen_q, seqlen_k, start_m, lo, full_lo, full_hi,
         hi) = _work_item(t, num_items, num_m, CU_Q, CU_K, CU_VT, n_q, n_k, num_heads, group, window_left,
                          window_right, IS_VARLEN, MASK_LEFT, MASK_RIGHT, ROWS)
        # rows of the 2-D views the descriptors see: Q8 [B*H*Nq, D], K8 [B*Hk*Nk, D], V8T [B*Hk*D, Nk_pad]
        q_row = (bq * num_heads + h) * n_q + q0 + start_m
        k_row = (bk * num_kv_heads + hk) * n_k + k0
        v_row = (bk * num_kv_heads + hk) * HEAD_DIM_V
        mbarrier.wait(q_empty, (j & 1) ^ 1)   # a fresh barrier's previous phase counts as complete
        _post_item(item_smem, item_bar, t)
        mbarrier.expect(q_ready, CONSUMERS * q_bytes)
        for c in gl.static_range(CONSUMERS):
            tma_load(q_desc, [q_row + c * HALF_M, 0], q_ready, q_smem.index(c))
            if QK_SPLIT:
                tma_load(q2_desc, [q_row + c * HALF_M, D1], q_ready, q2_smem.index(c))
        for start_n in range(lo, hi, BLOCK_N):
            s = i % STAGES
            if NAMED_BARRIERS:   # every consumer thread arrived when done with the buffer's last contents
                if i >= STAGES:
                    _named_barrier(False, RELEASE_BARRIER + s, 32 + CONSUMERS * 128, 1)
            else:   # a fresh barrier's "previous phase" counts as complete: the first STAGES waits pass at once
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma_load(k_desc, [k_row + start_n, 0], ready.index(s), k_smem.index(s))
            if QK_SPLIT:
                tma_load(k2_desc, [k_row + start_n, D1], ready.index(s), k2_smem.index(s))
            tma_load(vt_desc, [v_row, v0 + start_n], ready.index(s), v_smem.index(s))
            i += 1
        j += 1
        t = _claim_item(t, COUNTER, DYNAMIC)
    mbarrier.wait(q_empty, (j & 1) ^ 1)   # the consumers read the last item's index: the end may be posted
    _post_item(item_smem, item_bar, t)


@gluon.jit
def _consume(acc, m_i, l_i, it, ks, q, q2, k_smem, k2_smem, v_smem, ready, empty, turn_me, turn_other, KS, ks_off,
             rows, q_scale, cap_a, cap_b, lo, hi, seqlen_q, seqlen_k, window_left, window_right,
             MASKED: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
             PINGPONG: gl.constexpr, FIRST: gl.constexpr, V_ORDER: gl.constexpr,
             SOFTCAP: gl.constexpr, QK_SPLIT: gl.constexpr, NAMED_BARRIERS: gl.constexpr, CONSUMERS: gl.constexpr,
             IS_VARLEN: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Key tiles ``[lo, hi)`` for one warpgroup's 64 rows, each S = Q K^T waited for before its softmax.
    ``ks``: this tile's K scale, read a tile ahead (global-load latency stalled the loop when read after S).

    PINGPONG: the two warpgroups take turns to issue S (``turn_me`` / ``turn_other``), FlashAttention 3's
    scheduler barrier, so one's softmax tends to run under the other's products. (FlashAttention 3's
    in-warpgroup overlap, the next tile's S issued before this tile's softmax or once its P V is issued,
    measured 0.49-0.94x on an H100, session 16: unrolled by two so each in-flight S keeps its registers, the
    loop each warpgroup runs doubles and the instruction cache misses; docs/speed_notes.md.)"""
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.int32, s_layout)
    o_zero = gl.zeros(acc.shape, gl.int32, o_layout)
    diag = seqlen_k - seqlen_q
    # In band-masked loops the next tile's K scale comes through a pointer of its own: with start_n in the
    # address, LLVM widened the loop counter to 64 bits, and every key index and mask compare with it (a masked
    # tile at D=64 causal: 1,039 instructions a thread, 945 without the widening, 842 with _tile_band_mask).
    # Elsewhere the address keeps start_n: a kernel without a band compiles as it did before (see _inside).
    # Packed batches too: there the key offset is a loaded sequence start, and the widening came back in every
    # loop (an unmasked tile at D=128 reloaded two spilled registers, a masked one 1,099 instructions against 859).
    BAND: gl.constexpr = MASKED and (MASK_LEFT or MASK_RIGHT)
    KS_PTR: gl.constexpr = BAND or IS_VARLEN
    if KS_PTR:
        ks_ptr = KS + ks_off + lo + BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        if PINGPONG:
            if NAMED_BARRIERS:
                _named_barrier(False, TURN_BARRIER + FIRST, 256, 4)
            else:
                mbarrier.wait(turn_me, (it & 1) ^ FIRST)
        s_tok = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if QK_SPLIT:    # the channels past the first power-of-two block, into the same int32 scores
            s_tok = warpgroup_mma(q2, k2_smem.index(s).permute((1, 0)), s_tok, is_async=True)
        if PINGPONG:
            if NAMED_BARRIERS:
                _named_barrier(True, TURN_BARRIER + 1 - FIRST, 256, 4)
            else:
                mbarrier.arrive(turn_other, count=1)
        if KS_PTR:
            ks_next = gl.load(ks_ptr, mask=start_n + BLOCK_N < seqlen_k, other=0.0)
            ks_ptr += BLOCK_N
        else:
            cols = start_n + offs_n
            ks_next = gl.load(KS + ks_off + start_n + BLOCK_N, mask=start_n + BLOCK_N < seqlen_k, other=0.0)
        # The scores as x = 1.5 * 2^23 + S_int read as a float (quantize.int32_times), scaled per row: the K
        # scale is one number a tile, so it joins the row's Q scale (a per-key scale cost one FMA a score).
        s_int = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        t = (s_int + 0x4B400000).to(gl.float32, bitcast=True)
        if SOFTCAP:   # tanh((s + shift) / cap), s = ks * (x - 1.5 * 2^23): q_scale is the cap then (forward._fwd_tile)
            t_mul = cap_a * ks
            t = _tanh_scores(gl.fma(t, t_mul[:, None], (cap_b - t_mul * 12582912.0)[:, None]))
            row_mul = q_scale
            row_add = q_scale * 0.0
        else:   # floored: with an all-zero K tile (scale 0) a masked score would be -inf * 0
            row_mul = gl.maximum(q_scale * ks, 1e-37)
            row_add = row_mul * -12582912.0
        if BAND or (MASKED and IS_VARLEN):
            t = gl.where(_tile_band_mask(offs_n, rows, start_n, seqlen_k, diag, window_left, window_right, MASK_LEFT,
                                         MASK_RIGHT), t, float("-inf"))
        elif MASKED:
            t = gl.where(_inside(rows[:, None], cols[None, :], seqlen_q, seqlen_k), t, float("-inf"))
        tile_max = gl.fma(gl.max(t, 1), row_mul, row_add)
        m_new = gl.maximum(m_i, tile_max)
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_ref)
        e_ref = gl.where(tile_max == float("-inf"), 0.0, tile_max - LOG2_127)
        e = gl.exp2(gl.fma(t, row_mul[:, None], (row_add - e_ref)[:, None]))
        p_scale = gl.exp2(tile_max - m_ref) * (1.0 / 127.0)
        p8 = _as_operand(_round_to_int8(e), V_ORDER, p_layout)
        pv_tok = warpgroup_mma(p8, v_smem.index(s).permute((1, 0)), o_zero, use_acc=False, is_async=True)
        # while P V runs: the row sum, and the rescaled accumulator less the int32_times offset
        l_i = l_i * alpha + gl.sum(e, 1) * p_scale
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
        p_scale_o = gl.convert_layout(p_scale, gl.SliceLayout(1, o_layout))
        acc = gl.fma(acc, alpha_o[:, None], (p_scale_o * -12582912.0)[:, None])
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv_tok, ))
        if NAMED_BARRIERS:
            _named_barrier(True, RELEASE_BARRIER + s, 32 + CONSUMERS * 128, 4)
        else:
            mbarrier.arrive(empty.index(s), count=1)
        it += 1
        acc = gl.fma((pv + 0x4B400000).to(gl.float32, bitcast=True), p_scale_o[:, None], acc)
        m_i = m_new
        ks = ks_next
    return acc, m_i, l_i, it, ks


@gluon.jit
def _consumer(q_smem, q2_smem, C: gl.constexpr, k_smem, k2_smem, v_smem, q_ready, q_empty, ready, empty, item_smem,
              item_bar, turn_me, turn_other, QS, KS, VS, O, LSE, CU_Q, CU_K, CU_VT, SINKS, SINK_SHIFT, SHIFT,
              s_qsb, s_qsh, s_ksb, s_ksh, s_vsb, s_vsh, s_ob, s_oh, s_ot, s_lb, s_lh,
              n_q, n_k, num_heads, group, window_left, window_right, softcap2, num_items, num_m,
              IS_VARLEN: gl.constexpr, HEAD_DIM_V: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
              PINGPONG: gl.constexpr, FIRST: gl.constexpr, SINK_MODE: gl.constexpr,
              V_ORDER: gl.constexpr, SOFTCAP: gl.constexpr, QK_SPLIT: gl.constexpr, NAMED_BARRIERS: gl.constexpr,
              CONSUMERS: gl.constexpr):
    """One warpgroup: rows ``[C * 64, C * 64 + 64)`` of each of the program's work items against all their key
    tiles, then the item's epilogue (its Q buffer released first, so the loader refills it meanwhile)."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N, 32)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM_V, 32)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    ROWS: gl.constexpr = CONSUMERS * HALF_M

    if PINGPONG and NAMED_BARRIERS and FIRST == 0:   # the other warpgroup's first turn
        _named_barrier(True, TURN_BARRIER + 1, 256, 4)
    it = num_items * 0      # the ring's tile count, run on across items as the loader's
    j = num_items * 0
    t = _next_item(item_smem, item_bar, j)      # the loader's pick: past the last item means stop
    while t < num_items:
        (b, h, hk, bq, bk, q0, k0, v0, seqlen_q, seqlen_k, start_m, lo, full_lo, full_hi,
         hi) = _work_item(t, num_items, num_m, CU_Q, CU_K, CU_VT, n_q, n_k, num_heads, group, window_left,
                          window_right, IS_VARLEN, MASK_LEFT, MASK_RIGHT, ROWS)
        qs_off = bq.to(gl.int64) * s_qsb + h * s_qsh + q0
        ks_off = bk.to(gl.int64) * s_ksb + hk * s_ksh + k0
        vs_off = b.to(gl.int64) * s_vsb + hk * s_vsh
        o_off = bq.to(gl.int64) * s_ob + h.to(gl.int64) * s_oh + q0.to(gl.int64) * s_ot
        lse_off = bq.to(gl.int64) * s_lb + h * s_lh + q0
        rows = start_m + C * HALF_M + gl.arange(0, HALF_M, layout=row_layout)
        m_ok = rows < seqlen_q
        # kept above zero: masked (-inf) scores are scaled by it, and an all-zero row has scale 0
        q_scale = gl.maximum(gl.load(QS + qs_off + rows, mask=m_ok, other=0.0), 1e-30)
        cap_a = q_scale     # unused unless SOFTCAP
        cap_b = q_scale
        if SOFTCAP:   # the score's dequantization and the shift back to the caller's scores, both over the cap
            inv_cap = 1.0 / softcap2
            cap_a = q_scale * inv_cap
            cap_b = gl.load(SHIFT + lse_off + rows, mask=m_ok, other=0.0) * inv_cap
            q_scale = gl.full([HALF_M], 0.0, gl.float32, row_layout) + softcap2
        m_i = gl.full([HALF_M], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([HALF_M], gl.float32, row_layout)
        acc = gl.zeros([HALF_M, HEAD_DIM_V], gl.float32, o_layout)
        ks = gl.load(KS + ks_off + lo, mask=lo < hi, other=0.0)

        mbarrier.wait(q_ready, j & 1)
        q = q_smem.index(C)
        q2 = q2_smem.index(C)
        # masked left edge, unmasked middle, masked right edge
        acc, m_i, l_i, it, ks = _consume(acc, m_i, l_i, it, ks, q, q2, k_smem, k2_smem, v_smem, ready, empty,
                                         turn_me, turn_other, KS, ks_off, rows, q_scale, cap_a, cap_b, lo,
                                         full_lo, seqlen_q, seqlen_k, window_left, window_right, True,
                                         MASK_LEFT, MASK_RIGHT, PINGPONG, FIRST, V_ORDER, SOFTCAP,
                                         QK_SPLIT, NAMED_BARRIERS, CONSUMERS, IS_VARLEN, s_layout, o_layout, p_layout)
        acc, m_i, l_i, it, ks = _consume(acc, m_i, l_i, it, ks, q, q2, k_smem, k2_smem, v_smem, ready, empty,
                                         turn_me, turn_other, KS, ks_off, rows, q_scale, cap_a, cap_b, full_lo,
                                         full_hi, seqlen_q, seqlen_k, window_left, window_right, False,
                                         MASK_LEFT, MASK_RIGHT, PINGPONG, FIRST, V_ORDER, SOFTCAP,
                                         QK_SPLIT, NAMED_BARRIERS, CONSUMERS, IS_VARLEN, s_layout, o_layout, p_layout)
        acc, m_i, l_i, it, ks = _consume(acc, m_i, l_i, it, ks, q, q2, k_smem, k2_smem, v_smem, ready, empty,
                                         turn_me, turn_other, KS, ks_off, rows, q_scale, cap_a, cap_b, full_hi,
                                         hi, seqlen_q, seqlen_k, window_left, window_right, True,
                                         MASK_LEFT, MASK_RIGHT, PINGPONG, FIRST, V_ORDER, SOFTCAP,
                                         QK_SPLIT, NAMED_BARRIERS, CONSUMERS, IS_VARLEN, s_layout, o_layout, p_layout)
        mbarrier.arrive(q_empty, count=1)     # every S of the item was waited for: the next Q may land

        has_keys = l_i > 0
        lse = gl.where(has_keys, m_i + gl.log2(l_i), float("inf"))   # +inf: the backward's exp2(s - lse) is 0
        inv_l = gl.where(has_keys, 1.0 / l_i, 0.0)
        if SINK_MODE > 0:   # the head's sink joins the denominator, as in forward.py's epilogue
            sink_row = gl.full([HALF_M], 0.0, gl.float32, row_layout) + gl.load(SINKS + h).to(gl.float32)
            if SINK_MODE == 2:
                sink_row = sink_row - gl.load(SINK_SHIFT + lse_off + rows, mask=m_ok, other=0.0)
            sink2 = sink_row * 1.4426950408889634
            top = gl.maximum(lse, sink2)
            new_lse = top + gl.log2(gl.exp2(lse - top) + gl.exp2(sink2 - top))
            inv_l = gl.where(has_keys, gl.exp2(lse - new_lse) / l_i, 0.0)
            lse = gl.where(has_keys, new_lse, lse)
        gl.store(LSE + lse_off + rows, lse, mask=m_ok)
        inv_l = gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout))
        offs_d = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, o_layout))
        v_scale = gl.load(VS + vs_off + offs_d)
        out = acc * inv_l[:, None] * v_scale[None, :]
        rows_o = gl.convert_layout(rows, gl.SliceLayout(1, o_layout))
        # 64-bit token offsets: a [B, H, N, D] output can pass 2^31 elements
        ptrs = O + o_off + rows_o.to(gl.int64)[:, None] * s_ot + offs_d[None, :]
        gl.store(ptrs, out.to(O.dtype.element_ty), mask=(rows_o < seqlen_q)[:, None])
        j += 1
        t = _next_item(item_smem, item_bar, j)


@gluon.jit
def _attn_fwd_hopper_kernel(
    q_desc, k_desc, vt_desc, q2_desc, k2_desc, QS, KS, VS, O, LSE, CU_Q, CU_K, CU_VT, SINKS, SINK_SHIFT, SHIFT,
    COUNTER,
    s_qsb, s_qsh, s_ksb, s_ksh, s_vsb, s_vsh, s_ob, s_oh, s_ot, s_lb, s_lh,
    n_q, n_k, num_heads, num_kv_heads, group, window_left, window_right, softcap2, num_items, num_m,
    IS_VARLEN: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, HEAD_DIM_V: gl.constexpr,
    QK_SPLIT: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
    PINGPONG: gl.constexpr, SINK_MODE: gl.constexpr, V_ORDER: gl.constexpr,
    SOFTCAP: gl.constexpr, NAMED_BARRIERS: gl.constexpr, DYNAMIC: gl.constexpr,
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

    # (constexprs go into each tuple literally: a tuple built beforehand turns them into tensors; and the partition
    # list must be written in the call: one built beforehand and extended for a third consumer does not compile
    # on Triton 3.6, "cannot convert JITFunction to tensor", hence one call per consumer count)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (q_smem, q2_smem, 0, k_smem, k2_smem, v_smem, q_ready, q_empty, ready, empty, item_smem,
                         item_bar, turn.index(0), turn.index(1), QS, KS, VS, O, LSE, CU_Q, CU_K, CU_VT, SINKS,
                         SINK_SHIFT, SHIFT, s_qsb, s_qsh, s_ksb, s_ksh, s_vsb, s_vsh, s_ob, s_oh, s_ot, s_lb, s_lh,
                         n_q, n_k, num_heads, group, window_left, window_right, softcap2, num_items, num_m,
                         IS_VARLEN, HEAD_DIM_V, MASK_LEFT, MASK_RIGHT, PINGPONG, 1, SINK_MODE, V_ORDER,
                         SOFTCAP, QK_SPLIT, NAMED_BARRIERS, 2)),
            (_consumer, (q_smem, q2_smem, 1, k_smem, k2_smem, v_smem, q_ready, q_empty, ready, empty, item_smem,
                         item_bar, turn.index(1), turn.index(0), QS, KS, VS, O, LSE, CU_Q, CU_K, CU_VT, SINKS,
                         SINK_SHIFT, SHIFT, s_qsb, s_qsh, s_ksb, s_ksh, s_vsb, s_vsh, s_ob, s_oh, s_ot, s_lb, s_lh,
                         n_q, n_k, num_heads, group, window_left, window_right, softcap2, num_items, num_m,
                         IS_VARLEN, HEAD_DIM_V, MASK_LEFT, MASK_RIGHT, PINGPONG, 0, SINK_MODE, V_ORDER,
                         SOFTCAP, QK_SPLIT, NAMED_BARRIERS, 2)),
            (_loader, (q_desc, k_desc, vt_desc, q2_desc, k2_desc, q_smem, k_smem, v_smem, q2_smem, k2_smem, q_ready,
                       q_empty, ready, empty, item_smem, item_bar, COUNTER, CU_Q, CU_K, CU_VT, n_q, n_k, num_heads,
                       num_kv_heads, group, window_left, window_right, num_items, num_m, IS_VARLEN, MASK_LEFT,
                       MASK_RIGHT, HEAD_DIM_V, QK_SPLIT, NAMED_BARRIERS, DYNAMIC)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    else:   # three: 192 rows a program, no turns (FlashAttention 3's head-dim-64 tile)
        gl.static_assert(CONSUMERS == 3 and not PINGPONG, "2 consumer warpgroups, or 3 without ping-pong")
        gl.warp_specialize([
            (_consumer, (q_smem, q2_smem, 0, k_smem, k2_smem, v_smem, q_ready, q_empty, ready, empty, item_smem,
                         item_bar, turn.index(0), turn.index(1), QS, KS, VS, O, LSE, CU_Q, CU_K, CU_VT, SINKS,
                         SINK_SHIFT, SHIFT, s_qsb, s_qsh, s_ksb, s_ksh, s_vsb, s_vsh, s_ob, s_oh, s_ot, s_lb, s_lh,
                         n_q, n_k, num_heads, group, window_left, window_right, softcap2, num_items, num_m,
                         IS_VARLEN, HEAD_DIM_V, MASK_LEFT, MASK_RIGHT, False, 1, SINK_MODE, V_ORDER,
                         SOFTCAP, QK_SPLIT, NAMED_BARRIERS, 3)),
            (_consumer, (q_smem, q2_smem, 1, k_smem, k2_smem, v_smem, q_ready, q_empty, ready, empty, item_smem,
                         item_bar, turn.index(1), turn.index(0), QS, KS, VS, O, LSE, CU_Q, CU_K, CU_VT, SINKS,
                         SINK_SHIFT, SHIFT, s_qsb, s_qsh, s_ksb, s_ksh, s_vsb, s_vsh, s_ob, s_oh, s_ot, s_lb, s_lh,
                         n_q, n_k, num_heads, group, window_left, window_right, softcap2, num_items, num_m,
                         IS_VARLEN, HEAD_DIM_V, MASK_LEFT, MASK_RIGHT, False, 0, SINK_MODE, V_ORDER,
                         SOFTCAP, QK_SPLIT, NAMED_BARRIERS, 3)),
            (_consumer, (q_smem, q2_smem, 2, k_smem, k2_smem, v_smem, q_ready, q_empty, ready, empty, item_smem,
                         item_bar, turn.index(0), turn.index(1), QS, KS, VS, O, LSE, CU_Q, CU_K, CU_VT, SINKS,
                         SINK_SHIFT, SHIFT, s_qsb, s_qsh, s_ksb, s_ksh, s_vsb, s_vsh, s_ob, s_oh, s_ot, s_lb, s_lh,
                         n_q, n_k, num_heads, group, window_left, window_right, softcap2, num_items, num_m,
                         IS_VARLEN, HEAD_DIM_V, MASK_LEFT, MASK_RIGHT, False, 0, SINK_MODE, V_ORDER,
                         SOFTCAP, QK_SPLIT, NAMED_BARRIERS, 3)),
            (_loader, (q_desc, k_desc, vt_desc, q2_desc, k2_desc, q_smem, k_smem, v_smem, q2_smem, k2_smem, q_ready,
                       q_empty, ready, empty, item_smem, item_bar, COUNTER, CU_Q, CU_K, CU_VT, n_q, n_k, num_heads,
                       num_kv_heads, group, window_left, window_right, num_items, num_m, IS_VARLEN, MASK_LEFT,
                       MASK_RIGHT, HEAD_DIM_V, QK_SPLIT, NAMED_BARRIERS, DYNAMIC)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])


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
    if not (base.data_ptr() % 16 == 0 and strides[-1] == 1 and all(st * esize % 16 == 0 for st in strides[:-1])
            and min(shape) > 0):
        raise ValueError(f"TMA cannot address this memory: base {base.data_ptr():#x}, shape {list(shape)}, "
                         f"strides {list(strides)}, {esize}-byte elements")
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=base, shape=list(shape), strides=list(strides), block_shape=list(block_shape),
                         layout=shared_layout(tuple(block_shape), dtype), padding="zero")
    return desc


def _tma_desc(x2d, block_shape, dtype=gl.int8):
    """A TMA descriptor over a 2-D view: int8 tiles here, bf16/fp16 ones too in backward_hopper."""
    return tma_descriptor(x2d, x2d.shape, x2d.stride(), block_shape, dtype)


def qk_blocks(head_dim):
    """Q's and K's channels as (first, second) power-of-two blocks (Gluon tiles have power-of-two shapes):
    192 (MLA) -> (128, 64); 64 or 128 -> (that, 0)."""
    first = min(head_dim, 128)
    assert head_dim - first in (0, 64), head_dim
    return first, head_dim - first


def persistent_grid(num_items, programs, stand_in):
    """(grid, counter, dynamic) of a launch over ``num_items`` work items: ``programs`` persistent programs that
    take items from a zeroed int32 counter of the items handed out past each program's first (``dynamic``), when
    that is fewer than the items; else one program an item (``stand_in``: a tensor passed as the unused counter)."""
    if not (programs and programs < num_items):
        return (num_items, ), stand_in, False
    return (programs, ), torch.zeros(1, dtype=torch.int32, device=stand_in.device), True


def forward_hopper_args(quant, v8t, v_scale, out4, lse, layout_q, layout_k, num_heads, group, head_dim,
                        window, v_starts=None, consumers=2, consumer_regs=None, loader_regs=24, pingpong=None,
                        sinks=None, sink_shift=None, softcap=0.0, shift=None, named_barriers=None,
                        programs=None, v_operand_order=False):
    """(grid, args, kwargs) of the kernel for forward.launch_forward's contract (``sinks``, ``sink_shift``,
    ``softcap``, ``shift`` as there). ``pingpong`` defaults to on at V's head dim 128 and off at 64; the op
    passes ``dispatch.gluon_forward_pingpong``'s choice (session 26: off is faster for short unmasked calls and
    MLA's head dims).
    ``named_barriers``: the turns and the buffer releases on hardware named barriers, each thread arriving for
    itself, instead of mbarriers (whose one-thread arrivals Gluon precedes with a ``bar.sync`` of the warpgroup:
    three of a tile's four go); default on at V's head dim 128, where kernels alone ran 1.00-1.05x faster with two
    consumers and 1.01-1.04x with three (H100, session 18), off at 64 (0.98-1.03x).
    ``programs``: launch this many programs (``dispatch.gluon_programs``: one per SM), each taking work
    items (the query rows of one sequence and head) from an atomic counter until none is left, so the next item's
    Q and first K / V tiles load while this one's epilogue runs, and causal calls' items of unequal length balance
    (a static round-robin did not: session 20); None (or at least one per item): one program per work item.
    ``v_operand_order``: ``v8t`` from ``quantize_v(..., operand_order=True)`` (each 16 keys in the order P's
    registers hold them, so P goes to ``P V`` without shuffles: kernels alone 1.01-1.11x, session 21); the op's."""
    assert sink_shift is None or (sinks is not None and sink_shift.stride() == lse.stride())
    assert not softcap or (shift is not None and shift.stride() == lse.stride())
    assert not (softcap and sink_shift is not None), "capped scores are already the caller's"
    if consumers not in (2, 3):
        raise ValueError(f"consumers must be 2 or 3, got {consumers!r}")
    if pingpong is None:
        pingpong = out4.shape[3] == 128 and consumers == 2
    if named_barriers is None:
        named_barriers = out4.shape[3] == 128
    if consumer_regs is None:   # what one SM's 64K registers give each consumer warpgroup beside the loader
        consumer_regs = {2: 240, 3: 160}[consumers]
    q8, k8, q_scale, k_scale = quant["q8"], quant["k8"], quant["q_scale"], quant["k_scale"]
    head_dim_v = out4.shape[3]
    assert quant["q_mean"] is None and (head_dim, head_dim_v) in HEAD_DIMS and out4.stride(3) == 1
    assert head_dim in K_BLOCK_HEAD_DIMS and K_SCALE_BLOCK == BLOCK_N.value, "one K scale a key tile"
    bsz, hq, n_q, d = q8.shape
    hk, n_k = k8.shape[1], k8.shape[2]
    d1, d2 = qk_blocks(d)
    q_desc = _tma_desc(q8.view(-1, d), [HALF_M.value, d1])
    k_desc = _tma_desc(k8.view(-1, d), [BLOCK_N.value, d1])
    q2_desc = _tma_desc(q8.view(-1, d), [HALF_M.value, d2]) if d2 else q_desc
    k2_desc = _tma_desc(k8.view(-1, d), [BLOCK_N.value, d2]) if d2 else k_desc
    vt_desc = _tma_desc(v8t.view(-1, v8t.shape[-1]), [head_dim_v, BLOCK_N.value])
    cu_q = layout_q.cu_seqlens if layout_q.is_varlen else q_scale
    cu_k = layout_k.cu_seqlens if layout_k.is_varlen else q_scale
    if layout_k.is_varlen and v_starts is None:
        raise ValueError("packed batches need v8t laid out with quantize.aligned_starts, passed as v_starts")
    num_m = cdiv(layout_q.max_len, consumers * HALF_M.value)
    num_items = num_m * layout_q.num_seqs * num_heads
    grid, counter, dynamic = persistent_grid(num_items, programs, lse)
    return grid, (
        q_desc, k_desc, vt_desc, q2_desc, k2_desc, q_scale, k_scale, v_scale, out4, lse, cu_q, cu_k,
        v_starts if v_starts is not None else cu_k, sinks if sinks is not None else lse,
        sink_shift if sink_shift is not None else lse, shift if softcap else lse, counter,
        q_scale.stride(0), q_scale.stride(1), k_scale.stride(0), k_scale.stride(1),
        v_scale.stride(0), v_scale.stride(1), *out4.stride()[:3], lse.stride(0), lse.stride(1),
        n_q, n_k, num_heads, hk, group, window[0], window[1], float(softcap) * LOG2E, num_items, num_m,
    ), dict(IS_VARLEN=layout_q.is_varlen, MASK_LEFT=window[0] >= 0, MASK_RIGHT=window[1] >= 0,
            HEAD_DIM_V=head_dim_v, QK_SPLIT=bool(d2), CONSUMERS=consumers, CONSUMER_REGS=consumer_regs,
            LOADER_REGS=loader_regs, PINGPONG=pingpong,
            SINK_MODE=0 if sinks is None else 2 if sink_shift is not None else 1,
            V_ORDER=v_operand_order,
            SOFTCAP=bool(softcap), NAMED_BARRIERS=bool(named_barriers), DYNAMIC=dynamic, num_warps=4,
            ptx_options=ptx_options())


def launch_forward_hopper(quant, v8t, v_scale, out4, lse, layout_q, layout_k, num_heads, group, head_dim, window,
                          **tuning):
    """forward.launch_forward's contract on the Gluon kernel: ``out4`` ``[B, Hq, N, D]`` (any strides) and
    ``lse`` ``[B, Hq, N]`` fp32 are written. Needs (head_dim, V's) in ``HEAD_DIMS`` and no Q-smoothing; a packed
    batch needs ``v8t`` from ``quantize_v(..., t_starts=aligned_starts(layout_k))`` and those starts as ``v_starts``."""
    grid, args, kwargs = forward_hopper_args(quant, v8t, v_scale, out4, lse, layout_q, layout_k, num_heads, group,
                                             head_dim, window, **tuning)
    return launch(_attn_fwd_hopper_kernel, grid, *args, **kwargs)
