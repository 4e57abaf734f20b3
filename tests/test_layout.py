"""The layout rules of docs/internals.md, checked: layers, no import cycles, small modules, and
the environment and the store's keys each in one place."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import grimp
import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 300


def _sources(*folders: str) -> list[pathlib.Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def test_the_layer_contract_holds() -> None:
    """import-linter's contract in pyproject.toml (every import counts: function-local and
    TYPE_CHECKING ones too)."""
    lint = pathlib.Path(sys.executable).with_name("lint-imports")
    out = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    adj = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(adj):
        if start in index:
            continue
        work = [(start, iter(adj[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(adj[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back() -> None:
    """No import cycle between any two modules, packages' __init__ included."""
    graph = grimp.build_graph("resilient", include_external_packages=False)
    assert _cycles(graph) == []


@pytest.mark.parametrize("folder", ["resilient", "chaos"])
def test_modules_and_classes_stay_small(folder: str) -> None:
    too_big = []
    for path in _sources(folder):
        src = path.read_text()
        if src.count("\n") > MAX_MODULE_LINES:
            too_big.append(f"{path.relative_to(ROOT)}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                span = (node.end_lineno or node.lineno) - node.lineno + 1
                if span > MAX_CLASS_LINES:
                    too_big.append(f"{path.relative_to(ROOT)}: class {node.name} {span} lines")
    assert too_big == []


def test_hot_recovery_reads_its_environment_in_one_place() -> None:
    """RESILIENT_HOT and RESILIENT_GENERATION are read by HotMode.from_env alone (envvars.py);
    everything else is handed the HotMode."""
    readers = [
        str(p.relative_to(ROOT))
        for p in _sources("resilient")
        if p.name != "envvars.py"
        and any(
            f"environ.get({name}" in p.read_text() or f"int_env({name}" in p.read_text()
            for name in ("ENV_HOT", "ENV_GENERATION")
        )
    ]
    assert readers == []


def test_store_keys_are_built_in_storekeys_alone() -> None:
    writers = [
        str(p.relative_to(ROOT))
        for p in _sources("resilient")
        if p.name != "storekeys.py"
        and any(k in p.read_text() for k in ('"resilient/attempt_', '"resilient/round', "/gen_{"))
    ]
    assert writers == []
