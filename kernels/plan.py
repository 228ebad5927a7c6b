"""One plan per attention call: the kernel family that runs it, its tiles, its backward rule and its schedule.

Every size and schedule choice of the kernels lives here, as FlashAttention 3 keeps them in ``tile_size.h`` and
``heuristics.h``: the tiles (``tile_configs``; they are part of the numerics, since P and dS get one scale per row of
a tile, so the PyTorch reference takes them too), the backward rule (``backward_rule``), and the Gluon launches'
schedule (consumer warpgroups, ping-pong turns, named barriers, register splits, persistent programs, the one-launch
backward). ``dispatch`` says which families may run (``SAGEBWD_KERNELS``, the GPU, the Triton release);
``forward_plan`` and ``backward_plan`` ask it once and return a frozen plan that the launches follow.

Imports no Gluon: the plan of a call is known on any machine.
"""
import dataclasses
import functools
import types
from typing import Mapping, NamedTuple, Optional

import torch

from . import dispatch
from .constants import ONE_LAUNCH_QUERY_TILE

# ---------------------------------------------------------------------------------------------------------------------
# Tiles (tile_size.h)
# ---------------------------------------------------------------------------------------------------------------------


def block_dim(head_dim: int) -> int:
    """A head dim's tile in the portable kernels: the next power of two, at least 32 (tl.dot's minimum with room
    for int8)."""
    return max(32, 1 << (head_dim - 1).bit_length())


def dkdv_query_tile(head_dim: int) -> int:
    """Queries per tile of the dV and dK kernels, every family's: P^T's and dS^T's per-key scales span this many
    queries, so it is part of the numerics. Past head dim 128 (MLA's Q/K 192) dK's accumulator alone takes 96
    registers of the Gluon kernel: 64-query tiles there."""
    return 64 if head_dim > 128 else 128


def dq_key_tile(head_dim: int) -> int:
    """Keys per tile of the dQ kernels, every family's: dS's per-query scales span this many keys (part of the
    numerics, as dkdv_query_tile). Past 128 the Gluon dQ accumulator takes 96 registers: 64-key tiles halve S and
    dP beside it."""
    return 64 if head_dim > 128 else 128


@functools.lru_cache(maxsize=None)
def tile_configs(head_dim: int, device: torch.device, head_dim_v: Optional[int] = None) -> Mapping:
    """The portable kernels' and the reference's tiles: {"fwd", "dq"} -> (BLOCK_M, BLOCK_N, BLOCK_D, num_warps,
    num_stages); "dkdv" -> one such tile, or a (dV tile, dK tile) pair sharing BLOCK_M when "split_dkdv" (dV and dK
    as two launches, kernels/backward.py). ``BLOCK_D`` is Q's and K's; the tile shapes follow the larger of that
    and V's head dim. Read-only (computed once per argument set: it is asked on every call)."""
    return types.MappingProxyType(_tile_configs(head_dim, device, head_dim_v))


