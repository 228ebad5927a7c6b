"""The command-line flags the example scripts share (data, training, attention), the help formatter that shows each
default once, and the checks that stop a bad flag with one ``error: --flag ...`` line before anything is loaded."""
import argparse
from pathlib import Path

ATTN_IMPLEMENTATIONS = ("sagebwd", "sdpa", "eager")
ATTN_HELP = ("attention kernel: sagebwd (this package's INT8 attention), sdpa (PyTorch's "
             "scaled_dot_product_attention in the model's precision: the reference), eager (Transformers' plain "
             "matmul-softmax attention)")
MIXED_PRECISION = ("no", "fp16", "bf16")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default once: appended as ``(default: X)`` unless the help text already says
    what the default is, or the default is a switch's False or an unset None (the help says what unset means)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


def add_attn_implementation_argument(group, default="sagebwd"):
    group.add_argument("--attn_implementation", default=default, choices=ATTN_IMPLEMENTATIONS, help=ATTN_HELP)


def add_data_arguments(parser):
    group = parser.add_argument_group("data (default: the embedded book, no download)")
    group.add_argument("--dataset_name", default=None,
                       help="a dataset on the Hugging Face Hub (e.g. Salesforce/wikitext); needs a network")
    group.add_argument("--dataset_config_name", default=None,
                       help="the dataset's configuration (e.g. wikitext-2-raw-v1)")
    group.add_argument("--train_file", default=None,
                       help="a local .txt, .json or .jsonl file (json: one object per line with --text_column), "
                            "or pre-tokenized ids in a .npy (examples/code_corpus.py; pretrain.py only, with "
                            "--tokenizer_name the tokenizer that made it)")
    group.add_argument("--validation_file", default=None, help="like --train_file, for evaluation")
    group.add_argument("--text_column", default="text", help="the column holding the text")
    group.add_argument("--text_sample_by", default="paragraph", choices=("line", "paragraph", "document"),
                       help="for .txt files: one example per line, per blank-line separated paragraph (default), "
                            "or per file")
    group.add_argument("--validation_split_percentage", type=float, default=5.0,
                       help="without a validation split: the last this many percent of the training examples "
                            "(taken from the end, not at random, so that neighbouring paragraphs of a book do not "
                            "leak into evaluation)")
    group.add_argument("--max_train_samples", type=int, default=None, help="keep only the first N training examples")
    return group


def add_training_arguments(parser, *, output_dir, lr, max_steps, batch_size, seq_len):
    group = parser.add_argument_group("training")
    group.add_argument("--output_dir", default=output_dir, help="metrics, checkpoints, final weights")
    group.add_argument("--seq_len", type=int, default=seq_len, help="tokens per sequence")
    group.add_argument("--per_device_batch_size", type=int, default=batch_size,
                       help="sequences per micro-batch per process")
    group.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    group.add_argument("--max_steps", type=int, default=max_steps, help="optimizer steps")
    group.add_argument("--learning_rate", type=float, default=lr,
                       help="peak learning rate" + ("" if lr else " (default: see the script's docstring)"))
    group.add_argument("--warmup_steps", type=int, default=None,
                       help="linear warm-up steps (default: 5%% of the steps)")
    group.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay on matrices")
    group.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping (0: off)")
    group.add_argument("--mixed_precision", default=None, choices=MIXED_PRECISION,
                       help="autocast precision; default: what `accelerate launch`/`accelerate config` says (no)")
    group.add_argument("--gradient_checkpointing", action="store_true",
                       help="activation checkpointing: recompute each layer in the backward to save memory")
    group.add_argument("--seed", type=int, default=42, help="initialisation and data order")
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
                       help="trackers for --with_tracking: all, tensorboard, wandb, mlflow, ...")
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
