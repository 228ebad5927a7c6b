"""The segmented op (padding masks and packed sequence ids over a [B, N, H, D] batch): every real token gets
what its sequence alone gives, padding gets zeros and zero gradients, and torch.compile (aot_eager here,
inductor in the GPU suite) traces it without a graph break."""
import pytest
import torch

from sagebwd_hf import sagebwd_attn_func
from sagebwd_hf.segments import _segmented_fwd, segmented_attention
from sagebwd_hf.testing import run_with_grads
from conftest import kernel_devices

SCALE = 0.25


def qkv(b, n, nk, h, hkv, d, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=g).to(device, torch.bfloat16)  # noqa: E731
    return make(b, n, h, d), make(b, nk, hkv, d), make(b, nk, hkv, d), make(b, n, h, d)


def alone(q, k, v, do, causal):
    """One sequence ``[n, H, D]`` through the padded op: output and gradients."""
    fn = lambda *x: sagebwd_attn_func(*(t.transpose(0, 1)[None] for t in x), causal=causal,  # noqa: E731
                                      softmax_scale=SCALE)[0].transpose(0, 1)
    return list(run_with_grads(fn, q, k, v, do).values())


def segmented(q, k, v, do, mask=None, ids=None, causal=True):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    inputs = [x.clone() for x in (q, k, v)]
    out = segmented_attention(*leaves, mask, ids, causal=causal, softmax_scale=SCALE)
    out.backward(do)
    for x, before in zip((q, k, v), inputs):
        assert torch.equal(x, before)                       # inputs never modified
    return [out.detach()] + [x.grad for x in leaves]


def assert_same(got, want):
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("pattern", ["left", "right", "holes"])
def test_padding_mask(device, pattern):
    b, n = 2, 40
    q, k, v, do = qkv(b, n, n, 4, 2, 32, device)
    mask = torch.ones(b, n, dtype=torch.bool, device=device)
    if pattern == "left":
        mask[0, :13] = False
    elif pattern == "right":
        mask[1, 29:] = False
    else:                                    # holes: the real tokens are gathered in order, as flash's unpad
        mask[0, 5:9] = False
        mask[1, ::3] = False
    got = segmented(q, k, v, do, mask=mask)
    for row in range(b):
        real = mask[row]
        want = alone(q[row, real], k[row, real], v[row, real], do[row, real], causal=True)
        assert_same([x[row, real] for x in got], want)
        for x in got:                        # padding: zero output, zero gradients
            assert not x[row, ~real].any()


@pytest.mark.parametrize("device", kernel_devices())
def test_packed_ids(device):
    lengths = [[9, 20, 11], [40]]            # row 1 is one sequence, row 0 three
    q, k, v, do = qkv(2, 40, 40, 4, 1, 32, device, seed=1)
    ids = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths], device=device)
    got = segmented(q, k, v, do, ids=ids)
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            sl = slice(start, start + n)
            assert_same([x[row, sl] for x in got], alone(q[row, sl], k[row, sl], v[row, sl], do[row, sl], True))
            start += n


@pytest.mark.parametrize("device", kernel_devices())
def test_ids_without_restarts_run_the_padded_batch(device):
    q, k, v, do = qkv(2, 33, 33, 2, 2, 32, device, seed=2)
    ids = torch.zeros(2, 33, dtype=torch.long, device=device)
    got = segmented(q, k, v, do, ids=ids, causal=False)
    fn = lambda *x: sagebwd_attn_func(*(t.transpose(1, 2) for t in x),  # noqa: E731
                                      softmax_scale=SCALE).transpose(1, 2)
    assert_same(got, list(run_with_grads(fn, q, k, v, do).values()))


@pytest.mark.parametrize("device", kernel_devices())
def test_cache_queries_end_at_the_last_real_key(device):
    """A KV cache longer than the mask (a static cache's unwritten slots) and fewer queries than keys: each
    row's queries are the last q_len real tokens, aligned bottom-right to that row's last real key."""
    q, k, v, do = qkv(2, 4, 24, 4, 2, 32, device, seed=3)
    mask = torch.zeros(2, 20, dtype=torch.bool, device=device)
    mask[0, 3:20] = True                      # left padded, real keys 3..19
    mask[1, :20] = True
    got = segmented(q, k, v, do, mask=mask)
    for row in range(2):
        real = torch.nonzero(mask[row]).flatten()
        want = alone(q[row], k[row, real], v[row, real], do[row], causal=True)
        assert_same([got[0][row], got[1][row], got[2][row, real], got[3][row, real]], want)
        assert not got[2][row, 20:].any() and not got[3][row, 20:].any()   # unwritten slots: no gradient


