"""The examples (examples/*.py) run end to end through `accelerate launch --cpu`, a few steps each, offline;
checked by what they write: metrics CSV, checkpoints, a resume that reproduces the original run, the final
model / LoRA adapter, the comparison PNG and summary."""
import json
import math
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
FAULT_INJECTION = ROOT / "tests" / "fault_injection.py"
sys.path.insert(0, str(EXAMPLES))

import common.arguments  # noqa: E402
import common.context_parallel  # noqa: E402
import common.data  # noqa: E402
import common.metrics  # noqa: E402
import common.models  # noqa: E402
import common.training  # noqa: E402

LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no"]
# Small enough for a few seconds per run on 2 CPU cores.
SMALL = ["--seq_len", "64", "--per_device_batch_size", "4"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Offline, with the examples' cache (tokenizer, demo base model) in a fresh folder shared by the tests."""
    env = dict(os.environ)
    # conftest.py sets these for the kernel tests: the examples run SageBwd's CPU path (PyTorch), not the Triton
    # kernels under the (very slow) interpreter, and without the NaN-poisoned outputs of the kernel tests.
    for name in ("TRITON_INTERPRET", "SAGEBWD_POISON"):
        env.pop(name, None)
    env.update(SAGEBWD_EXAMPLES_CACHE=str(tmp_path_factory.mktemp("examples_cache")), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def run(cmd, env, cwd, expect_ok=True, timeout=600):
    result = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if expect_ok and result.returncode != 0:
        raise AssertionError(f"{shlex.join(map(str, cmd))} exited {result.returncode}\n"
                             f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return result


def launch(script, args, env, cwd):
    return run(LAUNCH + [EXAMPLES / script] + list(args), env, cwd)


def metrics(path):
    return common.metrics.read_metrics(Path(path) / "metrics.csv")


def train_rows(path):
    return [r for r in metrics(path) if r["loss"]]


# ---------------------------------------------------------------------------------------------------------
# pretrain.py
# ---------------------------------------------------------------------------------------------------------

def test_pretrain_checkpoint_and_resume(tmp_path, env):
    args = SMALL + ["--max_steps", "6", "--gradient_accumulation_steps", "2", "--checkpointing_steps", "3",
                    "--eval_steps", "3", "--max_eval_batches", "2"]
    first = tmp_path / "first"
    result = launch("pretrain.py", args + ["--output_dir", first], env, tmp_path)
    out = result.stdout
    assert "tokens per optimizer step: 512 = 4 sequences x 64 tokens x 2 accumulation x 1 processes" in out
    assert "check_training_setup: ok" in out
    # A float32 model on the CPU: the example says once, in its own log, that the attention runs in bfloat16,
    # and the library's warning of the same fact is not shown.
    assert out.count(common.models.FLOAT32_ATTENTION_NOTE) == 1 and "sagebwd: float32" not in result.stderr

    rows = train_rows(first)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    losses = [float(r["loss"]) for r in rows]
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(2048), abs=0.3)        # a fresh model guesses uniformly
    assert losses[-1] < losses[0] - 0.3                               # and learns
    assert [int(r["step"]) for r in rows if r["eval_loss"]] == [3, 6]
    assert all(int(r["tokens"]) == 512 * int(r["step"]) for r in rows)
    for step in (3, 6):
        state = json.loads((first / f"checkpoint-{step}" / "training_state.json").read_text())
        assert state["step"] == step and state["micro_batches"] == 2 * step
        assert (first / f"checkpoint-{step}" / "model.safetensors").exists()
    assert (first / "final_model" / "config.json").exists() and (first / "final_model" / "model.safetensors").exists()
    summary = json.loads((first / "run_summary.json").read_text())
    assert summary["steps"] == 6 and summary["tokens"] == 6 * 512 and summary["attn_implementation"] == "sagebwd"

    # Resume from step 3 in another folder ("latest" finds the copied checkpoint): steps 4-6 must repeat the
    # first run's (same batches, optimizer and scheduler state), and the CSV reads as one run.
    second = tmp_path / "second"
    second.mkdir()
    subprocess.run(["cp", "-r", str(first / "checkpoint-3"), str(second)], check=True)
    out = launch("pretrain.py", args + ["--output_dir", second, "--resume_from_checkpoint", "latest"], env,
                 tmp_path).stdout
    assert "at step 3" in out
    resumed = train_rows(second)
    assert [int(r["step"]) for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(rows, resumed):
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), abs=1e-5), (a, b)
        assert float(b["lr"]) == pytest.approx(float(a["lr"]), rel=1e-6)
    assert float(resumed[-1]["eval_loss"]) == pytest.approx(float(rows[-1]["eval_loss"]), abs=1e-5)


def test_pretrain_default_run_lands_in_readmes_range(tmp_path, env):
    """README's first command, `python examples/pretrain.py` with its defaults, ends in the ranges README states
    for the final train and held-out eval loss. The last digits depend on the CPU's bf16 kernels (machines
    differ by ~0.02), so the check allows README's range widened by 0.05 on each side, not one machine's value."""
    readme = (ROOT / "README.md").read_text()
    stated = re.search(r"final train loss around (\d\.\d+)–(\d\.\d+) and a held-out eval loss around "
                       r"(\d\.\d+)–(\d\.\d+)", " ".join(readme.split()))
    assert stated, "README no longer states the default run's final losses as ranges"
    train_lo, train_hi, eval_lo, eval_hi = map(float, stated.groups())
    out = run([sys.executable, EXAMPLES / "pretrain.py", "--output_dir", tmp_path / "run"], env, tmp_path).stdout
    last = re.search(r"step 200/200 loss (\d+\.\d+) .* \| eval loss (\d+\.\d+)", out)
    assert last, out[-2000:]
    train_loss, eval_loss = map(float, last.groups())
    assert train_lo - 0.05 <= train_loss <= train_hi + 0.05, (train_loss, (train_lo, train_hi))
    assert eval_lo - 0.05 <= eval_loss <= eval_hi + 0.05, (eval_loss, (eval_lo, eval_hi))
    first = train_rows(tmp_path / "run")[0]
    assert float(first["loss"]) == pytest.approx(7.66, abs=0.05)          # README: "falls from 7.66"


def test_pretrain_survives_sigkill_while_saving_and_mid_step(tmp_path, env):
    """Killed (SIGKILL, at chosen moments, by tests/fault_injection.py) while saving checkpoint 4 and
    later in the middle of step 7, then resumed with --resume_from_checkpoint latest: each resume starts from
    the last complete checkpoint (2, then 6), never from the half-written one, and the losses of the whole run
    match an uninterrupted run's."""
    args = SMALL + ["--max_steps", "8", "--checkpointing_steps", "2", "--no_save_model"]
    whole = tmp_path / "whole"
    launch("pretrain.py", args + ["--output_dir", whole], env, tmp_path)
    expected = train_rows(whole)
    assert [int(r["step"]) for r in expected] == list(range(1, 9))

    run_dir = tmp_path / "killed"
    cmd = LAUNCH + [EXAMPLES / "pretrain.py"] + args + ["--output_dir", run_dir]

    def killed_at(moment, argv):
        return LAUNCH + [FAULT_INJECTION, moment, EXAMPLES / "pretrain.py"] + argv + ["--output_dir", run_dir]

    killed = run(killed_at("save:4", args), env, tmp_path, expect_ok=False)
    assert killed.returncode != 0
    assert (run_dir / "checkpoint-2" / "training_state.json").exists()
    partial = run_dir / ".checkpoint-4.partial"
    assert not (run_dir / "checkpoint-4").exists() and (partial / "model.safetensors").exists()
    assert not (partial / "training_state.json").exists()

    resume = ["--resume_from_checkpoint", "latest"]
    killed = run(killed_at("step:7", args + resume), env, tmp_path, expect_ok=False)
    assert killed.returncode != 0 and "resumed from" in killed.stdout and "at step 2" in killed.stdout
    assert not (run_dir / ".checkpoint-4.partial").exists()          # replaced by the complete checkpoint-4
    assert [int(r["step"]) for r in train_rows(run_dir)] == list(range(1, 7))

    out = run(cmd + resume, env, tmp_path).stdout
    assert "at step 6" in out
    rows = train_rows(run_dir)
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    for a, b in zip(expected, rows):
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), abs=1e-5), (a, b)
    assert sorted(p.name for p in run_dir.glob("*checkpoint-*")) == [f"checkpoint-{s}" for s in (2, 4, 6, 8)]


