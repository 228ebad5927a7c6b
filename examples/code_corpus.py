#!/usr/bin/env python
"""Build a pre-training corpus, with no download, from the Python sources installed on this machine: the
standard library and every site-packages folder (on a typical GPU machine: torch, JAX, SciPy, scikit-learn,
pandas, Transformers, ...), tens of millions of tokens of code that nobody on this project wrote.

    python examples/code_corpus.py --output_dir runs/code_corpus              # every installed .py file
    python examples/code_corpus.py --output_dir /tmp/c --max_files 200        # a small one, for a quick look
    python examples/pretrain.py --train_file runs/code_corpus/train.npy --validation_file \\
        runs/code_corpus/eval.npy --tokenizer_name runs/code_corpus/tokenizer ...

Rules, each for a reason:
- a file's exact duplicates are kept once (site-packages hold many vendored copies), and files over
  --max_file_kb are left out (generated tables and data, not code);
- the held-out split is by a hash of the file's content (--eval_percent of the files): whole files are held
  out, so no evaluation text was seen in training, and the split does not depend on where a file is installed;
- a byte-level BPE (--vocab_size, GPT-2 style, nothing is ever unknown) is trained on a fixed sample of the
  training files, then every file is encoded and ends with the EOS token (the document boundary).

Writes into --output_dir: ``train.npy`` and ``eval.npy`` (uint16 token ids, files in path order, each
followed by EOS), ``tokenizer/`` (a Transformers fast tokenizer) and ``manifest.json`` (roots, file and token
counts per root and split, the token files' SHA-256, package versions, and the tokenizer's vocabulary
fingerprint, which pretrain.py checks against --tokenizer_name). The same installed packages give the
same bytes; the manifest says which packages those were.
"""
import argparse
import hashlib
import json
import os
import site
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.arguments import HelpFormatter  # noqa: E402
from common.data import train_bpe, vocab_fingerprint  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--output_dir", default="runs/code_corpus",
                        help="where the token files, the tokenizer and manifest.json go")
    parser.add_argument("--roots", nargs="+", default=None,
                        help="folders to read .py files from (default: the standard library and site-packages)")
    parser.add_argument("--vocab_size", type=int, default=8192, help="BPE vocabulary, EOS included (<= 65536)")
    parser.add_argument("--eval_percent", type=float, default=2.0, help="files held out for evaluation")
    parser.add_argument("--max_file_kb", type=int, default=256, help="larger files are left out")
    parser.add_argument("--max_files", type=int, default=None, help="keep the first N files (path order)")
    parser.add_argument("--tokenizer_sample_mb", type=float, default=24.0,
                        help="megabytes of training files the BPE learns from")
    args = parser.parse_args(argv)
    if not 256 < args.vocab_size <= 65536:
        parser.error(f"--vocab_size must be in (256, 65536] (token ids are stored as uint16), got {args.vocab_size}")
    if not 0 < args.eval_percent < 50:
        parser.error(f"--eval_percent must be in (0, 50), got {args.eval_percent}")
    return args


def default_roots():
    """The standard library and every site-packages folder of this interpreter, without nesting."""
    paths = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    paths += site.getsitepackages() + [site.getusersitepackages()]
    roots = sorted({os.path.realpath(p) for p in paths if os.path.isdir(p)})
    return [r for r in roots if not any(r != o and r.startswith(o + os.sep) for o in roots)]


def collect_files(roots, max_file_kb, max_files=None):
    """(root, relative path, text, content digest) of every distinct .py file, in (root, path) order."""
    seen, files = set(), []
    for root in roots:
        # site-packages under the stdlib folder is its own root (or excluded): no file is read twice
        nested = [r for r in roots if r != root and r.startswith(root + os.sep)]
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if os.path.join(dirpath, d) not in nested
                                 and d != "__pycache__")
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    if os.path.getsize(path) > max_file_kb * 1024 or os.path.islink(path):
                        continue
                    data = Path(path).read_bytes()
                except OSError:
                    continue
                digest = hashlib.sha256(data).hexdigest()
                if digest in seen or not data.strip():
                    continue
                seen.add(digest)
                files.append((root, os.path.relpath(path, root), data.decode("utf-8", errors="replace"), digest))
                if max_files is not None and len(files) >= max_files:
                    return files
    return files


def is_held_out(digest, eval_percent):
    return int(digest[:8], 16) % 10000 < eval_percent * 100


def encode(bpe, texts, eos_id, chunk=2000):
    """Every text's ids followed by EOS, concatenated (``encode_batch`` runs on all cores)."""
    parts = []
    for i in range(0, len(texts), chunk):
        for enc in bpe.encode_batch(texts[i:i + chunk]):
            parts.append(np.asarray(enc.ids, dtype=np.uint16))
            parts.append(np.asarray([eos_id], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def versions():
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "jax", "numpy", "scipy", "pandas", "scikit-learn", "triton", "sympy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def build(args):
    start = time.time()
    roots = [os.path.realpath(r) for r in args.roots] if args.roots else default_roots()
    files = collect_files(roots, args.max_file_kb, args.max_files)
    if not files:
        raise SystemExit(f"error: no .py file under {roots}")
    held = [is_held_out(f[3], args.eval_percent) for f in files]
    train = [f for f, h in zip(files, held) if not h]
    evals = [f for f, h in zip(files, held) if h]
    if not train or not evals:
        raise SystemExit(f"error: {len(files)} files give an empty split (--eval_percent {args.eval_percent}); "
                         "use more files")
    # The BPE sample: training files picked by their digest (spread over every package), up to the budget.
    sample, size = [], 0
    for f in sorted(train, key=lambda f: f[3]):
        if size >= args.tokenizer_sample_mb * 2**20:
            break
        sample.append(f[2])
        size += len(f[2])
    bpe, tokenizer = train_bpe(sample, args.vocab_size)
    eos_id = tokenizer.eos_token_id
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out / "tokenizer")
    manifest = dict(roots=roots, versions=versions(), vocab_size=len(tokenizer), eos_id=eos_id,
                    vocab_fingerprint=vocab_fingerprint(tokenizer),
                    eval_percent=args.eval_percent, max_file_kb=args.max_file_kb, tokenizer_sample_files=len(sample),
                    splits={})
    for split, group in (("train", train), ("eval", evals)):
        ids = encode(bpe, [f[2] for f in group], eos_id)
        np.save(out / f"{split}.npy", ids)
        per_root = {}
        for f in group:
            per_root.setdefault(f[0], [0, 0])
            per_root[f[0]][0] += 1
            per_root[f[0]][1] += len(f[2].encode("utf-8"))
        manifest["splits"][split] = dict(
            files=len(group), bytes=sum(b for _, b in per_root.values()), tokens=int(ids.size),
            sha256=hashlib.sha256(ids.tobytes()).hexdigest(),
            per_root={r: dict(files=n, bytes=b) for r, (n, b) in sorted(per_root.items())})
    manifest["build_s"] = round(time.time() - start, 1)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv=None):
    args = parse_args(argv)
    manifest = build(args)
    for split, info in manifest["splits"].items():
        print(f"{split}: {info['files']:,} files, {info['bytes'] / 2**20:.1f} MiB, {info['tokens']:,} tokens "
              f"({info['bytes'] / max(info['tokens'], 1):.2f} bytes a token), sha256 {info['sha256'][:12]}")
    print(f"vocabulary {manifest['vocab_size']}, built in {manifest['build_s']} s -> {args.output_dir}")


if __name__ == "__main__":
    main()
