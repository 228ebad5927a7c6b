#!/usr/bin/env python
"""Train with SDPA and with SageBwd from the same initial weights on the same batches, then draw both loss
curves and their difference into a PNG with a summary table: the picture to look at before trusting INT8
attention with a training run.

    python examples/compare_runs.py                   # CPU default: two tiny pre-training runs, ~2-3 min
    python examples/compare_runs.py --output_dir runs/cmp60m -- \\
        --size 60m --seq_len 1024 --per_device_batch_size 8 --max_steps 300 --mixed_precision bf16
    python examples/compare_runs.py --launcher "accelerate launch --multi_gpu --num_processes 2" -- --size 60m ...
    python examples/compare_runs.py --metrics runs/a/metrics.csv runs/b/metrics.csv --labels sdpa sagebwd

Everything after ``--`` goes to examples/pretrain.py, once per attention implementation (the first one,
sdpa by default, is the reference). The first run saves its initial weights (--save_init) and the others
load them (--init_from); the same --seed gives every run the same batches in the same order. So the runs
differ in the attention implementation alone, and the difference of their losses is what INT8 attention
costs (plus the run-to-run noise of non-deterministic GPU kernels).

With --metrics, nothing is trained: the given metrics.csv files (or run folders holding one) are compared.

Outputs in --output_dir: one folder per run (metrics.csv, run_summary.json), comparison.png, summary.md
and summary.json. The summary: final loss of each run (mean of the last --last_n steps), final eval loss,
the mean and mean absolute loss gap over the last --last_n steps, and training tokens/s (the first
--skip_steps steps, compilation and autotuning, excluded). Without matplotlib the table is printed and the
PNG skipped; draw it later, anywhere, from the CSVs with --metrics.
"""
import argparse
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as common  # noqa: E402

PRETRAIN = Path(__file__).resolve().parent / "pretrain.py"
# pretrain.py flags that this script sets for each run itself.
RESERVED = ("--attn_implementation", "--output_dir", "--save_init", "--init_from")


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    forwarded = []
    if "--" in argv:
        cut = argv.index("--")
        argv, forwarded = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     usage="%(prog)s [options] [-- pretrain.py options]")
    parser.add_argument("--output_dir", default="runs/compare", help="where the runs, PNG and summary go")
    parser.add_argument("--attn_implementations", nargs="+", default=["sdpa", "sagebwd"],
                        choices=common.ATTN_IMPLEMENTATIONS, help="runs to make; the first is the reference")
    parser.add_argument("--launcher", default=None,
                        help="command that runs pretrain.py, e.g. \"accelerate launch --num_processes 2\" "
                             "(default: this Python interpreter)")
    parser.add_argument("--metrics", nargs="+", default=None,
                        help="compare these metrics.csv files (or run folders) instead of training")
    parser.add_argument("--labels", nargs="+", default=None, help="names of the --metrics runs")
    parser.add_argument("--last_n", type=int, default=20, help="steps at the end that the summary averages")
    parser.add_argument("--skip_steps", type=int, default=None,
                        help="first steps left out of tokens/s (default: 10%% of the steps, at least 1)")
    parser.add_argument("--smoothing", type=float, default=None,
                        help="weight of the exponential moving average drawn over the raw curves, in [0, 1) "
                             "(0: none; default: averages over about 2%% of the steps)")
    parser.add_argument("--title", default=None, help="title of the figure")
    args = parser.parse_args(argv)
    args.forwarded = forwarded
    for flag in forwarded:
        if flag.split("=")[0] in RESERVED:
            parser.error(f"{flag.split('=')[0]} is set by compare_runs.py for each run; leave it out of the "
                         f"pretrain.py options (use --attn_implementations / --output_dir)")
    if args.metrics is not None:
        if len(args.metrics) < 2:
            parser.error("--metrics needs at least two metrics.csv files or run folders")
        if args.labels is not None and len(args.labels) != len(args.metrics):
            parser.error(f"--labels: {len(args.labels)} labels for {len(args.metrics)} --metrics files")
    elif args.labels is not None:
        parser.error("--labels goes with --metrics (launched runs are named after their attention implementation)")
    elif len(set(args.attn_implementations)) < 2:
        parser.error("--attn_implementations needs at least two different implementations")
    if args.smoothing is not None and not 0 <= args.smoothing < 1:
        parser.error(f"--smoothing must be in [0, 1), got {args.smoothing}")
    if args.last_n <= 0:
        parser.error(f"--last_n must be > 0, got {args.last_n}")
    return args


