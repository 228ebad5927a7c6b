"""The Gluon forward's FP8 rules (sagebwd_hf.numerics: precision "pv_e4m3", "pv_e4m3+p_static", and so the forward
of "fast"): on an sm_90 GPU, against the PyTorch reference of the same rule and against float64 attention, V's e4m3
preparation byte for byte against the reference's; everywhere, which kernel pass computes which precision (a pass
that does not compute it raises, it never computes "accurate" instead)."""
import functools
import math
import os
import re

import pytest
import torch

from sagebwd_hf import naive, sagebwd_attn_func, sagebwd_attn_varlen_func
from sagebwd_hf.interface import check_kernels_compute
from sagebwd_hf.kernels import dispatch
from sagebwd_hf.testing import error_stats, make_qkv

IS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def on_hopper(test):
    return pytest.mark.gpu(pytest.mark.skipif(not IS_SM90, reason="the Gluon kernels need an sm_90 GPU")(test))


FP8_RULES = ["pv_e4m3", "pv_e4m3+p_static"]

# O against the reference of the same rule: the share of the e4m3 roundings' effect the kernel may move (see
# _check_against_reference). lse does not see P's rounding.
E4M3_SHARE = 0.10
REF_MAX_REL_LSE = 1e-4
# Against float64 attention on K-outlier inputs (docs/fast_preset.md, CPU: O cos 0.9993-0.9994, rel L2
# 0.033-0.038 for these rules; accurate 0.017-0.020): the accuracy bar on O, and a bound that a wrong scale misses.
EXACT_MIN_COS_O = 0.999
EXACT_MAX_REL_O = 0.045

# (batch, heads, kv_heads, seqlen, head_dim, causal[, V's head dim])
CASES = [(2, 4, 4, n, d, causal) for n in (1024, 4096) for d in (64, 128) for causal in (False, True)]
CASES += [(2, 4, 2, 4096, 128, True),           # GQA
          (1, 4, 2, 1000, 192, True, 128)]      # MLA's head dims, N not a multiple of the tiles


def _case_id(c):
    return f"b{c[0]}h{c[1]}kv{c[2]}-n{c[3]}-d{c[4]}{f'v{c[6]}' if len(c) > 6 else ''}-{'causal' if c[5] else 'full'}"


def _check_against_reference(attn, got, rule, label):
    """``got`` (out, lse) of ``attn(precision=rule, return_lse=True)`` against the reference's; returns the accurate
    kernel's out.

    O's bound, both outputs rounded to bf16. V's e4m3 bytes are the reference's (the V pass test), and the scores,
    running max, row sum and epilogue are the accurate kernel's code: what those differ by is measured here, as the
    accurate kernel against its reference. The e4m3 P V adds two mechanisms, each a
    fraction of what rounding P and V to e4m3 moves O by (the rule's reference against the accurate reference,
    rel L2 0.034-0.039 on these inputs):

    - P's bytes: a P whose fp32 value lies within the kernel's difference from the reference (ex2.approx against
      exp2, the FMA'd argument: a few ulp) of an e4m3 rounding midpoint rounds the other way, one step (1/16 to
      1/8 of the value) instead of a rounding error of rms step / sqrt(12). The reference recomputed with each
      exp2 result, or each score, moved by 1 to 4 ulp at random differs from itself by 0.1%-1.3% of that share
      (CPU, N=1K, D=128, both rules).
    - the FP8 wgmma sums each tile's product in the tensor core's own precision (~14 bits, DeepSeek-V3's report):
      emulated as each k=32 step's products and incoming sum aligned to the largest and truncated to 13-14 bits,
      1.5%-2.5% of that share (CPU, N=1K, D=128, p_static).

    Their sum, at most 3.8% at D=128, is bounded by E4M3_SHARE of the share, twice the most measured on an H200
    (2026-11-27: 7.2% at MLA's Q/K head dim 192, causal, whose longer score sums differ more from the
    reference's and so flip more of P's bytes)."""
    out, lse = got
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), f"{label}: an element the kernel never wrote"
    ref = attn(precision=rule, return_lse=True, backend="naive")
    accurate, accurate_ref = attn(), attn(backend="naive")
    shared = error_stats(accurate, accurate_ref)[1]
    e4m3_share = error_stats(ref[0], accurate_ref)[1]
    bound = shared + E4M3_SHARE * e4m3_share
    rel = error_stats(out, ref[0])[1]
    assert rel <= bound, (f"{label} O: kernel vs reference rel L2 {rel:.2e} > {bound:.2e} (accurate kernel vs its "
                          f"reference {shared:.2e} + {E4M3_SHARE} x the rule's reference vs the accurate one "
                          f"{e4m3_share:.2e})")
    rel = error_stats(lse, ref[1])[1]
    assert rel <= REF_MAX_REL_LSE, f"{label} lse: kernel vs reference rel L2 {rel:.2e}"
    return accurate


