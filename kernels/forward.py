"""SageBwd forward: ``O = softmax(Q K^T) V`` with both products in INT8.

One program per (query tile, sequence, query head); an online softmax in base 2 walks the key tiles.
``S = Q8 K8^T`` is exact in int32 and dequantized with the per-token scales. ``P`` is quantized per row
of each key tile, with the row's largest value in the tile mapped to 127, so rows whose tile holds only
small probabilities keep their resolution. ``P8 V8`` is again exact in int32 and
scaled once per tile; V's per-channel scale is applied at the very end.

With ``SOFTCAP`` the dequantized base-2 scores are capped, ``cap * tanh(s / cap)``, before the softmax; the
row's K-smoothing shift (``SHIFT``) is added back first, since the cap sees the caller's scores.

Key tiles always start at multiples of BLOCK_N (the P scales depend on the tiling, and the PyTorch
reference uses the same one). Only tiles that cross the causal/window band or the end of the keys pay
for a mask: the loop over the key range is split into masked edges and an unmasked middle.
"""
import os

import torch
import triton
import triton.language as tl

from .launch import launch
from .layout import SeqLayout, cdiv, maybe, strides3, strides4
from .plan import block_dim  # (the portable kernels' head-dim tile: re-exported)
from .quantize import (INT8_MAX, LOG2_127, LOG2E, LOG2E_CONSTEXPR, Q_SMOOTH_BLOCK, TINY_SCALE, _seq_bounds, int32_times,
                       round_to_int8)


