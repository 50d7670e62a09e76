"""Discovery on etcd against a real etcd server (Debian's etcd-server, started here on free
loopback ports in a temporary data directory): registration and lookup, an owner killed with
SIGKILL, a restarted rank, etcd restarted under its owners (with and without its data), forged
entries and entries put back off their lease, a member that hangs, answers slowly or drops
every packet, a route whose rank is gone, a thousand routes registered and expired; and the
configuration and entry format on their own, with hypothesis."""

from __future__ import annotations

import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.integrations.discovery import (
    DEFAULT_PREFIX,
    EtcdConfig,
    ForgedEntry,
    decode_entry,
    directory_for,
    discovery_ttl,
    encode_entry,
    parse_discovery,
)
from kvtransport.integrations.discovery import etcd as etcd_module
from kvtransport.integrations.discovery.etcd import (
    DiscoveryUnreachable,
    EtcdDirectory,
    EtcdStore,
    forged_entries,
    store_for,
)
from kvtransport.runtime.auth import Secret, load_secret
from kvtransport.runtime.discovery_config import MIN_TTL, check_policy
from kvtransport.spi.errors import ConfigError, ConnectError, ProtocolError

from .etcd_server import ETCD, EtcdServer, Member

SECRET = load_secret(secrets.token_hex(32))
OTHER = load_secret(secrets.token_hex(32))
INSTANCE = "10.1.2.3:8998"


def route(tp_rank: int = 0, address: str = "tcp://10.0.0.1:5000", tp_size: int = 2, dp_rank: int = 0) -> dict[str, Any]:
    return {
        "address": address,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "dp_rank": dp_rank,
        "dp_size": dp_rank + 1,
        "endpoint": f"prefill-{dp_rank}-{tp_rank}",
    }


# -- configuration and entries, no server ---------------------------------------------------


def test_the_variable_names_the_backend() -> None:
    assert parse_discovery("") is None and parse_discovery("bootstrap") is None
    cfg = parse_discovery("etcd://a:1234,b/deploy/x")
    assert cfg == EtcdConfig((("a", 1234), ("b", 2379)), "/deploy/x")
    assert parse_discovery("etcd://h:1") == EtcdConfig((("h", 1),), DEFAULT_PREFIX)
    assert parse_discovery(cfg.describe()) == cfg
    for bad in ("redis://h:1", "etcd://", "etcd://h:notaport", "etcd://h:1/pre fix", "etcd:/h"):
        with pytest.raises(ConfigError, match="KVTRANSPORT_DISCOVERY"):
            parse_discovery(bad)
    with pytest.raises(ConfigError, match="KVTRANSPORT_DISCOVERY_TTL"):
        discovery_ttl({"KVTRANSPORT_DISCOVERY_TTL": "1"})
    assert discovery_ttl({}) == 10.0


@settings(max_examples=200, deadline=None)
@given(
    hosts=st.lists(
        st.tuples(st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True), st.integers(1, 65535)), min_size=1, max_size=4
    ),
    prefix=st.lists(st.from_regex(r"[A-Za-z0-9._-]{1,10}", fullmatch=True), max_size=3),
)
def test_a_described_config_reads_back_the_same(hosts: list[tuple[str, int]], prefix: list[str]) -> None:
    cfg = EtcdConfig(tuple(hosts), "/" + "/".join(prefix) if prefix else DEFAULT_PREFIX)
    assert parse_discovery(cfg.describe()) == cfg


def test_an_unsigned_deployment_may_use_only_a_loopback_etcd() -> None:
    remote = EtcdConfig((("10.0.0.5", 2379),))
    with pytest.raises(ConfigError, match="without a deployment secret"):
        check_policy(remote, Secret.none(), env={})
    assert "NOT signed" in check_policy(remote, Secret.none(), env={"KVTRANSPORT_INSECURE": "1"})
    assert "loopback" in check_policy(EtcdConfig((("127.0.0.1", 2379),)), Secret.none(), env={})
    assert "signed" in check_policy(remote, SECRET, env={})


