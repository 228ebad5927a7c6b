"""Padded batches whose rows hold padding or several packed sequences, run as varlen.

Transformers hands a backend ``[B, N, H, D]`` tensors plus a 2D padding mask or per-token sequence ids.
As FlashAttention does, the real tokens are gathered into one packed run, cut by ``cu_seqlens``, and the
results scattered back. Finding ``cu_seqlens`` reads the mask on the host and the gathered length depends
on the data, which torch.compile cannot trace with static shapes. So the whole gather -> varlen -> scatter
sits inside one custom op pair (``sagebwd::segmented_fwd/bwd``): its outputs have the shapes of its inputs,
the compiler sees an opaque call, and eager and compiled models run the same numbers. Eager calls keep the
packed copies for the backward instead of the padded inputs (``SageBwdSegmentedAttention``).
"""
import weakref
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from .interface import OP_TAGS, _backend, _backward, _backward_with, _check_options, _check_precision, _forward

# Values derived from a mask or sequence-id tensor that every layer of one forward gets again: one host
# read per forward instead of one per layer (and per backward). A few tensors per name: models whose layers
# alternate between masks (sliding-window and full layers each get their own) would evict each other.
_memo = {}     # name -> [(weakref to the tensor, its version, value)], most recent first
_SLOTS = 4


def per_tensor(name, tensor, fn):
    """``fn(tensor)``, cached while ``tensor`` is alive and unmodified."""
    if torch.compiler.is_compiling() or tensor.is_inference():   # inference tensors have no version counter
        return fn(tensor)
    slots = _memo.setdefault(name, [])
    for ref, version, value in slots:
        if ref() is tensor and version == tensor._version:
            return value
    value = fn(tensor)
    slots.insert(0, (weakref.ref(tensor), tensor._version, value))
    del slots[_SLOTS:]
    return value


class Plan(NamedTuple):
    """Where the packed run's tokens sit in the flattened ``[B * N]`` tensors (None: all of them, in
    order; ``cu_q`` None: no row needs cutting, run the padded batch as it is)."""
    idx_q: Optional[torch.Tensor]
    idx_k: Optional[torch.Tensor]
    cu_q: Optional[torch.Tensor]
    cu_k: Optional[torch.Tensor]
    max_q: int
    max_k: int


def query_rows(mask, q_len, causal):
    """Which queries are real tokens ``[B, q_len]``. The queries are the ``q_len`` tokens that end at the row's
    last real key (flash's _upad_input takes the mask's last ``q_len`` entries, the same for left padding;
    this also covers a static cache's unwritten tail); all of them for one-token decode or cross-attention."""
    if q_len == mask.shape[1]:
        return mask
    if q_len == 1 or not causal or q_len > mask.shape[1]:
        return torch.ones(mask.shape[0], q_len, dtype=torch.bool, device=mask.device)
    return torch.where(mask[:, -1:], mask[:, -q_len:], mask.any(1, keepdim=True))


def _unpad(mask):
    lengths = mask.sum(1, dtype=torch.int32)
    cu = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    return torch.nonzero(mask.flatten()).flatten(), cu, int(lengths.max())


def _padding_plan(mask, q_len, kv_len, causal):
    # keys past the mask's end (a static cache's unwritten slots) are not real
    keys = F.pad(mask, (0, kv_len - mask.shape[1]), value=False) if mask.shape[1] < kv_len else mask
    idx_k, cu_k, max_k = per_tensor(f"unpad:{kv_len}", mask, lambda m: _unpad(keys))
    if q_len == kv_len and keys is mask:
        return Plan(idx_k, idx_k, cu_k, cu_k, max_k, max_k)
    idx_q, cu_q, max_q = per_tensor(f"unpad_q:{q_len}:{causal}", mask,
                                    lambda m: _unpad(query_rows(m, q_len, causal)))
    return Plan(idx_q, idx_k, cu_q, cu_k, max_q, max_k)


