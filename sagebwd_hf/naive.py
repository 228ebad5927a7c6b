"""Attention in plain PyTorch: the exact reference, and SageBwd's quantized algorithm as the kernels compute it.

* ``attention_exact``: plain softmax attention in any precision (float64 in tests): the ground truth.
* ``sagebwd_forward_naive`` / ``sagebwd_backward_naive``: the SageBwd quantized algorithm, step by step,
  with the kernels' tiling (it decides the P and dS scales), so it is both the tests' oracle for the
  kernels and the op's implementation when tensors live on the CPU. They walk the queries in blocks
  (``query_block_rows``): memory grows with one block's scores, ``B x H x rows x N_k``, never ``N_q x N_k``,
  and the results are the whole-matrix computation's but for the order of fp32 sums over blocks.

Logit soft-capping (Gemma 2: ``cap * tanh(s / cap)``) is applied to the dequantized fp32 scores, after
the INT8 product and before the softmax, exactly where the kernels apply it. K-smoothing moved every
score of row i by ``-q_i . mean(k)``; that shift is added back before the cap (tanh is not shift-invariant),
and dQ gets ``rowsum(dS) * mean(k)``, which is no longer zero once dS is multiplied by the cap's derivative.
Attention sinks (gpt-oss) do not touch the scores at all: ``sagebwd_hf/sinks.py``.

All functions take padded ``[B, H, N, D]`` tensors (K/V may have fewer heads: GQA). Masks follow
FlashAttention: ``window_size = (left, right)``, ``-1`` for unbounded, causal is ``right = 0``, aligned
to the bottom-right corner when the query and key lengths differ.
"""
import math
from typing import NamedTuple, Optional

import torch

from .kernels.constants import K_BLOCK_HEAD_DIMS, K_SCALE_BLOCK, INT8_MAX, LOG2E, Q_SMOOTH_BLOCK, TINY_SCALE
from .numerics import ACCURATE, DS_TILE, E4M3_MAX, Numerics, round_e4m3


def k_scale_block(head_dim: int) -> int:
    """Tokens per K scale at this head dim (1: per token)."""
    return K_SCALE_BLOCK if head_dim in K_BLOCK_HEAD_DIMS else 1


def band_mask(n_q: int, n_k: int, window_size, device, rows: slice = slice(None), cols: slice = slice(None)
              ) -> torch.Tensor:
    """``[n_q, n_k]`` booleans: may query i attend to key j; only the ``rows`` x ``cols`` part if given."""
    left, right = window_size
    i = torch.arange(n_q, device=device)[rows, None]
    j = torch.arange(n_k, device=device)[None, cols]
    diag = n_k - n_q
    ok = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= i + diag + right
    if left >= 0:
        ok &= j >= i + diag - left
    return ok