def test_an_entry_verifies_only_under_its_key_and_secret() -> None:
    key = "/kvtransport/instances/x/ranks/0/1"
    raw = encode_entry(SECRET, key, route(1), 42)
    entry = decode_entry(SECRET, key, raw)
    assert entry.generation == 42 and entry.route["address"] == "tcp://10.0.0.1:5000"
    with pytest.raises(ForgedEntry):
        decode_entry(OTHER, key, raw)  # another deployment's secret
    with pytest.raises(ForgedEntry):
        decode_entry(SECRET, "/kvtransport/instances/x/ranks/0/0", raw)  # moved to another rank's key
    doc = json.loads(raw)
    doc["body"] = doc["body"].replace("10.0.0.1", "6.6.6.6")
    with pytest.raises(ForgedEntry):
        decode_entry(SECRET, key, json.dumps(doc).encode())  # redirected
    with pytest.raises(ForgedEntry):
        decode_entry(SECRET, key, encode_entry(Secret.none(), key, route(1), 42))  # written without the secret


@settings(max_examples=100, deadline=None)
@given(generation=st.integers(1, 2**63 - 1), lease=st.one_of(st.none(), st.integers(1, 2**63 - 1)))
def test_an_entry_reads_back_with_its_lease_and_the_same_bytes(generation: int, lease: int | None) -> None:
    """The lease an entry was written on is signed with it (readers compare it with the lease
    etcd holds the key on), and encoding is deterministic (an owner compares bytes)."""
    key = "/kvtransport/instances/x/ranks/0/1"
    raw = encode_entry(SECRET, key, route(1), generation, lease)
    assert raw == encode_entry(SECRET, key, route(1), generation, lease)
    entry = decode_entry(SECRET, key, raw)
    assert (entry.generation, entry.lease) == (generation, lease)
    if lease is not None:  # another lease's entry is other bytes, which the signature binds
        doc = json.loads(raw)
        doc["body"] = doc["body"].replace(f'"lease": {lease}', f'"lease": {lease + 1}')
        with pytest.raises(ForgedEntry):
            decode_entry(SECRET, key, json.dumps(doc).encode())


@settings(max_examples=300, deadline=None)
@given(
    raw=st.one_of(
        st.binary(max_size=300),
        st.builds(
            lambda d: json.dumps(d).encode(),
            st.dictionaries(
                st.sampled_from(["v", "body", "sig", "x"]), st.one_of(st.integers(), st.text(max_size=40), st.none())
            ),
        ),
    )
)
def test_any_bytes_read_as_an_entry_are_an_entry_or_a_protocol_error(raw: bytes) -> None:
    try:
        decode_entry(SECRET, "/k", raw)
    except ProtocolError:
        pass


# -- against a real etcd ----------------------------------------------------------------------


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    if not os.path.exists(ETCD):
        pytest.fail(f"no etcd at {ETCD}: bash scripts/dev setup installs Debian's etcd-server")
    server = EtcdServer(tmp_path / "etcd-data")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def config(etcd: EtcdServer) -> EtcdConfig:
    # A prefix of the test's own: the store cache is per config, and nothing leaks between tests.
    return EtcdConfig((("127.0.0.1", etcd.client_port),), f"/kvt-{secrets.token_hex(4)}")


def directory(config: EtcdConfig, **kw: Any) -> EtcdDirectory:
    kw.setdefault("secret", SECRET)
    return EtcdDirectory(INSTANCE, config, **kw)


def test_a_registered_route_is_found_and_removed(config: EtcdConfig) -> None:
    owner, reader = directory(config), directory(config)
    owner.register(route(1))
    found = reader.lookup(0, 1, wait=2)
    assert found["address"] == "tcp://10.0.0.1:5000" and found["generation"] == owner.generation
    # What a decode rank measures: lookup of a registered rank, p50 over 200 reads.
    took = []
    for _ in range(200):
        t0 = time.perf_counter()
        reader.lookup(0, 1, wait=1)
        took.append(time.perf_counter() - t0)
    print(f"etcd lookup p50 {statistics.median(took) * 1e3:.2f} ms")
    owner.unregister()
    with pytest.raises(ConnectError, match=r"dp=0 tp=1 of 10\.1\.2\.3:8998 is not registered"):
        reader.lookup(0, 1, wait=0.3)


