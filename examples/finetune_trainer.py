#!/usr/bin/env python
"""Fine-tune a causal LM with SageBwd INT8 attention through Transformers' Trainer, padding-free.

    python examples/finetune_trainer.py          # CPU default: demo base model, embedded book; ~50 s, 20 s cached
    python examples/finetune_trainer.py --lora   # PEFT LoRA instead of full fine-tuning
    accelerate launch examples/finetune_trainer.py --model_name_or_path Qwen/Qwen2.5-0.5B \\
        --dataset_name Salesforce/wikitext --dataset_config_name wikitext-2-raw-v1 \\
        --seq_len 1024 --per_device_batch_size 8 --gradient_checkpointing --eval_steps 200
    torchrun --nproc_per_node 2 examples/finetune_trainer.py ...      # DDP (on CPUs: ACCELERATE_USE_CPU=1 torchrun)
    python examples/finetune_trainer.py --checkpointing_steps 20                # checkpoint-20, -40, ... then:
    python examples/finetune_trainer.py --checkpointing_steps 20 --resume_from_checkpoint latest

The loop is Trainer's own (TrainingArguments built from the flags below); Trainer and Accelerate handle the
device, DDP/FSDP under `accelerate launch` or torchrun, gradient accumulation and checkpoints. The model is
loaded with attn_implementation="sagebwd" (--attn_implementation sagebwd|sdpa|eager). Full fine-tuning by
default; --lora trains a PEFT LoRA adapter instead (--lora_r, --lora_alpha, --lora_dropout,
--lora_target_modules, as examples/finetune_lora.py).

Padding-free batches: every document (cut into pieces of at most --seq_len tokens) is one example, and
transformers.DataCollatorWithFlattening lays the --per_device_batch_size examples of a micro-batch end to end
in one row [1, total] with position_ids restarting at every document and the first label of each set to -100.
No padding, no attention across documents: the sagebwd backend runs its packed (varlen) path, read from the
restarting position_ids (sagebwd_hf.attention_stats()["paths"]["packed"]); SDPA and eager get a
block-diagonal causal mask from Transformers.

Base model: --model_name_or_path, a hub name or a local folder (loaded with sagebwd_hf.load_with_qk_norm, so a
model saved after sagebwd_hf.add_qk_norm keeps its QK-norm gains). Without it, the demo base model of
examples/finetune_lora.py (the same cache entry): a tiny Llama pre-trained with SDPA for --demo_base_steps on the
first half of the training documents, then fine-tuned here on the second half. Default --learning_rate: 1e-3
(full) / 3e-3 (LoRA) for the demo base model, 2e-5 / 2e-4 with --model_name_or_path.

Precision: bf16 autocast where the device supports it (a CUDA GPU with bf16), fp32 elsewhere (CPU); or
--mixed_precision no|fp16|bf16. --gradient_checkpointing recomputes each layer in the backward.

Outputs in OUTPUT_DIR (default runs/finetune_trainer): metrics.csv (per step: loss, lr, grad norm, tokens, step
time; eval loss at step 0 = the base model, every --eval_steps and at the end: Trainer's, the mean over the
evaluation micro-batches; the columns of the other examples, so examples/compare_runs.py --metrics reads it; a
copy goes into each checkpoint), Trainer checkpoints checkpoint-N (--checkpointing_steps;
--resume_from_checkpoint PATH|latest continues on the batches the run would have seen), the model saved by
trainer.save_model in OUTPUT_DIR/final_model (with --lora: the adapter, in OUTPUT_DIR/adapter), and
run_summary.json (final train and eval loss, steps, tokens, and attention_stats: how many attention calls ran
which SageBwd path, or fell back to SDPA, in the main process over the run, evaluation included).
--with_tracking --report_to tensorboard|wandb|... also logs to Trainer's integrations (default: none).
"""
import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import arguments, checkpoints, data, models, training
from common.metrics import CSVLogger, read_metrics

