"""docs/structure.md names only what exists, and its floors are the layering test's.

A code reference on the page is a backticked `path/to/module.py:Qualified.name`; it resolves
when that file defines the name (a class, a function, a method of a class, or a name assigned
at that level), read from the file's AST: nothing is imported, so torch-heavy modules cost
nothing here. Every other backticked path, and every relative link, must exist. The floors
table must be tests/unit/test_layering.py's `MAY_IMPORT`, floor by floor, and each room of
`engine/` and part of `deploy/` may import only the rooms its row names.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "structure.md"

SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)")
REFERENCE = re.compile(r"(?P<path>[\w./-]+\.py):(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")
FILE_SUFFIX = re.compile(r"\w\.(py|md|sh|toml|yaml|yml|json|proto|lock|txt)$")


def spans(text: str) -> list[str]:
    """The backticked spans of `text`, fenced code blocks left out."""
    return SPAN.findall(FENCE.sub("", text))


def _find(body: list[ast.stmt], name: str) -> ast.stmt | None:
    """The statement of `body` that defines `name` (conditional definitions included)."""
    for stmt in body:
        if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if stmt.name == name:
                return stmt
        elif isinstance(stmt, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                return stmt
        elif isinstance(stmt, ast.AnnAssign):
            if isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                return stmt
        elif isinstance(stmt, ast.If):
            if (found := _find(stmt.body + stmt.orelse, name)) is not None:
                return found
        elif isinstance(stmt, ast.Try):
            inner = stmt.body + stmt.orelse + stmt.finalbody
            inner += [s for handler in stmt.handlers for s in handler.body]
            if (found := _find(inner, name)) is not None:
                return found
    return None


def resolve(root: Path, path: str, qualname: str) -> str | None:
    """None when the module at `root / path` defines `qualname` (`Class.method`, `function`,
    `NAME`), else what is wrong."""
    file = root / path
    if not file.is_file():
        return f"{path}: no such file"
    scope = ast.parse(file.read_text()).body
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        node = _find(scope, part)
        if node is None:
            where = f"{path}:{'.'.join(parts[:i])}" if i else path
            return f"{where} defines no {part!r}"
        if i + 1 < len(parts):
            if not isinstance(node, ast.ClassDef):
                return f"{path}:{'.'.join(parts[: i + 1])} is not a class"
            scope = node.body
    return None


def is_path(span: str) -> bool:
    return PATH.fullmatch(span) is not None and ("/" in span or bool(FILE_SUFFIX.search(span)))


def problems(root: Path, text: str, doc_dir: Path | None = None) -> list[str]:
    """What `text` names that does not exist under `root`: references that do not resolve,
    backticked paths that are missing, spans that look like references but are not written
    `path.py:Qualified.name`, and relative links (from `doc_dir`) that lead nowhere."""
    found = []
    for span in spans(text):
        if (m := REFERENCE.fullmatch(span)) is not None:
            if (why := resolve(root, m["path"], m["name"])) is not None:
                found.append(f"`{span}`: {why}")
        elif is_path(span):
            if not (root / span).exists():
                found.append(f"`{span}`: no such file or folder")
        elif ".py" in span:
            found.append(f"`{span}`: not a reference (write `path/to/module.py:Qualified.name`)")
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the page
        where = (doc_dir or root) / target.split("#")[0]
        if not where.exists():
            found.append(f"link ({target}): no such file or folder")
    return found


def _layering() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "layering_floors", ROOT / "tests" / "unit" / "test_layering.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def floors_table(text: str) -> dict[str, tuple[int, str]]:
    """The "Floors" section's table: package → (floor, its "may import" cell); rows without
    a floor number (`proto/`, `tests/`) left out."""
    section = text.split("## Floors", 1)[1].split("\n#", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            package = cells[1].strip("`").rstrip("/")
            table[package] = (int(cells[0]), cells[3])
    return table


def named_packages(cell: str, table: dict[str, tuple[int, str]], floor: int) -> set[str]:
    """The packages a "may import" cell names (`pdserve.v1` is the package `pdserve`);
    "every package below" names every package on a lower floor."""
    names = {s.rstrip("/") for s in SPAN.findall(cell)}
    named = {"pdserve" if n == "pdserve.v1" else n for n in names}
    named &= set(table) | {"pdserve"}
    if "every package below" in cell:
        named |= {p for p, (f, _) in table.items() if f < floor}
    return named


def room_of(package: str, path: str) -> str:
    """The room of `package` a path is in: its first folder, or "root" for its own files."""
    parts = Path(path).relative_to(package).parts
    return parts[0] if len(parts) > 1 or path.endswith("/") else "root"


def rooms_table(text: str, heading: str, package: str) -> dict[str, set[str]]:
    """A rooms table (engine's rooms, deploy's parts): room → the rooms it may import ("the
    root files" is the package's own files, "every room" every room); rows of folders without
    code ("—") left out."""
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[2] != "—":
            rows.append(({room_of(package, p) for p in SPAN.findall(cells[0])}, cells[2]))
    every = set().union(*(rooms for rooms, _ in rows))
    table = {}
    for rooms, cell in rows:
        allowed = {n.rstrip("/") for n in SPAN.findall(cell)}
        if "the root files" in cell:
            allowed.add("root")
        if "every room" in cell:
            allowed |= every
        table.update((room, allowed) for room in rooms)
    return table


def room_imports(package: str) -> dict[str, set[str]]:
    """Room of `package` → the other rooms of it that its modules import (the package's own
    `__init__.py` left out)."""
    layering = _layering()
    base = ROOT / package
    rooms = {p.name for p in base.iterdir() if (p / "__init__.py").is_file()}
    found: dict[str, set[str]] = {}
    for path in sorted(base.rglob("*.py")):
        if path == base / "__init__.py":
            continue
        room = room_of(package, str(path.relative_to(ROOT)))
        used = found.setdefault(room, set())
        for target in layering.imports(path):
            parts = target.split(".")
            if parts[0] == package:
                other = parts[1] if len(parts) > 1 and parts[1] in rooms else "root"
                if other != room:
                    used.add(other)
    return found


# ---- the resolver ---------------------------------------------------------------------------


def _module(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        "import typing\n"
        "class A:\n"
        "    field: int = 0\n"
        "    def m(self): ...\n"
        "    async def n(self): ...\n"
        "def f(): ...\n"
        "X = 1\n"
        "if typing.TYPE_CHECKING:\n"
        "    class T: ...\n"
    )
    return tmp_path


def test_resolve_finds_classes_functions_methods_and_names(tmp_path: Path) -> None:
    root = _module(tmp_path)
    for name in ("A", "A.m", "A.n", "A.field", "f", "X", "T"):
        assert resolve(root, "pkg/mod.py", name) is None, name


def test_resolve_refuses_a_wrong_name(tmp_path: Path) -> None:
    root = _module(tmp_path)
    assert resolve(root, "pkg/mod.py", "B") == "pkg/mod.py defines no 'B'"
    assert resolve(root, "pkg/mod.py", "A.missing") == "pkg/mod.py:A defines no 'missing'"
    assert resolve(root, "pkg/mod.py", "f.inner") == "pkg/mod.py:f is not a class"
    assert resolve(root, "pkg/mod.py", "m") == "pkg/mod.py defines no 'm'"  # a method
    assert resolve(root, "pkg/other.py", "A") == "pkg/other.py: no such file"


def test_problems_names_every_wrong_reference_path_and_link(tmp_path: Path) -> None:
    root = _module(tmp_path)
    text = (
        "`pkg/mod.py:A.m` resolves, `pkg/mod.py:A.wrong` does not; `pkg/` exists, `pkg/gone/`"
        " and `gone.md` do not; `pkg/mod.py A.m` is no reference; `plain words` and"
        " `pdserve.v1` and `.proto` are prose; [ok](pkg/mod.py), [bad](pkg/nope.py), [web](https://x.y).\n"
        "```\n`pkg/fenced.py:Nothing` in a fence is not checked\n```\n"
    )
    assert problems(root, text) == [
        "`pkg/mod.py:A.wrong`: pkg/mod.py:A defines no 'wrong'",
        "`pkg/gone/`: no such file or folder",
        "`gone.md`: no such file or folder",
        "`pkg/mod.py A.m`: not a reference (write `path/to/module.py:Qualified.name`)",
        "link (pkg/nope.py): no such file or folder",
    ]


def test_a_wrong_name_of_this_repository_is_refused() -> None:
    assert problems(ROOT, "`router/orchestrator.py:Orchestrator._lookup`") == []
    assert problems(ROOT, "`router/orchestrator.py:Orchestrator._hash_and_admit`") == [
        "`router/orchestrator.py:Orchestrator._hash_and_admit`: "
        "router/orchestrator.py:Orchestrator defines no '_hash_and_admit'"
    ]


# ---- the page -------------------------------------------------------------------------------


def test_every_reference_and_path_on_the_page_exists() -> None:
    text = DOC.read_text()
    references = [s for s in spans(text) if REFERENCE.fullmatch(s)]
    assert len(references) > 100, "the page names code as `path/to/module.py:Qualified.name`"
    assert problems(ROOT, text, DOC.parent) == []


def test_the_floors_table_is_the_layering_tests_may_import() -> None:
    layering = _layering()
    table = floors_table(DOC.read_text())
    assert set(table) == set(layering.PACKAGES)
    for package in layering.PACKAGES:
        floor, cell = table[package]
        allowed = layering.MAY_IMPORT[package] - {package}
        below = [table[p][0] for p in allowed if p in table]
        assert floor == 1 + max(below, default=-1), f"{package}: floor {floor}"
        assert named_packages(cell, table, floor) == allowed, f"{package}: {cell}"


@pytest.mark.parametrize(
    "package, heading",
    [("engine", "### The engine's rooms"), ("deploy", "### The parts of `deploy/`")],
)
def test_each_room_imports_only_the_rooms_its_row_names(package: str, heading: str) -> None:
    table = rooms_table(DOC.read_text(), heading, package)
    used = room_imports(package)
    assert set(used) <= set(table), f"rooms of {package}/ without a row: {set(used) - set(table)}"
    wrong = {
        room: sorted(rooms - table[room]) for room, rooms in used.items() if rooms - table[room]
    }
    assert not wrong, f"{package}/ rooms importing rooms their row does not name: {wrong}"
