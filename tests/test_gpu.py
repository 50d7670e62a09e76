"""GPU checks (skipped cleanly without a CUDA device): the conformance suite with KV in device
memory, two processes on one GPU, for ``mooncake-staged`` (CUDA copies through the ring, no GDR
needed), ``cuda-local`` (CUDA IPC) and ``mooncake-gdr`` (only where GDR is present).
``scripts/gpu-check`` runs this file and prints the figures."""

from __future__ import annotations

import pytest

from kvtransport.memory import MemoryKind
from kvtransport.probe import probe_host
from kvtransport.registry import load_driver
from kvtransport.testing.conformance import *  # noqa: F403
from kvtransport.testing.conformance import DriverUnderTest

pytestmark = pytest.mark.skipif(not probe_host().cuda_devices, reason="no CUDA device on this host")


@pytest.fixture(scope="module", params=["mooncake-staged", "cuda-local", "mooncake-gdr"])
def conformance_driver(request: pytest.FixtureRequest) -> DriverUnderTest:
    name = str(request.param)
    status = load_driver(name).probe()
    if not status.serves(MemoryKind(0)):
        if name == "mooncake-gdr":
            pytest.skip(f"mooncake-gdr cannot serve device memory here: {status.why_not(MemoryKind(0))}")
        pytest.fail(f"{name} must serve device memory on a CUDA host: {status.why_not(MemoryKind(0))}")
    return DriverUnderTest(name, device=0)
