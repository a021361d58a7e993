"""Figures of the package's layout, read from its source with ``ast``: how many modules,
the longest ones, how deep the imports go, the import cycles, private names imported
across modules, imports of the daemon by the formats, and branches on a format's or a
tier's name. `python scripts/layout_figures.py [--json]` from the repository root;
docs/design.md explains the layers these figures check.

Only imports inside the ``ckptd`` package count. An import inside a function counts
like one at the top (it is still a dependency: ``cycles``), except under ``if
TYPE_CHECKING:``; ``cycles_module_level`` counts only the imports run when a module is
imported (those at its top level), the cycles that would fail at import time.
"""

from __future__ import annotations

import argparse
import ast
import functools
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


@functools.lru_cache(maxsize=None)
def _tree(path: Path, text: str) -> ast.Module:
    return ast.parse(text, str(path))


def parse(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed once per text: the figures read each module nine ways."""
    return _tree(path, path.read_text())


@functools.lru_cache(maxsize=None)
def _import_nodes(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Each import statement of ``tree`` with (inside a function or lambda, inside the body
    of an ``if TYPE_CHECKING:``), found in one pass over the tree."""
    out: list[tuple[ast.Import | ast.ImportFrom, bool, bool]] = []

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append((node, in_function, type_checking))
        in_function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        guarded = set()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            guarded = {id(stmt) for stmt in node.body}
        for child in ast.iter_child_nodes(node):
            visit(child, in_function, type_checking or id(child) in guarded)

    visit(tree, False, False)
    return out


def imports(mods: dict[str, Path], *, in_functions: bool = True,
            type_checking: bool = False) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Each module's imported package modules, and (importer, module, name) for every
    private name (``_x``) imported from another module. ``in_functions``: imports inside
    functions count; ``type_checking``: so do those under ``if TYPE_CHECKING:``."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    private: list[tuple[str, str, str]] = []
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node, in_function, guarded in _import_nodes(parse(path)):
            if (guarded and not type_checking) or (in_function and not in_functions):
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods:
                        graph[mod].add(alias.name)
            else:
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
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in ("hdf5", "chunk")
                    for c in [node.left, *node.comparators]):
                out.append(f"{mod}:{node.lineno}")
    return out


TIER_NAMES = ("local", "peer", "remote")


def _is_tier_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in TIER_NAMES


def tier_branches(mods: dict[str, Path]) -> list[str]:
    """Comparisons with a tier's name outside the tiers package (``tier == "peer"``,
    ``x in ("remote", "peer")``, ``!=``), and tier names used as dispatch keys
    (``{"peer": ...}[x]``, ``d["remote"]`` read, ``d.get("peer")``, a ``match`` case): each is
    a branch that a fourth tier would have to grow. A name written as data (a key of a
    dict built for output, a config table's name) is not a branch."""
    out = []
    for mod, path in mods.items():
        if mod == f"{PACKAGE}.tiers" or mod.startswith(f"{PACKAGE}.tiers."):
            continue
        for node in ast.walk(parse(path)):
            hit = False
            if isinstance(node, ast.Compare) and any(
                    isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
                operands = [node.left, *node.comparators]
                hit = any(_is_tier_name(c) or (isinstance(c, (ast.Tuple, ast.List, ast.Set))
                                               and any(_is_tier_name(e) for e in c.elts)) for c in operands)
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                hit = _is_tier_name(node.slice) or (isinstance(node.value, ast.Dict) and any(
                    k is not None and _is_tier_name(k) for k in node.value.keys))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "get", "pop", "setdefault"):
                hit = bool(node.args) and _is_tier_name(node.args[0])
            elif isinstance(node, ast.MatchValue):
                hit = _is_tier_name(node.value)
            if hit:
                out.append(f"{mod}:{node.lineno}")  # type: ignore[attr-defined]
    return sorted(set(out), key=lambda x: (x.split(":")[0], int(x.split(":")[1])))


