"""Attention sinks (gpt-oss) and logit soft-capping (Gemma 2) on the op: the Triton kernels against the PyTorch
reference of the same quantized algorithm, and both against exact float64 attention with the same sink or
cap, forward and backward (the sinks' own gradient included). K gets channel outliers, so K-smoothing's row
shift, which the cap and the sinks must undo, is large here."""
import pytest
import torch
from conftest import kernel_devices

from sagebwd_hf import sagebwd_attn_func, sagebwd_attn_varlen_func
from sagebwd_hf.naive import attention_exact
from sagebwd_hf.testing import error_stats, make_qkv

# Measured (fp16, these shapes): under the interpreter, one seed, vs exact O/dK/dV cos >= 0.9997, dQ >= 0.9992;
# kernels vs reference rel L2 <= 2.8e-3. Without the sink's dQ term dQ falls to cos 0.963. dQ of the short causal
# case (17 queries, D=128, cap 30) over 60 seeds (CPU, kernels under the interpreter and the reference alike):
# down to 0.9978; a fresh-input H100 run gave 0.99800 against the former bound 0.998. Every other case and
# tensor stayed >= 0.9993 over 20 seeds.
EXACT_MIN_COS = {"O": 0.999, "dQ": 0.997, "dK": 0.998, "dV": 0.999}
ORACLE_REL = 2e-2
# The sinks' gradient, -sum_i p_sink,i (dO_i . O_i), is a 4-vector (one per head) and each entry a sum over rows
# with cancellation, so O's INT8 error reaches it amplified: over 5,000 fresh inputs per case the reference's cos
# against exact attention had a heavy tail (below 0.995 in 0.1-0.8% of draws, down to 0.942; an H100 run,
# 2026-11, failed the former bound 0.995 at 0.9899). It is checked three ways instead: exactly, against the formula on
# the op's own O and lse (rel to sum_i |term_i|: <= 7e-7 measured, reference and kernels); the lse against exact
# attention, which places the sink (|error| - 0.01 |lse|: <= 0.061 over 1,000 draws per case); and a coarse cos
# against exact (a sink dropped or misplaced gives < 0.8).
DSINKS_FORMULA_REL, LSE_ATOL, DSINKS_MIN_COS = 1e-4, 0.2, 0.9

# (heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, window, softcap, sinks)
CASES = [
    (4, 2, 130, 130, 64, True, (-1, -1), 0.0, True),      # gpt-oss: GQA, causal, sinks
    (4, 2, 130, 130, 64, True, (31, 0), 0.0, True),       # its sliding-window layers
    (4, 4, 100, 100, 64, False, (-1, -1), 0.0, True),
    (4, 2, 130, 130, 64, True, (31, 0), 5.0, False),      # Gemma 2: a cap that bites, window
    (2, 1, 17, 90, 128, True, (-1, -1), 30.0, False),     # q shorter than k
    (4, 2, 100, 100, 64, True, (-1, -1), 5.0, True),      # both
]


def _name(case):
    h, hk, nq, nk, d, causal, window, softcap, sinks = case
    return (f"h{h}kv{hk}-q{nq}k{nk}-d{d}-{'causal' if causal else 'full'}-w{window[0]}_{window[1]}"
            f"-cap{softcap:g}{'-sinks' if sinks else ''}")


def _grads(fn, q, k, v, do, sinks):
    """O, the gradients and (when ``fn`` returns ``(out, lse)``) the lse, in a dict."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    s = sinks.detach().clone().requires_grad_() if sinks is not None else None
    out = fn(*leaves, s)
    out, lse = out if isinstance(out, tuple) else (out, None)
    out.backward(do.to(out.dtype))
    result = {"O": out.detach(), "dQ": leaves[0].grad, "dK": leaves[1].grad, "dV": leaves[2].grad}
    if s is not None:
        result["dSinks"] = s.grad
    if lse is not None:
        result["lse"] = lse.detach()
    return result


def _check_sinks(label, result, exact, sinks, do):
    """dSinks as the comment above the cases says: the formula on the op's own O and lse, the lse, a coarse cos."""
    terms = torch.exp(sinks.double().view(1, -1, 1) - result["lse"].double()) * (
        do.double() * result["O"].double()).sum(-1)
    err = (result["dSinks"].double() + terms.sum((0, 2))).abs() / terms.abs().sum((0, 2))
    assert err.max() <= DSINKS_FORMULA_REL, f"{label} dSinks against -sum p_sink (dO . O): {err.tolist()}"
    torch.testing.assert_close(result["lse"].double(), exact["lse"], atol=LSE_ATOL, rtol=0.01,
                               msg=lambda m: f"{label} lse against exact attention: {m}")
    cos = error_stats(result["dSinks"], exact["dSinks"])[0]
    assert cos >= DSINKS_MIN_COS, f"{label} dSinks: cos {cos:.5f} against exact attention"


