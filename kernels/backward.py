"""SageBwd backward: dQ, dK, dV with four of the five products in INT8.

Two kernels, as in Triton's fused-attention tutorial, so that no gradient needs atomics (the result is
deterministic and GQA head groups are summed in registers):

* ``_attn_bwd_dkdv_kernel``: one program per (key tile, sequence, KV head); walks the query tiles of every
  query head in its group. ``S^T = K8 Q8^T`` (INT8), ``dP^T = V dO^T`` (input dtype, fp32 accumulation),
  ``dV += P^T dO`` and ``dK += dS^T Q`` (INT8). It can also run as two launches, dV alone and dK alone
  (``DO_DV``/``DO_DK``): S and P are computed twice, but each launch holds one accumulator, not two.
* ``_attn_bwd_dq_kernel``: one program per (query tile, sequence, query head); walks the key tiles:
  ``S`` and ``dP`` again, then ``dQ += dS K`` (INT8).

With ``SOFTCAP`` both kernels recompute the capped scores as the forward does and multiply dS by the cap's
derivative ``1 - tanh^2``.

``ROW_TERM`` (dQ): K-smoothing scores K - mean(k), which leaves ``rowsum(dS) * mean(k)`` (``KMEAN``) out of dQ:
zero when a row's dS sum to zero, but not with a cap or over one shard of a row's keys (ring attention's merged
lse): there the kernel sums its own dS (``ROW_SUMS``); with sinks the sink's share is given in ``ROW_DS``. The
epilogue adds it.

P and dS are quantized on the fly with one scale per row of the reduced-over tile: per key for dV and dK
(reduction over queries), per query for dQ (reduction over keys). The other operand's per-token scale is
folded into P or dS first, so that operand's INT8 bytes are the forward's, read token-contiguous.
"""
import torch
import triton
import triton.language as tl

from .forward import _ceil_to, _floor_to, _key_tiles, _score_mask, block_dim, fast_tanh, tanh_scores
from .launch import launch
from .layout import SeqLayout, cdiv, maybe, strides3, strides4
from .quantize import INT8_MAX, LOG2E, Q_SMOOTH_BLOCK, TINY_SCALE, _seq_bounds, int32_times, nan_max, round_to_int8


@triton.jit
def _quantize_rows(x, SIGNED: tl.constexpr):
    """Quantize each row of ``x`` to int8 with its own scale; returns (int8 tile, fp32 row scales)."""
    if SIGNED:
        x_max = nan_max(tl.abs(x), 1)
    else:
        x_max = nan_max(x, 1)
    x8 = round_to_int8(x * tl.where(x_max > TINY_SCALE, INT8_MAX / x_max, 0.0)[:, None])   # see quantize.py
    return x8, x_max * (1.0 / INT8_MAX)


@triton.jit
def _through_cap(ds, th):
    """dS with respect to the uncapped score: times d(cap tanh(x / cap))/dx = 1 - tanh^2."""
    return ds * (1.0 - th * th)