@triton.jit
def _floor_to(x, BLOCK: tl.constexpr):
    return (tl.maximum(x, 0) // BLOCK) * BLOCK


@triton.jit
def _ceil_to(x, BLOCK: tl.constexpr):
    return ((tl.maximum(x, 0) + BLOCK - 1) // BLOCK) * BLOCK


@triton.jit
def tanh_scores(y, FAST_TANH: tl.constexpr):
    """tanh for the soft cap ``cap * tanh(s / cap)``; callers fold 1/cap into the score's dequantization FMA and
    cap into exp2's. On NVIDIA GPUs PTX's ``tanh.approx.f32`` (one MUFU op; relative error 2^-10.99, eight times
    finer than bf16's rounding of the same score in eager Gemma 2 attention; FlashAttention's soft cap uses it
    too): ``1 - 2 / (e^(2y) + 1)`` with ``rcp.approx`` took three MUFU ops a score with P's exp2, and the capped
    kernels ran at 0.5-0.7 of the plain ones per FLOP (H100, docs/history.md). Elsewhere (the
    interpreter) that exact form, which saturates to +-1 without NaN at +-inf."""
    if FAST_TANH:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [y], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        t = 1.0 - 2.0 / (tl.exp2(y * 2.8853900817779268) + 1.0)   # 2 log2(e)
    return t


def fast_tanh(device) -> bool:
    """Whether the kernels may use PTX's tanh.approx (an NVIDIA GPU; not the interpreter, not ROCm)."""
    return device.type == "cuda" and torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _key_tiles(start_m, seqlen_q, seqlen_k, window_left, window_right,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, BOUND_KEYS: tl.constexpr):
    """Key tiles seen by the query tile at ``start_m``: ``[lo, full_lo)`` and ``[full_hi, hi)`` need the
    mask, ``[full_lo, full_hi)`` does not. Masks are aligned bottom-right: query i sees key j when
    ``i + diag - window_left <= j <= i + diag + window_right``, ``diag = seqlen_k - seqlen_q``.
    ``BOUND_KEYS``: keys past the end must be masked too (they are harmless where P is multiplied by
    zero-filled K or V anyway)."""
    diag = seqlen_k - seqlen_q
    hi = seqlen_k
    if BOUND_KEYS:
        full_hi = _floor_to(seqlen_k, BLOCK_N)
    else:
        full_hi = _ceil_to(seqlen_k, BLOCK_N)
    lo = 0
    full_lo = 0
    if MASK_RIGHT:
        hi = tl.minimum(hi, start_m + BLOCK_M + diag + window_right)
        full_hi = tl.minimum(full_hi, _floor_to(start_m + diag + window_right + 1, BLOCK_N))
    if MASK_LEFT:
        lo = _floor_to(start_m + diag - window_left, BLOCK_N)
        full_lo = _ceil_to(start_m + BLOCK_M - 1 + diag - window_left, BLOCK_N)
    hi = _ceil_to(hi, BLOCK_N)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _score_mask(rows, cols, seqlen_q, seqlen_k, window_left, window_right,
                MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """Booleans, broadcast of query indices ``rows`` against key indices ``cols`` (both 2D, either
    orientation): in bounds and inside the causal/window band."""
    diag = seqlen_k - seqlen_q
    valid = (rows < seqlen_q) & (cols < seqlen_k)
    if MASK_RIGHT:
        valid = valid & (cols <= rows + diag + window_right)
    if MASK_LEFT:
        valid = valid & (cols >= rows + diag - window_left)
    return valid


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q8, q_scale, q_mean, shift, softcap2, K8_base, KS_base, V8T_base, lo, hi,
               offs_m, offs_n, offs_d, d_ok, offs_dv, dv_ok, k0, seqlen_q, seqlen_k, window_left, window_right, s_k8t,
               s_vtd, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
               Q_SMOOTH: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q8, q_scale, q_mean, shift, softcap2, K8_base, KS_base, V8T_base,
                                  tl.multiple_of(start_n, BLOCK_N), offs_m, offs_n, offs_d, d_ok, offs_dv, dv_ok, k0,
                                  seqlen_q, seqlen_k, window_left, window_right, s_k8t, s_vtd,
                                  MASKED, MASK_LEFT, MASK_RIGHT, Q_SMOOTH, SOFTCAP, FAST_TANH)
    return acc, m_i, l_i


@triton.jit
def _fwd_tile(acc, m_i, l_i, q8, q_scale, q_mean, shift, softcap2, K8_base, KS_base, V8T_base, start_n,
              offs_m, offs_n, offs_d, d_ok, offs_dv, dv_ok, k0, seqlen_q, seqlen_k, window_left, window_right, s_k8t,
              s_vtd, MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
              Q_SMOOTH: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr):
    cols = start_n + offs_n
    n_ok = cols < seqlen_k
    k8t = tl.load(K8_base + (k0 + cols)[None, :] * s_k8t + offs_d[:, None],
                  mask=n_ok[None, :] & d_ok[:, None], other=0)
    k_scale = tl.load(KS_base + k0 + cols, mask=n_ok, other=0.0)
    # Scores in two FMAs per element: t = S_int * k_scale here, s = t * q_scale inside exp2's argument. The
    # row maximum is taken on t (q_scale >= 0 scales a row uniformly; the caller clamps it above zero, so
    # masked -inf entries stay -inf).
    t = int32_times(tl.dot(q8, k8t, out_dtype=tl.int32), k_scale[None, :])
    if Q_SMOOTH:   # the smoothed-out block mean adds a per-key score: fold it in, one more FMA
        t = tl.fma(t, q_scale[:, None], (tl.sum(q_mean[:, None] * k8t.to(tl.float32), 0) * k_scale)[None, :])
        row_scale = tl.full([offs_m.shape[0]], 1.0, tl.float32)
    else:
        row_scale = q_scale
    if SOFTCAP:   # t = tanh((s + shift) / cap), the cap left in row_scale (masked entries -inf after the cap)
        inv_cap = 1.0 / softcap2
        t = tanh_scores(tl.fma(t, (row_scale * inv_cap)[:, None], (shift * inv_cap)[:, None]), FAST_TANH)
        row_scale = tl.full([offs_m.shape[0]], softcap2, tl.float32)
    if MASKED:
        valid = _score_mask(offs_m[:, None], cols[None, :], seqlen_q, seqlen_k, window_left, window_right,
                            MASK_LEFT, MASK_RIGHT)
        t = tl.where(valid, t, float("-inf"))

    tile_max = tl.max(t, 1) * row_scale
    m_new = tl.maximum(m_i, tile_max)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_ref)
    # One exp2 per score gives P already scaled for INT8: e = 127 * p / max_tile(p) = 127 * exp2(s - tile_max)
    # (the row's largest p in the tile maps to 127). p itself is e * p_scale.
    e_ref = tl.where(tile_max == float("-inf"), 0.0, tile_max - LOG2_127)
    e = tl.exp2(tl.fma(t, row_scale[:, None], -e_ref[:, None]))
    p_scale = tl.exp2(tile_max - m_ref) * (1.0 / INT8_MAX)
    l_i = l_i * alpha + tl.sum(e, 1) * p_scale
    v8 = tl.load(V8T_base + offs_dv[None, :] * s_vtd + (k0 + cols)[:, None],
                 mask=n_ok[:, None] & dv_ok[None, :], other=0)
    acc = acc * alpha[:, None] + int32_times(tl.dot(round_to_int8(e), v8, out_dtype=tl.int32), p_scale[:, None])
    return acc, m_new, l_i


@triton.jit
def _attn_fwd_kernel(
    Q8, QS, K8, KS, V8T, VS, QMEAN, QMEAN_CU, O, LSE, SHIFT, SINKS, CU_Q, CU_K,
    s_q8b, s_q8h, s_q8t,
    s_qsb, s_qsh,
    s_k8b, s_k8h, s_k8t,
    s_ksb, s_ksh,
    s_vtb, s_vth, s_vtd,
    s_vsb, s_vsh,
    s_qmh, s_qmb,
    s_ob, s_oh, s_ot, s_od,
    s_lb, s_lh,
    n_q, n_k, num_heads, group, head_dim, head_dim_v, window_left, window_right, softcap2,
    IS_VARLEN: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    Q_SMOOTH: tl.constexpr, QSB: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr,
    SINK_MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)   # every head/batch offset in 64 bits (see _seq_bounds)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    hk = h // group
    bq, q0, seqlen_q = _seq_bounds(CU_Q, b, n_q, IS_VARLEN)
    bk, k0, seqlen_k = _seq_bounds(CU_K, b, n_k, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seqlen_q
    d_ok = offs_d < head_dim
    offs_dv = tl.arange(0, BLOCK_DV)     # V's and O's head dim (MLA: not Q's and K's)
    dv_ok = offs_dv < head_dim_v

    q8 = tl.load(Q8 + bq * s_q8b + h * s_q8h + (q0 + offs_m)[:, None] * s_q8t + offs_d[None, :],
                 mask=m_ok[:, None] & d_ok[None, :], other=0)
    # kept above zero: the tiles scale masked (-inf) scores by it, and an all-zero row has scale 0 (a NaN scale,
    # from a NaN in the row, stays NaN)
    q_scale = tl.maximum(tl.load(QS + bq * s_qsb + h * s_qsh + q0 + offs_m, mask=m_ok, other=0.0), TINY_SCALE,
                         propagate_nan=tl.PropagateNan.ALL)
    q_mean = q_scale  # unused unless Q_SMOOTH
    if Q_SMOOTH:  # all rows of this tile share one Q-mean block
        blk = tl.load(QMEAN_CU + b) + start_m // QSB
        q_mean = tl.load(QMEAN + h * s_qmh + blk * s_qmb + offs_d, mask=d_ok, other=0.0)
    shift = q_scale  # unused unless SOFTCAP
    if SOFTCAP:
        shift = tl.load(SHIFT + bq * s_lb + h * s_lh + q0 + offs_m, mask=m_ok, other=0.0)

    K8_base = K8 + bk * s_k8b + hk * s_k8h
    KS_base = KS + bk * s_ksb + hk * s_ksh
    V8T_base = V8T + bk * s_vtb + hk * s_vth

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    lo, full_lo, full_hi, hi = _key_tiles(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                          BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, True)
    # masked left edge, unmasked middle, masked right edge
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q8, q_scale, q_mean, shift, softcap2, K8_base, KS_base, V8T_base,
                               lo, full_lo, offs_m, offs_n, offs_d, d_ok, offs_dv, dv_ok, k0, seqlen_q, seqlen_k,
                               window_left, window_right, s_k8t, s_vtd, BLOCK_N, True, MASK_LEFT, MASK_RIGHT,
                               Q_SMOOTH, SOFTCAP, FAST_TANH)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q8, q_scale, q_mean, shift, softcap2, K8_base, KS_base, V8T_base,
                               full_lo, full_hi, offs_m, offs_n, offs_d, d_ok, offs_dv, dv_ok, k0, seqlen_q, seqlen_k,
                               window_left, window_right, s_k8t, s_vtd, BLOCK_N, False, MASK_LEFT, MASK_RIGHT,
                               Q_SMOOTH, SOFTCAP, FAST_TANH)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q8, q_scale, q_mean, shift, softcap2, K8_base, KS_base, V8T_base,
                               full_hi, hi, offs_m, offs_n, offs_d, d_ok, offs_dv, dv_ok, k0, seqlen_q, seqlen_k,
                               window_left, window_right, s_k8t, s_vtd, BLOCK_N, True, MASK_LEFT, MASK_RIGHT,
                               Q_SMOOTH, SOFTCAP, FAST_TANH)

    v_scale = tl.load(VS + b * s_vsb + hk * s_vsh + offs_dv, mask=dv_ok, other=0.0)
    has_keys = l_i != 0.0   # (not l_i > 0: a NaN row sum, from a NaN or inf input, stays NaN, as in SDPA)
    # base-2 log-sum-exp; +inf for empty rows makes the backward's exp2(s - lse) exactly 0
    lse = tl.where(has_keys, m_i + tl.log2(l_i), float("inf"))
    inv_l = tl.where(has_keys, 1.0 / l_i, 0.0)                  # fully masked rows give zeros, not NaN
    if SINK_MODE > 0:   # the head's sink joins the denominator (sinks.add_sinks' arithmetic, per row here)
        sink = tl.load(SINKS + h).to(tl.float32)
        if SINK_MODE == 2:   # K-smoothing moved the scores by -shift: the sink, in their frame, too
            sink = sink - tl.load(SHIFT + bq * s_lb + h * s_lh + q0 + offs_m, mask=m_ok, other=0.0)
        sink2 = sink * LOG2E_CONSTEXPR                       # log2(e): the kernels' scores are base 2
        top = tl.maximum(lse, sink2)
        new_lse = top + tl.log2(tl.exp2(lse - top) + tl.exp2(sink2 - top))
        inv_l = tl.where(has_keys, tl.exp2(lse - new_lse) / l_i, 0.0)
        lse = tl.where(has_keys, new_lse, lse)                  # a row with no key: zeros, lse +inf, as before
    out = acc * inv_l[:, None] * v_scale[None, :]
    tl.store(O + bq * s_ob + h * s_oh + (q0 + offs_m)[:, None] * s_ot + offs_dv[None, :] * s_od,
             out.to(O.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])
    tl.store(LSE + bq * s_lb + h * s_lh + q0 + offs_m, lse, mask=m_ok)


