"""The conformance suite against the fake driver (two processes, shared-memory KV)."""

from __future__ import annotations

import pytest

from kvtransport.testing.conformance import *  # noqa: F403
from kvtransport.testing.conformance import DriverUnderTest


@pytest.fixture(scope="module")
def conformance_driver() -> DriverUnderTest:
    return DriverUnderTest("fake")
