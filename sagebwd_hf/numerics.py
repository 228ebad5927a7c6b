"""Numerics presets: which rounding each low-precision product of SageBwd uses.

``precision="accurate"`` (the default) is the rule every kernel computes. ``precision="fast"`` is ``pv_e4m3`` with
``p_static``: the cheaper rules the Hopper kernels compute forward and backward. ``precision="fastest"`` is "fast"
with ``do_sequence`` and ``dk_e4m3``: the rules under which dV's and dK's products keep their scales along the sum,
so the Hopper backward accumulates them in place and computes S and dP once (one launch at head dims 64 and 128).
Each rule is also selectable on its own by joining rule names with ``+`` (``precision="pv_e4m3+ds_tile"``):

* ``pv_e4m3``: P·V (forward) and Pᵀ·dO (backward) in FP8 e4m3 instead of INT8. P, in [0, 1], is mapped onto
  e4m3's largest value 448; V gets one scale per channel, dO one per token (one per channel of a query tile with
  ``p_static``), each mapping its largest magnitude onto 448.
* ``p_static``: P gets a fixed scale instead of one from a max: in the forward the running row max (which the
  online softmax keeps anyway) maps to 127 (448 with e4m3) instead of each key tile's max; in the backward P ∈ [0, 1]
  maps to 127 (448) without a per-key max over the query tile. dO's scale then may not vary along the queries a
  tile sums over: one per channel per ``DS_TILE`` queries.
* ``ds_tile``: dS gets one scale per ``DS_TILE`` x ``DS_TILE`` tile, so one INT8 dS serves dK = dSᵀ·Q and
  dQ = dS·K, instead of one scale per key (dK) and another per query (dQ). Q's and K's scales in these two products
  are then one per ``DS_TILE`` tokens (K's already is at head dims 64, 128 and 192).
* ``dk_e4m3``: dK = dSᵀ·Q in FP8 e4m3 instead of INT8: Q one e4m3 scale per token, folded into dS, and dS one per
  key per query tile (its largest magnitude mapped to 448), as INT8's. e4m3's exponent keeps dS's small values,
  and an e4m3 product accumulates in fp32 on the tensor core: the Hopper kernels sum dK in place across query tiles
  (each key row rescaled to its latest tile's scale), with no int32 partial to convert every tile.
* ``do_sequence`` (with ``p_static``): dO gets one e4m3 scale per channel over its whole sequence and the query
  heads of its KV group, instead of one per query tile: P's and dO's scales then hold along all of dV's sum, which
  the Hopper kernels accumulate in place and scale once at the end.
* ``dp_int8``: dP = dO·Vᵀ in INT8 instead of 16-bit, dO one scale per token and V one per ``K_SCALE_BLOCK`` keys
  of its sequence (K's blocks): both scales factor out of the sum over channels, so one INT8 product unit replaces
  a 16-bit one. Only the Hopper one launch computes it, and only with the fastest preset's other rules.
* ``ds_bound`` (with ``dk_e4m3``): dK's dS gets one fixed scale per query row instead of one per key per query
  tile: each row is divided by a bound of its largest |dS|, ``max_k P · (|dO| · |V|max + |δ|)`` (max_k P =
  exp2(m − lse), the forward's row maximum of P; |V|max the norm of V's channel maxima over the sequence), and
  mapped onto 448. The bound multiplies Q's rows instead, in e4m3 with one scale per channel over the sequence and
  the KV group, applied to dK's columns after the sum. No scale then changes along dK's sum: no per-key maximum
  and no rescale of the accumulator. Only the Hopper one launch computes it, with the fastest preset's other rules
  (the Gluon forward keeps each row's largest score for it).

``ds_tile``, ``dk_e4m3``, ``do_sequence``, ``dp_int8`` and ``ds_bound`` change only the backward. QKᵀ stays INT8
with K-smoothing and dP = dO·Vᵀ stays in 16-bit in every preset. The PyTorch reference
(``sagebwd_hf.naive``) computes every rule; the Gluon kernels (Hopper) compute "accurate", ``pv_e4m3`` and
``pv_e4m3+p_static`` ("fast") forward and backward, each with or without ``dk_e4m3``, and "fastest" with or without
``dp_int8`` and ``ds_bound`` (and the forward of every rule with ``ds_tile``, a backward rule no kernel computes: its
accuracy is measured, its speed is not), the portable kernels "accurate" only; a kernel call that needs another
rule from them raises NotImplementedError (``interface.check_kernels_compute``).
docs/fast_preset.md has the rules' accuracy and costs.
"""
from typing import NamedTuple

