"""The conformance suite against ``mooncake-staged`` on the real engine, with host KV: the
whole staging pipeline (ring, credits, gather, wire, scatter) runs with the memcpy copy engine
and Mooncake moves the chunks between two processes; every byte verified."""

from __future__ import annotations

import pytest

from kvtransport.registry import load_driver
from kvtransport.testing.conformance import *  # noqa: F403
from kvtransport.testing.conformance import DriverUnderTest

from .conftest import require_engines


@pytest.fixture(
    scope="module",
    params=[{}, {"staging.ring_bytes": str(1 << 20), "staging.chunk_bytes": str(64 << 10)}],
    ids=["default-ring", "tiny-ring"],
)
def conformance_driver(request: pytest.FixtureRequest) -> DriverUnderTest:
    """Once with the default 256 MiB ring, once with 8 slots of 64 KiB each way, so that 100
    concurrent transfers and every multi-page one must stream through the ring on credits."""
    require_engines()
    status = load_driver("mooncake-staged").probe()
    assert status.available and "host" in status.memory, status
    return DriverUnderTest("mooncake-staged", options=dict(request.param))
