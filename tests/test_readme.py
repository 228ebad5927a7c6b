"""README's runnable snippets run as written: every ```python block whose first line is ``# runs as written``."""
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
MARKER = "# runs as written"


def runnable_blocks():
    with open(README) as f:
        text = f.read()
    return [block for block in re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)
            if block.startswith(MARKER + "\n")]


def test_readme_has_a_runnable_usage_snippet():
    assert runnable_blocks(), f"README.md has no ```python block that starts with {MARKER!r}"


@pytest.mark.parametrize("index", range(len(runnable_blocks())))
def test_snippet_runs_as_written(index, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # a user's CPU runs the PyTorch path
    code = runnable_blocks()[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})
