"""Gluon helpers the Hopper kernels (forward_hopper.py, backward_hopper_dkdv.py, backward_hopper_dq.py) inline: the
numbers and the rounding and score math they share with the portable kernels, the key-tile ranges and masks of a
work item, the TMA ring's buffer and barrier phases, the loader's work-item hand-off to the consumers (an atomic
counter, a one-slot mailbox), hardware named barriers, the TMA reduce-add, and the register relabelling that feeds a
wgmma accumulator to the next product as its A operand.

Each is a ``@gluon.jit`` function inlined where it is called (a Gluon kernel cannot call ``@triton.jit`` ones, so
the few lines that repeat quantize.py's and forward.py's arithmetic are written again here). What travels together
between the kernels' partitions and helpers is grouped in aggregates (``aggregate``): the batch's sequences, a work
item, the item mailbox here; each kernel's buffers, descriptors, tensors and options in its own module.
"""
from typing import Union

from triton._C.libtriton import ir as _ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin as gl_builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.language.core import PropagateNan, _aggregate, _unwrap_if_constexpr, base_value

from . import constants

# A launch's integer argument as a kernel sees it: a run-time value, or the constant Triton specializes a 1 to
Scalar = Union[gl.tensor, gl.constexpr]

# constants.py's numbers as the Gluon kernels read them (a jit function reads only constexpr globals): INT8's and
# FP8 e4m3's largest values and their log2 (with the pv_e4m3 rule P's and dO's largest value maps to 448), the
# smallest max |x| that gets a scale, the float-add rounding trick's bias and its bits, log2(e)
INT8_MAX = gl.constexpr(constants.INT8_MAX)
LOG2_127 = gl.constexpr(constants.LOG2_127)
E4M3_MAX = gl.constexpr(constants.E4M3_MAX)
LOG2_448 = gl.constexpr(constants.LOG2_448)
TINY_SCALE = gl.constexpr(constants.TINY_SCALE)
FLOAT_ROUND_BIAS = gl.constexpr(constants.FLOAT_ROUND_BIAS)
FLOAT_ROUND_BIAS_BITS = gl.constexpr(constants.FLOAT_ROUND_BIAS_BITS)
LOG2E = gl.constexpr(constants.LOG2E)


def aggregate(cls):
    """Gluon's aggregate (a class of typed fields that @gluon.jit functions take and return as one value, as
    Triton's Gluon attention tutorial groups its state), built from its fields given in order: ``X(a, b, ...)``.
    Triton 3.9 writes that constructor itself; 3.6 wants one that runs at compile time (a constexpr function,
    which receives constants unwrapped: they are wrapped again here)."""
    names = tuple(cls.__annotations__)

    def __init__(self, *values):
        assert len(values) == len(names), f"{type(self).__name__} takes {len(names)} fields, got {len(values)}"
        for name, value in zip(names, values):
            setattr(self, name, value if isinstance(value, base_value) else gl.constexpr(value))

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = gluon.constexpr_function(__init__)
    return _aggregate(cls)

# The TMA load is ``async_load`` from Triton 3.8 on (3.9 removed the old name); 3.6 and 3.7 have only
# ``async_copy_global_to_shared``. Same arguments in all four.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gl_builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Triton 3.8's ``tma.async_atomic_add`` (a TMA reduce-add from shared memory) for 3.6 and 3.7, whose Gluon
    builder has the op but no function for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


tma_atomic_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add


