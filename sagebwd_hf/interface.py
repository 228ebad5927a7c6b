"""SageBwd attention: the functional API and the op under it.

``sagebwd_attn_func`` (padded ``[B, H, N, D]``, the layout Transformers hands a backend) and
``sagebwd_attn_varlen_func`` (packed ``[total_tokens, H, D]`` with ``cu_seqlens``) check their arguments
(a ValueError or TypeError naming the bad one) and call one differentiable op, registered as torch custom ops
(``sagebwd::attn_fwd`` / ``attn_bwd``) so that torch.compile traces it without a graph break. CUDA tensors run
the kernels in ``sagebwd_hf.kernels`` (Hopper's Gluon kernels or the portable Triton ones, as
``kernels/dispatch.py`` picks); CPU tensors run the same quantized algorithm in plain PyTorch
(``sagebwd_hf.naive``), or the Triton kernels under Triton's interpreter when ``TRITON_INTERPRET=1``. Either way
a call computes the rule ``backward_rule`` names for its device, with the tiles ``tile_configs`` gives. Inputs
are never modified; outputs and gradients follow the inputs' layout.
"""
import os
import sys
import warnings
import weakref
from typing import NamedTuple, Optional, Tuple

import torch

from . import naive, numerics as numerics_rules, sinks as sink_math
from .kernels import attention as kernel_entry, dispatch, plan as kernel_plan
from .kernels.attention import poisoned as _poisoned
from .kernels.layout import SeqLayout, as_bhnd
# the tiles and the backward's rule are the plan's (kernels/plan.py); named here too, for the PyTorch path
from .kernels.plan import BackwardRule, backward_rule, dkdv_block_m, tile_configs  # noqa: F401

_PACKAGE = __name__.split(".")[0] + "."
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
_warned = set()


def _warn_once(key: str, message: str):
    """Warn once per process, pointing at the caller's line that called into this package."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=_first_frame_outside_package())


def _first_frame_outside_package() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the calling function name the nearest frame whose code
    is not this package's (the user's call of the op, or the model's attention call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------------

def _new_like(x: torch.Tensor, varlen: bool, head_dim: Optional[int] = None) -> torch.Tensor:
    """The layout of outputs and gradients: packed ``[T, H, D]`` contiguous; padded ``[B, H, N, D]`` in the
    caller's order of heads and tokens: head-major when ``x``'s heads are outer to its tokens (a user's
    ``torch.randn(B, H, N, D)``), else token-major, laid out as ``[B, N, H, D]`` (Transformers' q/k/v: its
    ``transpose(1, 2)`` is then free). A gradient in its leaf's own layout spares autograd a copy into it
    (3 x 128 MB per backward at B*N = 32K, H*D = 2048). The rule reads only the order of two strides, which
    torch.compile keeps for a custom op's inputs, so the fake implementation and the real one agree.
    ``head_dim``: the last dim, if not ``x``'s (the output has V's head dim, which MLA sets apart from Q's)."""
    shape = x.shape if head_dim is None else (*x.shape[:-1], head_dim)
    if varlen:
        return x.new_empty(shape)
    b, h, n, d = shape
    if h > 1 and n > 1 and x.stride(1) > x.stride(2):
        return x.new_empty(shape)
    return x.new_empty(b, n, h, d).transpose(1, 2)


class Shift(NamedTuple):
    """K-smoothing's per-row score shift ``scale * q_i . mean(k)`` (natural log, the lse's layout), and the mean
    itself per query row (``[B, H, 1, D]`` or packed ``[1, H, T, D]``), for what soft-capping and sinks add back."""
    rows: torch.Tensor
    k_mean: Optional[torch.Tensor]


def _torch_shift(q, k, cu_q, cu_k, scale) -> Shift:
    """The PyTorch path's (the Triton path gets the shift from Q's quantization pass)."""
    k_mean = sink_math.key_means(q, k, cu_q, cu_k)
    return Shift(sink_math.smoothing_shift(q, k_mean, cu_q is not None, scale), k_mean)


def _kernel_call(q, k, cu_q, cu_k, max_q, max_k, scale, window, k_smoothing, q_smoothing, softcap, need_shift):
    """What the call asks of the kernels (kernels/attention.Call)."""
    varlen = cu_q is not None
    lay_q = SeqLayout(cu_q.numel() - 1, max_q, cu_q) if varlen else SeqLayout(q.shape[0], q.shape[2], None)
    lay_k = SeqLayout(cu_k.numel() - 1, max_k, cu_k) if varlen else SeqLayout(k.shape[0], k.shape[2], None)
    return kernel_entry.Call(lay_q, lay_k, scale, tuple(window), bool(k_smoothing), bool(q_smoothing), softcap,
                             bool(need_shift))


def _forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, window, k_smoothing, q_smoothing, backend,
             softcap=0.0, sinks=None, precision="accurate", *, with_row_max=False):
    """q/k/v padded ``[B, H, N, D]`` or packed ``[T, H, D]`` (then cu_* given). Returns (out, lse2), and with
    ``with_row_max`` a third tensor: each row's largest score (lse2's layout) where the kernels' backward of the
    precision's rule needs it (ds_bound on the Gluon kernels), else an empty one. ``precision``: a checked preset
    or rule string (sagebwd_hf.numerics)."""
    need_shift = k_smoothing and (bool(softcap) or sinks is not None)
    out, lse, shift, row_max = _forward_kernels(q, k, v, cu_q, cu_k, max_q, max_k, scale, window, k_smoothing,
                                                q_smoothing, backend, softcap, need_shift, sinks, precision,
                                                with_row_max)
    if sinks is not None and backend == "naive":   # the Triton and Gluon kernels add them in their epilogue
        _, lse = sink_math.add_sinks(as_bhnd(out, cu_q is not None), lse, sinks, _sink_shift(shift, softcap))
    if with_row_max:
        return out, lse, row_max if row_max is not None else _no_row_max(q)
    return out, lse


