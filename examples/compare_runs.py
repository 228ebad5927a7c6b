#!/usr/bin/env python
"""Train with SDPA and with SageBwd from the same initial weights on the same batches, over several seeds, then
draw the loss curves, their difference and the run-to-run noise into a PNG with a summary table and a verdict:
the picture to look at before trusting INT8 attention with a training run.

    python examples/compare_runs.py                   # CPU default: 3 seeds x 2 tiny runs of 100 steps, ~2.5 min
    python examples/compare_runs.py --seeds 0 1 2 3 --output_dir runs/cmp60m -- \\
        --size 60m --seq_len 1024 --per_device_batch_size 8 --max_steps 300 --mixed_precision bf16
    python examples/compare_runs.py --launcher "accelerate launch --multi_gpu --num_processes 2" -- --size 60m ...
    python examples/compare_runs.py --metrics runs/compare/sdpa runs/compare/sagebwd    # redraw, no training
    python examples/compare_runs.py --metrics runs/a/metrics.csv runs/b/metrics.csv --labels sdpa sagebwd

Everything after ``--`` goes to examples/pretrain.py, once per attention implementation and seed (the first
implementation, sdpa by default, is the reference; with nothing after ``--``, ``--max_steps 100
--no_save_model``). For each
seed, the reference run saves its initial weights (--save_init) and the others load them (--init_from), and the
seed gives them the same batches in the same order: within a seed the runs differ in the attention
implementation alone.

Why several seeds: a tiny model trained at a high learning rate is chaotic, and the smallest difference
(INT8 rounding, or fp32 summation order) sends two runs apart by more than the INT8 error itself. One pair of
runs cannot tell the two apart; the spread of the gap across seeds can. The summary gives, per run, the final
loss (mean of the last --last_n steps) as mean and standard deviation over the seeds, the gap to the reference
paired by seed with a 95% confidence interval (Student's t over the seeds), and a verdict: the gap is larger
than the noise when that interval leaves out zero. The PNG draws the reference's seed-to-seed spread as a band
around its curve and around zero in the difference panel.

With --metrics, nothing is trained: each argument is a metrics.csv, a run folder holding one, or a folder of
``seed*/`` run folders (what this script writes per implementation).

Outputs in --output_dir: ``IMPL/seedN/`` per run (metrics.csv, run_summary.json), comparison.png, summary.md and
summary.json. Without matplotlib the table is printed and the PNG skipped; draw it later with --metrics.
"""
import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.arguments import ATTN_IMPLEMENTATIONS, HelpFormatter
from common.metrics import read_metrics

PRETRAIN = Path(__file__).resolve().parent / "pretrain.py"
# pretrain.py flags that this script sets for each run itself.
RESERVED = ("--attn_implementation", "--output_dir", "--save_init", "--init_from", "--seed")
# With nothing after "--": 3 seeds x 2 implementations x 100 steps of the tiny model, ~2.5 min on 2 CPU cores.
DEFAULT_PRETRAIN_ARGS = ["--max_steps", "100", "--no_save_model"]
# Student's t, two-sided 95%, by degrees of freedom (beyond 30: the normal 1.96 is within 4%).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    forwarded = []
    if "--" in argv:
        cut = argv.index("--")
        argv, forwarded = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter,
                                     usage="%(prog)s [options] [-- pretrain.py options]")
    parser.add_argument("--output_dir", default="runs/compare", help="where the runs, PNG and summary go")
    parser.add_argument("--attn_implementations", nargs="+", default=["sdpa", "sagebwd"],
                        choices=ATTN_IMPLEMENTATIONS, help="runs to make; the first is the reference")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                        help="one run per implementation and seed; two or more give a noise estimate")
    parser.add_argument("--launcher", default=None,
                        help="command that runs pretrain.py, e.g. \"accelerate launch --num_processes 2\" "
                             "(default: this Python interpreter)")
    parser.add_argument("--metrics", nargs="+", default=None,
                        help="compare these metrics.csv files, run folders or folders of seed*/ runs instead of "
                             "training")
    parser.add_argument("--labels", nargs="+", default=None, help="names of the --metrics runs")
    parser.add_argument("--last_n", type=int, default=20, help="steps at the end that the summary averages")
    parser.add_argument("--skip_steps", type=int, default=None,
                        help="first steps left out of tokens/s (default: 10%% of the steps, at least 1)")
    parser.add_argument("--smoothing", type=float, default=None,
                        help="weight of the exponential moving average drawn over the raw curves, in [0, 1) "
                             "(0: none; default: averages over about 2%% of the steps)")
    parser.add_argument("--title", default=None, help="title of the figure")
    args = parser.parse_args(argv)
    args.forwarded = forwarded if forwarded else list(DEFAULT_PRETRAIN_ARGS)
    for flag in forwarded:
        if flag.split("=")[0] in RESERVED:
            parser.error(f"{flag.split('=')[0]} is set by compare_runs.py for each run; leave it out of the "
                         f"pretrain.py options (use --attn_implementations / --output_dir / --seeds)")
    if args.metrics is not None:
        if len(args.metrics) < 2:
            parser.error("--metrics needs at least two metrics.csv files or run folders")
        if args.labels is not None and len(args.labels) != len(args.metrics):
            parser.error(f"--labels: {len(args.labels)} labels for {len(args.metrics)} --metrics files")
    elif args.labels is not None:
        parser.error("--labels goes with --metrics (launched runs are named after their attention implementation)")
    elif len(set(args.attn_implementations)) < 2:
        parser.error("--attn_implementations needs at least two different implementations")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds must be different from each other, got {args.seeds}")
    if args.smoothing is not None and not 0 <= args.smoothing < 1:
        parser.error(f"--smoothing must be in [0, 1), got {args.smoothing}")
    if args.last_n <= 0:
        parser.error(f"--last_n must be > 0, got {args.last_n}")
    return args