def test_pretrain_ddp_two_processes_match_one(tmp_path, env):
    """Two processes (DDP on CPU through gloo; `accelerate launch --cpu` starts only one, so torchrun with
    ACCELERATE_USE_CPU) with two sequences each train exactly as one process accumulating the same two
    micro-batches of two sequences: same data, same arithmetic per micro-batch, and DDP's averaged gradient
    (g0/2 + g1/2) equals the accumulated one bit for bit. Both run one thread per process (torchrun's default)
    so that no GEMM splits its work differently.

    Not compared with one process taking all four sequences at once: a batch of 4 runs other GEMM blockings,
    whose last-bit differences the bf16 cast and INT8 rounding of SageBwd turn into whole rounding steps, so
    those runs agree only to about 1e-4 in loss, and how closely depends on the CPU (7.63119 vs 7.63104 at
    step 3 on one machine). The exact comparison catches what a DDP bug would change (data shards, gradient
    averaging, the loss and token reductions) without a machine-dependent tolerance."""
    args = ["--seq_len", "64", "--max_steps", "3", "--no_save_model", "--per_device_batch_size", "2"]
    single = dict(env, OMP_NUM_THREADS="1")
    launch("pretrain.py", args + ["--gradient_accumulation_steps", "2", "--output_dir", tmp_path / "one"], single,
           tmp_path)
    # --standalone: a free local port for the rendezvous (not the fixed 29500 another job may hold); gloo on the
    # loopback interface, whatever the host name resolves to.
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               EXAMPLES / "pretrain.py"] + args + ["--output_dir", tmp_path / "two"],
              dict(single, ACCELERATE_USE_CPU="1", GLOO_SOCKET_IFNAME="lo"), tmp_path, timeout=300).stdout
    assert "2 sequences x 64 tokens x 1 accumulation x 2 processes" in out
    one, two = train_rows(tmp_path / "one"), train_rows(tmp_path / "two")
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert (b["loss"], b["grad_norm"], b["tokens"]) == (a["loss"], a["grad_norm"], a["tokens"])
    assert json.loads((tmp_path / "two" / "run_summary.json").read_text())["num_processes"] == 2


def test_pretrain_padding_free_qk_norm_smoothing(tmp_path, env):
    import sagebwd_hf

    out_dir = tmp_path / "run"
    out = launch("pretrain.py", SMALL + ["--max_steps", "3", "--padding_free", "--qk_norm", "--no_k_smoothing",
                                         "--q_smoothing", "--output_dir", out_dir], env, tmp_path).stdout
    assert "QK-norm yes" in out and "padding_free" in out
    assert "k_smoothing_off" in out                     # check_training_setup reports the switched-off smoothing
    rows = train_rows(out_dir)
    assert len(rows) == 3 and all(math.isfinite(float(r["loss"])) for r in rows)
    assert all(int(r["tokens"]) <= 4 * 64 * int(r["step"]) for r in rows)   # padding-free rows: at most B x S
    config = json.loads((out_dir / "final_model" / "config.json").read_text())
    assert config["sagebwd"] == {"k_smoothing": False, "q_smoothing": True}
    assert "sagebwd_qk_norm" in config
    model = sagebwd_hf.load_with_qk_norm(out_dir / "final_model")
    assert sagebwd_hf.has_qk_norm(model)


def test_pretrain_fast_precision(tmp_path, env):
    """--precision fast reaches the model's SageBwd options (saved in its config, printed, in the run summary) and
    trains on the CPU, whose PyTorch path computes every preset."""
    out_dir = tmp_path / "run"
    out = launch("pretrain.py", SMALL + ["--max_steps", "2", "--precision", "pv_e4m3+p_static", "--output_dir",
                                         out_dir], env, tmp_path).stdout
    assert "precision='fast'" in out                      # the rules' canonical name, from sagebwd_hf.get_options
    rows = train_rows(out_dir)
    assert len(rows) == 2 and all(math.isfinite(float(r["loss"])) for r in rows)
    assert json.loads((out_dir / "final_model" / "config.json").read_text())["sagebwd"] == {"precision": "fast"}
    assert json.loads((out_dir / "run_summary.json").read_text())["precision"] == "fast"


