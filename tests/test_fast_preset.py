"""The precision presets (sagebwd_hf.numerics): "accurate" is the rule every kernel computes, unchanged; "fast" and
its single rules are computed by the PyTorch reference, checked here against float64 computations of the same
roundings and against exact attention; the kernels refuse them until they compute them."""
import math
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import sagebwd_hf
from sagebwd_hf import naive, sagebwd_attn_func, sagebwd_attn_varlen_func
from sagebwd_hf.numerics import (ACCURATE, DS_TILE, E4M3_MAX, FAST, RULES, Numerics, parse_precision,
                                 precision_name, round_e4m3)
from sagebwd_hf.testing import compare, exact_reference, make_qkv, run_with_grads

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
BAR = {"O": 0.999, "dV": 0.999, "dQ": 0.99, "dK": 0.99}
# (do_sequence is a rule of p_static's dO scales, ds_bound of dk_e4m3's product: they come with them)
EVERY_RULE = (["accurate", "fast", "fastest"] + [r for r in RULES if r not in ("do_sequence", "ds_bound")]
              + ["pv_e4m3+p_static+do_sequence", "pv_e4m3+p_static+do_sequence+dk_e4m3+ds_bound"])


def e4m3_float64(x: torch.Tensor) -> torch.Tensor:
    """float8 e4m3fn rounding computed in float64 from its definition: 3 mantissa bits, exponents from -6 (below:
    subnormals in steps of 2^-9), nearest with ties to even, magnitudes past 448 saturated."""
    x = x.double()
    mag = x.abs().clamp(max=E4M3_MAX)
    exponent = torch.floor(torch.log2(mag.clamp(min=2.0 ** -6)))
    step = torch.exp2(exponent - 3)
    scaled = mag / step
    rounded = torch.floor(scaled)
    frac = scaled - rounded
    rounded = rounded + ((frac > 0.5) | ((frac == 0.5) & (rounded % 2 == 1))).double()
    return torch.sign(x) * torch.clamp(rounded * step, max=E4M3_MAX)


def test_e4m3_rounding_is_the_format_definition():
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([
        torch.randn(20000, generator=gen) * 10.0 ** torch.randint(-4, 3, (20000,), generator=gen).float(),
        torch.tensor([0.0, 448.0, 449.0, 464.0, 1e6, -1e6, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -6]),
        # exact ties between two e4m3 values, at normal and subnormal magnitudes
        (torch.arange(16, 32).float() + 0.5) * 2.0 ** -3, (torch.arange(0, 8).float() + 0.5) * 2.0 ** -9,
    ]).float()
    assert torch.equal(round_e4m3(values).double(), e4m3_float64(values))


