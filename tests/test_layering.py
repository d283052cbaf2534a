"""The package's rooms and their rules (docs/ARCHITECTURE.md), read from the imports themselves.

Every `import` / `from ... import` inside mlx_dspark is collected with `ast` (function-level imports
too; only `if TYPE_CHECKING:` blocks are skipped, as they never run), resolved to a module, and
checked against the layering rules; the checker itself is tested on a planted bad graph so that a
rule that silently stopped matching would fail here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_dspark"

# the rooms below the package, from the bottom up; a room may import itself and the rooms allowed it
FORBIDDEN = {
    "models": ("engine", "loading", "export", "serve", "bench", "train", "cli", "api", "testing"),
    "engine": ("loading", "export", "serve", "bench", "train", "cli", "api", "testing"),
    "loading": ("engine", "export", "serve", "bench", "train", "cli", "api"),
    "serve": ("bench", "train", "cli", "testing", "loading"),
    "bench": ("serve", "cli", "train", "testing"),
    "train": ("serve", "cli", "bench", "testing"),
    "chat_format": ("loading", "serve", "bench", "train", "cli", "api", "testing"),
    "api": ("serve", "bench", "train", "cli", "testing", "loading"),
    "export": ("engine", "serve", "bench", "train", "cli", "api", "testing"),
    "testing": ("engine", "serve", "bench", "train", "cli", "api"),
}
# the thin `python -m` shells and console-script targets that may import cli/
ENTRY_POINTS = {
    "mlx_dspark.generate", "mlx_dspark.server", "mlx_dspark.chat", "mlx_dspark.benchmark",
    "mlx_dspark.convert", "mlx_dspark.train.__main__", "mlx_dspark.train.calibrate", "mlx_dspark.export.__main__",
    "mlx_dspark.train.regenerate", "mlx_dspark.rank_vocab", "mlx_dspark.calibrate.__main__",
}  # fmt: skip
TOP_LEVEL_LIMIT = 8
LINE_LIMIT = 450
LARGE_ALLOWED = ("testing",)  # factories that read top to bottom


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The mlx_dspark modules `path` imports (a `from pkg import name` counts `pkg.name` when it is a module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith("mlx_dspark"))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.startswith("mlx_dspark"):
                    found.add(target)
                    found.update(f"{target}.{a.name}" for a in child.names if f"{target}.{a.name}" in modules)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "package"


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            if room(other) == "cli" and room(module) != "cli" and module not in ENTRY_POINTS:
                problems.append(f"{module} imports {other}: only entry points import cli/")
            if other in ENTRY_POINTS:
                problems.append(f"{module} imports the entry point {other}")
            if module in ENTRY_POINTS:
                continue  # a thin shell over cli/, whatever room it sits in
            if room(other) in FORBIDDEN.get(room(module), ()) and room(other) != room(module):
                problems.append(f"{module} ({room(module)}/) imports {other} ({room(other)}/)")
    return problems


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), plus self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return cycles


def test_the_checker_catches_planted_bad_imports():
    graph = import_graph()
    planted = {k: set(v) for k, v in graph.items()}
    planted["mlx_dspark.models.layers.qwen3"].add("mlx_dspark.engine.round.decode")  # a model reaching up
    planted["mlx_dspark.engine.round.decode"].add("mlx_dspark.loading.load")  # the engine loading files
    planted["mlx_dspark.serve.worker"].add("mlx_dspark.cli.common")  # a non-entry point importing cli/
    planted["mlx_dspark.engine.costs.curve"].add("mlx_dspark.engine.round.decode")  # decode -> schedule -> decode
    problems = layering_violations(planted)
    assert any(p.startswith("mlx_dspark.models.layers.qwen3 (models/) imports mlx_dspark.engine.round.decode") for p in problems)
    assert any(p.startswith("mlx_dspark.engine.round.decode (engine/) imports mlx_dspark.loading.load") for p in problems)
    assert any(p.startswith("mlx_dspark.serve.worker imports mlx_dspark.cli.common") for p in problems)
    assert any({"mlx_dspark.engine.round.decode", "mlx_dspark.engine.costs.curve"} <= set(c) for c in import_cycles(planted))


def test_rooms_import_only_downwards():
    assert layering_violations(import_graph()) == []


def test_no_import_cycles():
    assert import_cycles(import_graph()) == []


def test_the_top_level_holds_only_the_api_and_entry_points():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_LIMIT, top
    for name in top:
        if name in ("__init__.py", "api.py"):
            continue
        text = (PACKAGE / name).read_text(encoding="utf-8")
        assert len(text.splitlines()) <= 12, f"{name} is an entry point: a thin shell over cli/"


def test_no_module_past_the_size_of_one_job():
    too_long = {
        module_name(p): n
        for p in PACKAGE.rglob("*.py")
        if room(module_name(p)) not in LARGE_ALLOWED and (n := len(p.read_text(encoding="utf-8").splitlines())) > LINE_LIMIT
    }
    assert too_long == {}


def test_every_room_says_what_it_owns():
    for init in PACKAGE.rglob("__init__.py"):  # the rooms and the rooms inside them
        if init.parent == PACKAGE:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        where = init.parent.relative_to(PACKAGE)
        assert doc and len(doc) > 80, f"{where}/__init__.py needs a docstring: what it owns and must not import"


def test_the_module_map_in_the_architecture_doc_is_the_tree():
    doc = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    table = doc.split("## Module map", 1)[1].split("\n## ", 1)[0]
    listed: set[str] = set()
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        for name in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            matches = [p for p in PACKAGE.glob(name) if p.suffix == ".py"] if "*" in name else [PACKAGE / name]
            listed.update(str(p.relative_to(PACKAGE)) for p in matches if p.suffix == ".py")
    tree = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    rooms = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*/__init__.py")}  # the room docstrings, tested above
    tree, listed = tree - rooms, listed - rooms
    assert sorted(tree - listed) == [], "modules missing from docs/ARCHITECTURE.md's module map"
    assert sorted(listed - tree) == [], "the module map lists modules that do not exist"


def test_no_proposer_or_length_policy_ability_is_probed():
    """A head declares what it reads and can do (engine/proposers/base.Proposer), a length policy what it hears
    (engine/policy/draft_length.DraftLength): the engine reads the declaration, never getattr / hasattr."""
    from mlx_dspark.engine.policy.draft_length import DraftLength
    from mlx_dspark.engine.proposers.base import Proposer

    declared = {n for cls in (Proposer, DraftLength) for n in vars(cls) if not n.startswith("__")} - {"context", "grammar", "cap"}
    probe = re.compile(r"""(?:getattr|hasattr)\([^,()]+,\s*["'](\w+)["']""")
    found = [
        f"{p.relative_to(PACKAGE)}: {name}"
        for p in PACKAGE.rglob("*.py") if room(module_name(p)) != "testing"
        for name in probe.findall(p.read_text(encoding="utf-8")) if name in declared
    ]
    assert found == []
