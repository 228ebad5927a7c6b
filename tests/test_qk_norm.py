"""add_qk_norm: Qwen3's QK-norm on models without one (placement and arithmetic against a hand-written
reference and against Qwen3 itself), PEFT in both orders, save/reload bit-exact, the training check, and a
short pre-training run under attn_implementation="sagebwd"."""
import copy
import logging
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import sagebwd_hf
from sagebwd_hf import (QK_NORM_TOKENS_THRESHOLD, add_qk_norm, check_training_setup, has_qk_norm,
                        load_with_qk_norm, qk_norm_parameters)
from sagebwd_hf.qk_norm import QKRMSNorm, _ProjectionNorm

pytestmark = pytest.mark.filterwarnings("ignore:sagebwd. float32 attention inputs:UserWarning",
                                        "ignore:.*is_gradient_checkpointing.*:FutureWarning",
                                        "ignore:divide by zero:RuntimeWarning")

VOCAB = 128
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5)


def tiny_model(model_type="llama", impl="sdpa", seed=0, **overrides):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **dict(TINY, **overrides))
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl)


def qwen3_twin(state_dict):
    """Qwen3 with the same sizes: Llama's architecture plus q_norm/k_norm, under the same state-dict names."""
    twin = tiny_model("qwen3")
    twin.load_state_dict(state_dict, strict=True)
    return twin.eval()


def random_gains(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in qk_norm_parameters(model):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def ids(b=2, n=16, seed=2):
    return torch.randint(0, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


def hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# ---------------------------------------------------------------------------------------------------
# Placement and arithmetic
# ---------------------------------------------------------------------------------------------------

def test_post_norm_q_k_match_hand_written_rmsnorm():
    """q_proj/k_proj outputs become Qwen3's q_norm(q_proj(h).view(..., -1, head_dim)): RMSNorm over the head dim
    in float32, times the gain, eps from config.rms_norm_eps."""
    model = add_qk_norm(tiny_model())
    random_gains(model)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_norm, QKRMSNorm) and attn.q_norm.variance_epsilon == 1e-5
    h = torch.randn(2, 5, TINY["hidden_size"])
    for proj, norm in ((attn.q_proj, attn.q_norm), (attn.k_proj, attn.k_norm)):
        raw = torch.nn.functional.linear(h, proj.weight).view(2, 5, -1, 16).double()
        expected = raw / torch.sqrt(raw.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
        torch.testing.assert_close(proj(h).double(), expected.view(2, 5, -1), rtol=1e-6, atol=1e-6)


def test_same_model_as_qwen3():
    """Llama + add_qk_norm is Qwen3 (same sizes, norms before RoPE): identical logits with the same weights."""
    model = add_qk_norm(tiny_model()).eval()
    random_gains(model)
    assert torch.equal(model(ids()).logits, qwen3_twin(model.state_dict())(ids()).logits)
    without = tiny_model().eval()
    assert not torch.allclose(without(ids()).logits, model(ids()).logits, atol=1e-3)   # the norms do something


def test_defaults_state_dict_and_training():
    model = add_qk_norm(tiny_model(rms_norm_eps=1e-6))
    names = [n for n, _ in model.named_parameters() if "_norm" in n and "self_attn" in n]
    assert names == [f"model.layers.{i}.self_attn.{w}_norm.weight" for i in range(2) for w in "qk"]
    assert all(torch.equal(p, torch.ones(16)) and p.requires_grad for p in qk_norm_parameters(model))
    assert model.model.layers[1].self_attn.k_norm.variance_epsilon == 1e-6
    assert model.config.sagebwd_qk_norm == {"eps": 1e-6} and has_qk_norm(model)
    model(input_ids=ids(), labels=ids()).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in qk_norm_parameters(model))
    frozen = add_qk_norm(tiny_model(), eps=1e-3, trainable=False)
    assert all(not p.requires_grad for p in qk_norm_parameters(frozen))
    assert frozen.model.layers[0].self_attn.q_norm.variance_epsilon == 1e-3


def test_idempotent():
    model = add_qk_norm(tiny_model()).eval()
    random_gains(model)
    state, hooks, logits = copy.deepcopy(model.state_dict()), hook_count(model), model(ids()).logits
    add_qk_norm(model, eps=0.5, trainable=False)
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    assert hook_count(model) == hooks == 3 * 2          # per layer: q_proj, k_proj hooks and one pre-hook
    assert model.model.layers[0].self_attn.q_norm.variance_epsilon == 1e-5
    assert all(p.requires_grad for p in qk_norm_parameters(model))
    assert torch.equal(model(ids()).logits, logits)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "olmo2"])
