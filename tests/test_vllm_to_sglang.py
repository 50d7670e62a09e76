"""A vLLM prefill feeding an SGLang decode, part by part and without vLLM: the scheduler side's
hold under the bootstrap room with the first token, the worker side's handoff slots (one a
request, given back, never shared), a room offered twice, the proxy's helpers and the
``sglang_bootstrap`` setting.

The worker side runs on real endpoints over the fake driver: a vLLM-shaped prefill rank (its
blocks as vLLM 0.33 allocates them, the connector's handoff arena beside them) and an SGLang
decode rank stated as SGLang's decode states itself (its pages, its ten aux rows). Both engines'
processes over the real engines are ``test_cross_engine_cluster``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvtransport.integrations.pairing import request_tag
from kvtransport.integrations.vllm.scheduler_side import FirstToken, SchedulerSide
from kvtransport.integrations.vllm.sglang_registry import parse_bootstrap
from kvtransport.integrations.vllm.to_sglang import new_room, params_for_sglang_decode, sglang_decode_fields
from kvtransport.integrations.vllm.worker_side import StepResults, WorkerSide
from kvtransport.runtime.endpoint import Endpoint, Timeouts
from kvtransport.spi.errors import ConfigError, KVTransportError
from kvtransport.spi.memory import HOST, Region, RegionSet
from kvtransport.testing.fake import FakeDriver

from .test_cross_engine import SGLANG_AUX, SglangPool, VllmPool, as_sglang_decode, as_vllm_prefill

BLOCK = 4

# -- the scheduler side ---------------------------------------------------------------------


def _finished(rid: str, params: dict[str, Any] | None, output: list[int]) -> SimpleNamespace:
    """A request as vLLM 0.33's ``Request`` is at ``request_finished`` (no cached count on it)."""
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=list(range(40)),
        kv_transfer_params=params,
        num_computed_tokens=40,
        output_token_ids=output,
    )


def test_a_request_for_an_sglang_decode_is_held_under_its_room_with_the_first_token() -> None:
    side = SchedulerSide("engine-p", BLOCK, 2)
    side.set_addresses({0: "tcp://p:1", 1: "tcp://p:2"})
    room = 2**62 + 9
    request = _finished("r1", params_for_sglang_decode(room), [777, 5])
    # vLLM's scheduler asks for external tokens with the prefix it found cached (block-aligned):
    # that is the cached count SGLang's decode reports. A prefill request loads nothing.
    assert side.matched_tokens(request, 16) == (0, False)
    delay, params = side.finished(request, [4, 5], completed=True)
    assert delay is True and params is not None
    assert params["sglang_room"] == room and params["do_remote_prefill"] is False
    (hold,) = side.take_orders().holds
    assert (hold.request, hold.blocks, hold.name, hold.first_token) == (
        "r1",
        (4, 5),
        str(room),
        FirstToken(777, 16, room),
    )
    assert side.holding == {"r1"} and not side._cached
    # Without a prefix hit (or if vLLM never asked), the count is 0; either way nothing stays.
    side.finished(_finished("r2", params_for_sglang_decode(room + 1), [1]), [6], completed=True)
    assert side.take_orders().holds[0].first_token == FirstToken(1, 0, room + 1) and not side._cached


def test_the_cached_counts_waiting_for_request_finished_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests vLLM scheduled but never finished (it calls request_finished for every request
    it frees) cannot grow the table past its bound; a request for a vLLM decode is not kept."""
    monkeypatch.setattr("kvtransport.integrations.vllm.scheduler_side.MAX_PENDING", 4)
    side = SchedulerSide("engine-p", BLOCK, 1)
    for i in range(10):
        side.matched_tokens(_finished(f"r{i}", params_for_sglang_decode(i + 1), []), 8)
    side.matched_tokens(_finished("v", {"do_remote_decode": True}, []), 8)
    assert list(side._cached) == ["r6", "r7", "r8", "r9"]


@pytest.mark.parametrize(
    ("params", "output", "why"),
    [
        ({"do_remote_decode": True, "sglang_room": 0}, [1], "sglang_room"),
        ({"do_remote_decode": True, "sglang_room": 2**63}, [1], "sglang_room"),
        ({"do_remote_decode": True, "sglang_room": "12"}, [1], "sglang_room"),
        ({"do_remote_decode": True, "sglang_room": True}, [1], "sglang_room"),
        ({"do_remote_decode": True, "sglang_room": 12}, [], "without an output token"),
    ],
)
def test_a_request_an_sglang_decode_could_not_read_is_not_held(
    params: dict[str, Any], output: list[int], why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A room SGLang could not have made, or no first token to hand over: the blocks go back
    to vLLM at once (nothing is offered), with the reason in the log."""
    side = SchedulerSide("engine-p", BLOCK, 1)
    side.set_addresses({0: "tcp://p:1"})
    assert side.finished(_finished("r", params, output), [1, 2], completed=True) == (False, None)
    assert not side.holding and not side.take_orders().holds
    assert why in caplog.text


