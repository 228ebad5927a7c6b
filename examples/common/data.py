"""The examples' data: the offline tokenizer and book, datasets from the Hub or local files, the three batching
modes (packed, padding-free, padded), pre-tokenized token files, collators and data loaders.

Everything works offline: with no dataset or tokenizer flag the examples train on a public-domain book shipped in
``examples/data/`` with a byte-level BPE tokenizer trained on it at first use (cached). Hub names and local files go
through the same ``datasets`` / ``transformers`` loaders for users with a network.
"""
import hashlib
import json
from pathlib import Path

import torch

from .files import atomic_save_dir, cache_dir, file_digest

EXAMPLES_DIR = Path(__file__).resolve().parents[1]
EMBEDDED_TEXT = EXAMPLES_DIR / "data" / "botchan.txt"
EMBEDDED_VOCAB_SIZE = 2048
EOS_TOKEN = "<|endoftext|>"


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

    target = cache_dir() / f"tokenizer-bpe{vocab_size}-{file_digest(text_file)}"
    if not (target / "tokenizer.json").exists():
        def write(folder):
            paragraphs = [p for p in Path(text_file).read_text(encoding="utf-8").split("\n\n") if p.strip()]
            train_bpe(paragraphs, vocab_size)[1].save_pretrained(folder)
        atomic_save_dir(target, write)
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
# Datasets and batching
# ---------------------------------------------------------------------------------------------------------

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
    # shuffle=True gives a RandomSampler, which Accelerate swaps for a seedable one (see training.make_accelerator):
    # the order of epoch e is a function of (seed, e) alone, the same for every run and every resume.
    train = DataLoader(lm_datasets["train"], batch_size=batch, shuffle=True, collate_fn=collate, drop_last=True)
    evaluation = DataLoader(lm_datasets["validation"], batch_size=eval_batch, shuffle=False, collate_fn=collate)
    return train, evaluation
