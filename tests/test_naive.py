"""The PyTorch path (sagebwd_hf.naive) walks the queries in blocks: the same results as one whole-matrix pass, with
memory that grows with one block's scores."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sagebwd_hf import naive, sagebwd_attn_func
from sagebwd_hf.testing import assert_equal_but_summation_order, make_qkv, run_with_grads

WHOLE = 1 << 20   # query rows per block past any test's length: one pass over the whole score matrix


def _run(q, k, v, do, window, query_block, q_smoothing=False, softcap=0.0, dq_int8=True, block_m_dkdv=64):
    scale = q.shape[-1] ** -0.5
    out, lse = naive.sagebwd_forward_naive(q, k, v, scale, window, True, q_smoothing, 64, softcap,
                                           query_block=query_block)
    grads = naive.sagebwd_backward_naive(q, k, v, out, lse, do, scale, window, True, q_smoothing, block_m_dkdv, 64,
                                         softcap, dq_int8, query_block=query_block)
    return (out, lse) + grads


@pytest.mark.parametrize("case", [
    dict(n_q=300, n_k=300, d=64, window=(-1, 0)),
    dict(n_q=300, n_k=300, d=64, window=(-1, -1), q_smoothing=True, block_m_dkdv=128, dtype=torch.float16),
    dict(n_q=260, n_k=400, d=32, window=(50, 0), softcap=20.0, dq_int8=False),
    dict(n_q=400, n_k=260, d=128, window=(-1, 0), q_smoothing=True, softcap=30.0),
    dict(n_q=257, n_k=257, d=48, window=(17, 33), dq_int8=False),
], ids=["causal", "full-qsmooth-fp16", "window-softcap-onelaunch", "qk-lengths-differ", "band"])
def test_query_blocks_give_the_whole_matrix_results(case):
    """Every scale spans whole blocks (Q-smoothing's 128 queries, dK/dV's query tiles, K's over all keys), so
    blocks of 128 queries give what one pass over the whole matrix gives, but for the order of fp32 sums."""
    case = dict(case)
    n_q, n_k, d, window = case.pop("n_q"), case.pop("n_k"), case.pop("d"), case.pop("window")
    q, k, v, do = make_qkv(2, 4, 2, n_q, n_k, d, case.pop("dtype", torch.bfloat16), "cpu", k_outliers=4.0, seed=1)
    whole = _run(q, k, v, do, window, WHOLE, **case)
    blocks = _run(q, k, v, do, window, 128, **case)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), blocks, whole):
        if name == "lse":   # (+inf for rows that see no key)
            assert torch.equal(torch.isinf(got), torch.isinf(want))
            got, want = got[torch.isfinite(want)], want[torch.isfinite(want)]
        assert_equal_but_summation_order(got, want, name)


def test_query_block_must_span_whole_tiles():
    q, k, v, do = make_qkv(1, 2, 2, 200, 200, 32, torch.bfloat16, "cpu", seed=0)
    with pytest.raises(ValueError, match="multiple of 128"):
        naive.sagebwd_forward_naive(q, k, v, 0.2, query_block=64)
    out, lse = naive.sagebwd_forward_naive(q, k, v, 0.2)
    with pytest.raises(ValueError, match="multiple of 384"):
        naive.sagebwd_backward_naive(q, k, v, out, lse, do, 0.2, block_m_dkdv=192, query_block=256)


class _LargestTensor(TorchDispatchMode):
    """The most elements any op's output held while the mode was on."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [x.numel() for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        self.numel = max([self.numel] + sizes)
        return out


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_memory_grows_with_one_query_block(causal, monkeypatch):
    """Through the op (the CPU path a user's call takes), the largest tensor of forward and backward is one block's
    scores ``[B, H, rows, N_k]``: doubling the length doubles it (the whole matrix would quadruple)."""
    monkeypatch.setattr(naive, "SCORE_BLOCK_ELEMENTS", 2 * 4 * 128 * 512)   # 128 query rows at 512 keys
    largest = {}
    for n in (512, 1024):
        q, k, v, do = make_qkv(2, 4, 1, n, n, 32, torch.bfloat16, "cpu", seed=0)
        with _LargestTensor() as mode:
            run_with_grads(lambda a, b, c: sagebwd_attn_func(a, b, c, causal=causal, backend="naive"), q, k, v, do)
        largest[n] = mode.numel
    assert largest[512] == 2 * 4 * 128 * 512, largest
    assert largest[1024] == 2 * 4 * 128 * 1024, largest     # 64 rows fit the budget; a block is at least 128