def test_pretrain_qwen3_eager_checkpointing(tmp_path, env):
    out_dir = tmp_path / "run"
    result = launch("pretrain.py", SMALL + ["--max_steps", "2", "--model_type", "qwen3", "--attn_implementation",
                                            "eager", "--gradient_checkpointing", "--no_save_model", "--output_dir",
                                            out_dir], env, tmp_path)
    out = result.stdout
    assert "Qwen3ForCausalLM" in out and "attention eager" in out
    assert "checkpointing_enable` is deprecated" not in result.stderr          # the current Transformers API
    assert common.models.FLOAT32_ATTENTION_NOTE not in out                      # eager has a float32 path
    assert len(train_rows(out_dir)) == 2
    assert not (out_dir / "final_model").exists()


# ---------------------------------------------------------------------------------------------------------
# finetune_lora.py
# ---------------------------------------------------------------------------------------------------------

# PeftModel.from_pretrained below asks the model for is_gradient_checkpointing, deprecated in Transformers 5.24.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_finetune_lora_demo_base_and_resume(tmp_path, env):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # No LoRA dropout: the resumed run draws its dropout masks from a different point of the RNG stream (the
    # data loader takes a seed from it when it restarts), so with dropout the resumed steps differ slightly.
    args = SMALL + ["--demo_base_steps", "20", "--max_steps", "4", "--checkpointing_steps", "2", "--eval_steps", "2",
                    "--max_eval_batches", "3", "--lora_dropout", "0"]
    first = tmp_path / "first"
    result = launch("finetune_lora.py", args + ["--output_dir", first], env, tmp_path)
    out = result.stdout
    assert "demo base model: pre-training a tiny Llama for 20 steps" in out
    assert "is_gradient_checkpointing" not in result.stderr and "sagebwd: float32" not in result.stderr
    assert out.count(common.models.FLOAT32_ATTENTION_NOTE) == 1
    rows = metrics(first)
    assert rows[0]["step"] == "0" and rows[0]["eval_loss"] and not rows[0]["loss"]     # the base model's eval
    train = [r for r in rows if r["loss"]]
    assert [int(r["step"]) for r in train] == [1, 2, 3, 4]
    assert all(math.isfinite(float(r["loss"])) for r in train)
    assert float(train[-1]["eval_loss"]) < float(rows[0]["eval_loss"])                 # the LoRA helps
    for step in (2, 4):
        assert (first / f"checkpoint-{step}" / "training_state.json").exists()

    adapter = first / "adapter"
    assert (adapter / "adapter_config.json").exists() and (adapter / "adapter_model.safetensors").exists()
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    assert adapter_config["r"] == 16 and adapter_config["peft_type"] == "LORA"
    base_path = Path(adapter_config["base_model_name_or_path"])
    assert base_path.parent == Path(env["SAGEBWD_EXAMPLES_CACHE"])          # the cached demo base model
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), adapter)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)               # LoRA B starts at zero: trained

    # The second run finds the demo base model in the cache, and the resumed steps repeat the first run's.
    second = tmp_path / "second"
    out = launch("finetune_lora.py", args + ["--output_dir", second, "--resume_from_checkpoint",
                                             first / "checkpoint-2"], env, tmp_path).stdout
    assert "(cached)" in out and "at step 2" in out
    resumed = [r for r in metrics(second) if r["loss"]]
    assert [int(r["step"]) for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(train, resumed):
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), abs=1e-5), (a, b)
    assert (second / "adapter" / "adapter_model.safetensors").exists()