def _window(causal, window):
    return (window[0], 0) if causal else window


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("case", CASES, ids=_name)
def test_sinks_and_softcap_match_exact(device, case):
    h, hk, nq, nk, d, causal, window, softcap, with_sinks = case
    q, k, v, do = make_qkv(1, h, hk, nq, nk, d, torch.float16, device, k_outliers=6.0)
    q = q * 2.0   # larger scores, so that a cap of 5 bends them
    sinks = torch.randn(h, device=device) * 2.0 if with_sinks else None
    fn = lambda backend: (lambda x, y, z, s: sagebwd_attn_func(  # noqa: E731
        x, y, z, causal=causal, window_size=window, softcap=softcap, sinks=s, backend=backend, return_lse=True))
    kern = _grads(fn("triton"), q, k, v, do, sinks)
    ref = _grads(fn("naive"), q, k, v, do, sinks)
    exact = _grads(lambda x, y, z, s: attention_exact(x, y, z, window_size=_window(causal, window), softcap=softcap,
                                                      sinks=s),
                   q.double(), k.double(), v.double(), do.double(), None if sinks is None else sinks.double())
    for name, t in kern.items():
        assert torch.isfinite(t).all(), f"{name} has NaN/inf (or an element the kernel never wrote)"
        if name not in EXACT_MIN_COS:
            continue
        assert error_stats(t, ref[name])[1] <= ORACLE_REL, f"{name}: kernels vs reference {error_stats(t, ref[name])}"
        for label, result in (("kernels", kern), ("reference", ref)):
            cos, rel = error_stats(result[name], exact[name])
            assert cos >= EXACT_MIN_COS[name], f"{label} {name}: cos {cos:.5f} against exact attention"
    if with_sinks:
        for label, result in (("kernels", kern), ("reference", ref)):
            _check_sinks(label, result, exact, sinks, do)


