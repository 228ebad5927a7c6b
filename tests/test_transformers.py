"""attn_implementation="sagebwd": Transformers models run SageBwd, with SDPA's semantics up to INT8 error.

Tiny models built from configs (random init, nothing downloaded) are compared with the same weights under
"sdpa". CPU runs the Triton kernels under the interpreter (conftest), so models stay tiny; CPU models are
float32, whose attention SageBwd computes in bfloat16 (SDPA in float32). Bounds are cosine similarity /
relative L2 error against SDPA, set with a margin over what INT8 attention gives here, and tight enough to
fail when a window or a padding mask is lost (test_bounds_detect_a_dropped_window_or_mask).
GPU tests (python -m pytest -m gpu) repeat the comparisons on CUDA in bfloat16.
"""
import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AttentionInterface, AutoConfig, AutoModel, AutoModelForCausalLM
from transformers import masking_utils
from transformers.masking_utils import AttentionMaskInterface

import sagebwd_hf
from sagebwd_hf import transformers_integration as ti

pytestmark = pytest.mark.filterwarnings("ignore:sagebwd. float32 attention inputs:UserWarning",
                                        "ignore:divide by zero:RuntimeWarning")

VOCAB = 128
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
# Each family with the attention features it brings. Sliding windows are small enough that 24-token
# sequences cross them.
FAMILIES = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=7, max_window_layers=1,
                  layer_types=["full_attention", "sliding_attention"]),
    "qwen3": dict(model_type="qwen3", use_sliding_window=True, sliding_window=6, max_window_layers=0,
                  layer_types=["sliding_attention", "full_attention"]),
    "mistral": dict(model_type="mistral", sliding_window=5),
    "gemma3": dict(model_type="gemma3_text", sliding_window=6, query_pre_attn_scalar=64,   # scale != D**-0.5
                   layer_types=["sliding_attention", "full_attention"]),
    "llama_mqa": dict(model_type="llama", num_key_value_heads=1),
}
# Measured (CPU, all families, with/without padding): logits cos >= 0.99996, rel L2 <= 0.009;
# gradients cos >= 0.99993, rel L2 <= 0.012.
COS_MIN, REL_L2_MAX = 0.9995, 0.03            # logits
GRAD_COS_MIN, GRAD_REL_L2_MAX = 0.999, 0.04   # all parameter gradients, concatenated


def tiny_config(family, **overrides):
    kwargs = dict(TINY, **FAMILIES[family])
    kwargs.update(overrides)
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def tiny_model(family, impl="sagebwd", seed=0, device="cpu", dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation=impl)
    return model.to(device, dtype)


def batch(b=2, n=24, seed=1, padding=None, pad=7, device="cpu"):
    """Token ids, attention mask and labels; ``padding`` "left"/"right" pads row 0 by ``pad`` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    if padding == "left":
        mask[0, :pad] = 0
    elif padding == "right":
        mask[0, -pad:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out = dict(input_ids=ids, labels=labels)
    if padding is not None:
        out["attention_mask"] = mask
    return {k: v.to(device) for k, v in out.items()}


def cos(a, b):
    a, b = a.flatten().double(), b.flatten().double()
    return float(a @ b / (a.norm() * b.norm()))


def rel_l2(a, b):
    a, b = a.flatten().double(), b.flatten().double()
    return float((a - b).norm() / b.norm())


def run(model, impl, inputs, real=None):
    """Logits (real tokens only) and all parameter gradients of the LM loss under ``impl``."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(**inputs, use_cache=False)   # training: with a cache Transformers skips its packing detection
    out.loss.backward()
    grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    logits = out.logits.detach().float()
    return (logits[real] if real is not None else logits), grads, float(out.loss.detach())


def logits_of(model, impl, inputs):
    """Forward only (invariance checks do not need gradients)."""
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False).logits.float()


def assert_close_to_sdpa(model, inputs, real=None, bounds=(COS_MIN, REL_L2_MAX, GRAD_COS_MIN, GRAD_REL_L2_MAX)):
    sdpa_logits, sdpa_grads, _ = run(model, "sdpa", inputs, real)
    sagebwd_hf.reset_attention_stats()
    logits, grads, _ = run(model, "sagebwd", inputs, real)
    stats = sagebwd_hf.attention_stats()
    assert stats["fallback"] == {} and stats["sagebwd"] == model.config.num_hidden_layers, stats
    cos_min, rel_max, grad_cos_min, grad_rel_max = bounds
    assert cos(logits, sdpa_logits) >= cos_min and rel_l2(logits, sdpa_logits) <= rel_max
    assert cos(grads, sdpa_grads) >= grad_cos_min and rel_l2(grads, sdpa_grads) <= grad_rel_max
    return logits, sdpa_logits


# ---------------------------------------------------------------------------------------------------
# Registration and loading
# ---------------------------------------------------------------------------------------------------

def test_registered_in_both_interfaces():
    assert AttentionInterface._global_mapping["sagebwd"] is ti.sagebwd_attention_forward
    assert AttentionMaskInterface._global_mapping["sagebwd"] is ti.sagebwd_mask


def test_from_pretrained_from_config_and_set_attn_implementation(tmp_path):
    tiny_model("llama", impl="sdpa").save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sagebwd")
    assert loaded.config._attn_implementation == "sagebwd"
    assert tiny_model("llama").config._attn_implementation == "sagebwd"           # from_config
    switched = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    switched.set_attn_implementation("sagebwd")
    assert switched.config._attn_implementation == "sagebwd"
    sagebwd_hf.reset_attention_stats()
    with torch.no_grad():
        a, b = loaded(**batch()).logits, switched(**batch()).logits
    assert torch.equal(a, b)
    assert sagebwd_hf.attention_stats()["sagebwd"] == 4


def test_mask_patterns_the_kernel_expresses():
    """The mask function accepts Transformers' causal / bidirectional / sliding-window / packed patterns and
    nothing else, both by walking the closures (eager) and from the creators' flags (torch.compile)."""
    from transformers import masking_utils as mu
    packed_ids = torch.zeros(1, 8, dtype=torch.long)
    position_ids = torch.arange(8)[None]
    if hasattr(mu, "packed_sequence_compatibility_function"):   # 5.2x
        packed = mu.packed_sequence_compatibility_function(mu.causal_mask_function, position_ids, packed_ids)
    else:                                                        # 5.17
        packed = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(packed_ids))
    known = [mu.causal_mask_function, mu.bidirectional_mask_function, mu.sliding_window_causal_mask_function(4),
             mu.sliding_window_bidirectional_mask_function(4), packed]
    unknown = [mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)),
               mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function),
               mu.and_masks(mu.causal_mask_function, lambda b, h, q, kv: q >= 0)]
    assert all(ti._expressible(fn) for fn in known)
    assert not any(ti._expressible(fn) for fn in unknown)
    assert ti._mask_parts(unknown[0])[0] == 4           # chunked: the chunk ids path (without padding or cache)
    assert ti._mask_parts(mu.and_masks(unknown[0], mu.packed_sequence_mask_function(packed_ids))) is None
    config = tiny_config("llama", attention_chunk_size=4)
    assert ti._expressible_compiled(mu.causal_mask_function, dict(use_vmap=False, config=config))
    assert not ti._expressible_compiled(mu.causal_mask_function, dict(use_vmap=True, config=config))
    assert not ti._expressible_compiled(unknown[0], dict(use_vmap=False, local_size=4, config=config))
    assert not ti._expressible_compiled(unknown[1], dict(use_vmap=False, config=config))


