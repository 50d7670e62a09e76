"""The package's shape, checked from its source: no import circles, layers that only look down,
and a public API that exports what it says.

Every ``import`` counts, including those under ``TYPE_CHECKING`` and inside functions: a circle
that only the type checker follows still means neither module can be read without the other.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvtransport

PACKAGE = Path(kvtransport.__file__).resolve().parent

#: Each sub-package and the layer it sits on: a module imports from its own package (with no
#: circle) and from packages of lower layers, never from another package of its layer or above.
#: The package itself (``kvtransport``, the public API) sits above them all.
LAYERS = {
    "spi": 0,
    "negotiation": 1,
    "runtime": 2,
    "staging": 2,
    "tools": 3,
    "testing": 4,
    "integrations": 4,
}
API_LAYER = 5
#: Upward imports that are allowed, with the reason. The bench's decode peer loads the fake
#: drivers only when asked for them by name (``--driver fake``), and the fault-injecting
#: wrapper only when its options name a fault file, for fault injection; the CLI and its doctor
#: print the package's version.
ALLOWED_UPWARD = {
    ("kvtransport.tools.peer", "kvtransport.testing.fake"),
    ("kvtransport.tools.peer", "kvtransport.testing.faults"),
    ("kvtransport.tools.cli", "kvtransport"),
    # `kvtransport bench --consumer vllm` times the vLLM connector, which sits above the tools
    ("kvtransport.tools.cli", "kvtransport.integrations.vllm.bench"),
    ("kvtransport.tools.doctor", "kvtransport"),
}
#: What a driver package may import: the public API and the SPI, and the staged path (staged
#: drivers and the CUDA copy engine); nothing of the runtime, the negotiation or above.
DRIVER_MAY_IMPORT = ("kvtransport.spi", "kvtransport.staging")


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the kvtransport modules it imports (any import statement anywhere in it)."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in paths else source for a in node.names]
            for target in targets:
                # `import a.b.c` depends on a.b.c; a name imported from a package on the package
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    deps.add(target)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def test_no_import_circles() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_circle(tmp_path: Path) -> None:
    """The check above can fail: two modules that import each other, one of them only for types."""
    pkg = tmp_path / "kvtransport"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kvtransport.b import B\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\nclass B: ...\n"
    )
    (pkg / "c.py").write_text("import kvtransport.a\n")
    assert cycles(import_graph(pkg)) == [["kvtransport.a", "kvtransport.b"]]


def _package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(mod: str) -> int | None:
    """The layer of ``mod`` (a package's ``__init__`` included); ``None`` for ``__main__``."""
    if mod == "kvtransport":
        return API_LAYER
    if mod == "kvtransport.__main__":
        return None
    return LAYERS[_package(mod)]


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted(
        (mod, dep)
        for mod, deps in graph.items()
        for dep in deps
        if (mine := _layer(mod)) is not None
        and (theirs := _layer(dep)) is not None
        and _package(mod) != _package(dep)
        and theirs >= mine
        and (mod, dep) not in ALLOWED_UPWARD
    )


def test_layers_only_import_downward() -> None:
    graph = import_graph()
    assert upward_imports(graph) == []
    # Every module lives in a sub-package, except the public API: one public path per thing.
    top = {m.split(".")[1] for m in graph if m.count(".") == 1}
    assert top - set(LAYERS) == {"__main__"}


def test_the_layer_check_finds_an_upward_import() -> None:
    """The check above can fail: a package's __init__ that imports the tools, an SPI module
    that imports the staging package or the public API, a runtime module a staging one."""
    graph = {
        "kvtransport": set(),
        "kvtransport.spi": {"kvtransport.tools.cli"},
        "kvtransport.spi.driver": {"kvtransport.staging", "kvtransport"},
        "kvtransport.staging": set(),
        "kvtransport.staging.pipeline": {"kvtransport.runtime.session"},
        "kvtransport.runtime.session": {"kvtransport.spi.driver"},
        "kvtransport.tools.cli": set(),
    }
    assert upward_imports(graph) == [
        ("kvtransport.spi", "kvtransport.tools.cli"),
        ("kvtransport.spi.driver", "kvtransport"),
        ("kvtransport.spi.driver", "kvtransport.staging"),
        ("kvtransport.staging.pipeline", "kvtransport.runtime.session"),
    ]


def test_driver_packages_import_only_the_spi_and_the_staged_path() -> None:
    drivers = PACKAGE.parent / "drivers"
    bad = []
    for path in sorted(drivers.glob("*/kvtransport_*/**/*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            for name in names:
                if name.startswith("kvtransport.") and not name.startswith(DRIVER_MAY_IMPORT):
                    bad.append(f"{path.relative_to(drivers)}: {name}")
    assert bad == []
    assert len(list(drivers.glob("*/kvtransport_*/*.py"))) >= 10


def test_the_spi_imports_nothing_above_it_and_no_engine() -> None:
    graph = import_graph()
    for mod, deps in graph.items():
        if mod.startswith("kvtransport.spi"):
            assert all(d.startswith("kvtransport.spi") for d in deps), (mod, deps)
    code = (
        "import sys, kvtransport, kvtransport.runtime.endpoint, kvtransport.negotiation.negotiate; "
        "print(sorted(m for m in ('mooncake', 'nixl', 'nixl_cu12', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_session_knows_its_endpoint_only_through_session_host() -> None:
    graph = import_graph()
    for mod in ("kvtransport.runtime.session", "kvtransport.runtime.express", "kvtransport.runtime.handles"):
        assert "kvtransport.runtime.endpoint" not in graph[mod], mod
    assert "kvtransport.runtime.session" not in graph["kvtransport.runtime.express"]
    assert "kvtransport.runtime.session" not in graph["kvtransport.runtime.handles"]


def test_public_api() -> None:
    for name in kvtransport.__all__:
        assert hasattr(kvtransport, name), name
    # What a user needs, reachable from the package itself.
    for name in ("Endpoint", "Connection", "Transfer", "State", "KVLayout", "RegionSet", "KVTransport"):
        assert name in kvtransport.__all__, name
    errors = importlib.import_module("kvtransport.spi.errors")
    for name, value in vars(errors).items():
        if isinstance(value, type) and issubclass(value, kvtransport.KVTransportError):
            assert getattr(kvtransport, name, None) is value, f"{name} is not exported"


@pytest.mark.parametrize(
    "old", ["driver", "errors", "memory", "plan", "probe", "diagnose", "endpoint", "peer", "testing.gpu_check"]
)
def test_the_old_second_paths_are_gone(old: str) -> None:
    """One public path per thing: 0.1's paths went in 0.8 (the SPI lives under kvtransport.spi)."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"kvtransport.{old}")


def test_python_dash_m_kvtransport_is_the_cli_and_the_tools_run() -> None:
    for module in ("kvtransport", "kvtransport.tools.peer", "kvtransport.tools.gpu_check"):
        out = subprocess.run(
            [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60, check=False
        )
        assert out.returncode == 0, (module, out.stderr[-2000:])
        assert "usage:" in out.stdout, module
    out = subprocess.run([sys.executable, "-m", "kvtransport", "--help"], capture_output=True, text=True, timeout=60)
    assert "doctor" in out.stdout and "bench" in out.stdout
    # Importing the package's __main__ (pydoc, autodoc) runs nothing.
    out = subprocess.run([sys.executable, "-c", "import kvtransport.__main__"], capture_output=True, timeout=60)
    assert out.returncode == 0 and not out.stdout


def test_the_readme_example_is_the_example_file_and_runs() -> None:
    root = PACKAGE.parent
    example = (root / "examples" / "two_endpoints.py").read_text()
    assert f"```python\n{example.rstrip()}\n```" in (root / "README.md").read_text()
    out = subprocess.run(
        [sys.executable, str(root / "examples" / "two_endpoints.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("KVTRANSPORT_")}, "MC_LOG_LEVEL": "WARNING"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "verified: 3 pages x 8 regions" in out.stdout
