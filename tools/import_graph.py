"""The package's import graph as Python resolves it, read from the source (nothing is imported).

``sagebwd_hf.kernels`` is the repository's top-level ``kernels/`` folder (setup.cfg's ``package_dir``), so an
import of ``.kernels.dispatch`` from ``sagebwd_hf/interface.py`` is an arrow to ``kernels/dispatch.py``: tools that
map modules to files by folder alone draw ``kernels/`` apart. Prints one ``file -> file`` line per import, then any
cycle::

    python tools/import_graph.py            # sagebwd_hf/ and kernels/
    python tools/import_graph.py --cycles   # cycles only (exit 1 if any)
"""
import argparse
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"sagebwd_hf": "sagebwd_hf", "sagebwd_hf.kernels": "kernels"}   # module prefix -> folder


def module_file(name):
    """The file of module ``name`` (a package's __init__.py), or None outside the package."""
    for prefix in sorted(PACKAGES, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            rest = name[len(prefix) + 1:].split(".") if name != prefix else []
            base = os.path.join(PACKAGES[prefix], *rest)
            for path in (base + ".py", os.path.join(base, "__init__.py")):
                if os.path.isfile(os.path.join(ROOT, path)):
                    return path
            if os.path.isdir(os.path.join(ROOT, base)):
                return base + "/"
    return None


def module_name(path):
    for prefix, folder in sorted(PACKAGES.items(), key=lambda kv: len(kv[1]), reverse=True):
        if path.startswith(folder + "/"):
            rest = path[len(folder) + 1:-3].replace("/", ".")
            rest = rest[:-len(".__init__")] if rest.endswith(".__init__") else rest
            return prefix if rest == "__init__" else f"{prefix}.{rest}"
    raise ValueError(path)


def imports(path):
    """The package modules the file at ``path`` imports (at any depth of its code)."""
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    tree = ast.parse(open(os.path.join(ROOT, path)).read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:   # `from pkg import mod` names a module where one exists
                found.add(f"{base}.{alias.name}" if module_file(f"{base}.{alias.name}") else base)
    return {f for f in (module_file(m) for m in found) if f and f != path and not f.endswith("/")}


def graph():
    files = []
    for folder in PACKAGES.values():
        for dirpath, _, names in os.walk(os.path.join(ROOT, folder)):
            files += [os.path.relpath(os.path.join(dirpath, n), ROOT) for n in names if n.endswith(".py")]
    return {path: imports(path) for path in sorted(files)}


def cycles(edges):
    """Strongly connected components of more than one file (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cycles", action="store_true", help="print the cycles only; exit 1 if there is one")
    args = p.parse_args()
    edges = graph()
    if not args.cycles:
        for src, dsts in edges.items():
            for dst in sorted(dsts):
                print(f"{src} -> {dst}")
    found = cycles(edges)
    for part in found:
        print("cycle:", " ".join(part))
    return 1 if (args.cycles and found) else 0


if __name__ == "__main__":
    sys.exit(main())