# ---------------------------------------------------------------------------------------------------
# Same answers as SDPA
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_causal_lm_matches_sdpa(family):
    model = tiny_model(family)
    assert_close_to_sdpa(model, batch(padding="left" if family in ("llama", "gemma3") else None))


@pytest.mark.parametrize("padding", ["left", "right"])
def test_padded_batch_matches_sdpa(padding):
    inputs = batch(padding=padding)
    assert_close_to_sdpa(tiny_model("mistral"), inputs, real=inputs["attention_mask"].bool())


def test_bounds_detect_a_dropped_window_or_mask():
    """The bounds above are tight enough to catch a lost sliding window or a lost padding mask."""
    model = tiny_model("mistral", impl="sdpa")
    with_window, _, _ = run(model, "sdpa", batch())
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    model.config.sliding_window = None
    without_window, _, _ = run(model, "sdpa", batch())
    assert rel_l2(without_window, with_window) > 10 * REL_L2_MAX
    padded = batch(padding="left")
    real = padded["attention_mask"].bool()
    with_mask, _, _ = run(model, "sdpa", padded, real)
    without_mask, _, _ = run(model, "sdpa", {k: v for k, v in padded.items() if k != "attention_mask"}, real)
    assert rel_l2(without_mask, with_mask) > 3 * REL_L2_MAX


