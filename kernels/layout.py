"""One description of a batch for the kernels, whether padded or packed (varlen).

The kernels index every tensor as ``[batch, head, token, dim]`` through strides. A padded batch is just
that. A packed batch ``[total_tokens, heads, dim]`` is viewed as ``[1, heads, total_tokens, dim]`` and
each program finds its sequence's first token in ``cu_seqlens``; the batch stride is then unused.
"""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SeqLayout:
    num_seqs: int                  # programs along the batch axis of the grid
    max_len: int                   # longest sequence: sizes the grid along tokens
    cu_seqlens: Optional[torch.Tensor]  # int32 [num_seqs + 1] for packed batches, None when padded

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens is not None

    def seq_ids(self, total: int, device) -> torch.Tensor:
        """Sequence index of every packed token (varlen only)."""
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        return torch.repeat_interleave(torch.arange(self.num_seqs, device=device), lengths, output_size=total)


def as_bhnd(x: torch.Tensor, varlen: bool) -> torch.Tensor:
    """View a packed ``[T, H, D]`` tensor as ``[1, H, T, D]``; a padded ``[B, H, N, D]`` one is returned as is."""
    return x.permute(1, 0, 2).unsqueeze(0) if varlen else x


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code: Triton's is a constexpr function, ~2 us a call from Python."""
    return -(-a // b)


def strides4(x: Optional[torch.Tensor]):
    if x is None:
        return (0, 0, 0, 0)
    assert x.dim() == 4
    return tuple(x.stride())


def strides3(x: Optional[torch.Tensor]):
    if x is None:
        return (0, 0, 0)
    assert x.dim() == 3
    return tuple(x.stride())


def maybe(x: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Kernels need a real pointer even for an argument a constexpr switch leaves unused."""
    return x if x is not None else like


def token_rows(x4):
    """A caller's ``[B, H, N, D]`` tensor as the rows of a 2-D view in its own memory: ``(shape, strides, (rb,
    rh, ch))``, token n of head h in batch b at row ``b*rb + h*rh + n``, column ``h*ch``; None when TMA cannot
    address that memory (strides or base not 16-byte aligned: copy it first). Head-major memory (``[B, H, N,
    D]`` contiguous) gives ``ch = 0``; token-major memory (the ``[B, N, H, D]`` that Transformers' q/k/v and
    their gradients live in) ``rh = 0``. Copying those took 4 x 128 MB per backward at B*N = 32K, H*D = 2048."""
    b, h, n, d = x4.shape
    sb, sh, sn, sd = x4.stride()
    esize = x4.element_size()
    if not (sd == 1 and n > 0 and sn >= d and (sn * esize) % 16 == 0 and x4.data_ptr() % 16 == 0
            and (b == 1 or sb % sn == 0)):
        return None
    rb = sb // sn if b > 1 else 0
    if h == 1 or sh % sn == 0:                                       # heads are runs of rows
        rh = sh // sn if h > 1 else 0
        return [(b - 1) * rb + (h - 1) * rh + n, d], [sn, 1], (rb, rh, 0)
    if (sh * esize) % 16 == 0 and (h - 1) * sh + d <= sn:             # heads side by side in a row
        return [(b - 1) * rb + n, (h - 1) * sh + d], [sn, 1], (rb, 0, sh)
    return None


def tma_addressable(x4):
    """``x4``, or a contiguous copy where ``token_rows`` cannot address it."""
    return x4 if token_rows(x4) is not None else x4.contiguous()
