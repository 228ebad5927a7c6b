import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Without a GPU the Triton kernels run under Triton's interpreter. Both variables must be set before
# sagebwd_hf (and so the @triton.jit kernels) is imported.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SAGEBWD_POISON", "1")   # kernel outputs start as NaN: unwritten elements fail
# every launch the launch cache makes is checked against the compiled kernel Triton's own lookup picks
os.environ.setdefault("SAGEBWD_CHECK_LAUNCH", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


def kernel_devices():
    """Where the Triton kernels can be tested: the interpreter on CPU, the real thing on CUDA."""
    return [pytest.param("cpu", marks=pytest.mark.skipif(
                os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests need TRITON_INTERPRET=1")),
            pytest.param("cuda", marks=pytest.mark.gpu)]
