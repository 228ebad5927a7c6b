#!/usr/bin/env python
"""Build a pre-training corpus, with no download, from the Python sources installed on this machine: the
standard library and every site-packages folder (on a typical GPU machine: torch, JAX, SciPy, scikit-learn,
pandas, Transformers, ...), tens of millions of tokens of code that nobody on this project wrote.

    python examples/code_corpus.py                                     # every installed .py file
    python examples/code_corpus.py --output_dir /tmp/c --max_files 200 # a small one, for a quick look
    C=~/.cache/sagebwd-hf-examples/code_corpus                         # the default --output_dir
    python examples/pretrain.py --train_file $C/train.npy --validation_file $C/eval.npy \\
        --tokenizer_name $C/tokenizer ...

Rules, each for a reason:
- a file's exact duplicates are kept once (site-packages hold many vendored copies), and files over
  --max_file_kb are left out (generated tables and data, not code);
- the held-out split is by a hash of the file's content (--eval_percent of the files): whole files are held
  out, so no evaluation text was seen in training, and the split does not depend on where a file is installed;
- a byte-level BPE (--vocab_size, GPT-2 style, nothing is ever unknown) is trained on a fixed sample of the
  training files, then every file is encoded and ends with the EOS token (the document boundary).

Writes into --output_dir (default: ``code_corpus`` in the examples' cache folder, ``$SAGEBWD_EXAMPLES_CACHE`` or
``~/.cache/sagebwd-hf-examples``; outside the repository: a full corpus is a few hundred MB): ``train.npy`` and
``eval.npy`` (uint16 token ids, files in path order, each followed by EOS), ``tokenizer/`` (a Transformers fast
tokenizer) and ``manifest.json`` (roots, file and token counts per root and split, the token files' SHA-256,
package versions, and the tokenizer's vocabulary fingerprint, which pretrain.py checks against
--tokenizer_name). The same installed packages give the same bytes; the manifest says which packages those were.

Memory stays small whatever the corpus size: the files are listed (path and digest) first, then read again and
encoded a batch of about --batch_mb at a time, and the token ids go straight to the .npy files on disk.
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
from common.arguments import HelpFormatter
from common.data import train_bpe, vocab_fingerprint
from common.files import code_corpus_dir


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--output_dir", default=str(code_corpus_dir()),
                        help="where the token files, the tokenizer and manifest.json go")
    parser.add_argument("--roots", nargs="+", default=None,
                        help="folders to read .py files from (default: the standard library and site-packages)")
    parser.add_argument("--vocab_size", type=int, default=8192, help="BPE vocabulary, EOS included (<= 65536)")
    parser.add_argument("--eval_percent", type=float, default=2.0, help="files held out for evaluation")
    parser.add_argument("--max_file_kb", type=int, default=256, help="larger files are left out")
    parser.add_argument("--max_files", type=int, default=None, help="keep the first N files (path order)")
    parser.add_argument("--tokenizer_sample_mb", type=float, default=24.0,
                        help="megabytes of training files the BPE learns from")
    parser.add_argument("--batch_mb", type=float, default=8.0,
                        help="megabytes of source text encoded at a time (bounds the memory; the output is the same)")
    args = parser.parse_args(argv)
    if not 256 < args.vocab_size <= 65536:
        parser.error(f"--vocab_size must be in (256, 65536] (token ids are stored as uint16), got {args.vocab_size}")
    if not 0 < args.eval_percent < 50:
        parser.error(f"--eval_percent must be in (0, 50), got {args.eval_percent}")
    if not args.batch_mb > 0:
        parser.error(f"--batch_mb must be > 0, got {args.batch_mb}")
    return args


def default_roots():
    """The standard library and every site-packages folder of this interpreter, without nesting."""
    paths = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    paths += site.getsitepackages() + [site.getusersitepackages()]
    roots = sorted({os.path.realpath(p) for p in paths if os.path.isdir(p)})
    return [r for r in roots if not any(r != o and r.startswith(o + os.sep) for o in roots)]


def collect_files(roots, max_file_kb, max_files=None):
    """(root, relative path, content digest) of every distinct .py file, in (root, path) order. Only the list
    is kept: the texts are read again, a batch at a time, when they are encoded."""
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
                files.append((root, os.path.relpath(path, root), digest))
                if max_files is not None and len(files) >= max_files:
                    return files
    return files


def read_text(file):
    """The text of a listed file, read again; it must still be the file that was listed."""
    root, rel, digest = file
    path = os.path.join(root, rel)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SystemExit(f"error: {path} could not be read again while the corpus was built: {e}") from e
    if hashlib.sha256(data).hexdigest() != digest:
        raise SystemExit(f"error: {path} changed while the corpus was built; run it again")
    return data.decode("utf-8", errors="replace")


def is_held_out(digest, eval_percent):
    return int(digest[:8], 16) % 10000 < eval_percent * 100


def batches(files, batch_bytes):
    """``files`` in order, as lists of (file, text) of about ``batch_bytes`` of text each."""
    batch, size = [], 0
    for f in files:
        text = read_text(f)
        batch.append((f, text))
        size += len(text)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class TokenFile:
    """A 1-D uint16 .npy written a batch at a time: the header is rewritten with the final length at the end
    (its size does not change: numpy pads it to 64 bytes either way), and the SHA-256 of the ids is kept."""

    def __init__(self, path):
        self.path, self.tokens, self.sha256 = Path(path), 0, hashlib.sha256()
        self.file = open(self.path, "wb")
        self._header(10 ** 15)

    def _header(self, length):
        self.file.seek(0)
        np.lib.format.write_array_header_1_0(self.file, {"descr": np.dtype(np.uint16).str, "fortran_order": False,
                                                         "shape": (length,)})
        if not hasattr(self, "data_start"):
            self.data_start = self.file.tell()
        assert self.file.tell() == self.data_start, "the .npy header changed size"

    def write(self, ids):
        data = np.ascontiguousarray(ids, dtype=np.uint16).tobytes()
        self.file.write(data)
        self.sha256.update(data)
        self.tokens += len(data) // 2

    def close(self):
        self._header(self.tokens)
        self.file.close()


def encode_to(bpe, files, eos_id, token_file, batch_bytes):
    """Every file's ids followed by EOS, appended to ``token_file`` a batch at a time (``encode_batch`` runs on
    all cores); returns {root: [files, bytes]} of what was encoded."""
    encode = getattr(bpe, "encode_batch_fast", bpe.encode_batch)   # the same ids, without character offsets
    eos = np.asarray([eos_id], dtype=np.uint16)
    per_root = {}
    for batch in batches(files, batch_bytes):
        parts = []
        for (f, text), enc in zip(batch, encode([text for _, text in batch])):
            parts += [np.asarray(enc.ids, dtype=np.uint16), eos]
            counts = per_root.setdefault(f[0], [0, 0])
            counts[0] += 1
            counts[1] += len(text.encode("utf-8"))
        token_file.write(np.concatenate(parts))
    return per_root


def versions():
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "jax", "numpy", "scipy", "pandas", "scikit-learn", "triton", "sympy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def tokenizer_sample(train, budget_bytes):
    """The BPE sample: training files picked by their digest (spread over every package), up to the budget."""
    size = 0
    for f in sorted(train, key=lambda f: f[2]):
        if size >= budget_bytes:
            return
        text = read_text(f)
        size += len(text)
        yield text


def build(args):
    start = time.time()
    roots = [os.path.realpath(r) for r in args.roots] if args.roots else default_roots()
    files = collect_files(roots, args.max_file_kb, args.max_files)
    if not files:
        raise SystemExit(f"error: no .py file under {roots}")
    held = [is_held_out(f[2], args.eval_percent) for f in files]
    train = [f for f, h in zip(files, held) if not h]
    evals = [f for f, h in zip(files, held) if h]
    if not train or not evals:
        raise SystemExit(f"error: {len(files)} files give an empty split (--eval_percent {args.eval_percent}); "
                         "use more files")
    sample = list(tokenizer_sample(train, args.tokenizer_sample_mb * 2**20))
    bpe, tokenizer = train_bpe(sample, args.vocab_size)
    sample_files = len(sample)
    del sample
    eos_id = tokenizer.eos_token_id
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out / "tokenizer")
    manifest = dict(roots=roots, versions=versions(), vocab_size=len(tokenizer), eos_id=eos_id,
                    vocab_fingerprint=vocab_fingerprint(tokenizer),
                    eval_percent=args.eval_percent, max_file_kb=args.max_file_kb, tokenizer_sample_files=sample_files,
                    splits={})
    for split, group in (("train", train), ("eval", evals)):
        partial = out / f".{split}.npy.partial"          # renamed into place once complete
        token_file = TokenFile(partial)
        try:
            per_root = encode_to(bpe, group, eos_id, token_file, int(args.batch_mb * 2**20))
        finally:
            token_file.close()
        os.replace(partial, out / f"{split}.npy")
        manifest["splits"][split] = dict(
            files=len(group), bytes=sum(b for _, b in per_root.values()), tokens=token_file.tokens,
            sha256=token_file.sha256.hexdigest(),
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
