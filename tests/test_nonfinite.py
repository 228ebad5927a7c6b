"""A NaN or inf in q, k or v reaches the outputs as in SDPA: every element of O, LSE, dQ, dK and dV that attention
makes non-finite (SDPA's set in float64 without a mask; with a causal one, the sums over visible pairs: ``_reach``)
is non-finite in ours, forward and backward, on every path a call can take.

A quantization scale spans a block (one token of Q and dO; K_SCALE_BLOCK tokens of K at head dims 64 and 128; a
channel of V over its sequence; a key over a query tile for P and dS in the backward), and K-smoothing subtracts
each sequence's mean key: so where SDPA's non-finite elements stop at the bad token's reach, ours may cover the
sequence's (and head's) whole block. Other sequences of the batch stay finite. Before, the kernels' maxima
skipped NaN (and an inf max cancelled against the zero bytes it made), so a diverging run looked healthy.

CPU: the portable kernels under Triton's interpreter and the PyTorch reference. GPU (``-m gpu``): the Gluon and
portable kernels, both presets, dense and packed, head dims 64 and 128.
"""
import pytest
import torch
import torch.nn.functional as F

from sagebwd_hf import sagebwd_attn_func, sagebwd_attn_varlen_func

from conftest import kernel_devices

NAN, INF = float("nan"), float("inf")


def _bad(t):
    return ~torch.isfinite(t)


def _inputs(device, which, value, heads=2, n=64, d=64, dtype=None, seed=0):
    """(q, k, v, do) of two sequences, one element of ``which`` in sequence 0 set to ``value``."""
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float16)
    q, k, v, do = (torch.randn(2, heads, n, d, generator=g).to(device, dtype) for _ in range(4))
    dict(q=q, k=k, v=v)[which][0, 1, n // 2 + 3, 5] = value
    return q, k, v, do


def _visible(n_q, n_k, causal, device):
    rows = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)    # causal aligned bottom-right
    return rows >= torch.arange(n_k, device=device)[None, :] if causal else torch.ones(n_q, n_k, dtype=torch.bool,
                                                                                         device=device)


def _reach(q, k, v, do, causal):
    """Which elements of (O, LSE, dQ, dK, dV) attention makes non-finite: each is a sum over the (query, key) pairs
    that see each other, and it may be non-finite where a term of its sum has a non-finite factor (every step of
    softmax attention and its backward, as boolean products: a superset, since a -inf score gives a finite 0).
    With a causal mask SDPA's math also marks pairs the mask hides (it adds -inf to a NaN score), which no sum over
    visible pairs does, and ours does not either."""
    def anyrow(x):
        return ~torch.isfinite(x).all(-1, keepdim=True)

    def bmm(a, b):   # boolean matrix product: any_j a_ij & b_jc
        return (a.double() @ b.double()) > 0

    vis = _visible(q.shape[2], k.shape[2], causal, q.device)
    bad_s = vis & (anyrow(q) | anyrow(k).transpose(-1, -2))
    bad_row = bad_s.any(-1, keepdim=True)                        # its max and sum see every visible score
    bad_p = vis & bad_row
    bad_o = bad_row | bmm(vis.expand_as(bad_p), _bad(v))
    bad_dp = vis & (anyrow(do) | anyrow(v).transpose(-1, -2))
    bad_delta = bad_o.any(-1, keepdim=True) | anyrow(do)         # delta = rowsum(dO O)
    bad_ds = bad_p | bad_dp | (vis & bad_delta)
    bad_dq = bmm(bad_ds, torch.ones_like(k, dtype=torch.double)) | bmm(vis.expand_as(bad_ds), _bad(k))
    bad_dk = bmm(bad_ds.transpose(-1, -2), torch.ones_like(q, dtype=torch.double)) | \
        bmm(vis.transpose(-1, -2).expand_as(bad_ds.transpose(-1, -2)), _bad(q))
    bad_dv = bmm(bad_p.transpose(-1, -2), torch.ones_like(do, dtype=torch.double)) | \
        bmm(vis.transpose(-1, -2).expand_as(bad_p.transpose(-1, -2)), _bad(do))
    return bad_o, bad_row[..., 0], bad_dq, bad_dk, bad_dv


