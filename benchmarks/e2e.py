"""End-to-end training throughput: a Llama-3.2-1B-shaped model (random init, bf16) trained with each
attention implementation, tokens per second. Needs a CUDA GPU.

Model: LlamaConfig with Llama-3.2-1B's shape: hidden 2048, 16 layers, 32 query heads and 8 KV heads of
head_dim 64, MLP 8192, vocab 128256, tied embeddings (1.24B parameters); random init in bf16 on the GPU.
One training step = forward + backward + AdamW step (torch's default foreach AdamW, bf16 parameters and
states, "pure bf16") + zero_grad, on random token ids, --tokens tokens per step (default 32K: batch 8 at
4K, 4 at 8K, 1 at 32K). Tokens/s = tokens per step * timed steps / wall time (synchronized), after
--warmup untimed steps (the first compiles sagebwd's Triton kernels).

Loss: by default a chunked fused linear + cross-entropy (lm_head and the loss per --loss-chunk tokens,
gradients computed in the forward, never the whole [tokens, 128256] logits: same FLOPs as the usual path,
~4 GiB less memory per 4K tokens of chunk). --loss hf uses the model's own loss on full fp32 logits
(~25 GiB more at 32K tokens per step).

Activation checkpointing: --grad-ckpt auto (default) runs without it and, if a sequence length runs out of
memory, reruns every implementation at that length, and those after it, with it (the CSV says which).

Implementations (all through Transformers' attention interface, the same model and weights):
  sagebwd     attn_implementation="sagebwd" (after `import sagebwd_hf`)
  sagebwd-fast  the same with sagebwd_hf.configure(model, precision="fast")   (not in the default list)
  sagebwd-fastest  the same with precision="fastest"                         (not in the default list)
  sdpa        attn_implementation="sdpa", torch's own backend choice (the kernels it ran are reported)
  sdpa-flash  "sdpa" inside sdpa_kernel(FLASH_ATTENTION)
  sdpa-cudnn  "sdpa" inside sdpa_kernel(CUDNN_ATTENTION)          (not in the default list)
  noop        an attention that costs ~nothing (out = q + repeated k + v; every weight still gets a
              gradient): the bound on any attention speedup

    python benchmarks/e2e.py                                   # seq 4K 8K 32K x sagebwd sdpa sdpa-flash noop
    python benchmarks/e2e.py --seqlens 8192 --impls sagebwd sdpa --steps 3 --csv e2e.csv
"""
import argparse
import csv
import gc
import os
import re
import sys
import time

DEVICE = "cuda"
IMPLS = ["sagebwd", "sagebwd-fast", "sagebwd-fastest", "sdpa", "sdpa-flash", "sdpa-cudnn", "noop"]
DEFAULT_IMPLS = ["sagebwd", "sdpa", "sdpa-flash", "noop"]
LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu",
                    attention_dropout=0.0, use_cache=False)


def noop_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """[B, Hq, S, D] out = q + (k + v) repeated to Hq heads, as [B, S, Hq, D]: a few elementwise ops."""
    b, hk, s, d = key.shape
    g = query.shape[1] // hk
    kv = (key + value)[:, :, None].expand(b, hk, g, s, d).reshape(b, hk * g, s, d)
    return (query + kv).transpose(1, 2), None


def fused_linear_cross_entropy(torch):
    class FusedLinearCE(torch.autograd.Function):
        """mean cross-entropy of (h @ w.T) against labels, chunk by chunk; dh and dw made in the forward."""

        @staticmethod
        def forward(ctx, h, w, labels, chunk):
            n = h.shape[0]
            dh = torch.empty_like(h)
            dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            for s in range(0, n, chunk):
                hc, yc = h[s:s + chunk], labels[s:s + chunk]
                logits = (hc @ w.t()).float()
                lse = torch.logsumexp(logits, -1)
                loss += (lse - logits.gather(1, yc[:, None]).squeeze(1)).sum()
                g = logits.sub_(lse[:, None]).exp_()                 # softmax, in place
                g[torch.arange(len(yc), device=g.device), yc] -= 1.0
                g = g.div_(n).to(h.dtype)
                dh[s:s + chunk] = g @ w
                dw += g.t() @ hc
                del logits, g
            ctx.save_for_backward(dh, dw.to(w.dtype))
            return loss / n

        @staticmethod
        def backward(ctx, grad):
            dh, dw = ctx.saved_tensors
            return dh * grad, dw * grad, None, None
    return FusedLinearCE.apply