def _tile_configs(head_dim, device, head_dim_v):
    block_d = block_dim(head_dim)
    block_max = max(block_d, block_dim(head_dim_v or head_dim))
    pack = lambda c: (c[0], c[1], block_d, c[2], c[3])  # noqa: E731
    if device.type != "cuda":
        return {"fwd": pack((64, 64, 4, 1)), "dq": pack((64, 64, 4, 1)), "dkdv": pack((64, 64, 4, 1)),
                "split_dkdv": False}
    dkdv_m, dq_n = dkdv_query_tile(block_max), dq_key_tile(block_max)
    if block_max > 128:
        # Head dims past 128 (MLA's q/k 192): the fastest tiles of a sweep on an H100 (docs/history.md). MLA's
        # 192/128 runs the Gluon kernels on Hopper, whose forward walks 128-key tiles: the portable forward takes
        # that tile too, so that both families and the reference share one rule. One stage: two would need 112 KB
        # of shared memory, past the 99 KB an Ada GPU gives a program.
        mla = (head_dim, head_dim_v or head_dim) == (192, 128)
        return {"fwd": pack((64, 128, 4, 1) if mla else (64, 64, 4, 2)), "dq": pack((64, dq_n, 8, 1)),
                "dkdv": pack((dkdv_m, 32, 4, 1)), "split_dkdv": False}
    # Fastest of sweeps on an H200 at N=4096 (tools/breakdown.py --sweep / --split-sweep, docs/history.md). Fused,
    # the dK/dV kernel holds two [BLOCK_N, D] fp32 accumulators and spills (178 at D=128); split into a dV and a dK
    # launch it runs 1.36x faster at D=128 despite computing P twice. At D <= 64 splitting gained 1.03x only: fused
    # there; its dQ kernel is 1.36x faster at BLOCK_M 64, 4 warps.
    fwd = pack((64, 128, 4, 3))
    if block_max == 128:
        return {"fwd": fwd, "dq": pack((128, dq_n, 8, 2)),
                "dkdv": (pack((dkdv_m, 64, 4, 2)), pack((dkdv_m, 128, 8, 2))), "split_dkdv": True}
    return {"fwd": fwd, "dq": pack((64, dq_n, 4, 2)), "dkdv": pack((dkdv_m, 128, 8, 2)), "split_dkdv": False}


def dkdv_block_m(cfg) -> int:
    """A ``tile_configs`` entry's dK/dV query tile: P and dS get one scale per key per tile of this many queries."""
    return cfg["dkdv"][0][0] if cfg["split_dkdv"] else cfg["dkdv"][0]


# ---------------------------------------------------------------------------------------------------------------------
# The Gluon launches' schedule (heuristics.h)
# ---------------------------------------------------------------------------------------------------------------------

# Three consumer warpgroups in the Gluon forward (192 query rows a program) measured faster only without a mask
# (with P·V in e4m3: masked too), from this many query rows a sequence (on average, in a packed batch), and with a
# cap only at head dim 64 (docs/history.md, docs/fast_preset.md)
GLUON_THREE_CONSUMERS_MIN_QUERIES = 2048
# Ping-pong turns between two consumers at V's head dim 128 paid off only for masked square-head calls from this
# many query rows (capped calls keep them; docs/history.md)
GLUON_PINGPONG_MIN_QUERIES = 2048
# Head dims of the one-launch backward: at 128 its loop spills and it ran slower than the three launches, unless dV
# and dK accumulate in place (their per-tile conversions and second register sets gone)
ONE_LAUNCH_HEAD_DIMS = ((64, 64), )
ONE_LAUNCH_IN_PLACE_HEAD_DIMS = ((64, 64), (128, 128))
# Head dims whose in-place backward (dV and dK summed in their e4m3 accumulators) is built and tested on the GPU; MLA's
# 192/128, whose dK takes two accumulators, is not
IN_PLACE_HEAD_DIMS = ((64, 64), (128, 128))
# Registers a thread of each warpgroup gets (setmaxnreg): one SM's 64K registers shared by the consumers beside the
# loader. Forward: by consumer count; the backward's launches: two consumers.
FORWARD_CONSUMER_REGS = types.MappingProxyType({2: 240, 3: 160})
FORWARD_LOADER_REGS = 24
BACKWARD_CONSUMER_REGS = 240
BACKWARD_LOADER_REGS = 32
# The one launch's dQ staging buffers a consumer (reduce-adds in flight): at head dim 128 one fits shared memory
ONE_LAUNCH_DQ_BUFFERS = 3
ONE_LAUNCH_DQ_BUFFERS_D128 = 1


def one_launch_dq_buffers(head_dim: int) -> int:
    """The one launch's dQ staging buffers a consumer at ``head_dim``."""
    return ONE_LAUNCH_DQ_BUFFERS_D128 if head_dim > 64 else ONE_LAUNCH_DQ_BUFFERS


