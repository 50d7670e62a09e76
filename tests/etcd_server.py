"""A real etcd server for the discovery tests: Debian's ``etcd-server`` package (installed by
``scripts/dev``), started on free loopback ports in a temporary data directory, stopped (and
restartable, with or without its data) by the test."""

from __future__ import annotations

import http.client
import shutil
import subprocess
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
