"""The ``kvtransport doctor`` and ``kvtransport negotiate`` commands, run as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtransport.negotiation.hello import PROTOCOL_VERSION
from kvtransport.spi.probe import probe_host

from .conftest import require_engines, run_cli


def test_doctor_json_is_a_hello_document() -> None:
    out = run_cli("doctor", "--json")
    doc = json.loads(out.stdout)
    assert doc["protocol"]["name"] == "kvtransport" and doc["protocol"]["version"] == PROTOCOL_VERSION
    assert {"cuda-local", "mooncake-gdr", "mooncake-staged", "nixl-ucx"} <= set(doc["drivers"])
    for entry in doc["drivers"].values():
        assert entry["status"] is None or entry["status"]["reason"]
    if not doc["host"]["cuda_devices"]:
        assert not doc["drivers"]["cuda-local"]["status"]["available"]
        assert "CUDA" in doc["drivers"]["cuda-local"]["status"]["reason"]
    rails = doc["diagnostics"]["rails"]
    assert rails["root"] == "/sys" and isinstance(rails["gpus"], list)
    if not rails["gpus"]:
        assert any(note.startswith("no GPUs") for note in rails["notes"])


def test_doctor_table_names_each_driver() -> None:
    require_engines()
    out = run_cli("doctor")
    assert out.returncode == 0, out.stderr
    for name in ("cuda-local", "mooncake-gdr", "mooncake-staged", "nixl-ucx"):
        assert name in out.stdout
    assert "available" in out.stdout
    assert "\n  rails:   " in out.stdout
    if not probe_host().cuda_devices:
        assert "\n    no GPUs (" in out.stdout


def test_doctor_refuses_a_forced_rail_that_does_not_exist() -> None:
    out = run_cli("doctor", env={"KVTRANSPORT_RAILS": "cuda:0=no_such_rail"})
    assert out.returncode == 1
    assert "KVTRANSPORT_RAILS: no rail 'no_such_rail' on this host; rails here: " in out.stdout


def test_negotiate_on_this_host_picks_a_host_memory_driver() -> None:
    require_engines()
    out = run_cli("negotiate", "--json")
    assert out.returncode == 0, out.stderr
    decision = json.loads(out.stdout)
    assert decision["driver"] in ("nixl-ucx", "mooncake-gdr")
    outcomes = {c["driver"]: c for c in decision["candidates"]}
    assert outcomes[decision["driver"]]["outcome"] == "chosen"
    assert all(c["reason"] for c in decision["candidates"])


def test_negotiate_honours_the_forced_driver() -> None:
    require_engines()
    out = run_cli("negotiate", "--json", env={"KVTRANSPORT_DRIVER": "mooncake-gdr"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["driver"] == "mooncake-gdr"


def test_negotiate_with_a_misspelled_driver_fails_with_a_suggestion() -> None:
    out = run_cli("negotiate", env={"KVTRANSPORT_DRIVER": "nixl-ucz"})
    assert out.returncode != 0
    assert "Did you mean 'nixl-ucx'?" in out.stderr


def test_negotiate_forced_but_unusable_fails_with_the_reason() -> None:
    if probe_host().cuda_devices:
        pytest.skip("cuda-local is usable on a GPU host")
    out = run_cli("negotiate", env={"KVTRANSPORT_DRIVER": "cuda-local"})
    assert out.returncode != 0
    assert "KVTRANSPORT_DRIVER=cuda-local cannot be used" in out.stderr and "CUDA" in out.stderr


def test_negotiate_with_nothing_allowed_fails_listing_reasons() -> None:
    out = run_cli(
        "negotiate", env={"KVTRANSPORT_EXCLUDE": "cuda-local,mooncake-gdr,mooncake-staged,nixl-staged,nixl-ucx"}
    )
    assert out.returncode != 0
    assert "no driver can move KV" in out.stderr and "excluded by KVTRANSPORT_EXCLUDE" in out.stderr


def test_negotiate_between_hello_files(tmp_path: Path) -> None:
    require_engines()
    doc = json.loads(run_cli("doctor", "--json").stdout)
    remote = dict(doc, host=dict(doc["host"], host_id="another-host", hostname="decode-1"))
    remote["protocol"] = dict(doc["protocol"], endpoint="decode-1")
    (tmp_path / "remote.json").write_text(json.dumps(remote))
    out = run_cli("negotiate", "--remote", str(tmp_path / "remote.json"), "--json")
    assert out.returncode == 0, out.stderr
    decision = json.loads(out.stdout)
    # Another host: no shared memory, so UCX must say TCP.
    assert decision["acceptor"] == "decode-1"
    for c in decision["candidates"]:
        if c["driver"] == "nixl-ucx" and c["outcome"] != "rejected":
            assert c["path"] == "tcp"


def test_negotiate_rejects_a_malformed_hello(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text(json.dumps({"protocol": {"name": "kvtransport", "version": 99}}))
    out = run_cli("negotiate", "--remote", str(tmp_path / "bad.json"))
    assert out.returncode != 0 and "version 99" in out.stderr