def test_finetune_lora_local_qk_norm_model_padding_free_jsonl(tmp_path, env, monkeypatch):
    """A local model saved after add_qk_norm, a local JSONL dataset, padding-free batches, chosen targets."""
    import sagebwd_hf
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("SAGEBWD_EXAMPLES_CACHE", env["SAGEBWD_EXAMPLES_CACHE"])
    tokenizer = common.data.train_embedded_tokenizer()
    config = common.models.preset_config("llama", "tiny", tokenizer, 64)
    torch.manual_seed(0)
    base = sagebwd_hf.add_qk_norm(AutoModelForCausalLM.from_config(config))
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    paragraphs = [p for p in common.data.EMBEDDED_TEXT.read_text().split("\n\n") if p.strip()]
    with open(tmp_path / "train.jsonl", "w") as f:
        for p in paragraphs[:120]:
            f.write(json.dumps({"content": p}) + "\n")

    out_dir = tmp_path / "run"
    out = launch("finetune_lora.py", SMALL + ["--model_name_or_path", tmp_path / "base", "--train_file",
                                              tmp_path / "train.jsonl", "--text_column", "content", "--padding_free",
                                              "--lora_target_modules", "q_proj,v_proj", "--max_steps", "2",
                                              "--output_dir", out_dir], env, tmp_path).stdout
    assert "padding_free" in out
    assert len([r for r in metrics(out_dir) if r["loss"]]) == 2
    adapter_config = json.loads((out_dir / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter_config["target_modules"]) == ["q_proj", "v_proj"]


# ---------------------------------------------------------------------------------------------------------
# compare_runs.py
# ---------------------------------------------------------------------------------------------------------

def test_compare_runs_launch_and_metrics(tmp_path, env):
    out_dir = tmp_path / "cmp"
    cmd = [sys.executable, EXAMPLES / "compare_runs.py", "--output_dir", out_dir, "--last_n", "3", "--seeds", "0", "1",
           "--launcher", shlex.join(LAUNCH), "--", *SMALL, "--max_steps", "5", "--no_save_model"]
    out = run(cmd, env, tmp_path).stdout
    assert "| sdpa | 2 |" in out and "| sagebwd | 2 |" in out and "verdict: sagebwd - sdpa" in out
    assert "held-out eval loss: sagebwd " in out and "(95% CI over 2 seeds)" in out
    png = out_dir / "comparison.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert (out_dir / "init_seed0.safetensors").exists() and (out_dir / "init_seed1.safetensors").exists()
    summary = json.loads((out_dir / "summary.json").read_text())
    ref, sage = summary["runs"]
    assert (ref["run"], sage["run"]) == ("sdpa", "sagebwd") and ref["seeds"] == sage["seeds"] == 2
    assert ref["tokens_per_s"] > 0 and sage["tokens_per_s"] > 0 and ref["speed_vs_ref"] == 1.0
    # Same initial weights, same batches within a seed: the runs differ by INT8 attention error only.
    assert abs(sage["mean_gap"]) < 0.02 and sage["mean_abs_gap"] < 0.02 and math.isfinite(sage["gap_ci95"])
    assert sage["eval_gap"] == pytest.approx(sage["final_eval_loss"] - ref["final_eval_loss"], abs=1e-9)
    first = {(impl, seed): float(train_rows(out_dir / impl / f"seed{seed}")[0]["loss"])
             for impl in ("sdpa", "sagebwd") for seed in (0, 1)}
    for seed in (0, 1):
        assert first["sdpa", seed] == pytest.approx(first["sagebwd", seed], abs=1e-2)
    assert first["sdpa", 0] != first["sdpa", 1], "another seed, another start"

    # Drawing again from the run folders (all seeds), with custom labels; and from single CSVs (one seed).
    again = tmp_path / "again"
    out = run([sys.executable, EXAMPLES / "compare_runs.py", "--output_dir", again, "--metrics", out_dir / "sdpa",
               out_dir / "sagebwd", "--labels", "ref", "int8", "--last_n", "3"], env, tmp_path).stdout
    assert "| ref | 2 |" in out and "| int8 | 2 |" in out and "gap vs ref" in out
    assert (again / "comparison.png").exists()
    assert json.loads((again / "summary.json").read_text())["runs"][1]["mean_gap"] == pytest.approx(sage["mean_gap"])
    out = run([sys.executable, EXAMPLES / "compare_runs.py", "--output_dir", tmp_path / "one", "--metrics",
               out_dir / "sdpa" / "seed0" / "metrics.csv", out_dir / "sagebwd" / "seed0", "--last_n", "3"],
              env, tmp_path).stdout
    assert "no noise estimate" in out


# ---------------------------------------------------------------------------------------------------------
# code_corpus.py, token files, scale_study.py
# ---------------------------------------------------------------------------------------------------------

def _source_tree(root, n=60):
    """A folder of small Python files, a duplicate of one of them, an empty one and one over the size limit."""
    rng = random.Random(0)
    words = ["def", "return", "self", "import", "for", "in", "if", "else", "value", "index", "numpy", "torch"]
    for i in range(n):
        package = root / f"pkg{i % 5}"
        package.mkdir(parents=True, exist_ok=True)
        body = "\n".join(f"    x{j} = {' '.join(rng.choice(words) for _ in range(6))!r}" for j in range(30))
        (package / f"mod{i}.py").write_text(f"def f{i}():\n{body}\n    return {i}\n")
    (root / "pkg0" / "copy_of_mod0.py").write_bytes((root / "pkg0" / "mod0.py").read_bytes())
    (root / "pkg1" / "empty.py").write_text("\n")
    (root / "pkg2" / "table.py").write_text("T = [" + ", ".join(map(str, range(40000))) + "]\n")
    (root / "pkg3" / "notes.txt").write_text("not python\n")


def test_code_corpus_then_pretrain_on_its_token_files(tmp_path, env):
    import numpy as np
    from transformers import AutoTokenizer

    _source_tree(tmp_path / "src")
    corpus = tmp_path / "corpus"
    out = run([sys.executable, EXAMPLES / "code_corpus.py", "--roots", tmp_path / "src", "--output_dir", corpus,
               "--vocab_size", "512", "--eval_percent", "20", "--max_file_kb", "64"], env, tmp_path).stdout
    manifest = json.loads((corpus / "manifest.json").read_text())
    train, held = manifest["splits"]["train"], manifest["splits"]["eval"]
    # 60 files kept: the duplicate, the empty file, the oversized table and the .txt are left out
    assert train["files"] + held["files"] == 60 and held["files"] >= 3 and "train:" in out
    tokenizer = AutoTokenizer.from_pretrained(corpus / "tokenizer")
    ids = {split: np.load(corpus / f"{split}.npy") for split in ("train", "eval")}
    assert ids["train"].dtype == np.uint16 and ids["train"].size == train["tokens"]
    assert int(ids["train"].max()) < len(tokenizer) == manifest["vocab_size"]
    eos = tokenizer.eos_token_id
    assert (ids["train"] == eos).sum() == train["files"] and ids["train"][-1] == eos   # one EOS per file
    first = ids["train"][:int(np.argmax(ids["train"] == eos))]
    assert tokenizer.decode(first.tolist()).startswith("def f")                    # byte-level: exact text back
    # no held-out text in training: every eval file's first line is absent from the training text
    text = tokenizer.decode(ids["train"].tolist())
    eval_docs = tokenizer.decode(ids["eval"].tolist()).split(common.data.EOS_TOKEN)
    assert all(doc.splitlines()[0] not in text for doc in eval_docs if doc.strip())
    # the same sources give the same bytes, however many files are encoded at a time
    run([sys.executable, EXAMPLES / "code_corpus.py", "--roots", tmp_path / "src", "--output_dir", tmp_path / "again",
         "--vocab_size", "512", "--eval_percent", "20", "--max_file_kb", "64", "--batch_mb", "0.01"], env, tmp_path)
    assert json.loads((tmp_path / "again" / "manifest.json").read_text())["splits"] == manifest["splits"]
    for split in ("train", "eval"):
        assert (tmp_path / "again" / f"{split}.npy").read_bytes() == (corpus / f"{split}.npy").read_bytes()
    assert not [p.name for p in (tmp_path / "again").iterdir() if p.name.startswith(".")]   # no partial file left

    out_dir = tmp_path / "run"
    data = ["--train_file", corpus / "train.npy", "--validation_file", corpus / "eval.npy",
            "--tokenizer_name", corpus / "tokenizer"]
    out = launch("pretrain.py", SMALL + data + ["--max_steps", "3", "--no_save_model", "--output_dir", out_dir],
                 env, tmp_path).stdout
    rows_per_split = {split: ids[split].size // 64 for split in ids}
    assert f"{rows_per_split['train']} training rows (packed), {rows_per_split['eval']} validation rows" in out
    rows = metrics(out_dir)
    assert len(train_rows(out_dir)) == 3 and rows[-1]["eval_loss"] and int(rows[-1]["tokens"]) == 3 * 4 * 64
    _fails_before_training("pretrain.py", SMALL + data[:4] + ["--output_dir", tmp_path / "x"], env, tmp_path,
                           "--tokenizer_name")
    _fails_before_training("pretrain.py", SMALL + data + ["--padding_free", "--output_dir", tmp_path / "x"], env,
                           tmp_path, "--padding_free")
    _fails_before_training("pretrain.py", SMALL + ["--train_file", corpus / "train.npy", "--tokenizer_name", "embedded",
                                                   "--output_dir", tmp_path / "x"], env, tmp_path,
                           "was made by another tokenizer")
    np.save(tmp_path / "bad.npy", np.array([1, 2, 600] * 100, dtype=np.uint16))
    _fails_before_training("pretrain.py", SMALL + ["--train_file", tmp_path / "bad.npy", "--tokenizer_name",
                                                   corpus / "tokenizer", "--output_dir", tmp_path / "x"], env,
                           tmp_path, "token id 600 is outside the tokenizer's")


def test_code_corpus_writes_outside_the_repository_by_default(tmp_path, monkeypatch):
    """A full corpus is a few hundred MB: by default it goes to the examples' cache folder, where scale_study.py
    looks for it, not into the repository."""
    import code_corpus
    import scale_study

    monkeypatch.setenv("SAGEBWD_EXAMPLES_CACHE", str(tmp_path / "cache"))
    out = Path(code_corpus.parse_args([]).output_dir)
    assert out == tmp_path / "cache" / "code_corpus" and ROOT not in out.parents
    assert Path(scale_study.parse_args([]).corpus) == out
    monkeypatch.delenv("SAGEBWD_EXAMPLES_CACHE")
    assert ROOT not in Path(code_corpus.parse_args([]).output_dir).resolve().parents


def test_scale_study_runs_cells_resumes_and_reports(tmp_path, env, monkeypatch):
    import scale_study

    _source_tree(tmp_path / "src")
    corpus = tmp_path / "corpus"
    run([sys.executable, EXAMPLES / "code_corpus.py", "--roots", tmp_path / "src", "--output_dir", corpus,
         "--vocab_size", "512", "--eval_percent", "20"], env, tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("TRITON_INTERPRET", "SAGEBWD_POISON"):     # as the env fixture: the runs take the CPU path
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(scale_study, "SEQ_LEN", 32)
    monkeypatch.setattr(scale_study, "MICRO_BATCH", 2)
    monkeypatch.setattr(scale_study, "MODEL", ["--size", "tiny", "--seq_len", "32", "--per_device_batch_size", "2",
                                               "--no_save_model", "--max_eval_batches", "2"])
    monkeypatch.setattr(scale_study, "PLAN", {"64k": dict(accumulation=1, steps=4, lr=1e-3),
                                              "1m": dict(accumulation=2, steps=2, lr=2e-3)})
    results, docs = tmp_path / "results", tmp_path / "docs"
    argv = ["--corpus", str(corpus), "--results", str(results), "--work_dir", str(tmp_path / "work"),
            "--seeds", "0", "1", "--arms", "sdpa", "sagebwd"]
    # a deadline too short for any cell runs none
    scale_study.main(argv + ["--deadline_s", "1"])
    assert not results.exists()
    scale_study.main(argv)
    done = sorted(p.relative_to(results).as_posix() for p in results.glob("*/*/seed*/run_summary.json"))
    assert len(done) == 2 * 2 * 2 and "1m/sagebwd/seed1/run_summary.json" in done
    cell = json.loads((results / "1m" / "sagebwd" / "seed0" / "cell.json").read_text())
    assert cell["plan"]["tokens_per_step"] == 2 * 32 * 2 and "--gradient_accumulation_steps 2" in cell["command"]
    assert len(train_rows(results / "1m" / "sagebwd" / "seed0")) == 2
    # within a seed the arms start from the same weights on the same batches: first losses agree
    first = {arm: float(train_rows(results / "64k" / arm / "seed0")[0]["loss"]) for arm in ("sdpa", "sagebwd")}
    assert first["sdpa"] == pytest.approx(first["sagebwd"], abs=1e-2)
    # called again: nothing left to run; a changed plan makes its cells pending again
    assert all(scale_study.is_done(results, r, a, s) for r, a, s in scale_study.cells(scale_study.parse_args(argv)))
    monkeypatch.setitem(scale_study.PLAN, "1m", dict(accumulation=2, steps=3, lr=2e-3))
    assert not scale_study.is_done(results, "1m", "sdpa", 0) and scale_study.is_done(results, "64k", "sdpa", 0)
    # --cells names cells in its own order (duplicates once) and refuses what the plan does not hold
    picked = scale_study.parse_args(argv + ["--cells", "1m/sagebwd/1", "64k/sdpa/0", "1m/sagebwd/1"])
    assert scale_study.cells(picked) == [("1m", "sagebwd", 1), ("64k", "sdpa", 0)]
    for bad in ("2m/sdpa/0", "1m/flash/0", "1m/sdpa", "1m/sdpa/x"):
        with pytest.raises(SystemExit):
            scale_study.parse_args(argv + ["--cells", bad])
    # the fast presets' arms: not default arms, run by --cells, judged against sdpa
    assert not {"sagebwd_fast", "sagebwd_fastest"} & set(scale_study.parse_args([]).arms)
    assert scale_study.parse_args(argv + ["--cells", "64k/sagebwd_fastest/2"]).cells == [("64k", "sagebwd_fastest", 2)]
    assert scale_study.ARMS["sagebwd_fastest"][-2:] == ["--precision", "fastest"]
    assert any("sagebwd_fastest" in arms and arms[0] == "sdpa" for _, arms in scale_study.COMPARISONS)
    scale_study.main(argv + ["--cells", "64k/sagebwd_fast/0", "64k/sagebwd_fast/1"])
    cell = json.loads((results / "64k" / "sagebwd_fast" / "seed0" / "cell.json").read_text())
    assert "--attn_implementation sagebwd --precision fast" in cell["command"]
    summary = json.loads((results / "64k" / "sagebwd_fast" / "seed0" / "run_summary.json").read_text())
    assert summary["precision"] == "fast"
    fast = [float(r["loss"]) for r in train_rows(results / "64k" / "sagebwd_fast" / "seed0")]
    accurate = [float(r["loss"]) for r in train_rows(results / "64k" / "sagebwd" / "seed0")]
    assert fast[0] == pytest.approx(first["sdpa"], abs=1e-2)
    assert fast != accurate                     # the same run but for the preset: its rounding shows in the losses
    # --devices: a cell on each GPU at once (CUDA_VISIBLE_DEVICES), started in order, each recorded with its GPU
    with pytest.raises(SystemExit):
        scale_study.parse_args(argv + ["--devices", "0", "0"])
    started = []
    popen = subprocess.Popen

    def spy(cmd, **kwargs):
        alive = sum(proc.poll() is None for proc in started)
        proc = popen(cmd, **kwargs)
        proc.seen = (kwargs["env"].get("CUDA_VISIBLE_DEVICES"), alive)
        started.append(proc)
        return proc
    with monkeypatch.context() as patch:
        patch.setattr(scale_study.subprocess, "Popen", spy)
        scale_study.main(argv + ["--results", str(tmp_path / "parallel"), "--cells", "64k/sagebwd_fastest/0",
                                 "64k/sdpa/2", "--devices", "7", "9"])
    assert [proc.seen for proc in started] == [("7", 0), ("9", 1)]     # the second started while the first ran
    for arm, seed, device in (("sagebwd_fastest", 0, "7"), ("sdpa", 2, "9")):
        cell = json.loads((tmp_path / "parallel" / "64k" / arm / f"seed{seed}" / "cell.json").read_text())
        assert cell["device"] == device and scale_study.is_done(tmp_path / "parallel", "64k", arm, seed)

    scale_study.main(["--report", "--results", str(results), "--docs", str(docs)])
    for regime, arms in (("64k", ["sdpa", "sagebwd", "sagebwd_fast"]), ("1m", ["sdpa", "sagebwd"])):
        summary = json.loads((docs / regime / "summary.json").read_text())
        assert [r["run"] for r in summary["runs"]] == arms
        assert all(row["seeds"] == 2 and "verdict" in row for row in summary["runs"][1:])
        assert (docs / regime / "comparison.png").exists()
    assert not (docs / "64k_qknorm").exists()        # no sdpa_qknorm reference ran


def _synthetic_run(path, offset, step_time_s=0.5):
    """A metrics.csv of 40 steps: a falling loss moved by ``offset``."""
    logger = common.metrics.CSVLogger(path / "metrics.csv")
    for step in range(1, 41):
        logger.log(step=step, loss=5.0 - step / 40 + offset, tokens=100 * step, step_time_s=step_time_s)
    logger.close()


def test_compare_runs_from_diverging_csvs(tmp_path):
    """The summary measures the gap: two synthetic runs 0.5 apart give a mean gap of 0.5."""
    import compare_runs

    _synthetic_run(tmp_path / "a" / "seed0", 0.0, step_time_s=0.5)
    _synthetic_run(tmp_path / "b" / "seed0", 0.5, step_time_s=1.0)
    compare_runs.main(["--output_dir", str(tmp_path / "out"), "--metrics", str(tmp_path / "a" / "seed0"),
                       str(tmp_path / "b" / "seed0"), "--last_n", "10", "--skip_steps", "0"])
    runs = json.loads((tmp_path / "out" / "summary.json").read_text())["runs"]
    assert runs[1]["mean_gap"] == pytest.approx(0.5) and runs[1]["mean_abs_gap"] == pytest.approx(0.5)
    assert runs[0]["tokens_per_s"] == pytest.approx(200) and runs[1]["speed_vs_ref"] == pytest.approx(0.5)
    assert runs[0]["final_loss"] == pytest.approx(5.0 - 35.5 / 40)
    assert "no verdict" in runs[1]["verdict"]


@pytest.mark.parametrize("offset,expected", [(0.05, "larger than the noise"), (0.0, "within the noise")])
def test_compare_runs_verdict_against_seed_noise(tmp_path, offset, expected):
    """Per-seed shifts of sd 0.05 are the noise: a gap of 0.05 on every seed stands out of it, none does not.
    The seeds pair up (each b run shares its seed's shift with its a run, as runs from one start do)."""
    import compare_runs

    rnd = random.Random(1)
    for seed in range(4):
        shift = rnd.gauss(0.0, 0.05)
        for name, extra in (("a", 0.0), ("b", offset + rnd.gauss(0.0, 0.01))):
            _synthetic_run(tmp_path / name / f"seed{seed}", shift + extra)
    compare_runs.main(["--output_dir", str(tmp_path / "out"), "--metrics", str(tmp_path / "a"), str(tmp_path / "b"),
                       "--last_n", "10"])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    ref, other = summary["runs"]
    assert ref["seeds"] == other["seeds"] == 4 and ref["final_loss_sd"] > 0.01
    assert expected in other["verdict"], other["verdict"]
    assert other["mean_gap"] == pytest.approx(offset, abs=0.02)
    assert expected in (tmp_path / "out" / "summary.md").read_text()


def test_compare_runs_pairs_runs_by_seed(tmp_path, capsys):
    """Implementations with different seeds: each pairs with the reference's run of the same seed (a seed shifts
    both by the same amount, so pairing by position would mix the shifts); the reference's own spread uses all
    of its seeds; a run whose seed the reference lacks is left out, and said so."""
    import compare_runs

    shifts = {0: 0.0, 1: 0.3, 2: -0.2, 3: 0.1}
    for seed in (0, 1, 2):
        _synthetic_run(tmp_path / "ref" / f"seed{seed}", shifts[seed])
    for seed in (1, 2, 3):
        _synthetic_run(tmp_path / "b" / f"seed{seed}", shifts[seed] + 0.05)
    _synthetic_run(tmp_path / "c" / "seed0", shifts[0] - 0.01)
    compare_runs.main(["--output_dir", str(tmp_path / "out"), "--metrics", str(tmp_path / "ref"), str(tmp_path / "b"),
                       str(tmp_path / "c"), "--last_n", "10"])
    assert "b: seed3 without a ref run of the same seed: left out" in capsys.readouterr().out
    ref, b, c = json.loads((tmp_path / "out" / "summary.json").read_text())["runs"]
    assert ref["seeds"] == 3 and b["seeds"] == 2 and c["seeds"] == 1
    assert b["gap_per_seed"] == pytest.approx([0.05, 0.05]) and c["mean_gap"] == pytest.approx(-0.01)
    assert b["relative_gap"] == pytest.approx(0.05 / (5.0 - 35.5 / 40 + 0.05))
    assert ref["final_loss_sd"] == pytest.approx(statistics.stdev([0.0, 0.3, -0.2]))


# ---------------------------------------------------------------------------------------------------------
# Losses are logged in float32 under every launcher
# ---------------------------------------------------------------------------------------------------------

def test_losses_that_differ_in_the_fourth_digit_are_printed_and_saved_apart(tmp_path):
    """One step's loss goes through the loop's reduction (mean over micro-batches and processes, here Accelerate
    on one CPU process), its printed line and metrics.csv: 6.3047 and 6.3051 stay apart everywhere (as bf16 numbers
    both would be 6.3125). 16-bit micro-batch losses are upcast before the mean: the mean of bf16 6.28125 and 6.3125
    is 6.296875, which bf16 arithmetic would round to one of them."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    training = common.training
    accelerator = Accelerator(cpu=True)
    try:
        losses = [training.mean_loss(accelerator, [torch.tensor(x)]) for x in (6.3047, 6.3051)]
        half = [torch.tensor(6.28125, dtype=torch.bfloat16), torch.tensor(6.3125, dtype=torch.bfloat16)]
        assert training.mean_loss(accelerator, half) == 6.296875
    finally:
        AcceleratorState._reset_state(True)
    assert [training.step_line(1, 2, x, 1e-3, 1000.0).split()[3] for x in losses] == ["6.3047", "6.3051"]
    line = training.step_line(2, 2, losses[0], 1e-3, 1000.0, eval_loss=losses[1], eval_ppl=math.exp(losses[1]))
    assert "loss 6.3047" in line and "eval loss 6.3051" in line
    logger = common.metrics.CSVLogger(tmp_path / "metrics.csv")
    for step, x in enumerate(losses, 1):
        logger.log(step=step, loss=x, eval_loss=x)
    logger.close()
    rows = common.metrics.read_metrics(tmp_path / "metrics.csv")
    assert [(r["loss"], r["eval_loss"]) for r in rows] == [("6.3047", "6.3047"), ("6.3051", "6.3051")]


def test_an_empty_evaluation_set_reports_no_loss_not_zero():
    """No validation row as long as --seq_len leaves nothing to evaluate: evaluate says so (None) instead of a mean
    of 0 over 0 tokens, and the step's line prints no eval loss; a non-empty set still gets its token-weighted mean."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    training = common.training

    class Model(torch.nn.Module):
        def forward(self, labels, **_):
            return types.SimpleNamespace(loss=labels.float().mean())

    accelerator = Accelerator(cpu=True)
    try:
        assert training.evaluate(accelerator, Model(), []) == (None, None)
        batch = dict(input_ids=torch.ones(1, 5, dtype=torch.long), labels=torch.full((1, 5), 2))
        loss, ppl = training.evaluate(accelerator, Model(), [batch])
    finally:
        AcceleratorState._reset_state(True)
    assert loss == 2.0 and ppl == pytest.approx(math.exp(2.0))
    assert "eval" not in training.step_line(8, 8, 6.4, 1e-4, 1000.0, None, None)


FSDP2_LOSS_DTYPE = """
import json, sys, types
import torch, torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM
import common.training

dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
results = {}
for policy in ("accelerate", "kept"):
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")                  # what Accelerate sets up for --mixed_precision bf16
    if policy == "kept":
        common.training.keep_loss_float32(types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin)))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    fully_shard(model, mp_policy=plugin.mixed_precision_policy)
    ids = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    logits = out.logits.detach().float()
    reference = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    mp = plugin.mixed_precision_policy
    grads = [p.grad.full_tensor() for p in model.parameters()]
    results[policy] = dict(loss=out.loss.item(), loss_dtype=str(out.loss.dtype), logits_dtype=str(out.logits.dtype),
                           reference=reference.item(), param_dtype=str(mp.param_dtype),
                           reduce_dtype=str(mp.reduce_dtype), grads=[g.double().sum().item() for g in grads])
dist.destroy_process_group()
print(json.dumps(results))
"""


def test_fsdp2_with_bf16_mixed_precision_returns_the_loss_in_float32(tmp_path, env):
    """Accelerate's FSDP2 policy for --mixed_precision bf16 casts the model's outputs to bf16, the loss included, so
    every process logged a bf16 loss. With keep_loss_float32 (what make_accelerator applies) the loss is the
    float32 cross-entropy of the model's bf16 logits; parameters and gradient reduction stay bf16, logits stay bf16
    and the gradients are the same. FSDP2 itself (fully_shard on one gloo process on the CPU): Accelerate uses
    FSDP on GPUs only."""
    script = tmp_path / "fsdp2_loss.py"
    script.write_text(FSDP2_LOSS_DTYPE)
    out = run([sys.executable, script, tmp_path / "store"], dict(env, PYTHONPATH=str(EXAMPLES)), tmp_path).stdout
    results = json.loads(out.strip().splitlines()[-1])
    accelerate, kept = results["accelerate"], results["kept"]
    assert accelerate["loss_dtype"] == "torch.bfloat16"
    assert kept["loss_dtype"] == "torch.float32" and kept["loss"] == pytest.approx(kept["reference"], abs=1e-6)
    assert accelerate["loss"] == float(torch.tensor(kept["loss"]).bfloat16())    # the same loss, rounded
    for result in (accelerate, kept):
        assert result["logits_dtype"] == result["param_dtype"] == result["reduce_dtype"] == "torch.bfloat16"
    assert kept["grads"] == accelerate["grads"]


# ---------------------------------------------------------------------------------------------------------
# Bad inputs: one line that names the flag, before any training step
# ---------------------------------------------------------------------------------------------------------

def _fails_before_training(script, argv, env, cwd, expected):
    result = run([sys.executable, EXAMPLES / script] + [str(a) for a in argv], env, cwd, expect_ok=False)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], result.stderr[-3000:]
    assert "step 1/" not in result.stdout


def test_bad_inputs_fail_before_training(tmp_path, env):
    from transformers import LlamaConfig

    base = ["--seq_len", "64", "--max_steps", "2", "--output_dir", tmp_path / "run"]
    _fails_before_training("pretrain.py", base + ["--train_file", tmp_path / "missing.txt"], env, tmp_path,
                           "--train_file")
    _fails_before_training("finetune_lora.py", base + ["--validation_file", tmp_path / "missing.txt"], env,
                           tmp_path, "--validation_file")
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"document {i} " * 40}) for i in range(40)) + "\n")
    _fails_before_training("pretrain.py", base + ["--train_file", data, "--text_column", "body"], env, tmp_path,
                           "--text_column 'body' is not a column")
    config = tmp_path / "short_positions"
    LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=32).save_pretrained(config)
    _fails_before_training("pretrain.py", base + ["--config_name", config], env, tmp_path,
                           "--seq_len 64 is longer than the model's max_position_embeddings (32")
    _fails_before_training("finetune_lora.py", base + ["--model_name_or_path", tmp_path / "no_model"], env, tmp_path,
                           "--model_name_or_path")


