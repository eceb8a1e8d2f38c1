"""The package's layout: no module imports one that (directly or not) imports it back."""

import ast
import re
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


def test_init_files_only_re_export():
    """An `__init__.py` holds a docstring, imports and `__all__` (the top one its
    `__version__` too), nothing else: the code of a package lives in modules named by their
    job."""
    offenders = []
    for file in sorted(PACKAGE.rglob("__init__.py")):
        names = [["__all__"]] + ([["__version__"]] if file.parent == PACKAGE else [])
        body = ast.parse(file.read_text()).body
        for node in body[1:] if body and isinstance(body[0], ast.Expr) else body:
            kept = isinstance(node, (ast.Import, ast.ImportFrom)) or (
                isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] in names)
            if not kept:
                offenders.append(f"{file.relative_to(PACKAGE)}:{node.lineno}")
    assert len(list(PACKAGE.rglob("__init__.py"))) > 15  # the walk found the packages
    assert not offenders, "code in __init__.py (move it to a module named by its job):\n" + \
        "\n".join(offenders)


def test_init_files_export_what_they_import():
    """What an `__init__.py` imports by name it re-exports: `__all__` lists exactly those
    names (an import for its effect, `import starqa.core.hugepages`, binds none)."""
    wrong = []
    for file in sorted(PACKAGE.rglob("__init__.py")):
        body = ast.parse(file.read_text()).body
        imported = {a.asname or a.name for node in body if isinstance(node, ast.ImportFrom)
                    for a in node.names} - {"annotations"}
        listed = {name for node in body if isinstance(node, ast.Assign)
                  and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
                  for name in ast.literal_eval(node.value)}
        if imported != listed:
            wrong.append(f"{file.relative_to(PACKAGE)}: imported, not in __all__: "
                         f"{sorted(imported - listed)}; in __all__, not imported: "
                         f"{sorted(listed - imported)}")
    assert not wrong, "__all__ against the imports:\n" + "\n".join(wrong)


def test_only_the_display_modules_draw():
    """Display code (rich) lives in the CLI's display modules; everything else reports
    through `starqa.core.progress.UI` (models included: a download's progress is the caller's to
    draw)."""
    drawing = set()
    for file in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "rich" or n.startswith("rich.") for n in names):
                drawing.add(file.relative_to(PACKAGE).as_posix())
    assert drawing == {"cli/ui.py", "cli/eval_report.py"}, drawing


# ---------------------------------------------------------------------------- method names

# "dense" is also a weight format (`--weights dense`, models.WEIGHT_FORMATS, decoder.py):
# a "dense" whose nearest enclosing comparison, call, statement or parameter mentions
# weights (or decoder.py's `fmt`), or that sits in a function about weights, is that format.
WEIGHTS = re.compile(r"weight|fmt", re.IGNORECASE)
# the nearest of these around a literal says what the literal is compared with, passed to,
# assigned to or returned
CONTEXT = (ast.Compare, ast.Call, ast.keyword, ast.Dict, ast.arguments, ast.stmt)


def _weight_format(node: ast.Constant, parents: dict, source: str) -> bool:
    child, around = node, parents.get(node)
    while around is not None and not isinstance(around, CONTEXT):
        child, around = around, parents.get(around)
    if isinstance(around, ast.arguments):  # a parameter's default: the parameter's name
        params = around.posonlyargs + around.args
        named = dict(zip(map(id, around.defaults), params[len(params) - len(around.defaults):]))
        named |= {id(d): a for d, a in zip(around.kw_defaults, around.kwonlyargs) if d}
        return id(child) in named and bool(WEIGHTS.search(named[id(child)].arg))
    if around is not None and WEIGHTS.search(ast.get_source_segment(source, around) or ""):
        return True
    while around is not None and not isinstance(around, (ast.FunctionDef, ast.AsyncFunctionDef)):
        around = parents.get(around)
    return around is not None and bool(WEIGHTS.search(around.name))


def method_literals(source: str, names) -> list[tuple[int, str]]:
    """(line, name) of every string literal in `source` that spells a method name, weight
    formats aside."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value in names
                  and not (node.value == "dense" and _weight_format(node, parents, source)))


def test_method_literals_tell_methods_from_weight_formats():
    names = ("star", "dense", "ring")
    assert method_literals('if method.name == "ring":\n    pass', names) == [(1, "ring")]
    assert method_literals('def f(method="star", base="dense"): ...', names) == [
        (1, "dense"), (1, "star")]
    assert method_literals('OWNERS = {"anchor": ("star", "dense")}', names) == [
        (1, "dense"), (1, "star")]
    assert method_literals('REFERENCE = "dense"', names) == [(1, "dense")]
    weights = ('def load(weights="dense"): ...\nif fmt != "dense": pass\n'
               'job.get("weights", "dense")\nWEIGHT_FORMATS = ("dense", "int8")\n'
               'def phase2_weights():\n    return "dense"\n')
    assert method_literals(weights, names) == []


def test_method_names_are_spelled_only_in_the_registry():
    """Behaviour that depends on the method lives in starqa/methods/ (the registry); the
    rest of the package asks it (`methods.get(name).…`) and never spells a method's name."""
    from starqa.methods import METHODS

    assert {"star", "dense", "ring", "pulsar", "apb"} <= set(METHODS)
    registry = PACKAGE / "methods"
    found = [f"{file.relative_to(PACKAGE.parent)}:{line}: {name!r}"
             for file in sorted(PACKAGE.rglob("*.py")) if registry not in file.parents
             for line, name in method_literals(file.read_text(), METHODS)]
    assert not found, "method names outside the registry:\n" + "\n".join(found)