# -- the proxy's helpers and the setting ----------------------------------------------------


def test_the_proxy_gives_both_engines_the_same_room() -> None:
    room = new_room()
    assert 0 < room < 2**63
    assert params_for_sglang_decode(room) == {"do_remote_decode": True, "sglang_room": room}
    assert sglang_decode_fields("10.0.0.7:8998", room) == {
        "bootstrap_host": "10.0.0.7",
        "bootstrap_port": 8998,
        "bootstrap_room": room,
    }
    assert sglang_decode_fields("[fd00::1]:9000", room)["bootstrap_host"] == "fd00::1"


@pytest.mark.parametrize(
    ("ask", "named"),
    [
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 5}, "top logprobs"),
        ({"token_ids_logprob": [7, 9]}, "token_ids_logprob"),
        ({"return_sampling_mask": True}, "a sampling mask"),
    ],
)
def test_a_request_asking_for_what_vllm_cannot_hand_over_is_refused(ask: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=f"asking for {named} cannot be prefilled by vLLM"):
        params_for_sglang_decode(3, **ask)


@pytest.mark.parametrize("room", [0, -1, 2**63, 1.5, "7", True, None])
def test_a_room_sglang_could_not_make_is_refused(room: Any) -> None:
    with pytest.raises(ConfigError, match=r"bootstrap room must be a whole number"):
        params_for_sglang_decode(room)
    with pytest.raises(ConfigError, match=r"bootstrap room must be a whole number"):
        sglang_decode_fields("h:1", room)


@pytest.mark.parametrize("value", ["", None, "host", "host:", ":80", "h:0", "h:65536", "h:port", "h:-1"])
def test_an_unusable_bootstrap_address_names_the_setting(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"sglang_bootstrap'\] must be host:port"):
        parse_bootstrap(value)


def test_a_bootstrap_address_parses_as_sglang_reads_it() -> None:
    assert parse_bootstrap(" prefill-0:8998 ") == ("prefill-0", 8998)
    assert parse_bootstrap("[::1]:65535") == ("::1", 65535)


# -- the worker side over real endpoints (fake driver) -------------------------------------

FAST = Timeouts(connect=5, bootstrap=5, waiting=5, transfer=5, heartbeat_interval=0.1, heartbeat_timeout=1.0)
AUX_SLOTS = 4


@dataclasses.dataclass
class Pair:
    prefill: WorkerSide
    vllm: VllmPool
    arena: np.ndarray
    decode: Endpoint
    sglang: SglangPool
    aux: list[np.ndarray]
    conn: Any = None


@contextlib.contextmanager
def vllm_prefill_and_sglang_decode(arena_slots: int, delay: float = 0.0) -> Iterator[Pair]:
    """A vLLM prefill rank (blocks filled with random values, a handoff arena of
    ``arena_slots``, each write taking ``delay`` s) and an SGLang decode rank (pages and aux
    rows filled with -1 / 0xAB)."""
    vllm = VllmPool("LBNHC", 2, 6, BLOCK, BLOCK, 2, 8, 1, 0)
    for _, view in vllm.views:
        view.copy_(torch.randn(view.shape, dtype=torch.float16))
    regions, layout, arena = as_vllm_prefill(vllm)
    arena = arena[:arena_slots]
    sglang = SglangPool(2, 6, BLOCK, 2, 8, 1, 0, 2)
    for buf in (*sglang.k, *sglang.v):
        buf.fill_(-1.0)
    aux = [np.full((AUX_SLOTS, n), 0xAB, dtype=np.uint8) for n in SGLANG_AUX]
    decode_regions = RegionSet(
        kv=sglang.regions.kv,
        aux=tuple(Region(int(r.ctypes.data), r.nbytes, HOST, r.shape[1], f"aux{i}") for i, r in enumerate(aux)),
    )
    prefill_ep = Endpoint(
        regions,
        layout,
        drivers={"fake": FakeDriver},
        name="vllm-p",
        timeouts=FAST,
        driver_options={"fake.delay": str(delay)},
    )
    prefill = WorkerSide(prefill_ep, tp_rank=0, tp_size=1, lease_s=60, handoff_arena=arena)
    decode = Endpoint(
        decode_regions, as_sglang_decode(sglang.layout), drivers={"fake": FakeDriver}, name="sglang-d", timeouts=FAST
    )
    try:
        yield Pair(prefill, vllm, arena, decode, sglang, aux)
    finally:
        prefill.close()
        decode.close()


