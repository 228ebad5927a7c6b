"""The kernels' entry: ``forward`` and ``backward`` take a call's tensors, what the call asks (``Call``) and its plan
(``plan.forward_plan`` / ``plan.backward_plan``), and run the quantization passes and the launches the plan names:
the Gluon kernels (hopper_launch) or the portable ones (forward.launch_forward, backward.launch_backward).

Tensors are ``[B, H, N, D]`` (a packed batch viewed ``[1, H, T, D]``: ``layout.as_bhnd``); outputs are the
caller's, allocated in its layout. Argument checks, autograd and the PyTorch reference are the caller's
(``sagebwd_hf.interface``).
"""
import dataclasses
import os
from typing import Callable, Optional, Tuple

import torch

from . import dispatch
from .backward import launch_backward
from .constants import LOG2E
from .forward import launch_forward
from .layout import SeqLayout
from .plan import BackwardPlan, ForwardPlan
from .ds_bound import prepare_ds_bound
from .quantize import aligned_starts, prepare_backward, prepare_forward, quantize

# Tests set SAGEBWD_POISON=1: kernel outputs start as NaN, so an element a kernel forgot shows up.
POISON = os.environ.get("SAGEBWD_POISON") == "1"


def poisoned(*tensors):
    """``tensors``, filled with NaN where ``POISON`` is on."""
    if POISON:
        for x in tensors:
            x.fill_(float("nan"))
    return tensors


@dataclasses.dataclass(frozen=True)
class Call:
    """What a call asks of the kernels, beside its tensors: its sequences (``layout_q``, ``layout_k``), the softmax
    ``scale``, the ``window`` (left, right; -1 unbounded), K- and Q-smoothing, a soft ``softcap`` (0: off), and
    ``need_shift``: K-smoothing's per-row score shift is wanted back (a cap or sinks add it to the scores)."""
    layout_q: SeqLayout
    layout_k: SeqLayout
    scale: float
    window: Tuple[int, int]
    k_smoothing: bool
    q_smoothing: bool
    softcap: float = 0.0
    need_shift: bool = False


def _softcap_shift(q_shift, lse):
    """What the kernels add to their base-2 scores before the cap (zeros without K-smoothing)."""
    if q_shift is None:
        return torch.zeros(lse.shape, device=lse.device, dtype=torch.float32)
    return q_shift * LOG2E


def forward(q4, k4, v4, out4, call: Call, plan: ForwardPlan, sinks: Optional[torch.Tensor] = None,
            row_max: Optional[torch.Tensor] = None):
    """Write ``out4`` ``[B, Hq, N, Dv]`` (any strides); return (base-2 lse ``[B, Hq, N]``, K-smoothing's row shift
    ``scale * q . mean(k)`` ``[B, Hq, N]`` or None where ``call.need_shift`` is off). ``sinks`` ``[Hq]`` join each
    row's softmax denominator in the kernels' epilogue. ``row_max`` (fp32 ``[B, Hq, N]`` contiguous, the Gluon
    kernel only): also each row's largest score in lse's frame, which the ds_bound rule's backward reads."""
    if row_max is not None and not plan.gluon:
        raise NotImplementedError("row_max: only the Gluon forward writes each row's largest score")
    lay_q, lay_k, softcap = call.layout_q, call.layout_k, call.softcap
    counters = None
    if plan.gluon:
        from .hopper_launch import COUNTER_INTS, counter_slot, launch_forward_hopper   # imports Gluon
        counters = torch.empty(COUNTER_INTS, dtype=torch.int32, device=q4.device)   # zeroed by Q's pass
    # the Gluon kernel reads V^T by TMA, whose tiles must start 16-byte aligned: packed sequences are laid so
    v_starts = aligned_starts(lay_k) if plan.gluon and lay_k.is_varlen else None
    # K's and V's statistics, K's pass (combining K's mean), Q's and V's in one launch (V's combining its scales;
    # Q's zeroing the launch's work counter); the Gluon forward reads V^T's keys in the order its P registers hold
    # them (quantize.operand_order_columns); with pv_e4m3, V in e4m3
    quant, v8t, v_scale = prepare_forward(q4, k4, v4, lay_q, lay_k, call.scale, call.k_smoothing, call.q_smoothing,
                                          row_shift=call.need_shift, v_starts=v_starts, v_operand_order=plan.gluon,
                                          zero_ints=counters, v_e4m3=plan.pv_e4m3)
    q_shift = quant.q_shift if call.need_shift else None
    lse = torch.empty(q4.shape[:3], device=q4.device, dtype=torch.float32)
    poisoned(out4, lse)
    args = (quant, v8t, v_scale, out4, lse, lay_q, lay_k, q4.shape[1], q4.shape[1] // k4.shape[1], q4.shape[3],
            call.window)
    # the sinks sit in the kernels' frame: below the caller's by K-smoothing's shift, unless the cap added it back
    sink_args = {} if sinks is None else dict(sinks=sinks.contiguous(),
                                              sink_shift=None if softcap else q_shift)
    cap_args = dict(softcap=softcap, shift=_softcap_shift(q_shift, lse) if softcap else None)
    if plan.gluon:
        if row_max is not None:
            poisoned(row_max)
        launch_forward_hopper(*args, v_starts=v_starts, v_operand_order=True, counter=counter_slot(counters, 0),
                              row_max=row_max, **plan.hopper_schedule(), **cap_args, **sink_args)
        dispatch.count("fwd_gluon")
    else:
        launch_forward(*args, plan.tiles["fwd"], **cap_args, **sink_args)
        dispatch.count("fwd_triton")
    return lse, q_shift


