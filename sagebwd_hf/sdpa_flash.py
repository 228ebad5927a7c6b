"""SageBwd behind PyTorch's SDPA flash backend: ``torch.nn.attention.activate_flash_attention_impl("SageBwd")``.

``import sagebwd_hf`` registers the implementation ``"SageBwd"`` with PyTorch's flash-attention registry (torch's
``register_flash_attention_impl``, the way it plugs in FA3 and FA4); nothing changes until a user activates it.
Once active, the CUDA kernels of SDPA's flash op (``aten::_scaled_dot_product_flash_attention``) and of
FlashAttention's op (``aten::_flash_attention_forward``, padded or packed with ``cu_seqlens``), and their
backwards, are SageBwd's: every ``F.scaled_dot_product_attention`` call that picks the flash backend, torch's
varlen attention, and PyTorch's ring attention under ``context_parallel`` run the INT8 forward and backward.

Contract, each op's own semantics: ``scale`` (default ``head_dim ** -0.5``), GQA (fewer key/value heads),
windows and bottom-right causal alignment where FlashAttention's op has them, the returned tensors' shapes and
dtypes. The forward returns the natural-log log-sum-exp of the caller's scores (K-smoothing's shift taken out);
the backward takes the ``out`` and ``logsumexp`` it is given (ring attention passes merged ones) and recomputes
by the same rule. Calls the kernels cannot take exactly go to the original kernel (``support_error`` says which
and why; ``stats()`` counts them): dropout, a debug mask, SDPA's causal call with query and key lengths apart (its
documented alignment is top-left), dtypes other than fp16/bf16, head dims the kernels do not take, empty
tensors, ``seqused_k``, ALiBi and paged KV caches.
"""
import collections
import weakref
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from . import interface, naive

IMPL_NAME = "SageBwd"
FORWARD_OP = "_scaled_dot_product_flash_attention"              # SDPA's flash backend, [B, H, N, D]
BACKWARD_OP = "_scaled_dot_product_flash_attention_backward"
FA_FORWARD_OP = "_flash_attention_forward"                        # FlashAttention's: [B, N, H, D] or packed
FA_BACKWARD_OP = "_flash_attention_backward"

_calls = collections.Counter()       # "forward" / "backward" -> calls run by SageBwd's kernels
_fallbacks = collections.Counter()   # reason -> calls handed to the original kernel


def registry_available() -> bool:
    """Whether this torch lets a library replace SDPA's flash kernels (``torch.nn.attention``'s registry and
    ``torch.library.get_kernel``, which keeps the original kernel for the calls we leave to it)."""
    from torch.nn import attention
    return hasattr(attention, "register_flash_attention_impl") and hasattr(torch.library, "get_kernel")


def _missing_registry() -> str:
    return (f"torch {torch.__version__} has no flash-attention registry (torch.nn.attention."
            f"register_flash_attention_impl and torch.library.get_kernel): SageBwd cannot run behind SDPA here; "
            f"use attn_implementation='sagebwd' or sagebwd_attn_func instead")


def stats() -> dict:
    """``{"forward": n, "backward": n, "backward_row_term": n, "fallback": {reason: n}}`` since the last
    ``reset_stats()``: calls run by SageBwd's kernels, backwards of merged (ring) results among them, and calls
    left to the original kernel by reason."""
    return {"forward": _calls["forward"], "backward": _calls["backward"],
            "backward_row_term": _calls["backward_row_term"], "fallback": dict(_fallbacks)}


def reset_stats() -> None:
    _calls.clear()
    _fallbacks.clear()


def is_active() -> bool:
    """Whether ``"SageBwd"`` is the active SDPA flash implementation in this process."""
    if not registry_available():
        return False
    from torch.nn.attention import current_flash_attention_impl
    return current_flash_attention_impl() == IMPL_NAME


def activate() -> None:
    """``torch.nn.attention.activate_flash_attention_impl("SageBwd")``, with a clear error where torch lacks it."""
    if not registry_available():
        raise RuntimeError(_missing_registry())
    from torch.nn.attention import activate_flash_attention_impl
    activate_flash_attention_impl(IMPL_NAME)


def restore() -> None:
    """Give SDPA's flash backend its own kernels back (``torch.nn.attention.restore_flash_attention_impl``)."""
    if registry_available() and is_active():
        from torch.nn.attention import restore_flash_attention_impl
        restore_flash_attention_impl()


# ---------------------------------------------------------------------------------------------------
# Which calls the kernels take
# ---------------------------------------------------------------------------------------------------

