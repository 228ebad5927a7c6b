"""Names that moved or changed shape keep working for one release, with a DeprecationWarning naming the new way."""
import importlib
import subprocess
import sys

import pytest
import torch

from sagebwd_hf.kernels.layout import SeqLayout
from sagebwd_hf.kernels.quantize import Quantized, quantize


def test_quantize_result_by_string_key_warns_and_equals_the_field():
    x = torch.randn(1, 2, 16, 32)
    result = quantize(x, SeqLayout(1, 16, None))
    assert isinstance(result, Quantized)
    with pytest.warns(DeprecationWarning, match="x8"):
        by_key = result["x8"]
    assert by_key is result.x8
    assert isinstance(result[0], torch.Tensor) or result[0] is None       # positions stay a tuple's


@pytest.mark.parametrize("module, name", [("forward_hopper", "forward_hopper_args"),
                                          ("forward_hopper", "launch_forward_hopper"),
                                          ("backward_hopper", "launch_backward_hopper"),
                                          ("backward_hopper", "dq_key_tile")])
def test_launch_helpers_moved_to_hopper_launch(module, name):
    try:
        old = importlib.import_module(f"sagebwd_hf.kernels.{module}")
        new = importlib.import_module("sagebwd_hf.kernels.hopper_launch")
    except Exception as exc:   # noqa: BLE001  (a Triton without this Gluon API: the portable kernels run)
        pytest.skip(f"the Gluon kernels do not import here: {exc}")
    with pytest.warns(DeprecationWarning, match=f"hopper_launch.{name}"):
        assert getattr(old, name) is getattr(new, name)
    with pytest.raises(AttributeError, match="no attribute"):
        old.not_a_name  # noqa: B018  (the access is the test)


def test_model_coverage_moved_to_testing():
    old = importlib.import_module("sagebwd_hf.model_coverage")
    new = importlib.import_module("sagebwd_hf.testing.model_coverage")
    with pytest.warns(DeprecationWarning, match="sagebwd_hf.testing.model_coverage.classify"):
        assert old.classify is new.classify
    with pytest.warns(DeprecationWarning, match="sagebwd_hf.testing.model_coverage.BOUNDS"):
        from sagebwd_hf.model_coverage import BOUNDS
    assert BOUNDS is new.BOUNDS
    with pytest.raises(AttributeError, match="no attribute"):
        old.not_a_name  # noqa: B018  (the access is the test)


def test_model_coverage_module_runs_under_its_old_name():
    result = subprocess.run([sys.executable, "-m", "sagebwd_hf.model_coverage", "--help"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Which causal-LM architectures" in result.stdout               # the new module's own help
    assert "moved to python -m sagebwd_hf.testing.model_coverage" in result.stderr
