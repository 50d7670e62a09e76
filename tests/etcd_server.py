"""A real etcd server for the discovery tests: Debian's ``etcd-server`` package (installed by
``scripts/dev``), started on free loopback ports in a temporary data directory, stopped (and
restartable, with or without its data) by the test; and :class:`Member`, a loopback address
standing for a cluster member that hangs, answers slowly or drops every packet."""

from __future__ import annotations

import http.client
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

from .conftest import unused_port

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


class EtcdServer:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.client_port = unused_port()
        self.peer_port = unused_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / f"etcd-{self.client_port}.log"

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 20.0) -> None:
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    ETCD,
                    "--name=kvt",
                    f"--data-dir={self.data_dir}",
                    f"--listen-client-urls={client}",
                    f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=kvt={peer}",
                    "--log-level=error",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if self.healthy():
                return
            time.sleep(0.05)
        raise RuntimeError(f"etcd did not become healthy within {timeout} s: {self.log.read_text()[-2000:]}")

    def healthy(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.client_port, timeout=1)
        try:
            conn.request("GET", "/health")
            return b'"true"' in conn.getresponse().read()
        except OSError:
            return False
        finally:
            conn.close()

    def stop(self, *, wipe: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)


class Member:
    """A loopback address that stands for a member of the etcd cluster and misbehaves on demand
    (``mode``, which may change while clients are connected):

    - ``ok``: forwards to the real etcd at ``target_port``;
    - ``hung``: accepts connections and reads requests, never answers;
    - ``slow``: forwards requests, and answers one byte every ``byte_s`` seconds (each read of a
      client gets a byte in time: only a bound on the whole request ends it);
    - ``black-holed`` (from the start only): accepts no connection, its backlog full, so a
      connect waits for a SYN-ACK that never comes.
    """

    def __init__(self, target_port: int, mode: str = "ok", byte_s: float = 0.02) -> None:
        self.target_port, self.mode, self.byte_s = target_port, mode, byte_s
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        if mode == "black-holed":
            self.listener.listen(0)
            # Fill the accept queue (and the SYN retries behind it): later SYNs are dropped.
            for _ in range(4):
                filler = socket.socket()
                filler.setblocking(False)
                try:
                    filler.connect(("127.0.0.1", self.port))
                except BlockingIOError:
                    pass
                self._socks.append(filler)
            return
        self.listener.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        src.settimeout(None)
        try:
            while not self._closed.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if self.mode == "hung":
                    continue  # read and dropped: nothing goes on, nothing comes back
                if answers and self.mode == "slow":
                    for i in range(len(data)):
                        if self._closed.wait(self.byte_s):
                            return
                        dst.sendall(data[i : i + 1])
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(2)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            s.close()