def backward(q4, k4, v4, o4, do4, lse, dq4, dk4, dv4, call: Call, plan: BackwardPlan, *, key_shard: bool = False,
             sink_grads: Optional[Callable] = None, row_max: Optional[torch.Tensor] = None):
    """Write ``dk4`` and ``dv4`` and, unless the plan is the one launch (``dq4`` None then), ``dq4``; return (the one
    launch's fp32 dQ or None, the sinks' gradient or None). ``lse``: the forward's (base 2; merged over every shard
    of keys with ``key_shard``: ``k4`` and ``v4`` one shard of each row's keys). ``sink_grads(delta, q_shift)`` ->
    (dsinks, row_ds): the sinks' gradient and their share of each row's rowsum(dS), from delta = rowsum(dO * O)
    that dO's pass gives (``sagebwd_hf.sinks``). ``row_max``: the forward's row maxima (``forward``'s), which the
    ds_bound rule's bound reads."""
    lay_q, lay_k, softcap, rule = call.layout_q, call.layout_k, call.softcap, plan.rule
    gluon, one_launch, varlen = plan.gluon, plan.one_launch, lay_q.is_varlen
    # the forward's bytes again (same inputs, same deterministic quantization), plus token-major copies (for the
    # Gluon kernels in the order their P and dS registers hold the tokens: quantize.operand_order_columns)
    # packed batches on the Gluon kernels: each sequence's token-major copy starts 16-aligned (TMA)
    starts_q = aligned_starts(lay_q) if gluon and varlen else None
    starts_k = aligned_starts(lay_k) if gluon and varlen else None
    counters = dq_acc = None
    if gluon:
        from .hopper_launch import COUNTER_INTS, launch_backward_hopper   # imports Gluon: only where it runs
        # the launches' work counters and the one launch's fp32 dQ accumulator, zeroed by Q's pass (no fills)
        counters = torch.empty(COUNTER_INTS, dtype=torch.int32, device=q4.device)
        if one_launch:
            dq_acc = torch.empty(q4.shape, dtype=torch.float32, device=q4.device)
    # K's statistics, K's pass, then Q's and dO's (with delta = rowsum(dO * O)) in one launch; under dk_e4m3 (a
    # Gluon plan's only, never with Q-smoothing) Q's pass writes its token-major copy in e4m3 (dK's operand), the
    # INT8 one being unread there
    quant, do_q = prepare_backward(q4, k4, do4, o4, lay_q, lay_k, call.scale, call.k_smoothing, call.q_smoothing,
                                   row_shift=call.need_shift, operand_order=gluon, t_starts_q=starts_q,
                                   t_starts_k=starts_k, k_transposed=not one_launch, zero_ints=counters,
                                   zero_rows=dq_acc, do_e4m3=plan.pv_e4m3,
                                   do_channel_tile=rule.block_m_dkdv if plan.p_static else None,
                                   do_group=q4.shape[1] // k4.shape[1] if plan.do_sequence else None,
                                   qt_e4m3=plan.dk_e4m3 and not plan.ds_bound, do_int8_rows=plan.dp_int8,
                                   q_transposed=not plan.ds_bound)
    dp_int8 = None
    if plan.dp_int8:   # dP = dO V^T in INT8: dO's rows from its pass, V one scale a key block as K
        v_q = quantize(v4, lay_k, natural=True, block_scale=True)
        dp_int8 = (do_q.x8, do_q.x8_scale, v_q.x8, v_q.scale)
    ds_bound = None
    if plan.ds_bound:   # dK's dS at each query's fixed scale: Q's copy times the rows' bounds, after dO's delta
        assert plan.one_launch and row_max is not None and row_max.shape == lse.shape
        group = q4.shape[1] // k4.shape[1]
        q8t_bound, ds_inv, ds_bound = prepare_ds_bound(q4, v4, do4, lse, row_max, do_q.delta, lay_q, lay_k,
                                                       group, starts_q, operand_order=True)
        q_e4m3 = (q8t_bound, ds_inv)
    else:
        q_e4m3 = (quant.q8t, quant.qt_scale) if plan.dk_e4m3 else None
    q_shift = quant.q_shift if call.need_shift else None
    if call.q_smoothing:   # dK = dS^T Q needs the caller's Q, not the smoothed one the scores use
        raw = quantize(q4, lay_q, natural=False, transposed=True)
        q8rt, q_scale_raw = raw.x8t, raw.scale
    else:
        q8rt, q_scale_raw = quant.q8t, quant.q_scale_raw
    dsinks = row_ds = None
    if sink_grads is not None:
        dsinks, row_ds = sink_grads(do_q.delta, None if softcap else q_shift)
    # dQ's K-smoothing term (the dQ kernels' epilogue; with a cap or a key shard they sum their own dS)
    term = dict(k_mean=quant.k_mean if call.need_shift or (key_shard and call.k_smoothing) else None, row_ds=row_ds)
    cap_args = dict(softcap=softcap, shift=_softcap_shift(q_shift, lse) if softcap else None)
    heads = (q4.shape[1], k4.shape[1], q4.shape[3], call.window, call.scale)
    if gluon:
        dq_acc = launch_backward_hopper(quant, v4, do4, do_q.x8t, do_q.scale, lse, do_q.delta, dq4, dk4, dv4, *heads,
                                        programs=plan.programs, operand_order=True,
                                        packing=(lay_q, lay_k, starts_q, starts_k) if varlen else None,
                                        fused_dq=one_launch, counters=counters, dq_acc=dq_acc,
                                        pv_e4m3=plan.pv_e4m3, p_static=plan.p_static,
                                        fused_dkdv=plan.in_place and not one_launch, q_e4m3=q_e4m3,
                                        in_place=plan.in_place, dp_int8=dp_int8, ds_bound=ds_bound, **term,
                                        **cap_args)
        dispatch.count("bwd_gluon_one_launch" if one_launch else "bwd_gluon")
    else:
        launch_backward(quant, q8rt, q_scale_raw, quant.k8t, v4, do4, do_q.x8t, do_q.scale, lse, do_q.delta, dq4,
                        dk4, dv4, lay_q, lay_k, *heads[:3], call.window, call.scale, plan.tiles["dkdv"],
                        plan.tiles["dq"], split_dkdv=plan.tiles["split_dkdv"], **term, **cap_args)
        dispatch.count("bwd_triton")
    return dq_acc, dsinks
