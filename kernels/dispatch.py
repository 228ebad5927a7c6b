"""The one place that picks a kernel family for a call: Hopper's Gluon kernels or the portable ``tl.dot`` ones.

``SAGEBWD_KERNELS`` (read on every call) forces a choice:

* ``auto`` (default): the portable kernels, until the Gluon ones are faster (``GLUON_BY_DEFAULT``; then: Gluon
  on an sm_90 GPU with a Triton whose Gluon API they are tested on, ``GLUON_TESTED``, for the calls they take).
* ``triton``: always the portable kernels (Ampere, Ada, Hopper, Blackwell, the interpreter).
* ``gluon``: the Gluon forward on an sm_90 GPU (H100, H200), also on an untested Triton release, for the calls
  it takes (head dim 64 or 128, no Q-smoothing, padded batches); any other call runs the portable kernels,
  with one warning. On a GPU that is not sm_90, or without Gluon, it raises.

``kernel_counts()`` says which ran (``sagebwd_hf.attention_stats()["kernels"]`` too).
"""
import collections
import os
import warnings

import torch
import triton

ENV_VAR = "SAGEBWD_KERNELS"
CHOICES = ("auto", "gluon", "triton")
GLUON_TESTED = ("3.6",)            # Triton major.minor releases the Gluon kernels were run and checked on
GLUON_HEAD_DIMS = (64, 128)
# Off: measured on an H100 (docs/speed_notes.md) the Gluon forward runs at 1.01-1.05x the portable kernel at
# D=128 and 0.86-0.95x at D=64, and it faults on packed batches.
GLUON_BY_DEFAULT = False

_counts = collections.Counter()    # "fwd_gluon", "fwd_triton", ... -> launches
_warned = set()


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
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"compute capability {capability[0]}.{capability[1]} (the Gluon kernels are for sm_90: H100, H200)"
    try:
        from . import forward_hopper  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (an old Triton without Gluon, or a Gluon with another API)
        return f"triton {triton.__version__} cannot build the Gluon kernels ({type(exc).__name__}: {exc})"
    return None


def use_gluon(device: torch.device, head_dim: int, q_smoothing: bool, varlen: bool = False) -> bool:
    """True when this call runs the Gluon (Hopper) kernels."""
    choice = requested()
    if choice == "triton":
        return False
    takes_call = head_dim in GLUON_HEAD_DIMS and not q_smoothing and not varlen
    if choice == "auto":
        return (GLUON_BY_DEFAULT and takes_call and _triton_minor() in GLUON_TESTED
                and gluon_unavailable(device) is None)
    reason = gluon_unavailable(device)
    if reason is not None:
        raise ValueError(f"{ENV_VAR}=gluon, but the Gluon kernels cannot run here: {reason}. "
                         f"Use {ENV_VAR}=auto or triton.")
    if not takes_call:
        key = (head_dim, q_smoothing, varlen)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"{ENV_VAR}=gluon: the Gluon kernels take padded batches with head dims "
                          f"{GLUON_HEAD_DIMS} and no Q-smoothing; this call (head dim {head_dim}, "
                          f"q_smoothing={q_smoothing}, packed={varlen}) runs the portable Triton kernels",
                          stacklevel=4)
        return False
    return True
