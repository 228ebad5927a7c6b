"""Shared pieces of the examples: the embedded text and tokenizer, data loading and batching, model presets,
metrics CSV, checkpoints and evaluation.

Everything here works offline: with no dataset or tokenizer flag the examples train on a public-domain book
shipped in ``examples/data/`` with a byte-level BPE tokenizer trained on it at first use (cached). Hub names
and local files go through the same ``datasets`` / ``transformers`` loaders for users with a network.
"""
import csv
import gc
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

EXAMPLES_DIR = Path(__file__).resolve().parent
EMBEDDED_TEXT = EXAMPLES_DIR / "data" / "botchan.txt"
EMBEDDED_VOCAB_SIZE = 2048
EOS_TOKEN = "<|endoftext|>"

ATTN_IMPLEMENTATIONS = ("sagebwd", "sdpa", "eager")
MIXED_PRECISION = ("no", "fp16", "bf16")


def cache_dir() -> Path:
    """Where the examples keep what they build once (tokenizer, demo base model).
    ``SAGEBWD_EXAMPLES_CACHE`` overrides the default ``~/.cache/sagebwd-hf-examples``."""
    path = os.environ.get("SAGEBWD_EXAMPLES_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                     "sagebwd-hf-examples")
    return Path(path)


def _file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


def _atomic_save_dir(final: Path, write) -> Path:
    """Write a folder under a temporary name, then rename it into place: several processes (``accelerate
    launch --num_processes N``) or an interrupted run never see a half-written cache entry."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    try:
        write(tmp)
        try:
            os.replace(tmp, final)
        except OSError:          # another process got there first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# ---------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------

def train_bpe(texts, vocab_size: int):
    """A byte-level BPE (GPT-2 style: any UTF-8 text encodes, nothing is ever unknown) trained on ``texts``
    with the ``tokenizers`` library: (the ``tokenizers.Tokenizer``, it wrapped as a Transformers fast
    tokenizer). One special token serves as end of text and as padding (GPT-2's convention); the model's loss
    never sees padding because the collators set those labels to -100."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    return bpe, PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                        pad_token=EOS_TOKEN, model_max_length=1 << 20)


def train_embedded_tokenizer(text_file: Path = EMBEDDED_TEXT, vocab_size: int = EMBEDDED_VOCAB_SIZE):
    """``train_bpe`` on the paragraphs of ``text_file``. Trained once (about a second) and cached under
    ``cache_dir()``, keyed by the text's hash and the vocabulary size."""
    from transformers import AutoTokenizer

    target = cache_dir() / f"tokenizer-bpe{vocab_size}-{_file_digest(text_file)}"
    if not (target / "tokenizer.json").exists():
        def write(folder):
            paragraphs = [p for p in Path(text_file).read_text(encoding="utf-8").split("\n\n") if p.strip()]
            train_bpe(paragraphs, vocab_size)[1].save_pretrained(folder)
        _atomic_save_dir(target, write)
    return AutoTokenizer.from_pretrained(target)


def load_tokenizer(name_or_path):
    """``None`` or ``"embedded"``: the offline BPE above. Anything else: ``AutoTokenizer.from_pretrained``
    (a hub name or a local folder). A tokenizer without a pad token gets its EOS token as pad token."""
    from transformers import AutoTokenizer

    if name_or_path in (None, "embedded"):
        tokenizer = train_embedded_tokenizer()
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"error: cannot load a tokenizer from {name_or_path!r} (--tokenizer_name or "
                             f"--model_name_or_path): {str(exc).splitlines()[0]}") from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer {name_or_path!r} has neither a pad token nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ---------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------

def add_data_arguments(parser):
    group = parser.add_argument_group("data (default: the embedded book, no download)")
    group.add_argument("--dataset_name", default=None,
                       help="a dataset on the Hugging Face Hub (e.g. Salesforce/wikitext); needs a network")
    group.add_argument("--dataset_config_name", default=None, help="the dataset's configuration (e.g. wikitext-2-raw-v1)")
    group.add_argument("--train_file", default=None,
                       help="a local .txt, .json or .jsonl file (json: one object per line with --text_column), "
                            "or pre-tokenized ids in a .npy (examples/code_corpus.py; pretrain.py only, with "
                            "--tokenizer_name the tokenizer that made it)")
    group.add_argument("--validation_file", default=None, help="like --train_file, for evaluation")
    group.add_argument("--text_column", default="text", help="the column holding the text (default: text)")
    group.add_argument("--text_sample_by", default="paragraph", choices=("line", "paragraph", "document"),
                       help="for .txt files: one example per line, per blank-line separated paragraph (default), "
                            "or per file")
    group.add_argument("--validation_split_percentage", type=float, default=5.0,
                       help="without a validation split: the last this many percent of the training examples "
                            "(default 5; taken from the end, not at random, so that neighbouring paragraphs of "
                            "a book do not leak into evaluation)")
    group.add_argument("--max_train_samples", type=int, default=None, help="keep only the first N training examples")
    return group


def load_raw_datasets(args):
    """A ``DatasetDict`` with ``train`` and ``validation`` from the Hub, local files or the embedded book."""
    from datasets import DatasetDict, load_dataset

    if args.dataset_name is not None:
        raw = load_dataset(args.dataset_name, args.dataset_config_name)
    else:
        files = {"train": args.train_file or str(EMBEDDED_TEXT)}
        if args.validation_file is not None:
            files["validation"] = args.validation_file
        extensions = {Path(f).suffix.lower() for f in files.values()}
        if len(extensions) != 1:
            raise SystemExit(f"error: --train_file and --validation_file must have the same extension, got "
                             f"{sorted(extensions)}")
        extension = extensions.pop()
        if extension == ".txt":
            raw = load_dataset("text", data_files=files, sample_by=args.text_sample_by)
        elif extension in (".json", ".jsonl"):
            raw = load_dataset("json", data_files=files)
        else:
            raise SystemExit(f"error: --train_file: unsupported extension {extension!r}; allowed: .txt, .json, .jsonl")
    if "train" not in raw:
        raise SystemExit(f"error: --dataset_name {args.dataset_name}: no 'train' split (splits: {list(raw)})")
    if "validation" not in raw:
        if not 0 < args.validation_split_percentage < 100:
            raise SystemExit("error: --validation_split_percentage must be in (0, 100), got "
                             f"{args.validation_split_percentage}")
        split = raw["train"].train_test_split(test_size=args.validation_split_percentage / 100, shuffle=False)
        raw = DatasetDict(train=split["train"], validation=split["test"])
    if args.text_column not in raw["train"].column_names:
        raise SystemExit(f"error: --text_column {args.text_column!r} is not a column of the dataset; columns: "
                         f"{raw['train'].column_names}")
    if args.max_train_samples is not None:
        raw["train"] = raw["train"].select(range(min(args.max_train_samples, len(raw["train"]))))
    return DatasetDict(train=raw["train"], validation=raw["validation"])


def tokenize_documents(raw, tokenizer, text_column, num_proc=None):
    """Each text becomes one token sequence ending with EOS (the document boundary packing relies on)."""
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer([t for t in batch[text_column]], add_special_tokens=True)["input_ids"]
        return {"input_ids": [x + [eos] if not x or x[-1] != eos else x for x in ids]}

    columns = raw["train"].column_names
    out = raw.filter(lambda b: [bool(t and t.strip()) for t in b[text_column]], batched=True, num_proc=num_proc)
    return out.map(tokenize, batched=True, remove_columns=columns, num_proc=num_proc, desc="tokenizing")


BATCHING_MODES = ("packed", "padding_free", "padded")


def build_lm_dataset(tokenized, mode, seq_len, per_device_batch_size):
    """Turn tokenized documents into training examples, one of three ways:

    - ``packed``: documents concatenated (EOS between them) and cut into rows of exactly ``seq_len`` tokens;
      attention crosses document boundaries inside a row (GPT-style pre-training). Batches ``[B, seq_len]``.
    - ``padding_free``: documents (longer ones cut into ``seq_len`` pieces) laid end to end in rows of at most
      ``per_device_batch_size * seq_len`` tokens, with ``position_ids`` restarting at every document and the
      first label of each document set to -100: what ``transformers.DataCollatorWithFlattening`` makes. The
      model sees ``[1, total]`` with no attention mask and keeps documents apart (SageBwd's varlen path,
      SDPA's block-diagonal mask); no compute is spent on padding. One row per micro-batch.
    - ``padded``: one row per document (longer ones cut into ``seq_len`` pieces), padded to the longest row of
      the batch; an attention mask and -100 labels hide the padding.
    """
    from transformers import DataCollatorWithFlattening

    if mode not in BATCHING_MODES:
        raise ValueError(f"batching mode must be one of {BATCHING_MODES}, got {mode!r}")

    def pieces(batch):
        for ids in batch["input_ids"]:
            for start in range(0, len(ids), seq_len):
                if len(ids) - start >= 2:           # a one-token piece has nothing to predict
                    yield ids[start:start + seq_len]

    if mode == "packed":
        def fn(batch):
            flat = [t for ids in batch["input_ids"] for t in ids]
            rows = [flat[i:i + seq_len] for i in range(0, len(flat) - seq_len + 1, seq_len)]
            return {"input_ids": rows, "labels": [list(r) for r in rows]}
        # Rows are cut from runs of 1000 documents (the remainder of each run, < seq_len tokens, is dropped).
        batch_size = 1000
    elif mode == "padded":
        def fn(batch):
            rows = list(pieces(batch))
            return {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}
        batch_size = 1000
    else:
        flatten = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
        budget = per_device_batch_size * seq_len

        def fn(batch):
            rows, current, size = [], [], 0
            for piece in pieces(batch):
                if current and size + len(piece) > budget:
                    rows.append(current)
                    current, size = [], 0
                current.append(piece)
                size += len(piece)
            if current:
                rows.append(current)
            out = {"input_ids": [], "labels": [], "position_ids": []}
            for row in rows:
                flat = flatten([{"input_ids": p} for p in row], return_tensors="np")
                for key in out:
                    out[key].append(flat[key][0].tolist())
            return out
        batch_size = 1000
    return tokenized.map(fn, batched=True, batch_size=batch_size, remove_columns=tokenized["train"].column_names,
                         desc=f"batching ({mode})")


TOKEN_FILE_SUFFIX = ".npy"


def is_token_file(path) -> bool:
    return path is not None and Path(path).suffix.lower() == TOKEN_FILE_SUFFIX


def vocab_fingerprint(tokenizer) -> str:
    """A digest of the token -> id map: two tokenizers with the same one encode the same ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


class TokenRows(torch.utils.data.Dataset):
    """Packed rows of ``seq_len`` tokens cut in order from a pre-tokenized stream: a 1-D ``.npy`` of token ids
    with EOS between documents (what examples/code_corpus.py writes), read through a memory map, so a corpus of
    any size costs no tokenization and no copy in memory. Rows are what ``build_lm_dataset``'s packed mode
    makes: attention crosses document boundaries inside a row; the remainder (< seq_len tokens) is dropped."""

    def __init__(self, ids, seq_len):
        self.ids, self.seq_len = ids, seq_len

    def __len__(self):
        return len(self.ids) // self.seq_len

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        row = torch.from_numpy(self.ids[i * self.seq_len:(i + 1) * self.seq_len].astype("int64"))
        return {"input_ids": row, "labels": row}


def token_file_datasets(args, tokenizer, seq_len):
    """``train`` and ``validation`` TokenRows from ``--train_file`` (and ``--validation_file``, else the last
    ``--validation_split_percentage`` of the training rows). Every id must be below the tokenizer's size."""
    import numpy as np

    streams = {}
    for split, flag in (("train", "train_file"), ("validation", "validation_file")):
        path = getattr(args, flag)
        if path is None:
            continue
        if not is_token_file(path):
            raise SystemExit(f"error: --{flag} {path}: with a token file (.npy) for --train_file, "
                             f"--validation_file must be one too")
        try:
            ids = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise SystemExit(f"error: --{flag} {path}: not a .npy array: {exc}") from None
        if ids.ndim != 1 or ids.dtype.kind not in "ui" or ids.size == 0:
            raise SystemExit(f"error: --{flag} {path}: a token file is a non-empty 1-D integer array, got "
                             f"shape {ids.shape} dtype {ids.dtype}")
        manifest = Path(path).parent / "manifest.json"      # code_corpus.py's: names the tokenizer it used
        if manifest.exists():
            made_by = json.loads(manifest.read_text()).get("vocab_fingerprint")
            if made_by and made_by != vocab_fingerprint(tokenizer):
                raise SystemExit(f"error: --{flag} {path} was made by another tokenizer than --tokenizer_name "
                                 f"(vocabulary {made_by} in {manifest}, {vocab_fingerprint(tokenizer)} given); use "
                                 f"the tokenizer folder written beside it")
        top = int(ids.max())
        if top >= len(tokenizer) or int(ids.min()) < 0:
            raise SystemExit(f"error: --{flag} {path}: token id {top} is outside the tokenizer's {len(tokenizer)} "
                             f"ids (--tokenizer_name: the tokenizer that made the file)")
        streams[split] = ids
    if "validation" not in streams:
        if not 0 < args.validation_split_percentage < 100:
            raise SystemExit("error: --validation_split_percentage must be in (0, 100), got "
                             f"{args.validation_split_percentage}")
        ids = streams["train"]
        rows = len(ids) // seq_len
        cut = (rows - max(1, int(rows * args.validation_split_percentage / 100))) * seq_len
        streams = {"train": ids[:cut], "validation": ids[cut:]}
    out = {split: TokenRows(ids, seq_len) for split, ids in streams.items()}
    for split, rows in out.items():
        if len(rows) == 0:
            raise SystemExit(f"error: the {split} token file holds fewer than --seq_len {seq_len} tokens")
    if args.max_train_samples is not None:
        out["train"] = TokenRows(streams["train"][:args.max_train_samples * seq_len], seq_len)
    return out


def make_collator(mode, tokenizer):
    """The collate function for ``build_lm_dataset``'s rows."""
    if mode == "padded":
        def collate(features):
            batch = tokenizer.pad([{"input_ids": f["input_ids"], "attention_mask": f["attention_mask"]}
                                   for f in features], padding=True, return_tensors="pt")
            batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            return batch
        return collate

    def collate(features):
        if mode == "padding_free" and len(features) != 1:
            raise ValueError("padding_free rows are whole micro-batches: use a DataLoader batch size of 1")
        return {key: torch.stack([torch.as_tensor(f[key], dtype=torch.long) for f in features])
                for key in features[0]}
    return collate


def make_dataloaders(lm_datasets, mode, tokenizer, per_device_batch_size, eval_batch_size=None):
    from torch.utils.data import DataLoader

    collate = make_collator(mode, tokenizer)
    batch = 1 if mode == "padding_free" else per_device_batch_size
    eval_batch = 1 if mode == "padding_free" else (eval_batch_size or per_device_batch_size)
    if len(lm_datasets["train"]) == 0:
        raise ValueError("the training data has no example after tokenization and batching (text too short "
                         "for --seq_len?)")
    # shuffle=True gives a RandomSampler, which Accelerate swaps for a seedable one (see make_accelerator):
    # the order of epoch e is a function of (seed, e) alone, the same for every run and every resume.
    train = DataLoader(lm_datasets["train"], batch_size=batch, shuffle=True, collate_fn=collate, drop_last=True)
    evaluation = DataLoader(lm_datasets["validation"], batch_size=eval_batch, shuffle=False, collate_fn=collate)
    return train, evaluation


def to_float(value):
    """A Python float from a number or a tensor (FSDP2 returns the gradient norm as a sharded DTensor)."""
    if value is None:
        return None
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


def count_tokens(batch) -> int:
    """Tokens the model computes on in this batch (padding excluded)."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


# ---------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------

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
    _atomic_save_dir(path, write)
    return path


def count_parameters(model, trainable_only=False) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


# ---------------------------------------------------------------------------------------------------------
# Accelerator, optimizer
# ---------------------------------------------------------------------------------------------------------

def add_training_arguments(parser, *, output_dir, lr, max_steps, batch_size, seq_len):
    group = parser.add_argument_group("training")
    group.add_argument("--output_dir", default=output_dir, help=f"metrics, checkpoints, final weights (default {output_dir})")
    group.add_argument("--seq_len", type=int, default=seq_len, help=f"tokens per sequence (default {seq_len})")
    group.add_argument("--per_device_batch_size", type=int, default=batch_size,
                       help=f"sequences per micro-batch per process (default {batch_size})")
    group.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    group.add_argument("--max_steps", type=int, default=max_steps,
                       help="optimizer steps" + (f" (default {max_steps})" if max_steps else ""))
    group.add_argument("--learning_rate", type=float, default=lr,
                       help="peak learning rate" + (f" (default {lr})" if lr else " (default: see the script's docstring)"))
    group.add_argument("--warmup_steps", type=int, default=None, help="linear warm-up steps (default: 5%% of the steps)")
    group.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay on matrices")
    group.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping (0: off)")
    group.add_argument("--mixed_precision", default=None, choices=MIXED_PRECISION,
                       help="autocast precision; default: what `accelerate launch`/`accelerate config` says (no)")
    group.add_argument("--gradient_checkpointing", action="store_true",
                       help="activation checkpointing: recompute each layer in the backward to save memory")
    group.add_argument("--seed", type=int, default=42, help="initialisation and data order (default 42)")
    group.add_argument("--eval_steps", type=int, default=None, help="evaluate every N steps (default: at the end only)")
    group.add_argument("--max_eval_batches", type=int, default=None, help="evaluate on at most N batches")
    group.add_argument("--checkpointing_steps", type=int, default=None,
                       help="save an Accelerate checkpoint (model, optimizer, scheduler, RNG, data position) "
                            "every N steps into OUTPUT_DIR/checkpoint-N")
    group.add_argument("--resume_from_checkpoint", default=None,
                       help="a checkpoint-N folder, or 'latest' for the newest one in --output_dir")
    group.add_argument("--with_tracking", action="store_true",
                       help="also log metrics to Accelerate's trackers (--report_to)")
    group.add_argument("--report_to", default="all",
                       help="trackers for --with_tracking: all, tensorboard, wandb, mlflow, ... (default all)")
    return group


def check_files(args, *names):
    """Local files named by flags exist: a one-line error naming the flag before anything is loaded."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None and not Path(value).exists():
            raise SystemExit(f"error: --{name} {value}: no such file or folder")


def check_fits_positions(config, seq_len, flag):
    """``--seq_len`` within the model's positions (RoPE models would run past what they were trained on; learned
    position tables would index out of range)."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise SystemExit(f"error: --seq_len {seq_len} is longer than the model's max_position_embeddings "
                         f"({limit}, from {flag})")


def check_positive(args, *names):
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise SystemExit(f"error: --{name} must be > 0, got {value}")


def make_accelerator(args):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    kwargs = {}
    if args.with_tracking:
        kwargs["log_with"] = args.report_to
    return Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # Seedable sampler: the shuffled order depends on (seed, epoch) only, so that two runs (sdpa and
        # sagebwd) see the same batches and a resumed run sees what the original would have seen.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "logs")),
        **kwargs,
    )


def adamw(model, lr, weight_decay, betas=(0.9, 0.95)):
    """AdamW with weight decay on matrices only (not on norms' gains or biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)


# ---------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------

METRIC_COLUMNS = ("step", "epoch", "loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s",
                  "elapsed_s", "eval_loss", "eval_ppl")


class CSVLogger:
    """``metrics.csv``: one row per optimizer step (eval columns filled on evaluation steps). Written by the
    main process only, flushed at every row so that a crash or a kill keeps what was done. On resume the rows
    after the checkpoint's step are dropped first, so that the file reads as one run."""

    def __init__(self, path, enabled=True, resume_step=None, restore_from=None):
        self.path, self.enabled = Path(path), enabled
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows = []
        if resume_step is not None:
            source = self.path if self.path.exists() else (Path(restore_from) if restore_from else None)
            if source is not None and source.exists():
                rows = [r for r in read_metrics(source) if int(r["step"]) <= resume_step]
        # the kept rows go to a new file that replaces the old one in one step: a kill here loses no row
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        self.file = open(tmp, "w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=METRIC_COLUMNS)
        self.writer.writeheader()
        for row in rows:
            self.writer.writerow({k: row.get(k, "") for k in METRIC_COLUMNS})
        self.file.flush()
        os.fsync(self.file.fileno())
        os.replace(tmp, self.path)

    def log(self, **values):
        if not self.enabled:
            return
        unknown = set(values) - set(METRIC_COLUMNS)
        if unknown:
            raise KeyError(f"unknown metric columns {sorted(unknown)}")
        self.writer.writerow({k: _fmt(values.get(k)) for k in METRIC_COLUMNS})
        self.file.flush()

    def close(self):
        if self.enabled:
            self.file.close()


def _fmt(value):
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def read_metrics(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(accelerator, model, dataloader, max_batches=None):
    """Token-weighted mean loss over the evaluation set (all processes), and its perplexity."""
    model.eval()
    loss_sum = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    count = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    for i, batch in enumerate(dataloader):
        if max_batches is not None and i >= max_batches:
            break
        loss = model(**batch).loss
        # The model's loss is the mean over predicted tokens: labels shifted by one, -100 ignored.
        n = (batch["labels"][..., 1:] != -100).sum()
        loss_sum += loss.double() * n
        count += n
    loss_sum, count = accelerator.reduce(loss_sum, "sum"), accelerator.reduce(count, "sum")
    model.train()
    mean = (loss_sum / count.clamp(min=1)).item()
    return mean, math.exp(min(mean, 50.0))


# ---------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------

TRAINING_STATE = "training_state.json"


def save_checkpoint(accelerator, output_dir, step, state, metrics_path=None):
    """``accelerator.save_state`` (model, optimizer, scheduler, RNG states, sampler) plus where the loop was.

    Written under a hidden name (``.checkpoint-N.partial``) and renamed to ``checkpoint-N`` only once every
    file is in, ``training_state.json`` last: a run killed while saving leaves no half-written checkpoint-N,
    only a hidden folder that ``find_checkpoint`` never picks and the next save of that step replaces."""
    out = Path(output_dir)
    final, partial = out / f"checkpoint-{step}", out / f".checkpoint-{step}.partial"
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)                       # left by a save that was killed
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    fault_point("save", step)
    accelerator.wait_for_everyone()                  # every process's files are in
    if accelerator.is_main_process:
        if metrics_path is not None and Path(metrics_path).exists():
            shutil.copy(metrics_path, partial / "metrics.csv")
        write_atomic(partial / TRAINING_STATE, json.dumps(dict(state, step=step), indent=1))
        old = out / f".checkpoint-{step}.old"
        if final.exists():                           # the same step saved again after a resume
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def write_atomic(path, text):
    """Replace ``path``'s contents all at once: a kill leaves the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


FAULT_ENV = "SAGEBWD_EXAMPLES_KILL_AT"


def fault_point(where, step):
    """Test hook: ``SAGEBWD_EXAMPLES_KILL_AT=save:4`` (or ``step:7``) makes the process SIGKILL itself in the
    middle of saving checkpoint 4 (after the model and optimizer files, before it is complete), or in the
    middle of optimizer step 7 (after the backward, before the update): a crash at a chosen moment, for
    tests/test_examples.py. Unset, it does nothing."""
    if os.environ.get(FAULT_ENV) == f"{where}:{step}":
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


def find_checkpoint(resume_from_checkpoint, output_dir, marker=TRAINING_STATE):
    """The folder to resume from: the path given, or with 'latest' the newest complete checkpoint-N in output_dir
    (complete: it holds ``marker``, the file written last; Trainer's checkpoints mark with trainer_state.json)."""
    if resume_from_checkpoint == "latest":
        folder = Path(output_dir)
        candidates = [p for p in folder.glob("checkpoint-*")
                      if p.name.split("-")[-1].isdigit() and (p / marker).exists()] if folder.is_dir() else []
        if not candidates:
            raise SystemExit(f"error: --resume_from_checkpoint latest: no checkpoint-N folder with {marker} in "
                             f"{output_dir} (--output_dir)")
        return max(candidates, key=lambda p: int(p.name.split("-")[-1]))
    path = Path(resume_from_checkpoint)
    if not (path / marker).exists():
        raise SystemExit(f"error: --resume_from_checkpoint {resume_from_checkpoint}: not a checkpoint folder "
                         f"(no {marker}); give a checkpoint-N folder or 'latest'")
    return path


def load_checkpoint(accelerator, path):
    try:
        accelerator.load_state(str(path))
    except (RuntimeError, ValueError, KeyError) as exc:   # another model's or optimizer's tensors
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = next((line for line in lines if "size mismatch" in line or "Missing" in line or "Unexpected" in line),
                      lines[0] if lines else type(exc).__name__)
        raise SystemExit(f"error: --resume_from_checkpoint {path}: it does not fit this model (same --size, "
                         f"--model_type, --qk_norm and LoRA settings?): {detail[:300]}") from None
    return json.loads((Path(path) / TRAINING_STATE).read_text())


class StepTimer:
    """Wall time of each optimizer step (synchronising the GPU, so that it is the real step time)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.start = None

    def _now(self):
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def reset(self):
        self.start = self._now()

    def lap(self):
        now = self._now()
        elapsed, self.start = now - self.start, now
        return elapsed


# ---------------------------------------------------------------------------------------------------
# The training loop both examples share
# ---------------------------------------------------------------------------------------------------

def resume(accelerator, args, out):
    """Where the loop is (optimizer steps, micro-batches consumed -> epoch and position in it, tokens, time),
    from ``--resume_from_checkpoint`` or fresh; and the metrics CSV, continued from the checkpoint's copy.
    Returns ``(state, metrics, resume_path or None)``."""
    state = {"step": 0, "micro_batches": 0, "tokens": 0, "elapsed_s": 0.0}
    resume_path = None
    if args.resume_from_checkpoint:
        resume_path = find_checkpoint(args.resume_from_checkpoint, out)
        state.update(load_checkpoint(accelerator, resume_path))
        accelerator.print(f"resumed from {resume_path} at step {state['step']}")
    metrics = CSVLogger(out / "metrics.csv", enabled=accelerator.is_main_process,
                        resume_step=state["step"] if resume_path else None,
                        restore_from=resume_path / "metrics.csv" if resume_path else None)
    return state, metrics, resume_path


def release_process_group():
    """For scripts whose loop is not ours (Trainer): once the caller has dropped its references to the model,
    free what is left of the DDP wrapper, then destroy the process group through its Python handle; see
    ``end_training`` for why the order matters."""
    gc.collect()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def end_training(accelerator):
    """Close the trackers and destroy the process group, after the prepared model is gone.

    Callers ``del`` their own references to the prepared objects first. The order matters under DDP: DDP's C++
    reducer owns the process group too, so a group destroyed first (``accelerator.end_training()`` alone) is
    freed later by the reducer, when the model is garbage-collected, with the GIL held. Gloo's destructor then
    joins a worker thread that waits for the GIL to free the tensors of a finished allreduce: a deadlock that
    hung one rank at exit in about one run of four. Freed through its Python handle (here, last), the group is
    destroyed with the GIL released."""
    accelerator.free_memory()          # the accelerator's own references to the prepared objects
    gc.collect()                       # DDP's forward hooks keep it in reference cycles
    accelerator.end_training()


def train(accelerator, args, model, optimizer, scheduler, train_dataloader, eval_dataloader, out, state, metrics,
          max_steps, log_every, desc):
    """Optimizer steps with gradient accumulation until ``max_steps``, resuming mid-epoch from ``state``:
    per-step metrics (CSV, trackers), evaluation every ``--eval_steps`` and at the end, checkpoints every
    ``--checkpointing_steps``. Step times leave evaluation and checkpointing out. Returns where it ended:
    ``{"step", "tokens", "elapsed_s", "eval_loss"}``."""
    batches_per_epoch = len(train_dataloader)
    step, micro, tokens, elapsed = state["step"], state["micro_batches"], state["tokens"], state["elapsed_s"]
    epoch, skip = divmod(micro, batches_per_epoch)
    progress = tqdm(total=max_steps, initial=step, desc=desc, disable=not accelerator.is_local_main_process)
    timer = StepTimer(accelerator.device)
    step_losses, step_tokens = [], 0
    model.train()
    timer.reset()
    while step < max_steps:
        train_dataloader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(train_dataloader, skip) if skip else train_dataloader
        skip = 0
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    fault_point("step", step + 1)
                grad_norm = None
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            micro += 1
            step_losses.append(loss.detach().float())
            step_tokens += count_tokens(batch)
            if not accelerator.sync_gradients:
                continue

            # One optimizer step done: average the loss over micro-batches and processes, sum the tokens.
            step += 1
            step_loss = accelerator.reduce(torch.stack(step_losses).mean(), "mean").item()
            global_tokens = int(accelerator.reduce(torch.tensor(step_tokens, device=accelerator.device), "sum"))
            step_losses, step_tokens = [], 0
            step_time = timer.lap()
            tokens += global_tokens
            elapsed += step_time
            eval_loss = eval_ppl = None
            if (args.eval_steps and step % args.eval_steps == 0) or step == max_steps:
                eval_loss, eval_ppl = evaluate(accelerator, model, eval_dataloader, args.max_eval_batches)
            row = dict(step=step, epoch=round(micro / batches_per_epoch, 4), loss=step_loss,
                       lr=scheduler.get_last_lr()[0], grad_norm=to_float(grad_norm),
                       tokens=tokens, step_time_s=step_time, tokens_per_s=global_tokens / max(step_time, 1e-9),
                       elapsed_s=elapsed, eval_loss=eval_loss, eval_ppl=eval_ppl)
            metrics.log(**row)
            if args.with_tracking:
                accelerator.log({k: v for k, v in row.items() if v is not None and k != "step"}, step=step)
            progress.update(1)
            progress.set_postfix(loss=f"{step_loss:.3f}", refresh=False)
            if step % log_every == 0 or step == max_steps or eval_loss is not None:
                line = (f"step {step}/{max_steps} loss {step_loss:.4f} lr {row['lr']:.2e} "
                        f"tokens/s {row['tokens_per_s']:,.0f}")
                if eval_loss is not None:
                    line += f" | eval loss {eval_loss:.4f} ppl {eval_ppl:.2f}"
                if accelerator.is_local_main_process:
                    progress.write(line)
            if args.checkpointing_steps and step % args.checkpointing_steps == 0:
                path = save_checkpoint(accelerator, out, step,
                                       dict(micro_batches=micro, tokens=tokens, elapsed_s=elapsed),
                                       metrics_path=out / "metrics.csv")
                accelerator.print(f"saved {path}")
            timer.reset()           # evaluation and checkpointing are not counted as step time
            if step >= max_steps:
                break
        epoch += 1
    progress.close()
    metrics.close()
    return {"step": step, "tokens": tokens, "elapsed_s": elapsed, "eval_loss": eval_loss}

