"""Registry: discovery through real entry points of separate distributions, error paths,
and the env-var policy."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtransport.negotiation.hello import load_drivers
from kvtransport.negotiation.registry import Policy, list_drivers, load_driver
from kvtransport.runtime.environment import unknown_env_vars, warn_unknown_env_vars
from kvtransport.spi.driver import DRIVER_API_VERSION, Capabilities, DriverStatus, KVTransport
from kvtransport.spi.errors import (
    ConfigError,
    DriverAPIMismatch,
    DriverLoadError,
    DuplicateDriver,
    NoSuchDriver,
)

from .conftest import run_cli

FIRST_PARTY = {"cuda-local", "mooncake-gdr", "mooncake-staged", "nixl-staged", "nixl-ucx"}


def test_first_party_drivers_are_listed_from_their_own_distributions() -> None:
    entries = {e.name: e for e in list_drivers()}
    assert FIRST_PARTY <= set(entries)
    assert entries["nixl-ucx"].distribution == "kvtransport-nixl"
    assert entries["mooncake-staged"].distribution == "kvtransport-mooncake"
    assert entries["cuda-local"].target == "kvtransport_cuda.local:CudaLocal"


def test_import_and_listing_import_no_engine() -> None:
    code = (
        "import sys, kvtransport\n"
        "assert 'stevedore' not in sys.modules, 'entry points scanned at import'\n"
        "from kvtransport.negotiation.registry import list_drivers\n"
        "names = [e.name for e in list_drivers()]\n"
        "engines = ('mooncake', 'nixl_cu12', 'torch', 'kvtransport_nixl', 'kvtransport_mooncake')\n"
        "bad = [m for m in engines if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print(len(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 4


def test_loading_one_driver_imports_only_that_one() -> None:
    code = (
        "import sys\n"
        "from kvtransport.negotiation.registry import load_driver\n"
        "cls = load_driver('cuda-local')\n"
        "assert cls.name == 'cuda-local'\n"
        "others = ('kvtransport_nixl', 'kvtransport_mooncake', 'nixl_cu12', 'mooncake')\n"
        "print(sorted(m for m in others if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_third_party_distribution_is_discovered_and_works(use_plugins: Callable[..., None]) -> None:
    use_plugins("example_driver")
    entry = next(e for e in list_drivers() if e.name == "example-memcpy")
    assert entry.distribution == "kvtransport-example-driver"
    cls = load_driver("example-memcpy")
    assert cls.probe().available
    loaded = load_drivers()
    assert loaded.hellos["example-memcpy"].usable
    assert FIRST_PARTY <= set(loaded.classes)


def test_broken_entry_points_are_reported_and_do_not_hide_the_others(
    use_plugins: Callable[..., None],
) -> None:
    use_plugins("broken_driver")
    with pytest.raises(DriverLoadError, match=r"broken-import.*ModuleNotFoundError"):
        load_driver("broken-import")
    with pytest.raises(DriverAPIMismatch, match=f"expected {DRIVER_API_VERSION}, got 0"):
        load_driver("broken-api")
    with pytest.raises(DriverLoadError, match=r"not a subclass of kvtransport\.KVTransport"):
        load_driver("broken-notadriver")
    with pytest.raises(DriverLoadError, match="capability claims are never inherited"):
        load_driver("broken-inherits")
    loaded = load_drivers()
    for name in ("broken-import", "broken-api", "broken-notadriver", "broken-inherits"):
        assert loaded.hellos[name].status is None and loaded.hellos[name].load_error
        assert name not in loaded.classes
    assert FIRST_PARTY <= set(loaded.classes)


def test_duplicate_names_raise_naming_both_distributions(use_plugins: Callable[..., None]) -> None:
    use_plugins("example_driver", "dup_driver")
    with pytest.raises(DuplicateDriver) as info:
        load_driver("example-memcpy")
    assert "kvtransport-example-driver" in str(info.value)
    assert "kvtransport-dup-driver" in str(info.value)
    assert "kvtransport_dup_driver" not in sys.modules, "a duplicate must be refused before import"


def test_doctor_lists_broken_and_duplicate_plugins(plugin_dirs: dict[str, Path]) -> None:
    out = run_cli(
        "doctor",
        "--json",
        pythonpath=[plugin_dirs[n] for n in ("example_driver", "dup_driver", "broken_driver")],
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["drivers"]["broken-import"]["load_error"]
    assert "ModuleNotFoundError" in doc["drivers"]["broken-import"]["load_error"]
    assert "DuplicateDriver" not in out.stderr
    assert any("kvtransport-dup-driver" in p for p in doc["diagnostics"]["problems"])
    assert doc["drivers"]["nixl-ucx"]["status"]["available"] is True


def test_unknown_driver_name_suggests_the_close_one() -> None:
    with pytest.raises(NoSuchDriver) as info:
        Policy.from_env({"KVTRANSPORT_DRIVER": "nixl-ucz"})
    text = str(info.value)
    assert "No such driver: 'nixl-ucz'. Did you mean 'nixl-ucx'?" in text
    assert "Installed: cuda-local, mooncake-gdr, mooncake-staged, nixl-staged, nixl-ucx" in text
    with pytest.raises(NoSuchDriver, match="KVTRANSPORT_EXCLUDE"):
        Policy.from_env({"KVTRANSPORT_EXCLUDE": "nixl-ucx,mooncake"})


def test_policy_parsing() -> None:
    known = sorted(FIRST_PARTY)
    policy = Policy.from_env(
        {"KVTRANSPORT_DRIVERS": "mooncake-gdr, nixl-ucx,mooncake-gdr", "KVTRANSPORT_EXCLUDE": "cuda-local"},
        known=known,
    )
    assert policy.allow == ("mooncake-gdr", "nixl-ucx") and policy.exclude == ("cuda-local",)
    assert policy.permits("nixl-ucx") == (True, "")
    assert not policy.permits("mooncake-staged")[0]
    assert not policy.permits("cuda-local")[0]
    assert policy.rank("nixl-ucx") == 1
    with pytest.raises(ConfigError, match="also listed in KVTRANSPORT_EXCLUDE"):
        Policy.from_env({"KVTRANSPORT_DRIVER": "nixl-ucx", "KVTRANSPORT_EXCLUDE": "nixl-ucx"}, known=known)
    with pytest.raises(ConfigError, match="not among KVTRANSPORT_DRIVERS"):
        Policy.from_env({"KVTRANSPORT_DRIVER": "nixl-ucx", "KVTRANSPORT_DRIVERS": "mooncake-gdr"}, known=known)
    assert Policy.from_env({}, known=known) == Policy()


def test_unknown_kvtransport_variables_warn(caplog: pytest.LogCaptureFixture) -> None:
    env = {
        "KVTRANSPORT_DRIVRE": "x",
        "KVTRANSPORT_NIXL_BACKEND": "UCX",
        "KVTRANSPORT_EXAMPLE_GBPS": "1",
        "HOME": "/",
    }
    assert unknown_env_vars(env) == ["KVTRANSPORT_DRIVRE", "KVTRANSPORT_EXAMPLE_GBPS"]
    assert unknown_env_vars(env, driver_vars=["KVTRANSPORT_EXAMPLE_GBPS"]) == ["KVTRANSPORT_DRIVRE"]
    with caplog.at_level(logging.WARNING, logger="kvtransport"):
        warn_unknown_env_vars(env, driver_vars=["KVTRANSPORT_EXAMPLE_GBPS"])
    assert "KVTRANSPORT_DRIVRE (did you mean KVTRANSPORT_DRIVER?)" in caplog.text


def test_capability_claims_are_not_inherited() -> None:
    class Base(KVTransport):
        name = "t-base"
        api_version = DRIVER_API_VERSION
        capabilities = Capabilities(frozenset({"host", "cuda"}), frozenset({"host", "cuda"}))

        @classmethod
        def probe(cls) -> DriverStatus:
            return DriverStatus(True, "")

    with pytest.raises(TypeError, match="must declare capabilities itself"):

        class Child(Base):
            name = "t-child"
            api_version = DRIVER_API_VERSION

    class Helper(Base):  # no name: an abstract intermediate, allowed
        pass

    assert "capabilities" not in Helper.__dict__