def _no_row_max(q):
    """The op's third output where no kernel keeps the row maxima (a custom op cannot return None)."""
    return q.new_empty(0, dtype=torch.float32)


def _sink_shift(shift: Optional[Shift], softcap):
    """Where the sinks sit in the kernels' frame: K-smoothing's row shift (natural units) below the caller's, or
    None when the scores are the caller's (no smoothing; capped scores, which had the shift added back)."""
    return None if shift is None or softcap else shift.rows


def _forward_kernels(q, k, v, cu_q, cu_k, max_q, max_k, scale, window, k_smoothing, q_smoothing, backend,
                     softcap, need_shift, sinks=None, precision="accurate", with_row_max=False):
    """(out, lse2, Shift or None, row maxima or None). The Triton and Gluon kernels fold ``sinks`` into out and
    lse2; the PyTorch path leaves them to the caller. The row maxima: with ``with_row_max``, where the Gluon
    forward runs a ds_bound rule (its backward's max P = exp2(row_max - lse2))."""
    varlen = cu_q is not None
    cfg = tile_configs(q.shape[-1], q.device, v.shape[-1])
    out = _new_like(q, varlen, v.shape[-1])
    rules = numerics_rules.parse_precision(precision)
    if backend == "naive":
        dispatch.count("fwd_naive")
        out_naive, lse = _per_sequence(
            lambda qs, ks, vs: naive.sagebwd_forward_naive(qs, ks, vs, scale, window, k_smoothing,
                                                           q_smoothing, block_n=cfg["fwd"][1], softcap=softcap,
                                                           numerics=rules)
            if qs.shape[2] and ks.shape[2] else   # an empty sequence: zeros, lse +inf (no key seen)
            (qs.new_zeros(*qs.shape[:3], vs.shape[3]), torch.full(qs.shape[:3], float("inf"), device=qs.device)),
            q, k, v, cu_q, cu_k)
        return out.copy_(out_naive), lse, _torch_shift(q, k, cu_q, cu_k, scale) if need_shift else None, None
    q4, k4, v4 = as_bhnd(q, varlen), as_bhnd(k, varlen), as_bhnd(v, varlen)
    call = _kernel_call(q, k, cu_q, cu_k, max_q, max_k, scale, window, k_smoothing, q_smoothing, softcap, need_shift)
    empty = q4.numel() == 0 or k4.numel() == 0
    mean_len_q = q4.shape[2] // max(call.layout_q.num_seqs, 1) if varlen else None   # (padded: every row's length)
    plan = kernel_plan.forward_plan(q.device, q4.shape[3], v4.shape[3], q_smoothing=q_smoothing, varlen=varlen,
                                    masked=tuple(window) != (-1, -1), softcap=bool(softcap),
                                    max_len_q=call.layout_q.max_len, pv_e4m3=rules.pv_e4m3, p_static=rules.p_static,
                                    empty=empty, mean_len_q=mean_len_q)
    # before any launch (an empty side has no P to round: its zeros and +inf lse are every rule's)
    check_kernels_compute(precision, forward_on_gluon=plan.gluon or empty)
    row_max = None
    if with_row_max and rules.ds_bound:   # (past the check, so on the Gluon forward; an empty side: no scores)
        row_max = torch.empty(q4.shape[:3], device=q4.device, dtype=torch.float32)
        if empty:
            row_max.fill_(float("-inf"))
    lse, q_shift = kernel_entry.forward(q4, k4, v4, as_bhnd(out, varlen), call, plan, sinks=sinks,
                                        row_max=None if empty else row_max)
    shift = Shift(q_shift, None) if need_shift else None
    return out, lse, shift, row_max