def _attention_outputs(model, impl, inputs, real):
    """Outputs of every attention module (the ones Transformers gives ``is_causal``), and the gradients of
    their squared sum. A random-init encoder's hidden states barely depend on its attention, so the encoder
    tests compare the attention itself."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    outputs = []
    hooks = [m.register_forward_hook(lambda m, args, out: outputs.append(out[0] if isinstance(out, tuple) else out))
             for m in model.modules() if hasattr(m, "is_causal")]
    try:
        model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    sum(o[real].pow(2).sum() for o in outputs).backward()
    grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    return torch.cat([o.detach()[real].float() for o in outputs]), grads


def _check_encoder(encoder, device="cpu", dtype=torch.float32, n=24, pad=7,
                   bounds=(COS_MIN, REL_L2_MAX, GRAD_COS_MIN, GRAD_REL_L2_MAX)):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64 if device == "cpu" else 256, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=128, max_position_embeddings=1024, pad_token_id=0)
    if encoder == "bert":
        config = AutoConfig.for_model("bert", attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, **common)
    else:
        config = AutoConfig.for_model("modernbert", local_attention=8 if device == "cpu" else 128,
                                      global_attn_every_n_layers=2, attention_dropout=0.0, mlp_dropout=0.0,
                                      embedding_dropout=0.0, sep_token_id=1, cls_token_id=2, bos_token_id=2,
                                      eos_token_id=1, **common)
    model = AutoModel.from_config(config, attn_implementation="sagebwd").to(device, dtype)
    assert all(not m.is_causal for m in model.modules() if hasattr(m, "is_causal"))
    inputs = batch(n=n, padding="right", pad=pad, device=device)
    inputs = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    real = inputs["attention_mask"].bool()
    out0, grads0 = _attention_outputs(model, "sdpa", inputs, real)
    sagebwd_hf.reset_attention_stats()
    out1, grads1 = _attention_outputs(model, "sagebwd", inputs, real)
    assert sagebwd_hf.attention_stats()["paths"] == {"padding": 2}
    cos_min, rel_max, grad_cos_min, grad_rel_max = bounds
    assert cos(out1, out0) >= cos_min and rel_l2(out1, out0) <= rel_max
    assert cos(grads1, grads0) >= grad_cos_min and rel_l2(grads1, grads0) <= grad_rel_max
    # the comparison notices a lost padding mask (on the padded row)
    row0 = real.clone()
    row0[1:] = False
    masked, _ = _attention_outputs(model, "sdpa", inputs, row0)
    inputs["attention_mask"] = torch.ones_like(inputs["attention_mask"])
    unmasked, _ = _attention_outputs(model, "sdpa", inputs, row0)
    assert rel_l2(unmasked, masked) > rel_max   # (on an H200 in bf16: 0.055 against the 0.04 bound)


@pytest.mark.parametrize("encoder", ["bert", "modernbert"])
def test_bidirectional_encoder_matches_sdpa(encoder):
    """is_causal False, a 2D padding mask -> varlen without causality; ModernBERT adds bidirectional
    sliding-window layers (its mask |i - j| <= W/2 as window_size=(W/2, W/2))."""
    _check_encoder(encoder)


def test_scaling_is_honoured():
    """Gemma3 scales by query_pre_attn_scalar**-0.5, not head_dim**-0.5: calling the backend directly with
    both scales gives different answers, each matching SDPA with that scale."""
    model = tiny_model("gemma3")
    attn = model.model.layers[1].self_attn
    assert attn.scaling != attn.head_dim ** -0.5
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 20, 16, generator=g, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, 2, 20, 16, generator=g, dtype=torch.bfloat16)
    outs = []
    for scale in (attn.scaling, attn.head_dim ** -0.5):
        out, _ = ti.sagebwd_attention_forward(attn, q, k, v, None, scaling=scale)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1), is_causal=True,
            scale=scale).transpose(1, 2)
        assert rel_l2(out, ref) < 0.02
        outs.append(out)
    assert rel_l2(outs[0], outs[1]) > 0.1


def test_gqa_and_mqa_never_repeat_kv(monkeypatch):
    seen = []
    real_func = ti.sagebwd_attn_func

    def spy(q, k, v, **kw):
        seen.append((q.shape[1], k.shape[1]))
        return real_func(q, k, v, **kw)

    monkeypatch.setattr(ti, "sagebwd_attn_func", spy)
    for family, kv_heads in (("llama", 2), ("llama_mqa", 1)):
        with torch.no_grad():
            tiny_model(family)(**batch())
        assert seen and all(s == (4, kv_heads) for s in seen), seen
        seen.clear()


# ---------------------------------------------------------------------------------------------------
# Padding and packing invariance (SageBwd against itself: same sequence, same numbers)
# ---------------------------------------------------------------------------------------------------

INVARIANCE_ATOL = 1e-4


@pytest.mark.parametrize("padding", ["left", "right"])
def test_padding_invariance(padding):
    """Row 0 alone and padded inside a batch: same logits on its real tokens, same gradients."""
    model = tiny_model("qwen2")
    model.set_attn_implementation("sagebwd")
    padded = batch(padding=padding)
    real = padded["attention_mask"][0].bool()
    alone = {k: v[:1, real] for k, v in padded.items() if k != "attention_mask"}
    if padding == "left":   # a left-padded row's positions start after its padding in generate(), not here
        padded["position_ids"] = (padded["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    results = []
    for inputs, rows in ((padded, (0, real)), (alone, (0, slice(None)))):
        model.zero_grad(set_to_none=True)
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False).logits[rows]
        logits.pow(2).mean().backward()     # gradients of row 0's real logits
        results.append((logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters()
                                                    if p.grad is not None])))
    (padded_logits, padded_grads), (alone_logits, alone_grads) = results
    torch.testing.assert_close(padded_logits, alone_logits, atol=INVARIANCE_ATOL, rtol=0)
    torch.testing.assert_close(padded_grads, alone_grads, atol=1e-5, rtol=1e-3)


def _packed_inputs(lengths, flash_kwargs, seed=3):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    return seqs, collator([{"input_ids": s.tolist()} for s in seqs])


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packing_invariance(flash_kwargs):
    """A padding-free batch (DataCollatorWithFlattening) gives each sequence the logits it gets alone: no
    attention across sequence boundaries; and SDPA (which splits at the position_ids) agrees."""
    model = tiny_model("llama")
    seqs, packed = _packed_inputs([9, 14, 5], flash_kwargs)
    sagebwd_hf.reset_attention_stats()
    packed_logits = logits_of(model, "sagebwd", packed)
    assert sagebwd_hf.attention_stats()["paths"] == {"cu_seq_lens" if flash_kwargs else "packed": 2}
    start = 0
    for seq in seqs if not flash_kwargs else ():   # the position_ids case already shows this
        alone_logits = logits_of(model, "sagebwd", dict(input_ids=seq[None]))
        torch.testing.assert_close(packed_logits[0, start:start + len(seq)], alone_logits[0],
                                   atol=INVARIANCE_ATOL, rtol=0)
        start += len(seq)
    sdpa_logits = logits_of(model, "sdpa", packed)
    assert cos(packed_logits, sdpa_logits) >= COS_MIN and rel_l2(packed_logits, sdpa_logits) <= REL_L2_MAX


def test_packed_position_ids_off_runs_the_dense_call():
    """``packed_position_ids=False``: restarting position_ids are positions only (RoPE still reads them), so the
    batch runs as one dense causal call, eager and compiled; explicit cu_seq_lens still split it. (What makes a
    compiled model capturable in CUDA graphs: the packed path reads the ids on the host every call.)"""
    model = tiny_model("llama", num_hidden_layers=1)
    _, packed = _packed_inputs([9, 14, 5], flash_kwargs=False)
    sagebwd_hf.configure(model, packed_position_ids=False)
    assert sagebwd_hf.get_options(model).op_kwargs() == {"k_smoothing": True, "q_smoothing": False,
                                                         "precision": "accurate"}
    sagebwd_hf.reset_attention_stats()
    logits = logits_of(model, "sagebwd", packed)
    assert sagebwd_hf.attention_stats()["paths"] == {"dense": 1}
    sagebwd_hf.configure(model, packed_position_ids=None)     # the default again: packed
    sagebwd_hf.reset_attention_stats()
    split = logits_of(model, "sagebwd", packed)
    assert sagebwd_hf.attention_stats()["paths"] == {"packed": 1}
    assert rel_l2(logits, split) > 0.01     # the later sequences now see the earlier ones
    sagebwd_hf.configure(model, packed_position_ids=False)
    sagebwd_hf.reset_attention_stats()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    compiled_logits = compiled(**packed, use_cache=False).logits.detach().float()
    assert sagebwd_hf.attention_stats()["paths"] == {"dense": 1}
    torch.testing.assert_close(compiled_logits, logits, atol=1e-5, rtol=1e-5)
    with_cu = _packed_inputs([9, 14, 5], flash_kwargs=True)[1]
    sagebwd_hf.reset_attention_stats()
    logits_of(model, "sagebwd", with_cu)
    assert sagebwd_hf.attention_stats()["paths"] == {"cu_seq_lens": 1}


def test_packed_sliding_window_matches_sdpa():
    """Packing and a sliding window together: the window restarts with every sequence."""
    model = tiny_model("mistral")
    _, packed = _packed_inputs([11, 13], flash_kwargs=False)
    assert_close_to_sdpa(model, packed)


# ---------------------------------------------------------------------------------------------------
# Generation with a KV cache
# ---------------------------------------------------------------------------------------------------

def _confident_model(family, steps=40):
    """A tiny model trained (with SDPA, fast) on a fixed bigram table, so that greedy decoding has clear
    winners: a random-init model's top logits are too close for INT8 error not to flip some of them."""
    model = tiny_model(family, impl="sdpa")
    successor = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        ids = [torch.randint(0, VOCAB, (8,), generator=g)]
        for _ in range(23):
            ids.append(successor[ids[-1]])
        ids = torch.stack(ids, 1)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


