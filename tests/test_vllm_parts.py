"""The vLLM connector's parts that need no vLLM (fast tier): the ``kv_transfer_params`` a client
carries between the instances (hypothesis: what prefill writes parses back; whatever a client
sends instead is refused with a ConfigError naming the field), the KV description of vLLM's
cache tensors, the scheduler side's bookkeeping, and both worker sides over real endpoints
(the fake driver: the pairing, the prefix, the lease). tests/test_vllm.py runs the whole
connector inside vLLM's own scheduler on the real engines."""

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
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.integrations.vllm import scheduler_side, worker_side
from kvtransport.integrations.vllm.layout import describe_kv_caches
from kvtransport.integrations.vllm.params import (
    RemotePrefill,
    is_remote_decode,
    is_remote_prefill,
    parse,
    prompt_digest,
    sign,
    verify,
)
from kvtransport.integrations.vllm.scheduler_side import SchedulerSide
from kvtransport.integrations.vllm.worker_side import StepResults, WorkerSide
from kvtransport.runtime.auth import Secret
from kvtransport.runtime.endpoint import Endpoint, Timeouts
from kvtransport.spi.errors import ConfigError, MemoryLayoutError, NegotiationError
from kvtransport.testing.fake import FakeDriver
from kvtransport.tools.kv_pool import KVPool

BS = 16

hex64 = st.binary(min_size=32, max_size=32).map(bytes.hex)
texts = st.text(st.characters(codec="utf-8", exclude_characters="@"), min_size=1, max_size=40)


