"""The examples' models: the pre-training size presets (Llama or Qwen3 shapes), loading a base model to fine-tune,
the offline demo base model, LoRA, activation checkpointing, and the one line an example prints when SageBwd
computes a float32 model's attention in bfloat16.

Without ``--model_name_or_path`` the fine-tuning examples make their own demo base model, a tiny Llama pre-trained
with SDPA on the first half of the documents and cached, since nothing can be downloaded on an offline machine."""
import hashlib
import json
import math
import warnings

import torch

from .arguments import check_fits_positions
from .data import build_lm_dataset, load_raw_datasets, load_tokenizer, tokenize_documents
from .files import atomic_save_dir, cache_dir
from .training import adamw

# Shapes of the pre-training presets. vocab_size comes from the tokenizer. head_dim 32 keeps the CPU default
# fast; 64 is one of SageBwd's tuned head dims.
MODEL_PRESETS = {
    # ~1M parameters: the CPU default, a few hundred steps in a couple of minutes on 2 cores.
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    # ~56M parameters with the embedded 2K vocabulary (55M outside the embeddings): the GPU proof at seq 1024.
    "60m": dict(hidden_size=640, intermediate_size=1728, num_hidden_layers=12, num_attention_heads=10,
                num_key_value_heads=5, head_dim=64),
    # Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 query / 8 KV heads of 64, MLP 8192, RoPE theta 500K).
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, rope_theta=500000.0),
}
MODEL_TYPES = ("llama", "qwen3")


def preset_config(model_type, size, tokenizer, seq_len):
    """A Llama or Qwen3 config of one of MODEL_PRESETS' shapes, sized for ``tokenizer``."""
    from transformers import AutoConfig

    if model_type not in MODEL_TYPES:
        raise ValueError(f"--model_type must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}")
    if size not in MODEL_PRESETS:
        raise ValueError(f"--size must be one of {', '.join(MODEL_PRESETS)}, got {size!r}")
    shape = dict(MODEL_PRESETS[size])
    rope_theta = shape.pop("rope_theta", 10000.0)
    # Round the vocabulary up to a multiple of 64: tensor-core friendly, and room for a few added tokens.
    vocab_size = int(math.ceil(len(tokenizer) / 64) * 64)
    kwargs = dict(vocab_size=vocab_size, max_position_embeddings=max(seq_len, 2048), tie_word_embeddings=True,
                  rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, use_cache=False, **shape)
    config = AutoConfig.for_model(model_type, **kwargs)
    # Transformers 5 keeps RoPE settings in rope_parameters (rope_theta before it).
    if hasattr(config, "rope_parameters") and isinstance(getattr(config, "rope_parameters"), dict):
        config.rope_parameters["rope_theta"] = rope_theta
    else:
        config.rope_theta = rope_theta
    return config


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def finetune_documents(args, process):
    """The fine-tuning scripts' data: (tokenizer, tokenized documents, base model path). Without
    ``--model_name_or_path`` the demo base model learns from the first half of the documents and the
    fine-tuning from the second (one cache entry for every fine-tuning script). Call it under
    ``main_process_first``; ``process`` is the Accelerator or PartialState."""
    tokenizer = load_tokenizer(args.tokenizer_name or args.model_name_or_path)
    raw = load_raw_datasets(args)
    tokenized = tokenize_documents(raw, tokenizer, args.text_column)
    model_path = args.model_name_or_path
    if model_path is None:
        half = len(tokenized["train"]) // 2
        base_docs = tokenized["train"].select(range(half))
        tokenized["train"] = tokenized["train"].select(range(half, len(tokenized["train"])))
        model_path = demo_base_model(process, tokenizer, base_docs, args.demo_base_steps, args.seed)
    return tokenizer, tokenized, model_path


def load_base_model(args, model_path):
    """The causal LM to fine-tune, with ``--attn_implementation`` and ``--model_dtype``. load_with_qk_norm: a plain
    from_pretrained for ordinary checkpoints; it restores the QK-norm gains of a model saved after
    sagebwd_hf.add_qk_norm. A model that does not load, or whose positions are shorter than ``--seq_len``, stops
    with one line naming the flag."""
    import sagebwd_hf

    try:
        model = sagebwd_hf.load_with_qk_norm(model_path, attn_implementation=args.attn_implementation,
                                             dtype=DTYPES[args.model_dtype])
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: --model_name_or_path {model_path}: cannot load a causal LM: "
                         f"{str(exc).splitlines()[0]}") from None
    check_fits_positions(model.config, args.seq_len, "--model_name_or_path")
    model.config.use_cache = False
    return model


