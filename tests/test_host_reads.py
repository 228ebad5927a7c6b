"""Device-to-host reads (each a GPU sync, tests/host_reads.py) of the attention function as Transformers calls it,
counted on CPU tensors with the launches stubbed (tests/launch_counting.py), and the caches that keep them to one
forward's first layer: a mask, sequence ids or cu_seqlens written in place are read again.

A read in every layer stalls the host until the GPU has run everything queued, so the GPU then waits for the host
to launch the next layer: the later layers of a forward (the same mask or ids) and their backward read nothing.
The first layer's counts are upper bounds the paths must not exceed.
"""
import pytest
import torch

from host_reads import counted_host_reads
from launch_counting import TRANSFORMERS_PATHS, stubbed_launches, transformers_call
from sagebwd_hf.segments import _plan

LENGTHS = [37, 5, 20, 1, 12]
# a forward's first layer: the padding mask's indices and longest row (nonzero, max); packed position_ids: whether
# any row restarts, the sequences' starts and the longest; cu_seq_lens: its values checked once
FIRST_LAYER_READS = {"padded": 2, "packed": 3, "cu_seq_lens": 1}


@pytest.mark.parametrize("hopper", [True, False], ids=["hopper", "portable"])
@pytest.mark.parametrize("path", TRANSFORMERS_PATHS)
def test_a_later_layer_reads_nothing(path, hopper):
    call, leaves, do = transformers_call(path, LENGTHS, heads=2, kv_heads=1, head_dim=64)
    with stubbed_launches(hopper):
        call().backward(do)          # the forward's first layer
        with counted_host_reads() as later:
            call().backward(do)
        with counted_host_reads() as first:
            call(fresh=True).backward(do)
    assert sum(later.values()) == 0, dict(later)
    assert sum(first.values()) <= FIRST_LAYER_READS[path], dict(first)


def test_reads_are_counted():
    """The counter sees what would wait for a GPU (else the test above proves nothing)."""
    x = torch.arange(6)
    with counted_host_reads() as reads:
        int(x.max())
        x.tolist()
        torch.nonzero(x)
        x[x > 2]
        torch.repeat_interleave(x, x)
        torch.equal(x, x)
    assert dict(reads) == {"_local_scalar_dense": 1, "tolist": 1, "nonzero": 1, "index": 1, "repeat_interleave": 1,
                           "equal": 1}


def _expected_padding_plan(mask):
    idx = torch.nonzero(mask.flatten()).flatten()
    lengths = mask.sum(1)
    return idx, torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32), int(lengths.max())


@pytest.mark.parametrize("q_len", [24, 8], ids=["self", "cached"])
def test_padding_plan_reads_a_mask_written_in_place_again(q_len):
    mask = torch.arange(24)[None] < torch.tensor([24, 10, 3])[:, None]
    q, k = torch.empty(3, q_len, 1, 8), torch.empty(3, 24, 1, 8)
    for _ in range(2):                                   # (the second from the cache)
        plan = _plan(q, k, mask, None, True)
    mask[1, 10:16] = True                                # the same tensor, written in place
    mask[2] = False
    plan = _plan(q, k, mask, None, True)
    idx, cu, longest = _expected_padding_plan(mask)
    assert torch.equal(plan.idx_k, idx) and torch.equal(plan.cu_k, cu) and plan.max_k == longest
    if q_len == 24:
        assert plan.idx_q is plan.idx_k


def test_packed_plan_reads_ids_written_in_place_again():
    ids = torch.tensor([[0] * 5 + [1] * 3 + [2] * 8])
    q = torch.empty(1, 16, 1, 8)
    for _ in range(2):
        plan = _plan(q, q, None, ids, True)
    assert plan.cu_q.tolist() == [0, 5, 8, 16] and plan.max_q == 8
    ids[0, 8:] = 1                                       # two sequences now
    plan = _plan(q, q, None, ids, True)
    assert plan.cu_q.tolist() == [0, 5, 16] and plan.max_q == 11
    ids.zero_()                                          # one sequence a row: the padded batch as it is
    plan = _plan(q, q, None, ids, True)
    assert plan.cu_q is None and plan.max_q == 16
