"""Packed and padded fine-tuning as users run it: a Llama-3.2-1B-shaped model trained on documents of long-tailed
lengths, packed into one row by Transformers' DataCollatorWithFlattening or padded with an attention mask, with
each attention implementation. Needs a CUDA GPU.

Model: e2e.py's LLAMA_3_2_1B shape (hidden 2048, 32 query / 8 KV heads of dim 64, MLP 8192, vocab 128256, tied
embeddings), --layers of its 16 (default 8), random init (seed 0), bf16 on the GPU. --modes full: every weight
trained, AdamW (torch's default foreach, bf16 states); lora: PEFT LoRA (r=16, alpha 32, no dropout) on q/k/v/o,
AdamW over the adapters. Loss: the causal LM loss (position t predicts label t+1, -100 ignored, summed over the
step's micro-batches and divided by the step's label count, as Trainer's num_items_in_batch), computed as a chunked
fused lm_head + cross-entropy (never the whole logits; same FLOPs).

Documents: lognormal lengths (sigma 1, mean 750 before the cap at 4096 tokens, ~720 after; median ~455), random
token ids, fixed seed, drawn until they hold --tokens tokens (the last one cut to fit); the same documents for
every batch kind, mode and implementation.
  packed  one row [1, tokens] made by transformers.DataCollatorWithFlattening itself: position_ids restarting at
          each document, labels -100 at each document's first token; --flash-kwargs adds cu_seq_lens_q/k and
          max_length_q/k (return_flash_attn_kwargs=True). No attention_mask.
  padded  the same documents in order, --pad-batch of them per micro-batch (default 8, as
          per_device_train_batch_size), each right-padded to its longest with an attention_mask and labels -100 on
          the padding; one step accumulates the gradients of all micro-batches (the real tokens per step are the
          packed row's; the padded tokens ~2.9x more at 8 a batch). --pad-batch 0: all documents in one batch.

Attention implementations (one model, switched with set_attn_implementation):
  sdpa          Transformers' "sdpa": a packed row gets a block-causal 4D mask from its restarting position_ids
                (masking_utils finds the packed sequences), a padded batch a 4D mask from the attention_mask;
                torch picks the kernel (the CSV's sdpa_kernels says which ran)
  fa2-varlen    FlashAttention 2's varlen kernel as flash_attention_2 users get it, the one torch ships:
                torch.ops.aten._flash_attention_forward with cu_seqlens (its autograd backward is
                aten._flash_attention_backward), registered as the Transformers attention "fa2_varlen" with
                masking_utils.flash_attention_mask; cu_seqlens from the collator's kwargs, else from restarting
                position_ids (in each layer, as Transformers' flash path), padded batches unpadded by the 2D mask
  sagebwd       attn_implementation="sagebwd"
  sagebwd-fastest  the same with precision="fastest" (sagebwd_hf.configure; not in the default list)
  sagebwd-sdpa  the fa2-varlen function with sagebwd_hf.sdpa_flash active: SageBwd's kernels behind torch's
                varlen flash op

Per (mode, tokens, batch kind, implementation): the median step time (forward + backward of every micro-batch +
AdamW step + zero_grad, synchronized) over --steps (default 3) after --warmup (default 1: it compiles sagebwd's
Triton kernels), tokens/s of real tokens, peak memory of the timed steps, and the attention op alone: the
attention function's forward + backward on layer 0's own q/k/v, mask and kwargs, captured from the last warmup
step (the function is wrapped in AttentionInterface for that step), timed as median wall time (synchronized) over
--attn-reps calls per micro-batch, times the layer count, summed over micro-batches. That is the attention's part
of a step with the host work inside the function (cu_seqlens derivation, unpadding) and without the model's
once-per-forward mask creation or activation checkpointing's recomputed forward. Speedups against sdpa and
fa2-varlen are their time / this one's. As a correctness check before each group is timed: the cosine between
each implementation's last hidden state and sdpa's on the group's first micro-batch (forward only, real tokens).
Activation checkpointing: --grad-ckpt auto reruns an implementation that runs out of memory with it (column ckpt;
a step speedup between rows that differ in it is marked "*"). sdpa on a packed 64K-token row may need it on an
80 GB GPU: its block-causal mask is dense (64K x 64K), and torch's SDPA turns a boolean mask into an additive bias
in every layer.

    python benchmarks/packed_finetune.py                                    # 16K tokens, packed+padded, full
    python benchmarks/packed_finetune.py --tokens 16384 65536 --modes full lora --csv packed_finetune.csv
    python benchmarks/packed_finetune.py --tokens 32768 --kinds packed --flash-kwargs --impls fa2-varlen sagebwd
"""
import argparse
import contextlib
import csv
import gc
import math
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DataCollatorWithFlattening
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e import LLAMA_3_2_1B, attention_kernels   # (benchmarks/ is the script's folder)

