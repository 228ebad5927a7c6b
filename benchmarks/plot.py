"""Plot the benchmark CSVs into one PNG for the README (runs anywhere; needs matplotlib).

Top rows: TFLOP/s-equivalent against N from benchmarks/speed.py's CSV, one panel per head dim x
causal: forward+backward (first row) and forward (second row, with sageattention's forward when it was
measured), for every method in the CSV. GQA shapes are left out of the lines (the table has them).
Bottom row, with --e2e: benchmarks/e2e.py's tokens/s per sequence length and implementation, each bar
labelled with its ratio to sdpa's default backend. The title names the device and the versions stored in
the CSVs.

    python benchmarks/plot.py speed.csv --e2e e2e.csv -o docs/speed_h100.png
"""
import argparse
import csv
import os
import sys

DS_BOUND = "pv_e4m3+p_static+do_sequence+dk_e4m3+ds_bound"
COLORS = {"sagebwd": "#d62728", "sagebwd_fast": "#ff7f0e", "sagebwd-fast": "#ff7f0e", "cudnn": "#1f77b4",
          "sagebwd@fastest": "#e377c2", "sagebwd-fastest": "#e377c2", f"sagebwd@{DS_BOUND}": "#8c564b",
          "flash": "#2ca02c", "sageattn": "#9467bd",
          "efficient": "#bcbd22", "sdpa": "#1f77b4", "sdpa-flash": "#2ca02c", "sdpa-cudnn": "#17becf",
          "noop": "#7f7f7f"}
LABELS = {"sagebwd": "SageBwd (INT8)", "sagebwd_fast": "SageBwd, precision='fast'",
          "sagebwd-fast": "SageBwd, precision='fast'", "sagebwd@fastest": "SageBwd, precision='fastest'",
          "sagebwd-fastest": "SageBwd, precision='fastest'",
          f"sagebwd@{DS_BOUND}": "SageBwd, 'fastest' rules + ds_bound",
          "cudnn": "SDPA cuDNN", "flash": "SDPA flash (FA2)",
          "sageattn": "sageattention 1.0.6 (fwd only)", "efficient": "SDPA mem-efficient",
          "sdpa": "sdpa (default backend)", "sdpa-flash": "sdpa flash", "sdpa-cudnn": "sdpa cuDNN",
          "noop": "no-op attention (bound)"}


def read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"{path}: no rows")
    return rows


def num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def truthy(x):
    return str(x).strip().lower() in ("true", "1", "yes")


def kfmt(n):
    n = int(n)
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def speed_title(rows, device):
    r = rows[0]
    parts = [device or r.get("device") or "device not recorded"]
    for key, name in (("torch", "torch"), ("triton", "Triton"), ("cudnn", "cuDNN"), ("sageattention", "sageattention")):
        if r.get(key) and r[key] not in ("-", "None"):
            parts.append(f"{name} {r[key]}")
    return " | ".join(parts)