def test_models_with_their_own_qk_norm_are_left_alone(model_type, caplog):
    model = tiny_model(model_type)
    state, hooks = copy.deepcopy(model.state_dict()), hook_count(model)
    with caplog.at_level(logging.WARNING, logger="sagebwd_hf.qk_norm"):
        assert add_qk_norm(model) is model
    assert "already has QK-norm" in caplog.text and "left unchanged" in caplog.text
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    assert hook_count(model) == hooks and not hasattr(model.config, "sagebwd_qk_norm")
    assert has_qk_norm(model)


def test_unsupported_model_raises():
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt2", vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=32))   # fused c_attn
    with pytest.raises(ValueError, match="no attention module with q_proj, k_proj and head_dim"):
        add_qk_norm(model)


# ---------------------------------------------------------------------------------------------------
# PEFT: the norm sees the full LoRA output, whichever was applied first
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["qk_norm_then_peft", "peft_then_qk_norm"])
def test_peft_both_orders(order):
    from peft import LoraConfig, get_peft_model
    model = tiny_model()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"], init_lora_weights=False)
    if order == "qk_norm_then_peft":
        add_qk_norm(model)
        random_gains(model)
        peft_model = get_peft_model(model, lora)
    else:
        peft_model = get_peft_model(model, lora)
        add_qk_norm(peft_model)
        random_gains(peft_model)
    peft_model.eval()
    out = peft_model(ids()).logits
    # Reference: Qwen3 with the LoRA deltas merged into q_proj/k_proj (PEFT's own merge), so its q_norm sees
    # base + delta by construction.
    merged_state = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    torch.testing.assert_close(out, qwen3_twin(merged_state)(ids()).logits, rtol=0, atol=2e-5)
    base_state = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                  for k, v in peft_model.state_dict().items() if "lora_" not in k}
    assert (out - qwen3_twin(base_state)(ids()).logits).abs().max() > 1e-2     # the LoRA deltas matter
    # Frozen by PEFT when added first; kept trainable when added after.
    assert all(p.requires_grad == (order == "peft_then_qk_norm") for p in qk_norm_parameters(peft_model))
    for layer in peft_model.base_model.model.model.layers:    # one norm hook on the LoRA wrapper itself
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj):
            assert sum(isinstance(h, _ProjectionNorm) for h in proj._forward_hooks.values()) == 1


def test_peft_trains_norms_saved_with_the_adapter(tmp_path):
    """Norms added before get_peft_model train when listed in modules_to_save, and reload bit-exact."""
    from peft import LoraConfig, PeftModel, get_peft_model
    model = add_qk_norm(tiny_model())
    model.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj"],
                                                  modules_to_save=["q_norm", "k_norm"]))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad and "_norm" in n]
    assert len(trainable) == 4 and all("modules_to_save" in n for n in trainable)
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        peft_model(input_ids=ids(), labels=ids()).loss.backward()
        opt.step()
        opt.zero_grad()
    trained = peft_model.base_model.model.model.layers[0].self_attn.q_norm.modules_to_save["default"].weight
    assert not torch.equal(trained, torch.ones_like(trained))
    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(load_with_qk_norm(tmp_path / "base", attn_implementation="sdpa"),
                                         tmp_path / "adapter")
    peft_model.eval()
    reloaded.eval()
    assert torch.equal(peft_model(ids()).logits, reloaded(ids()).logits)