import sagebwd_hf  # registers attn_implementation="sagebwd" with Transformers

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
# --learning_rate defaults: (full fine-tuning, LoRA) for the tiny demo base model / a real pre-trained model.
DEMO_LR, MODEL_LR = (1e-3, 3e-3), (2e-5, 2e-4)
LORA_DEFAULTS = dict(lora_r=16, lora_alpha=32.0, lora_dropout=0.05, lora_target_modules="all-linear")
TRAINER_STATE = "trainer_state.json"      # written by Trainer into every complete checkpoint-N


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=arguments.HelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--model_name_or_path", default=None,
                       help="base model: hub name or local folder (default: the cached demo base model)")
    model.add_argument("--tokenizer_name", default=None, help="default: the base model's tokenizer")
    arguments.add_attn_implementation_argument(model)
    model.add_argument("--model_dtype", default="float32", choices=tuple(models.DTYPES),
                       help="dtype of the loaded weights (keep float32 for full fine-tuning; with --lora the "
                            "frozen base may be bfloat16)")
    model.add_argument("--demo_base_steps", type=int, default=300,
                       help="pre-training steps of the demo base model (only without --model_name_or_path)")
    lora = parser.add_argument_group("LoRA (with --lora; default: full fine-tuning)")
    lora.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter instead of all weights")
    lora.add_argument("--lora_r", type=int, default=None, help=f"LoRA rank (default: {LORA_DEFAULTS['lora_r']})")
    lora.add_argument("--lora_alpha", type=float, default=None,
                      help=f"LoRA scaling numerator, scale = alpha / r (default: {LORA_DEFAULTS['lora_alpha']:g})")
    lora.add_argument("--lora_dropout", type=float, default=None,
                      help=f"dropout on the LoRA input (default: {LORA_DEFAULTS['lora_dropout']})")
    lora.add_argument("--lora_target_modules", default=None,
                      help="comma-separated module names (e.g. q_proj,k_proj,v_proj,o_proj) or all-linear "
                           "(default)")
    arguments.add_data_arguments(parser)
    arguments.add_training_arguments(parser, output_dir="runs/finetune_trainer", lr=None, max_steps=None,
                                     batch_size=8, seq_len=128)
    parser.add_argument("--num_train_epochs", type=float, default=3,
                        help="epochs over the training data, unless --max_steps is given")
    parser.add_argument("--lr_scheduler_type", default="cosine", choices=SCHEDULERS)
    parser.add_argument("--log_every", type=int, default=None,
                        help="print a metrics line every N steps (default: 10 lines per run; metrics.csv has all)")
    # Same flags as the Accelerate examples; what they mean here:
    helps = {
        "--per_device_batch_size": "documents (pieces of at most --seq_len tokens) per micro-batch per process, "
                                   "flattened into one padding-free row",
        "--seq_len": "longest document piece: longer documents are cut into pieces of this many tokens",
        "--mixed_precision": "no (fp32), fp16 or bf16 (Trainer's autocast; the weights stay in --model_dtype); "
                             "default: bf16 where the device supports it (CUDA with bf16), fp32 elsewhere (CPU)",
        "--checkpointing_steps": "save a Trainer checkpoint (model, optimizer, scheduler, RNG, trainer state) every "
                                 "N steps into OUTPUT_DIR/checkpoint-N",
        "--with_tracking": "also report to Trainer's integrations (--report_to); default: report_to='none'",
        "--max_eval_batches": "evaluate on the first N eval micro-batches only",
    }
    for flag, text in helps.items():
        parser._option_string_actions[flag].help = text
    args = parser.parse_args(argv)
    arguments.check_positive(args, "seq_len", "per_device_batch_size", "gradient_accumulation_steps", "max_steps",
                             "learning_rate", "eval_steps", "checkpointing_steps", "num_train_epochs", "lora_r",
                             "lora_alpha", "demo_base_steps", "max_eval_batches", "log_every")
    given = [f"--{name}" for name in LORA_DEFAULTS if getattr(args, name) is not None]
    if given and not args.lora:
        raise SystemExit(f"error: {', '.join(given)}: LoRA settings apply with --lora only (default: full "
                         "fine-tuning)")
    for name, value in LORA_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not 0 <= args.lora_dropout < 1:
        raise SystemExit(f"error: --lora_dropout must be in [0, 1), got {args.lora_dropout}")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        raise SystemExit(f"error: --warmup_steps must be >= 0, got {args.warmup_steps}")
    if args.learning_rate is None:
        args.learning_rate = (DEMO_LR if args.model_name_or_path is None else MODEL_LR)[int(args.lora)]
    arguments.check_files(args, "train_file", "validation_file")
    return args


