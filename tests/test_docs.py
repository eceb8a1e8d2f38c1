"""The user docs against the code: README.md and docs/*.md.

No model and no torch: the CLI reference is regenerated from the Typer app (whose import
is cheap), and every `starqa COMMAND --option` the docs show is looked up in it.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300
PAGE_MAX_LINES = 450


def _gen_cli():
    spec = importlib.util.spec_from_file_location("gen_cli", DOCS / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def _command_tree():
    from starqa.cli import app

    group = typer.main.get_command(app)
    tree = {}
    for name, cmd in group.commands.items():
        opts = {"--help"}
        for p in cmd.params:
            if p.param_type_name == "option":
                opts.update(p.opts)
                opts.update(p.secondary_opts)
        tree[name] = opts
    return tree


# ---- (1) docs/cli.md is generated ------------------------------------------------------

def _sections(text: str) -> dict[str, str]:
    """docs/cli.md by command: {"ingest": its section, ...; "": the page's head}."""
    parts = re.split(r"^## starqa (\S+)$", text, flags=re.M)
    return {"": parts[0], **dict(zip(parts[1::2], parts[2::2]))}


def test_cli_reference_is_generated_from_the_app():
    expected = _gen_cli().render()
    actual = (DOCS / "cli.md").read_text() if (DOCS / "cli.md").exists() else ""
    if actual != expected:
        want, have = _sections(expected), _sections(actual)
        stale = sorted(n or "(the head)" for n in set(want) | set(have)
                       if want.get(n) != have.get(n))
        pytest.fail("docs/cli.md differs from what the Typer app generates for "
                    f"{', '.join(stale)}: run `python docs/gen_cli.py` and commit docs/cli.md")


# ---- (2) every starqa command shown exists ---------------------------------------------

_FENCE = re.compile(r"^(```|~~~)")
_INLINE = re.compile(r"`([^`\n]+)`")
# Tokens that end one command: shell separators, redirections, comments.
_STOP = {"|", "||", "&&", ";", "<", ">", ">>", "&", "#", "\\"}


def _code_spans(text: str):
    """(line number, code) for every code line (fenced or indented) and inline code span.

    A code line ending in a backslash is joined with the next, as a shell would.
    """
    in_fence = False
    pending = None  # (first line number, text so far) of a continued code line
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        if in_fence or line.startswith("    ") or line.startswith("\t"):
            if pending is not None:
                number, line = pending[0], pending[1] + " " + line.strip()
                pending = None
            if line.rstrip().endswith("\\"):
                pending = (number, line.rstrip()[:-1])
                continue
            yield number, line
        else:
            if pending is not None:
                yield pending
                pending = None
            for match in _INLINE.finditer(line):
                yield number, match.group(1)
    if pending is not None:
        yield pending


def _split(code: str) -> list[str]:
    try:
        return shlex.split(code, comments=False, posix=True)
    except ValueError:  # an unbalanced quote in an excerpt
        return code.split()


def _invocations(text: str):
    """(line, command, [options]) for every `starqa COMMAND ...` in the code of a page.

    `starqa` counts as the program when it starts the code or follows a shell separator,
    a `$` prompt, an environment assignment or `python -m`; elsewhere it is a word.
    """
    for number, code in _code_spans(text):
        tokens = _split(code)
        for i, tok in enumerate(tokens):
            if tok != "starqa" or i + 1 >= len(tokens):
                continue
            before = tokens[i - 1] if i else None
            if before is not None and before not in _STOP and before not in {"$", "-m"} \
                    and not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", before):
                continue
            command, options = tokens[i + 1], []
            if command.startswith("-"):
                continue  # `starqa --help`
            for tok in tokens[i + 2:]:
                if tok in _STOP or tok == "starqa" or tok.startswith("#"):
                    break
                if tok.startswith("-") and len(tok) > 1 and not re.fullmatch(r"-\d.*", tok):
                    options.append(tok.split("=", 1)[0])
            yield number, command, options


def _doc_files() -> list[Path]:
    return [README] + _pages()


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: p.name)
def test_every_command_and_option_shown_exists(path):
    tree = _command_tree()
    problems = []
    for line, command, options in _invocations(path.read_text()):
        if command not in tree:
            problems.append(f"{path.name}:{line}: `starqa {command}` is not a command")
            continue
        for opt in options:
            if opt not in tree[command]:
                problems.append(f"{path.name}:{line}: `starqa {command}` has no {opt}")
    assert not problems, "\n".join(problems)