def _sdpa64(q, k, v, do, causal):
    """SDPA in float64: which elements of (O, natural LSE, dQ, dK, dV) are non-finite."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    out.backward(do.double())
    scores = leaves[0].detach() @ leaves[1].detach().transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(~_visible(q.shape[2], k.shape[2], True, q.device), -INF)
    return tuple(_bad(x) for x in (out.detach(), torch.logsumexp(scores, -1)) + tuple(x.grad for x in leaves))


def _expected(q, k, v, do, causal):
    """What SDPA makes non-finite, less what a causal mask hides (SDPA's masked pairs: ``_reach``)."""
    reach, sdpa = _reach(q, k, v, do, causal), _sdpa64(q, k, v, do, causal)
    if not causal:   # every pair visible: nothing of SDPA's lies outside the reach
        for name, mine, want in zip(("O", "LSE", "dQ", "dK", "dV"), reach, sdpa):
            assert not (want & ~mine).any(), f"SDPA's non-finite {name} lies outside the reference's reach"
    return tuple(a & b for a, b in zip(reach, sdpa))


def _ours(q, k, v, do, causal, **kwargs):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = sagebwd_attn_func(*leaves, causal=causal, return_lse=True, **kwargs)
    out.backward(do)
    return (out.detach(), lse) + tuple(x.grad for x in leaves)


def _ours_packed(q, k, v, do, causal, **kwargs):
    """The same two sequences packed ``[T, H, D]`` (sagebwd_attn_varlen_func), returned as ``[B, H, N, D]``."""
    b, h, n, d = q.shape
    packed = [x.detach().transpose(1, 2).reshape(b * n, h, d).clone().requires_grad_() for x in (q, k, v)]
    cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=q.device)
    out, lse = sagebwd_attn_varlen_func(*packed, cu, cu, n, n, causal=causal, return_lse=True, **kwargs)
    out.backward(do.transpose(1, 2).reshape(b * n, h, d))
    unpack = lambda x: x.reshape(b, n, h, -1).transpose(1, 2)   # noqa: E731
    lse = lse.reshape(h, b, n).transpose(0, 1) if lse.shape[0] == h else lse.reshape(b, n, h).transpose(1, 2)
    return (unpack(out.detach()), lse) + tuple(unpack(x.grad) for x in packed)


def assert_nonfinite_as_sdpa(ours, ref, label):
    """Every element the reference (``_expected``) makes non-finite is non-finite in ours; sequence 1 (no bad
    input) stays finite."""
    for name, mine, want in zip(("O", "LSE", "dQ", "dK", "dV"), ours, ref):
        mine = mine.reshape(want.shape)
        missed = want & ~_bad(mine)
        assert not missed.any(), (f"{label} {name}: {int(missed.sum())} of the reference's {int(want.sum())} "
                                  f"non-finite elements are finite")
        assert not _bad(mine[1]).any(), f"{label} {name}: the other sequence turned non-finite"
    assert _bad(ours[0]).any(), f"{label}: O has no non-finite element"


CASES = [(which, value, causal) for which in "qkv" for value in (NAN, INF) for causal in (False, True)]
CASE_IDS = [f"{w}-{'nan' if v != v else 'inf'}-{'causal' if c else 'full'}" for w, v, c in CASES]


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("which, value, causal", CASES, ids=CASE_IDS)
def test_nonfinite_input_reaches_outputs_dense(device, which, value, causal):
    q, k, v, do = _inputs(device, which, value)
    assert_nonfinite_as_sdpa(_ours(q, k, v, do, causal, backend="triton"), _expected(q, k, v, do, causal), "dense")


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("which, value", [("q", NAN), ("k", INF), ("v", NAN)])
def test_nonfinite_input_reaches_outputs_packed(device, which, value):
    q, k, v, do = _inputs(device, which, value)
    assert_nonfinite_as_sdpa(_ours_packed(q, k, v, do, True, backend="triton"), _expected(q, k, v, do, True),
                             "packed")


@pytest.mark.parametrize("which, value", [("q", INF), ("k", NAN), ("v", INF)])
def test_nonfinite_input_reaches_outputs_reference(which, value):
    """The PyTorch path (the kernels' oracle) keeps them too."""
    q, k, v, do = _inputs("cpu", which, value)
    assert_nonfinite_as_sdpa(_ours(q, k, v, do, True, backend="naive"), _expected(q, k, v, do, True), "reference")


def test_finite_inputs_stay_finite_with_masked_rows():
    """The NaN-keeping maxima and row sums leave a row that sees no key (causal, bottom-right, 64 queries over 32
    keys: the first 32 rows) zeros with an lse of -inf, not NaN."""
    q, k, v, do = _inputs("cpu", "q", 0.0)
    ours = _ours(q, k[:, :, :32], v[:, :, :32], do, True, backend="triton")
    for name, t in zip(("O", "dQ", "dK", "dV"), (ours[0],) + ours[2:]):
        assert torch.isfinite(t).all(), name
    assert (ours[0][:, :, :32] == 0).all() and (ours[1][:, :, :32] == -INF).all()


