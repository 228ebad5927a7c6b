"""Smoothing and INT8 quantization of the attention inputs, before the attention kernels run.

Scales (all fp32, symmetric, ``x ~ scale * x8``):

* Q, dO: one scale per token (``max|x| / 127`` over the head dim). A per-token scale sits outside the
  head-dim reduction of ``Q K^T``; for products that reduce over tokens (``dS K``, ``dS^T Q``, ``P^T dO``)
  the attention kernels fold it into the other operand (dS or P) before quantizing that one, so the INT8
  bytes are the same in both layouts.
* K: at head dims 64 and 128, one scale per run of ``K_SCALE_BLOCK`` tokens from each sequence's start (the
  max over the run), stored per token like the others, so every kernel may read it per token; the Hopper
  kernels, whose key tile is that run, read one number a tile (``constants.K_SCALE_BLOCK`` says why). Other head
  dims: per token.
* V: one scale per channel per sequence; it leaves the ``P V`` reduction and is applied once at the end. Under the
  ``pv_e4m3`` rule (``quantize_v(..., e4m3=True)``) V is FP8 e4m3 instead, its channel max mapped to 448.

Products that reduce over tokens need their INT8 operand token-contiguous (Hopper's 8-bit wgmma is K-major
only), so those tensors get a transposed copy ``[B, H, D, N_pad]``, written by the same pass.

Kernels: ``_token_stats_kernel`` (mean or max|x| over runs of tokens: the K mean, the Q-smoothing
block means, V's channel scales; per 512-token chunk for long sequences, then ``_combine_chunks_kernel``) and
``_quantize_kernel`` (one read of the input, INT8 out in either layout, the scales, and for dO also
``delta = rowsum(dO * O)``); ``_quantize_pair_kernel`` runs two inputs' quantization programs in one launch.
Each program reduces its own tokens in a fixed order: no atomics, so forward and backward quantize the same
input to the same bytes.

The op's launches (``prepare_forward``, ``prepare_backward``): the statistics; K's pass, which combines K's
mean from the chunks itself; then Q's pass with V's (the forward; V's combining its channel scales) or with
dO's (the backward) in one launch, Q's also zeroing the Gluon launches' work counters and the one-launch
backward's dQ accumulator. Every byte is the separate passes' (tests/test_launch_count.py compares them).
"""
import functools
import os
import warnings
import weakref
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import constants
from .constants import K_BLOCK_HEAD_DIMS, K_SCALE_BLOCK, LOG2E, Q_SMOOTH_BLOCK  # (re-exported)
from .launch import launch
from .layout import SeqLayout, cdiv, strides3, strides4

TOKEN_ALIGN = 16        # transposed copies pad the token axis so every row starts 16-byte aligned
STATS_CHUNK = 512       # tokens per program for a whole sequence's mean or max (padded batches)
STATS_ROWS = 32         # tokens per load in the statistics kernel (its accumulator holds that many rows)

# constants.py's numbers as @triton.jit code reads them (a jit function reads only constexpr globals): here's,
# forward.py's and backward.py's. (LOG2E stays the plain float the host code multiplies by.)
FLOAT_ROUND_BIAS = tl.constexpr(constants.FLOAT_ROUND_BIAS)
FLOAT_ROUND_BIAS_BITS = tl.constexpr(constants.FLOAT_ROUND_BIAS_BITS)
TINY_SCALE = tl.constexpr(constants.TINY_SCALE)
INT8_MAX = tl.constexpr(constants.INT8_MAX)
LOG2_127 = tl.constexpr(constants.LOG2_127)
E4M3_MAX = tl.constexpr(constants.E4M3_MAX)
LOG2E_CONSTEXPR = tl.constexpr(constants.LOG2E)


def _field_by_key(self, key):
    """``result["name"]``, the dict these results used to be: the field, with a DeprecationWarning."""
    if isinstance(key, str):
        warnings.warn(f"{type(self).__name__}[{key!r}]: the result is a NamedTuple now; use .{key} (indexing by "
                      f"name goes in the next release)", DeprecationWarning, stacklevel=2)
        return getattr(self, key)
    return tuple.__getitem__(self, key)


class Quantized(NamedTuple):
    """What ``quantize`` made of one input ``[B, H, N, D]``; a field not asked for is None."""
    x8: Optional[torch.Tensor]        # int8, natural layout [B, H, N, D]
    x8t: Optional[torch.Tensor]       # int8, token-major [B, H, D, N_pad]
    scale: Optional[torch.Tensor]     # fp32 per token [B, H, N] (None with a channel_scale)
    delta: Optional[torch.Tensor]     # rowsum(x * out_for_delta) [B, H, N]
    row_dot: Optional[torch.Tensor]   # each token dotted with its sequence's vector (``dot``) [B, H, N]
    scaled: Optional[torch.Tensor]    # scale times the ``scaled`` factor [B, H, N]
    t_scale: Optional[torch.Tensor] = None   # x8t's own per-token e4m3 scales [B, H, N] (``transposed_e4m3``)
    x8_scale: Optional[torch.Tensor] = None  # x8's own per-token INT8 scales [B, H, N] (``natural_int8``)
    __getitem__ = _field_by_key


class QuantizedQK(NamedTuple):
    """INT8 Q and K for ``S = Q K^T`` (``quantize_qk``); a field not asked for is None."""
    q8: torch.Tensor                      # [B, H, N, D]
    q_scale: torch.Tensor                 # per token, softmax scale and log2(e) folded in (the kernels use exp2)
    q_scale_raw: torch.Tensor             # per token, Q's own
    v_scale: Optional[torch.Tensor]       # V's per-channel scales [Hkv, S, Dv] (with ``v4``), for quantize_v
    q8t: Optional[torch.Tensor]           # Q's token-major copy [B, H, D, N_pad] (``transposed``)
    k8: torch.Tensor                      # [B, Hkv, N, D]
    k_scale: torch.Tensor                 # per token (one per K_SCALE_BLOCK tokens at K_BLOCK_HEAD_DIMS)
    k8t: Optional[torch.Tensor]           # K's token-major copy (``k_transposed``)
    q_mean: Optional[torch.Tensor]        # Q-smoothing block means [H, blocks, D], scaled like q_scale
    q_mean_cu: Optional[torch.Tensor]     # first block of each sequence
    k_mean: Optional[torch.Tensor]        # K-smoothing means [Hkv, S, D]
    q_shift: Optional[torch.Tensor]       # softmax_scale * q . mean(k) per query [B, H, N] (``row_shift``)
    v_parts: Optional[tuple] = None       # V's channel maxima per chunk, for quantize_v (``fused`` with ``v4``)
    qt_scale: Optional[torch.Tensor] = None   # q8t's per-token e4m3 scales, where q8t holds e4m3 bytes (``qt_e4m3``)
    __getitem__ = _field_by_key


@triton.jit
def round_to_int8(x):
    """Round to nearest (ties to even) and narrow to int8, for |x| <= 127.

    Adding 1.5 * 2^23 leaves the rounded integer in the low mantissa bits, whose low byte is the int8:
    one float add instead of a float-to-int conversion (those issue at a quarter of the FP32 rate)."""
    return (x + FLOAT_ROUND_BIAS).to(tl.int32, bitcast=True).to(tl.int8)


INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")   # kernels run by Triton's interpreter


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def nan_max(x, axis: tl.constexpr):
    """The largest element over ``axis`` (of |x| or of P >= 0), NaN where any element is NaN or inf.

    A scale is this max over 127 (or 448). ``tl.max`` skips NaN on the GPU (PTX ``max``), and an inf max makes the
    block's bytes 0 with an inf scale that cancels against them: either way a NaN or inf input gave finite outputs
    where SDPA's are NaN. With the scale NaN, every product that reads the block is NaN, as in SDPA (more elements
    than SDPA's where the block holds more than the bad one). One ``max.NaN`` a step, the cost of ``max``.
    (Under Triton's interpreter a reduction with a combine function of our own calls it once an element in Python,
    and its ``tl.max`` skips NaN too: there the max plus the sum of ``x * 0``, which is NaN where any element is NaN
    or inf and 0 elsewhere, gives the same numbers with numpy's reductions.)"""
    if INTERPRETED:
        m = tl.max(x, axis) + tl.sum(x * 0.0, axis)
    else:
        m = tl.reduce(x, axis, _max_keeping_nan)
    return tl.where(m == float("inf"), float("nan"), m)


@triton.jit
def int32_times(x, scale):
    """``float(x) * scale`` for int32 ``x`` with |x| < 2^22 and a ``scale`` that broadcasts against it (a row or
    column vector): an integer add and one FMA. ``(x + 0x4B400000)`` read as a float is ``1.5 * 2^23 + x``
    exactly; the FMA multiplies and takes off ``1.5 * 2^23 * scale`` with one rounding (an error under one
    unit of ``x``, far below the INT8 quantization error)."""
    return tl.fma((x + FLOAT_ROUND_BIAS_BITS).to(tl.float32, bitcast=True), scale, scale * -FLOAT_ROUND_BIAS)


@triton.jit
def _seq_bounds(CU, b, n_dense, IS_VARLEN: tl.constexpr):
    """(batch index into the tensors, first token, length) of sequence ``b`` (an int64 index).

    The batch index and first token come back as int64, so every offset built from them is 64-bit: a
    ``[B, H, N, D]`` tensor or a packed batch can pass 2^31 elements (int32 offsets wrapped and faulted)."""
    if IS_VARLEN:
        first = tl.load(CU + b)
        length = tl.load(CU + b + 1) - first
        start = first.to(tl.int64)
        batch = b * 0
    else:
        start = b * 0
        length = n_dense
        batch = b
    return batch, start, length


