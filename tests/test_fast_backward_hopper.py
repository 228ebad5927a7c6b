"""The Gluon backward's FP8 rules (sagebwd_hf.numerics: precision "pv_e4m3", "pv_e4m3+p_static"): dV = P^T dO in
e4m3, dK and dQ as in "accurate". On an sm_90 GPU, forward and backward through the op against the PyTorch reference
of the same rule and against float64, dO's e4m3 preparation byte for byte against the reference's; everywhere,
which backward computes which precision (a backward that does not compute it raises, naming what is missing; it never
computes another rule instead), and the preparation's scales."""
import functools
import os
import re

import pytest
import torch

from sagebwd_hf import naive, sagebwd_attn_func, sagebwd_attn_varlen_func
from sagebwd_hf.interface import GLUON_BACKWARD_RULES, backward_rule, check_kernels_compute
from sagebwd_hf.kernels import dispatch
from sagebwd_hf.numerics import parse_precision
from sagebwd_hf.testing import error_stats, exact_reference, make_qkv, run_with_grads

from conftest import kernel_devices

IS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def on_hopper(test):
    return pytest.mark.gpu(pytest.mark.skipif(not IS_SM90, reason="the Gluon kernels need an sm_90 GPU")(test))


# (the last two sum dV and dK in place: one key-tile launch for both over 64-query tiles)
FP8_RULES = ["pv_e4m3", "pv_e4m3+p_static", "pv_e4m3+dk_e4m3", "pv_e4m3+p_static+dk_e4m3",
             "pv_e4m3+p_static+do_sequence+dk_e4m3"]
# dP in INT8 too, and dK's dS at each query's fixed scale: the one launch's only (three launches refuse them;
# ds_bound: tests/test_ds_bound.py)
DP_INT8 = "pv_e4m3+p_static+do_sequence+dk_e4m3+dp_int8"
ONE_LAUNCH_RULES = [DP_INT8, "pv_e4m3+p_static+do_sequence+dk_e4m3+ds_bound",
                    "pv_e4m3+p_static+do_sequence+dk_e4m3+dp_int8+ds_bound"]

# dV against the reference of the same rule: the share of the e4m3 roundings' effect the kernel may move, derived
# as tests/test_fast_forward_hopper.py's _check_against_reference derives O's (see _check_against_reference here).
# Measured on an H200 (2026-11-27): 6.6% on padded calls (head dim 64, causal, N=1K), and up to 11.3% on a packed
# batch whose error sat in a sequence's first 64 keys (rel L2 1.2-1.3e-2 there, 2-5e-3 elsewhere; bit-identical
# run to run, absent with another seed in the same layout): a causal sequence's first keys take their dV from few
# large P values, and one P byte rounded the other way at an e4m3 midpoint moves such a row by up to 1/16.
E4M3_SHARE = 0.15
# dQ and dK: the same kernels and rule in every precision here; what moves them is the forward's O (delta =
# rowsum(dO * O)) and the statistics of a distance summed from many roundings over other inputs
SAME_RULE_MARGIN = 1.2
# Against float64 on K-outlier inputs (docs/fast_preset.md, CPU: dV cos 0.9992-0.9994, rel L2 0.034-0.039 for these
# rules; dQ, dK cos 0.9997-0.9998 as "accurate"): the accuracy bar on dV, and bounds that a wrong scale misses.
EXACT_MIN_COS_DV = 0.999
EXACT_MAX_REL_DV = 0.045
EXACT_MIN_COS_DQK = 0.999

# (batch, heads, kv_heads, seqlen, head_dim, causal, deterministic): at head dim 64 the op's default backward is
# the one launch (dV, dK and dQ in the key-tile programs, 64-query tiles), deterministic=True the three launches
CASES = [(2, 4, 4, n, d, causal, None) for n in (1024, 4096) for d in (64, 128) for causal in (False, True)]
CASES += [(2, 4, 4, 1024, 64, causal, True) for causal in (False, True)]
CASES += [(2, 4, 2, 4096, 128, True, None)]        # GQA


def _case_id(c):
    return (f"b{c[0]}h{c[1]}kv{c[2]}-n{c[3]}-d{c[4]}-{'causal' if c[5] else 'full'}"
            f"{'-deterministic' if c[6] else ''}")


