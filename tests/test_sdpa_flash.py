"""SageBwd behind SDPA's flash backend, and the "sagebwd" backend under context parallelism (CPU).

The overrides are registered for the CPU dispatch key here (``_register_kernels("CPU")``), where the flash ops
have no kernel of their own, so that ``torch.ops.aten._scaled_dot_product_flash_attention`` and its autograd
backward run the same path as on a GPU. The GPU tests (``-m gpu``) call ``F.scaled_dot_product_attention`` with
the implementation active; the multi-GPU test (``-m multigpu``) runs torch's context parallelism.
"""
import math
import os

import pytest
import torch
import torch.nn.functional as F

import sagebwd_hf
from sagebwd_hf import context_parallel, sdpa_flash
from sagebwd_hf.testing import error_stats, make_qkv, run_with_grads

needs_registry = pytest.mark.skipif(not sdpa_flash.registry_available(),
                                    reason="this torch has no flash-attention registry")
FLASH = torch.ops.aten._scaled_dot_product_flash_attention


@pytest.fixture
def cpu_override():
    """The SageBwd kernels behind the flash ops for CPU tensors, for one test."""
    sdpa_flash.reset_stats()
    handle = sdpa_flash._register_kernels("CPU")
    yield
    handle.remove()


def exact(q, k, v, causal, scale):
    """float64 attention, GQA by repeating heads, causal aligned bottom-right: (out, natural lse)."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, 1) for x in (k, v))
    s = q.double() @ k.transpose(-1, -2) * scale
    if causal:
        offset = k.shape[2] - q.shape[2]
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1 + offset),
                          float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def test_registered_under_its_name_and_activates():
    if not sdpa_flash.registry_available():
        with pytest.raises(RuntimeError, match="no flash-attention registry"):
            sdpa_flash.activate()
        return
    from torch.nn.attention import current_flash_attention_impl, list_flash_attention_impls
    assert sdpa_flash.IMPL_NAME in list_flash_attention_impls()
    assert not sdpa_flash.is_active()
    try:
        sdpa_flash.activate()
        assert current_flash_attention_impl() == "SageBwd" and sdpa_flash.is_active()
    finally:
        sdpa_flash.restore()
    assert current_flash_attention_impl() is None and not sdpa_flash.is_active()


def _qkv(dtype=torch.bfloat16, heads=4, kv_heads=2, n_q=64, n_k=64, d=32, dv=None):
    q = torch.randn(2, heads, n_q, d, dtype=dtype)
    k = torch.randn(2, kv_heads, n_k, d, dtype=dtype)
    v = torch.randn(2, kv_heads, n_k, dv or d, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("change, reason", [
    (dict(), None),
    (dict(dropout_p=0.1), "dropout"),
    (dict(return_debug_mask=True), "debug_mask"),
    (dict(dtype=torch.float32), "dtype"),
    (dict(d=12), "head_dim"),
    (dict(d=264), "head_dim"),
    (dict(dv=64), "head_dim"),            # the flash ops take one head dim for q, k and v
    (dict(kv_heads=3), "heads"),
    (dict(n_q=0), "empty"),
    (dict(is_causal=True, n_q=32), "causal_non_square"),
    (dict(is_causal=True), None),
    (dict(n_q=32), None),                 # a query shorter than its keys, not causal: taken
])
def test_support_check(change, reason):
    flags = {k: change.pop(k) for k in ("dropout_p", "return_debug_mask", "is_causal") if k in change}
    q, k, v = _qkv(**change)
    assert sdpa_flash.support_error(q, k, v, **flags) == reason


@needs_registry
@pytest.mark.parametrize("causal, kv_heads, scale", [(True, 2, None), (False, 4, 0.3), (False, 1, None)])
def test_flash_op_equals_sagebwd_attn_func(cpu_override, causal, kv_heads, scale):
    torch.manual_seed(0)
    q, k, v = _qkv(kv_heads=kv_heads)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, debug = FLASH(*leaves, 0.0, causal, False, scale=scale)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, q.shape[:3], torch.float32)
    assert cum_q is None and cum_k is None and (max_q, max_k) == (q.shape[2], k.shape[2])
    do = torch.randn_like(out)
    out.backward(do)

    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = sagebwd_hf.sagebwd_attn_func(*ref_leaves, causal=causal, softmax_scale=scale, return_lse=True)
    ref_out.backward(do)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    # the backward gets SDPA's natural lse and takes K-smoothing's shift off again: fp32 rounding of the lse
    # flips about 1% of the gradients' bf16 roundings (seen: relative L2 1.5e-4 to 3.4e-4), far under INT8's 1e-2
    for name, mine, ref in zip(("dQ", "dK", "dV"), leaves, ref_leaves):
        cos, rel = error_stats(mine.grad, ref.grad)
        assert cos > 0.99999 and rel < 1e-3, (name, cos, rel)
    # the backward got the lse its forward returned (kept by autograd): no recomputation for a ring's row term
    assert sdpa_flash.stats() == {"forward": 1, "backward": 1, "backward_row_term": 0, "fallback": {}}
    assert sagebwd_hf.attention_stats()["sdpa_flash"] == sdpa_flash.stats()
    sagebwd_hf.reset_attention_stats()
    assert sdpa_flash.stats()["forward"] == 0


@needs_registry
@pytest.mark.parametrize("order", [(0, 1, 2, 3), (0, 2, 1, 3), (2, 0, 1, 3)])
def test_outputs_and_grads_have_the_strides_the_meta_functions_promise(cpu_override, order):
    """torch.compile plans what follows the op from its meta function: ``empty_like(query)``'s strides."""
    shape = (2, 4, 64, 32)
    stored = [torch.randn(*[shape[i] for i in order], dtype=torch.bfloat16) for _ in range(3)]
    back = [order.index(i) for i in range(4)]
    q, k, v = (x.permute(*back).requires_grad_() for x in (x.detach() for x in stored))
    out = FLASH(q, k, v, 0.0, True, False)[0]
    assert out.stride() == torch.empty_like(q).stride()
    out.backward(torch.randn_like(out))
    for x in (q, k, v):
        assert x.grad.stride() == torch.empty_like(x).stride()


