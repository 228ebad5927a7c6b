"""GPU (sm_90): the Gluon dV, dK and dQ kernels (kernels/backward_hopper.py) against the portable dV, dK and dQ
launches on the same quantized inputs and query tile. Same tile
rules, so they differ only by fp32 rounding order and exp2 (and, for dK, the bf16 dP^T product's accumulation
order); persistent launches (a few programs taking every work item) give the same bits as one program an item, and
so do launches fed the token-major copies in quantize's operand order (P^T and dS^T read from the registers as they
are: the same int32 products, summed in another order)."""
import pytest
import torch

from sagebwd_hf.interface import tile_configs
from sagebwd_hf.kernels.backward import launch_backward
from sagebwd_hf.kernels.forward import launch_forward
from sagebwd_hf.kernels.layout import SeqLayout
from sagebwd_hf.kernels.quantize import quantize, quantize_qk, quantize_v
from sagebwd_hf.testing import assert_equal_but_summation_order, error_stats, make_qkv

IS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not IS_SM90, reason="the Gluon kernels need an sm_90 GPU")]

# (batch, heads, kv_heads, seqlen, head_dim, window[, V's head dim])
CASES = [
    (2, 4, 4, 1024, 128, (-1, -1)),
    (1, 8, 2, 1000, 128, (-1, 0)),      # GQA, causal, N not a multiple of the tiles
    (2, 4, 1, 777, 64, (-1, 0)),        # MQA
    (1, 4, 2, 1100, 64, (100, 0)),      # sliding window
    (1, 2, 2, 600, 128, (130, 77)),     # two-sided window
    (1, 4, 2, 700, 192, (-1, 0), 128),  # MLA: Q/K in two channel blocks, V's own head dim, 64-row tiles
]


@pytest.mark.parametrize("part", ["dv", "dk", "dq"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}h{c[1]}kv{c[2]}-n{c[3]}-d{c[4]}"
                         f"{f'v{c[6]}' if len(c) > 6 else ''}-w{c[5][0]}_{c[5][1]}")
