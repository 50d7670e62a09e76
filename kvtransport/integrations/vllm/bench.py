"""``kvtransport bench --consumer vllm``: what the vLLM connector adds per request over
kvtransport's own endpoint, on the same requests, the same connection and the same driver.

A prefill process holds each request's blocks: through the connector's worker side (``hold``,
then its per-step ``poll`` binds decode's announcement, writes, and learns the writes are done)
or through the endpoint directly (it waits for the announcement, sends, and polls the sender
until done). This process is decode: through the connector (``load``, then ``poll`` until the
request is reported) or directly (``expect``, then its state polled until final). Both sides
poll at the same cadence in both modes, until the same moment, so the difference is the
connector's bookkeeping: its orders, its connection cache, its pairing checks and its reports
(on 2 cores a side that polls while the other waits slows the transfer it shares the CPUs with,
which would be counted as the connector's). Requests
alternate between the modes (drift on a noisy machine hits both alike); the figures are
medians, and the last bytes of every request are checked.

``python -m kvtransport.integrations.vllm.bench --serve ...`` is the prefill process.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvtransport.integrations.vllm.params import RemotePrefill
from kvtransport.integrations.vllm.worker_side import WorkerSide
from kvtransport.negotiation.registry import load_driver
from kvtransport.runtime.endpoint import Endpoint, State, Transfer
from kvtransport.spi.driver import KVTransport
from kvtransport.spi.errors import KVTransportError
from kvtransport.tools.kv_pool import PAGE_TOKENS, KVPool
from kvtransport.tools.peer_process import PeerProcess

__all__ = ["render", "run"]

#: How often both sides poll in connector mode: the fastest engine step this stands for.
STEP_S = 0.0001


def _drivers(name: str) -> dict[str, type[KVTransport]] | None:
    return None if name in ("", "auto") else {name: load_driver(name)}


def _worker(pool: KVPool, driver: str, name: str) -> WorkerSide:
    endpoint = Endpoint(pool.regions, pool.layout, drivers=_drivers(driver), name=name)
    return WorkerSide(endpoint, tp_rank=0, tp_size=1, lease_s=600.0)


def serve(argv: list[str]) -> int:
    """The prefill process: JSON lines in (``offer``, ``close``), one JSON line out each."""
    p = argparse.ArgumentParser()
    p.add_argument("--driver", default="auto")
    p.add_argument("--pages", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--item", type=int, required=True)
    args = p.parse_args(argv)
    pool = KVPool(args.pages, args.layers, args.item, 0, shared=False)
    pool.fill(7)
    side = _worker(pool, args.driver, "bench-vllm-prefill")
    raw: dict[str, np.ndarray[Any, Any]] = {}
    senders: dict[str, Transfer] = {}
    #: Sent through the endpoint, polled until done: an engine frees the blocks only then, as
    #: the connector's worker side does.
    sending: list[Transfer] = []
    reply({"address": side.address, "name": side.endpoint.name})
    fd, buffer = sys.stdin.fileno(), b""
    try:
        while True:
            # An engine step polls between forwards; 0.1 ms stands for the fastest step (a spin
            # that never waits would starve the endpoint's I/O thread of the GIL).
            ready, _, _ = select.select([fd], [], [], STEP_S if (raw or sending or side.held) else 0.05)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return 0
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    cmd = json.loads(line)
                    if cmd["cmd"] == "close":
                        reply({"ok": True})
                        return 0
                    pages = np.arange(cmd["first"], cmd["first"] + cmd["count"], dtype=np.int64)
                    if cmd["mode"] == "connector":
                        side.hold(cmd["tag"], pages.tolist())
                    else:
                        raw[cmd["tag"]] = pages
                    reply({"ok": True})
            side.poll()
            sending = [t for t in sending if not t.state.final]
            for tag in list(raw):
                sender = senders.get(tag)
                if sender is None:
                    conn = side.endpoint.announced(tag)
                    if conn is None:
                        continue
                    sender = senders[tag] = conn.sender(tag)  # once: a second would be a duplicate
                if sender.state is not State.BOOTSTRAPPING:  # the announcement is filed
                    sender.send(raw.pop(tag), last=True)
                    sending.append(senders.pop(tag))
    finally:
        side.close()
        pool.close()


def reply(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def run(
    *, driver: str = "auto", requests: int = 200, tokens: int = 256, layers: int = 32, item: int = 8192
) -> dict[str, Any]:
    """Time ``requests`` requests of ``tokens`` tokens (``layers`` K and V regions of pages of
    ``item`` bytes) each way; the report :func:`render` prints."""
    blocks = -(-tokens // PAGE_TOKENS)
    pages = blocks * 8
    pool = KVPool(pages, layers, item, 0, shared=False)
    peer = PeerProcess(
        *("--serve", "--driver", driver, "--pages", str(pages), "--layers", str(layers), "--item", str(item)),
        module="kvtransport.integrations.vllm.bench",
        timeout=120,
    )
    side = _worker(pool, driver, "bench-vllm-decode")
    times: dict[str, list[float]] = {"connector": [], "raw": []}
    try:
        conn = side._connection(peer.address).result(timeout=60)  # the connection both modes use
        for i in range(requests + 2):  # the first two warm each mode up
            mode = ("connector", "raw")[i % 2]
            first = (i % 8) * blocks
            tag = f"bench-{i}"
            dst = list(range((i + 3) % 8 * blocks, (i + 3) % 8 * blocks + blocks))
            peer.call("offer", tag=tag, first=first, count=blocks, mode=mode)
            started = time.perf_counter()
            if mode == "raw":
                # Polled at the connector's cadence, not waited on: a decode engine learns of
                # either kind of completion at a step, and a waiting decode would leave the
                # CPUs to the transfer that a polling one shares with it.
                t: Transfer = conn.expect(tag, dst)
                deadline = started + 60
                while not t.state.final:
                    if time.perf_counter() > deadline:
                        raise KVTransportError(f"request {tag}: not complete through the endpoint within 60 s")
                    time.sleep(STEP_S)
                if t.state is not State.SUCCESS:
                    raise KVTransportError(f"request {tag} failed through the endpoint: {t.error}")
            else:
                remote = RemotePrefill("bench", tag, 1, (peer.address,), blocks * PAGE_TOKENS, blocks, PAGE_TOKENS)
                side.load(tag, dst, 0, remote)
                deadline = started + 60
                while True:
                    got = side.poll()
                    if tag in got.finished_recving:
                        if got.failed_recving:
                            raise KVTransportError(f"request {tag} failed through the connector")
                        break
                    if time.perf_counter() > deadline:
                        raise KVTransportError(f"request {tag}: no result through the connector within 60 s")
                    time.sleep(STEP_S)
            elapsed = time.perf_counter() - started
            if i >= 2:
                times[mode].append(elapsed)
            if pool.page_digests(dst[-1:]) != _expected(first + blocks - 1, pool):
                raise KVTransportError(f"request {tag} ({mode}): its last block arrived wrong")
        decision = conn.decision
    except KVTransportError as exc:
        try:
            code = peer.proc.wait(5)
        except Exception:  # noqa: BLE001 - still running: its stderr so far
            code = None
        raise KVTransportError(f"{exc}; the prefill process (exit {code}) said:\n{peer.stderr[-3000:]}") from exc
    finally:
        side.close()
        peer.close()
        pool.close()
    med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
    return {
        "driver": decision.driver if decision else "?",
        "requests": requests,
        "tokens": tokens,
        "bytes_per_request": blocks * layers * 2 * item,
        "median_ms": med,
        "p90_ms": {m: float(np.percentile(v, 90)) * 1e3 for m, v in times.items()},
        "overhead_ms": med["connector"] - med["raw"],
        "ratio": med["raw"] / med["connector"] if med["connector"] else 0.0,
    }


def _expected(page: int, pool: KVPool) -> list[int]:
    # The prefill pool was filled with seed 7: the same fill here, on a spare pool, tells
    # what its page holds.
    global _REFERENCE
    if _REFERENCE is None or _REFERENCE.num_pages != pool.num_pages:
        _REFERENCE = KVPool(pool.num_pages, pool.num_layers, pool.item_len, 0, shared=False)
        _REFERENCE.fill(7)
    return _REFERENCE.page_digests([page])


_REFERENCE: KVPool | None = None


def render(doc: dict[str, Any]) -> str:
    med, p90 = doc["median_ms"], doc["p90_ms"]
    return "\n".join(
        [
            f"vLLM connector against kvtransport's endpoint: {doc['requests']} requests of {doc['tokens']} tokens "
            f"({doc['bytes_per_request'] / 2**20:.1f} MiB each), driver {doc['driver']}, alternating",
            f"  endpoint   p50 {med['raw']:8.3f} ms   p90 {p90['raw']:8.3f} ms",
            f"  connector  p50 {med['connector']:8.3f} ms   p90 {p90['connector']:8.3f} ms",
            f"  overhead   {doc['overhead_ms']:+.3f} ms per request (p50), ratio endpoint/connector {doc['ratio']:.3f}",
        ]
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(serve(sys.argv[2:]))
    print(render(run()))