def _announce(pair: Pair, name: str, pages: list[int], slot: int, prefix_tokens: int = 0) -> Any:
    if pair.conn is None:
        pair.conn = pair.decode.connect(pair.prefill.address)
    return pair.conn.expect(request_tag(name, 1, 1, 0), np.asarray(pages), aux=slot, prefix=prefix_tokens)


def _until_final(pair: Pair, transfers: list[Any], timeout: float = 10) -> StepResults:
    sent = StepResults()
    deadline = time.monotonic() + timeout
    while not all(t.state.final for t in transfers):
        assert time.monotonic() < deadline, [t.state for t in transfers]
        sent.finished_sending |= pair.prefill.poll().finished_sending
        time.sleep(0.005)
    for _ in range(20):  # the prefill rank sees its parts end on a later poll
        sent.finished_sending |= pair.prefill.poll().finished_sending
        time.sleep(0.005)
    return sent


def _token_row(pair: Pair, slot: int) -> int:
    return int(pair.aux[0][slot].view("<i4")[0])


def test_the_blocks_after_decodes_prefix_and_the_first_token_reach_sglang() -> None:
    """Decode holds one page (a prefix of 4 tokens) and announces two more: prefill writes its
    blocks 4 and 5 (not 3) into them, and the token, cached prefix and room into the slot."""
    room = 2**40 + 3
    with vllm_prefill_and_sglang_decode(arena_slots=2) as pair:
        pair.prefill.hold("r", [3, 4, 5], str(room), FirstToken(4242, 4, room))
        transfer = _announce(pair, str(room), [5, 0], slot=2, prefix_tokens=BLOCK)
        sent = _until_final(pair, [transfer])
        assert transfer.state.name == "SUCCESS", transfer.error
        assert sent.finished_sending == {"r"}
        for src, dst in ((4, 5), (5, 0)):
            for t in range(BLOCK):
                for layer in range(2):
                    for part, buf in enumerate((pair.sglang.k, pair.sglang.v)):
                        want = pair.vllm.token(layer, src, t, part)
                        assert torch.equal(buf[layer][dst * BLOCK + t], want), (src, t, layer, part)
        assert bool((pair.sglang.k[0][BLOCK : 5 * BLOCK] == -1).all())  # pages 1..4 untouched
        assert _token_row(pair, 2) == 4242 and list(pair.aux[1][2].view("<i4")[:3]) == [4, 4, 0]
        assert int(pair.aux[9][2].view("<u8")[0]) == room
        assert all(bool((row[s] == 0xAB).all()) for row in pair.aux for s in (0, 1, 3))


def test_handoff_slots_are_one_a_request_and_come_back_after_it() -> None:
    """An arena of one slot: a request announced while another's write (1 s) holds the slot is
    given back with the reason, nothing written for it; once the first is done its slot serves
    a third request."""
    with vllm_prefill_and_sglang_decode(arena_slots=1, delay=1.0) as pair:
        for name, token in (("11", 101), ("12", 102), ("13", 103)):
            pair.prefill.hold(f"r{name}", [1], name, FirstToken(token, 0, int(name)))
        first = _announce(pair, "11", [2], slot=0)
        deadline = time.monotonic() + 5
        while not pair.prefill._held["r11"].sent:  # its write posted: the slot is taken
            assert time.monotonic() < deadline
            pair.prefill.poll()
            time.sleep(0.005)
        second = _announce(pair, "12", [3], slot=1)
        _until_final(pair, [second])
        assert not first.state.final  # the slot was still in use
        assert second.state.name == "FAILED" and "no free handoff slot" in str(second.error)
        assert bool((pair.aux[0][1] == 0xAB).all()) and bool((pair.sglang.k[0][3 * BLOCK : 4 * BLOCK] == -1).all())
        _until_final(pair, [first])
        assert first.state.name == "SUCCESS", first.error
        assert _token_row(pair, 0) == 101
        third = _announce(pair, "13", [4], slot=3)
        _until_final(pair, [third])
        assert third.state.name == "SUCCESS", third.error
        assert _token_row(pair, 3) == 103 and pair.prefill._free_slots == [0]


def test_an_arena_of_no_slots_gives_every_sglang_request_back_with_the_reason() -> None:
    with vllm_prefill_and_sglang_decode(arena_slots=0) as pair:
        pair.prefill.hold("r", [1, 2], "21", FirstToken(5, 0, 21))
        transfer = _announce(pair, "21", [0, 1], slot=0)
        sent = _until_final(pair, [transfer])
        assert transfer.state.name != "SUCCESS" and "no free handoff slot" in str(transfer.error)
        assert sent.finished_sending == {"r"}  # the blocks went back to vLLM
        assert bool((pair.sglang.k[0] == -1).all()) and bool((pair.aux[0] == 0xAB).all())


