"""The conformance suite against ``mooncake-gdr`` on the real engine: two processes on loopback,
host-memory KV, every byte verified."""

from __future__ import annotations

import pytest

from kvtransport.registry import load_driver
from kvtransport.testing.conformance import *  # noqa: F403
from kvtransport.testing.conformance import DriverUnderTest

from .conftest import require_engines


@pytest.fixture(scope="module")
def conformance_driver() -> DriverUnderTest:
    require_engines()
    status = load_driver("mooncake-gdr").probe()
    assert status.available, f"mooncake-gdr must be usable on this machine: {status.reason} ({status.fix})"
    return DriverUnderTest("mooncake-gdr")