def gluon_forward_consumers(head_dim: int, masked: bool, softcap: bool, len_q: int,
                            pv_e4m3: bool = False) -> int:
    """Consumer warpgroups of a Gluon forward launch; ``len_q``: a sequence's query rows, on average over a packed
    batch (``forward_plan``'s ``mean_len_q``); ``pv_e4m3``: the numerics rule of P·V (its tile loop is shorter,
    and causal calls ran faster with three too)."""
    mask_allowed = not masked or (pv_e4m3 and head_dim in (64, 128))
    three = (head_dim in (64, 128, 192) and mask_allowed and (not softcap or head_dim == 64)
             and len_q >= GLUON_THREE_CONSUMERS_MIN_QUERIES)
    return 3 if three else 2


def gluon_forward_pingpong(head_dim: int, head_dim_v: int, masked: bool, softcap: bool, max_len_q: int) -> bool:
    """Whether a two-consumer Gluon forward launch takes turns."""
    if head_dim_v != 128:
        return False
    return softcap or (head_dim == 128 and masked and max_len_q >= GLUON_PINGPONG_MIN_QUERIES)


def gluon_forward_named_barriers(head_dim_v: int) -> bool:
    """The forward's turns and buffer releases on hardware named barriers, each thread arriving for itself, instead
    of mbarriers (whose one-thread arrivals Gluon precedes with a ``bar.sync`` of the warpgroup): on at V's head
    dim 128, where kernels alone ran 1.00-1.05x faster with two consumers and 1.01-1.04x with three (H100), off at
    64 (0.98-1.03x)."""
    return head_dim_v == 128


def gluon_one_launch_backward(deterministic: Optional[bool], head_dim: int, head_dim_v: int, softcap: bool,
                              in_place: bool = False) -> bool:
    """Whether a backward that runs on the Gluon kernels takes the one launch (FlashAttention 3's: dQ added up by
    fp32 reduce-adds, whose order varies run to run; 64-query tiles and dQ's product unquantized, so other, more
    accurate, numbers: ``backward_rule``). It does when ``deterministic`` is False (the op's argument; None asks
    ``dispatch.BACKWARD_ENV``, "fast" meaning False), torch does not demand determinism, the head dims are
    ``ONE_LAUNCH_HEAD_DIMS`` (``ONE_LAUNCH_IN_PLACE_HEAD_DIMS`` for a precision whose dV and dK accumulate in place
    with P at its fixed scale, ``in_place``: at head dim 128 a per-query row of dO's scales more overflows shared
    memory)
    and there is no cap (its K-smoothing term needs dS's row sums; the sinks' is given).
    It is faster at every length, masked or not. Otherwise dV, dK and dQ run as three launches, each gradient
    written once: bit-identical run to run."""
    if deterministic is None:
        deterministic = dispatch.backward_requested() == "deterministic"
    if deterministic or torch.are_deterministic_algorithms_enabled():
        return False
    head_dims = ONE_LAUNCH_IN_PLACE_HEAD_DIMS if in_place else ONE_LAUNCH_HEAD_DIMS
    return (head_dim, head_dim_v) in head_dims and not softcap


def gluon_programs(device: torch.device) -> Optional[int]:
    """Programs of a Gluon launch: one per SM, each taking work items from an atomic counter (the persistent
    schedule, forward and backward alike)."""
    return dispatch.sm_count(device)


# ---------------------------------------------------------------------------------------------------------------------
# The backward's rule and the plans
# ---------------------------------------------------------------------------------------------------------------------


class BackwardRule(NamedTuple):
    """What a backward computes, beside the forward's tiles (naive.sagebwd_backward_naive's arguments of the same
    names): P and dS get one scale per key per ``block_m_dkdv`` queries; with ``dq_int8`` dQ = dS K runs in INT8,
    dS with one scale per query per ``block_n_dq`` keys; without it dS in the inputs' dtype times the int8 K (the
    Hopper one launch's, ``one_launch``). With rules whose dV and dK accumulate in place (numerics'
    ``in_place``) the Hopper kernels compute dV and dK in one launch over 64-query tiles
    (``ONE_LAUNCH_QUERY_TILE``), beside the dQ launch or in the one launch."""
    block_m_dkdv: int
    block_n_dq: int
    dq_int8: bool
    one_launch: bool


