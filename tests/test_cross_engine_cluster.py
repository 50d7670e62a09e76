"""Each engine's prefill feeding the other's decode, each engine's own scheduler in its own
process: the SGLang ranks of tests/sglang_scheduler.py (SGLang 0.5.23's scheduler, pools and
kvtransport's SGLang backend, in the SGLang environment), the vLLM instances of
tests/vllm_engine.py (vLLM 0.33's scheduler and the connector, in the vLLM environment), and
the proxy between them: the test sends one prompt to both, under one bootstrap room.

- SGLang prefill -> vLLM decode: vLLM's decode gets the ``kv_transfer_params``
  ``params_for_sglang_prefill`` makes from SGLang's bootstrap registry, then checks every token
  of every layer, head, K and V of what landed in its blocks against the KV the SGLang
  prefill's stand-in model wrote (tests/model_content.py), read where vLLM's attention reads it.
- vLLM prefill -> SGLang decode: vLLM's prefill registers at the bootstrap address SGLang's
  decode is given (``sglang_bootstrap``) and gets ``params_for_sglang_decode``; SGLang's decode
  checks every byte of the prompt's KV in its pages against the same model's KV, and commits the
  token vLLM sampled from its aux slot (SGLang's own ``_commit_transfer_to_req``, which also
  refuses a slot written for another room)."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtransport.integrations.vllm.from_sglang import params_for_sglang_prefill
from kvtransport.integrations.vllm.to_sglang import params_for_sglang_decode
from kvtransport.runtime.auth import load_secret

from .conftest import require_engines
from .test_sglang_scheduler import Cluster, Topo, kv_bytes
from .vllm_cluster import SECRET, Instance, engine_config, instance_env, require_vllm

#: The SGLang harness's tiny Llama (tests/test_sglang_scheduler.py): 2 layers, 2 KV heads of 16,
#: float32 weights, which SGLang runs as float16.
MODEL = {"layers": 2, "heads": 2, "head_size": 16, "dtype": "float16", "content": "sglang"}


@pytest.fixture(scope="module")
def sglang_prefill() -> Iterator[Cluster]:
    """One SGLang prefill rank and no SGLang decode: vLLM decodes."""
    require_engines()
    require_vllm()
    with tempfile.TemporaryDirectory(prefix="sglang-xengine-") as tmp:
        # KVTRANSPORT_LAYERWISE from the start: the plugin installs its hooks then (each case
        # turns the sends on or off when it configures the rank).
        env = {"KVTRANSPORT_SECRET": SECRET, "KVTRANSPORT_LAYERWISE": "1"}
        cluster = Cluster(Path(tmp), Topo(tp=1), Topo(tp=0), env=env)
        try:
            yield cluster
        finally:
            cluster.close()


def prompt(room: int, n: int) -> list[int]:
    return [3 + (room * 5 + i * 11) % 250 for i in range(n)]


@pytest.mark.parametrize(
    ("driver", "decode_tp", "layout", "layerwise"),
    [
        # vLLM's CPU attention backend: head-major blocks (LBHNC), each rank all heads
        ("mooncake-gdr", 1, None, False),
        # a GPU backend's token-major blocks (LBNHC, what the connector asks for), decode at
        # TP 2: each vLLM rank takes its head of every token from the one SGLang rank, which
        # sends layer by layer as its forward writes them (KVTRANSPORT_LAYERWISE)
        ("nixl-ucx", 2, "LBNHC", True),
    ],
)
def test_an_sglang_prefill_feeds_a_vllm_decode_byte_exact(
    sglang_prefill: Cluster, driver: str, decode_tp: int, layout: str | None, layerwise: bool
) -> None:
    cluster = sglang_prefill
    # Layer-wise from the first token on (KVTRANSPORT_LAYERWISE_MIN_TOKENS=0): every chunk goes
    # in layer groups, each group's runs out of its layers' K and V buffers only.
    env = {"KVTRANSPORT_LAYERWISE": "1", "KVTRANSPORT_LAYERWISE_MIN_TOKENS": "0"} if layerwise else {}
    cluster.configure(page_size=16, driver=driver, **(env or {"KVTRANSPORT_LAYERWISE": "0"}))
    decode = Instance(
        "decode",
        engine_config(decode_tp, prefix_caching=False, **MODEL, **({"layouts": [layout]} if layout else {})),
        instance_env(driver),
    )
    try:
        lengths = [15, 16, 17, 48, 100]
        specs = []
        for n in lengths:
            room = cluster.room()
            specs.append(
                {"rid": f"x{room}", "room": room, "prompt_len": n, "tokens": prompt(room, n), "max_new_tokens": 1}
            )
        outcome: dict[str, Any] = {}
        sglang = threading.Thread(target=lambda: outcome.setdefault("out", cluster.run(specs, timeout=60)))
        sglang.start()
        secret = load_secret(SECRET)
        for spec in specs:
            params = params_for_sglang_prefill(
                f"127.0.0.1:{cluster.bootstrap_port}", spec["room"], spec["tokens"], block_size=16, secret=secret
            )
            decode.send(op="decode", id=spec["rid"], tokens=spec["tokens"], params=params, max_tokens=2)
        loaded = {spec["rid"]: decode.wait("loaded", spec["rid"], timeout=90) for spec in specs}
        finished = {spec["rid"]: decode.wait("finished", spec["rid"], timeout=30)["reason"] for spec in specs}
        sglang.join(timeout=120)
        out = outcome["out"]
        for spec in specs:
            rid, n = spec["rid"], spec["prompt_len"]
            got = loaded[rid]
            # vLLM recomputes the last prompt token: every one before it came from SGLang.
            assert got["checked"] == n - 1 and got["bad"] == 0, (rid, got)
            assert finished[rid] == "length", (rid, finished[rid])
            assert [o["state"] for o in out.prefill[rid]] == ["success"], out.prefill[rid]
            if layerwise:  # (chunks, layer groups) the prefill sent layer by layer
                assert out.prefill[rid][0]["layerwise"][0] >= 1, out.prefill[rid]
        assert not any(any(c.values()) for c in out.leaks.values()), out.leaks
        stats = decode.settle()
        assert stats["free_blocks"] == stats["num_blocks"] - 1, stats  # vLLM's null block aside
    finally:
        decode.close()


@pytest.fixture(scope="module")
def sglang_decode() -> Iterator[Cluster]:
    """One SGLang decode rank and no SGLang prefill: vLLM prefills."""
    require_engines()
    require_vllm()
    with tempfile.TemporaryDirectory(prefix="sglang-xengine-decode-") as tmp:
        cluster = Cluster(Path(tmp), Topo(tp=0), Topo(tp=1), env={"KVTRANSPORT_SECRET": SECRET})
        try:
            yield cluster
        finally:
            cluster.close()


#: What the vLLM stand-in model samples first (tests/vllm_engine.py: 100 + tokens generated).
VLLM_FIRST_TOKEN = 100


@pytest.mark.parametrize(
    ("driver", "prefill_tp", "layout"),
    [
        # vLLM at TP 2 (a head each) into one SGLang rank (both heads): the two vLLM ranks write
        # their head of every token into SGLang's pages, the first of them the aux slot too
        ("nixl-ucx", 2, None),
        # token-major blocks (LBNHC, a GPU backend's), TP 1 -> 1
        ("mooncake-gdr", 1, "LBNHC"),
    ],
)
def test_a_vllm_prefill_feeds_an_sglang_decode_byte_exact(
    sglang_decode: Cluster, driver: str, prefill_tp: int, layout: str | None
) -> None:
    cluster = sglang_decode
    cluster.configure(page_size=16, driver=driver)
    bootstrap = f"127.0.0.1:{cluster.bootstrap_port}"
    config = engine_config(prefill_tp, **MODEL, **({"layouts": [layout]} if layout else {}))
    config["extra"] = {**config["extra"], "sglang_bootstrap": bootstrap}
    prefill = Instance("prefill", config, instance_env(driver))
    try:
        specs = []
        for n in [15, 16, 17, 48, 100]:
            room = cluster.room()
            specs.append(
                {
                    "rid": f"v{room}",
                    "room": room,
                    "prompt_len": n,
                    "tokens": prompt(room, n),
                    "max_new_tokens": 2,
                    # vLLM's prefill hands no logprobs (params_for_sglang_decode refuses them)
                    "return_logprob": False,
                    "expect_aux": {"output_id": VLLM_FIRST_TOKEN, "cached_tokens": 0},
                }
            )
        # Sent once the others ended: its first two blocks are the 48-token prompt's, found in
        # vLLM's prefix cache, which SGLang's decode reports as its cached tokens.
        room = cluster.room()
        shared = specs[3]["tokens"][:32] + prompt(room, 16)
        late = {**specs[3], "rid": f"v{room}", "room": room, "tokens": shared}
        late["expect_aux"] = {"output_id": VLLM_FIRST_TOKEN, "cached_tokens": 32}
        outcome: dict[str, Any] = {}
        sglang = threading.Thread(target=lambda: outcome.setdefault("out", cluster.run([*specs, late], timeout=60)))
        sglang.start()
        ended = {}
        for batch in (specs, [late]):
            for spec in batch:
                prefill.send(
                    op="prefill", id=spec["rid"], tokens=spec["tokens"], params=params_for_sglang_decode(spec["room"])
                )
            ended |= {spec["rid"]: prefill.wait("finished", spec["rid"], timeout=90)["reason"] for spec in batch}
        specs.append(late)
        sglang.join(timeout=120)
        out = outcome["out"]
        [rank] = cluster.decode
        for spec in specs:
            rid, n = spec["rid"], spec["prompt_len"]
            assert ended[rid] == "length", (rid, ended[rid])
            [got] = out.decode[rid]
            assert got["state"] == "success", (rid, got)
            # Every byte of the prompt's KV, every layer, head, K and V, where SGLang reads it.
            assert got["tokens"] == n and got["kv_bytes"] == kv_bytes(n, rank), (rid, got)
            assert got["aux"]["output_id"] == VLLM_FIRST_TOKEN and got["aux"]["logprob"] is None, (rid, got)
        for name, (count, first) in out.stray_pages.items():
            assert count == 0, f"{name}: {count} pages written outside every request's, e.g. {first}"
        assert not any(any(c.values()) for c in out.leaks.values()), out.leaks
        stats = prefill.settle()
        assert stats["holding"] == 0 and all(w["held"] == 0 for w in stats["workers"]), stats
        assert stats["free_blocks"] == stats["num_blocks"] - 1, stats  # vLLM's null block aside
    finally:
        prefill.close()