@needs_registry
def test_unsupported_call_goes_to_the_original_kernel(cpu_override):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="no CPU kernel of its own"):   # the CPU key has no original
        FLASH(q, k, v, 0.1, False, False)
    # (SDPA's own flash kernel may call FlashAttention's op through the dispatcher: counted there too)
    assert set(sdpa_flash.stats()["fallback"]) == {"dropout"} and sdpa_flash.stats()["forward"] == 0


FA_FORWARD = torch.ops.aten._flash_attention_forward


def _packed(heads=4, kv_heads=2, lengths=(40, 0, 88), d=32):
    total = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return (torch.randn(total, heads, d, dtype=torch.bfloat16), torch.randn(total, kv_heads, d, dtype=torch.bfloat16),
            torch.randn(total, kv_heads, d, dtype=torch.bfloat16), cu, max(lengths))


@needs_registry
@pytest.mark.parametrize("window", [(None, None), (16, None)])
def test_flashattention_varlen_op_equals_sagebwd_varlen(cpu_override, window):
    torch.manual_seed(0)
    q, k, v, cu, longest = _packed()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse, *_ = FA_FORWARD(*leaves, cu, cu, longest, longest, 0.0, True, False, scale=None,
                              window_size_left=window[0], window_size_right=window[1])
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, (q.shape[1], q.shape[0]), torch.float32)
    do = torch.randn_like(out)
    out.backward(do)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = sagebwd_hf.sagebwd_attn_varlen_func(
        *ref_leaves, cu, cu, longest, longest, causal=True, window_size=(-1 if window[0] is None else window[0], 0),
        return_lse=True)
    ref_out.backward(do)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    for name, mine, ref in zip(("dQ", "dK", "dV"), leaves, ref_leaves):
        cos, rel = error_stats(mine.grad, ref.grad)
        assert cos > 0.99999 and rel < 1e-3, (name, cos, rel)
    assert sdpa_flash.stats()["backward_row_term"] == 0