def test_the_command_parser_sees_commands_and_options():
    text = "\n".join([
        "    $ starqa ask \"who?\" --top-k 1% -c docs  # a comment --not-this",
        "    STARQA_HOME=/tmp/h starqa ingest repo/ --nnodes 2 \\",
        "        --node-rank 1",
        "Run `starqa chat --attention topk < q.txt`; `starqa` alone is a word.",
        "    the starqa cold ask   # a word in an output line",
    ])
    found = list(_invocations(text))
    assert found == [
        (1, "ask", ["--top-k", "-c"]),
        (2, "ingest", ["--nnodes", "--node-rank"]),
        (4, "chat", ["--attention"]),
    ]


_SCRIPT = re.compile(r"(?:python3?|bash)\s+(benchmarks/[\w/.-]+)")


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: p.name)
def test_every_benchmark_shown_exists_with_its_options(path):
    """`python benchmarks/X.py --opt` in a page: the script exists and spells `--opt`."""
    problems = []
    for line, code in _code_spans(path.read_text()):
        for match in _SCRIPT.finditer(code):
            script = ROOT / match.group(1)
            if not script.exists():
                problems.append(f"{path.name}:{line}: {match.group(1)} does not exist")
                continue
            source = script.read_text()
            for tok in _split(code[match.end():]):
                if tok in _STOP or tok.startswith("#"):
                    break
                if tok.startswith("--") and f'"{tok.split("=", 1)[0]}"' not in source:
                    problems.append(f"{path.name}:{line}: {match.group(1)} has no {tok}")
    assert not problems, "\n".join(problems)


# ---- (3) links between README and docs -------------------------------------------------

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces → -."""
    anchors = set()
    for line in path.read_text().splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def test_every_anchor_linked_exists():
    problems = []
    for page in _doc_files():
        for target in _LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or "#" not in target:
                continue
            file, anchor = target.split("#", 1)
            linked = (page.parent / file) if file else page
            if linked.suffix == ".md" and linked.exists() and anchor not in _anchors(linked):
                problems.append(f"{page.name}: #{anchor} is no heading of {linked.name}")
    assert not problems, "\n".join(problems)


def _local_links(path: Path) -> list[str]:
    links = []
    for target in _LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        links.append(target.split("#", 1)[0])
    return links


def test_every_docs_page_is_linked_from_the_readme_and_exists():
    linked = {(README.parent / t).resolve() for t in _local_links(README)}
    missing = sorted(str(p.relative_to(ROOT)) for p in linked if not p.exists())
    assert not missing, f"README.md links to missing files: {missing}"
    unlinked = [p.name for p in _pages() if p.resolve() not in linked]
    assert not unlinked, f"docs pages not linked from README.md: {unlinked}"


@pytest.mark.parametrize("path", _pages(), ids=lambda p: p.name)
def test_links_in_docs_pages_resolve(path):
    missing = [t for t in _local_links(path) if not (path.parent / t).exists()]
    assert not missing, f"{path.name} links to missing files: {missing}"


# ---- (4) lengths -----------------------------------------------------------------------

def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines > {README_MAX_LINES}"


@pytest.mark.parametrize("path", _pages(), ids=lambda p: p.name)
def test_each_docs_page_is_short(path):
    lines = len(path.read_text().splitlines())
    assert lines <= PAGE_MAX_LINES, f"{path.name} has {lines} lines > {PAGE_MAX_LINES}"


# ---- (5) docs/reliability.md: every promise names a test that exists ---------------------

_CITED = re.compile(r"`(test_\w+\.py)::(test_\w+)`")
_BY_HAND = "## Shown by hand only"


def test_every_promise_names_a_test_that_exists():
    """Each promise of docs/reliability.md (an entry `- ...` up to the next) cites
    `tests/FILE::TEST`, and each test cited is defined there, except under its heading of
    promises shown by hand."""
    import ast

    text = (DOCS / "reliability.md").read_text()
    tested, by_hand = text.split(_BY_HAND, 1) if _BY_HAND in text else (text, "")
    defined: dict[str, set[str]] = {}
    problems = []
    for file, test in _CITED.findall(text):
        if file not in defined:
            path = ROOT / "tests" / file
            defined[file] = {node.name for node in ast.parse(path.read_text()).body
                             if isinstance(node, ast.FunctionDef)} if path.exists() else set()
        if test not in defined[file]:
            problems.append(f"{file}::{test} is not a test in tests/")
    for entry in re.split(r"^- ", tested, flags=re.M)[1:]:
        if not _CITED.search(entry.split("\n\n")[0]):
            problems.append(f"no test named for: {entry.splitlines()[0]}")
    assert not problems, "\n".join(problems)
