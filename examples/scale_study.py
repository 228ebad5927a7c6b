#!/usr/bin/env python
"""The tokens-per-step study: does SageBwd train like full-precision attention at a small and at a large
number of tokens per optimizer step, and what do QK-norm and K-smoothing change? (arXiv 2603.02170 finds a
match at 260K tokens per step, a gap at 2.1M, and without QK-norm a failure at large tokens per step; our
``check_training_setup`` warns above 2^19 tokens per step without QK-norm on that evidence.)

    python examples/code_corpus.py --output_dir /tmp/corpus          # the data: installed Python sources
    python examples/scale_study.py --corpus /tmp/corpus --deadline_s 540   # run what fits, resume next call
    python examples/scale_study.py --corpus /tmp/corpus --cells 1m/sdpa/1 1m/sagebwd/1   # chosen cells, in order
    python examples/scale_study.py --corpus /tmp/corpus --devices 0 1 2 3        # four cells at a time, a GPU each
    python examples/scale_study.py --status                          # the plan, and which cells are done
    python examples/scale_study.py --report                          # tables and PNGs into docs/fidelity/

The plan is fixed here (PLAN): a ~60M Llama (the 60m preset, head dim 64, GQA 10/5) at sequence length 1024,
bf16 autocast, on the code corpus, in two regimes of tokens per step, with these arms:

    sdpa                 the reference (PyTorch SDPA, bf16)
    sagebwd              SageBwd as shipped (K-smoothing on)
    sagebwd_qknorm       SageBwd with QK-norm added (sagebwd_hf.add_qk_norm)
    sagebwd_no_ksmooth   SageBwd with K-smoothing off
    sdpa_qknorm          (optional, --arms) the reference for the QK-norm arm: same model, SDPA
    sagebwd_fast         (optional, --arms or --cells) SageBwd with precision="fast" (FP8 e4m3 P·V and Pᵀ·dO,
                         fixed P scales; sagebwd_hf.numerics), against sdpa like sagebwd
    sagebwd_fastest      (optional, --arms or --cells) precision="fastest" ("fast" plus dK = dSᵀ·Q in e4m3 and
                         dO's scales per sequence), against sdpa like sagebwd

Each cell (regime, arm, seed) is one examples/pretrain.py run; within a seed every arm starts from the same
weights (same seed, same config; QK-norm gains start at 1) and sees the same batches in the same order. A
cell's metrics.csv, run_summary.json and cell.json (its command and the plan it ran under) go to
``--results/REGIME/ARM/seedN/``. A cell is done when its run_summary.json is there and its plan matches: the
script skips done cells and any cell that would not end by --deadline_s (e.g. a time limit on each use of a
GPU machine; a later, shorter cell may still fit), so calling it again resumes the study. ``--devices`` runs that
many cells at once, each on its own GPU (``CUDA_VISIBLE_DEVICES``), in the same order. --report draws each regime
with examples/compare_runs.py (loss curves, the reference's seed-to-seed band, the gaps with their 95% interval, a
verdict per arm) and writes the table to ``--docs``.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.arguments import HelpFormatter
from common.files import code_corpus_dir

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = Path(__file__).resolve().parent / "pretrain.py"
SEQ_LEN = 1024
MICRO_BATCH = 32          # sequences per forward/backward; the regimes differ in accumulation only
MODEL = ["--size", "60m", "--seq_len", str(SEQ_LEN), "--per_device_batch_size", str(MICRO_BATCH),
         "--mixed_precision", "bf16", "--no_save_model", "--max_eval_batches", "16"]
# tokens per step = MICRO_BATCH * SEQ_LEN * accumulation. lr: the 60m preset's 1e-3 at the small regime; a
# larger batch takes a larger step (2e-3: below the square-root rule's 4e-3, so that SDPA itself stays stable).
PLAN = {
    "64k": dict(accumulation=2, steps=640, lr=1e-3),      # 65,536 tokens a step, 42M tokens
    "1m": dict(accumulation=32, steps=80, lr=2e-3),       # 1,048,576 tokens a step, 84M tokens
}
ARMS = {
    "sdpa": ["--attn_implementation", "sdpa"],
    "sagebwd": ["--attn_implementation", "sagebwd"],
    "sagebwd_qknorm": ["--attn_implementation", "sagebwd", "--qk_norm"],
    "sagebwd_no_ksmooth": ["--attn_implementation", "sagebwd", "--no_k_smoothing"],
    "sdpa_qknorm": ["--attn_implementation", "sdpa", "--qk_norm"],
    "sagebwd_fast": ["--attn_implementation", "sagebwd", "--precision", "fast"],
    "sagebwd_fastest": ["--attn_implementation", "sagebwd", "--precision", "fastest"],
}
DEFAULT_ARMS = ("sdpa", "sagebwd", "sagebwd_qknorm", "sagebwd_no_ksmooth")
# --report's comparisons (folder suffix, arms): the first arm is the reference of the others (QK-norm changes the
# model, so its arm has its own); each draws the arms that have done cells, and only with its reference among them.
COMPARISONS = [("", ["sdpa", "sagebwd", "sagebwd_qknorm", "sagebwd_no_ksmooth", "sagebwd_fast",
                     "sagebwd_fastest"]),
               ("_qknorm", ["sdpa_qknorm", "sagebwd_qknorm"])]
# Seconds a cell needs beyond its training steps (start-up, model build, Triton compilation, evaluations).
OVERHEAD_S = 45.0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--corpus", default=str(code_corpus_dir()), help="examples/code_corpus.py's output folder")
    parser.add_argument("--results", default=str(ROOT / "docs" / "fidelity" / "study"),
                        help="where each cell's metrics go (kept in the repository: the study resumes from it)")
    parser.add_argument("--work_dir", default="/tmp/scale_study_work", help="the runs' scratch space")
    parser.add_argument("--regimes", nargs="+", default=list(PLAN), choices=list(PLAN))
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--cells", nargs="+", default=None, metavar="REGIME/ARM/SEED",
                        help="run these cells, in this order (e.g. 1m/sdpa/1 64k/sagebwd/2), instead of "
                             "--regimes x --arms x --seeds")
    parser.add_argument("--deadline_s", type=float, default=None,
                        help="start no cell that would not end within this many seconds of the start")
    parser.add_argument("--devices", nargs="+", default=None, metavar="GPU",
                        help="run a cell on each of these GPUs at once (CUDA_VISIBLE_DEVICES values, e.g. 0 1 2 3); "
                             "default: one cell at a time on what the machine shows")
    parser.add_argument("--tokens_per_s", type=float, default=3e5,
                        help="throughput assumed for a cell before one of its regime and arm has run")
    parser.add_argument("--status", action="store_true", help="print the plan and what is done, run nothing")
    parser.add_argument("--report", action="store_true", help="draw and tabulate the done cells, run nothing")
    parser.add_argument("--docs", default=str(ROOT / "docs" / "fidelity"), help="where --report writes")
    args = parser.parse_args(argv)
    if args.devices is not None and len(set(args.devices)) != len(args.devices):
        parser.error(f"--devices must be different from each other, got {args.devices}")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds must be different from each other, got {args.seeds}")
    if args.cells is not None:
        parsed = []
        for text in args.cells:
            parts = text.split("/")
            if len(parts) != 3 or parts[0] not in PLAN or parts[1] not in ARMS or not parts[2].isdigit():
                parser.error(f"--cells: '{text}' is not REGIME/ARM/SEED with REGIME in {sorted(PLAN)}, ARM in "
                             f"{sorted(ARMS)} and SEED a non-negative integer")
            parsed.append((parts[0], parts[1], int(parts[2])))
        args.cells = list(dict.fromkeys(parsed))
    return args


def tokens_per_step(regime):
    return MICRO_BATCH * SEQ_LEN * PLAN[regime]["accumulation"]


def cell_plan(regime, arm):
    """Everything that defines a cell's run: a cell done under another plan is not done under this one."""
    p = PLAN[regime]
    return dict(regime=regime, arm=arm, tokens_per_step=tokens_per_step(regime), model=MODEL, arm_args=ARMS[arm],
                accumulation=p["accumulation"], steps=p["steps"], lr=p["lr"])