@needs_registry
def test_flashattention_dense_op_is_bottom_right_causal(cpu_override):
    """FlashAttention's own op ([B, N, H, D]) aligns a causal mask bottom-right when the query is shorter."""
    q, k, v = (x.transpose(1, 2) for x in _qkv(n_q=24))
    out, lse, *_ = FA_FORWARD(q, k, v, None, None, 24, 64, 0.0, True, False)
    ref, ref_lse = sagebwd_hf.sagebwd_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), causal=True,
                                                return_lse=True)
    assert torch.equal(out, ref.transpose(1, 2)) and torch.equal(lse, ref_lse)


@needs_registry
@pytest.mark.parametrize("extra, reason", [(dict(seqused_k=torch.tensor([40, 0, 88], dtype=torch.int32)), "seqused_k"),
                                           (dict(alibi_slopes=torch.ones(4)), "alibi")])
def test_flashattention_op_leaves_what_it_cannot_take(cpu_override, extra, reason):
    q, k, v, cu, longest = _packed()
    with pytest.raises(NotImplementedError):
        FA_FORWARD(q, k, v, cu, cu, longest, longest, 0.0, True, False, **extra)
    assert sdpa_flash.stats()["fallback"] == {reason: 1}


def test_lse_is_the_natural_log_of_the_callers_scores():
    """K-smoothing shifts every score of a row; SDPA's lse must not carry that shift (ring attention merges
    partial results by it). Keys with a large common offset make the shift large."""
    torch.manual_seed(1)
    q, k, v, _ = make_qkv(2, 4, 2, 96, 96, 32, torch.bfloat16, "cpu", k_outliers=8.0, seed=3)
    scale = 32 ** -0.5
    _, lse = sdpa_flash.forward(q, k, v, True, None)
    _, lse_exact = exact(q, k, v, True, scale)
    assert (lse.double() - lse_exact).abs().max() < 0.02
    shift = sdpa_flash._smoothing_rows(q, k, scale)
    assert shift.abs().max() > 1.0                       # the shift the lse must not carry is not negligible
    lse2 = torch.where(torch.rand_like(lse) < 0.1, torch.full_like(lse, float("inf")), lse * 1.3)
    assert torch.equal(sdpa_flash.kernel_lse(sdpa_flash.natural_lse(lse2, q, k, scale), q, k, scale).isinf(),
                       lse2.isinf())
    back = sdpa_flash.kernel_lse(sdpa_flash.natural_lse(lse2, q, k, scale), q, k, scale)
    finite = ~lse2.isinf()
    assert torch.allclose(back[finite], lse2[finite], rtol=1e-5, atol=1e-4)


def _merge(parts):
    """Ring attention's merge of per-shard (out, lse) in fp32."""
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
    out = sum(p[0].float() * torch.exp(p[1] - lse).unsqueeze(-1) for p in parts)
    return out.to(parts[0][0].dtype), lse