@gluon.constexpr_function
def wgmma_layout(n, k):
    """The register layout of one warpgroup's wgmma result ``[64 rows, n]`` (``k``: the instruction's depth, 32
    for 8-bit operands, 16 for 16-bit ones); every product's layout in these kernels and backward_hopper's."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, k])


# gl.maximum's NaN rule for the scales and clamps: NaN wins (PTX max.NaN, the cost of max), so a NaN or inf input
# reaches the outputs as in SDPA instead of dropping out of its block's scale (quantize.nan_max)
KEEP_NAN = gl.constexpr(PropagateNan.ALL)


@gluon.jit
def _max_keeping_nan(a, b):
    return gl.maximum(a, b, propagate_nan=KEEP_NAN)


@gluon.jit
def nan_max(x, axis: gl.constexpr):
    """The largest element over ``axis``, NaN where any element is NaN or inf (quantize.nan_max)."""
    m = gl.reduce(x, axis, _max_keeping_nan)
    return gl.where(m == float("inf"), float("nan"), m)


@gluon.jit
def round_to_int8(x):
    return (x + FLOAT_ROUND_BIAS).to(gl.int32, bitcast=True).to(gl.int8)


@gluon.jit
def tanh_scores(y):
    """forward.tanh_scores in Gluon: ``tanh.approx.f32``, one MUFU op (the reasons there)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [y], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def to_operand_order(p):
    """A [64, 128] wgmma accumulator tile relabelled so that each thread's registers are, unchanged, the 8-bit
    A operand (k_width 4) of a product over its columns. In a 16-column group a thread holds accumulator
    columns {2t, 2t+1, 2t+8, 2t+9} (t: lane % 4) and the operand wants k = 4t..4t+3, so k's bits (k0, k1, k2, k3)
    are column bits (c0, c3, c1, c2): column c = sigma(k). Converting without the relabel costs shuffles and
    selects (16 SHFL, 16 SEL and 16 PRMT a tile at D=128); with it, the other operand's keys must come in
    sigma's order: quantize writes V^T so (``operand_order``), and the backward's token-major copies."""
    x = gl.reshape(p, [p.shape[0], p.shape[1] // 16, 2, 2, 2, 2])      # (row, c >> 4, c3, c2, c1, c0)
    return gl.reshape(gl.permute(x, (0, 1, 3, 4, 2, 5)), [p.shape[0], p.shape[1]])


@gluon.jit
def as_operand(x8, ORDER: gl.constexpr, p_layout: gl.constexpr):
    """An int8 accumulator-layout tile as the wgmma A operand ``p_layout``: with ``ORDER`` read from its
    registers as they are (to_operand_order; the other operand's tokens permuted to match), else moved by shuffles."""
    if ORDER:
        return gl.convert_layout(to_operand_order(x8), p_layout, assert_trivial=True)
    return gl.convert_layout(x8, p_layout)


@gluon.jit
def floor_to(x, BLOCK: gl.constexpr):
    return (gl.maximum(x, 0) // BLOCK) * BLOCK


@gluon.jit
def ceil_to(x, BLOCK: gl.constexpr):
    return ((gl.maximum(x, 0) + BLOCK - 1) // BLOCK) * BLOCK


@gluon.jit
def key_tiles(start_m, seqlen_q, seqlen_k, window_left, window_right,
               ROWS: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, BLOCK: gl.constexpr):
    """forward._key_tiles for ``ROWS`` query rows and ``BLOCK``-key tiles (keys past the end always masked):
    ``[lo, full_lo)`` and ``[full_hi, hi)`` need the mask, ``[full_lo, full_hi)`` does not."""
    diag = seqlen_k - seqlen_q
    hi = seqlen_k
    full_hi = floor_to(seqlen_k, BLOCK)
    lo = seqlen_k * 0           # a tensor either way: partitions take no Python ints
    full_lo = lo
    if MASK_RIGHT:
        hi = gl.minimum(hi, start_m + ROWS + diag + window_right)
        full_hi = gl.minimum(full_hi, floor_to(start_m + diag + window_right + 1, BLOCK))
    if MASK_LEFT:
        lo = floor_to(start_m + diag - window_left, BLOCK)
        full_lo = ceil_to(start_m + ROWS - 1 + diag - window_left, BLOCK)
    hi = ceil_to(hi, BLOCK)
    full_lo = gl.minimum(gl.maximum(full_lo, lo), hi)
    full_hi = gl.minimum(gl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@gluon.jit
def inside_sequences(r2, c2, seqlen_q, seqlen_k):
    """Which (query row ``r2``, key ``c2``) pairs lie inside both sequences: the mask of a kernel without a window
    band, whose masked tiles are the sequences' last ones (the form that kernel had before key_band_mask: with
    it, the unmasked tile loops of kernels without a band measured 1-3% slower, H100, though their loops kept
    their instruction counts)."""
    return (r2 < seqlen_q) & (c2 < seqlen_k)


@gluon.jit
def key_band_mask(offs_n, rows, start_n, seqlen_k, diag, window_left, window_right,
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
def named_barrier(ARRIVE: gl.constexpr, bar_id, threads, WARPS: gl.constexpr):
    """``bar.arrive`` (ARRIVE) or ``bar.sync`` on hardware barrier ``bar_id`` (``threads`` take part in all) by
    every thread of this WARPS-warp partition. Each thread signals for itself: an mbarrier arrival is one thread's,
    so Gluon syncs the partition before it (a ``bar.sync`` of its warps per arrival)."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    op: gl.constexpr = "bar.arrive" if ARRIVE else "bar.sync"
    ids = gl.full([32 * WARPS], 0, gl.int32, one) + bar_id
    counts = gl.full([32 * WARPS], 0, gl.int32, one) + threads
    gl.inline_asm_elementwise(op + " $1, $2; mov.u32 $0, 0;", "=r,r,r", [ids, counts], dtype=gl.int32,
                              is_pure=False, pack=1)


# The ring's arithmetic as builtins, not @gluon.jit helpers: their ops are traced in place as the expressions they
# stand for (an inlined jit call adds debug-info labels to the PTX, and ptxas then scheduled some kernels differently).
@gl_builtin
def ring_slot(i, STAGES, _semantic=None):
    """The buffer that use ``i`` (counted from 0, on across work items) of a ``STAGES``-buffer ring takes:
    ``i % STAGES``."""
    return i.__mod__(STAGES, _semantic=_semantic)


@gl_builtin
def ring_phase(i, STAGES, _semantic=None):
    """The phase a wait for use ``i`` of a ``STAGES``-buffer ring's ``ready`` barrier waits for, ``(i // STAGES) & 1``:
    it flips each time the ring comes round (a one-buffer ring's: every use, ``i & 1``)."""
    one = gl.constexpr(1)
    if _unwrap_if_constexpr(STAGES) == 1:
        return i.__and__(one, _semantic=_semantic)
    return i.__floordiv__(STAGES, _semantic=_semantic).__and__(one, _semantic=_semantic)


@gl_builtin
def free_phase(i, STAGES, _semantic=None):
    """The phase the producer's wait on the ``empty`` barrier of use ``i``'s buffer waits for, ``ring_phase ^ 1``: its
    previous use's release. A fresh barrier's previous phase counts as complete, so the ring's first round passes at
    once."""
    return ring_phase(i, STAGES, _semantic=_semantic).__xor__(gl.constexpr(1), _semantic=_semantic)


@aggregate
class Sequences:
    """The batch as a kernel's work items see it: padded lengths ``n_q`` / ``n_k``, or (``IS_VARLEN``) the packed
    sequences' token starts ``CU_Q`` / ``CU_K`` and the 16-aligned starts ``CU_T`` of the token-major copy the kernel
    reads (V^T in the forward, Q^T and dO^T for dK / dV, K^T for dQ: quantize.aligned_starts); the query and KV
    heads (``group`` query heads a KV head); the window (``MASK_LEFT`` / ``MASK_RIGHT``: which sides bound it); the
    ``num_items`` work items, ``num_tiles`` of them a (sequence, head)."""
    CU_Q: gl.tensor
    CU_K: gl.tensor
    CU_T: gl.tensor
    n_q: Scalar
    n_k: Scalar
    num_heads: Scalar
    num_kv_heads: Scalar
    group: Scalar
    window_left: Scalar
    window_right: Scalar
    num_items: Scalar
    num_tiles: Scalar
    IS_VARLEN: gl.constexpr
    MASK_LEFT: gl.constexpr
    MASK_RIGHT: gl.constexpr


@aggregate
class WorkItem:
    """One work item: the tiles from row ``start`` (a query in the forward and dQ, a key in dK / dV) of sequence ``b``
    (``bt``: its batch index in the [B, H, N] tensors, 0 in a packed batch), head ``h`` (dK / dV: the KV head) and
    KV head ``hk``; the sequence's first query, key and token-major column (``q0``, ``k0``, ``t0``) and lengths; the
    other side's tiles ``[lo, hi)``: ``[lo, full_lo)`` and ``[full_hi, hi)`` masked, ``[full_lo, full_hi)`` not."""
    b: gl.tensor
    bt: gl.tensor
    h: gl.tensor
    hk: gl.tensor
    start: gl.tensor
    q0: gl.tensor
    k0: gl.tensor
    t0: gl.tensor
    seqlen_q: gl.tensor
    seqlen_k: gl.tensor
    lo: gl.tensor
    full_lo: gl.tensor
    full_hi: gl.tensor
    hi: gl.tensor


@gluon.jit
def split_item(t, num_tiles, num_heads, LONGEST_FIRST: gl.constexpr):
    """Work item ``t``, numbered tile fastest, as (tile, sequence, head); ``LONGEST_FIRST`` reverses the tiles
    (a causal call's last query tiles see the most keys)."""
    tile = t % num_tiles
    if LONGEST_FIRST:
        tile = num_tiles - 1 - tile
    bh = t // num_tiles
    return tile, bh // num_heads, bh % num_heads


@aggregate
class ItemMailbox:
    """The loader's hand-off of the next work item to the consumers: a one-slot mailbox in shared memory (``slot``)
    and the barrier that says an index was posted (``posted``)."""
    slot: gl.shared_memory_descriptor
    posted: gl.shared_memory_descriptor

    @gluon.jit
    def post(self, t):
        """The loader tells the consumers which work item comes next (past the last: stop)."""
        one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        self.slot.store(gl.full([1], 0, gl.int32, one) + t)
        mbarrier.arrive(self.posted, count=1)

    @gluon.jit
    def next(self, j):
        """A consumer warpgroup waits for the loader's ``j``-th posted item and reads its index."""
        mbarrier.wait(self.posted, ring_phase(j, 1))
        return gl.max(self.slot.load(gl.BlockedLayout([1], [32], [4], [0])), 0)


@gluon.jit
def claim_item(t, COUNTER, DYNAMIC: gl.constexpr):
    """The loader's next work item after ``t``: with ``DYNAMIC`` the next one handed out (``COUNTER`` counts the
    items taken past each program's first, which is its program id), else ``t`` plus the number of programs.
    Called by a one-warp loader. The count reaches the warp's lanes by a shuffle, not shared memory: Triton
    broadcasts a scalar atomic's result through a scratch word, which its allocator may lay over an mbarrier it
    sees as dead (the forward's unused turn barriers), and a barrier's memory is not for plain loads and stores.
    Under GPU time-slicing a program then read a wrong count and dropped the item it had taken (its output rows
    were never written)."""
    if DYNAMIC:
        lane_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        lane = gl.arange(0, 32, layout=lane_layout)
        first = lane == 0
        taken = gl.atomic_add(COUNTER + lane * 0, gl.full([32], 1, gl.int32, lane_layout), mask=first,
                              sem="acq_rel", scope="gpu")
        return gl.num_programs(0) + gl.max(gl.where(first, taken, 0), 0)
    return t + gl.num_programs(0)


def moved_to_hopper_launch(module_name: str, names):
    """A module ``__getattr__`` that keeps the host-side launch helpers that moved to ``hopper_launch.py``
    reachable under their old module for one release, with a DeprecationWarning (imported at call time: the launch
    module imports the kernels)."""
    names = frozenset(names)

    def __getattr__(name):
        if name in names:
            import importlib
            import warnings

            hopper_launch = importlib.import_module(f"{__package__}.hopper_launch")
            warnings.warn(f"{module_name}.{name} moved to sagebwd_hf.kernels.hopper_launch.{name}; the old name goes "
                          f"in the next release", DeprecationWarning, stacklevel=2)
            return getattr(hopper_launch, name)
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    return __getattr__
