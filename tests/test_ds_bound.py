"""The ds_bound rule on the kernels (sagebwd_hf.numerics): dK's dS at one fixed e4m3 scale per query row, 448 over a
bound of the row's largest |dS|, and Q times the bound at one e4m3 scale per channel, both applied after dK's sum.

Everywhere: the preparation (the rows' bounds, Q's e4m3 copy and its channel maxima) against the reference's
expressions. On an sm_90 GPU: forward and backward through the op against the reference of the rule and float64,
padded and packed, with sinks and a window; the forward's row maxima against the reference's; opcheck and
torch.compile; a deterministic call (three launches) refused before any launch. (Non-finite inputs under the rule:
tests/test_nonfinite.py.)"""
import functools

import pytest
import torch

from sagebwd_hf import naive, sagebwd_attn_func
from sagebwd_hf.kernels import dispatch
from sagebwd_hf.numerics import round_e4m3
from sagebwd_hf.testing import make_qkv, run_with_grads

from conftest import kernel_devices
from test_fast_backward_hopper import (_case_id, _check_against_reference, _packed_batch, check_one_launch_rule,
                                       on_hopper)

DS_BOUND = "pv_e4m3+p_static+do_sequence+dk_e4m3+ds_bound"
DS_BOUND_DP_INT8 = DS_BOUND + "+dp_int8"


