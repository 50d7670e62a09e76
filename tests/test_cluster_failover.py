"""Failover across simulated hosts (issue 46, item 3): control on one rail, data on another, the
data rail cut in the middle of transfers; the requests in flight complete over the other path.

Two hosts joined by two rails. The control channel and mooncake-gdr (TCP, bound to the
endpoint's address) use rail 0; nixl-ucx is bound to rail 1 (``UCX_NET_DEVICES=rail1`` on both
hosts). The user's list of drivers (``KVTRANSPORT_DRIVERS``) makes nixl-ucx the chosen driver
and mooncake-gdr its standby. Rail 1 is cut silently (its switch port down: no reset reaches
either side) while transfers are on it: nixl-ucx reports nothing, its completions simply stop,
so the stall check moves them to mooncake-gdr, and the decode side fences nixl-ucx for that
peer before any of them counts as done. Every byte is checked, and where the bytes went is read
from the rails' own counters.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvtransport.tools import simcluster
from kvtransport.tools.peer_process import PeerProcess
from kvtransport.tools.simcluster import SimCluster

from .conftest import require_engines

PAGES, LAYERS, ITEM = 96, 4, 128 * 1024  # 48 MiB: three transfers of 32 pages (16 MiB each)
TIMEOUTS = {"heartbeat_interval": 0.2, "heartbeat_timeout": 3.0, "stall": 0.3}
#: Slow enough that the transfers are still in flight 0.2 s in (each rail shaped alike).
RATE = "400mbit"


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    reason = simcluster.unavailable()
    if reason is not None:
        pytest.skip(reason)
    with SimCluster(hosts=2, rails=2, rate=RATE) as c:
        yield c


def _hosts(cluster: SimCluster) -> tuple[PeerProcess, PeerProcess, dict[str, Any]]:
    require_engines()
    args = ("--driver", "nixl-ucx+mooncake-gdr", "--pages", str(PAGES + 8), "--layers", str(LAYERS))
    args += ("--item", str(ITEM), "--aux-slots", "0", "--private", "--timeouts", json.dumps(TIMEOUTS))
    env = {
        **os.environ,
        "KVTRANSPORT_SECRET": os.urandom(16).hex(),
        "KVTRANSPORT_DRIVERS": "nixl-ucx,mooncake-gdr",
        "UCX_NET_DEVICES": "rail1",
    }
    env.pop("UCX_TLS", None)
    peers: list[PeerProcess] = []
    try:
        for host, name in enumerate(("prefill", "decode")):
            seed = ("--seed", "11") if name == "prefill" else ()
            listen = f"tcp://{cluster.address(host, 0)}:0"
            peers.append(
                PeerProcess(*args, *seed, "--name", name, "--listen", listen, launcher=cluster.launcher(host), env=env)
            )
        prefill, decode = peers
        accepted: list[dict[str, Any]] = []
        t = threading.Thread(target=lambda: accepted.append(prefill.call("accept", timeout=30)))
        t.start()
        decision = decode.call("connect", address=prefill.address, timeout=30)["decision"]
        t.join(30)
        assert accepted and "error" not in accepted[0], accepted
    except BaseException:
        for p in peers:
            p.close()
        raise
    return prefill, decode, decision


def test_a_cut_data_rail_moves_the_requests_in_flight_to_the_other_path(cluster: SimCluster) -> None:
    prefill, decode, decision = _hosts(cluster)
    restored = False
    try:
        assert decision["driver"] == "nixl-ucx" and decision["standby"] == ["mooncake-gdr"], decision
        tags = ["a", "b", "c"]
        pages = {tag: list(range(i * 32, (i + 1) * 32)) for i, tag in enumerate(tags)}
        # One request first: the stall check judges a lane by the rate it showed (never by a
        # nominal estimate, which across a shaped link is far off).
        decode.call("expect", transfers={"warm": list(range(PAGES, PAGES + 8))})
        prefill.call("send", transfers={"warm": [list(range(8))]})
        assert decode.call("wait", tags=["warm"], timeout=30)["states"]["warm"][0] == "SUCCESS"
        before = cluster.counters()
        decode.call("expect", transfers=pages)
        prefill.call("send", transfers={tag: [list(range(32))] for tag in tags})
        time.sleep(0.2)
        cut_at = time.monotonic()
        cluster.cut(1, 1, "both")  # the decode host's port on the data rail
        ended = decode.call("wait", tags=tags, timeout=30, wait_s=20)
        states = ended["states"]
        assert all(states[tag][0] == "SUCCESS" for tag in tags), states
        healed = max(ended["finished"][tag] for tag in tags) - cut_at
        digests = decode.call("digests", pages=[p for tag in tags for p in pages[tag]])["digests"]
        assert digests == prefill.call("digests", pages=list(range(32)) * 3)["digests"]
        taken = prefill.call("taken", tags=tags)["taken"]
        moved = [tag for tag in tags if taken[tag][0] == "mooncake-gdr"]
        assert moved, f"every transfer finished on nixl-ucx before the cut: {taken}"
        after = cluster.counters()
        rail0 = after[(0, 0)].tx - before[(0, 0)].tx
        rail1 = after[(0, 1)].tx - before[(0, 1)].tx
        assert rail1 > 0, "nixl-ucx sent nothing over rail 1 before the cut"
        moved_bytes = len(moved) * 32 * LAYERS * ITEM
        assert rail0 >= moved_bytes, f"rail 0 carried {rail0} bytes, the moved transfers hold {moved_bytes}"
        failovers = prefill.call("metrics")["metrics"]["failovers"]
        assert failovers == [{"from": "nixl-ucx", "to": "mooncake-gdr", "count": 1}], failovers
        assert all(taken[tag][2] > cut_at for tag in moved), (taken, cut_at)
        detected = min(taken[tag][2] for tag in moved) - cut_at
        print(f"self-heal: moved {detected:.2f} s after the cut, the last request arrived {healed:.2f} s after it")
        # The cut rail comes back: after its quarantine nixl-ucx is offered back on this
        # connection (new receive agents on both ends, the failed ones stay fenced), a transfer
        # probes it over rail 1, and it carries the connection's transfers again; a new
        # connection uses it too.
        cluster.restore(1, 1)
        restored = True
        restored_at, rounds, via = time.monotonic(), 0, ""
        while via != "nixl-ucx":
            assert time.monotonic() - restored_at < 30, "nixl-ucx never came back on the connection"
            rounds += 1
            tag = f"later{rounds}"
            decode.call("expect", transfers={tag: [PAGES]})
            prefill.call("send", transfers={tag: [[0]]})
            assert decode.call("wait", tags=[tag], timeout=30)["states"][tag][0] == "SUCCESS"
            via = prefill.call("taken", tags=[tag])["taken"][tag][0]
            time.sleep(0.1)
        print(f"nixl-ucx back on the connection {time.monotonic() - restored_at:.2f} s after the rail returned")
        assert decode.call("digests", pages=[PAGES])["digests"] == prefill.call("digests", pages=[0])["digests"]
        back = prefill.call("metrics")["metrics"]["lanes_back"]
        assert back == [{"driver": "nixl-ucx", "count": 1}], back
        accepted: list[dict[str, Any]] = []
        t = threading.Thread(target=lambda: accepted.append(prefill.call("accept", timeout=30)))
        t.start()
        again = decode.call("connect", address=prefill.address, timeout=30)["decision"]
        t.join(30)
        assert accepted and "error" not in accepted[0] and again["driver"] == "nixl-ucx", (accepted, again)
        decode.call("expect", transfers={"new": [PAGES + 1]})
        prefill.call("send", transfers={"new": [[1]]})
        assert decode.call("wait", tags=["new"], timeout=30)["states"]["new"][0] == "SUCCESS"
        assert prefill.call("taken", tags=["new"])["taken"]["new"][0] == "nixl-ucx"
        assert decode.call("digests", pages=[PAGES + 1])["digests"] == prefill.call("digests", pages=[1])["digests"]
    finally:
        if not restored:
            cluster.restore(1, 1)
        prefill.close()
        decode.close()