def _check_against_reference(attn, q, k, v, do, rule, label):
    """The op's forward and backward with ``precision=rule`` on the kernels (``attn``: the op with the call's other
    arguments) against the reference's of the same rule (``backend="naive"``, which computes the rule of the
    backward the kernels run: plan.backward_rule). Returns (the rule's kernel results, the accurate kernel's).

    dV's bound: dO's e4m3 bytes are the reference's (the dO pass test), and S^T, P^T's exponent, the per-key maxima
    and the epilogue are the accurate kernel's code: what those differ by is measured here, as the accurate kernel
    against its reference. The e4m3 P^T dO adds the mechanisms the forward's P V adds, each a fraction of what
    rounding P and dO to e4m3 moves dV by (the rule's reference against the accurate reference): P^T's bytes flipped
    at e4m3 midpoints by the kernel's few-ulp differences in P^T (ex2.approx, dO's or 448's log2 folded into the
    exponent where the reference multiplies), and the FP8 wgmma's ~14-bit sums of each 128-query tile
    (tests/test_fast_forward_hopper.py measured 0.1-1.3% and 1.5-2.5% of that share for O's tiles of 128 keys).
    Their sum is bounded by E4M3_SHARE of the share. dQ and dK: SAME_RULE_MARGIN times the accurate kernel's
    distance from its reference, plus E4M3_SHARE of the rule's share (what the e4m3 forward's O moves delta by)."""
    got = run_with_grads(functools.partial(attn, precision=rule), q, k, v, do)
    for name, x in got.items():
        assert torch.isfinite(x).all(), f"{label} {name}: an element the kernel never wrote"
    ref = run_with_grads(functools.partial(attn, precision=rule, backend="naive"), q, k, v, do)
    accurate = run_with_grads(attn, q, k, v, do)
    accurate_ref = run_with_grads(functools.partial(attn, backend="naive"), q, k, v, do)
    for name in ("dQ", "dK", "dV"):
        shared = error_stats(accurate[name], accurate_ref[name])[1]
        e4m3_share = error_stats(ref[name], accurate_ref[name])[1]
        bound = (shared if name == "dV" else SAME_RULE_MARGIN * shared) + E4M3_SHARE * e4m3_share
        cos, rel = error_stats(got[name], ref[name])
        print(f"{label} {name}: kernel vs reference cos {cos:.6f} rel {rel:.2e} (bound {bound:.2e}; accurate "
              f"kernel vs its reference {shared:.2e}, the rule's reference vs the accurate one {e4m3_share:.2e})")
        assert rel <= bound, (f"{label} {name}: kernel vs reference rel L2 {rel:.2e} > {bound:.2e} (accurate kernel "
                              f"vs its reference {shared:.2e}; the rule's reference vs the accurate one "
                              f"{e4m3_share:.2e})")
    return got, accurate


def _check_against_float64(got, accurate, q, k, v, do, causal, label):
    exact = exact_reference(q, k, v, do, window_size=(-1, 0) if causal else (-1, -1))
    cos, rel = error_stats(got["dV"], exact["dV"])
    assert cos >= EXACT_MIN_COS_DV and rel <= EXACT_MAX_REL_DV, \
        f"{label} dV against float64: cos {cos:.5f}, rel {rel:.4f}"
    assert error_stats(accurate["dV"], exact["dV"])[1] < rel     # e4m3 costs dV accuracy, as the rule's table says
    for name in ("dQ", "dK"):
        cos = error_stats(got[name], exact[name])[0]
        assert cos >= EXACT_MIN_COS_DQK, f"{label} {name} against float64: cos {cos:.5f}"
    assert not torch.equal(got["dV"], accurate["dV"])        # the precision reaches the dV kernel


