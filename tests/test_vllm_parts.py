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

from kvtransport.integrations.vllm.layout import describe_kv_caches
from kvtransport.integrations.vllm.params import RemotePrefill, is_remote_decode, is_remote_prefill, parse
from kvtransport.integrations.vllm.scheduler_side import SchedulerSide
from kvtransport.integrations.vllm.worker_side import StepResults, WorkerSide
from kvtransport.runtime.endpoint import Endpoint, Timeouts
from kvtransport.spi.errors import ConfigError, MemoryLayoutError, NegotiationError
from kvtransport.testing.fake import FakeDriver
from kvtransport.tools.kv_pool import KVPool

BS = 16

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


def _layers(shape: tuple[int, ...], n: int = 3, dtype: torch.dtype = torch.float16) -> list[tuple[str, Any]]:
    return [(f"model.layers.{i}.attn", torch.zeros(shape, dtype=dtype)) for i in range(n)]


def test_mha_blocks_are_registered_k_layers_then_v_layers() -> None:
    layers = _layers((2, 10, BS, 4, 8))
    kv = describe_kv_caches(layers, block_size=BS, use_mla=False, tp_rank=1, tp_size=2, total_kv_heads=8)
    assert kv.num_blocks == 10
    assert [r.ptr for r in kv.regions.kv] == [t[0].data_ptr() for _, t in layers] + [t[1].data_ptr() for _, t in layers]
    assert set(kv.regions.kv_item_lens) == {BS * 4 * 8 * 2}
    layout = kv.layout
    assert (layout.kv_split, layout.num_kv_heads, layout.head_dim, layout.num_layers) == ("kv", 4, 8, 3)
    assert (layout.tp_rank, layout.tp_size, layout.total_kv_heads, layout.dtype) == (1, 2, 8, "float16")
    assert layout.extra["token_layout"] == "NHD"


def test_head_major_blocks_are_told_apart_by_the_block_size() -> None:
    kv = describe_kv_caches(
        _layers((2, 10, 4, BS, 8)), block_size=BS, use_mla=False, tp_rank=0, tp_size=1, total_kv_heads=4
    )
    assert kv.layout.extra["token_layout"] == "HND" and kv.layout.num_kv_heads == 4


def test_mla_registers_one_latent_region_per_layer() -> None:
    kv = describe_kv_caches(_layers((10, BS, 576)), block_size=BS, use_mla=True, tp_rank=0, tp_size=4, total_kv_heads=1)
    assert len(kv.regions.kv) == 3 and kv.layout.kv_split == "mla" and kv.layout.total_kv_heads == 0


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        ([], "no KV cache tensors"),
        (_layers((3, 10, BS, 4, 8)), "K and V first"),
        (_layers((2, 10, 5, 4, 8)), "no axis of the block size"),
        ([("a.0", torch.zeros(2, 10, BS, 4, 8)), ("a.1", torch.zeros(2, 10, BS, 2, 8))], "every layer's KV alike"),
        ([("a.0", torch.zeros(2, 10, BS, 4, 8).transpose(1, 2))], "not contiguous|block size"),
    ],
)
def test_unregistrable_caches_are_refused_with_the_reason(layers: list[tuple[str, Any]], match: str) -> None:
    with pytest.raises(MemoryLayoutError, match=match):
        describe_kv_caches(layers, block_size=BS, use_mla=False, tp_rank=0, tp_size=1, total_kv_heads=4)


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
    params = RemotePrefill("engine-p", "p-r", 1, ("tcp://p:1",), 50, 4, BS).to_params()
    req = _request("d-r", 50, params)
    assert side.matched_tokens(req, 32) == (18, True)
    side.after_alloc(req, [9, 10], held_blocks=2, num_external=18)
    (load,) = side.take_orders().loads
    assert (load.blocks, load.prefix, load.remote.request_id if load.remote else None) == ((9, 10), 2, "p-r")
    assert side.matched_tokens(req, 32) == (0, False)  # do_remote_prefill is now False


def test_unusable_params_take_the_load_path_and_fail_it_with_the_reason() -> None:
    side = SchedulerSide("engine-d", BS, 1)
    req = _request("d-bad", 40, {"do_remote_prefill": True, "tp_size": "many"})
    assert side.matched_tokens(req, 0) == (40, True)  # never a silent local prefill
    side.after_alloc(req, [1, 2, 3], held_blocks=0, num_external=40)
    (load,) = side.take_orders().loads
    assert load.remote is None and "remote_kvtransport" in load.error


# -- both worker sides over real endpoints (fake driver) ------------------------------------

FAST = Timeouts(connect=5, bootstrap=5, waiting=5, transfer=5, heartbeat_interval=0.1, heartbeat_timeout=1.0)
PAGES, LAYERS, ITEM = 32, 2, 256


@contextlib.contextmanager
def prefill_and_decode(lease: float) -> Iterator[tuple[KVPool, KVPool, WorkerSide, WorkerSide, list[float]]]:
    pools = [KVPool(PAGES, LAYERS, ITEM, 0), KVPool(PAGES, LAYERS, ITEM, 0)]
    pools[0].fill(1)
    now = [0.0]
    sides: list[WorkerSide] = []
    try:
        for i, pool in enumerate(pools):
            ep = Endpoint(pool.regions, pool.layout, drivers={"fake": FakeDriver}, name=f"w{i}", timeouts=FAST)
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


def test_an_sglang_prefill_and_a_vllm_decode_are_refused_at_handshake_with_both_engines() -> None:
    """Each engine's layout says which engine it is: a pair of different engines fails the
    handshake (LayoutMismatch, both names) instead of moving pages neither side can use."""
    pools = [KVPool(PAGES, LAYERS, ITEM, 0), KVPool(PAGES, LAYERS, ITEM, 0)]
    endpoints = []
    try:
        for pool, engine in zip(pools, ("sglang", "vllm"), strict=True):
            layout = dataclasses.replace(pool.layout, extra={"engine": engine})
            endpoints.append(Endpoint(pool.regions, layout, drivers={"fake": FakeDriver}, name=engine, timeouts=FAST))
        with pytest.raises(NegotiationError, match=r"LayoutMismatch.*engine: vllm .*, sglang .*same serving engine"):
            endpoints[1].connect(endpoints[0].address)
        same = dataclasses.replace(pools[0].layout, extra={"engine": "vllm"})
        assert not same.incompatibilities(dataclasses.replace(pools[1].layout, extra={"engine": "vllm"}))
    finally:
        for ep in endpoints:
            ep.close()
        for pool in pools:
            pool.close()
