"""The one place that picks a kernel family for a call: Hopper's Gluon kernels or the portable ``tl.dot`` ones.

``SAGEBWD_KERNELS`` (read on every call) forces a choice:

* ``auto`` (default): on an sm_90 GPU (H100, H200) with a Triton release the Gluon kernels are tested on
  (``constants.TESTED_TRITON``; another release runs the portable kernels there, with one warning), the Gluon
  forward and backward for every call they take; the portable kernels everywhere else.
* ``triton``: always the portable kernels (Ampere, Ada, Hopper, Blackwell, the interpreter).
* ``gluon``: the Gluon kernels on an sm_90 GPU, also on an untested Triton release, for the calls they take;
  any other call runs the portable kernels, with one warning. On a GPU that is not sm_90, or without Gluon,
  it raises.

The Gluon kernels take (Q/K, V) head dims ``GLUON_HEAD_DIMS`` (64, 128, and MLA's 192 with 128 for V), no
Q-smoothing, padded or packed batches, causal or windowed masks, soft caps and sinks.

``SAGEBWD_BACKWARD`` (read on every call; the op's ``deterministic`` argument wins over it): ``fast`` (default)
or ``deterministic``, see ``plan.gluon_one_launch_backward``.

This module imports no Gluon at import time (``gluon_unavailable`` imports the kernels lazily, once per device).
``kernel_counts()`` says which family ran (``sagebwd_hf.attention_stats()["kernels"]`` too).
"""
import collections
import functools
import os
import warnings
from typing import Optional

import torch
import triton

from .constants import GLUON_HEAD_DIMS, TESTED_TRITON

ENV_VAR = "SAGEBWD_KERNELS"
CHOICES = ("auto", "gluon", "triton")
BACKWARD_ENV = "SAGEBWD_BACKWARD"
BACKWARD_CHOICES = ("deterministic", "fast")
BACKWARD_DEFAULT = "fast"

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
    if _triton_minor() in TESTED_TRITON:
        return None
    return f"Triton {triton.__version__} is not a release the Hopper (Gluon) kernels are tested on " \
           f"({', '.join(TESTED_TRITON)})"


def _warn_untested_triton(device: torch.device) -> None:
    """auto on an H100/H200 with a Triton the Gluon kernels were not run on: they stay off, and once per
    process the user learns that this GPU runs the slower portable kernels, and why."""
    if "untested_triton" in _warned or not _is_hopper(device):
        return
    _warned.add("untested_triton")
    warnings.warn(f"sagebwd: {untested_triton()}, so this sm_90 GPU runs the portable Triton kernels, which are "
                  f"slower (README, Speed). {ENV_VAR}=gluon runs the Gluon kernels anyway; {ENV_VAR}=triton "
                  f"keeps the portable ones without this warning.", stacklevel=4)


def backward_requested() -> str:
    value = os.environ.get(BACKWARD_ENV, BACKWARD_DEFAULT).strip().lower() or BACKWARD_DEFAULT
    if value not in BACKWARD_CHOICES:
        raise ValueError(f"{BACKWARD_ENV} must be one of {BACKWARD_CHOICES}, got {os.environ.get(BACKWARD_ENV)!r}")
    return value


def use_gluon(device: torch.device, head_dim: int, q_smoothing: bool, varlen: bool = False, softcap: bool = False,
              head_dim_v: Optional[int] = None) -> bool:
    """True when this call runs the Gluon (Hopper) kernels: the pair (``head_dim``, ``head_dim_v``, None meaning
    Q's) one of ``GLUON_HEAD_DIMS``, no ``q_smoothing``, and ``SAGEBWD_KERNELS`` and the device allowing it. The
    Gluon kernels take every length, mask, pass and cap alike (``varlen`` and ``softcap`` appear in the forced
    choice's warning). How a call runs on them is kernels/plan.py's."""
    choice = requested()
    if choice == "triton":
        return False
    takes_call = (head_dim, head_dim_v or head_dim) in GLUON_HEAD_DIMS and not q_smoothing
    if choice == "auto":
        if not takes_call:
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
