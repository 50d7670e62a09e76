"""vLLM's connector (``kvtransport.integrations.vllm``) through vLLM's own scheduler: two vLLM
instances, each in its own process in the vLLM environment (tests/vllm_engine.py: vLLM's v1
``Scheduler``, ``KVConnectorFactory``, model-runner mixin and ``KVOutputAggregator``), prefill
-> decode over the real engines, every transferred token of every layer, head and K/V checked
on decode, and both instances back to all blocks free afterwards."""

from __future__ import annotations

import os
import signal
import time

import pytest

from .vllm_cluster import Instance, engine_config, instance_env, pd_pair, prompt, require_vllm, run_request

pytestmark = [pytest.mark.engines]

DRIVERS = ["nixl-ucx", "mooncake-gdr"]
#: The soak's requests (a multiple of 10: each tenth is one kind), CI's size.
SOAK_REQUESTS = int(os.environ.get("KVTRANSPORT_VLLM_SOAK_REQUESTS", "100"))


def assert_idle(inst: Instance) -> None:
    """No request, no held block, no transfer, every block free (one is vLLM's null block)."""
    s = inst.settle()
    assert s["requests"] == 0, s
    assert s["holding"] == 0, s
    assert all(w["held"] == 0 and w["loading"] == 0 for w in s["workers"]), s
    assert s["free_blocks"] == s["num_blocks"] - 1, s


def released_within(inst: Instance, since: float) -> float:
    """Seconds from ``since`` until ``inst`` holds no request and has every block free again
    (the assertion fails after 30 s: long before the 480 s lease would return them)."""
    s = inst.settle(timeout=30)
    took = time.monotonic() - since
    assert s["holding"] == 0 and s["free_blocks"] == s["num_blocks"] - 1, s
    return took


def once(driver: str) -> None:
    """Scenarios decided on the control plane (params, aborts, leases, connects) run on the
    first driver only; the data path's run on every driver."""
    if driver != DRIVERS[0]:
        pytest.skip("decided on the control plane, the same on every driver: run on the first")


@pytest.fixture(scope="module", params=DRIVERS)
def pair(request: pytest.FixtureRequest):
    require_vllm()
    with pd_pair(request.param) as (p, d):
        yield request.param, p, d


