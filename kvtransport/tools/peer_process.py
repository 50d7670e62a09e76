"""Drive a :mod:`kvtransport.tools.peer` process (or another module speaking its JSON-lines
protocol) from the bench or a test: spawn, command, kill."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any, Protocol


class Peer(Protocol):
    """A decode side the bench drives over the JSON-lines protocol of :mod:`kvtransport.tools.peer`:
    a :class:`PeerProcess` here, or a ``bench_remote.RemotePeer`` on another host (whose
    ``clock_offset`` maps its clock onto ours)."""

    def call(self, cmd: str, timeout: float = 60.0, **fields: Any) -> dict[str, Any]: ...

    def close(self) -> None: ...


class PeerProcess:
    """A peer endpoint in a child process; every exchange has a timeout."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        module: str = "kvtransport.tools.peer",
        launcher: Sequence[str] = (),
    ) -> None:
        """``launcher``: a command the peer runs under (``ip netns exec NS``, say)."""
        self.proc = subprocess.Popen(
            [*launcher, sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        self._pumps = [
            threading.Thread(target=self._pump, daemon=True),
            threading.Thread(target=self._pump_err, daemon=True),
        ]
        for t in self._pumps:
            t.start()
        hello = self._read(timeout)
        self.address: str = hello["address"]
        self.name: str = hello["name"]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def _read(self, timeout: float) -> dict[str, Any]:
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"peer gave no answer within {timeout} s; stderr:\n{self.stderr}") from None
            if line is None:
                raise RuntimeError(f"peer exited ({self.proc.poll()}); stderr:\n{self.stderr}")
            if line.startswith("{"):
                result: dict[str, Any] = json.loads(line)
                return result

    def call(self, cmd: str, timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
        self.proc.stdin.flush()
        result = self._read(timeout)
        if "error" in result and cmd != "close":
            raise RuntimeError(f"peer {cmd} failed: {result['error']}: {result['message']}")
        return result

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self._release_pipes()

    def _release_pipes(self) -> None:
        """Once the child is gone: close our ends of its pipes (a test counting file
        descriptors must not see the harness's)."""
        for t in self._pumps:
            t.join(5)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("close", timeout=10)
            except (RuntimeError, TimeoutError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._release_pipes()
