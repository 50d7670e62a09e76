"""The conformance suite against ``nixl-ucx`` on the real engine: two processes on loopback,
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
    status = load_driver("nixl-ucx").probe()
    assert status.available, f"nixl-ucx must be usable on this machine: {status.reason} ({status.fix})"
    return DriverUnderTest("nixl-ucx")
