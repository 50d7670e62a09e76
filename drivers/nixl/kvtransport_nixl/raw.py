"""NIXL used directly, for ``kvtransport bench``'s baseline: one agent per side, one WRITE
transfer of the same descriptors, completion by spinning on ``check_xfer_state``.

The agents run without NIXL's progress thread: the Python API starts it with no delay, so
each raw agent would spin a core for as long as it exists, idle or not, and on a small host
slow down every other path the bench measures beside it. Instead a thread of ours progresses
the agent every 5 ms (UCX needs the target to accept its connection), and the writer
progresses its transfer itself through ``check_xfer_state``."""

from __future__ import annotations

import importlib
import threading
import time
import uuid
from typing import Any

import msgpack
import numpy as np

from kvtransport.spi.memory import RegionSet
from kvtransport.spi.plan import Runs

from .data_path import _keep_exit_safe
from .engine_probe import probe_nixl, quiet_nixl_logging

#: The longest one raw write may take (the bench's requests take well under a second).
WRITE_TIMEOUT_S = 120.0
#: Between two progress calls of an idle raw agent.
PROGRESS_S = 0.005


class RawNixl:
    def __init__(self, regions: RegionSet, host: str) -> None:
        facts = probe_nixl()
        nixl: Any = importlib.import_module(facts.module)
        quiet_nixl_logging()
        _keep_exit_safe()
        self._mem = "VRAM" if regions.kv_kind.is_cuda else "DRAM"
        self._dev = regions.kv_kind.device or 0
        self._agent = nixl.nixl_agent(
            f"raw-{uuid.uuid4().hex[:8]}", nixl.nixl_agent_config(enable_prog_thread=False, backends=[])
        )
        self._agent.create_backend(facts.backend, dict(facts.backend_params))
        self._reg = self._agent.register_memory([(r.ptr, r.length, self._dev, "") for r in regions.all()], self._mem)
        self._peer = ""
        self._peer_dev = 0
        self._lock = threading.Lock()  # one caller of the agent at a time
        #: A transfer that outlived its deadline: kept (releasing it could free what the engine
        #: still writes from), and no further write goes through this agent.
        self._stuck: Any = None
        self._closed = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, name="raw-nixl-progress", daemon=True)
        self._progress.start()

    def _progress_loop(self) -> None:
        while not self._closed.wait(PROGRESS_S):
            with self._lock:
                self._agent.get_new_notifs()

    def info(self) -> bytes:
        with self._lock:
            meta = self._agent.get_agent_metadata()
        data = msgpack.packb({"meta": meta, "device": self._dev})
        assert isinstance(data, bytes)
        return data

    def connect(self, info: bytes) -> None:
        doc = msgpack.unpackb(info)
        with self._lock:
            name = self._agent.add_remote_agent(doc["meta"])
        self._peer = name.decode() if isinstance(name, bytes) else str(name)
        self._peer_dev = int(doc["device"])

    def write(self, runs: Runs) -> None:
        n = len(runs)
        local = np.stack([runs.src, runs.length, np.full(n, self._dev, np.uint64)], axis=1)
        remote = np.stack([runs.dst, runs.length, np.full(n, self._peer_dev, np.uint64)], axis=1)
        with self._lock:
            if self._stuck is not None:
                raise RuntimeError("an earlier NIXL transfer never finished; this raw engine is unusable")
            self._write(local, remote)

    def _write(self, local: Any, remote: Any) -> None:
        handle = self._agent.initialize_xfer(
            "WRITE",
            self._agent.get_xfer_descs(local, self._mem),
            self._agent.get_xfer_descs(remote, self._mem),
            self._peer,
        )
        state = self._agent.transfer(handle)
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        while state == "PROC" and time.monotonic() < deadline:
            state = self._agent.check_xfer_state(handle)
        if state == "PROC":
            # Still running: releasing the handle now could free what the engine writes from.
            self._stuck = handle
            raise RuntimeError(f"NIXL transfer still running after {WRITE_TIMEOUT_S:.0f} s")
        self._agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in {state}")

    def close(self) -> None:
        self._closed.set()
        self._progress.join(5)
        with self._lock:
            self._teardown()

    def _teardown(self) -> None:
        if self._stuck is not None:
            try:
                self._agent.release_xfer_handle(self._stuck)
            except Exception:  # noqa: BLE001 - best effort: the engine may still hold it
                pass
            self._stuck = None
        if self._peer:
            self._agent.remove_remote_agent(self._peer)
        self._agent.deregister_memory(self._reg)
