"""One prefill rank feeding a wider decode TP (``fanin.FanOut``), in one process on the fake
driver: each chunk reaches every decode rank with that rank's heads, and a failure of one part
fails the whole request on every rank. And the SGLang adapter's tags for such rooms: each
prefill endpoint hears exactly one announcer per tag."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from kvtransport.runtime.endpoint import Connection, Endpoint, State, Timeouts
from kvtransport.runtime.fanin import FanOut
from kvtransport.runtime.layer_groups import LayerwisePolicy
from kvtransport.spi.errors import TransferAborted
from kvtransport.spi.tp_map import sources, targets
from kvtransport.testing.fake import FakeDriver
from kvtransport.tools.kv_pool import PAGE_TOKENS, KVPool

FAKE = {"fake": FakeDriver}
FAST = Timeouts(connect=5, bootstrap=5, waiting=5, transfer=5, heartbeat_interval=0.1, heartbeat_timeout=1.0)
HEADS, HEAD_BYTES, PAGES = 4, 32, 32


def _pool(tp: int, rank: int) -> KVPool:
    return KVPool(PAGES, 4, PAGE_TOKENS * (HEADS // tp) * HEAD_BYTES, 0, tp=(HEADS, tp, rank))


@contextlib.contextmanager
def one_to_two() -> Iterator[tuple[list[KVPool], list[Connection], list[Connection]]]:
    """Prefill TP 1 (4 heads) and decode TP 2 (2 heads each): pools, prefill's connection to
    each decode rank, each decode rank's connection to prefill."""
    pools = [_pool(1, 0), _pool(2, 0), _pool(2, 1)]
    pools[0].fill_heads()
    endpoints: list[Endpoint] = []
    try:
        for i, pool in enumerate(pools):
            endpoints.append(Endpoint(pool.regions, pool.layout, drivers=FAKE, name=f"ep{i}", timeouts=FAST))
        recv = [endpoints[d].connect(endpoints[0].address) for d in (1, 2)]
        send = [endpoints[0].accept(5) for _ in (1, 2)]
        send.sort(key=lambda c: c.peer_layout.tp_rank if c.peer_layout else -1)
        yield pools, send, recv
    finally:
        for ep in endpoints:
            ep.close()
        for pool in pools:
            pool.close()


def _announced(fan: FanOut) -> None:
    deadline = time.monotonic() + 5
    while fan.state is State.BOOTSTRAPPING:
        assert time.monotonic() < deadline, "the announcements never arrived"
        time.sleep(0.01)


def test_each_chunk_reaches_every_decode_rank_with_its_heads() -> None:
    with one_to_two() as (pools, send, recv):
        dst = [[3, 9, 4], [20, 1, 7]]
        parts = [recv[d].expect(f"r@{d}", dst[d]) for d in (0, 1)]
        fan = FanOut("r", [send[d].sender(f"r@{d}") for d in (0, 1)])
        _announced(fan)
        assert fan.state is State.WAITING_FOR_INPUT
        fan.send([5, 6], last=False)
        fan.send([11], last=True)
        for part in parts:
            assert part.wait(5) is State.SUCCESS
        assert fan.wait(5) is State.SUCCESS
        for d in (0, 1):
            assert pools[1 + d].check_heads([5, 6, 11], dst[d]) == ""
        # Each decode rank holds half the heads: the fan-out moved each page's bytes once.
        assert fan.bytes == 3 * 4 * PAGE_TOKENS * HEADS * HEAD_BYTES


def test_a_layer_wise_send_reaches_every_decode_rank_with_its_heads() -> None:
    """``FanOut.send_layerwise``: each mark reaches the stream to every decode rank; each rank
    gets its heads of every layer, in groups."""
    with one_to_two() as (pools, send, recv):
        dst = [[3, 9, 4], [20, 1, 7]]
        parts = [recv[d].expect(f"lw@{d}", dst[d]) for d in (0, 1)]
        fan = FanOut("lw", [send[d].sender(f"lw@{d}") for d in (0, 1)])
        _announced(fan)
        streams = fan.send_layerwise([5, 6, 11], policy=LayerwisePolicy(min_tokens=0, adaptive=False))
        assert streams.num_layers == 2
        streams.layer_ready(1)
        streams.layer_ready(0)
        for part in parts:
            assert part.wait(5) is State.SUCCESS
        assert fan.wait(5) is State.SUCCESS and streams.complete
        assert [[g.layers for g in s.groups] for s in streams.streams] == [[(1,), (0,)]] * 2
        for d in (0, 1):
            assert pools[1 + d].check_heads([5, 6, 11], dst[d]) == ""
        # A failed part: the next mark still reaches the other stream, then raises.
        parts2 = [recv[d].expect(f"lw2@{d}", dst[d]) for d in (0, 1)]
        fan2 = FanOut("lw2", [send[d].sender(f"lw2@{d}") for d in (0, 1)])
        _announced(fan2)
        streams2 = fan2.send_layerwise([5, 6, 11], policy=LayerwisePolicy(min_tokens=0, adaptive=False))
        fan2.parts[0].abort("one decode rank went away")
        with pytest.raises(TransferAborted):
            streams2.layer_ready(0)
        assert len(streams2.streams[1].groups) == 1
        with pytest.raises(TransferAborted):
            parts2[0].wait(5)


def test_an_abort_of_one_decode_rank_fails_the_fan_out_and_its_other_part() -> None:
    with one_to_two() as (pools, send, recv):
        parts = [recv[d].expect(f"q@{d}", [1, 2]) for d in (0, 1)]
        fan = FanOut("q", [send[d].sender(f"q@{d}") for d in (0, 1)])
        _announced(fan)
        parts[1].abort("decode rank 1 gave up")
        with pytest.raises(TransferAborted):
            fan.wait(5)
        assert fan.state is State.FAILED
        # The other decode rank hears of it too (its sender was aborted), and nothing was sent.
        with pytest.raises(TransferAborted):
            parts[0].wait(5)
        assert all(p.drained.wait(5) for p in parts)
        assert pools[1].check_heads([5, 6], [1, 2]) != ""


@pytest.mark.parametrize("prefill_tp", [1, 2, 4, 8])
@pytest.mark.parametrize("decode_tp", [1, 2, 4, 8])
def test_a_rooms_tags_name_one_announcer_per_prefill_endpoint(prefill_tp: int, decode_tp: int) -> None:
    """The tags the SGLang adapter's decode ranks announce under (``room_tag``): at every
    prefill rank, the decode ranks it feeds use distinct tags, one of them the bare room
    number (the one whose layout tells prefill decode's TP size); a decode rank uses one tag
    at all its sources."""
    adapter = pytest.importorskip("kvtransport.integrations.sglang", reason="needs sglang==0.5.23")
    room = 4242
    for p in range(prefill_tp):
        tags = [adapter.room_tag(room, prefill_tp, decode_tp, d) for d in targets(prefill_tp, p, decode_tp)]
        assert len(set(tags)) == len(tags) and tags.count(str(room)) == 1, tags
    for d in range(decode_tp):
        tag = adapter.room_tag(room, prefill_tp, decode_tp, d)
        assert tag == str(room) or (decode_tp > prefill_tp and tag == f"{room}@{d}")
        assert sources(prefill_tp, decode_tp, d)  # every decode rank has a source to announce to
