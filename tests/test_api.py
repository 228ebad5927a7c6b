"""Argument checking, dtype handling and the PyTorch (CPU) path of the public API."""
import importlib.util
import warnings

import pytest
import torch

from sagebwd_hf import interface, sagebwd_attn_func, sagebwd_attn_varlen_func
from sagebwd_hf.testing import compare, exact_reference, make_qkv, run_with_grads


def _qkv(b=1, h=2, hk=2, n=16, d=64, dtype=torch.float16):
    return make_qkv(b, h, hk, n, n, d, dtype, "cpu")[:3]


@pytest.mark.parametrize("make_bad, match", [
    (lambda q, k, v: (q[0], k, v), r"q must have shape"),
    (lambda q, k, v: (q, k[..., :32], v), r"head dim"),
    (lambda q, k, v: (q, k, v[:, :, :8]), r"k and v must have the same shape but for the head dim"),
    (lambda q, k, v: (q, k, v[..., :20]), r"v head dim must be a multiple of 8"),
    (lambda q, k, v: (q.repeat(2, 1, 1, 1), k, v), r"batch size"),
    (lambda q, k, v: (q.repeat(1, 3, 1, 1)[:, :3], k, v), r"multiple of k/v's heads"),
    (lambda q, k, v: (q[..., :20], k[..., :20], v[..., :20]), r"multiple of 8"),
    (lambda q, k, v: (torch.zeros(1, 2, 4, 264, dtype=torch.float16),) * 3, r"multiple of 8 from 8 to 256"),
])
def test_shape_errors_name_the_argument(make_bad, match):
    with pytest.raises(ValueError, match=match):
        sagebwd_attn_func(*make_bad(*_qkv()))


def test_type_errors():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="share one dtype"):
        sagebwd_attn_func(q, k.bfloat16(), v)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        sagebwd_attn_func(q.double(), k.double(), v.double())
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        sagebwd_attn_func(q, k.tolist(), v)


@pytest.mark.parametrize("kwargs, match", [
    (dict(window_size=(3,)), "window_size"),
    (dict(window_size=(-2, 0)), "window_size"),
    (dict(causal=True, window_size=(4, 5)), "right must be -1 or 0 with causal"),
    (dict(softmax_scale=0.0), "softmax_scale"),
    (dict(softmax_scale=float("inf")), "softmax_scale must be a positive finite number"),
    (dict(softmax_scale=-float("inf")), "softmax_scale"),
    (dict(softmax_scale=float("nan")), "softmax_scale"),
    (dict(softmax_scale=True), "softmax_scale"),
    (dict(backend="cuda"), "backend"),
])
def test_option_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sagebwd_attn_func(*_qkv(), **kwargs)