@on_hopper
@pytest.mark.parametrize("rule", FP8_RULES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gluon_backward_computes_the_rule(case, rule):
    b, h, hk, n, d, causal, deterministic = case
    q, k, v, do = make_qkv(b, h, hk, n, n, d, torch.bfloat16, "cuda", k_outliers=10.0, seed=n + d + causal)
    # (the op fills its outputs and gradients with NaN before the kernels write them: tests/conftest.py)
    attn = functools.partial(sagebwd_attn_func, causal=causal, deterministic=deterministic)
    dispatch.reset_kernel_counts()
    run_with_grads(functools.partial(attn, precision=rule), q, k, v, do)
    counts = dispatch.kernel_counts()
    rules = parse_precision(rule)    # (in place with P's fixed scale, the one launch runs at head dim 128 too)
    one_launch = backward_rule(q.device, d, d, deterministic=deterministic, in_place=rules.in_place,
                               p_static=rules.p_static).one_launch
    d128 = rules.in_place and rules.p_static
    assert one_launch == ((d == 64 or d128) and not deterministic) or os.environ.get(dispatch.BACKWARD_ENV)
    assert counts.get("bwd_gluon_one_launch" if one_launch else "bwd_gluon") == 1, counts
    assert counts.get("fwd_gluon") == 1, counts
    got, accurate = _check_against_reference(attn, q, k, v, do, rule, f"{rule} {_case_id(case)}")
    _check_against_float64(got, accurate, q, k, v, do, causal, f"{rule} {_case_id(case)}")


def _packed_batch(seed, deterministic=None):
    """A causal packed batch of uneven sequences (one shorter than a tile, one empty), 4 query heads sharing 2 KV
    heads of 64: (the varlen call, (q, k, v, dO) packed ``[T, H, D]``)."""
    lengths = [300, 1, 0, 1100, 129]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    total = int(cu[-1])
    q, k, v, do = make_qkv(1, 4, 2, total, total, 64, torch.bfloat16, "cuda", k_outliers=10.0, seed=seed)

    def attn(q, k, v, **kw):
        return sagebwd_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                                        deterministic=deterministic, **kw)
    return attn, tuple(x[0].transpose(0, 1).contiguous() for x in (q, k, v, do))


@on_hopper
@pytest.mark.parametrize("deterministic", [None, True])
@pytest.mark.parametrize("rule", FP8_RULES)
def test_packed_batch(rule, deterministic):
    """A packed batch of uneven sequences (one shorter than a tile, one empty): dO's scales per sequence's query
    tiles (p_static) and the token-major copy's aligned starts."""
    attn, tensors = _packed_batch(seed=12, deterministic=deterministic)
    _check_against_reference(attn, *tensors, rule, f"{rule} packed")


@on_hopper
@pytest.mark.parametrize("rule", FP8_RULES)
def test_sinks_and_cap(rule):
    """A call with sinks and a soft cap (three launches: the cap's dQ row term), the dV rule unchanged by them."""
    q, k, v, do = make_qkv(2, 4, 2, 1000, 1000, 128, torch.bfloat16, "cuda", k_outliers=10.0, seed=13)
    sinks = torch.randn(4, device="cuda")
    attn = functools.partial(sagebwd_attn_func, causal=True, sinks=sinks, softcap=30.0)
    _check_against_reference(attn, q, k, v, do, rule, f"{rule} sinks and cap")


@on_hopper
@pytest.mark.parametrize("case", [(2, 4, 4, 1024, d, causal, None) for d in (64, 128) for causal in (False, True)]
                         + [(2, 4, 2, 4096, 128, True, None)], ids=_case_id)
def test_dp_int8_one_launch(case):
    """dP = dO V^T in INT8 in the one launch (V's INT8 copy one scale a key block, dO's one a token, both folded
    into the per-query vectors): against the reference of the rule and float64, and not the fastest preset's
    numbers."""
    check_one_launch_rule(case, DP_INT8, "fastest")


def check_one_launch_rule(case, rule, base):
    """A one-launch rule on ``case`` against its reference and float64, run by the one launch, with dV equal to the
    ``base`` precision's (the same dV rule) and dK not."""
    b, h, hk, n, d, causal, deterministic = case
    q, k, v, do = make_qkv(b, h, hk, n, n, d, torch.bfloat16, "cuda", k_outliers=10.0, seed=n + d + causal)
    attn = functools.partial(sagebwd_attn_func, causal=causal, deterministic=deterministic)
    dispatch.reset_kernel_counts()
    got, accurate = _check_against_reference(attn, q, k, v, do, rule, f"{rule} {_case_id(case)}")
    assert dispatch.kernel_counts().get("bwd_gluon_one_launch"), dispatch.kernel_counts()
    _check_against_float64(got, accurate, q, k, v, do, causal, f"{rule} {_case_id(case)}")
    other = run_with_grads(functools.partial(attn, precision=base), q, k, v, do)
    assert torch.equal(got["dV"], other["dV"]) and not torch.equal(got["dK"], other["dK"])