@on_hopper
@pytest.mark.parametrize("rule", FP8_RULES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gluon_forward_computes_the_rule(case, rule):
    b, h, hk, n, d, causal = case[:6]
    q, k, v, _ = make_qkv(b, h, hk, n, n, d, torch.bfloat16, "cuda", k_outliers=10.0, seed=n + d + causal,
                          head_dim_v=case[6] if len(case) > 6 else None)
    dispatch.reset_kernel_counts()
    # (the op fills out and lse with NaN before the kernel writes them: tests/conftest.py sets SAGEBWD_POISON)
    attn = functools.partial(sagebwd_attn_func, q, k, v, causal=causal)
    got = attn(precision=rule, return_lse=True)
    assert dispatch.kernel_counts().get("fwd_gluon") == 1, dispatch.kernel_counts()
    accurate = _check_against_reference(attn, got, rule, rule)
    out_exact, lse_exact = naive.attention_exact(q, k, v, window_size=(-1, 0) if causal else (-1, -1))
    cos, rel = error_stats(got[0], out_exact)
    assert cos >= EXACT_MIN_COS_O and rel <= EXACT_MAX_REL_O, f"{rule} O against float64: cos {cos:.5f}, rel {rel:.4f}"
    # (as tests/test_kernels.py's test_lse_matches_exact: the INT8 scores' error grows with the scores)
    assert torch.allclose(got[1].double(), lse_exact, atol=2e-2, rtol=1e-2)
    assert not torch.equal(accurate, got[0])        # the precision reaches the kernel
    assert error_stats(accurate, out_exact)[1] < rel     # and e4m3 costs accuracy, as the rule's table says


@on_hopper
def test_fast_forward_is_the_fp8_rules():
    """"fast" is pv_e4m3+p_static: the same forward, the same bits; ds_tile, a backward rule, changes no forward
    bit."""
    q, k, v, _ = make_qkv(2, 4, 2, 1000, 1000, 128, torch.bfloat16, "cuda", k_outliers=10.0, seed=11)
    fast = sagebwd_attn_func(q, k, v, causal=True, precision="fast", return_lse=True)
    rules = sagebwd_attn_func(q, k, v, causal=True, precision="pv_e4m3+p_static", return_lse=True)
    assert torch.equal(fast[0], rules[0]) and torch.equal(fast[1], rules[1])
    assert torch.equal(fast[0], sagebwd_attn_func(q, k, v, causal=True, precision="pv_e4m3+p_static+ds_tile"))
    per_tile = sagebwd_attn_func(q, k, v, causal=True, precision="pv_e4m3+ds_tile")
    assert torch.equal(per_tile, sagebwd_attn_func(q, k, v, causal=True, precision="pv_e4m3"))
    assert not torch.equal(per_tile, fast[0])       # a fixed P scale is another rule


@on_hopper
@pytest.mark.parametrize("lengths, consumers", [([2300, 2100], 3), ([100, 150, 2100, 1], 2)],
                         ids=["mean-past-2048", "longest-past-2048"])
def test_packed_causal_with_either_consumer_count(lengths, consumers, forward_plans):
    """The e4m3 forward on a causal packed batch runs three consumer warpgroups where its sequences average 2,048
    query rows and two where only its longest passes them (kernels/plan.py): both against the reference."""
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    total = int(cu[-1])
    q, k, v, _ = make_qkv(1, 4, 2, total, total, 64, torch.bfloat16, "cuda", k_outliers=10.0, seed=14)
    flat = lambda x: x[0].transpose(0, 1).contiguous()  # noqa: E731
    attn = functools.partial(sagebwd_attn_varlen_func, flat(q), flat(k), flat(v), cu, cu, max(lengths),
                             max(lengths), causal=True)
    got = attn(precision="pv_e4m3+p_static", return_lse=True)
    assert forward_plans[0].gluon and forward_plans[0].consumers == consumers
    _check_against_reference(attn, got, "pv_e4m3+p_static", f"packed {lengths}")


@on_hopper
@pytest.mark.parametrize("rule", FP8_RULES)
def test_packed_sinks_and_cap(rule):
    """A packed batch (uneven sequences, one shorter than a tile), and a call with sinks and a soft cap (the
    fixed P scale's row sum holds 448 times the sum: the sinks' epilogue must see the true one)."""
    lengths = [300, 1, 1100, 129]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    total = int(cu[-1])
    q, k, v, _ = make_qkv(1, 4, 2, total, total, 64, torch.bfloat16, "cuda", k_outliers=10.0, seed=12)
    flat = lambda x: x[0].transpose(0, 1).contiguous()  # noqa: E731
    args = (flat(q), flat(k), flat(v), cu, cu, max(lengths), max(lengths))
    attn = functools.partial(sagebwd_attn_varlen_func, *args, causal=True)
    _check_against_reference(attn, attn(precision=rule, return_lse=True), rule, f"{rule} packed")
    q, k, v, _ = make_qkv(2, 4, 2, 1000, 1000, 128, torch.bfloat16, "cuda", k_outliers=10.0, seed=13)
    sinks = torch.randn(4, device="cuda")
    attn = functools.partial(sagebwd_attn_func, q, k, v, causal=True, sinks=sinks, softcap=30.0)
    _check_against_reference(attn, attn(precision=rule, return_lse=True), rule, f"{rule} sinks and cap")


def _assert_same_e4m3(got8, want8, v, label):
    """``got8`` == ``want8`` (e4m3 values as fp32, V's [B, H, N, D] with the max over N); else which elements differ
    and by how much: V, its channel's max, 448 v / max in float64 (a value on an e4m3 tie shows a rounding of the
    quotient deciding it), both values and their distance in e4m3 steps."""
    if torch.equal(got8, want8):
        return
    vd = v.double()
    v_max = vd.abs().amax(2, keepdim=True).expand_as(vd)
    codes = lambda x: x.to(torch.float8_e4m3fn).view(torch.uint8).int()  # noqa: E731
    bad = (got8 != want8).nonzero().tolist()
    rows = [f"{tuple(i)}: v {vd[tuple(i)].item():.8g} max {v_max[tuple(i)].item():.8g} "
            f"448 v / max {(448.0 * vd / v_max)[tuple(i)].item():.10g} got {got8[tuple(i)].item():g} "
            f"want {want8[tuple(i)].item():g} ({(codes(got8) - codes(want8))[tuple(i)].item():+d} codes)"
            for i in bad[:12]]
    raise AssertionError(f"{label}: {len(bad)} of {got8.numel()} e4m3 values differ from the reference's; first:\n"
                         + "\n".join(rows))


@on_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_v_pass_writes_the_reference_bytes(head_dim):
    """quantize_v(..., e4m3=True): V^T's bytes are the reference's e4m3 V (v times 448 / its channel's max, that
    quotient rounded once, then to e4m3 nearest even; an all-zero channel gives zeros) bit for bit, padded and in
    the op's fused preparation, and the channel maxima are the reference's (its scale is max / 448); a packed
    batch's aligned, operand-ordered copy holds the same bytes moved."""
    from sagebwd_hf.kernels.layout import SeqLayout
    from sagebwd_hf.kernels.quantize import aligned_starts, operand_order_columns, prepare_forward, quantize_v

    gen = torch.Generator().manual_seed(head_dim)
    v = torch.randn(2, 3, 700, head_dim, generator=gen) * torch.exp(torch.randn(1, 1, 1, head_dim, generator=gen) * 3)
    v[:, :, :, 5] = 0.0
    v = v.to("cuda", torch.bfloat16)
    want8, want_scale = naive._e4m3_per_slice(v.float(), 2)
    lay = SeqLayout(2, 700, None)
    v8t, v_max = quantize_v(v, lay, e4m3=True)
    got8 = v8t[..., :700].view(torch.float8_e4m3fn).float().transpose(-1, -2)
    _assert_same_e4m3(got8, want8, v, "V pass")
    assert torch.equal(v_max.unsqueeze(2) * (1.0 / 448.0), want_scale)      # v_max [S, H, D]
    q = torch.randn_like(v)
    _, v8t_fused, v_max_fused = prepare_forward(q, v, v, lay, lay, head_dim ** -0.5, True, False, v_e4m3=True)
    assert torch.equal(v8t_fused, v8t) and torch.equal(v_max_fused, v_max)

    lengths = [5, 0, 17, 600, 33]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    v = v[:1, :, :int(cu[-1])]
    lay = SeqLayout(len(lengths), max(lengths), cu)
    natural, v_max = quantize_v(v, lay, e4m3=True)
    starts = aligned_starts(lay)
    ordered, v_max_ordered = quantize_v(v, lay, starts, operand_order=True, e4m3=True)
    assert torch.equal(v_max, v_max_ordered)
    perm = operand_order_columns(640)
    for i, n in enumerate(lengths):
        a, s = int(cu[i]), int(starts[i])
        assert torch.equal(ordered[..., (s + perm[:n]).to("cuda")], natural[..., a:a + n])
        if n:
            want8 = naive._e4m3_per_slice(v[:, :, a:a + n].float(), 2)[0]
            _assert_same_e4m3(natural[..., a:a + n].view(torch.float8_e4m3fn).float().transpose(-1, -2), want8,
                              v[:, :, a:a + n], f"packed sequence {i}")


def test_which_pass_computes_which_precision():
    """check_kernels_compute: every kernel computes "accurate"; the Gluon forward the forward of every precision
    with pv_e4m3 (ds_tile is a backward rule); a backward on the portable kernels nothing else (the Gluon backward's
    rules: tests/test_fast_backward_hopper.py); no kernel a fixed INT8 P scale or ds_tile alone."""
    for precision in ("accurate", "pv_e4m3", "pv_e4m3+p_static", "pv_e4m3+ds_tile", "fast"):
        check_kernels_compute(precision, forward_on_gluon=True)
    check_kernels_compute("accurate", forward_on_gluon=False)
    check_kernels_compute("accurate")
    for precision in ("pv_e4m3", "fast"):
        with pytest.raises(NotImplementedError, match=rf"precision='{re.escape(precision)}' is computed only by the "
                                                      r"PyTorch path .*runs the portable Triton kernels"):
            check_kernels_compute(precision, forward_on_gluon=False)
        with pytest.raises(NotImplementedError, match=r"by the Gluon kernels \(an sm_90 GPU.*which compute its "
                                                      r"forward and its backward; this call's backward runs the "
                                                      r"portable"):
            check_kernels_compute(precision)
    with pytest.raises(NotImplementedError, match=r"which compute its forward and, without ds_tile, its backward; "
                                                  r"ds_tile \(one dS scale per 64x64 tile"):
        check_kernels_compute("pv_e4m3+p_static+do_sequence+dk_e4m3+ds_tile", backward_on_gluon=True)
    check_kernels_compute("pv_e4m3+p_static+do_sequence+dk_e4m3+ds_bound", forward_on_gluon=True)
    for precision in ("p_static", "ds_tile", "p_static+ds_tile"):
        for forward_on_gluon in (True, False, None):
            with pytest.raises(NotImplementedError, match=rf"precision='{re.escape(precision)}' is computed only"):
                check_kernels_compute(precision, forward_on_gluon=forward_on_gluon)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the kernels need CUDA or TRITON_INTERPRET=1")
def test_portable_forward_and_a_ds_tile_backward_refuse_the_fp8_rules(monkeypatch):
    """The op: a forward on the portable kernels (the interpreter, or SAGEBWD_KERNELS=triton on a GPU) raises
    before any launch; on Hopper the Gluon forward of "pv_e4m3+p_static+ds_tile" runs and its backward raises,
    naming ds_tile."""
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    q, k, v, do = make_qkv(1, 2, 2, 200, 200, 64, torch.bfloat16, device, seed=14)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    with pytest.raises(NotImplementedError, match="this call's forward runs the portable Triton kernels"):
        sagebwd_attn_func(q, k, v, causal=True, precision="pv_e4m3+p_static", backend="triton")
    monkeypatch.delenv(dispatch.ENV_VAR)
    if not IS_SM90:
        return
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = sagebwd_attn_func(*leaves, causal=True, precision="pv_e4m3+p_static+ds_tile")
    with pytest.raises(NotImplementedError, match=r"ds_tile \(one dS scale per 64x64 tile for dK and dQ\) is "
                                                  r"computed by no backward kernel"):
        out.backward(do)
    assert math.isfinite(out.float().sum().item())
