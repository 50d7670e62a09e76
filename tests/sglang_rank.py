"""A prefill rank of SGLang's disaggregation, in its own process, driven by JSON lines: the
real ``KVArgs`` and the kvtransport backend classes, called the way SGLang's prefill scheduler
calls them (``Sender(mgr, addr, room)``, ``poll`` until WaitingForInput, ``init``, ``send`` in
chunks, ``poll`` until Success or Failed). The first line out is ``{"address": bootstrap}``."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll

from kvtransport.integrations.sglang import (
    KVTransportKVBootstrapServer,
    KVTransportKVManager,
    KVTransportKVSender,
)
from kvtransport.tools.kv_pool import KVPool


def kv_args(pool: KVPool, rank: int = 0, role: str = "prefill") -> KVArgs:
    """The fields SGLang 0.5.23 sets on each side (disaggregation/prefill.py and decode.py
    build ``KVArgs``): only prefill sets ``kv_head_num`` (decode does only with staging on)."""
    args = KVArgs()
    args.engine_rank = rank
    args.kv_data_ptrs = [b.ptr for b in pool.buffers]
    args.kv_data_lens = [b.size for b in pool.buffers]
    args.kv_item_lens = [pool.item_len] * len(pool.buffers)
    args.aux_data_ptrs = [b.ptr for b in pool.aux]
    args.aux_data_lens = [b.size for b in pool.aux]
    args.aux_item_lens = [pool.aux_item_len] * len(pool.aux)
    args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], []
    args.page_size = 16
    args.kv_cache_dtype_str = "bfloat16"
    args.gpu_id = 0
    if role == "prefill":
        args.kv_head_num = 8
    args.system_dp_rank = 0
    return args


def poll_until(r: Any, states: set[int], timeout: float = 30.0) -> int:
    """Poll a sender or receiver (as SGLang's scheduler does) until its state is in ``states``."""
    deadline = time.monotonic() + timeout
    while (state := r.poll()) not in states:
        assert time.monotonic() < deadline, f"stuck in {state}"
        time.sleep(0.002)
    return int(state)


def server_args(port: int, tp_size: int = 1, dp_size: int = 1, host: str = "127.0.0.1") -> SimpleNamespace:
    return SimpleNamespace(
        host=host, disaggregation_bootstrap_port=port, tp_size=tp_size, dp_size=dp_size, device="cpu"
    )


class ForwardDoneAfter:
    """What SGLang's prefill hands a sender under overlap scheduling (prefill.py,
    maybe_send_cached_prefix_chunk): an event the previous forward records. Here the "forward"
    ends ``seconds`` after the event is made; ``query()`` is all the backend may call."""

    def __init__(self, seconds: float) -> None:
        self.done_at = time.monotonic() + seconds

    def query(self) -> bool:
        return time.monotonic() >= self.done_at


def run_scheduler(
    mgr: KVTransportKVManager, requests: list[dict[str, Any]], wait: bool, timeout: float
) -> dict[str, Any]:
    """The prefill scheduler's loop: poll each sender, send its chunks once it waits for
    input, then poll until every request concluded."""
    senders = {}
    for r in requests:
        s = KVTransportKVSender(mgr, f"{mgr.bootstrap_host}:{mgr.bootstrap_port}", r["room"])
        senders[r["room"]] = (s, r)
    sent: set[int] = set()
    prefixes: dict[int, int] = {}
    states: dict[int, list[Any]] = {}
    deadline = time.monotonic() + timeout
    while len(states) < len(senders) and time.monotonic() < deadline:
        for room, (s, r) in senders.items():
            if room in states:
                continue
            state = s.poll()
            if state == KVPoll.WaitingForInput and room not in sent:
                prefixes[room] = s.pop_decode_prefix_len()  # as SGLang's finalize_bootstrap does
                if r.get("abort"):
                    s.abort()
                else:
                    s.init(sum(len(c) for c in r["chunks"]), r.get("aux"))
                    if r.get("prefix_event_s"):
                        s._early_send_wait_event = ForwardDoneAfter(r["prefix_event_s"])
                    for i, chunk in enumerate(r["chunks"]):
                        # As SGLang's prefill does (prefill.py, send_kv_chunk): ask the
                        # sender whether this segment goes out at all.
                        last = i == len(r["chunks"]) - 1
                        if s.should_send_kv_chunk(len(chunk), last):
                            # SGLang passes the state list (here: no state types) with the last
                            # segment only, and None with the others.
                            s.send(chunk, [] if last else None)
                sent.add(room)
                if not wait:
                    states[room] = ["STARTED", ""]
            elif state in (KVPoll.Success, KVPoll.Failed):
                error = ""
                if state == KVPoll.Failed:
                    try:
                        s.failure_exception()
                    except Exception as exc:  # noqa: BLE001 - reported to the test
                        error = f"{type(exc).__name__}: {exc}"
                states[room] = ["SUCCESS" if state == KVPoll.Success else "FAILED", error]
                metric = s.get_transfer_metric()
                states[room].append(metric.transfer_total_bytes)
                states[room].append(prefixes.get(room))
                states[room].append(time.monotonic())  # when the scheduler saw it end
        time.sleep(0.001)
    for room in senders:
        states.setdefault(room, ["TIMEOUT", ""])
    return {"states": {str(k): v for k, v in states.items()}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--item", type=int, default=4096)
    p.add_argument("--aux-slots", type=int, default=16)
    p.add_argument("--tp-size", type=int, default=1)
    # With KVTRANSPORT_DISCOVERY on etcd, nothing listens on the bootstrap port: it names the instance.
    p.add_argument("--bootstrap-port", type=int, default=0)
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1", help="SGLang's --host: the bootstrap server's and the endpoint's")
    args = p.parse_args()
    pool = KVPool(args.pages, args.layers, args.item, args.aux_slots, shared=False)
    pool.fill(seed=99 + args.dp_rank)
    server = KVTransportKVBootstrapServer(args.host, args.bootstrap_port)
    kv = kv_args(pool)
    kv.system_dp_rank = args.dp_rank
    mgr = KVTransportKVManager(kv, "prefill", server_args(server.port, args.tp_size, args.dp_size, args.host))
    print(json.dumps({"address": f"{args.host}:{server.port}", "name": mgr.endpoint.name}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                op = cmd["cmd"]
                if op == "send":
                    result = run_scheduler(mgr, cmd["requests"], cmd.get("wait", True), cmd.get("timeout", 60))
                elif op == "digests":
                    result = {"digests": pool.page_digests(cmd["pages"])}
                elif op == "aux_digest":
                    result = {"digest": pool.aux_digest(cmd["slot"])}
                elif op == "close":
                    print(json.dumps({"ok": True}), flush=True)
                    break
                else:
                    raise ValueError(f"unknown command {op!r}")
            except Exception as exc:  # noqa: BLE001
                result = {"error": type(exc).__name__, "message": traceback.format_exc()}
            print(json.dumps(result), flush=True)
    finally:
        mgr.teardown()
        server.close()
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