def test_rejects_both_or_neither():
    q, k, v, _ = qkv(1, 8, 8, 2, 2, 32, "cpu")
    with pytest.raises(ValueError, match="exactly one of mask and ids"):
        segmented_attention(q, k, v, causal=True, softmax_scale=SCALE)


@pytest.mark.parametrize("softcap, with_sinks", [(0.0, False), (5.0, True)], ids=["plain", "softcap_sinks"])
def test_opcheck(softcap, with_sinks):
    q, k, v, _ = qkv(2, 24, 24, 4, 2, 32, "cpu")
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[0, :5] = False
    for x in (q, k, v):
        x.requires_grad_()
    sinks = torch.randn(4, requires_grad=True) if with_sinks else None
    args = (True, SCALE, -1, 0, True, False, "naive", softcap, "accurate", sinks)
    torch.library.opcheck(_segmented_fwd, (q, k, v, mask, None) + args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("kind", ["mask", "ids"])
def test_compile_fullgraph_matches_eager(kind):
    q, k, v, do = qkv(2, 24, 24, 4, 2, 32, "cpu", seed=4)
    if kind == "mask":
        mask, ids = torch.ones(2, 24, dtype=torch.bool), None
        mask[1, :7] = False
    else:
        mask, ids = None, torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    fn = lambda a, b, c: segmented_attention(a, b, c, mask, ids, causal=True, softmax_scale=SCALE)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got, want = run_with_grads(compiled, q, k, v, do), run_with_grads(fn, q, k, v, do)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_per_tensor_keeps_a_few_tensors_per_name():
    """Layers that alternate between two masks (sliding-window and full) read each once per forward; a mask
    modified in place is read again."""
    from sagebwd_hf.segments import per_tensor
    reads = []
    a, b = torch.ones(3), torch.zeros(3)
    read = lambda t: reads.append(1) or float(t.sum())  # noqa: E731
    for _ in range(3):
        assert per_tensor("test", a, read) == 3.0 and per_tensor("test", b, read) == 0.0
    assert len(reads) == 2
    a.add_(1)
    assert per_tensor("test", a, read) == 6.0 and len(reads) == 3


@pytest.mark.parametrize("case", ["self", "queries_after_cache", "sinks_cap"])
def test_eager_call_holds_packed_tensors_and_equals_the_op(case):
    """An eager call that cuts rows keeps the packed q, k, v (real tokens only) for its backward, not the padded
    inputs, and computes the op pair's outputs and gradients bit for bit."""
    from sagebwd_hf.interface import _backend
    from sagebwd_hf.segments import _segmented_bwd_impl, _segmented_fwd_impl, query_rows
    n_q = 8 if case == "queries_after_cache" else 24
    q, k, v, do = qkv(2, n_q, 24, 4, 2, 32, "cpu", seed=3)
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[0, :7] = False                     # left padding in one row
    mask[1, 20:] = False                    # right padding in the other
    sinks = torch.randn(4) if case == "sinks_cap" else None
    args = (True, SCALE, -1, 0, True, False, _backend(q, None), 5.0 if case == "sinks_cap" else 0.0,
            "accurate")

    leaves = [x.clone().requires_grad_() for x in (q, k, v)] + ([sinks.clone().requires_grad_()] if sinks is not None
                                                                else [])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = segmented_attention(*leaves[:3], mask, None, causal=True, softmax_scale=SCALE,
                                  softcap=args[7], sinks=leaves[3] if sinks is not None else None)
    out.backward(do)
    real_q = int(query_rows(mask, n_q, True).sum())
    held = [t for t in saved if t.dim() == 3 and t.dtype == q.dtype]      # [tokens, heads, D]: packed q, k, v
    assert sorted(t.shape[0] for t in held) == sorted([real_q, int(mask.sum()), int(mask.sum())])
    padded = [t for t in saved if t.shape[:2] == q.shape[:2]]   # [B, N, ...]: only the output (the caller holds it)
    assert [t.data_ptr() for t in padded] == [out.data_ptr()]

    want_out, lse = _segmented_fwd_impl(q, k, v, mask, None, *args, sinks)
    want = _segmented_bwd_impl(do, q, k, v, want_out, lse, mask, None, *args, sinks)
    assert torch.equal(out.detach(), want_out)
    for got, expected in zip(leaves, want):
        assert torch.equal(got.grad, expected)