def test_requests_move_byte_exact_with_the_forced_driver(pair) -> None:
    driver, p, d = pair
    # Lengths around block edges: a partial last block, exactly one block, several.
    for i, n in enumerate((50, 16, 17, 200)):
        got = run_request(p, d, f"exact-{driver}-{i}", prompt(n, seed=i))
        assert got["bad"] == 0, got
        assert got["checked"] == n - 1  # vLLM recomputes the last prompt token to sample
        assert got["finished"] == "length"
        assert got["params"]["remote_kvtransport"]["num_blocks"] == -(-n // 16)
    assert d.stats()["workers"][0]["drivers"] == [driver]
    assert_idle(p)
    assert_idle(d)


def test_decode_with_a_prefix_cache_hit_loads_only_the_rest(pair) -> None:
    """Decode's prefix cache holds the first two blocks: it announces the blocks after them,
    with the prefix, and prefill sends only those."""
    driver, p, d = pair
    tokens = prompt(80, seed=42)
    d.send(op="local", id=f"warm-{driver}", tokens=tokens[:40], max_tokens=1)
    d.wait("finished", f"warm-{driver}")
    got = run_request(p, d, f"prefix-{driver}", tokens)
    assert got["bad"] == 0, got
    assert got["checked"] == 79
    assert_idle(p)
    assert_idle(d)


def test_a_decode_that_never_comes_releases_the_blocks_and_a_late_one_fails_fast(pair) -> None:
    """Prefill holds a finished request's blocks for its lease (short here); with no decode,
    they go back when it runs out, and a decode arriving later hears at once that nothing
    comes: its request fails (kv_load_failure_policy=fail) instead of waiting."""
    driver, _, d = pair
    once(driver)
    inst = Instance(
        "prefill-lease",
        engine_config(extra={"listen_host": "127.0.0.1", "lease_s": 1.0}),
        instance_env(driver),
    )
    try:
        inst.send(op="prefill", id="orphan", tokens=prompt(40))
        params = inst.wait("prefilled", "orphan")["params"]
        assert inst.stats()["holding"] == 1
        assert_idle(inst)
        assert inst.stats()["workers"][0]["expired"] == 1
        started = time.monotonic()
        d.send(op="decode", id=f"late-{driver}", tokens=prompt(40), params=params)
        assert d.wait("finished", f"late-{driver}")["reason"] == "error"
        assert time.monotonic() - started < 10
    finally:
        inst.close()
    assert_idle(d)


@pytest.mark.parametrize(
    "damage",
    [
        {"remote_kvtransport": None},
        {"tp_size": 0},
        {"remote_num_tokens": -5},
        {"remote_request_id": "x" * 300},
        {
            "remote_kvtransport": {
                "version": 1,
                "addresses": ["tcp://127.0.0.1:1"] * 9,
                "num_blocks": 3,
                "block_size": 16,
            }
        },
        {"remote_kvtransport": {"version": 99}},
        {"block_size_of": 32},
    ],
)
def test_hostile_params_fail_the_request_with_the_reason_and_decode_goes_on(pair, damage) -> None:
    driver, p, d = pair
    once(driver)
    case = f"{driver}-{'-'.join(damage)}-{len(str(damage))}"
    tokens = prompt(40, seed=len(case))
    p.send(op="prefill", id=f"p-hostile-{case}", tokens=tokens)
    params = p.wait("prefilled", f"p-hostile-{case}")["params"]
    bad = dict(params)
    for key, value in damage.items():
        if key == "block_size_of":
            bad["remote_kvtransport"] = {**params["remote_kvtransport"], "block_size": value}
        else:
            bad[key] = value
    d.send(op="decode", id=f"hostile-{case}", tokens=tokens, params=bad)
    assert d.wait("finished", f"hostile-{case}")["reason"] == "error"
    # The same decode instance serves the next (well-formed) request.
    d.send(op="decode", id=f"after-hostile-{case}", tokens=tokens, params=params)
    got = d.wait("loaded", f"after-hostile-{case}")
    assert got["bad"] == 0
    d.wait("finished", f"after-hostile-{case}")
    assert_idle(p)
    assert_idle(d)


def test_params_of_one_prompt_with_another_prompt_fail_and_poison_nothing(pair) -> None:
    """A client pairing a request's params with another prompt: decode refuses the load (the
    params' prompt digest, signed with the deployment secret here), so no KV of other tokens
    lands in its blocks or its prefix cache; the right prompt with the same params still loads."""
    driver, p, d = pair
    once(driver)
    tokens = prompt(48, seed=99)
    p.send(op="prefill", id=f"p-swap-{driver}", tokens=tokens)
    params = p.wait("prefilled", f"p-swap-{driver}")["params"]
    assert len(params["remote_kvtransport"]["mac"]) == 64  # the instances share a secret
    d.send(op="decode", id=f"swap-{driver}", tokens=prompt(48, seed=98), params=params)
    assert d.wait("finished", f"swap-{driver}")["reason"] == "error"
    assert any("made for another prompt" in line for line in d.log), "".join(d.log[-5:])
    d.send(op="decode", id=f"unswapped-{driver}", tokens=tokens, params=params)
    assert d.wait("loaded", f"unswapped-{driver}")["bad"] == 0
    d.wait("finished", f"unswapped-{driver}")
    assert_idle(p)
    assert_idle(d)


def test_an_abort_on_prefill_offers_nothing(pair) -> None:
    driver, p, _ = pair
    once(driver)
    p.send_many(
        {"op": "prefill", "id": f"gone-{driver}", "tokens": prompt(300)}, {"op": "abort", "id": f"gone-{driver}"}
    )
    assert p.wait("finished", f"gone-{driver}")["reason"] == "abort"
    assert_idle(p)


NEVER_LOADED = [
    "aborted before vLLM scheduled it",
    "refused by vLLM's serving layer",
    "aborted while waiting for free blocks",
    "computed on decode (prompt logprobs)",
    "aborted whenever the abort lands",
]


@pytest.mark.parametrize("how", NEVER_LOADED)
def test_a_decode_request_that_does_not_load_gives_prefill_its_blocks_back_at_once(pair, how: str) -> None:
    """Decode ends a request, or admits it without loading, before any load of it started: its
    prefill (default lease, 480 s) hears so and frees the request's blocks within seconds. The
    last case aborts a request whose load may be starting, running or done (soak's kind 8)."""
    driver, p, d = pair
    once(driver)
    req = f"never-{NEVER_LOADED.index(how)}"
    blocks = how == "aborted while waiting for free blocks"
    tokens = prompt(600 if blocks else 48, seed=200 + NEVER_LOADED.index(how))
    p.send(op="prefill", id=f"p-{req}", tokens=tokens)
    params = p.wait("prefilled", f"p-{req}")["params"]
    assert p.stats()["holding"] == 1
    decode = {"op": "decode", "id": req, "tokens": tokens, "params": params}
    if how == "aborted before vLLM scheduled it":
        d.send_many(decode, {"op": "abort", "id": req})  # taken before the next step
        assert d.wait("finished", req)["reason"] == "abort"
    elif how == "refused by vLLM's serving layer":
        d.send(op="reject", id=req, params=params)
        d.wait("rejected", req)
    elif blocks:
        # A local request holds 94 of decode's 127 blocks: the 38 this one needs never free
        # while it runs; vLLM asks the connector (the params are parsed) and leaves it queued.
        d.send_many({"op": "local", "id": f"hog-{req}", "tokens": prompt(1500, seed=7), "max_tokens": 500}, decode)
        deadline = time.monotonic() + 30
        while True:
            s = d.stats()
            if s["params_pending"] == 1 and s["statuses"].get(req) == "WAITING":
                break
            assert time.monotonic() < deadline, s
            time.sleep(0.05)
        d.send(op="abort", id=req)
        assert d.wait("finished", req)["reason"] == "abort"
    elif how == "computed on decode (prompt logprobs)":
        # vLLM reads no cached KV for a request wanting prompt logprobs, so it loads none.
        d.send(**decode, prompt_logprobs=1)
        assert d.wait("loaded", req)["checked"] == 0
    else:
        d.send(**decode)
        d.send(op="abort", id=req)
    ended = time.monotonic()
    took = released_within(p, ended)
    assert took < 10, took
    if blocks:
        d.send(op="abort", id=f"hog-{req}")
    if how == "computed on decode (prompt logprobs)":
        assert d.wait("finished", req)["reason"] == "length"
    assert p.stats()["workers"][0]["expired"] == 0
    assert_idle(p)
    assert_idle(d)


def test_a_decode_abort_while_prefill_is_unreachable_releases_its_blocks(pair) -> None:
    """Decode waits on a prefill that does not answer (stopped): aborting the request gives its
    blocks back at once; prefill, resumed, releases its own at the lease."""
    driver, _, d = pair
    once(driver)
    inst = Instance(
        "prefill-stopped",
        engine_config(extra={"listen_host": "127.0.0.1", "lease_s": 2.0}),
        instance_env(driver),
    )
    try:
        inst.send(op="prefill", id="frozen", tokens=prompt(64))
        params = inst.wait("prefilled", "frozen")["params"]
        os.kill(inst.proc.pid, signal.SIGSTOP)
        d.send(op="decode", id=f"frozen-{driver}", tokens=prompt(64), params=params)
        time.sleep(0.5)
        assert d.stats()["requests"] == 1
        d.send(op="abort", id=f"frozen-{driver}")
        assert d.wait("finished", f"frozen-{driver}")["reason"] == "abort"
        assert_idle(d)
        os.kill(inst.proc.pid, signal.SIGCONT)
        assert_idle(inst)
    finally:
        os.kill(inst.proc.pid, signal.SIGCONT)
        inst.close()


def test_a_prefill_that_dies_fails_decode_fast(pair) -> None:
    """Prefill killed (SIGKILL) after it offered a request: decode's load fails within the
    connect timeout, the request ends with an error, and decode serves the next one."""
    driver, p, d = pair
    once(driver)
    doomed = Instance("prefill-doomed", engine_config(), instance_env(driver))
    doomed.send(op="prefill", id="doomed", tokens=prompt(64))
    params = doomed.wait("prefilled", "doomed")["params"]
    doomed.kill()
    started = time.monotonic()
    d.send(op="decode", id=f"doomed-{driver}", tokens=prompt(64), params=params)
    assert d.wait("finished", f"doomed-{driver}", timeout=60)["reason"] == "error"
    assert time.monotonic() - started < 20
    got = run_request(p, d, f"after-doomed-{driver}", prompt(64, seed=3))
    assert got["bad"] == 0
    assert_idle(d)


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "layout"),
    [
        # vLLM's CPU attention backend supports head-major blocks only (LBHNC): a page's rows are
        # its heads' token runs, and a rank's heads one contiguous slice of the block
        (1, 4, None),
        # a GPU backend's token-major blocks (what the connector asks for): a slice per token
        (2, 1, "LBNHC"),
    ],
)
def test_unequal_tp_moves_every_head_byte_exact(prefill_tp: int, decode_tp: int, layout: str | None) -> None:
    require_vllm()
    over = {"layouts": [layout]} if layout else {}
    with pd_pair(
        "nixl-ucx",
        prefill=engine_config(prefill_tp, **over),
        decode=engine_config(decode_tp, **over),
    ) as (p, d):
        for i, n in enumerate((33, 128)):
            got = run_request(p, d, f"tp-{i}", prompt(n, seed=i))
            assert got["bad"] == 0, got
            assert got["checked"] == n - 1
        assert_idle(p)
        assert_idle(d)