@on_hopper
def test_dp_int8_packed_and_refused_off_the_one_launch():
    """dp_int8 on a packed batch of uneven sequences against its reference; a call whose backward is not the one
    launch (deterministic=True) raises, naming dp_int8, before any launch."""
    attn, tensors = _packed_batch(seed=14)
    _check_against_reference(attn, *tensors, DP_INT8, "dp_int8 packed")
    q, k, v, do = make_qkv(1, 4, 4, 256, 256, 64, torch.bfloat16, "cuda", seed=15)
    out = sagebwd_attn_func(q.requires_grad_(), k, v, precision=DP_INT8, deterministic=True)
    with pytest.raises(NotImplementedError, match="dp_int8 is computed only by the Hopper one-launch backward"):
        out.backward(do)


@on_hopper
def test_mla_refuses_a_fixed_p_scale_and_computes_pv_e4m3():
    """MLA's head dims (192/128): the dV kernel's 64-query tile holds fewer of dO's per-channel scales than V's 128
    channels: p_static is refused before any launch; pv_e4m3 (per-token dO scales) runs."""
    q, k, v, do = make_qkv(1, 4, 2, 700, 700, 192, torch.bfloat16, "cuda", k_outliers=10.0, seed=15,
                           head_dim_v=128)
    attn = functools.partial(sagebwd_attn_func, causal=True)
    with pytest.raises(NotImplementedError, match="fewer than V's head dim 128"):
        run_with_grads(functools.partial(attn, precision="pv_e4m3+p_static"), q, k, v, do)
    _check_against_reference(attn, q, k, v, do, "pv_e4m3", "pv_e4m3 MLA")


def _assert_same_e4m3(got8, want8, label):
    bad = (got8 != want8).nonzero().tolist()
    assert not bad, (f"{label}: {len(bad)} of {got8.numel()} e4m3 values differ from the reference's; first: "
                     + ", ".join(f"{tuple(i)} got {got8[tuple(i)].item():g} want {want8[tuple(i)].item():g}"
                                 for i in bad[:8]))


def _e4m3(x8t, n):
    """The [B, H, D, N_pad] e4m3 bytes of a token-major copy as fp32 [B, H, n, D]."""
    return x8t[..., :n].view(torch.float8_e4m3fn).float().transpose(-1, -2)


@on_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_do_pass_writes_the_reference_bytes(head_dim):
    """dO's e4m3 pass (prepare_backward's do_e4m3, the op's launches): the reference's bytes bit for bit (dO times 448
    / its max, that quotient rounded once, then e4m3 nearest even; an all-zero token gives zeros) and its scales,
    per token (pv_e4m3) and per channel per query tile (p_static: 64 queries in Q's launch, 128 in one of its own);
    a packed batch's aligned, operand-ordered copy holds each sequence's tiles from its own start."""
    from sagebwd_hf.kernels.layout import SeqLayout
    from sagebwd_hf.kernels.quantize import aligned_starts, operand_order_columns, prepare_backward

    gen = torch.Generator().manual_seed(head_dim)
    do = torch.randn(2, 3, 700, head_dim, generator=gen) * torch.exp(torch.randn(1, 1, 700, 1, generator=gen) * 2)
    do[:, :, 5] = 0.0
    do = do.to("cuda", torch.bfloat16)
    q, o = torch.randn_like(do), torch.randn_like(do)
    lay = SeqLayout(2, 700, None)
    prep = functools.partial(prepare_backward, q, q, do, o, lay, lay, head_dim ** -0.5, True, False)
    _, do_q = prep(do_e4m3=True)
    want8, want_scale = naive._e4m3_per_slice(do.float(), -1)
    _assert_same_e4m3(_e4m3(do_q.x8t, 700), want8, "per token")
    assert torch.equal(do_q.scale, want_scale.squeeze(-1))
    for tile in (64, 128):
        _, do_q = prep(do_e4m3=True, do_channel_tile=tile)
        want8, want_scale = naive._e4m3_per_slice(naive._tiles(do.float(), 2, tile), 3)
        _assert_same_e4m3(_e4m3(do_q.x8t, 700), want8.flatten(2, 3)[:, :, :700], f"per channel per {tile}")
        assert torch.equal(do_q.scale, want_scale[:, :, :, 0])          # [S, H, tiles, D]

    lengths = [5, 0, 17, 600, 33]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    do, q, o = (x[:1, :, :int(cu[-1])].contiguous() for x in (do, q, o))
    lay = SeqLayout(len(lengths), max(lengths), cu)
    starts = aligned_starts(lay)
    perm = operand_order_columns(640)
    _, do_q = prepare_backward(q, q, do, o, lay, lay, head_dim ** -0.5, True, False, operand_order=True,
                               t_starts_q=starts, t_starts_k=starts, do_e4m3=True, do_channel_tile=128)
    for i, n in enumerate(lengths):
        a, s = int(cu[i]), int(starts[i])
        want8, want_scale = naive._e4m3_per_slice(naive._tiles(do[:, :, a:a + n].float(), 2, 128), 3)
        got = do_q.x8t[..., (s + perm[:n]).to("cuda")].view(torch.float8_e4m3fn).float().transpose(-1, -2)
        _assert_same_e4m3(got, want8.flatten(2, 3)[:, :, :n], f"packed sequence {i}")
        if n:
            assert torch.equal(do_q.scale[i, :, :want_scale.shape[2]], want_scale[0, :, :, 0])


