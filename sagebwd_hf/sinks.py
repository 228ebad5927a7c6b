"""Attention sinks (gpt-oss's ``s_aux``) and the K-smoothing row shift they and soft-capping need.

A sink is one learned logit per head that joins every row's softmax denominator and carries no value:
``o_i = sum_j exp(s_ij) v_j / (exp(sink) + sum_j exp(s_ij))``. That changes nothing inside the kernels:

* forward: the kernels' output and base-2 lse without the sink give it exactly, ``lse' = log2(2^lse +
  2^sink)`` and ``o' = o * 2^(lse - lse')``, one elementwise pass over the output;
* backward: the kernels run with ``lse'`` and ``o'`` (their ``P = 2^(s - lse')`` and ``delta = rowsum(dO o')``
  are then the sink-softmax's), and the sink's gradient is ``-sum_i 2^(sink - lse'_i) delta_i``.

One subtlety: the kernels score K - mean(k) (K-smoothing), which moves row i by ``-q_i . mean(k) * scale``.
The sink does not move, so in the kernels' frame it sits at ``sink - shift_i``; and since the rows' dS no
longer sum to zero (the sink takes its share), dQ gets back the ``rowsum(dS) * mean(k)`` that the smoothed
keys left out: the dQ kernels add it in their epilogue from ``sink_grads``' row sums, the PyTorch path with
``add_row_ds_term``.
"""
import math

import torch

from .kernels.layout import SeqLayout, as_bhnd
from .naive import LOG2E


def key_means(q, k, cu_q, cu_k):
    """The mean K-smoothing subtracts, per query row: ``[B, H, 1, D]`` (padded) or ``[1, H, Tq, D]`` (packed,
    each query token gets its own sequence's mean), fp32, KV heads repeated to q's."""
    if cu_k is None:
        k_mean = k.float().mean(2, keepdim=True)                                   # [B, Hkv, 1, D]
    else:
        seq_k = SeqLayout(cu_k.numel() - 1, 0, cu_k).seq_ids(k.shape[0], k.device)
        seq_q = SeqLayout(cu_q.numel() - 1, 0, cu_q).seq_ids(q.shape[0], q.device)
        sums = torch.zeros(cu_k.numel() - 1, *k.shape[1:], device=k.device).index_add_(0, seq_k, k.float())
        counts = (cu_k[1:] - cu_k[:-1]).clamp_min(1).float()[:, None, None]
        k_mean = (sums / counts)[seq_q].permute(1, 0, 2).unsqueeze(0)            # [1, Hkv, Tq, D]
    return k_mean.repeat_interleave(q.shape[1] // k.shape[1], dim=1)   # heads: dim 1 in both layouts


def smoothing_shift(q, k_mean, varlen, scale):
    """``scale * q_i . mean(k)`` in the lse layout (``[B, H, N]``, packed ``[1, H, T]``), fp32, natural log."""
    return (as_bhnd(q, varlen).float() * k_mean).sum(-1) * scale


def _sink_logits2(sinks, lse2, shift):
    """Each row's sink logit in the kernels' frame: base 2, K-smoothing's shift taken off."""
    sink = sinks.float().view(1, -1, 1).expand_as(lse2)
    return (sink - shift) * LOG2E if shift is not None else sink * LOG2E


def add_sinks(out, lse2, sinks, shift):
    """The forward: ``out`` (kernel layout, written in place) and the kernels' base-2 ``lse2`` (+inf for rows
    that see no key) -> the sink-softmax's output and lse. ``shift``: ``smoothing_shift`` or None."""
    sink2 = _sink_logits2(sinks, lse2, shift)
    empty = torch.isinf(lse2)               # no key: the sink takes everything, the output stays zero
    new_lse = torch.where(empty, lse2, torch.logaddexp2(torch.where(empty, sink2, lse2), sink2))
    keep = torch.where(empty, torch.zeros_like(lse2), torch.exp2(lse2 - new_lse))
    out.mul_(keep.unsqueeze(-1))           # computed in fp32, rounded once to out's dtype
    return out, new_lse


def sink_grads(delta, lse2, sinks, shift):
    """The sinks' gradient ``[H]`` (in ``sinks``' dtype) and rowsum(dS) over the real keys (the lse layout, fp32;
    for dQ's K-smoothing term), from ``delta`` = rowsum(dO * O) and the (sink-inclusive) ``lse2``."""
    p_sink = torch.where(torch.isinf(lse2), torch.zeros_like(lse2),
                         torch.exp2(_sink_logits2(sinks, lse2, shift) - lse2))
    row_ds = p_sink * delta                 # the keys' dS sum to minus the sink's, -p_sink * delta
    dsinks = -row_ds.sum(dim=(0, 2))
    return dsinks.to(sinks.dtype), row_ds


def add_row_ds_term(dq, row_ds, k_mean, varlen, scale):
    """dQ += scale * rowsum(dS) * mean(k), in place on the op's dq (whose layout as_bhnd maps), in one pass (the
    PyTorch path's; the kernels do it in dQ's epilogue)."""
    as_bhnd(dq, varlen).addcmul_(row_ds.unsqueeze(-1), k_mean, value=scale)
    return dq


def check_sinks(sinks, num_heads, device):
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor of shape [heads] or None, got {type(sinks).__name__}")
    if sinks.dim() != 1 or sinks.shape[0] != num_heads:
        raise ValueError(f"sinks must have shape [heads] = [{num_heads}] (one logit per query head), "
                         f"got {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks must be on q's device {device}, got {sinks.device}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}")


def check_softcap(softcap):
    if (not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or softcap < 0
            or not math.isfinite(softcap)):
        raise ValueError(f"softcap must be 0 (off) or a positive finite number, got {softcap!r}")
    return float(softcap)