@pytest.mark.parametrize("family", ["mistral"])   # sliding window 5: decoding runs past it
def test_greedy_generate_with_cache(family):
    """Left-padded batch, prefill then one-token decode steps through the cache. The decode logits match
    SDPA's (teacher-forced, no cache) within the logits bounds, and the greedy tokens agree with SDPA's
    generate() on at least 90% of the first 4 tokens (measured: 100%)."""
    model = _confident_model(family)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :2] = 0
    new = 4
    out = {}
    for impl in ("sdpa", "sagebwd"):
        model.set_attn_implementation(impl)
        sagebwd_hf.reset_attention_stats()
        out[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                   pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    stats = sagebwd_hf.attention_stats()
    assert stats["sagebwd"] == new * model.config.num_hidden_layers and stats["fallback"] == {}, stats
    tokens = {impl: o.sequences[:, ids.shape[1]:] for impl, o in out.items()}
    assert (tokens["sagebwd"] == tokens["sdpa"]).float().mean() >= 0.9
    # the sagebwd run's decode logits against SDPA on the same tokens without a cache
    model.set_attn_implementation("sdpa")
    full_mask = torch.cat([mask, torch.ones(3, new, dtype=mask.dtype)], 1)
    with torch.no_grad():
        ref = model(input_ids=out["sagebwd"].sequences, attention_mask=full_mask, use_cache=False).logits
    scores = torch.stack(out["sagebwd"].scores, 1)
    ref = ref[:, ids.shape[1] - 1:-1]
    assert cos(scores, ref) >= COS_MIN and rel_l2(scores, ref) <= REL_L2_MAX


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_chunked_prefill_and_decode_with_cache(cache):
    """Gemma3 (a sliding and a full layer): prefill in two chunks, then one decode step, through a dynamic
    cache with a left-padding mask, or a static cache with and without one. A static cache hands the
    attention all its slots, written or not, and generate() passes no mask for an unpadded batch. Matches
    SDPA."""
    model = tiny_model("gemma3").eval()
    ids = batch(n=14)["input_ids"]
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    for attention_mask in ((None, mask) if cache == "static" else (mask,)):
        logits = {}
        for impl in ("sdpa", "sagebwd"):
            model.set_attn_implementation(impl)
            kv = (transformers.StaticCache(config=model.config, max_cache_len=20) if cache == "static"
                  else transformers.DynamicCache(config=model.config))
            steps = []
            with torch.inference_mode():      # inference tensors carry no version counter: also fine
                for chunk in (slice(0, 8), slice(8, 14), slice(0, 1)):
                    end = kv.get_seq_length() + chunk.stop - chunk.start
                    kw = {} if attention_mask is None else dict(
                        attention_mask=F.pad(attention_mask, (0, 1), value=1)[:, :end])
                    steps.append(model(input_ids=ids[:, chunk], past_key_values=kv, **kw).logits)
            logits[impl] = torch.cat(steps, 1)[:, 3:]      # row 1's padding left out
        assert rel_l2(logits["sagebwd"], logits["sdpa"]) <= REL_L2_MAX


# ---------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------

def _train(model, impl, inputs, steps, lr=3e-3):
    model.set_attn_implementation(impl)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(**inputs, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_training_loss_falls_and_tracks_sdpa():
    inputs = batch(padding="right")
    sage = _train(tiny_model("qwen3", num_hidden_layers=1, layer_types=["sliding_attention"]), "sagebwd",
                  inputs, steps=3)
    sdpa = _train(tiny_model("qwen3", num_hidden_layers=1, layer_types=["sliding_attention"]), "sdpa",
                  inputs, steps=3)
    assert sage[-1] < 0.9 * sage[0]
    assert all(b < a for a, b in zip(sage, sage[1:])), sage
    assert max(abs(a - b) / b for a, b in zip(sage, sdpa)) < 0.01, (sage, sdpa)


def test_gradient_checkpointing():
    """Recomputation runs the kernel again (twice the calls) and gives the very same gradients."""
    inputs = batch(padding="left")
    grads = []
    for checkpointing in (False, True):
        model = tiny_model("llama", num_hidden_layers=1)
        model.train()
        if checkpointing:
            # activation_checkpointing_enable in 5.23 (gradient_checkpointing_enable is its deprecated alias)
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        sagebwd_hf.reset_attention_stats()
        _, g, _ = run(model, "sagebwd", inputs)
        grads.append(g)
        assert sagebwd_hf.attention_stats()["sagebwd"] == (2 if checkpointing else 1)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def test_peft_lora_model():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", impl="sdpa")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    inputs = batch(padding="left")
    grads = {}
    for impl in ("sdpa", "sagebwd"):
        lora.set_attn_implementation(impl)           # PEFT forwards this to the wrapped model
        assert lora.base_model.model.config._attn_implementation == impl
        lora.zero_grad(set_to_none=True)
        sagebwd_hf.reset_attention_stats()
        lora(**inputs, use_cache=False).loss.backward()
        grads[impl] = torch.cat([p.grad.flatten() for n, p in lora.named_parameters() if p.requires_grad])
        assert sagebwd_hf.attention_stats()["sagebwd"] == (2 if impl == "sagebwd" else 0)
    assert cos(grads["sagebwd"], grads["sdpa"]) >= GRAD_COS_MIN
    assert rel_l2(grads["sagebwd"], grads["sdpa"]) <= GRAD_REL_L2_MAX


def test_float32_inputs_run_in_the_model_dtype():
    """PEFT/autocast hand float32 q/k/v to a bfloat16 model: computed in bfloat16, returned in float32."""
    model = tiny_model("llama").to(torch.bfloat16)
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 10, 16, generator=g)
    k, v = torch.randn(2, 2, 2, 10, 16, generator=g)
    out32, _ = ti.sagebwd_attention_forward(attn, q, k, v, None, scaling=0.25)
    out16, _ = ti.sagebwd_attention_forward(attn, q.bfloat16(), k.bfloat16(), v.bfloat16(), None, scaling=0.25)
    assert out32.dtype == torch.float32 and out16.dtype == torch.bfloat16
    assert torch.equal(out32, out16.float())
    with torch.autocast("cpu", dtype=torch.float16):     # autocast's dtype wins over the weights'
        assert ti._compute_dtype(q, attn) == torch.float16


# ---------------------------------------------------------------------------------------------------
# What the kernel cannot do: SDPA with a one-time warning and a counter, or a clear error
# ---------------------------------------------------------------------------------------------------

@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(ti, "_warned", set())
    sagebwd_hf.reset_attention_stats()


def _assert_fallback(model, inputs, reason, calls):
    """SageBwd's fallback gives SDPA's logits, warns once naming the reason, and counts every call."""
    with pytest.warns(UserWarning, match=r"sagebwd: .*runs through SDPA"):
        logits, _, _ = run(model, "sagebwd", inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no second warning
        run(model, "sagebwd", inputs)
    stats = sagebwd_hf.attention_stats()
    assert stats["fallback"] == {reason: 2 * calls} and stats["sagebwd"] == 0, stats
    ref, _, _ = run(model, "sdpa", inputs)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-4)


def test_fallback_attention_dropout(fresh_warnings):
    model = tiny_model("llama", attention_dropout=0.5).train()
    with pytest.warns(UserWarning, match="attention dropout"):
        run(model, "sagebwd", batch())
    assert sagebwd_hf.attention_stats()["fallback"] == {"dropout": 2}
    model.eval()                                 # no dropout at inference: the kernel runs
    logits_of(model, "sagebwd", batch())
    assert sagebwd_hf.attention_stats()["paths"] == {"dense": 2}


def test_fallback_head_dim(fresh_warnings):
    _assert_fallback(tiny_model("mistral", head_dim=12), batch(padding="left"), "head_dim", calls=2)


def test_fallback_user_4d_mask(fresh_warnings):
    inputs = batch()
    n = inputs["input_ids"].shape[1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril() & ~torch.eye(n, dtype=torch.bool).roll(1, 0)
    inputs["attention_mask"] = allowed[None, None].expand(2, 1, n, n)
    with pytest.warns(UserWarning, match=r"sagebwd: a 4D attention mask that is not a causal, bidirectional or "
                                         r"sliding-window pattern over padded rows \(a mask passed by the user"):
        run(tiny_model("llama"), "sagebwd", inputs)
    ti._warned.clear()
    sagebwd_hf.reset_attention_stats()
    _assert_fallback(tiny_model("llama"), inputs, "mask_4d", calls=2)


def _eager_form(keep):
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("case", ["causal", "causal_window_left_pad", "bidirectional_window", "bidirectional_pad",
                                  "decode_with_cache", "additive"])
def test_4d_masks_of_plain_patterns_are_read_back(case):
    """A 4D mask that is exactly causal / bidirectional / a window over padded rows gives back the kernel's
    arguments (what sdpa_mask and eager_mask hand models that do not declare FlashAttention support)."""
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[0, :4] = False                                              # row 0 left-padded
    causal, window, pad, q_len, kv_len = {
        "causal": (True, (-1, -1), None, 12, 12),
        "causal_window_left_pad": (True, (3, 0), padding, 12, 12),
        "bidirectional_window": (False, (2, 2), None, 12, 12),
        "bidirectional_pad": (False, (-1, -1), padding, 12, 12),
        "decode_with_cache": (True, (-1, -1), padding, 3, 12),
        "additive": (True, (5, 0), None, 12, 12)}[case]
    keep = ti._dense_mask(2, q_len, kv_len, causal, window, pad, None, "cpu")
    mask = _eager_form(keep) if case == "additive" else keep
    got = ti._as_kernel_pattern(mask, 2, q_len, kv_len)
    assert got is not None and got[:2] == (causal, window)
    assert (got[2] is None) == (pad is None) and (pad is None or torch.equal(got[2], pad))


def test_4d_masks_are_read_back_under_inference_mode():
    """Inference tensors have no version counter (the read-back is not cached there), yet a causal 4D mask still
    runs the causal kernel call."""
    attn = tiny_model("llama").model.layers[0].self_attn
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    causal = ti._dense_mask(1, 8, 8, True, (-1, -1), None, None, "cpu")
    with torch.inference_mode():
        got = ti.sagebwd_attention_forward(attn, q, k, v, causal.clone())[0]
        want = ti.sagebwd_attention_forward(attn, q, k, v, None, is_causal=True)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


_IRREGULAR = (torch.ones(24, 24, dtype=torch.bool).tril() & ~torch.eye(24, dtype=torch.bool).roll(1, 0))[None, None]


@pytest.mark.parametrize("case", ["irregular", "bias", "per_head", "window_over_a_hole", "no_key"])
def test_4d_masks_that_are_no_plain_pattern_are_kept(case):
    """Anything else stays a 4D mask (SDPA then): a hole in the causal pattern, an additive bias, heads with
    different patterns, a window over padding in mid-row (the padded path would count distances without the
    hole), a batch whose mask sees nothing."""
    keep = ti._dense_mask(2, 12, 12, True, (3, 0), None, None, "cpu")
    mask = {"irregular": _IRREGULAR[:, :, :12, :12].expand(2, 1, 12, 12),
            "bias": _eager_form(keep) + 0.5 * keep,
            "per_head": torch.cat([keep, ti._dense_mask(2, 12, 12, True, (2, 0), None, None, "cpu")], 1),
            "window_over_a_hole": keep & torch.tensor([True] * 5 + [False] + [True] * 6)[None, None, None, :],
            "no_key": torch.zeros(2, 1, 12, 12, dtype=torch.bool)}[case]
    assert ti._as_kernel_pattern(mask, 2, 12, 12) is None


def test_models_without_flash_support_get_their_own_mask():
    """A model that does not declare FlashAttention support gets the mask its sdpa or eager path gets: BigBird-
    Pegasus' decoder self-attention is built with is_causal=False and is causal only through its mask."""
    from transformers import BigBirdPegasusConfig, BigBirdPegasusForCausalLM, LlamaConfig
    assert ti._declared_support(LlamaConfig) == (True, True)
    assert ti._declared_support(BigBirdPegasusConfig) == (False, False)
    config = BigBirdPegasusConfig(vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=64, attention_type="original_full",
                                  dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = BigBirdPegasusForCausalLM(config)
    assert not model.model.decoder.layers[0].self_attn.is_causal
    inputs = batch()
    eager_logits, _, _ = run(model, "eager", inputs)
    sagebwd_hf.reset_attention_stats()
    logits, _, _ = run(model, "sagebwd", inputs)
    assert sagebwd_hf.attention_stats()["paths"] == {"dense": 1}
    assert rel_l2(logits, eager_logits) <= 0.01, rel_l2(logits, eager_logits)   # bidirectional: ~0.07


def test_mask_overlays_that_make_a_plain_pattern_run_on_the_kernels(fresh_warnings):
    """Gemma3's use_bidirectional_attention overlays or_mask_function (full layers: all keys; sliding layers: a
    window both ways): the mask function hands on the dense mask rather than lose the overlay, as
    flash_attention_mask does, and the attention reads it back as bidirectional, windowed or not."""
    model = tiny_model("gemma3", use_bidirectional_attention=True)
    assert_close_to_sdpa(model, batch())
    assert sagebwd_hf.attention_stats()["paths"] == {"dense": 2}


def test_fallback_mask_pattern_the_kernel_cannot_express(fresh_warnings, monkeypatch):
    """An overlay that makes no plain pattern (here: every query also sees key 0's neighbour 1) runs SDPA."""
    import transformers.models.gemma3.modeling_gemma3 as gemma3
    monkeypatch.setattr(gemma3, "_bidirectional_window_overlay", lambda window: lambda b, h, q, kv: kv == 1)
    _assert_fallback(tiny_model("gemma3", use_bidirectional_attention=True, layer_types=["sliding_attention"] * 2),
                     batch(), "mask_4d", calls=2)


def _llama4(chunk=8):
    from transformers import Llama4TextConfig
    torch.manual_seed(0)
    config = Llama4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=256, attention_chunk_size=chunk, num_local_experts=2,
                              num_experts_per_tok=1, interleave_moe_layer_step=2)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sagebwd")


@pytest.mark.parametrize("chunk", [8, 10], ids=["whole_chunks", "short_last_chunk"])
def test_chunked_attention_runs_chunks_as_sequences(chunk, monkeypatch):
    """Llama 4's chunked layers (query i sees keys of its own chunk, causally): each chunk runs on the kernels as
    a sequence of its own (the pattern the kernel skips, not a dense mask); gradients too. Whole chunks (24 tokens
    in chunks of 8) run as a padded batch of chunks, the same numbers as the packed run; with a shorter last chunk
    (chunks of 10: two whole ones and 4 tokens) the packed run itself."""
    model = _llama4(chunk)
    assert set(model.config.layer_types) == {"chunked_attention"}
    ids = ti.sagebwd_mask(2, 24, 24, mask_function=masking_utils.chunked_causal_mask_function(
        chunk, torch.zeros(2, dtype=torch.long)))
    assert ids.tolist() == [[i // chunk for i in range(24)]] * 2
    assert ti._whole_chunks(ids) == (chunk if 24 % chunk == 0 else None)
    assert_close_to_sdpa(model, batch())
    assert sagebwd_hf.attention_stats()["paths"] == {"chunked": 2}
    logits, grads, _ = run(model, "sagebwd", batch())
    monkeypatch.setattr(ti, "_whole_chunks", lambda ids: None)     # the packed run
    packed, packed_grads, _ = run(model, "sagebwd", batch())
    torch.testing.assert_close(logits, packed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads, packed_grads, atol=1e-5, rtol=1e-4)


def test_chunked_attention_with_padding_falls_back(fresh_warnings):
    """Padding inside chunked attention moves the chunk boundaries per row: the dense mask, through SDPA."""
    _assert_fallback(_llama4(), batch(padding="left"), "mask_4d", 2)


# DeepSeek sparse attention (DSA): an indexer picks each query's top-k keys. Tiny MLA configs (q/k head dim 24,
# v 16), 8 keys kept of up to 24.
DSA_TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=8,
                n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                topk_group=1, max_position_embeddings=256)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_deepseek_sparse_attention_runs_its_selected_keys(model_type, fresh_warnings):
    """The indexer reads the 4D mask (``attention_mask[:, 0]``), and the backend gets the selected keys as
    ``indices`` (which flash_attention_2 ignores: dense attention, silently). sagebwd gives the indexer its
    mask and runs exactly the selected keys (through SDPA), padded rows included."""
    inputs = batch(padding="left")
    logits = {}
    for impl in ("sdpa", "sagebwd"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **DSA_TINY), attn_implementation=impl)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logits[impl] = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(logits["sagebwd"][real], logits["sdpa"][real], atol=1e-5, rtol=1e-4)
    assert sagebwd_hf.attention_stats()["fallback"] == {"sparse_indices": 2}
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **dict(DSA_TINY, index_topk=64)),
                                             attn_implementation="sdpa")
    dense_logits = dense(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    assert (dense_logits[real] - logits["sdpa"][real]).abs().max() > 1e-3, "the selection must matter here"


@pytest.mark.parametrize("padding", [None, "left"])
def test_mla_value_head_dim_runs_on_the_kernels(padding):
    """DeepSeek V3's multi-head latent attention: q/k heads of 24 (16 + 8 rotary), v heads of 16. It ran SDPA
    (a head dim the kernel did not take) before V got a head dim of its own."""
    config = AutoConfig.for_model("deepseek_v3", **{k: v for k, v in DSA_TINY.items() if not k.startswith("index")})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    inputs = batch(padding=padding)
    real = inputs["attention_mask"].bool() if padding else None
    assert_close_to_sdpa(model, inputs, real)
    assert sagebwd_hf.attention_stats()["paths"] == {"padding" if padding else "dense": 2}


def test_bad_calls_raise():
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 16)
    k = v = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="output_attentions"):
        ti.sagebwd_attention_forward(attn, q, k, v, None, output_attentions=True)
    with pytest.raises(ValueError, match="sliding_window"):
        ti.sagebwd_attention_forward(attn, q, k, v, None, sliding_window=0)
    with pytest.raises(ValueError, match="attention_mask"):
        ti.sagebwd_attention_forward(attn, q, k, v, torch.ones(1, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"sinks must have shape \[heads\]"):
        ti.sagebwd_attention_forward(attn, q, k, v, None, s_aux=torch.zeros(2))


def _exact_with_extras(q, k, v, mask, softcap=None, sinks=None, scale=None):
    """Float64 attention with a soft cap and sinks as the models' eager code has them; [B, q, H, Dv]."""
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(2, 3) * (scale or q.shape[-1] ** -0.5)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    top = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(top), top, 0.0))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
    return (p[..., :k.shape[2]] @ v).transpose(1, 2)


