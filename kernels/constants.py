"""Numbers that the kernels, the dispatch policy and the PyTorch reference (``sagebwd_hf.naive``) share.

Plain Python, no Triton import: the reference and the dispatch policy read them on machines without Gluon.
Block sizes here are part of the numerics (each one sets which tokens share a quantization scale), so the
kernels and the reference must agree on them.
"""

LOG2E = 1.4426950408889634   # the kernels' softmax runs in base 2: scores and caps are scaled by log2(e)

# The quantization's numbers. Each is written once here; the Triton and Gluon kernels read them as constexpr
# globals (quantize.py wraps them for the @triton.jit code, hopper_common.py for the Gluon kernels), so every use
# compiles to the same float32 constant.
INT8_MAX = 127.0               # what a block's largest magnitude maps to in INT8
LOG2_127 = 6.988684686772166   # log2(INT8_MAX): P's exponent offset when its largest value maps to 127
E4M3_MAX = 448.0               # FP8 e4m3's largest finite value: the largest magnitude maps to it with e4m3 bytes
LOG2_448 = 8.807354922057604   # log2(E4M3_MAX)
# The smallest max |x| that gets a scale: a block whose largest magnitude is at most this (a denormal) quantizes to
# zeros, since 127 / max would overflow to inf and 0 * inf is NaN. Far below any value that moves a bf16 result.
# Also the floor the forward kernels clamp Q's scale to (masked -inf scores are scaled by it).
TINY_SCALE = 1e-30
# The float-add rounding trick (quantize.round_to_int8, int32_times): x + 1.5 * 2^23 for |x| < 2^22 leaves round(x)
# (ties to even) in the low mantissa bits; an int32 plus FLOAT_ROUND_BIAS_BITS (the bias's float32 bit pattern)
# read as a float is 1.5 * 2^23 plus that integer, exactly.
FLOAT_ROUND_BIAS = 12582912.0          # 1.5 * 2**23
FLOAT_ROUND_BIAS_BITS = 0x4B400000     # FLOAT_ROUND_BIAS's float32 bits

# Triton major.minor releases the Gluon kernels and the direct relaunch (launch.py) are tested on: the GPU suite
# passed on each (H100); torch 2.12 and 2.13 require Triton 3.7, torch 2.14 requires 3.8.
TESTED_TRITON = ("3.6", "3.7", "3.8", "3.9")

# (Q/K head dim, V head dim) pairs the Gluon kernels take: the square ones and MLA's 192/128 (DeepSeek V2/V3;
# hopper_launch.qk_blocks says how 192 is tiled).
GLUON_HEAD_DIMS = ((64, 64), (128, 128), (192, 128))

Q_SMOOTH_BLOCK = 128   # tokens per Q-smoothing mean; every kernel's query tile divides it

# At head dims 64, 128 and 192 K's scale is one per run of K_SCALE_BLOCK tokens from each sequence's start
# (SageAttention's per-block rule), elsewhere one per token. It is the Hopper kernels' key tile: a tile's K scale
# is one number that joins each query row's constant instead of a multiply per score. A token's max over few
# channels varies more: at small head dims (16) per-block scales grew the logits error by 30%, and the portable
# kernels that run other head dims gain nothing from them. Against per-token scales (fp64 reference, D=128): O, dQ,
# dK, dV cosine within 3e-5.
K_SCALE_BLOCK = 128
K_BLOCK_HEAD_DIMS = (64, 128, 192)

# The one-launch backward's query tile: P^T's and dS^T's per-key scales span this many queries, so it is part of
# the numerics (plan.backward_rule), and CPU code must know it without importing Gluon. With 128 queries S^T
# and dP^T take 64 registers each and the loop spilled ~1 KB at D=64 (sm_90); 64 is FlashAttention 3's tile there.
ONE_LAUNCH_QUERY_TILE = 64