def test_instances_with_different_block_layouts_refuse_the_pair_with_both() -> None:
    """Prefill head-major (vLLM's CPU backend), decode token-major: the same bytes per block,
    in another order; the handshake refuses the pair and decode's request fails with both."""
    require_vllm()
    with pd_pair("nixl-ucx", decode=engine_config(layouts=["LBNHC"])) as (p, d):
        tokens = prompt(40)
        p.send(op="prefill", id="p-mixed", tokens=tokens)
        params = p.wait("prefilled", "p-mixed")["params"]
        d.send(op="decode", id="mixed", tokens=tokens, params=params)
        assert d.wait("finished", "mixed")["reason"] == "error"

        def said() -> bool:
            return any("LayoutMismatch" in line or "token_layout" in line for line in list(d.log))

        # (its log comes on stderr, read by another thread than its events: the line may follow
        # the "finished" event by a moment)
        deadline = time.monotonic() + 10
        while not said() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert said(), "".join(d.log[-10:])
        assert_idle(d)


def test_a_soak_of_mixed_requests_leaves_both_instances_flat() -> None:
    """SOAK_REQUESTS requests (100 here; KVTRANSPORT_VLLM_SOAK_REQUESTS for a longer soak), a
    tenth each aborted on decode, aborted on prefill, or sent with damaged
    params, the rest byte-exact; afterwards (once the short lease returned what decode never
    took) neither instance holds a request, a block, a transfer or a pending param, and their
    descriptors, threads and memory are where they were after the first wave."""
    require_vllm()
    lease = {"listen_host": "127.0.0.1", "lease_s": 2.0}
    with pd_pair("nixl-ucx", prefill=engine_config(extra=lease), decode=engine_config(extra=lease)) as (p, d):
        baseline: dict[str, dict[str, int]] = {}
        exact = 0
        for i in range(SOAK_REQUESTS):
            kind = i % 10
            tokens = prompt(20 + (i * 37) % 200, seed=i)
            if kind == 7:  # aborted on prefill: nothing is offered
                p.send_many({"op": "prefill", "id": f"pa-{i}", "tokens": tokens}, {"op": "abort", "id": f"pa-{i}"})
                assert p.wait("finished", f"pa-{i}")["reason"] == "abort"
                continue
            p.send(op="prefill", id=f"p-{i}", tokens=tokens)
            params = p.wait("prefilled", f"p-{i}")["params"]
            if kind == 8:  # aborted on decode, whenever the abort lands
                d.send(op="decode", id=f"d-{i}", tokens=tokens, params=params)
                d.send(op="abort", id=f"d-{i}")
                d.wait("finished", f"d-{i}")
            elif kind == 9:  # damaged params: the load fails with the field's name
                bad = {**params, "remote_num_tokens": "all"}
                d.send(op="decode", id=f"d-{i}", tokens=tokens, params=bad)
                assert d.wait("finished", f"d-{i}")["reason"] == "error"
            else:
                d.send(op="decode", id=f"d-{i}", tokens=tokens, params=params, max_tokens=1)
                got = d.wait("loaded", f"d-{i}")
                assert got["bad"] == 0, got
                d.wait("finished", f"d-{i}")
                exact += 1
            if i == 49:
                baseline = {"prefill": p.settle(), "decode": d.settle()}
        assert exact == SOAK_REQUESTS * 7 // 10
        for name, inst in (("prefill", p), ("decode", d)):
            end = inst.settle(timeout=30)
            start = baseline[name]
            assert end["requests"] == end["holding"] == end["params_pending"] == 0, end
            assert end["free_blocks"] == end["num_blocks"] - 1, end
            assert all(w["held"] == w["loading"] == 0 for w in end["workers"]), end
            assert end["workers"][0]["peers"] <= 1, end
            assert end["fds"] <= start["fds"] + 2 and end["threads"] <= start["threads"], (name, start, end)
            assert end["rss"] - start["rss"] < 48 << 20, (name, start["rss"], end["rss"])
