#!/usr/bin/env python
"""LoRA fine-tuning of a causal LM with SageBwd INT8 attention, using PEFT and Accelerate.

    python examples/finetune_lora.py                  # CPU default: embedded demo base model and book, ~2 min
    accelerate launch examples/finetune_lora.py --model_name_or_path Qwen/Qwen2.5-0.5B \\
        --dataset_name Salesforce/wikitext --dataset_config_name wikitext-2-raw-v1 \\
        --seq_len 1024 --mixed_precision bf16 --gradient_checkpointing
    accelerate launch --multi_gpu --num_processes 2 examples/finetune_lora.py ...                # DDP

Base model: --model_name_or_path, a hub name or a local folder (a model saved after sagebwd_hf.add_qk_norm,
e.g. examples/pretrain.py --qk_norm's final_model, is loaded with its QK-norm gains). Without it, the
script makes its own *demo base model*, since nothing can be downloaded on an offline machine: a tiny Llama
(the pretrain.py "tiny" preset) pre-trained with SDPA for --demo_base_steps steps on the first half of the
training documents; it is cached (SAGEBWD_EXAMPLES_CACHE, default ~/.cache/sagebwd-hf-examples) and the
LoRA then fine-tunes it on the second half, which it has not seen. Default --learning_rate: 3e-3 for the
tiny demo base model, 2e-4 with --model_name_or_path.

Data: the embedded book by default (or --dataset_name / --train_file). By default one document per row,
padded per batch (the mask goes to SageBwd's varlen path, no dense mask); --packing packs documents into
fixed-length rows; --padding_free lays them end to end with restarting position_ids (no padding).

Outputs in OUTPUT_DIR: metrics.csv (loss per step, eval loss and perplexity at step 0, every --eval_steps
and at the end), checkpoint-N folders (--checkpointing_steps; --resume_from_checkpoint), and the adapter in
OUTPUT_DIR/adapter (adapter_config.json, adapter_model.safetensors, the tokenizer).
"""
import argparse
import os
import sys
from pathlib import Path

from accelerate.utils import set_seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import arguments, checkpoints, data, models, training

import sagebwd_hf  # registers attn_implementation="sagebwd" with Transformers

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
DEFAULT_LR, DEMO_LR = 2e-4, 3e-3       # --learning_rate default with --model_name_or_path / with the demo base


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=arguments.HelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--model_name_or_path", default=None,
                       help="base model: hub name or local folder (default: the cached demo base model)")
    model.add_argument("--tokenizer_name", default=None, help="default: the base model's tokenizer")
    arguments.add_attn_implementation_argument(model)
    model.add_argument("--model_dtype", default="float32", choices=tuple(models.DTYPES),
                       help="dtype of the frozen base weights (LoRA weights stay float32)")
    model.add_argument("--demo_base_steps", type=int, default=300,
                       help="pre-training steps of the demo base model (only without --model_name_or_path)")
    lora = parser.add_argument_group("LoRA")
    lora.add_argument("--lora_r", type=int, default=16, help="LoRA rank")
    lora.add_argument("--lora_alpha", type=float, default=32, help="LoRA scaling numerator (scale = alpha / r)")
    lora.add_argument("--lora_dropout", type=float, default=0.05,
                      help="dropout on the LoRA input (a resumed run draws other dropout masks than an "
                           "uninterrupted one; with 0 a resume reproduces it exactly)")
    lora.add_argument("--lora_target_modules", default="all-linear",
                      help="comma-separated module names (e.g. q_proj,k_proj,v_proj,o_proj) or all-linear")
    arguments.add_data_arguments(parser)
    batching = parser.add_mutually_exclusive_group()
    batching.add_argument("--packing", action="store_true",
                          help="pack documents into fixed-length rows of --seq_len tokens (default: one padded "
                               "document per row)")
    batching.add_argument("--padding_free", action="store_true",
                          help="documents end to end with restarting position_ids: no padding, no attention "
                               "across documents")
    arguments.add_training_arguments(parser, output_dir="runs/finetune_lora", lr=None, max_steps=None, batch_size=8,
                                     seq_len=128)
    parser.add_argument("--num_train_epochs", type=float, default=3,
                        help="epochs over the training data, unless --max_steps is given")
    parser.add_argument("--lr_scheduler_type", default="cosine", choices=SCHEDULERS)
    args = parser.parse_args(argv)
    arguments.check_positive(args, "seq_len", "per_device_batch_size", "gradient_accumulation_steps", "max_steps",
                             "learning_rate", "eval_steps", "checkpointing_steps", "num_train_epochs", "lora_r",
                             "lora_alpha", "demo_base_steps")
    if args.learning_rate is None:
        # LoRA on a real pre-trained model wants a small step; the tiny demo base model learns faster with more.
        args.learning_rate = DEMO_LR if args.model_name_or_path is None else DEFAULT_LR
    if not 0 <= args.lora_dropout < 1:
        parser.error(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}")
    arguments.check_files(args, "train_file", "validation_file")
    return args


