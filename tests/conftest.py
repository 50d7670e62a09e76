"""Shared test set-up: third-party plugin distributions installed for real, and helpers."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# These machines are shared and noisy: a slow example generation is not a failure of the code
# under test, and timing is never what a property test asserts.
settings.register_profile("kvtransport", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("kvtransport")

# A calibration cache of the machine's user must not change which driver a test's endpoints pick
# (children inherit it); the calibration tests point the variable at their own file.
os.environ["KVTRANSPORT_CALIBRATION"] = "off"

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = Path(__file__).resolve().parent / "plugins"


@pytest.fixture(scope="session")
def plugin_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each test plugin under tests/plugins, installed with pip into its own target folder.

    They are real distributions with entry points; keeping each in its own folder (added to
    ``sys.path`` / ``PYTHONPATH`` only by the tests that want it) keeps the broken ones out of
    the environment the main job and the other tests see.
    """
    base = tmp_path_factory.mktemp("plugins")
    dirs = {}
    for project in sorted(PLUGINS.iterdir()):
        if not (project / "pyproject.toml").exists():
            continue
        target = base / project.name
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "--disable-pip-version-check",
                "--target",
                str(target),
                str(project),
            ],
            check=True,
            capture_output=True,
        )
        dirs[project.name] = target
    return dirs


@pytest.fixture
def use_plugins(monkeypatch: pytest.MonkeyPatch, plugin_dirs: dict[str, Path]) -> Iterator[object]:
    """Put chosen plugin distributions on ``sys.path`` for in-process discovery."""
    from stevedore.extension import ExtensionManager

    def add(*names: str) -> None:
        for name in names:
            monkeypatch.syspath_prepend(str(plugin_dirs[name]))
        ExtensionManager.ENTRY_POINT_CACHE.clear()

    yield add
    ExtensionManager.ENTRY_POINT_CACHE.clear()
    for name in list(sys.modules):
        if name.startswith(("kvtransport_example_driver", "kvtransport_broken_driver", "kvtransport_dup_driver")):
            del sys.modules[name]


def run_cli(
    *args: str, env: dict[str, str] | None = None, pythonpath: list[Path] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m kvtransport.tools.cli`` in a fresh process with a controlled environment."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVTRANSPORT_")}
    if pythonpath:
        full_env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "kvtransport.tools.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        check=False,
    )


#: Where unused_port() looks: above Mooncake's handshake ports (15000-17000 by default) and below
#: the kernel's ephemeral range, which it reads from /proc.
LISTEN_PORTS_FROM = 20000
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def unused_port() -> int:
    """A port nothing listens on now, for a server a test (or its child process) starts later.

    A port from ``bind(("127.0.0.1", 0))`` is an ephemeral one: between its release and the
    server's bind, any outgoing connection on the machine may take it as its source port (CI saw
    "Address already in use" this way, with SGLang's ranks opening connections all the while).
    Ports below the ephemeral range are never given to connections; each is handed out once per
    test process, and checked free with a bind that refuses even TIME_WAIT leftovers."""
    high = _ephemeral_low()
    candidates = [p for p in range(LISTEN_PORTS_FROM, high) if p not in _handed_out]
    random.shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no unused port in {LISTEN_PORTS_FROM}-{high - 1} (the ephemeral range starts at {high})")


def require_engines() -> None:
    """Engines are part of the test set-up: a missing one is a failure, not a skip, unless the
    developer opts out explicitly."""
    if os.environ.get("KVTRANSPORT_TESTS_WITHOUT_ENGINES") == "1":
        pytest.skip("KVTRANSPORT_TESTS_WITHOUT_ENGINES=1")


@pytest.fixture(autouse=True)
def _clean_kvtransport_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("KVTRANSPORT_") and key not in (
            "KVTRANSPORT_TESTS_WITHOUT_ENGINES",
            "KVTRANSPORT_TESTS_WITHOUT_VLLM",
        ):
            monkeypatch.delenv(key)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the full tier's tests (tests/tiers.py) ``full``; ``-m "not full"`` is the fast tier."""
    from tests.tiers import in_full_tier

    for item in items:
        if in_full_tier(item.path.stem, item.name):
            item.add_marker(pytest.mark.full)