def format_imports_daemon(mods: dict[str, Path]) -> list[str]:
    """Imports of ``ckptd.daemon`` inside ``ckptd.format``, annotation-only ones too: the
    formats sit below the daemon (docs/design.md)."""
    graph, _ = imports(mods, type_checking=True)
    return [f"{m} imports {d}" for m in sorted(graph) if m.startswith(f"{PACKAGE}.format")
            for d in sorted(graph[m]) if d == f"{PACKAGE}.daemon" or d.startswith(f"{PACKAGE}.daemon.")]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between ``ckptd``'s subpackages and top-level modules."""
    def top(m: str) -> str:
        return ".".join(m.split(".")[:2])
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(top(m), set()).update(top(d) for d in deps)
    for m, deps in out.items():
        deps.discard(m)
        deps.discard(PACKAGE)
    out.pop(PACKAGE, None)
    return out


def class_attributes(path: Path, name: str) -> list[str]:
    """The attributes a class's methods assign on ``self``."""
    if not path.exists():
        return []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            attrs = set()
            for sub in ast.walk(node):
                targets = sub.targets if isinstance(sub, ast.Assign) else (
                    [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else [])
                for t in targets:
                    for e in ast.walk(t):
                        if (isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name)
                                and e.value.id == "self"):
                            attrs.add(e.attr)
            return sorted(attrs)
    return []


