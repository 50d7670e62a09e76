"""Many endpoints in one child process, driven by JSON lines on stdin (for the lifecycle tests).

Each endpoint has its own small KV pool in shared memory (the fake driver maps the peer's) and
plays the decode side: it connects to the endpoint under test, announces page 0 of its pool
under the tag ``<prefix>-<i>`` and waits for it. The test kills this process with SIGKILL, or
closes every endpoint cleanly, and checks that the endpoint under test forgets them all.
Commands: ``connect`` (address, n), ``expect`` (prefix), ``wait`` (prefix, timeout) -> digests,
``close``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from kvtransport.runtime.endpoint import Endpoint, Timeouts
from kvtransport.spi.errors import KVTransportError
from kvtransport.testing.fake import FakeDriver
from kvtransport.tools.kv_pool import KVPool


def main() -> int:
    timeouts = Timeouts(**json.loads(sys.argv[1])) if len(sys.argv) > 1 else Timeouts()
    pools: list[KVPool] = []
    endpoints: list[Endpoint] = []
    conns: list[Any] = []
    transfers: list[Any] = []
    print(json.dumps({"address": "", "name": "swarm"}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["cmd"]
        try:
            if op == "connect":
                for i in range(cmd["n"]):
                    pool = KVPool(4, 1, 4096, 0)
                    ep = Endpoint(
                        pool.regions, pool.layout, drivers={"fake": FakeDriver}, name=f"swarm-{i}", timeouts=timeouts
                    )
                    pools.append(pool)
                    endpoints.append(ep)
                    conns.append(ep.connect(cmd["address"]))
                reply: dict[str, Any] = {"ok": len(conns)}
            elif op == "expect":
                transfers = [c.expect(f"{cmd['prefix']}-{i}", [0]) for i, c in enumerate(conns)]
                reply = {"ok": len(transfers)}
            elif op == "wait":
                states = []
                for t in transfers:
                    try:
                        states.append(t.wait(cmd.get("wait_s", 20)).name)
                    except KVTransportError as exc:
                        states.append(f"{type(exc).__name__}: {exc}")
                reply = {"states": states, "digests": [p.page_digests([0])[0] for p in pools]}
            elif op == "close":
                for ep in endpoints:
                    ep.close()
                for pool in pools:
                    pool.close()
                print(json.dumps({"ok": True}), flush=True)
                return 0
            else:
                reply = {"error": "ValueError", "message": f"unknown command {op!r}"}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            reply = {"error": type(exc).__name__, "message": str(exc)}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
