"""``python -m sagebwd_hf``: an environment report to paste into a bug report.

Versions (sagebwd-hf, Python, torch, Triton, Transformers, Accelerate, PEFT, datasets), each GPU and the kernel
family a call with head dim 64/128 would run on it (``kernels/dispatch.py``), the ``SAGEBWD_KERNELS`` setting,
whether compiled kernels are re-launched directly (``kernels/launch.py``), and whether
``attn_implementation="sagebwd"`` is registered with Transformers (attention and mask functions:
without the mask function Transformers hands the backend no mask).
"""
import importlib.metadata
import os
import platform
import sys


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _kernel_path(device) -> str:
    """Which kernel family a plain call (head dim 128, 4K keys) runs on ``device``, and why."""
    from .kernels import dispatch

    # auto on an untested Triton runs no Gluon kernel: said here, without spending use_gluon's one warning
    untested = dispatch.untested_triton() if dispatch.requested() == "auto" else None
    try:
        forward = not untested and dispatch.use_gluon(device, 128, q_smoothing=False)
        backward = not untested and dispatch.use_gluon(device, 128, q_smoothing=False)
    except ValueError as exc:              # SAGEBWD_KERNELS=gluon where Gluon cannot run
        return f"error: {exc}"
    if forward or backward:
        parts = [name for name, on in (("forward", forward), ("backward", backward)) if on]
        return (f"Gluon Hopper kernels for the {' and '.join(parts)} (kernels/forward_hopper.py, "
                f"backward_hopper.py) at (Q/K, V) head dims "
                f"{', '.join(f'{a}/{b}' for a, b in dispatch.GLUON_HEAD_DIMS)}; portable Triton kernels otherwise")
    reason = dispatch.gluon_unavailable(device)
    if reason is None:
        if untested:
            reason = f"off: {untested} ({dispatch.ENV_VAR}=gluon forces it)"
        elif dispatch.requested() == "triton":
            reason = f"off ({dispatch.ENV_VAR}=triton)"
        else:
            reason = "off (no Gluon kernel takes a head-dim-128 call here)"
    return f"portable Triton kernels (tl.dot); Gluon: {reason}"


def report() -> str:
    import torch

    from . import __version__
    lines = [f"sagebwd-hf {__version__}",
             f"python {platform.python_version()} ({sys.executable}) on {platform.platform()}"]
    lines += [f"{dist} {_version(dist)}" for dist in ("torch", "triton", "transformers", "accelerate", "peft",
                                                      "datasets")]
    lines.append(f"CUDA runtime {torch.version.cuda}; SAGEBWD_KERNELS={os.environ.get('SAGEBWD_KERNELS', '(unset)')}; "
                 f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '(unset)')}")
    if torch.cuda.is_available():
        from .kernels import launch
        lines.append(f"kernel launches: {launch.status()}")
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            lines.append(f"GPU {i}: {torch.cuda.get_device_name(i)} (sm_{major}{minor}): "
                         f"{_kernel_path(torch.device('cuda', i))}")
    else:
        lines.append("GPU: none; CPU tensors run the PyTorch path (sagebwd_hf.naive), or the Triton kernels under "
                     "the interpreter with TRITON_INTERPRET=1")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    attention = "sagebwd" in AttentionInterface()
    mask = "sagebwd" in AttentionMaskInterface()
    lines.append(f"Transformers registration: attention function {'yes' if attention else 'NO'}, "
                 f"mask function {'yes' if mask else 'NO'}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
