"""benchmarks/packed_finetune.py's CPU parts: the documents, their packed and padded batches, the loss, and the
FlashAttention-varlen attention function on a tiny Llama against SDPA: its layouts with an exact per-sequence
stand-in for the op, and once through torch's flash op itself, forward and backward, with SageBwd's kernels behind
it for CPU tensors (the op has no CPU kernel of its own)."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

import sagebwd_hf
from sagebwd_hf import sdpa_flash

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import packed_finetune as pf

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")

VOCAB = 128
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
LENGTHS = [9, 30, 1, 17, 24]     # a one-token document too (its label is only the separator)
COS_MIN = 0.999                   # last hidden state, INT8 attention against SDPA


def tiny_model(impl):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**TINY), attn_implementation=impl).to(torch.bfloat16)


def cos(a, b):
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


# ---------------------------------------------------------------------------------------------------
# Documents and batches
# ---------------------------------------------------------------------------------------------------

def test_document_lengths_fill_the_step_exactly_with_a_long_tail():
    lengths = pf.document_lengths(200_000, seed=0)
    assert sum(lengths) == 200_000
    assert lengths == pf.document_lengths(200_000, seed=0)
    assert lengths != pf.document_lengths(200_000, seed=1)
    assert all(1 <= n <= pf.DOC_MAX for n in lengths) and all(n >= 2 for n in lengths[:-1])
    mean = sum(lengths[:-1]) / len(lengths[:-1])
    assert 650 <= mean <= 800, mean
    assert max(lengths) >= 3000 and sorted(lengths)[len(lengths) // 2] < mean * 0.75   # long-tailed
    # a larger step extends the same documents
    assert pf.document_lengths(16384)[:-1] == pf.document_lengths(65536)[:len(pf.document_lengths(16384)) - 1]


def test_packed_row_is_the_collators_and_its_cu_seqlens_derive_from_position_ids():
    examples = pf.make_documents(LENGTHS, VOCAB)
    assert [len(e["input_ids"]) for e in examples] == LENGTHS
    assert all(0 < t < VOCAB for e in examples for t in e["input_ids"])
    row = pf.packed_batch(examples, flash_kwargs=True)
    total = sum(LENGTHS)
    assert row["input_ids"].shape == row["position_ids"].shape == row["labels"].shape == (1, total)
    assert "attention_mask" not in row
    starts = torch.tensor([0] + LENGTHS).cumsum(0)
    assert row["cu_seq_lens_q"].tolist() == row["cu_seq_lens_k"].tolist() == starts.tolist()
    assert row["max_length_q"] == max(LENGTHS)
    assert (row["labels"][0, starts[:-1]] == pf.IGNORE).all()
    assert int((row["labels"] == pf.IGNORE).sum()) == len(LENGTHS)
    assert row["position_ids"][0, starts[:-1]].eq(0).all()

    cu, longest = pf.cu_seqlens_from_position_ids(row["position_ids"], 1, total)
    assert cu.dtype == torch.int32 and torch.equal(cu, row["cu_seq_lens_q"]) and longest == row["max_length_q"]
    plain = pf.packed_batch(examples)
    assert set(plain) == {"input_ids", "labels", "position_ids"} and torch.equal(plain["input_ids"], row["input_ids"])


def test_cu_seqlens_without_restarts_is_one_sequence_a_row():
    cu, longest = pf.cu_seqlens_from_position_ids(torch.arange(6)[None], 3, 6)
    assert cu.tolist() == [0, 6, 12, 18] and longest == 6
    restarting = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    cu, longest = pf.cu_seqlens_from_position_ids(restarting, 2, 5)
    assert cu.tolist() == [0, 3, 5, 7, 10] and longest == 3


def test_padded_batches_hold_the_same_documents_right_padded():
    examples = pf.make_documents(LENGTHS, VOCAB)
    batches = pf.padded_batches(examples, pad_batch=2)
    assert len(batches) == 3
    docs = []
    for b in batches:
        ids, mask, labels = b["input_ids"], b["attention_mask"], b["labels"]
        assert ids.shape == mask.shape == labels.shape and ids.shape[0] <= 2
        assert ids.shape[1] == int(mask.sum(-1).max())                     # padded to its longest
        for r in range(ids.shape[0]):
            n = int(mask[r].sum())
            assert mask[r, :n].all() and not mask[r, n:].any()             # right padding
            assert (labels[r, n:] == pf.IGNORE).all() and torch.equal(labels[r, :n], ids[r, :n])
            docs.append(ids[r, :n].tolist())
    assert docs == [e["input_ids"] for e in examples]
    assert len(pf.padded_batches(examples, pad_batch=0)) == 1


def test_packed_and_padded_predict_the_same_tokens():
    """The causal LM loss's pairs: every document's tokens after its first, in the same order, either way."""
    examples = pf.make_documents(LENGTHS, VOCAB)
    row = pf.packed_batch(examples)
    _, packed_targets = pf.label_positions(row["labels"])
    padded_targets = torch.cat([pf.label_positions(b["labels"])[1] for b in pf.padded_batches(examples, 2)])
    expected = [t for e in examples for t in e["input_ids"][1:]]
    assert packed_targets.tolist() == padded_targets.tolist() == expected
    index, _ = pf.label_positions(row["labels"])
    assert torch.equal(row["input_ids"].flatten()[index + 1], packed_targets)    # position t predicts t + 1


def test_unpad_indices():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    indices, cu, longest = pf.unpad_indices(mask)
    assert indices.tolist() == [0, 1, 2, 4, 8, 9, 10, 11]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 4, 8] and longest == 4


@pytest.mark.parametrize("frozen_weight", [False, True])
def test_chunked_lm_loss_matches_cross_entropy(frozen_weight):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=g, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, requires_grad=not frozen_weight)
    labels = torch.randint(0, 40, (2, 7), generator=g)
    labels[0, 3] = labels[1, 6] = pf.IGNORE
    index, targets = pf.label_positions(labels)
    loss = pf.chunked_lm_loss(hidden, weight, index, targets, denominator=20, chunk=3)
    logits = hidden[:, :-1] @ weight.t()
    expected = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=pf.IGNORE,
                               reduction="sum") / 20
    torch.testing.assert_close(loss, expected)
    got = torch.autograd.grad(loss, [hidden] + ([] if frozen_weight else [weight]))
    want = torch.autograd.grad(expected, [hidden] + ([] if frozen_weight else [weight]))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------------
# Attention implementations on a tiny Llama
# ---------------------------------------------------------------------------------------------------

@pytest.fixture
def sagebwd_behind_flash_op_on_cpu():
    """torch's FlashAttention op runs SageBwd's kernels for CPU tensors, for one test (the fa2_varlen function
    then runs here as on a GPU with sdpa_flash active)."""
    if not sdpa_flash.registry_available():
        pytest.skip("this torch has no flash-attention registry")
    pf.register_fa2_varlen()
    sdpa_flash.reset_stats()
    handle = sdpa_flash._register_kernels("CPU")
    yield
    handle.remove()


@torch.no_grad()
def last_hidden(model, impl, inputs):
    model.set_attn_implementation(impl)
    return model.model(**inputs, use_cache=False).last_hidden_state


def test_sdpa_attends_within_documents_of_a_packed_row():
    """The benchmark's premise: Transformers gives SDPA a block-causal mask from restarting position_ids."""
    examples = pf.make_documents(LENGTHS, VOCAB)
    model = tiny_model("sdpa")
    row = last_hidden(model, "sdpa", pf.packed_batch(examples))
    start = 0
    for e in examples:
        alone = last_hidden(model, "sdpa", {"input_ids": torch.tensor([e["input_ids"]])})
        torch.testing.assert_close(row[0, start:start + len(e["input_ids"])], alone[0], atol=2e-2, rtol=2e-2)
        start += len(e["input_ids"])


