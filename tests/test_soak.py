"""``kvtransport soak`` at CI size on the real engines: random sizes, aborts from both sides,
16 in flight, every byte verified, and both processes' tables, threads and fds back at their
baseline at the end. The full-size run is ``kvtransport soak`` (10,000 transfers per driver)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from .conftest import require_engines, run_cli

DRIVERS = ("nixl-ucx", "mooncake-gdr", "mooncake-staged", "nixl-staged")
TRANSFERS = int(os.environ.get("KVTRANSPORT_SOAK_TRANSFERS", "300"))


@pytest.mark.engines
def test_soak_on_every_real_host_driver() -> None:
    require_engines()
    args = [a for d in DRIVERS for a in ("--driver", d)]
    out = run_cli("soak", *args, "--transfers", str(TRANSFERS), "--json", timeout=600)
    assert out.returncode == 0, _verdicts(out.stdout) + "\n" + out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["ok"]
    for r in report["drivers"]:
        assert r["transfers"] == TRANSFERS and r["corrupt"] == 0 and not r["unexpected"], r
        assert r["succeeded"] > TRANSFERS // 2 and r["aborted"] > 0, r  # both fates really happened
        assert not r["leaks"], r["leaks"]
        assert r["end"]["prefill"]["handles"] == 0 and r["end"]["decode"]["handles"] == 0


def _verdicts(stdout: str) -> str:
    """Each driver's verdict from the soak's JSON (its tail alone may show only the last, which
    passed), or the raw tail if it is not JSON."""
    try:
        drivers = json.loads(stdout)["drivers"]
    except (ValueError, KeyError, TypeError):
        return stdout[-3000:]
    keys = ("driver", "transfers", "succeeded", "aborted", "corrupt", "seconds", "leaks")
    rows = [{**{k: d.get(k) for k in keys}, "unexpected": d.get("unexpected", [])[:3]} for d in drivers]
    return "\n".join(json.dumps(row) for row in rows)


def test_soak_reports_corruption_it_can_see() -> None:
    """The soak's verdict is not a constant: a pool whose pages are wrong fails it."""
    from kvtransport.tools.soak import DriverSoak

    r = DriverSoak("x", transfers=10, succeeded=9, corrupt=1)
    assert not r.ok
    r = DriverSoak(
        "x", transfers=10, succeeded=10, start={"prefill": {"sessions": 1}}, end={"prefill": {"sessions": 2}}
    )
    assert r.leaks == ["prefill.sessions 1 -> 2"] and not r.ok


@pytest.mark.engines
def test_soak_of_a_connection_with_two_lanes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A calibrated connection keeping two drivers as lanes (models that favour nixl-ucx for
    few descriptors, mooncake-staged for many) under the soak's random sizes, aborts from both
    sides and 16 in flight: both lanes carry verified transfers, and both processes' tables,
    handles, threads and fds end where they were after the first wave."""
    require_engines()
    from kvtransport.negotiation.calibration_cache import write_cache
    from kvtransport.negotiation.cost_model import CostModel
    from kvtransport.negotiation.hello import load_drivers
    from kvtransport.spi.probe import machine_key
    from kvtransport.tools.soak import run_soak

    names = ("nixl-ucx", "mooncake-staged")
    loaded = load_drivers(names)
    cache = tmp_path / "calibration.json"
    figures = {"nixl-ucx": ("shm", 1e-4, 5e-5), "mooncake-staged": ("tcp", 5e-3, 0.0)}
    for n, (path, latency, per_run) in figures.items():
        version = loaded.hellos[n].status.version  # type: ignore[union-attr]
        write_cache(cache, {n: [CostModel(path, latency, per_run, 100.0, "", version)]}, machine_key())
    monkeypatch.setenv("KVTRANSPORT_CALIBRATION", str(cache))  # both processes read it
    r = run_soak("+".join(names), transfers=min(TRANSFERS, 300))
    assert r.ok, r.render()
    assert r.corrupt == 0 and not r.unexpected and not r.leaks, r.render()
    assert set(r.lanes) == set(names) and min(r.lanes.values()) >= 10, r.lanes
    assert r.end["prefill"]["handles"] == 0 and r.end["decode"]["handles"] == 0
