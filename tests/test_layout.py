"""The layout shows its readers, and stays that way: no import cycle, no source over 600 lines
(Python, CUDA and C++, tests and perf/ included), each role's package depends only on the ones
below it, and no CUDA kernel includes torch.

Imports are read from the syntax tree (those inside functions too), never by importing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kata", "bench", "fixed")
MAX_LINES = 600
SOURCE_SUFFIXES = {".py", ".cu", ".cuh", ".cpp", ".h"}
# What each part of kata/ may import of kata/ itself: the harness judges, the two readers'
# tools each build on it and never on each other, the toolchain stands alone.
MAY_IMPORT = {
    "kata.toolchain": {"kata", "kata.toolchain"},
    "kata.harness": {"kata", "kata.toolchain", "kata.harness"},
    "kata.interviewer": {"kata", "kata.toolchain", "kata.harness", "kata.interviewer"},
    "kata.candidate": {"kata", "kata.toolchain", "kata.harness", "kata.candidate"},
}
# The runner is the one process that runs the implementation under test, fixed/ among them.
RUNS_THE_IMPLEMENTATION = {("kata.harness.runner", "fixed")}


def modules(root: Path = REPO) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "_build" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that `name` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from kata import shipped` imports a module; `from kata import REPO_ROOT` does not.
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            # A package's __init__ is imported with each of its modules: not a cycle.
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def role(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and ".".join(parts[:2]) in MAY_IMPORT else None


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_the_cycle_finder_finds_one():
    graph = {"kata.a": {"kata.b"}, "kata.b": {"kata.c"}, "kata.c": {"kata.a"}, "kata": set()}
    assert find_cycle(graph) == ["kata.a", "kata.b", "kata.c", "kata.a"]


def test_each_role_imports_only_what_it_may():
    wrong = []
    for module, imported in import_graph().items():
        own = role(module)
        if own is None:
            continue
        for target in imported:
            if target.startswith("kata") and (role(target) or "kata") not in MAY_IMPORT[own]:
                wrong.append(f"{module} imports {target}")
            outside = target.startswith(("bench", "fixed"))
            if outside and (module, target) not in RUNS_THE_IMPLEMENTATION:
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_the_harness_never_imports_a_readers_tools():
    graph = import_graph()
    assert "kata.harness.review" in graph  # the walk saw the harness
    readers = ("kata.interviewer", "kata.candidate")
    for module in graph:
        if module.startswith("kata.harness."):
            assert not any(target.startswith(readers) for target in graph[module]), module


def sources(root: Path = REPO) -> dict[str, Path]:
    """Every Python, CUDA and C++ source of the project (its packages, tests, perf/ and the
    candidate's flawed/), by its path from the root; builds excluded."""
    found = {}
    for top in (*PACKAGES, "tests", "perf", "flawed"):
        for path in sorted((root / top).rglob("*")):
            if path.suffix in SOURCE_SUFFIXES and "_build" not in path.parts:
                found[path.relative_to(root).as_posix()] = path
    return found


@pytest.mark.parametrize("name", sorted(sources()))
def test_no_module_over_600_lines(name):
    lines = len(sources()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name}: {lines} lines"


def test_no_kernel_includes_torch():
    kernels = sorted((REPO / "fixed" / "csrc" / "kernels").glob("*.cuh"))
    assert kernels, "fixed/csrc/kernels/ holds the CUDA kernels"
    include = re.compile(r'^\s*#\s*include\s*[<"](torch|ATen|c10)/', re.M)
    assert [k.name for k in kernels if include.search(k.read_text())] == []
    listed = (REPO / "fixed" / "csrc" / "kernels" / "README.md").read_text()
    assert [k.name for k in kernels if f"`{k.name}`" not in listed] == []


def test_the_glue_is_one_level_above_the_kernels():
    lesson = {p.name for p in (REPO / "fixed" / "csrc").iterdir() if p.is_file()}
    assert lesson == {
        "attention.cpp",
        "checks.h",
        "checks.cpp",
        "attention_cpu.cpp",
        "attention_cuda.cu",
    }
