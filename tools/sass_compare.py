"""Do two versions of the code compile the Gluon kernels to the same machine code? Compiles each configuration
with compile_offline.py in this tree and in another git ref's (exported with ``git archive``), and compares the
SASS instruction by instruction, addresses and line comments left out. A refactor whose SASS is identical needs no
GPU run to show it changed nothing the GPU executes; one that differs prints the first differing lines.

    /tmp/t36/bin/python tools/sass_compare.py main                       # the default configurations
    /tmp/t36/bin/python tools/sass_compare.py HEAD~3 --configs "dkdvq fastest 64" "fwd fast 128 causal"

A configuration is ``KERNEL PRECISION HEAD_DIM [causal] [JSON]`` (compile_offline.py's ``--kernel``,
``--precision``, ``--head-dim``, ``--causal`` and ``--kw``). Needs the Python of compile_offline.py (Triton 3.6.0's
wheel, whose ptxas it uses).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the kernels a change to the backward or the forward touches, each preset where it runs its own code
DEFAULT_CONFIGS = [
    "dkdvq accurate 64", "dkdvq fastest 64", "dkdvq fastest 128", "dkdv fastest 128",
    "dv accurate 128", "dk accurate 128", "dq accurate 128", "fwd accurate 128 causal", "fwd fast 128",
]
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;")


def parse_config(text):
    """``KERNEL PRECISION HEAD_DIM [causal] [JSON]`` -> compile_offline.py's arguments."""
    words = text.split(maxsplit=3)
    if len(words) < 3 or not words[2].isdigit():
        raise SystemExit(f"--configs: '{text}' is not KERNEL PRECISION HEAD_DIM [causal] [JSON]")
    args = ["--kernel", words[0], "--precision", words[1], "--head-dim", words[2]]
    rest = words[3] if len(words) > 3 else ""
    if rest.startswith("causal"):
        args.append("--causal")
        rest = rest[len("causal"):].strip()
    if rest:
        json.loads(rest)   # (a clear error here rather than in the compiler's)
        args += ["--kw", rest]
    return args


def instructions(sass_path):
    """The SASS's instructions, without their addresses and trailing comments."""
    with open(sass_path) as f:
        return [m.group(1) for m in map(INSTRUCTION.match, f) if m]


def compile_in(tree, args, out):
    subprocess.run([sys.executable, os.path.join(tree, "tools", "compile_offline.py"), *args, "--out", out],
                   check=True, capture_output=True, text=True, cwd=tree)
    return instructions(os.path.join(out, "kernel.sass"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="the git ref to compare this tree against (e.g. main, HEAD~1)")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, metavar="CONFIG")
    a = p.parse_args(argv)
    configs = [(text, parse_config(text)) for text in a.configs]
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = os.path.join(tmp, "base")
        os.makedirs(base_tree)
        archive = subprocess.run(["git", "archive", a.base], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", base_tree], input=archive, check=True)
        differ = 0
        for i, (text, args) in enumerate(configs):
            try:
                mine = compile_in(ROOT, args, os.path.join(tmp, f"mine{i}"))
                theirs = compile_in(base_tree, args, os.path.join(tmp, f"base{i}"))
            except subprocess.CalledProcessError as e:
                print(f"{text:<36} does not compile: {(e.stderr or '').strip().splitlines()[-1:]}")
                differ += 1
                continue
            if mine == theirs:
                print(f"{text:<36} identical ({len(mine)} instructions)")
                continue
            differ += 1
            first = next((j for j, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
            print(f"{text:<36} differs: {len(mine)} instructions here, {len(theirs)} in {a.base}; first at "
                  f"instruction {first}: {mine[first] if first < len(mine) else '(end)'!r} here, "
                  f"{theirs[first] if first < len(theirs) else '(end)'!r} there")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