def _packed_plan(ids):
    """Sequence ids ``[B, N]`` (a new sequence wherever the id changes, and at every row start)."""
    starts = F.pad(ids[:, 1:] != ids[:, :-1], (1, 0), value=True).flatten()
    # (two host reads: the starts' count comes with nonzero's output shape, which reads it anyway)
    cu = F.pad(torch.nonzero(starts).flatten(), (0, 1), value=starts.numel()).to(torch.int32)
    if cu.numel() - 1 == ids.shape[0]:          # one sequence per row: the padded batch as it is
        return Plan(None, None, None, None, ids.shape[1], ids.shape[1])
    longest = int((cu[1:] - cu[:-1]).max())
    return Plan(None, None, cu, cu, longest, longest)


def _plan(q, k, mask, ids, causal) -> Plan:
    if mask is not None:
        return _padding_plan(mask, q.shape[1], k.shape[1], causal)
    return per_tensor("packed", ids, _packed_plan)


def _gather(x, idx):
    # index_select, not ``flat[idx]``: the same copy without advanced indexing's Python and TensorIterator setup,
    # host time on every gather (eight a forward + backward)
    flat = x.reshape(-1, x.shape[-2], x.shape[-1])
    return flat if idx is None else flat.index_select(0, idx)


def _scatter(packed, idx, shape):
    """The packed rows back in a padded ``shape`` ``[B, N, H, D]``, zeros where no row goes."""
    if idx is None:
        return packed.view(shape)
    full = packed.new_zeros(shape[0] * shape[1], *shape[-2:])
    return full.index_copy_(0, idx, packed).view(shape)


def _out_shape(q, v):
    return (*q.shape[:-1], v.shape[-1])      # V's head dim (MLA: not Q's)


def _to_tokens(lse):
    """Padded lse ``[B, H, N]`` -> the token-major ``[1, H, B * N]`` this op returns."""
    return lse.transpose(0, 1).reshape(1, lse.shape[1], -1)


def _segmented_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                        ids: Optional[torch.Tensor], causal: bool, scale: float, window_left: int, window_right: int,
                        k_smoothing: bool, q_smoothing: bool, backend: str, softcap: float, precision: str,
                        sinks: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """q ``[B, Nq, H, D]``, k/v ``[B, Nk, Hkv, D]`` (any strides; v's head dim may differ). Returns out
    ``[B, Nq, H, Dv]`` (zeros for padding queries) and the kernels' base-2 lse ``[1, H, B * Nq]``."""
    return _planned_forward(_plan(q, k, mask, ids, causal), q, k, v, scale, (window_left, window_right), k_smoothing,
                            q_smoothing, backend, softcap, sinks, precision)


def _planned_forward(plan, q, k, v, scale, window, k_smoothing, q_smoothing, backend, softcap, sinks, precision):
    """``_segmented_fwd_impl`` for a plan already made."""
    if plan.cu_q is None:
        out, lse = _forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, plan.max_q,
                            plan.max_k, scale, window, k_smoothing, q_smoothing, backend, softcap, sinks,
                            precision)
        return out.transpose(1, 2).contiguous(), _to_tokens(lse)
    _, _, _, out, lse_packed = _packed_forward(q, k, v, plan, scale, window, k_smoothing, q_smoothing, backend,
                                               softcap, sinks, precision)
    return _unpacked(out, lse_packed, plan, q, v)


def _packed_forward(q, k, v, plan, scale, window, k_smoothing, q_smoothing, backend, softcap, sinks, precision):
    """The packed run of a plan that cuts rows: ``(q, k, v, out, lse)`` packed, the inputs as gathered."""
    q_packed, k_packed, v_packed = _gather(q, plan.idx_q), _gather(k, plan.idx_k), _gather(v, plan.idx_k)
    out, lse = _forward(q_packed, k_packed, v_packed, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale, window,
                        k_smoothing, q_smoothing, backend, softcap, sinks, precision)
    return q_packed, k_packed, v_packed, out, lse


def _unpacked(out, lse_packed, plan, q, v):
    """The packed run's out and lse in the op's outputs: ``[B, Nq, H, Dv]`` and ``[1, H, B * Nq]``."""
    if plan.idx_q is None:
        return out.view(_out_shape(q, v)), lse_packed
    lse = lse_packed.new_full((1, q.shape[2], q.shape[0] * q.shape[1]), float("inf")).index_copy_(
        2, plan.idx_q, lse_packed)
    return _scatter(out, plan.idx_q, _out_shape(q, v)), lse


