"""The SGLang backend against SGLang's real base classes (sglang==0.5.23 installed with
--no-deps): a prefill rank in a child process (tests/sglang_rank.py, which also runs the
bootstrap server) and a decode rank here, replaying the schedulers' call sequences over real
drivers on host memory, with the KV and aux bytes verified on the decode side."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from .conftest import require_engines

sglang_conn = pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="sglang==0.5.23 not installed")
KVPoll = sglang_conn.KVPoll

from kvtransport.integrations.sglang import (  # noqa: E402 - needs SGLang, checked just above
    KVTransferError,
    KVTransportKVManager,
    KVTransportKVReceiver,
    KVTransportKVSender,
)
from kvtransport.spi.errors import KVTransportError  # noqa: E402
from kvtransport.tools.kv_pool import KVPool  # noqa: E402
from kvtransport.tools.peer_process import PeerProcess  # noqa: E402

from .sglang_rank import kv_args, poll_until, server_args  # noqa: E402

PAGES, LAYERS, ITEM, AUX = 256, 4, 4096, 16
FAST = {"KVTRANSPORT_HEARTBEAT_INTERVAL": "0.2", "KVTRANSPORT_HEARTBEAT_TIMEOUT": "2"}


def test_the_backend_subclasses_sglangs_own_classes() -> None:
    base = sglang_conn
    assert issubclass(KVTransportKVManager, base.BaseKVManager)
    assert issubclass(KVTransportKVSender, base.BaseKVSender)
    assert issubclass(KVTransportKVReceiver, base.BaseKVReceiver)
    from kvtransport.integrations.sglang import KVTransportKVBootstrapServer

    assert issubclass(KVTransportKVBootstrapServer, base.BaseKVBootstrapServer)
    # Nothing abstract left: SGLang can instantiate every class.
    for cls in (KVTransportKVManager, KVTransportKVSender, KVTransportKVReceiver, KVTransportKVBootstrapServer):
        assert not getattr(cls, "__abstractmethods__", None), cls


def test_importing_without_sglang_names_the_package_and_version() -> None:
    code = "import sys; sys.modules['sglang'] = None; import kvtransport.integrations.sglang"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "sglang==0.5.23" in proc.stderr


@dataclass
class Ranks:
    prefill: PeerProcess
    decode: KVTransportKVManager
    pool: KVPool
    bootstrap: str

    def receiver(self, room: int) -> KVTransportKVReceiver:
        r = KVTransportKVReceiver(self.decode, self.bootstrap, room)
        r.init(0)
        return r


class _PrefillRank:
    """One prefill rank process per driver, shared by this module's tests (starting one, which
    imports SGLang, costs seconds); a test that kills it gets a fresh one for the next test.
    Every test uses rooms of its own, and each gets a fresh decode manager."""

    def __init__(self, driver: str) -> None:
        self.driver = driver
        self.env = {"KVTRANSPORT_DRIVER": driver, **FAST}
        self.process: PeerProcess | None = None

    def alive(self) -> PeerProcess:
        if self.process is not None and self.process.proc.poll() is not None:
            self.process.close()
            self.process = None
        if self.process is None:
            self.process = PeerProcess(
                *("--pages", str(PAGES), "--layers", str(LAYERS), "--item", str(ITEM), "--aux-slots", str(AUX)),
                module="tests.sglang_rank",
                env={**os.environ, **self.env},
            )
        return self.process

    def close(self) -> None:
        if self.process is not None:
            self.process.close()


@pytest.fixture(scope="module", params=["nixl-ucx", "mooncake-gdr"])
def prefill_rank(request: pytest.FixtureRequest) -> Iterator[_PrefillRank]:
    require_engines()
    rank = _PrefillRank(str(request.param))
    try:
        yield rank
    finally:
        rank.close()


@pytest.fixture
def ranks(prefill_rank: _PrefillRank, monkeypatch: pytest.MonkeyPatch) -> Iterator[Ranks]:
    for k, v in prefill_rank.env.items():
        monkeypatch.setenv(k, v)
    prefill = prefill_rank.alive()
    pool = KVPool(PAGES, LAYERS, ITEM, AUX, shared=False)
    try:
        mgr = KVTransportKVManager(kv_args(pool, role="decode"), "decode", server_args(0))
    except Exception:
        pool.close()
        raise
    try:
        yield Ranks(prefill, mgr, pool, prefill.address)
    finally:
        mgr.teardown()
        pool.close()


def _check_bytes(r: Ranks, src: list[int], dst: list[int]) -> None:
    assert r.pool.page_digests(dst) == r.prefill.call("digests", pages=src)["digests"]


def test_single_request_with_aux(ranks: Ranks) -> None:
    rx = ranks.receiver(7)
    assert poll_until(rx, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
    assert rx.mgr.endpoint.connections  # one connection to the prefill rank
    dst, src = list(range(100, 140)), list(range(0, 40))
    rx.send_metadata(np.array(dst, dtype=np.int32), aux_index=3)
    out = ranks.prefill.call("send", requests=[{"room": 7, "chunks": [src], "aux": 11}])["states"]
    assert out["7"][0] == "SUCCESS", out
    assert out["7"][2] == 40 * LAYERS * ITEM + 64  # the transfer metric counts KV and aux bytes
    assert poll_until(rx, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    _check_bytes(ranks, src, dst)
    assert ranks.pool.aux_digest(3) == ranks.prefill.call("aux_digest", slot=11)["digest"]


def test_sixty_four_concurrent_requests_chunked_with_aux(ranks: Ranks) -> None:
    rng = np.random.default_rng(64)
    free = rng.permutation(PAGES).tolist()
    requests, receivers, expect = [], {}, {}
    for room in range(1000, 1064):
        n = int(rng.integers(1, 4))
        dst, free = free[:n], free[n:]
        src = rng.choice(PAGES, n, replace=False).tolist()
        cut = sorted(rng.choice(range(1, n + 1), min(2, n), replace=False).tolist()) if n > 1 else [n]
        chunks = [src[a:b] for a, b in zip([0, *cut], [*cut, n], strict=False) if b > a] or [src]
        rx = ranks.receiver(room)
        poll_until(rx, {KVPoll.WaitingForInput})
        aux = room % AUX
        rx.send_metadata(np.array(dst, dtype=np.int32), aux_index=aux)
        receivers[room] = rx
        expect[room] = (src, dst, aux, (room * 7) % AUX)
        requests.append({"room": room, "chunks": chunks, "aux": (room * 7) % AUX})
    out = ranks.prefill.call("send", requests=requests, timeout=90)["states"]
    assert all(v[0] == "SUCCESS" for v in out.values()), out
    for room, rx in receivers.items():
        assert poll_until(rx, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
        src, dst, _, _ = expect[room]
        _check_bytes(ranks, src, dst)
    # Aux slots are shared by rooms here (64 rooms, 16 slots): the last writer wins; check one
    # room per slot that nobody overwrote after it.
    last_room_per_slot = {expect[room][2]: room for room in sorted(expect)}
    for slot, room in last_room_per_slot.items():
        assert ranks.pool.aux_digest(slot) == ranks.prefill.call("aux_digest", slot=expect[room][3])["digest"]


def test_abort_from_decode_reaches_prefill(ranks: Ranks) -> None:
    rx = ranks.receiver(21)
    poll_until(rx, {KVPoll.WaitingForInput})
    rx.send_metadata(np.array([1, 2, 3], dtype=np.int32), aux_index=0)
    rx.abort()
    assert rx.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError, match="aborted by the decode scheduler"):
        rx.failure_exception()
    out = ranks.prefill.call("send", requests=[{"room": 21, "chunks": [[4, 5, 6]], "aux": 1}], timeout=10)["states"]
    assert out["21"][0] == "FAILED" and "aborted by the decode scheduler" in out["21"][1], out


def test_abort_from_prefill_reaches_decode(ranks: Ranks) -> None:
    rx = ranks.receiver(22)
    poll_until(rx, {KVPoll.WaitingForInput})
    rx.send_metadata(np.array([1, 2, 3], dtype=np.int32), aux_index=0)
    out = ranks.prefill.call("send", requests=[{"room": 22, "chunks": [[4, 5, 6]], "abort": True}], timeout=10)
    assert out["states"]["22"][0] == "FAILED"
    assert poll_until(rx, {KVPoll.Success, KVPoll.Failed}, 5) == KVPoll.Failed
    with pytest.raises(KVTransferError, match=r"TransferAborted.*aborted by the prefill scheduler"):
        rx.failure_exception()


def test_a_retracted_request_sglang_bootstraps_again_fails_with_the_reason(ranks: Ranks) -> None:
    """SGLang's decode asks the manager to have prefill recompute a retracted request
    (decode.py, _submit_prefill_recompute, with Req.build_rebootstrap_payload()). The backend
    does not serve that yet: the room fails at once with the reason, and prefill hears of it,
    rather than decode waiting for KV that never comes."""
    rx = ranks.receiver(23)
    poll_until(rx, {KVPoll.WaitingForInput})
    rx.send_metadata(np.array([1, 2, 3], dtype=np.int32), aux_index=0)
    ranks.decode.submit_prefill_recompute(rx, {"rid": "r23", "bootstrap_room": 23})
    assert rx.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError, match="cannot have prefill recompute a retracted request"):
        rx.failure_exception()
    out = ranks.prefill.call("send", requests=[{"room": 23, "chunks": [[4, 5, 6]], "aux": 1}], timeout=10)["states"]
    assert out["23"][0] == "FAILED" and "retracted" in out["23"][1], out


def _held_until_drained(rx: KVTransportKVReceiver, timeout: float = 10.0) -> bool:
    """SGLang's deferred release, as decode.py drives it on a Failed room: notify, then ask the
    manager every loop whether the pages may be freed."""
    mgr = rx.kv_mgr
    assert mgr.enable_deferred_decode_kv_release and mgr.supports_deferred_decode_kv_release
    rx.ensure_abort_notified(force_arm=True)
    if not rx.abort_notified:
        return False
    required = len(rx.bootstrap_infos)
    deadline = time.monotonic() + timeout
    while not mgr.is_abort_release_safe(rx.room, required):
        assert time.monotonic() < deadline, "prefill never confirmed that its writes stopped"
        time.sleep(0.01)
    mgr.clear_deferred_abort_state(rx.room)
    return True


@pytest.mark.parametrize("who", ["decode", "prefill"])
def test_a_failed_room_is_held_until_prefill_confirms_its_writes_stopped(ranks: Ranks, who: str) -> None:
    room = 41 if who == "decode" else 42
    rx = ranks.receiver(room)
    poll_until(rx, {KVPoll.WaitingForInput})
    rx.send_metadata(np.array([7, 8, 9], dtype=np.int32), aux_index=0)
    if who == "decode":
        rx.abort()  # before prefill created its sender: its endpoint answers the abort itself
    else:
        request = {"room": room, "chunks": [[4, 5, 6]], "abort": True}
        assert ranks.prefill.call("send", requests=[request], timeout=10)["states"][str(room)][0] == "FAILED"
    assert poll_until(rx, {KVPoll.Success, KVPoll.Failed}, 5) == KVPoll.Failed
    assert len(rx.bootstrap_infos) == 1
    assert _held_until_drained(rx)
    assert rx.transfer is not None and rx.transfer.drained.is_set()


def test_a_room_that_failed_before_its_metadata_is_not_held(ranks: Ranks) -> None:
    rx = ranks.receiver(43)
    poll_until(rx, {KVPoll.WaitingForInput})
    rx.abort()
    assert rx.poll() == KVPoll.Failed
    assert rx.bootstrap_infos == [] and not _held_until_drained(rx)
    # ... and the prefill rank hears of it at once, not at its bootstrap timeout (300 s).
    start = time.monotonic()
    out = ranks.prefill.call("send", requests=[{"room": 43, "chunks": [[1, 2]]}], timeout=10)["states"]
    assert out["43"][0] == "FAILED" and "aborted by the decode scheduler" in out["43"][1], out
    assert time.monotonic() - start < 5


def test_decode_waiting_timeout(ranks: Ranks, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode rank announced its pages; the prefill never sends: Failed with a timeout
    after KVTRANSPORT_WAITING_TIMEOUT (+ the transfer timeout on the receiving side)."""
    monkeypatch.setenv("KVTRANSPORT_WAITING_TIMEOUT", "0.5")
    monkeypatch.setenv("KVTRANSPORT_TRANSFER_TIMEOUT", "0.5")
    pool = KVPool(PAGES, LAYERS, ITEM, AUX, shared=False)
    mgr = KVTransportKVManager(kv_args(pool, role="decode"), "decode", server_args(0))
    try:
        rx = KVTransportKVReceiver(mgr, ranks.bootstrap, 40)
        rx.init(0)
        poll_until(rx, {KVPoll.WaitingForInput})
        rx.send_metadata(np.array([5], dtype=np.int32), aux_index=0)
        start = time.monotonic()
        assert poll_until(rx, {KVPoll.Success, KVPoll.Failed}, 10) == KVPoll.Failed
        assert 0.9 <= time.monotonic() - start < 5
        with pytest.raises(KVTransferError, match="TransferTimeout"):
            rx.failure_exception()
    finally:
        mgr.teardown()
        pool.close()