def _backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window, k_smoothing,
              q_smoothing, backend, softcap=0.0, sinks=None, deterministic=None, *, key_shard=False,
              precision="accurate", row_max=None):
    """Returns (dq, dk, dv, dsinks or None). ``deterministic``: the caller's choice (None: SAGEBWD_BACKWARD's;
    kernels/dispatch.py). ``key_shard``: ``k`` and ``v`` are one shard of each row's keys and ``out``, ``lse`` were
    merged over all shards (ring attention's backward of one shard). ``precision``: as ``_forward``'s.
    ``row_max``: ``_forward(..., with_row_max=True)``'s third output (the kernels' ds_bound rule reads it).

    With a cap, sinks or ``key_shard``, dQ owes K-smoothing's ``rowsum(dS) * mean(k)`` (the rows' dS no longer sum
    to zero over these keys): the dQ kernels add it in their epilogue (with a cap or a key shard from their own dS
    sums); the PyTorch path here."""
    if key_shard and sinks is not None:
        raise ValueError("key_shard: a shard of keys with sinks is not computed (the sink belongs to no shard)")
    need_shift = k_smoothing and (bool(softcap) or sinks is not None)
    if backend != "naive":   # (the kernels check the precision before any launch)
        return _backward_kernels(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window, k_smoothing,
                                 q_smoothing, softcap, need_shift, sinks, deterministic, key_shard=key_shard,
                                 precision=precision, row_max=row_max)
    dq, dk, dv = _backward_naive(dout, q, k, v, out, lse, cu_q, cu_k, max_k, scale, window, k_smoothing,
                                 q_smoothing, softcap, deterministic, key_shard=key_shard, precision=precision)
    dsinks = None
    if sinks is not None:
        shift = _torch_shift(q, k, cu_q, cu_k, scale) if need_shift else None
        delta = (as_bhnd(dout, cu_q is not None).float() * as_bhnd(out, cu_q is not None).float()).sum(-1)
        dsinks, row_ds = sink_math.sink_grads(delta, lse, sinks, None if shift is None or softcap else shift.rows)
        if shift is not None and not softcap:   # (the reference with a cap differentiates the caller's scores)
            sink_math.add_row_ds_term(dq, row_ds, shift.k_mean, cu_q is not None, scale)
    return dq, dk, dv, dsinks


def _backward_naive(dout, q, k, v, out, lse, cu_q, cu_k, max_k, scale, window, k_smoothing, q_smoothing, softcap,
                    deterministic, *, key_shard=False, precision="accurate"):
    """The PyTorch path's dq, dk, dv (into the op's layouts), by the rule the kernels would compute on this
    device (backward_rule)."""
    varlen = cu_q is not None
    rules = numerics_rules.parse_precision(precision)
    rule = backward_rule(q.device, q.shape[-1], v.shape[-1], softcap=softcap, q_smoothing=q_smoothing,
                         varlen=varlen, deterministic=deterministic, key_shard=key_shard, in_place=rules.in_place,
                         p_static=rules.p_static)
    tiles = dict(block_m_dkdv=rule.block_m_dkdv, block_n_dq=rule.block_n_dq, softcap=softcap, dq_int8=rule.dq_int8,
                 key_shard=key_shard, numerics=rules)
    dq, dk, dv = _poisoned(_new_like(q, varlen), _new_like(k, varlen), _new_like(v, varlen))
    dispatch.count("bwd_naive")
    if varlen:
        lse_t = lse[0].transpose(0, 1)      # [T, H] so it splits like the tokens
        grads = _per_sequence(
            lambda qs, ks, vs, os_, ls, dos: naive.sagebwd_backward_naive(
                qs, ks, vs, os_, ls[:, :, :, 0], dos, scale, window, k_smoothing, q_smoothing, **tiles)
            if qs.shape[2] and ks.shape[2] else   # an empty sequence has zero gradients
            (torch.zeros_like(qs), torch.zeros_like(ks), torch.zeros_like(vs)),
            q, k, v, cu_q, cu_k, extra_q=(out, lse_t.unsqueeze(-1), dout))
    else:
        grads = naive.sagebwd_backward_naive(q, k, v, out, lse, dout, scale, window, k_smoothing,
                                             q_smoothing, **tiles)
    return tuple(dst.copy_(src) for dst, src in zip((dq, dk, dv), grads))