def _repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    return x.repeat_interleave(num_heads // x.shape[1], dim=1)


def _sum_groups(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    b, h, n, d = x.shape
    return x.view(b, num_kv_heads, h // num_kv_heads, n, d).sum(2)


def attention_exact(q, k, v, softmax_scale=None, window_size=(-1, -1), dtype=torch.float64, softcap=0.0,
                    sinks=None):
    """Softmax attention computed in ``dtype``; differentiable. Returns (out, natural-log lse).

    ``softcap`` > 0 caps the scores at ``softcap * tanh(s / softcap)``; ``sinks`` ``[heads]`` adds one
    learned logit per head to every row's softmax denominator (it has no value). Rows that see no key give
    zeros (and lse -inf, or the sink's logit)."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    q, k, v = q.to(dtype), _repeat_kv(k.to(dtype), q.shape[1]), _repeat_kv(v.to(dtype), q.shape[1])
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    mask = band_mask(q.shape[2], k.shape[2], window_size, q.device)
    s = s.masked_fill(~mask, float("-inf"))
    row_max = s.amax(-1, keepdim=True)
    sink = None
    if sinks is not None:
        sink = sinks.to(dtype).view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max).detach()
    p = torch.exp(s - row_max)
    denom = p.sum(-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - row_max)
    out = (p @ v) / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = torch.where(denom > 0, denom.log() + row_max, torch.full_like(denom, float("-inf")))
    return out, lse.squeeze(-1)


# ---------------------------------------------------------------------------------------------------
# The quantized algorithm
# ---------------------------------------------------------------------------------------------------

def quantize_per_token(x: torch.Tensor):
    """Symmetric INT8 with one scale per row of the last dim (stored as integer-valued fp32)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > TINY_SCALE, INT8_MAX / amax, torch.zeros_like(amax))
    return torch.round(xf * inv), amax.squeeze(-1) * (1.0 / INT8_MAX)   # the kernels multiply too


def quantize_per_block(x: torch.Tensor, block: int):
    """Symmetric INT8 of ``[B, H, N, D]`` with one scale per run of ``block`` tokens (the last run shorter),
    returned per token ``[B, H, N]`` like ``quantize_per_token``'s: every kernel reads it that way."""
    xf = x.float()
    n = xf.shape[2]
    amax = _tiles(xf.abs().amax(-1), 2, block).amax(-1, keepdim=True)           # [B, H, T, 1]
    amax = amax.expand(*amax.shape[:-1], block).flatten(2)[..., :n]             # [B, H, N]
    inv = torch.where(amax > TINY_SCALE, INT8_MAX / amax, torch.zeros_like(amax))
    return torch.round(xf * inv[..., None]), amax * (1.0 / INT8_MAX)


def _row_quantize(x: torch.Tensor, dim: int, signed: bool):
    """Quantize ``x`` with one scale per slice along ``dim`` (the reduced-over tile axis)."""
    x_max = (x.abs() if signed else x).amax(dim, keepdim=True)
    inv = torch.where(x_max > TINY_SCALE, INT8_MAX / x_max, torch.zeros_like(x_max))
    return torch.round(x * inv), x_max * (1.0 / INT8_MAX)     # round half to even, as the kernels do


def _e4m3_per_slice(x: torch.Tensor, dim: int):
    """FP8 e4m3 with one scale per slice along ``dim`` (its largest magnitude maps to 448): (values as fp32, scales
    keeping ``dim``). Each value is x times 448 / max, that quotient rounded once (a kernel's div.rn.f32), then
    rounded to e4m3."""
    x_max = x.abs().amax(dim, keepdim=True)
    # A tensor divided by a tensor: IEEE division on the CPU and CUDA. ``448.0 / x_max`` would be PyTorch's
    # reciprocal times 448, rounded twice; on bf16 inputs x / max is often a ratio of small integers whose product
    # with 448 lies exactly on an e4m3 tie, which the second rounding pushes off it.
    inv = torch.where(x_max > TINY_SCALE, torch.full_like(x_max, E4M3_MAX) / x_max, torch.zeros_like(x_max))
    return round_e4m3(x * inv), x_max * (1.0 / E4M3_MAX)


def _tile_quantize(x: torch.Tensor, tile: int):
    """Symmetric INT8 of ``[B, H, rows, cols]`` with one scale per ``tile`` x ``tile`` block (zero-padded at the
    ends): values ``[B, H, row tiles, tile, col tiles, tile]``, scales ``[B, H, row tiles, col tiles]``."""
    t = _tiles(_tiles(x, 2, tile), 4, tile)
    x_max = t.abs().amax((3, 5), keepdim=True)
    inv = torch.where(x_max > TINY_SCALE, INT8_MAX / x_max, torch.zeros_like(x_max))
    return torch.round(t * inv), (x_max * (1.0 / INT8_MAX))[:, :, :, 0, :, 0]


def _q_block_means(qf: torch.Tensor) -> torch.Tensor:
    """Per-token copy of the mean of its block of Q_SMOOTH_BLOCK tokens (blocks counted from ``qf``'s first row)."""
    n = qf.shape[2]
    out = torch.empty_like(qf)
    for start in range(0, n, Q_SMOOTH_BLOCK):
        blk = qf[:, :, start:start + Q_SMOOTH_BLOCK]
        out[:, :, start:start + Q_SMOOTH_BLOCK] = blk.mean(2, keepdim=True)
    return out


def softcap_base2(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(s / softcap)`` for base-2 scores (the cap given in natural units)."""
    cap2 = softcap * LOG2E
    return cap2 * torch.tanh(s / cap2)


# Both passes walk the queries in blocks of rows, so memory grows with one block's [B, H, rows, N_k] scores, not
# with N_q x N_k. A block is a whole number of Q-smoothing blocks and of dK/dV query tiles, and keys are
# quantized once for all of them, so every scale is the one a whole-matrix pass would take: only the order in
# which fp32 sums over query blocks are added up differs. Rows per block: as many as keep one score tensor near
# SCORE_BLOCK_ELEMENTS (64 MiB in fp32), at least one such unit.
SCORE_BLOCK_ELEMENTS = 1 << 24


def query_block_rows(batch_heads: int, n_k: int, tile_m: int = 1, query_block: Optional[int] = None) -> int:
    """Query rows per block for ``batch_heads`` (B x H) score rows of ``n_k`` keys, whole Q-smoothing blocks and
    ``tile_m``-query tiles; ``query_block`` asks for that many (it must be a multiple of both)."""
    unit = math.lcm(Q_SMOOTH_BLOCK, tile_m)
    if query_block is not None:
        if query_block <= 0 or query_block % unit:
            raise ValueError(f"query_block must be a positive multiple of {unit}, got {query_block}")
        return query_block
    return max(unit, SCORE_BLOCK_ELEMENTS // max(1, batch_heads * n_k) // unit * unit)


def _visible_keys(rows: slice, n_q: int, n_k: int, window_size, tile_n: int) -> slice:
    """The keys some query of ``rows`` may attend to, widened to whole ``tile_n``-key tiles counted from key 0.
    A tile outside adds nothing to any sum (its P and dS are zero, the online softmax's max does not move), so
    leaving it out changes no result, and causal or windowed calls skip the masked part of every block."""
    left, right = window_size
    diag = n_k - n_q
    lo = 0 if left < 0 else min(n_k, max(0, rows.start + diag - left)) // tile_n * tile_n
    hi = n_k if right < 0 else min(n_k, max(0, -(-(rows.stop + diag + right) // tile_n) * tile_n))
    return slice(lo, max(lo, hi))


class _Keys(NamedTuple):
    """K's side of the scores, computed once for every query block: the int8 K (integer-valued fp32) and its
    scales with KV heads repeated to Q's, and K-smoothing's mean ``[B, H, 1, D]`` (None without smoothing)."""
    k8: torch.Tensor
    k_scale: torch.Tensor
    k_mean: Optional[torch.Tensor]


def _quantize_keys(k: torch.Tensor, num_heads: int, k_smoothing: bool) -> _Keys:
    kf = k.float()
    k_mean = None
    if k_smoothing:   # the mean over all keys of the sequence, whatever block of queries asks
        k_mean = kf.mean(2, keepdim=True)
        kf = kf - k_mean
        k_mean = _repeat_kv(k_mean, num_heads)
    k8, k_scale = quantize_per_block(kf, k_scale_block(k.shape[-1]))
    return _Keys(_repeat_kv(k8, num_heads), _repeat_kv(k_scale.unsqueeze(-1), num_heads).squeeze(-1), k_mean)


def _block_scores(q_rows, keys: _Keys, rows, cols, n_q, n_k, softmax_scale, window_size, q_smoothing, softcap=0.0):
    """Dequantized base-2 scores S * softmax_scale * log2(e) of the queries ``q_rows`` (rows ``rows`` of Q) against
    the keys ``cols``, soft-capped if asked, masked with -inf; and the mask."""
    c = softmax_scale * LOG2E
    k8, k_scale = keys.k8[:, :, cols], keys.k_scale[:, :, cols]
    qf = q_rows.float()
    if q_smoothing:
        q_mean = _q_block_means(qf)
        qf = qf - q_mean
    q8, q_scale_raw = quantize_per_token(qf)
    # int8 x int8 sums stay below 2^24, so these float32 products are exact
    s = (q8 @ k8.transpose(-1, -2)) * (q_scale_raw * c)[..., :, None] * k_scale[..., None, :]
    if q_smoothing:
        s = s + ((q_mean * c) @ k8.transpose(-1, -2)) * k_scale[..., None, :]
    if softcap:   # the cap sees the caller's scores: K-smoothing's row shift added back first
        if keys.k_mean is not None:
            s = s + (q_rows.float() @ keys.k_mean.transpose(-1, -2)) * c
        s = softcap_base2(s, softcap)
    mask = band_mask(n_q, n_k, window_size, q_rows.device, rows=rows, cols=cols)
    return s.masked_fill(~mask, float("-inf")), mask


def _row_blocks(n_q: int, block_rows: int):
    return (slice(start, min(start + block_rows, n_q)) for start in range(0, n_q, block_rows))


def sagebwd_forward_naive(q, k, v, softmax_scale, window_size=(-1, -1), k_smoothing=True,
                          q_smoothing=False, block_n=64, softcap=0.0, query_block=None,
                          numerics: Numerics = ACCURATE):
    """Returns (out in q's dtype, base-2 log-sum-exp fp32 with +inf for rows that see no key).

    ``block_n``: the forward kernel's key tile (P gets one scale per query per tile). ``query_block``: query rows
    per pass (None: sized by SCORE_BLOCK_ELEMENTS); any value gives the same results. ``numerics``: the rules of
    a precision preset (sagebwd_hf.numerics; the default is "accurate")."""
    b, h, n_q = q.shape[:3]
    n_k = k.shape[2]
    keys = _quantize_keys(k, h, k_smoothing)
    vf = v.float()
    if numerics.pv_e4m3:
        v8, v_scale = _e4m3_per_slice(vf, 2)
    else:
        v_scale = vf.abs().amax(2, keepdim=True) * (1.0 / INT8_MAX)               # per channel
        v_inv = torch.where(v_scale > TINY_SCALE / INT8_MAX, 1.0 / v_scale, torch.zeros_like(v_scale))
        v8 = torch.round(vf * v_inv)
    v8 = _repeat_kv(v8, h)
    v_scale = _repeat_kv(v_scale, h)

    out = q.new_empty(b, h, n_q, v.shape[-1])
    lse = torch.empty(b, h, n_q, device=q.device)
    for rows in _row_blocks(n_q, query_block_rows(b * h, n_k, 1, query_block)):
        cols = _visible_keys(rows, n_q, n_k, window_size, block_n)
        s = _block_scores(q[:, :, rows], keys, rows, cols, n_q, n_k, softmax_scale, window_size, q_smoothing,
                          softcap)[0]
        n_rows = rows.stop - rows.start
        m = torch.full((b, h, n_rows), float("-inf"), device=q.device)
        l = torch.zeros(b, h, n_rows, device=q.device)
        acc = torch.zeros(b, h, n_rows, v.shape[-1], device=q.device)
        for start in range(0, s.shape[-1], block_n):            # online softmax, one key tile at a time
            s_tile = s[..., start:start + block_n]
            tile_max = s_tile.amax(-1)
            m_new = torch.maximum(m, tile_max)
            m_ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp2(m - m_ref)
            if numerics.p_static:
                # P relative to the running max, which maps to p_max (127, or e4m3's 448): no per-tile scale
                e = torch.exp2(s_tile - (m_ref - math.log2(numerics.p_max))[..., None])
                p_scale = torch.full_like(m_ref, 1.0 / numerics.p_max)
            else:
                # P is quantized per row of the tile: its largest value in the tile maps to 127,
                # e = 127 * p / max_tile(p) = 127 * exp2(s - tile_max), and p = e * p_scale
                e_ref = torch.where(torch.isinf(tile_max), torch.zeros_like(tile_max),
                                    tile_max - math.log2(numerics.p_max))
                e = torch.exp2(s_tile - e_ref[..., None])
                p_scale = torch.exp2(tile_max - m_ref) * (1.0 / numerics.p_max)
            l = l * alpha + e.sum(-1) * p_scale
            key0 = cols.start + start
            e8 = round_e4m3(e) if numerics.pv_e4m3 else torch.round(e)
            acc = acc * alpha[..., None] + (e8 @ v8[:, :, key0:key0 + block_n]) * p_scale[..., None]
            m = m_new
        has_keys = l != 0   # (a NaN row sum, from a NaN or inf input, stays NaN, as the kernels keep it)
        out[:, :, rows] = acc * torch.where(has_keys, 1.0 / l, torch.zeros_like(l))[..., None] * v_scale
        lse[:, :, rows] = torch.where(has_keys, m + torch.log2(l), torch.full_like(l, float("inf")))
    return out, lse


def _tiles(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zero-pad ``dim`` to a multiple of ``size`` and split it into (tiles, size)."""
    n = x.shape[dim]
    pad = (-n) % size
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_zeros(shape)], dim)
    shape = list(x.shape)
    shape[dim:dim + 1] = [(n + pad) // size, size]
    return x.reshape(shape)


def row_max_scores(q, keys: "_Keys", softmax_scale, window_size, q_smoothing, softcap, block_n,
                   block_rows) -> torch.Tensor:
    """Each query row's largest visible score ``[B, H, Nq]`` in lse's frame (base 2, the quantized scores the
    forward's online softmax ends with); -inf for a row that sees no key."""
    b, h, n_q = q.shape[:3]
    n_k = keys.k8.shape[2]
    m = torch.full((b, h, n_q), float("-inf"), device=q.device)
    for rows in _row_blocks(n_q, block_rows):
        cols = _visible_keys(rows, n_q, n_k, window_size, block_n)
        if cols.stop > cols.start:
            s = _block_scores(q[:, :, rows], keys, rows, cols, n_q, n_k, softmax_scale, window_size, q_smoothing,
                              softcap)[0]
            m[:, :, rows] = s.amax(-1)
    return m


def ds_row_bound(q, keys: "_Keys", v, out, lse, dout, softmax_scale, window_size, q_smoothing, softcap,
                 block_n, block_rows) -> torch.Tensor:
    """The ds_bound rule's bound of each query row's largest |dS| ``[B, H, Nq]``: ``max_k P · (|dO| · |V|max +
    |δ|)``. max_k P = exp2(m − lse) with m the row's largest score (``row_max_scores``), |dP| ≤ |dO| |V_k| ≤
    |dO| · |V|max with |V|max the norm of V's channel maxima over the sequence, δ = rowsum(dO · O); a cap's
    derivative is at most 1. Rows that see no key get 0."""
    m = row_max_scores(q, keys, softmax_scale, window_size, q_smoothing, softcap, block_n, block_rows)
    h = q.shape[1]
    p_max = torch.exp2(m - lse)                                   # +inf lse or -inf m: 0
    v_norm = _repeat_kv(v.float().abs().amax(2).norm(dim=-1, keepdim=True), h)    # [B, H, 1]
    delta = (dout.float() * out.float()).sum(-1)
    return p_max * (dout.float().norm(dim=-1) * v_norm + delta.abs())


def sagebwd_backward_naive(q, k, v, out, lse, dout, softmax_scale, window_size=(-1, -1),
                           k_smoothing=True, q_smoothing=False, block_m_dkdv=64, block_n_dq=64, softcap=0.0,
                           dq_int8=True, query_block=None, key_shard=False, numerics: Numerics = ACCURATE):
    """Gradients (dq, dk, dv) of the quantized algorithm, in the inputs' dtypes.

    ``block_m_dkdv``: query tile of the dK/dV kernel (P and dS get one scale per key per tile);
    ``block_n_dq``: key tile of the dQ kernel (dS gets one scale per query per tile). ``dq_int8`` False: dQ's
    product as the one-launch Hopper backward computes it (the default at head dim 64; its query tile is 64): dS
    rounded to the inputs' dtype times the int8 K (exact there) in fp32, times K's scales. ``query_block``: query
    rows per pass, a multiple of ``block_m_dkdv`` (None: sized by SCORE_BLOCK_ELEMENTS); dK and dV are summed
    over the passes in fp32. ``key_shard``: ``k`` and ``v`` are one shard of each row's keys, ``out`` and ``lse``
    merged over all shards (ring attention), so dS's rows do not sum to zero over these keys and dQ gets
    ``rowsum(dS) * mean(k)`` (a cap gets it anyway). ``numerics``: the rules of a precision preset
    (sagebwd_hf.numerics; with ``p_static`` dO gets one scale per channel per ``block_m_dkdv`` queries, with
    ``ds_tile`` ``block_n_dq`` and the query blocks must be multiples of DS_TILE)."""
    b, h, n_q = q.shape[:3]
    n_k = k.shape[2]
    keys = _quantize_keys(k, h, k_smoothing)
    vf = _repeat_kv(v.float(), h)
    dq = torch.empty_like(q)
    dk = torch.zeros(b, h, n_k, k.shape[-1], device=q.device)      # summed over KV groups at the end
    dv = torch.zeros(b, h, n_k, v.shape[-1], device=q.device)

    # dV = P^T dO and dK = dS^T Q reduce over queries: one scale per key per query tile
    def over_queries(x, x8, x_scale, signed, e4m3=False):
        t = _tiles(x * x_scale[..., :, None], 2, block_m_dkdv)                # [B, H, T, bm, Nk]
        t8, t_scale = _e4m3_per_slice(t, 3) if e4m3 else _row_quantize(t, 3, signed)
        rhs = _tiles(x8, 2, block_m_dkdv)                                     # [B, H, T, bm, D]
        return ((t8.transpose(-1, -2) @ rhs) * t_scale.transpose(-1, -2)).sum(2)

    if numerics.do_sequence:   # dO's channel maxima over each sequence and the query heads of its KV group
        hkv = k.shape[1]
        do_max = dout.float().abs().amax(2).view(b, hkv, h // hkv, -1).amax(2, keepdim=True)
        do_max = do_max.expand(-1, -1, h // hkv, -1).reshape(b, h, 1, -1)        # [B, H, 1, D]

    def pt_do_static(p, do_rows):
        """dV's part with P at its fixed scale (p_static): dO one scale per channel per query tile, or with
        do_sequence per channel over the sequence and KV group (one scale along the whole sum)."""
        p_max = numerics.p_max
        if numerics.do_sequence:
            inv = torch.where(do_max > TINY_SCALE, torch.full_like(do_max, E4M3_MAX) / do_max,
                              torch.zeros_like(do_max))
            do8 = round_e4m3(do_rows.float() * inv)
            return (round_e4m3(p * p_max).transpose(-1, -2) @ do8) * (do_max * (1.0 / (E4M3_MAX * p_max)))
        do_t = _tiles(do_rows.float(), 2, block_m_dkdv)                        # [B, H, T, bm, D]
        do8, do_t_scale = _e4m3_per_slice(do_t, 3) if numerics.pv_e4m3 else _row_quantize(do_t, 3, True)
        p8 = _tiles(round_e4m3(p * p_max) if numerics.pv_e4m3 else torch.round(p * p_max), 2, block_m_dkdv)
        return ((p8.transpose(-1, -2) @ do8) * do_t_scale).sum(2) * (1.0 / p_max)

    if numerics.ds_bound:   # dK's dS over a per-row bound at a fixed scale; Q times the bound, one scale a channel
        row_bound = ds_row_bound(q, keys, v, out, lse, dout, softmax_scale, window_size, q_smoothing, softcap,
                                 block_n_dq, query_block_rows(b * h, n_k, block_m_dkdv, query_block))
        hkv = k.shape[1]
        qr_max = (q.float() * row_bound[..., None]).abs().amax(2).view(b, hkv, h // hkv, -1).amax(2, keepdim=True)
        qr_max = qr_max.expand(-1, -1, h // hkv, -1).reshape(b, h, 1, -1)       # [B, H, 1, D]
        qr_inv = torch.where(qr_max > TINY_SCALE, torch.full_like(qr_max, E4M3_MAX) / qr_max,
                             torch.zeros_like(qr_max))

    if numerics.dp_int8:   # dP = dO V^T in INT8: V one scale per K-scale block of its sequence, dO one per token
        v8_dp, v_scale_dp = quantize_per_block(v, k_scale_block(v.shape[-1]))
        v8_dp, v_scale_dp = _repeat_kv(v8_dp, h), _repeat_kv(v_scale_dp.unsqueeze(-1), h).squeeze(-1)

    if numerics.ds_tile:
        if block_n_dq % DS_TILE or block_m_dkdv % DS_TILE:
            raise ValueError(f"ds_tile needs tiles that are multiples of {DS_TILE}, got {block_m_dkdv} and "
                             f"{block_n_dq}")
        if k_scale_block(k.shape[-1]) % DS_TILE:   # dQ's K needs one scale per DS_TILE keys
            kf = k.float() - k.float().mean(2, keepdim=True) if k_smoothing else k.float()
            k8_ds, k_scale_ds = quantize_per_block(kf, DS_TILE)
            k8_ds, k_scale_ds = _repeat_kv(k8_ds, h), _repeat_kv(k_scale_ds.unsqueeze(-1), h).squeeze(-1)
        else:
            k8_ds, k_scale_ds = keys.k8, keys.k_scale

    for rows in _row_blocks(n_q, query_block_rows(b * h, n_k, block_m_dkdv, query_block)):
        cols = _visible_keys(rows, n_q, n_k, window_size, block_n_dq)
        q_rows, do_rows = q[:, :, rows], dout[:, :, rows]
        s, mask = _block_scores(q_rows, keys, rows, cols, n_q, n_k, softmax_scale, window_size, q_smoothing,
                                softcap)
        p = torch.where(mask, torch.exp2(s - lse[:, :, rows, None]), torch.zeros_like(s))
        if numerics.dp_int8:   # both scales factor out of the sum over channels (exact integer sums)
            do8_dp, do_scale_dp = quantize_per_token(do_rows)
            dp = ((do8_dp @ v8_dp[:, :, cols].transpose(-1, -2)) * do_scale_dp[..., None]
                  * v_scale_dp[:, :, None, cols])
        else:
            dp = do_rows.float() @ vf[:, :, cols].transpose(-1, -2)    # stays in high precision
        delta = (do_rows.float() * out[:, :, rows].float()).sum(-1)
        ds = p * (dp - delta[..., None])
        if softcap:   # through the cap: d(cap tanh(x / cap))/dx = 1 - tanh^2
            ds = ds * torch.where(mask, 1.0 - (s / (softcap * LOG2E)) ** 2, torch.zeros_like(s))
        del s, dp

        if numerics.p_static:
            dv[:, :, cols] += pt_do_static(p, do_rows)
        elif numerics.pv_e4m3:
            do8e, do_scale_e = _e4m3_per_slice(do_rows.float(), -1)
            dv[:, :, cols] += over_queries(p, do8e, do_scale_e.squeeze(-1), False, e4m3=True)
        else:
            dv[:, :, cols] += over_queries(p, *quantize_per_token(do_rows), False)
        k8, k_scale = keys.k8[:, :, cols], keys.k_scale[:, :, cols]
        ds8 = None
        if numerics.ds_tile:   # one INT8 dS, one scale per DS_TILE x DS_TILE tile, for both dK and dQ
            ds8, ds_scale = _tile_quantize(ds, DS_TILE)                   # [B, H, Tq, t, Tk, t], [B, H, Tq, Tk]
            q8b, q_scale_b = quantize_per_block(q_rows, DS_TILE)
            q8t, q_scale_t = _tiles(q8b, 2, DS_TILE), _tiles(q_scale_b, 2, DS_TILE)[..., 0]   # [B, H, Tq, t, D]
            dk_tiles = torch.einsum("bhqikj,bhqid->bhqkjd", ds8, q8t)    # exact: integer sums below 2^24
            dk_tiles = (dk_tiles * (ds_scale * q_scale_t[..., None])[..., None, None]).sum(2)   # [B, H, Tk, t, D]
            dk[:, :, cols] += dk_tiles.flatten(2, 3)[:, :, :cols.stop - cols.start]
        elif numerics.ds_bound:   # no scale changes along the sum over queries: it is applied after it
            bound = row_bound[:, :, rows]
            # (a tiny bound as a zero one: 448 over it would be inf, and inf times a zero dS NaN)
            ds_inv = torch.where(bound > TINY_SCALE, torch.full_like(bound, E4M3_MAX) / bound, torch.zeros_like(bound))
            ds_e4m3 = round_e4m3(ds * ds_inv[..., None])
            qr8 = round_e4m3((q_rows.float() * bound[..., None]) * qr_inv)
            dk[:, :, cols] += (ds_e4m3.transpose(-1, -2) @ qr8) * (qr_max * (1.0 / E4M3_MAX ** 2))
        elif numerics.dk_e4m3:   # Q one e4m3 scale per token (folded into dS), dS one per key per query tile
            q8e, q_scale_e = _e4m3_per_slice(q_rows.float(), -1)
            dk[:, :, cols] += over_queries(ds, q8e, q_scale_e.squeeze(-1), True, e4m3=True)
        else:   # dK needs the true Q, not the smoothed one the scores used
            dk[:, :, cols] += over_queries(ds, *quantize_per_token(q_rows), True)
        if ds8 is not None and dq_int8:
            k8t = _tiles(k8_ds[:, :, cols], 2, DS_TILE)                              # [B, H, Tk, t, D]
            k_scale_t = _tiles(k_scale_ds[:, :, cols], 2, DS_TILE)[..., 0]           # [B, H, Tk]
            dq_tiles = torch.einsum("bhqikj,bhkjd->bhqkid", ds8, k8t)
            dq_tiles = (dq_tiles * (ds_scale * k_scale_t[:, :, None, :])[..., None, None]).sum(3)  # [B, H, Tq, t, D]
            dq_rows = dq_tiles.flatten(2, 3)[:, :, :rows.stop - rows.start] * softmax_scale
        elif dq_int8:   # dQ = dS K reduces over keys: one scale per query per key tile
            t = _tiles(ds * k_scale[..., None, :], 3, block_n_dq)                 # [B, H, rows, T, bn]
            t8, t_scale = _row_quantize(t, 4, True)
            k_tiles = _tiles(k8, 2, block_n_dq)                                   # [B, H, T, bn, D]
            dq_rows = ((t8.transpose(2, 3) @ k_tiles) * t_scale.transpose(2, 3)).sum(2) * softmax_scale
        else:
            dq_rows = (ds.to(dout.dtype).float() @ (k8.float() * k_scale[..., None])) * softmax_scale
        if (softcap or key_shard) and keys.k_mean is not None:   # scores of K - mean(k): rows' dS do not sum to 0
            dq_rows = dq_rows + ds.sum(-1, keepdim=True) * keys.k_mean * softmax_scale
        dq[:, :, rows] = dq_rows

    hkv = k.shape[1]
    return dq, _sum_groups(dk * softmax_scale, hkv).to(k.dtype), _sum_groups(dv, hkv).to(v.dtype)


def lse_to_natural(lse2: torch.Tensor) -> torch.Tensor:
    """Internal base-2 lse (+inf marks empty rows) -> natural log (-inf for empty rows)."""
    return torch.where(torch.isinf(lse2), torch.full_like(lse2, float("-inf")), lse2 * math.log(2.0))