def test_resume_from_another_models_checkpoint_fails_before_training(tmp_path, env):
    args = SMALL + ["--max_steps", "1", "--checkpointing_steps", "1", "--no_save_model"]
    launch("pretrain.py", args + ["--output_dir", tmp_path / "tiny"], env, tmp_path)
    _fails_before_training("pretrain.py", args + ["--output_dir", tmp_path / "other", "--qk_norm",
                                                  "--resume_from_checkpoint", tmp_path / "tiny" / "checkpoint-1"],
                           env, tmp_path, "--resume_from_checkpoint")


# ---------------------------------------------------------------------------------------------------------
# Bad flags name the flag and the allowed values
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script,argv,expected", [
    ("pretrain", ["--attn_implementation", "flash"], ["--attn_implementation", "sagebwd", "sdpa", "eager"]),
    ("pretrain", ["--size", "7b"], ["--size", "tiny", "60m", "1b"]),
    ("pretrain", ["--max_steps", "0"], ["--max_steps", "> 0"]),
    ("pretrain", ["--precision", "fp4"], ["--precision", "'accurate', 'fast'", "pv_e4m3", "'fp4'"]),
    ("pretrain", ["--precision", "fast", "--attn_implementation", "sdpa"],
     ["--precision fast", "--attn_implementation sagebwd", "sdpa"]),
    ("finetune_lora", ["--lora_dropout", "1.5"], ["--lora_dropout", "[0, 1)"]),
    ("finetune_lora", ["--packing", "--padding_free"], ["--padding_free", "--packing"]),
    ("compare_runs", ["--attn_implementations", "sdpa", "flash"], ["--attn_implementations", "sagebwd"]),
    ("compare_runs", ["--", "--output_dir", "x"], ["--output_dir", "compare_runs.py"]),
    ("compare_runs", ["--", "--seed", "3"], ["--seed", "--seeds"]),
    ("compare_runs", ["--seeds", "1", "1"], ["--seeds", "different"]),
])
def test_bad_flags(script, argv, expected, capsys):
    module = __import__(script)
    with pytest.raises(SystemExit) as exc:
        module.parse_args(argv)
    message = str(exc.value.code) + capsys.readouterr().err
    assert exc.value.code != 0
    for text in expected:
        assert text in message, message


