"""The runs app's layers hold, and its modules import one another in no circle (issue 33 item 2).

Layers, lowest first (HackSoft's styleguide): models and plain values; reads and checks (selectors,
validation, worker_hosts, launch_checks); writes (services); the web's faces (api, views, consumers,
forms, serializers, downloads, ...). A module imports its own layer or lower ones, never a higher one,
and no chain of imports comes back to where it started. Every import counts, the ones inside
functions too: a lazy import only hides a circle. The worker drives the control plane through its
services; nothing in ``controlplane/runs`` or ``trainer/`` imports ``worker``.

Read from the source with ``ast`` (nothing imported), so a planted back-import fails here at once.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

APP = "controlplane.runs"
# The first part of a module's name under controlplane.runs -> its layer.
LAYERS: dict[str, int] = {
    "models": 0,
    "json_values": 0,
    "placement": 0,
    "selectors": 1,
    "validation": 1,
    "worker_hosts": 1,
    "launch_checks": 1,
    "services": 2,
    **dict.fromkeys(
        ("api", "views", "consumers", "forms", "serializers", "downloads", "presets", "admin", "urls"), 3
    ),
    **dict.fromkeys(("ws_auth", "apps", ""), 3),  # "": the package's __init__
}
LAYER_NAMES = ("models and values", "reads and checks", "services", "web faces")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, modules: set[str] | None = None) -> set[str]:
    """Every absolute module name ``path`` imports, at any depth. ``from a import b`` names ``a.b``
    when that is one of ``modules`` (a submodule), else ``a``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if modules is not None and full in modules else node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def app_graph() -> dict[str, set[str]]:
    """The runs app's modules (migrations and management commands aside) -> the app modules each imports."""
    files = [
        f
        for f in (REPO / "controlplane" / "runs").rglob("*.py")
        if "migrations" not in f.parts and "management" not in f.parts
    ]
    modules = {_module_name(f): f for f in files}
    return {
        name: {m for m in imports_of(f, set(modules)) if m in modules and m != name}
        for name, f in modules.items()
    }


def layer_of(module: str) -> int:
    part = module.removeprefix(APP).lstrip(".").split(".")[0]
    assert part in LAYERS, f"{module}: a new module of the runs app; give it a layer in LAYERS ({__file__})"
    return LAYERS[part]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each import of a higher layer."""
    return [
        f"{a} ({LAYER_NAMES[layer_of(a)]}) -> {b} ({LAYER_NAMES[layer_of(b)]})"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if layer_of(b) > layer_of(a)
    ]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_runs_app_imports_only_downward_and_in_no_circle():
    graph = app_graph()
    assert f"{APP}.selectors" in graph and f"{APP}.services.ingest" in graph
    assert upward_imports(graph) == []
    assert circles(graph) == []


def test_a_planted_back_import_is_caught():
    """The circle issue 33 found: selectors took ``finite_or_none`` from the ingest service, which
    takes ``run_event_create`` from lifecycle, which validates with validation, which reads
    ``dataset_summary`` from selectors."""
    graph = app_graph()
    graph[f"{APP}.selectors"].add(f"{APP}.services.ingest")
    assert upward_imports(graph) == [
        f"{APP}.selectors (reads and checks) -> {APP}.services.ingest (services)"
    ]
    (circle,) = circles(graph)
    assert {f"{APP}.selectors", f"{APP}.services.ingest", f"{APP}.validation"} <= set(circle)


def test_nothing_in_the_runs_app_or_the_trainer_imports_the_worker():
    """The worker calls the control plane's services; the engine and the web never call back."""
    offenders = [
        f"{path.relative_to(REPO)}: {name}"
        for root in ("controlplane/runs", "trainer")
        for path in sorted((REPO / root).rglob("*.py"))
        for name in sorted(imports_of(path))
        if name == "worker" or name.startswith("worker.")
    ]
    assert offenders == []