@triton.jit
def _run_stats(base, s_xt, t0, start, end, d_ok, ABS_MAX: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_D: tl.constexpr, row_mul=None, HAS_ROW_MUL: tl.constexpr = False):
    """Mean (or max |x|) of rows ``[start, end)`` of one sequence's head, in a fixed order. Each thread keeps
    its own elements' running sum (or max) and the rows meet once at the end: a reduction across the
    program's rows per loaded tile (shared memory and a barrier each time) left the loads latency-bound.
    ``HAS_ROW_MUL``: each row times its factor at ``row_mul + t0 + row`` first."""
    offs_t = tl.arange(0, BLOCK_T)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for t in range(start, end, BLOCK_T):
        rows = t + offs_t
        x = tl.load(base + (t0 + rows)[:, None] * s_xt, mask=(rows < end)[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        if HAS_ROW_MUL:
            x = x * tl.load(row_mul + t0 + rows, mask=rows < end, other=0.0)[:, None]
        if ABS_MAX:
            acc = tl.maximum(acc, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)   # (nan_max)
        else:
            acc += x
    if ABS_MAX:
        return nan_max(acc, 0)
    return tl.sum(acc, 0) / tl.maximum(end - start, 1).to(tl.float32)


@triton.jit
def _token_stats_kernel(
    X, X2, CU, BLK_CU, OUT, OUT2, ROW_MUL,
    s_xb, s_xh, s_xt, s_xd, s_x2b, s_x2h, s_x2t, s_x2d, s_oh, s_ob, s_o2h, s_o2b, s_rb, s_rh,
    n_dense, num_heads, head_dim, head_dim2, block_tokens, factor, factor2,
    IS_VARLEN: tl.constexpr, ABS_MAX: tl.constexpr, ABS_MAX2: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_ROW_MUL: tl.constexpr = False,
):
    """Mean (or max |x|) over each run of ``block_tokens`` tokens of every sequence, times ``factor`` ->
    ``OUT[h, blk, :]``; grid axis 2 = 1 takes the second input (``X2``, same tokens and heads: K and V), so
    one launch gives both statistics. ``HAS_ROW_MUL``: the first input's rows times ``ROW_MUL`` ``[B, H, N]``
    (strides ``s_rb``, ``s_rh``; tokens contiguous) first."""
    pid_blk = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)   # every head/batch offset in 64 bits (see _seq_bounds)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    bx, t0, seqlen = _seq_bounds(CU, b, n_dense, IS_VARLEN)
    blk0 = tl.load(BLK_CU + b)
    if pid_blk >= tl.load(BLK_CU + b + 1) - blk0:
        return
    offs_d = tl.arange(0, BLOCK_D)
    start = pid_blk * block_tokens
    end = tl.minimum(start + block_tokens, seqlen)
    if tl.program_id(2) == 0:
        d_ok = offs_d < head_dim
        acc = _run_stats(X + bx * s_xb + h * s_xh + offs_d[None, :] * s_xd, s_xt, t0, start, end, d_ok, ABS_MAX,
                         BLOCK_T, BLOCK_D, ROW_MUL + bx * s_rb + h * s_rh, HAS_ROW_MUL)
        tl.store(OUT + h * s_oh + (blk0 + pid_blk) * s_ob + offs_d, acc * factor, mask=d_ok)
    else:
        d_ok = offs_d < head_dim2
        acc = _run_stats(X2 + bx * s_x2b + h * s_x2h + offs_d[None, :] * s_x2d, s_x2t, t0, start, end, d_ok,
                         ABS_MAX2, BLOCK_T, BLOCK_D)
        tl.store(OUT2 + h * s_o2h + (blk0 + pid_blk) * s_o2b + offs_d, acc * factor2, mask=d_ok)


@triton.jit
def _quantize_program(
    pid_t, pid_bh,
    X, SUB, SUB_CU, CSCALE, O, X8, X8T, SCALE, SCALED, DELTA, CU, T_CU, DOTV, ROW_DOT, PART, PART_CU, ZEROS, ZROWS,
    SCALE_T, s_xb, s_xh, s_xt, s_xd, s_subh, s_subb, s_csh, s_csb, s_ob, s_oh, s_ot, s_od, s_8b, s_8h, s_8t, s_tb, s_th,
    s_td, s_sb, s_sh, s_dvh, s_dvb, s_ph, s_pb, s_zb, s_zh, s_zt, n_dense, num_heads, head_dim, sub_block,
    dot_group, dot_scale, scaled_factor, chunk_tokens, part_factor,
    IS_VARLEN: tl.constexpr, HAS_SUB: tl.constexpr, PER_CHANNEL: tl.constexpr, WITH_DELTA: tl.constexpr,
    WITH_SCALED: tl.constexpr, WRITE_NATURAL: tl.constexpr, WRITE_T: tl.constexpr, HAS_T_CU: tl.constexpr,
    WITH_DOT: tl.constexpr, BLOCK_SCALE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    OPERAND_ORDER: tl.constexpr = False, FROM_PARTS: tl.constexpr = False, ZERO_INTS: tl.constexpr = 0,
    ZERO_ROWS: tl.constexpr = False, E4M3: tl.constexpr = False, TILE_CHANNELS: tl.constexpr = False,
    T_E4M3: tl.constexpr = False, NAT_INT8: tl.constexpr = False, ROW_MUL: tl.constexpr = False,
):
    """One program of ``_quantize_kernel`` (``pid_bh`` int64: every head/batch offset in 64 bits, see
    _seq_bounds).

    ``FROM_PARTS``: the sequence's K mean (``HAS_SUB``) or V's channel scales (``PER_CHANNEL``) combined here from
    the statistics pass's chunks (``PART``, sequence b's ``PART_CU[b]:PART_CU[b+1]``) as ``_combine_chunks_kernel``
    combines them, and written to ``SUB`` / ``CSCALE`` by each sequence's first program: one launch less.
    ``ZERO_INTS``: program (0, 0) zeroes that many int32s at ``ZEROS`` (the Gluon launches' work counters);
    ``ZERO_ROWS``: every program zeroes its tokens' rows of ``ZROWS`` (fp32, ``X``'s shape: the one-launch
    backward's dQ accumulator). ``E4M3``: FP8 e4m3 bytes instead of INT8, each scale's max |x| mapped to e4m3's 448
    (448 / max rounded once: ``sagebwd_hf.naive``'s); with ``PER_CHANNEL`` ``CSCALE`` holds each channel's max (the
    pv_e4m3 rule's V), else ``SCALE`` gets max / 448 per token (its dO), or with ``TILE_CHANNELS`` one max / 448 per
    channel of the program's ``BLOCK_T`` tokens goes to ``CSCALE`` ``[S, H, tiles, D]`` (sequence and head strides
    ``s_csb``, ``s_csh``; pv_e4m3+p_static's dO, whose tiles are the dK/dV kernel's query tiles). ``NAT_INT8`` (with
    ``PER_CHANNEL`` e4m3 bytes in the token-major copy): the natural copy in INT8 with one scale per token of its own,
    max / 127 in ``SCALE_T`` (the dp_int8 rule's dO beside do_sequence's). ``ROW_MUL`` (with ``PER_CHANNEL``, which
    writes no per-token scale: ``SCALE`` is an input then): each token's row times its factor in ``SCALE`` first (the
    ds_bound rule's Q times each row's bound)."""
    if ZERO_INTS > 0:   # (before any program returns: a first sequence may be empty)
        if pid_t == 0 and pid_bh == 0:
            tl.store(ZEROS + tl.arange(0, ZERO_INTS), tl.zeros([ZERO_INTS], tl.int32))
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    bx, t0, seqlen = _seq_bounds(CU, b, n_dense, IS_VARLEN)
    start = pid_t * BLOCK_T
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    if FROM_PARTS:   # the whole sequence's mean or channel maxima, from its chunks (an empty one's too)
        blk0 = tl.load(PART_CU + b)
        combined = _combined_parts(PART, s_ph, s_pb, h, blk0, tl.load(PART_CU + b + 1) - blk0, chunk_tokens,
                                   seqlen, d_ok, part_factor, PER_CHANNEL, BLOCK_D)
        if pid_t == 0:
            if PER_CHANNEL:
                tl.store(CSCALE + h * s_csh + b * s_csb + offs_d, combined, mask=d_ok)
            else:
                tl.store(SUB + h * s_subh + b * s_subb + offs_d, combined, mask=d_ok)
    if start >= seqlen:
        return
    rows = start + tl.arange(0, BLOCK_T)
    t_ok = rows < seqlen
    ok = t_ok[:, None] & d_ok[None, :]
    if ZERO_ROWS:
        tl.store(ZROWS + bx * s_zb + h * s_zh + (t0 + rows)[:, None] * s_zt + offs_d[None, :],
                 tl.zeros([BLOCK_T, BLOCK_D], tl.float32), mask=ok)
    x = tl.load(X + bx * s_xb + h * s_xh + (t0 + rows)[:, None] * s_xt + offs_d[None, :] * s_xd,
                mask=ok, other=0.0).to(tl.float32)
    if ROW_MUL:
        tl.static_assert(PER_CHANNEL and not (WITH_DOT or HAS_SUB or WITH_DELTA or NAT_INT8),
                         "a row factor on a per-channel pass of its own")
        x = x * tl.load(SCALE + bx * s_sb + h * s_sh + t0 + rows, mask=t_ok, other=0.0)[:, None]
    if WITH_DOT:   # each row . one vector per (sequence, head group): Q's rows . mean(k), K-smoothing's shift
        vec = tl.load(DOTV + (h // dot_group) * s_dvh + b * s_dvb + offs_d, mask=d_ok, other=0.0)
        tl.store(ROW_DOT + bx * s_sb + h * s_sh + t0 + rows, tl.sum(x * vec[None, :], 1) * dot_scale, mask=t_ok)
    if HAS_SUB:   # K mean of the sequence, or the Q-smoothing mean of each row's block
        if FROM_PARTS:
            x -= tl.where(ok, combined[None, :], 0.0)
        else:
            blk = tl.load(SUB_CU + b) + rows // sub_block
            x -= tl.load(SUB + h * s_subh + blk[:, None] * s_subb + offs_d[None, :], mask=ok, other=0.0)
    if PER_CHANNEL:
        if FROM_PARTS:
            c_scale = combined
        else:
            c_scale = tl.load(CSCALE + h * s_csh + b * s_csb + offs_d, mask=d_ok, other=0.0)
        if E4M3:   # c_scale is the channel's max |x|; a tiny one quantizes to zeros, as in the reference
            # (rounded division: ``/`` is div.full.f32, within 2 ulp, and the reference's bytes need 448 / max's)
            y = x * tl.where(c_scale > TINY_SCALE, tl.math.div_rn(tl.full([BLOCK_D], E4M3_MAX, tl.float32), c_scale),
                             0.0)[None, :]
        else:
            y = x * tl.where(c_scale > 1e-32, 1.0 / c_scale, 0.0)[None, :]
    elif TILE_CHANNELS:   # (e4m3) one scale per channel over the program's tokens, max |x| to 448 (rows past the
        # end hold zeros), written as max / 448 to CSCALE [S, H, tiles, D] at (sequence, head, this tile)
        c_max = nan_max(tl.abs(x), 0)
        y = x * tl.where(c_max > TINY_SCALE, tl.math.div_rn(tl.full([BLOCK_D], E4M3_MAX, tl.float32), c_max),
                         0.0)[None, :]
        tl.store(CSCALE + h * s_csh + b * s_csb + pid_t * head_dim + offs_d, c_max * (1.0 / E4M3_MAX), mask=d_ok)
    elif E4M3:   # one scale per token, max |x| to 448 (448 / max rounded once, as the reference divides)
        amax = nan_max(tl.abs(x), 1)
        y = x * tl.where(amax > TINY_SCALE, tl.math.div_rn(tl.full([BLOCK_T], E4M3_MAX, tl.float32), amax), 0.0)[:, None]
        tl.store(SCALE + bx * s_sb + h * s_sh + t0 + rows, amax * (1.0 / E4M3_MAX), mask=t_ok)
    else:
        amax = nan_max(tl.abs(x), 1)
        if BLOCK_SCALE:   # one scale for the program's BLOCK_T tokens (rows past the end hold zeros)
            amax = tl.zeros_like(amax) + nan_max(amax, 0)
        # A row whose largest magnitude is tiny (a denormal) quantizes to zeros (constants.TINY_SCALE)
        y = x * tl.where(amax > TINY_SCALE, INT8_MAX / amax, 0.0)[:, None]
        tl.store(SCALE + bx * s_sb + h * s_sh + t0 + rows, amax * (1.0 / INT8_MAX), mask=t_ok)
        if WITH_SCALED:   # Q's scale with the softmax scale folded in, as the forward kernels take it
            tl.store(SCALED + bx * s_sb + h * s_sh + t0 + rows, amax * (1.0 / INT8_MAX) * scaled_factor, mask=t_ok)
        if T_E4M3:   # the token-major copy in e4m3 instead, one scale per token of its own (max / 448 in SCALE_T):
            # the bytes and scales of a pass with E4M3 alone (dK's operand under the dk_e4m3 rule)
            tl.static_assert(not BLOCK_SCALE, "e4m3 per token")
            y_t = x * tl.where(amax > TINY_SCALE, tl.math.div_rn(tl.full([BLOCK_T], E4M3_MAX, tl.float32), amax),
                               0.0)[:, None]
            tl.store(SCALE_T + bx * s_sb + h * s_sh + t0 + rows, amax * (1.0 / E4M3_MAX), mask=t_ok)
    if E4M3:   # round to nearest even, saturating (cvt.rn.satfinite.e4m3x2.f32, two values an instruction)
        tl.static_assert(not (BLOCK_SCALE or WITH_SCALED), "e4m3 bytes: per channel, per token or per tile channel")
        x8 = y.to(tl.float8e4nv).to(tl.int8, bitcast=True)
    else:
        x8 = round_to_int8(y)
    x8_natural = x8
    if NAT_INT8:   # the natural copy: INT8, one scale per token (quantize_per_token's bytes)
        tl.static_assert(PER_CHANNEL and E4M3 and WRITE_NATURAL, "INT8 rows beside per-channel e4m3 bytes")
        amax_n = nan_max(tl.abs(x), 1)
        x8_natural = round_to_int8(x * tl.where(amax_n > TINY_SCALE, INT8_MAX / amax_n, 0.0)[:, None])
        tl.store(SCALE_T + bx * s_sb + h * s_sh + t0 + rows, amax_n * (1.0 / INT8_MAX), mask=t_ok)
    if WRITE_NATURAL:
        tl.store(X8 + bx * s_8b + h * s_8h + (t0 + rows)[:, None] * s_8t + offs_d[None, :], x8_natural, mask=ok)
    if WRITE_T:
        t0_t = t0
        if HAS_T_CU:   # the transposed copy's own sequence starts (16-aligned for TMA)
            t0_t = tl.load(T_CU + b).to(tl.int64)
        # X8T holds tokens last: the tile is transposed in registers and stored at contiguous token addresses, so
        # every Triton lays the store along the tokens (each warp writes neighbouring tokens of a channel). The
        # operand order's permutation is applied to the data, not the addresses: with permuted addresses the
        # contiguity is unknown and Triton 3.9 laid the lanes along the channels instead (32 rows of X8T a
        # store: the pass ran 5-8x slower than on 3.6, which picked the tokens; H100, Triton 3.9).
        if T_E4M3:
            x8t = tl.trans(y_t.to(tl.float8e4nv).to(tl.int8, bitcast=True))
        else:
            x8t = tl.trans(x8)
        # Where each sequence's copy is padded to 16 tokens of its own (padded batches; packed ones with their
        # own starts), whole groups of 16 are written, those past the sequence's end as the zeros of its rows
        # past it: a mask constant over 16 tokens lets each thread store 16 bytes at once. Packed sequences
        # without starts of their own abut: there only their own tokens.
        OWN_PADDING: tl.constexpr = HAS_T_CU or not IS_VARLEN
        t_keep = (rows // 16) * 16 < seqlen if OWN_PADDING else t_ok
        if OPERAND_ORDER:   # token 8*b3 + 4*b2 + 2*b1 + b0 of each 16 at 8*b2 + 4*b1 + 2*b3 + b0 (operand_order_columns)
            tl.static_assert(OWN_PADDING, "the operand order permutes whole groups of 16 tokens")
            x8t = tl.reshape(tl.permute(tl.reshape(x8t, [BLOCK_D, BLOCK_T // 16, 2, 2, 2, 2]), [0, 1, 3, 4, 2, 5]),
                             [BLOCK_D, BLOCK_T])
        tl.store(X8T + bx * s_tb + h * s_th + offs_d[:, None] * s_td + (t0_t + rows)[None, :], x8t,
                 mask=d_ok[:, None] & t_keep[None, :])
    if WITH_DELTA:  # dO's pass also gives the backward's delta = rowsum(dO * O)
        o = tl.load(O + bx * s_ob + h * s_oh + (t0 + rows)[:, None] * s_ot + offs_d[None, :] * s_od,
                    mask=ok, other=0.0).to(tl.float32)
        tl.store(DELTA + bx * s_sb + h * s_sh + t0 + rows, tl.sum(x * o, 1), mask=t_ok)


@triton.jit
def _quantize_kernel(
    X, SUB, SUB_CU, CSCALE, O, X8, X8T, SCALE, SCALED, DELTA, CU, T_CU, DOTV, ROW_DOT, PART, PART_CU, ZEROS, ZROWS,
    SCALE_T, s_xb, s_xh, s_xt, s_xd, s_subh, s_subb, s_csh, s_csb, s_ob, s_oh, s_ot, s_od, s_8b, s_8h, s_8t, s_tb, s_th,
    s_td, s_sb, s_sh, s_dvh, s_dvb, s_ph, s_pb, s_zb, s_zh, s_zt, n_dense, num_heads, head_dim, sub_block,
    dot_group, dot_scale, scaled_factor, chunk_tokens, part_factor,
    IS_VARLEN: tl.constexpr, HAS_SUB: tl.constexpr, PER_CHANNEL: tl.constexpr, WITH_DELTA: tl.constexpr,
    WITH_SCALED: tl.constexpr, WRITE_NATURAL: tl.constexpr, WRITE_T: tl.constexpr, HAS_T_CU: tl.constexpr,
    WITH_DOT: tl.constexpr, BLOCK_SCALE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    OPERAND_ORDER: tl.constexpr = False, FROM_PARTS: tl.constexpr = False, ZERO_INTS: tl.constexpr = 0,
    ZERO_ROWS: tl.constexpr = False, E4M3: tl.constexpr = False, TILE_CHANNELS: tl.constexpr = False,
    T_E4M3: tl.constexpr = False, NAT_INT8: tl.constexpr = False, ROW_MUL: tl.constexpr = False,
):
    """Quantizes one input (``quantize``): programs (token tile, sequence x head); ``_quantize_program``."""
    _quantize_program(
        tl.program_id(0), tl.program_id(1).to(tl.int64),
        X, SUB, SUB_CU, CSCALE, O, X8, X8T, SCALE, SCALED, DELTA, CU, T_CU, DOTV, ROW_DOT, PART, PART_CU, ZEROS,
        ZROWS, SCALE_T, s_xb, s_xh, s_xt, s_xd, s_subh, s_subb, s_csh, s_csb, s_ob, s_oh, s_ot, s_od, s_8b, s_8h, s_8t, s_tb,
        s_th, s_td, s_sb, s_sh, s_dvh, s_dvb, s_ph, s_pb, s_zb, s_zh, s_zt, n_dense, num_heads, head_dim, sub_block,
        dot_group, dot_scale, scaled_factor, chunk_tokens, part_factor,
        IS_VARLEN=IS_VARLEN, HAS_SUB=HAS_SUB, PER_CHANNEL=PER_CHANNEL, WITH_DELTA=WITH_DELTA,
        WITH_SCALED=WITH_SCALED, WRITE_NATURAL=WRITE_NATURAL, WRITE_T=WRITE_T, HAS_T_CU=HAS_T_CU, WITH_DOT=WITH_DOT,
        BLOCK_SCALE=BLOCK_SCALE, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, OPERAND_ORDER=OPERAND_ORDER,
        FROM_PARTS=FROM_PARTS, ZERO_INTS=ZERO_INTS, ZERO_ROWS=ZERO_ROWS, E4M3=E4M3, TILE_CHANNELS=TILE_CHANNELS,
        T_E4M3=T_E4M3, NAT_INT8=NAT_INT8, ROW_MUL=ROW_MUL,
    )


@triton.jit
def _quantize_pair_kernel(
    X, SUB, SUB_CU, CSCALE, O, X8, X8T, SCALE, SCALED, DELTA, CU, T_CU, DOTV, ROW_DOT, PART, PART_CU, ZEROS, ZROWS,
    SCALE_T, s_xb, s_xh, s_xt, s_xd, s_subh, s_subb, s_csh, s_csb, s_ob, s_oh, s_ot, s_od, s_8b, s_8h, s_8t, s_tb, s_th,
    s_td, s_sb, s_sh, s_dvh, s_dvb, s_ph, s_pb, s_zb, s_zh, s_zt, n_dense, num_heads, head_dim, sub_block,
    dot_group, dot_scale, scaled_factor, chunk_tokens, part_factor,
    X_b, SUB_b, SUB_CU_b, CSCALE_b, O_b, X8_b, X8T_b, SCALE_b, SCALED_b, DELTA_b, CU_b, T_CU_b, DOTV_b, ROW_DOT_b,
    PART_b, PART_CU_b, ZEROS_b, ZROWS_b, SCALE_T_b, s_xb_b, s_xh_b, s_xt_b, s_xd_b, s_subh_b, s_subb_b, s_csh_b, s_csb_b,
    s_ob_b, s_oh_b, s_ot_b, s_od_b, s_8b_b, s_8h_b, s_8t_b, s_tb_b, s_th_b, s_td_b, s_sb_b, s_sh_b, s_dvh_b,
    s_dvb_b, s_ph_b, s_pb_b, s_zb_b, s_zh_b, s_zt_b, n_dense_b, num_heads_b, head_dim_b, sub_block_b, dot_group_b,
    dot_scale_b, scaled_factor_b, chunk_tokens_b, part_factor_b,
    programs_bh, programs_bh_b,
    IS_VARLEN: tl.constexpr, HAS_SUB: tl.constexpr, PER_CHANNEL: tl.constexpr, WITH_DELTA: tl.constexpr,
    WITH_SCALED: tl.constexpr, WRITE_NATURAL: tl.constexpr, WRITE_T: tl.constexpr, HAS_T_CU: tl.constexpr,
    WITH_DOT: tl.constexpr, BLOCK_SCALE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    OPERAND_ORDER: tl.constexpr, FROM_PARTS: tl.constexpr, ZERO_INTS: tl.constexpr,
    ZERO_ROWS: tl.constexpr, E4M3: tl.constexpr, TILE_CHANNELS: tl.constexpr, T_E4M3: tl.constexpr,
    NAT_INT8: tl.constexpr, ROW_MUL: tl.constexpr,
    IS_VARLEN_B: tl.constexpr, HAS_SUB_B: tl.constexpr, PER_CHANNEL_B: tl.constexpr, WITH_DELTA_B: tl.constexpr,
    WITH_SCALED_B: tl.constexpr, WRITE_NATURAL_B: tl.constexpr, WRITE_T_B: tl.constexpr, HAS_T_CU_B: tl.constexpr,
    WITH_DOT_B: tl.constexpr, BLOCK_SCALE_B: tl.constexpr, BLOCK_T_B: tl.constexpr, BLOCK_D_B: tl.constexpr,
    OPERAND_ORDER_B: tl.constexpr, FROM_PARTS_B: tl.constexpr, ZERO_INTS_B: tl.constexpr,
    ZERO_ROWS_B: tl.constexpr, E4M3_B: tl.constexpr, TILE_CHANNELS_B: tl.constexpr, T_E4M3_B: tl.constexpr,
    NAT_INT8_B: tl.constexpr, ROW_MUL_B: tl.constexpr,
):
    """Two inputs quantized in one launch (``quantize_pair``): grid axis 2 picks the input, its arguments the
    plain ones or those ending in ``_b`` / ``_B``; each program runs ``_quantize_program`` as ``_quantize_kernel``
    would for that input (same tile, same warps: the same bytes). ``programs_bh``: each input's sequences x
    heads (the grid's axis 1 is the larger of the two)."""
    pid_bh = tl.program_id(1).to(tl.int64)
    if tl.program_id(2) == 0:
        if pid_bh < programs_bh:
            _quantize_program(
                tl.program_id(0), pid_bh,
                X, SUB, SUB_CU, CSCALE, O, X8, X8T, SCALE, SCALED, DELTA, CU, T_CU, DOTV, ROW_DOT, PART, PART_CU,
                ZEROS, ZROWS, SCALE_T, s_xb, s_xh, s_xt, s_xd, s_subh, s_subb, s_csh, s_csb, s_ob, s_oh, s_ot, s_od, s_8b,
                s_8h, s_8t, s_tb, s_th, s_td, s_sb, s_sh, s_dvh, s_dvb, s_ph, s_pb, s_zb, s_zh, s_zt, n_dense,
                num_heads, head_dim, sub_block, dot_group, dot_scale, scaled_factor, chunk_tokens, part_factor,
                IS_VARLEN=IS_VARLEN, HAS_SUB=HAS_SUB, PER_CHANNEL=PER_CHANNEL, WITH_DELTA=WITH_DELTA,
                WITH_SCALED=WITH_SCALED, WRITE_NATURAL=WRITE_NATURAL, WRITE_T=WRITE_T, HAS_T_CU=HAS_T_CU,
                WITH_DOT=WITH_DOT, BLOCK_SCALE=BLOCK_SCALE, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
                OPERAND_ORDER=OPERAND_ORDER, FROM_PARTS=FROM_PARTS, ZERO_INTS=ZERO_INTS, ZERO_ROWS=ZERO_ROWS,
                E4M3=E4M3, TILE_CHANNELS=TILE_CHANNELS, T_E4M3=T_E4M3, NAT_INT8=NAT_INT8, ROW_MUL=ROW_MUL,
            )
    else:
        if pid_bh < programs_bh_b:
            _quantize_program(
                tl.program_id(0), pid_bh,
                X_b, SUB_b, SUB_CU_b, CSCALE_b, O_b, X8_b, X8T_b, SCALE_b, SCALED_b, DELTA_b, CU_b, T_CU_b, DOTV_b,
                ROW_DOT_b, PART_b, PART_CU_b, ZEROS_b, ZROWS_b, SCALE_T_b, s_xb_b, s_xh_b, s_xt_b, s_xd_b, s_subh_b, s_subb_b,
                s_csh_b, s_csb_b, s_ob_b, s_oh_b, s_ot_b, s_od_b, s_8b_b, s_8h_b, s_8t_b, s_tb_b, s_th_b, s_td_b,
                s_sb_b, s_sh_b, s_dvh_b, s_dvb_b, s_ph_b, s_pb_b, s_zb_b, s_zh_b, s_zt_b, n_dense_b, num_heads_b,
                head_dim_b, sub_block_b, dot_group_b, dot_scale_b, scaled_factor_b, chunk_tokens_b, part_factor_b,
                IS_VARLEN=IS_VARLEN_B, HAS_SUB=HAS_SUB_B, PER_CHANNEL=PER_CHANNEL_B, WITH_DELTA=WITH_DELTA_B,
                WITH_SCALED=WITH_SCALED_B, WRITE_NATURAL=WRITE_NATURAL_B, WRITE_T=WRITE_T_B, HAS_T_CU=HAS_T_CU_B,
                WITH_DOT=WITH_DOT_B, BLOCK_SCALE=BLOCK_SCALE_B, BLOCK_T=BLOCK_T_B, BLOCK_D=BLOCK_D_B,
                OPERAND_ORDER=OPERAND_ORDER_B, FROM_PARTS=FROM_PARTS_B, ZERO_INTS=ZERO_INTS_B,
                ZERO_ROWS=ZERO_ROWS_B, E4M3=E4M3_B, TILE_CHANNELS=TILE_CHANNELS_B, T_E4M3=T_E4M3_B,
                NAT_INT8=NAT_INT8_B, ROW_MUL=ROW_MUL_B,
            )


@triton.jit
def _combined_parts(PART, s_ph, s_pb, h, blk0, chunks, chunk_tokens, n, d_ok, factor, ABS_MAX: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """A sequence's mean (or max |x|) from its ``chunks`` chunks' at ``PART[h, blk0 + c]``, in a fixed order, times
    ``factor``: the combine launch and the quantization pass that combines for itself run this same code, so both
    give the same bits."""
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for c in range(0, chunks):
        part = tl.load(PART + h * s_ph + (blk0 + c) * s_pb + offs_d, mask=d_ok, other=0.0)
        if ABS_MAX:
            acc = tl.maximum(acc, part, propagate_nan=tl.PropagateNan.ALL)   # (nan_max)
        else:   # chunk means back to sums: every chunk holds chunk_tokens tokens but the last
            acc += part * tl.minimum(chunk_tokens, n - c * chunk_tokens).to(tl.float32)
    if not ABS_MAX:
        acc = acc / tl.maximum(n, 1).to(tl.float32)
    return acc * factor


@triton.jit
def _combine_run(PART, OUT, s_ph, s_pb, s_oh, s_ob, b, h, blk0, chunks, chunk_tokens, n, d_ok, factor,
                 ABS_MAX: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(OUT + h * s_oh + b * s_ob + offs_d,
             _combined_parts(PART, s_ph, s_pb, h, blk0, chunks, chunk_tokens, n, d_ok, factor, ABS_MAX, BLOCK_D),
             mask=d_ok)


@triton.jit
def _combine_chunks_kernel(PART, PART2, OUT, OUT2, CU, BLK_CU, s_ph, s_pb, s_p2h, s_p2b, s_oh, s_ob, s_o2h, s_o2b,
                           num_heads, chunk_tokens, n_dense, head_dim, head_dim2, factor, factor2,
                           IS_VARLEN: tl.constexpr, ABS_MAX: tl.constexpr, ABS_MAX2: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """A whole sequence's mean (or max |x|) from its chunks' (``_token_stats_kernel``; sequence b's are
    ``BLK_CU[b]:BLK_CU[b+1]``), in a fixed order, times ``factor``; grid axis 1 = 1 combines the second input's."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // num_heads
    h = pid % num_heads
    _, _, n = _seq_bounds(CU, b, n_dense, IS_VARLEN)
    blk0 = tl.load(BLK_CU + b)
    chunks = tl.load(BLK_CU + b + 1) - blk0
    offs_d = tl.arange(0, BLOCK_D)
    if tl.program_id(1) == 0:
        _combine_run(PART, OUT, s_ph, s_pb, s_oh, s_ob, b, h, blk0, chunks, chunk_tokens, n, offs_d < head_dim,
                     factor, ABS_MAX, BLOCK_D)
    else:
        _combine_run(PART2, OUT2, s_p2h, s_p2b, s_o2h, s_o2b, b, h, blk0, chunks, chunk_tokens, n,
                     offs_d < head_dim2, factor2, ABS_MAX2, BLOCK_D)


def _blocks_cu(layout: SeqLayout, block_tokens: int, device, times: int = 1) -> torch.Tensor:
    """First block of every sequence when each is cut into runs of ``block_tokens`` (int32 [S + 1]), times
    ``times``."""
    if layout.is_varlen:
        return _packed_offsets(layout.cu_seqlens, block_tokens, times, device)
    return _steps(layout.num_seqs + 1, -(-layout.max_len // block_tokens) * times, device)


def _packed_blocks_cu(cu_seqlens, block_tokens, times, device):
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    cu = torch.zeros(cu_seqlens.numel(), dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(-(-lengths // block_tokens), 0)
    return cu * times if times != 1 else cu


# A packed batch's block offsets cost 8-10 small kernels a call (9 of a packed forward's launches, 13 of its
# backward's), and Transformers passes every layer of a step the same cu_seqlens: they are made once per tensor
# and made again only when it is written in place (its version counter moves). While a CUDA graph is captured
# they are always made (a graph replays its kernels, not this cache). id -> (weak reference, version, {key: value}).
_packed_cache = {}


def _packed_offsets(cu_seqlens, block_tokens, times, device):
    key = (block_tokens, times, device)
    try:
        version = cu_seqlens._version
    except RuntimeError:    # an inference-mode tensor has no version counter
        version = None
    if version is None or (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()):
        return _packed_blocks_cu(cu_seqlens, block_tokens, times, device)
    entry = _packed_cache.get(id(cu_seqlens))
    if entry is None or entry[0]() is not cu_seqlens or entry[1] != version:
        if len(_packed_cache) >= 16:
            _packed_cache.pop(next(iter(_packed_cache)))
        entry = _packed_cache[id(cu_seqlens)] = (weakref.ref(cu_seqlens), version, {})
    offsets = entry[2].get(key)
    if offsets is None:
        offsets = entry[2][key] = _packed_blocks_cu(cu_seqlens, block_tokens, times, device)
    return offsets


@functools.lru_cache(maxsize=64)
def _steps(count: int, step: int, device) -> torch.Tensor:
    """``arange(count) * step`` as int32, made once per shape: a padded batch's offsets cost two launches
    and their Python on every call otherwise (the kernels only read them)."""
    return torch.arange(count, dtype=torch.int32, device=device) * step


def token_stats(x4: torch.Tensor, layout: SeqLayout, abs_max: bool, block_tokens=None, row_mul=None):
    """Mean (or max |x|) over each sequence (or each run of ``block_tokens`` within it); ``row_mul`` (fp32 ``[B, H,
    N]``, tokens contiguous): each token's row times its factor first.

    Returns (``[H, blocks, D]`` fp32, ``cu_blocks`` int32 [S + 1])."""
    return _stats(x4, layout, abs_max, block_tokens, row_mul=row_mul)[:2]


def _stats(x4, layout, abs_max, block_tokens=None, factor=1.0, second=None, row_mul=None):
    """token_stats times ``factor``, and with ``second = (x4b, abs_max_b, factor_b)`` the same for a second
    input of the same heads and tokens (its own head dim) in the same launches, returned third (else None): the
    forward takes K's mean and V's channel scales in one pass. ``row_mul`` (fp32 ``[B, H, N]``, tokens
    contiguous): ``x4``'s rows times it first (the ds_bound rule's Q times each row's bound)."""
    assert row_mul is None or (row_mul.shape == x4.shape[:3] and row_mul.stride(2) == 1 and second is None)
    h, d = x4.shape[1], x4.shape[3]
    x2, abs_max2, factor2 = second if second is not None else (x4, abs_max, factor)
    assert x2.shape[:3] == x4.shape[:3]
    d2 = x2.shape[3]
    inputs = 2 if second is not None else 1
    whole = block_tokens is None
    if whole and layout.max_len > STATS_CHUNK:
        # One program per sequence would walk all its tokens alone (32 programs at B=2, H=16, N=16K: 1.8 ms
        # on an H100; a packed batch of 8 x 4K: 0.14 ms against 0.08 chunked): statistics per chunk in
        # parallel, then a fixed-order reduction (no atomics, so every call gives the same bytes).
        part, part_cu, part2 = _stats(x4, layout, abs_max, block_tokens=STATS_CHUNK,
                                      second=(x2, abs_max2, 1.0) if second is not None else None, row_mul=row_mul)
        part2 = part if part2 is None else part2
        stats = torch.empty(h, layout.num_seqs, d, device=x4.device, dtype=torch.float32)
        stats2 = torch.empty(h, layout.num_seqs, d2, device=x4.device, dtype=torch.float32) if second else stats
        launch(
            _combine_chunks_kernel, (layout.num_seqs * h, inputs),
            part, part2, stats, stats2, layout.cu_seqlens if layout.is_varlen else part_cu, part_cu,
            part.stride(0), part.stride(1), part2.stride(0), part2.stride(1),
            stats.stride(0), stats.stride(1), stats2.stride(0), stats2.stride(1), h,
            STATS_CHUNK, layout.max_len, d, d2, float(factor), float(factor2),
            IS_VARLEN=layout.is_varlen, ABS_MAX=abs_max, ABS_MAX2=abs_max2, BLOCK_D=_block_d(max(d, d2)))
        return stats, _steps(layout.num_seqs + 1, 1, x4.device), stats2 if second is not None else None
    block_tokens = max(layout.max_len, 1) if whole else block_tokens
    cu_blocks = _steps(layout.num_seqs + 1, 1, x4.device) if whole else _blocks_cu(layout, block_tokens, x4.device)
    # a packed batch's block count is only known on the device: an upper bound (each sequence's last block may be
    # partial) sizes the buffer without waiting for it
    total = layout.num_seqs if whole else (x4.shape[2] // block_tokens + layout.num_seqs if layout.is_varlen else
                                           layout.num_seqs * -(-layout.max_len // block_tokens))
    # (a padded batch's programs write every entry: no zero fill)
    alloc = torch.zeros if layout.is_varlen or total == 0 else torch.empty
    out = alloc(h, max(total, 1), d, device=x4.device, dtype=torch.float32)
    out2 = alloc(h, max(total, 1), d2, device=x4.device, dtype=torch.float32) if second is not None else out
    grid = (1 if whole else cdiv(max(layout.max_len, 1), block_tokens), layout.num_seqs * h, inputs)
    launch(
        _token_stats_kernel, grid,
        x4, x2, layout.cu_seqlens if layout.is_varlen else cu_blocks, cu_blocks, out, out2,
        row_mul if row_mul is not None else out, *strides4(x4), *strides4(x2), out.stride(0), out.stride(1),
        out2.stride(0), out2.stride(1), *strides3(row_mul)[:2],
        x4.shape[2], h, d, d2, block_tokens, float(factor), float(factor2),
        IS_VARLEN=layout.is_varlen, ABS_MAX=abs_max, ABS_MAX2=abs_max2, BLOCK_T=STATS_ROWS,
        BLOCK_D=_block_d(max(d, d2)), HAS_ROW_MUL=row_mul is not None,
    )
    return out, cu_blocks, out2 if second is not None else None


# (tokens, warps) per program of the quantization pass; tools/prep.py --tiles sweeps it
QUANTIZE_TILE = (64, 4)


def _block_d(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _padded_tokens(n: int) -> int:
    return -(-max(n, 1) // TOKEN_ALIGN) * TOKEN_ALIGN


def aligned_starts(layout: SeqLayout) -> torch.Tensor:
    """First column of every sequence of a packed batch when each starts 16-byte aligned (int32 [S + 1]).

    TMA faults (an illegal instruction) when a tile's innermost coordinate is not 16-byte aligned, and a packed
    batch's sequences start anywhere: the Gluon forward reads V^T laid out with these starts."""
    return _blocks_cu(layout, TOKEN_ALIGN, layout.cu_seqlens.device, times=TOKEN_ALIGN)


def _quantize_launch(x4: torch.Tensor, layout: SeqLayout, *, sub=None, sub_cu=None, sub_block=None,
                     channel_scale=None, natural=True, transposed=False, out_for_delta=None, t_starts=None, dot=None,
                     scaled=None, block_scale=False, operand_order=False, parts=None, zero_ints=None,
                     zero_rows=None, e4m3=False, channel_tile=None, transposed_e4m3=False, natural_int8=False,
                     row_mul=None):
    """``quantize``'s outputs and its launch, not made: (``Quantized``, grid, arguments, constexprs, warps)."""
    bsz, h, n, d = x4.shape
    dev = x4.device
    x8 = torch.empty(bsz, h, n, d, dtype=torch.int8, device=dev) if natural else None
    # with t_starts, each sequence pads by under TOKEN_ALIGN columns: a bound that needs no device sync
    width = _padded_tokens(n + (TOKEN_ALIGN - 1) * layout.num_seqs if t_starts is not None else n)
    # padding columns are zeros; where there are none (padded batches, N a multiple of 16) no fill is needed
    every_column = t_starts is None and not layout.is_varlen and width == n
    x8t = ((torch.empty if every_column else torch.zeros)(bsz, h, d, width, dtype=torch.int8, device=dev)
           if transposed else None)
    if channel_tile is not None:   # one scale per channel per channel_tile tokens of each sequence
        assert e4m3 and channel_scale is None and scaled is None and dot is None and not block_scale
        tile_scale = torch.empty(layout.num_seqs, h, cdiv(max(layout.max_len, 1), channel_tile), d,
                                 dtype=torch.float32, device=dev)
        channel_scale = tile_scale     # (the pass writes it where it reads V's channel scales)
    scale = None if channel_scale is not None else torch.empty(bsz, h, n, dtype=torch.float32, device=dev)
    delta = torch.empty(bsz, h, n, dtype=torch.float32, device=dev) if out_for_delta is not None else None
    row_dot = torch.empty(bsz, h, n, dtype=torch.float32, device=dev) if dot is not None else None
    scaled_out = torch.empty(bsz, h, n, dtype=torch.float32, device=dev) if scaled is not None else None
    # (the per-token scales of a copy with a rule of its own: an e4m3 x8t, or an INT8 x8 beside e4m3 channels)
    t_scale = torch.empty(bsz, h, n, dtype=torch.float32, device=dev) if transposed_e4m3 or natural_int8 else None
    assert not transposed_e4m3 or (transposed and scale is not None and not (e4m3 or block_scale))
    assert not natural_int8 or (natural and e4m3 and channel_scale is not None and channel_tile is None)
    assert not (transposed_e4m3 and natural_int8)
    assert row_mul is None or (channel_scale is not None and channel_tile is None and parts is None and dot is None
                               and sub is None and out_for_delta is None and not natural_int8
                               and row_mul.shape == x4.shape[:3] and row_mul.stride(2) == 1)
    scale = row_mul if row_mul is not None else scale   # (read there: a per-channel pass writes no token scale)
    assert t_scale is None or delta is not None or scale is not None   # (t_scale shares their strides)
    assert scaled is None or scale is not None
    assert dot is None or scale is not None    # row_dot shares scale's strides
    any_out = x8 if x8 is not None else x8t
    if any_out is None:
        raise ValueError("quantize writes x8 (natural) or x8t (transposed): neither was asked for")
    block_t, num_warps = (K_SCALE_BLOCK, 8) if block_scale else QUANTIZE_TILE
    if channel_tile is not None:   # a program a tile (8 warps for 128 tokens, as K's pass)
        block_t, num_warps = channel_tile, QUANTIZE_TILE[1] if channel_tile == QUANTIZE_TILE[0] else 8
    assert not (block_scale and channel_scale is not None)
    assert not e4m3 or not (block_scale or scaled is not None), "e4m3 bytes per channel, token or tile channel"
    assert parts is None or (channel_scale is not None or (sub is not None and sub_block == 1 << 30))
    assert zero_ints is None or (zero_ints.dtype == torch.int32 and zero_ints.numel() & (zero_ints.numel() - 1) == 0)
    assert zero_rows is None or (zero_rows.shape == x4.shape and zero_rows.stride(3) == 1)
    grid = (cdiv(max(layout.max_len, 1), block_t), layout.num_seqs * h)
    args = (
        x4, sub if sub is not None else x4, sub_cu if sub_cu is not None else any_out,
        channel_scale if channel_scale is not None else x4,
        out_for_delta if out_for_delta is not None else x4,
        x8 if x8 is not None else any_out, x8t if x8t is not None else any_out,
        scale if scale is not None else x4, scaled_out if scaled_out is not None else x4,
        delta if delta is not None else x4,
        layout.cu_seqlens if layout.is_varlen else any_out, t_starts if t_starts is not None else any_out,
        dot[0] if dot is not None else x4, row_dot if row_dot is not None else x4,
        parts[0] if parts is not None else x4, parts[1] if parts is not None else any_out,
        zero_ints if zero_ints is not None else any_out, zero_rows if zero_rows is not None else x4,
        t_scale if t_scale is not None else x4, *strides4(x4), *strides3(sub)[:2],
        *(channel_scale.stride()[1::-1] if channel_tile is not None else strides3(channel_scale)[:2]),
        *strides4(out_for_delta),
        *strides4(x8)[:3], *strides4(x8t)[:3], *strides3(scale if scale is not None else delta)[:2],
        *strides3(dot[0] if dot is not None else None)[:2],
        *strides3(parts[0] if parts is not None else None)[:2], *strides4(zero_rows)[:3],
        n, h, d, sub_block or 1, dot[1] if dot is not None else 1, float(dot[2]) if dot is not None else 1.0,
        float(scaled) if scaled is not None else 1.0, STATS_CHUNK, float(parts[2]) if parts is not None else 1.0,
    )
    constexprs = dict(
        IS_VARLEN=layout.is_varlen, HAS_SUB=sub is not None,
        PER_CHANNEL=channel_scale is not None and channel_tile is None, TILE_CHANNELS=channel_tile is not None,
        WITH_DELTA=delta is not None, WITH_SCALED=scaled is not None, WRITE_NATURAL=natural, WRITE_T=transposed,
        HAS_T_CU=t_starts is not None, WITH_DOT=dot is not None, BLOCK_SCALE=block_scale, BLOCK_T=block_t,
        BLOCK_D=_block_d(d), OPERAND_ORDER=operand_order, FROM_PARTS=parts is not None,
        ZERO_INTS=0 if zero_ints is None else zero_ints.numel(), ZERO_ROWS=zero_rows is not None, E4M3=e4m3,
        T_E4M3=transposed_e4m3, NAT_INT8=natural_int8, ROW_MUL=row_mul is not None,
    )
    scale = channel_scale if channel_tile is not None or row_mul is not None else scale
    return (Quantized(x8=x8, x8t=x8t, scale=scale, delta=delta, row_dot=row_dot, scaled=scaled_out,
                      t_scale=t_scale if transposed_e4m3 else None, x8_scale=t_scale if natural_int8 else None),
            grid, args, constexprs, num_warps)


def quantize(x4: torch.Tensor, layout: SeqLayout, *, sub=None, sub_cu=None, sub_block=None,
             channel_scale=None, natural=True, transposed=False, out_for_delta=None, t_starts=None, dot=None,
             scaled=None, block_scale=False, operand_order=False, parts=None, zero_ints=None, zero_rows=None,
             e4m3=False, channel_tile=None, transposed_e4m3=False, natural_int8=False, row_mul=None):
    """One pass over ``x4`` ``[B, H, N, D]`` -> ``Quantized`` with ``x8`` (natural ``[B, H, N, D]``), ``x8t``
    (``[B, H, D, N_pad]``), ``scale`` (per token ``[B, H, N]``, unless ``channel_scale`` given) and
    ``delta`` (``rowsum(x * out_for_delta)``) as asked. ``t_starts`` (packed batches): each sequence's first
    column in ``x8t`` (``aligned_starts``) instead of its first token. ``dot = (vectors [Hv, S, D], group,
    factor)``: also ``row_dot`` ``[B, H, N]``, each token of head h dotted with its sequence's vector of head
    h // group (before ``sub``), times factor. ``scaled`` (a float): also ``scaled``, the scales times it.
    ``block_scale``: one scale per ``K_SCALE_BLOCK`` tokens of each sequence (K's rule), still stored per token.
    ``operand_order``: ``x8t``'s tokens permuted inside each 16 of a sequence (``operand_order_columns``).
    ``parts = (chunks, chunks_cu, factor)``: ``sub`` (a whole sequence's mean, written here) or ``channel_scale``
    (written here) combined in this pass from the statistics pass's chunks (``_stats(..., block_tokens=
    STATS_CHUNK)``; ``factor`` as the combine's), the same bits as the combine launch would give.
    ``zero_ints``: an int32 tensor (a power of two of them) zeroed by the pass; ``zero_rows``: an fp32 tensor of
    ``x4``'s shape (contiguous last dim) whose rows the pass zeroes. ``e4m3`` (with ``channel_scale`` holding each
    channel's max |x|, not a scale): FP8 e4m3 bytes in ``x8`` / ``x8t`` (int8 tensors holding them), the max mapped
    to 448, round to nearest even; without ``channel_scale`` one scale per token, max / 448 in ``scale`` (448 / max
    rounded once, as ``sagebwd_hf.naive``'s e4m3 divides); with ``channel_tile`` too, one per channel per
    ``channel_tile`` tokens of each sequence, ``scale`` ``[S, H, tiles, D]`` holding max / 448.
    ``transposed_e4m3`` (per-token INT8 otherwise): ``x8t`` in FP8 e4m3 with its own per-token scales max / 448 in
    ``t_scale``, the bytes of a pass with ``e4m3`` alone, while ``x8`` stays INT8 (Q's pass under dk_e4m3).
    ``natural_int8`` (with ``e4m3`` and ``channel_scale``): ``x8`` in INT8 with one scale per token of its own, max /
    127 in ``x8_scale`` (quantize_per_token's bytes), while ``x8t`` keeps the per-channel e4m3 rule (dO under
    do_sequence with dp_int8). ``row_mul`` (fp32 ``[B, H, N]``, tokens contiguous; with ``channel_scale`` alone):
    each token's row times its factor before the channel scales (the ds_bound rule's Q times its rows' bounds)."""
    result, grid, args, constexprs, num_warps = _quantize_launch(
        x4, layout, sub=sub, sub_cu=sub_cu, sub_block=sub_block, channel_scale=channel_scale, natural=natural,
        transposed=transposed, out_for_delta=out_for_delta, t_starts=t_starts, dot=dot, scaled=scaled,
        block_scale=block_scale, operand_order=operand_order, parts=parts, zero_ints=zero_ints, zero_rows=zero_rows,
        e4m3=e4m3, channel_tile=channel_tile, transposed_e4m3=transposed_e4m3, natural_int8=natural_int8,
        row_mul=row_mul)
    launch(_quantize_kernel, grid, *args, **constexprs, num_warps=num_warps)
    return result


def quantize_pair(x4, layout, options, x4_b, layout_b, options_b):
    """``quantize(x4, layout, **options)`` and ``quantize(x4_b, layout_b, **options_b)`` in one launch (the same
    bytes: each input's programs are the ones ``quantize`` would launch, same tile and warps); both must take the
    same program tile (neither ``block_scale``). Returns the two ``Quantized``."""
    first, grid, args, constexprs, warps = _quantize_launch(x4, layout, **options)
    second, grid_b, args_b, constexprs_b, warps_b = _quantize_launch(x4_b, layout_b, **options_b)
    assert warps == warps_b and constexprs["BLOCK_T"] == constexprs_b["BLOCK_T"], "one program tile for both"
    launch(_quantize_pair_kernel, (max(grid[0], grid_b[0]), max(grid[1], grid_b[1]), 2), *args, *args_b,
           grid[1], grid_b[1], **constexprs, **{name + "_B": value for name, value in constexprs_b.items()},
           num_warps=warps)
    return first, second


def quantize_qk(q4, k4, layout_q: SeqLayout, layout_k: SeqLayout, softmax_scale: float,
                k_smoothing: bool, q_smoothing: bool, transposed: bool = False, row_shift: bool = False, v4=None,
                operand_order: bool = False, t_starts_q=None, t_starts_k=None, k_transposed: Optional[bool] = None,
                fused: bool = False, zero_ints=None, zero_rows=None, v_e4m3: bool = False):
    """INT8 Q and K for ``S = Q K^T`` (and, with ``transposed``, their token-major copies for the backward).

    Returns a ``QuantizedQK``: ``q8, q_scale`` (softmax scale and log2(e) folded in, so the kernels use exp2),
    ``q_scale_raw``, ``k8, k_scale``, ``q8t, k8t``, for Q-smoothing ``q_mean`` (``[H, blocks, D]``,
    scaled like ``q_scale``) and ``q_mean_cu`` (first block of each sequence), and with K-smoothing ``k_mean``
    (``[Hkv, S, D]``) and, if ``row_shift``, ``q_shift`` (``softmax_scale * q . mean(k)`` per query, ``[B, H, N]``:
    how far K-smoothing moved each row's scores; soft-capping and sinks need it back). With ``v4`` (the forward)
    also ``v_scale`` (``[Hkv, S, Dv]``, for ``quantize_v``), from the same launches as K's mean.
    ``operand_order``: ``q8t`` and ``k8t`` in ``quantize``'s operand order (the Gluon backward's);
    ``t_starts_q`` / ``t_starts_k``: their sequences' first columns (packed batches: ``aligned_starts``).
    ``k_transposed`` (default: ``transposed``): whether K's token-major copy is made (the Hopper one launch reads
    only Q's; its ``k8t`` is then None).
    ``fused``: the same bytes in fewer launches: where a sequence is longer than a statistics chunk, K's pass
    combines K's mean from the chunks itself (no combine launch), and V's channel scales are left to
    ``quantize_v`` as chunks (``v_parts``; ``v_scale`` None); ``zero_ints`` / ``zero_rows`` are zeroed by Q's pass
    (``quantize``'s). ``v_e4m3``: V's statistics for ``quantize_v(..., e4m3=True)`` (each channel's max |v|).
    """
    return _quantize_qk(q4, k4, layout_q, layout_k, softmax_scale, k_smoothing, q_smoothing, transposed, row_shift, v4,
                        operand_order, t_starts_q, t_starts_k, k_transposed, fused, zero_ints, zero_rows,
                        v_e4m3=v_e4m3)[0]


def _quantize_qk(q4, k4, layout_q, layout_k, softmax_scale, k_smoothing, q_smoothing, transposed, row_shift, v4,
                 operand_order, t_starts_q, t_starts_k, k_transposed, fused, zero_ints, zero_rows, partner=None,
                 v_e4m3=False, qt_e4m3=False):
    """quantize_qk, and with ``partner`` a second input quantized in Q's launch (``quantize_pair``):
    ``partner(v_scale, v_parts)`` gives its ``(x4, layout, options)``; returns (QuantizedQK, its Quantized or
    None). ``qt_e4m3``: Q's token-major copy in FP8 e4m3 with its own per-token scales (``quantize``'s
    ``transposed_e4m3``; without Q-smoothing)."""
    k_sub = k_cu = v_scale = k_parts = v_parts = None
    v_factor = _v_stats_factor(v_e4m3)
    v_stats = (v4, True, v_factor) if v4 is not None else None
    if fused and layout_k.max_len > STATS_CHUNK and (k_smoothing or v4 is not None):
        # the chunks _stats would combine, combined instead by the passes that read them
        chunks, chunks_cu, v_chunks = _stats(k4 if k_smoothing else v4, layout_k, not k_smoothing,
                                             block_tokens=STATS_CHUNK,
                                             second=(v4, True, 1.0) if k_smoothing and v4 is not None else None)
        if k_smoothing:
            k_parts = (chunks, chunks_cu, 1.0)
            k_sub = torch.empty(k4.shape[1], layout_k.num_seqs, k4.shape[3], device=k4.device, dtype=torch.float32)
        else:
            v_chunks = chunks
        if v4 is not None:
            v_parts = (v_chunks, chunks_cu, v_factor)
    elif k_smoothing:   # softmax is unchanged: every score of a row moves by the same q . mean(k)
        k_sub, k_cu, v_scale = _stats(k4, layout_k, False, second=v_stats)
    elif v4 is not None:
        v_scale = _stats(v4, layout_k, True, factor=v_factor)[0]
    k_transposed = transposed if k_transposed is None else k_transposed
    k = quantize(k4, layout_k, sub=k_sub, sub_cu=k_cu, sub_block=1 << 30, transposed=k_transposed,
                 block_scale=k4.shape[-1] in K_BLOCK_HEAD_DIMS, operand_order=operand_order, t_starts=t_starts_k,
                 parts=k_parts)
    q_mean = q_cu = None
    if q_smoothing:   # S = (q - q_mean) K^T + q_mean K^T; the second term is added back in fp32
        q_mean, q_cu = token_stats(q4, layout_q, abs_max=False, block_tokens=Q_SMOOTH_BLOCK)
    dot = (k_sub, q4.shape[1] // k4.shape[1], softmax_scale) if row_shift and k_smoothing else None
    assert not qt_e4m3 or (transposed and not q_smoothing), "an e4m3 Q^T needs Q's own (unsmoothed) copy"
    q_options = dict(sub=q_mean, sub_cu=q_cu, sub_block=Q_SMOOTH_BLOCK, transposed=transposed and not q_smoothing,
                     dot=dot, scaled=softmax_scale * LOG2E, operand_order=operand_order, t_starts=t_starts_q,
                     zero_ints=zero_ints, zero_rows=zero_rows, transposed_e4m3=qt_e4m3)
    paired = None
    if partner is None:
        q = quantize(q4, layout_q, **q_options)
    else:
        q, paired = quantize_pair(q4, layout_q, q_options, *partner(v_scale, v_parts))
    return QuantizedQK(q8=q.x8, q_scale=q.scaled, q_scale_raw=q.scale, v_scale=v_scale,
                       q8t=q.x8t, k8=k.x8, k_scale=k.scale, k8t=k.x8t,
                       q_mean=None if q_mean is None else q_mean * (softmax_scale * LOG2E), q_mean_cu=q_cu,
                       k_mean=k_sub, q_shift=q.row_dot, v_parts=v_parts, qt_scale=q.t_scale), paired


def operand_order_columns(n: int) -> torch.Tensor:
    """Where ``quantize(..., operand_order=True)`` puts each of ``n`` tokens (n a multiple of 16): inside each 16,
    token c goes to column (c0, c3, c1, c2) read as bits 0-3. The Gluon forward feeds P to ``P V`` from the
    registers its softmax left it in, which hold P's keys in that order (hopper_common.to_operand_order): V's
    token-major copy takes the same order, so the product is unchanged (a permutation of its sum)."""
    c = torch.arange(n) % 16
    return torch.arange(n) - c + (c & 1) + ((c >> 3) & 1) * 2 + ((c >> 1) & 1) * 4 + ((c >> 2) & 1) * 8


def quantize_v(v4: torch.Tensor, layout: SeqLayout, t_starts=None, v_scale=None, operand_order=False, v_parts=None,
               e4m3=False):
    """Per-channel INT8 V in token-major layout: (``v8t [B, H, D, N_pad]``, ``v_scale`` viewed ``[S, H, D]``);
    ``t_starts`` as ``quantize``'s; ``v_scale`` ``[H, S, D]`` if already taken (``quantize_qk(..., v4=)``);
    ``operand_order``: each sequence's tokens permuted inside each 16 as the Gluon forward reads them
    (``operand_order_columns``); ``v_parts``: ``quantize_qk(..., fused=True)``'s, the scales combined by this pass.
    ``e4m3`` (the pv_e4m3 rule): ``v8t`` holds FP8 e4m3 bytes, each channel's max |v| mapped to 448, and
    ``v_scale`` that max itself (the scale times 448: the reference's 448 / max and max / 448 are both taken from it,
    the second by the forward kernel; from ``quantize_qk(..., v_e4m3=True)`` if already taken).
    """
    v_scale, options = _v_options(v4, layout, t_starts, v_scale, operand_order, v_parts, e4m3)
    return quantize(v4, layout, **options).x8t, v_scale.transpose(0, 1)


def _v_stats_factor(e4m3: bool) -> float:
    """What V's channel maxima are multiplied by into ``quantize_v``'s ``v_scale``: 1/127 (INT8's scale), or 1 with
    e4m3 (the max itself)."""
    return 1.0 if e4m3 else 1.0 / constants.INT8_MAX


def _v_options(v4, layout, t_starts, v_scale, operand_order, v_parts, e4m3=False):
    """(V's scales ``[H, S, D]``, ``quantize``'s options for V's pass) of ``quantize_v``."""
    if v_parts is not None:
        v_scale = torch.empty(v4.shape[1], layout.num_seqs, v4.shape[3], device=v4.device, dtype=torch.float32)
    elif v_scale is None:
        v_scale = _stats(v4, layout, True, factor=_v_stats_factor(e4m3))[0]      # [H, S, D]
    return v_scale, dict(channel_scale=v_scale, natural=False, transposed=True, t_starts=t_starts,
                         operand_order=operand_order, parts=v_parts, e4m3=e4m3)


def quantize_do_sequence(do4: torch.Tensor, layout: SeqLayout, group: int, out_for_delta: torch.Tensor,
                         t_starts=None, operand_order: bool = False, natural_int8: bool = False) -> Quantized:
    """dO for the do_sequence rule: token-major FP8 e4m3 bytes (``x8t``), each channel's max |dO| over its sequence
    and the ``group`` query heads of its KV group mapped to 448, with ``delta``; ``scale`` holds those maxima
    ``[S, H, D]`` (every head of a group its group's; a view of ``[H, S, D]``). ``natural_int8`` (the dp_int8 rule):
    also ``x8``, dO in INT8 with one scale per token (``x8_scale``), from the same pass."""
    stats = kv_group_max(_stats(do4, layout, True)[0], group)                    # [H, S, D]
    result = quantize(do4, layout, channel_scale=stats, natural=natural_int8, transposed=True,
                      out_for_delta=out_for_delta, t_starts=t_starts, operand_order=operand_order, e4m3=True,
                      natural_int8=natural_int8)
    return result._replace(scale=stats.transpose(0, 1))


def kv_group_max(stats: torch.Tensor, group: int) -> torch.Tensor:
    """``[H, S, D]`` statistics -> each KV group's maximum, at every head of the group (amax keeps a NaN)."""
    if group == 1:
        return stats
    h = stats.shape[0]
    stats = stats.view(h // group, group, *stats.shape[1:]).amax(1, keepdim=True)
    return stats.expand(-1, group, -1, -1).reshape(h, *stats.shape[2:]).contiguous()


def prepare_forward(q4, k4, v4, layout_q: SeqLayout, layout_k: SeqLayout, softmax_scale: float, k_smoothing: bool,
                    q_smoothing: bool, row_shift: bool = False, v_starts=None, v_operand_order: bool = False,
                    zero_ints=None, v_e4m3: bool = False):
    """The forward's preparation in the fewest launches: ``quantize_qk(..., v4=v4, fused=True)`` and
    ``quantize_v`` with V quantized in Q's launch (the same bytes as the separate passes). Returns
    (``QuantizedQK``, ``v8t``, ``v_scale``) as those give them; ``v_e4m3``: V as ``quantize_v(..., e4m3=True)``."""
    v_scale = []

    def v_pass(scale, parts):
        scale, options = _v_options(v4, layout_k, v_starts, scale, v_operand_order, parts, v_e4m3)
        v_scale.append(scale)
        return v4, layout_k, options
    quant, v = _quantize_qk(q4, k4, layout_q, layout_k, softmax_scale, k_smoothing, q_smoothing, False, row_shift, v4,
                            False, None, None, None, True, zero_ints, None, partner=v_pass, v_e4m3=v_e4m3)
    return quant, v.x8t, v_scale[0].transpose(0, 1)


def prepare_backward(q4, k4, do4, o4, layout_q: SeqLayout, layout_k: SeqLayout, softmax_scale: float,
                     k_smoothing: bool, q_smoothing: bool, row_shift: bool = False, operand_order: bool = False,
                     t_starts_q=None, t_starts_k=None, k_transposed: bool = True, zero_ints=None, zero_rows=None,
                     do_e4m3: bool = False, do_channel_tile: Optional[int] = None, do_group: Optional[int] = None,
                     qt_e4m3: bool = False, do_int8_rows: bool = False, q_transposed: bool = True):
    """The backward's preparation in the fewest launches: ``quantize_qk(..., transposed=True, fused=True)`` and dO's
    pass (``quantize(do4, natural=False, transposed=True, out_for_delta=o4)``: token-major INT8, scales, delta) in
    Q's launch (the same bytes as the separate passes). Returns (``QuantizedQK``, dO's ``Quantized``).
    ``do_e4m3`` (the pv_e4m3 rule's dV): dO in FP8 e4m3, one scale per token (``quantize``'s ``e4m3``), or with
    ``do_channel_tile`` one per channel per that many queries of each sequence (with p_static: the dK/dV kernel's
    query tile); a pass of its own unless its program tile is Q's. ``do_group`` (the do_sequence rule): dO by
    ``quantize_do_sequence`` with KV groups of that many query heads, after its own statistics pass. ``qt_e4m3`` (the
    dk_e4m3 rule's dK, without Q-smoothing): Q's token-major copy in FP8 e4m3 from Q's pass (``q8t``, ``qt_scale``)
    instead of INT8. ``do_int8_rows`` (with ``do_group``: the dp_int8 rule): dO's pass also writes dO in INT8 with
    one scale per token (``x8``, ``x8_scale``). ``q_transposed`` False: no token-major copy of Q (the ds_bound rule
    writes its own: ``quantize_ds_bound``)."""
    assert not do_int8_rows or do_group is not None
    do_options = dict(natural=False, transposed=True, out_for_delta=o4, operand_order=operand_order,
                      t_starts=t_starts_q, e4m3=do_e4m3, channel_tile=do_channel_tile)
    alone = (do_channel_tile is not None and do_channel_tile != QUANTIZE_TILE[0]) or do_group is not None
    quant, do_q = _quantize_qk(q4, k4, layout_q, layout_k, softmax_scale, k_smoothing, q_smoothing, q_transposed,
                               row_shift, None, operand_order, t_starts_q, t_starts_k, k_transposed, True, zero_ints,
                               zero_rows, partner=None if alone else lambda scale, parts: (do4, layout_q, do_options),
                               qt_e4m3=qt_e4m3)
    if do_group is not None:
        return quant, quantize_do_sequence(do4, layout_q, do_group, o4, t_starts_q, operand_order,
                                           natural_int8=do_int8_rows)
    return quant, quantize(do4, layout_q, **do_options) if alone else do_q