def test_softcap_or_sinks_that_need_a_fallback_run_eager(fresh_warnings):
    """SDPA has neither a soft cap nor sinks, so a call that must fall back (dropout, a 4D mask no kernel pattern
    matches) runs them in eager PyTorch attention, counted under its reason, against float64 attention; a row
    that sees no key gives zeros (with a sink too: the sink takes the whole row), not NaN."""
    attn = tiny_model("llama").model.layers[0].self_attn.eval()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 8, 16, generator=gen) * 3
    k, v = (torch.randn(1, 2, 8, 16, generator=gen) for _ in range(2))
    mask = _IRREGULAR[:, :, :8, :8].clone()
    mask[..., 3, :] = False                       # query 3 sees no key
    sinks = torch.randn(4, generator=gen)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    calls = [(dict(dropout=0.1, softcap=5.0), None, causal),   # dropout: eval mode, so none applied
             (dict(s_aux=sinks), mask, mask), (dict(softcap=5.0, s_aux=sinks), mask, mask),
             (dict(softcap=5.0), mask, mask)]
    for kw, given, meant in calls:
        with pytest.warns(UserWarning, match="PyTorch eager attention") if kw is calls[0][0] else nullcontext():
            out = ti.sagebwd_attention_forward(attn, q, k, v, given, **kw)[0]
        want = _exact_with_extras(q, k, v, meant, kw.get("softcap"), kw.get("s_aux"))
        assert torch.isfinite(out).all() and out.shape == want.shape, kw
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{kw}: {m}")
        if given is not None:
            assert out[:, 3].abs().max() == 0, kw
    assert sagebwd_hf.attention_stats()["fallback"] == {"dropout": 1, "mask_4d": 3}
    attn.train()    # in training the fallback applies the dropout it was given
    outs = [ti.sagebwd_attention_forward(attn, q, k, v, None, dropout=0.5, softcap=5.0)[0] for _ in range(2)]
    assert torch.isfinite(outs[0]).all() and not torch.equal(outs[0], outs[1])


