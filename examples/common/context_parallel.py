"""Context parallelism for the examples: one long sequence sharded over GPUs (``--context_parallel N``).

Accelerate's ``ParallelismConfig(cp_size=N)`` with FSDP2 runs torch's ``context_parallel``: inside
``accelerator.maybe_context_parallel`` each process holds a load-balanced shard of every sequence, and SDPA's
flash, efficient and cuDNN ops become ring attention. An ``attn_implementation="sagebwd"`` model sends its
attention through that ring on SageBwd's kernels once SageBwd is active behind SDPA (``sagebwd_hf.sdpa_flash``),
which ``setup`` does; it never attends within a shard only (``sagebwd_hf.context_parallel``).

A batch entering the shards carries what the shards cannot derive from their own tokens: the labels shifted
before sharding (``shift_labels``, which Transformers' loss takes as they are) and the global ``position_ids``.
"""
import contextlib
import os

import torch


def check(args):
    """Refuse what context parallelism cannot run, with the flag to change (before anything is loaded)."""
    cp = args.context_parallel
    if cp < 1:
        raise SystemExit(f"error: --context_parallel must be >= 1, got {cp}")
    if cp == 1:
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % cp:
        raise SystemExit(f"error: --context_parallel {cp} must divide the number of processes ({world}); launch "
                         f"with accelerate launch --num_processes N --use_fsdp --fsdp_version 2")
    if args.attn_implementation not in ("sagebwd", "sdpa"):
        raise SystemExit(f"error: --context_parallel needs --attn_implementation sagebwd or sdpa (ring attention "
                         f"runs SDPA's kernels), got {args.attn_implementation}")
    if getattr(args, "padding_free", False):
        raise SystemExit("error: --context_parallel shards whole causal sequences: it cannot take --padding_free "
                         "rows (their documents would need a mask)")
    if args.seq_len % (2 * cp):
        raise SystemExit(f"error: --seq_len {args.seq_len} must be a multiple of 2 x --context_parallel = {2 * cp} "
                         f"(each process holds two load-balanced chunks of every sequence)")


def parallelism_config(args):
    """Accelerate's ParallelismConfig for ``--context_parallel`` (the rest of the processes shard the model and
    the data, FSDP2), or None without it."""
    if getattr(args, "context_parallel", 1) == 1:
        return None
    from accelerate.parallelism_config import ParallelismConfig
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return ParallelismConfig(dp_shard_size=world // args.context_parallel, cp_size=args.context_parallel)


def setup(args):
    """Before the model runs: SageBwd behind SDPA, so that ring attention runs on its kernels."""
    if getattr(args, "context_parallel", 1) > 1 and args.attn_implementation == "sagebwd":
        from sagebwd_hf import sdpa_flash
        sdpa_flash.activate()


def sequence_shards(accelerator, batch):
    """A context in which ``batch`` (changed in place) holds this process's shard of every sequence; a null
    context without context parallelism. The forward and the backward both run inside it."""
    config = accelerator.parallelism_config
    if config is None or not config.cp_enabled:
        return contextlib.nullcontext()
    ids = batch["input_ids"]
    batch.pop("attention_mask", None)      # whole causal rows: the ring applies the causal pattern across shards
    batch["shift_labels"] = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    batch["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()
    buffers = [batch[name] for name in ("input_ids", "labels", "shift_labels", "position_ids")]
    return accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                              no_restore_buffers=set(buffers))


def predicted_tokens(batch):
    """Tokens the loss predicts in ``batch`` (this process's shard under context parallelism)."""
    if "shift_labels" in batch:
        return (batch["shift_labels"] != -100).sum()
    return (batch["labels"][..., 1:] != -100).sum()