@pytest.mark.parametrize("device", kernel_devices())
def test_packed_sequences_with_sinks_and_softcap(device):
    """Each sequence of a packed batch gets its own K mean (the row shift and dQ's term): packed equals each
    sequence run alone, the sinks' gradient summed over sequences."""
    torch.manual_seed(0)
    lens = [5, 70, 0, 33]
    h, hk, d = 4, 2, 64
    cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens), h, d, device=device, dtype=torch.float16) * 2
    k = (torch.randn(sum(lens), hk, d, device=device) + 3 * torch.randn(d, device=device)).half()
    v = torch.randn(sum(lens), hk, d, device=device, dtype=torch.float16)
    do = torch.randn_like(q)
    sinks = torch.randn(h, device=device)
    for softcap in (0.0, 5.0):
        packed = _grads(lambda x, y, z, s: sagebwd_attn_varlen_func(
            x, y, z, cu, cu, max(lens), max(lens), causal=True, softcap=softcap, sinks=s), q, k, v, do, sinks)
        d_sinks = torch.zeros_like(sinks)
        for i in range(len(lens)):
            sl = slice(int(cu[i]), int(cu[i + 1]))
            if not lens[i]:
                continue
            to4 = lambda x: x[sl].transpose(0, 1).unsqueeze(0)  # noqa: E731
            alone = _grads(lambda x, y, z, s: sagebwd_attn_func(x, y, z, causal=True, softcap=softcap, sinks=s),
                           to4(q), to4(k), to4(v), to4(do), sinks)
            for name in ("O", "dQ", "dK", "dV"):
                torch.testing.assert_close(packed[name][sl], alone[name][0].transpose(0, 1), atol=2e-3, rtol=2e-2,
                                           msg=lambda m: f"softcap={softcap} sequence {i} {name}: {m}")
            d_sinks += alone["dSinks"]
        torch.testing.assert_close(packed["dSinks"], d_sinks, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("device", kernel_devices())
def test_rows_without_keys_give_zeros_with_sinks(device):
    """A causal query longer than its keys: its first rows see no key, only the sink, whose value is zero."""
    q, k, v, do = make_qkv(1, 2, 2, 40, 17, 64, torch.float16, device)
    sinks = torch.randn(2, device=device)
    result = _grads(lambda x, y, z, s: sagebwd_attn_func(x, y, z, causal=True, sinks=s), q, k, v, do, sinks)
    for name, t in result.items():
        assert torch.isfinite(t).all(), name
    assert (result["O"][:, :, :23] == 0).all() and (result["dQ"][:, :, :23] == 0).all()


@pytest.mark.parametrize("device", kernel_devices())
def test_sinks_far_above_and_below_the_scores(device):
    """Sinks of +-80 (2^115 against scores of ~1): the kernels' epilogue adds them in log space, as the reference
    does, so neither overflows: a sink far above takes almost all the weight, one far below none."""
    q, k, v, do = make_qkv(1, 4, 2, 70, 70, 64, torch.float16, device, k_outliers=6.0)
    sinks = torch.tensor([80.0, -80.0, 0.0, 8.0], device=device)
    fn = lambda backend: (lambda x, y, z, s: sagebwd_attn_func(  # noqa: E731
        x, y, z, causal=True, sinks=s, backend=backend))
    kern = _grads(fn("triton"), q, k, v, do, sinks)
    ref = _grads(fn("naive"), q, k, v, do, sinks)
    for name in kern:
        assert torch.isfinite(kern[name]).all(), name
        assert error_stats(kern[name], ref[name])[1] <= ORACLE_REL or kern[name].abs().max() < 1e-6, name
    assert kern["O"][:, 0].abs().max() < 1e-6 and kern["O"][:, 1].abs().max() > 0.05


def test_lse_includes_the_sink_and_the_cap():
    q, k, v, _ = make_qkv(1, 2, 1, 50, 50, 64, torch.float16, "cpu", k_outliers=6.0)
    sinks = torch.randn(2)
    for softcap in (0.0, 5.0):
        _, lse = sagebwd_attn_func(q, k, v, causal=True, softcap=softcap, sinks=sinks, return_lse=True)
        _, lse_exact = attention_exact(q, k, v, window_size=(-1, 0), softcap=softcap, sinks=sinks)
        torch.testing.assert_close(lse, lse_exact.float(), atol=0.05, rtol=0.01)


@pytest.mark.parametrize("kwargs, match", [
    (dict(sinks=torch.zeros(3)), r"sinks must have shape \[heads\] = \[4\]"),
    (dict(sinks=torch.zeros(4, 1)), r"sinks must have shape"),
    (dict(sinks=torch.zeros(4, dtype=torch.long)), "sinks must be a floating-point"),
    (dict(sinks=[0.0] * 4), "sinks must be a torch.Tensor"),
    (dict(softcap=-1.0), "softcap must be 0"),
    (dict(softcap=float("inf")), "softcap must be 0"),
    (dict(softcap=True), "softcap must be 0"),
])
def test_bad_sinks_and_softcap_name_the_argument(kwargs, match):
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises((ValueError, TypeError), match=match):
        sagebwd_attn_func(q, q[:, :2], q[:, :2], **kwargs)


def test_inputs_are_not_modified():
    q, k, v, do = make_qkv(1, 2, 2, 30, 30, 64, torch.bfloat16, "cpu", k_outliers=4.0)
    sinks = torch.randn(2)
    leaves = [x.requires_grad_() for x in (q, k, v, sinks)]
    before = [x.detach().clone() for x in leaves]
    sagebwd_attn_func(q, k, v, causal=True, softcap=5.0, sinks=sinks).backward(do)
    for x, y in zip(leaves, before):
        assert torch.equal(x.detach(), y) and x.grad is not None and torch.isfinite(x.grad).all()
