"""What one attention call launches, counted on a CPU: every Triton or Gluon launch the op makes (through the
``launch`` of kernels/quantize.py, ds_bound.py, forward.py, backward.py and hopper_launch.py, stubbed: nothing runs)
and every torch op that would be a kernel on a GPU (a fill, a copy, arithmetic; views and allocations are counted
apart).

``hopper=True`` takes the Hopper (Gluon) path's host code on CPU tensors: dispatch answers as on an H100 (132
SMs), the Gluon launches are recorded instead of run. Used by tests/test_launch_count.py (the counts the op must
not exceed) and tools/host_cpu.py (the host time of a call with the launches stubbed).
"""
import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sagebwd_hf import interface
from sagebwd_hf.kernels import attention, backward, dispatch, ds_bound, forward, plan, quantize
from sagebwd_hf.kernels.constants import GLUON_HEAD_DIMS

H100_SMS = 132
# ops that make no kernel on a GPU: allocations (counted apart) and metadata
_ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}
_NO_KERNEL = {"detach", "alias", "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
              "_local_scalar_dense", "is_same_size", "_has_compatible_shallow_copy_type", "set_"}


class TorchOps(TorchDispatchMode):
    """Counts torch ops by kind: ``kernels`` (a GPU kernel each: fills, copies, arithmetic), ``allocations``,
    ``views``; ``names`` lists the kernel ops."""

    def __init__(self):
        super().__init__()
        self.kernels, self.allocations, self.views = 0, 0, 0
        self.names = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _ALLOCATIONS:
            self.allocations += 1
        elif func.is_view or name in _NO_KERNEL:
            self.views += 1
        else:
            self.kernels += 1
            self.names[name] += 1
        return func(*args, **(kwargs or {}))


class Launches:
    """The Triton and Gluon launches recorded while ``stubbed_launches`` is active, by kernel name."""

    def __init__(self):
        self.names = collections.Counter()

    def __call__(self, kernel, grid, *args, **kwargs):
        self.names[getattr(kernel, "__name__", None) or kernel.fn.__name__] += 1

    @property
    def total(self):
        return sum(self.names.values())


def _use_gluon_as_on_hopper(device, head_dim, q_smoothing, varlen=False, softcap=False, head_dim_v=None):
    return (head_dim, head_dim_v or head_dim) in GLUON_HEAD_DIMS and not q_smoothing


