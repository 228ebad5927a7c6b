"""The one place that picks a kernel family for a call: Hopper's Gluon kernels or the portable ``tl.dot`` ones.

``SAGEBWD_KERNELS`` (read on every call) forces a choice:

* ``auto`` (default): on an sm_90 GPU with a Triton whose Gluon API they are tested on (``GLUON_TESTED``;
  another release runs the portable kernels there, with one warning),
  the Gluon forward for the calls it takes where it measured faster (at head dim 128, a causal or windowed call
  from ``GLUON_MIN_KEYS_D128`` keys, the longest sequence's, on: now every length) and the Gluon backward, padded
  or packed; the portable kernels everywhere else.
* ``triton``: always the portable kernels (Ampere, Ada, Hopper, Blackwell, the interpreter).
* ``gluon``: the Gluon kernels on an sm_90 GPU (H100, H200), also on an untested Triton release, for the calls
  they take (head dims 64, 128, or MLA's 192 for Q/K with 128 for V; no Q-smoothing; padded or packed); any
  other call runs the portable kernels, with one warning. On a GPU that is
  not sm_90, or without Gluon, it raises.

``SAGEBWD_BACKWARD`` (read on every call; the op's ``deterministic`` argument wins over it): ``fast`` (default)
or ``deterministic``, see ``BACKWARD_ENV`` below.

``kernel_counts()`` says which ran (``sagebwd_hf.attention_stats()["kernels"]`` too).
"""
import collections
import functools
import os
import warnings
from typing import Optional

import torch
import triton

