"""Model coverage: every causal-LM architecture of the installed Transformers, tiny, on SageBwd.

``sagebwd_hf.testing.model_coverage`` builds each architecture of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` tiny from its
default config and runs a training step with the reference attention (sdpa, or eager where SDPA does not
compute the model's attention) and with "sagebwd" on the same weights; ``sagebwd_hf.attention_stats()``
classifies it (runs on SageBwd / documented fallback / raises by design / not routed / cannot build tiny).
Each architecture here must:

* keep the status that ``docs/model_coverage.md`` records, when the installed Transformers is the doc's (a new
  architecture, or a changed status, fails with the command that regenerates the doc: review the difference,
  then regenerate); with another Transformers the statuses are not compared, the rules below still hold;
* show no silent mismatch: logits and all parameter gradients within the bounds of tests/test_transformers.py
  against the reference (or an explanation in ``EXPLAINED`` that is checked in the same run), every call that
  ran on the kernels within CALL_REL_MAX of exact attention on its own inputs, as many attention calls as the
  reference made, and a model that is "not routed" exactly unchanged;
* fall back only for a reason the adapter documents, and fail only in the ways it documents.

On CPU the models are float32 and SageBwd computes the attention in bfloat16 through its PyTorch path
(``sagebwd_hf.naive``, the algorithm of the kernels): the Triton interpreter (tests/conftest.py) would take
far too long for ~190 models; tests/test_kernels.py checks the kernels against that path. The GPU variant
(``python -m pytest -m gpu tests/test_model_coverage.py``) runs bfloat16 models on the Triton/Gluon kernels.
"""
import os

import pytest
import transformers

from sagebwd_hf.testing import model_coverage as mc
from sagebwd_hf import transformers_integration as ti

pytestmark = pytest.mark.filterwarnings("ignore")

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), mc.DOC)
EXPECTED = mc.read_doc(DOC)                 # {model_type: status key}
DOC_VERSIONS = mc.doc_versions(DOC)
SAME_TRANSFORMERS = DOC_VERSIONS.get("transformers") == transformers.__version__

def _params(names, strict=True):
    return [pytest.param(name, marks=pytest.mark.xfail(strict=strict, reason=mc.KNOWN_BUGS[name]))
            if name in mc.KNOWN_BUGS else name for name in names]


def _check(result, compare_status=True):
    what = f"{result.model_type}: {result.key} ({mc.describe(result)})"
    assert result.status != "error", f"sagebwd run fails in a way the adapter does not document: {what}"
    assert not result.mismatch, f"silent mismatch: {what}"
    if result.status == "fallback":
        assert set(result.fallback) <= set(ti.FALLBACK_REASONS), what
    if result.status == "not routed":
        assert not result.interface_in_source or result.model_type in mc.NOT_ROUTED_BUT_INTERFACE, (
            f"not routed, yet its modeling code calls the attention interface (did the tiny config lose its "
            f"attention layers?): {what}")
    if result.status == "raises":
        assert result.detail.startswith("ValueError: sagebwd:"), what
    if compare_status:
        assert result.model_type in EXPECTED, (
            f"new architecture {what}: not in docs/model_coverage.md; review it, then regenerate with "
            f"`{mc.REGENERATE}`")
        assert result.key == EXPECTED[result.model_type], (
            f"status changed: docs/model_coverage.md says {EXPECTED[result.model_type]!r}, now {what}; review "
            f"it, then regenerate with `{mc.REGENERATE}`")


@pytest.mark.parametrize("model_type", _params(mc.architectures()))
def test_architecture(model_type):
    _check(mc.classify(model_type, "cpu"), compare_status=SAME_TRANSFORMERS)


def test_doc_lists_every_installed_architecture():
    """The doc covers exactly the installed Transformers' causal-LM architectures (and says which version)."""
    if not SAME_TRANSFORMERS:
        pytest.skip(f"docs/model_coverage.md is for Transformers {DOC_VERSIONS.get('transformers')}, installed "
                    f"{transformers.__version__}: regenerate it with `{mc.REGENERATE}`")
    installed = set(mc.architectures())
    assert set(EXPECTED) == installed, (
        f"docs/model_coverage.md (Transformers {DOC_VERSIONS.get('transformers')}) and the installed "
        f"Transformers {transformers.__version__} differ: new {sorted(installed - set(EXPECTED))}, gone "
        f"{sorted(set(EXPECTED) - installed)}; regenerate with `{mc.REGENERATE}`")
    errors = {name for name, status in EXPECTED.items() if status == "error"}
    assert errors <= set(mc.KNOWN_BUGS), f"undocumented failures in the doc: {sorted(errors - set(mc.KNOWN_BUGS))}"


def test_explanations_are_for_architectures_that_run():
    """An EXPLAINED entry (bounds passed by a checked explanation) is only for an architecture that runs on the
    kernels, and names a known kind of explanation."""
    for name, (kind, reason) in mc.EXPLAINED.items():
        assert kind in ("router", "sensitive") and reason, name
        assert name in EXPECTED and (EXPECTED[name] == "sagebwd" or EXPECTED[name].startswith("fallback")), name


def test_a_lost_window_is_caught(monkeypatch):
    """The comparison has teeth: with sliding windows dropped in the adapter (every window attends to all
    keys), Mistral's tiny model (window 8, 24 tokens) is flagged."""
    assert mc.classify("mistral").key == "sagebwd" and not mc.classify("mistral").mismatch
    monkeypatch.setattr(ti, "_window", lambda sliding_window, causal: (-1, 0 if causal else -1))
    result = mc.classify("mistral")
    assert result.status == "sagebwd" and "logits rel L2" in result.mismatch, mc.describe(result)


def _gpu_params(names):
    return [pytest.param(name, marks=pytest.mark.xfail(strict=False, reason=mc.GPU_DEVIATIONS[name]))
            if isinstance(name, str) and name in mc.GPU_DEVIATIONS else name
            for name in _params(names, strict=SAME_TRANSFORMERS)]


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", _gpu_params(mc.architectures()))
def test_gpu_architecture(model_type):
    """bfloat16 models on CUDA, the kernels themselves. Statuses are compared with the (CPU) doc only when the
    Transformers versions agree."""
    import torch
    _check(mc.classify(model_type, "cuda", torch.bfloat16),
           compare_status=SAME_TRANSFORMERS and model_type in EXPECTED)