def _backward_kernels(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window, k_smoothing,
                      q_smoothing, softcap, need_shift, sinks, deterministic=None, *, key_shard=False,
                      precision="accurate", row_max=None):
    """The Triton or Gluon kernels' (dq, dk, dv, dsinks or None). ``precision``: "accurate", or on the Gluon kernels
    a rule of GLUON_BACKWARD_RULES (dV's product; check_kernels_compute refuses the others before any launch)."""
    varlen = cu_q is not None
    dk, dv = _poisoned(_new_like(k, varlen), _new_like(v, varlen))
    q4, k4, v4 = as_bhnd(q, varlen), as_bhnd(k, varlen), as_bhnd(v, varlen)
    call = _kernel_call(q, k, cu_q, cu_k, max_q, max_k, scale, window, k_smoothing, q_smoothing, softcap, need_shift)
    empty = q4.numel() == 0 or k4.numel() == 0
    rules = numerics_rules.parse_precision(precision)
    plan = kernel_plan.backward_plan(q.device, q4.shape[3], v4.shape[3], q_smoothing=q_smoothing, varlen=varlen,
                                     softcap=softcap, deterministic=deterministic, key_shard=key_shard,
                                     pv_e4m3=rules.pv_e4m3, p_static=rules.p_static, dk_e4m3=rules.dk_e4m3,
                                     do_sequence=rules.do_sequence, in_place=rules.in_place, dp_int8=rules.dp_int8,
                                     ds_bound=rules.ds_bound, empty=empty)
    # before any launch (an empty side has no P to round: its zero gradients are every rule's)
    check_kernels_compute(precision, backward_on_gluon=plan.gluon or empty)
    one_launch_only = next((name for name in ONE_LAUNCH_RULES if getattr(rules, name)), None)
    if one_launch_only and not (plan.one_launch or empty):
        raise NotImplementedError(
            f"precision={precision!r}: {one_launch_only} is computed only by the Hopper one-launch backward (no cap, "
            "not deterministic, no key shard, head dims 64/64 and 128/128); this call runs another, and the PyTorch "
            "path (backend='naive') computes it")
    if rules.ds_bound and not empty and (row_max is None or row_max.numel() == 0):
        raise NotImplementedError(
            f"precision={precision!r}: ds_bound's backward reads each row's largest score, which only "
            "sagebwd_attn_func and sagebwd_attn_varlen_func keep from their Gluon forward; this call has none (use "
            "one of those, or backend='naive')")
    if plan.in_place and (q4.shape[3], v4.shape[3]) not in kernel_plan.IN_PLACE_HEAD_DIMS:
        raise NotImplementedError(
            f"precision={precision!r}: the Gluon backward sums dV and dK in place at (Q/K, V) head dims "
            f"{', '.join(f'{a}/{b}' for a, b in kernel_plan.IN_PLACE_HEAD_DIMS)}, not {q4.shape[3]}/{v4.shape[3]}; "
            "the PyTorch path (backend='naive') computes it")
    if plan.p_static and not plan.do_sequence and v4.shape[3] > plan.rule.block_m_dkdv:
        raise NotImplementedError(
            f"precision={precision!r}: the Gluon dV kernel stages dO's per-channel scales of a query tile in one "
            f"vector of {plan.rule.block_m_dkdv} (its query tile), fewer than V's head dim {v4.shape[3]}; the "
            "PyTorch path (backend='naive') computes it")
    # the one launch's dQ accumulates in fp32 (B*H*N*D*4 bytes): its bf16 dQ is made only once the launch's
    # inputs are freed, which keeps the op's peak memory below flash attention's (docs/benchmarks.md)
    dq = None if plan.one_launch else _poisoned(_new_like(q, varlen))[0]
    sink_grads = None if sinks is None else (
        lambda delta, q_shift: sink_math.sink_grads(delta, lse, sinks, q_shift))
    dq_acc, dsinks = kernel_entry.backward(q4, k4, v4, as_bhnd(out, varlen), as_bhnd(dout, varlen), lse,
                                           None if dq is None else as_bhnd(dq, varlen), as_bhnd(dk, varlen),
                                           as_bhnd(dv, varlen), call, plan, key_shard=key_shard,
                                           sink_grads=sink_grads, row_max=row_max)
    if dq is None:
        dq = _new_like(q, varlen)
        as_bhnd(dq, varlen).copy_(dq_acc)
    return dq, dk, dv, dsinks


def _per_sequence(fn, q, k, v, cu_q, cu_k, extra_q=()):
    """Run a padded-layout function on every sequence of a packed batch and re-pack the results.

    ``fn`` gets ``[1, H, n, D]`` tensors; tensors of ``extra_q`` are split like q."""
    if cu_q is None:
        return fn(q, k, v, *extra_q)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    pieces = []
    to4 = lambda x, a, b: x[a:b].transpose(0, 1).unsqueeze(0)  # noqa: E731
    for i in range(len(bq) - 1):
        args = [to4(q, bq[i], bq[i + 1]), to4(k, bk[i], bk[i + 1]), to4(v, bk[i], bk[i + 1])]
        args += [to4(x, bq[i], bq[i + 1]) for x in extra_q]
        pieces.append(fn(*args))
    results = []
    for parts in zip(*pieces):
        if parts[0].dim() == 3:   # base-2 lse [1, H, n] -> [1, H, T]
            results.append(torch.cat(parts, dim=2))
        else:                     # [1, H, n, D] -> [T, H, D]
            results.append(torch.cat([x[0].transpose(0, 1) for x in parts], dim=0))
    return tuple(results)


# Registered as torch custom ops with fake (meta) implementations, so torch.compile traces through the
# attention without a graph break, and autograd is attached to the op rather than to Python code.
# The outputs' layout follows the inputs' strides (_new_like): compiled graphs must hand the op the strides
# it was traced with (the default for custom ops in recent torch; the tag makes it explicit).
# Eager calls skip torch.library's dispatch and run the same functions through a plain autograd.Function
# (autograd_op): the op's autograd wrapper cost ~80 us of host time a forward and as much a backward.
OP_TAGS = (torch.Tag.needs_exact_strides,) if hasattr(torch.Tag, "needs_exact_strides") else ()


def _attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Optional[torch.Tensor],
              cu_k: Optional[torch.Tensor], max_q: int, max_k: int, scale: float, window_left: int,
              window_right: int, k_smoothing: bool, q_smoothing: bool, backend: str, softcap: float,
              deterministic: Optional[bool], precision: str,
              sinks: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, (window_left, window_right), k_smoothing,
                    q_smoothing, backend, softcap, sinks, precision, with_row_max=True)


def _attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, row_max: torch.Tensor, cu_q: Optional[torch.Tensor], cu_k: Optional[torch.Tensor],
              max_q: int, max_k: int, scale: float, window_left: int, window_right: int, k_smoothing: bool,
              q_smoothing: bool, backend: str, softcap: float, deterministic: Optional[bool], precision: str,
              sinks: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dsinks = _attn_grads(dout, q, k, v, out, lse, row_max, cu_q, cu_k, max_q, max_k, scale,
                                     window_left, window_right, k_smoothing, q_smoothing, backend, softcap,
                                     deterministic, precision, sinks)
    return dq, dk, dv, _no_sinks_grad(q) if dsinks is None else dsinks