def cell_dir(results, regime, arm, seed):
    return Path(results) / regime / arm / f"seed{seed}"


def is_done(results, regime, arm, seed):
    folder = cell_dir(results, regime, arm, seed)
    if not (folder / "run_summary.json").exists() or not (folder / "cell.json").exists():
        return False
    return json.loads((folder / "cell.json").read_text())["plan"] == cell_plan(regime, arm)


def cells(args):
    """--cells as given; else seed by seed, small regime first: the first seed of every arm comes before any
    second seed."""
    if args.cells is not None:
        return args.cells
    return [(r, a, s) for s in args.seeds for r in args.regimes for a in args.arms]


def estimate_s(args, regime, arm):
    """Seconds a cell should take: from a done cell of the same regime and arm, else --tokens_per_s."""
    speeds = []
    for seed_dir in sorted((Path(args.results) / regime / arm).glob("seed*")):
        summary = seed_dir / "run_summary.json"
        if summary.exists():
            speeds.append(json.loads(summary.read_text())["tokens_per_s"])
    speed = min(speeds) if speeds else args.tokens_per_s
    return PLAN[regime]["steps"] * tokens_per_step(regime) / speed + OVERHEAD_S


def corpus_args(corpus):
    corpus = Path(corpus)
    for name in ("train.npy", "eval.npy", "tokenizer", "manifest.json"):
        if not (corpus / name).exists():
            raise SystemExit(f"error: --corpus {corpus}: no {name} (build it with examples/code_corpus.py)")
    manifest = json.loads((corpus / "manifest.json").read_text())
    return ["--train_file", str(corpus / "train.npy"), "--validation_file", str(corpus / "eval.npy"),
            "--tokenizer_name", str(corpus / "tokenizer")], manifest


