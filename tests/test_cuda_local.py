"""``cuda-local``'s host-side logic, which runs without a GPU: translating peer addresses
through the opened IPC mappings, and the aux notice (host-memory slots carried by value)
checked against the receiver's regions before anything is written. The device path itself is
covered by tests/test_gpu.py on a CUDA host."""

from __future__ import annotations

from collections.abc import Mapping

import msgpack
import numpy as np
import pytest

from kvtransport.negotiation.registry import load_driver
from kvtransport.spi.errors import ProtocolError
from kvtransport.spi.inbound import Claim, InboundGuard
from kvtransport.spi.memory import MemoryKind, RegionSet
from kvtransport_cuda.local import _Peer


class _Context:
    """The receiver's side of the context: its real inbound guard, aux slot 1 announced."""

    endpoint_id = "test"
    host = "127.0.0.1"
    options: Mapping[str, str] = {}
    guard: InboundGuard | None = None

    def send_notice(self, peer: str, payload: bytes) -> None:
        raise AssertionError("not expected")

    def check_inbound(self, peer: str, dst: np.ndarray, length: np.ndarray) -> bool:
        assert self.guard is not None
        return self.guard.check(dst, length, "aux destination")


def test_peer_addresses_translate_into_the_mappings_and_host_runs_are_flagged() -> None:
    peer = _Peer(stream=None)
    peer.add(0x10000, 0x1000, 0x90000)  # peer region 1 mapped here at 0x90000
    peer.add(0x20000, 0x2000, 0x70000)
    dst = np.array([0x10000, 0x10FFF, 0x20010, 0x30000, 0x5], dtype=np.uint64)
    mapped, hit = peer.translate(dst)
    assert hit.tolist() == [True, True, True, False, False]
    assert mapped[:3].tolist() == [0x90000, 0x90FFF, 0x70010]


def _receiver(aux: np.ndarray) -> object:
    cls = load_driver("cuda-local")
    context = _Context()
    driver = cls(context)
    kv = np.zeros(4096, dtype=np.uint8)
    regions = RegionSet.from_kv_args(
        [int(kv.ctypes.data)],
        [4096],
        [1024],
        kind=MemoryKind(0),
        aux_data_ptrs=[int(aux.ctypes.data)],
        aux_data_lens=[aux.nbytes],
        aux_item_lens=[64],
    )
    driver._regions = regions  # type: ignore[attr-defined]
    context.guard = InboundGuard(regions)
    context.guard.add(Claim(np.array([], dtype=np.int64), 1))
    return driver


def test_aux_notice_writes_the_bytes_into_the_aux_slot() -> None:
    aux = np.zeros(256, dtype=np.uint8)
    driver = _receiver(aux)
    dst = np.array([aux.ctypes.data + 64], dtype=np.uint64)
    notice = {"op": "aux", "dst": dst.tobytes(), "len": np.array([64], np.uint64).tobytes(), "data": bytes(range(64))}
    driver.on_notice("p", msgpack.packb(notice))  # type: ignore[attr-defined]
    assert aux[64:128].tolist() == list(range(64)) and not aux[:64].any() and not aux[128:].any()


@pytest.mark.parametrize("bad", ["outside", "kv-region", "short-data", "not-msgpack", "unannounced-slot"])
def test_bad_aux_notice_is_refused_and_writes_nothing(bad: str) -> None:
    aux = np.zeros(256, dtype=np.uint8)
    driver = _receiver(aux)
    dst = aux.ctypes.data + (256 if bad == "outside" else 0 if bad == "unannounced-slot" else 64)
    if bad == "kv-region":  # device KV must never be written from a notice
        dst = driver._regions.kv[0].ptr  # type: ignore[attr-defined]
    data = bytes(10) if bad == "short-data" else bytes(64)
    payload = (
        b"\xc1"
        if bad == "not-msgpack"
        else msgpack.packb(
            {
                "op": "aux",
                "dst": np.array([dst], np.uint64).tobytes(),
                "len": np.array([64], np.uint64).tobytes(),
                "data": data,
            }
        )
    )
    with pytest.raises(ProtocolError, match="bad aux notice"):
        driver.on_notice("p", payload)  # type: ignore[attr-defined]
    assert not aux.any()


def test_a_departed_peer_is_fenced_only_once_its_process_has_ended() -> None:
    """The peer's copies into this side's exported memory cannot be revoked: ``fence`` answers
    ``True`` only once the process its connection info named has ended (asked again after
    ``disconnect`` while the pages are held)."""
    import subprocess
    import sys

    from kvtransport.spi import process_sockets

    driver = load_driver("cuda-local")(_Context())  # type: ignore[abstract, arg-type]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = process_sockets.process_start(child.pid)
        assert start is not None
        driver._processes["p"] = (process_sockets.kernel_and_pid_namespace(), child.pid, start)  # type: ignore[attr-defined]
        assert not driver.fence("p")
        driver.disconnect("p")  # no stream opened: only the process is remembered
        assert not driver.fence("p"), "fenced while the peer process still runs"
    finally:
        child.kill()
        child.wait()
    assert driver.fence("p")
    assert not driver.fence("unknown"), "a peer whose process is unknown cannot be fenced"