def test_sinks_under_their_other_name():
    """``sinks=`` of one logit per head is s_aux; a sink per query (inkling2) is refused, not dropped."""
    attn = tiny_model("llama").model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 16)
    k = v = torch.randn(1, 2, 8, 16)
    sinks = torch.randn(4)
    torch.testing.assert_close(ti.sagebwd_attention_forward(attn, q, k, v, None, sinks=sinks)[0],
                               ti.sagebwd_attention_forward(attn, q, k, v, None, s_aux=sinks)[0], rtol=0, atol=0)
    assert not torch.equal(ti.sagebwd_attention_forward(attn, q, k, v, None, sinks=sinks)[0],
                           ti.sagebwd_attention_forward(attn, q, k, v, None)[0])
    with pytest.raises(ValueError, match=r"sinks of shape \(1, 4, 8, 1\) \(one logit per query\)"):
        ti.sagebwd_attention_forward(attn, q, k, v, None, sinks=torch.zeros(1, 4, 8, 1))


def test_an_unknown_tensor_kwarg_is_named(fresh_warnings):
    attn = tiny_model("llama").model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 16)
    k = v = torch.randn(1, 2, 8, 16)
    with pytest.warns(UserWarning, match="`attention_bias=` \\(a tensor\\), which sagebwd does not read"):
        ti.sagebwd_attention_forward(attn, q, k, v, None, attention_bias=torch.zeros(8, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ti.sagebwd_attention_forward(attn, q, k, v, None, position_ids=torch.arange(8)[None], use_cache=False)
    assert not [w for w in caught if "does not read" in str(w.message)]


def test_trainers_num_items_in_batch_is_accepted_silently(fresh_warnings):
    """Trainer passes ``num_items_in_batch`` (the loss's token count, a tensor) through the model's kwargs to
    every attention call; it changes nothing the attention computes, and no warning names it."""
    model = tiny_model("llama")
    inputs = batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = model(**inputs, num_items_in_batch=torch.tensor(inputs["labels"].numel())).loss
        loss.backward()
    assert torch.isfinite(loss)
    assert not [w for w in caught if "num_items_in_batch" in str(w.message) or "does not read" in str(w.message)]
    assert sagebwd_hf.attention_stats()["sagebwd"] > 0


# Models whose attention SDPA does not compute (soft-capped logits, sinks): compared with their eager path on
# an unpadded batch (eager gives a fully padded query row uniform attention where sdpa/flash/sagebwd give zeros,
# and the next-token loss reads that row's logits).
EAGER_ONLY = {
    "gemma2": dict(model_type="gemma2", attn_logit_softcapping=50.0, final_logit_softcapping=None, sliding_window=8),
    "gemma2_tight_cap": dict(model_type="gemma2", attn_logit_softcapping=2.0, final_logit_softcapping=None,
                             sliding_window=8, initializer_range=0.2),   # scores of several units: the cap bends
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]),
}


