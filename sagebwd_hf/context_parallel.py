"""``attn_implementation="sagebwd"`` under PyTorch's context parallelism: ring attention, or a clear error.

PyTorch's ``context_parallel`` (what Accelerate's ``ParallelismConfig(cp_size=...)`` and torchtitan use) shards
each sequence over GPUs and turns SDPA's flash / efficient / cuDNN ops into ring attention. A Transformers
backend that calls its own kernels would attend within each GPU's shard only. So while context parallelism is
active, the ``"sagebwd"`` backend sends every attention call through ``F.scaled_dot_product_attention`` on the
flash backend, whose ring runs SageBwd's kernels once ``"SageBwd"`` is the active SDPA flash implementation
(``sagebwd_hf.sdpa_flash``); without it, or for a call the ring cannot compute (a mask, a sliding window, a soft
cap, sinks, dropout), it raises instead of computing something else.
"""
import sys

import torch
import torch.nn.functional as F

from . import sdpa_flash

HOW_TO = ("activate SageBwd behind SDPA before the model runs -- torch.nn.attention.activate_flash_attention_impl"
          "('SageBwd') or sagebwd_hf.sdpa_flash.activate() -- and context parallelism's ring attention runs on "
          "SageBwd's kernels (for attn_implementation='sagebwd' and 'sdpa' models alike)")


def active() -> bool:
    """Whether PyTorch's context parallelism handles SDPA now (inside ``context_parallel(...)``, or with its
    module-wrapper dispatch enabled): its ring handlers are then installed in DTensor's op dispatcher."""
    if "torch.distributed.tensor" not in sys.modules:   # never imported: never enabled (and no import cost)
        return False
    try:
        from torch.distributed.tensor import DTensor
        handlers = DTensor._op_dispatcher._custom_op_handlers
    except (ImportError, AttributeError):
        return False
    return torch.ops.aten._scaled_dot_product_flash_attention.default in handlers


def _unsupported(attention_mask, dropout, causal, window, softcap, s_aux, query):
    if attention_mask is not None:
        return "an attention mask (context parallelism shards whole causal or bidirectional sequences)"
    if dropout:
        return "attention dropout"
    if tuple(window) != (-1, -1):
        return "a sliding window"
    if softcap:
        return "a soft cap"
    if s_aux is not None:
        return "attention sinks"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"{query.dtype} tensors (the flash backend takes float16 and bfloat16)"
    return None


def ring_attention(query, key, value, attention_mask, dropout, scaling, causal, window, softcap, s_aux):
    """One Transformers attention call (query ``[B, Hq, S, D]``, key/value ``[B, Hkv, S, D]``, this GPU's shard;
    ``window``: FlashAttention's pair, (-1, -1) without a sliding window; ``causal`` apart) through context
    parallelism's ring on SageBwd's kernels; returns ``[B, S, Hq, D]``."""
    if not sdpa_flash.is_active():
        raise RuntimeError("sagebwd: PyTorch context parallelism is active, and attn_implementation='sagebwd' "
                           "would attend within each GPU's shard of the sequence only. To run it: " + HOW_TO + ".")
    reason = _unsupported(attention_mask, dropout, causal, window, softcap, s_aux, query)
    if reason is not None:
        raise NotImplementedError(f"sagebwd: under context parallelism attention runs as SDPA's ring on the flash "
                                  f"backend, which does not compute {reason}.")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(query, key, value, is_causal=causal,
                                             scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2)
