"""metrics.csv: one row per optimizer step with the same columns in every example (written by ``CSVLogger``,
read by ``read_metrics``; examples/compare_runs.py draws and compares runs from these files). Losses are written
with 6 significant digits, from float32 values (see ``training.mean_loss``)."""
import csv
import os
from pathlib import Path


METRIC_COLUMNS = ("step", "epoch", "loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s",
                  "elapsed_s", "eval_loss", "eval_ppl")


class CSVLogger:
    """``metrics.csv``: one row per optimizer step (eval columns filled on evaluation steps). Written by the
    main process only, flushed at every row so that a crash or a kill keeps what was done. On resume the rows
    after the checkpoint's step are dropped first, so that the file reads as one run."""

    def __init__(self, path, enabled=True, resume_step=None, restore_from=None):
        self.path, self.enabled = Path(path), enabled
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows = []
        if resume_step is not None:
            source = self.path if self.path.exists() else (Path(restore_from) if restore_from else None)
            if source is not None and source.exists():
                rows = [r for r in read_metrics(source) if int(r["step"]) <= resume_step]
        # the kept rows go to a new file that replaces the old one in one step: a kill here loses no row
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        self.file = open(tmp, "w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=METRIC_COLUMNS)
        self.writer.writeheader()
        for row in rows:
            self.writer.writerow({k: row.get(k, "") for k in METRIC_COLUMNS})
        self.file.flush()
        os.fsync(self.file.fileno())
        os.replace(tmp, self.path)

    def log(self, **values):
        if not self.enabled:
            return
        unknown = set(values) - set(METRIC_COLUMNS)
        if unknown:
            raise KeyError(f"unknown metric columns {sorted(unknown)}")
        self.writer.writerow({k: _fmt(values.get(k)) for k in METRIC_COLUMNS})
        self.file.flush()

    def close(self):
        if self.enabled:
            self.file.close()


def _fmt(value):
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def read_metrics(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