DEVICE = "cuda"
IMPLS = ["sdpa", "fa2-varlen", "sagebwd", "sagebwd-sdpa"]
CHOICES = IMPLS + ["sagebwd-fastest"]
KINDS = ["packed", "padded"]
MODES = ["full", "lora"]
FA2_VARLEN = "fa2_varlen"
# implementation -> the name the model is switched to (and whose attention function is timed)
ATTN_NAME = {"sdpa": "sdpa", "fa2-varlen": FA2_VARLEN, "sagebwd": "sagebwd", "sagebwd-fastest": "sagebwd",
             "sagebwd-sdpa": FA2_VARLEN}
DOC_MEAN, DOC_SIGMA, DOC_MAX = 750, 1.0, 4096
IGNORE = -100
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


# ---------------------------------------------------------------------------------------------------
# Documents and batches (CPU)
# ---------------------------------------------------------------------------------------------------

def document_lengths(tokens, seed=0, mean=DOC_MEAN, sigma=DOC_SIGMA, max_len=DOC_MAX):
    """Lognormal lengths (``mean`` before the cap at ``max_len``, at least 2), drawn until they hold ``tokens``;
    the last is cut so that they sum to exactly ``tokens``. A larger ``tokens`` extends the same draw."""
    rng = random.Random(seed)
    mu = math.log(mean) - sigma ** 2 / 2
    lengths, total = [], 0
    while total < tokens:
        n = min(max_len, max(2, round(rng.lognormvariate(mu, sigma))), tokens - total)
        lengths.append(n)
        total += n
    return lengths


def make_documents(lengths, vocab_size, seed=0):
    """One example ``{"input_ids": [...]}`` per length, random ids in [1, vocab_size) (0 is the padding id)."""
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, vocab_size, (n,), generator=gen).tolist()} for n in lengths]


def packed_batch(examples, flash_kwargs=False):
    """The documents as DataCollatorWithFlattening makes them: input_ids, labels, position_ids ``[1, total]``,
    and with ``flash_kwargs`` cu_seq_lens_q/k (int32) and max_length_q/k (ints)."""
    return DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(examples)


def padded_batches(examples, pad_batch, pad_id=0):
    """The documents in order, ``pad_batch`` a batch (0: all in one), each right-padded to its longest:
    input_ids, attention_mask, labels (-100 on the padding) ``[B, L]``."""
    size = pad_batch or len(examples)
    batches = []
    for start in range(0, len(examples), size):
        docs = [e["input_ids"] for e in examples[start:start + size]]
        width = max(len(d) for d in docs)
        ids = torch.full((len(docs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(docs), width), dtype=torch.long)
        for row, doc in enumerate(docs):
            ids[row, :len(doc)] = torch.tensor(doc)
            mask[row, :len(doc)] = 1
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)})
    return batches


def label_positions(labels):
    """The causal LM loss's pairs: ``(index, targets)``, the flat positions ``b * S + t`` of ``[B, S]`` whose next
    label ``labels[b, t + 1]`` counts (not -100), and those labels."""
    following = labels[:, 1:]
    keep = following != IGNORE
    rows, cols = keep.nonzero(as_tuple=True)
    return rows * labels.shape[1] + cols, following[keep]


# ---------------------------------------------------------------------------------------------------
# FlashAttention 2's varlen kernel (torch's own) as a Transformers attention function
# ---------------------------------------------------------------------------------------------------