@pytest.mark.parametrize("family", list(EAGER_ONLY))
def test_softcap_and_sinks_models_match_eager(family):
    """Gemma 2's capped logits and gpt-oss's sinks run on the kernels (no fallback), close to eager."""
    kwargs = dict(TINY, **EAGER_ONLY[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kwargs.pop("model_type"), **kwargs),
                                             attn_implementation="eager")
    for name, param in model.named_parameters():
        if name.endswith("sinks"):          # initialised to zeros: make them matter
            torch.nn.init.normal_(param, std=2.0)
    inputs = batch()
    eager_logits, eager_grads, _ = run(model, "eager", inputs)
    sagebwd_hf.reset_attention_stats()
    logits, grads, _ = run(model, "sagebwd", inputs)
    stats = sagebwd_hf.attention_stats()
    assert stats["fallback"] == {} and stats["sagebwd"] == 2, stats
    assert cos(logits, eager_logits) >= COS_MIN and rel_l2(logits, eager_logits) <= REL_L2_MAX
    assert cos(grads, eager_grads) >= GRAD_COS_MIN and rel_l2(grads, eager_grads) <= GRAD_REL_L2_MAX
    if family == "gpt_oss":
        sinks = model.model.layers[0].self_attn.sinks
        assert sinks.grad is not None and sinks.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------
# torch.compile: no graph break anywhere (fullgraph=True), the same numbers as eager
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_compile_fullgraph(kind):
    """Padding (a mask from the tokenizer) and packing by position_ids are decided in-graph."""
    model = tiny_model("mistral", num_hidden_layers=1)
    model.set_attn_implementation("sagebwd")
    if kind == "padded":
        inputs = batch(padding="left")
        real = inputs["attention_mask"].bool()
    else:
        _, inputs = _packed_inputs([9, 15], flash_kwargs=False)
        real = torch.ones_like(inputs["input_ids"], dtype=torch.bool)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)   # a graph break raises
    results = []
    for fn in (compiled, model):
        model.zero_grad(set_to_none=True)
        sagebwd_hf.reset_attention_stats()
        out = fn(**inputs, use_cache=False)
        out.loss.backward()
        results.append((out.logits.detach()[real], torch.cat([p.grad.flatten() for p in model.parameters()]),
                        sagebwd_hf.attention_stats()))
    (logits_c, grads_c, stats_c), (logits_e, grads_e, stats_e) = results
    assert stats_c["sagebwd"] == stats_e["sagebwd"] == 1 and stats_c["fallback"] == {}
    torch.testing.assert_close(logits_c, logits_e, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads_c, grads_e, atol=1e-5, rtol=1e-4)


def test_compiled_model_compiles_once_and_counts(monkeypatch):
    """Calls of a compiled model reuse its one graph: attention_stats() and the one-time warnings stay out of it
    (counted and warned while dynamo traces, once per compilation). A count updated inside the graph made dynamo
    guard on its value, so every call recompiled, and past dynamo's recompile limit the model ran eager."""
    model = tiny_model("llama", num_hidden_layers=2)
    inputs = batch()
    monkeypatch.setattr(ti, "_warned", set())
    for dropout in (0.0, 0.5):   # dropout in training: every call falls back to SDPA, with one warning
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = dropout
        torch._dynamo.reset()
        sagebwd_hf.reset_attention_stats()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        with torch._dynamo.config.patch(error_on_recompile=True), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(3):
                compiled(**inputs, use_cache=False).loss.backward()
        stats = sagebwd_hf.attention_stats()
        fallback_warnings = [w for w in seen if "instead" in str(w.message)]
        if dropout:
            assert stats["sagebwd"] == 0 and stats["fallback"] == {"dropout": 2}
            assert len(fallback_warnings) == 1 and "dropout" in str(fallback_warnings[0].message)
        else:
            assert stats["sagebwd"] == 2 and stats["fallback"] == {} and not fallback_warnings
    sagebwd_hf.reset_attention_stats()
    model(**inputs, use_cache=False)        # eager: every call counts
    model(**inputs, use_cache=False)
    assert sagebwd_hf.attention_stats()["fallback"] == {"dropout": 4}