def support_error(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                  packed=False, bottom_right=False) -> Optional[str]:
    """Why SageBwd cannot compute this flash call exactly (a short reason, counted in ``stats()``), or None.
    ``query``: ``[B, H, Lq, D]``, or with ``packed`` FlashAttention's ``[T, H, D]``. ``bottom_right``: the op
    aligns a causal mask bottom-right when the query is shorter (FlashAttention's ops do, as the kernels;
    SDPA's documents top-left)."""
    tensors = (query, key, value)
    if any(t.dim() != (3 if packed else 4) for t in tensors):
        return "rank"
    if dropout_p != 0.0:
        return "dropout"
    if return_debug_mask:
        return "debug_mask"
    if query.dtype not in interface.SUPPORTED_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return "dtype"
    if len({t.device for t in tensors}) != 1:
        return "device"
    heads, head_dim, kv_heads = query.shape[-3], query.shape[-1], key.shape[-3]
    if key.shape[:-1] != value.shape[:-1] or key.shape[-1] != head_dim or (not packed and key.shape[0] !=
                                                                              query.shape[0]):
        return "shape"
    if kv_heads == 0 or heads % kv_heads:
        return "heads"
    if value.shape[-1] != head_dim or head_dim % 8 or not 8 <= head_dim <= interface.MAX_HEAD_DIM:
        return "head_dim"      # (the flash ops take one head dim for q, k and v)
    if query.numel() == 0 or key.numel() == 0:
        return "empty"
    if is_causal and not (packed or bottom_right) and query.shape[2] != key.shape[2]:
        return "causal_non_square"
    return None


class Packing(NamedTuple):
    """FlashAttention's varlen layout: tokens ``[T, H, D]``, sequence ``i`` at ``cu[i]:cu[i+1]`` (int32)."""
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def _scale(query, scale):
    return float(scale) if scale is not None else query.shape[-1] ** -0.5


def _window(is_causal, left=None, right=None):
    """FlashAttention's (left, right) pair as the op takes it: -1 unbounded, right 0 when causal."""
    left = -1 if left is None or left < 0 else int(left)
    right = 0 if is_causal else (-1 if right is None or right < 0 else int(right))
    return left, right


def _backend(query):
    return "triton" if interface._use_triton(query) else "naive"


def _lengths(query, key, packing):
    if packing is None:
        return None, None, query.shape[2], key.shape[2]
    return packing


def _smoothing_rows(query, key, scale, packing=None):
    """K-smoothing's per-row score shift (natural log, ``[B, H, Lq]`` or packed ``[1, H, T]``): what the kernels'
    lse lacks."""
    cu_q, cu_k, _, _ = _lengths(query, key, packing)
    return interface._torch_shift(query, key, cu_q, cu_k, scale).rows


def natural_lse(lse2, query, key, scale, packing=None):
    """The kernels' base-2, smoothed lse (+inf for rows that see no key) -> SDPA's natural-log lse of the
    caller's scores (-inf for such rows)."""
    return naive.lse_to_natural(lse2) + _smoothing_rows(query, key, scale, packing)


def kernel_lse(logsumexp, query, key, scale, packing=None):
    """The inverse of ``natural_lse``, for a backward handed SDPA's (possibly ring-merged) lse."""
    lse = logsumexp.float() - _smoothing_rows(query, key, scale, packing)
    return torch.where(torch.isinf(logsumexp), torch.full_like(lse, float("inf")), lse * naive.LOG2E)


# The lse tensors this module's forward returned (id -> weak reference). A backward handed one of them runs on
# the whole row's keys; any other lse was merged from several calls (ring attention), see ``backward``.
_own_lse = {}


def _remember(lse):
    key = id(lse)
    _own_lse[key] = weakref.ref(lse, lambda _: _own_lse.pop(key, None))


def _is_own(lse) -> bool:
    ref = _own_lse.get(id(lse))
    return ref is not None and ref() is lse


def forward(query, key, value, is_causal=False, scale=None, window=(None, None), packing=None):
    """SageBwd's forward in SDPA's terms, in the op's layouts (padded ``[B, H, N, D]``, or ``[T, H, D]`` with
    ``packing``): ``(out, logsumexp)``, the lse fp32 natural log, ``[B, H, Lq]`` or packed ``[1, H, T]``.
    ``window``: FlashAttention's (left, right), None or -1 unbounded."""
    scale = _scale(query, scale)
    cu_q, cu_k, max_q, max_k = _lengths(query, key, packing)
    out, lse2 = interface._forward(query, key, value, cu_q, cu_k, max_q, max_k, scale, _window(is_causal, *window),
                                   True, False, _backend(query))
    lse = natural_lse(lse2, query, key, scale, packing)
    _remember(lse)
    return out, lse


