"""Across simulated hosts (issue 46): every driver between two hosts of a :class:`SimCluster`,
and silent partitions in the middle of transfers.

Each host is a network namespace with its own hostname, IPC, PID and mount namespaces and its
own ``/dev/shm``, joined to the other by a switch (:mod:`kvtransport.tools.simcluster`). The
prefill and the decode each run in their own process on their own host.

- The bytes cross the rail: the prefill host's interface sent at least the KV bytes moved, and
  the two processes share no namespace a real pair of hosts would not share.
- A link cut silently (both ways, or only what one host sends) while transfers are in flight:
  every transfer ends on both sides with a typed error within the heartbeat timeout + 1 s;
  decode fences the prefill before its pages come back; the link returns a second later (TCP
  delivers what it held, the engines send what they queued) and not one byte of those pages
  changes; a new connection to the same prefill moves a request byte-exact.
- The same cut under SGLang's own classes: a prefill rank on one host (SGLang's ``KVArgs``,
  the backend's manager, sender and bootstrap server, polled as its prefill scheduler polls),
  the decode rank in this process, plugged into the switch: both schedulers see
  ``KVPoll.Failed`` within the bound, with the reason, and the next request over the returned
  link succeeds.

Skipped where simulated hosts cannot be made (no CAP_NET_ADMIN/CAP_SYS_ADMIN, no iproute2).
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvtransport.tools import simcluster
from kvtransport.tools.peer_process import PeerProcess
from kvtransport.tools.simcluster import SimCluster

from .conftest import require_engines

DRIVERS = ("mooncake-gdr", "mooncake-staged", "nixl-ucx", "nixl-staged")
PAGES, LAYERS, ITEM = 96, 4, 128 * 1024  # 48 MiB a round; three transfers of 32 pages
HEARTBEAT = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.5}
#: Slow enough that the three transfers are still in flight 0.3 s in (about 1 s for 48 MiB).
RATE = "400mbit"
#: The documented bound: an in-flight transfer fails within the heartbeat timeout + 1 s of a cut.
BOUND_S = HEARTBEAT["heartbeat_timeout"] + 1.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    reason = simcluster.unavailable()
    if reason is not None:
        pytest.skip(reason)
    with SimCluster(hosts=2, rails=1, rate=RATE, here=True) as c:
        yield c


def _hosts(cluster: SimCluster, driver: str, **extra_env: str) -> tuple[PeerProcess, PeerProcess]:
    """A prefill on host 0 and a decode on host 1, connected (decode dials)."""
    require_engines()
    args = ("--driver", driver, "--pages", str(PAGES + 8), "--layers", str(LAYERS), "--item", str(ITEM))
    args += ("--aux-slots", "0", "--private", "--timeouts", json.dumps(HEARTBEAT))
    env = {**os.environ, "KVTRANSPORT_SECRET": os.urandom(16).hex(), **extra_env}  # two hosts: authenticated
    env.pop("UCX_TLS", None)  # UCX picks what it finds: across hosts, that is TCP
    peers = []
    try:
        for host, name in enumerate(("prefill", "decode")):
            listen = f"tcp://{cluster.address(host)}:0"
            seed = ("--seed", "7") if name == "prefill" else ()
            peers.append(
                PeerProcess(*args, *seed, "--name", name, "--listen", listen, launcher=cluster.launcher(host), env=env)
            )
        _connect(*peers)
    except BaseException:
        for p in peers:
            p.close()
        raise
    return peers[0], peers[1]


def _connect(prefill: PeerProcess, decode: PeerProcess, timeout: float = 20) -> dict[str, Any]:
    accepted: list[dict[str, Any]] = []
    t = threading.Thread(target=lambda: accepted.append(prefill.call("accept", timeout=timeout)))
    t.start()
    decision = decode.call("connect", address=prefill.address, timeout=timeout)["decision"]
    t.join(timeout)
    assert accepted and "error" not in accepted[0], accepted
    return dict(decision)


def _round(prefill: PeerProcess, decode: PeerProcess, tag: str, src: list[int], dst: list[int]) -> None:
    decode.call("expect", transfers={tag: dst})
    prefill.call("send", transfers={tag: [src]})
    state = decode.call("wait", tags=[tag], timeout=30)["states"][tag]
    assert state[0] == "SUCCESS", state
    assert decode.call("digests", pages=dst)["digests"] == prefill.call("digests", pages=src)["digests"]


@pytest.mark.parametrize("driver", DRIVERS)
def test_two_hosts_share_nothing_and_the_kv_crosses_the_rail(cluster: SimCluster, driver: str) -> None:
    prefill, decode = _hosts(cluster, driver)
    try:
        here, there = prefill.call("whereami"), decode.call("whereami")
        assert here["hostname"] != there["hostname"] and here["host_id"] != there["host_id"]
        shared = [ns for ns, ident in here["namespaces"].items() if there["namespaces"][ns] == ident]
        assert shared == [], f"the simulated hosts share the {shared} namespaces"
        before = cluster.counters()
        pages = list(range(PAGES))
        _round(prefill, decode, "crossing", pages, pages[::-1])
        after = cluster.counters()
        moved = PAGES * LAYERS * ITEM
        sent = after[(0, 0)].tx - before[(0, 0)].tx
        received = after[(1, 0)].rx - before[(1, 0)].rx
        # Every KV byte went over the link, once (headers and the control channel on top).
        assert moved <= received <= sent * 1.01 and sent < moved * 1.3, (moved, sent, received)
    finally:
        prefill.close()
        decode.close()


#: (who is cut off, how): both ways at the switch, or only what one host sends.
CUTS = {"both-ways": (0, "both"), "prefill-sends-nothing": (0, "out"), "decode-sends-nothing": (1, "out")}


@pytest.mark.parametrize("cut", sorted(CUTS))
@pytest.mark.parametrize("driver", DRIVERS)
def test_a_silent_partition_fails_every_transfer_in_time_and_no_late_write_lands(
    cluster: SimCluster, driver: str, cut: str
) -> None:
    _partition(cluster, driver, cut)


def test_a_partition_of_a_connection_learning_its_lanes_fences_every_lane(cluster: SimCluster, tmp_path: Any) -> None:
    """No driver named, nothing calibrated: the connection keeps three lanes (one-sided and
    two-sided drivers), and its first three transfers go one to each; the cut fails all three
    in time and the fence covers every lane (no late write of any of them lands)."""
    _partition(cluster, "auto", "both-ways", KVTRANSPORT_CALIBRATION=str(tmp_path / "none.json"))


def _partition(cluster: SimCluster, driver: str, cut: str, **env: str) -> None:
    host, direction = CUTS[cut]
    prefill, decode = _hosts(cluster, driver, **env)
    tags = ["a", "b", "c"]
    pages = {tag: list(range(i * 32, (i + 1) * 32)) for i, tag in enumerate(tags)}
    restored = False
    try:
        decode.call("expect", transfers=pages)
        prefill.call("send", transfers={tag: [list(range(32))] for tag in tags})
        time.sleep(0.3)
        cut_at = time.monotonic()
        cluster.cut(host, 0, direction)
        ended: dict[str, dict[str, Any]] = {}

        def wait(side: str, peer: PeerProcess) -> None:
            ended[side] = peer.call("wait", tags=tags, timeout=15, wait_s=10)

        waits = [threading.Thread(target=wait, args=item) for item in (("prefill", prefill), ("decode", decode))]
        for t in waits:
            t.start()
        for t in waits:
            t.join(20)
        for side in ("prefill", "decode"):
            states = ended[side]["states"]
            if all(states[tag][0] == "SUCCESS" for tag in tags):
                pytest.fail(f"{side}: every transfer finished before the cut; the rate does not hold them")
            for tag in tags:
                state, error, message, _ = states[tag]
                if state == "SUCCESS":
                    continue  # done before the cut reached it
                took = ended[side]["finished"][tag] - cut_at
                assert state == "FAILED" and error, f"{side} {tag}: {states[tag]}"
                assert took <= BOUND_S, f"{side} {tag} failed {took:.2f} s after the cut ({error}: {message})"
        failed = [tag for tag in tags if ended["decode"]["states"][tag][0] == "FAILED"]
        # Decode gives the pages back only once the prefill is fenced, then reuses them.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            states = decode.call("state", tags=failed)["states"]
            if all(states[tag][3] for tag in failed):
                break
            time.sleep(0.1)
        assert all(states[tag][3] for tag in failed), f"decode never fenced the cut-off prefill: {states}"
        reused = [p for tag in failed for p in pages[tag]]
        decode.call("poison", pages=reused)
        marked = decode.call("digests", pages=reused)["digests"]
        time.sleep(1.0)
        cluster.restore(host, 0)
        restored = True
        # The same processes, nothing restarted: a new connection moves a request byte-exact
        # while the old session's queued writes come back to life.
        _connect(prefill, decode)
        _round(prefill, decode, "after", list(range(8)), list(range(PAGES, PAGES + 8)))
        time.sleep(3.0)
        after = decode.call("digests", pages=reused)["digests"]
        changed = [p for p, a, b in zip(reused, marked, after, strict=True) if a != b]
        assert changed == [], f"{len(changed)} pages written after the fence: {changed[:8]}"
    finally:
        if not restored:
            cluster.restore(host, 0)
        prefill.close()
        decode.close()


def test_a_crashed_owners_namespaces_are_swept(cluster: SimCluster) -> None:
    """A cluster whose process died without closing it (SIGKILL) is removed by the next one."""
    import subprocess
    import sys

    code = "from kvtransport.tools.simcluster import SimCluster; import os; c = SimCluster(); os._exit(0)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    left = [ns for ns in simcluster._namespaces() if ns.startswith(simcluster.PREFIX)]
    assert len(left) > len(cluster.netns) + 1, "the crashed process left nothing behind: nothing to test"
    swept = simcluster.sweep_stale()
    assert swept and all(ns not in simcluster._namespaces() for ns in swept)
    assert all(ns in simcluster._namespaces() for ns in cluster.netns), "a live cluster was swept"


def test_sglangs_schedulers_see_a_partition_as_failed_requests_in_time(
    cluster: SimCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's prefill rank on host 0, its decode rank here (198.18.0.254), the link of host 0
    cut both ways while four requests are in flight, restored, then a fifth request."""
    require_engines()
    sglang_conn = pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="sglang==0.5.23 not installed")
    from kvtransport.integrations.sglang import KVTransportKVManager, KVTransportKVReceiver
    from kvtransport.tools.kv_pool import KVPool

    from .sglang_rank import kv_args, poll_until, server_args

    kv_poll = sglang_conn.KVPoll
    here = cluster.address(simcluster.HERE)
    env = {
        "KVTRANSPORT_DRIVER": "mooncake-gdr",
        "KVTRANSPORT_HEARTBEAT_INTERVAL": str(HEARTBEAT["heartbeat_interval"]),
        "KVTRANSPORT_HEARTBEAT_TIMEOUT": str(HEARTBEAT["heartbeat_timeout"]),
        "KVTRANSPORT_SECRET": os.urandom(16).hex(),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    pages, item, aux = 128, ITEM, 16
    rank_args = ("--pages", str(pages), "--layers", str(LAYERS), "--item", str(item), "--aux-slots", str(aux))
    prefill = PeerProcess(
        *rank_args,
        "--host",
        cluster.address(0),
        module="tests.sglang_rank",
        env={**os.environ, **env},
        launcher=cluster.launcher(0),
    )
    pool = KVPool(pages, LAYERS, item, aux, shared=False)
    mgr = KVTransportKVManager(kv_args(pool, role="decode"), "decode", server_args(0, host=here))
    restored = False
    try:
        rooms = {room: list(range(i * 24, (i + 1) * 24)) for i, room in enumerate(range(40, 44))}
        receivers = {}
        for room, dst in rooms.items():
            rx = KVTransportKVReceiver(mgr, prefill.address, room)
            rx.init(0)
            assert poll_until(rx, {kv_poll.WaitingForInput}) == kv_poll.WaitingForInput
            rx.send_metadata(np.array(dst, dtype="int32"), aux_index=room % aux)
            receivers[room] = rx
        sent: dict[str, Any] = {}
        requests = [{"room": room, "chunks": [list(range(24))], "aux": 1} for room in rooms]
        sending = threading.Thread(target=lambda: sent.update(prefill.call("send", requests=requests, timeout=30)))
        sending.start()
        time.sleep(0.3)
        cut_at = time.monotonic()
        cluster.cut(0, 0, "both")
        ended = {}
        deadline = time.monotonic() + 10
        while len(ended) < len(receivers) and time.monotonic() < deadline:
            for room, rx in receivers.items():
                if room not in ended and rx.poll() in (kv_poll.Success, kv_poll.Failed):
                    ended[room] = (rx.poll(), time.monotonic() - cut_at)
            time.sleep(0.002)
        sending.join(30)
        states = sent["states"]
        failed = [room for room, (state, _) in ended.items() if state == kv_poll.Failed]
        assert failed, f"no request was in flight at the cut: {ended}"
        for room in failed:
            took = ended[room][1]
            assert took <= BOUND_S, f"decode's scheduler saw room {room} fail {took:.2f} s after the cut"
            with pytest.raises(Exception, match=r"stopped answering|lost|PeerLost"):
                receivers[room].failure_exception()
            state, error, _, _, when = states[str(room)]
            assert state == "FAILED" and error, states[str(room)]
            assert when - cut_at <= BOUND_S, f"prefill's scheduler saw room {room} fail {when - cut_at:.2f} s after"
        time.sleep(1.0)
        cluster.restore(0, 0)
        restored = True
        # The next request over the returned link, with the same managers: nothing restarted.
        rx = KVTransportKVReceiver(mgr, prefill.address, 50)
        rx.init(0)
        assert poll_until(rx, {kv_poll.WaitingForInput}, timeout=20) == kv_poll.WaitingForInput
        dst = list(range(100, 108))
        rx.send_metadata(np.array(dst, dtype="int32"), aux_index=3)
        out = prefill.call("send", requests=[{"room": 50, "chunks": [list(range(8))], "aux": 5}], timeout=30)
        assert out["states"]["50"][0] == "SUCCESS", out
        assert poll_until(rx, {kv_poll.Success, kv_poll.Failed}) == kv_poll.Success
        assert pool.page_digests(dst) == prefill.call("digests", pages=list(range(8)))["digests"]
    finally:
        if not restored:
            cluster.restore(0, 0)
        mgr.teardown()
        prefill.close()
        pool.close()


def test_bench_across_hosts_shows_where_the_bytes_went_and_what_a_cut_did(cluster: SimCluster) -> None:
    """``kvtransport bench --hosts 2 --cut-at``: every request verified, the KV over rail 0, and
    the request the cut caught failed in time, then arrived once the link was back."""
    import subprocess
    import sys

    require_engines()
    cmd = [sys.executable, "-m", "kvtransport", "bench", "--hosts", "2", "--driver", "mooncake-gdr"]
    cmd += ["--requests", "4", "--prompt-tokens", "512", "--warmup", "0", "--rate", "1gbit"]
    cmd += ["--cut-at", "0.3", "--cut-for", "2", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["integrity"]["ok"] and doc["integrity"]["requests_verified"] == 4
    moved = doc["kv_bytes_moved"]
    links = doc["cluster"]["links"]
    caught = len(doc["cut"]["failed"]) * doc["workload"]["request_bytes"]  # sent in part before the cut
    assert moved == 4 * doc["workload"]["request_bytes"]
    assert moved <= links["host0.rail0"]["tx"] <= (moved + caught) * 1.05
    assert links["host1.rail0"]["rx"] >= moved
    cut = doc["cut"]
    assert cut["happened"] and cut["failed"], cut
    for f in cut["failed"]:
        assert f["after_s"] <= 3.0 + 1.0, f  # the bench's endpoints keep the default heartbeat (3 s)
    assert [r["request"] for r in cut["recovered"]] == [f["request"] for f in cut["failed"]][-1:]


def test_the_bench_on_host_zero_gets_every_flag_but_the_clusters() -> None:
    from kvtransport.tools.bench_hosts import forwarded
    from kvtransport.tools.cli import build_parser

    argv = ["bench", "--hosts", "2", "--rails=2", "--driver", "x", "--rate", "1gbit", "--cut-at", "1", "--json"]
    assert forwarded(argv) == ["bench", "--driver", "x", "--json"]
    # An abbreviation would slip past forwarded() into the bench on host 0: refused instead.
    for abbreviated in (["bench", "--host", "2"], ["bench", "--hosts", "2", "--cut-a", "1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(abbreviated)


def test_an_uncalibrated_pair_of_hosts_learns_which_lane_is_fastest_across_the_link(
    cluster: SimCluster, tmp_path: Any
) -> None:
    """No calibration between the hosts: the connection keeps the best-ranked drivers as lanes,
    sends whole transfers to each until it measured each MIN_SAMPLES times, then each to the
    lane whose measured median (of its last transfers) is lowest, as computed here from the
    same transfers' times; every byte verified."""
    from kvtransport.negotiation.negotiate import LEARNING_LANES
    from kvtransport.runtime.lane import MIN_SAMPLES, RATIO_WINDOW

    no_models = str(tmp_path / "no-calibration.json")  # nothing measured on either host
    prefill, decode = _hosts(cluster, "auto", KVTRANSPORT_CALIBRATION=no_models)
    try:
        decision = _connect(prefill, decode)
        lanes = decision["lanes"]
        assert 1 < len(lanes) <= LEARNING_LANES and "learning" in decision["basis_note"], decision
        measured: dict[str, list[float]] = {lane: [] for lane in lanes}
        exploring = len(lanes) * MIN_SAMPLES
        src, dst = list(range(8)), list(range(40, 48))
        for i in range(exploring + 8):
            tag = f"learn-{i}"
            expected = None
            if i >= exploring:
                # The lane a learned connection must pick: the lowest median of what each lane
                # measured over its last transfers (equal sizes: the prediction is that median).
                expected = min(lanes, key=lambda n: statistics.median(measured[n][-RATIO_WINDOW:]))
            _round(prefill, decode, tag, src, dst)
            # Prefill's own Success comes after its lane took the measurement in.
            assert prefill.call("wait", tags=[tag], timeout=30)["states"][tag][0] == "SUCCESS"
            driver, seconds, _ = prefill.call("taken", tags=[tag])["taken"][tag]
            assert seconds > 0, (tag, driver)
            if i < exploring:
                assert len(measured[driver]) < MIN_SAMPLES, f"{tag} went to {driver}, measured enough already"
            else:
                assert driver == expected, (tag, driver, {n: sorted(v)[-RATIO_WINDOW:] for n, v in measured.items()})
            measured[driver].append(seconds)
        assert all(len(v) >= MIN_SAMPLES for v in measured.values()), measured
    finally:
        prefill.close()
        decode.close()


def test_vllms_schedulers_see_a_partition_as_a_failed_load_and_serve_on(cluster: SimCluster) -> None:
    """vLLM's own scheduler in a prefill instance on host 0 and a decode instance on host 1: a
    first request connects them; the link is cut after the second request's prefill, before
    its decode loads; decode's load fails within the heartbeat timeout + 1 s and the request
    ends in error (what vLLM's kv_load_failure_policy takes); prefill gives the request's blocks
    back at its lease; after the link returns, the next request moves byte-exact."""
    from .vllm_cluster import Instance, engine_config, instance_env, prompt, require_vllm, run_request

    require_vllm()
    lease = 3.0
    fast = {
        "KVTRANSPORT_HEARTBEAT_INTERVAL": str(HEARTBEAT["heartbeat_interval"]),
        "KVTRANSPORT_HEARTBEAT_TIMEOUT": str(HEARTBEAT["heartbeat_timeout"]),
    }
    instances: list[Instance] = []
    restored = True
    try:
        for host, name in enumerate(("prefill", "decode")):
            config = engine_config(extra={"listen_host": cluster.address(host), "lease_s": lease})
            env = instance_env("nixl-ucx", **fast)
            instances.append(Instance(name, config, env, launcher=cluster.launcher(host)))
        p, d = instances
        first = run_request(p, d, "before", prompt(64, seed=1))
        assert first["bad"] == 0 and first["finished"] != "error", first
        p.send(op="prefill", id="p-cut", tokens=prompt(64, seed=2))
        params = p.wait("prefilled", "p-cut")["params"]
        cluster.cut(0, 0, "both")
        restored = False
        cut_at = time.monotonic()
        d.send(op="decode", id="cut", tokens=prompt(64, seed=2), params=params, max_tokens=1)
        assert d.wait("finished", "cut", timeout=30)["reason"] == "error"
        took = time.monotonic() - cut_at
        assert took <= BOUND_S + 0.5, f"decode's load failed {took:.2f} s after the cut"  # (+ the event's way out)
        time.sleep(1.0)
        cluster.restore(0, 0)
        restored = True
        # Prefill never heard from decode about it: its blocks come back at the lease.
        held = p.settle(timeout=lease + 10)
        assert held["requests"] == 0 and held["holding"] == 0, held
        after = run_request(p, d, "after", prompt(96, seed=3))
        assert after["bad"] == 0 and after["checked"] == 95 and after["finished"] != "error", after
    finally:
        if not restored:
            cluster.restore(0, 0)
        for inst in reversed(instances):
            inst.close()


def test_a_simulated_hosts_own_rails_are_what_topology_reads_there(cluster: SimCluster) -> None:
    """spi.topology inside a simulated host (its own /sys/class/net): its rails are the
    cluster's veth interfaces, virtual (no PCI device, so equally near), loopback left out;
    and doctor lists them."""
    import subprocess
    import sys

    code = (
        "import json; from kvtransport.spi.topology import read_topology; t = read_topology('/sys'); "
        "print(json.dumps({'rdma': [r.name for r in t.rdma], 'ip': [r.name for r in t.ip], "
        "'virtual': [r.name for r in t.virtual]}))"
    )
    done = subprocess.run(
        [*cluster.launcher(0), sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"rdma": [], "ip": [], "virtual": [f"rail{r}" for r in range(cluster.rails)]}, seen
    doctor = subprocess.run(
        [*cluster.launcher(0), sys.executable, "-m", "kvtransport", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    rails = [line for line in doctor.stdout.splitlines() if line.strip().startswith("rails:")]
    assert rails and "rail0" in rails[0], doctor.stdout[-2000:]


def test_learning_connections_that_come_and_go_leave_both_hosts_flat(cluster: SimCluster, tmp_path: Any) -> None:
    """Each connection between the hosts keeps three lanes, each with its receive side on the
    other host; connections that come and go (a handshake, three drivers connected, closed)
    leave both endpoints' tables, threads and descriptors where they were."""
    prefill, decode = _hosts(cluster, "auto", KVTRANSPORT_CALIBRATION=str(tmp_path / "none.json"))

    def settled() -> tuple[dict[str, Any], dict[str, Any]]:
        deadline = time.monotonic() + 15
        while True:
            # one connection stays: the one _hosts made (and the closed ones' control connections
            # are gone: their disconnects reach the acceptor a moment after their sessions end)
            both = prefill.call("stats"), decode.call("stats")
            quiet = all(
                s["stats"]["sessions"] == 1 and s["stats"]["unclaimed"] == 0 and s["stats"]["incoming"] == 0
                for s in both
            )
            if quiet or time.monotonic() > deadline:
                return both
            time.sleep(0.2)

    try:
        # Warm-up: the drivers' threads and spare receive sides exist after the first ones.
        decode.call("connects", address=prefill.address, count=3, timeout=60)
        base = settled()
        rounds = []
        for _ in range(2):
            seconds = decode.call("connects", address=prefill.address, count=20, timeout=120)["seconds"]
            assert len(seconds) == 20
            rounds.append(settled())
        for i, name in enumerate(("prefill", "decode")):
            before, first, second = base[i], rounds[0][i], rounds[1][i]
            assert second["stats"] == first["stats"] == before["stats"], (name, before["stats"], second["stats"])
            assert second["process"]["threads"] <= before["process"]["threads"], (name, before, second)
            # Descriptors: the sockets of the last connection's closed agents may stay until the
            # next connect or disconnect drives this endpoint's NIXL agents (up to one
            # connection's worth, whatever the count: 4 and 14 more after two rounds in one
            # clean-clone run), so 20 connections must leave less than one descriptor each.
            fds = [s["process"]["fds"] for s in (before, first, second)]
            assert fds[1] <= fds[0] + 16 and fds[2] <= fds[1] + 16, (name, fds)
    finally:
        prefill.close()
        decode.close()
