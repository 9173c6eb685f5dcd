"""The house's rules, read statically from the source (docs/architecture.md, "The rooms"):

- no import cycle among the project's modules, imports inside functions included (those under
  TYPE_CHECKING aside);
- the runtime package (shared/aivedio) and the handlers (functions/) import nothing of the tools
  package (shared/aivedio_tools), at any depth;
- lower rooms never import higher ones (LAYERS, bottom first);
- an import inside a function is only there for start-up time, and says so (`# lazy: why`), or is an
  optional dependency tried under `except ImportError`;
- the layer build ships the runtime package whole, with no list of what to leave out."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from layers import build

ROOT = Path(__file__).resolve().parents[2]
RUNTIME, TOOLS = "aivedio", "aivedio_tools"
PACKAGES = {RUNTIME: ROOT / "shared", TOOLS: ROOT / "shared", "functions": ROOT, "infra_cdk": ROOT, "layers": ROOT}

# The rooms of the runtime package, bottom first: a module may import its own layer and the ones
# below it, never one above. A room is a package of aivedio, or one of its top-level modules; the
# maintenance room's table (reconcile.room) sits at the bottom, since the config and the schedules
# read it and it loads its services only by name.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("errors", "config", "reconcile.room", "tasks", "events", "metrics_catalog", "observability",
                    "tenant_errors", "gateway_errors", "faults", "caching", "cloud_config", "cloud_credentials")),
    ("plumbing", ("db", "cache", "context", "wakeups", "events_routing", "outbox", "audit", "auth", "degraded",
                  "terminal_events")),
    ("operator-set policy, as data", ("policy",)),
    ("providers and prices", ("providers", "pricing")),
    ("provider spend", ("spend",)),
    ("customer credit, the scheduler, and what must hold of them", ("billing", "scheduling", "invariants")),
    ("media", ("media",)),
    ("attempts", ("attempts",)),
    ("admission", ("admission",)),
    ("repairs and reads", ("reconcile", "health", "views", "bootstrap")),
    ("operator actions", ("admin",)),
)
LAYER_OF = {room: i for i, (_, rooms) in enumerate(LAYERS) for room in rooms}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, base in PACKAGES.items():
        for p in (base / pkg).rglob("*.py"):
            parts = list(p.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids |= {id(n) for n in ast.walk(node)}
    return ids


def _imports(module: str) -> list[tuple[ast.stmt, str, bool]]:
    """(statement, imported project module, inside a function) for each import of `module`."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f) if n is not f}
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                out.append((node, target, id(node) in in_function))
    return out


GRAPH: dict[str, set[str]] = {m: {t for _, t, _ in _imports(m)} for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
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
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


def tools_reached(graph: dict[str, set[str]]) -> dict[str, str]:
    """Each runtime or handler module that reaches the tools package, with the import that does."""
    reached: dict[str, str] = {}
    for start in (m for m in graph if m.split(".")[0] in (RUNTIME, "functions")):
        seen, todo = {start}, [start]
        while todo:
            m = todo.pop()
            for t in graph.get(m, ()):
                if t.split(".")[0] == TOOLS:
                    reached.setdefault(start, f"{m} -> {t}")
                elif t not in seen:
                    seen.add(t)
                    todo.append(t)
    return reached


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != RUNTIME or len(parts) == 1:
        return None
    return "reconcile.room" if module == "aivedio.reconcile.room" else parts[1]


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a lower room of the runtime to a higher one."""
    return sorted(f"{m} -> {t}" for m in graph for t in graph[m]
                  if (a := _room(m)) is not None and (b := _room(t)) is not None and LAYER_OF[b] > LAYER_OF[a])


def unexplained_lazy_imports(paths: list[Path]) -> list[str]:
    """Imports inside functions with neither a `# lazy:` comment nor an `except ImportError`."""
    out = []
    for path in paths:
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        tried = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try)
                 and any(h.type is not None and "ImportError" in ast.unparse(h.type) for h in t.handlers)
                 for stmt in t.body for n in ast.walk(stmt)}
        for f in ast.walk(tree):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(f):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in tried \
                        and "# lazy:" not in " ".join(lines[node.lineno - 1:node.end_lineno]):
                    out.append(f"{path}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return sorted(set(out))


def test_no_import_cycle_among_the_projects_modules():
    assert cycles(GRAPH) == []


def test_the_runtime_and_the_handlers_import_nothing_of_the_tools():
    assert tools_reached(GRAPH) == {}


def test_every_room_of_the_runtime_has_a_layer():
    rooms = {r for m in MODULES if (r := _room(m)) is not None}
    assert rooms - set(LAYER_OF) == set(), "a new room: give it its place in LAYERS (and in docs/architecture.md)"
    assert set(LAYER_OF) - rooms == set(), "LAYERS names a room that no longer exists"


def test_lower_rooms_never_import_higher_ones():
    assert upward(GRAPH) == []


def test_an_import_inside_a_function_says_why():
    assert unexplained_lazy_imports([p for m, p in MODULES.items() if m.split(".")[0] in (RUNTIME, TOOLS, "functions")]) == []


def test_the_layer_build_ships_the_runtime_package_whole(tmp_path):
    dest = build.copy_package(tmp_path)
    src = ROOT / "shared" / RUNTIME
    shipped = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert shipped == sorted(p.relative_to(src).as_posix() for p in src.rglob("*")
                             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
    assert not (tmp_path / TOOLS).exists()
    assert "DEV_ONLY" not in (ROOT / "layers" / "build.py").read_text()


def test_each_check_is_able_to_fail(tmp_path):
    """Each check above fires on a graph or a file that breaks its rule."""
    broken = {**GRAPH, "aivedio.errors": GRAPH["aivedio.errors"] | {"aivedio.config"},
              "aivedio.config": GRAPH["aivedio.config"] | {"aivedio.errors"}}
    assert ["aivedio.config", "aivedio.errors"] in cycles(broken)
    broken = {**GRAPH, "aivedio.errors": GRAPH["aivedio.errors"] | {"aivedio_tools.cli.common"}}
    assert tools_reached(broken)["aivedio.errors"] == "aivedio.errors -> aivedio_tools.cli.common"
    assert tools_reached(broken)["aivedio.auth"] == "aivedio.errors -> aivedio_tools.cli.common"  # at any depth
    broken = {**GRAPH, "aivedio.errors": GRAPH["aivedio.errors"] | {"aivedio.admin.capacity"}}
    assert upward(broken) == ["aivedio.errors -> aivedio.admin.capacity"]
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    import json\n    return json\n\n\ndef g():\n    import csv  # lazy: a reason\n"
                     "    try:\n        import rich\n    except ImportError:\n        rich = None\n    return csv, rich\n")
    assert unexplained_lazy_imports([probe]) == [f"{probe}:2: import json"]


def room_imports() -> dict[str, set[str]]:
    """Room -> the rooms it imports (for docs/architecture.md's table)."""
    out: dict[str, set[str]] = defaultdict(set)
    for m in MODULES:
        a = _room(m)
        for t in GRAPH[m]:
            b = _room(t)
            if a is not None and b is not None and a != b:
                out[a].add(b)
    return out