def start_cell(args, regime, arm, seed, data_args, device=None):
    """Start a cell's pretrain.py run (on GPU ``device`` alone, if given); returns what finish_cell needs."""
    plan = cell_plan(regime, arm)
    work = Path(args.work_dir) / regime / arm / f"seed{seed}"
    shutil.rmtree(work, ignore_errors=True)
    cmd = [sys.executable, str(PRETRAIN)] + MODEL + data_args + ARMS[arm] + [
        "--gradient_accumulation_steps", str(plan["accumulation"]), "--max_steps", str(plan["steps"]),
        "--learning_rate", str(plan["lr"]), "--eval_steps", str(max(1, plan["steps"] // 8)),
        "--log_every", str(max(1, plan["steps"] // 8)), "--seed", str(seed), "--output_dir", str(work)]
    where = "" if device is None else f" (GPU {device})"
    print(f"[scale_study] {regime}/{arm}/seed{seed}{where}: {shlex.join(cmd)}", flush=True)
    env = dict(os.environ, TQDM_DISABLE="1")
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(device)
    log = work.parent / f"seed{seed}.log"
    work.parent.mkdir(parents=True, exist_ok=True)
    out = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return dict(cell=(regime, arm, seed), plan=plan, cmd=cmd, work=work, log=log, out=out, proc=proc,
                device=device, start=time.time())


def finish_cell(args, job, manifest):
    """Wait for a started cell, print its log's summary lines, keep its metrics and write its cell.json; a failed
    run raises SystemExit."""
    returncode = job["proc"].wait()
    job["out"].close()
    (regime, arm, seed), plan, cmd, work = job["cell"], job["plan"], job["cmd"], job["work"]
    lines = job["log"].read_text(errors="replace").splitlines()
    print(f"[scale_study] {regime}/{arm}/seed{seed}:", flush=True)
    print("\n".join("    " + line for line in lines if line.startswith(("step ", "check_training", "model:",
                                                                       "tokens per"))), flush=True)
    if returncode != 0:
        print("\n".join(lines[-30:]))
        raise SystemExit(f"[scale_study] {regime}/{arm}/seed{seed} failed (exit code {returncode})")
    start = job["start"]
    dest = cell_dir(args.results, regime, arm, seed)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.csv", "run_summary.json"):
        shutil.copy(work / name, dest / name)
    train = manifest["splits"]["train"]
    cell = dict(plan=plan, seed=seed, command=shlex.join(cmd), wall_s=round(time.time() - start, 1),
                device=job["device"],
                corpus=dict(train_tokens=train["tokens"], sha256=train["sha256"], versions=manifest["versions"]),
                epochs=round(plan["steps"] * plan["tokens_per_step"] / train["tokens"], 3),
                log_tail=[line for line in lines if not line.startswith("pretrain")][-12:])
    (dest / "cell.json").write_text(json.dumps(cell, indent=1))
    return cell


def status(args):
    for regime, arm, seed in cells(args):
        done = is_done(args.results, regime, arm, seed)
        print(f"{regime:>4} {arm:<20} seed{seed}: {'done' if done else 'to run'} "
              f"(~{estimate_s(args, regime, arm) / 60:.1f} min)")


def run(args):
    start = time.time()
    data_args, manifest = corpus_args(args.corpus)
    train_tokens = manifest["splits"]["train"]["tokens"]
    for regime in args.regimes:
        need = PLAN[regime]["steps"] * tokens_per_step(regime)
        if need > train_tokens:
            print(f"[scale_study] note: {regime} trains on {need:,} tokens, the corpus holds {train_tokens:,}: "
                  f"{need / train_tokens:.2f} epochs (some data repeats)")
    # the corpus is what is installed on the machine: cells made on another one are not comparable
    sha = manifest["splits"]["train"]["sha256"]
    for cell_file in sorted(Path(args.results).glob("*/*/seed*/cell.json")):
        other = json.loads(cell_file.read_text())["corpus"]["sha256"]
        if other != sha:
            print(f"[scale_study] warning: {cell_file.parent} was trained on another corpus (train sha256 "
                  f"{other[:12]}, this one {sha[:12]}): other installed packages; compare with care")
    ran = 0
    free = list(args.devices) if args.devices else [None]
    running = []
    pending = [c for c in cells(args) if not is_done(args.results, *c)]
    while pending or running:
        while pending and free:   # start what fits the deadline, in order, on the free GPUs
            regime, arm, seed = pending.pop(0)
            need = estimate_s(args, regime, arm)
            left = None if args.deadline_s is None else args.deadline_s - (time.time() - start)
            if left is not None and need > left:     # a later, shorter cell may still fit
                print(f"[scale_study] not now: {regime}/{arm}/seed{seed} needs ~{need:.0f} s, {left:.0f} s left")
                continue
            running.append(start_cell(args, regime, arm, seed, data_args, free.pop(0)))
        if not running:
            break
        while all(job["proc"].poll() is None for job in running):
            time.sleep(0.2)
        job = next(job for job in running if job["proc"].poll() is not None)
        running.remove(job)
        try:
            cell = finish_cell(args, job, manifest)
        except SystemExit:
            for other in running:   # (a failed cell ends the study: the others are stopped, not left behind)
                other["proc"].kill()
                other["proc"].wait()
                other["out"].close()
            raise
        free.append(job["device"])
        ran += 1
        regime, arm, seed = job["cell"]
        print(f"[scale_study] {regime}/{arm}/seed{seed} done in {cell['wall_s']} s", flush=True)
    print(f"[scale_study] ran {ran} cell(s) in {time.time() - start:.0f} s")
    status(args)


def _relative(path):
    path = Path(path).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def report(args):
    """compare_runs.py over each regime's done cells: one PNG, summary.md and summary.json per comparison."""
    import compare_runs

    docs = Path(args.docs)
    for regime in PLAN:
        base = Path(args.results) / regime
        done = {arm: sorted(p for p in (base / arm).glob("seed*") if (p / "run_summary.json").exists())
                for arm in ARMS}
        for suffix, arms in COMPARISONS:
            reference = arms[0]
            arms = [a for a in arms if done[a]]
            if len(arms) < 2 or arms[0] != reference:
                continue
            out = docs / f"{regime}{suffix}"
            title = (f"60M Llama on installed Python sources, {tokens_per_step(regime):,} tokens per step, bf16\n"
                     f"{' vs '.join(arms)}")
            compare_runs.main(["--metrics"] + [str(base / a) for a in arms] + ["--labels"] + arms
                              + ["--output_dir", str(out), "--title", title, "--last_n", "10"])
            # the summary names its metrics files relative to the repository, not to this machine
            summary = json.loads((out / "summary.json").read_text())
            summary["metrics"] = [[_relative(p) for p in group] for group in summary["metrics"]]
            (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))


def main(argv=None):
    args = parse_args(argv)
    if args.status:
        status(args)
    elif args.report:
        report(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
