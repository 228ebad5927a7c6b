"""The tree speaks of the product only: no work-log words in any tracked text file.

README, docs, CHANGELOG, code, comments, docstrings and tests say what the product does, why, and what was
measured (with dates, devices and versions). A work log's words -- a numbered work session, an issue number of
this project, the names of the tools that built it -- say nothing to a user and go stale at once; history goes
in docs/history.md, dated. Issue numbers of other projects stay when the line names the project
("triton issue 11584", "transformers PR 46634", "SageAttention #34").
"""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = os.path.relpath(os.path.abspath(__file__), ROOT)
# third-party text shipped as data (a public-domain novel for the examples' corpus)
SKIP = (THIS, "examples/data/botchan.txt")
TEXT_SUFFIXES = (".py", ".md", ".txt", ".cfg", ".toml", ".sh", ".yml", ".yaml", ".json", ".csv", "")
UPSTREAM = re.compile(r"\b(triton|pytorch|torch|transformers|flash[-_ ]?attention|flash_attn|fa[234]|"
                      r"sage[-_ ]?attention|accelerate|peft|cutlass|cudnn|nccl|datasets|huggingface|github\.com|llvm|"
                      r"numpy)\b", re.I)
FORBIDDEN = [
    ("a work session", re.compile(r"\bsessions?\b(?!\s*=|\(|\.\w|_)", re.I)),   # (code's session objects pass)
    ("an issue number", re.compile(r"\b(?:issue|task|ticket)\s*#?\s*\d+"
                                   r"|\b(?:issues|tasks)\s*(?:#\s*\d+|\d+\s*(?:and|,|-|&)\s*\d+)",
                                   re.I)),   # ("issues 743 instructions" is a verb)
    ("an issue number", re.compile(r"(?<![\w&/])#\d{1,3}\b(?![\w-])")),
    ("a tool of the workshop", re.compile(r"farm-studio|device tool|\.library/|helper session"
                                          r"|issues (?:resolved|blocked)", re.I)),
]


def tracked_text_files():
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        paths = names.splitlines()
    except (OSError, subprocess.CalledProcessError):   # not a git checkout: every file under the root
        paths = [os.path.relpath(os.path.join(d, f), ROOT) for d, dirs, files in os.walk(ROOT)
                 for f in files if "/." not in "/" + os.path.relpath(d, ROOT) + "/"]
    return [p for p in paths if p not in SKIP and os.path.splitext(p)[1] in TEXT_SUFFIXES
            and os.path.isfile(os.path.join(ROOT, p))]


def findings(path):
    found = []
    try:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError:
        return found
    for number, line in enumerate(lines, 1):
        for what, pattern in FORBIDDEN:
            for match in pattern.finditer(line):
                if what == "an issue number" and UPSTREAM.search(line[:match.start()]):
                    continue
                found.append(f"{path}:{number}: {what}: {line.strip()[:140]}")
    return found


def test_no_work_log_words_in_the_tree():
    found = [f for path in tracked_text_files() for f in findings(path)]
    assert not found, "work-log words in the tree (say it as the product, date it in docs/history.md):\n" + \
        "\n".join(found)


@pytest.mark.parametrize("line, flagged", [
    ("measured in session 17 on an H100", True),
    ("# Session 29: one run", True),
    ("see issue 11 for the targets", True),
    ("the default since issue #45", True),
    ("fixed (#12)", True),
    ("issues 10 and 11 set the targets", True),
    ("the tile loop issues 743 instructions", False),
    ("built with farm-studio", True),
    ("triton issue 11584: bf16 dot in the interpreter", False),
    ("transformers PR 46634 (packed sequences)", False),
    ("SageAttention #34 asks for the true LSE", False),
    ("measured 2026-11-27 on an H200 (docs/history.md)", False),
    ("a process started with setsid keeps its session", True),
    ("requests.Session() and session.get(url)", False),
    ("what was measured this session.", True),
])
def test_the_check_flags_what_it_should(tmp_path, monkeypatch, line, flagged):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    (tmp_path / "f.md").write_text(line + "\n")
    assert bool(findings("f.md")) == flagged