@pytest.mark.parametrize("window_size, error", [
    ((True, False), TypeError),
    ((1.0, 0), TypeError),
    ("-1,-1", TypeError),
    (-1, TypeError),
    ((3,), ValueError),
    ((-1, 0, 0), ValueError),
    ((0, -2), ValueError),
])
def test_window_size_errors_name_the_argument_and_allowed_values(window_size, error):
    """A bad window_size is refused before any tensor work, naming the argument and what it takes, for
    both entry points (bools are ints to Python, never a window here)."""
    match = r"window_size must be a tuple of two ints \(left, right\), each -1 \(unbounded\) or >= 0"
    with pytest.raises(error, match=match):
        sagebwd_attn_func(*_qkv(), window_size=window_size)
    q = torch.randn(8, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(error, match=match):
        sagebwd_attn_varlen_func(q, q, q, cu, cu, 8, 8, window_size=window_size)


def test_window_size_takes_a_list_and_zero_widths():
    q, k, v = _qkv()
    torch.testing.assert_close(sagebwd_attn_func(q, k, v, window_size=[2, 0]),
                               sagebwd_attn_func(q, k, v, window_size=(2, 0)), rtol=0, atol=0)
    assert torch.isfinite(sagebwd_attn_func(q, k, v, window_size=(0, 0)).float()).all()


def test_deterministic_is_a_bool_or_none():
    with pytest.raises(TypeError, match="deterministic must be None, True or False, got 'fast'"):
        sagebwd_attn_func(*_qkv(), deterministic="fast")
    q, k, v = _qkv()   # on CPU every choice is the PyTorch path's one backward
    outs = [sagebwd_attn_func(q, k, v, deterministic=d) for d in (None, True, False)]
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_varlen_errors():
    q = torch.randn(10, 2, 64, dtype=torch.float16)
    good = torch.tensor([0, 4, 10], dtype=torch.int32)
    cases = [
        (dict(cu_seqlens_q=good.long()), TypeError, "cu_seqlens_q must be int32"),
        (dict(cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32)), ValueError, "holds 10 tokens"),
        (dict(cu_seqlens_k=torch.tensor([0, 7, 4, 10], dtype=torch.int32)), ValueError, "never decrease"),
        (dict(cu_seqlens_q=torch.tensor([1, 4, 10], dtype=torch.int32)), ValueError, "start at 0"),
        (dict(max_seqlen_q=5), ValueError, "more than its max_seqlen"),
        (dict(cu_seqlens_k=torch.tensor([0, 10], dtype=torch.int32), max_seqlen_k=10), ValueError,
         "same number of sequences"),
    ]
    for override, exc, match in cases:
        args = dict(cu_seqlens_q=good, cu_seqlens_k=good, max_seqlen_q=6, max_seqlen_k=6)
        args.update(override)
        with pytest.raises(exc, match=match):
            sagebwd_attn_varlen_func(q, q, q, **args)
    with pytest.raises(ValueError, match=r"q must have shape \[total_tokens"):
        sagebwd_attn_varlen_func(q[None], q[None], q[None], good, good, 6, 6)


def test_varlen_values_checked_once_per_tensor_until_written(monkeypatch):
    """Reading cu_seqlens back waits for the GPU, so a tensor's values are checked on first use only (every layer
    of a step passes the same one), and again after an in-place write or with another max_seqlen."""
    from sagebwd_hf import interface
    checks = []
    real = interface._check_cu_values
    monkeypatch.setattr(interface, "_check_cu_values", lambda *a: (checks.append(a[0]), real(*a)))
    q = torch.randn(10, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out = sagebwd_attn_varlen_func(q, q, q, cu, cu, 6, 6, backend="naive")
    assert checks == ["cu_seqlens_q"]              # cu_seqlens_k is the same tensor with the same bounds
    torch.testing.assert_close(sagebwd_attn_varlen_func(q, q, q, cu, cu, 6, 6, backend="naive"), out)
    assert checks == ["cu_seqlens_q"]
    sagebwd_attn_varlen_func(q, q, q, cu, cu.clone(), 6, 6, backend="naive")
    assert checks == ["cu_seqlens_q", "cu_seqlens_k"]   # a new tensor with the same values
    with pytest.raises(ValueError, match="more than its max_seqlen 5"):
        sagebwd_attn_varlen_func(q, q, q, cu, cu, 5, 6, backend="naive")
    cu[1] = 7                                       # written in place: a sequence of 7 > max_seqlen 6
    with pytest.raises(ValueError, match="more than its max_seqlen 6"):
        sagebwd_attn_varlen_func(q, q, q, cu, cu, 6, 6, backend="naive")
    with torch.inference_mode():                    # no version counter: checked every call
        cu_inf = torch.tensor([0, 4, 10], dtype=torch.int32)
        for _ in range(2):
            sagebwd_attn_varlen_func(q, q, q, cu_inf, cu_inf, 6, 6, backend="naive")
    assert checks[-4:] == ["cu_seqlens_q", "cu_seqlens_k"] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_device_mismatch():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="one device"):
        sagebwd_attn_func(q.cuda(), k, v)