@on_hopper
@pytest.mark.parametrize("group", [1, 2])
def test_do_sequence_pass_writes_the_reference_bytes(group):
    """dO's pass under do_sequence (quantize_do_sequence): one e4m3 scale per channel over each sequence and the
    query heads of its KV group, the reference's bytes bit for bit, its maxima as the scales of every head of the
    group, and delta = rowsum(dO * O)."""
    from sagebwd_hf.kernels.layout import SeqLayout
    from sagebwd_hf.kernels.quantize import quantize_do_sequence

    gen = torch.Generator().manual_seed(group)
    do = torch.randn(2, 4, 700, 128, generator=gen) * torch.exp(torch.randn(1, 4, 700, 1, generator=gen) * 2)
    do = do.to("cuda", torch.bfloat16)
    o = torch.randn_like(do)
    got = quantize_do_sequence(do, SeqLayout(2, 700, None), group, o)
    want_max = do.float().abs().amax(2).view(2, 4 // group, group, 128).amax(2, keepdim=True)
    want_max = want_max.expand(-1, -1, group, -1).reshape(2, 4, 128)
    assert torch.equal(got.scale, want_max)
    want8 = naive.round_e4m3(do.float() * (torch.full_like(want_max, 448.0) / want_max)[:, :, None])
    _assert_same_e4m3(_e4m3(got.x8t, 700), want8, f"per channel per sequence, group {group}")
    torch.testing.assert_close(got.delta, (do.float() * o.float()).sum(-1), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                    reason="the preparation under Triton's interpreter")
def test_do_sequence_pass_scales():
    """quantize_do_sequence under the interpreter: its scales are dO's channel maxima over each sequence and the
    query heads of its KV group (a packed batch's per sequence), delta is every rule's, and prepare_backward takes
    it for ``do_group``."""
    from sagebwd_hf.kernels.layout import SeqLayout
    from sagebwd_hf.kernels.quantize import prepare_backward, quantize_do_sequence

    gen = torch.Generator().manual_seed(4)
    do = (torch.randn(2, 4, 150, 64, generator=gen) * torch.exp(torch.randn(1, 4, 150, 1, generator=gen))).bfloat16()
    q, o = torch.randn_like(do), torch.randn_like(do)
    lay = SeqLayout(2, 150, None)
    got = quantize_do_sequence(do, lay, 2, o)
    want = do.float().abs().amax(2).view(2, 2, 2, 64).amax(2, keepdim=True).expand(-1, -1, 2, -1).reshape(2, 4, 64)
    assert torch.equal(got.scale, want)
    prep = functools.partial(prepare_backward, q, q, do, o, lay, lay, 0.125, True, False)
    assert torch.equal(got.delta, prep()[1].delta)
    assert torch.equal(prep(do_e4m3=True, do_group=2)[1].scale, want)
    cu = torch.tensor([0, 40, 40, 150], dtype=torch.int32)
    packed = quantize_do_sequence(do[:1], SeqLayout(3, 110, cu), 4, o[:1])
    for i in range(3):
        a, n = int(cu[i]), int(cu[i + 1] - cu[i])
        if n:
            assert torch.equal(packed.scale[i], do[0, :, a:a + n].float().abs().amax((0, 1)).expand(4, -1))


def test_which_backward_computes_which_precision():
    """check_kernels_compute for a backward: the Gluon kernels compute accurate, pv_e4m3 and pv_e4m3+p_static; with
    ds_tile the refusal names ds_tile; the portable kernels accurate only; no kernel p_static or ds_tile alone."""
    assert GLUON_BACKWARD_RULES == tuple(parse_precision(r) for r in FP8_RULES + ONE_LAUNCH_RULES)
    for precision in ["accurate", "fast"] + FP8_RULES + ONE_LAUNCH_RULES:
        check_kernels_compute(precision, backward_on_gluon=True)
    check_kernels_compute("accurate")
    for precision in FP8_RULES + ONE_LAUNCH_RULES:
        with pytest.raises(NotImplementedError, match=rf"precision='{re.escape(precision)}' is computed only by the "
                                                      r"PyTorch path .*backward runs the portable Triton kernels"):
            check_kernels_compute(precision)
    for precision in ("pv_e4m3+p_static+ds_tile", "pv_e4m3+ds_tile"):
        for backward_on_gluon in (True, False):
            with pytest.raises(NotImplementedError, match=r"ds_tile \(one dS scale per 64x64 tile for dK and dQ\) "
                                                          r"is computed by no backward kernel"):
                check_kernels_compute(precision, backward_on_gluon=backward_on_gluon)
    for precision in ("p_static", "ds_tile", "p_static+ds_tile"):
        with pytest.raises(NotImplementedError, match=rf"precision='{re.escape(precision)}' is computed only .*"
                                                      r"Gluon \(Hopper\) backward also 'pv_e4m3'"):
            check_kernels_compute(precision, backward_on_gluon=True)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                    reason="the preparation under Triton's interpreter")
