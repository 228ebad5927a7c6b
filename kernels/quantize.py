"""Smoothing and INT8 quantization of the attention inputs, done before the attention kernels run.

Scales (all fp32, symmetric, ``x ~ scale * x8``):

* Q, K, dO: one scale per token (``max|x| / 127`` over the head dim). A per-token scale sits outside the
  head-dim reduction of ``Q K^T``; for products that reduce over tokens (``dS K``, ``dS^T Q``, ``P^T dO``)
  the kernels fold it into the other operand (dS or P) before quantizing that one, so the int8 data is
  the same in both layouts.
* V: one scale per channel per sequence; it leaves the ``P V`` reduction and is applied once at the end.

Products that reduce over tokens need the INT8 operand token-contiguous (Hopper's 8-bit wgmma is K-major
only), so those tensors also get a transposed copy ``[B, H, D, N_pad]``.

Everything here is plain PyTorch and deterministic (no atomics): forward and backward quantize the same
inputs to the same bytes, so the backward's recomputed scores match the forward's log-sum-exp.
"""
import math
from typing import Optional

import torch

from .layout import SeqLayout

LOG2E = 1.4426950408889634
TOKEN_ALIGN = 16        # transposed copies pad the token axis so every row starts 16-byte aligned
Q_SMOOTH_BLOCK = 128    # tokens per Q-smoothing mean; every kernel's query tile divides it


def quantize_per_token(x: torch.Tensor):
    """``x [..., D]`` -> (int8 ``[..., D]``, fp32 scale ``[...]``); all-zero rows get scale 0."""
    xf = x.float()
    scale = xf.abs().amax(-1) / 127.0
    x8 = torch.round(xf / scale.clamp_min(1e-30).unsqueeze(-1)).to(torch.int8)
    return x8.contiguous(), scale.contiguous()


def token_major_copy(x8: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, D]`` int8 -> ``[B, H, D, N_pad]`` with tokens contiguous, zero padded."""
    b, h, n, d = x8.shape
    n_pad = -(-max(n, 1) // TOKEN_ALIGN) * TOKEN_ALIGN
    out = x8.new_zeros(b, h, d, n_pad)
    out[..., :n] = x8.transpose(-1, -2)
    return out


def _segments(x4: torch.Tensor, lengths: torch.Tensor, reduce: str) -> torch.Tensor:
    """Reduce a packed ``[1, H, T, D]`` tensor over consecutive token segments -> ``[S, H, D]``."""
    _, h, t, d = x4.shape
    flat = x4[0].transpose(0, 1).reshape(t, h * d)
    if reduce == "mean":
        sums = torch.segment_reduce(flat, "sum", lengths=lengths, axis=0)
        out = sums / lengths.clamp_min(1).to(sums.dtype).unsqueeze(1)
    else:
        out = torch.segment_reduce(flat, "max", lengths=lengths, axis=0, initial=0.0)
    return out.view(-1, h, d)


def per_sequence(x4: torch.Tensor, layout: SeqLayout, reduce: str) -> torch.Tensor:
    """Mean or max over each sequence's tokens: ``[B, H, N, D]`` (or packed ``[1, H, T, D]``) -> ``[S, H, D]``."""
    if not layout.is_varlen:
        return x4.mean(2) if reduce == "mean" else x4.amax(2)
    lengths = (layout.cu_seqlens[1:] - layout.cu_seqlens[:-1]).long()
    return _segments(x4, lengths, reduce)


