"""SageBwd's options (sagebwd_hf.config): defaults, precedence global < model < layer, persistence through
config.json, validation; and what the smoothing switches do to the op's quantization error."""
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import sagebwd_hf
from sagebwd_hf import SageBwdOptions, configure, get_options, options_for, sagebwd_attn_func
from sagebwd_hf import transformers_integration as ti
from sagebwd_hf.testing import compare, exact_reference, make_qkv, run_with_grads

pytestmark = pytest.mark.filterwarnings("ignore:sagebwd. float32 attention inputs:UserWarning",
                                        "ignore:divide by zero:RuntimeWarning",
                                        "ignore:.*is_gradient_checkpointing.*:FutureWarning")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, max_position_embeddings=64)


@pytest.fixture(autouse=True)
def _fresh_globals():
    sagebwd_hf.reset_global_options()
    yield
    sagebwd_hf.reset_global_options()


def tiny_model(impl="sdpa", **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **dict(TINY, **overrides)),
                                            attn_implementation=impl)


def attn(model, layer):
    return model.model.layers[layer].self_attn


def resolved(model):
    return [(options_for(attn(model, i)).k_smoothing, options_for(attn(model, i)).q_smoothing)
            for i in range(model.config.num_hidden_layers)]


def test_defaults():
    assert SageBwdOptions() == SageBwdOptions(k_smoothing=True, q_smoothing=False)
    assert SageBwdOptions().op_kwargs() == {"k_smoothing": True, "q_smoothing": False, "precision": "accurate"}
    # every option the op takes goes to it; the rest are the attention backend's
    import inspect
    from sagebwd_hf import sagebwd_attn_func
    from sagebwd_hf.config import OP_KEYS, OPTION_KEYS
    assert set(OP_KEYS) == set(OPTION_KEYS) & set(inspect.signature(sagebwd_attn_func).parameters)
    model = tiny_model()
    assert resolved(model) == [(True, False)] * 3
    assert get_options(model) == get_options(model, layer=2) == SageBwdOptions()
    assert not hasattr(model.config, "sagebwd")              # nothing stored until something is set
    assert options_for(torch.nn.Linear(2, 2)) == SageBwdOptions()   # no config, no layer_idx: the globals


def test_precedence_layer_over_model_over_global():
    model = tiny_model()
    sagebwd_hf.set_global_options(q_smoothing=True)
    assert resolved(model) == [(True, True)] * 3
    configure(model, q_smoothing=False)                           # model beats global
    assert resolved(model) == [(True, False)] * 3
    configure(model, layers=[0, 2], q_smoothing=True)             # layer beats model
    configure(model, layers=1, k_smoothing=False)
    assert resolved(model) == [(True, True), (False, False), (True, True)]
    assert model.config.sagebwd == {"q_smoothing": False,
                                    "layers": {"0": {"q_smoothing": True}, "1": {"k_smoothing": False},
                                               "2": {"q_smoothing": True}}}
    sagebwd_hf.set_global_options(k_smoothing=False)              # global only fills what nothing else sets
    assert resolved(model) == [(False, True), (False, False), (False, True)]
    sagebwd_hf.reset_global_options()
    configure(model, q_smoothing=None)                            # None: remove, fall back to the global
    sagebwd_hf.set_global_options(q_smoothing=True)
    assert resolved(model) == [(True, True), (False, True), (True, True)]
    configure(model, layers=[0, 1, 2], q_smoothing=None, k_smoothing=None)
    assert "layers" not in model.config.sagebwd and resolved(model) == [(True, True)] * 3
    assert get_options(model, layer=1) == SageBwdOptions(k_smoothing=True, q_smoothing=True)
    sagebwd_hf.clear_options(model)
    assert not hasattr(model.config, "sagebwd")


def test_saved_with_the_model(tmp_path):
    model = tiny_model()
    configure(model, q_smoothing=True)
    configure(model, layers=2, k_smoothing=False, q_smoothing=False)
    before = resolved(model)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["sagebwd"] == {
        "q_smoothing": True, "layers": {"2": {"k_smoothing": False, "q_smoothing": False}}}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert loaded.config.sagebwd == model.config.sagebwd
    assert resolved(loaded) == before == [(True, True), (True, True), (False, False)]
    sagebwd_hf.set_global_options(q_smoothing=False, k_smoothing=False)   # saved settings beat globals
    assert resolved(loaded)[2] == (False, False) and resolved(loaded)[0] == (False, True)


def test_peft_model_shares_the_config():
    from peft import LoraConfig, get_peft_model
    model = tiny_model()
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    configure(peft_model, layers=0, k_smoothing=False)
    assert resolved(model)[0] == (False, False) and get_options(peft_model, 0).k_smoothing is False