ENV_VAR = "SAGEBWD_KERNELS"
CHOICES = ("auto", "gluon", "triton")
# Triton major.minor releases the Gluon kernels were run and checked on (the GPU suite on an H100: 3.6, the GPU
# machines' own; 3.7, 3.8 and 3.9, carried there by benchmarks/device_triton.sh, session 25; the op's speed
# measured on each, 3.8 in session 26). torch 2.12 and 2.13 require Triton 3.7, torch 2.14 requires 3.8.
GLUON_TESTED = ("3.6", "3.7", "3.8", "3.9")
# (Q/K head dim, V head dim) pairs the Gluon kernels take: MLA's 192/128 (DeepSeek V2/V3, session 17) beside
# the square ones; forward_hopper.qk_blocks says how 192 is tiled
GLUON_HEAD_DIMS = ((64, 64), (128, 128), (192, 128))
# Measured on an H100 (docs/speed_notes.md, session 4), whole forward against the portable kernels: 1.02-1.24x
# at D=128 from 4K keys, 1.01-1.08x at D=64 (1K-16K), but 0.93x at D=128 with 1K keys. Kernels alone (session
# 14): at D=128 with 1K keys 1.15x without a mask but 0.97x causal (2K: 1.15x, 1.04x), so below
# GLUON_MIN_KEYS_D128 masked (causal or windowed) calls stayed portable. Session 21 (H200, kernels alone, the
# persistent kernel with P in operand order): 1.14x causal at 1K keys, 1.24x at 2K (1.23x, 1.26x unmasked), so
# every length runs on Gluon; the threshold stays as the knob.
GLUON_BY_DEFAULT = True
GLUON_MIN_KEYS_D128 = 0
# The Gluon backward (dV, dK, dQ launches, kernels/backward_hopper.py) for padded batches.
GLUON_BWD_BY_DEFAULT = True
# Soft-capped scores. Session 11 (tanh from exp2 and rcp.approx, three MUFU ops a score): the Gluon forward only
# 1.00-1.04x the portable one unmasked, 0.83-0.93x causal, so auto ran capped forwards portable. Session 18
# (tanh.approx, two MUFU ops; H100, cap 50, whole op): the capped forward 1.01-1.13x faster on Gluon than
# portable (D=128 N=1K/4K and D=64 N=4K, causal or not).
GLUON_SOFTCAP_FORWARD = True
# Three consumer warpgroups in the Gluon forward (192 query rows a program, FlashAttention 3's head-dim-64
# tile) once K's scale is one per key tile. Kernels alone on an H100 (B*N = 32K, H*D = 2048), against two
# consumers: at D=64 (spill-free at 160 registers, session 15) 1.13x at 4K and 16K keys without a mask, 1.02x at
# 1K; at D=128 (a few spilled registers a tile, session 16, two runs) 1.07-1.08x at 4K, 1.09-1.11x at 16K, 1.01x
# at 1K; causal 0.55-0.95x at D=64, 0.56-0.88x at D=128: 192-row programs cross the diagonal on more tiles.
# MLA's 192/128 (session 17, one run, 4K keys): 1.04x without a mask, 0.63x causal (0.82x at 16K).
# Soft-capped (session 18, cap 50, 2K/4K/16K keys): 1.09 / 1.06 / 1.04x at D=64, 1.01 / 0.98 / 0.97x at D=128.
# So unmasked, from this many query rows (the longest sequence's), and capped only at D=64.
GLUON_THREE_CONSUMERS_MIN_QUERIES = 2048
# A persistent Gluon forward: one program per SM taking work items (the query tiles of a sequence and head) from an
# atomic counter, so the next item's Q and first K / V tiles load while this one's epilogue runs, and causal
# calls' uneven items balance (forward_hopper_args's ``programs``). Kernels alone on an H100 against one program an
# item (session 20, B*N = 32K, H*D = 2048): 1.02-1.08x at 1K-4K query rows without a mask, 1.00-1.05x causal
# (0.98x at D=64 1K), 1.01-1.05x at 16K but 0.95x at D=64 16K without a mask. A static round-robin schedule was
# 0.82-0.96x causal (unbalanced).
GLUON_FORWARD_PERSISTENT = True
# The Gluon backward's dV, dK and dQ launches on the same schedule (session 20, same shapes, all three launches
# against the previous kernels): 1.01-1.03x at D=128, 1.03-1.08x at D=64 without a mask, 0.98-1.00x D=64 causal.
GLUON_BACKWARD_PERSISTENT = True
# The backward's determinism (``BACKWARD_ENV``): "fast" (default) lets Hopper calls at head dim 64 without a cap run
# FlashAttention 3's one launch (backward_hopper ``fused_dq``: dQ added up by fp32 reduce-adds, whose order varies;
# 64-query tiles and dQ's product unquantized, so other numbers, more accurate ones: naive's ``dq_int8=False``,
# interface.backward_rule); "deterministic" runs dV, dK and dQ as three launches, each gradient written once,
# bit-identical run to run. Every other call is deterministic either way. H100, the backward's kernels against
# the three launches (session 27, B*N = 32K, H*D = 2048, and Llama-3.2-1B's 32/8 heads at 8K): 1.11-1.15x at
# 1K-16K keys, causal or not, except 1.06x causal at 1K (0.94-0.97x before dQ's scale moved into the kernel: the
# masked threshold, kept as a knob, is 0). Training steps (e2e.py, Llama-3.2-1B's shape, 8K): 840.9 ms against
# 855.9. The default since session 28 (issue 11: the fast mode by default, determinism on request).
# ``torch.use_deterministic_algorithms(True)`` keeps the three launches whatever the variable says.
BACKWARD_ENV = "SAGEBWD_BACKWARD"
BACKWARD_CHOICES = ("deterministic", "fast")
BACKWARD_DEFAULT = "fast"
ONE_LAUNCH_HEAD_DIMS = ((64, 64), )
# Its query tile (backward_hopper.FUSED_QUERY_TILE): P^T's and dS^T's per-key scales span this many queries, so it
# is part of the numerics (interface.backward_rule); here so that CPU code can say it without importing Gluon
ONE_LAUNCH_QUERY_TILE = 64
ONE_LAUNCH_MIN_KEYS_MASKED = 0

_counts = collections.Counter()    # "fwd_gluon", "fwd_triton", ... -> launches
_warned = set()
_unavailable = {}                  # CUDA device index -> gluon_unavailable's answer


