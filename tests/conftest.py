import os

# On a machine of several GPUs the device script spreads pytest-xdist's workers over them
# (SAGEBWD_TEST_GPUS="0 1 2 3"): each worker sees one GPU. This must happen before CUDA starts.
_gpus = os.environ.get("SAGEBWD_TEST_GPUS", "").split()
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _gpus and _worker.startswith("gw"):
    os.environ["CUDA_VISIBLE_DEVICES"] = _gpus[int(_worker[2:]) % len(_gpus)]

import pytest  # noqa: E402
import torch  # noqa: E402

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


@pytest.fixture
def forward_plans(monkeypatch):
    """Every forward plan the op builds during the test, in order (``kernels/plan.py``'s ``forward_plan``, spied)."""
    from sagebwd_hf.kernels import plan

    plans, build = [], plan.forward_plan

    def recording(*args, **kwargs):
        plans.append(build(*args, **kwargs))
        return plans[-1]
    monkeypatch.setattr(plan, "forward_plan", recording)
    return plans