def test_a_request_held_without_a_handoff_is_not_written_into_an_sglang_decode() -> None:
    """A vLLM request offered to a vLLM decode (no ``sglang_room``) but announced by an SGLang
    decode that asks for its first token: refused, since there is no token to hand over."""
    with vllm_prefill_and_sglang_decode(arena_slots=2) as pair:
        pair.prefill.hold("31", [1])
        transfer = _announce(pair, "31", [0], slot=0)
        _until_final(pair, [transfer])
        assert transfer.state.name != "SUCCESS" and "without 'sglang_room'" in str(transfer.error)
        assert bool((pair.sglang.k[0] == -1).all())


def test_a_prefix_that_is_not_whole_blocks_is_refused_with_the_sizes() -> None:
    with vllm_prefill_and_sglang_decode(arena_slots=2) as pair:
        pair.prefill.hold("r", [1, 2, 3], "41", FirstToken(5, 0, 41))
        transfer = _announce(pair, "41", [0], slot=0, prefix_tokens=BLOCK + 1)
        _until_final(pair, [transfer])
        assert f"prefix of {BLOCK + 1} tokens, not whole blocks of {BLOCK}" in str(transfer.error)
        assert sorted(pair.prefill._free_slots) == [0, 1]  # no slot was taken


def test_a_second_request_under_a_held_room_is_released_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """Two requests the proxy gave one room: decode's announcement names the room, so only the
    first may answer it; the second's blocks go back to vLLM on the next step."""
    with vllm_prefill_and_sglang_decode(arena_slots=2) as pair:
        pair.prefill.hold("a", [1], "51", FirstToken(1, 0, 51))
        pair.prefill.hold("b", [2], "51", FirstToken(2, 0, 51))
        assert "as another held request is" in caplog.text
        assert pair.prefill.poll().finished_sending == {"b"}
        transfer = _announce(pair, "51", [0], slot=1)
        sent = _until_final(pair, [transfer])
        assert transfer.state.name == "SUCCESS", transfer.error
        assert sent.finished_sending == {"a"} and _token_row(pair, 1) == 1


def test_a_handoff_slot_comes_back_when_the_decode_goes_away_mid_write() -> None:
    """The slot is the request's from its write until its transfer ends, however it ends: a
    decode that closes while the write (1 s) is in flight fails the transfer, and the slot
    and the blocks go back."""
    with vllm_prefill_and_sglang_decode(arena_slots=1, delay=1.0) as pair:
        pair.prefill.hold("r", [1], "61", FirstToken(6, 0, 61))
        _announce(pair, "61", [2], slot=0)
        deadline = time.monotonic() + 5
        while not pair.prefill._held["r"].sent:
            assert time.monotonic() < deadline
            pair.prefill.poll()
            time.sleep(0.005)
        assert pair.prefill._free_slots == []
        pair.decode.close()
        sent = StepResults()
        deadline = time.monotonic() + 10
        while "r" not in sent.finished_sending:
            assert time.monotonic() < deadline, pair.prefill.stats()
            sent.finished_sending |= pair.prefill.poll().finished_sending
            time.sleep(0.01)
        assert pair.prefill._free_slots == [0] and pair.prefill.held == 0 and not pair.prefill._names


def test_a_decode_stating_other_aux_rows_than_it_registered_is_refused_and_others_served() -> None:
    """A buggy or hostile SGLang decode whose layout states a 512-byte room row over a 64-byte
    registered one would have the handoff write across other slots' rows: the prefill refuses
    its handshake (the stated lengths must be the registered ones) and serves the next decode."""
    with vllm_prefill_and_sglang_decode(arena_slots=2) as pair:
        stated = as_sglang_decode(pair.sglang.layout)
        liar = Endpoint(
            pair.decode.regions,
            dataclasses.replace(stated, aux_item_lens=(*SGLANG_AUX[:9], 512)),
            drivers={"fake": FakeDriver},
            name="liar",
            timeouts=FAST,
        )
        try:
            with pytest.raises(KVTransportError, match=r"aux items of .* its regions hold"):
                liar.connect(pair.prefill.address)
        finally:
            liar.close()
        pair.prefill.hold("r", [1], "71", FirstToken(7, 0, 71))
        transfer = _announce(pair, "71", [0], slot=1)
        _until_final(pair, [transfer])
        assert transfer.state.name == "SUCCESS", transfer.error
        assert _token_row(pair, 1) == 7
