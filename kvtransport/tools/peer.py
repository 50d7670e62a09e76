"""A scriptable endpoint in its own process, driven by JSON lines on stdin.

``python -m kvtransport.tools.peer --driver NAME --pages N ...`` prints one JSON line with its
address, then answers one JSON line per command. The bench runs it as its decode side; tests
(and the conformance suite) use it as the far side of a real two-process transfer. Commands:
``accept``, ``connect``, ``expect``, ``send``, ``wait``, ``digests``, ``aux_digest``, ``abort``,
``state``, ``poison``, ``forget``, ``stats``, ``raw_open`` / ``raw_close`` (the driver's raw
engine over the same pool, for the bench's baseline), ``cpus`` (the CPU sets of its threads,
after ``--cpus`` pinned them), ``close``.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import json
import os
import socket
import sys
import time
import traceback
from typing import Any

from kvtransport.negotiation.registry import load_driver
from kvtransport.runtime.endpoint import Connection, Endpoint, State, Timeouts, Transfer
from kvtransport.runtime.fanin import FanIn, expect_from
from kvtransport.spi.driver import KVTransport
from kvtransport.spi.errors import KVTransportError
from kvtransport.spi.probe import host_id
from kvtransport.tools.baseline import RawEngine, raw_engine_of
from kvtransport.tools.cpu_pin import pin_process, process_cpus
from kvtransport.tools.kv_pool import PAGE_TOKENS, KVPool
from kvtransport.tools.soak import process_resources


def driver_classes(name: str) -> dict[str, type[KVTransport]] | None:
    if name in ("fake", "fake-two-sided"):
        # The fakes serve the tests' fault injection; only they load kvtransport.testing.
        from kvtransport.testing.fake import FakeDriver, FakeTwoSided

        fakes: dict[str, type[KVTransport]] = {"fake": FakeDriver, "fake-two-sided": FakeTwoSided}
        return {name: fakes[name]}
    if name in ("", "auto"):
        return None
    return {n: load_driver(n) for n in name.split("+")}  # "A+B": exactly these


def _with_faults(
    drivers: dict[str, type[KVTransport]] | None, options: dict[str, Any]
) -> dict[str, type[KVTransport]] | None:
    """The drivers, those whose fault file ``options`` name (``faults.<driver>``) wrapped to
    fail on command (``kvtransport.testing.faults``; named drivers only)."""
    if drivers is None or not any(k.startswith("faults.") for k in options):
        return drivers
    from kvtransport.testing.faults import with_faults

    return with_faults(drivers, options)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--driver", default="fake")
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--item", type=int, default=4096)
    p.add_argument("--aux-slots", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--options", default="{}")
    p.add_argument("--timeouts", default="{}")
    p.add_argument("--name", default="peer")
    p.add_argument("--private", action="store_true", help="private memory instead of /dev/shm (real engines)")
    p.add_argument("--device", type=int, default=None, help="KV in device memory of this CUDA device")
    p.add_argument("--state", default="[]", help="state groups, JSON [[items, item_len, buffers], ...]")
    p.add_argument("--tp", default="", help="unequal-TP rank: total KV heads, TP size, TP rank (e.g. 8,2,1)")
    p.add_argument("--mla", action="store_true", help="the buffers hold MLA's latent")
    p.add_argument("--listen", default="tcp://127.0.0.1:0", help="the endpoint's listen address")
    p.add_argument("--page-tokens", type=int, default=PAGE_TOKENS, help="tokens per page of the layout")
    p.add_argument("--engine", default="", choices=("", "sglang", "vllm"), help="shape the pool as this engine's")
    p.add_argument("--role", default="prefill", choices=("prefill", "decode"), help="the engine pool's role")
    p.add_argument("--cpus", default="", help="run on these CPUs only, comma-separated (bench --pin)")
    args = p.parse_args(argv)
    if args.cpus:
        # Before any engine or endpoint thread starts: those inherit the set.
        pin_process([int(c) for c in args.cpus.split(",")])
    pool = KVPool(
        args.pages,
        args.layers,
        args.item,
        args.aux_slots,
        shared=not args.private,
        device=args.device,
        state=tuple(tuple(g) for g in json.loads(args.state)),
        tp=tuple(int(x) for x in args.tp.split(",")) if args.tp else None,  # type: ignore[arg-type]
        mla=args.mla,
        page_tokens=args.page_tokens,
        engine=args.engine,
        role=args.role,
    )
    if args.seed:
        pool.fill(args.seed)
    endpoint = Endpoint(
        pool.regions,
        pool.layout,
        drivers=_with_faults(driver_classes(args.driver), json.loads(args.options)),
        name=args.name,
        listen=args.listen,
        driver_options=json.loads(args.options),
        timeouts=Timeouts(**json.loads(args.timeouts)),
    )
    session = _Session(endpoint, pool)
    _reply({"address": endpoint.address, "name": endpoint.name})
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            cmd = json.loads(line)
            try:
                result = _run(cmd, session)
            except KVTransportError as exc:
                result = {"error": type(exc).__name__, "message": str(exc)}
            except Exception as exc:  # noqa: BLE001 - report to the driving test
                result = {"error": type(exc).__name__, "message": traceback.format_exc()}
            # This process's CPU seconds so far (all threads), so a driver can put a CPU cost on
            # what happened between two replies.
            result.setdefault("cpu", time.process_time())
            _reply(result)
            if cmd.get("cmd") == "close":
                break
    finally:
        if session.raw is not None:
            session.raw.close()
        endpoint.close()
        pool.close()
    return 0


class _Session:
    def __init__(self, endpoint: Endpoint, pool: KVPool) -> None:
        self.endpoint = endpoint
        self.pool = pool
        self.conns: list[Connection] = []
        self.transfers: dict[str, Transfer | FanIn] = {}
        self.raw: RawEngine | None = None


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _state(t: Transfer | FanIn) -> list[Any]:
    """[state, error type, error, drained] (drained: a receiver's pages are free of its writes)."""
    return [t.state.name, type(t.error).__name__ if t.error else "", str(t.error or ""), t.drained.is_set()]


def _run(cmd: dict[str, Any], session: _Session) -> dict[str, Any]:
    ep, pool, conns, transfers = session.endpoint, session.pool, session.conns, session.transfers
    op = cmd["cmd"]
    if op == "accept":
        conns.append(ep.accept(cmd.get("timeout", 10)))
        return {"decision": conns[-1].decision.to_dict() if conns[-1].decision else None}
    if op == "connect":
        t0 = time.perf_counter()
        conns.append(ep.connect(cmd["address"], cmd.get("timeout")))
        took = time.perf_counter() - t0
        return {"decision": conns[-1].decision.to_dict() if conns[-1].decision else None, "seconds": took}
    if op == "connects":
        # Handshake cost: connect, then close, ``count`` times; seconds each.
        seconds = []
        for _ in range(cmd["count"]):
            t0 = time.perf_counter()
            c = ep.connect(cmd["address"], cmd.get("timeout"))
            seconds.append(time.perf_counter() - t0)
            c.close("connect benchmark")
        return {"seconds": seconds}
    conn = conns[cmd.get("conn", -1)] if conns else None
    if op == "expect":
        assert conn is not None
        for tag, pages in cmd["transfers"].items():
            transfers[tag] = conn.expect(
                tag, pages, aux=cmd.get("aux", {}).get(tag), state=cmd.get("state", {}).get(tag)
            )
        return {"ok": True}
    if op == "expect_from":
        # One destination fed by several of this side's connections (unequal TP).
        sources = [conns[i] for i in cmd["conns"]]
        for tag, pages in cmd["transfers"].items():
            transfers[tag] = expect_from(sources, tag, pages, aux=cmd.get("aux", {}).get(tag))
        return {"ok": True}
    if op == "fill_heads":
        pool.fill_heads()
        return {"ok": True}
    if op == "check_heads":
        return {"mismatch": pool.check_heads(cmd["src"], cmd["dst"])}
    if op == "send":
        assert conn is not None
        deadline = time.monotonic() + cmd.get("timeout", 10)
        for tag in cmd["transfers"]:
            transfers[tag] = conn.sender(tag)
        for tag, chunks in cmd["transfers"].items():
            t = transfers[tag]
            assert isinstance(t, Transfer)
            while t.state is State.BOOTSTRAPPING and time.monotonic() < deadline:
                time.sleep(0.001)
            for i, chunk in enumerate(chunks):
                last = i == len(chunks) - 1
                extra = {"aux": cmd.get("aux", {}).get(tag), "state": cmd.get("state", {}).get(tag)} if last else {}
                t.send(chunk, last=last, **extra)
        return {"ok": True}
    if op == "wait":
        # ``wait_s``: a driving process's own step timeout (its ``call`` keeps ``timeout``).
        deadline = time.monotonic() + cmd.get("wait_s", cmd.get("timeout", 10))
        for tag in cmd["tags"]:
            try:
                transfers[tag].wait(max(0.0, deadline - time.monotonic()))
            except KVTransportError:
                pass
        return {
            "states": {tag: _state(transfers[tag]) for tag in cmd["tags"]},
            "finished": {tag: transfers[tag].finished for tag in cmd["tags"]},
        }
    if op == "taken":
        # Which driver each transfer took, how long it took on this side (lanes), and when it
        # moved to that driver from a failed one (failover; 0: it did not).
        taken = {
            tag: [
                getattr(transfers[tag], "driver", ""),
                getattr(transfers[tag], "measured_s", 0.0),
                getattr(transfers[tag], "failed_over_at", 0.0),
            ]
            for tag in cmd["tags"]
        }
        return {"taken": taken}
    if op == "state":
        return {"states": {tag: _state(transfers[tag]) for tag in cmd["tags"]}}
    if op == "whereami":
        # What a simulated host must not share with another (tools.simcluster).
        namespaces = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in ("net", "pid", "uts", "ipc", "mnt")}
        return {"hostname": socket.gethostname(), "pid": os.getpid(), "namespaces": namespaces, "host_id": host_id()}
    if op == "cpus":
        return {"cpus": process_cpus()}
    if op == "digests":
        return {"digests": pool.page_digests(cmd["pages"], cmd.get("regions"))}
    if op == "aux_digest":
        return {"digest": pool.aux_digest(cmd["slot"])}
    if op == "state_digests":
        return {"digests": pool.state_digests(cmd["group"], cmd["items"])}
    if op == "abort":
        transfers[cmd["tag"]].abort(cmd.get("reason", "aborted by the peer script"))
        return {"ok": True}
    if op == "forget":
        for tag in cmd["tags"]:
            transfers.pop(tag, None)
        return {"ok": True}
    if op == "trim":
        # Hand the allocator's free pages back to the OS, so RSS shows what is live rather than
        # what zmq and msgpack buffered for a moment (glibc only; elsewhere a no-op).
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        return {"ok": True}
    if op == "metrics":
        return {"metrics": ep.metrics.snapshot()}
    if op == "stats":
        return {"stats": ep.stats(), "process": process_resources()}
    if op == "ring_usage":
        return {name: driver.ring_usage() for name, driver in ep.drivers.items() if hasattr(driver, "ring_usage")}
    if op == "replay":
        # One step of ``bench --trace`` (an open loop: one call a step, never waiting): the new
        # requests' pages announced (the bench poisons and checks them in its pauses); of the
        # ``collect`` ones, those that ended, with when (this side's clock) and how, forgotten.
        assert conn is not None
        for tag, pages in cmd.get("expect", {}).items():
            transfers[tag] = conn.expect(tag, pages)
        ended = {}
        for tag in cmd.get("collect", []):
            t = transfers[tag]
            if t.state.final and t.finished > 0:  # (the I/O thread sets the state, then the time)
                ended[tag] = {"state": _state(t), "finished": t.finished}
                del transfers[tag]
        return {"ended": ended}
    if op == "poison":
        pool.poison(cmd["pages"])
        for group, items in enumerate(cmd.get("state", [])):
            pool.poison_state(group, items)
        return {"ok": True}
    if op == "cpu":
        return {"cpu": time.process_time(), "now": time.monotonic()}
    if op == "raw_open":
        cls = load_driver(cmd["driver"])
        raw_cls = raw_engine_of(cls)
        if raw_cls is None:
            return {"info": None}
        if session.raw is not None:  # one raw engine at a time
            session.raw.close()
            session.raw = None
        session.raw = raw_cls(pool.regions, ep.host)
        return {"info": base64.b64encode(session.raw.info()).decode()}
    if op == "raw_close":
        if session.raw is not None:
            session.raw.close()
            session.raw = None
        return {"ok": True}
    if op == "close":
        return {"ok": True}
    raise ValueError(f"unknown command {op!r}")


if __name__ == "__main__":
    sys.exit(main())