def backward_rule(device: torch.device, head_dim: int, head_dim_v: Optional[int] = None, *,
                  softcap: float = 0.0, q_smoothing: bool = False, varlen: bool = False,
                  deterministic: Optional[bool] = None, key_shard: bool = False,
                  in_place: bool = False, p_static: bool = False) -> BackwardRule:
    """The rule of a backward call on ``device`` (``deterministic``: the op's argument; ``key_shard``: a shard of
    each row's keys, which the one launch cannot take: its key-tile programs cannot sum dS's rows). The kernels
    compute it, and so does the PyTorch path on the same device (``backend="naive"``): on a Hopper GPU at head dim
    64 the default is the one launch's rule (``SAGEBWD_BACKWARD``), elsewhere and with ``deterministic=True`` the
    three launches'. ``in_place``: the precision's dV and dK accumulate in place (numerics' ``in_place``), which
    on the Gluon kernels fuses dV's and dK's launches (their 64-query tiles); with ``p_static`` too the one launch
    runs at head dim 128 as well."""
    cfg = tile_configs(head_dim, device, head_dim_v)
    head_dim_v = head_dim_v or head_dim
    def gluon():
        return (dispatch.gluon_unavailable(device) is None
                and dispatch.use_gluon(device, head_dim, q_smoothing, varlen, softcap=bool(softcap),
                                       head_dim_v=head_dim_v))
    one_launch = (not key_shard
                  and gluon_one_launch_backward(deterministic, head_dim, head_dim_v, bool(softcap),
                                                in_place and p_static)
                  and gluon())
    if one_launch:
        return BackwardRule(ONE_LAUNCH_QUERY_TILE, cfg["dq"][1], False, True)
    if in_place and gluon():
        return BackwardRule(ONE_LAUNCH_QUERY_TILE, cfg["dq"][1], True, False)
    return BackwardRule(dkdv_block_m(cfg), cfg["dq"][1], True, False)


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    """How a forward call runs. ``family``: "gluon" (Hopper) or "triton" (the portable kernels); ``tiles``: the
    portable kernels' (``tile_configs``); ``pv_e4m3`` / ``p_static``: the numerics rule's P·V (the Gluon kernel's;
    the portable kernels compute the accurate rule); the Gluon launch's ``consumers``, ``pingpong``,
    ``named_barriers``, ``consumer_regs`` / ``loader_regs`` and persistent ``programs``."""
    family: str
    tiles: Mapping
    pv_e4m3: bool = False
    p_static: bool = False
    consumers: int = 2
    pingpong: bool = False
    named_barriers: bool = False
    consumer_regs: int = FORWARD_CONSUMER_REGS[2]
    loader_regs: int = FORWARD_LOADER_REGS
    programs: Optional[int] = None

    @property
    def gluon(self) -> bool:
        return self.family == "gluon"

    def hopper_schedule(self) -> dict:
        """The Gluon launch's schedule keywords (hopper_launch.forward_hopper_args')."""
        return dict(consumers=self.consumers, pingpong=self.pingpong, named_barriers=self.named_barriers,
                    consumer_regs=self.consumer_regs, loader_regs=self.loader_regs, programs=self.programs,
                    pv_e4m3=self.pv_e4m3, p_static=self.p_static)


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """How a backward call runs: ``family`` and ``tiles`` as ForwardPlan's; ``rule`` (``backward_rule``); on the
    Gluon kernels ``one_launch`` (dV, dK and dQ in one launch, dQ by reduce-adds) or three launches, dV's numerics
    rule (``pv_e4m3``, ``p_static``, ``do_sequence``), dK's (``dk_e4m3``; ``ds_bound``: the one launch's only), dP's
    (``dp_int8``: the one launch's only), whether dV and dK accumulate in place (``in_place``: one key-tile launch
    for both, or the one launch), the register split and persistent ``programs``."""
    family: str
    tiles: Mapping
    rule: BackwardRule
    pv_e4m3: bool = False
    p_static: bool = False
    dk_e4m3: bool = False
    do_sequence: bool = False
    in_place: bool = False
    dp_int8: bool = False
    ds_bound: bool = False
    consumer_regs: int = BACKWARD_CONSUMER_REGS
    loader_regs: int = BACKWARD_LOADER_REGS
    dq_buffers: int = ONE_LAUNCH_DQ_BUFFERS
    programs: Optional[int] = None

    @property
    def gluon(self) -> bool:
        return self.family == "gluon"

    @property
    def one_launch(self) -> bool:
        return self.gluon and self.rule.one_launch


