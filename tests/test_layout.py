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
import warnings
from pathlib import Path

import pytest

import kvtransport

PACKAGE = Path(kvtransport.__file__).resolve().parent

#: Each sub-package and the layer it sits on: a module may import from its own layer's
#: packages' modules only when no circle results, and from lower layers freely, never upward.
LAYERS = {
    "spi": 0,
    "negotiation": 1,
    "runtime": 2,
    "staging": 2,
    "tools": 3,
    "testing": 4,
    "integrations": 4,
}
#: Upward imports that are allowed, with the reason. The bench's decode peer loads the fake
#: drivers only when asked for them by name (``--driver fake``), for fault injection.
ALLOWED_UPWARD = {("kvtransport.tools.peer", "kvtransport.testing.fake")}
#: The old top-level modules kept as aliases of where they moved (``kvtransport/<name>.py``).
STABLE_ALIASES = {
    "driver": "kvtransport.spi.driver",
    "errors": "kvtransport.spi.errors",
    "memory": "kvtransport.spi.memory",
}
DEPRECATED_ALIASES = {
    "plan": "kvtransport.spi.plan",
    "probe": "kvtransport.spi.probe",
    "diagnose": "kvtransport.spi.diagnose",
    "endpoint": "kvtransport.runtime.endpoint",
    "prometheus": "kvtransport.runtime.prometheus",
}


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
                if target and target != mod and not mod.startswith(target + "."):
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


def _layer(mod: str) -> int | None:
    parts = mod.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 2 else None


def test_layers_only_import_downward() -> None:
    graph = import_graph()
    upward = sorted(
        (mod, dep)
        for mod, deps in graph.items()
        for dep in deps
        if (mine := _layer(mod)) is not None
        and (theirs := _layer(dep)) is not None
        and mod.split(".")[1] != dep.split(".")[1]
        and theirs >= mine
        and (mod, dep) not in ALLOWED_UPWARD
    )
    assert upward == []
    # Every module lives in a sub-package, except the public API and the aliases of moved ones.
    top = {m.split(".")[1] for m in graph if m.count(".") == 1}
    assert top - set(LAYERS) == {*STABLE_ALIASES, *DEPRECATED_ALIASES, "__main__"}
    assert {m.split(".")[1] for m in graph if m.count(".") >= 2} == set(LAYERS)


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


@pytest.mark.parametrize("old", sorted(STABLE_ALIASES))
def test_stable_aliases_keep_working_without_a_warning(old: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alias = importlib.import_module(f"kvtransport.{old}")
    target = importlib.import_module(STABLE_ALIASES[old])
    public = [n for n in vars(target) if not n.startswith("_") and not isinstance(vars(target)[n], type(sys))]
    assert public and all(getattr(alias, n) is getattr(target, n) for n in public)


@pytest.mark.parametrize("old", sorted(DEPRECATED_ALIASES))
def test_moved_documented_modules_warn(old: str) -> None:
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        f"try:\n    import kvtransport.{old}\nexcept DeprecationWarning as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert DEPRECATED_ALIASES[old] in out.stdout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        alias = importlib.import_module(f"kvtransport.{old}")
    target = importlib.import_module(DEPRECATED_ALIASES[old])
    names = getattr(target, "__all__", None) or [n for n in vars(target) if not n.startswith("_")]
    assert all(getattr(alias, n) is getattr(target, n) for n in names)


def test_python_dash_m_kvtransport_is_the_cli() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtransport", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "doctor" in out.stdout and "bench" in out.stdout


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
