"""The driver conformance suite: import it into a test module of your driver package and
supply a ``conformance_driver`` fixture.

.. code-block:: python

    # tests/test_conformance.py of a driver package
    import pytest
    from kvtransport.testing.conformance import *  # noqa: F403
    from kvtransport.testing.conformance import DriverUnderTest

    @pytest.fixture(scope="module")
    def conformance_driver() -> DriverUnderTest:
        return DriverUnderTest("my-driver")

Each test runs a real endpoint in this process (the prefill side, sending) and another in a
child process (:mod:`kvtransport.tools.peer`, the decode side, receiving), over the real
control channel on loopback, with the driver forced on both, and verifies every byte by
per-page digests. Tests are gated by the capabilities the driver declares (host memory, or
device memory with ``DriverUnderTest(name, device=0)`` on a CUDA host), not by its name.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvtransport.negotiation.registry import load_driver
from kvtransport.runtime.endpoint import Connection, Endpoint, State, Timeouts
from kvtransport.runtime.layer_groups import LayerwisePolicy
from kvtransport.spi.driver import KVTransport
from kvtransport.spi.errors import InvalidPages, PeerLost, TransferAborted, TransferTimeout
from kvtransport.testing.fake import FakeDriver
from kvtransport.tools.kv_pool import KVPool
from kvtransport.tools.peer_process import PeerProcess

__all__ = [
    "DriverUnderTest",
    "test_write_and_verify_bytes",
    "test_a_one_batch_transfer_says_done_on_the_express_stream",
    "test_many_pages_coalesced_and_scattered",
    "test_chunked_send_with_aux",
    "test_state_items_go_with_the_last_chunk",
    "test_concurrent_transfers",
    "test_bad_pages_submit_nothing",
    "test_abort_from_receiver_reaches_sender",
    "test_abort_from_sender_reaches_receiver",
    "test_an_abort_with_writes_in_flight_is_confirmed_drained",
    "test_peer_loss_fails_transfers",
    "test_close_while_in_flight",
    "test_no_handle_left_after_finish_or_abort",
    "test_writes_touch_only_the_announced_pages",
    "test_close_is_idempotent_and_never_raises",
    "test_layerwise_groups_out_of_order_and_in_flight",
    "test_layerwise_abort_between_groups",
    "test_layerwise_sender_that_never_marks_its_last_layer_times_out",
    "pair",
]

PAGES, LAYERS, ITEM, AUX = 512, 4, 4096, 8
#: State groups of both sides: a window pool (64 pages of 2 KiB in 2 buffers, like SGLang's SWA
#: sub-pool) and a slot pool (16 slots of 1.5 KiB in 3 buffers, like its Mamba state tensors).
STATE = ((64, 2048, 2), (16, 1536, 3))


@dataclass
class DriverUnderTest:
    """The driver a package tests: its registered name (``fake`` for the built-in fake)."""

    name: str
    options: dict[str, str] = field(default_factory=dict)
    #: CUDA device for both sides' KV (``None``: host memory, the CPU suite).
    device: int | None = None

    def classes(self) -> dict[str, type[KVTransport]]:
        cls: type[KVTransport] = FakeDriver if self.name == "fake" else load_driver(self.name)
        return {self.name: cls}

    def serves_memory(self) -> bool:
        family = "host" if self.device is None else "cuda"
        caps = self.classes()[self.name].capabilities
        return family in caps.reads and family in caps.writes


@dataclass
class Pair:
    local: Endpoint
    pool: KVPool
    conn: Connection
    peer: PeerProcess
    driver: DriverUnderTest | None = None


@pytest.fixture
def pair(conformance_driver: DriverUnderTest) -> Iterator[Pair]:
    device = conformance_driver.device
    if not conformance_driver.serves_memory():
        where = "host memory" if device is None else "device memory"
        pytest.skip(f"{conformance_driver.name} does not declare {where}")
    # The fake driver maps the peer's buffers, so host KV lives in /dev/shm.
    pool = KVPool(PAGES, LAYERS, ITEM, AUX, device=device, state=STATE)
    pool.fill(seed=1234)
    local = Endpoint(
        pool.regions,
        pool.layout,
        drivers=conformance_driver.classes(),
        name="prefill",
        driver_options=conformance_driver.options,
        timeouts=Timeouts(heartbeat_interval=0.2, heartbeat_timeout=2.0),
    )
    peer = PeerProcess(
        "--driver",
        conformance_driver.name,
        "--pages",
        str(PAGES),
        "--layers",
        str(LAYERS),
        "--item",
        str(ITEM),
        "--aux-slots",
        str(AUX),
        "--state",
        json.dumps(STATE),
        "--name",
        "decode",
        "--options",
        json.dumps(conformance_driver.options),
        "--timeouts",
        json.dumps({"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0}),
        *(("--device", str(device)) if device is not None else ()),
    )
    try:
        decision = peer.call("connect", address=local.address)["decision"]
        assert decision["driver"] == conformance_driver.name
        conn = local.accept(10)
        yield Pair(local, pool, conn, peer, conformance_driver)
    finally:
        peer.close()
        local.close()
        pool.close()


def _send_and_verify(p: Pair, transfers: dict[str, tuple[list[int], list[int]]], chunks: int = 1) -> None:
    p.peer.call("expect", transfers={tag: dst for tag, (_, dst) in transfers.items()})
    senders = {tag: p.conn.sender(tag) for tag in transfers}
    deadline = time.monotonic() + 10
    for tag, (src, _) in transfers.items():
        t = senders[tag]
        while t.state is State.BOOTSTRAPPING and time.monotonic() < deadline:
            time.sleep(0.001)
        for i, part in enumerate(np.array_split(np.array(src), chunks)):
            t.send(part, last=i == chunks - 1)
    for t in senders.values():
        assert t.wait(30) is State.SUCCESS
    states = p.peer.call("wait", tags=list(transfers), timeout=30)["states"]
    assert all(s[0] == "SUCCESS" for s in states.values()), states
    for _tag, (src, dst) in transfers.items():
        assert p.peer.call("digests", pages=dst)["digests"] == p.pool.page_digests(src)


def test_write_and_verify_bytes(pair: Pair) -> None:
    _send_and_verify(pair, {"one": ([3, 4, 5], [10, 11, 12])})


def test_a_one_batch_transfer_says_done_on_the_express_stream(pair: Pair) -> None:
    """A transfer of one batch: "done" leaves on the session's express stream from the thread
    that saw the batch finish; a chunked transfer's "done" takes the control channel. A
    two-sided driver's session in ordered mode sends every notice and "done" on the stream;
    one not in ordered mode sends none of them there. Bytes verified."""
    deadline = time.monotonic() + 10
    session = pair.local.sessions[pair.conn.id]
    # The peer (the initiator) binds the stream after its handshake: wait for it here.
    while session.express is None and time.monotonic() < deadline:
        time.sleep(0.01)
    link = session.express
    assert link is not None, "the session should have bound an express stream"
    decision = pair.conn.decision
    assert decision is not None
    two_sided = type(pair.local.drivers[decision.driver]).capabilities.two_sided
    ordered = session.ordered is link
    before = link.sent
    _send_and_verify(pair, {"express-one": ([7, 8, 9], [20, 21, 22])})
    if not two_sided:
        assert link.sent == before + 1
        _send_and_verify(pair, {"express-chunked": ([30, 31, 32, 33], [40, 41, 42, 43])}, chunks=2)
        assert link.sent == before + 1, "a chunked transfer's done must not go express"
    elif ordered:
        # Ordered mode: the chunk's notice, then "done", both on the stream (the notice inside
        # the "done" when the batch finished on the thread that submitted it: one frame).
        assert link.sent >= before + 1, "in ordered mode a transfer's notices and done go on the stream"
        after_one = link.sent
        _send_and_verify(pair, {"express-chunked": ([30, 31, 32, 33], [40, 41, 42, 43])}, chunks=2)
        assert link.sent >= after_one + 3, "in ordered mode every notice and done go on the stream"
    else:
        # The session sent ordered messages on the control channel before the stream bound:
        # they stay there, or a later one could overtake them.
        assert link.sent == before


def test_many_pages_coalesced_and_scattered(pair: Pair) -> None:
    rng = np.random.default_rng(7)
    contiguous = list(range(100, 356))
    scattered_src = rng.choice(PAGES, 200, replace=False).tolist()
    # Destinations of concurrent transfers must not overlap, or one would overwrite the other.
    free = np.setdiff1d(np.arange(PAGES), contiguous)
    scattered_dst = rng.choice(free, 200, replace=False).tolist()
    _send_and_verify(pair, {"contiguous": (contiguous, contiguous), "scattered": (scattered_src, scattered_dst)})


def test_chunked_send_with_aux(pair: Pair) -> None:
    pair.peer.call("expect", transfers={"aux": list(range(20, 60))}, aux={"aux": 5})
    t = pair.conn.sender("aux")
    while t.state is State.BOOTSTRAPPING:
        time.sleep(0.001)
    t.send(list(range(0, 15)), last=False)
    t.send(list(range(15, 30)), last=False)
    with pytest.raises(InvalidPages, match="must carry one"):
        t.send(list(range(30, 40)), last=True)  # the receiver announced an aux slot
    t.send(list(range(30, 40)), last=True, aux=2)
    assert t.wait(30) is State.SUCCESS
    assert pair.peer.call("wait", tags=["aux"])["states"]["aux"][0] == "SUCCESS"
    assert pair.peer.call("digests", pages=list(range(20, 60)))["digests"] == pair.pool.page_digests(list(range(40)))
    assert pair.peer.call("aux_digest", slot=5)["digest"] == pair.pool.aux_digest(2)


def test_state_items_go_with_the_last_chunk(pair: Pair) -> None:
    """The last chunk carries each state group's items to the items the receiver announced,
    in every buffer of the group; nothing else of the state pools changes, and a count that
    does not match the announcement is refused before anything is submitted."""
    windows, slots = list(range(STATE[0][0])), list(range(STATE[1][0]))
    pools = (windows, slots)
    before = [pair.peer.call("state_digests", group=g, items=items)["digests"] for g, items in enumerate(pools)]
    dst_state = [[5, 9, 10, 11], [7]]
    pair.peer.call("expect", transfers={"st": list(range(30, 40))}, aux={"st": 1}, state={"st": dst_state})
    t = pair.conn.sender("st")
    while t.state is State.BOOTSTRAPPING:
        time.sleep(0.001)
    t.send(list(range(0, 6)), last=False)
    for wrong in ([[1, 2, 3], [12]], [[1, 2, 3, 4]], [[1, 2, 3, 4], [12], [0]], [[1, 2, 3, STATE[0][0]], [12]]):
        with pytest.raises(InvalidPages):
            t.send(list(range(6, 10)), last=True, aux=3, state=wrong)
    with pytest.raises(InvalidPages, match="last chunk"):
        t.send([6], last=False, state=[[1], [2]])
    t.send(list(range(6, 10)), last=True, aux=3, state=[[1, 2, 3, 4], [12]])
    assert t.wait(30) is State.SUCCESS
    assert pair.peer.call("wait", tags=["st"])["states"]["st"][0] == "SUCCESS"
    assert pair.peer.call("digests", pages=list(range(30, 40)))["digests"] == pair.pool.page_digests(list(range(10)))
    assert pair.peer.call("aux_digest", slot=1)["digest"] == pair.pool.aux_digest(3)
    src_state = [[1, 2, 3, 4], [12]]
    for g, items in enumerate(pools):
        after = pair.peer.call("state_digests", group=g, items=items)["digests"]
        want = list(before[g])
        for d, digest in zip(dst_state[g], pair.pool.state_digests(g, src_state[g]), strict=True):
            want[d] = digest
        assert after == want, f"state group {g}: items changed that the transfer does not own, or wrong bytes"


def test_concurrent_transfers(pair: Pair) -> None:
    rng = np.random.default_rng(11)
    transfers = {}
    dst_free = rng.permutation(PAGES).tolist()
    for i in range(100):
        n = int(rng.integers(1, 5))
        src = rng.choice(PAGES, n, replace=False).tolist()
        dst, dst_free = dst_free[:n], dst_free[n:]
        transfers[f"req-{i}"] = (src, dst)
    _send_and_verify(pair, transfers)


def test_bad_pages_submit_nothing(pair: Pair) -> None:
    pair.peer.call("expect", transfers={"bad": [1, 2]})
    t = pair.conn.sender("bad")
    while t.state is State.BOOTSTRAPPING:
        time.sleep(0.001)
    for bad in ([1, PAGES], [-1, 0], [0, 1, 2]):
        with pytest.raises(InvalidPages):
            t.send(bad, last=True)
    before = pair.peer.call("digests", pages=[1, 2])["digests"]
    assert t.state is State.WAITING_FOR_INPUT
    t.send([7, 8], last=True)
    assert t.wait(30) is State.SUCCESS
    # The receiver's Success is what says the bytes are in its pool (for a two-sided driver
    # the sender finishes once its chunks are handed over).
    assert pair.peer.call("wait", tags=["bad"])["states"]["bad"][0] == "SUCCESS"
    after = pair.peer.call("digests", pages=[1, 2])["digests"]
    assert after == pair.pool.page_digests([7, 8]) and after != before


def test_abort_from_receiver_reaches_sender(pair: Pair) -> None:
    pair.peer.call("expect", transfers={"ab": [1]})
    t = pair.conn.sender("ab")
    while t.state is State.BOOTSTRAPPING:
        time.sleep(0.001)
    start = time.monotonic()
    pair.peer.call("abort", tag="ab", reason="client went away")
    with pytest.raises(TransferAborted, match="client went away"):
        t.wait(5)
    assert time.monotonic() - start < 1.0
    assert pair.peer.call("state", tags=["ab"])["states"]["ab"][0] == "FAILED"


def test_abort_from_sender_reaches_receiver(pair: Pair) -> None:
    pair.peer.call("expect", transfers={"ab2": [1]})
    t = pair.conn.sender("ab2")
    while t.state is State.BOOTSTRAPPING:
        time.sleep(0.001)
    t.abort("prefill preempted")
    state = pair.peer.call("wait", tags=["ab2"], timeout=10)["states"]["ab2"]
    assert state[0] == "FAILED" and state[1] == "TransferAborted" and "prefill preempted" in state[2]
    with pytest.raises(TransferAborted):
        t.send([1], last=True)


def test_an_abort_with_writes_in_flight_is_confirmed_drained(pair: Pair) -> None:
    """SPI: after ``abort``, ``settled`` tells when no write of the batch can land any more;
    the receiver learns it (``Transfer.drained``) and only then may reuse its pages."""
    pages = list(range(PAGES // 2))
    pair.peer.call("expect", transfers={"drain": pages})
    t = pair.conn.sender("drain")
    while t.state is State.BOOTSTRAPPING:
        time.sleep(0.001)
    t.send(pages[: len(pages) // 2], last=False)  # a large batch, likely still in flight
    t.abort("conformance: aborted with writes in flight")
    state = pair.peer.call("wait", tags=["drain"], timeout=5)["states"]["drain"]
    assert state[0] == "FAILED", state
    deadline = time.monotonic() + 30
    while not (state := pair.peer.call("state", tags=["drain"])["states"]["drain"])[3]:
        assert time.monotonic() < deadline, f"the receiver was never told the writes stopped: {state}"
        time.sleep(0.01)
    mine, _ = _settled(pair)
    assert mine["handles"] == 0, mine


def test_peer_loss_fails_transfers(pair: Pair) -> None:
    pair.peer.call("expect", transfers={"lost": [1, 2, 3]})
    t = pair.conn.sender("lost")
    while t.state is State.BOOTSTRAPPING:
        time.sleep(0.001)
    pair.peer.kill()
    start = time.monotonic()  # dead by now (kill() waits for it): how long that took is not the driver's
    with pytest.raises(PeerLost, match="decode"):
        t.wait(10)
    # The heartbeat timeout and two beats (2.4 s), with 1.5 s for a loaded machine (a late
    # timer, this thread's wake-up): detection at twice the timeout (4 s) still fails it.
    assert time.monotonic() - start < 2.0 + 2 * 0.2 + 1.5


def test_close_while_in_flight(pair: Pair) -> None:
    pair.peer.call("expect", transfers={f"c{i}": [i] for i in range(20)})
    senders = [pair.conn.sender(f"c{i}") for i in range(20)]
    pair.local.close()
    for t in senders:
        assert t.state is State.FAILED
    states = pair.peer.call("wait", tags=[f"c{i}" for i in range(20)], timeout=5)["states"]
    assert all(s[0] == "FAILED" for s in states.values()), states


def _settled(p: Pair, timeout: float = 10.0) -> tuple[dict[str, int], dict[str, int]]:
    """Both sides' resource counters once no batch is left in a driver (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        mine, theirs = p.local.stats(), p.peer.call("stats")["stats"]
        if (mine["handles"] == mine["watches"] == theirs["handles"] == theirs["watches"] == 0) or (
            time.monotonic() > deadline
        ):
            return mine, theirs
        time.sleep(0.02)