def main(argv=None):
    args = parse_args(argv)
    from transformers import get_scheduler

    accelerator = training.make_accelerator(args)
    set_seed(args.seed)
    out = Path(args.output_dir)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    mode = "packed" if args.packing else "padding_free" if args.padding_free else "padded"

    with accelerator.main_process_first():
        tokenizer, tokenized, model_path = models.finetune_documents(args, accelerator)
        lm_datasets = data.build_lm_dataset(tokenized, mode, args.seq_len, args.per_device_batch_size)
    train_dataloader, eval_dataloader = data.make_dataloaders(lm_datasets, mode, tokenizer,
                                                              args.per_device_batch_size)

    # Re-seed: the LoRA initialisation and dropout then do not depend on whether the demo base model was
    # trained in this process or found in the cache.
    set_seed(args.seed)
    model = models.load_base_model(args, model_path)
    if args.gradient_checkpointing:
        models.enable_activation_checkpointing(model)
    model, targets = models.add_lora(model, args)
    trainable, total = models.count_parameters(model, trainable_only=True), models.count_parameters(model)
    accelerator.print(f"model: {model_path}, attention {args.attn_implementation}; LoRA r={args.lora_r} "
                      f"alpha={args.lora_alpha} on {targets}: {trainable:,} trainable of {total:,} parameters")
    models.note_float32_attention(accelerator, model, args.attn_implementation, accelerator.mixed_precision)

    optimizer = training.adamw(model, args.learning_rate, args.weight_decay, betas=(0.9, 0.999))
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader)
    batches_per_epoch = len(train_dataloader)
    steps_per_epoch = max(1, batches_per_epoch // args.gradient_accumulation_steps)
    max_steps = args.max_steps or max(1, int(args.num_train_epochs * steps_per_epoch))
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, max_steps // 20)
    # Accelerate steps a prepared scheduler once per process: step counts times num_processes, as in its examples.
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup * accelerator.num_processes,
                              num_training_steps=max_steps * accelerator.num_processes)
    scheduler = accelerator.prepare(scheduler)
    tokens_per_step = (args.per_device_batch_size * args.seq_len * args.gradient_accumulation_steps
                       * accelerator.num_processes)
    accelerator.print(f"data: {len(lm_datasets['train'])} training rows ({mode}), {len(lm_datasets['validation'])} "
                      f"validation rows; {max_steps} steps ({steps_per_epoch} per epoch); at most "
                      f"{tokens_per_step:,} tokens per step")
    if args.with_tracking:
        accelerator.init_trackers("sagebwd_finetune_lora", config={k: v for k, v in vars(args).items()
                                                                   if isinstance(v, (int, float, str, bool))})

    state, metrics, resume_path = checkpoints.resume(accelerator, args, out)
    if resume_path is None:
        # The base model's loss on the evaluation data: the number the fine-tuning should bring down.
        eval_loss, eval_ppl = training.evaluate(accelerator, model, eval_dataloader, args.max_eval_batches)
        metrics.log(step=0, eval_loss=eval_loss, eval_ppl=eval_ppl)
        if eval_loss is not None:
            accelerator.print(f"step 0 (base model): eval loss {eval_loss:.4f} ppl {eval_ppl:.2f}")

    training.train(accelerator, args, model, optimizer, scheduler, train_dataloader, eval_dataloader, out, state,
                   metrics, max_steps, max(1, max_steps // 10), desc="finetune_lora")

    # The adapter only (a few MB): adapter_config.json + adapter_model.safetensors. get_state_dict gathers
    # FSDP shards; PEFT's save_pretrained keeps the LoRA weights of the full state dict.
    adapter_dir = out / "adapter"
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(adapter_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        tokenizer.save_pretrained(adapter_dir)
    accelerator.print(f"saved the adapter to {adapter_dir} (base model: {model_path}); load it with "
                      "peft.PeftModel.from_pretrained(base_model, adapter_dir)")
    del model, optimizer, scheduler, train_dataloader, eval_dataloader   # before the process group: see end_training
    training.end_training(accelerator)


if __name__ == "__main__":
    main()