def test_gluon_dkdv_matches_portable(case, part):
    from sagebwd_hf.kernels.hopper_launch import dkdv_query_tile, dq_key_tile, launch_dkdv_hopper, launch_dq_hopper

    b, h, hk, n, d, window = case[:6]
    dv = case[6] if len(case) > 6 else d
    q, k, v, do = make_qkv(b, h, hk, n, n, d, torch.bfloat16, "cuda", head_dim_v=dv)
    scale = d ** -0.5
    lay = SeqLayout(b, n, None)
    cfg = tile_configs(d, q.device, dv)
    quant = quantize_qk(q, k, lay, lay, scale, True, False, transposed=True)
    v8t, v_scale = quantize_v(v, lay)
    out, lse = torch.empty_like(do), torch.empty(b, h, n, device="cuda")     # the kernels' base-2 lse
    launch_forward(quant, v8t, v_scale, out, lse, lay, lay, h, h // hk, d, window, cfg["fwd"])
    do_q = quantize(do, lay, natural=False, transposed=True, out_for_delta=out)
    dkdv = cfg["dkdv"][0] if cfg["split_dkdv"] else cfg["dkdv"]
    assert dkdv[0] == dkdv_query_tile(d), \
        "the Gluon kernels' query tile (P^T's and dS^T's scales) is the portable kernel's"
    assert cfg["dq"][1] == dq_key_tile(d), "the Gluon dQ kernel's key tile (dS's scales) is the portable kernel's"
    dkdv_cfg = tuple((dkdv_query_tile(d),) + c[1:]
                     for c in (cfg["dkdv"] if cfg["split_dkdv"] else (cfg["dkdv"],) * 2))
    want = {"dq": torch.full_like(q, float("nan")), "dk": torch.full_like(k, float("nan")),
            "dv": torch.full_like(v, float("nan"))}
    launch_backward(quant, quant.q8t, quant.q_scale_raw, quant.k8t, v, do, do_q.x8t, do_q.scale,
                    lse, do_q.delta, want["dq"], want["dk"], want["dv"], lay, lay, h, hk, d, window,
                    scale, dkdv_cfg, cfg["dq"], kernels=(part,), split_dkdv=True)
    quant_ordered = quantize_qk(q, k, lay, lay, scale, True, False, transposed=True, operand_order=True)
    do8t_ordered = quantize(do, lay, natural=False, transposed=True, operand_order=True).x8t
    runs = {}
    # one program a work item, or 3 persistent programs taking them all; natural or operand order
    for programs, order in ((None, False), (3, False), (3, True)):
        got = runs[programs, order] = {name: torch.full_like(t, float("nan")) for name, t in want.items()}
        qt = quant_ordered if order else quant
        if part == "dq":
            launch_dq_hopper(qt, lse, do, do_q.delta, v, got["dq"], h // hk, d, window, scale,
                             programs=programs, operand_order=order)
        else:
            launch_dkdv_hopper(part, qt, lse, do, do8t_ordered if order else do_q.x8t, do_q.scale,
                               do_q.delta, v, got["dv"], got["dk"], h // hk, d, window, scale,
                               programs=programs, operand_order=order)
    for name in (part,):
        got = runs[None, False]
        assert torch.isfinite(got[name]).all(), f"{name}: an element the Gluon kernel never wrote"
        cos, rel = error_stats(got[name], want[name])
        print(f"{case} {part} {name}: gluon vs portable cos {cos:.6f} rel {rel:.2e}")
        assert cos >= 0.9999 and rel <= 6e-3, name
        assert torch.equal(runs[3, False][name], got[name]), f"{name}: the persistent schedule changed the numbers"
        assert torch.equal(runs[3, True][name], got[name]), f"{name}: the operand order changed the numbers"


def _token_major(x):
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("d, backward", [(64, "deterministic"), (128, "deterministic"), (64, "fast")])
def test_gluon_backward_reads_every_memory_layout(d, backward, monkeypatch):
    """The Gluon backward reads dO and V in the caller's memory through kernels.layout.token_rows (no copy):
    head-major, token-major (Transformers' q/k/v and their gradients), V as a slice of a fused KV buffer, and
    V with expanded heads must give the same bytes. N is not a multiple of the tiles, so tiles cross the end of
    a sequence into the next head's rows (head-major) or the next batch's tokens (token-major)."""
    from sagebwd_hf import attention_stats, reset_attention_stats, sagebwd_attn_func

    monkeypatch.setenv("SAGEBWD_KERNELS", "gluon")
    monkeypatch.setenv("SAGEBWD_BACKWARD", backward)    # "fast": the one launch (its dQ adds up in any order)
    ran = "bwd_gluon_one_launch" if backward == "fast" else "bwd_gluon"
    b, h, hk, n = 2, 4, 2, 333
    q, k, v, do = make_qkv(b, h, hk, n, n, d, torch.bfloat16, "cuda")
    kv = torch.stack([_token_major(k).transpose(1, 2), _token_major(v).transpose(1, 2)], dim=2)   # [B, N, 2, Hk, D]
    layouts = {
        "head_major": (q, k, v, do),
        "token_major": (_token_major(q), _token_major(k), _token_major(v), _token_major(do)),
        "fused_kv": (_token_major(q), kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), _token_major(do)),
        "expanded_v": (q, k, v[:, :1].expand(b, hk, n, d), do),
    }
    results = {}
    for name, (qi, ki, vi, doi) in layouts.items():
        leaves = [x.detach().clone().requires_grad_() if x.is_contiguous() else x.detach().requires_grad_()
                  for x in (qi, ki, vi)]
        reset_attention_stats()
        out = sagebwd_attn_func(*leaves, causal=True)
        out.backward(doi)
        assert attention_stats()["kernels"].get(ran, 0) == 1, name
        results[name] = [out] + [x.grad for x in leaves]
        assert all(torch.isfinite(x).all() for x in results[name]), name
    for name in ("token_major", "fused_kv"):
        for got, want, what in zip(results[name], results["head_major"], ("out", "dq", "dk", "dv")):
            _assert_same(got, want, what, backward, f"{name}: {what} differs from the head-major call")
    # expanded V holds other values (head 0 repeated): its reference is the same values, materialized
    ref = [x.detach().clone().requires_grad_() for x in (q, k, v[:, :1].expand(b, hk, n, d).contiguous())]
    out = sagebwd_attn_func(*ref, causal=True)
    out.backward(do)
    for got, want, what in zip(results["expanded_v"], [out] + [x.grad for x in ref], ("out", "dq", "dk", "dv")):
        _assert_same(got, want, what, backward, f"expanded_v: {what} differs from the materialized call")