@pytest.mark.parametrize("call, message", [
    (lambda m: configure(m, k_smooth=True), "unknown SageBwd option 'k_smooth'; allowed options: k_smoothing, "
                                            "q_smoothing"),
    (lambda m: configure(m, k_smoothing="yes"), "'k_smoothing' must be True or False, got 'yes'"),
    (lambda m: configure(m, q_smoothing=1), "'q_smoothing' must be True or False, got 1"),
    (lambda m: configure(m, layers=3, q_smoothing=True), "layer index 3 is out of range: the model has 3 layers"),
    (lambda m: configure(m, layers=-1, q_smoothing=True), "layer index must be an int >= 0, got -1"),
    (lambda m: configure(m, layers=["a"], q_smoothing=True), "layer index must be an int >= 0, got 'a'"),
    (lambda m: get_options(m, layer=7), "layer index 7 is out of range"),
    (lambda m: sagebwd_hf.set_global_options(qsmoothing=True), "unknown SageBwd option 'qsmoothing'"),
    (lambda m: sagebwd_hf.set_global_options(k_smoothing=0), "'k_smoothing' must be True or False, got 0"),
    (lambda m: SageBwdOptions(q_smoothing="false"), "'q_smoothing' must be True or False, got 'false'"),
])
def test_validation_errors_name_key_and_allowed_values(call, message):
    model = tiny_model()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(model)
    assert not hasattr(model.config, "sagebwd")                # a failed call writes nothing
    assert sagebwd_hf.get_global_options() == SageBwdOptions()


def test_hand_edited_config_is_validated_when_read():
    model = tiny_model()
    model.config.sagebwd = {"k_smoothing": "true"}
    with pytest.raises(ValueError, match=r"config.sagebwd: SageBwd option 'k_smoothing' must be True or False"):
        options_for(attn(model, 0))
    model.config.sagebwd = {"layers": {"1": {"q_smoothin": True}}}
    with pytest.raises(ValueError, match=r"config.sagebwd\['layers'\]\['1'\]: unknown SageBwd option 'q_smoothin'"):
        options_for(attn(model, 1))
    model.config.sagebwd = {"layers": [True]}
    with pytest.raises(ValueError, match=r"config.sagebwd\['layers'\] must be a dict"):
        get_options(model)


# ---------------------------------------------------------------------------------------------------
# What the switches do: quantization error against exact attention, on inputs with outliers
# ---------------------------------------------------------------------------------------------------

CAUSAL = (-1, 0)   # exact_reference's window for causal attention


def errors(q, k, v, do, reference, options: SageBwdOptions):
    result = run_with_grads(lambda a, b, c: sagebwd_attn_func(a, b, c, causal=True, **options.op_kwargs()),
                            q, k, v, do)
    return {name: rel for name, (_, rel) in compare(result, reference).items()}


def test_smoothing_is_exact_for_attention():
    """Subtracting the mean key changes neither exact attention nor its gradients: the switches only move the
    quantization error."""
    q, k, v, do = make_qkv(1, 2, 1, 96, 96, 64, torch.float16, "cpu", k_outliers=10.0, seed=0)
    ref = exact_reference(q, k, v, do, window_size=CAUSAL)
    k64 = k.double()
    smoothed = exact_reference(q, k64 - k64.mean(2, keepdim=True), v, do, window_size=CAUSAL)
    for name in ref:
        torch.testing.assert_close(smoothed[name], ref[name], rtol=0, atol=1e-12)


def test_k_smoothing_lowers_the_error_on_k_outliers():
    # Measured: rel L2 with K-smoothing O .015, dQ .018, dK .017, dV .016; without .028, .074, .027, .028
    q, k, v, do = make_qkv(1, 2, 1, 128, 128, 64, torch.float16, "cpu", k_outliers=10.0, seed=0)
    ref = exact_reference(q, k, v, do, window_size=CAUSAL)
    on = errors(q, k, v, do, ref, SageBwdOptions(k_smoothing=True))
    off = errors(q, k, v, do, ref, SageBwdOptions(k_smoothing=False))
    for name in ("O", "dQ", "dK", "dV"):
        assert on[name] < 0.75 * off[name], (name, on, off)
        assert on[name] < 0.03, (name, on)
    assert off["dQ"] > 2 * on["dQ"]


def test_q_smoothing_changes_the_error_on_q_outliers():
    # Q with a per-channel offset as make_qkv gives K. Measured: rel L2 of O .0176 off, .0150 on.
    q, k, v, do = make_qkv(1, 2, 1, 128, 128, 64, torch.float16, "cpu", k_outliers=10.0, seed=0)
    q_offset = make_qkv(1, 1, 1, 1, 128, 64, torch.float32, "cpu", k_outliers=10.0, seed=1)[1].mean((0, 1, 2))
    q = (q.float() + q_offset).half()
    ref = exact_reference(q, k, v, do, window_size=CAUSAL)
    off = errors(q, k, v, do, ref, SageBwdOptions(q_smoothing=False))
    on = errors(q, k, v, do, ref, SageBwdOptions(q_smoothing=True))
    assert on["O"] < 0.95 * off["O"] and on["dV"] < 0.95 * off["dV"], (on, off)
    assert all(on[name] < 0.05 for name in on), on


# ---------------------------------------------------------------------------------------------------
# The attention backend honours the per-layer options (once it reads them: see README)
# ---------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(ti, "options_for"),
                    reason="the 'sagebwd' attention backend does not read sagebwd_hf.config.options_for yet")
def test_backend_passes_per_layer_options(monkeypatch):
    seen = []
    real = ti.sagebwd_attn_func

    def spy(*args, **kwargs):
        seen.append((kwargs.get("k_smoothing", True), kwargs.get("q_smoothing", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(ti, "sagebwd_attn_func", spy)
    model = tiny_model("sagebwd", num_hidden_layers=2)
    configure(model, q_smoothing=True)
    configure(model, layers=1, k_smoothing=False, q_smoothing=False)
    model(input_ids=torch.randint(0, 128, (1, 16)), use_cache=False)
    assert seen == [(True, True), (False, False)]