def per_token(stat: torch.Tensor, x4: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
    """Broadcast a per-sequence ``[S, H, D]`` statistic back onto the tokens of ``x4``."""
    if not layout.is_varlen:
        return stat.unsqueeze(2)
    ids = layout.seq_ids(x4.shape[2], x4.device)
    return stat[ids].transpose(0, 1).unsqueeze(0)


def q_block_means(qf: torch.Tensor, layout: SeqLayout):
    """Mean of Q over blocks of ``Q_SMOOTH_BLOCK`` tokens, blocks restarting at every sequence.

    Returns (per-token mean ``like qf``, block means ``[H, total_blocks, D]``, ``cu_blocks`` int32 [S + 1]).
    """
    bsz, h, n, d = qf.shape
    if not layout.is_varlen:
        nblk = -(-n // Q_SMOOTH_BLOCK)
        pad = nblk * Q_SMOOTH_BLOCK - n
        padded = torch.nn.functional.pad(qf, (0, 0, 0, pad)).view(bsz, h, nblk, Q_SMOOTH_BLOCK, d)
        counts = torch.full((nblk,), float(Q_SMOOTH_BLOCK), device=qf.device)
        counts[-1] = Q_SMOOTH_BLOCK - pad
        means = padded.sum(3) / counts[:, None]                                   # [B, H, nblk, D]
        per_tok = means.repeat_interleave(Q_SMOOTH_BLOCK, dim=2)[:, :, :n]
        blocks = means.transpose(0, 1).reshape(h, bsz * nblk, d)
        cu_blocks = torch.arange(bsz + 1, device=qf.device, dtype=torch.int32) * nblk
        return per_tok, blocks.contiguous(), cu_blocks
    lengths = (layout.cu_seqlens[1:] - layout.cu_seqlens[:-1]).long()
    nblk = -(-lengths // Q_SMOOTH_BLOCK)
    cu_blocks = torch.zeros(layout.num_seqs + 1, dtype=torch.int32, device=qf.device)
    cu_blocks[1:] = torch.cumsum(nblk, 0)
    # length of every block, in order: full blocks, then each sequence's remainder
    starts = torch.repeat_interleave(lengths, nblk)
    within = torch.arange(int(nblk.sum()), device=qf.device) - torch.repeat_interleave(cu_blocks[:-1].long(), nblk)
    block_len = (starts - within * Q_SMOOTH_BLOCK).clamp(max=Q_SMOOTH_BLOCK)
    means = _segments(qf, block_len, "mean")                                      # [nblocks, H, D]
    per_tok = means.repeat_interleave(block_len, dim=0, output_size=n).transpose(0, 1).unsqueeze(0)
    return per_tok, means.transpose(0, 1).contiguous(), cu_blocks


def quantize_qk(q4, k4, layout_q: SeqLayout, layout_k: SeqLayout, softmax_scale: float,
                k_smoothing: bool, q_smoothing: bool):
    """INT8 Q and K for ``S = Q K^T``.

    Returns a dict: ``q8, q_scale`` (softmax scale and log2(e) folded in, so the kernels use exp2),
    ``q_scale_raw``, ``k8, k_scale``, and for Q-smoothing ``q_mean`` (``[H, blocks, D]``, scaled like
    ``q_scale``) and ``q_mean_cu`` (first block of each sequence).
    """
    kf = k4.float()
    if k_smoothing:   # softmax is unchanged: every score of a row moves by the same q . mean(k)
        kf = kf - per_token(per_sequence(kf, layout_k, "mean"), kf, layout_k)
    k8, k_scale = quantize_per_token(kf)

    qf = q4.float()
    q_mean = q_mean_cu = None
    if q_smoothing:   # S = (q - q_mean) K^T + q_mean K^T; the second term is added back in fp32
        per_tok, q_mean, q_mean_cu = q_block_means(qf, layout_q)
        qf = qf - per_tok
        q_mean = q_mean * (softmax_scale * LOG2E)
    q8, q_scale_raw = quantize_per_token(qf)
    return dict(q8=q8, q_scale=q_scale_raw * (softmax_scale * LOG2E), q_scale_raw=q_scale_raw,
                k8=k8, k_scale=k_scale, q_mean=q_mean, q_mean_cu=q_mean_cu)


def quantize_v(v4: torch.Tensor, layout: SeqLayout):
    """Per-channel INT8 V in token-major layout: (``v8t [B, H, D, N_pad]``, ``v_scale [S, H, D]``)."""
    vf = v4.float()
    v_scale = per_sequence(vf.abs(), layout, "max") / 127.0
    v8 = torch.round(vf / per_token(v_scale.clamp_min(1e-30), vf, layout)).to(torch.int8)
    return token_major_copy(v8), v_scale.contiguous()


def is_power_of_two(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def next_power_of_two(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1))))


def maybe(x: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Kernels need a real pointer even for an unused argument."""
    return x if x is not None else like