def _assert_same(got, want, what, backward, message):
    """The same bytes; the one launch's dQ within fp32 rounding (its reduce-adds' order varies)."""
    if what == "dq" and backward == "fast":
        assert_equal_but_summation_order(got, want, message)
    else:
        assert torch.equal(got, want), message



PACKED_CASES = [(d, window, extra, backward) for d in (64, 128) for window in ((-1, -1), (-1, 0), (100, 0))
                for extra in ({}, {"softcap": 5.0}, {"sinks": True}) for backward in ("deterministic", "fast")
                if backward == "deterministic" or (d == 64 and "softcap" not in extra)]   # (where the one launch runs)


@pytest.mark.parametrize("d, window, extra, backward", PACKED_CASES,
                         ids=lambda c: c if isinstance(c, (int, str)) else
                         {(-1, -1): "full", (-1, 0): "causal", (100, 0): "window"}.get(c, None) if isinstance(c, tuple)
                         else (next(iter(c), "plain")))
def test_gluon_backward_on_packed_batches(d, window, extra, backward, monkeypatch):
    """Uneven and empty sequences in one packed batch on the Gluon backward, 5 persistent programs walking the
    work items (past short sequences' ends too: those run no tiles). Tiles cross each sequence's end into the
    next one's tokens, and the token-major copies start 16-aligned (quantize.aligned_starts). Against the
    portable kernels' packed call, and each sequence against its own padded call on the Gluon kernels (the same
    tile rules, so the same numbers up to the K means' and V scales' summation order). With a cap or sinks the dQ
    launch adds K-smoothing's row term from each sequence's K mean (k_mean [Hk, S, D]). ``backward="fast"``: the
    one launch (the default at head dim 64), against the PyTorch path's packed call, which computes its rule."""
    from sagebwd_hf import attention_stats, reset_attention_stats, sagebwd_attn_func, sagebwd_attn_varlen_func
    from sagebwd_hf.kernels import dispatch, plan

    monkeypatch.setattr(plan, "gluon_programs", lambda device: 5)
    monkeypatch.setenv(dispatch.BACKWARD_ENV, backward)
    lengths = [300, 0, 1, 129, 128, 517]
    h, hk = 4, 2
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    total, longest = int(cu[-1]), max(lengths)
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v, do = (torch.randn(total, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for n in (h, hk, hk, h))
    kw = dict(causal=window[1] == 0, window_size=window, softcap=extra.get("softcap", 0.0))
    if extra.get("sinks"):
        kw["sinks"] = torch.randn(h, device="cuda", generator=gen)
    names = ("out", "dq", "dk", "dv")

    def packed(choice):
        monkeypatch.setenv("SAGEBWD_KERNELS", "auto" if choice == "naive" else choice)
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        reset_attention_stats()
        out = sagebwd_attn_varlen_func(*leaves, cu, cu, longest, longest, backend="naive" if choice == "naive"
                                       else None, **kw)
        out.backward(do)
        ran = {"gluon": "bwd_gluon_one_launch" if backward == "fast" else "bwd_gluon"}.get(choice, f"bwd_{choice}")
        assert attention_stats()["kernels"].get(ran, 0) == 1, choice
        return [out] + [x.grad for x in leaves]

    gluon, portable = packed("gluon"), packed("naive" if backward == "fast" else "triton")
    for got, want, name in zip(gluon, portable, names):
        assert torch.isfinite(got).all(), f"{name}: an element the Gluon kernels never wrote, or not finite"
        cos, rel = error_stats(got, want)
        print(f"d{d} {window} {name}: packed gluon vs portable cos {cos:.6f} rel {rel:.2e}")
        assert cos >= 0.9999 and rel <= 6e-3, name
    monkeypatch.setenv("SAGEBWD_KERNELS", "gluon")
    for i, n in enumerate(lengths):
        a, e = int(cu[i]), int(cu[i + 1])
        if n == 0:
            assert all(x[a:e].numel() == 0 for x in gluon)
            continue
        leaves = [x[a:e].transpose(0, 1)[None].detach().clone().requires_grad_() for x in (q, k, v)]
        out = sagebwd_attn_func(*leaves, **kw)
        out.backward(do[a:e].transpose(0, 1)[None])
        for got, want, name in zip(gluon, [out] + [x.grad for x in leaves], names):
            cos, rel = error_stats(got[a:e].transpose(0, 1)[None], want)
            assert cos >= 0.99999 and rel <= 2e-3, (n, name, cos, rel)


# (batch, heads, kv_heads, seqlen, window): head dim 64, where the one launch fits its registers
ONE_LAUNCH_CASES = [
    (2, 4, 4, 1024, (-1, -1)),
    (1, 8, 2, 1000, (-1, 0)),      # GQA, causal, N not a multiple of the tiles
    (2, 4, 1, 777, (-1, -1)),      # MQA; the last key tile past the end (its keys must not reach dQ)
    (1, 4, 2, 1100, (100, 0)),     # sliding window
    (1, 2, 2, 600, (130, 77)),     # two-sided window
]


@pytest.mark.parametrize("case", ONE_LAUNCH_CASES, ids=lambda c: f"b{c[0]}h{c[1]}kv{c[2]}-n{c[3]}-w{c[4][0]}_{c[4][1]}")
def test_one_launch_backward_with_dq_reduce_adds(case):
    """``launch_backward_hopper(..., fused_dq=True)``: dV and dK as the portable launches give them at the one
    launch's 64-query tile, and dQ (dS K in bf16 from the quantized K, added by TMA reduce-adds) against float64,
    poisoned outputs, K outliers."""
    from sagebwd_hf.kernels.hopper_launch import launch_backward_hopper
    from sagebwd_hf.testing import exact_reference

    b, h, hk, n, window = case
    d = 64
    q, k, v, do = make_qkv(b, h, hk, n, n, d, torch.bfloat16, "cuda", k_outliers=8.0)
    scale = d ** -0.5
    lay = SeqLayout(b, n, None)
    cfg = tile_configs(d, q.device)
    quant = quantize_qk(q, k, lay, lay, scale, True, False, transposed=True)
    v8t, v_scale = quantize_v(v, lay)
    out, lse = torch.empty_like(do), torch.empty(b, h, n, device="cuda")
    launch_forward(quant, v8t, v_scale, out, lse, lay, lay, h, h // hk, d, window, cfg["fwd"])
    do_q = quantize(do, lay, natural=False, transposed=True, out_for_delta=out)
    want = {"dq": torch.full_like(q, float("nan")), "dk": torch.full_like(k, float("nan")),
            "dv": torch.full_like(v, float("nan"))}
    dkdv_cfg = (64,) + cfg["dkdv"][1:]     # the one launch's query tile: P^T's and dS^T's scales span it
    launch_backward(quant, quant.q8t, quant.q_scale_raw, quant.k8t, v, do, do_q.x8t, do_q.scale,
                    lse, do_q.delta, want["dq"], want["dk"], want["dv"], lay, lay, h, hk, d, window, scale,
                    (dkdv_cfg, dkdv_cfg), cfg["dq"], split_dkdv=True)
    quant_ordered = quantize_qk(q, k, lay, lay, scale, True, False, transposed=True, operand_order=True)
    do8t = quantize(do, lay, natural=False, transposed=True, operand_order=True).x8t
    got = {name: torch.full_like(t, float("nan")) for name, t in want.items()}
    launch_backward_hopper(quant_ordered, v, do, do8t, do_q.scale, lse, do_q.delta, got["dq"], got["dk"],
                           got["dv"], h, hk, d, window, scale, fused_dq=True,
                           operand_order=True, programs=7)
    for name in ("dk", "dv"):
        assert torch.isfinite(got[name]).all(), f"{name}: an element the kernel never wrote"
        cos, rel = error_stats(got[name], want[name])
        print(f"{case} {name}: one launch vs portable cos {cos:.6f} rel {rel:.2e}")
        assert cos >= 0.9999 and rel <= 6e-3, name
    ref = exact_reference(q, k, v, do, scale, window)
    assert torch.isfinite(got["dq"]).all(), "dq: an element never written"
    cos, rel = error_stats(got["dq"], ref["dQ"])
    cos3, rel3 = error_stats(want["dq"], ref["dQ"])
    print(f"{case} dq against float64: one launch cos {cos:.6f} rel {rel:.2e}; three launches {cos3:.6f} {rel3:.2e}")
    assert cos >= 0.9995 and rel <= 3e-2