# ---------------------------------------------------------------------------------------------------
# Save and reload
# ---------------------------------------------------------------------------------------------------

def test_save_and_reload_bit_exact(tmp_path, caplog):
    model = add_qk_norm(tiny_model()).eval()
    random_gains(model)
    model.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="sagebwd_hf.qk_norm"):
        loaded = load_with_qk_norm(tmp_path, attn_implementation="sdpa").eval()
    assert caplog.text == ""
    assert type(loaded) is type(model) and has_qk_norm(loaded)
    state, loaded_state = model.state_dict(), loaded.state_dict()
    assert loaded_state.keys() == state.keys() and all(torch.equal(loaded_state[k], state[k]) for k in state)
    assert torch.equal(loaded(ids()).logits, model(ids()).logits)
    assert loaded.config.sagebwd_qk_norm == {"eps": 1e-5}
    assert check_training_setup(loaded, 2 * QK_NORM_TOKENS_THRESHOLD, warn=False) == []
    # in another dtype, as from_pretrained
    half = load_with_qk_norm(tmp_path, dtype=torch.bfloat16)
    gain = model.model.layers[1].self_attn.k_norm.weight
    assert torch.equal(half.model.layers[1].self_attn.k_norm.weight, gain.bfloat16())
    # a plain from_pretrained drops the gains: the check says so
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not has_qk_norm(plain)
    assert [f.code for f in check_training_setup(plain, 1000, warn=False)] == ["qk_norm_not_loaded"]
    # a checkpoint without the record loads plainly
    tiny_model().save_pretrained(tmp_path / "plain")
    assert not has_qk_norm(load_with_qk_norm(tmp_path / "plain"))


# ---------------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------------

def test_check_training_setup():
    assert 262_144 <= QK_NORM_TOKENS_THRESHOLD < 2_100_000
    model = tiny_model()
    assert check_training_setup(model, 262_144) == []                     # the paper's fine setting
    with pytest.warns(UserWarning, match="2,097,152 tokens per optimizer step with 2 of 2 attention modules"):
        findings = check_training_setup(model, 2_097_152)
    assert [f.code for f in findings] == ["qk_norm_missing"]
    assert check_training_setup(add_qk_norm(tiny_model()), 2_097_152) == []
    assert check_training_setup(tiny_model("qwen3"), 2_097_152) == []     # its own QK-norm
    sagebwd_hf.configure(model, layers=1, k_smoothing=False)
    with pytest.warns(UserWarning, match=r"K-smoothing is off for layers \[1\]"):
        findings = check_training_setup(model, 1024)
    assert [f.code for f in findings] == ["k_smoothing_off"]
    assert {f.code for f in check_training_setup(model, 10 ** 7, warn=False)} == {"k_smoothing_off",
                                                                                  "qk_norm_missing"}
    with pytest.raises(ValueError, match="tokens_per_step must be a positive int"):
        check_training_setup(model, 0)


# ---------------------------------------------------------------------------------------------------
# Pre-training under attn_implementation="sagebwd" (CPU: the Triton kernels under the interpreter)
# ---------------------------------------------------------------------------------------------------

def test_short_pretraining_run_with_sagebwd():
    model = add_qk_norm(tiny_model("llama", impl="sagebwd", num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=32))
    tokens = ids(b=1, n=32)
    assert check_training_setup(model, tokens.numel(), warn=False) == []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sagebwd_hf.reset_attention_stats()
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    stats = sagebwd_hf.attention_stats()
    assert stats["sagebwd"] == 5 * 2 and stats["fallback"] == {}, stats
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.85 * losses[0], losses
    assert all(not torch.equal(p, torch.ones_like(p)) for p in qk_norm_parameters(model))   # the gains train