@pytest.mark.parametrize("argv,world,expected", [
    (["--context_parallel", "0"], 2, ["--context_parallel", ">= 1"]),
    (["--context_parallel", "2"], 3, ["--context_parallel 2", "number of processes (3)"]),
    (["--context_parallel", "2", "--padding_free"], 2, ["--context_parallel", "--padding_free"]),
    (["--context_parallel", "2", "--attn_implementation", "eager"], 2, ["sagebwd or sdpa", "eager"]),
    (["--context_parallel", "2", "--seq_len", "130"], 2, ["--seq_len 130", "multiple of 2 x --context_parallel = 4"]),
    (["--context_parallel", "2", "--precision", "fast"], 2, ["--precision fast", "--context_parallel 2", "'accurate'"]),
])
def test_bad_context_parallel_flags(argv, world, expected, monkeypatch, capsys):
    """--context_parallel refuses what ring attention cannot run, naming the flag, before anything loads."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    test_bad_flags("pretrain", argv, expected, capsys)


def test_context_parallel_flag_passes_checks_and_is_inert_without_it(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = __import__("pretrain").parse_args(["--context_parallel", "2", "--seq_len", "128"])
    config = common.context_parallel.parallelism_config(args)
    assert (config.cp_size, config.dp_shard_size) == (2, 2)
    assert common.context_parallel.parallelism_config(__import__("pretrain").parse_args([])) is None



# ---------------------------------------------------------------------------------------------------------
# --help: each default said once
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", ["pretrain", "finetune_lora", "finetune_trainer", "compare_runs", "code_corpus",
                                    "scale_study"])
def test_help_says_each_default_once(script, capsys):
    module = __import__(script)
    with pytest.raises(SystemExit) as exc:
        module.parse_args(["--help"])
    assert exc.value.code == 0
    flags, current = {}, None
    for line in capsys.readouterr().out.splitlines():
        option = re.match(r"\s{2}(-{1,2}[\w-]+)", line)
        if option:
            current = option.group(1)
            flags[current] = ""
        elif not line.startswith(" "):         # a group's title or a blank line ends the flag's text
            current = None
        if current is not None and line.strip():
            flags[current] += " " + line.strip()
    assert len(flags) > 4 and "-h" in flags
    for flag, text in flags.items():
        assert text.count("default") <= 1, (flag, text)
    if "--attn_implementation" in flags:
        assert all(f"{name} (" in flags["--attn_implementation"] for name in common.arguments.ATTN_IMPLEMENTATIONS)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_gpu_proof_help_prints_usage_and_exits_0(flag, tmp_path):
    """gpu_proof.sh --help prints its usage and the knobs it reads, and starts nothing (no output folder)."""
    result = subprocess.run(["bash", EXAMPLES / "gpu_proof.sh", flag], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60, env=dict(os.environ, OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work")))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: ") and "single|ddp|fsdp|all" in result.stdout
    assert "STEPS" in result.stdout and "--help" in result.stdout and not result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()
    bad = subprocess.run(["bash", EXAMPLES / "gpu_proof.sh", "bogus"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work")))
    assert bad.returncode == 2 and "usage:" in bad.stderr