_segmented_fwd = torch.library.custom_op("sagebwd::segmented_fwd", _segmented_fwd_impl, mutates_args=(),
                                         tags=OP_TAGS)


@_segmented_fwd.register_fake
def _(q, k, v, mask, ids, causal, scale, window_left, window_right, k_smoothing, q_smoothing, backend, softcap,
      precision, sinks):
    return q.new_empty(_out_shape(q, v)), q.new_empty((1, q.shape[2], q.shape[0] * q.shape[1]), dtype=torch.float32)


def _segmented_bwd_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, mask: Optional[torch.Tensor], ids: Optional[torch.Tensor], causal: bool,
                        scale: float, window_left: int, window_right: int, k_smoothing: bool, q_smoothing: bool,
                        backend: str, softcap: float, precision: str, sinks: Optional[torch.Tensor]
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dsinks = _segmented_grads(dout, q, k, v, out, lse, mask, ids, causal, scale, window_left,
                                          window_right, k_smoothing, q_smoothing, backend, softcap, precision, sinks)
    return dq, dk, dv, _sinks_grad(dsinks, q)


def _segmented_grads(dout, q, k, v, out, lse, mask, ids, causal, scale, window_left, window_right, k_smoothing,
                     q_smoothing, backend, softcap, precision, sinks):
    """_segmented_bwd_impl's gradients, the sinks' None without sinks: the eager backward's, which spares it the
    custom op's stand-in (an allocation a backward)."""
    plan = _plan(q, k, mask, ids, causal)
    window = (window_left, window_right)
    if plan.cu_q is None:
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        lse_bhn = lse.view(q.shape[2], q.shape[0], q.shape[1]).transpose(0, 1).contiguous()
        dq, dk, dv, dsinks = _backward(t(dout), t(q), t(k), t(v), t(out), lse_bhn, None, None, plan.max_q,
                                       plan.max_k, scale, window, k_smoothing, q_smoothing, backend, softcap, sinks,
                                       precision=precision)
        return tuple(t(g).contiguous() for g in (dq, dk, dv)) + (dsinks,)
    lse_packed = lse if plan.idx_q is None else lse.index_select(2, plan.idx_q)
    return _packed_backward(dout, _gather(q, plan.idx_q), _gather(k, plan.idx_k), _gather(v, plan.idx_k), out,
                            lse_packed, plan, (q.shape, k.shape, v.shape), scale, window, k_smoothing, q_smoothing,
                            backend, softcap, sinks, precision)


def _packed_backward(dout, q_packed, k_packed, v_packed, out, lse_packed, plan, shapes, scale, window, k_smoothing,
                     q_smoothing, backend, softcap, sinks, precision):
    """Gradients of a packed run (``_packed_forward``'s q, k, v and lse; ``dout`` and ``out`` padded), scattered
    into the inputs' ``shapes``, and the sinks' (None without sinks)."""
    dq, dk, dv, dsinks = _backward(_gather(dout, plan.idx_q), q_packed, k_packed, v_packed, _gather(out, plan.idx_q),
                                   lse_packed, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale, window,
                                   k_smoothing, q_smoothing, backend, softcap, sinks, precision=precision)
    q_shape, k_shape, v_shape = shapes
    return (_scatter(dq, plan.idx_q, q_shape), _scatter(dk, plan.idx_k, k_shape), _scatter(dv, plan.idx_k, v_shape),
            dsinks)


_segmented_bwd = torch.library.custom_op("sagebwd::segmented_bwd", _segmented_bwd_impl, mutates_args=(),
                                         tags=OP_TAGS)


def _sinks_grad(dsinks, q):
    return q.new_empty(0, dtype=torch.float32) if dsinks is None else dsinks   # a custom op cannot return None


@_segmented_bwd.register_fake
def _(dout, q, k, v, out, lse, mask, ids, causal, scale, window_left, window_right, k_smoothing, q_smoothing,
      backend, softcap, precision, sinks):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            _sinks_grad(None if sinks is None else sinks.new_empty(sinks.shape), q))