def backward(grad_out, query, key, value, out, logsumexp, is_causal=False, scale=None, window=(None, None),
             packing=None, merged=None):
    """SageBwd's backward from SDPA's saved tensors (``forward``'s layouts): ``(dq, dk, dv)``.

    K-smoothing scores ``k - mean(k)``, which leaves ``rowsum(dS) * mean(k)`` out of dQ; over a row's keys dS sums
    to zero, so the kernels skip it. Ring attention calls this backward once per shard of keys with the merged
    ``out`` and ``logsumexp``, and over one shard dS does not sum to zero: for an lse this module's forward did
    not return (or with ``merged=True``), the dQ kernels sum their own dS rows and add the term."""
    scale = _scale(query, scale)
    cu_q, cu_k, max_q, max_k = _lengths(query, key, packing)
    key_shard = merged if merged is not None else not _is_own(logsumexp)
    if key_shard:
        _calls["backward_row_term"] += 1
    dq, dk, dv, _ = interface._backward(grad_out, query, key, value, out,
                                        kernel_lse(logsumexp, query, key, scale, packing), cu_q, cu_k, max_q, max_k,
                                        scale, _window(is_causal, *window), True, False, _backend(query),
                                        key_shard=key_shard)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------
# The dispatcher overrides
# ---------------------------------------------------------------------------------------------------

@dataclass
class _Handle:
    """What ``activate_flash_attention_impl`` keeps alive; ``remove`` gives the original kernels back."""
    library: Optional[torch.library.Library]

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


class _NoKernel:
    """Stands for an op's original kernel where the dispatch key has none (the CPU key in tests)."""
    def __init__(self, op, dispatch_key):
        self.what = f"aten::{op} has no {dispatch_key} kernel of its own"

    def call_boxed(self, *args, **kwargs):
        raise NotImplementedError(f"SageBwd cannot take this call and {self.what} to hand it to")


def _original_kernel(op, dispatch_key):
    try:
        return torch.library.get_kernel(f"aten::{op}", dispatch_key)
    except RuntimeError:
        return _NoKernel(op, dispatch_key)


def _laid_out_like(x, ref):
    """``x`` in ``torch.empty_like(ref)``'s strides, what the ops' meta functions promise (torch.compile plans the
    ops that follow from them); a copy only where the kernels' layout differs (unusual caller strides)."""
    strides = torch.empty_like(ref, device="meta").stride()
    if x.stride() == strides:
        return x
    return torch.empty_like(ref, dtype=x.dtype).copy_(x)


def _rng_outputs(query):
    """The rng state and debug mask a flash forward returns; no dropout, so nothing in them is read."""
    return (torch.zeros((2,), dtype=torch.uint64, device=query.device),
            torch.zeros((), dtype=torch.uint64, device=query.device),
            torch.empty(0, dtype=query.dtype, device=query.device))


def _packing_error(cum_seq_q, cum_seq_k, seqused_k=None, alibi_slopes=None, block_table=None):
    """What FlashAttention's op may carry beside SDPA's arguments that the kernels do not compute."""
    if (cum_seq_q is None) != (cum_seq_k is None):
        return "cu_seqlens"
    if cum_seq_q is not None and (cum_seq_q.dtype != torch.int32 or cum_seq_k.dtype != torch.int32):
        return "cu_seqlens"
    if seqused_k is not None:
        return "seqused_k"
    if alibi_slopes is not None:
        return "alibi"
    if block_table is not None:
        return "paged_kv"
    return None


