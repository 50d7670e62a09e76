"""Two vLLM instances (tests/vllm_engine.py, each in its own process in the vLLM environment)
and the proxy between them: prefill a request on one, hand its ``kv_transfer_params`` to the
other's decode request, read the events. The tests' side does not import vLLM."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "tests" / "vllm_engine.py"
SECRET = "kvtransport-vllm-tests-secret-0123456789"


def vllm_python() -> str | None:
    """The vLLM environment's interpreter: ``.venv-vllm``, which ``scripts/dev setup`` makes
    (vLLM pins packages SGLang's environment cannot share)."""
    path = ROOT / ".venv-vllm" / "bin" / "python"
    return str(path) if path.exists() else None


def require_vllm() -> str:
    """The vLLM environment is part of the test set-up: a missing one is a failure, not a skip,
    unless the developer opts out (``KVTRANSPORT_TESTS_WITHOUT_VLLM=1``)."""
    python = vllm_python()
    if python is None:
        reason = "no vLLM environment (.venv-vllm): `bash scripts/dev setup` makes it"
        if os.environ.get("KVTRANSPORT_TESTS_WITHOUT_VLLM") == "1":
            pytest.skip(reason)
        pytest.fail(reason)
    return python


class Instance:
    """One vLLM instance: commands in, events out (a reader thread queues them)."""

    def __init__(self, name: str, config: dict[str, Any], env: dict[str, str], launcher: Sequence[str] = ()) -> None:
        """``launcher``: a command the instance runs under (a simulated host's, say)."""
        self.name = name
        self.proc = subprocess.Popen(
            [*launcher, require_vllm(), str(ENGINE), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=str(ROOT),
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self.addresses = self.wait("ready", timeout=120)["addresses"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                self.log.append(line.decode(errors="replace"))

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line.decode(errors="replace"))
            del self.log[:-400]

    def send(self, **cmd: Any) -> None:
        self.send_many(cmd)

    def send_many(self, *cmds: dict[str, Any]) -> None:
        """Commands in one write: the instance takes them all before its next step."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("".join(json.dumps(c) + "\n" for c in cmds).encode())
        self.proc.stdin.flush()

    def wait(self, event: str, req: str | None = None, timeout: float = 60) -> dict[str, Any]:
        """The next event of this kind (for request ``req``); other events are kept for later."""
        deadline = time.monotonic() + timeout
        kept: list[dict[str, Any]] = []
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and self.events.empty()):
                    tail = "".join(self.log[-30:])
                    raise AssertionError(f"{self.name}: no {event!r} for {req!r} within {timeout} s; log:\n{tail}")
                try:
                    got = self.events.get(timeout=min(left, 0.5))
                except queue.Empty:
                    continue
                if got.get("event") == event and (req is None or got.get("id") == req):
                    return got
                kept.append(got)
        finally:
            for k in kept:
                self.events.put(k)

    def stats(self) -> dict[str, Any]:
        self.send(op="stats")
        return self.wait("stats")

    def settle(self, timeout: float = 30, **want: int) -> dict[str, Any]:
        """Stats once the instance holds no request, no blocks and no transfer."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            idle = (
                s["requests"] == 0 and s["holding"] == 0 and all(w["held"] == w["loading"] == 0 for w in s["workers"])
            )
            if idle or time.monotonic() > deadline:
                return s
            time.sleep(0.1)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="quit")
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)


def instance_env(driver: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTRANSPORT_")}
    env.update(
        KVTRANSPORT_SECRET=SECRET,
        VLLM_LOGGING_LEVEL="WARNING",
        PYTHONUNBUFFERED="1",
        GLOG_minloglevel="2",
    )
    if driver:
        env["KVTRANSPORT_DRIVER"] = driver
    env.update(extra)
    return env


def engine_config(tp: int = 1, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "tp": tp,
        "block_size": 16,
        "layers": 4,
        "heads": 4,
        "head_size": 16,
        "num_blocks": 128,
        "extra": {"listen_host": "127.0.0.1"},
    }
    cfg.update(over)
    return cfg


@contextmanager
def pd_pair(
    driver: str | None,
    *,
    prefill: dict[str, Any] | None = None,
    decode: dict[str, Any] | None = None,
    prefill_env: dict[str, str] | None = None,
) -> Iterator[tuple[Instance, Instance]]:
    p = Instance("prefill", prefill or engine_config(), instance_env(driver, **(prefill_env or {})))
    try:
        d = Instance("decode", decode or engine_config(), instance_env(driver))
    except BaseException:
        p.close()
        raise
    try:
        yield p, d
    finally:
        d.close()
        p.close()


def prompt(n: int, seed: int = 0) -> list[int]:
    return [3 + (i * 7 + seed * 31) % 900 for i in range(n)]


def run_request(p: Instance, d: Instance, req: str, tokens: list[int], max_tokens: int = 2) -> dict[str, Any]:
    """Prefill ``req`` on ``p``, decode it on ``d`` with the params ``p`` returned (what vLLM's
    proxy does); the decode instance's ``loaded`` event, with ``finished`` added."""
    p.send(op="prefill", id=f"p-{req}", tokens=tokens)
    params = p.wait("prefilled", f"p-{req}")["params"]
    d.send(op="decode", id=req, tokens=tokens, params=params, max_tokens=max_tokens)
    loaded = d.wait("loaded", req)
    loaded["finished"] = d.wait("finished", req)["reason"]
    loaded["params"] = params
    return loaded


__all__ = ["Instance", "engine_config", "pd_pair", "prompt", "require_vllm", "run_request"]
