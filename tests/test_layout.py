"""The package's layout: no module imports one that (directly or not) imports it back."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "starqa"


def imports() -> dict[str, set[str]]:
    """starqa module → the starqa modules it imports, at the top or inside functions."""
    graph = {}
    for file in PACKAGE.rglob("*.py"):
        name = ".".join(file.relative_to(PACKAGE.parent).with_suffix("").parts)
        name = name.removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("starqa"):
                deps |= ({f"starqa.{a.name}" for a in node.names} if node.module == "starqa"
                         else {node.module})
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("starqa")}
        graph[name] = deps - {name}
    return graph


def test_no_import_cycles():
    graph = imports()
    assert len(graph) > 20 and "starqa.engine" in graph  # the walk found the package
    state: dict[str, str] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":
                cycles.append(" → ".join(path[path.index(dep):] + [dep]))
            elif dep in graph and dep not in state:
                visit(dep, path + [dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