def _inputs(device, group, n):
    """q, v, dO ``[2, 4, n, 64]`` (V with 4 // group heads), row maxima, lse and delta ``[2, 4, n]``, with a row that
    sees no key (lse +inf, row max -inf), an all-zero dO row and a row whose bound is tiny but not 0."""
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(2, 4, n, 64, generator=gen) * torch.exp(torch.randn(1, 1, n, 1, generator=gen))
    v = torch.randn(2, 4 // group, n, 64, generator=gen) + torch.randn(2, 4 // group, 1, 64, generator=gen) * 3
    do = torch.randn(2, 4, n, 64, generator=gen) * torch.exp(torch.randn(1, 1, n, 1, generator=gen) * 2) * 1e-2
    do[1, 2, 40] = 0.0
    row_max = torch.randn(2, 4, n, generator=gen) * 4
    lse = row_max + torch.rand(2, 4, n, generator=gen) * 6
    row_max[0, 1, 3], lse[0, 1, 3] = float("-inf"), float("inf")
    lse[1, 0, 9] = row_max[1, 0, 9] + 120.0     # max P 2^-120: a bound below TINY_SCALE, above 0
    delta = torch.randn(2, 4, n, generator=gen) * 1e-2
    return [x.to(device) for x in (q.bfloat16(), v.bfloat16(), do.bfloat16(), row_max, lse, delta)]


def _want_bound(v, do, row_max, lse, delta, group):
    """The bound in float64, as sagebwd_hf.naive.ds_row_bound writes it (V's channel maxima over each sequence)."""
    v_norm = v.double().abs().amax(2).norm(dim=-1).repeat_interleave(group, 1)[..., None]   # [B, H, 1]
    return torch.exp2(row_max.double() - lse.double()) * (do.double().norm(dim=-1) * v_norm + delta.double().abs())


def _check_inverse(ds_inv, bound, device):
    """448 / bound correctly rounded to fp32 (the GPU's IEEE division: float64's quotient rounded once is the same
    number; PyTorch's CUDA division was an ulp off in a quarter of them), 0 for a bound at most TINY_SCALE (not
    inf); the interpreter's division within an ulp."""
    want = torch.where(bound > 1e-30, (448.0 / bound.double()).float(), torch.zeros_like(bound))
    torch.testing.assert_close(ds_inv, want, rtol=0 if device == "cuda" else 2.5e-7, atol=0)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("group, n", [(1, 150), (2, 150), (2, 600)])
def test_preparation_is_the_reference(device, group, n):
    """The rows' bounds within fp32 rounding of the float64 expression (0 where a row sees no key), and from those
    bounds Q's channel maxima exactly the reference's, 448 / bound rounded once (0 for a tiny bound, not inf); Q's
    e4m3 bytes the reference's on the GPU (the interpreter's fp8 cast does not round to nearest: within an e4m3 step
    there). Padded and packed batches (aligned starts, operand order: the bytes read back in token order); 600
    tokens take the statistics' chunked path."""
    from sagebwd_hf.kernels.layout import SeqLayout
    from sagebwd_hf.kernels.ds_bound import ds_row_bounds, quantize_ds_bound
    from sagebwd_hf.kernels.quantize import aligned_starts, operand_order_columns

    q, v, do, row_max, lse, delta = _inputs(device, group, n)
    lay = SeqLayout(2, n, None)
    bound, ds_inv = ds_row_bounds(v, do, lse, row_max, delta, lay, lay, group)
    want = _want_bound(v, do, row_max, lse, delta, group)
    assert bound[0, 1, 3] == 0 and bound[1, 2, 40] > 0 and 0 < bound[1, 0, 9] < 1e-30 and bound.is_contiguous()
    torch.testing.assert_close(bound.double(), want, rtol=5e-6, atol=0)
    assert torch.isfinite(ds_inv).all() and ds_inv[1, 0, 9] == 0 and ds_inv[0, 1, 3] == 0
    _check_inverse(ds_inv, bound, device)
    cu = torch.tensor([0, 40, 40, n], dtype=torch.int32, device=device)
    packed = SeqLayout(3, n - 40, cu)
    seqs = [(0, 40), (40, n)]
    bound_packed, inv_packed = ds_row_bounds(v[:1], do[:1], lse[:1], row_max[:1], delta[:1], packed, packed, group)
    _check_inverse(inv_packed, bound_packed, device)
    for a, b in seqs:
        want_seq = _want_bound(v[:1, :, a:b], do[:1, :, a:b], row_max[:1, :, a:b], lse[:1, :, a:b],
                               delta[:1, :, a:b], group)
        torch.testing.assert_close(bound_packed[:, :, a:b].double(), want_seq, rtol=5e-6, atol=0)

    # (batch row, sequence, first token, end): the packed batch's second sequence is empty
    for lay_x, x, rows, spans in ((lay, q, bound, [(b, b, 0, n) for b in range(2)]),
                                  (packed, q[:1], bound_packed, [(0, 0, 0, 40), (0, 2, 40, n)])):
        starts = aligned_starts(lay_x) if lay_x.is_varlen else None
        q8t, q_max = quantize_ds_bound(x, rows, lay_x, group, starts, operand_order=True)
        for b, s, a, e in spans:
            qr = x[b, :, a:e].float() * rows[b, :, a:e, None]                         # [H, n, D]
            want_max = qr.abs().amax(1).view(4 // group, group, -1).amax(1).repeat_interleave(group, 0)
            assert torch.equal(q_max[s], want_max)
            want8 = round_e4m3(qr * (torch.full_like(want_max, 448.0) / want_max)[:, None, :])
            col0 = int(starts[s]) if starts is not None else 0
            n16 = -(-(e - a) // 16) * 16
            cols = col0 + operand_order_columns(n16).to(device)[:e - a]
            got8 = q8t[b][:, :, cols].view(torch.float8_e4m3fn).float().transpose(-1, -2)
            if device == "cuda":
                assert torch.equal(got8, want8)
            else:   # the interpreter's fp8 cast is not the GPU's: mostly toward zero, down to half the value
                # (e4m3's subnormals, below 2^-6, further), up a step at some ties, and garbage for fp32's
                # subnormals: where the value is not 0, the scales hold
                nz = want8 != 0
                near = (got8.abs() <= want8.abs() * 1.125 + 2.0 ** -9) & (got8.abs() >= want8.abs() / 2 - 2.0 ** -6)
                assert near[nz].all()
                assert (got8 * want8 >= 0)[nz].all()


@on_hopper
@pytest.mark.parametrize("rule", [DS_BOUND, DS_BOUND_DP_INT8])
@pytest.mark.parametrize("case", [(2, 4, 4, 1024, d, causal, None) for d in (64, 128) for causal in (False, True)]
                         + [(2, 4, 2, 4096, 128, True, None)], ids=_case_id)
def test_one_launch(case, rule):
    """The one launch with ds_bound against the reference of the rule and float64: dV is fastest's (the same rule),
    dK is not."""
    if rule == DS_BOUND_DP_INT8 and case[3] == 4096:
        pytest.skip("one long case a rule")
    check_one_launch_rule(case, rule, rule.replace("+ds_bound", ""))


@on_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sinks_and_a_window(head_dim):
    """Sinks (in lse, so in max P) and a sliding window (the row maxima over the visible keys) on the one launch."""
    q, k, v, do = make_qkv(2, 4, 2, 1000, 1000, head_dim, torch.bfloat16, "cuda", k_outliers=10.0, seed=25)
    sinks = torch.randn(4, device="cuda")
    attn = functools.partial(sagebwd_attn_func, causal=True, sinks=sinks, window_size=(255, 0))
    dispatch.reset_kernel_counts()
    _check_against_reference(attn, q, k, v, do, DS_BOUND, f"ds_bound sinks window d{head_dim}")
    assert dispatch.kernel_counts().get("bwd_gluon_one_launch"), dispatch.kernel_counts()


@on_hopper
def test_packed_batch():
    """A packed batch of uneven sequences (one shorter than a tile, one empty) against the reference."""
    attn, tensors = _packed_batch(seed=22)
    _check_against_reference(attn, *tensors, DS_BOUND, "ds_bound packed")


def _reference_row_max(q, k, causal):
    """The reference's largest score of each row (sagebwd_hf.naive.row_max_scores: lse's frame) and its lse."""
    scale, window = q.shape[-1] ** -0.5, (-1, 0) if causal else (-1, -1)
    keys = naive._quantize_keys(k, q.shape[1], True)
    m = naive.row_max_scores(q, keys, scale, window, False, 0.0, 64, 128)
    lse = naive.sagebwd_forward_naive(q, k, k, scale, window)[1]
    return m, lse


def _kernel_scores_row_max(q, k):
    """Each row's largest causal score from the kernels' own INT8 Q and K (``quantize_qk``: K-smoothed, Q's scale
    with the softmax scale and log2(e) folded in) in float64. The reference's own quantization can round a tie the
    other way (its 127 / max is PyTorch's division, the kernels' Triton's): one flipped element moves a score by up
    to 127 units, ~0.03 here."""
    from sagebwd_hf.kernels.layout import SeqLayout
    from sagebwd_hf.kernels.quantize import quantize_qk

    lay_q, lay_k = SeqLayout(q.shape[0], q.shape[2], None), SeqLayout(k.shape[0], k.shape[2], None)
    quant = quantize_qk(q, k, lay_q, lay_k, q.shape[-1] ** -0.5, True, False)
    group = q.shape[1] // k.shape[1]
    k8 = quant.k8.double().repeat_interleave(group, 1)
    k_scale = quant.k_scale.double().repeat_interleave(group, 1)
    s = (quant.q8.double() @ k8.transpose(-1, -2)) * quant.q_scale.double()[..., None] * k_scale[..., None, :]
    n_q, n_k = q.shape[2], k.shape[2]
    future = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(n_k - n_q + 1)
    return s.masked_fill(future, float("-inf")).amax(-1)


def test_reference_row_maxima_bound_p():
    """The reference's row maxima against its lse: max P = exp2(m - lse) in (0, 1], 1 on a causal first row."""
    q, k, _, _ = make_qkv(1, 4, 2, 300, 300, 64, torch.float16, "cpu", k_outliers=10.0, seed=27)
    m, lse = _reference_row_max(q, k, causal=True)
    p_max = torch.exp2(m - lse)
    assert (p_max > 0).all() and (p_max <= 1 + 1e-6).all() and (p_max[..., 0] > 1 - 1e-6).all()


@on_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_row_maxima(head_dim):
    """The Gluon forward's row maxima are the largest of its own quantized scores (``_kernel_scores_row_max``), in
    lse's frame: max P = exp2(row_max - lse) in (0, 1] on rows that see keys, 1 on a causal
    first row (one key)."""
    from sagebwd_hf.interface import _attn

    q, k, v, _ = make_qkv(1, 4, 2, 700, 700, head_dim, torch.bfloat16, "cuda", k_outliers=10.0, seed=23)
    out, lse, row_max = _attn(q, k, v, None, None, 700, 700, head_dim ** -0.5, -1, 0, True, False,
                              "triton", 0.0, None, DS_BOUND, None)
    want = _kernel_scores_row_max(q, k)
    assert row_max.shape == lse.shape and torch.isfinite(row_max).all(), row_max
    # (the kernel's score is an fma of its int32 sum with a rounded offset: within a unit of the sum, ~1e-4 here)
    torch.testing.assert_close(row_max.double(), want, rtol=1e-5, atol=1e-3)
    p_max = torch.exp2(row_max - lse)
    # (within fp32's rounding of scores and lse near 2^5: an ulp there is 4e-6)
    assert (p_max > 0).all() and (p_max <= 1 + 1e-4).all(), (p_max.min(), p_max.max())
    assert (p_max[..., 0] > 1 - 1e-4).all(), p_max[..., 0]      # a causal first row sees one key: P = 1


@on_hopper
def test_op_checks_and_compiles():
    """The op under ds_bound (its third output, the row maxima) passes opcheck, and a fully compiled forward and
    backward equals the eager one (dQ's fp32 reduce-adds: up to their summation order)."""
    from sagebwd_hf import interface
    from sagebwd_hf.testing import error_stats

    q, k, v, do = make_qkv(1, 4, 2, 256, 256, 128, torch.bfloat16, "cuda", k_outliers=10.0, seed=26)
    args = (None, None, 256, 256, 128 ** -0.5, -1, 0, True, False, "triton", 0.0, None, DS_BOUND, None)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(interface._attn_fwd_op, tuple(leaves) + args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    fn = functools.partial(sagebwd_attn_func, causal=True, precision=DS_BOUND)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)   # fullgraph: a break would raise
    got, want = run_with_grads(compiled, q, k, v, do), run_with_grads(fn, q, k, v, do)
    for name in want:
        cos, rel = error_stats(got[name], want[name])
        assert rel < 1e-5 if name != "dQ" else rel < 1e-3, (name, cos, rel)


@on_hopper
def test_refused_where_the_one_launch_does_not_run():
    """deterministic=True (three launches) raises naming ds_bound before any launch."""
    q, k, v, do = make_qkv(1, 4, 4, 256, 256, 64, torch.bfloat16, "cuda", seed=24)
    out = sagebwd_attn_func(q.requires_grad_(), k, v, precision=DS_BOUND, deterministic=True)
    with pytest.raises(NotImplementedError, match="ds_bound is computed only by the Hopper one-launch backward"):
        out.backward(do)
