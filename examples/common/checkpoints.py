"""Checkpoints of the Accelerate loop: ``save_checkpoint`` writes ``OUTPUT_DIR/checkpoint-N`` (Accelerate's state
plus where the loop was) so that a kill at any moment leaves either the complete folder or none; ``find_checkpoint``
picks the one to resume from ('latest': the newest complete one); ``resume`` restores it and continues the run's
metrics.csv from the checkpoint's copy."""
import json
import os
import shutil
from pathlib import Path

from .files import write_atomic
from .metrics import CSVLogger

TRAINING_STATE = "training_state.json"


def save_checkpoint(accelerator, output_dir, step, state, metrics_path=None):
    """``accelerator.save_state`` (model, optimizer, scheduler, RNG states, sampler) plus where the loop was.

    Written under a hidden name (``.checkpoint-N.partial``) and renamed to ``checkpoint-N`` only once every
    file is in, ``training_state.json`` last: a run killed while saving leaves no half-written checkpoint-N,
    only a hidden folder that ``find_checkpoint`` never picks and the next save of that step replaces."""
    out = Path(output_dir)
    final, partial = out / f"checkpoint-{step}", out / f".checkpoint-{step}.partial"
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)                       # left by a save that was killed
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()                  # every process's files are in
    if accelerator.is_main_process:
        if metrics_path is not None and Path(metrics_path).exists():
            shutil.copy(metrics_path, partial / "metrics.csv")
        write_atomic(partial / TRAINING_STATE, json.dumps(dict(state, step=step), indent=1))
        old = out / f".checkpoint-{step}.old"
        if final.exists():                           # the same step saved again after a resume
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def find_checkpoint(resume_from_checkpoint, output_dir, marker=TRAINING_STATE):
    """The folder to resume from: the path given, or with 'latest' the newest complete checkpoint-N in output_dir
    (complete: it holds ``marker``, the file written last; Trainer's checkpoints mark with trainer_state.json)."""
    if resume_from_checkpoint == "latest":
        folder = Path(output_dir)
        candidates = [p for p in folder.glob("checkpoint-*")
                      if p.name.split("-")[-1].isdigit() and (p / marker).exists()] if folder.is_dir() else []
        if not candidates:
            raise SystemExit(f"error: --resume_from_checkpoint latest: no checkpoint-N folder with {marker} in "
                             f"{output_dir} (--output_dir)")
        return max(candidates, key=lambda p: int(p.name.split("-")[-1]))
    path = Path(resume_from_checkpoint)
    if not (path / marker).exists():
        raise SystemExit(f"error: --resume_from_checkpoint {resume_from_checkpoint}: not a checkpoint folder "
                         f"(no {marker}); give a checkpoint-N folder or 'latest'")
    return path


def load_checkpoint(accelerator, path):
    """``accelerator.load_state`` and the loop's position saved beside it; a checkpoint of another model stops
    with one line naming the flag."""
    try:
        accelerator.load_state(str(path))
    except (RuntimeError, ValueError, KeyError) as exc:   # another model's or optimizer's tensors
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = next((line for line in lines if "size mismatch" in line or "Missing" in line or "Unexpected" in line),
                      lines[0] if lines else type(exc).__name__)
        raise SystemExit(f"error: --resume_from_checkpoint {path}: it does not fit this model (same --size, "
                         f"--model_type, --qk_norm and LoRA settings?): {detail[:300]}") from None
    return json.loads((Path(path) / TRAINING_STATE).read_text())


def resume(accelerator, args, out):
    """Where the loop is (optimizer steps, micro-batches consumed -> epoch and position in it, tokens, time),
    from ``--resume_from_checkpoint`` or fresh; and the metrics CSV, continued from the checkpoint's copy.
    Returns ``(state, metrics, resume_path or None)``."""
    state = {"step": 0, "micro_batches": 0, "tokens": 0, "elapsed_s": 0.0}
    resume_path = None
    if args.resume_from_checkpoint:
        resume_path = find_checkpoint(args.resume_from_checkpoint, out)
        state.update(load_checkpoint(accelerator, resume_path))
        accelerator.print(f"resumed from {resume_path} at step {state['step']}")
    metrics = CSVLogger(out / "metrics.csv", enabled=accelerator.is_main_process,
                        resume_step=state["step"] if resume_path else None,
                        restore_from=resume_path / "metrics.csv" if resume_path else None)
    return state, metrics, resume_path
