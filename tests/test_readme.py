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


def test_the_transformers_quickstart_runs_offline_on_a_cpu():
    """The Transformers quickstart has a runnable block (run above): a model built from a config, no download."""
    blocks = [b for b in runnable_blocks() if 'attn_implementation="sagebwd"' in b]
    assert blocks and any("from_config(" in b and "from_pretrained(" not in b for b in blocks)


def test_quick_start_commands_are_what_ci_runs():
    """README's first commands (pre-train the small model, run the tests) are the ones .ci/run runs on a fresh
    CPU machine, in that order."""
    with open(README) as f:
        text = f.read()
    first_bash = re.search(r"^## Quick start\n.*?^```bash\n(.*?)^```", text, flags=re.M | re.S)
    assert first_bash, "README has no ```bash block under '## Quick start'"
    commands = [line.split("#")[0].strip() for line in first_bash.group(1).splitlines() if line.strip()]
    assert commands == ["python examples/pretrain.py", "python -m pytest -q"]
    with open(os.path.join(os.path.dirname(README), ".ci", "run")) as f:
        ci = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert [c for c in ci if c in commands] == commands
    assert text.index("## Install") < text.index("## Quick start")


def test_readme_stays_short():
    with open(README) as f:
        assert len(f.read().splitlines()) <= 250
