"""NIXL used directly, for ``kvtransport bench``'s baseline: one agent per side, one WRITE
transfer of the same descriptors, completion by spinning on ``check_xfer_state``."""

from __future__ import annotations

import importlib
import uuid
from typing import Any

import msgpack
import numpy as np

from kvtransport.memory import RegionSet
from kvtransport.plan import Runs

from .data_path import _keep_exit_safe
from .engine_probe import probe_nixl, quiet_nixl_logging


class RawNixl:
    def __init__(self, regions: RegionSet, host: str) -> None:
        facts = probe_nixl()
        nixl: Any = importlib.import_module(facts.module)
        quiet_nixl_logging()
        _keep_exit_safe()
        self._mem = "VRAM" if regions.kv_kind.is_cuda else "DRAM"
        self._dev = regions.kv_kind.device or 0
        self._agent = nixl.nixl_agent(f"raw-{uuid.uuid4().hex[:8]}", nixl.nixl_agent_config(backends=[]))
        self._agent.create_backend(facts.backend, dict(facts.backend_params))
        self._reg = self._agent.register_memory([(r.ptr, r.length, self._dev, "") for r in regions.all()], self._mem)
        self._peer = ""
        self._peer_dev = 0

    def info(self) -> bytes:
        data = msgpack.packb({"meta": self._agent.get_agent_metadata(), "device": self._dev})
        assert isinstance(data, bytes)
        return data

    def connect(self, info: bytes) -> None:
        doc = msgpack.unpackb(info)
        name = self._agent.add_remote_agent(doc["meta"])
        self._peer = name.decode() if isinstance(name, bytes) else str(name)
        self._peer_dev = int(doc["device"])

    def write(self, runs: Runs) -> None:
        n = len(runs)
        local = np.stack([runs.src, runs.length, np.full(n, self._dev, np.uint64)], axis=1)
        remote = np.stack([runs.dst, runs.length, np.full(n, self._peer_dev, np.uint64)], axis=1)
        handle = self._agent.initialize_xfer(
            "WRITE",
            self._agent.get_xfer_descs(local, self._mem),
            self._agent.get_xfer_descs(remote, self._mem),
            self._peer,
        )
        state = self._agent.transfer(handle)
        while state == "PROC":
            state = self._agent.check_xfer_state(handle)
        self._agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in {state}")

    def close(self) -> None:
        if self._peer:
            self._agent.remove_remote_agent(self._peer)
        self._agent.deregister_memory(self._reg)
