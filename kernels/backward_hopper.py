"""SageBwd backward on Hopper (sm_90), in Gluon: the key-tile kernel (dV, dK, or in one launch all three
gradients) and the dQ kernel, warp-specialized, TMA-fed, async wgmma.

Contract: backward.launch_backward's (hopper_launch.launch_backward_hopper launches them), at the portable
kernels' tiles, so the numerics are theirs: the key-tile launches walk 128-query tiles (P^T's and dS^T's per-key
scales), the dQ launch walks 128-key tiles (dS's per-query scales):

* dV (``_attn_bwd_dkdv_hopper_kernel``, ``DO_DV``): ``S^T = K8 Q8^T`` in INT8, dequantized with the item's one K
  scale (``TILE_KS``: the loader folds it into the per-query vectors, one FMA a score) and the per-token Q
  scales; ``P^T = exp2(S^T - lse)``; ``dV += P^T dO`` in INT8 (dO's per-token scale folded into P^T, ``FOLD``:
  as log2 in its exponent; P^T quantized per key over each query tile). ``PV_E4M3`` / ``P_STATIC`` compute the
  precision rules of those names (sagebwd_hf.numerics; ``naive.sagebwd_backward_naive`` is their spec): P^T and
  dO in FP8 e4m3 (P^T from registers, two scores a conversion, each key's max over the tile mapped to 448; dO^T's
  e4m3 bytes from shared memory, per-token scales folded as in INT8), or with ``P_STATIC`` P^T = 448 p and dO's
  scales per channel per query tile (the loader stages them; each tile's product takes them by one FMA); off,
  the kernel is the accurate one unchanged. dK and dQ are the same in these rules.
* dK (same kernel, ``DO_DK``): S^T and P^T again, ``dP^T = V dO^T`` in bf16/fp16, ``dS^T = P^T (dP^T - delta)``,
  ``dK += dS^T Q`` in INT8 (Q's per-token scale folded into dS^T).
* dQ (``_attn_bwd_dq_hopper_kernel``): ``S = Q8 K8^T``, ``dP = dO V^T``, ``dS = P (dP - delta)``, ``dQ += dS K``
  in INT8 (dS quantized per query over each key tile, whose one K scale joins the row's scale).
* the one launch (``DO_DQ``, FlashAttention 3's, D=64, 64-query tiles: ``constants.ONE_LAUNCH_QUERY_TILE``): the
  key-tile programs compute dV and dK and also dQ: each consumer stores its dS^T tile (bf16) to shared memory and
  announces it, waits for the other's only after its own dV product, then adds up its half of dQ's channels as
  ``dS K`` in the input dtype over the program's 128 keys (K as exact bf16 integers times its one scale), and a
  TMA reduce-add puts the fp32 result into a zeroed accumulator. dQ's product is unquantized (more accurate) and
  the adds' order varies: not bit-identical run to run. plan.gluon_one_launch_backward says when it runs.
* in place (``DK_E4M3``: dK = dS^T Q in e4m3, Q^T's e4m3 bytes from shared memory; ``IN_PLACE``: dV's and dK's e4m3
  products accumulate in their fp32 wgmma accumulators across every query tile, dV with no per-tile work under
  ``P_STATIC`` with dO's scales per sequence (applied at the end), dK and a per-tile-scaled dV after one multiply a
  row where a key's scale moved: backward_hopper_common.running_scale): the launch ``dkdv`` (dV and dK, S^T and
  dP^T once, 64-query tiles, each gradient written once) and the one launch, also at D=128 (one dQ staging buffer
  a consumer). ``ASYNC`` (in place with ``P_STATIC``, both gradients): dV's product issued before dS^T's math,
  dK's before the wait for the other consumer's dS^T, both waited for at the tile's end; P^T = 448 p.

Each of the three launches writes every gradient once (deterministic). Why three launches by default and not one:
INT8 wgmma accumulates in int32 and the quantization scale changes per tile, so each product is dequantized
through its own int32 registers into an fp32 accumulator; at D=128 the one launch's registers spill unless dV and dK
sum in place (above).

Schedule: the forward's (forward_hopper.py): a work item is 128 keys (dV, dK) or 128 queries (dQ) of one
(sequence, head); one program per SM takes items from an atomic counter (causal items longest first), or one
program runs one item. A loader warp posts each item to the two 64-row consumer warpgroups, brings the item's own
tile once they released the last one, and streams the other side's operands and per-query vectors through a
two-stage TMA ring.

Options: ``SOFTCAP`` (the capped scores recomputed as the forward does, dS times ``1 - tanh^2``); ``ROW_TERM``
(dQ: K-smoothing leaves ``rowsum(dS) * mean(k)`` out of dQ, zero unless a cap, sinks or one shard of a row's keys
make dS's rows not sum to zero; the epilogue adds it, with ``ROW_SUMS`` from the kernel's own dS); packed batches
(``IS_VARLEN``: token-major copies start 16-aligned, ``quantize.aligned_starts``); head dims 64, 128 and MLA's 192 for
Q/K with 128 for V (``QK_SPLIT``: two wgmmas for each product over Q's and K's channels, two accumulators for dK and dQ); no Q-smoothing.

The kernels live in backward_hopper_dkdv.py (the key-tile launches) and backward_hopper_dq.py (the dQ launch), what
both use in backward_hopper_common.py; this module names what hopper_launch reads.
"""
from .backward_hopper_common import HALF_N, STAGES  # noqa: F401
from .backward_hopper_dkdv import BLOCK_N, _attn_bwd_dkdv_hopper_kernel, _k_operand, _reduce_dq  # noqa: F401
from .backward_hopper_dq import BLOCK_M, _attn_bwd_dq_hopper_kernel  # noqa: F401
from .hopper_common import moved_to_hopper_launch, tma_atomic_add  # noqa: F401

__getattr__ = moved_to_hopper_launch(__name__, (
    'dkdv_hopper_args', 'dq_hopper_args', 'dkdv_query_tile', 'dq_key_tile', 'launch_backward_hopper',
    'launch_dkdv_hopper', 'launch_dq_hopper'))
