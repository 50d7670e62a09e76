"""SGLang's prefill and decode finding each other through etcd, with no bootstrap server process:
two prefill DP ranks in child processes (tests/sglang_rank.py, SGLang's real base classes) publish
their routes in a real etcd; a decode manager here routes rooms to them by bootstrap room, over
nixl-ucx on host memory, bytes verified. etcd is then restarted empty under them: requests on the
connections already made go on, and the routes come back as their owners refresh."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import require_engines, unused_port
from .etcd_server import EtcdServer

sglang_conn = pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="sglang==0.5.23 not installed")
KVPoll = sglang_conn.KVPoll

from kvtransport.integrations.discovery import EtcdConfig  # noqa: E402
from kvtransport.integrations.discovery.etcd import EtcdDirectory  # noqa: E402
from kvtransport.integrations.sglang import KVTransportKVManager, KVTransportKVReceiver  # noqa: E402
from kvtransport.runtime.auth import load_secret  # noqa: E402
from kvtransport.spi.errors import ConfigError  # noqa: E402
from kvtransport.tools.kv_pool import KVPool  # noqa: E402
from kvtransport.tools.peer_process import PeerProcess  # noqa: E402

from .sglang_rank import kv_args, poll_until, server_args  # noqa: E402

PAGES, LAYERS, ITEM, AUX = 64, 2, 4096, 8
SECRET = "d" * 40


@pytest.fixture
def deployment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[EtcdServer, str, Callable[[int], PeerProcess]]]:
    require_engines()
    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    discovery = f"etcd://{etcd.url}/kvt-sglang"
    env = {
        "KVTRANSPORT_DRIVER": "nixl-ucx",
        "KVTRANSPORT_DISCOVERY": discovery,
        "KVTRANSPORT_DISCOVERY_TTL": "2",
        "KVTRANSPORT_SECRET": SECRET,
        "KVTRANSPORT_HEARTBEAT_INTERVAL": "0.2",
        "KVTRANSPORT_HEARTBEAT_TIMEOUT": "2",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    port = unused_port()  # names the instance; nothing listens on it
    started: list[PeerProcess] = []

    def start(dp: int) -> PeerProcess:
        started.append(
            PeerProcess(
                *("--pages", str(PAGES), "--layers", str(LAYERS), "--item", str(ITEM), "--aux-slots", str(AUX)),
                *("--bootstrap-port", str(port), "--dp-rank", str(dp), "--dp-size", "2"),
                module="tests.sglang_rank",
                env={**os.environ, **env},
            )
        )
        return started[-1]

    try:
        yield etcd, f"127.0.0.1:{port}", start
    finally:
        for r in started:
            r.close()
        etcd.stop()


def test_prefill_dp_ranks_and_decode_meet_through_etcd(
    deployment: tuple[EtcdServer, str, Callable[[int], PeerProcess]],
) -> None:
    etcd, instance, start = deployment
    ranks = [start(0), start(1)]
    assert all(r.address == instance for r in ranks)  # the instance's name, with no server behind it
    pool = KVPool(PAGES, LAYERS, ITEM, AUX, shared=False)
    mgr = KVTransportKVManager(kv_args(pool, role="decode"), "decode", server_args(0))
    try:

        def transfer(room: int, dst: list[int], src: list[int]) -> None:
            rx = KVTransportKVReceiver(mgr, instance, room)
            rx.init(room % 2)  # SGLang's decode: the prefill DP rank of the room (follow_bootstrap_room)
            assert poll_until(rx, {KVPoll.WaitingForInput, KVPoll.Failed}) == KVPoll.WaitingForInput
            rx.send_metadata(np.array(dst, dtype=np.int32), aux_index=room % AUX)
            prefill = ranks[room % 2]
            out = prefill.call("send", requests=[{"room": room, "chunks": [src], "aux": 1}], timeout=30)["states"]
            assert out[str(room)][0] == "SUCCESS", out
            assert poll_until(rx, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
            assert pool.page_digests(dst) == prefill.call("digests", pages=src)["digests"]

        transfer(7, [1, 2, 3], [10, 11, 12])  # DP rank 1
        transfer(8, [4, 5], [20, 21])  # DP rank 0
        deadline = time.monotonic() + 10
        while not mgr.try_ensure_parallel_info(instance):  # as SGLang's decode asks, about once a second
            assert time.monotonic() < deadline, "the prefill instance's layout never came from etcd"
            time.sleep(0.05)
        info = mgr.prefill_info_table[instance]
        assert (info.dp_size, info.follow_bootstrap_room) == (2, True)

        # etcd restarts empty: the connections already made carry on meanwhile ...
        etcd.stop(wipe=True)
        transfer(9, [6, 7], [30, 31])
        transfer(10, [8], [40])
        etcd.start()
        # ... and the routes come back as their owners refresh (a new decode rank finds them).
        reader = EtcdDirectory(
            instance, EtcdConfig((("127.0.0.1", etcd.client_port),), "/kvt-sglang"), secret=load_secret(SECRET)
        )
        for dp in range(2):
            assert reader.lookup(dp, 0, wait=20)["dp_rank"] == dp
        transfer(11, [9, 10], [50, 51])

        # DP rank 1 crashes and starts again (a new endpoint, a new generation over its entry):
        # decode notices the connection died, looks the rank up again and reaches the new one.
        first = reader.lookup(1, 0, wait=1)
        ranks[1].proc.kill()
        ranks[1] = start(1)
        second = reader.lookup(1, 0, wait=5)
        assert second["generation"] > first["generation"] and second["endpoint"] != first["endpoint"]
        deadline = time.monotonic() + 15
        while mgr.live_sources(instance, 1):  # the heartbeat timeout (2 s here) ends the old one
            assert time.monotonic() < deadline, "decode never noticed the crashed rank"
            time.sleep(0.05)
        transfer(13, [11, 12], [60, 61])
        assert {c.peer_endpoint for c in mgr.live_sources(instance, 1)} == {second["endpoint"]}
    finally:
        mgr.teardown()
        pool.close()


def test_a_prefill_instance_that_registers_rooms_is_refused_on_etcd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rooms are not published on etcd: a prefill rank that would need them refuses to start,
    naming the setting, instead of leaving decode to time out on every request."""
    monkeypatch.setenv("KVTRANSPORT_DISCOVERY", "etcd://127.0.0.1:1/kvt")  # never reached
    monkeypatch.setenv("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", "1")
    monkeypatch.setenv("KVTRANSPORT_DRIVER", "nixl-ucx")
    require_engines()
    pool = KVPool(PAGES, LAYERS, ITEM, AUX, shared=False)
    try:
        with pytest.raises(ConfigError, match="FORCE_QUERY_PREFILL_DP_RANK"):
            KVTransportKVManager(kv_args(pool), "prefill", server_args(unused_port(), dp_size=2))
    finally:
        pool.close()


