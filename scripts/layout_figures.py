"""Figures of the package's layout, read from its source with ``ast``: how many modules,
the longest ones, how deep the imports go, the import cycles, and private names
imported across modules. `python scripts/layout_figures.py [--json]` from the
repository root; docs/design.md explains the layers these figures check.

Only imports inside the ``ckptd`` package count. An import inside a function
counts like one at the top (it is still a dependency), except under
``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

PACKAGE = "ckptd"


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package under ``root``."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Each module's imported package modules, and (importer, module, name) for every
    private name (``_x``) imported from another module."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    private: list[tuple[str, str, str]] = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods:
                        graph[mod].add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, is_pkg, node)
                if not (target == PACKAGE or target.startswith(PACKAGE + ".")):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in mods:  # `from . import x`: the module x
                        graph[mod].add(sub)
                    elif target in mods:
                        graph[mod].add(target)
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            private.append((mod, target, alias.name))
        graph[mod].discard(mod)
    return graph, private


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _condensed(graph: dict[str, set[str]], comps: list[list[str]]) -> dict[str, set[str]]:
    """The import graph with each cycle taken as one module (its first)."""
    rep = {m: c[0] for c in comps for m in c}
    dag: dict[str, set[str]] = {}
    for m, deps in graph.items():
        dag.setdefault(rep.get(m, m), set()).update(rep.get(d, d) for d in deps)
    for m, deps in dag.items():
        deps.discard(m)
    return dag


def longest_chain(graph: dict[str, set[str]], comps: list[list[str]]) -> list[str]:
    """One longest chain of imports, importer first (a cycle counts as one module); its
    length is the number of import levels."""
    dag = _condensed(graph, comps)
    best: dict[str, list[str]] = {}

    def chain(m: str) -> list[str]:
        if m not in best:
            best[m] = [m]
            tails = [chain(x) for x in sorted(dag.get(m, ()))]
            best[m] = [m] + max(tails, key=len, default=[])
        return best[m]

    return max((chain(m) for m in sorted(dag)), key=len, default=[])

def format_branches(mods: dict[str, Path]) -> list[str]:
    """Comparisons with a format's name (``x == "hdf5"``) outside the format package:
    each is a branch that a new storage format would have to grow."""
    out = []
    for mod, path in mods.items():
        if mod.startswith(f"{PACKAGE}.format"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in ("hdf5", "chunk")
                    for c in [node.left, *node.comparators]):
                out.append(f"{mod}:{node.lineno}")
    return out


def figures(root: Path) -> dict:
    mods = modules(root)
    graph, private = imports(mods)
    comps = cycles(graph)
    sizes = sorted(((sum(1 for _ in p.open()), m) for m, p in mods.items()), reverse=True)
    top = [m for m in mods if m.count(".") == 1 and not mods[m].name == "__init__.py"]
    return {
        "modules": len(mods),
        "top_level_modules": len(top),
        "longest": [{"module": m, "lines": n} for n, m in sizes[:8]],
        "over_500_lines": [m for n, m in sizes if n > 500],
        "import_levels": len(chain := longest_chain(graph, comps)),
        "longest_chain": chain,
        "cycles": comps,
        "private_imports": [f"{a} imports {c} from {b}" for a, b, c in sorted(private)],
        "format_branches": format_branches(mods),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = ap.parse_args()
    f = figures(args.root)
    if args.json:
        print(json.dumps(f, indent=2))
        return
    print(f"modules: {f['modules']} ({f['top_level_modules']} at the top of {PACKAGE}/)")
    print("longest: " + ", ".join(f"{x['module']} {x['lines']}" for x in f["longest"]))
    print(f"over 500 lines: {len(f['over_500_lines'])}")
    print(f"import levels: {f['import_levels']} ({' -> '.join(f['longest_chain'])})")
    print(f"cycles: {len(f['cycles'])}" + "".join(f"\n  {' <-> '.join(c)}" for c in f["cycles"]))
    print(f"private names imported across modules: {len(f['private_imports'])}"
          + "".join(f"\n  {p}" for p in f["private_imports"]))
    print(f"format-name branches outside {PACKAGE}/format: {len(f['format_branches'])}"
          + "".join(f"\n  {b}" for b in f["format_branches"]))


if __name__ == "__main__":
    main()