def test_no_handle_left_after_finish_or_abort(pair: Pair) -> None:
    """SPI MUST: a finished or aborted batch leaves nothing in the driver (``pending() == 0``)."""
    rng = np.random.default_rng(3)
    tags = [f"h{i}" for i in range(60)]
    dst_free = rng.permutation(PAGES).tolist()
    transfers = {}
    for tag in tags:
        dst, dst_free = dst_free[:4], dst_free[4:]
        transfers[tag] = (rng.choice(PAGES, 4, replace=False).tolist(), dst)
    pair.peer.call("expect", transfers={tag: dst for tag, (_, dst) in transfers.items()})
    senders = {tag: pair.conn.sender(tag) for tag in tags}
    for i, (tag, (src, _)) in enumerate(transfers.items()):
        t = senders[tag]
        while t.state is State.BOOTSTRAPPING:
            time.sleep(0.001)
        t.send(src[:2], last=False)
        if i % 3 == 0:
            t.abort("conformance: abort with a batch in flight")
        else:
            t.send(src[2:], last=True)
    for i, tag in enumerate(tags):
        if i % 3:
            assert senders[tag].wait(30) is State.SUCCESS
    pair.peer.call("wait", tags=tags, timeout=30)
    mine, theirs = _settled(pair)
    assert mine["handles"] == 0 and mine["watches"] == 0, mine
    assert theirs["handles"] == 0 and theirs["watches"] == 0, theirs


