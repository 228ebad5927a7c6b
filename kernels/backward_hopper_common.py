"""What the Hopper backward's two kernels share (backward_hopper_dkdv.py: the key-tile launches, dV, dK and the
one launch; backward_hopper_dq.py: the dQ launch; backward_hopper.py says what each computes): the consumer
warpgroup's rows and the ring's depth, K's scales and where the caller's dO and V lie, a sequence's place in the
tensors, an operand quantized per row to INT8 and its product dequantized into an fp32 accumulator, and the stores of
gradient rows. ``@gluon.jit`` functions, inlined where they are called.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma

from .hopper_common import (E4M3_MAX, FLOAT_ROUND_BIAS, FLOAT_ROUND_BIAS_BITS, INT8_MAX, TINY_SCALE, Scalar,
                            aggregate, as_operand, round_to_int8)

HALF_N = gl.constexpr(64)     # rows per consumer warpgroup (one wgmma M): keys (key-tile launches) or queries (dQ)
STAGES = gl.constexpr(2)      # buffers of the loader's TMA ring: query tiles (key-tile launches) or key tiles (dQ)


@aggregate
class KeyScales:
    """K's scales ``KS`` [B, Hk, N] (one a ``K_SCALE_BLOCK`` keys) and their batch and head strides."""
    KS: gl.tensor
    s_ksb: Scalar
    s_ksh: Scalar


@aggregate
class CallerRows:
    """Where dO and V lie in the caller's memory (hopper_launch.token_rows: token ``n`` of head ``h`` in sequence
    ``b`` is row ``b * rb + h * rh + n``, its channels from column ``h * ch``)."""
    do_rb: Scalar
    do_rh: Scalar
    do_ch: Scalar
    v_rb: Scalar
    v_rh: Scalar
    v_ch: Scalar


@gluon.jit
def sequence_bounds(b, seqs):
    """Sequence ``b``'s place in the tensors: (batch index of the [B, H, N, D] tensors, first query, first key,
    first column of the token-major copy (Q^T and dO^T, or K^T), query and key counts). Packed batches are one
    [1, H, T, D] batch with the sequences' token starts ``CU_Q`` / ``CU_K`` and their token-major copies'
    16-aligned starts ``CU_T`` (quantize.aligned_starts: TMA wants 16-byte aligned tile columns)."""
    if seqs.IS_VARLEN:
        q0 = gl.load(seqs.CU_Q + b)
        seqlen_q = gl.load(seqs.CU_Q + b + 1) - q0
        k0 = gl.load(seqs.CU_K + b)
        seqlen_k = gl.load(seqs.CU_K + b + 1) - k0
        t0 = gl.load(seqs.CU_T + b)
        bt = b * 0
    else:
        q0 = b * 0            # tensors, not constants: both branches must give one type
        seqlen_q = seqs.n_q + q0
        k0 = q0
        seqlen_k = seqs.n_k + q0
        t0 = q0
        bt = b
    return bt, q0, k0, t0, seqlen_q, seqlen_k


@gluon.jit
def no_tiles_unless(inside, lo, full_lo, full_hi, hi):
    """A tile loop's bounds, or all zero for a packed batch's item past its sequence's end (it runs no tiles; all
    four, so the loader and the consumers agree: forward_hopper._work_item)."""
    keep = inside.to(gl.int32)
    return lo * keep, full_lo * keep, full_hi * keep, hi * keep


@gluon.jit
def quantize_rows(x, x_max, ORDER: gl.constexpr, p_layout: gl.constexpr, o_layout: gl.constexpr):
    """``x`` quantized per row (``x_max`` its row maxima of |x|, mapped to 127; backward._quantize_rows) as an
    int8 wgmma A operand, and the row scales in the product's row layout. ``ORDER``: the operand read from the
    registers as they are, its columns in hopper_common.to_operand_order's order (the B operand's token-major copy
    permuted to match: quantize's ``operand_order``); else moved by shuffles."""
    x8 = as_operand(round_to_int8(x * gl.where(x_max > TINY_SCALE, INT8_MAX / x_max, 0.0)[:, None]), ORDER, p_layout)
    return x8, gl.convert_layout(x_max * (1.0 / INT8_MAX), gl.SliceLayout(1, o_layout))