def test_tile_and_slice_quantizers_match_float64():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 100, 130, generator=gen) * torch.rand(1, 2, 100, 1, generator=gen) * 1e-3
    x8, scale = naive._tile_quantize(x, DS_TILE)
    xd = x.double()
    for i in range(0, 100, DS_TILE):
        for j in range(0, 130, DS_TILE):
            tile = xd[:, :, i:i + DS_TILE, j:j + DS_TILE]
            want_scale = tile.abs().amax((2, 3)) / 127
            got_scale = scale[:, :, i // DS_TILE, j // DS_TILE].double()
            torch.testing.assert_close(got_scale, want_scale, rtol=1e-6, atol=0)
            ti, tj = tile.shape[2], tile.shape[3]
            got = x8[:, :, i // DS_TILE, :ti, j // DS_TILE, :tj]
            want = torch.round(tile * (127 / tile.abs().amax((2, 3), keepdim=True)))
            # the same round-to-even of (nearly) the same quotient: at most a tie decided the other way
            assert (got.double() - want).abs().max() <= 1 and (got.double() != want).float().mean() < 1e-3
    v8, v_scale = naive._e4m3_per_slice(x, 2)
    want_scale = xd.abs().amax(2, keepdim=True) / E4M3_MAX
    torch.testing.assert_close(v_scale.double(), want_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(v8.double(), e4m3_float64(x / v_scale), rtol=0, atol=0)


def _inverse(x_max: torch.Tensor, rules: Numerics) -> torch.Tensor:
    """p_max / x_max in fp32 as the reference scales by it: e4m3's 448 / max rounded once (a tensor divided by a
    tensor; ``448.0 / x_max`` is PyTorch's reciprocal times 448, rounded twice, and decides exact e4m3 ties of bf16
    inputs the other way). INT8's 127 / max as before (the reference's 1 / (max / 127) is within the bound)."""
    if rules.pv_e4m3:
        return torch.full_like(x_max, rules.p_max) / x_max
    return rules.p_max / x_max


@pytest.mark.parametrize("rules", [Numerics(pv_e4m3=True), Numerics(p_static=True), Numerics(True, True, False)])
def test_forward_rule_matches_float64(rules):
    """O over one key tile from the rule's definition: P = exp2(s - m) mapped onto p_max (m the tile's row max, which
    is also the running max here), rounded to e4m3 or INT8; V per channel; the sum of unrounded P normalizes."""
    q, k, v, _ = make_qkv(1, 2, 2, 48, 64, 64, torch.bfloat16, "cpu", k_outliers=10.0, seed=2)
    scale = 64 ** -0.5
    out, _ = naive.sagebwd_forward_naive(q, k, v, scale, block_n=64, numerics=rules)
    keys = naive._quantize_keys(k, 2, True)
    s = naive._block_scores(q, keys, slice(0, 48), slice(0, 64), 48, 64, scale, (-1, -1), False)[0]
    m = s.amax(-1, keepdim=True)
    e = torch.exp2(s - (m - math.log2(rules.p_max))).double()     # as the kernels compute it, in fp32
    v_max = v.float().abs().amax(2, keepdim=True)
    v_quotient = (v.float() * _inverse(v_max, rules)).double()    # the kernels multiply by the inverse, in fp32
    rnd = e4m3_float64 if rules.pv_e4m3 else torch.round
    want = (rnd(e) @ rnd(v_quotient)) * (v_max.double() / rules.p_max) / e.sum(-1, keepdim=True)
    assert (out.double() - want).norm() / want.norm() < 4e-3       # bf16 result


def test_backward_rules_match_float64():
    """dV under p_static (+ pv_e4m3) and dK / dQ under ds_tile, from their definitions in float64, on one tile of 64
    queries and 64 keys (so the tiles' scales are whole-matrix ones)."""
    q, k, v, do = make_qkv(1, 1, 1, 64, 64, 64, torch.bfloat16, "cpu", k_outliers=10.0, seed=3)
    scale = 64 ** -0.5
    out, lse = naive.sagebwd_forward_naive(q, k, v, scale)
    keys = naive._quantize_keys(k, 1, True)
    s = naive._block_scores(q, keys, slice(0, 64), slice(0, 64), 64, 64, scale, (-1, -1), False)[0]
    p = torch.exp2(s - lse[..., None])
    dp = do.float() @ v.float().transpose(-1, -2)
    ds = (p * (dp - (do.float() * out.float()).sum(-1, keepdim=True))).double()
    pd = p.double()
    for e4m3 in (False, True):
        rules = Numerics(pv_e4m3=e4m3, p_static=True, ds_tile=True)
        dq, dk, dv = naive.sagebwd_backward_naive(q, k, v, out, lse, do, scale, block_m_dkdv=64, block_n_dq=64,
                                                  numerics=rules)
        rnd = e4m3_float64 if e4m3 else torch.round
        do_max = do.float().abs().amax(2, keepdim=True)                    # one scale per channel of the query tile
        do_quotient = (do.float() * _inverse(do_max, rules)).double()
        want_dv = (rnd(pd * rules.p_max).transpose(-1, -2) @ rnd(do_quotient)) * do_max.double() / rules.p_max ** 2
        assert (dv.double() - want_dv).norm() / want_dv.norm() < 4e-3      # bf16 result
        ds_scale = ds.abs().max() / 127
        ds8 = torch.round(ds / ds_scale)
        qd = q.double()
        q_scale = qd.abs().max() / 127                                     # one per 64 tokens
        want_dk = (ds8.transpose(-1, -2) @ torch.round(qd / q_scale)) * ds_scale * q_scale * scale
        k8, k_scale = keys.k8.double(), keys.k_scale.double()[..., None]   # K's own blocks (128 tokens at D=64)
        want_dq = (ds8 @ (k8 * k_scale)) * ds_scale * scale
        assert (dk.double() - want_dk).norm() / want_dk.norm() < 4e-3
        assert (dq.double() - want_dq).norm() / want_dq.norm() < 4e-3


@pytest.mark.parametrize("dp_int8", [False, True])
def test_in_place_rules_match_float64(dp_int8):
    """dV under do_sequence (dO one e4m3 scale per channel over the sequence and both query heads of the KV group)
    and dK under dk_e4m3 (Q one e4m3 scale per token folded into dS, dS one per key over the query tile), from their
    definitions in float64, on one tile of 64 queries and 64 keys, two query heads sharing one KV head; with
    ``dp_int8`` dS from dP = dO V^T in INT8 (dO one scale per token, V one for its block of keys)."""
    q, k, v, do = make_qkv(1, 2, 1, 64, 64, 64, torch.bfloat16, "cpu", k_outliers=10.0, seed=9)
    do[:, 1] *= 16    # the group's second head sets most of dO's channel maxima
    scale = 64 ** -0.5
    out, lse = naive.sagebwd_forward_naive(q, k, v, scale)
    keys = naive._quantize_keys(k, 2, True)
    s = naive._block_scores(q, keys, slice(0, 64), slice(0, 64), 64, 64, scale, (-1, -1), False)[0]
    p = torch.exp2(s - lse[..., None])
    dp = do.float() @ v.float().transpose(-1, -2)                      # (one KV head: broadcast over both heads)
    if dp_int8:   # x * (127 / max) rounded in fp32, as the rule's bytes; products exact in float64; the 64 keys
        # are one block of V's
        do_max, v_max = do.float().abs().amax(-1, keepdim=True), v.float().abs().amax((-1, -2), keepdim=True)
        do8, v8 = ((x.float() * (127 / m)).round().double() for x, m in ((do, do_max), (v, v_max)))
        dp = (do8 @ v8.transpose(-1, -2)) * (do_max.double() / 127) * (v_max.double() / 127)
    ds = (p * (dp - (do.float() * out.float()).sum(-1, keepdim=True))).double()
    rules = parse_precision("fastest+dp_int8".replace("fastest", "pv_e4m3+p_static+do_sequence+dk_e4m3")
                            if dp_int8 else "fastest")
    dq, dk, dv = naive.sagebwd_backward_naive(q, k, v, out, lse, do, scale, block_m_dkdv=64, block_n_dq=64,
                                              numerics=rules)
    do_max = do.float().abs().amax((1, 2), keepdim=True)               # over the tokens and the group's heads
    do_quotient = (do.float() * (torch.full_like(do_max, E4M3_MAX) / do_max)).double()
    want_dv = ((e4m3_float64(p.double() * E4M3_MAX).transpose(-1, -2) @ e4m3_float64(do_quotient))
               * do_max.double() / E4M3_MAX ** 2).sum(1, keepdim=True)
    # the bf16 result against the definition rounded to bf16 (one max per head instead: 3e-3 here)
    want_dv = want_dv.to(dv.dtype).double()
    assert (dv.double() - want_dv).norm() / want_dv.norm() < 5e-4
    q_max = q.float().abs().amax(-1, keepdim=True)                     # Q per token
    q8 = e4m3_float64((q.float() * (torch.full_like(q_max, E4M3_MAX) / q_max)).double())
    x = ds * (q_max.double() / E4M3_MAX)                               # Q's scale folded into dS
    x_max = x.abs().amax(-2, keepdim=True)                             # per key over the tile
    want_dk = ((e4m3_float64(x * (E4M3_MAX / x_max)).transpose(-1, -2) @ q8) * x_max.transpose(-1, -2) / E4M3_MAX
               * scale).sum(1, keepdim=True).to(dk.dtype).double()
    assert (dk.double() - want_dk).norm() / want_dk.norm() < 5e-4
    fast = naive.sagebwd_backward_naive(q, k, v, out, lse, do, scale, block_m_dkdv=64, block_n_dq=64, numerics=FAST)
    assert torch.equal(dq, fast[0]) != dp_int8                         # dQ's rule is fast's, but for dP
    assert not torch.equal(dk, fast[1]) and not torch.equal(dv, fast[2])


def test_ds_bound_matches_float64():
    """dK under ds_bound from its definition in float64, on one tile of 64 queries and 64 keys, two query heads
    sharing one KV head: each query row's dS over the bound max_k P (|dO| |V|max + |delta|) at e4m3's 448, Q's rows
    times the bound in e4m3 with one scale per channel over the tokens and both heads, that scale after the sum."""
    q, k, v, do = make_qkv(1, 2, 1, 64, 64, 64, torch.bfloat16, "cpu", k_outliers=10.0, seed=9)
    do[:, 1] *= 16
    q[:, 1, :20] *= 0.01          # rows whose bound sits far below the others'
    scale = 64 ** -0.5
    out, lse = naive.sagebwd_forward_naive(q, k, v, scale)
    keys = naive._quantize_keys(k, 2, True)
    s = naive._block_scores(q, keys, slice(0, 64), slice(0, 64), 64, 64, scale, (-1, -1), False)[0].double()
    lse = lse.double()
    p = torch.exp2(s - lse[..., None])
    dod, outd, qd, vd = do.double(), out.double(), q.double(), v.double()
    delta = (dod * outd).sum(-1, keepdim=True)
    ds = p * (dod @ vd.transpose(-1, -2) - delta)
    v_norm = vd.abs().amax(2, keepdim=True).norm(dim=-1, keepdim=True)           # [1, 1, 1, 1]
    bound = torch.exp2(s.amax(-1, keepdim=True) - lse[..., None]) * (dod.norm(dim=-1, keepdim=True) * v_norm
                                                                     + delta.abs())
    looseness = bound / ds.abs().amax(-1, keepdim=True)
    assert looseness.min() >= 1 - 1e-9 and looseness.max() < 128    # a bound of each row's |dS|, 6-93x here
    qr = qd * bound
    qr_max = qr.abs().amax((1, 2), keepdim=True)                                  # per channel over both heads
    want_dk = ((e4m3_float64(ds * (E4M3_MAX / bound)).transpose(-1, -2) @ e4m3_float64(qr * (E4M3_MAX / qr_max)))
               * qr_max / E4M3_MAX ** 2 * scale).sum(1, keepdim=True)
    rules = parse_precision("pv_e4m3+p_static+do_sequence+dk_e4m3+ds_bound")
    got = naive.sagebwd_backward_naive(q, k, v, out, lse.float(), do, scale, block_m_dkdv=64, block_n_dq=64,
                                       numerics=rules)
    want_dk = want_dk.to(got[1].dtype).double()
    assert (got[1].double() - want_dk).norm() / want_dk.norm() < 5e-4
    fastest = naive.sagebwd_backward_naive(q, k, v, out, lse.float(), do, scale, block_m_dkdv=64, block_n_dq=64,
                                           numerics=parse_precision("fastest"))
    assert torch.equal(got[0], fastest[0]) and torch.equal(got[2], fastest[2])   # dQ's and dV's rules are fastest's
    assert (got[1].double() - fastest[1].double()).norm() / want_dk.norm() > 2e-3


def test_ds_bound_needs_dk_e4m3():
    for bad in ("ds_bound", "pv_e4m3+ds_bound", "pv_e4m3+p_static+do_sequence+ds_bound"):
        with pytest.raises(ValueError, match="ds_bound is a rule of dk_e4m3's dK product"):
            parse_precision(bad)


def test_accurate_is_todays_rule_bit_for_bit():
    q, k, v, do = make_qkv(1, 2, 1, 200, 200, 64, torch.bfloat16, "cpu", k_outliers=10.0, seed=4)
    base = run_with_grads(lambda a, b, c: sagebwd_attn_func(a, b, c, causal=True, backend="naive"), q, k, v, do)
    named = run_with_grads(lambda a, b, c: sagebwd_attn_func(a, b, c, causal=True, backend="naive",
                                                             precision="accurate"), q, k, v, do)
    assert all(torch.equal(base[n], named[n]) for n in base)
    out, lse = naive.sagebwd_forward_naive(q, k, v, 0.125, (-1, 0))
    out2, lse2 = naive.sagebwd_forward_naive(q, k, v, 0.125, (-1, 0), numerics=Numerics())
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    grads = naive.sagebwd_backward_naive(q, k, v, out, lse, do, 0.125, (-1, 0))
    grads2 = naive.sagebwd_backward_naive(q, k, v, out, lse, do, 0.125, (-1, 0), numerics=ACCURATE)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))
    fast = run_with_grads(lambda a, b, c: sagebwd_attn_func(a, b, c, causal=True, backend="naive", precision="fast"),
                          q, k, v, do)
    assert not any(torch.equal(base[n], fast[n]) for n in base)     # the argument reaches the computation


@pytest.mark.parametrize("precision", ["fast", "fastest", "pv_e4m3+p_static+do_sequence+dk_e4m3+ds_bound"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_fast_meets_the_accuracy_bar(head_dim, causal, precision):
    q, k, v, do = make_qkv(1, 2, 2, 384, 384, head_dim, torch.bfloat16, "cpu", k_outliers=10.0, seed=5)
    ref = exact_reference(q, k, v, do, window_size=(-1, 0) if causal else (-1, -1))
    got = compare(run_with_grads(lambda a, b, c: sagebwd_attn_func(a, b, c, causal=causal, backend="naive",
                                                                   precision=precision), q, k, v, do), ref)
    for name, (cos, rel_l2) in got.items():
        assert cos >= BAR[name], (name, cos, rel_l2)


def test_varlen_computes_each_sequence_with_the_preset():
    q, k, v, do = make_qkv(1, 2, 2, 160, 160, 64, torch.bfloat16, "cpu", seed=6)
    flat = lambda x: x[0].transpose(0, 1).contiguous()  # noqa: E731
    cu = torch.tensor([0, 70, 160], dtype=torch.int32)
    packed = sagebwd_attn_varlen_func(flat(q), flat(k), flat(v), cu, cu, 90, 90, causal=True, backend="naive",
                                      precision="fast")
    for a, b in ((0, 70), (70, 160)):
        one = sagebwd_attn_func(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True, backend="naive",
                                precision="fast")
        assert torch.equal(packed[a:b], flat(one))


@pytest.mark.parametrize("bad", ["Fast", "", "fp8", "pv_e4m3+pv_e4m3", "fast+ds_tile", 1, None, True])
def test_bad_precision_names_the_argument_and_the_allowed_values(bad):
    q, k, v, _ = make_qkv(1, 2, 2, 16, 16, 64, torch.bfloat16, "cpu", seed=7)
    with pytest.raises(ValueError, match=r"precision must be 'accurate', 'fast', 'fastest' or rule names joined by "
                                         r"'\+' \(pv_e4m3, p_static, ds_tile, dk_e4m3, do_sequence, dp_int8, "
                                         r"ds_bound\), got"):
        sagebwd_attn_func(q, k, v, precision=bad, backend="naive")
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="precision must be"):
        sagebwd_attn_varlen_func(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 16, 16,
                                 precision=bad, backend="naive")
    with pytest.raises(ValueError, match="SageBwd option 'precision' must be 'accurate', 'fast'"):
        sagebwd_hf.SageBwdOptions(precision=bad)


def test_do_sequence_needs_p_static():
    for bad in ("do_sequence", "pv_e4m3+do_sequence", "do_sequence+dk_e4m3"):
        with pytest.raises(ValueError, match="do_sequence is a rule of p_static's dO scales"):
            parse_precision(bad)


def test_precision_strings_round_trip():
    for name in EVERY_RULE + ["pv_e4m3+ds_tile", "ds_tile+pv_e4m3"]:
        rules = parse_precision(name)
        assert parse_precision(precision_name(rules)) == rules
    assert parse_precision("pv_e4m3+p_static") == FAST and precision_name(FAST) == "fast"
    assert precision_name(parse_precision("dk_e4m3+do_sequence+p_static+pv_e4m3")) == "fastest"
    assert precision_name(parse_precision("pv_e4m3+p_static+ds_tile")) == "pv_e4m3+p_static+ds_tile"


@pytest.mark.parametrize("precision", ["fast", "ds_tile", "pv_e4m3+p_static+dk_e4m3+do_sequence+ds_bound"])
def test_kernels_refuse_other_precisions(precision):
    q, k, v, _ = make_qkv(1, 2, 2, 16, 16, 64, torch.bfloat16, "cpu", seed=8)
    if not (q.is_cuda or __import__("os").environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("the kernels need CUDA or TRITON_INTERPRET=1")
    with pytest.raises(NotImplementedError, match=f"precision='{re.escape(precision)}' is computed only by the "
                                                  "PyTorch path"):
        sagebwd_attn_func(q, k, v, precision=precision, backend="triton")


def test_configure_carries_the_preset_to_the_backend(monkeypatch):
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=128, hidden_size=128, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                  max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sagebwd").to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 96))
    sagebwd_hf.configure(model, layers=[1], precision="fast")
    assert sagebwd_hf.get_options(model, layer=1).precision == "fast"
    assert sagebwd_hf.get_options(model, layer=0).precision == "accurate"
    if __import__("os").environ.get("TRITON_INTERPRET") == "1":   # the kernels' path: layer 1 is refused
        with pytest.raises(NotImplementedError, match="precision='fast'"):
            model(ids)
        monkeypatch.delenv("TRITON_INTERPRET")                     # the PyTorch path computes it
    with torch.no_grad():
        fast = model(ids).logits
        sagebwd_hf.configure(model, layers=[1], precision=None)
        accurate = model(ids).logits
    assert not torch.equal(fast, accurate)
    assert torch.nn.functional.cosine_similarity(fast.double().flatten(), accurate.double().flatten(), 0) > 0.999