def _attn_grads(dout, q, k, v, out, lse, row_max, cu_q, cu_k, max_q, max_k, scale, window_left, window_right,
                k_smoothing, q_smoothing, backend, softcap, deterministic, precision, sinks):
    """_attn_bwd's gradients, the sinks' None without sinks: the eager backward's (_backward_with returns None for
    them then), which spares it the custom op's stand-in, an allocation a backward."""
    return _backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, (window_left, window_right),
                     k_smoothing, q_smoothing, backend, softcap, sinks, deterministic, precision=precision,
                     row_max=row_max)


_attn_fwd_op = torch.library.custom_op("sagebwd::attn_fwd", _attn_fwd, mutates_args=(), tags=OP_TAGS)
_attn_bwd_op = torch.library.custom_op("sagebwd::attn_bwd", _attn_bwd, mutates_args=(), tags=OP_TAGS)


def _no_sinks_grad(q):
    return q.new_empty(0, dtype=torch.float32)     # a custom op cannot return None


@_attn_fwd_op.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left, window_right, k_smoothing, q_smoothing, backend,
      softcap, deterministic, precision, sinks):
    varlen = cu_q is not None
    lse_shape = (1, q.shape[1], q.shape[0]) if varlen else q.shape[:3]
    # (the row maxima: kept only by the Gluon forward under a ds_bound rule, which depends on the device)
    row_max_shape = lse_shape if numerics_rules.parse_precision(precision).ds_bound and backend != "naive" else (0,)
    return (_new_like(q, varlen, v.shape[-1]), q.new_empty(lse_shape, dtype=torch.float32),
            q.new_empty(row_max_shape, dtype=torch.float32))


@_attn_bwd_op.register_fake
def _(dout, q, k, v, out, lse, row_max, cu_q, cu_k, max_q, max_k, scale, window_left, window_right, k_smoothing,
      q_smoothing, backend, softcap, deterministic, precision, sinks):
    varlen = cu_q is not None
    dsinks = _no_sinks_grad(q) if sinks is None else sinks.new_empty(sinks.shape)
    return _new_like(q, varlen), _new_like(k, varlen), _new_like(v, varlen), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *args, sinks = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], output[2], cu_q, cu_k, sinks)
    ctx.args = args
    ctx.mark_non_differentiable(output[1], output[2])
    # lse has no gradient: without this autograd would allocate and zero-fill one (a launch) every backward
    ctx.set_materialize_grads(False)


def _backward_with(bwd, num_inputs):
    """An op's backward over ``bwd`` (its registered backward op, or that op's function in eager calls): the
    saved q, k, v, out, lse, the op's other saved tensors and the sinks, the non-tensor inputs in ``ctx.args``;
    gradients for q, k, v and the sinks (last of the op's ``num_inputs``). Only the first output is
    differentiable."""
    def backward(ctx, dout, *_non_differentiable):
        if dout is None:    # the output took no part in what is differentiated (grads are not materialized)
            return (None,) * num_inputs
        *saved, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = bwd(dout, *saved, *ctx.args, sinks)
        return (dq, dk, dv) + (None,) * (num_inputs - 4) + (dsinks if sinks is not None else None,)
    return backward


def autograd_op(name, fwd_op, fwd, bwd_op, bwd, setup_context, num_inputs):
    """Attach autograd to the custom op ``fwd_op`` (its backward through ``bwd_op``) and return what callers
    call: ``fwd_op`` where torch.compile traces, else an autograd.Function named ``name`` over the ops' own
    Python functions ``fwd`` and ``bwd``, with the same ``setup_context`` (no torch.library dispatch). ``bwd``
    may give None for the sinks' gradient where there are no sinks (a custom op must return a tensor)."""
    fwd_op.register_autograd(_backward_with(bwd_op, num_inputs), setup_context=setup_context)

    def forward(ctx, *inputs):
        output = fwd(*inputs)
        setup_context(ctx, inputs, output)
        return output
    methods = dict(forward=staticmethod(forward), backward=staticmethod(_backward_with(bwd, num_inputs)))
    eager = type(name, (torch.autograd.Function,), methods).apply

    def call(*inputs):
        return fwd_op(*inputs) if torch.compiler.is_compiling() else eager(*inputs)
    return call


_attn = autograd_op("SageBwdAttention", _attn_fwd_op, _attn_fwd, _attn_bwd_op, _attn_grads, _setup_context, 17)


# ---------------------------------------------------------------------------------------------------
# Argument checks: every bad input gets a ValueError/TypeError naming the argument
# ---------------------------------------------------------------------------------------------------

def _true_lse(lse2, q, k, cu_q, cu_k, scale, k_smoothing, softcap):
    """Natural-log lse of the caller's scores. K-smoothing moved every score of row i by
    ``-scale * q_i . mean(k)``: the kernels' lse is that much too small (unless the scores were capped, which
    added the shift back)."""
    lse = naive.lse_to_natural(lse2)
    if not k_smoothing or softcap:
        return lse
    return lse + _torch_shift(q, k, cu_q, cu_k, scale).rows


def _check_deterministic(deterministic):
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be None, True or False, got {deterministic!r}")
    return deterministic