@contextlib.contextmanager
def stubbed_launches(hopper: bool, launches=None):
    """Record every launch instead of running it (in ``launches``, a ``Launches``); with ``hopper`` the op takes its
    Gluon path."""
    from sagebwd_hf.kernels import hopper_launch

    launches = Launches() if launches is None else launches
    patches = [(module, "launch", launches) for module in (quantize, ds_bound, forward, backward, hopper_launch)]
    patches.append((attention, "POISON", False))     # the tests' NaN fills are not the op's
    patches.append((interface, "_use_triton", lambda x: True))   # CPU tensors take the kernels' path, GPU or not
    if hopper:
        patches += [(dispatch, "use_gluon", _use_gluon_as_on_hopper),
                    (dispatch, "gluon_unavailable", lambda device: None),
                    (plan, "gluon_programs", lambda device: H100_SMS)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield launches
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def inputs(batch, heads, kv_heads, seqlen, head_dim, packed=False, dtype=torch.bfloat16):
    """q, k, v (requiring grad) and dO: padded ``[B, H, N, D]`` laid out as Transformers' ``[B, N, H, D]``
    transposed, or packed ``[B*N, H, D]`` with ``cu_seqlens``."""
    g = torch.Generator().manual_seed(0)
    if packed:
        make = lambda h: torch.randn(batch * seqlen, h, head_dim, generator=g, dtype=dtype)  # noqa: E731
        q, k, v = make(heads), make(kv_heads), make(kv_heads)
        cu = torch.arange(batch + 1, dtype=torch.int32) * seqlen
        do = torch.randn(batch * seqlen, heads, head_dim, generator=g, dtype=dtype)
    else:
        make = lambda h: torch.randn(batch, seqlen, h, head_dim, generator=g, dtype=dtype).transpose(1, 2)  # noqa
        q, k, v = make(heads), make(kv_heads), make(kv_heads)
        cu = None
        do = torch.randn(batch, seqlen, heads, head_dim, generator=g, dtype=dtype).transpose(1, 2)
    return [x.requires_grad_() for x in (q, k, v)], cu, do


def call(q, k, v, cu, seqlen, **options):
    if cu is None:
        return interface.sagebwd_attn_func(q, k, v, backend="triton", **options)
    return interface.sagebwd_attn_varlen_func(q, k, v, cu, cu, seqlen, seqlen, backend="triton", **options)


def count_call(hopper, batch=2, heads=16, kv_heads=16, seqlen=1024, head_dim=128, packed=False, **options):
    """{"fwd": (launches, torch kernels, allocations), "bwd": ...} of one call after a first one (which fills the
    op's caches), and the launches' and torch kernels' names. The default shape has more work items than an
    H100 has SMs, so every Gluon launch is persistent (a counter to zero)."""
    (q, k, v), cu, do = inputs(batch, heads, kv_heads, seqlen, head_dim, packed)
    result, names = {}, {}
    with stubbed_launches(hopper) as launches:
        call(q, k, v, cu, seqlen, **options).backward(do)
        launches.names.clear()
        for x in (q, k, v, options.get("sinks")):   # (else autograd adds the new gradients to these: not the op's)
            if x is not None:
                x.grad = None
        with TorchOps() as ops:
            out = call(q, k, v, cu, seqlen, **options)
        result["fwd"] = (launches.total, ops.kernels, ops.allocations)
        names["fwd"] = (dict(launches.names), dict(ops.names))
        launches.names.clear()
        with TorchOps() as ops:
            out.backward(do)
        result["bwd"] = (launches.total, ops.kernels, ops.allocations)
        names["bwd"] = (dict(launches.names), dict(ops.names))
    return result, names


class _Attention(torch.nn.Module):
    """What the attention function reads of a model's attention module (a layer after the first)."""
    is_causal = True
    layer_idx = 1


TRANSFORMERS_PATHS = ("padded", "packed", "cu_seq_lens")


def transformers_call(path, lengths, heads, kv_heads, head_dim):
    """``sagebwd_attention_forward`` as a model calls it on documents of ``lengths`` tokens: ``path`` "padded" (one
    row each, right padded, the 2D bool mask sagebwd_mask hands every layer), "packed" (one row, restarting
    position_ids) or "cu_seq_lens" (that row with the collator's cu_seq_lens_q/k, one tensor, and max_length_q/k).
    Returns ``(call, (q, k, v), dO)``: ``call()`` runs it with the same mask or ids every time, as the layers of one
    forward get them; ``call(fresh=True)`` with copies it has not seen, as a forward's first layer."""
    from sagebwd_hf.transformers_integration import sagebwd_attention_forward

    assert path in TRANSFORMERS_PATHS, path
    g = torch.Generator().manual_seed(0)
    if path == "padded":
        batch, n = len(lengths), max(lengths)
        mask = torch.arange(n)[None] < torch.tensor(lengths)[:, None]
        extra = {}
    else:
        batch, n = 1, sum(lengths)
        mask = None
        extra = dict(position_ids=torch.cat([torch.arange(length) for length in lengths])[None])
        if path == "cu_seq_lens":
            cu = torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)
            extra.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    # [B, H, N, D] views of [B, N, H, D] projections, as Transformers hands them
    make = lambda h: torch.randn(batch, n, h, head_dim, generator=g, dtype=torch.bfloat16).transpose(1, 2)  # noqa
    q, k, v = (x.requires_grad_() for x in (make(heads), make(kv_heads), make(kv_heads)))
    do = torch.randn(batch, n, heads, head_dim, generator=g, dtype=torch.bfloat16)
    module = _Attention()

    def call(fresh=False):
        m, kwargs = mask, extra
        if fresh:   # new tensors (one copy of a tensor passed under two names, as the collator passes cu_seq_lens)
            copies = {}
            copy = lambda x: copies.setdefault(id(x), x.clone()) if isinstance(x, torch.Tensor) else x  # noqa
            m, kwargs = copy(mask), {name: copy(value) for name, value in extra.items()}
        return sagebwd_attention_forward(module, q, k, v, m, dropout=0.0, scaling=head_dim ** -0.5, **kwargs)[0]
    return call, (q, k, v), do
