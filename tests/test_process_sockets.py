"""spi.process_sockets: finding an engine's listeners, severing the connections accepted on
them (and only those), and telling whether a peer process still runs."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from kvtransport.spi import process_sockets

pytestmark = pytest.mark.skipif(not process_sockets.supported(), reason="needs /proc (Linux)")


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def test_new_listeners_names_the_ports_opened_inside_the_block_only() -> None:
    before = _listener()
    try:
        with process_sockets.new_listeners() as opened:
            inside = _listener()
        try:
            assert opened == {inside.getsockname()[1]}
            assert process_sockets.port_in_blob(
                inside.getsockname()[1], b"xx" + struct.pack(">H", inside.getsockname()[1])
            )
        finally:
            inside.close()
    finally:
        before.close()


def test_sever_cuts_what_arrives_later_on_the_engines_connections_and_spares_the_others() -> None:
    engine, other = _listener(), _listener()
    try:
        writer = socket.create_connection(engine.getsockname())
        accepted, _ = engine.accept()
        bystander_client = socket.create_connection(other.getsockname())
        bystander, _ = other.accept()
        writer.sendall(b"before")
        time.sleep(0.05)
        drained: list[bytes] = []
        reader = threading.Thread(target=lambda: drained.append(accepted.recv(100)))
        reader.start()  # the "engine" reads what was queued before the fence
        severed, unread = process_sockets.sever({engine.getsockname()[1]}, timeout=2.0)
        reader.join(2)
        assert (severed, unread) == (1, 0)
        assert drained == [b"before"]
        # Anything sent after the fence never reaches the engine: the kernel resets the connection.
        with pytest.raises(OSError):
            for _ in range(50):
                writer.sendall(b"x" * 65536)
                time.sleep(0.01)
        accepted.settimeout(1.0)
        try:
            late = accepted.recv(100)
        except ConnectionResetError:
            late = b""
        assert late == b"", "bytes sent after the fence reached the engine"
        # The other listener's connection is untouched.
        bystander_client.sendall(b"still here")
        assert bystander.recv(100) == b"still here"
        for s in (writer, accepted, bystander_client, bystander):
            s.close()
    finally:
        engine.close()
        other.close()


def test_sever_reports_bytes_the_engine_did_not_read_in_time() -> None:
    engine = _listener()
    try:
        writer = socket.create_connection(engine.getsockname())
        accepted, _ = engine.accept()
        writer.sendall(b"queued")
        time.sleep(0.05)
        assert process_sockets.sever({engine.getsockname()[1]}, timeout=0.1) == (1, 1)
        writer.close()
        accepted.close()
    finally:
        engine.close()


def test_a_process_is_alive_until_it_ends_and_a_reused_pid_is_not_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = process_sockets.process_start(child.pid)
        assert start is not None and process_sockets.process_alive(child.pid, start)
        assert not process_sockets.process_alive(child.pid, start + 1), "another process under the same pid"
    finally:
        child.kill()
        child.wait()
    assert not process_sockets.process_alive(child.pid, start)
