"""The conformance suite against ``nixl-ucx`` and ``mooncake-gdr`` on the real engines: two
processes on loopback, host-memory KV, every byte verified."""

from __future__ import annotations

import pytest

from kvtransport.registry import load_driver
from kvtransport.testing.conformance import *  # noqa: F403
from kvtransport.testing.conformance import DriverUnderTest

from .conftest import require_engines


@pytest.fixture(scope="module", params=["nixl-ucx", "mooncake-gdr"])
def conformance_driver(request: pytest.FixtureRequest) -> DriverUnderTest:
    require_engines()
    name = str(request.param)
    status = load_driver(name).probe()
    assert status.available, f"{name} must be usable on this machine: {status.reason} ({status.fix})"
    return DriverUnderTest(name)
