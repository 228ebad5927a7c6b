"""The package's shape: ``sagebwd_hf`` imports the kernels from the repository's top-level ``kernels/`` folder
(``sagebwd_hf.kernels``), ``kernels/`` imports nothing of ``sagebwd_hf``, no two files import each other in a loop,
and in a source checkout only ``kernels/`` joins the package (no other top-level folder is importable through it).
The graph is ``tools/import_graph.py``'s, read from the source."""
import importlib.util
import os

import pytest

import sagebwd_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def edges():
    spec = importlib.util.spec_from_file_location("import_graph", os.path.join(ROOT, "tools", "import_graph.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool, tool.graph()


def test_kernels_import_nothing_of_the_package(edges):
    _, graph = edges
    kernels = [path for path in graph if path.startswith("kernels/")]
    assert "kernels/attention.py" in kernels and "kernels/plan.py" in kernels
    for path in kernels:
        assert all(dst.startswith("kernels/") for dst in graph[path]), (path, graph[path])


def test_the_package_reaches_the_kernels_through_their_entry(edges):
    _, graph = edges
    interface = graph["sagebwd_hf/interface.py"]
    assert {"kernels/attention.py", "kernels/plan.py"} <= interface
    # the launches are the entry's: the op's module builds no kernel call itself
    assert not interface & {"kernels/forward.py", "kernels/backward.py", "kernels/hopper_launch.py",
                            "kernels/quantize.py"}, interface


def test_no_import_cycle(edges):
    tool, graph = edges
    assert tool.cycles(graph) == []
    assert tool.cycles({"a.py": {"b.py"}, "b.py": {"a.py"}}) == [["a.py", "b.py"]]   # the check can fail


def test_only_kernels_joins_the_package():
    assert list(sagebwd_hf.__path__) == [os.path.dirname(sagebwd_hf.__file__)]
    kernels = os.path.realpath(sagebwd_hf.kernels.__path__[0])
    assert os.path.basename(kernels) == "kernels" and os.path.isfile(os.path.join(kernels, "plan.py"))
    for name in ("examples", "benchmarks", "tools", "tests"):
        assert importlib.util.find_spec(f"sagebwd_hf.{name}") is None, name