# ---------------------------------------------------------------------------------------------------
# CUDA, bfloat16 (python -m pytest -m gpu). Bounds: 2-3x what the same models give in bfloat16 with the
# kernels under the CPU interpreter (logits rel L2 <= 0.014, gradients <= 0.021; bf16 SDPA itself is
# 0.010 / 0.014 away from fp32 SDPA there).
# ---------------------------------------------------------------------------------------------------

GPU_SIZE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64,
                max_position_embeddings=2048)
GPU_WINDOWS = {"qwen2": dict(sliding_window=96), "qwen3": dict(sliding_window=80),
               "mistral": dict(sliding_window=64), "gemma3": dict(sliding_window=64, query_pre_attn_scalar=256)}
GPU_BOUNDS = (0.999, 0.04, 0.998, 0.06)


def gpu_model(family, impl="sagebwd", **overrides):
    return tiny_model(family, impl, device="cuda", dtype=torch.bfloat16,
                      **dict(GPU_SIZE, **GPU_WINDOWS.get(family, {}), **overrides))


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_gpu_causal_lm_matches_sdpa(family, padding):
    inputs = batch(b=4, n=512, padding=padding, pad=100, device="cuda")
    real = inputs["attention_mask"].bool() if padding else None
    assert_close_to_sdpa(gpu_model(family), inputs, real, bounds=GPU_BOUNDS)


@pytest.mark.gpu
@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_gpu_packing_matches_sdpa_and_separate_sequences(flash_kwargs):
    model = gpu_model("mistral")
    seqs, packed = _packed_inputs([300, 77, 512, 1], flash_kwargs)
    packed = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in packed.items()}
    packed_logits, _ = assert_close_to_sdpa(model, packed, bounds=GPU_BOUNDS)
    start = 0
    for seq in seqs:
        alone, _, _ = run(model, "sagebwd", dict(input_ids=seq[None].cuda(), labels=seq[None].cuda()))
        # the same sequence through other kernel launches: bf16 matmuls of other shapes, same INT8 math
        assert rel_l2(packed_logits[0, start:start + len(seq)], alone[0]) <= 0.02
        start += len(seq)


@pytest.mark.gpu
def test_gpu_greedy_generate():
    model = _confident_model("llama").to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (8, 40), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    mask[5, :3] = 0
    out = {}
    for impl in ("sdpa", "sagebwd"):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                                   pad_token_id=0)[:, ids.shape[1]:]
    assert (out["sagebwd"] == out["sdpa"]).float().mean() >= 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "padded", "packed"])
def test_gpu_compile_inductor(kind):
    """torch.compile with the default backend (inductor), fullgraph, a training step: the same logits and
    gradients as eager (padding and packing run inside the segmented custom op, which inductor calls as is)."""
    model = gpu_model("qwen3")
    if kind == "packed":
        _, inputs = _packed_inputs([100, 156, 60, 196], flash_kwargs=False)
        inputs = {k: v.view(2, -1).cuda() for k, v in inputs.items()}
        real = torch.ones_like(inputs["input_ids"], dtype=torch.bool)
    else:
        inputs = batch(b=4, n=256, padding="left" if kind == "padded" else None, pad=50, device="cuda")
        real = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
    dense = batch(b=4, n=256, device="cuda")
    gaps = {}
    # SDPA's own compiled-vs-eager gap, on the unpadded batch (SDPA's packing detection differs in-graph)
    for impl, impl_inputs, impl_real in (("sdpa", dense, None), ("sagebwd", inputs, real)):
        model.set_attn_implementation(impl)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        results = []
        for fn in (compiled, model):
            model.zero_grad(set_to_none=True)
            sagebwd_hf.reset_attention_stats()
            out = fn(**impl_inputs, use_cache=False)
            out.loss.backward()
            logits = out.logits.detach().float()
            results.append((logits[impl_real] if impl_real is not None else logits,
                            torch.cat([p.grad.flatten().float() for p in model.parameters()]),
                            sagebwd_hf.attention_stats()))
        (logits_c, grads_c, stats_c), (logits_e, grads_e, stats_e) = results
        gaps[impl] = (rel_l2(logits_c, logits_e), rel_l2(grads_c, grads_e))
    assert stats_c["fallback"] == stats_e["fallback"] == {}
    assert stats_c["sagebwd"] == stats_e["sagebwd"] == model.config.num_hidden_layers
    # A bf16 model: inductor keeps fused intermediates (norms, RoPE) in fp32 where eager rounds every op to
    # bf16, so compiled and eager differ for SDPA too. SageBwd's gap (logits 1.3% seen on an H200) must stay
    # of SDPA's size.
    for i, what in enumerate(("logits", "gradients")):
        assert gaps["sagebwd"][i] <= 2 * gaps["sdpa"][i] + 0.005, (what, gaps)


@pytest.mark.gpu
def test_gpu_llama_1b_shape_training_tracks_sdpa():
    """Llama-3.2-1B attention shapes (hidden 2048, 32 heads / 8 KV heads, head dim 64), 4 of its 16 layers,
    random init; fp32 weights under bf16 autocast, AdamW. SageBwd's losses track SDPA's step by step and the
    first step's gradients agree."""
    config = AutoConfig.for_model("llama", vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                                  num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                                  head_dim=64, max_position_embeddings=4096, rope_theta=500000.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (2, 1024), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1, :200] = 0
    inputs = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    losses, first_grads = {}, {}
    for impl in ("sdpa", "sagebwd"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        losses[impl] = []
        for step in range(5):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**inputs, use_cache=False).loss
            loss.backward()
            if step == 0:
                first_grads[impl] = torch.cat([p.grad.flatten() for p in model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[impl].append(float(loss.detach()))
        del model, opt
    assert losses["sagebwd"][-1] < losses["sagebwd"][0]
    # the model memorises the batch (loss 10.8 -> 0.1 in 5 steps on an H200): bound the gap by the start loss
    assert max(abs(a - b) for a, b in zip(losses["sagebwd"], losses["sdpa"])) < 0.01 * losses["sdpa"][0], losses
    assert cos(first_grads["sagebwd"], first_grads["sdpa"]) >= 0.99
    assert rel_l2(first_grads["sagebwd"], first_grads["sdpa"]) <= 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("encoder", ["bert", "modernbert"])
def test_gpu_bidirectional_encoder_matches_sdpa(encoder):
    _check_encoder(encoder, "cuda", torch.bfloat16, n=512, pad=256, bounds=GPU_BOUNDS)