def _setup_context(ctx, inputs, output):
    q, k, v, mask, ids, *args, sinks = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], mask, ids, sinks)
    ctx.args = args
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)    # no zero-filled gradient for lse every backward (interface._setup_context)


NUM_INPUTS = 15
_segmented_fwd.register_autograd(_backward_with(_segmented_bwd, NUM_INPUTS), setup_context=_setup_context)
_op_backward = _backward_with(_segmented_grads, NUM_INPUTS)


class SageBwdSegmentedAttention(torch.autograd.Function):
    """Eager calls (no torch.library dispatch, as interface.autograd_op's). A call that cuts rows keeps the packed
    q, k, v and lse its forward gathered for the backward instead of the padded inputs: the padding is not held
    until the backward (FlashAttention's varlen path holds packed tensors too), and the backward gathers only dO
    and out. Under torch.compile the op pair runs instead, whose saved tensors keep the inputs' static shapes."""

    @staticmethod
    def forward(ctx, q, k, v, mask, ids, causal, scale, window_left, window_right, k_smoothing, q_smoothing, backend,
                softcap, precision, sinks):
        args = (causal, scale, window_left, window_right, k_smoothing, q_smoothing, backend, softcap, precision)
        plan = _plan(q, k, mask, ids, causal)
        if plan.cu_q is None or plan.idx_q is None:    # no padding to leave out: saved as the op saves them
            output = _planned_forward(plan, q, k, v, scale, (window_left, window_right), k_smoothing, q_smoothing,
                                      backend, softcap, sinks, precision)
            _setup_context(ctx, (q, k, v, mask, ids, *args, sinks), output)
            ctx.packing = None
            return output
        q_packed, k_packed, v_packed, out_packed, lse_packed = _packed_forward(
            q, k, v, plan, scale, (window_left, window_right), k_smoothing, q_smoothing, backend, softcap, sinks,
            precision)
        out, lse = _unpacked(out_packed, lse_packed, plan, q, v)
        ctx.save_for_backward(q_packed, k_packed, v_packed, out, lse_packed, sinks)
        ctx.packing = (plan, (q.shape, k.shape, v.shape))
        ctx.args = args
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if ctx.packing is None:
            return _op_backward(ctx, dout, dlse)
        if dout is None:
            return (None,) * NUM_INPUTS
        q_packed, k_packed, v_packed, out, lse_packed, sinks = ctx.saved_tensors
        plan, shapes = ctx.packing
        _, scale, window_left, window_right, k_smoothing, q_smoothing, backend, softcap, precision = ctx.args
        dq, dk, dv, dsinks = _packed_backward(dout, q_packed, k_packed, v_packed, out, lse_packed, plan, shapes, scale,
                                              (window_left, window_right), k_smoothing, q_smoothing, backend,
                                              softcap, sinks, precision)
        return (dq, dk, dv) + (None,) * (NUM_INPUTS - 4) + (dsinks if sinks is not None else None,)


def _segmented(*inputs):
    return _segmented_fwd(*inputs) if torch.compiler.is_compiling() else SageBwdSegmentedAttention.apply(*inputs)


def segmented_attention(q, k, v, mask=None, ids=None, *, causal, softmax_scale, window_size=(-1, -1),
                        k_smoothing=True, q_smoothing=False, softcap=0.0, sinks=None, precision="accurate"):
    """Attention over ``[B, N, H, D]`` rows cut by a padding ``mask`` ``[B, Nk]`` (bool, True = real token)
    or by sequence ``ids`` ``[B, N]`` (self-attention; a new sequence wherever the id changes). Padding
    queries get zeros. Inputs must already be float16/bfloat16; validation is the caller's but for ``precision``
    (sagebwd_attn_func's argument), checked here."""
    if (mask is None) == (ids is None):
        raise ValueError("segmented_attention needs exactly one of mask and ids")
    window, scale = _check_options(window_size, softmax_scale, q.shape[-1], causal)   # causal: right = 0
    backend = _backend(q, None)
    return _segmented(q, k, v, mask, ids, bool(causal), scale, *window, bool(k_smoothing), bool(q_smoothing),
                      backend, float(softcap), _check_precision(precision, backend), sinks)[0]
