"""The layering of docs/structure.md, held by the code's own imports: which package may import
which, no import circle between any two modules (type-only and function-level imports
count), and the torch-free packages importable with torch made unimportable."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGES = (
    "vocabulary", "engine", "kv_transfer", "prefix_index", "admission", "worker_runtime",
    "prefill_worker", "decode_worker", "router", "planner", "simulator", "deploy", "loadtests",
    "benchmarks",
)  # fmt: skip
SHIPPED = tuple(p for p in PACKAGES if p != "benchmarks")

# package -> the other packages it may import (docs/structure.md, "Floors")
MAY_IMPORT: dict[str, set[str]] = {
    "vocabulary": set(),
    "engine": {"vocabulary"},
    "prefix_index": {"vocabulary"},
    "admission": {"vocabulary"},
    "kv_transfer": {"engine", "vocabulary"},
    "worker_runtime": {"engine", "kv_transfer", "prefix_index", "vocabulary"},
    "prefill_worker": {"worker_runtime", "engine", "kv_transfer", "prefix_index", "vocabulary"},
    "decode_worker": {"worker_runtime", "engine", "kv_transfer", "prefix_index", "vocabulary"},
    "router": {"admission", "prefix_index", "vocabulary", "pdserve"},
    "planner": {"router", "vocabulary"},
    "simulator": {"admission", "router", "planner", "loadtests", "vocabulary"},
    "loadtests": {"vocabulary", "pdserve"},
    "deploy": set(PACKAGES) - {"benchmarks", "deploy"} | {"pdserve"},
    "benchmarks": set(PACKAGES) | {"pdserve"},
}
TORCH_FREE = (
    "vocabulary", "router", "admission", "prefix_index", "planner", "simulator", "loadtests",
)  # fmt: skip
# Locust's files run in a process of their own (gevent's monkey-patching), never imported here.
OWN_PROCESS = {"loadtests.locustfile", "loadtests.locust_openai"}


def modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            yield ".".join(parts), path


def imports(path: Path) -> set[str]:
    """Every absolute module an import in `path` names (`from a.b import c` names a.b and,
    where it is a module, a.b.c), wherever the import stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    known = dict(modules())
    return {
        name: {m for m in imports(path) if m in known and m != name} for name, path in known.items()
    }


def test_every_package_imports_only_what_its_floor_may() -> None:
    wrong = []
    for name, path in modules():
        package = name.split(".")[0]
        for target in imports(path):
            other = target.split(".")[0]
            if other in MAY_IMPORT and other != package and other not in MAY_IMPORT[package]:
                wrong.append(f"{path.relative_to(ROOT)} imports {target}")
            if other == "pdserve" and "pdserve" not in MAY_IMPORT[package]:
                wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not wrong, "\n".join(wrong)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `edges` (its modules in order, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_circle_and_only_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_circle_anywhere() -> None:
    edges = graph()
    # a package's __init__ that re-exports its modules is not a circle with them
    for name in list(edges):
        edges[name] = {t for t in edges[name] if not name.startswith(t + ".")}
    cycle = find_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle or ())


@pytest.mark.timeout(240)
def test_torch_free_packages_import_every_module_without_torch() -> None:
    names = [n for n, _ in modules() if n.split(".")[0] in TORCH_FREE and n not in OWN_PROCESS]
    code = f"""
import importlib, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is not importable here (imported as {{name}})")
        return None
sys.meta_path.insert(0, NoTorch())
for name in {names!r}:
    importlib.import_module(name)
assert "torch" not in sys.modules
print(len({names!r}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=200
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) == len(names) > 70
