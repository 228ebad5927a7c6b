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