def functions(mods: dict[str, Path]) -> list[tuple[int, str]]:
    """(lines, module:qualified name) of every function and method, longest first."""
    out = []
    for mod, path in mods.items():
        def walk(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = prefix + child.name
                    out.append((child.end_lineno - child.lineno + 1, f"{mod}:{name}"))
                    walk(child, name + ".")
                elif isinstance(child, ast.ClassDef):
                    walk(child, prefix + child.name + ".")
        walk(parse(path), "")
    return sorted(out, reverse=True)


PRAGMAS = ("# type:", "# noqa", "# pragma", "#!", "# fmt:")


def comment_density(mods: dict[str, Path]) -> tuple[int, int]:
    """(comments, code lines) over the package: a comment is a ``#`` token other than a
    pragma; a code line holds a token other than a comment or a docstring."""
    import io
    import tokenize
    comments = code = 0
    for path in mods.values():
        text = path.read_text()
        doc_lines: set[int] = set()
        for node in ast.walk(parse(path)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                        and isinstance(body[0].value.value, str):
                    doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
        lines: set[int] = set()
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                if not tok.string.startswith(PRAGMAS):
                    comments += 1
            elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                  tokenize.ENDMARKER):
                lines.update(range(tok.start[0], tok.end[0] + 1))
        code += len(lines - doc_lines)
    return comments, code


def docstring_lines(mods: dict[str, Path]) -> list[int]:
    """The length in lines of each module's docstring (0 where there is none)."""
    out = []
    for path in mods.values():
        doc = ast.get_docstring(parse(path), clean=True)
        out.append(len(doc.splitlines()) if doc else 0)
    return out


def repeated_names(mods: dict[str, Path]) -> list[str]:
    """File names (``server.py``) that stand in more than one folder of the package."""
    seen: dict[str, list[str]] = {}
    for mod, path in mods.items():
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(mod)
    return sorted(f"{n}: {', '.join(ms)}" for n, ms in seen.items() if len(ms) > 1)


READER_BANNED = ("fills_root", "reads_into", "unreachable")


def reader_asks_tiers(mods: dict[str, Path]) -> list[str]:
    """Names under ``ckptd/reader`` by which a reader would ask a tier what it can do."""
    out = []
    for mod, path in mods.items():
        if mod.startswith(f"{PACKAGE}.reader"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                out += [f"{mod}:{i} {w}" for w in READER_BANNED if w in line]
    return out


def docs_figures(root: Path) -> dict:
    pages = sorted((root / "docs").glob("*")) if (root / "docs").is_dir() else []
    return {"pages": len([p for p in pages if p.is_file()]),
            "kb": round(sum(p.stat().st_size for p in pages if p.is_file()) / 1000, 1)}


def figures(root: Path) -> dict:
    mods = modules(root)
    graph, private = imports(mods)
    comps = cycles(graph)
    top_comps = cycles(imports(mods, in_functions=False)[0])
    sizes = sorted(((sum(1 for _ in p.open()), m) for m, p in mods.items()), reverse=True)
    top = [m for m in mods if m.count(".") == 1 and not mods[m].name == "__init__.py"]
    tc_graph, _ = imports(mods, type_checking=True)
    funcs = functions(mods)
    comments, code = comment_density(mods)
    docs = sorted(docstring_lines(mods))
    load_len = [n for n, f in funcs if f == f"{PACKAGE}.reader.loading:load"]
    return {
        "lines": sum(n for n, _ in sizes),
        "modules": len(mods),
        "top_level_modules": len(top),
        "longest": [{"module": m, "lines": n} for n, m in sizes[:8]],
        "over_500_lines": [m for n, m in sizes if n > 500],
        "import_levels": len(chain := longest_chain(graph, comps)),
        "longest_chain": chain,
        "cycles": comps,
        "cycles_module_level": top_comps,
        "private_imports": [f"{a} imports {c} from {b}" for a, b, c in sorted(private)],
        "format_branches": format_branches(mods),
        "format_imports_daemon": format_imports_daemon(mods),
        "tier_branches": tier_branches(mods),
        "cycles_type_checking": cycles(tc_graph),
        "package_cycles": cycles(package_graph(tc_graph)),
        "daemon_attributes": class_attributes(root / PACKAGE / "daemon" / "server.py", "Daemon"),
        "reader_asks_tiers": reader_asks_tiers(mods),
        "tier_modules_over_300": [m for n, m in sizes if m.startswith(f"{PACKAGE}.tiers") and n > 300],
        "repeated_module_names": repeated_names(mods),
        "reader_load_lines": load_len[0] if load_len else None,
        "functions_over_60": [f"{f} {n}" for n, f in funcs if n > 60],
        "longest_functions": [f"{f} {n}" for n, f in funcs[:6]],
        "comments_per_1000": round(1000 * comments / max(code, 1), 1),
        "code_lines": code,
        "median_docstring_lines": docs[len(docs) // 2] if len(docs) % 2 else (
            (docs[len(docs) // 2 - 1] + docs[len(docs) // 2]) / 2),
        "docs": docs_figures(root),
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
    print(f"cycles, imports inside functions included: {len(f['cycles'])}"
          + "".join(f"\n  {' <-> '.join(c)}" for c in f["cycles"]))
    print(f"cycles of module-level imports: {len(f['cycles_module_level'])}"
          + "".join(f"\n  {' <-> '.join(c)}" for c in f["cycles_module_level"]))
    print(f"private names imported across modules: {len(f['private_imports'])}"
          + "".join(f"\n  {p}" for p in f["private_imports"]))
    print(f"format-name branches outside {PACKAGE}/format: {len(f['format_branches'])}"
          + "".join(f"\n  {b}" for b in f["format_branches"]))
    print(f"imports of {PACKAGE}/daemon in {PACKAGE}/format: {len(f['format_imports_daemon'])}"
          + "".join(f"\n  {b}" for b in f["format_imports_daemon"]))
    print(f"tier-name branches outside {PACKAGE}/tiers: {len(f['tier_branches'])}"
          + "".join(f"\n  {b}" for b in f["tier_branches"]))
    print(f"lines of {PACKAGE}/: {f['lines']}")
    print(f"cycles, TYPE_CHECKING imports included: {len(f['cycles_type_checking'])}"
          + "".join(f"\n  {' <-> '.join(c)}" for c in f["cycles_type_checking"]))
    print(f"package cycles: {len(f['package_cycles'])}"
          + "".join(f"\n  {' <-> '.join(c)}" for c in f["package_cycles"]))
    print(f"Daemon attributes: {len(f['daemon_attributes'])} ({', '.join(f['daemon_attributes'])})")
    print(f"reader names asking a tier what it can do: {len(f['reader_asks_tiers'])}"
          + "".join(f"\n  {b}" for b in f["reader_asks_tiers"]))
    print(f"tier modules over 300 lines: {f['tier_modules_over_300']}")
    print(f"repeated module names: {len(f['repeated_module_names'])}"
          + "".join(f"\n  {b}" for b in f["repeated_module_names"]))
    print(f"reader.load: {f['reader_load_lines']} lines")
    print(f"functions over 60 lines: {len(f['functions_over_60'])}"
          + "".join(f"\n  {b}" for b in f["functions_over_60"]))
    print(f"inline comments per 1,000 code lines: {f['comments_per_1000']} ({f['code_lines']} code lines)")
    print(f"median module docstring: {f['median_docstring_lines']} lines")
    print(f"docs/: {f['docs']['pages']} pages, {f['docs']['kb']} KB")


if __name__ == "__main__":
    main()
