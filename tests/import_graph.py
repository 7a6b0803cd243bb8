"""The tree-wide import graph of the installed packages, and its cycles.

    python -m tests.import_graph     # every module's imports of ours, by layer, then the cycles

Every import statement counts, at module level or inside a function: a deferred import is still a
dependency. The layers, lowest first: experiments <- engine <- env <- agents <- rlctl; a module
may import its own layer and the ones below it. ``experiments`` is data and one lookup (the shipped
scenarios, policies, checkpoints' configs): every layer may read it, and it imports nothing of ours.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("experiments", "engine", "env", "agents", "rlctl")
GENERATED = ("rlctl/online/proto/rlctl/",)  # protoc's stubs import each other by relative paths


def modules() -> dict[str, Path]:
    """Every module of the five packages: dotted name -> file."""
    found = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if any(str(rel).startswith(g) for g in GENERATED):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` (a module, or a module plus an attribute) names."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports."""
    known = modules()
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets.update(f"{base}.{a.name}" for a in node.names)
                targets.add(base)
        edges[name] = {m for t in targets if (m := _resolve(t, known)) and m != name}
    return edges


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a lower layer to a higher one."""
    return sorted((a, b) for a, bs in edges.items() for b in bs if layer(b) > layer(a))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    edges = graph()
    for name in sorted(edges, key=lambda m: (layer(m), m)):
        print(f"{name} -> {', '.join(sorted(edges[name])) or '(nothing of ours)'}")
    by_layer = {(LAYERS[layer(a)], LAYERS[layer(b)]) for a, bs in edges.items() for b in bs}
    print("\nlayer edges:", ", ".join(f"{a} -> {b}" for a, b in sorted(by_layer, key=lambda e: (LAYERS.index(e[0]), LAYERS.index(e[1])))))
    print(f"upward imports: {len(upward(edges))}; import cycles: {len(cycles(edges))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