def test_prefill_registers_under_the_name_decode_is_handed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With etcd the instance's name is the key: a wildcard --host (registered at loopback by
    the built-in registry) becomes this host's outward address; the variable overrides both."""
    from kvtransport.integrations.sglang_topology import discovery_instance, outward_ip, rank_topology

    monkeypatch.delenv("KVTRANSPORT_DISCOVERY_INSTANCE", raising=False)
    pool = KVPool(4, 1, 64, 1, shared=False)
    try:
        kv = kv_args(pool)
        named = rank_topology(kv, _args(8998, "10.9.8.7"))
        assert discovery_instance(named) == "10.9.8.7:8998"
        wildcard = rank_topology(kv, _args(8998, "0.0.0.0"))
        assert wildcard.bootstrap_host == "127.0.0.1" and discovery_instance(wildcard) == f"{outward_ip()}:8998"
        monkeypatch.setenv("KVTRANSPORT_DISCOVERY_INSTANCE", "prefill-0.svc:8998")
        assert discovery_instance(wildcard) == "prefill-0.svc:8998"
    finally:
        pool.close()


def _args(port: int, host: str) -> Any:
    args = server_args(port)
    args.host = host
    return args


def test_decode_fails_at_once_on_a_route_whose_rank_is_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that died keeps its route in etcd until its lease expires (longer after an etcd
    outage). SGLang's decode connecting to it fails at once (nothing listens at the address),
    with an error that names the instance and the rank and says the route may be stale, not
    after the connect timeout with an address only; the route is looked up again next time."""
    from kvtransport.integrations.discovery.dial import StaleRoute

    require_engines()
    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    for k, v in {"KVTRANSPORT_DRIVER": "nixl-ucx", "KVTRANSPORT_SECRET": SECRET}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("KVTRANSPORT_DISCOVERY", f"etcd://{etcd.url}/kvt-gone")
    instance = f"127.0.0.1:{unused_port()}"
    owner = EtcdDirectory(instance, EtcdConfig((("127.0.0.1", etcd.client_port),), "/kvt-gone"), ttl=10)
    gone = f"tcp://127.0.0.1:{unused_port()}"  # the rank's address: nothing listens there any more
    owner.register(
        {"address": gone, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "follow_bootstrap_room": True}
        | {"page_size": 16, "kv_cache_dtype": "bfloat16", "endpoint": "sglang-prefill-dp0-tp0-gone"}
    )
    pool = KVPool(PAGES, LAYERS, ITEM, AUX, shared=False)
    mgr = KVTransportKVManager(kv_args(pool, role="decode"), "decode", server_args(0))
    try:
        t0 = time.monotonic()
        with pytest.raises(StaleRoute) as failed:
            mgr.connection_to(instance, 0, 0, 1)
        print(f"decode's connect to a gone rank failed after {time.monotonic() - t0:.3f} s: {failed.value}")
        text = str(failed.value)
        for part in (f"dp=0 tp=0 of instance {instance}", gone, "refused", "may be stale", "looked up"):
            assert part in text, (part, text)
        assert (instance, 0, 0) not in mgr._routes  # looked up again for the next request
    finally:
        mgr.teardown()
        pool.close()
        owner.unregister()
        etcd.stop()
