"""The house's structural rules, checked on the source: no import loops (function-level, TYPE_CHECKING and
registry strings included) and no family switches outside toolkit/models/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("toolkit", "jobs")
LAZY_REFERENCE = re.compile(r"^((?:toolkit|jobs)(?:\.\w+)+):\w+$")


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imported_modules(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Every project module `path` imports anywhere in its text (top level, in functions, under TYPE_CHECKING),
    the packages above each (importing a.b.c runs a and a.b), and "module:Name" strings (lazy registries)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and LAZY_REFERENCE.match(node.value):
            targets = [node.value.split(":")[0]]
        for target in targets:
            parts = target.split(".")
            found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & modules.keys()
    found.discard(name)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_loop_through_a_function_level_import(tmp_path):
    modules = {"toolkit.a": tmp_path / "a.py", "toolkit.b": tmp_path / "b.py", "toolkit": tmp_path / "i.py"}
    modules["toolkit.a"].write_text("from toolkit import b\n")
    modules["toolkit.b"].write_text("def f():\n    from toolkit.a import x\n")
    modules["toolkit"].write_text("")
    graph = {name: imported_modules(path, name, modules) for name, path in modules.items()}
    assert import_cycles(graph) == [["toolkit.a", "toolkit.b"]]


def test_no_import_loops_in_the_project():
    modules = project_modules()
    graph = {name: imported_modules(path, name, modules) for name, path in modules.items()}
    assert import_cycles(graph) == []


def test_package_init_files_import_nothing():
    """Package __init__ files hold a docstring only, so importing one module never drags in its siblings (and
    the config check stays free of the training libraries)."""
    offenders = [str(path.relative_to(REPO)) for name, path in project_modules().items()
                 if path.name == "__init__.py" and any(isinstance(node, (ast.Import, ast.ImportFrom))
                                                       for node in ast.parse(path.read_text()).body)
                 and path.parent.name != "optimizers"]
    assert offenders == []


def test_no_family_switches_outside_the_model_packages():
    pattern = re.compile(r"\barch\s*(==|!=|in)\s*[\(\[\{\"']")
    offenders = [f"{path.relative_to(REPO)}:{number}" for package in ("toolkit", "jobs")
                 for path in (REPO / package).rglob("*.py") if "models" not in path.relative_to(REPO).parts
                 for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