def test_different_tp_sizes_without_the_models_heads_are_refused_clearly(ranks: Ranks) -> None:
    """Prefill TP 1 feeds decode TP 2 by slicing heads, which needs the model's KV head count
    (SGLang's ``total_kv_head_num``): a prefill that does not state it fails each request with
    the reason, at the handshake."""
    pool = KVPool(PAGES, LAYERS, ITEM, AUX, shared=False)
    mgr = KVTransportKVManager(kv_args(pool, role="decode"), "decode", server_args(0, tp_size=2))
    try:
        rx = KVTransportKVReceiver(mgr, ranks.bootstrap, 50)
        rx.init(0)  # returns at once: the lookup and connect run on the manager's workers
        assert poll_until(rx, {KVPoll.Failed}, 30) == KVPoll.Failed
        with pytest.raises(KVTransferError, match=r"LayoutMismatch: .*tp_size: 2 .* 1 .*neither side states"):
            rx.failure_exception()
    finally:
        mgr.teardown()
        pool.close()


def test_a_room_goes_only_to_the_decode_rank_the_registry_pairs_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill rank 0 of TP 2. Decode rank 1 (of the deployment, holding its secret) skips the
    registry, dials prefill rank 0 and announces room 77 first: prefill fails that room rather
    than send rank 0's KV to rank 1, and rank 1 hears so at once. Decode rank 0, which the
    registry pairs with prefill rank 0, gets room 78, every byte right."""
    require_engines()
    from kvtransport.integrations.bootstrap import BootstrapClient
    from kvtransport.spi.errors import TransferAborted

    env = {"KVTRANSPORT_DRIVER": "nixl-ucx", **FAST}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    prefill = PeerProcess(
        *("--pages", str(PAGES), "--layers", str(LAYERS), "--item", str(ITEM), "--aux-slots", str(AUX)),
        *("--tp-size", "2"),
        module="tests.sglang_rank",
        env={**os.environ, **env},
    )
    pools = [KVPool(PAGES, LAYERS, ITEM, AUX, shared=False) for _ in range(2)]
    managers: list[KVTransportKVManager] = []
    try:
        for rank, pool in enumerate(pools):
            managers.append(
                KVTransportKVManager(kv_args(pool, rank=rank, role="decode"), "decode", server_args(0, tp_size=2))
            )
        route = BootstrapClient(prefill.address).lookup(0, 0, 10)
        wrong = managers[1].endpoint.connect(route["address"])
        stolen = wrong.expect("77", [1, 2])
        out = prefill.call("send", requests=[{"room": 77, "chunks": [[3, 4]]}])["states"]
        assert out["77"][0] == "FAILED" and "announced by the wrong rank" in out["77"][1], out
        with pytest.raises(TransferAborted, match="not paired with this rank"):
            stolen.wait(10)
        assert pools[1].page_digests([1, 2]) != prefill.call("digests", pages=[3, 4])["digests"]
        rx = KVTransportKVReceiver(managers[0], prefill.address, 78)
        rx.init(0)
        assert poll_until(rx, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
        rx.send_metadata(np.array([10, 11], dtype=np.int32))
        out = prefill.call("send", requests=[{"room": 78, "chunks": [[5, 6]]}])["states"]
        assert out["78"][0] == "SUCCESS", out
        assert poll_until(rx, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
        assert pools[0].page_digests([10, 11]) == prefill.call("digests", pages=[5, 6])["digests"]
    finally:
        prefill.close()
        for mgr in managers:
            mgr.teardown()
        for pool in pools:
            pool.close()


def test_a_decode_on_another_secret_fails_the_prefill_request_early_and_leaves_the_others_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Prefill and a decode rank on the deployment's secret, a second decode rank on another
    one, all through SGLang's real classes (prefill here too, to read its log and metrics).
    The misconfigured decode fails its room 1 at once (AuthenticationFailed); prefill's room 1,
    which hears nothing from it, fails after the grace with the reason, not at SGLang's 300 s
    bootstrap timeout. Room 2, whose decode holds the secret, arrives while another
    attempt fails authentication and waits past the grace: it is unaffected, every byte right."""
    require_engines()
    import logging

    from kvtransport.integrations.sglang import KVTransportKVBootstrapServer

    good, other = "test-sglang-deployment-secret-000001", "test-sglang-another-secret-0000002"
    env = {"KVTRANSPORT_DRIVER": "nixl-ucx", **FAST, "KVTRANSPORT_AUTH_FAILURE_GRACE": "1", "KVTRANSPORT_SECRET": good}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    pools = [KVPool(PAGES, LAYERS, ITEM, AUX, shared=False) for _ in range(3)]
    pools[0].fill(seed=5)
    server = KVTransportKVBootstrapServer("127.0.0.1", 0)
    managers: list[KVTransportKVManager] = []
    try:
        prefill = KVTransportKVManager(kv_args(pools[0]), "prefill", server_args(server.port))
        managers.append(prefill)
        decode = KVTransportKVManager(kv_args(pools[1], role="decode"), "decode", server_args(0))
        managers.append(decode)
        monkeypatch.setenv("KVTRANSPORT_SECRET", other)  # read when a manager's endpoint starts
        wrong = KVTransportKVManager(kv_args(pools[2], role="decode"), "decode", server_args(0))
        managers.append(wrong)
        assert prefill.timeouts.bootstrap == 300 and prefill.timeouts.auth_grace == 1
        addr = f"127.0.0.1:{server.port}"
        with caplog.at_level(logging.WARNING, logger="kvtransport"):
            tx = KVTransportKVSender(prefill, addr, 1)
            lost = KVTransportKVReceiver(wrong, addr, 1)
            lost.init(0)
            assert poll_until(lost, {KVPoll.Failed}, 10) == KVPoll.Failed
            with pytest.raises(KVTransferError, match="refused the connection: authentication failed"):
                lost.failure_exception()
            assert tx.poll() == KVPoll.Bootstrapping
            # Room 2 and, at the same moment, another attempt on the wrong secret.
            kept_at = time.monotonic()
            kept = KVTransportKVSender(prefill, addr, 2)
            stray = KVTransportKVReceiver(wrong, addr, 3)
            stray.init(0)
            rx = KVTransportKVReceiver(decode, addr, 2)
            rx.init(0)
            assert poll_until(rx, {KVPoll.WaitingForInput}, 10) == KVPoll.WaitingForInput
            rx.send_metadata(np.array([20, 21, 22], dtype=np.int32), aux_index=2)
            assert poll_until(stray, {KVPoll.Failed}, 10) == KVPoll.Failed
            assert poll_until(tx, {KVPoll.Failed}, 30) == KVPoll.Failed  # the grace, not 300 s
            with pytest.raises(KVTransferError) as failed:
                tx.failure_exception()
            reason = str(failed.value)
            assert "connections to this prefill rank are failing authentication (2 in the last 60 s" in reason
            assert "last from 127.0.0.1" in reason and "KVTRANSPORT_SECRET / KVTRANSPORT_SECRET_FILE" in reason
            # Room 2 waited past the grace too (announced, held by prefill's "forward"): untouched.
            assert poll_until(kept, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
            time.sleep(max(0.0, 1.2 - (time.monotonic() - kept_at)))
            assert kept.poll() == KVPoll.WaitingForInput
            kept.init(3, 7)
            kept.send(np.array([30, 31, 32], dtype=np.int64), [])
            assert poll_until(kept, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
            assert poll_until(rx, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
        assert pools[1].page_digests([20, 21, 22]) == pools[0].page_digests([30, 31, 32])
        assert pools[1].aux_digest(2) == pools[0].aux_digest(7)
        auth = prefill.endpoint.metrics.snapshot()["auth"]
        assert auth["failures"] == 2 and auth["last_from"] == "127.0.0.1"
        assert prefill.endpoint.stats()["auth_failures_recent"] == 2
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        endpoint_says = [m for m in warnings if m.startswith("connections to endpoint sglang-prefill")]
        assert len(endpoint_says) == 1 and "failing authentication: 1 in the last 60 s" in endpoint_says[0], warnings
        assert sum("Room 1 fails now, not at the bootstrap timeout (300 s)" in m for m in warnings) == 1, warnings
    finally:
        for mgr in managers:
            mgr.teardown()
        server.close()
        for pool in pools:
            pool.close()


def test_a_last_chunk_without_pages_still_ends_the_transfer(ranks: Ranks) -> None:
    """Chunked prefill whose final segment holds no new page: SGLang asks
    ``should_send_kv_chunk(0, last=True)`` (yes, as its own backends answer) and sends it. The
    chunk that completed the page count was not the last one (SGLang writes the aux row only just
    before its last send), so the empty last chunk is what carries the aux row and ends the
    transfer: every byte and the aux row right."""
    rx = ranks.receiver(24)
    assert poll_until(rx, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
    dst, src = list(range(60, 70)), list(range(10, 20))
    rx.send_metadata(np.array(dst, dtype=np.int32), aux_index=2)
    out = ranks.prefill.call("send", requests=[{"room": 24, "chunks": [src, []], "aux": 5}])["states"]
    assert out["24"][0] == "SUCCESS", out
    assert poll_until(rx, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    _check_bytes(ranks, src, dst)
    assert ranks.pool.aux_digest(2) == ranks.prefill.call("aux_digest", slot=5)["digest"]


def test_with_a_decode_side_prefix_only_the_pages_after_it_move(ranks: Ranks) -> None:
    """Decode's radix cache holds the first 32 tokens (2 pages): it announces only the pages
    after them with ``decode_prefix_len=32``; prefill reads the length (``pop_decode_prefix_len``,
    once), sends the suffix, and decode's cached pages stay as they were."""
    rx = ranks.receiver(51)
    assert poll_until(rx, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
    cached = [200, 201]
    before = ranks.pool.page_digests(cached)
    dst, src = list(range(202, 208)), list(range(52, 58))
    rx.send_metadata(np.array(dst, dtype=np.int32), aux_index=6, decode_prefix_len=32)
    out = ranks.prefill.call("send", requests=[{"room": 51, "chunks": [src], "aux": 7}])["states"]
    assert out["51"][0] == "SUCCESS" and out["51"][3] == 32, out
    assert poll_until(rx, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    _check_bytes(ranks, src, dst)
    assert ranks.pool.page_digests(cached) == before
    assert ranks.pool.aux_digest(6) == ranks.prefill.call("aux_digest", slot=7)["digest"]


def test_pages_wait_for_the_forward_sglang_asked_the_sender_to_wait_for(ranks: Ranks) -> None:
    """Under overlap scheduling SGLang's prefill hands the sender an event on
    ``_early_send_wait_event`` (the previous forward may still be writing the prefix pages):
    no byte of the room may reach decode before that event completes."""
    import threading

    delay = 0.8
    rx = ranks.receiver(31)
    assert poll_until(rx, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
    dst, src = list(range(150, 160)), list(range(30, 40))
    expected = ranks.prefill.call("digests", pages=src)["digests"]
    assert ranks.pool.page_digests(dst) != expected
    rx.send_metadata(np.array(dst, dtype=np.int32), aux_index=1)
    landed: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set() and not landed:
            if any(a == b for a, b in zip(ranks.pool.page_digests(dst), expected, strict=True)):
                landed.append(time.monotonic())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    start = time.monotonic()
    watcher.start()
    try:
        request = {"room": 31, "chunks": [src], "aux": 4, "prefix_event_s": delay}
        out = ranks.prefill.call("send", requests=[request])["states"]
    finally:
        time.sleep(0.05)
        stop.set()
        watcher.join(5)
    assert out["31"][0] == "SUCCESS", out
    assert poll_until(rx, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    assert landed and landed[0] - start >= delay * 0.75, f"pages landed {landed[0] - start:.3f} s in"
    _check_bytes(ranks, src, dst)


def test_decode_scheduler_calls_never_block_and_fill_the_prefill_info_table(ranks: Ranks) -> None:
    """What SGLang's decode scheduler calls first for every request (decode.py:
    ``prefill_info_table.get``, ``try_ensure_parallel_info`` about once a second, then the
    receiver's ``init``): each returns at once; the table fills in the background; a failed
    transfer's ``receiver.kv_mgr`` is the manager (SGLang reads its deferred-release flag)."""
    mgr = ranks.decode
    assert mgr.prefill_info_table.get(ranks.bootstrap) is None
    t0 = time.monotonic()
    first = mgr.try_ensure_parallel_info(ranks.bootstrap)
    # Against this live registry even a waiting call would be quick: the dead address below is
    # what catches one (its lookup would wait for seconds); 1 s leaves room for a loaded
    # machine's thread start and hand-off.
    assert time.monotonic() - t0 < 1.0
    deadline = time.monotonic() + 10
    while not mgr.try_ensure_parallel_info(ranks.bootstrap):
        assert time.monotonic() < deadline, "the prefill info never arrived"
        time.sleep(0.05)
    info = mgr.prefill_info_table[ranks.bootstrap]
    assert (info.dp_size, info.follow_bootstrap_room, info.tp_size) == (1, True, 1) and first in (False, True)
    # Nobody at this address: still no wait, and no entry.
    dead = "127.0.0.1:9"
    t0 = time.monotonic()
    for _ in range(3):
        assert mgr.try_ensure_parallel_info(dead) is False
    rx = KVTransportKVReceiver(mgr, dead, 99)
    rx.init(0)
    assert time.monotonic() - t0 < 1.0, "a scheduler call waited for the registry"
    assert rx.poll() == KVPoll.Bootstrapping
    assert rx.kv_mgr is mgr and rx.kv_mgr.enable_deferred_decode_kv_release is True  # SGLang's default


def test_sglangs_timeout_variables_are_honoured() -> None:
    from kvtransport.integrations.sglang import sglang_timeouts

    assert sglang_timeouts({}).bootstrap == 300 and sglang_timeouts({}).waiting == 300
    theirs = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "120", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "90"}
    assert (sglang_timeouts(theirs).bootstrap, sglang_timeouts(theirs).waiting) == (120, 90)
    ours = {**theirs, "KVTRANSPORT_BOOTSTRAP_TIMEOUT": "7"}
    assert (sglang_timeouts(ours).bootstrap, sglang_timeouts(ours).waiting) == (7, 90)


def test_a_decode_managers_tables_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A router naming endless bootstrap addresses must not grow a decode rank's tables."""
    import kvtransport.integrations.sglang.manager as adapter

    monkeypatch.setattr(adapter, "MAX_PREFILL_PEERS", 3)
    pool = KVPool(PAGES, LAYERS, ITEM, AUX, shared=False)
    mgr = KVTransportKVManager(kv_args(pool, role="decode"), "decode", server_args(0))
    try:
        for port in range(20):
            assert mgr.try_ensure_parallel_info(f"127.0.0.1:{port + 1}") is False
            mgr.connect_soon(f"127.0.0.1:{port + 1}", 0)
        assert len(mgr._lookups) <= 3 and len(mgr._connects) <= 3
        assert len(mgr._routes) <= 3 and len(mgr.prefill_info_table) <= 3
    finally:
        mgr.teardown()
        pool.close()


@pytest.mark.parametrize("unserved", ["dsa", "c128_state"])
def test_a_pool_with_state_kvtransport_does_not_move_is_refused_at_start_up(unserved: str) -> None:
    """SGLang builds KVArgs with one state group per state type (utils.py, append_state_component).
    SWA and Mamba are served; any other type stops the manager with the reason, before an
    endpoint exists, rather than failing every request of that model."""
    state_type = sglang_conn.StateType
    pool = KVPool(PAGES, LAYERS, ITEM, AUX, shared=False, state=((16, 256, 2), (8, 512, 1)))
    try:
        for types, error in (([state_type.SWA, state_type(unserved)], unserved), ([state_type.MAMBA], "groups")):
            args = kv_args(pool, role="decode")
            args.state_types = types
            groups = pool.state_buffers
            args.state_data_ptrs = [[b.ptr for b in g] for g in groups]
            args.state_data_lens = [[b.size for b in g] for g in groups]
            args.state_item_lens = [[item] * n for (_, item, n) in pool.state]
            with pytest.raises(KVTransportError, match=error):
                KVTransportKVManager(args, "decode", server_args(0))
        args.state_types = [state_type.SWA, state_type.MAMBA]
        mgr = KVTransportKVManager(args, "decode", server_args(0))
        try:
            assert mgr.endpoint.regions.state_groups == (2, 1)
            assert mgr.endpoint.layout.state_types == ("swa", "mamba")
            assert mgr.endpoint.layout.state_item_lens == ((256, 256), (512,))
        finally:
            mgr.teardown()
    finally:
        pool.close()


def test_pipeline_parallelism_is_refused_at_start_up() -> None:
    """PP > 1 would reach the backend as an AttributeError on the first poll
    (poll_pp_consensus); it is refused when the manager starts, with the reason."""
    pool = KVPool(PAGES, LAYERS, ITEM, AUX, shared=False)
    try:
        args = server_args(0)
        args.pp_size = 2
        with pytest.raises(KVTransportError, match=r"pipeline parallelism \(pp_size 2\)"):
            KVTransportKVManager(kv_args(pool, role="decode"), "decode", args)
    finally:
        pool.close()


def test_the_prefill_complete_allocation_policy_is_refused_at_start_up() -> None:
    """--disaggregation-decode-allocation-policy prefill_complete (decode reads the receiver's
    conclude_state, prefill calls mark_prefill_complete): SGLang's own argument check refuses it
    for backends other than Mooncake (test_sglang_plugin); a server-args object that skipped
    that check is refused when the manager starts, naming the flag, on either side."""
    pool = KVPool(PAGES, LAYERS, ITEM, AUX, shared=False)
    try:
        for role in ("prefill", "decode"):
            args = server_args(0)
            args.disaggregation_decode_allocation_policy = "prefill_complete"
            with pytest.raises(KVTransportError, match="--disaggregation-decode-allocation-policy prefill_complete"):
                KVTransportKVManager(kv_args(pool, role=role), role, args)
    finally:
        pool.close()


def test_dp_attention_without_sglangs_published_configuration_is_refused() -> None:
    """Outside SGLang's scheduler (nothing published), KVArgs' engine_rank is the global TP
    rank on prefill and the attention-TP rank on decode, and neither says the attention-DP
    rank: under DP attention the backend refuses rather than pair the wrong ranks. Without DP
    attention engine_rank is the attention-TP rank on both sides."""
    from kvtransport.integrations.sglang_topology import rank_topology
    from kvtransport.spi.errors import ConfigError

    pool = KVPool(PAGES, LAYERS, ITEM, AUX, shared=False)
    try:
        args = server_args(0, tp_size=4, dp_size=2)
        args.enable_dp_attention = True
        with pytest.raises(ConfigError, match="DP attention is on"):
            rank_topology(kv_args(pool, rank=3), args)
        args.enable_dp_attention = False
        topo = rank_topology(kv_args(pool, rank=3), args)
        assert (topo.attn_tp_rank, topo.attn_tp_size, topo.resolved) == (3, 4, False)
    finally:
        pool.close()


# Last in the module: it kills the shared prefill rank.
def test_prefill_killed_mid_transfer_fails_decode_with_peer_lost(ranks: Ranks) -> None:
    rooms = list(range(130, 138))
    receivers = {}
    for i, room in enumerate(rooms):
        rx = ranks.receiver(room)
        poll_until(rx, {KVPoll.WaitingForInput})
        rx.send_metadata(np.arange(i * 32, i * 32 + 32, dtype=np.int32), aux_index=0)
        receivers[room] = rx
    # The prefill scheduler starts every request but only one is given chunks before it dies.
    ranks.prefill.call("send", requests=[{"room": rooms[0], "chunks": [list(range(16))]}], wait=False)
    start = time.monotonic()
    ranks.prefill.kill()
    for rx in receivers.values():
        assert poll_until(rx, {KVPoll.Success, KVPoll.Failed}, 10) == KVPoll.Failed
    assert time.monotonic() - start < 6
    with pytest.raises(KVTransferError, match="PeerLost"):
        receivers[rooms[-1]].failure_exception()