def test_writes_touch_only_the_announced_pages(pair: Pair) -> None:
    """SPI MUST: nothing outside the given runs changes at the destination."""
    everything = list(range(PAGES))
    before = pair.peer.call("digests", pages=everything)["digests"]
    dst = [5, 6, 7, 100, 300, 301]
    _send_and_verify(pair, {"only": ([10, 11, 12, 13, 200, 201], dst)})
    after = pair.peer.call("digests", pages=everything)["digests"]
    changed = [i for i in everything if before[i] != after[i]]
    assert set(changed) <= set(dst), f"pages written that nobody announced: {sorted(set(changed) - set(dst))}"


def test_close_is_idempotent_and_never_raises(pair: Pair) -> None:
    """SPI MUST: ``close()`` twice, and with peers connected, raises nothing."""
    drivers = list(pair.local.drivers.values())
    pair.local.close()
    pair.local.close()
    for driver in drivers:
        driver.close()  # a second close of every driver instance
        assert driver.pending() == 0


#: Layer-wise sends in the suite: every layer its own group, whatever the request's length,
#: so that each layer is a batch of its own.
EVERY_LAYER = LayerwisePolicy(min_tokens=0, first_group=1, adaptive=False)


def _layer_regions(p: Pair, layers: list[int]) -> list[int]:
    """The KV regions of ``layers`` in the suite's pools (every layer's K, then every V)."""
    n = p.pool.layout.num_layers
    return [i for i in range(LAYERS) if i % n in layers]


