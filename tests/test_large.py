"""Tensors past 2^31 elements, and one very long sequence (GPU only; ~25 GB of GPU memory at most, so they fit
an 80 GB H100; run this file on its own, not beside other GPU tests in parallel).

Offsets in the kernels are 64-bit (kernels/quantize.py ``_seq_bounds``): with 32-bit ones the batch and token
offsets of these tensors wrapped and the kernels faulted (illegal memory access), taking the CUDA context down.
Each sequence's result depends on that sequence alone (K mean, V scales, tiles are all per sequence), so a
slice run alone must give the same bits."""
import pytest
import torch

from sagebwd_hf import sagebwd_attn_func, sagebwd_attn_varlen_func
from sagebwd_hf.testing import error_stats

pytestmark = pytest.mark.gpu
# MQA keeps K/V small: Q, O, dO and dQ carry the 2^31+ elements (bf16 [2080, 8, 1024, 128]: 2.18e9 each).
B, H, N, D = 2080, 8, 1024, 128


def _grads(fn, q, k, v, do):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _randn(*shape, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)


def test_dense_past_2_31_elements_matches_slices_run_alone():
    q, do = _randn(B, H, N, D, seed=0), _randn(B, H, N, D, seed=1)
    k, v = _randn(B, 1, N, D, seed=2), _randn(B, 1, N, D, seed=3)
    assert q.numel() > 2**31
    fn = lambda a, b, c: sagebwd_attn_func(a, b, c, causal=True)  # noqa: E731
    full = _grads(fn, q, k, v, do)
    for sl in (slice(0, 2), slice(B - 2, B)):      # the last batch entries sit past element 2^31
        alone = _grads(fn, q[sl], k[sl], v[sl], do[sl])
        for name, a, b in zip(("O", "dQ", "dK", "dV"), full, alone):
            assert torch.equal(a[sl], b), f"{name} of batch {sl} differs from the same rows run alone"


def test_varlen_past_2_31_elements_matches_sequences_run_alone():
    seqs = 2600                                     # ~2.23M tokens x 8 heads x 128 > 2^31
    lengths = torch.full((seqs,), N, dtype=torch.int64)
    lengths[::3] = N // 2 + 7                       # uneven
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32).cuda()
    total = int(cu[-1])
    q, do = _randn(total, H, D, seed=4), _randn(total, H, D, seed=5)
    k, v = _randn(total, 1, D, seed=6), _randn(total, 1, D, seed=7)
    assert q.numel() > 2**31
    fn = lambda a, b, c: sagebwd_attn_varlen_func(a, b, c, cu, cu, N, N, causal=True)  # noqa: E731
    full = _grads(fn, q, k, v, do)
    for i in (0, seqs - 1):
        a, z = int(cu[i]), int(cu[i + 1])
        one = torch.tensor([0, z - a], dtype=torch.int32, device="cuda")
        alone = _grads(lambda x, y, w: sagebwd_attn_varlen_func(x, y, w, one, one, z - a, z - a, causal=True),
                       q[a:z], k[a:z], v[a:z], do[a:z])
        for name, x, y in zip(("O", "dQ", "dK", "dV"), full, alone):
            assert torch.equal(x[a:z], y), f"{name} of sequence {i} differs from the sequence run alone"


def test_128k_causal_sequence_against_exact_rows():
    n, h, d = 128 * 1024, 2, 128
    q, k, v, do = (_randn(1, h, n, d, seed=s) for s in range(8, 12))
    out, dq, dk, dv = _grads(lambda a, b, c: sagebwd_attn_func(a, b, c, causal=True), q, k, v, do)
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))
    rows = torch.tensor([0, 1, 4095, 65_537, n - 129, n - 1], device="cuda")
    for head in range(h):            # exact attention (float64) for the sampled rows only
        qs = q[0, head, rows].double()
        scores = qs @ k[0, head].double().T * d ** -0.5
        scores = scores.masked_fill(torch.arange(n, device="cuda")[None, :] > rows[:, None], float("-inf"))
        ref = torch.softmax(scores, -1) @ v[0, head].double()
        cos, rel = error_stats(out[0, head, rows], ref)
        assert cos >= 0.999 and rel <= 0.05, f"head {head}: cos {cos:.5f} rel L2 {rel:.4f}"