def test_do_pass_scales_and_launches():
    """dO's e4m3 pass under the interpreter: its scales are the reference's (per token, and per channel per query
    tile: [S, H, tiles, D], a packed batch's per sequence), in Q's launch or alone the same; the interpreter's fp8
    cast is not the GPU's round to nearest (the bytes: test_do_pass_writes_the_reference_bytes)."""
    from sagebwd_hf.kernels.layout import SeqLayout
    from sagebwd_hf.kernels.quantize import prepare_backward, quantize

    gen = torch.Generator().manual_seed(3)
    do = (torch.randn(2, 2, 150, 64, generator=gen) * torch.exp(torch.randn(1, 1, 150, 1, generator=gen))).bfloat16()
    q, o = torch.randn_like(do), torch.randn_like(do)
    lay = SeqLayout(2, 150, None)
    prep = functools.partial(prepare_backward, q, q, do, o, lay, lay, 0.125, True, False)
    want_scale = naive._e4m3_per_slice(do.float(), -1)[1].squeeze(-1)
    paired = prep(do_e4m3=True)[1]
    assert torch.equal(paired.scale, want_scale)
    assert torch.equal(paired.delta, prep()[1].delta)       # delta is every rule's
    for tile in (64, 128):                                  # 64: in Q's launch; 128: a pass of its own
        do_q = prep(do_e4m3=True, do_channel_tile=tile)[1]
        want = naive._e4m3_per_slice(naive._tiles(do.float(), 2, tile), 3)[1][:, :, :, 0]
        assert do_q.scale.shape == (2, 2, -(-150 // tile), 64) and torch.equal(do_q.scale, want)
        alone = quantize(do, lay, natural=False, transposed=True, out_for_delta=o, e4m3=True, channel_tile=tile)
        assert torch.equal(alone.scale, do_q.scale) and torch.equal(alone.x8t, do_q.x8t)
    cu = torch.tensor([0, 40, 40, 150], dtype=torch.int32)
    flat = do[:1, :, :150]
    packed = quantize(flat, SeqLayout(3, 110, cu), natural=False, transposed=True, e4m3=True, channel_tile=64)
    for i in range(3):
        a, n = int(cu[i]), int(cu[i + 1] - cu[i])
        if n:
            want = naive._e4m3_per_slice(naive._tiles(flat[:, :, a:a + n].float(), 2, 64), 3)[1][0, :, :, 0]
            assert torch.equal(packed.scale[i, :, :want.shape[1]], want)


@pytest.mark.parametrize("device", kernel_devices())
def test_q_pass_writes_the_e4m3_token_major_copy(device):
    """Q's pass with qt_e4m3 (the dk_e4m3 rule's dK on the Gluon kernels): its natural copy and scales are the INT8
    pass's, its token-major copy and per-token scales those of an e4m3 pass of their own, bit for bit; padded and
    packed batches (aligned starts, operand order), an all-zero token and a NaN one included."""
    from sagebwd_hf.kernels.layout import SeqLayout
    from sagebwd_hf.kernels.quantize import aligned_starts, prepare_backward, quantize

    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 2, 150, 64, generator=gen) * torch.exp(torch.randn(1, 1, 150, 1, generator=gen) * 2)
    q[0, 1, 7], q[1, 0, 30, 5] = 0.0, float("nan")
    q = q.to(device, torch.bfloat16)
    k, do, o = (torch.randn_like(q) for _ in range(3))
    cu = torch.tensor([0, 40, 40, 150], dtype=torch.int32, device=device)
    for lay, x in ((SeqLayout(2, 150, None), q), (SeqLayout(3, 110, cu), q[:1])):
        starts = aligned_starts(lay) if lay.is_varlen else None
        kx, dox, ox = (t[:x.shape[0]].contiguous() for t in (k, do, o))
        prep = functools.partial(prepare_backward, x, kx, dox, ox, lay, lay, 0.125, True, False, operand_order=True,
                                 t_starts_q=starts, t_starts_k=starts, k_transposed=False)
        fused, plain = prep(qt_e4m3=True)[0], prep()[0]
        alone = quantize(x, lay, natural=False, transposed=True, e4m3=True, operand_order=True, t_starts=starts)
        assert torch.equal(fused.q8, plain.q8) and plain.qt_scale is None
        for got, want in ((fused.q_scale, plain.q_scale), (fused.q_scale_raw, plain.q_scale_raw),
                          (fused.qt_scale, alone.scale)):
            assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0))
        assert torch.equal(fused.q8t, alone.x8t) and not torch.equal(fused.q8t, plain.q8t)