def test_layerwise_groups_out_of_order_and_in_flight(pair: Pair) -> None:
    """A layer-wise send (``Transfer.send_layerwise``): the last layer marked first, the first
    while the last's batch is likely still in flight; each is a batch of its own, the aux
    slot rides with the last group, and every byte of every region lands."""
    src, dst = list(range(0, 256)), list(range(256, 512))
    pair.peer.call("poison", pages=dst)
    pair.peer.call("expect", transfers={"lw": dst}, aux={"lw": 3})
    t = pair.conn.sender("lw")
    while t.state is State.BOOTSTRAPPING:
        time.sleep(0.001)
    stream = t.send_layerwise(src, aux=6, policy=EVERY_LAYER)
    n = stream.num_layers
    assert n == pair.pool.layout.num_layers >= 2
    for layer in reversed(range(n)):
        stream.layer_ready(layer)
    assert [g.layers for g in stream.groups] == [(layer,) for layer in reversed(range(n))]
    assert all(g.batch for g in stream.groups), "each group is a batch of its own"
    assert t.wait(30) is State.SUCCESS
    assert pair.peer.call("wait", tags=["lw"], timeout=30)["states"]["lw"][0] == "SUCCESS"
    assert pair.peer.call("digests", pages=dst)["digests"] == pair.pool.page_digests(src)
    assert pair.peer.call("aux_digest", slot=3)["digest"] == pair.pool.aux_digest(6)


