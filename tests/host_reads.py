"""Device-to-host reads of one call, counted on a CPU: every place where, on a GPU, the host would wait for the
device (a value read back: ``.item()``, ``int()`` / ``bool()`` of a tensor, ``.tolist()``, ``.cpu()``; an op whose
output size depends on the data: ``nonzero``, boolean indexing, ``repeat_interleave`` without ``output_size``;
``torch.equal``). Each one stalls the host's launch queue until the GPU has caught up, so a call that makes one per
layer keeps the GPU waiting for the host. Used by tests (the reads a call must not exceed) and
tools/host_cpu.py.
"""
import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that wait for the device on a GPU: a scalar read, or an output whose size the data decides
_READS = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "unique", "_unique", "_unique2",
          "unique_dim", "unique_consecutive"}


def _boolean_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _Ops(TorchDispatchMode):
    def __init__(self, reads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        if (name in _READS
                or (name in ("index", "index_put", "index_put_") and _boolean_index(args[1]))
                or (name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor")
                    and kwargs.get("output_size") is None)):
            self.reads[name] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def counted_host_reads():
    """Counts the reads made inside the block, by kind: yields a ``collections.Counter`` (``sum(c.values())``: all
    of them). Methods that need no dispatch on CPU tensors (``tolist``, ``cpu``, ``numpy``) are counted by patching
    them for the block."""
    reads = collections.Counter()
    patched = {}
    for name in ("tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):
            reads[_name] += 1
            return _original(self, *args, **kwargs)
        patched[name] = original
        setattr(torch.Tensor, name, counting)
    try:
        with _Ops(reads):
            yield reads
    finally:
        for name, original in patched.items():
            setattr(torch.Tensor, name, original)