def test_the_configured_backend_is_what_directory_for_returns(
    config: EtcdConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtransport.integrations.bootstrap import BootstrapClient

    monkeypatch.delenv("KVTRANSPORT_DISCOVERY", raising=False)
    assert isinstance(directory_for("127.0.0.1:8998"), BootstrapClient)
    monkeypatch.setenv("KVTRANSPORT_DISCOVERY", config.describe())
    monkeypatch.setenv("KVTRANSPORT_SECRET", "s" * 40)
    d = directory_for("127.0.0.1:8998")
    assert isinstance(d, EtcdDirectory) and d.config == config and not d.serves_rooms
    assert d.reachable() == ""


_OWNER = """
import sys, time
from kvtransport.integrations.discovery import parse_discovery
from kvtransport.integrations.discovery.etcd import EtcdDirectory
d = EtcdDirectory(sys.argv[2], parse_discovery(sys.argv[1]), ttl=float(sys.argv[3]))
d.keep_registered({"address": "tcp://10.0.0.9:7000", "tp_rank": 0, "tp_size": 1, "dp_rank": 0,
                   "endpoint": "victim"})
print("registered", flush=True)
time.sleep(600)
"""


def test_an_owner_killed_with_sigkill_is_gone_within_its_ttl(config: EtcdConfig) -> None:
    from etcd3gw.client import Etcd3Client

    ttl = 2.0
    env = {**os.environ, "KVTRANSPORT_SECRET": "k" * 40}
    proc = subprocess.Popen(
        [sys.executable, "-c", _OWNER, config.describe(), INSTANCE, str(ttl)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "registered"
        raw = Etcd3Client(host=config.endpoints[0][0], port=config.endpoints[0][1], timeout=2, api_path="/v3/")
        reader = directory(config, secret=load_secret("k" * 40))
        assert reader.lookup(0, 0, wait=2)["endpoint"] == "victim"
        time.sleep(ttl)  # it refreshed meanwhile: still there
        assert reader.lookup(0, 0, wait=0)["endpoint"] == "victim"
        # Issue 45, 4: anyone with write access to etcd (no secret needed) puts the entry back
        # byte for byte without its lease; the owner's next refresh puts it back on the lease.
        key = reader.key(0, 0)
        value, meta = raw.get(key, metadata=True)[0]
        raw.put(key, value)
        put_back = time.monotonic()
        while int(raw.get(key, metadata=True)[0][1].get("lease", 0)) != int(meta["lease"]):
            assert time.monotonic() - put_back < 3 * ttl, "the owner left its entry off its lease"
            time.sleep(0.02)
        print(f"entry back on its lease {time.monotonic() - put_back:.2f} s after it was put back without one")
        killed = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        while True:
            try:
                reader.lookup(0, 0, wait=0)
            except ConnectError as exc:
                assert "dp=0 tp=0" in str(exc) and INSTANCE in str(exc)
                break
            assert time.monotonic() - killed < ttl + 2.0, "the dead owner's route outlived its lease"
            time.sleep(0.05)
        gone = time.monotonic() - killed
        print(f"a SIGKILLed owner's route vanished after {gone:.2f} s (ttl {ttl:g} s)")
        assert gone <= ttl + 2.0
    finally:
        proc.kill()
        proc.wait(10)


def test_a_restarted_rank_replaces_its_old_entry_and_the_old_one_stops(config: EtcdConfig) -> None:
    old = directory(config, ttl=2, generation=1000)
    old.keep_registered(route(0, "tcp://10.0.0.1:1111"), interval=0.2)
    new = directory(config, ttl=2, generation=2000)  # a later start of the same rank
    new.register(route(0, "tcp://10.0.0.2:2222"))
    reader = directory(config)
    found = reader.lookup(0, 0, wait=1)
    assert found["address"] == "tcp://10.0.0.2:2222" and found["generation"] == 2000
    deadline = time.monotonic() + 5
    while not old.superseded:
        assert time.monotonic() < deadline, "the old start kept refreshing over the new one"
        time.sleep(0.05)
    time.sleep(0.5)
    assert reader.lookup(0, 0, wait=0)["generation"] == 2000, "the old start wrote over the new one"
    with pytest.raises(ConnectError, match="later start"):
        old.register(route(0, "tcp://10.0.0.1:1111"))
    old.close()
    new.unregister()


def test_entries_come_back_after_etcd_restarts_without_its_data(etcd: EtcdServer, config: EtcdConfig) -> None:
    owner = directory(config, ttl=2)
    owner.keep_registered(route(1), interval=0.3)
    reader = directory(config)
    assert reader.lookup(0, 1, wait=1)["generation"] == owner.generation
    etcd.stop(wipe=True)
    time.sleep(1.0)
    with pytest.raises(ConnectError):
        reader.lookup(0, 1, wait=0.2)
    restarted = time.monotonic()
    etcd.start()
    found = reader.lookup(0, 1, wait=20)  # the owner's next refresh finds its lease gone and writes anew
    print(f"entry back {time.monotonic() - restarted:.2f} s after etcd restarted empty")
    assert found["generation"] == owner.generation
    owner.unregister()


def test_a_forged_entry_is_ignored_and_counted(config: EtcdConfig) -> None:
    from etcd3gw.client import Etcd3Client

    host, port = config.endpoints[0]
    raw = Etcd3Client(host=host, port=port, timeout=2, api_path="/v3/")
    reader = directory(config)
    key = reader.key(0, 0)
    before = forged_entries()
    # A stranger without the secret (signing with another one) points rank (0, 0) at itself.
    raw.put(key, encode_entry(OTHER, key, route(0, "tcp://6.6.6.6:6666"), 2**62))
    with pytest.raises(ConnectError, match="forged"):
        reader.lookup(0, 0, wait=0.3)
    assert reader.forged >= 1 and forged_entries() > before
    raw.put(key, b"not an entry at all")
    with pytest.raises(ConnectError):
        reader.lookup(0, 0, wait=0.1)
    # The owner's own write replaces it: a forged entry claims no generation the owner respects.
    owner = directory(config)
    owner.register(route(0))
    assert reader.lookup(0, 0, wait=1)["address"] == "tcp://10.0.0.1:5000"
    # Its own bytes put back off its lease (without one, or on one its putter keeps alive) would
    # outlive it: the entry is signed with its lease, and readers ignore it off that lease.
    value, meta = raw.get(key, metadata=True)[0]
    assert int(meta["lease"]) == owner._lease
    detached = reader.detached
    raw.put(key, value)
    with pytest.raises(ConnectError, match="off their lease"):
        reader.lookup(0, 0, wait=0.1)
    raw.put(key, value, lease=raw.lease(ttl=60))
    with pytest.raises(ConnectError, match="off their lease"):
        reader.lookup(0, 0, wait=0.1)
    assert reader.detached >= detached + 2
    owner.unregister()


def test_a_thousand_routes_registered_and_expired_leave_the_client_flat(config: EtcdConfig) -> None:
    from etcd3gw.client import Etcd3Client

    host, port = config.endpoints[0]
    raw = Etcd3Client(host=host, port=port)
    tracemalloc.start()
    sizes = []
    try:
        for _ in range(3):
            owner = directory(config, ttl=2)
            owner.keep_registered(route(0, tp_size=1000), interval=0.5)  # keeps the one lease alive
            for tp in range(1, 1000):
                owner.register(route(tp, tp_size=1000))
            assert len(raw.get_prefix(f"{config.prefix}/")) == 1000
            owner.close()  # stops refreshing: the lease expires and etcd deletes all 1,000
            deadline = time.monotonic() + 10
            while raw.get_prefix(f"{config.prefix}/"):
                assert time.monotonic() < deadline, "routes outlived their lease"
                time.sleep(0.1)
            del owner
            sizes.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    print(f"traced memory after each round of 1,000 routes: {[s // 1024 for s in sizes]} KiB")
    assert sizes[2] - sizes[0] < 256 * 1024, sizes


def test_doctor_says_which_backend_and_whether_it_answers(etcd: EtcdServer) -> None:
    from kvtransport.tools.doctor import discovery_report

    line, problem = discovery_report({})
    assert "built-in bootstrap registry" in line and problem == ""
    line, problem = discovery_report({"KVTRANSPORT_DISCOVERY": f"etcd://{etcd.url}/kvt"})
    assert "reachable" in line and "etcd 3." in line and problem == ""
    etcd.stop()
    line, problem = discovery_report({"KVTRANSPORT_DISCOVERY": f"etcd://{etcd.url}/kvt"})
    assert "unreachable" in line and "no etcd endpoint" in problem
    _, problem = discovery_report({"KVTRANSPORT_DISCOVERY": "zookeeper://x"})
    assert "KVTRANSPORT_DISCOVERY" in problem
    # A remote etcd without a secret: every serving process would refuse it, so doctor says so.
    _, problem = discovery_report({"KVTRANSPORT_DISCOVERY": "etcd://192.0.2.2:2379/kvt"})
    assert "without a deployment secret" in problem


def test_an_old_start_cannot_overwrite_a_newer_one_between_its_read_and_its_write(config: EtcdConfig) -> None:
    """Found by review: the generation check and the put were two requests. The put is now a
    transaction on the revision read, so the old start's write fails once the new one wrote."""
    from etcd3gw.client import Etcd3Client

    old = directory(config, generation=1000)
    old.register(route(0, "tcp://10.0.0.1:1111"))
    key = old.key(0, 0)
    _, revision = old._read(key)  # the old start reads ...
    new = directory(config, generation=2000)
    new.register(route(0, "tcp://10.0.0.2:2222"))  # ... a new start writes ...
    client = Etcd3Client(host=config.endpoints[0][0], port=config.endpoints[0][1])
    value = encode_entry(SECRET, key, route(0, "tcp://10.0.0.1:1111"), 1000)
    assert old._put_if(client, key=key, value=value, revision=revision) is False  # ... the old write fails
    assert directory(config).lookup(0, 0, wait=1)["address"] == "tcp://10.0.0.2:2222"
    new.unregister()
    old.close()


def test_a_restart_on_a_clock_behind_the_old_start_still_takes_the_key(config: EtcdConfig) -> None:
    old = directory(config, ttl=2, generation=5000)
    old.keep_registered(route(0, "tcp://10.0.0.1:1111"), interval=0.2)
    new = directory(config, ttl=2, generation=10)  # its clock is behind the old start's
    new.register(route(0, "tcp://10.0.0.2:2222"))
    assert new.generation == 5001
    found = directory(config).lookup(0, 0, wait=1)
    assert found["address"] == "tcp://10.0.0.2:2222" and found["generation"] == 5001
    deadline = time.monotonic() + 5
    while not old.superseded:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    old.close()
    new.unregister()


def test_a_dead_etcd_does_not_hold_unregister_or_close_past_their_timeouts() -> None:
    import socket

    # A listener that accepts and never answers: every request waits for its timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        cfg = EtcdConfig((("127.0.0.1", silent.getsockname()[1]),), f"/kvt-{secrets.token_hex(4)}")
        d = directory(cfg, ttl=3)
        t0 = time.monotonic()
        assert d.keep_registered(route(0), first_wait=0.5) is False  # goes on in the background
        assert time.monotonic() - t0 < 3.5
        t0 = time.monotonic()
        d.unregister(timeout=0.5)
        assert time.monotonic() - t0 < 3.0, "unregister waited past its timeout"


# -- a cluster with a member that misbehaves (issue 45, 3) ------------------------------------


def _watch_entry(etcd: EtcdServer, key: str, lease: Callable[[], int | None], seconds: float) -> list[str]:
    """Read ``key`` through the healthy member every 20 ms for ``seconds``: each time it was
    missing or off its owner's lease."""
    from etcd3gw.client import Etcd3Client

    raw = Etcd3Client(host="127.0.0.1", port=etcd.client_port, timeout=2, api_path="/v3/")
    problems = []
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds:
        found = raw.get(key, metadata=True)
        if not found:
            problems.append(f"missing at {elapsed:.2f} s")
        elif int(found[0][1].get("lease", 0)) != lease():
            problems.append(f"off its lease at {elapsed:.2f} s")
        time.sleep(0.02)
    return problems


def test_a_member_that_hangs_never_costs_a_live_rank_its_entry(
    etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case: the first member of the list, the one the rank talks to, starts to
    accept and never answer; at the shortest TTL the configuration accepts, each refresh moves on
    to the second member in time, remembers the first as unhealthy, and the entry never lapses.
    A process that never talked to the cluster looks the rank up through the same list within
    its wait."""
    member = Member(etcd.client_port)
    try:
        cfg = EtcdConfig((member.endpoint, ("127.0.0.1", etcd.client_port)), f"/kvt-{secrets.token_hex(4)}")
        owner = directory(cfg, ttl=MIN_TTL)
        assert owner.keep_registered(route(0), first_wait=2)
        member.mode = "hung"
        problems = _watch_entry(etcd, owner.key(0, 0), lambda: owner._lease, 1.5 * MIN_TTL)
        assert not problems, problems
        assert owner.registered.is_set() and store_for(cfg).order()[0] == 1  # the healthy member first now
        monkeypatch.setattr(etcd_module, "_stores", {})  # a new process: nothing known of the member
        t0 = time.monotonic()
        assert directory(cfg).lookup(0, 0, wait=1.0)["endpoint"] == "prefill-0-0"
        print(f"a first lookup past the hung member took {time.monotonic() - t0:.2f} s (wait 1 s)")
        owner.unregister()
    finally:
        member.close()


def test_each_try_gets_half_of_what_is_left_and_a_failed_endpoint_waits_its_turn() -> None:
    """The store's rules, with a request that fails on the endpoints a test names (no server):
    each try gets half of what is left of the call while another endpoint remains (so a second
    one always gets as long as the first took), at most the request timeout; an endpoint that
    failed is tried after the others until its back-off ends, and answers first once it answered."""
    cfg = EtcdConfig((("127.0.0.1", 1), ("127.0.0.1", 2), ("127.0.0.1", 3)), f"/kvt-{secrets.token_hex(4)}")
    store = EtcdStore(cfg)
    bad: set[int] = set()
    tried: list[tuple[int, float]] = []

    def request(client: Any) -> int:
        tried.append((client.port, client.timeout))
        if client.port in bad:
            raise OSError("down")
        return int(client.port)

    bad = {1}
    assert store.run("get", request, deadline=time.monotonic() + 1.0) == 2
    (first, t1), (second, t2) = tried
    assert (first, second) == (1, 2) and 0.45 < t1 <= 0.5 and 0.45 < t2 <= 0.5  # two left, then two left
    assert store.order() == [1, 2, 0] and store.unhealthy() == ["127.0.0.1:1"]
    assert store.order(now=time.monotonic() + 1.5) == [1, 2, 0]  # its back-off over: tried in its turn
    tried.clear()
    bad = {2}  # the one that answered fails: the third is tried before the first, set aside
    assert store.run("get", request, deadline=time.monotonic() + 8.0) == 3
    assert [port for port, _ in tried] == [2, 3] and tried[0][1] == store.timeout  # capped at the timeout
    assert store.order() == [2, 0, 1]  # 3 answered last; 1 and 2 aside, the earlier first
    assert store.order(now=time.monotonic() + 1.5) == [2, 0, 1]
    tried.clear()
    bad = {2, 3}
    assert store.run("get", request) == 1  # the set-aside one is still tried, last of all
    assert [port for port, _ in tried] == [3, 1]
    assert store.order()[0] == 0 and "127.0.0.1:1" not in store.unhealthy()
    bad = {1, 2, 3}
    with pytest.raises(DiscoveryUnreachable, match=r"127\.0\.0\.1:1: OSError: down"):
        store.run("get", request)


@pytest.mark.parametrize("mode", ["hung", "slow", "black-holed"])
def test_a_bad_first_member_from_the_start_never_costs_a_rank_its_entry(
    etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Every way a member fails to answer: one that hangs, one that answers a byte at a time
    (every read of the client gets a byte in time: only a bound on the whole request ends it),
    one that drops every SYN. The rank registers past it, stays registered for three TTLs at the
    shortest TTL, and a new process's lookup gets past it within its wait."""
    member = Member(etcd.client_port, mode)
    try:
        cfg = EtcdConfig((member.endpoint, ("127.0.0.1", etcd.client_port)), f"/kvt-{secrets.token_hex(4)}")
        owner = directory(cfg, ttl=MIN_TTL)
        assert owner.keep_registered(route(0), first_wait=2)
        problems = _watch_entry(etcd, owner.key(0, 0), lambda: owner._lease, 3 * MIN_TTL)
        assert not problems, problems
        monkeypatch.setattr(etcd_module, "_stores", {})
        assert directory(cfg).lookup(0, 0, wait=1.0)["endpoint"] == "prefill-0-0"
        assert directory(cfg).reachable() == ""
        owner.unregister()
    finally:
        member.close()


def test_a_refresh_that_fails_is_tried_again_before_the_lease_ends(etcd: EtcdServer) -> None:
    """With one member, and it hangs for half a second at a time (a garbage-collection pause, a
    slow disk): the refresh that hangs fails at its deadline and the next try comes within a
    quarter of what is left of the lease, not after a back-off longer than the lease."""
    member = Member(etcd.client_port)
    try:
        cfg = EtcdConfig((member.endpoint,), f"/kvt-{secrets.token_hex(4)}")
        owner = directory(cfg, ttl=MIN_TTL)
        assert owner.keep_registered(route(0), first_wait=2)

        def pauses() -> None:
            for gap in (0.6, 0.9, 1.2, 1.5):  # each pause at another point of the refresh cycle
                time.sleep(gap)
                member.mode = "hung"
                time.sleep(0.5)
                member.mode = "ok"

        pausing = threading.Thread(target=pauses, daemon=True)
        pausing.start()
        problems = _watch_entry(etcd, owner.key(0, 0), lambda: owner._lease, 8.0)
        pausing.join()
        assert not problems, problems
        owner.unregister()
    finally:
        member.close()


# -- a dead rank's route: how long it stays, and what a connect to it says (issue 45, 5) ------


def test_a_rank_killed_during_an_etcd_outage_is_gone_a_ttl_after_etcd_returns(
    etcd: EtcdServer, config: EtcdConfig
) -> None:
    """etcd renews every lease when a leader takes over, and a restarted etcd elects one: a rank
    that died while etcd was down keeps its route until about TTL (plus the election timeout)
    after etcd returned, however long ago its last refresh was (docs/discovery.md)."""
    from etcd3gw.client import Etcd3Client

    owner = directory(config, ttl=MIN_TTL)
    owner.keep_registered(route(0))
    key = owner.key(0, 0)
    etcd.stop()  # with its data
    owner.close()  # the rank dies while etcd is down: nothing refreshes its lease any more
    time.sleep(MIN_TTL + 0.5)  # longer than its lease: it would have expired, had etcd been up
    etcd.start()
    returned = time.monotonic()
    raw = Etcd3Client(host="127.0.0.1", port=etcd.client_port, timeout=2, api_path="/v3/")
    assert raw.get(key), "the route was gone as etcd returned"
    while raw.get(key):
        assert time.monotonic() - returned < MIN_TTL + 5.0, "the route outlived the bound after etcd returned"
        time.sleep(0.05)
    print(f"a rank killed during an etcd outage: route gone {time.monotonic() - returned:.2f} s after etcd returned")


def test_a_connect_to_a_route_whose_rank_is_gone_says_so_at_once() -> None:
    """A dead rank's route outlives it (above). A connect to it fails at once when nothing
    listens there any more (not after the 10 s connect timeout), and any connect failure names
    the rank, the address, how old the lookup was, and that the route may be stale."""
    import socket

    from kvtransport.integrations.discovery.dial import StaleRoute, dial
    from kvtransport.runtime.endpoint import Endpoint
    from kvtransport.testing.fake import FakeDriver
    from kvtransport.tools.kv_pool import KVPool

    pools = [KVPool(8, 1, 512, 1) for _ in range(2)]
    prefill = Endpoint(pools[0].regions, pools[0].layout, drivers={"fake": FakeDriver}, name="prefill-0-0")
    decode = Endpoint(pools[1].regions, pools[1].layout, drivers={"fake": FakeDriver}, name="decode")
    try:
        live = {**route(0, prefill.address), "endpoint": prefill.name, "generation": 7}
        rank = f"prefill rank dp=0 tp=0 of instance {INSTANCE}"
        conn = dial(decode, live, rank=rank, timeout=5, looked_up=time.monotonic())
        assert conn.peer_endpoint == "prefill-0-0"
        conn.close("done")
        prefill.close()  # the rank is gone; its route is not (yet)
        t0 = time.monotonic()
        with pytest.raises(StaleRoute) as failed:
            dial(decode, live, rank=rank, timeout=10, looked_up=time.monotonic() - 4)
        print(f"a connect to a gone rank's route failed after {time.monotonic() - t0:.3f} s: {failed.value}")
        text = str(failed.value)
        for part in (rank, prefill.address, "generation 7", "looked up 4.0 s ago", "refused", "may be stale"):
            assert part in text, (part, text)
        # Something listens there, and never answers (another process took the port, or the
        # rank hangs): the connect's own timeout, said the same way.
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(4)
            hung = {**live, "address": f"tcp://127.0.0.1:{silent.getsockname()[1]}"}
            with pytest.raises(StaleRoute, match=r"no handshake answer .*may be stale"):
                dial(decode, hung, rank=rank, timeout=0.5)
    finally:
        prefill.close()
        decode.close()
        for pool in pools:
            pool.close()