def test_layerwise_abort_between_groups(pair: Pair) -> None:
    """An abort after the first group: the receiver fails and hears "drained"; the next
    layer's mark raises the abort and posts nothing, so the layers not yet sent keep the
    receiver's bytes, then and later."""
    src, dst = list(range(0, 128)), list(range(300, 428))
    pair.peer.call("poison", pages=dst)
    later = _layer_regions(pair, [1])
    untouched = pair.peer.call("digests", pages=dst, regions=later)["digests"]
    pair.peer.call("expect", transfers={"lw-abort": dst})
    t = pair.conn.sender("lw-abort")
    while t.state is State.BOOTSTRAPPING:
        time.sleep(0.001)
    stream = t.send_layerwise(src, policy=EVERY_LAYER)
    stream.layer_ready(0)
    t.abort("conformance: aborted between layer groups")
    with pytest.raises(TransferAborted):
        stream.layer_ready(1)
    assert len(stream.groups) == 1
    deadline = time.monotonic() + 30
    while not (state := pair.peer.call("state", tags=["lw-abort"])["states"]["lw-abort"])[3]:
        assert state[0] in ("FAILED", "WAITING_FOR_INPUT", "TRANSFERRING"), state
        assert time.monotonic() < deadline, f"the receiver was never told the writes stopped: {state}"
        time.sleep(0.01)
    assert state[0] == "FAILED", state
    assert pair.peer.call("digests", pages=dst, regions=later)["digests"] == untouched
    time.sleep(0.2)
    assert pair.peer.call("digests", pages=dst, regions=later)["digests"] == untouched
    mine, _ = _settled(pair)
    assert mine["handles"] == 0, mine