def _tiny_llama(impl):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(attn_implementation=impl, vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=128)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


@pytest.mark.filterwarnings("ignore:sagebwd. float32 attention inputs:UserWarning")
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_nonfinite_reaches_the_logits_through_transformers(layout):
    """attn_implementation="sagebwd" on a padded batch (attention mask) and a packed one (restarting
    position_ids): a token whose embedding is NaN gives NaN logits wherever SDPA's (each sequence in a row of its
    own) are, and none in the other sequence. (SDPA on the packed row itself turns every logit NaN: its masked
    math multiplies the other sequence's zero probabilities by the NaN values.)"""
    import transformers
    ids = torch.randint(0, 63, (2, 24), generator=torch.Generator().manual_seed(1))
    ids[0, 10] = 63                                     # the one token whose embedding turns NaN
    padded = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    if layout == "padded":
        padded["attention_mask"][1, :5] = 0
        inputs = padded
    else:
        collator = transformers.DataCollatorWithFlattening()
        inputs = {key: val for key, val in collator([{"input_ids": row.tolist()} for row in ids]).items()
                  if key in ("input_ids", "position_ids")}
    logits = {}
    for impl, batch in (("sdpa", padded), ("sagebwd", inputs)):
        model = _tiny_llama(impl)
        model.model.embed_tokens.weight[63] = NAN
        with torch.no_grad():
            logits[impl] = model(**batch).logits.reshape(2, 24, -1)
    want, mine = logits["sdpa"], logits["sagebwd"]
    assert _bad(want[0]).any() and not _bad(want[1]).any()
    assert not (_bad(want) & ~_bad(mine)).any()
    assert not _bad(mine[1]).any()


# --- GPU: the Gluon and portable kernels, both presets, head dims 64 and 128 -----------------------------------------

GPU_CASES = [(which, value) for which in "qkv" for value in (NAN, INF)]
# dV and dK summed in place (the one launch at head dims 64 and 128; deterministic: one key-tile launch for both)
IN_PLACE = "pv_e4m3+p_static+do_sequence+dk_e4m3"
# dK's dS at each row's fixed scale from a bound (the one launch only): a bad row's bound reaches Q's channel scales
DS_BOUND = IN_PLACE + "+ds_bound"


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["gluon", "triton"])
@pytest.mark.parametrize("precision", ["accurate", "fast", IN_PLACE, DS_BOUND])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["dense", "packed"])
@pytest.mark.parametrize("deterministic", [None, True])
def test_nonfinite_input_reaches_outputs_gpu(monkeypatch, kernels, precision, head_dim, causal, layout,
                                             deterministic):
    if kernels == "triton" and precision != "accurate":
        pytest.skip("the portable kernels compute the accurate preset only")
    if deterministic and precision == DS_BOUND:
        pytest.skip("ds_bound is the one launch's only (tests/test_ds_bound.py: the refusal)")
    if deterministic and head_dim == 128 and precision != IN_PLACE:
        pytest.skip("head dim 128 runs the three launches either way")
    monkeypatch.setenv("SAGEBWD_KERNELS", kernels)
    run = _ours if layout == "dense" else _ours_packed
    for which, value in GPU_CASES:
        q, k, v, do = _inputs("cuda", which, value, heads=4, n=512, d=head_dim)
        ours = run(q, k, v, do, causal, precision=precision, deterministic=deterministic)
        assert_nonfinite_as_sdpa(ours, _expected(q, k, v, do, causal),
                                 f"{kernels} {precision} D={head_dim} {layout} {which}={value}")


@pytest.mark.gpu
@pytest.mark.parametrize("which, value", GPU_CASES)
def test_nonfinite_input_reaches_outputs_sdpa_provider(which, value):
    """Behind SDPA (torch.nn.attention's flash registry, sagebwd_hf.sdpa_flash) as well."""
    from sagebwd_hf import sdpa_flash
    if not sdpa_flash.registry_available():
        pytest.skip("this torch has no flash-attention registry")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v, do = _inputs("cuda", which, value, heads=4, n=512, d=128)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    sdpa_flash.reset_stats()
    sdpa_flash.activate()
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
            out.backward(do)
    finally:
        sdpa_flash.restore()
    assert sdpa_flash.stats()["forward"] == 1 and sdpa_flash.stats()["backward"] == 1
    ref = _expected(q, k, v, do, True)
    for name, mine, want in zip(("O", "dQ", "dK", "dV"), [out] + [x.grad for x in leaves], ref[:1] + ref[2:]):
        assert not (want & ~_bad(mine)).any(), name