def _check_tensors(q, k, v, rank, layout_name):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != rank:
            raise ValueError(f"{name} must have shape {layout_name}, got {tuple(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"q, k and v must be on one device: q is on {q.device}, {name} on {x.device}")
        if x.dtype not in SUPPORTED_DTYPES + (torch.float32,):
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
        if x.dtype != q.dtype:
            raise TypeError(f"q, k and v must share one dtype: q is {q.dtype}, {name} is {x.dtype}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k must share the head dim: got {q.shape[-1]} and {k.shape[-1]}")
    for name, head_dim in (("q/k", q.shape[-1]), ("v", v.shape[-1])):   # v's may differ (MLA: 192 and 128)
        if head_dim % 8 != 0 or not 8 <= head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name} head dim must be a multiple of 8 from 8 to {MAX_HEAD_DIM}, got {head_dim}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same shape but for the head dim, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")


def _check_heads(num_heads, num_kv_heads):
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"q's heads ({num_heads}) must be a multiple of k/v's heads ({num_kv_heads})")


def _check_window_size(window_size):
    """``window_size`` is ``(left, right)``: two ints (bools are not), each -1 (unbounded) or >= 0."""
    allowed = "a tuple of two ints (left, right), each -1 (unbounded) or >= 0"
    if not isinstance(window_size, (tuple, list)):
        raise TypeError(f"window_size must be {allowed}, got {window_size!r}")
    if len(window_size) != 2:
        raise ValueError(f"window_size must be {allowed}, got {window_size!r}")
    if not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size):
        raise TypeError(f"window_size must be {allowed}, got {window_size!r}")
    if not all(w >= -1 for w in window_size):
        raise ValueError(f"window_size must be {allowed}, got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _check_options(window_size, softmax_scale, head_dim, causal):
    left, right = _check_window_size(window_size)
    if causal:
        if right not in (-1, 0):
            raise ValueError(f"window_size right must be -1 or 0 with causal=True, got {right}")
        right = 0
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    elif (not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool)
          or not 0 < softmax_scale < float("inf")):
        raise ValueError(f"softmax_scale must be a positive finite number or None, got {softmax_scale!r}")
    return (left, right), float(softmax_scale)


def _check_cu_seqlens(name, cu, total, max_seqlen, device):
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D tensor of batch_size + 1 offsets")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {cu.device}")
    if not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"max_seqlen for {name} must be a non-negative int, got {max_seqlen!r}")
    if torch.compiler.is_compiling():   # the value checks below would read the tensor back: graph break
        return
    try:
        key = (cu._version, total, max_seqlen)
    except RuntimeError:                # an inference-mode tensor has no version counter: check every call
        key = None
    seen = _checked_cu_seqlens.get(id(cu))
    if key is not None and seen is not None and seen[0]() is cu and seen[1] == key:
        return
    _check_cu_values(name, cu, total, max_seqlen)
    if key is not None:
        if len(_checked_cu_seqlens) >= 16:
            _checked_cu_seqlens.pop(next(iter(_checked_cu_seqlens)))
        _checked_cu_seqlens[id(cu)] = (weakref.ref(cu), key)


# Reading cu_seqlens' values back waits for the GPU, and Transformers passes the same tensors to every layer
# of a step: a tensor is checked once, and again only if it is written in place (its version counter moves)
# or used with another token count or max_seqlen. id -> (weak reference, (version, total, max_seqlen)).
_checked_cu_seqlens = {}


def _check_cu_values(name, cu, total, max_seqlen):
    lengths = cu[1:] - cu[:-1]
    first, last, shortest, longest = torch.stack([cu[0], cu[-1], lengths.min(), lengths.max()]).tolist()
    if first != 0 or shortest < 0:
        raise ValueError(f"{name} must start at 0 and never decrease, got {cu.tolist()}")
    if last != total:
        raise ValueError(f"{name}[-1] is {last} but the packed tensor holds {total} tokens")
    if longest > max_seqlen:
        raise ValueError(f"a sequence in {name} has {longest} tokens, more than its max_seqlen {max_seqlen}")


def _check_extras(softcap, sinks, num_heads, device) -> float:
    if sinks is not None:
        sink_math.check_sinks(sinks, num_heads, device)
    return sink_math.check_softcap(softcap)


def _compute_dtype(q, k, v):
    if q.dtype == torch.float32:
        _warn_once("fp32", "sagebwd: float32 q/k/v are computed in bfloat16 (INT8 attention has no fp32 "
                           "path); the output and gradients are returned in float32.")
        return q.bfloat16(), k.bfloat16(), v.bfloat16(), torch.float32
    return q, k, v, None


def _check_precision(precision, backend) -> str:
    """The canonical string of a ``precision`` argument (ValueError naming it if it is none of the allowed ones);
    NotImplementedError where no kernel computes its forward (check_kernels_compute: the forward and backward
    check again where they run)."""
    name = numerics_rules.precision_name(numerics_rules.parse_precision(precision))
    if backend != "naive":
        check_kernels_compute(name, forward_on_gluon=True)
    return name