def mixed_precision(args):
    """'bf16', 'fp16' or 'no' (fp32). Unset: bf16 where it runs natively (a CUDA device with bf16), else fp32.
    (`accelerate launch --mixed_precision` is not read: its default, 'no', is indistinguishable from a choice.)"""
    choice = args.mixed_precision
    if choice is None:
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    if choice == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise SystemExit("error: --mixed_precision bf16: this GPU has no bf16; use fp16 or no")
    if choice == "fp16" and not torch.cuda.is_available():
        raise SystemExit("error: --mixed_precision fp16 needs a CUDA GPU; use bf16 or no on a CPU")
    return choice


def checkpointing_arguments(training_arguments_class, enabled):
    """--gradient_checkpointing as TrainingArguments takes it: ``activation_checkpointing`` (Transformers 5.x, where
    ``gradient_checkpointing`` is a deprecated alias) or ``gradient_checkpointing``. Non-reentrant checkpointing
    also works with a frozen embedding (LoRA), without enable_input_require_grads."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(training_arguments_class)}
    prefix = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {prefix: enabled, f"{prefix}_kwargs": {"use_reentrant": False} if enabled else None}


def make_callbacks(max_steps, metrics, log_every):
    """metrics.csv (one row per optimizer step, the other examples' columns) and a short printed line every
    ``log_every`` steps, from what Trainer logs (logging_steps=1: every step's loss, lr and grad norm)."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import ProgressCallback

    class Metrics(TrainerCallback):
        def __init__(self):
            self.rows, self.step_start, self.elapsed, self.last_tokens = {}, None, 0.0, 0

        def on_train_begin(self, args_, state, control, **kwargs):
            self.last_tokens = state.num_input_tokens_seen
            # elapsed training time so far (kept in the checkpoint's metrics.csv on resume)
            self.elapsed = metrics.last_elapsed

        def on_step_begin(self, args_, state, control, **kwargs):
            self.flush(state.global_step)           # the previous step's row is complete (log, eval, save)
            self.step_start = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_time = time.perf_counter() - self.step_start
            self.elapsed += step_time
            tokens = state.num_input_tokens_seen
            row = self.rows.setdefault(state.global_step, {"step": state.global_step})
            row.update(epoch=round(state.epoch, 4), tokens=tokens, step_time_s=step_time, elapsed_s=self.elapsed,
                       tokens_per_s=(tokens - self.last_tokens) / max(step_time, 1e-9))
            self.last_tokens = tokens
            if state.global_step >= state.max_steps:
                control.should_evaluate = True      # the final evaluation, inside the loop (a checkpoint has it)

        def on_log(self, args_, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "loss" not in logs and "eval_loss" not in logs:
                return                              # Trainer's end-of-training summary (runtime, mean loss)
            row = self.rows.setdefault(state.global_step, {"step": state.global_step})
            if "loss" in logs:
                row.update(loss=logs["loss"], lr=logs.get("learning_rate"), grad_norm=logs.get("grad_norm"))
            if "eval_loss" in logs:
                row.update(eval_loss=logs["eval_loss"], eval_ppl=math.exp(min(logs["eval_loss"], 50.0)))
            step = state.global_step
            if state.is_world_process_zero and ("eval_loss" in logs or (
                    "loss" in logs and (step % log_every == 0 or step == max_steps))):
                if "eval_loss" in logs and step == 0:
                    line = f"step 0 (base model): eval loss {logs['eval_loss']:.4f} ppl {row['eval_ppl']:.2f}"
                elif "eval_loss" in logs:
                    line = f"step {step}/{max_steps} eval loss {logs['eval_loss']:.4f} ppl {row['eval_ppl']:.2f}"
                else:
                    line = (f"step {step}/{max_steps} loss {logs['loss']:.4f} lr {row['lr']:.2e} "
                            f"tokens/s {row.get('tokens_per_s', 0):,.0f}")
                progress.write(line)

        def on_save(self, args_, state, control, **kwargs):
            # the metrics so far go with the checkpoint: a resume into another folder continues the CSV
            self.flush(state.global_step)
            folder = Path(args_.output_dir) / f"checkpoint-{state.global_step}"
            if state.is_world_process_zero and metrics.enabled and folder.is_dir():
                shutil.copy(metrics.path, folder / "metrics.csv")

        def on_train_end(self, args_, state, control, **kwargs):
            self.flush(state.global_step)

        def flush(self, upto):
            for step in sorted(self.rows):
                if step <= upto:
                    metrics.log(**self.rows.pop(step))

    class QuietProgress(ProgressCallback):
        """Trainer's progress bar without its dict print of every log (the Metrics lines replace it)."""

        def on_log(self, args_, state, control, logs=None, **kwargs):
            pass

        def write(self, line):
            if self.training_bar is not None:
                self.training_bar.write(line)      # above the bar, not through it
            else:
                print(line, flush=True)

    progress = QuietProgress()
    return Metrics(), progress


class ResumableCSV(CSVLogger):
    """CSVLogger (metrics.csv), remembering the elapsed training time of the rows it kept on resume."""

    def __init__(self, path, enabled=True, resume_step=None, restore_from=None):
        super().__init__(path, enabled, resume_step, restore_from)
        self.last_elapsed = 0.0
        if enabled and resume_step is not None:
            rows = [r for r in read_metrics(self.path) if r.get("elapsed_s")]
            self.last_elapsed = float(rows[-1]["elapsed_s"]) if rows else 0.0


def main(argv=None):
    args = parse_args(argv)
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments, set_seed
    from transformers.trainer_callback import ProgressCallback

    out = Path(args.output_dir)
    # Before anything is loaded: a resume that cannot happen stops here, with one line.
    resume_path = checkpoints.find_checkpoint(args.resume_from_checkpoint, out, TRAINER_STATE) if args.resume_from_checkpoint else None
    precision = mixed_precision(args)

    # TrainingArguments first: it sets up the processes (torchrun / accelerate launch) and the device. The number
    # of steps, which needs the data, is filled in below.
    training_args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=args.per_device_batch_size,
        per_device_eval_batch_size=args.per_device_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,        # 0: no clipping
        lr_scheduler_type=args.lr_scheduler_type,
        max_steps=1,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        **checkpointing_arguments(TrainingArguments, args.gradient_checkpointing),
        logging_strategy="steps",
        logging_steps=1,                          # every step's loss for metrics.csv
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps,
        # The base model's eval loss (step 0), the number the fine-tuning should bring down. Inside train(), after
        # the model is wrapped: a trainer.evaluate() before train() leaves the model unwrapped under DDP
        # (Transformers 5.23: no DistributedDataParallel, each process trains its own copy).
        eval_on_start=not args.resume_from_checkpoint,
        save_strategy="steps" if args.checkpointing_steps else "no",
        save_steps=args.checkpointing_steps or 500,
        report_to=args.report_to if args.with_tracking else "none",
        seed=args.seed,
        # documents in a flattened row are counted whole: all tokens are real ("non_padding" would skip EOS,
        # which is also the pad token of the embedded tokenizer)
        include_num_input_tokens_seen="all",
        remove_unused_columns=False,             # the dataset holds input_ids only; the collator makes the rest
        dataloader_pin_memory=torch.cuda.is_available(),
    )
    from accelerate import PartialState
    _ = training_args.device                      # sets up the processes (lazily done by TrainingArguments)
    state = PartialState()                        # the one TrainingArguments set up: .print, .device
    if training_args.process_index == 0:
        out.mkdir(parents=True, exist_ok=True)

    with training_args.main_process_first(desc="tokenizer, data and demo base model"):
        tokenizer, tokenized, model_path = models.finetune_documents(args, state)
        # One example per document piece (<= seq_len tokens); DataCollatorWithFlattening then lays the examples
        # of each micro-batch end to end. ("padded" rows are exactly those pieces; the mask is not needed.)
        lm_datasets = data.build_lm_dataset(tokenized, "padded", args.seq_len, args.per_device_batch_size)
        lm_datasets = lm_datasets.remove_columns([c for c in lm_datasets["train"].column_names if c != "input_ids"])
    world = training_args.world_size
    if len(lm_datasets["train"]) == 0:
        raise SystemExit("error: --train_file / --dataset_name: no training example after tokenization")
    if args.max_eval_batches:
        n_eval = min(args.max_eval_batches * args.per_device_batch_size * world, len(lm_datasets["validation"]))
        lm_datasets["validation"] = lm_datasets["validation"].select(range(n_eval))
    if world > 1:
        # Whole evaluation batches on every process: Trainer fills a short last round with repeated examples and
        # drops their losses after the gather, but each loss was scaled by the token count of its round (the
        # tokens of all processes), so the eval loss of an uneven set is off (by 0.2 in a test with 2 processes).
        per_round = args.per_device_batch_size * world
        keep = len(lm_datasets["validation"]) // per_round * per_round
        if keep == 0:
            raise SystemExit(f"error: --per_device_batch_size {args.per_device_batch_size}: fewer evaluation examples "
                             f"({len(lm_datasets['validation'])}) than one batch on each of the {world} processes")
        lm_datasets["validation"] = lm_datasets["validation"].select(range(keep))
    if len(lm_datasets["validation"]) == 0:
        raise SystemExit("error: --validation_split_percentage / --validation_file: no evaluation example")
    batches_per_epoch = math.ceil(len(lm_datasets["train"]) / (args.per_device_batch_size * world))
    steps_per_epoch = max(1, batches_per_epoch // args.gradient_accumulation_steps)
    max_steps = args.max_steps or max(1, int(args.num_train_epochs * steps_per_epoch))
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, max_steps // 20)
    training_args.max_steps, training_args.warmup_steps = max_steps, warmup

    # Re-seed: the LoRA initialisation does not depend on whether the demo base model was trained in this
    # process or found in the cache.
    set_seed(args.seed)
    model = models.load_base_model(args, model_path)
    n_params = models.count_parameters(model)
    if args.lora:
        model, targets = models.add_lora(model, args)
        what = f"LoRA r={args.lora_r} alpha={args.lora_alpha:g} on {targets}"
    else:
        what = "full fine-tuning"
    trainable = models.count_parameters(model, trainable_only=True)
    tokens_per_step = args.per_device_batch_size * args.seq_len * args.gradient_accumulation_steps * world
    state.print(f"model: {model_path}, {n_params / 1e6:.2f}M parameters, attention {args.attn_implementation}, "
                f"{what}: {trainable:,} trainable; precision {precision if precision != 'no' else 'fp32'}"
                + (", gradient checkpointing" if args.gradient_checkpointing else ""))
    models.note_float32_attention(state, model, args.attn_implementation, precision)
    state.print(f"data: {len(lm_datasets['train'])} training documents (pieces of <= {args.seq_len} tokens), "
                f"{len(lm_datasets['validation'])} for evaluation; padding-free micro-batches of "
                f"{args.per_device_batch_size} documents; {max_steps} steps ({steps_per_epoch} per epoch), at most "
                f"{tokens_per_step:,} tokens per step = {args.per_device_batch_size} x {args.seq_len} x "
                f"{args.gradient_accumulation_steps} accumulation x {world} processes")
    if args.attn_implementation == "sagebwd":
        findings = sagebwd_hf.check_training_setup(model, tokens_per_step, warn=False)
        state.print("check_training_setup: " + ("; ".join(f"{f.code}: {f.message}" for f in findings)
                                                if findings else "ok"))

    resume_step = json.loads((resume_path / TRAINER_STATE).read_text())["global_step"] if resume_path else None
    metrics = ResumableCSV(out / "metrics.csv", enabled=training_args.process_index == 0, resume_step=resume_step,
                           restore_from=resume_path / "metrics.csv" if resume_path else None)
    log_every = args.log_every or max(1, max_steps // 10)
    metrics_cb, progress_cb = make_callbacks(max_steps, metrics, log_every)
    trainer = Trainer(model=model, args=training_args, train_dataset=lm_datasets["train"],
                      eval_dataset=lm_datasets["validation"], processing_class=tokenizer,
                      data_collator=DataCollatorWithFlattening(return_position_ids=True, separator_id=-100),
                      callbacks=[metrics_cb])
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(progress_cb)
    training.keep_loss_float32(trainer.accelerator)   # FSDP2 with bf16: the logged losses stay float32

    sagebwd_hf.reset_attention_stats()            # what ran in this run (this process), evaluation included
    if resume_path is not None:
        state.print(f"resuming from {resume_path} at step {resume_step}")
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=str(resume_path) if resume_path else None)
    wall = time.perf_counter() - start

    save_dir = out / ("adapter" if args.lora else "final_model")
    trainer.save_model(str(save_dir))             # the adapter only with --lora; with the tokenizer
    metrics.close()

    stats = sagebwd_hf.attention_stats()
    if trainer.is_world_process_zero():
        rows = read_metrics(out / "metrics.csv")
        train_rows = [r for r in rows if r["loss"]]
        eval_rows = [r for r in rows if r["eval_loss"]]
        final_loss = float(train_rows[-1]["loss"]) if train_rows else None
        final_eval = float(eval_rows[-1]["eval_loss"]) if eval_rows else None
        base_eval = float(eval_rows[0]["eval_loss"]) if eval_rows and int(eval_rows[0]["step"]) == 0 else None
        tokens = trainer.state.num_input_tokens_seen
        elapsed = float(train_rows[-1]["elapsed_s"]) if train_rows and train_rows[-1]["elapsed_s"] else wall
        summary = dict(
            attn_implementation=args.attn_implementation, lora=args.lora, model=str(model_path),
            parameters=n_params, trainable_parameters=trainable, steps=trainer.state.global_step,
            final_train_loss=final_loss, final_eval_loss=final_eval, base_eval_loss=base_eval,
            train_loss_last_10=(round(sum(float(r["loss"]) for r in train_rows[-10:]) / len(train_rows[-10:]), 6)
                                if train_rows else None),
            train_loss_mean=result.training_loss,
            resumed_from=str(resume_path) if resume_path else None, tokens=tokens,
            train_time_s=round(elapsed, 3), tokens_per_s=round(tokens / max(elapsed, 1e-9), 1),
            mixed_precision=precision, gradient_checkpointing=args.gradient_checkpointing,
            batching="padding_free (DataCollatorWithFlattening)", tokens_per_step=tokens_per_step,
            num_processes=world, distributed_type=str(state.distributed_type.value),
            device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            saved_to=str(save_dir), attention_stats=stats)
        (out / "run_summary.json").write_text(json.dumps(summary, indent=1))
        paths = ", ".join(f"{k} {v}" for k, v in stats["paths"].items()) or "none"
        fallback = (", fallback " + ", ".join(f"{k} {v}" for k, v in stats["fallback"].items())
                    if stats["fallback"] else "")
        print(f"done: {trainer.state.global_step} steps, train loss {final_loss:.4f}, eval loss "
              + (f"{base_eval:.4f} -> " if base_eval is not None else "") + f"{final_eval:.4f}, "
              f"{args.attn_implementation} ({'LoRA' if args.lora else 'full'}), SageBwd attention calls: {paths}"
              f"{fallback}; {wall:.0f} s; saved {save_dir}, summary {out / 'run_summary.json'}", flush=True)
    del trainer, model                  # the DDP wrapper before the process group: see training.end_training
    training.release_process_group()


if __name__ == "__main__":
    main()