@triton.jit
def _query_tiles(start_n, seqlen_q, seqlen_k, window_left, window_right,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """Query tiles that see the key tile at ``start_n`` (``_key_tiles`` solved for the queries):
    ``[lo, full_lo)`` and ``[full_hi, hi)`` cross the band's edge and need the mask. Rows and keys past
    the ends need none here: their lse is +inf and their dO, K and V are zero-filled."""
    diag = seqlen_k - seqlen_q
    lo = 0
    full_lo = 0
    hi = seqlen_q
    full_hi = _ceil_to(seqlen_q, BLOCK_M)
    if MASK_RIGHT:
        lo = _floor_to(start_n - diag - window_right, BLOCK_M)
        full_lo = _ceil_to(start_n + BLOCK_N - 1 - diag - window_right, BLOCK_M)
    if MASK_LEFT:
        hi = tl.minimum(hi, start_n + BLOCK_N - diag + window_left)
        full_hi = tl.minimum(full_hi, _floor_to(start_n - diag + window_left + 1, BLOCK_M))
    hi = _ceil_to(hi, BLOCK_M)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _dkdv_tiles(dk, dv, k8, k8f, k_scale, v, lo, hi, b, offs_m, offs_n, offs_d, d_ok, offs_dv, dv_ok,
                Q8_h, QS_h, QSR_h, Q8RT_h, DO_h, DO8T_h, DOS_h, LSE_h, DELTA_h, SH_h, QM_h, QMEAN_CU,
                q0, seqlen_q, seqlen_k, window_left, window_right, softcap2, s_q8t, s_qtd, s_dot, s_dod, s_dtd,
                s_qmb, BLOCK_M: tl.constexpr, QSB: tl.constexpr, MASKED: tl.constexpr, MASK_LEFT: tl.constexpr,
                MASK_RIGHT: tl.constexpr, Q_SMOOTH: tl.constexpr, DOT_FP32: tl.constexpr,
                DO_DK: tl.constexpr, DO_DV: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        q_mean = _q_mean(QM_h, QMEAN_CU, b, start_m, s_qmb, offs_d, d_ok, QSB, Q_SMOOTH)
        dk, dv = _dkdv_tile(dk, dv, k8, k8f, k_scale, v, tl.multiple_of(start_m, BLOCK_M), offs_m, offs_n,
                            offs_d, d_ok, offs_dv, dv_ok, Q8_h, QS_h, QSR_h, Q8RT_h, DO_h, DO8T_h, DOS_h, LSE_h,
                            DELTA_h, SH_h,
                            q_mean, q0, seqlen_q, seqlen_k, window_left, window_right, softcap2, s_q8t, s_qtd,
                            s_dot, s_dod, s_dtd, MASKED, MASK_LEFT, MASK_RIGHT, Q_SMOOTH, DOT_FP32, DO_DK, DO_DV,
                            SOFTCAP, FAST_TANH)
    return dk, dv


@triton.jit
def _dkdv_tile(dk, dv, k8, k8f, k_scale, v, start_m, offs_m, offs_n, offs_d, d_ok, offs_dv, dv_ok,
               Q8_h, QS_h, QSR_h, Q8RT_h, DO_h, DO8T_h, DOS_h, LSE_h, DELTA_h, SH_h, q_mean_h,
               q0, seqlen_q, seqlen_k, window_left, window_right, softcap2, s_q8t, s_qtd, s_dot, s_dod, s_dtd,
               MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
               Q_SMOOTH: tl.constexpr, DOT_FP32: tl.constexpr, DO_DK: tl.constexpr, DO_DV: tl.constexpr,
               SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr):
    rows = start_m + offs_m
    m_ok = rows < seqlen_q
    md_ok_t = d_ok[:, None] & m_ok[None, :]
    q8t = tl.load(Q8_h + (q0 + rows)[None, :] * s_q8t + offs_d[:, None], mask=md_ok_t, other=0)
    q_scale = tl.load(QS_h + q0 + rows, mask=m_ok, other=0.0)
    lse = tl.load(LSE_h + q0 + rows, mask=m_ok, other=float("inf"))
    # S^T in two FMAs per score (int32_times, then q_scale inside exp2's argument); lse is +inf past the end
    st = int32_times(tl.dot(k8, q8t, out_dtype=tl.int32), k_scale[:, None])
    if SOFTCAP:   # capped scores as in the forward (row shift back, then cap); tanh kept for the derivative
        inv_cap = 1.0 / softcap2
        shift = tl.load(SH_h + q0 + rows, mask=m_ok, other=0.0)
        if Q_SMOOTH:
            shift = (shift[None, :] + (tl.sum(k8f * q_mean_h[None, :], 1) * k_scale)[:, None]) * inv_cap
        else:
            shift = (shift * inv_cap)[None, :]
        tht = tanh_scores(tl.fma(st, (q_scale * inv_cap)[None, :], shift), FAST_TANH)
        pt = tl.exp2(tl.fma(tht, softcap2, -lse[None, :]))
    elif Q_SMOOTH:
        pt = tl.exp2(tl.fma(st, q_scale[None, :], (tl.sum(k8f * q_mean_h[None, :], 1) * k_scale)[:, None]
                            - lse[None, :]))
    else:
        pt = tl.exp2(tl.fma(st, q_scale[None, :], -lse[None, :]))
    if MASKED:
        valid = _score_mask(rows[None, :], offs_n[:, None], seqlen_q, seqlen_k, window_left,
                            window_right, MASK_LEFT, MASK_RIGHT)
        pt = tl.where(valid, pt, 0.0)

    if DO_DV:   # dV += P^T dO, dO's per-token scale folded into P^T
        do_scale = tl.load(DOS_h + q0 + rows, mask=m_ok, other=0.0)
        p8t, p_scale = _quantize_rows(pt * do_scale[None, :], False)
        do8 = tl.load(DO8T_h + offs_dv[None, :] * s_dtd + (q0 + rows)[:, None],
                      mask=m_ok[:, None] & dv_ok[None, :], other=0)
        dv += int32_times(tl.dot(p8t, do8, out_dtype=tl.int32), p_scale[:, None])

    if DO_DK:
        # dP^T = V dO^T stays in the input dtype (quantizing it would feed error into dS)
        dot_t = tl.load(DO_h + (q0 + rows)[None, :] * s_dot + offs_dv[:, None] * s_dod,
                        mask=dv_ok[:, None] & m_ok[None, :], other=0.0)
        if DOT_FP32:
            dot_t = dot_t.to(tl.float32)
        dpt = tl.dot(v, dot_t)
        delta = tl.load(DELTA_h + q0 + rows, mask=m_ok, other=0.0)
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:
            dst = _through_cap(dst, tht)

        # dK += dS^T Q, Q's per-token scale folded into dS^T
        qr_scale = tl.load(QSR_h + q0 + rows, mask=m_ok, other=0.0)
        ds8t, ds_scale = _quantize_rows(dst * qr_scale[None, :], True)
        q8r = tl.load(Q8RT_h + offs_d[None, :] * s_qtd + (q0 + rows)[:, None],
                      mask=m_ok[:, None] & d_ok[None, :], other=0)
        dk += int32_times(tl.dot(ds8t, q8r, out_dtype=tl.int32), ds_scale[:, None])
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q8, QS, QS_RAW, Q8RT, K8, KS, V, DO, DO8T, DOS, LSE, DELTA, SHIFT, QMEAN, QMEAN_CU, DK, DV, CU_Q, CU_K,
    s_q8b, s_q8h, s_q8t,
    s_qsb, s_qsh,
    s_qtb, s_qth, s_qtd,
    s_k8b, s_k8h, s_k8t,
    s_ksb, s_ksh,
    s_vb, s_vh, s_vt, s_vd,
    s_dob, s_doh, s_dot, s_dod,
    s_dtb, s_dth, s_dtd,
    s_qmh, s_qmb,
    s_dkb, s_dkh, s_dkt, s_dkd,
    s_dvb, s_dvh, s_dvt, s_dvd,
    n_q, n_k, num_kv_heads, group, head_dim, head_dim_v, window_left, window_right, softmax_scale, softcap2,
    IS_VARLEN: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    Q_SMOOTH: tl.constexpr, QSB: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
    FAST_TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, DO_DK: tl.constexpr, DO_DV: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)   # every head/batch offset in 64 bits (see _seq_bounds)
    b = pid_bh // num_kv_heads
    hk = pid_bh % num_kv_heads
    bq, q0, seqlen_q = _seq_bounds(CU_Q, b, n_q, IS_VARLEN)
    bk, k0, seqlen_k = _seq_bounds(CU_K, b, n_k, IS_VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= seqlen_k:
        return

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < seqlen_k
    d_ok = offs_d < head_dim
    nd_ok = n_ok[:, None] & d_ok[None, :]
    offs_dv = tl.arange(0, BLOCK_DV)     # V's, dO's and dV's head dim (MLA: not Q's and K's)
    dv_ok = offs_dv < head_dim_v
    ndv_ok = n_ok[:, None] & dv_ok[None, :]

    k8 = tl.load(K8 + bk * s_k8b + hk * s_k8h + (k0 + offs_n)[:, None] * s_k8t + offs_d[None, :],
                 mask=nd_ok, other=0)
    k_scale = tl.load(KS + bk * s_ksb + hk * s_ksh + k0 + offs_n, mask=n_ok, other=0.0)
    v = tl.load(V + bk * s_vb + hk * s_vh + (k0 + offs_n)[:, None] * s_vt + offs_dv[None, :] * s_vd,
                mask=ndv_ok, other=0.0)
    if DOT_FP32:   # Triton's interpreter mis-multiplies bf16 dots
        v = v.to(tl.float32)
    k8f = k_scale  # unused unless Q_SMOOTH
    if Q_SMOOTH:
        k8f = k8.to(tl.float32)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, full_lo, full_hi, hi = _query_tiles(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                            BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    for g in range(group):
        h = hk * group + g
        Q8_h = Q8 + bq * s_q8b + h * s_q8h
        QS_h = QS + bq * s_qsb + h * s_qsh
        QSR_h = QS_RAW + bq * s_qsb + h * s_qsh
        Q8RT_h = Q8RT + bq * s_qtb + h * s_qth
        DO_h = DO + bq * s_dob + h * s_doh
        DO8T_h = DO8T + bq * s_dtb + h * s_dth
        DOS_h = DOS + bq * s_qsb + h * s_qsh
        LSE_h = LSE + bq * s_qsb + h * s_qsh
        DELTA_h = DELTA + bq * s_qsb + h * s_qsh
        SH_h = SHIFT + bq * s_qsb + h * s_qsh
        QM_h = QMEAN + h * s_qmh
        # masked edge, unmasked middle, masked edge
        dk, dv = _dkdv_tiles(dk, dv, k8, k8f, k_scale, v, lo, full_lo, b, offs_m, offs_n, offs_d, d_ok,
                             offs_dv, dv_ok, Q8_h, QS_h, QSR_h, Q8RT_h, DO_h, DO8T_h, DOS_h, LSE_h, DELTA_h, SH_h,
                             QM_h, QMEAN_CU,
                             q0, seqlen_q, seqlen_k, window_left, window_right, softcap2, s_q8t, s_qtd, s_dot,
                             s_dod, s_dtd, s_qmb, BLOCK_M, QSB, True, MASK_LEFT, MASK_RIGHT, Q_SMOOTH, DOT_FP32,
                             DO_DK, DO_DV, SOFTCAP, FAST_TANH)
        dk, dv = _dkdv_tiles(dk, dv, k8, k8f, k_scale, v, full_lo, full_hi, b, offs_m, offs_n, offs_d, d_ok,
                             offs_dv, dv_ok, Q8_h, QS_h, QSR_h, Q8RT_h, DO_h, DO8T_h, DOS_h, LSE_h, DELTA_h, SH_h,
                             QM_h, QMEAN_CU,
                             q0, seqlen_q, seqlen_k, window_left, window_right, softcap2, s_q8t, s_qtd, s_dot,
                             s_dod, s_dtd, s_qmb, BLOCK_M, QSB, False, MASK_LEFT, MASK_RIGHT, Q_SMOOTH, DOT_FP32,
                             DO_DK, DO_DV, SOFTCAP, FAST_TANH)
        dk, dv = _dkdv_tiles(dk, dv, k8, k8f, k_scale, v, full_hi, hi, b, offs_m, offs_n, offs_d, d_ok,
                             offs_dv, dv_ok, Q8_h, QS_h, QSR_h, Q8RT_h, DO_h, DO8T_h, DOS_h, LSE_h, DELTA_h, SH_h,
                             QM_h, QMEAN_CU,
                             q0, seqlen_q, seqlen_k, window_left, window_right, softcap2, s_q8t, s_qtd, s_dot,
                             s_dod, s_dtd, s_qmb, BLOCK_M, QSB, True, MASK_LEFT, MASK_RIGHT, Q_SMOOTH, DOT_FP32,
                             DO_DK, DO_DV, SOFTCAP, FAST_TANH)

    if DO_DK:
        tl.store(DK + bk * s_dkb + hk * s_dkh + (k0 + offs_n)[:, None] * s_dkt + offs_d[None, :] * s_dkd,
                 (dk * softmax_scale).to(DK.dtype.element_ty), mask=nd_ok)
    if DO_DV:
        tl.store(DV + bk * s_dvb + hk * s_dvh + (k0 + offs_n)[:, None] * s_dvt + offs_dv[None, :] * s_dvd,
                 dv.to(DV.dtype.element_ty), mask=ndv_ok)


@triton.jit
def _q_mean(QM_h, QMEAN_CU, b, start_m, s_qmb, offs_d, d_ok, QSB: tl.constexpr, Q_SMOOTH: tl.constexpr):
    """Q-smoothing mean of the block holding the query tile at ``start_m`` (tiles never straddle blocks)."""
    if Q_SMOOTH:
        blk = tl.load(QMEAN_CU + b) + start_m // QSB
        q_mean = tl.load(QM_h + blk * s_qmb + offs_d, mask=d_ok, other=0.0)
    else:
        q_mean = tl.zeros([offs_d.shape[0]], tl.float32)
    return q_mean


@triton.jit
def _dq_tiles(dq, row_ds, q8, q_scale, q_mean, shift, softcap2, do, lse, delta, K8_base, K8T_base, KS_base,
              V_base, lo, hi, offs_m, offs_n, offs_d, d_ok, offs_dv, dv_ok, k0, seqlen_q, seqlen_k, window_left,
              window_right,
              s_k8t, s_ktd, s_vt, s_vd, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, MASK_LEFT: tl.constexpr,
              MASK_RIGHT: tl.constexpr, Q_SMOOTH: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
              FAST_TANH: tl.constexpr, ROW_SUMS: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        dq, row_ds = _dq_tile(dq, row_ds, q8, q_scale, q_mean, shift, softcap2, do, lse, delta, K8_base,
                              K8T_base, KS_base, V_base, tl.multiple_of(start_n, BLOCK_N), offs_m, offs_n, offs_d,
                              d_ok, offs_dv, dv_ok, k0, seqlen_q, seqlen_k, window_left, window_right, s_k8t, s_ktd,
                              s_vt, s_vd,
                              MASKED, MASK_LEFT, MASK_RIGHT, Q_SMOOTH, DOT_FP32, SOFTCAP, FAST_TANH, ROW_SUMS)
    return dq, row_ds


@triton.jit
def _dq_tile(dq, row_ds, q8, q_scale, q_mean, shift, softcap2, do, lse, delta, K8_base, K8T_base, KS_base,
             V_base, start_n, offs_m, offs_n, offs_d, d_ok, offs_dv, dv_ok, k0, seqlen_q, seqlen_k, window_left,
             window_right,
             s_k8t, s_ktd, s_vt, s_vd,
             MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
             Q_SMOOTH: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
             FAST_TANH: tl.constexpr, ROW_SUMS: tl.constexpr):
    cols = start_n + offs_n
    n_ok = cols < seqlen_k
    dn_ok = d_ok[:, None] & n_ok[None, :]
    k8t = tl.load(K8_base + (k0 + cols)[None, :] * s_k8t + offs_d[:, None], mask=dn_ok, other=0)
    k_scale = tl.load(KS_base + k0 + cols, mask=n_ok, other=0.0)
    s = int32_times(tl.dot(q8, k8t, out_dtype=tl.int32), k_scale[None, :])
    if SOFTCAP:
        inv_cap = 1.0 / softcap2
        if Q_SMOOTH:
            bias = (shift[:, None] + (tl.sum(q_mean[:, None] * k8t.to(tl.float32), 0) * k_scale)[None, :]) * inv_cap
        else:
            bias = (shift * inv_cap)[:, None]
        th = tanh_scores(tl.fma(s, (q_scale * inv_cap)[:, None], bias), FAST_TANH)
        p = tl.exp2(tl.fma(th, softcap2, -lse[:, None]))
    elif Q_SMOOTH:
        p = tl.exp2(tl.fma(s, q_scale[:, None], (tl.sum(q_mean[:, None] * k8t.to(tl.float32), 0) * k_scale)[None, :]
                           - lse[:, None]))
    else:
        p = tl.exp2(tl.fma(s, q_scale[:, None], -lse[:, None]))
    if MASKED:
        valid = _score_mask(offs_m[:, None], cols[None, :], seqlen_q, seqlen_k, window_left, window_right,
                            MASK_LEFT, MASK_RIGHT)
        p = tl.where(valid, p, 0.0)

    vt = tl.load(V_base + (k0 + cols)[None, :] * s_vt + offs_dv[:, None] * s_vd, mask=dv_ok[:, None] & n_ok[None, :],
                 other=0.0)
    if DOT_FP32:
        vt = vt.to(tl.float32)
    dp = tl.dot(do, vt)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = _through_cap(ds, th)
    if ROW_SUMS:   # (keys past the end are unmasked in the middle tiles: their K scale zeroes them in dQ, not here)
        row_ds += tl.sum(tl.where(n_ok[None, :], ds, 0.0), 1)

    # dQ += dS K, K's per-token scale folded into dS
    ds8, ds_scale = _quantize_rows(ds * k_scale[None, :], True)
    k8 = tl.load(K8T_base + offs_d[None, :] * s_ktd + (k0 + cols)[:, None],
                 mask=n_ok[:, None] & d_ok[None, :], other=0)
    dq += int32_times(tl.dot(ds8, k8, out_dtype=tl.int32), ds_scale[:, None])
    return dq, row_ds


@triton.jit
def _attn_bwd_dq_kernel(
    Q8, QS, K8, K8T, KS, V, DO, LSE, DELTA, SHIFT, ROW_DS, KMEAN, QMEAN, QMEAN_CU, DQ, CU_Q, CU_K,
    s_q8b, s_q8h, s_q8t,
    s_qsb, s_qsh,
    s_k8b, s_k8h, s_k8t,
    s_ktb, s_kth, s_ktd,
    s_ksb, s_ksh,
    s_vb, s_vh, s_vt, s_vd,
    s_dob, s_doh, s_dot, s_dod,
    s_qmh, s_qmb,
    s_kmh, s_kmb,
    s_dqb, s_dqh, s_dqt, s_dqd,
    n_q, n_k, num_heads, group, head_dim, head_dim_v, window_left, window_right, softmax_scale, softcap2,
    IS_VARLEN: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    Q_SMOOTH: tl.constexpr, QSB: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
    FAST_TANH: tl.constexpr, ROW_TERM: tl.constexpr, ROW_SUMS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
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
    md_ok = m_ok[:, None] & d_ok[None, :]
    offs_dv = tl.arange(0, BLOCK_DV)     # dO's and V's head dim (MLA: not Q's and K's)
    dv_ok = offs_dv < head_dim_v

    q8 = tl.load(Q8 + bq * s_q8b + h * s_q8h + (q0 + offs_m)[:, None] * s_q8t + offs_d[None, :],
                 mask=md_ok, other=0)
    q_scale = tl.load(QS + bq * s_qsb + h * s_qsh + q0 + offs_m, mask=m_ok, other=0.0)
    lse = tl.load(LSE + bq * s_qsb + h * s_qsh + q0 + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(DELTA + bq * s_qsb + h * s_qsh + q0 + offs_m, mask=m_ok, other=0.0)
    do = tl.load(DO + bq * s_dob + h * s_doh + (q0 + offs_m)[:, None] * s_dot + offs_dv[None, :] * s_dod,
                 mask=m_ok[:, None] & dv_ok[None, :], other=0.0)
    if DOT_FP32:
        do = do.to(tl.float32)
    q_mean = _q_mean(QMEAN + h * s_qmh, QMEAN_CU, b, start_m, s_qmb, offs_d, d_ok, QSB, Q_SMOOTH)
    shift = lse  # unused unless SOFTCAP
    if SOFTCAP:
        shift = tl.load(SHIFT + bq * s_qsb + h * s_qsh + q0 + offs_m, mask=m_ok, other=0.0)
    row_ds = tl.zeros([BLOCK_M], tl.float32)

    K8_base = K8 + bk * s_k8b + hk * s_k8h
    K8T_base = K8T + bk * s_ktb + hk * s_kth
    KS_base = KS + bk * s_ksb + hk * s_ksh
    V_base = V + bk * s_vb + hk * s_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    lo, full_lo, full_hi, hi = _key_tiles(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                          BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, False)
    # masked edge, unmasked middle, masked edge
    dq, row_ds = _dq_tiles(dq, row_ds, q8, q_scale, q_mean, shift, softcap2, do, lse, delta, K8_base, K8T_base,
                           KS_base, V_base, lo, full_lo,
                   offs_m, offs_n, offs_d, d_ok, offs_dv, dv_ok, k0, seqlen_q, seqlen_k, window_left, window_right,
                   s_k8t, s_ktd, s_vt, s_vd, BLOCK_N, True, MASK_LEFT, MASK_RIGHT, Q_SMOOTH, DOT_FP32, SOFTCAP,
                   FAST_TANH, ROW_SUMS)
    dq, row_ds = _dq_tiles(dq, row_ds, q8, q_scale, q_mean, shift, softcap2, do, lse, delta, K8_base, K8T_base,
                           KS_base, V_base, full_lo, full_hi,
                   offs_m, offs_n, offs_d, d_ok, offs_dv, dv_ok, k0, seqlen_q, seqlen_k, window_left, window_right,
                   s_k8t, s_ktd, s_vt, s_vd, BLOCK_N, False, MASK_LEFT, MASK_RIGHT, Q_SMOOTH, DOT_FP32, SOFTCAP,
                   FAST_TANH, ROW_SUMS)
    dq, row_ds = _dq_tiles(dq, row_ds, q8, q_scale, q_mean, shift, softcap2, do, lse, delta, K8_base, K8T_base,
                           KS_base, V_base, full_hi, hi,
                   offs_m, offs_n, offs_d, d_ok, offs_dv, dv_ok, k0, seqlen_q, seqlen_k, window_left, window_right,
                   s_k8t, s_ktd, s_vt, s_vd, BLOCK_N, True, MASK_LEFT, MASK_RIGHT, Q_SMOOTH, DOT_FP32, SOFTCAP,
                   FAST_TANH, ROW_SUMS)

    if ROW_TERM:   # the kernel's own row sums (ROW_SUMS), else the sinks' (given)
        if not ROW_SUMS:
            row_ds = tl.load(ROW_DS + bq * s_qsb + h * s_qsh + q0 + offs_m, mask=m_ok, other=0.0)
        k_mean = tl.load(KMEAN + hk * s_kmh + b * s_kmb + offs_d, mask=d_ok, other=0.0)
        dq += row_ds[:, None] * k_mean[None, :]
    tl.store(DQ + bq * s_dqb + h * s_dqh + (q0 + offs_m)[:, None] * s_dqt + offs_d[None, :] * s_dqd,
             (dq * softmax_scale).to(DQ.dtype.element_ty), mask=md_ok)


def launch_backward(quant, q8rt, q_scale_raw, k8t, v4, do4, do8t, do_scale, lse, delta,
                    dq4, dk4, dv4, layout_q: SeqLayout, layout_k: SeqLayout,
                    num_heads, num_kv_heads, head_dim, window, softmax_scale, dkdv_config, dq_config,
                    kernels=("dkdv", "dq"), split_dkdv=False, softcap=0.0, shift=None, row_ds=None, k_mean=None):
    """Run the backward kernels; ``dq4, dk4, dv4`` (``[B, H, N, D]`` views, any strides) are written.
    ``kernels`` picks a subset (benchmarks time them one at a time). ``split_dkdv`` computes dV and dK in two
    launches of the key-tile kernel (one accumulator each, S and P recomputed): fewer live registers.
    ``softcap`` > 0: capped scores (``shift`` as the forward's). ``k_mean`` (``[Hkv, S, D]`` fp32, the means
    K-smoothing took): dQ gets ``rowsum(dS) * k_mean``, the row sums ``row_ds`` (lse's layout; the sinks' share)
    if given and there is no cap, else the kernel's own."""
    if softcap:
        assert shift is not None and shift.stride() == lse.stride()
    if row_ds is not None:
        assert row_ds.stride() == lse.stride()
    q8, k8, q_mean, q_mean_cu = quant.q8, quant.k8, quant.q_mean, quant.q_mean_cu
    q_scale, k_scale = quant.q_scale, quant.k_scale
    group = num_heads // num_kv_heads
    dot_fp32 = v4.device.type == "cpu" and v4.dtype == torch.bfloat16
    common = dict(IS_VARLEN=layout_q.is_varlen, MASK_LEFT=window[0] >= 0, MASK_RIGHT=window[1] >= 0,
                  Q_SMOOTH=q_mean is not None, QSB=Q_SMOOTH_BLOCK, DOT_FP32=dot_fp32, SOFTCAP=bool(softcap),
                  FAST_TANH=fast_tanh(q8.device))
    row_sums = k_mean is not None and (bool(softcap) or row_ds is None)    # the kernel's own, else the sinks'
    k_mean_arg = maybe(k_mean, lse)
    softcap2 = float(softcap) * LOG2E
    shift, row_ds = maybe(shift, lse), maybe(row_ds, lse)
    cu_q = maybe(layout_q.cu_seqlens, q8)
    cu_k = maybe(layout_k.cu_seqlens, q8)
    q_mean_arg = maybe(q_mean, q_scale)
    q_mean_cu_arg = maybe(q_mean_cu, q8)

    compiled = {}
    if {"dkdv", "dv", "dk"} & set(kernels):
        # split: dkdv_config is one tile for both launches, or a (dV tile, dK tile) pair with one BLOCK_M
        if not split_dkdv:
            launches = (("dkdv", dkdv_config, dict(DO_DK=True, DO_DV=True)),)
        else:
            dv_config, dk_config = dkdv_config if isinstance(dkdv_config[0], tuple) else (dkdv_config,) * 2
            assert dv_config[0] == dk_config[0], "BLOCK_M sets P's and dS's scales: one for both launches"
            launches = (("dv", dv_config, dict(DO_DK=False, DO_DV=True)),
                        ("dk", dk_config, dict(DO_DK=True, DO_DV=False)))
        for name, config, parts in launches:
            if "dkdv" not in kernels and name not in kernels:   # benchmarks time "dv" / "dk" alone
                continue
            compiled[name] = _launch_dkdv(
                q8, q_scale, q_scale_raw, q8rt, k8, k_scale, v4, do4, do8t, do_scale, lse, delta, shift, q_mean_arg,
                q_mean_cu_arg, dk4, dv4, cu_q, cu_k, q_mean, layout_k, num_kv_heads, group, head_dim, window,
                softmax_scale, softcap2, config, dict(common, **parts))
    if "dq" in kernels:
        compiled["dq"] = _launch_dq(
            q8, q_scale, k8, k8t, k_scale, v4, do4, lse, delta, shift, row_ds, k_mean_arg, q_mean_arg, q_mean_cu_arg,
            dq4, cu_q, cu_k, q_mean, k_mean, layout_q, num_heads, group, head_dim, window, softmax_scale, softcap2,
            dq_config, dict(common, ROW_TERM=k_mean is not None, ROW_SUMS=row_sums))
    return compiled


def _launch_dkdv(q8, q_scale, q_scale_raw, q8rt, k8, k_scale, v4, do4, do8t, do_scale, lse, delta, shift,
                 q_mean_arg, q_mean_cu_arg, dk4, dv4, cu_q, cu_k, q_mean, layout_k, num_kv_heads, group,
                 head_dim, window, softmax_scale, softcap2, config, common):
    block_m, block_n, block_d, num_warps, num_stages = config
    assert Q_SMOOTH_BLOCK % block_m == 0
    grid = (cdiv(layout_k.max_len, block_n), layout_k.num_seqs * num_kv_heads)
    return launch(
        _attn_bwd_dkdv_kernel, grid,
        q8, q_scale, q_scale_raw, q8rt, k8, k_scale, v4, do4, do8t, do_scale, lse, delta, shift,
        q_mean_arg, q_mean_cu_arg, dk4, dv4, cu_q, cu_k,
        *strides4(q8)[:3], *strides3(q_scale)[:2], *strides4(q8rt)[:3],
        *strides4(k8)[:3], *strides3(k_scale)[:2],
        *strides4(v4), *strides4(do4), *strides4(do8t)[:3],
        *strides3(q_mean)[:2], *strides4(dk4), *strides4(dv4),
        q8.shape[2], k8.shape[2], num_kv_heads, group, head_dim, v4.shape[3], window[0], window[1], softmax_scale,
        softcap2, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dim(v4.shape[3]),
        num_warps=num_warps, num_stages=num_stages,
        **common,
    )


def _launch_dq(q8, q_scale, k8, k8t, k_scale, v4, do4, lse, delta, shift, row_ds, k_mean_arg, q_mean_arg,
               q_mean_cu_arg, dq4, cu_q, cu_k, q_mean, k_mean, layout_q, num_heads, group, head_dim, window,
               softmax_scale, softcap2, config, common):
    block_m, block_n, block_d, num_warps, num_stages = config
    assert Q_SMOOTH_BLOCK % block_m == 0
    grid = (cdiv(layout_q.max_len, block_m), layout_q.num_seqs * num_heads)
    return launch(
        _attn_bwd_dq_kernel, grid,
        q8, q_scale, k8, k8t, k_scale, v4, do4, lse, delta, shift, row_ds, k_mean_arg, q_mean_arg, q_mean_cu_arg, dq4,
        cu_q, cu_k, *strides4(q8)[:3], *strides3(q_scale)[:2],
        *strides4(k8)[:3], *strides4(k8t)[:3], *strides3(k_scale)[:2],
        *strides4(v4), *strides4(do4), *strides3(q_mean)[:2], *strides3(k_mean)[:2], *strides4(dq4),
        q8.shape[2], k8.shape[2], num_heads, group, head_dim, v4.shape[3], window[0], window[1], softmax_scale,
        softcap2, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dim(v4.shape[3]),
        num_warps=num_warps, num_stages=num_stages,
        **common,
    )