def kernel_counts() -> dict:
    """Kernel launches per (pass, family) since the last reset, e.g. ``{"fwd_gluon": 12, "bwd_triton": 12}``."""
    return dict(_counts)


def reset_kernel_counts() -> None:
    _counts.clear()


def count(name: str) -> None:
    _counts[name] += 1


def requested() -> str:
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV_VAR} must be one of {CHOICES}, got {os.environ.get(ENV_VAR)!r}")
    return value


def _triton_minor() -> str:
    return ".".join(triton.__version__.split(".")[:2])


def gluon_unavailable(device: torch.device):
    """Why the Gluon kernels cannot run on ``device`` (a string), or None when they can."""
    if device.type != "cuda":
        return f"{device.type} tensors (the Gluon kernels need a CUDA GPU; the interpreter does not run Gluon)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 (the interpreter does not run Gluon)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _unavailable:       # asked on every call: the capability query and import cost host time
        _unavailable[index] = _gluon_unavailable_on(device)
    return _unavailable[index]


def _gluon_unavailable_on(device: torch.device):
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"compute capability {capability[0]}.{capability[1]} (the Gluon kernels are for sm_90: H100, H200)"
    try:
        from . import forward_hopper  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (an old Triton without Gluon, or a Gluon with another API)
        return f"triton {triton.__version__} cannot build the Gluon kernels ({type(exc).__name__}: {exc})"
    return None


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device: the grid of a persistent launch (one program per SM)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _is_hopper(device: torch.device) -> bool:
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device) == (9, 0))


def untested_triton() -> Optional[str]:
    """Why ``auto`` keeps the Gluon kernels off whatever the GPU, when this Triton is not a tested release."""
    if _triton_minor() in GLUON_TESTED:
        return None
    return f"Triton {triton.__version__} is not a release the Hopper (Gluon) kernels are tested on " \
           f"({', '.join(GLUON_TESTED)})"


def _warn_untested_triton(device: torch.device) -> None:
    """auto on an H100/H200 with a Triton the Gluon kernels were not run on: they stay off, and once per
    process the user learns that this GPU runs the slower portable kernels, and why."""
    if "untested_triton" in _warned or not _is_hopper(device):
        return
    _warned.add("untested_triton")
    warnings.warn(f"sagebwd: {untested_triton()}, so this sm_90 GPU runs the portable Triton kernels, which are "
                  f"slower (README, Speed). {ENV_VAR}=gluon runs the Gluon kernels anyway; {ENV_VAR}=triton "
                  f"keeps the portable ones without this warning.", stacklevel=4)


def gluon_forward_consumers(head_dim: int, masked: bool, softcap: bool, max_len_q: int) -> int:
    """Consumer warpgroups of a Gluon forward launch (``forward_hopper_args``'s ``consumers``)."""
    three = (head_dim in (64, 128, 192) and not masked and (not softcap or head_dim == 64)
             and max_len_q >= GLUON_THREE_CONSUMERS_MIN_QUERIES)
    return 3 if three else 2


# Ping-pong turns between the two consumer warpgroups of a Gluon forward at V's head dim 128 (forward_hopper_args's
# ``pingpong``; FlashAttention 3's scheduler barrier). On in every such launch until session 26, which measured it
# again on the persistent kernels (H100, kernels alone, B*N = 32K, three alternated runs each, outputs
# bit-identical; time with it over time without): D=128 causal 1K 1.01, 2K 0.99, 4K 0.97, 16K 0.94; D=128 1K
# without a mask 1.05; MLA's 192/128 1K 1.03, 4K causal 1.04. So on for masked square-head calls from this many
# query rows; soft-capped calls, not measured, keep it; off at 64 (session 18).
GLUON_PINGPONG_MIN_QUERIES = 2048


def gluon_forward_pingpong(head_dim: int, head_dim_v: int, masked: bool, softcap: bool, max_len_q: int) -> bool:
    """Whether a two-consumer Gluon forward launch takes turns (``forward_hopper_args``'s ``pingpong``)."""
    if head_dim_v != 128:
        return False
    return softcap or (head_dim == 128 and masked and max_len_q >= GLUON_PINGPONG_MIN_QUERIES)


