"""GPU checks (skipped cleanly without a CUDA device): the conformance suite with KV in device
memory, two processes on one GPU, for ``mooncake-staged`` (CUDA copies through the ring, no GDR
needed), ``cuda-local`` (CUDA IPC) and ``mooncake-gdr`` (only where GDR is present).
``scripts/gpu-check`` runs this file and prints the figures."""

from __future__ import annotations

import pytest

from kvtransport.negotiation.registry import load_driver
from kvtransport.spi.memory import MemoryKind
from kvtransport.spi.probe import probe_host
from kvtransport.testing.conformance import *  # noqa: F403
from kvtransport.testing.conformance import DriverUnderTest, Pair

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


def test_the_cuda_copy_engine_copies_head_slices_as_one_memmove_per_piece_would() -> None:
    """Unequal TP through the staged path on a GPU: 1 KiB rows at a 2 KiB step (a head slice of
    each token) from device memory into a ring chunk and back out at another step, as 2-D
    copies, byte for byte what one copy per piece writes; odd pieces beside them."""
    import numpy as np

    from kvtransport.staging.cuda_copy import CudaCopyEngine

    engine = CudaCopyEngine(0)
    size, row = 1 << 20, 1024
    dev = engine.cuda.alloc(size)
    try:
        rng = np.random.default_rng(7)
        data = rng.integers(0, 256, size, dtype=np.uint8)
        engine.cuda.memcpy(dev, int(data.ctypes.data), size)
        ring = np.zeros(size // 2, dtype=np.uint8)
        engine.pin(int(ring.ctypes.data), ring.nbytes)
        pages = rng.permutation(size // (32 * row))[:12]
        src = [int(p) * 32 * row + t * 2 * row + row for p in pages for t in range(16)]  # heads of rows
        src.append(size - 100)  # an odd piece of 100 bytes
        lens = [row] * (len(src) - 1) + [100]
        dst = np.cumsum([0, *lens[:-1]])
        engine.copy(
            (int(ring.ctypes.data) + dst).astype(np.uint64),
            (dev + np.asarray(src)).astype(np.uint64),
            np.asarray(lens, dtype=np.uint64),
        )
        want = np.concatenate([data[s : s + n] for s, n in zip(src, lens, strict=True)])
        assert np.array_equal(ring[: want.size], want)
        # And back: the ring's rows into device memory at a 4 KiB step.
        out = engine.cuda.alloc(size)
        try:
            engine.cuda.memset(out, 0, size)
            back = [i * 4 * row for i in range(len(lens) - 1)] + [size - 200]
            engine.copy(
                (out + np.asarray(back)).astype(np.uint64),
                (int(ring.ctypes.data) + dst).astype(np.uint64),
                np.asarray(lens, dtype=np.uint64),
            )
            got = np.empty(size, dtype=np.uint8)
            engine.cuda.memcpy(int(got.ctypes.data), out, size)
            expect = np.zeros(size, dtype=np.uint8)
            for b, s, n in zip(back, src, lens, strict=True):
                expect[b : b + n] = data[s : s + n]
            assert np.array_equal(got, expect)
        finally:
            engine.cuda.free(out)
    finally:
        engine.cuda.free(dev)
        engine.close()


def test_layers_marked_after_cuda_events_go_once_the_kernels_finished(pair: Pair) -> None:
    """A layer-wise send on a GPU: each layer marked ready with a CUDA event recorded behind a
    kernel that runs for a while (``torch.cuda._sleep``), as prefill would record one behind
    each layer's last kernel. No group is posted before its event completed, the caller's
    thread never waits for one, and every byte lands."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    import time

    from kvtransport.runtime.endpoint import State
    from kvtransport.runtime.layer_groups import LayerwisePolicy

    src, dst = list(range(0, 64)), list(range(200, 264))
    pair.peer.call("expect", transfers={"gpu-lw": dst})
    t = pair.conn.sender("gpu-lw")
    while t.state is State.BOOTSTRAPPING:
        time.sleep(0.001)
    stream = t.send_layerwise(src, policy=LayerwisePolicy(min_tokens=0, first_group=1, adaptive=False))
    events = []
    start = time.perf_counter()
    for layer in range(stream.num_layers):
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU time per "layer"
        event = torch.cuda.Event()
        event.record()
        events.append(event)
        stream.layer_ready(layer, after=event)
    marked = time.perf_counter() - start
    assert not all(e.query() for e in events), "the caller went on while the kernels ran"
    assert len(stream.groups) < stream.num_layers
    assert t.wait(60) is State.SUCCESS
    assert marked < 0.05 * stream.num_layers, "marking must not wait for the events"
    # The first event completes after its kernel's tens of ms, well after every mark returned.
    assert stream.groups[0].posted_at - start > marked
    assert pair.peer.call("wait", tags=["gpu-lw"], timeout=30)["states"]["gpu-lw"][0] == "SUCCESS"
    assert pair.peer.call("digests", pages=dst)["digests"] == pair.pool.page_digests(src)
