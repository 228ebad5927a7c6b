"""The Accelerate training loop that pretrain.py and finetune_lora.py share: the Accelerator, AdamW, evaluation,
the loop itself (gradient accumulation, per-step metrics, evaluation and checkpoints, resuming mid-epoch) and a
clean end under DDP. The loop does not know how many processes run it: Accelerate shards the data, wraps the model
for DDP/FSDP, autocasts and accumulates. Losses are logged in float32 under every launcher (``mean_loss``,
``keep_loss_float32``)."""
import dataclasses
import gc
import math
import os
import time

import torch
from tqdm.auto import tqdm

from .checkpoints import save_checkpoint
from .context_parallel import parallelism_config, predicted_tokens, sequence_shards


def make_accelerator(args):
    """The Accelerator of ``--mixed_precision``, ``--gradient_accumulation_steps`` and ``--with_tracking``, with
    the launcher's settings (``accelerate launch`` / ``accelerate config``: processes, DDP, FSDP), a seedable
    sampler, and FSDP2 made to return the loss in float32 (``keep_loss_float32``)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    kwargs = {}
    if args.with_tracking:
        kwargs["log_with"] = args.report_to
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # Seedable sampler: the shuffled order depends on (seed, epoch) only, so that two runs (sdpa and
        # sagebwd) see the same batches and a resumed run sees what the original would have seen.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        project_config=ProjectConfiguration(project_dir=args.output_dir,
                                            logging_dir=os.path.join(args.output_dir, "logs")),
        parallelism_config=parallelism_config(args),
        **kwargs,
    )
    keep_loss_float32(accelerator)
    return accelerator


def keep_loss_float32(accelerator):
    """Under FSDP2 with fp16/bf16 mixed precision, Accelerate's policy casts the model's outputs to that dtype
    (``MixedPrecisionPolicy.output_dtype``), the loss included: each process's loss would be a 16-bit number (in
    steps of 1/32 at a loss of 6), and so would their mean, in steps of 1/(32 x processes). The model computes its
    loss in float32 (Transformers upcasts the logits), so the outputs are left in the dtype they are computed in;
    the parameters still compute in 16 bits and gradients are reduced as configured: the gradients are the same.
    A no-op under any other launcher. Call before ``accelerator.prepare`` (Trainer: on ``trainer.accelerator``
    before ``train``)."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "mixed_precision_policy", None)
    if (getattr(plugin, "fsdp_version", 1) == 2
            and getattr(policy, "output_dtype", None) in (torch.float16, torch.bfloat16)):
        plugin.mixed_precision_policy = dataclasses.replace(policy, output_dtype=None)


def mean_loss(accelerator, losses) -> float:
    """One optimizer step's loss: the mean of its micro-batch losses over micro-batches and processes, each loss
    upcast to float32 before the mean and the cross-process reduction (so that a float16/bfloat16 loss does not
    round the logged mean to its own few digits)."""
    local = torch.stack([loss.detach().float() for loss in losses]).mean()
    return accelerator.reduce(local, "mean").item()


def step_line(step, max_steps, loss, lr, tokens_per_s, eval_loss=None, eval_ppl=None) -> str:
    """The printed line of an optimizer step (and of its evaluation): losses with 4 decimals."""
    line = f"step {step}/{max_steps} loss {loss:.4f} lr {lr:.2e} tokens/s {tokens_per_s:,.0f}"
    if eval_loss is not None:
        line += f" | eval loss {eval_loss:.4f} ppl {eval_ppl:.2f}"
    return line


def adamw(model, lr, weight_decay, betas=(0.9, 0.95)):
    """AdamW with weight decay on matrices only (not on norms' gains or biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)


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


@torch.no_grad()
def evaluate(accelerator, model, dataloader, max_batches=None):
    """Token-weighted mean loss over the evaluation set (all processes), and its perplexity; accumulated in
    float64 from each batch's loss. ``(None, None)`` when the set has no token to predict (e.g. no validation row
    as long as ``--seq_len``): no number rather than a loss of 0."""
    model.eval()
    loss_sum = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    count = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    for i, batch in enumerate(dataloader):
        if max_batches is not None and i >= max_batches:
            break
        with sequence_shards(accelerator, batch):
            loss = model(**batch).loss
        # The model's loss is the mean over predicted tokens: labels shifted by one, -100 ignored.
        n = predicted_tokens(batch)
        loss_sum += loss.double() * n
        count += n
    loss_sum, count = accelerator.reduce(loss_sum, "sum"), accelerator.reduce(count, "sum")
    model.train()
    if count.item() == 0:
        return None, None
    mean = (loss_sum / count).item()
    return mean, math.exp(min(mean, 50.0))


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
                with sequence_shards(accelerator, batch):      # (a null context without --context_parallel)
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                grad_norm = None
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            micro += 1
            step_losses.append(loss.detach())
            step_tokens += count_tokens(batch)
            if not accelerator.sync_gradients:
                continue

            # One optimizer step done: average the loss over micro-batches and processes, sum the tokens.
            step += 1
            step_loss = mean_loss(accelerator, step_losses)
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
            printed = step % log_every == 0 or step == max_steps or eval_loss is not None
            if printed and accelerator.is_local_main_process:
                progress.write(step_line(step, max_steps, step_loss, row["lr"], row["tokens_per_s"], eval_loss,
                                         eval_ppl))
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
