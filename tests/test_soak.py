"""``kvtransport soak`` at CI size on the real engines: random sizes, aborts from both sides,
16 in flight, every byte verified, and both processes' tables, threads and fds back at their
baseline at the end. The full-size run is ``kvtransport soak`` (10,000 transfers per driver)."""

from __future__ import annotations

import json
import os

import pytest

from .conftest import require_engines, run_cli

DRIVERS = ("nixl-ucx", "mooncake-gdr", "mooncake-staged", "nixl-staged")
TRANSFERS = int(os.environ.get("KVTRANSPORT_SOAK_TRANSFERS", "300"))


@pytest.mark.engines
def test_soak_on_every_real_host_driver() -> None:
    require_engines()
    args = [a for d in DRIVERS for a in ("--driver", d)]
    out = run_cli("soak", *args, "--transfers", str(TRANSFERS), "--json", timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["ok"]
    for r in report["drivers"]:
        assert r["transfers"] == TRANSFERS and r["corrupt"] == 0 and not r["unexpected"], r
        assert r["succeeded"] > TRANSFERS // 2 and r["aborted"] > 0, r  # both fates really happened
        assert not r["leaks"], r["leaks"]
        assert r["end"]["prefill"]["handles"] == 0 and r["end"]["decode"]["handles"] == 0


def test_soak_reports_corruption_it_can_see() -> None:
    """The soak's verdict is not a constant: a pool whose pages are wrong fails it."""
    from kvtransport.soak import DriverSoak

    r = DriverSoak("x", transfers=10, succeeded=9, corrupt=1)
    assert not r.ok
    r = DriverSoak(
        "x", transfers=10, succeeded=10, start={"prefill": {"sessions": 1}}, end={"prefill": {"sessions": 2}}
    )
    assert r.leaks == ["prefill.sessions 1 -> 2"] and not r.ok
