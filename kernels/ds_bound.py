"""dK's operands under the ds_bound rule (``sagebwd_hf.numerics``; the reference: ``sagebwd_hf.naive.ds_row_bound``).

dS^T goes to FP8 e4m3 at one fixed scale per query row, 448 over a bound of the row's largest |dS|, and Q times
that bound goes to e4m3 at one scale per channel over the sequence and the KV group; both scales leave dK's sum
over queries, so the one-launch backward accumulates dK in place. The bound of row i is
max P_i · (|dO_i| · |V|max + |δ_i|): max P_i = exp2(row_max_i − lse_i) from the forward, |V|max the norm of V's
channel maxima over the sequence, δ = rowsum(dO · O) from dO's pass.

Launches: V's statistics, ``_ds_bound_rows_kernel`` (one read of dO: the bound and 448 / bound of every row), Q·bound's
statistics and its quantization pass (``quantize.quantize(..., row_mul=)``); a KV group's maximum adds two small ones.
"""
import torch
import triton
import triton.language as tl

from . import constants
from .launch import launch
from .layout import SeqLayout, cdiv, strides4
from .quantize import _seq_bounds, kv_group_max, quantize, token_stats

# (query rows, warps) per program of the bounds' pass: one dO tile of 64 rows in registers
BOUND_TILE = (64, 4)


@triton.jit
def _ds_bound_rows_kernel(
    DO, LSE, ROW_MAX, DELTA, V_MAX, CU, BOUND, DS_INV,
    s_db, s_dh, s_dt, s_dd, s_rb, s_rh, s_vh, s_vs,
    n_dense, num_heads, group, head_dim, tiny, e4m3_max,
    IS_VARLEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``BLOCK_T`` query rows of one sequence's head: ``BOUND`` = exp2(row_max − lse) · (|dO| · |V_MAX| + |delta|)
    and ``DS_INV`` = 448 / bound, 0 where the bound is at most ``tiny`` (448 over it would be inf, and inf times a zero
    dS NaN). The row vectors (``LSE``, ``ROW_MAX``, ``DELTA``, ``BOUND``, ``DS_INV``) share strides, tokens
    contiguous; ``V_MAX`` ``[Hkv, S, D]`` holds V's channel maxima of each sequence. A non-finite dO or delta gives a
    NaN bound, which the e4m3 scales carry into dK."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)   # every head/batch offset in 64 bits (see quantize._seq_bounds)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    bx, t0, seqlen = _seq_bounds(CU, b, n_dense, IS_VARLEN)
    start = pid_t * BLOCK_T
    if start >= seqlen:
        return
    offs_t = start + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = offs_t < seqlen
    d_ok = offs_d < head_dim
    v_max = tl.load(V_MAX + (h // group) * s_vh + b * s_vs + offs_d, mask=d_ok, other=0.0)
    v_norm = tl.sqrt_rn(tl.sum(v_max * v_max, 0))
    tokens = t0 + offs_t
    do = tl.load(DO + bx * s_db + h * s_dh + tokens[:, None] * s_dt + offs_d[None, :] * s_dd,
                 mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    do_norm = tl.sqrt_rn(tl.sum(do * do, 1))
    rows = bx * s_rb + h * s_rh + tokens
    lse = tl.load(LSE + rows, mask=t_ok, other=0.0)
    row_max = tl.load(ROW_MAX + rows, mask=t_ok, other=0.0)
    delta = tl.load(DELTA + rows, mask=t_ok, other=0.0)
    bound = tl.exp2(row_max - lse) * (do_norm * v_norm + tl.abs(delta))
    tl.store(BOUND + rows, bound, mask=t_ok)
    tl.store(DS_INV + rows, tl.where(bound > tiny, tl.math.div_rn(e4m3_max, bound), 0.0), mask=t_ok)


def ds_row_bounds(v4: torch.Tensor, do4: torch.Tensor, lse: torch.Tensor, row_max: torch.Tensor,
                  delta: torch.Tensor, layout_q: SeqLayout, layout_k: SeqLayout, group: int):
    """Each query row's bound of its largest |dS| and 448 over it (0 where the bound is at most TINY_SCALE), both
    fp32 contiguous of ``lse``'s shape ``[B, H, N]``; a row that sees no key (row max −inf) gets 0 for both."""
    lse, row_max, delta = (x.contiguous() for x in (lse, row_max, delta))
    assert lse.shape == row_max.shape == delta.shape == do4.shape[:3]
    v_max = token_stats(v4, layout_k, True)[0]                                       # [Hkv, S, D]
    bound, ds_inv = torch.empty_like(lse), torch.empty_like(lse)
    h, d = do4.shape[1], do4.shape[3]
    block_t, warps = BOUND_TILE
    launch(_ds_bound_rows_kernel, (cdiv(max(layout_q.max_len, 1), block_t), layout_q.num_seqs * h),
           do4, lse, row_max, delta, v_max, layout_q.cu_seqlens if layout_q.is_varlen else lse, bound, ds_inv,
           *strides4(do4), lse.stride(0), lse.stride(1), v_max.stride(0), v_max.stride(1),
           do4.shape[2], h, group, d, float(constants.TINY_SCALE), float(constants.E4M3_MAX),
           IS_VARLEN=layout_q.is_varlen, BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(max(d, 16)), num_warps=warps)
    return bound, ds_inv


def quantize_ds_bound(q4: torch.Tensor, bound: torch.Tensor, layout_q: SeqLayout, group: int, t_starts=None,
                      operand_order: bool = False):
    """Q times its rows' bounds (``ds_row_bounds``) in FP8 e4m3, token-major as Q's copy (``t_starts``,
    ``operand_order`` as ``quantize``'s), one scale per channel over the sequence and the KV group's query heads, its
    max mapped to 448. Returns (those e4m3 bytes, the channel maxima ``[S, H, D]``)."""
    q_max = kv_group_max(token_stats(q4, layout_q, True, row_mul=bound)[0], group)       # [H, S, D]
    q_t = quantize(q4, layout_q, channel_scale=q_max, natural=False, transposed=True, t_starts=t_starts,
                   operand_order=operand_order, e4m3=True, row_mul=bound)
    return q_t.x8t, q_max.transpose(0, 1)


def prepare_ds_bound(q4, v4, do4, lse, row_max, delta, layout_q: SeqLayout, layout_k: SeqLayout, group: int,
                     t_starts=None, operand_order: bool = False):
    """The one launch's ds_bound operands after dO's pass (``delta``): (Q·bound's e4m3 token-major bytes, 448 / each
    row's bound ``[B, H, N]``, Q·bound's channel maxima ``[S, H, D]``)."""
    bound, ds_inv = ds_row_bounds(v4, do4, lse, row_max, delta, layout_q, layout_k, group)
    q8t, q_max = quantize_ds_bound(q4, bound, layout_q, group, t_starts, operand_order)
    return q8t, ds_inv, q_max
