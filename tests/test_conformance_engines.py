"""The conformance suite against ``nixl-ucx`` and ``mooncake-gdr`` on the real engines: two
processes on loopback, host-memory KV, every byte verified."""

from __future__ import annotations

import pytest

from kvtransport.negotiation.registry import load_driver
from kvtransport.testing.conformance import *  # noqa: F403
from kvtransport.testing.conformance import DriverUnderTest

from .conftest import require_engines


@pytest.fixture(scope="module", params=["nixl-ucx", "nixl-ucx/split", "mooncake-gdr"])
def conformance_driver(request: pytest.FixtureRequest) -> DriverUnderTest:
    """``nixl-ucx/split``: every batch of two runs or more is cut into parts that two threads
    post at once (its ``driver_options``), so the whole suite runs on that path."""
    require_engines()
    name, _, variant = str(request.param).partition("/")
    status = load_driver(name).probe()
    assert status.available, f"{name} must be usable on this machine: {status.reason} ({status.fix})"
    options = {"nixl.split_bytes": "1", "nixl.posters": "2"} if variant == "split" else {}
    return DriverUnderTest(name, options)
