"""Files the examples write: the cache folder for what they build once (tokenizer, demo base model), and writes
that a kill or a second process can never see half done (a folder renamed into place, a file replaced at once)."""
import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """Where the examples keep what they build once (tokenizer, demo base model).
    ``SAGEBWD_EXAMPLES_CACHE`` overrides the default ``~/.cache/sagebwd-hf-examples``."""
    path = os.environ.get("SAGEBWD_EXAMPLES_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                     "sagebwd-hf-examples")
    return Path(path)


def code_corpus_dir() -> Path:
    """examples/code_corpus.py's default output folder (a few hundred MB for a full corpus): in the cache."""
    return cache_dir() / "code_corpus"


def file_digest(path: Path) -> str:
    """The first 12 hex digits of the file's SHA-256: a cache key."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


def atomic_save_dir(final: Path, write) -> Path:
    """Write a folder under a temporary name, then rename it into place: several processes (``accelerate
    launch --num_processes N``) or an interrupted run never see a half-written cache entry."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    try:
        write(tmp)
        try:
            os.replace(tmp, final)
        except OSError:          # another process got there first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def write_atomic(path, text):
    """Replace ``path``'s contents all at once: a kill leaves the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