@st.composite
def remotes(draw: st.DrawFn) -> RemotePrefill:
    tp = draw(st.integers(1, 8))
    tokens = draw(st.integers(0, 100_000))
    return RemotePrefill(
        engine_id=draw(texts),
        request_id=draw(texts),
        tp_size=tp,
        addresses=tuple(draw(st.lists(texts, min_size=tp, max_size=tp))),
        num_tokens=tokens,
        num_blocks=-(-tokens // BS),
        block_size=BS,
        prompt_sha256=draw(hex64),
        mac=draw(st.just("") | hex64),
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@given(remotes())
def test_what_prefill_writes_decode_reads_back(remote: RemotePrefill) -> None:
    params = remote.to_params()
    assert is_remote_prefill(params) and not is_remote_decode(params)
    assert parse(params, block_size=BS) == remote


@settings(max_examples=300)
@given(
    remotes(),
    st.sampled_from(
        [
            "remote_engine_id",
            "remote_request_id",
            "tp_size",
            "remote_num_tokens",
            "remote_kvtransport",
            "addresses",
            "num_blocks",
            "block_size",
            "version",
        ]
    ),
    json_values,
)
def test_a_client_changing_any_field_gets_its_name_or_the_same_request(
    remote: RemotePrefill, key: str, value: Any
) -> None:
    params = remote.to_params()
    inner = params["remote_kvtransport"]
    (inner if key in inner else params)[key] = value
    try:
        got = parse(params, block_size=BS)
    except ConfigError as exc:
        assert key in str(exc) or "remote_kvtransport" in str(exc) or "blocks" in str(exc), str(exc)
    else:  # a change parse accepts must still be a well-formed request
        assert got.tp_size == len(got.addresses) and got.num_blocks == -(-got.num_tokens // BS)


@given(json_values)
def test_garbage_params_raise_config_errors_only(value: Any) -> None:
    with pytest.raises(ConfigError):
        parse(value, block_size=BS)


def test_a_prefill_of_another_block_size_is_refused_with_both_sizes() -> None:
    params = RemotePrefill("e", "r", 1, ("tcp://a:1",), 40, 3, BS).to_params()
    with pytest.raises(ConfigError, match="blocks of 16 tokens, this decode instance 32"):
        parse(params, block_size=32)


# -- the KV description ---------------------------------------------------------------------


B, H, N, C, L = 10, 4, BS, 32, 3  # blocks, heads, tokens a block, a head's K+V elements, layers


def _views(layout: str, n: int = L, heads: int = H) -> list[tuple[str, Any]]:
    """Per-layer ``[B, H, N, C]`` views laid out as vLLM 0.33's KVCacheLayout names them (the
    vLLM-run tests take them from vLLM's own allocate_kv_cache)."""
    if layout == "LBNHC":  # each layer's blocks contiguous, a block token-major
        return [
            (f"model.layers.{i}.attn", torch.zeros(B, N, heads, C, dtype=torch.float16).permute(0, 2, 1, 3))
            for i in range(n)
        ]
    if layout == "LBHNC":  # each layer's blocks contiguous, a block head-major
        return [(f"model.layers.{i}.attn", torch.zeros(B, heads, N, C, dtype=torch.float16)) for i in range(n)]
    assert layout == "BLNHC"  # a block of every layer together, token-major
    buf = torch.zeros(B, n, N, heads, C, dtype=torch.float16)
    return [(f"model.layers.{i}.attn", buf[:, i].permute(0, 2, 1, 3)) for i in range(n)]


def _describe(layers: list[tuple[str, Any]], **over: Any) -> Any:
    args: dict[str, Any] = {"block_size": BS, "use_mla": False, "tp_rank": 1, "tp_size": 2, "total_kv_heads": 2 * H}
    args.update(over)
    return describe_kv_caches(layers, **args)


def test_token_major_layers_are_a_region_each_with_a_row_per_token() -> None:
    layers = _views("LBNHC")
    kv = _describe(layers)
    page = H * N * C * 2
    assert kv.num_blocks == B
    assert [r.ptr for r in kv.regions.kv] == [t.data_ptr() for _, t in layers]
    assert kv.regions.kv_item_lens == (page,) * L
    layout = kv.layout
    assert (layout.page_size, layout.num_kv_heads, layout.head_dim, layout.num_layers) == (N, H, C, L)
    assert (layout.tp_rank, layout.tp_size, layout.total_kv_heads, layout.dtype) == (1, 2, 2 * H, "float16")
    assert layout.extra == {"engine": "vllm", "block_size": BS, "token_layout": "NHD", "packing": "layer"}


def test_head_major_layers_have_a_row_per_block_of_each_heads_tokens() -> None:
    layout = _describe(_views("LBHNC")).layout
    assert (layout.page_size, layout.head_dim, layout.extra["token_layout"]) == (1, N * C, "HND")


def test_block_outermost_caches_are_one_region_of_whole_blocks() -> None:
    layers = _views("BLNHC")
    kv = _describe(layers)
    assert len(kv.regions.kv) == 1 and kv.regions.kv[0].ptr == layers[0][1].data_ptr()
    assert kv.regions.kv_item_lens == (L * H * N * C * 2,) and kv.num_blocks == B
    assert (kv.layout.page_size, kv.layout.extra["packing"]) == (L * N, "block")


def test_mla_is_one_head_of_latent() -> None:
    kv = _describe(_views("LBNHC", heads=1), use_mla=True, tp_size=4, total_kv_heads=1)
    assert kv.layout.kv_split == "mla" and kv.layout.total_kv_heads == 0 and kv.layout.num_kv_heads == 1


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        ([], "no KV cache tensors"),
        ([("a.0", torch.zeros(2, B, N, H, C))], "per-layer"),
        ([("a.0", torch.zeros(B, H, N, C)), ("a.1", torch.zeros(B, 2, N, C))], "every layer's KV alike"),
        ([("a.0", torch.zeros(B, H, N, 2 * C)[..., :C])], "not one dense range"),
        ([("a.0", torch.zeros(B, H, 5, C))], "whole kernel blocks"),
        ([(f"a.{i}", torch.zeros(B, 2 * L, H, N, C)[:, 2 * i]) for i in range(L)], "neither a range per layer"),
    ],
)
def test_unregistrable_caches_are_refused_with_the_reason(layers: list[tuple[str, Any]], match: str) -> None:
    with pytest.raises(MemoryLayoutError, match=match):
        _describe(layers)


# -- the scheduler side ---------------------------------------------------------------------


def _request(rid: str, tokens: int, params: dict[str, Any] | None, computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid, prompt_token_ids=list(range(tokens)), kv_transfer_params=params, num_computed_tokens=computed
    )


def test_prefill_holds_a_finished_request_and_offers_what_decode_parses() -> None:
    side = SchedulerSide("engine-p", BS, 2)
    side.set_addresses({0: "tcp://p:1", 1: "tcp://p:2"})
    req = _request("r1", 40, {"do_remote_decode": True}, computed=40)
    delay, params = side.finished(req, [5, 6, 7], completed=True)
    assert delay is True and params is not None
    remote = parse(params, block_size=BS)
    assert (remote.request_id, remote.addresses, remote.num_tokens, remote.num_blocks) == (
        "r1",
        ("tcp://p:1", "tcp://p:2"),
        40,
        3,
    )
    assert side.holding == {"r1"}
    assert [h.blocks for h in side.take_orders().holds] == [(5, 6, 7)]
    side.sent({"r1"})
    assert not side.holding


@pytest.mark.parametrize("case", ["aborted", "not remote decode", "no addresses"])
def test_prefill_holds_nothing_it_cannot_offer(case: str) -> None:
    side = SchedulerSide("engine-p", BS, 1)
    if case != "no addresses":
        side.set_addresses({0: "tcp://p:1"})
    params = None if case == "not remote decode" else {"do_remote_decode": True}
    assert side.finished(_request("r", 40, params, 40), [1, 2, 3], completed=case != "aborted") == (False, None)
    assert not side.holding and not side.take_orders().holds


def test_decode_loads_after_its_prefix_and_only_once() -> None:
    side = SchedulerSide("engine-d", BS, 1)
    params = RemotePrefill("engine-p", "p-r", 1, ("tcp://p:1",), 50, 4, BS, prompt_digest(range(50), 50)).to_params()
    req = _request("d-r", 50, params)
    assert side.matched_tokens(req, 32) == (18, True)
    side.after_alloc(req, [9, 10], held_blocks=2, num_external=18)
    (load,) = side.take_orders().loads
    assert (load.blocks, load.prefix, load.remote.request_id if load.remote else None) == ((9, 10), 2, "p-r")
    assert side.matched_tokens(req, 32) == (0, False)  # do_remote_prefill is now False


def _signed_pair(secret: Secret) -> tuple[SchedulerSide, SchedulerSide, dict[str, Any]]:
    prefill, decode = SchedulerSide("engine-p", BS, 1, secret), SchedulerSide("engine-d", BS, 1, secret)
    prefill.set_addresses({0: "tcp://p:1"})
    _, params = prefill.finished(_request("r", 40, {"do_remote_decode": True}, 40), [1, 2, 3], completed=True)
    assert params is not None
    return prefill, decode, params


def test_params_made_for_another_prompt_fail_the_load_with_the_reason() -> None:
    """A client pairing one request's params with another prompt would have decode load KV of
    other tokens (and file it in its prefix cache under this prompt's hashes)."""
    _, decode, params = _signed_pair(Secret.none())
    other = _request("d", 40, params)
    other.prompt_token_ids = [7, *range(1, 40)]
    assert decode.matched_tokens(other, 0) == (40, True)
    decode.after_alloc(other, [4, 5, 6], held_blocks=0, num_external=40)
    (load,) = decode.take_orders().loads
    assert load.remote is None and "made for another prompt" in load.error


def test_with_a_secret_params_changed_on_the_way_fail_and_signed_ones_load() -> None:
    secret = Secret.from_bytes(b"k" * 32, "test")
    _, decode, params = _signed_pair(secret)
    assert len(params["remote_kvtransport"]["mac"]) == 64
    decode.after_alloc(_request("ok", 40, dict(params)), [4, 5, 6], held_blocks=0, num_external=40)
    moved = {**params, "remote_kvtransport": {**params["remote_kvtransport"], "addresses": ["tcp://evil:1"]}}
    decode.after_alloc(_request("moved", 40, moved), [7, 8, 9], held_blocks=0, num_external=40)
    ok, bad = decode.take_orders().loads
    assert ok.remote is not None and ok.error == ""
    assert bad.remote is None and "not signed with this deployment's secret" in bad.error
    unsigned = sign(parse(params, block_size=BS), Secret.none())
    with pytest.raises(ConfigError, match="not signed"):
        verify(unsigned, range(40), secret)


def test_unusable_params_take_the_load_path_and_fail_it_with_the_reason() -> None:
    side = SchedulerSide("engine-d", BS, 1)
    req = _request("d-bad", 40, {"do_remote_prefill": True, "tp_size": "many"})
    assert side.matched_tokens(req, 0) == (40, True)  # never a silent local prefill
    side.after_alloc(req, [1, 2, 3], held_blocks=0, num_external=40)
    (load,) = side.take_orders().loads
    assert load.remote is None and "remote_kvtransport" in load.error


def _decode_request(rid: str, params: dict[str, Any], status: str = "FINISHED_ABORTED", **fields: Any) -> Any:
    req = _request(rid, 40, dict(params))
    req.status = status
    for key, value in fields.items():
        setattr(req, key, value)
    return req


@pytest.mark.parametrize(
    "how", ["ended while queued", "ended waiting for free blocks", "computes its prompt itself", "rejected by vLLM"]
)
def test_a_decode_request_that_will_never_load_tells_its_prefill_once(how: str) -> None:
    """Every way vLLM's decode scheduler lets a remote-prefill request go without starting its
    load hands the workers one decline naming the prefill request (they tell its ranks, which
    give the blocks back at once); nothing loads it later."""
    secret = Secret.from_bytes(b"k" * 32, "test")
    _, decode, params = _signed_pair(secret)
    req = _decode_request("d", params)
    if how == "ended waiting for free blocks":
        assert decode.matched_tokens(req, 0) == (40, True)  # vLLM asked, then found no blocks
    if how == "rejected by vLLM":
        # vLLM's serving layer ends a request it refused with a placeholder prompt
        # (AsyncLLM.notify_kv_transfer_request_rejected): the MAC vouches for the params.
        req.prompt_token_ids, req.abort_immediately = [0], True
    if how == "computes its prompt itself":
        decode.after_alloc(req, [], held_blocks=2, num_external=0)  # e.g. prompt logprobs
        assert decode.has_orders()
        assert decode.matched_tokens(req, 0) == (0, False)  # nor loads after a preemption
        assert decode.finished(req, [], completed=True) == (False, None)
    else:
        assert decode.finished(req, [], completed=False) == (False, None)
    orders = decode.take_orders()
    assert [(d.request, d.remote.request_id, d.remote.addresses) for d in orders.declines] == [
        ("d", "r", ("tcp://p:1",))
    ]
    assert not orders.loads and not decode.has_orders() and not decode._params
    assert "FINISHED_ABORTED" in orders.declines[0].reason or how == "computes its prompt itself"
    assert decode.finished(req, [], completed=False) == (False, None)  # once
    assert not decode.take_orders().declines


@pytest.mark.parametrize("damage", ["another prompt", "unsigned", "malformed"])
def test_a_decode_request_whose_params_a_load_would_refuse_tells_nobody(
    damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Only verified params name a prefill to tell: a client holding a copy of another request's
    params cannot free its blocks with a request of another prompt, or point decode elsewhere."""
    secret = Secret.from_bytes(b"k" * 32, "test")
    _, decode, params = _signed_pair(secret)
    req = _decode_request("d", params)
    if damage == "another prompt":
        req.prompt_token_ids = [7, *range(1, 40)]
    elif damage == "unsigned":
        req.abort_immediately = True
        req.kv_transfer_params["remote_kvtransport"] = {**params["remote_kvtransport"], "addresses": ["tcp://x:1"]}
    else:
        req.kv_transfer_params["tp_size"] = "many"
    with caplog.at_level("WARNING"):
        assert decode.finished(req, [], completed=False) == (False, None)
    assert not decode.take_orders().declines and not decode._params
    assert "its prefill is not told" in caplog.text


def test_declines_waiting_for_a_step_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_side, "MAX_PENDING", 3)
    _, decode, params = _signed_pair(Secret.none())
    for i in range(5):
        decode.finished(_decode_request(f"d{i}", params), [], completed=False)
    assert [d.request for d in decode.take_orders().declines] == ["d2", "d3", "d4"]  # the newest


# -- both worker sides over real endpoints (fake driver) ------------------------------------

FAST = Timeouts(connect=5, bootstrap=5, waiting=5, transfer=5, heartbeat_interval=0.1, heartbeat_timeout=1.0)
PAGES, LAYERS, ITEM = 32, 2, 256


@contextlib.contextmanager
def prefill_and_decode(
    lease: float, timeouts: Timeouts = FAST
) -> Iterator[tuple[KVPool, KVPool, WorkerSide, WorkerSide, list[float]]]:
    pools = [KVPool(PAGES, LAYERS, ITEM, 0), KVPool(PAGES, LAYERS, ITEM, 0)]
    pools[0].fill(1)
    now = [0.0]
    sides: list[WorkerSide] = []
    try:
        for i, pool in enumerate(pools):
            ep = Endpoint(pool.regions, pool.layout, drivers={"fake": FakeDriver}, name=f"w{i}", timeouts=timeouts)
            sides.append(WorkerSide(ep, tp_rank=0, tp_size=1, lease_s=lease, clock=lambda: now[0]))
        yield pools[0], pools[1], sides[0], sides[1], now
    finally:
        for side in sides:
            side.close()
        for pool in pools:
            pool.close()


def _until(prefill: WorkerSide, decode: WorkerSide, done: Any, timeout: float = 10) -> tuple[StepResults, StepResults]:
    sent, got = StepResults(), StepResults()
    deadline = time.monotonic() + timeout
    while not done(sent, got):
        assert time.monotonic() < deadline, (sent, got)
        for total, step in ((sent, prefill.poll()), (got, decode.poll())):
            for name in ("finished_sending", "finished_recving", "failed_recving", "failed_blocks"):
                getattr(total, name).update(getattr(step, name))
        time.sleep(0.005)
    return sent, got


def test_decode_reads_the_blocks_after_its_prefix_and_prefill_releases_them() -> None:
    with prefill_and_decode(lease=60) as (src, dst, prefill, decode, _):
        prefill.hold("r", [3, 4, 5, 6, 7])
        remote = RemotePrefill("p", "r", 1, (prefill.address,), 80, 5, BS)
        decode.load("d", [20, 21, 22], prefix=2, remote=remote)
        _, got = _until(prefill, decode, lambda s, g: "r" in s.finished_sending and "d" in g.finished_recving)
        assert not got.failed_recving and not got.failed_blocks
        assert src.page_digests([5, 6, 7]) == dst.page_digests([20, 21, 22])
        assert prefill.held == 0 and decode.loading == 0


def test_a_lease_that_runs_out_releases_the_blocks_and_refuses_a_late_decode() -> None:
    with prefill_and_decode(lease=5) as (_, dst, prefill, decode, now):
        prefill.hold("r", [1, 2])
        assert not prefill.poll().finished_sending
        now[0] = 6.0
        assert prefill.poll().finished_sending == {"r"}
        assert prefill.expired == 1
        dst.poison([10, 11])
        before = dst.page_digests([10, 11])
        decode.load("d", [10, 11], prefix=0, remote=RemotePrefill("p", "r", 1, (prefill.address,), 32, 2, BS))
        _, got = _until(prefill, decode, lambda s, g: "d" in g.finished_recving)
        assert got.failed_recving == {"d"} and got.failed_blocks == {10, 11}
        assert dst.page_digests([10, 11]) == before  # nothing was written


def test_decode_asking_for_more_blocks_than_prefill_holds_fails_both_sides_with_the_counts() -> None:
    with prefill_and_decode(lease=60) as (_, _dst, prefill, decode, _now):
        prefill.hold("r", [1, 2])
        decode.load("d", [10, 11, 12], prefix=0, remote=RemotePrefill("p", "r", 1, (prefill.address,), 48, 3, BS))
        _, got = _until(prefill, decode, lambda s, g: "r" in s.finished_sending and "d" in g.finished_recving)
        assert got.failed_recving == {"d"}


def test_a_decode_cancelled_before_it_announces_tells_prefill_which_releases_the_blocks() -> None:
    """Decode ends the request while its connection is still being made: prefill hears so once
    the connection is up and gives the blocks back then, not when the lease (60 s on a clock
    that never moves here) runs out."""
    with prefill_and_decode(lease=60) as (_, _dst, prefill, decode, _now):
        prefill.hold("r", [1, 2])
        decode.load("d", [10, 11], prefix=0, remote=RemotePrefill("p", "r", 1, (prefill.address,), 32, 2, BS))
        got = decode.poll({"d"})  # cancelled in the step that started the load
        _, late = _until(prefill, decode, lambda s, g: "r" in s.finished_sending)
        assert "d" in got.finished_recving | late.finished_recving
        assert prefill.held == 0 and prefill.expired == 0 and decode.loading == 0


def test_a_declined_request_is_released_by_prefill_at_once_with_or_without_a_connection() -> None:
    """Decode declines requests it will never load: the first over a connection it makes for
    it (off the step), the next over the live one, one before prefill even holds the request;
    prefill gives each back at once, not when the lease (60 s on a clock that never moves) ends."""
    with prefill_and_decode(lease=60) as (_, _dst, prefill, decode, _now):
        prefill.hold("r1", [1, 2])
        decode.decline("d1", RemotePrefill("p", "r1", 1, (prefill.address,), 32, 2, BS), "aborted")
        _, got = _until(prefill, decode, lambda s, g: "r1" in s.finished_sending)
        assert not got.finished_recving  # vLLM waits for nothing on decode's side
        decode.decline("d2", RemotePrefill("p", "r2", 1, (prefill.address,), 32, 2, BS), "aborted")
        time.sleep(0.2)  # the decline is there before prefill holds the request
        prefill.hold("r2", [3, 4])
        _until(prefill, decode, lambda s, g: "r2" in s.finished_sending)
        assert prefill.held == 0 and prefill.expired == 0 and decode.loading == 0
        assert decode.declined == 2 and decode.untold == 0


def test_a_decode_rank_declines_to_every_prefill_rank_it_reads_from() -> None:
    """Prefill TP 2, decode TP 1: the decode rank tells both prefill ranks, each under the tag it
    waits for, and both give their blocks back."""
    # 4 KV heads of 32 bytes a token: 2 on each prefill rank, all 4 on the decode rank.
    ranks_of = [(2, 0), (2, 1), (1, 0)]
    pools = [KVPool(PAGES, LAYERS, 16 * 32 * 4 // tp, 0, tp=(4, tp, rank)) for tp, rank in ranks_of]
    sides: list[WorkerSide] = []
    try:
        for i, (pool, (tp, rank)) in enumerate(zip(pools, ranks_of, strict=True)):
            ep = Endpoint(pool.regions, pool.layout, drivers={"fake": FakeDriver}, name=f"w{i}", timeouts=FAST)
            sides.append(WorkerSide(ep, tp_rank=rank, tp_size=tp, lease_s=60, clock=lambda: 0.0))
        *ranks, decode = sides
        for rank in ranks:
            rank.hold("r", [1, 2])
        decode.decline("d", RemotePrefill("p", "r", 2, tuple(r.address for r in ranks), 32, 2, BS), "aborted")
        released: set[int] = set()
        deadline = time.monotonic() + 10
        while released != {0, 1}:
            assert time.monotonic() < deadline, [r.stats() for r in ranks]
            released |= {i for i, r in enumerate(ranks) if "r" in r.poll().finished_sending}
            time.sleep(0.01)
        assert all(r.expired == 0 for r in ranks)
    finally:
        for side in sides:
            side.close()
        for pool in pools:
            pool.close()


def test_a_decline_to_an_unreachable_prefill_is_dropped_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody listens at the prefill's address: the decline is counted untold (the prefill's
    lease returns its blocks) once the connect failed; past the bound, at once."""
    monkeypatch.setattr(worker_side, "MAX_DECLINING", 1)
    with prefill_and_decode(lease=60, timeouts=dataclasses.replace(FAST, connect=0.5)) as (_, _, _, decode, _):
        nowhere = RemotePrefill("p", "r", 1, ("tcp://127.0.0.1:9",), 16, 1, BS)
        decode.decline("d1", nowhere, "aborted")
        decode.decline("d2", nowhere, "aborted")  # the first still connecting: over the bound
        assert decode.untold >= 1
        deadline = time.monotonic() + 15
        while decode.untold < 2 or decode._declining:
            assert time.monotonic() < deadline, decode.stats()
            time.sleep(0.01)
        assert decode.declined == 0 and not decode.poll().finished_recving


def test_a_decode_cancelled_before_its_prefill_answers_reports_at_once() -> None:
    with prefill_and_decode(lease=60) as (_, _dst, _prefill, decode, _now):
        # An address nobody listens on: the connect is still pending when the request ends.
        decode.load("d", [1], prefix=0, remote=RemotePrefill("p", "r", 1, ("tcp://127.0.0.1:9",), 16, 1, BS))
        got = decode.poll({"d"})
        deadline = time.monotonic() + 5
        while "d" not in got.finished_recving:
            assert time.monotonic() < deadline
            got = decode.poll()
        assert got.failed_recving == {"d"} and decode.loading == 0


def test_an_unpairable_tp_fails_the_load_with_the_sizes(caplog: pytest.LogCaptureFixture) -> None:
    with prefill_and_decode(lease=60) as (_, _dst, _prefill, decode, _now):
        rank = WorkerSide(decode.endpoint, tp_rank=0, tp_size=2, lease_s=60)  # decode at TP 2
        rank.load("d", [1], prefix=0, remote=RemotePrefill("p", "r", 3, ("a", "b", "c"), 16, 1, BS))
        with caplog.at_level("WARNING"):
            got = rank.poll()
        assert got.failed_recving == {"d"}
        assert np.array_equal(sorted(got.failed_blocks), [1])
        assert "prefill runs attention TP=3, this decode rank TP=2" in caplog.text


def test_an_sglang_decode_that_names_no_aux_rows_is_refused_a_vllm_prefill_at_handshake() -> None:
    """Each engine's layout says which engine it is (and SGLang's its role and aux rows): a vLLM
    instance paired with an SGLang decode that does not say where its first-token rows lie fails
    the handshake (LayoutMismatch, with the reason) instead of writing the token blind."""
    pools = [KVPool(PAGES, LAYERS, ITEM, 0), KVPool(PAGES, LAYERS, ITEM, 0)]
    endpoints = []
    try:
        for pool, extra in zip(pools, ({"engine": "sglang", "role": "decode"}, {"engine": "vllm"}), strict=True):
            layout = dataclasses.replace(pool.layout, extra=extra)
            endpoints.append(
                Endpoint(pool.regions, layout, drivers={"fake": FakeDriver}, name=extra["engine"], timeouts=FAST)
            )
        with pytest.raises(
            NegotiationError, match=r"LayoutMismatch.*a vLLM prefill .*cannot feed the SGLang decode.*aux_rows"
        ):
            endpoints[1].connect(endpoints[0].address)
        same = dataclasses.replace(pools[0].layout, extra={"engine": "vllm"})
        assert not same.incompatibilities(dataclasses.replace(pools[1].layout, extra={"engine": "vllm"}))
    finally:
        for ep in endpoints:
            ep.close()
        for pool in pools:
            pool.close()


def test_an_announcement_prefill_does_not_hold_fails_after_the_silence_bound() -> None:
    """A replayed or made-up request (prefill holds no such blocks): decode does not wait the
    endpoint's 300 s for input, but fails the load after ``bootstrap`` with the reason."""
    quick = dataclasses.replace(FAST, bootstrap=1.0)
    with prefill_and_decode(lease=60, timeouts=quick) as (_, _dst, prefill, decode, now):
        decode.load("d", [1, 2], prefix=0, remote=RemotePrefill("p", "never", 1, (prefill.address,), 32, 2, BS))
        deadline = time.monotonic() + 5
        while decode._loads["d"].transfer is None:  # connected and announced
            assert time.monotonic() < deadline
            assert not decode.poll().finished_recving
            time.sleep(0.01)
        assert not decode.poll().finished_recving
        now[0] += 2.0  # past the silence bound (decode's clock)
        _, got = _until(prefill, decode, lambda s, g: "d" in g.finished_recving)
        assert got.failed_recving == {"d"} and decode.loading == 0


def test_a_load_whose_prefill_vanished_after_the_announcement_is_released() -> None:
    """Prefill's endpoint closes after decode announced (a crash, a restart): its transfer
    fails, no drain confirmation can come, and the load is still reported (failed) once the
    connection is gone, instead of holding vLLM's request and blocks for ever."""
    with prefill_and_decode(lease=60) as (_, _dst, prefill, decode, now):
        decode.load("d", [1, 2], prefix=0, remote=RemotePrefill("p", "r", 1, (prefill.address,), 32, 2, BS))
        deadline = time.monotonic() + 5
        while decode._loads["d"].transfer is None:
            assert time.monotonic() < deadline
            decode.poll()
            time.sleep(0.01)
        prefill.endpoint.close()
        got = StepResults()
        deadline = time.monotonic() + 10
        while "d" not in got.finished_recving:
            assert time.monotonic() < deadline, decode.stats()
            now[0] += 0.5  # decode's clock: past the grace once the connection is gone
            step = decode.poll()
            got.finished_recving |= step.finished_recving
            got.failed_recving |= step.failed_recving
            time.sleep(0.05)
        assert got.failed_recving == {"d"} and decode.loading == 0
