"""Launching a Triton (or Gluon) kernel again without Triton's per-call Python.

``kernel[grid](*args, **kwargs)`` binds every argument, specializes each (dtype, 16-byte alignment, ints equal
to 1 or divisible by 16), builds a cache key and looks the compiled kernel up before it launches: ~170 µs
of host time a launch under cProfile with our 30-50 arguments, and one attention call makes 6 launches forward and 9 back.
For a short sequence or a small batch that host time, not the GPU, bounds a training step (H100, the 60m
preset at 8 x 1024 tokens: 4.7 ms of host time per attention forward + backward for 0.4 ms of GPU work,
``benchmarks/per_call.py --shapes proof``; docs/history.md).

``launch`` keeps the compiled kernel of each call under a key of its own that is at least as fine as Triton's
specialization (equal keys imply equal specializations: see ``_arg_key``), and launches it through
the compiled kernel's own launcher, the call Triton itself ends with. The first call of a key, and every call
where the key cannot be formed (an argument of another type), goes through ``kernel[grid]``, so compilation,
autotuning-free configs and errors stay Triton's.

It is on only where it was checked: a Triton release in ``TESTED`` (the launcher call is internal API), no
interpreter, no launch hooks (a profiler such as proton installs them), and ``SAGEBWD_FAST_LAUNCH`` not "0".
``SAGEBWD_CHECK_LAUNCH=1`` (the GPU tests set it) also asks Triton's own binder on every fast launch and raises
if it would have picked another compiled kernel.
"""
import os

import torch
import triton
from triton.runtime.jit import JITFunction

from .constants import TESTED_TRITON as TESTED   # the releases whose launcher call this module was checked on

_MAJOR_MINOR = ".".join(triton.__version__.split(".")[:2])


def _off_reason():
    if _MAJOR_MINOR not in TESTED:
        return f"Triton {triton.__version__} is not a release it was checked on ({', '.join(TESTED)})"
    if os.environ.get("SAGEBWD_FAST_LAUNCH", "1") == "0":
        return "SAGEBWD_FAST_LAUNCH=0"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1"
    return None


ENABLED = _off_reason() is None


def _fp_fusion(environ=os.environ):
    """The ``enable_fp_fusion`` every launch asks for: True, unless the user chose with TRITON_DEFAULT_FP_FUSION
    (None: Triton's default, theirs). Triton 3.10 turns fusion off by default (3.9 warns that it will); the
    kernels were written, timed and their test bounds set with it on, and some of their FMAs come from it: the
    Gluon dQ loop has ~130 a tile (D=128, Triton 3.9: 885 instructions a tile, 950 without fusion;
    compile_offline.py), the forward's are explicit (792, 795)."""
    return None if "TRITON_DEFAULT_FP_FUSION" in environ else True


FP_FUSION = _fp_fusion()
CHECK = os.environ.get("SAGEBWD_CHECK_LAUNCH") == "1"

# (id(kernel), device, key) -> (compiled kernel, its launcher, function, packed metadata, trailing arguments)
_compiled = {}
MAX_ENTRIES = 4096   # ints are keyed by value: a stream of new shapes must not grow the cache without bound
_descriptor_types = set()
_descriptor_ids = {}    # a TMA descriptor's key -> the small key standing for it (descriptor_key)


class _Uncached(Exception):
    pass


def _arg_key(a):
    """A key at least as fine as Triton's specialization of a runtime argument (``native_specialize_impl``):
    tensors by dtype and 16-byte alignment (what Triton specializes them on: an aligned one by its dtype alone, an
    unaligned one by ``(dtype, False)``, no tuple made for the common case); ints by value (finer than
    Triton's "is 1 / divisible by 16 / 32 or 64 bits"; a training loop repeats its shapes); floats by type
    (never specialized; not by value, as 1.0 == 1 would meet the int 1); bools, None; TMA descriptors by
    dtype, block and layout. Keys of different types never compare equal."""
    cls = a.__class__
    if cls is int:
        return a
    if cls in _descriptor_types:   # (padding, and 3.8's tf32 rounding: what else Triton specializes them on)
        return a.__dict__.get("launch_key") or descriptor_key(
            a.base.dtype, a.block_shape, a.layout, getattr(a, "padding", None), getattr(a, "round_f32_to_tf32", None))
    if isinstance(a, torch.Tensor):
        return a.dtype if a.data_ptr() % 16 == 0 else (a.dtype, False)
    if cls is float:
        return float
    if cls is bool:
        return bool, a
    if a is None:
        return None
    if all(hasattr(a, name) for name in ("base", "block_shape", "layout")):    # a TMA descriptor class
        _descriptor_types.add(cls)
        return _arg_key(a)
    raise _Uncached