@gluon.jit
def accumulate_product(acc, x8, x_scale, b_smem):
    """``acc += x_scale * (x8 @ B)``, ``B`` an int8 tile in shared memory; the int32 product is dequantized by
    the forward's add trick (quantize.int32_times). ``x8`` and ``x_scale`` are moved to ``acc``'s layouts (a
    relabelling: A's registers and the rows do not depend on the product's width)."""
    o_layout: gl.constexpr = acc.type.layout
    x8 = gl.convert_layout(x8, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4), assert_trivial=True)
    x_scale = gl.convert_layout(x_scale, gl.SliceLayout(1, o_layout), assert_trivial=True)
    prod = warpgroup_mma(x8, b_smem.permute((1, 0)), gl.zeros(acc.shape, gl.int32, o_layout), use_acc=False)
    return gl.fma((prod + FLOAT_ROUND_BIAS_BITS).to(gl.float32, bitcast=True), x_scale[:, None],
                  acc + (x_scale * -FLOAT_ROUND_BIAS)[:, None])


@gluon.jit
def running_scale(acc_scale, x_scale):
    """An accumulator that sums in place: each row's scale after this tile (the tile's ``x_scale``, or the old
    ``acc_scale`` where the tile's row is all zeros) and the factor the accumulator's row takes first. The sum over
    tiles is then the reference's ``sum_t (x8_t @ B) * x_scale_t``, up to the fp32 rounding of the factors; a NaN
    scale reaches the accumulator."""
    x_scale = gl.convert_layout(x_scale, acc_scale.type.layout, assert_trivial=True)
    empty = x_scale <= TINY_SCALE * (1.0 / E4M3_MAX)
    return gl.where(empty, acc_scale, x_scale), gl.where(empty, 1.0, acc_scale / x_scale)


@gluon.jit
def product_in_place(acc, x8, b_smem, IS_ASYNC: gl.constexpr):
    """``acc + x8 @ B``: an FP8 e4m3 product from registers into the fp32 accumulator itself (one wgmma chain over
    every tile: no second register set, no per-tile conversion); ``IS_ASYNC``: issued, not waited for."""
    x8 = gl.convert_layout(x8, gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=4),
                           assert_trivial=True)
    return warpgroup_mma(x8, b_smem.permute((1, 0)), acc, is_async=IS_ASYNC)


@gluon.jit
def accumulate_in_place(acc, factor, x8, b_smem, IS_ASYNC: gl.constexpr):
    """``acc = acc * factor + x8 @ B`` (product_in_place), the accumulator's rows rescaled first to the tile's
    scales (running_scale)."""
    factor = gl.convert_layout(factor, gl.SliceLayout(1, acc.type.layout), assert_trivial=True)
    return product_in_place(acc * factor[:, None], x8, b_smem, IS_ASYNC)


@gluon.jit
def store_rows(acc, rows, seqlen, OUT, out_off, s_ot, out_scale, COL0: gl.constexpr):
    """Rows of ``acc`` (scaled) into columns ``[COL0, COL0 + width)`` of ``OUT``'s rows ``rows``."""
    o_layout: gl.constexpr = acc.type.layout
    offs_d = COL0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, o_layout))
    rows_o = gl.convert_layout(rows, gl.SliceLayout(1, o_layout))
    ptrs = OUT + out_off + rows_o.to(gl.int64)[:, None] * s_ot + offs_d[None, :]
    gl.store(ptrs, (acc * out_scale).to(OUT.dtype.element_ty), mask=(rows_o < seqlen)[:, None])