# ------------------------------------------------------------------ the dependency table

ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def allowed() -> dict[str, set[str]]:
    """The dependency table, written once in docs/architecture.md: each package (or
    top-level module) → the packages it may import, in the order the doc reads them."""
    rows = re.findall(r"^\| `(\w+)(?:/|\.py)?` \| ([^|]*) \|$", ARCHITECTURE.read_text(),
                      re.MULTILINE)
    return {name: set(re.findall(r"\w+", deps)) for name, deps in rows}


def unit(module: str) -> str:
    """The table's name for a starqa module: its package, or the top-level module's name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_imports_follow_the_dependency_table():
    ALLOWED = allowed()
    graph = imports()
    units = {unit(m) for m in graph}
    assert units == set(ALLOWED), f"packages not in the table: {units ^ set(ALLOWED)}"
    against = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            source, target = unit(module), unit(dep)
            if source == target or target == "__init__":  # every import runs the top one
                continue
            if target not in ALLOWED[source]:
                against.append(f"{module} → {dep}")
    assert not against, "imports against the table (docs/architecture.md):\n" + \
        "\n".join(against)
    below: dict[str, set[str]] = {}  # package → everything it reaches through the table

    def reach(package: str, path: tuple[str, ...]) -> set[str]:
        assert package not in path, "the table has a cycle: " + " → ".join(path + (package,))
        if package not in below:
            below[package] = set().union(*(reach(t, path + (package,)) | {t}
                                           for t in ALLOWED[package]))
        return below[package]

    for package in ALLOWED:
        reach(package, ())


def test_the_architecture_doc_walks_the_table():
    """docs/architecture.md has one section per package, in the table's order."""
    found = re.findall(r"^## `(\w+)(?:/|\.py)`", ARCHITECTURE.read_text(), re.MULTILINE)
    assert found == [p for p in allowed() if p not in ("__main__", "__init__")], found


# ------------------------------------------------------------------ function sizes

MAX_LINES, MAX_PARAMS = 80, 8
# The functions allowed past those limits, each with its reason (at most five).
LONG = {
    "phase1/hooks.py:starqa_attention": "transformers' attention interface fixes its parameters",
}


def _commands() -> set[str]:
    """The functions `starqa.cli` registers as Typer commands, as "cli/module.py:name":
    one parameter per option is their nature."""
    from starqa.cli import app

    return {f"{Path(info.callback.__code__.co_filename).relative_to(PACKAGE).as_posix()}:"
            f"{info.callback.__name__}" for info in app.registered_commands}


def _is_command(node: ast.FunctionDef) -> bool:
    """A function decorated as a Typer command (`@app.command(...)`)."""
    return any(isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
               and d.func.attr == "command" for d in node.decorator_list)


def long_functions(source: str) -> list[tuple[str, int, int]]:
    """(name, lines, parameters) of each function in `source` over the limits; `self` and
    `cls` are not counted, nor a command's options."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or _is_command(node):
            continue
        args = node.args
        params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
        params += [a.arg for a in (args.vararg, args.kwarg) if a]
        params = [p for p in params if p not in ("self", "cls")]
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_LINES or len(params) > MAX_PARAMS:
            found.append((node.name, lines, len(params)))
    return found


def test_long_functions_are_found():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert long_functions(f"def f():\n{body}\n") == [("f", MAX_LINES + 1, 0)]
    many = ", ".join(f"a{i}" for i in range(MAX_PARAMS + 1))
    assert long_functions(f"class C:\n    def m(self, {many}):\n        pass\n") == [
        ("m", 2, MAX_PARAMS + 1)]
    assert long_functions(f"@app.command()\ndef ask({many}):\n    pass\n") == []
    assert long_functions(f"def ok(self, {', '.join(f'a{i}' for i in range(8))}): ...") == []


def test_no_function_is_long():
    assert len(LONG) <= 5
    found = {f"{file.relative_to(PACKAGE).as_posix()}:{name}": (lines, params)
             for file in sorted(PACKAGE.rglob("*.py"))
             for name, lines, params in long_functions(file.read_text())}
    commands = _commands()
    assert "cli/asking.py:ask" in commands  # the commands were found
    over = [f"{where}: {lines} lines, {params} parameters"
            for where, (lines, params) in found.items()
            if where not in LONG and where not in commands]
    assert not over, (f"over {MAX_LINES} lines or {MAX_PARAMS} parameters (split it, or group "
                      "what travels together in a frozen dataclass):\n" + "\n".join(over))
    assert not set(LONG) - set(found), f"stale exceptions: {set(LONG) - set(found)}"