# The rules the Gluon (Hopper) kernels compute besides "accurate": P V (forward) and P^T dO (the backward's dV) in
# FP8 e4m3, P's scale per key tile (per key over a query tile) or fixed; in the backward also dK in e4m3 (dk_e4m3)
# and, with a fixed P scale, dO's per sequence (do_sequence). A precision's forward rule is its rules less the
# backward-only ones (Numerics.forward): the Gluon forward of "pv_e4m3+ds_tile" is that of "pv_e4m3"; no backward
# kernel computes ds_tile. "fast" is "pv_e4m3+p_static".
_N = numerics_rules.Numerics
# Backward rules of the reference that no kernel computes yet, and what each is (check_kernels_compute's errors)
NO_BACKWARD_KERNEL = {"ds_tile": "one dS scale per 64x64 tile for dK and dQ"}
# Backward rules only the Hopper one launch computes (the Gluon rules below hold them with fastest's others only)
ONE_LAUNCH_RULES = ("dp_int8", "ds_bound")
GLUON_FORWARD_RULES = (_N(pv_e4m3=True), _N(pv_e4m3=True, p_static=True))
GLUON_BACKWARD_RULES = GLUON_FORWARD_RULES + (
    _N(pv_e4m3=True, dk_e4m3=True), _N(pv_e4m3=True, p_static=True, dk_e4m3=True),
    _N(pv_e4m3=True, p_static=True, do_sequence=True, dk_e4m3=True),
    _N(pv_e4m3=True, p_static=True, do_sequence=True, dk_e4m3=True, dp_int8=True),
    _N(pv_e4m3=True, p_static=True, do_sequence=True, dk_e4m3=True, ds_bound=True),
    _N(pv_e4m3=True, p_static=True, do_sequence=True, dk_e4m3=True, dp_int8=True, ds_bound=True))


def _where_gluon_runs() -> str:
    """The calls the Gluon kernels run, as check_kernels_compute's errors name them."""
    head_dims = ", ".join(f"{a}/{b}" for a, b in dispatch.GLUON_HEAD_DIMS)
    return f"an sm_90 GPU, Q/K and V head dims {head_dims}, no Q-smoothing, SAGEBWD_KERNELS not 'triton'"


def check_kernels_compute(precision: str, forward_on_gluon: Optional[bool] = None, *,
                          backward_on_gluon: bool = False) -> None:
    """Raise NotImplementedError unless the kernels compute ``precision``; the PyTorch path computes every preset
    and rule. Every Triton and Gluon kernel computes "accurate"; the Gluon forward (``forward_on_gluon``: the pass
    is a forward and it runs there) also the forward of the precisions GLUON_FORWARD_RULES names; a backward
    (``forward_on_gluon`` None) on the Gluon kernels (``backward_on_gluon``) the rules GLUON_BACKWARD_RULES names
    (dV's product; dK and dQ are the same in them), on the portable kernels "accurate" only. No kernel computes
    another rule in its place."""
    rules = numerics_rules.parse_precision(precision)
    if rules == numerics_rules.ACCURATE:
        return
    prefix = f"precision={precision!r} is computed only by the PyTorch path so far (CPU tensors, or backend='naive')"
    gluon_forward = rules.forward in GLUON_FORWARD_RULES
    if forward_on_gluon is None:
        if rules in GLUON_BACKWARD_RULES and backward_on_gluon:
            return
        # what is missing: a backward rule no kernel computes, or the Gluon kernels
        if rules._replace(**dict.fromkeys(NO_BACKWARD_KERNEL, False)) in GLUON_BACKWARD_RULES:
            unbuilt = next((name for name in NO_BACKWARD_KERNEL if getattr(rules, name)), None)
            missing = (f"{unbuilt} ({NO_BACKWARD_KERNEL[unbuilt]}) is computed by no backward kernel" if unbuilt
                       else "this call's backward runs the portable Triton kernels, which compute "
                            "precision='accurate'")
            raise NotImplementedError(
                f"{prefix} and by the Gluon kernels ({_where_gluon_runs()}), which compute its forward and"
                f"{f', without {unbuilt},' if unbuilt else ''} its backward; {missing}")
        raise NotImplementedError(f"{prefix}; the Triton and Gluon backward kernels compute precision='accurate', and "
                                  "the Gluon (Hopper) backward also 'pv_e4m3' and 'pv_e4m3+p_static', each with or "
                                  "without dk_e4m3, and 'pv_e4m3+p_static+do_sequence+dk_e4m3' (with or without "
                                  "dp_int8 and ds_bound)")
    if not gluon_forward:
        raise NotImplementedError(
            f"{prefix}; the Triton and Gluon kernels compute precision='accurate', and the Gluon (Hopper) forward also "
            "'pv_e4m3' and 'pv_e4m3+p_static' (with or without ds_tile, a backward rule)")
    if not forward_on_gluon:
        raise NotImplementedError(
            f"{prefix} and, for the forward, by the Gluon kernel ({_where_gluon_runs()}); this call's forward runs "
            "the portable Triton kernels, which compute precision='accurate'")


def _backend(q, backend):
    if backend is None:
        return "triton" if _use_triton(q) else "naive"
    if backend not in ("triton", "naive"):
        raise ValueError(f"backend must be None, 'triton' or 'naive', got {backend!r}")
    if backend == "triton" and not _use_triton(q):
        raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    return backend


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------