def unpad_indices(mask):
    """A 2D padding mask ``[B, S]`` -> (flat indices of its real tokens, cu_seqlens int32 ``[B + 1]``, longest
    row), as Transformers' flash path unpads."""
    lengths = mask.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    return indices, cu, int(lengths.max())


def cu_seqlens_from_position_ids(position_ids, batch, seq):
    """cu_seqlens int32 and the longest sequence of a ``[batch, seq]`` batch whose sequences start where the
    position id is the smallest one (restarting position_ids, as Transformers' flash path reads them) and at every
    row's start; without restarts, one sequence a row."""
    positions = position_ids.expand(batch, seq).reshape(-1)
    starts = positions == positions.min()
    starts[::seq] = True
    cu = torch.cat([torch.nonzero(starts, as_tuple=False).flatten(),
                    torch.tensor([batch * seq], device=positions.device)]).to(torch.int32)
    return cu, int(cu.diff().max())


def _flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """torch's FlashAttention op on packed ``[T, H, D]`` tensors, causal, no dropout; arguments that torch 2.11's
    and later schemas share."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                   scale=scale)[0]


def fa2_varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                         sliding_window=None, softcap=None, **kwargs):
    """``AttentionInterface`` entry: query ``[B, Hq, S, D]``, key/value ``[B, Hkv, S, D]`` (GQA native) ->
    ``([B, S, Hq, D], None)``, causal self-attention only (what the benchmark's model needs)."""
    if dropout or sliding_window or softcap or not (is_causal if is_causal is not None
                                                     else getattr(module, "is_causal", True)):
        raise NotImplementedError("fa2_varlen: causal attention without dropout, window or soft cap only")
    batch, heads, seq, _ = query.shape
    if key.shape[2] != seq:
        raise NotImplementedError("fa2_varlen: self-attention without a cache only")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))     # [B, S, H, D]
    if attention_mask is not None:                                  # padding: unpad, attend, pad back
        if attention_mask.dim() != 2:
            raise ValueError("fa2_varlen: expects the 2D mask of masking_utils.flash_attention_mask")
        indices, cu, longest = unpad_indices(attention_mask.bool())
        q, k, v = (x.reshape(batch * seq, *x.shape[2:]).index_select(0, indices) for x in (q, k, v))
        out = _flash_varlen(q, k, v, cu, cu, longest, longest, scaling)
        full = out.new_zeros(batch * seq, *out.shape[1:]).index_copy(0, indices, out)
        return full.view(batch, seq, *out.shape[1:]), None
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("max_length_q") is not None:
        cu_q, cu_k = kwargs["cu_seq_lens_q"].to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32)
        max_q, max_k = int(kwargs["max_length_q"]), int(kwargs["max_length_k"])
    elif kwargs.get("position_ids") is not None:
        cu_q, max_q = cu_seqlens_from_position_ids(kwargs["position_ids"], batch, seq)
        cu_k, max_k = cu_q, max_q
    else:
        cu_q = cu_k = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=query.device)
        max_q = max_k = seq
    q, k, v = (x.reshape(batch * seq, *x.shape[2:]) for x in (q, k, v))
    out = _flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scaling)
    return out.view(batch, seq, *out.shape[1:]), None


def register_fa2_varlen():
    AttentionInterface.register(FA2_VARLEN, fa2_varlen_attention)
    AttentionMaskInterface.register(FA2_VARLEN, flash_attention_mask)


# ---------------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------------

class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum of cross-entropy(h @ w.T, targets) / denominator, ``chunk`` rows at a time; dh and dw (only those that
    need a gradient: no dw for a frozen lm_head) made in the forward."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, denominator):
        need_dh, need_dw = ctx.needs_input_grad[:2]
        dh = torch.empty_like(h) if need_dh else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_dw else None
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            hc, yc = h[s:s + chunk], targets[s:s + chunk]
            logits = (hc @ weight.t()).float()
            lse = torch.logsumexp(logits, -1)
            loss += (lse - logits.gather(1, yc[:, None]).squeeze(1)).sum()
            if need_dh or need_dw:
                g = logits.sub_(lse[:, None]).exp_()                  # softmax, in place
                g[torch.arange(len(yc), device=g.device), yc] -= 1.0
                g = g.div_(denominator).to(h.dtype)
                if need_dh:
                    dh[s:s + chunk] = g @ weight
                if need_dw:
                    dw += g.t() @ hc
            del logits
        ctx.grads = (dh, None if dw is None else dw.to(weight.dtype))
        return loss / denominator

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.grads
        del ctx.grads
        return (None if dh is None else dh * grad, None if dw is None else dw * grad, None, None, None)


