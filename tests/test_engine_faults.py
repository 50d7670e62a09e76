"""Faults on the real engines: a peer advertising a driver it cannot serve, an engine error in
the middle of a transfer, an engine that cannot start, a peer killed mid-transfer. Each gives
a typed error naming the driver and what the engine said, and the endpoint keeps serving
other peers."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from collections.abc import Iterator

import msgpack
import pytest

from kvtransport.negotiation.registry import load_driver
from kvtransport.runtime.endpoint import Endpoint, State, Timeouts
from kvtransport.spi.errors import DriverError, EngineError, KVTransportError, NegotiationError, PeerLost
from kvtransport.tools.kv_pool import KVPool
from kvtransport.tools.peer_process import PeerProcess

from .conftest import require_engines, unused_port

ENGINES = ["nixl-ucx", "mooncake-gdr"]
PAGES, LAYERS, ITEM = 64, 4, 4096


@pytest.fixture
def pools() -> Iterator[tuple[KVPool, KVPool, KVPool]]:
    made = [KVPool(PAGES, LAYERS, ITEM, 0, shared=False) for _ in range(3)]
    for i, pool in enumerate(made):
        pool.fill(seed=10 + i)
    yield made[0], made[1], made[2]
    for pool in made:
        pool.close()


def _endpoint(pool: KVPool, driver: str, name: str) -> Endpoint:
    return Endpoint(
        pool.regions,
        pool.layout,
        drivers={driver: load_driver(driver)},
        name=name,
        timeouts=Timeouts(heartbeat_interval=0.2, heartbeat_timeout=2.0, transfer=20.0),
    )


def _move(sender: Endpoint, receiver: Endpoint, tag: str, src: list[int], dst: list[int]) -> None:
    """A transfer from ``sender`` to ``receiver`` (receiver connects), bytes checked after."""
    conn_r = receiver.connect(sender.address, 10)
    conn_s = next(c for c in sender.connections.values() if c.id == conn_r.id)
    recv = conn_r.expect(tag, dst)
    send = conn_s.sender(tag)
    while send.state is State.BOOTSTRAPPING:
        time.sleep(0.001)
    send.send(src)
    assert send.wait(20) is State.SUCCESS
    assert recv.wait(20) is State.SUCCESS


@pytest.mark.parametrize("driver", ENGINES)
def test_peer_advertising_unusable_connection_info_is_refused_and_others_still_served(
    driver: str, pools: tuple[KVPool, KVPool, KVPool]
) -> None:
    require_engines()
    a_pool, bad_pool, good_pool = pools
    a = _endpoint(a_pool, driver, "prefill")
    bad = _endpoint(bad_pool, driver, "liar")
    good = _endpoint(good_pool, driver, "decode")
    try:
        entry = bad.hello.drivers[driver]
        forged = dataclasses.replace(entry, conn=b"\x93not what it says")
        bad.hello = dataclasses.replace(bad.hello, drivers={**bad.hello.drivers, driver: forged})
        # ... and as the receive side it made for this connection, which is what the peer uses.
        bad.drivers[driver].receive_info = lambda peer: b"\x93not what it says"  # type: ignore[method-assign]
        with pytest.raises(KVTransportError) as info:
            bad.connect(a.address, 10)
        assert driver in str(info.value) and "connection info" in str(info.value)
        _move(a, good, "after-liar", [1, 2, 3], [7, 8, 9])
        assert good_pool.page_digests([7, 8, 9]) == a_pool.page_digests([1, 2, 3])
    finally:
        for ep in (bad, good, a):
            ep.close()


def test_mooncake_write_to_a_dead_engine_fails_typed_and_endpoint_serves_others(
    pools: tuple[KVPool, KVPool, KVPool],
) -> None:
    require_engines()
    driver = "mooncake-gdr"
    a_pool, ghost_pool, good_pool = pools
    a = _endpoint(a_pool, driver, "prefill")
    ghost = _endpoint(ghost_pool, driver, "ghost")
    good = _endpoint(good_pool, driver, "decode")
    dead_port = unused_port()  # not ephemeral: no outgoing connection takes it meanwhile
    try:
        # The ghost advertises a well-formed session where no engine listens, as the receive
        # side of this connection: the handshake passes, the write fails inside Mooncake.
        session = msgpack.packb({"session": f"127.0.0.1:{dead_port}", "protocol": "tcp"})
        ghost.drivers[driver].receive_info = lambda peer: session  # type: ignore[method-assign]
        conn_g = ghost.connect(a.address, 10)
        conn_a = next(c for c in a.connections.values() if c.id == conn_g.id)
        conn_g.expect("doomed", [1, 2])
        t = conn_a.sender("doomed")
        while t.state is State.BOOTSTRAPPING:
            time.sleep(0.001)
        t.send([3, 4])
        with pytest.raises(EngineError, match=r"mooncake-gdr: Mooncake refused a \d+-byte write to 127\.0\.0\.1:\d+"):
            t.wait(20)
        _move(a, good, "after-ghost", [5, 6], [10, 11])
        assert good_pool.page_digests([10, 11]) == a_pool.page_digests([5, 6])
    finally:
        for ep in (ghost, good, a):
            ep.close()


def test_mooncake_that_cannot_start_is_reported_not_crashed(
    monkeypatch: pytest.MonkeyPatch, pools: tuple[KVPool, KVPool, KVPool]
) -> None:
    """No free handshake port makes Mooncake itself crash the process (SIGSEGV); the driver
    checks first and the endpoint reports why the driver is unusable."""
    require_engines()
    held = []
    for _ in range(20):  # two adjacent free ports, held for the test
        s1 = socket.socket()
        s1.bind(("127.0.0.1", 0))
        port = s1.getsockname()[1]
        s2 = socket.socket()
        try:
            s2.bind(("127.0.0.1", port + 1))
        except OSError:
            s1.close()
            s2.close()
            continue
        held = [s1, s2]
        break
    assert held, "could not find two adjacent free ports"
    a_pool, b_pool, _ = pools
    b = _endpoint(b_pool, "mooncake-gdr", "decode")
    monkeypatch.setenv("MC_MIN_RPC_PORT", str(port))
    monkeypatch.setenv("MC_MAX_RPC_PORT", str(port + 1))
    a = _endpoint(a_pool, "mooncake-gdr", "prefill")
    try:
        assert "mooncake-gdr" not in a.drivers
        status = a.hello.drivers["mooncake-gdr"].status
        assert status is not None and not status.available
        assert f"no free port for its handshake service in {port}-{port + 1}" in status.reason
        with pytest.raises(NegotiationError, match="no free port"):
            b.connect(a.address, 10)
    finally:
        a.close()
        b.close()
        for s in held:
            s.close()


@pytest.mark.parametrize("driver", ENGINES)
def test_decode_killed_mid_transfer_fails_typed_and_prefill_serves_others(
    driver: str, pools: tuple[KVPool, KVPool, KVPool]
) -> None:
    require_engines()
    # A big pool on the doomed side, so the transfer is still in flight when it dies.
    big_pages, big_item = 256, 256 * 1024
    a_pool = KVPool(big_pages, LAYERS, big_item, 0, shared=False)
    a = Endpoint(
        a_pool.regions,
        a_pool.layout,
        drivers={driver: load_driver(driver)},
        name="prefill",
        timeouts=Timeouts(heartbeat_interval=0.2, heartbeat_timeout=2.0, transfer=20.0),
    )
    peer = PeerProcess(
        *("--driver", driver, "--pages", str(big_pages), "--layers", str(LAYERS), "--item", str(big_item)),
        *("--aux-slots", "0", "--private", "--name", "doomed"),
        "--timeouts",
        json.dumps({"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0}),
    )
    try:
        peer.call("connect", address=a.address)
        conn = a.accept(10)
        pages = list(range(big_pages))
        tags = [f"big-{i}" for i in range(8)]
        peer.call("expect", transfers={tag: pages for tag in tags[:1]})
        t = conn.sender(tags[0])
        while t.state is State.BOOTSTRAPPING:
            time.sleep(0.001)
        t.send(pages)  # 256 MiB
        time.sleep(0.05)
        start = time.monotonic()
        peer.kill()
        if t.state is State.SUCCESS:
            pytest.skip("the transfer finished before the kill; nothing to observe")
        with pytest.raises((PeerLost, EngineError, DriverError)) as info:
            t.wait(15)
        assert time.monotonic() - start < 10
        assert "doomed" in str(info.value) or driver in str(info.value)
        # Another decode endpoint is still served.
        small_pool = KVPool(big_pages, LAYERS, big_item, 0, shared=False)
        try:
            other = Endpoint(small_pool.regions, small_pool.layout, drivers={driver: load_driver(driver)}, name="next")
            try:
                _move(a, other, "after-kill", [1, 2], [3, 4])
            finally:
                other.close()
        finally:
            small_pool.close()
    finally:
        peer.close()
        a.close()
        a_pool.close()