def test_layerwise_sender_that_never_marks_its_last_layer_times_out(pair: Pair) -> None:
    """A layer-wise sender that marks all but its last layer fails with the Transferring
    timeout, and so does its receiver; nothing hangs."""
    assert pair.driver is not None
    pair.local.close()  # one prefill endpoint over this pool at a time (a driver may key peers by it)
    short = Endpoint(
        pair.pool.regions,
        pair.pool.layout,
        drivers=pair.driver.classes(),
        name="prefill-short",
        driver_options=pair.driver.options,
        timeouts=Timeouts(transfer=1.0, heartbeat_interval=0.2, heartbeat_timeout=2.0),
    )
    try:
        pair.peer.call("connect", address=short.address)
        conn = short.accept(10)
        dst = list(range(40, 72))
        pair.peer.call("expect", transfers={"lw-stuck": dst})  # on the newest connection
        t = conn.sender("lw-stuck")
        while t.state is State.BOOTSTRAPPING:
            time.sleep(0.001)
        stream = t.send_layerwise(list(range(32)), policy=EVERY_LAYER)
        for layer in range(stream.num_layers - 1):
            stream.layer_ready(layer)
        start = time.monotonic()
        with pytest.raises(TransferTimeout):
            t.wait(10)
        assert time.monotonic() - start < 5
        state = pair.peer.call("wait", tags=["lw-stuck"], timeout=10)["states"]["lw-stuck"]
        assert state[0] == "FAILED", state
        with pytest.raises(TransferTimeout):
            stream.layer_ready(stream.num_layers - 1)
    finally:
        short.close()
