"""SageBwd behind PyTorch's SDPA flash backend: ``torch.nn.attention.activate_flash_attention_impl("SageBwd")``.

``import sagebwd_hf`` registers the implementation ``"SageBwd"`` with PyTorch's flash-attention registry (torch's
``register_flash_attention_impl``, the way it plugs in FA3 and FA4); nothing changes until a user activates it.
Once active, the CUDA kernels of ``aten::_scaled_dot_product_flash_attention`` and its backward are ours: every
``F.scaled_dot_product_attention`` call that picks the flash backend, and PyTorch's ring attention under
``context_parallel``, runs SageBwd's INT8 forward and backward.

Contract, the op's own semantics: ``scale`` (default ``head_dim ** -0.5``), GQA (fewer key/value heads), the
returned tensors' shapes and dtypes; the forward returns the natural-log log-sum-exp of the caller's scores
(K-smoothing's shift taken out), and the backward takes the ``out`` and ``logsumexp`` it is given (ring attention
passes merged ones) and recomputes by the same rule. Calls the kernels cannot take exactly go to the original
kernel (``support_error`` says which and why; ``stats()`` counts them): dropout, a debug mask, a causal call
whose query and key lengths differ (the flash kernel's bottom-right alignment is not SDPA's documented top-left
one), dtypes other than fp16/bf16, head dims the kernels do not take, empty tensors.
"""
import collections
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from . import interface, naive, sinks as sink_math

IMPL_NAME = "SageBwd"
FORWARD_OP = "_scaled_dot_product_flash_attention"
BACKWARD_OP = "_scaled_dot_product_flash_attention_backward"

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

def support_error(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False) -> Optional[str]:
    """Why SageBwd cannot compute this flash call exactly (a short reason, counted in ``stats()``), or None."""
    tensors = (query, key, value)
    if any(t.dim() != 4 for t in tensors):
        return "rank"
    if dropout_p != 0.0:
        return "dropout"
    if return_debug_mask:
        return "debug_mask"
    if query.dtype not in interface.SUPPORTED_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return "dtype"
    if len({t.device for t in tensors}) != 1:
        return "device"
    batch, heads, len_q, head_dim = query.shape
    if key.shape[:3] != value.shape[:3] or key.shape[0] != batch or key.shape[3] != head_dim:
        return "shape"
    if key.shape[1] == 0 or heads % key.shape[1]:
        return "heads"
    if any(d % 8 or not 8 <= d <= interface.MAX_HEAD_DIM for d in (head_dim, value.shape[3])):
        return "head_dim"
    if min(batch, heads, len_q, key.shape[2]) == 0:
        return "empty"
    if is_causal and len_q != key.shape[2]:
        return "causal_non_square"
    return None


def _scale(query, scale):
    return float(scale) if scale is not None else query.shape[-1] ** -0.5


def _window(is_causal):
    return (-1, 0) if is_causal else (-1, -1)


def _backend(query):
    return "triton" if interface._use_triton(query) else "naive"


def _smoothing_rows(query, key, scale):
    """K-smoothing's per-row score shift (natural log, ``[B, H, Lq]``): what the kernels' lse lacks."""
    return interface._torch_shift(query, key, None, None, scale).rows


def natural_lse(lse2, query, key, scale):
    """The kernels' base-2, smoothed lse (+inf for rows that see no key) -> SDPA's natural-log lse of the
    caller's scores (-inf for such rows)."""
    return naive.lse_to_natural(lse2) + _smoothing_rows(query, key, scale)


def kernel_lse(logsumexp, query, key, scale):
    """The inverse of ``natural_lse``, for a backward handed SDPA's (possibly ring-merged) lse."""
    lse = logsumexp.float() - _smoothing_rows(query, key, scale)
    return torch.where(torch.isinf(logsumexp), torch.full_like(lse, float("inf")), lse * naive.LOG2E)


# The lse tensors this module's forward returned (id -> weak reference). A backward handed one of them runs on
# the whole row's keys; any other lse was merged from several calls (ring attention), see ``backward``.
_own_lse = {}


def _remember(lse):
    _own_lse[id(lse)] = weakref.ref(lse, lambda _, key=id(lse): _own_lse.pop(key, None))


def _is_own(lse) -> bool:
    ref = _own_lse.get(id(lse))
    return ref is not None and ref() is lse