def _register_kernels(dispatch_key: str = "CUDA") -> _Handle:
    """Override the flash ops' kernels for ``dispatch_key`` (CUDA; the CPU tests take the CPU key, where the ops
    have no kernel of their own, to run the same path through the dispatcher)."""
    if not registry_available():
        raise RuntimeError(_missing_registry())
    original = {op: _original_kernel(op, dispatch_key) for op in (FORWARD_OP, BACKWARD_OP, FA_FORWARD_OP,
                                                                  FA_BACKWARD_OP)}

    def fall_back(op, reason, keyset, args, kwargs):
        if reason is not None:
            _fallbacks[reason] += 1
        return original[op].call_boxed(keyset, *args, **kwargs)

    def sdpa_forward(keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                     **kwargs):
        reason = support_error(query, key, value, dropout_p, is_causal, return_debug_mask)
        if reason is not None:
            return fall_back(FORWARD_OP, reason, keyset, (query, key, value, dropout_p, is_causal,
                                                          return_debug_mask), kwargs)
        _calls["forward"] += 1
        out, lse = forward(query, key, value, is_causal, kwargs.get("scale"))
        out = _laid_out_like(out, query)
        rng_state, unused, debug_mask = _rng_outputs(query)
        return out, lse, None, None, query.shape[2], key.shape[2], rng_state, unused, debug_mask

    def sdpa_backward(keyset, *args, **kwargs):
        grad_out, query, key, value, out, logsumexp, _, _, _, _, dropout_p, is_causal = args[:12]
        # the forward's decision, from the same arguments: a call it left to the original kernel comes back here
        # with that kernel's lse and rng state, which only the original backward reads
        if support_error(query, key, value, dropout_p, is_causal) is not None or logsumexp.dtype != torch.float32:
            return fall_back(BACKWARD_OP, None, keyset, args, kwargs)
        _calls["backward"] += 1
        grads = backward(grad_out, query, key, value, out, logsumexp, is_causal, kwargs.get("scale"))
        return tuple(_laid_out_like(g, x) for g, x in zip(grads, (query, key, value)))

    def fa_forward(keyset, *args, **kwargs):
        query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask = args[:10]
        packed = cum_seq_q is not None
        q, k, v = (query, key, value) if packed else (x.transpose(1, 2) for x in (query, key, value))
        reason = (support_error(q, k, v, dropout_p, is_causal, return_debug_mask, packed=packed, bottom_right=True)
                  or _packing_error(cum_seq_q, cum_seq_k, kwargs.get("seqused_k"), kwargs.get("alibi_slopes"),
                                    kwargs.get("block_table")))
        if reason is not None:
            return fall_back(FA_FORWARD_OP, reason, keyset, args, kwargs)
        _calls["forward"] += 1
        window = (kwargs.get("window_size_left"), kwargs.get("window_size_right"))
        packing = Packing(cum_seq_q, cum_seq_k, int(max_q), int(max_k)) if packed else None
        out, lse = forward(q, k, v, is_causal, kwargs.get("scale"), window, packing)
        if packed:
            lse = lse[0]                                          # [H, T], FlashAttention's packed lse
        else:
            out = out.transpose(1, 2)                             # [B, N, H, D]
        _remember(lse)
        return (_laid_out_like(out, query), lse, *_rng_outputs(query))

    def fa_backward(keyset, *args, **kwargs):
        grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal = \
            args[:12]
        packed = cum_seq_q is not None
        tensors = (grad_out, query, key, value, out) if packed else tuple(x.transpose(1, 2) for x in
                                                                          (grad_out, query, key, value, out))
        if (support_error(*tensors[1:4], dropout_p, is_causal, packed=packed, bottom_right=True) is not None
                or _packing_error(cum_seq_q, cum_seq_k) is not None or logsumexp.dtype != torch.float32):
            return fall_back(FA_BACKWARD_OP, None, keyset, args, kwargs)
        _calls["backward"] += 1
        window = (kwargs.get("window_size_left"), kwargs.get("window_size_right"))
        packing = Packing(cum_seq_q, cum_seq_k, int(max_q), int(max_k)) if packed else None
        grads = backward(*tensors, logsumexp.unsqueeze(0) if packed else logsumexp, is_causal, kwargs.get("scale"),
                         window, packing, merged=not _is_own(logsumexp))
        grads = grads if packed else tuple(g.transpose(1, 2) for g in grads)
        return tuple(_laid_out_like(g, x) for g, x in zip(grads, (query, key, value)))

    library = torch.library.Library("aten", "IMPL")
    for op, impl in ((FORWARD_OP, sdpa_forward), (BACKWARD_OP, sdpa_backward), (FA_FORWARD_OP, fa_forward),
                     (FA_BACKWARD_OP, fa_backward)):
        library.impl(op, impl, dispatch_key, with_keyset=True)
    return _Handle(library)


def register() -> bool:
    """Make ``"SageBwd"`` known to ``torch.nn.attention.activate_flash_attention_impl`` (not active). Returns
    False where this torch has no registry."""
    if not registry_available():
        return False
    from torch.nn.attention import register_flash_attention_impl
    register_flash_attention_impl(IMPL_NAME, register_fn=_register_kernels)
    return True