def launch_runs(args, out):
    """Run pretrain.py once per attention implementation, all from the first run's initial weights."""
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
    init = out / "init.safetensors"
    paths = []
    for i, impl in enumerate(args.attn_implementations):
        run_dir = out / impl
        same_start = ["--save_init", str(init)] if i == 0 else ["--init_from", str(init)]
        cmd = launcher + [str(PRETRAIN)] + args.forwarded + ["--attn_implementation", impl,
                                                               "--output_dir", str(run_dir)] + same_start
        print(f"[compare_runs] run {i + 1}/{len(args.attn_implementations)}: {shlex.join(cmd)}", flush=True)
        result = subprocess.run(cmd)
        if result.returncode != 0:
            raise SystemExit(f"[compare_runs] the {impl} run failed (exit code {result.returncode})")
        paths.append(run_dir / "metrics.csv")
    return paths, list(args.attn_implementations)


def load_run(path):
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.csv"
    if not path.exists():
        raise SystemExit(f"error: no metrics file {path}")
    rows = common.read_metrics(path)
    train = [r for r in rows if r.get("loss")]
    if not train:
        raise SystemExit(f"error: {path} has no training rows")
    run = {"path": str(path),
           "step": [int(r["step"]) for r in train],
           "loss": [float(r["loss"]) for r in train],
           "tokens": [float(r["tokens"]) if r.get("tokens") else math.nan for r in train],
           "step_time": [float(r["step_time_s"]) if r.get("step_time_s") else math.nan for r in train],
           "eval": [(int(r["step"]), float(r["eval_loss"])) for r in rows if r.get("eval_loss")]}
    summary_file = path.parent / "run_summary.json"
    run["run_summary"] = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    return run


def ema(values, weight):
    """Exponential moving average, debiased as TensorBoard's (no pull towards the first value)."""
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        if not math.isfinite(v):
            out.append(math.nan)
            continue
        avg, norm = weight * avg + (1 - weight) * v, weight * norm + (1 - weight)
        out.append(avg / norm)
    return out


def mean(values):
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def throughput(run, skip):
    """Training tokens/s over the steps after the first ``skip`` (compilation, autotuning, warm caches)."""
    n = len(run["step"])
    skip = min(skip, n - 1)
    step_tokens = [b - a for a, b in zip([0.0] + run["tokens"][:-1], run["tokens"])]
    tokens = sum(step_tokens[skip:])
    seconds = sum(t for t in run["step_time"][skip:] if math.isfinite(t))
    return tokens / seconds if seconds > 0 else math.nan


def summarize(runs, labels, last_n, skip_steps):
    ref = runs[0]
    rows = []
    for run, label in zip(runs, labels):
        skip = skip_steps if skip_steps is not None else max(1, len(run["step"]) // 10)
        ref_loss = dict(zip(ref["step"], ref["loss"]))
        common_steps = [s for s in run["step"] if s in ref_loss]
        loss = dict(zip(run["step"], run["loss"]))
        gaps = [loss[s] - ref_loss[s] for s in common_steps]
        tail = gaps[-last_n:]
        row = {"run": label, "steps": run["step"][-1],
               "final_loss": mean(run["loss"][-last_n:]),
               "final_eval_loss": run["eval"][-1][1] if run["eval"] else None,
               "tokens_per_s": throughput(run, skip)}
        if run is not ref:
            row.update(mean_gap=mean(tail), mean_abs_gap=mean([abs(g) for g in tail]),
                       relative_gap=mean(tail) / mean(ref["loss"][-last_n:]) if tail else math.nan,
                       common_steps=len(common_steps))
        rows.append(row)
    ref_speed = rows[0]["tokens_per_s"]
    for row in rows:
        row["speed_vs_ref"] = row["tokens_per_s"] / ref_speed if ref_speed and math.isfinite(ref_speed) else math.nan
    return rows


def _f(value, fmt):
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, fmt)