def chunked_lm_loss(hidden, weight, index, targets, denominator, chunk=4096):
    """The causal LM loss of ``hidden [B, S, D]`` at ``label_positions``' ``index``/``targets``, summed and divided
    by ``denominator`` (the step's label count)."""
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    return _ChunkedLinearCrossEntropy.apply(h, weight, targets, chunk, denominator)


# ---------------------------------------------------------------------------------------------------
# Timing helpers (GPU)
# ---------------------------------------------------------------------------------------------------

class LayerZeroCapture:
    """While active, the attention function registered as ``name`` records layer 0's calls (module, detached
    q/k/v, mask, kwargs) and runs as before. ``recording`` False skips calls (activation checkpointing's
    recomputation in the backward)."""

    def __init__(self, name):
        self.name, self.calls, self.recording = name, [], True

    def __enter__(self):
        self.original = ALL_ATTENTION_FUNCTIONS[self.name]

        def capturing(module, query, key, value, attention_mask, **kwargs):
            if self.recording and getattr(module, "layer_idx", 0) == 0:
                self.calls.append((module, query.detach(), key.detach(), value.detach(), attention_mask, kwargs))
            return self.original(module, query, key, value, attention_mask, **kwargs)
        AttentionInterface.register(self.name, capturing)
        return self

    def __exit__(self, *exc):
        AttentionInterface.register(self.name, self.original)
        return False


