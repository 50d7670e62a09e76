"""The conformance suite against the staged drivers on the real engines, with host KV: the
whole staging pipeline (ring, credits, gather, wire, scatter) runs with the memcpy copy engine
and Mooncake (``mooncake-staged``) or NIXL/UCX (``nixl-staged``) moves the chunks between two
processes; every byte verified."""

from __future__ import annotations

import pytest

from kvtransport.negotiation.registry import load_driver
from kvtransport.testing.conformance import *  # noqa: F403
from kvtransport.testing.conformance import DriverUnderTest

from .conftest import require_engines

TINY = {"staging.ring_bytes": str(1 << 20), "staging.chunk_bytes": str(64 << 10)}


@pytest.fixture(
    scope="module",
    params=[("mooncake-staged", {}), ("mooncake-staged", TINY), ("nixl-staged", TINY)],
    ids=["mooncake-default-ring", "mooncake-tiny-ring", "nixl-tiny-ring"],
)
def conformance_driver(request: pytest.FixtureRequest) -> DriverUnderTest:
    """The default 256 MiB ring, and 8 slots of 64 KiB each way, so that 100 concurrent
    transfers and every multi-page one must stream through the ring on credits."""
    require_engines()
    name, options = request.param
    status = load_driver(name).probe()
    assert status.available and "host" in status.memory, status
    return DriverUnderTest(name, options=dict(options))