def table_lines(rows, labels, last_n):
    header = ["run", "steps", f"final loss (last {last_n})", "final eval loss", f"gap vs {labels[0]} (mean)",
              "mean abs gap", "tokens/s", f"speed vs {labels[0]}"]
    body = [[r["run"], str(r["steps"]), _f(r["final_loss"], ".4f"), _f(r["final_eval_loss"], ".4f"),
             _f(r.get("mean_gap"), "+.4f") + (f" ({_f(100 * r['relative_gap'], '+.2f')}%)" if "relative_gap" in r
                                              else ""),
             _f(r.get("mean_abs_gap"), ".4f"), _f(r["tokens_per_s"], ",.0f"), _f(r["speed_vs_ref"], ".2f") + "x"]
            for r in rows]
    return header, body


def markdown(header, body):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def plot(runs, labels, rows, header, body, path, smoothing, title):
    try:
        import matplotlib
    except ImportError:
        print("[compare_runs] matplotlib is not installed: skipped the PNG (pip install matplotlib, then rerun "
              "with --metrics on the CSVs to draw it)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_gap, ax_table) = plt.subplots(3, 1, figsize=(10, 10.5),
                                                    gridspec_kw={"height_ratios": [3, 2, 1.1]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if smoothing is None:
        smoothing = 1.0 - 1.0 / max(1.0, max(len(r["step"]) for r in runs) / 50)
    for i, (run, label) in enumerate(zip(runs, labels)):
        c = colors[i % len(colors)]
        ax_loss.plot(run["step"], run["loss"], color=c, alpha=0.25, linewidth=0.8)
        # Later runs dashed: where the curves coincide, both stay visible.
        ax_loss.plot(run["step"], ema(run["loss"], smoothing), color=c, linewidth=1.8, label=f"{label} (train)",
                     linestyle="-" if i == 0 else "--")
        if run["eval"]:
            ax_loss.plot(*zip(*run["eval"]), "o--", color=c, markersize=4, linewidth=1, label=f"{label} (eval)")
    ax_loss.set_ylabel("loss")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_loss.set_title(title or f"{' vs '.join(labels)}: same initial weights, same batches")

    ref_loss = dict(zip(runs[0]["step"], runs[0]["loss"]))
    for i, (run, label) in enumerate(zip(runs[1:], labels[1:]), start=1):
        c = colors[i % len(colors)]
        steps = [s for s in run["step"] if s in ref_loss]
        loss = dict(zip(run["step"], run["loss"]))
        gap = [loss[s] - ref_loss[s] for s in steps]
        ax_gap.plot(steps, gap, color=c, alpha=0.25, linewidth=0.8)
        ax_gap.plot(steps, ema(gap, smoothing), color=c, linewidth=1.8, label=f"{label} - {labels[0]}")
    ax_gap.axhline(0.0, color="black", linewidth=0.8)
    ax_gap.set_ylabel(f"loss difference vs {labels[0]}")
    ax_gap.set_xlabel("optimizer step")
    ax_gap.legend()
    ax_gap.grid(alpha=0.3)

    ax_table.axis("off")
    table = ax_table.table(cellText=body, colLabels=header, loc="center", cellLoc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    table.scale(1, 1.4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.metrics is not None:
        paths = args.metrics
        labels = args.labels or [Path(p).parent.name if Path(p).is_file() else Path(p).name for p in paths]
    else:
        paths, labels = launch_runs(args, out)
    runs = [load_run(p) for p in paths]
    rows = summarize(runs, labels, args.last_n, args.skip_steps)
    header, body = table_lines(rows, labels, args.last_n)
    table = markdown(header, body)
    info = runs[0]["run_summary"]
    context = ""
    if info:
        context = (f"{info.get('parameters', 0) / 1e6:.1f}M parameters, {info.get('tokens_per_step', 0):,} tokens per "
                   f"step, {info.get('num_processes', 1)} process(es) ({info.get('distributed_type', '?')}), "
                   f"mixed precision {info.get('mixed_precision', '?')}, device {info.get('device', '?')}")
    print("\n" + (context + "\n\n" if context else "") + table + "\n")
    (out / "summary.md").write_text((context + "\n\n" if context else "") + table + "\n")
    (out / "summary.json").write_text(json.dumps({"context": info, "runs": rows, "metrics": [str(p) for p in paths]},
                                                 indent=1, default=str))
    png = plot(runs, labels, rows, header, body, out / "comparison.png", args.smoothing, args.title)
    if png:
        print(f"[compare_runs] wrote {png}, {out / 'summary.md'}, {out / 'summary.json'}")


if __name__ == "__main__":
    main()