def forward(query, key, value, is_causal=False, scale=None):
    """SageBwd's forward in SDPA's terms: ``(out [B, H, Lq, Dv], logsumexp [B, H, Lq] fp32, natural log)``."""
    scale = _scale(query, scale)
    out, lse2 = interface._forward(query, key, value, None, None, query.shape[2], key.shape[2], scale,
                                   _window(is_causal), True, False, _backend(query))
    lse = natural_lse(lse2, query, key, scale)
    _remember(lse)
    return out, lse


def backward(grad_out, query, key, value, out, logsumexp, is_causal=False, scale=None):
    """SageBwd's backward from SDPA's saved tensors: ``(dq, dk, dv)``.

    K-smoothing scores ``k - mean(k)``, which leaves ``rowsum(dS) * mean(k)`` out of dQ; over a row's keys dS sums
    to zero, so the kernels skip it. Ring attention calls this backward once per shard of keys with the merged
    ``out`` and ``logsumexp``, and over one shard dS does not sum to zero: for an lse this module's forward did
    not return, the shard's forward is recomputed for its exact row sums,
    ``rowsum(dS_i) = exp(lse_shard_i - lse_i) * (dO_i . out_shard_i - dO_i . out_i)``, and the term is added."""
    scale = _scale(query, scale)
    dq, dk, dv, _ = interface._backward(grad_out, query, key, value, out, kernel_lse(logsumexp, query, key, scale),
                                        None, None, query.shape[2], key.shape[2], scale, _window(is_causal), True,
                                        False, _backend(query))
    if not _is_own(logsumexp):
        _calls["backward_row_term"] += 1
        out_shard, lse_shard = forward(query, key, value, is_causal, scale)
        dout = grad_out.float()
        row_ds = torch.exp(lse_shard - logsumexp.float()) * ((dout * out_shard.float()).sum(-1)
                                                             - (dout * out.float()).sum(-1))
        row_ds = torch.where(torch.isinf(lse_shard), torch.zeros_like(row_ds), row_ds)   # a shard a row sees none of
        dq_f32 = dq.float()
        sink_math.add_row_ds_term(dq_f32, row_ds, sink_math.key_means(query, key, None, None), False, scale)
        dq = dq.copy_(dq_f32)
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


def _register_kernels(dispatch_key: str = "CUDA") -> _Handle:
    """Override the flash ops' kernels for ``dispatch_key`` (CUDA; the CPU tests take the CPU key, where the ops
    have no kernel of their own, to run the same path through the dispatcher)."""
    if not registry_available():
        raise RuntimeError(_missing_registry())
    original_forward = _original_kernel(FORWARD_OP, dispatch_key)
    original_backward = _original_kernel(BACKWARD_OP, dispatch_key)

    def forward_impl(keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                     scale=None):
        reason = support_error(query, key, value, dropout_p, is_causal, return_debug_mask)
        if reason is not None:
            _fallbacks[reason] += 1
            return original_forward.call_boxed(keyset, query, key, value, dropout_p, is_causal, return_debug_mask,
                                               scale=scale)
        _calls["forward"] += 1
        out, lse = forward(query, key, value, is_causal, scale)
        rng_state = torch.zeros((2,), dtype=torch.uint64, device=query.device)
        unused = torch.zeros((), dtype=torch.uint64, device=query.device)
        debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
        return out, lse, None, None, query.shape[2], key.shape[2], rng_state, unused, debug_mask

    def backward_impl(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                      dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        # the forward's decision, from the same arguments: a call it left to the original kernel comes back here
        # with that kernel's lse and rng state, which only the original backward reads
        if support_error(query, key, value, dropout_p, is_causal) is not None or logsumexp.dtype != torch.float32:
            return original_backward.call_boxed(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q,
                                                cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                                                philox_offset, scale=scale)
        _calls["backward"] += 1
        return backward(grad_out, query, key, value, out, logsumexp, is_causal, scale)

    library = torch.library.Library("aten", "IMPL")
    library.impl(FORWARD_OP, forward_impl, dispatch_key, with_keyset=True)
    library.impl(BACKWARD_OP, backward_impl, dispatch_key, with_keyset=True)
    return _Handle(library)


def register() -> bool:
    """Make ``"SageBwd"`` known to ``torch.nn.attention.activate_flash_attention_impl`` (not active). Returns
    False where this torch has no registry."""
    if not registry_available():
        return False
    from torch.nn.attention import register_flash_attention_impl
    register_flash_attention_impl(IMPL_NAME, register_fn=_register_kernels)
    return True