@pytest.mark.parametrize("kv_heads, causal", [(2, False), (4, False), (2, True)])
def test_backward_takes_merged_out_and_lse(kv_heads, causal):
    """What ring attention does: each shard of keys gives (out, lse), merged in fp32; each shard's backward gets
    the merged out and lse, and dQ is summed. O, dK and dV are as close to exact attention as the whole call's.
    dQ gets the row term each shard owes, from the kernels' own dS sums: those also carry the forward's P V
    rounding projected on dO (the whole call's K-smoothing cancels it), times the shard's K mean, so with 4-sigma
    K channel offsets dQ's error is up to ~1.6x the whole call's (1.0x without offsets); without the term it was
    5x (0.086 against 0.017). The shard's own lse instead of the merged one gives wrong gradients."""
    q, k, v, do = make_qkv(1, 4, kv_heads, 128, 128, 32, torch.bfloat16, "cpu", k_outliers=4.0, seed=5)
    scale = 32 ** -0.5
    # causal: the query's second half against the first half of the keys (all visible) and the second (causal)
    if causal:
        q, do = q[:, :, 64:], do[:, :, 64:]
    shards = [(k[:, :, :64], v[:, :, :64], False), (k[:, :, 64:], v[:, :, 64:], causal)]
    sdpa_flash.reset_stats()
    parts = [sdpa_flash.forward(q, ks, vs, c, None) for ks, vs, c in shards]
    out, lse = _merge(parts)
    grads = [sdpa_flash.backward(do, q, ks, vs, out, lse, c, None) for ks, vs, c in shards]
    assert sdpa_flash.stats()["backward_row_term"] == 2
    ring = dict(O=out, dQ=sum(g[0].float() for g in grads), dK=torch.cat([g[1] for g in grads], 2),
                dV=torch.cat([g[2] for g in grads], 2))

    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, _ = exact(*leaves, causal, scale)
    ref_out.backward(do.double())
    ref = dict(O=ref_out, dQ=leaves[0].grad, dK=leaves[1].grad, dV=leaves[2].grad)
    whole_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    whole_out = sagebwd_hf.sagebwd_attn_func(*whole_leaves, causal=causal)
    whole_out.backward(do)
    whole = dict(O=whole_out, dQ=whole_leaves[0].grad, dK=whole_leaves[1].grad, dV=whole_leaves[2].grad)
    for name in ref:
        cos, rel = error_stats(ring[name], ref[name])
        _, whole_rel = error_stats(whole[name], ref[name])
        assert cos > 0.999 and rel < (1.75 if name == "dQ" else 1.25) * whole_rel + 1e-3, (name, cos, rel, whole_rel)

    unmerged = [sdpa_flash.backward(do, q, ks, vs, out, part[1], c, None) for (ks, vs, c), part in
                zip(shards, parts)]
    _, rel = error_stats(torch.cat([g[2] for g in unmerged], 2), ref["dV"])
    _, whole_rel = error_stats(whole["dV"], ref["dV"])
    assert rel > 3 * whole_rel