_Tensor = torch.Tensor


def descriptor_key(base_dtype, block_shape, layout, padding, round_f32_to_tf32=None):
    """A TMA descriptor's key: one small tuple for each (dtype, block, layout, padding, rounding). A descriptor
    made with it as its ``launch_key`` attribute (hopper_launch.tma_descriptor, once per kind of descriptor) is
    keyed without hashing and comparing its Gluon layout (Python methods) at every launch."""
    key = (base_dtype, tuple(block_shape), layout, padding, round_f32_to_tf32)
    small = _descriptor_ids.get(key)
    if small is None:
        small = _descriptor_ids[key] = ("tma descriptor", len(_descriptor_ids))
    return small


def _key(args):
    # ints (strides, sizes) are most arguments, plain tensors the next most, then descriptors and floats: all but
    # descriptors inline, without a call each (each key as _arg_key's; a tensor subclass, such as a Parameter, goes
    # through _arg_key). A Gluon forward and backward key ~570 arguments: this is ~15% of their host time.
    return tuple([a if (cls := a.__class__) is int
                  else (a.dtype if a.data_ptr() % 16 == 0 else (a.dtype, False)) if cls is _Tensor
                  else float if cls is float else _arg_key(a) for a in args])


def _hooks_installed() -> bool:
    rt = triton.knobs.runtime
    # (3.7 on: a stages-inspection hook adds a field to Triton's cache key that ours does not see)
    return (any(getattr(h, "calls", h) for h in (rt.launch_enter_hook, rt.launch_exit_hook))
            or getattr(rt, "add_stages_inspection_hook", None) is not None)


def _triton_pick(kernel, args, kwargs):
    """The compiled kernel ``kernel[grid]`` would launch for these arguments (JITFunction.run's lookup)."""
    from triton.runtime.jit import compute_cache_key

    knobs = triton.knobs
    device = triton.runtime.driver.active.get_current_device()
    kernel_cache, kernel_key_cache, _, _, binder = kernel.device_caches[device]
    kw = dict(kwargs, debug=kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
              instrumentation_mode=knobs.compilation.instrumentation_mode)
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):     # 3.9 on: one more option JITFunction.run sets
        kw["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    _, specialization, options = binder(*args, **kw)
    return kernel_cache.get(compute_cache_key(kernel_key_cache, specialization, options))


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, re-launching the compiled kernel directly once one exists for the
    arguments' specialization. Runtime arguments go positionally, constexprs and options by keyword."""
    if FP_FUSION is not None:
        kwargs.setdefault("enable_fp_fusion", FP_FUSION)
    if not ENABLED or not isinstance(kernel, JITFunction) or _hooks_installed():
        return kernel[grid](*args, **kwargs)
    try:
        key = (id(kernel), torch.cuda.current_device(), _key(args), tuple(kwargs.items()))
        entry = _compiled.get(key)
    except (_Uncached, TypeError):      # TypeError: an unhashable keyword value
        return kernel[grid](*args, **kwargs)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        # (a tensor passed by keyword would be keyed, and kept alive, by identity: such calls stay uncached)
        if (compiled is not None and not hasattr(compiled, "result")
                and not any(isinstance(v, torch.Tensor) for v in kwargs.values())):
            if len(_compiled) >= MAX_ENTRIES:
                _compiled.clear()
            # constexprs and defaults after the positional arguments, in signature order: fixed by the key
            tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in kernel.params[len(args):])
            _compiled[key] = (compiled, compiled.run, compiled.function, compiled.packed_metadata, tail)
        return compiled
    compiled, run, function, metadata, tail = entry
    if CHECK:
        picked = _triton_pick(kernel, args, kwargs)
        if picked is None or picked.function != function:
            raise RuntimeError(f"sagebwd launch cache: {getattr(kernel, '__name__', kernel)} would run another "
                               f"compiled kernel under Triton's own lookup (key {key[2:]})")
    g = tuple(grid) + (1, 1)
    run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(key[1]), function, metadata, None, None, None,
        *args, *tail)
    return compiled


def status() -> str:
    """One line for ``python -m sagebwd_hf``: whether kernels are re-launched directly, and if not why."""
    if ENABLED:
        return f"direct re-launch of compiled kernels (kernels/launch.py, Triton {triton.__version__})"
    return f"through Triton's kernel[grid] ({_off_reason() or 'turned off in this process'})"


def cache_size() -> int:
    return len(_compiled)