def test_fp32_runs_in_bf16_and_returns_fp32():
    q, k, v, do = make_qkv(1, 2, 2, 40, 40, 64, torch.float32, "cpu")
    interface._warned.discard("fp32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run_with_grads(lambda a, b, c: sagebwd_attn_func(a, b, c, causal=True), q, k, v, do)
        run_with_grads(lambda a, b, c: sagebwd_attn_func(a, b, c, causal=True), q, k, v, do)
    notices = [w for w in caught if "bfloat16" in str(w.message)]
    assert len(notices) == 1, "the fp32 notice is given once"
    assert notices[0].filename == __file__, f"the notice names the caller's line, not {notices[0].filename}"
    assert all(t.dtype == torch.float32 for t in res.values())
    for name, (cos, rel) in compare(res, exact_reference(q, k, v, do, window_size=(-1, 0))).items():
        assert cos > 0.999 and rel < 0.05, (name, cos, rel)


@pytest.mark.parametrize("backend", ["naive", None])
def test_cpu_path_matches_exact(backend):
    """The CPU path (reference implementation) on its own, against float64 attention."""
    q, k, v, do = make_qkv(2, 4, 2, 90, 90, 64, torch.bfloat16, "cpu")
    res = run_with_grads(lambda a, b, c: sagebwd_attn_func(a, b, c, causal=True, backend=backend), q, k, v, do)
    for name, (cos, rel) in compare(res, exact_reference(q, k, v, do, window_size=(-1, 0))).items():
        assert cos > 0.999 and rel < 0.05, (name, cos, rel)


def test_kernels_folder_is_not_a_top_level_module():
    """Hugging Face's `kernels` package owns that name; ours is importable as sagebwd_hf.kernels only."""
    import os

    import sagebwd_hf.kernels.forward as fwd
    repo_kernels = os.path.dirname(fwd.__file__)
    # no __init__.py: with the repo root on sys.path, `kernels` is at most a namespace portion, which
    # loses to any real `kernels` install and which transformers' availability check rejects
    assert not os.path.exists(os.path.join(repo_kernels, "__init__.py"))
    spec = importlib.util.find_spec("kernels")
    if spec is not None and spec.origin not in (None, "namespace"):
        assert not spec.origin.startswith(repo_kernels)


def test_cpu_path_varlen_with_empty_sequences():
    """The PyTorch path takes empty sequences (no queries, or no keys): zeros out, zero gradients."""
    lens_q, lens_k = [5, 0, 7], [5, 3, 0]
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), 2, 64, dtype=torch.float16, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 64, dtype=torch.float16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    out = sagebwd_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 5, causal=True, backend="naive")
    out.float().sum().backward()
    assert torch.isfinite(out).all() and (out[5:] == 0).all() and (out[:5].abs().sum(-1) > 0).all()
    assert (q.grad[5:] == 0).all() and (k.grad[5:] == 0).all() and torch.isfinite(k.grad).all()


def test_environment_report_runs_as_a_module():
    """`python -m sagebwd_hf` prints versions, the kernel path and the Transformers registration."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "sagebwd_hf"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("sagebwd-hf ", "torch ", "triton ", "transformers ", "accelerate ", "peft ",
                 "Transformers registration: attention function yes, mask function yes"):
        assert text in out, out
    assert ("GPU 0:" in out) if __import__("torch").cuda.is_available() else ("GPU: none" in out)


def test_environment_report_names_the_kernel_path(monkeypatch):
    """The report's kernel line on an H100/H200, as the dispatch decides it (mocked here): Gluon with a tested
    Triton, portable with the reason otherwise."""
    from sagebwd_hf.__main__ import _kernel_path
    from sagebwd_hf.kernels import dispatch

    dev = torch.device("cuda")
    monkeypatch.setattr(dispatch, "gluon_unavailable", lambda device: None)
    monkeypatch.setattr(dispatch, "_is_hopper", lambda device: True)
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "_triton_minor", lambda: dispatch.TESTED_TRITON[0])
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert _kernel_path(dev).startswith("Gluon Hopper kernels for the forward and backward")
    monkeypatch.setattr(dispatch, "_triton_minor", lambda: "99.0")
    assert "Gluon: off: Triton " in _kernel_path(dev) and "not a release the Hopper (Gluon) kernels are tested on" \
        in _kernel_path(dev)
    assert "untested_triton" not in dispatch._warned          # the report leaves the one warning to real calls
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert _kernel_path(dev).endswith("Gluon: off (SAGEBWD_KERNELS=triton)")
    monkeypatch.setattr(dispatch, "gluon_unavailable", lambda device: "compute capability 8.0")
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    assert _kernel_path(dev).endswith("Gluon: compute capability 8.0")
