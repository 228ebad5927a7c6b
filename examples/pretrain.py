#!/usr/bin/env python
"""Pre-train a Llama- or Qwen3-style causal LM from scratch with SageBwd INT8 attention, using Accelerate.

    python examples/pretrain.py                       # CPU default: tiny Llama on the embedded book, ~2 min
    accelerate launch examples/pretrain.py --size 60m --seq_len 1024 --mixed_precision bf16
    accelerate launch --multi_gpu --num_processes 2 examples/pretrain.py --size 60m ...          # DDP
    accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 examples/pretrain.py ...     # FSDP
    accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 --mixed_precision bf16 examples/pretrain.py \
        --size 60m --seq_len 32768 --per_device_batch_size 1 --context_parallel 2      # one sequence over 2 GPUs

The script itself does not know how many processes run it: Accelerate places the model, shards the data,
wraps the model for DDP/FSDP, autocasts (--mixed_precision) and accumulates gradients.

Model: a size preset (--size tiny|60m|1b, --model_type llama|qwen3) or --config_name (a config.json, a
folder, or a hub name), built with random weights. SageBwd's stability switches (arXiv 2603.02170): --qk_norm
adds Qwen3-style QK-norm to a Llama (needed above ~2^19 tokens per step), --no_k_smoothing turns off
K-smoothing (on by default; the paper finds it essential), --q_smoothing turns on Q-smoothing. --precision fast
trains with SageBwd's cheaper numerics preset (sagebwd_hf.numerics). The tokens per optimizer step are printed
and checked by sagebwd_hf.check_training_setup.

Data: the embedded book by default (or --dataset_name / --train_file), packed into fixed-length rows, or
--padding_free rows with restarting position_ids (no padding, no attention across documents). A .npy
--train_file holds token ids already (examples/code_corpus.py builds one from the installed Python sources:
tens of millions of tokens, offline); it is read through a memory map, with no `datasets` needed. Cosine
schedule with linear warm-up; metrics per step in OUTPUT_DIR/metrics.csv; checkpoints with
--checkpointing_steps and --resume_from_checkpoint; the final model in OUTPUT_DIR/final_model.

Same start for two runs (examples/compare_runs.py does this): --save_init FILE writes the initial weights,
--init_from FILE loads them; with the same --seed both runs also see the same batches in the same order.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
from accelerate.utils import set_seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import arguments, checkpoints, context_parallel, data, models, training

import sagebwd_hf  # registers attn_implementation="sagebwd" with Transformers
from sagebwd_hf import numerics

# Peak learning rates that work for each preset (smaller models tolerate larger steps).
PRESET_LR = {"tiny": 3e-3, "60m": 1e-3, "1b": 3e-4}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=arguments.HelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--model_type", default="llama", choices=models.MODEL_TYPES,
                       help="architecture of the size preset (qwen3 has QK-norm built in)")
    model.add_argument("--size", default="tiny", choices=tuple(models.MODEL_PRESETS),
                       help="size preset: tiny (~1M, CPU), 60m (~56M, GPU proof), 1b (Llama-3.2-1B shape)")
    model.add_argument("--config_name", default=None,
                       help="a config.json, a folder holding one, or a hub name: overrides --model_type/--size")
    model.add_argument("--tokenizer_name", default=None,
                       help="hub name or folder; default: a BPE trained offline on the embedded book")
    arguments.add_attn_implementation_argument(model)
    model.add_argument("--qk_norm", action="store_true",
                       help="add QK-norm (per-head RMSNorm on q and k, as Qwen3) with sagebwd_hf.add_qk_norm")
    model.add_argument("--no_k_smoothing", action="store_true", help="turn SageBwd's K-smoothing off")
    model.add_argument("--q_smoothing", action="store_true", help="turn SageBwd's Q-smoothing on")
    model.add_argument("--precision", default="accurate", metavar="PRESET",
                       help="SageBwd's numerics preset (sagebwd_hf.numerics): accurate, fast (P·V and Pᵀ·dO in FP8 "
                            "e4m3 with fixed P scales; on GPUs the Hopper kernels compute it), or rule names joined "
                            "by '+' (pv_e4m3, p_static, ds_tile)")
    model.add_argument("--init_from", default=None, help="load the initial weights from this .safetensors file")
    model.add_argument("--save_init", default=None, help="save the initial weights to this .safetensors file")
    model.add_argument("--no_save_model", action="store_true", help="do not write OUTPUT_DIR/final_model")
    arguments.add_data_arguments(parser)
    parser.add_argument("--padding_free", action="store_true",
                        help="padding-free rows (documents end to end, position_ids restarting, no attention "
                             "across documents) instead of fixed-length packed rows")
    arguments.add_training_arguments(parser, output_dir="runs/pretrain", lr=None, max_steps=200, batch_size=8,
                                     seq_len=128)
    parser.add_argument("--context_parallel", type=int, default=1, metavar="N",
                        help="shard every sequence over N processes (torch's context parallelism, ring attention; "
                             "with accelerate launch --use_fsdp --fsdp_version 2); sagebwd runs the ring on its "
                             "kernels behind SDPA")
    parser.add_argument("--min_lr_ratio", type=float, default=0.1, help="cosine schedule ends at lr * this")
    parser.add_argument("--log_every", type=int, default=None,
                        help="print a metrics line every N steps (default: 10 lines per run)")
    parser.set_defaults(weight_decay=0.1)
    args = parser.parse_args(argv)
    arguments.check_positive(args, "seq_len", "per_device_batch_size", "gradient_accumulation_steps", "max_steps",
                             "learning_rate", "eval_steps", "checkpointing_steps", "log_every")
    if args.learning_rate is None:
        args.learning_rate = PRESET_LR[args.size]
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.max_steps // 20)
    if args.init_from and args.save_init:
        parser.error("--init_from and --save_init: give one of them")
    check_precision(parser, args)
    arguments.check_files(args, "train_file", "validation_file", "init_from")
    context_parallel.check(args)
    if data.is_token_file(args.train_file):
        if args.padding_free:
            raise SystemExit("error: --padding_free needs documents; a token file (.npy --train_file) gives "
                             "packed rows only")
        if args.tokenizer_name is None:
            raise SystemExit("error: a token file (.npy --train_file) needs --tokenizer_name: the tokenizer "
                             "that made it")
    return args


def check_precision(parser, args):
    """--precision checked and made canonical ("pv_e4m3+p_static" -> "fast"). Only the sagebwd backend computes a
    preset, and under --context_parallel the ring runs SageBwd's kernels behind SDPA at "accurate": a cheaper
    preset there would be a run that silently is not what it says."""
    try:
        args.precision = numerics.precision_name(numerics.parse_precision(args.precision, "--precision"))
    except ValueError as error:
        parser.error(str(error))
    if args.precision == "accurate":
        return
    if args.attn_implementation != "sagebwd":
        parser.error(f"--precision {args.precision} is SageBwd's numerics: it needs --attn_implementation sagebwd "
                     f"(got {args.attn_implementation})")
    if args.context_parallel > 1:
        parser.error(f"--precision {args.precision} with --context_parallel {args.context_parallel}: the ring "
                     "attention runs SageBwd's kernels behind SDPA at precision 'accurate' only")


def build_model(args, tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.config_name:
        config = AutoConfig.from_pretrained(args.config_name)
        if getattr(config, "vocab_size", 0) < len(tokenizer):
            raise SystemExit(f"error: --config_name vocab_size {config.vocab_size} is smaller than the "
                             f"tokenizer's {len(tokenizer)} tokens")
        arguments.check_fits_positions(config, args.seq_len, "--config_name")
    else:
        config = models.preset_config(args.model_type, args.size, tokenizer, args.seq_len)
    # Same seed, same config -> same weights, whatever the attention implementation.
    set_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn_implementation)
    if args.qk_norm:
        sagebwd_hf.add_qk_norm(model)
    smoothing = {}
    if args.no_k_smoothing:
        smoothing["k_smoothing"] = False
    if args.q_smoothing:
        smoothing["q_smoothing"] = True
    preset = {"precision": args.precision} if args.precision != "accurate" else {}
    if smoothing or preset:
        # Stored in model.config.sagebwd: saved with the model, read by the sagebwd backend on every call.
        sagebwd_hf.configure(model, **smoothing, **preset)
    if args.init_from:
        from safetensors.torch import load_model
        missing, unexpected = load_model(model, args.init_from, strict=False)
        if missing or unexpected:
            raise SystemExit(f"error: --init_from {args.init_from} does not match this model: missing "
                             f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]} (same --size, "
                             "--model_type and --qk_norm as the run that saved it?)")
    if args.gradient_checkpointing:
        models.enable_activation_checkpointing(model)
    return model


def main(argv=None):
    args = parse_args(argv)
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    accelerator = training.make_accelerator(args)
    set_seed(args.seed)
    out = Path(args.output_dir)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)

    # Data: the main process tokenizes (and fills the datasets cache) first, the others then read its cache.
    mode = "padding_free" if args.padding_free else "packed"
    with accelerator.main_process_first():
        tokenizer = data.load_tokenizer(args.tokenizer_name)
        if data.is_token_file(args.train_file):      # pre-tokenized (code_corpus.py): no datasets needed
            lm_datasets = data.token_file_datasets(args, tokenizer, args.seq_len)
        else:
            raw = data.load_raw_datasets(args)
            tokenized = data.tokenize_documents(raw, tokenizer, args.text_column)
            lm_datasets = data.build_lm_dataset(tokenized, mode, args.seq_len, args.per_device_batch_size)
    train_dataloader, eval_dataloader = data.make_dataloaders(lm_datasets, mode, tokenizer,
                                                              args.per_device_batch_size)

    model = build_model(args, tokenizer)
    context_parallel.setup(args)
    if args.save_init and accelerator.is_main_process:
        from safetensors.torch import save_model
        Path(args.save_init).parent.mkdir(parents=True, exist_ok=True)
        save_model(model, args.save_init)        # handles the tied embedding / lm_head weight
    n_params = models.count_parameters(model)
    n_params_body = n_params - model.get_input_embeddings().weight.numel()

    # Tokens per optimizer step, the quantity the paper's stability findings are stated in.
    world = accelerator.num_processes
    replicas = world // args.context_parallel      # the processes of one context-parallel group share sequences
    tokens_per_step = args.per_device_batch_size * args.seq_len * args.gradient_accumulation_steps * replicas
    accelerator.print(f"model: {type(model).__name__}, {n_params / 1e6:.2f}M parameters "
                      f"({n_params_body / 1e6:.2f}M outside the embeddings), attention {args.attn_implementation}, "
                      f"QK-norm {'yes' if sagebwd_hf.has_qk_norm(model) else 'no'}"
                      + (f", {sagebwd_hf.get_options(model)}" if args.attn_implementation == "sagebwd" else ""))
    models.note_float32_attention(accelerator, model, args.attn_implementation, accelerator.mixed_precision)
    accelerator.print(f"data: {len(lm_datasets['train'])} training rows ({mode}), "
                      f"{len(lm_datasets['validation'])} validation rows")
    sharded = (f" (data-parallel; each sequence over {args.context_parallel} context-parallel processes)"
               if args.context_parallel > 1 else "")
    accelerator.print(f"tokens per optimizer step: {tokens_per_step:,} = {args.per_device_batch_size} sequences x "
                      f"{args.seq_len} tokens x {args.gradient_accumulation_steps} accumulation x {replicas} "
                      f"processes{sharded}"
                      + (" (an upper bound: padding-free rows hold whole documents)" if args.padding_free else ""))
    if args.attn_implementation == "sagebwd":
        findings = sagebwd_hf.check_training_setup(model, tokens_per_step)
        accelerator.print("check_training_setup: " + ("; ".join(f"{f.code}: {f.message}" for f in findings)
                                                      if findings else "ok"))

    optimizer = training.adamw(model, args.learning_rate, args.weight_decay)
    # The scheduler is stepped once per process by Accelerate's wrapper (it assumes per-process batches):
    # hence the step counts times num_processes, as in Accelerate's own examples.
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=args.warmup_steps * world, num_training_steps=args.max_steps * world,
        min_lr_rate=args.min_lr_ratio)
    model, optimizer, train_dataloader, eval_dataloader, scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, scheduler)

    if args.with_tracking:
        accelerator.init_trackers("sagebwd_pretrain", config={k: v for k, v in vars(args).items()
                                                             if isinstance(v, (int, float, str, bool))})

    state, metrics, _ = checkpoints.resume(accelerator, args, out)
    log_every = args.log_every or max(1, args.max_steps // 10)
    end = training.train(accelerator, args, model, optimizer, scheduler, train_dataloader, eval_dataloader, out,
                         state, metrics, args.max_steps, log_every, desc="pretrain")

    if not args.no_save_model:
        final = out / "final_model"
        unwrapped = accelerator.unwrap_model(model)
        # get_state_dict gathers FSDP shards; save_pretrained also records the QK-norm for load_with_qk_norm.
        state_dict = accelerator.get_state_dict(model)
        unwrapped.save_pretrained(final, is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save, state_dict=state_dict)
        if accelerator.is_main_process:
            tokenizer.save_pretrained(final)
        accelerator.print(f"saved the model to {final}"
                          + (" (load it with sagebwd_hf.load_with_qk_norm)" if args.qk_norm else ""))
    if accelerator.is_main_process:
        tokens, elapsed = end["tokens"], end["elapsed_s"]
        summary = dict(attn_implementation=args.attn_implementation, precision=args.precision,
                       parameters=n_params, steps=end["step"],
                       tokens_per_step=tokens_per_step, tokens=tokens, train_time_s=round(elapsed, 3),
                       tokens_per_s=round(tokens / max(elapsed, 1e-9), 1), eval_loss=end["eval_loss"],
                       num_processes=world, mixed_precision=accelerator.mixed_precision,
                       distributed_type=str(accelerator.distributed_type.value),
                       device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
        (out / "run_summary.json").write_text(json.dumps(summary, indent=1))
    del model, optimizer, scheduler, train_dataloader, eval_dataloader   # before the process group: see end_training
    training.end_training(accelerator)


if __name__ == "__main__":
    main()