def launch_forward(quant, v8t, v_scale, out4, lse, layout_q: SeqLayout, layout_k: SeqLayout,
                   num_heads, group, head_dim, window, config, softcap=0.0, shift=None, sinks=None,
                   sink_shift=None):
    """Run the forward kernel; ``out4`` ``[B, Hq, N, Dv]`` (any strides) and ``lse`` ``[B, Hq, N]`` fp32 are
    written (``Dv``: V's head dim, ``v8t.shape[2]``; it may differ from ``head_dim``, Q's and K's).
    ``softcap`` > 0 (natural units) caps the scores after adding ``shift`` (base 2, lse's layout). ``sinks``
    ``[Hq]`` (natural units, contiguous) join each row's denominator, in the kernels' frame less ``sink_shift``
    (natural units, lse's layout: K-smoothing's row shift; None when the scores are the caller's): ``out4`` and
    ``lse`` come out as the sink-softmax's."""
    assert not softcap or (shift is not None and shift.stride() == lse.stride())
    assert not (softcap and sink_shift is not None), "capped scores are already the caller's"
    assert sink_shift is None or sink_shift.stride() == lse.stride()
    if sink_shift is not None:
        shift = sink_shift
    sink_mode = 0 if sinks is None else 2 if sink_shift is not None else 1
    block_m, block_n, block_d, num_warps, num_stages = config
    assert Q_SMOOTH_BLOCK % block_m == 0
    q8, k8 = quant.q8, quant.k8
    q_mean = quant.q_mean
    grid = (cdiv(layout_q.max_len, block_m), layout_q.num_seqs * num_heads)
    return launch(
        _attn_fwd_kernel, grid,
        q8, quant.q_scale, k8, quant.k_scale, v8t, v_scale,
        maybe(q_mean, v_scale), maybe(quant.q_mean_cu, q8), out4, lse, maybe(shift, lse), maybe(sinks, lse),
        maybe(layout_q.cu_seqlens, q8), maybe(layout_k.cu_seqlens, q8),
        *strides4(q8)[:3], *strides3(quant.q_scale)[:2],
        *strides4(k8)[:3], *strides3(quant.k_scale)[:2],
        *strides4(v8t)[:3], *strides3(v_scale)[:2],
        *strides3(q_mean)[:2],
        *strides4(out4), *strides3(lse)[:2],
        q8.shape[2], k8.shape[2], num_heads, group, head_dim, out4.shape[3], window[0], window[1],
        float(softcap) * LOG2E,
        IS_VARLEN=layout_q.is_varlen, MASK_LEFT=window[0] >= 0, MASK_RIGHT=window[1] >= 0,
        Q_SMOOTH=q_mean is not None, QSB=Q_SMOOTH_BLOCK, SOFTCAP=bool(softcap), FAST_TANH=fast_tanh(q8.device),
        SINK_MODE=sink_mode,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dim(out4.shape[3]),
        num_warps=num_warps, num_stages=num_stages,
    )