def test_sagebwd_agrees_with_sdpa_on_a_packed_row():
    model = tiny_model("sdpa")
    inputs = pf.packed_batch(pf.make_documents(LENGTHS, VOCAB))
    inputs.pop("labels")
    sagebwd_hf.reset_attention_stats()
    got = last_hidden(model, "sagebwd", inputs)
    assert sagebwd_hf.attention_stats()["paths"] == {"packed": TINY["num_hidden_layers"]}
    assert cos(got, last_hidden(model, "sdpa", inputs)) > COS_MIN


def exact_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """What the flash op computes, one sequence at a time: causal attention of packed ``[T, H, D]`` tensors."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and torch.equal(cu_q, cu_k)
    lengths = cu_q.diff().tolist()
    assert max_q == max_k == max(lengths) and cu_q[-1] == q.shape[0]
    outs = [F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scale,
                                           enable_gqa=True).transpose(0, 1)
            for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist())]
    return torch.cat(outs)


def _inputs(kind, examples):
    if kind == "padded":
        return pf.padded_batches(examples, pad_batch=3)[0]
    return pf.packed_batch(examples, flash_kwargs=kind == "packed_cu_seq_lens")


@pytest.mark.parametrize("kind", ["packed", "packed_cu_seq_lens", "padded"])
def test_fa2_varlen_function_layouts(monkeypatch, kind):
    """Unpadding, cu_seqlens from the collator or from position_ids, GQA and the output layout, with an exact
    stand-in for the op: the function equals SDPA."""
    pf.register_fa2_varlen()
    monkeypatch.setattr(pf, "_flash_varlen", exact_varlen)
    inputs = _inputs(kind, pf.make_documents(LENGTHS, VOCAB))
    inputs.pop("labels")
    model = tiny_model("sdpa").float()
    want = last_hidden(model, "sdpa", inputs)
    got = last_hidden(model, pf.FA2_VARLEN, inputs)
    real = inputs["attention_mask"].bool() if kind == "padded" else torch.ones(want.shape[:2], dtype=torch.bool)
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-4)


def test_fa2_varlen_function_runs_the_flash_op_and_trains(sagebwd_behind_flash_op_on_cpu):
    inputs = pf.packed_batch(pf.make_documents(LENGTHS, VOCAB))
    labels = inputs.pop("labels")
    model = tiny_model("sdpa")
    want = last_hidden(model, "sdpa", inputs)
    assert cos(last_hidden(model, pf.FA2_VARLEN, inputs), want) > COS_MIN
    assert sdpa_flash.stats()["forward"] == TINY["num_hidden_layers"] and not sdpa_flash.stats()["fallback"]

    index, targets = pf.label_positions(labels)
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    pf.chunked_lm_loss(hidden, model.lm_head.weight, index, targets, len(targets)).backward()
    assert sdpa_flash.stats()["backward"] == TINY["num_hidden_layers"]
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_captured_attention_calls_are_layer_zeros():
    model = tiny_model("sdpa")
    inputs = pf.packed_batch(pf.make_documents(LENGTHS, VOCAB))
    inputs.pop("labels")
    original = pf.ALL_ATTENTION_FUNCTIONS["sdpa"]
    with pf.LayerZeroCapture("sdpa") as capture:
        last_hidden(model, "sdpa", inputs)
    assert pf.ALL_ATTENTION_FUNCTIONS["sdpa"] is original
    assert len(capture.calls) == 1
    module, query, key, value, mask, kwargs = capture.calls[0]
    assert module is model.model.layers[0].self_attn
    assert query.shape == (1, 4, sum(LENGTHS), 16) and key.shape == value.shape == (1, 2, sum(LENGTHS), 16)
    assert "position_ids" in kwargs and "scaling" in kwargs


def test_refuses_without_a_gpu(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.setattr(sys, "argv", ["packed_finetune.py"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        pf.main()