def attention_kernels(torch, fn):
    """Names of the attention kernels fn() launches (torch profiler), classified; 'unknown' if it fails."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = {e.key for e in prof.key_averages()}
    except Exception as e:  # noqa: BLE001  (no CUPTI in some sandboxes)
        return f"unknown ({type(e).__name__})"
    kinds = set()
    for n in names:
        low = n.lower()
        if "cudnn" in low and ("sdpa" in low or "fmha" in low or "flash" in low or "attn" in low):
            kinds.add("cudnn")
        elif "flash_fwd" in low or "flash_bwd" in low or "pytorch_flash" in low:
            kinds.add("flash")
        elif "fmha" in low or "efficient_attention" in low or "mem_eff" in low:
            kinds.add("efficient")
        elif re.search(r"softmax|bmm", low) and "sdpa" in low:
            kinds.add("math")
    return "+".join(sorted(kinds)) or "none found"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 32768])
    p.add_argument("--tokens", type=int, default=32768, help="tokens per step (batch = tokens // seqlen, >= 1)")
    p.add_argument("--impls", nargs="+", default=DEFAULT_IMPLS, choices=IMPLS)
    p.add_argument("--steps", type=int, default=5, help="timed steps per (seqlen, impl)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--layers", type=int, default=16, help="decoder layers (16 = Llama-3.2-1B)")
    p.add_argument("--loss", choices=["fused", "hf"], default="fused")
    p.add_argument("--loss-chunk", type=int, default=4096, help="tokens per lm_head/loss chunk (--loss fused)")
    p.add_argument("--grad-ckpt", choices=["auto", "on", "off"], default="auto",
                   help="activation checkpointing: auto = only from the first length that runs out of memory")
    p.add_argument("--optimizer", choices=["adamw", "none"], default="adamw")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--csv", default=None)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile one step per (seqlen, impl) and print its N costliest GPU kernels")
    args = p.parse_args()

    import torch
    if not torch.cuda.is_available():
        sys.exit("e2e.py needs a CUDA GPU (torch.cuda.is_available() is False); run it on the device machine")
    for var in ("SAGEBWD_POISON", "TRITON_INTERPRET"):
        if os.environ.pop(var, None):
            print(f"# note: unset {var} for timing")
    import transformers
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig

    import sagebwd_hf  # registers "sagebwd"
    AttentionInterface.register("noop", noop_attention)   # no mask function: layers get attention_mask=None

    impl_of = {"sagebwd": ("sagebwd", None), "sagebwd-fast": ("sagebwd", None),
               "sagebwd-fastest": ("sagebwd", None), "sdpa": ("sdpa", None),
               "noop": ("noop", None),
               "sdpa-flash": ("sdpa", SDPBackend.FLASH_ATTENTION), "sdpa-cudnn": ("sdpa", SDPBackend.CUDNN_ATTENTION)}
    cfg = LlamaConfig(**dict(LLAMA_3_2_1B, num_hidden_layers=args.layers))
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr) if args.optimizer == "adamw" else None
    fused_ce = fused_linear_cross_entropy(torch)
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "gpu_gib": round(gib, 1), "params": n_params,
            "layers": args.layers, "loss_kind": args.loss, "optimizer": args.optimizer, "tokens_per_step": args.tokens}
    print("# " + " | ".join(f"{k} {v}" for k, v in meta.items()))

    def step(ids, labels):
        if args.loss == "fused":
            h = model.model(input_ids=ids, use_cache=False).last_hidden_state
            loss = fused_ce(h.flatten(0, 1), model.lm_head.weight, labels.flatten(), args.loss_chunk)
        else:
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        return loss

    def run_one(name, seq, ckpt):
        impl, backend = impl_of[name]
        model.set_attn_implementation(impl)
        if impl == "sagebwd":   # the numerics preset (None: the default, "accurate")
            sagebwd_hf.configure(model, precision={"sagebwd-fast": "fast", "sagebwd-fastest": "fastest"}.get(name))
        batch = max(1, args.tokens // seq)
        gen = torch.Generator(device=DEVICE).manual_seed(seq)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=DEVICE, generator=gen)
        labels = torch.randint(0, cfg.vocab_size, (batch, seq), device=DEVICE, generator=gen)
        row = dict(meta, seqlen=seq, batch=batch, impl=name, grad_ckpt=ckpt)
        torch.cuda.reset_peak_memory_stats()

        def steps(n):
            loss = None
            for _ in range(n):
                loss = step(ids, labels)
            return loss
        try:
            with sdpa_kernel([backend]) if backend is not None else _nullcontext():
                steps(max(0, args.warmup - 1))
                if impl == "sdpa":   # which SDPA kernels ran: profile one warmup step
                    row["sdpa_kernels"] = attention_kernels(torch, lambda: steps(1))
                elif args.warmup:
                    steps(1)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                loss = steps(args.steps)
                torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) / args.steps
                if args.profile:
                    print_profile(torch, f"seq {seq} {name}", lambda: steps(1), args.profile)
        except torch.cuda.OutOfMemoryError as e:
            row["error"] = "OOM: " + str(e).splitlines()[0][:120]
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        if "error" in row:
            return row
        row.update(step_ms=dt * 1e3, tokens_per_s=batch * seq / dt, final_loss=loss.item(),
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        return row

    rows = []
    ckpt = args.grad_ckpt == "on"
    for seq in args.seqlens:
        while True:
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
            seq_rows = []
            for name in args.impls:
                row = run_one(name, seq, ckpt)
                model.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.empty_cache()
                seq_rows.append(row)
                if "error" in row:
                    print(f"  seq {seq:>6} {name:<10} ckpt={ckpt!s:<5} {row['error']}", flush=True)
                else:
                    print(f"  seq {seq:>6} {name:<10} ckpt={ckpt!s:<5} {row['tokens_per_s'] / 1e3:7.1f} ktok/s  "
                          f"step {row['step_ms']:7.1f} ms  peak {row['peak_gib']:5.1f} GiB  "
                          f"loss {row['final_loss']:.3f}"
                          + (f"  sdpa kernels: {row['sdpa_kernels']}" if "sdpa_kernels" in row else ""), flush=True)
                if row.get("error", "").startswith("OOM") and args.grad_ckpt == "auto" and not ckpt:
                    break
            if any(r.get("error", "").startswith("OOM") for r in seq_rows) and args.grad_ckpt == "auto" and not ckpt:
                print(f"# seq {seq}: out of memory without activation checkpointing; rerunning this length "
                      "(and the ones after it) with it", flush=True)
                ckpt = True
                continue
            break
        by = {r["impl"]: r for r in seq_rows}
        for r in seq_rows:
            for ref in ("sdpa", "sdpa-flash", "noop"):
                b = by.get(ref, {})
                if "tokens_per_s" in r and "tokens_per_s" in b:
                    r[f"x_{ref}"] = r["tokens_per_s"] / b["tokens_per_s"]
            if "step_ms" in r and "step_ms" in by.get("noop", {}) and r["impl"] != "noop":
                r["attn_share"] = 1.0 - by["noop"]["step_ms"] / r["step_ms"]
        rows += seq_rows
        if args.csv:                 # after every length: a run stopped early keeps what it measured
            fields = list(dict.fromkeys(k for r in rows for k in r))
            with open(args.csv, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=fields)
                w.writeheader()
                w.writerows(rows)

    if args.csv and rows:
        print(f"# wrote {args.csv}")
    print_summary(rows, meta, args)


def print_profile(torch, title, fn, top):
    """One call of fn under the torch profiler: its GPU time by kernel, the ``top`` costliest, and the total."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]   # kernels, not the ops above them
    total = sum(e.self_device_time_total for e in events)
    print(f"# profile {title}: {total / 1e3:.1f} ms of GPU kernels in one step", flush=True)
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        ms = e.self_device_time_total / 1e3
        print(f"#   {ms:8.2f} ms {100 * ms * 1e3 / total:5.1f}% x{e.count:<5} {e.key[:100]}", flush=True)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def print_summary(rows, meta, args):
    f = lambda r, k, spec: format(r[k], spec) if r.get(k) is not None else "-"  # noqa: E731
    print(f"\n== e2e summary: {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | "
          f"transformers {meta['transformers']} ==")
    print(f"Llama-3.2-1B shape, {meta['layers']} layers, {meta['params'] / 1e9:.2f}B params, bf16, random init; "
          f"fwd+bwd+{'AdamW' if args.optimizer == 'adamw' else 'no optimizer'}; {args.tokens} tokens/step; "
          f"loss {'chunked fused' if args.loss == 'fused' else 'HF full logits'}")
    print(f"{'seq':>6} {'impl':<10} {'ckpt':<5} {'ktok/s':>7} {'step ms':>8} {'peak GiB':>8} {'x sdpa':>7} "
          f"{'x flash':>7} {'x noop':>7} {'attn share':>10}  sdpa kernels")
    for r in rows:
        if "error" in r:
            print(f"{r['seqlen']:>6} {r['impl']:<10} {str(r['grad_ckpt']):<5} {r['error']}")
            continue
        print(f"{r['seqlen']:>6} {r['impl']:<10} {str(r['grad_ckpt']):<5} {r['tokens_per_s'] / 1e3:>7.1f} "
              f"{r['step_ms']:>8.1f} {r['peak_gib']:>8.1f} {f(r, 'x_sdpa', '.3f'):>7} {f(r, 'x_sdpa-flash', '.3f'):>7} "
              f"{f(r, 'x_noop', '.3f'):>7} {f(r, 'attn_share', '.0%'):>10}  {r.get('sdpa_kernels', '')}")
    print("targets (sagebwd):")
    for seq, ref, bar in ((8192, "sdpa", 1.05), (8192, "sdpa-flash", 1.15), (32768, "sdpa", 1.15)):
        r = next((r for r in rows if r["seqlen"] == seq and r["impl"] == "sagebwd"), None)
        x = r.get(f"x_{ref}") if r else None
        print(f"  seq {seq} >= {bar:.2f}x {ref}: " + ("not measured" if x is None else
              f"{'PASS' if x >= bar else 'FAIL'}  {x:.3f}x"))


if __name__ == "__main__":
    main()
