"""What the op launches for a grid of calls, launch by launch, without a GPU: each kernel's name, grid, constexprs,
scalar arguments and tensor arguments' shapes, strides and dtypes, with the Hopper (Gluon) path taken as on an
H100 (132 SMs). Launches are recorded, not run. Two trees that print the same text make the same launches::

    python tools/launch_record.py > /tmp/new.txt
    (cd OTHER_TREE && PYTHONPATH=$PWD python $OLDPWD/tools/launch_record.py) > /tmp/old.txt
    diff /tmp/old.txt /tmp/new.txt

It runs the ``sagebwd_hf`` that Python imports (the tree on PYTHONPATH), whatever tree this script is in.
"""
import contextlib
import itertools
import os
import warnings

os.environ.pop("TRITON_INTERPRET", None)
os.environ.pop("SAGEBWD_POISON", None)
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import sagebwd_hf  # noqa: E402
from sagebwd_hf import interface  # noqa: E402
from sagebwd_hf.kernels import backward, dispatch, forward, hopper_launch, quantize  # noqa: E402
from sagebwd_hf.kernels.constants import GLUON_HEAD_DIMS  # noqa: E402

SMS = 132
LOG = []


def _describe(x):
    if isinstance(x, torch.Tensor):
        return f"T{tuple(x.shape)}{tuple(x.stride())}{str(x.dtype)[6:]}"
    if isinstance(x, (bool, int, float, str)) or x is None:
        return repr(x)
    if hasattr(x, "block_shape"):   # a TMA descriptor
        return f"D{tuple(x.shape)}{tuple(x.strides)}{tuple(x.block_shape)}"
    return type(x).__name__


def _record(kernel, grid, *args, **kwargs):
    name = getattr(kernel, "__name__", None) or kernel.fn.__name__
    kw = {k: v for k, v in kwargs.items() if k != "ptx_options"}
    LOG.append(f"  {name} grid={tuple(grid) if not callable(grid) else 'fn'} "
               f"{' '.join(f'{k}={v!r}' for k, v in sorted(kw.items()))} | {' '.join(_describe(a) for a in args)}")


@contextlib.contextmanager
def hopper_stubs():
    def use_gluon(device, head_dim, q_smoothing, varlen=False, *args, head_dim_v=None, **kwargs):
        return (head_dim, head_dim_v or head_dim) in GLUON_HEAD_DIMS and not q_smoothing

    patches = [(m, "launch", _record) for m in (quantize, forward, backward, hopper_launch)]
    patches += [(interface, "_use_triton", lambda x: True), (dispatch, "use_gluon", use_gluon),
                (dispatch, "gluon_unavailable", lambda device: None), (dispatch, "sm_count", lambda device: SMS)]
    if hasattr(dispatch, "gluon_programs"):   # (a tree whose dispatch still holds the schedule)
        patches.append((dispatch, "gluon_programs", lambda device, backward=False: SMS))
    saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
    try:
        for m, n, v in patches:
            setattr(m, n, v)
        yield
    finally:
        for m, n, v in saved:
            setattr(m, n, v)


def calls():
    for (d, dv), causal, packed, extra, precision, det in itertools.product(
            [(64, 64), (128, 128), (192, 128), (96, 96)], [False, True], [False, True],
            ["", "softcap", "sinks", "window"], ["accurate", "fast"], [None, True]):
        if precision == "fast" and (d, dv) == (96, 96):
            continue
        yield dict(d=d, dv=dv, causal=causal, packed=packed, extra=extra, precision=precision, deterministic=det)


def run(case, n=2304):
    h, hk = 4, 2
    g = torch.Generator().manual_seed(0)
    mk = lambda heads, dim: torch.randn(1 if case["packed"] else 2, heads, n, dim, generator=g,  # noqa: E731
                                        dtype=torch.bfloat16)
    q, k, v = mk(h, case["d"]), mk(hk, case["d"]), mk(hk, case["dv"])
    kwargs = dict(causal=case["causal"], backend="triton", precision=case["precision"],
                  deterministic=case["deterministic"])
    if case["extra"] == "softcap":
        kwargs["softcap"] = 30.0
    elif case["extra"] == "sinks":
        kwargs["sinks"] = torch.zeros(h, requires_grad=True)
    elif case["extra"] == "window":
        kwargs["window_size"] = (300, 0)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    if case["packed"]:
        cu = torch.tensor([0, 700, 2304], dtype=torch.int32)
        flat = [x.detach()[0].transpose(0, 1).contiguous().requires_grad_() for x in leaves]
        out = sagebwd_hf.sagebwd_attn_varlen_func(*flat, cu, cu, 1604, 1604, **kwargs)
    else:
        out = sagebwd_hf.sagebwd_attn_func(*leaves, **kwargs)
    out.backward(torch.ones_like(out))


def main():
    with hopper_stubs():
        for case in calls():
            LOG.append(" ".join(f"{k}={v}" for k, v in case.items()))
            try:
                run(case)
            except Exception as exc:   # noqa: BLE001  (a refusal is part of what a call does)
                LOG.append(f"  raises {type(exc).__name__}: {str(exc)[:120]}")
    print("\n".join(LOG))


if __name__ == "__main__":
    main()