def launch_runs(args, out):
    """pretrain.py once per seed and attention implementation; within a seed, all from the same initial weights.
    Returns one list of metrics.csv paths (one per seed) per implementation."""
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
    groups = {impl: [] for impl in args.attn_implementations}
    total, done = len(args.seeds) * len(args.attn_implementations), 0
    for seed in args.seeds:
        init = out / f"init_seed{seed}.safetensors"
        for i, impl in enumerate(args.attn_implementations):
            run_dir = out / impl / f"seed{seed}"
            same_start = ["--save_init", str(init)] if i == 0 else ["--init_from", str(init)]
            cmd = launcher + [str(PRETRAIN)] + args.forwarded + ["--attn_implementation", impl, "--seed", str(seed),
                                                                   "--output_dir", str(run_dir)] + same_start
            done += 1
            print(f"[compare_runs] run {done}/{total}: {shlex.join(cmd)}", flush=True)
            result = subprocess.run(cmd)
            if result.returncode != 0:
                raise SystemExit(f"[compare_runs] the {impl} run with seed {seed} failed (exit code "
                                 f"{result.returncode})")
            groups[impl].append(run_dir / "metrics.csv")
    return list(groups.values()), list(groups)


def find_runs(path):
    """metrics.csv files behind one --metrics argument: the file, a run folder's, or each seed*/ folder's."""
    path = Path(path)
    if path.is_file():
        return [path]
    if (path / "metrics.csv").exists():
        return [path / "metrics.csv"]
    seeds = sorted((p for p in path.glob("seed*") if (p / "metrics.csv").exists()),
                   key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
    if not seeds:
        raise SystemExit(f"error: no metrics file {path}/metrics.csv and no {path}/seed*/metrics.csv")
    return [p / "metrics.csv" for p in seeds]


def load_run(path):
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.csv"
    if not path.exists():
        raise SystemExit(f"error: no metrics file {path}")
    rows = read_metrics(path)
    train = [r for r in rows if r.get("loss")]
    if not train:
        raise SystemExit(f"error: {path} has no training rows")
    run = {"path": str(path),
           "step": [int(r["step"]) for r in train],
           "loss": [float(r["loss"]) for r in train],
           "tokens": [float(r["tokens"]) if r.get("tokens") else math.nan for r in train],
           "step_time": [float(r["step_time_s"]) if r.get("step_time_s") else math.nan for r in train],
           "eval": [(int(r["step"]), float(r["eval_loss"])) for r in rows if r.get("eval_loss")]}
    # a seed*/ folder names the run's seed: runs of different implementations pair on it
    run["seed"] = path.parent.name if re.fullmatch(r"seed\d+", path.parent.name) else None
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
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def std(values):
    """Sample standard deviation (n - 1); nan below two values."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if len(values) < 2:
        return math.nan
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def ci95(values):
    """Half-width of the 95% confidence interval of the mean of ``values`` (Student's t); nan below two."""
    values = [v for v in values if math.isfinite(v)]
    df = len(values) - 1
    if df < 1:
        return math.nan
    t = T95[max(k for k in T95 if k <= df)] if df <= 30 else 1.96
    return t * std(values) / math.sqrt(len(values))


def throughput(run, skip):
    """Training tokens/s over the steps after the first ``skip`` (compilation, autotuning, warm caches)."""
    n = len(run["step"])
    skip = min(skip, n - 1)
    step_tokens = [b - a for a, b in zip([0.0] + run["tokens"][:-1], run["tokens"])]
    tokens = sum(step_tokens[skip:])
    seconds = sum(t for t in run["step_time"][skip:] if math.isfinite(t))
    return tokens / seconds if seconds > 0 else math.nan


def step_gaps(run, ref):
    """(steps both runs logged, loss of ``run`` minus loss of ``ref`` at each)."""
    ref_loss = dict(zip(ref["step"], ref["loss"]))
    loss = dict(zip(run["step"], run["loss"]))
    steps = [s for s in run["step"] if s in ref_loss]
    return steps, [loss[s] - ref_loss[s] for s in steps]


def paired(runs, refs):
    """(run, reference run) pairs: by seed folder name where every run has one, else by position."""
    if all(r["seed"] for r in runs + refs):
        by_seed = {r["seed"]: r for r in refs}
        return [(r, by_seed[r["seed"]]) for r in runs if r["seed"] in by_seed]
    return list(zip(runs, refs))


def summarize(groups, labels, last_n, skip_steps):
    """One row per implementation; ``groups[i]`` holds its runs, one per seed, each paired with the reference's
    (``groups[0]``) run of the same seed."""
    refs = groups[0]
    ref_final = [mean(r["loss"][-last_n:]) for r in refs]
    rows = []
    for runs, label in zip(groups, labels):
        finals = [mean(r["loss"][-last_n:]) for r in runs]
        speeds = [throughput(r, skip_steps if skip_steps is not None else max(1, len(r["step"]) // 10))
                  for r in runs]
        evals = [r["eval"][-1][1] for r in runs if r["eval"]]
        row = {"run": label, "seeds": len(runs), "steps": runs[0]["step"][-1],
               "final_loss": mean(finals), "final_loss_sd": std(finals), "final_loss_per_seed": finals,
               "final_eval_loss": mean(evals) if evals else None, "tokens_per_s": mean(speeds)}
        if runs is not refs:
            pairs = paired(runs, refs)
            tails = [step_gaps(run, ref)[1][-last_n:] for run, ref in pairs]
            per_seed = [mean(tail) for tail in tails]
            row.update(mean_gap=mean(per_seed), gap_per_seed=per_seed, gap_ci95=ci95(per_seed),
                       mean_abs_gap=mean([mean([abs(g) for g in tail]) for tail in tails]),
                       relative_gap=mean(per_seed) / mean([mean(ref["loss"][-last_n:]) for _, ref in pairs]),
                       common_steps=min(len(step_gaps(run, ref)[0]) for run, ref in pairs))
            row["verdict"] = verdict(row, labels[0], std(ref_final))
            if all(r["eval"] for r in runs + refs):      # the held-out loss at the end, paired by seed
                eval_gaps = [run["eval"][-1][1] - ref["eval"][-1][1] for run, ref in pairs]
                row.update(eval_gap=mean(eval_gaps), eval_gap_per_seed=eval_gaps, eval_gap_ci95=ci95(eval_gaps),
                           ref_eval_loss_paired=mean([ref["eval"][-1][1] for _, ref in pairs]))
        rows.append(row)
    ref_speed = rows[0]["tokens_per_s"]
    for row in rows:
        row["speed_vs_ref"] = row["tokens_per_s"] / ref_speed if ref_speed and math.isfinite(ref_speed) else math.nan
    return rows


def verdict(row, ref_label, ref_sd):
    """One sentence: is the gap to the reference larger than the run-to-run noise?"""
    gap, half, n = row["mean_gap"], row["gap_ci95"], row["seeds"]
    head = f"{row['run']} - {ref_label}: final loss gap {gap:+.4f} ({100 * row['relative_gap']:+.2f}%)"
    if not math.isfinite(half):
        return (f"{head} from one seed: no noise estimate, so no verdict (run two or more seeds, e.g. "
                f"--seeds 0 1 2)")
    interval = f"95% CI [{gap - half:+.4f}, {gap + half:+.4f}] over {n} seeds"
    noise = f"{ref_label}'s own seed-to-seed sd {ref_sd:.4f}"
    if gap - half > 0 or gap + half < 0:
        direction = "worse" if gap > 0 else "better"
        return f"{head}, {interval}: larger than the noise ({noise}): {row['run']} trains {direction}"
    return f"{head}, {interval}: within the noise ({noise}): no difference shown"


def eval_line(row, ref):
    """The held-out loss at the last evaluation: the figure that says whether a model generalises, not memorises."""
    half = row["eval_gap_ci95"]
    ci = f" ± {half:.4f} (95% CI over {row['seeds']} seeds)" if math.isfinite(half) else " (one seed)"
    ref_eval = row["ref_eval_loss_paired"]        # the reference's runs of the same seeds
    return (f"held-out eval loss: {row['run']} {row['final_eval_loss']:.4f} vs {ref['run']} "
            f"{ref_eval:.4f}: gap {row['eval_gap']:+.4f}{ci} ({100 * row['eval_gap'] / ref_eval:+.2f}%)")


def _f(value, fmt):
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, fmt)


def table_lines(rows, labels, last_n):
    header = ["run", "seeds", "steps", f"final loss (last {last_n}, mean ± sd)", "final eval loss",
              f"gap vs {labels[0]} (mean ± 95% CI)", "mean abs gap", "tokens/s", f"speed vs {labels[0]}"]
    body = []
    for r in rows:
        gap = "-"
        if "mean_gap" in r:
            gap = _f(r["mean_gap"], "+.4f") + (f" ± {_f(r['gap_ci95'], '.4f')}" if math.isfinite(r["gap_ci95"])
                                               else "") + f" ({_f(100 * r['relative_gap'], '+.2f')}%)"
        body.append([r["run"], str(r["seeds"]), str(r["steps"]),
                     _f(r["final_loss"], ".4f") + (f" ± {r['final_loss_sd']:.4f}" if math.isfinite(r["final_loss_sd"])
                                                   else ""),
                     _f(r["final_eval_loss"], ".4f"), gap, _f(r.get("mean_abs_gap"), ".4f"),
                     _f(r["tokens_per_s"], ",.0f"), _f(r["speed_vs_ref"], ".2f") + "x"])
    return header, body


def markdown(header, body):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def _across_seeds(curves):
    """Steps every curve has, and per step the mean and sd over the curves (each a dict step -> value)."""
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return steps, [mean([c[s] for c in curves]) for s in steps], [std([c[s] for c in curves]) for s in steps]


def _which(runs, refs):
    """': seed0' where a run's seeds are not the reference's: its mean curve is over other seeds, so say which."""
    seeds = [r["seed"] for r in runs]
    return f": {', '.join(seeds)}" if all(seeds) and set(seeds) != {r["seed"] for r in refs} else ""


def plot(groups, labels, rows, header, body, path, smoothing, title):
    try:
        import matplotlib
    except ImportError:
        print("[compare_runs] matplotlib is not installed: skipped the PNG (pip install matplotlib, then rerun "
              "with --metrics on the run folders to draw it)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_gap, ax_table) = plt.subplots(3, 1, figsize=(11, 11.5),
                                                    gridspec_kw={"height_ratios": [3, 2, 1.3]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if smoothing is None:
        smoothing = 1.0 - 1.0 / max(1.0, max(len(r["step"]) for runs in groups for r in runs) / 50)
    smooth = lambda run: dict(zip(run["step"], ema(run["loss"], smoothing)))  # noqa: E731
    for i, (runs, label) in enumerate(zip(groups, labels)):
        c = colors[i % len(colors)]
        for run in runs:
            ax_loss.plot(run["step"], run["loss"], color=c, alpha=0.12, linewidth=0.6)
        steps, avg, sd = _across_seeds([smooth(r) for r in runs])
        # Later runs dashed: where the curves coincide, both stay visible.
        ax_loss.plot(steps, avg, color=c, linewidth=1.8, linestyle="-" if i == 0 else "--",
                     label=f"{label} (train, mean of {len(runs)} seed{'s' if len(runs) > 1 else ''}{_which(runs, groups[0])})")
        if len(runs) > 1 and i == 0:
            ax_loss.fill_between(steps, [a - s for a, s in zip(avg, sd)], [a + s for a, s in zip(avg, sd)], color=c,
                                 alpha=0.2, linewidth=0, label=f"{label}: ±1 sd over seeds")
        evals = [dict(r["eval"]) for r in runs if r["eval"]]
        if evals:
            e_steps, e_avg, _ = _across_seeds(evals)
            ax_loss.plot(e_steps, e_avg, "o--", color=c, markersize=4, linewidth=1, label=f"{label} (eval)")
    ax_loss.set_ylabel("loss")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.legend(fontsize=8)
    ax_loss.grid(alpha=0.3)
    ax_loss.set_title(title or f"{' vs '.join(labels)}: same initial weights and batches per seed")

    ref_steps, _, ref_sd = _across_seeds([smooth(r) for r in groups[0]])
    if len(groups[0]) > 1:
        ax_gap.fill_between(ref_steps, [-s for s in ref_sd], ref_sd, color="grey", alpha=0.25, linewidth=0,
                            label=f"noise: {labels[0]}'s ±1 sd over seeds")
    for i, (runs, label) in enumerate(zip(groups[1:], labels[1:]), start=1):
        c = colors[i % len(colors)]
        gaps = []
        for run, ref in paired(runs, groups[0]):
            steps, gap = step_gaps(run, ref)
            gaps.append(dict(zip(steps, ema(gap, smoothing))))
            ax_gap.plot(steps, gaps[-1].values(), color=c, alpha=0.3, linewidth=0.8)
        steps, avg, sd = _across_seeds(gaps)
        ax_gap.plot(steps, avg, color=c, linewidth=1.8, label=f"{label} - {labels[0]} (mean over seeds)")
        if len(gaps) > 1:
            half = [ci95([g[s] for g in gaps]) for s in steps]
            ax_gap.fill_between(steps, [a - h for a, h in zip(avg, half)], [a + h for a, h in zip(avg, half)],
                                color=c, alpha=0.15, linewidth=0, label="95% CI of the mean gap")
    ax_gap.axhline(0.0, color="black", linewidth=0.8)
    ax_gap.set_ylabel(f"loss difference vs {labels[0]}")
    ax_gap.set_xlabel("optimizer step")
    ax_gap.legend(fontsize=8)
    ax_gap.grid(alpha=0.3)

    ax_table.axis("off")
    table = ax_table.table(cellText=body, colLabels=header, loc="upper center", cellLoc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(7)
    table.auto_set_column_width(list(range(len(header))))
    table.scale(1, 1.4)
    verdicts = "\n".join(r["verdict"] for r in rows if "verdict" in r)
    ax_table.text(0.5, 0.0, verdicts, ha="center", va="bottom", fontsize=8, wrap=True, transform=ax_table.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.metrics is not None:
        paths = [find_runs(p) for p in args.metrics]
        labels = args.labels or [Path(p).parent.name if Path(p).is_file() else Path(p).name for p in args.metrics]
    else:
        paths, labels = launch_runs(args, out)
    groups = [[load_run(p) for p in group] for group in paths]
    if all(r["seed"] for g in groups for r in g):
        # each implementation pairs with the reference on the seeds both ran; the reference's noise uses all of its
        ref_seeds = {r["seed"] for r in groups[0]}
        for label, group in zip(labels[1:], groups[1:]):
            alone = [r["seed"] for r in group if r["seed"] not in ref_seeds]
            if alone:
                print(f"[compare_runs] {label}: {', '.join(alone)} without a {labels[0]} run of the same seed: left out")
        groups = [groups[0]] + [[r for r in g if r["seed"] in ref_seeds] for g in groups[1:]]
        lonely = [label for label, g in zip(labels, groups) if not g]
        if lonely:
            raise SystemExit(f"error: --metrics: no seed in common with the reference {labels[0]} (its seeds: "
                             f"{', '.join(sorted(ref_seeds))}): {', '.join(lonely)}")
    else:
        n = min(len(g) for g in groups)
        if any(len(g) != n for g in groups):
            print(f"[compare_runs] the runs have different numbers of seeds ({[len(g) for g in groups]}): the first "
                  f"{n} of each are compared, paired in order")
            groups = [g[:n] for g in groups]
    rows = summarize(groups, labels, args.last_n, args.skip_steps)
    header, body = table_lines(rows, labels, args.last_n)
    table = markdown(header, body)
    verdicts = "\n".join("verdict: " + r["verdict"] for r in rows if "verdict" in r)
    evals = [eval_line(r, rows[0]) for r in rows if "eval_gap" in r]
    if evals:
        verdicts += "\n" + "\n".join(evals)
    info = groups[0][0]["run_summary"]
    context = ""
    if info:
        context = (f"{info.get('parameters', 0) / 1e6:.1f}M parameters, {info.get('tokens_per_step', 0):,} tokens per "
                   f"step, {info.get('num_processes', 1)} process(es) ({info.get('distributed_type', '?')}), "
                   f"mixed precision {info.get('mixed_precision', '?')}, device {info.get('device', '?')}")
    text = (context + "\n\n" if context else "") + table + "\n\n" + verdicts + "\n"
    print("\n" + text)
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps({"context": info, "runs": rows,
                                                  "metrics": [[str(p) for p in g] for g in paths]},
                                                 indent=1, default=str))
    png = plot(groups, labels, rows, header, body, out / "comparison.png", args.smoothing, args.title)
    if png:
        print(f"[compare_runs] wrote {png}, {out / 'summary.md'}, {out / 'summary.json'}")


if __name__ == "__main__":
    main()