def forward_plan(device: torch.device, head_dim: int, head_dim_v: int, *, q_smoothing: bool, varlen: bool,
                 masked: bool, softcap: bool, max_len_q: int, pv_e4m3: bool = False, p_static: bool = False,
                 empty: bool = False, mean_len_q: Optional[int] = None) -> ForwardPlan:
    """The plan of a forward call (``empty``: a side with no token, which the portable kernels take: a TMA
    descriptor cannot have a zero extent). ``pv_e4m3`` / ``p_static``: the call's numerics rule, which the Gluon
    kernel computes; the portable kernels' plan leaves them off. ``mean_len_q``: a packed batch's query rows over
    its sequences (default ``max_len_q``), which picks the consumer warpgroups: on documents of ~700 tokens whose
    longest passed 2,048, three ran the forward 0.79-0.98x as fast as two (H200, both presets, D=64 and 128)."""
    tiles = tile_configs(head_dim, device, head_dim_v)
    if empty or not dispatch.use_gluon(device, head_dim, q_smoothing, varlen, softcap=softcap, head_dim_v=head_dim_v):
        return ForwardPlan("triton", tiles)
    consumers = gluon_forward_consumers(head_dim, masked, softcap,
                                        max_len_q if mean_len_q is None else mean_len_q, pv_e4m3)
    pingpong = consumers == 2 and gluon_forward_pingpong(head_dim, head_dim_v, masked, softcap, max_len_q)
    return ForwardPlan("gluon", tiles, pv_e4m3=pv_e4m3, p_static=p_static, consumers=consumers, pingpong=pingpong,
                       named_barriers=gluon_forward_named_barriers(head_dim_v),
                       consumer_regs=FORWARD_CONSUMER_REGS[consumers], programs=gluon_programs(device))


def backward_plan(device: torch.device, head_dim: int, head_dim_v: int, *, q_smoothing: bool, varlen: bool,
                  softcap: float, deterministic: Optional[bool], key_shard: bool = False, pv_e4m3: bool = False,
                  p_static: bool = False, dk_e4m3: bool = False, do_sequence: bool = False,
                  in_place: bool = False, dp_int8: bool = False, ds_bound: bool = False,
                  empty: bool = False) -> BackwardPlan:
    """The plan of a backward call (arguments as ``forward_plan``'s and ``backward_rule``'s; ``pv_e4m3``,
    ``p_static``, ``dk_e4m3``, ``do_sequence``, ``dp_int8``, ``ds_bound``: the precision's rules, ``in_place``
    whether they let dV and dK sum in place: numerics.Numerics.in_place)."""
    tiles = tile_configs(head_dim, device, head_dim_v)
    rule = backward_rule(device, head_dim, head_dim_v, softcap=softcap, q_smoothing=q_smoothing, varlen=varlen,
                         deterministic=deterministic, key_shard=key_shard, in_place=in_place, p_static=p_static)
    if empty or not dispatch.use_gluon(device, head_dim, q_smoothing, varlen, softcap=bool(softcap),
                                       head_dim_v=head_dim_v):
        return BackwardPlan("triton", tiles, rule)
    return BackwardPlan("gluon", tiles, rule, pv_e4m3=pv_e4m3, p_static=p_static, dk_e4m3=dk_e4m3,
                        do_sequence=do_sequence, in_place=in_place, dp_int8=dp_int8, ds_bound=ds_bound,
                        programs=gluon_programs(device))