def plot(speed_rows, e2e_rows, out, device=None, dpi=130):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for r in speed_rows:                      # older CSVs named the column "backend"
        r.setdefault("method", r.get("backend"))
    grid = [r for r in speed_rows if r.get("kv_heads") in (None, "", r.get("heads"))]
    panels = sorted({(int(r["head_dim"]), truthy(r["causal"])) for r in grid}, key=lambda p: (-p[0], p[1]))
    methods = list(dict.fromkeys(r["method"] for r in grid))
    ncols = max(1, len(panels))
    nrows = 2 + (1 if e2e_rows else 0)
    fig = plt.figure(figsize=(4.2 * ncols, 3.4 * nrows + 0.9))
    gs = fig.add_gridspec(nrows, ncols, hspace=0.45, wspace=0.28)
    handles = {}
    for row_i, (key, label, short) in enumerate((("fwd_bwd_tflops", "forward+backward TFLOP/s", "fwd+bwd"),
                                                 ("fwd_tflops", "forward TFLOP/s", "forward"))):
        for col, (d, causal) in enumerate(panels):
            ax = fig.add_subplot(gs[row_i, col])
            for m in methods:
                pts = sorted((int(r["seqlen"]), num(r.get(key))) for r in grid
                             if r["method"] == m and int(r["head_dim"]) == d and truthy(r["causal"]) == causal)
                pts = [(n, v) for n, v in pts if v == v]
                if not pts:
                    continue
                ln, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4,
                              lw=2.2 if m == "sagebwd" else 1.5, color=COLORS.get(m), label=LABELS.get(m, m))
                handles.setdefault(m, ln)
            ax.set_xscale("log", base=2)
            ns = sorted({int(r["seqlen"]) for r in grid})
            ax.set_xticks(ns, [kfmt(n) for n in ns])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.set_title(f"{short}: D={d}, {'causal' if causal else 'non-causal'}", fontsize=10)
            ax.set_xlabel("sequence length N (B·N = 32K)", fontsize=8)
            if col == 0:
                ax.set_ylabel(label, fontsize=9)
    if e2e_rows:
        ax = fig.add_subplot(gs[2, :])
        seqs = sorted({int(r["seqlen"]) for r in e2e_rows})
        impls = list(dict.fromkeys(r["impl"] for r in e2e_rows))
        width = 0.8 / max(1, len(impls))
        for i, impl in enumerate(impls):
            for j, s in enumerate(seqs):
                r = next((r for r in e2e_rows if r["impl"] == impl and int(r["seqlen"]) == s), None)
                v = num(r.get("tokens_per_s")) / 1e3 if r else float("nan")
                if v != v:
                    continue
                bar = ax.bar(j + (i - (len(impls) - 1) / 2) * width, v, width * 0.95, color=COLORS.get(impl),
                             label=None if "e2e:" + impl in handles else LABELS.get(impl, impl))
                handles.setdefault("e2e:" + impl, bar)
                x = num(r.get("x_sdpa"))
                tag = f"{x:.2f}×" if x == x and impl != "sdpa" else ""
                if truthy(r.get("grad_ckpt")):
                    tag += "\nckpt"
                if tag:
                    ax.annotate(tag, (bar[0].get_x() + bar[0].get_width() / 2, v), ha="center", va="bottom",
                                fontsize=7, xytext=(0, 1), textcoords="offset points")
        ax.set_xticks(range(len(seqs)), [kfmt(s) for s in seqs])
        ax.set_xlabel("sequence length (tokens per step fixed)", fontsize=8)
        ax.set_ylabel("training ktokens/s", fontsize=9)
        r0 = e2e_rows[0]
        ax.set_title(f"End to end: Llama-3.2-1B-shaped model ({r0.get('layers', '?')} layers), bf16, "
                     f"fwd+bwd+{'AdamW' if r0.get('optimizer', 'adamw') == 'adamw' else 'no optimizer'}, "
                     f"{r0.get('tokens_per_step', '?')} tokens/step; labels: × sdpa default"
                     + (f"; transformers {r0['transformers']}" if r0.get("transformers") else ""), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.22)
        ax.legend(fontsize=8, loc="upper right", ncol=len(impls))
    speed_handles = [h for m, h in handles.items() if not m.startswith("e2e:")]
    fig.legend(speed_handles, [h.get_label() for h in speed_handles], loc="upper center", ncol=len(speed_handles),
               fontsize=9, bbox_to_anchor=(0.5, 1 - 0.55 / fig.get_figheight()), frameon=False)
    fig.suptitle("SageBwd vs SDPA — " + speed_title(speed_rows, device)
                 + "\nB·N = 32K tokens, H·D = 2048, bf16; TFLOP/s-equivalent: 4·B·H·N²·D forward, ×2.5 backward, "
                 "halved when causal; whole op per call", fontsize=10, y=1 - 0.05 / fig.get_figheight())
    fig.subplots_adjust(top=1 - 1.25 / fig.get_figheight(), bottom=0.6 / fig.get_figheight(), left=0.05, right=0.99)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=dpi)
    print(f"wrote {out}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("speed_csv", help="CSV from benchmarks/speed.py --csv")
    p.add_argument("--e2e", metavar="CSV", help="CSV from benchmarks/e2e.py --csv (adds the bottom row)")
    p.add_argument("-o", "--out", default=None, help="PNG path (default: the speed CSV's name with .png)")
    p.add_argument("--device", default=None, help="device name for the title, for CSVs that lack it")
    p.add_argument("--dpi", type=int, default=130)
    args = p.parse_args()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("plot.py needs matplotlib: pip install matplotlib")
    out = args.out or os.path.splitext(args.speed_csv)[0] + ".png"
    plot(read_csv(args.speed_csv), read_csv(args.e2e) if args.e2e else None, out, args.device, args.dpi)


if __name__ == "__main__":
    main()