def backward_requested() -> str:
    value = os.environ.get(BACKWARD_ENV, BACKWARD_DEFAULT).strip().lower() or BACKWARD_DEFAULT
    if value not in BACKWARD_CHOICES:
        raise ValueError(f"{BACKWARD_ENV} must be one of {BACKWARD_CHOICES}, got {os.environ.get(BACKWARD_ENV)!r}")
    return value


def gluon_one_launch_backward(deterministic: Optional[bool], head_dim: int, head_dim_v: int, softcap: bool,
                              masked: bool, max_len_k: int) -> bool:
    """Whether a backward that runs on the Gluon kernels takes the one launch: ``deterministic`` False (the op's
    argument; None asks ``BACKWARD_ENV``, "fast" meaning False), determinism not demanded by torch, head dims it
    fits, no cap (its K-smoothing term needs dS's row sums; the sinks' is given), and with a causal or windowed
    mask from ONE_LAUNCH_MIN_KEYS_MASKED keys."""
    if deterministic is None:
        deterministic = backward_requested() == "deterministic"
    if deterministic or torch.are_deterministic_algorithms_enabled():
        return False
    return ((head_dim, head_dim_v) in ONE_LAUNCH_HEAD_DIMS and not softcap
            and (not masked or max_len_k >= ONE_LAUNCH_MIN_KEYS_MASKED))


def gluon_programs(device: torch.device, backward: bool = False) -> Optional[int]:
    """Programs of a Gluon launch (``forward_hopper_args``'s and the backward's ``programs``): one per SM, or
    None (one per work item) without GLUON_FORWARD_PERSISTENT / GLUON_BACKWARD_PERSISTENT."""
    return sm_count(device) if (GLUON_BACKWARD_PERSISTENT if backward else GLUON_FORWARD_PERSISTENT) else None


def use_gluon(device: torch.device, head_dim: int, q_smoothing: bool, varlen: bool = False,
              seqlen_k: int = 1 << 30, backward: bool = False, softcap: bool = False,
              head_dim_v: Optional[int] = None, masked: bool = True) -> bool:
    """True when this call runs the Gluon (Hopper) kernels (``seqlen_k``: the longest key sequence;
    ``masked``: a causal or windowed call;
    ``backward``: the choice for the backward pass;
    ``softcap``: soft-capped scores (both families compute them; ``auto`` keeps the forward of such calls on
    the portable kernels, see ``GLUON_SOFTCAP_FORWARD``); ``head_dim_v``: V's head dim (None: Q's), the pair
    one of ``GLUON_HEAD_DIMS``)."""
    choice = requested()
    if choice == "triton":
        return False
    takes_call = (head_dim, head_dim_v or head_dim) in GLUON_HEAD_DIMS and not q_smoothing
    if choice == "auto":
        if backward:
            faster = GLUON_BWD_BY_DEFAULT
        else:
            faster = (GLUON_BY_DEFAULT and (head_dim != 128 or seqlen_k >= GLUON_MIN_KEYS_D128 or not masked)
                      and (GLUON_SOFTCAP_FORWARD or not softcap))
        if not (takes_call and faster):
            return False
        if untested_triton() is not None:
            _warn_untested_triton(device)
            return False
        return gluon_unavailable(device) is None
    reason = gluon_unavailable(device)
    if reason is not None:
        raise ValueError(f"{ENV_VAR}=gluon, but the Gluon kernels cannot run here: {reason}. "
                         f"Use {ENV_VAR}=auto or triton.")
    if not takes_call:
        key = (head_dim, head_dim_v, q_smoothing, softcap)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"{ENV_VAR}=gluon: the Gluon kernels take (Q/K, V) head dims {GLUON_HEAD_DIMS} "
                          f"without Q-smoothing; this call's kernels (head dim {head_dim}, V's "
                          f"{head_dim_v or head_dim}, q_smoothing={q_smoothing}, packed={varlen}, "
                          f"softcap={softcap}) run the portable Triton kernels", stacklevel=4)
        return False
    return True