import torch

from .kernels.constants import E4M3_MAX, INT8_MAX  # (named here too: the rules' scales)

DS_TILE = 64          # queries and keys per dS scale under ds_tile; tokens per Q scale in dK's product


class Numerics(NamedTuple):
    """Which cheaper rules a call uses (all False: "accurate")."""
    pv_e4m3: bool = False
    p_static: bool = False
    ds_tile: bool = False
    dk_e4m3: bool = False
    do_sequence: bool = False
    dp_int8: bool = False
    ds_bound: bool = False

    @property
    def forward(self) -> "Numerics":
        """The rules of the forward (the backward-only ones off)."""
        return self._replace(ds_tile=False, dk_e4m3=False, do_sequence=False, dp_int8=False, ds_bound=False)

    @property
    def in_place(self) -> bool:
        """Whether dV's and dK's products keep their scales along the sum (up to a per-row rescale), so the Hopper
        kernels accumulate them in place: e4m3 products, P's scale per key a tile or fixed with dO's per sequence."""
        return self.pv_e4m3 and self.dk_e4m3 and (not self.p_static or self.do_sequence)

    @property
    def p_max(self) -> float:
        """What P's largest value maps to: e4m3's 448 or INT8's 127."""
        return E4M3_MAX if self.pv_e4m3 else INT8_MAX


RULES = Numerics._fields
ACCURATE = Numerics()
FAST = Numerics(pv_e4m3=True, p_static=True)
FASTEST = Numerics(pv_e4m3=True, p_static=True, dk_e4m3=True, do_sequence=True)
PRESETS = {"accurate": ACCURATE, "fast": FAST, "fastest": FASTEST}
ALLOWED = ("accurate", "fast", "fastest", "rule names joined by '+': " + ", ".join(RULES))


def parse_precision(precision: str, argument: str = "precision") -> Numerics:
    """A preset name or rule names joined by ``+`` -> Numerics. ValueError naming ``argument`` otherwise."""
    if isinstance(precision, str):
        if precision in PRESETS:
            return PRESETS[precision]
        names = precision.split("+")
        if all(name in RULES for name in names) and len(set(names)) == len(names):
            rules = Numerics(**{name: True for name in names})
            if rules.do_sequence and not rules.p_static:
                raise ValueError(f"{argument}: do_sequence is a rule of p_static's dO scales (add p_static and "
                                 f"pv_e4m3), got {precision!r}")
            if rules.ds_bound and not rules.dk_e4m3:
                raise ValueError(f"{argument}: ds_bound is a rule of dk_e4m3's dK product (add dk_e4m3), got "
                                 f"{precision!r}")
            return rules
    raise ValueError(f"{argument} must be 'accurate', 'fast', 'fastest' or rule names joined by '+' "
                     f"({', '.join(RULES)}), got {precision!r}")


def precision_name(numerics: Numerics) -> str:
    """The canonical string of ``numerics``: a preset's name, else its rules joined by ``+``."""
    for name, preset in PRESETS.items():
        if numerics == preset:
            return name
    return "+".join(name for name in RULES if getattr(numerics, name))


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) rounded to float8 e4m3fn as a kernel's saturating convert does (nearest, ties to even; beyond
    448 saturates), returned as fp32."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