@pytest.mark.parametrize("device", kernel_devices())
def test_do_pass_writes_int8_rows_for_dp_int8(device):
    """dO's do_sequence pass with ``do_int8_rows`` (the dp_int8 rule): its token-major e4m3 copy, channel maxima and
    delta are the plain pass's, bit for bit, and its natural copy quantize_per_token's INT8 scales and bytes (but at
    rounding ties: the reference's dO in dP); padded and packed batches, an all-zero token and a NaN one included."""
    from sagebwd_hf.kernels.layout import SeqLayout
    from sagebwd_hf.kernels.quantize import aligned_starts, prepare_backward
    from sagebwd_hf.naive import quantize_per_token

    gen = torch.Generator().manual_seed(12)
    do = torch.randn(2, 4, 150, 64, generator=gen) * torch.exp(torch.randn(1, 1, 150, 1, generator=gen) * 2) * 1e-3
    do[0, 1, 7], do[0, 0, 30, 5] = 0.0, float("nan")
    do = do.to(device, torch.bfloat16)
    q, o = (torch.randn_like(do) for _ in range(2))
    k = torch.randn(2, 2, 150, 64, device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0, 40, 40, 150], dtype=torch.int32, device=device)
    for lay, dx in ((SeqLayout(2, 150, None), do), (SeqLayout(3, 110, cu), do[:1])):
        starts = aligned_starts(lay) if lay.is_varlen else None
        qx, kx, ox = (t[:dx.shape[0]].contiguous() for t in (q, k, o))
        prep = functools.partial(prepare_backward, qx, kx, dx, ox, lay, lay, 0.125, True, False, operand_order=True,
                                 t_starts_q=starts, t_starts_k=starts, k_transposed=False, do_e4m3=True,
                                 do_group=2)
        rows, plain = prep(do_int8_rows=True)[1], prep()[1]
        assert plain.x8 is None and plain.x8_scale is None
        assert torch.equal(rows.x8t, plain.x8t)
        assert torch.equal(rows.scale.nan_to_num(-1.0), plain.scale.nan_to_num(-1.0))
        # (delta's row sums: the two compiled passes may contract them into FMAs differently on the GPU)
        torch.testing.assert_close(rows.delta, plain.delta, rtol=1e-5, atol=1e-9, equal_nan=True)
        want8, want_scale = quantize_per_token(dx)
        ok = ~torch.isnan(want_scale)   # (a NaN token's bytes are the cast's; its scale keeps the NaN)
        got8 = rows.x8.float()
        # scales equal; bytes equal but at ties, where 127 / max within an ulp of the reference's rounds either way
        assert torch.equal(rows.x8_scale[ok], want_scale[ok])
        off = (got8[ok] - want8[ok]).abs()
        assert off.max() <= 1 and (off > 0).float().mean() < 1e-3
        assert torch.isnan(rows.x8_scale[~ok]).all() and (~ok).sum() == 1