def demo_base_model(accelerator, tokenizer, base_docs, steps, seed, seq_len=128, batch_size=8):
    """The offline stand-in for a pre-trained checkpoint: a tiny Llama pre-trained for ``steps`` steps with
    SDPA on ``base_docs`` (tokenized documents). Cached by the exact training tokens and settings, so a second
    run (or the other processes of this one, or another example's run) loads it instead of training it again.
    Returns the folder (model and tokenizer). ``accelerator``: an ``Accelerator`` or ``accelerate.PartialState``
    (what is used: ``.print`` and ``.device``). Used by finetune_lora.py and finetune_trainer.py."""
    from accelerate.utils import set_seed
    from datasets import DatasetDict
    from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

    key = hashlib.sha256()
    for ids in base_docs["input_ids"]:
        key.update(torch.tensor(ids, dtype=torch.int32).numpy().tobytes())
    key.update(json.dumps([steps, seed, seq_len, batch_size, len(tokenizer), MODEL_PRESETS["tiny"]]).encode())
    path = cache_dir() / f"demo-base-llama-tiny-{key.hexdigest()[:12]}"
    if (path / "config.json").exists():
        accelerator.print(f"demo base model: {path} (cached)")
        return path

    accelerator.print(f"demo base model: pre-training a tiny Llama for {steps} steps on {len(base_docs)} "
                      f"documents (cached afterwards in {path})")
    rows = build_lm_dataset(DatasetDict(train=base_docs), "packed", seq_len, batch_size)["train"]
    set_seed(seed)
    config = preset_config("llama", "tiny", tokenizer, seq_len)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(accelerator.device)
    optimizer = adamw(model, 3e-3, 0.1)
    scheduler = get_cosine_schedule_with_warmup(optimizer, max(1, steps // 20), steps)
    generator = torch.Generator().manual_seed(seed)
    data = torch.tensor(rows["input_ids"], dtype=torch.long)
    model.train()
    for step in range(1, steps + 1):
        batch = data[torch.randint(len(data), (batch_size,), generator=generator)].to(accelerator.device)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step % max(1, steps // 5) == 0:
            accelerator.print(f"  demo base step {step}/{steps} loss {loss.item():.4f}")
    model.config.use_cache = True

    def write(folder):
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    atomic_save_dir(path, write)
    return path


def count_parameters(model, trainable_only=False) -> int:
    """Parameters of ``model`` (tied weights counted once), or only those that train."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def enable_activation_checkpointing(model):
    """Recompute each layer in the backward to save memory (``--gradient_checkpointing``). Non-reentrant: it also
    works with a frozen embedding (LoRA) without enable_input_require_grads. Transformers 5.24 calls it
    ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` is a deprecated alias there); earlier
    releases have only ``gradient_checkpointing_enable``."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def add_lora(model, args):
    """``model`` with a PEFT LoRA adapter of ``--lora_r``, ``--lora_alpha`` and ``--lora_dropout`` on
    ``--lora_target_modules`` (comma-separated module names, or all-linear). Returns ``(peft_model, targets)``;
    targets that match no module stop with one line naming the flag."""
    from peft import LoraConfig, get_peft_model

    targets = args.lora_target_modules
    targets = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    try:
        config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                            target_modules=targets, task_type="CAUSAL_LM")
        with warnings.catch_warnings():
            # PEFT asks the model for is_gradient_checkpointing, which Transformers 5.24 deprecates (in favour of
            # is_activation_checkpointing): a warning about PEFT's call, which the user cannot act on.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated",
                                    category=FutureWarning)
            model = get_peft_model(model, config)
    except ValueError as err:
        raise SystemExit(f"error: --lora_target_modules {args.lora_target_modules!r}: {err}") from None
    return model, targets


FLOAT32_ATTENTION_NOTE = ("attention: this float32 model's attention runs in bfloat16 with INT8 products (SageBwd has "
                          "no float32 path); its outputs and gradients are float32")


def note_float32_attention(process, model, attn_implementation, mixed_precision):
    """Print ``FLOAT32_ATTENTION_NOTE`` once (``process.print``: the main process) when SageBwd will compute a
    float32 model's attention in bfloat16: float32 weights and no fp16/bf16 autocast, the CPU default. The
    library's warning of the same fact is then silenced in this process: the example has said it, in its own
    log. Returns whether it did."""
    if attn_implementation != "sagebwd" or mixed_precision not in (None, "no"):
        return False
    first_linear = next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
    if first_linear is None or first_linear.weight.dtype != torch.float32:
        return False
    process.print(FLOAT32_ATTENTION_NOTE)
    warnings.filterwarnings("ignore", message="sagebwd: float32", category=UserWarning)
    return True