def median_wall_ms(fn, reps):
    """Median wall time (ms, synchronized) of ``fn()`` over ``reps`` calls, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def attention_op_ms(fn, calls, reps):
    """Forward + backward of the attention function ``fn`` on each captured call, median ms each, summed."""
    total = 0.0
    for module, query, key, value, mask, kwargs in calls:
        leaves = [x.detach().clone().requires_grad_() for x in (query, key, value)]
        grad = torch.randn_like(fn(module, *leaves, mask, **kwargs)[0])

        def once():
            for x in leaves:
                x.grad = None
            fn(module, *leaves, mask, **kwargs)[0].backward(grad)
        total += median_wall_ms(once, reps)
    return total


def captured_attention_ms(attn_name, run_step, reps, kernels_row=None):
    """Runs ``run_step(capture)`` with layer 0's attention calls captured, then times the attention function on
    them (``attention_op_ms``); with ``kernels_row``, also records which SDPA kernels one call launches. The
    captured tensors (SDPA's 4D mask among them) are freed on return, before the timed steps."""
    with LayerZeroCapture(attn_name) as capture:
        run_step(capture)
    fn = ALL_ATTENTION_FUNCTIONS[attn_name]
    ms = attention_op_ms(fn, capture.calls, reps)
    if kernels_row is not None:
        module, query, key, value, mask, kwargs = capture.calls[0]
        kernels_row["sdpa_kernels"] = attention_kernels(torch, lambda: fn(module, query, key, value, mask, **kwargs))
    return ms


def _to(batch, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def micro_batches(kind, examples, args, device):
    """The step's micro-batches: (model inputs, label index, targets), on ``device``."""
    collated = [packed_batch(examples, args.flash_kwargs)] if kind == "packed" else padded_batches(examples,
                                                                                                 args.pad_batch)
    out = []
    for batch in collated:
        index, targets = label_positions(batch["labels"])
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        out.append((_to(inputs, device), index.to(device), targets.to(device)))
    return out


# ---------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[16384], help="real tokens per step")
    p.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    p.add_argument("--impls", nargs="+", default=IMPLS, choices=CHOICES, help="sdpa and fa2-varlen are the references")
    p.add_argument("--modes", nargs="+", default=["full"], choices=MODES)
    p.add_argument("--lora", action="store_true", help="the same as --modes lora")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of Llama-3.2-1B's 16")
    p.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (>= 1: the last captures layer 0)")
    p.add_argument("--attn-reps", type=int, default=3, help="timed calls of the attention op per micro-batch")
    p.add_argument("--pad-batch", type=int, default=8, help="documents per padded micro-batch (0: all in one)")
    p.add_argument("--flash-kwargs", action="store_true",
                   help="packed rows carry cu_seq_lens_q/k and max_length_q/k (return_flash_attn_kwargs=True)")
    p.add_argument("--grad-ckpt", choices=["auto", "on", "off"], default="auto",
                   help="activation checkpointing: auto = rerun an implementation that runs out of memory with it")
    p.add_argument("--loss-chunk", type=int, default=4096, help="tokens per lm_head/loss chunk")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", default=None)
    args = p.parse_args()
    if args.lora:
        args.modes = ["lora"]
    args.warmup = max(1, args.warmup)

    if not torch.cuda.is_available():
        sys.exit("packed_finetune.py needs a CUDA GPU (torch.cuda.is_available() is False); run it on a GPU machine")
    for var in ("SAGEBWD_POISON", "TRITON_INTERPRET"):
        if os.environ.pop(var, None):
            print(f"# note: unset {var} for timing")
    import transformers
    import triton
    from transformers import LlamaConfig

    import sagebwd_hf  # noqa: F401  (registers "sagebwd")
    register_fa2_varlen()

    cfg = LlamaConfig(**dict(LLAMA_3_2_1B, num_hidden_layers=args.layers))
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "layers": args.layers, "pad_batch": args.pad_batch,
            "flash_kwargs": args.flash_kwargs}
    print("# " + " | ".join(f"{k} {v}" for k, v in meta.items()), flush=True)
    documents = {t: make_documents(document_lengths(t, args.seed), cfg.vocab_size, args.seed) for t in args.tokens}

    rows = []
    for mode in args.modes:
        run_mode(mode, args, cfg, meta, documents, rows)
        gc.collect()
        torch.cuda.empty_cache()

    if args.csv and rows:
        print(f"# wrote {args.csv}")
    print_summary(rows, meta)


def run_mode(mode, args, cfg, meta, documents, rows):
    """Builds the model for ``mode`` (full or lora) and measures every (tokens, kind, implementation) on it,
    appending to ``rows`` (and the CSV after every group)."""
    from transformers import AutoModelForCausalLM

    import sagebwd_hf
    from sagebwd_hf import sdpa_flash
    device = DEVICE
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    if mode == "lora":
        from peft import LoraConfig, get_peft_model
        get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr)
    trainable = sum(p.numel() for p in params)

    def step(batches, labels_in_step, capture=None):
        loss = 0.0
        for inputs, index, targets in batches:
            hidden = model.model(**inputs, use_cache=False).last_hidden_state
            part = chunked_lm_loss(hidden, model.lm_head.weight, index, targets, labels_in_step,
                                   args.loss_chunk)
            if capture is not None:
                capture.recording = False
            part.backward()
            if capture is not None:
                capture.recording = True
            loss += part.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    @contextlib.contextmanager
    def implementation(name):
        model.set_attn_implementation(ATTN_NAME[name])
        sagebwd_hf.configure(model, precision="fastest" if name == "sagebwd-fastest" else None)
        if name == "sagebwd-sdpa":
            sdpa_flash.activate()
        sagebwd_hf.reset_attention_stats()
        sdpa_flash.reset_stats()
        try:
            yield
        finally:
            if name == "sagebwd-sdpa":
                sdpa_flash.restore()

    def what_ran(name):
        if name in ("sagebwd", "sagebwd-fastest"):
            s = sagebwd_hf.attention_stats()
            return " ".join(f"{k}:{v}" for k, v in {**s["paths"], **{f"fallback:{r}": n for r, n in
                                                                     s["fallback"].items()}}.items())
        if name == "sagebwd-sdpa":
            s = sdpa_flash.stats()
            return f"SageBwd fwd:{s['forward']} bwd:{s['backward']}" + "".join(
                f" fallback:{r}:{n}" for r, n in s["fallback"].items())
        return ""

    @torch.no_grad()
    def last_hidden(batches):
        inputs = batches[0][0]
        h = model.model(**inputs, use_cache=False).last_hidden_state
        real = inputs.get("attention_mask")
        return (h[real.bool()] if real is not None else h.flatten(0, 1)).float()

    def cosines(batches):
        model.eval()
        out, ref = {}, None
        try:
            for name in ["sdpa"] + [n for n in args.impls if n != "sdpa"]:
                try:
                    with implementation(name):
                        h = last_hidden(batches)
                except Exception as e:  # noqa: BLE001  (reported in the timing row)
                    print(f"#   cos check {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    continue
                if name == "sdpa":
                    ref = h
                elif ref is not None:
                    out[name] = F.cosine_similarity(h.flatten(), ref.flatten(), dim=0).item()
                del h
        finally:
            model.train()
            gc.collect()
            torch.cuda.empty_cache()
        return out

    def run_one(name, batches, labels_in_step, row):
        attn_name = ATTN_NAME[name]
        try:
            with implementation(name):
                for _ in range(args.warmup - 1):
                    step(batches, labels_in_step)
                attn_ms = captured_attention_ms(attn_name, lambda c: step(batches, labels_in_step, c),
                                                args.attn_reps, row if name == "sdpa" else None) * args.layers
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                times = []
                for _ in range(args.steps):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    loss = step(batches, labels_in_step)
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                row["ran"] = what_ran(name)
        except torch.cuda.OutOfMemoryError as e:
            row["error"] = "OOM: " + str(e).splitlines()[0][:120]
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        finally:
            opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
        if "error" not in row:
            step_ms = statistics.median(times)
            row.update(step_ms=step_ms, tokens_per_s=row["tokens"] / step_ms * 1e3, attn_ms=attn_ms,
                       attn_share=attn_ms / step_ms, peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                       final_loss=float(loss))
        return row

    for tokens in args.tokens:
        examples = documents[tokens]
        for kind in args.kinds:
            batches = micro_batches(kind, examples, args, device)
            labels_in_step = sum(len(t) for _, _, t in batches)
            padded_tokens = sum(b[0]["input_ids"].numel() for b in batches)
            cos = cosines(batches)
            group = []
            for name in args.impls:
                ckpt = args.grad_ckpt == "on"
                while True:
                    if ckpt:
                        model.gradient_checkpointing_enable(
                            gradient_checkpointing_kwargs={"use_reentrant": False})
                    else:
                        model.gradient_checkpointing_disable()
                    row = dict(meta, mode=mode, trainable=trainable, kind=kind, tokens=tokens,
                               padded_tokens=padded_tokens, docs=len(examples), micro_batches=len(batches),
                               impl=name, grad_ckpt=ckpt, cos_vs_sdpa=1.0 if name == "sdpa" else cos.get(name))
                    run_one(name, batches, labels_in_step, row)
                    print_row(row)
                    if row.get("error", "").startswith("OOM") and args.grad_ckpt == "auto" and not ckpt:
                        ckpt = True                 # this implementation again, with checkpointing
                        continue
                    break
                group.append(row)
            add_ratios(group)
            rows += group
            if args.csv:               # after every group: a run stopped early keeps what it measured
                write_csv(args.csv, rows)
    model.gradient_checkpointing_disable()


def add_ratios(group):
    """x_<ref>: the reference's step time / this one's; attn_x_<ref>: the same for the attention op;
    ckpt_differs: the references whose row ran with activation checkpointing otherwise than this one."""
    by = {r["impl"]: r for r in group}
    for r in group:
        differs = []
        for ref in ("sdpa", "fa2-varlen"):
            b = by.get(ref, {})
            if "step_ms" in r and "step_ms" in b:
                r[f"x_{ref}"] = b["step_ms"] / r["step_ms"]
                r[f"attn_x_{ref}"] = b["attn_ms"] / r["attn_ms"]
                if b["grad_ckpt"] != r["grad_ckpt"]:
                    differs.append(ref)
        r["ckpt_differs"] = " ".join(differs)


def write_csv(path, rows):
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def print_row(r):
    head = f"  {r['mode']:<4} {r['kind']:<6} {r['tokens']:>6} {r['impl']:<12} ckpt={r['grad_ckpt']!s:<5}"
    if "error" in r:
        print(f"{head} {r['error']}", flush=True)
        return
    print(f"{head} step {r['step_ms']:8.1f} ms {r['tokens_per_s'] / 1e3:7.1f} ktok/s peak {r['peak_gib']:5.1f} GiB "
          f"attn {r['attn_ms']:7.1f} ms ({r['attn_share']:.0%}) loss {r['final_loss']:.3f}"
          + (f" cos {r['cos_vs_sdpa']:.5f}" if r.get("cos_vs_sdpa") is not None else "")
          + (f"  sdpa kernels: {r['sdpa_kernels']}" if r.get("sdpa_kernels") else "")
          + (f"  ran: {r['ran']}" if r.get("ran") else ""), flush=True)


def print_summary(rows, meta):
    def f(r, key, spec):   # a step speedup against a row that differs in activation checkpointing gets a "*"
        if r.get(key) is None:
            return "-"
        differs = key.startswith("x_") and key[2:] in r.get("ckpt_differs", "").split()
        return format(r[key], spec) + ("*" if differs else "")
    print(f"\n== packed/padded fine-tuning: {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | "
          f"transformers {meta['transformers']} ==")
    print(f"Llama-3.2-1B shape, {meta['layers']} layers, bf16, random init; fwd+bwd+AdamW; documents lognormal "
          f"(mean {DOC_MEAN} before the {DOC_MAX} cap); padded: {meta['pad_batch'] or 'all'} documents a micro-batch; "
          f"packed rows {'with' if meta['flash_kwargs'] else 'without'} cu_seq_lens")
    print(f"{'mode':<4} {'kind':<6} {'tokens':>6} {'padded':>7} {'impl':<12} {'ckpt':<5} {'step ms':>8} {'ktok/s':>7} "
          f"{'peak GiB':>8} {'x sdpa':>7} {'x fa2':>7} {'attn ms':>8} {'share':>6} {'attn x sdpa':>11} "
          f"{'attn x fa2':>10} {'cos':>8}")
    for r in rows:
        head = (f"{r['mode']:<4} {r['kind']:<6} {r['tokens']:>6} {r['padded_tokens']:>7} {r['impl']:<12} "
                f"{str(r['grad_ckpt']):<5}")
        if "error" in r:
            print(f"{head} {r['error']}")
            continue
        print(f"{head} {r['step_ms']:>8.1f} {r['tokens_per_s'] / 1e3:>7.1f} {r['peak_gib']:>8.1f} "
              f"{f(r, 'x_sdpa', '.3f'):>7} {f(r, 'x_fa2-varlen', '.3f'):>7} {r['attn_ms']:>8.1f} "
              f"{r['attn_share']:>6.0%} {f(r, 'attn_x_sdpa', '.3f'):>11} {f(r, 'attn_x_fa2-varlen', '.3f'):>10} "
              f"{f(r, 'cos_vs_sdpa', '.5f'):>8}")
    if any(r.get("ckpt_differs") for r in rows):
        print("* step against a row run otherwise with activation checkpointing (column ckpt)")
    print("targets (sagebwd against fa2-varlen): attention op >= 1.20x, step >= 1.00x, peak memory <= fa2-varlen's")
    for r in rows:
        if r["impl"] not in ("sagebwd", "sagebwd-fastest") or r.get("x_fa2-varlen") is None:
            continue
        ref = next(b for b in rows if b["impl"] == "fa2-varlen" and all(b[k] == r[k] for k in
                                                                         ("mode", "kind", "tokens")))
        checks = [("attn", r["attn_x_fa2-varlen"] >= 1.2), ("step", r["x_fa2-varlen"] >= 1.0),
                  ("memory", r["peak_gib"] <= ref["peak_gib"] * 1.001)]
        print(f"  {r['mode']:<4} {r['kind']:<6} {r['tokens']:>6}: attn {r['attn_x_fa2-varlen']:.3f}x, "
              f"step {f(r, 'x_fa2-varlen', '.3f')}x, peak {r['peak_gib']:.1f} vs {ref['peak_gib']:.1f} GiB: "
              + " ".join(f"{k} {'PASS' if ok else 'FAIL'}" for k, ok in checks))


if __name__ == "__main__":
    main()