def sagebwd_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                      k_smoothing: bool = True, q_smoothing: bool = False, return_lse: bool = False,
                      backend: Optional[str] = None, softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                      deterministic: Optional[bool] = None, precision: str = "accurate"):
    """INT8 attention with an INT8 backward (SageBwd).

    Args:
        q: ``[batch, heads, seqlen_q, head_dim]``, float16 or bfloat16 (float32 runs in bfloat16).
        k, v: ``[batch, kv_heads, seqlen_k, head_dim]``; ``heads`` a multiple of ``kv_heads`` (GQA/MQA). v may
            have a head dim of its own (multi-head latent attention; on Hopper, DeepSeek's 192/128 runs the Gluon
            kernels, other pairs the portable ones). Any strides; inputs are never modified.
        causal: mask future keys, aligned bottom-right when ``seqlen_q != seqlen_k``.
        softmax_scale: defaults to ``head_dim ** -0.5``.
        window_size: ``(left, right)`` local attention as in FlashAttention, -1 for unbounded.
        k_smoothing: subtract the mean key (per sequence and KV head) before quantizing. Keep it on.
        q_smoothing: subtract per-block query means, adding their scores back in fp32. Off by default.
        return_lse: also return the natural-log log-sum-exp ``[batch, heads, seqlen_q]`` (fp32,
            -inf for rows that see no key; not differentiable).
        backend: None picks Triton for CUDA tensors and PyTorch for CPU ones; "naive" or "triton" force one.
        softcap: > 0 caps the scores at ``softcap * tanh(s / softcap)`` (Gemma 2), applied to the dequantized
            fp32 scores after the INT8 product; 0 is off. Runs on every kernel family.
        sinks: ``[heads]``, one learned logit per query head in every row's softmax denominator (gpt-oss's
            attention sinks); differentiable. None is off.
        deterministic: False lets the backward trade bit-identical gradients for speed where it can (Hopper, head
            dim 64, no soft cap: one launch, dQ added up by reduce-adds; README, "Supported"); True keeps
            three launches, each gradient written once. None (default): ``SAGEBWD_BACKWARD``'s choice, ``fast``
            (as False) unless it says ``deterministic``. ``torch.use_deterministic_algorithms(True)`` wins over
            False. ``backward_rule`` says which numbers a call computes.
        precision: the numerics preset. "accurate" (default): INT8 with per-row and per-column scales, the rule
            every kernel computes. "fast": FP8 e4m3 P·V and Pᵀ·dO with fixed P scales ("pv_e4m3+p_static";
            ``sagebwd_hf.numerics`` and docs/fast_preset.md). "fastest": "fast" with dK in e4m3 and dO's scales
            per sequence, whose backward sums dV and dK in place (head dims 64 and 128 on Hopper). Or single rules
            joined by "+" ("pv_e4m3", "pv_e4m3+ds_tile"). The PyTorch path (CPU tensors, or ``backend="naive"``)
            computes them all; on the kernels, the Gluon kernels (Hopper) compute GLUON_BACKWARD_RULES forward
            and backward, and the forward of those with ds_tile; any other kernel pass (a backward with ds_tile,
            the portable kernels) or precision raises NotImplementedError (``check_kernels_compute``).

    Returns:
        ``out`` ``[batch, heads, seqlen_q, head_dim of v]`` in q's dtype, and ``lse`` if asked.
    """
    _check_tensors(q, k, v, 4, "[batch, heads, seqlen, head_dim]")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    _check_heads(q.shape[1], k.shape[1])
    window, scale = _check_options(window_size, softmax_scale, q.shape[-1], causal)
    softcap = _check_extras(softcap, sinks, q.shape[1], q.device)
    backend = _backend(q, backend)
    precision = _check_precision(precision, backend)
    q, k, v, restore = _compute_dtype(q, k, v)
    out, lse, _ = _attn(q, k, v, None, None, q.shape[2], k.shape[2], scale, *window,
                        bool(k_smoothing), bool(q_smoothing), backend, softcap,
                        _check_deterministic(deterministic), precision, sinks)
    if restore is not None:
        out = out.to(restore)
    if not return_lse:
        return out
    return out, _true_lse(lse, q.detach(), k.detach(), None, None, scale, k_smoothing, softcap)


def sagebwd_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                             max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                             softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                             k_smoothing: bool = True, q_smoothing: bool = False, return_lse: bool = False,
                             backend: Optional[str] = None, softcap: float = 0.0,
                             sinks: Optional[torch.Tensor] = None, deterministic: Optional[bool] = None,
                             precision: str = "accurate"):
    """Packed (padding-free) batches, as ``flash_attn_varlen_func``.

    ``q`` is ``[total_q, heads, head_dim]``, ``k``/``v`` ``[total_k, kv_heads, head_dim]`` (v's head dim may
    differ); sequence ``i`` holds tokens ``cu_seqlens[i]:cu_seqlens[i+1]`` (int32, on q's device). No token
    attends across a sequence boundary. ``lse``, if asked, is ``[heads, total_q]``. Other arguments as ``sagebwd_attn_func``.
    """
    _check_tensors(q, k, v, 3, "[total_tokens, heads, head_dim]")
    _check_heads(q.shape[1], k.shape[1])
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, q.device)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
                         f"got {cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")
    window, scale = _check_options(window_size, softmax_scale, q.shape[-1], causal)
    softcap = _check_extras(softcap, sinks, q.shape[1], q.device)
    backend = _backend(q, backend)
    precision = _check_precision(precision, backend)
    q, k, v, restore = _compute_dtype(q, k, v)
    out, lse, _ = _attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, *window,
                        bool(k_smoothing), bool(q_smoothing), backend, softcap,
                        _check_deterministic(deterministic), precision, sinks)
    if restore is not None:
        out = out.to(restore)
    if not return_lse:
        return out
    return out, _true_lse(lse, q.detach(), k.detach(), cu_seqlens_q, cu_seqlens_k, scale, k_smoothing, softcap)[0]
