"""Nothing starqa receives is unpickled: no module imports pickle or calls torch.distributed's
object collectives; objects cross ranks as JSON (two real gloo ranks), and the sources
gathered that way add up with their line numbers as ints."""

import json
import os
import subprocess
from pathlib import Path


_TORCH_OBJECT_COLLECTIVES = {"gather_object", "all_gather_object", "broadcast_object_list",
                             "scatter_object_list", "send_object_list", "recv_object_list"}


def _pickle_uses(path: Path) -> list[str]:
    """Imports of pickle (or its kin) and calls of torch.distributed's object collectives,
    however torch.distributed is aliased in the module."""
    import ast

    tree = ast.parse(path.read_text())
    aliases, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("pickle", "_pickle", "cPickle", "dill", "cloudpickle"):
                    found.append(f"import {a.name}")
                if a.name == "torch.distributed":
                    aliases.add(a.asname or "torch.distributed")
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[0] in ("pickle", "_pickle", "dill", "cloudpickle"):
                found.append(f"from {mod} import")
            for a in node.names:
                if mod == "torch" and a.name == "distributed":
                    aliases.add(a.asname or a.name)
                if mod == "torch.distributed" and a.name in _TORCH_OBJECT_COLLECTIVES:
                    found.append(f"from torch.distributed import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _TORCH_OBJECT_COLLECTIVES:
            if ast.unparse(node.value) in aliases | {"torch.distributed"}:
                found.append(ast.unparse(node))
    return found


def test_no_module_pickles_or_uses_torch_object_collectives():
    package = Path(__file__).parents[1] / "starqa"
    modules = sorted(package.rglob("*.py"))
    assert len(modules) > 10
    found = {str(p.relative_to(package)): uses for p in modules if (uses := _pickle_uses(p))}
    assert found == {}


def test_pickle_use_detector_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nimport torch.distributed as td\nfrom torch import "
                   "distributed as d2\ntd.broadcast_object_list([1])\nd2.gather_object(1, [])\n")
    assert _pickle_uses(bad) == ["import pickle", "td.broadcast_object_list",
                                 "d2.gather_object"]


_JSON_RANKS = """
import json, os
from starqa.runtime import dist
from starqa.phase2 import sources
info = dist.init("cpu")
r = info.rank
part = {f"doc{r}.md": {1: 0.5, 10 + r: 0.25}, "shared.py": {3: 1.0}}
gathered = dist.gather_object(info, part, dst=1)
request = {"op": "ask", "query_ids": [1, 2, 3], "nested": {5: {"x": None, "s": "é—✓"}},
           "max_new_tokens": 4} if r == 1 else None
got = dist.broadcast_object(info, request, src=1)
with open(os.path.join(os.environ["OUT_DIR"], f"rank{r}.json"), "w") as f:
    keys = lambda parts: sorted({type(k).__name__ for p in parts for v in p.values() for k in v})
    json.dump({"rank": r, "gathered": gathered, "request": got,
               "types": keys(gathered or []) + [type(next(iter(got["nested"]))).__name__]
               + keys([sources.add(gathered or [])]),
               "sum": sources.add(gathered) if gathered else None,
               "traffic": info.traffic.as_dict()["by_op"]}, f)
dist.barrier(info)
os._exit(0)
"""


def test_objects_cross_two_gloo_ranks_as_json(tmp_path):
    """Two real gloo ranks: nested dicts with int keys gathered and broadcast; they arrive
    as JSON (int keys as strings) and sources.add turns the lines back into ints."""
    import sys

    script = tmp_path / "ranks.py"
    script.write_text(_JSON_RANKS)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1",
           "OUT_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(script)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["gathered"] is None
    # the keys as the ranks saw them: strings after the wire, ints again after sources.add
    assert ranks[1]["types"] == ["str", "str", "int"] and ranks[0]["types"] == ["str"]
    assert ranks[1]["gathered"] == [{"doc0.md": {"1": 0.5, "10": 0.25}, "shared.py": {"3": 1.0}},
                                    {"doc1.md": {"1": 0.5, "11": 0.25}, "shared.py": {"3": 1.0}}]
    assert ranks[1]["sum"] == {"doc0.md": {"1": 0.5, "10": 0.25}, "shared.py": {"3": 2.0},
                               "doc1.md": {"1": 0.5, "11": 0.25}}  # printed as JSON again
    want = {"op": "ask", "query_ids": [1, 2, 3], "nested": {"5": {"x": None, "s": "é—✓"}},
            "max_new_tokens": 4}
    assert ranks[0]["request"] == ranks[1]["request"] == want
    sent = len(json.dumps({"doc0.md": {1: 0.5, 10: 0.25}, "shared.py": {3: 1.0}},
                          separators=(",", ":")).encode())
    assert ranks[0]["traffic"]["gather_object"] == {"calls": 1, "sent": sent, "received": 0}
    assert ranks[1]["traffic"]["gather_object"] == {"calls": 1, "sent": 0, "received": sent}


def test_sources_add_takes_lines_gathered_as_json():
    from starqa.runtime import dist
    from starqa.phase2 import sources

    info = dist.local_world()
    parts = dist.gather_object(info, {"a.py": {2: 0.5, 7: 0.25}}, dst=0)
    assert parts == [{"a.py": {"2": 0.5, "7": 0.25}}]  # as across ranks
    assert sources.add(parts + [{"a.py": {2: 0.5}}]) == {"a.py": {2: 1.0, 7: 0.25}}
    assert sources.top_sources(sources.add(parts))[0]["lines"] == [2, 2]