@pytest.mark.parametrize("device, head_dim", [
    pytest.param("cpu", 32, marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                      reason="CPU kernel tests need TRITON_INTERPRET=1")),
    pytest.param("cuda", 64, marks=pytest.mark.gpu), pytest.param("cuda", 128, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("causal", [False, True])
def test_key_shard_row_term_kernels_equal_reference(device, head_dim, causal):
    """A shard's backward with the merged lse: the dQ kernels sum their own dS rows for K-smoothing's term, the
    reference the same rule in PyTorch; both differ from a backward that leaves the term out."""
    from sagebwd_hf import interface
    n = 128 if device == "cpu" else 512
    q, k, v, do = make_qkv(1, 4, 2, n, n, head_dim, torch.bfloat16, device, k_outliers=4.0, seed=7)
    scale = head_dim ** -0.5
    half = n // 2
    shard_k, shard_v = k[:, :, half:], v[:, :, half:]
    window = (-1, 0) if causal else (-1, -1)
    out, lse2 = interface._forward(q, k, v, None, None, n, n, scale, window, True, False, "naive")
    lse_nat = sdpa_flash.natural_lse(lse2, q, k, scale)      # the whole row's lse, as ring attention merges it
    lse_shard = sdpa_flash.kernel_lse(lse_nat, q, shard_k, scale)

    def grads(backend, key_shard):
        return interface._backward(do, q, shard_k, shard_v, out, lse_shard, None, None, n, half, scale,
                                   (-1, half) if causal else window, True, False, backend, key_shard=key_shard)[:3]

    sagebwd_hf.reset_attention_stats()
    kernels = grads("triton", True)
    assert set(sagebwd_hf.attention_stats()["kernels"]) == {"bwd_triton" if device == "cpu" else "bwd_gluon"}
    reference, without = grads("naive", True), grads("naive", False)
    for name, got, want in zip(("dQ", "dK", "dV"), kernels, reference):
        cos, rel = error_stats(got, want)
        assert cos > 0.99999 and rel < 5e-3, (name, cos, rel)
    _, rel_without = error_stats(without[0], reference[0])
    assert rel_without > 0.05, rel_without      # the term is not negligible: the test sees it


# ---------------------------------------------------------------------------------------------------
# attn_implementation="sagebwd" under context parallelism
# ---------------------------------------------------------------------------------------------------

@pytest.fixture
def context_parallel_dispatch():
    """What torch's context_parallel() installs: its ring handlers in DTensor's op dispatcher."""
    attention = pytest.importorskip("torch.distributed.tensor.experimental._attention")
    if not hasattr(attention, "_enable_context_parallel_dispatcher"):
        pytest.skip(f"torch {torch.__version__} has no context-parallel dispatcher switch")
    assert not context_parallel.active()
    attention._enable_context_parallel_dispatcher()
    try:
        yield
    finally:
        attention._disable_context_parallel_dispatcher()
    assert not context_parallel.active()


def _tiny_llama():
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sagebwd").to(torch.bfloat16)


def test_sagebwd_model_never_attends_per_shard_silently(context_parallel_dispatch):
    assert context_parallel.active()
    model = _tiny_llama()
    ids = torch.randint(0, 64, (1, 16))
    with pytest.raises(RuntimeError, match="activate_flash_attention_impl"):
        model(ids)


@needs_registry
def test_sagebwd_model_runs_sdpa_ring_when_sagebwd_is_behind_sdpa(context_parallel_dispatch, monkeypatch):
    calls = []

    def recording_sdpa(q, k, v, is_causal=False, scale=None, enable_gqa=False, **kwargs):
        from torch.nn.attention import _cur_sdpa_kernel_backends as backends
        calls.append((is_causal, enable_gqa, tuple(backends())))
        return torch.zeros_like(q)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    monkeypatch.setattr(sdpa_flash, "is_active", lambda: True)
    sagebwd_hf.reset_attention_stats()
    model = _tiny_llama()
    model(torch.randint(0, 64, (1, 16)))
    from torch.nn.attention import SDPBackend
    assert calls == [(True, True, (SDPBackend.FLASH_ATTENTION,))]
    assert sagebwd_hf.attention_stats()["paths"] == {"context_parallel": 1}

    with pytest.raises(NotImplementedError, match="an attention mask"):
        model(torch.randint(0, 64, (2, 16)), attention_mask=torch.tensor([[1] * 16, [0] * 4 + [1] * 12]))


def test_not_active_outside_context_parallel():
    assert not context_parallel.active()
    assert math.isfinite(float(_tiny_llama()(torch.randint(0, 64, (1, 8))).logits.float().sum()))


# ---------------------------------------------------------------------------------------------------
# GPU: F.scaled_dot_product_attention with the implementation active
# ---------------------------------------------------------------------------------------------------

@pytest.fixture
def sagebwd_behind_sdpa():
    if not sdpa_flash.registry_available():
        pytest.skip("this torch has no flash-attention registry")
    sdpa_flash.activate()
    sdpa_flash.reset_stats()
    try:
        yield
    finally:
        sdpa_flash.restore()


def _flash_sdpa(q, k, v, **kwargs):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_sdpa_runs_sagebwd_when_active(sagebwd_behind_sdpa, head_dim, causal, kv_heads):
    q, k, v, do = make_qkv(2, 8, kv_heads, 1024, 1024, head_dim, torch.bfloat16, "cuda", k_outliers=4.0)
    gqa = dict(enable_gqa=True) if kv_heads != 8 else {}
    ours = run_with_grads(lambda *x: _flash_sdpa(*x, is_causal=causal, **gqa), q, k, v, do)
    ref = run_with_grads(lambda *x: sagebwd_hf.sagebwd_attn_func(*x, causal=causal), q, k, v, do)
    exact_ref = run_with_grads(lambda *x: exact(*x, causal, head_dim ** -0.5)[0], q.double(), k.double(),
                               v.double(), do.double())
    assert sdpa_flash.stats()["forward"] == 1 and sdpa_flash.stats()["backward"] == 1
    assert sdpa_flash.stats()["backward_row_term"] == 0
    assert torch.equal(ours["O"], ref["O"])
    for name in ("dQ", "dK", "dV"):
        cos, rel = error_stats(ours[name], ref[name])
        assert cos > 0.99999 and rel < 2e-3, (name, cos, rel)
    for name, cos_min in (("O", 0.999), ("dQ", 0.99), ("dK", 0.99), ("dV", 0.999)):
        cos, rel = error_stats(ours[name], exact_ref[name])
        print(f"D={head_dim} causal={causal} kv_heads={kv_heads} {name}: cos {cos:.5f} rel L2 {rel:.4f}")
        assert cos >= cos_min, (name, cos, rel)


@pytest.mark.gpu
def test_sdpa_leaves_what_it_cannot_take_to_flash(sagebwd_behind_sdpa):
    q, k, v, _ = make_qkv(1, 4, 4, 256, 256, 64, torch.bfloat16, "cuda")
    sdpa_flash.restore()
    native = _flash_sdpa(q, k, v, is_causal=True)
    native_short = _flash_sdpa(q[:, :, :100], k, v)
    sdpa_flash.activate()
    ours = _flash_sdpa(q, k, v, is_causal=True)
    assert not torch.equal(ours, native) and error_stats(ours, native)[0] > 0.999   # INT8, not the same kernel
    torch.manual_seed(0)
    dropped = _flash_sdpa(q, k, v, dropout_p=0.5)          # dropout: the original kernel
    # (SDPA's own flash kernel may call FlashAttention's op through the dispatcher: counted there too)
    assert set(sdpa_flash.stats()["fallback"]) == {"dropout"}
    assert (dropped == 0).float().mean() < 0.5             # a real output, not zeros
    assert torch.equal(_flash_sdpa(q[:, :, :100], k, v), _flash_sdpa(q[:, :, :100], k, v))
    assert not torch.equal(_flash_sdpa(q[:, :, :100], k, v), native_short)   # non-square, not causal: ours
    sdpa_flash.restore()
    assert torch.equal(_flash_sdpa(q, k, v, is_causal=True), native)         # restored: flash's own again


@pytest.mark.gpu
def test_flashattention_varlen_op_matches_flash_on_the_gpu(sagebwd_behind_sdpa):
    """FlashAttention's packed op with SageBwd active: flash's own output and lse layout, INT8 close to its values."""
    q, k, v, cu, longest = _packed(heads=8, kv_heads=2, lengths=(300, 1, 700), d=64)
    q, k, v, cu = q.cuda(), k.cuda(), v.cuda(), cu.cuda()
    ours = FA_FORWARD(q, k, v, cu, cu, longest, longest, 0.0, True, False)
    sdpa_flash.restore()
    native = FA_FORWARD(q, k, v, cu, cu, longest, longest, 0.0, True, False)
    sdpa_flash.activate()
    for mine, ref in zip(ours[:2], native[:2]):
        assert (mine.shape, mine.dtype, mine.stride()) == (ref.shape, ref.dtype, ref.stride())
    assert error_stats(ours[0], native[0])[0] > 0.999
    assert (ours[1] - native[1]).abs().max() < 0.05
