"""The attacker's side of the hostile-input suite (``tests/test_hostile.py``).

Nothing here imports kvtransport: hostile bytes are built with msgpack and raw zmq sockets from
a copy of the wire schema written down by reading ``kvtransport/runtime/wire.py``, so a bug shared by
the encoder and the decoder cannot hide itself. What lives here:

- :class:`Victim`: a ``kvtransport.tools.peer`` child process (its stdout protocol, stderr,
  ``/proc`` figures, how it died);
- :class:`RecordingProxy`: a ROUTER/DEALER relay that records every frame a legitimate pair
  exchanges through it (the captured hellos, welcomes, expects, dones, notices, pings);
- :class:`Attacker`: one DEALER socket dialling the victim;
- hypothesis strategies over the schema, and :class:`Mutator`, a seeded ``random.Random``
  generator of cheap hostile frames from the captures.
- :class:`StrikeLedger`: what each frame costs an attacker session (the victim closes a session
  at its 16th protocol violation), so a fuzz batch can keep its checked session open.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
from hypothesis import strategies as st

# --- the wire schema, as read from kvtransport/runtime/wire.py (deliberately not imported) -----------

VERSION = 14
LIMIT = 4 << 20  # DEFAULT_MAX_MESSAGE_BYTES
#: Frames larger than this make zmq drop the connection (MAXMSGSIZE: the limit plus framing room):
#: the attacker's DEALER reconnects with a new route, so a session on the old one is orphaned.
ZMQ_LIMIT = LIMIT + 1024
#: What sealing adds to a message (docs/security.md): marker byte, u64 sequence, HMAC-SHA256.
SEAL_OVERHEAD = 1 + 8 + 32
#: Every integer the wire carries is in [lo, MAX_INT] (wire.py's Int: lo is 0, -1 for expect.aux).
MAX_INT = (1 << 62) - 1
SCHEMA: dict[str, dict[str, type]] = {
    "auth": {"conn": str, "nonce": bytes},
    "challenge": {"conn": str, "nonce": bytes},
    "proof": {"conn": str, "nonce_i": bytes, "nonce_a": bytes, "mac": bytes},
    "hello": {"conn": str, "hello": dict, "regions": dict, "lanes": dict},
    "welcome": {"conn": str, "hello": dict, "regions": dict, "decision": dict, "express": int, "lanes": dict},
    "express": {"conn": str},
    "refuse": {"conn": str, "reason": str},
    "expect": {"tag": str, "pages": bytes, "aux": int, "prefix": int, "state": list},
    "done": {"tag": str, "bytes": int, "lane": str, "notices": list},
    "abort": {"tag": str, "reason": str},
    "drained": {"tag": str},
    "notice": {"payload": bytes, "lane": str},
    "lane_down": {"lane": str, "gen": int, "reason": str},
    "lane_reopen": {"lane": str, "gen": int, "info": bytes},
    "lane_reopened": {"lane": str, "gen": int, "info": bytes, "reason": str},
    "ping": {"seq": int},
    "bye": {"reason": str},
}
#: Bounds on the fields above (wire.py: connection ids 64 characters and no "~", tags 256, reasons 4096;
#: nonces and MACs 64 bytes; an announcement's state at most 1024 entries, a done's notices
#: at most 8 byte strings).
INT_LOW = {("expect", "aux"): -1}
INT_HIGH = {("welcome", "express"): 65535}
TEXT_MAX = {"conn": 64, "tag": 256, "reason": 4096, "lane": 64}
BYTES_MAX = {"nonce": 64, "nonce_i": 64, "nonce_a": 64, "mac": 64, "info": 64 << 10}
LIST_MAX = {("expect", "state"): 1024, ("done", "notices"): 8}
#: Most notices one "done" may carry.
DONE_NOTICES_MAX = 8
KINDS = tuple(SCHEMA)
STAGED_OPS = ("want", "grant", "lend", "release", "revoke", "chunk")

EXTREME_INTS = (
    -(2**63),
    -(2**63) + 1,
    -(2**31),
    -2,
    -1,
    0,
    1,
    2,
    7,
    8,
    2**31 - 1,
    2**32,
    2**53 + 1,
    2**62 - 1,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 2,
    2**64 - 1,
)
SPECIAL_FLOATS = (0.0, -0.0, 1.5, -1.0, 1e308, -1e308, math.inf, -math.inf, math.nan, 2.0**64)
#: Deep enough that ``str()`` or ``repr()`` of the decoded object exceeds Python's default
#: recursion limit, shallow enough for msgpack to pack and unpack it.
DEEP = 1000


def pack(obj: Any) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def message(kind: str, v: Any = VERSION, **fields: Any) -> bytes:
    """A message frame as the schema lays it out (no validation: hostile values welcome)."""
    return pack({"v": v, "t": kind, **fields})


def deep(depth: int = DEEP, leaf: Any = 0) -> Any:
    obj = leaf
    for _ in range(depth):
        obj = [obj]
    return obj


def well_formed(frame: bytes) -> dict[str, Any] | None:
    """The decoded map if ``frame`` passes the schema as wire.py states it (size, map, version,
    type, exactly the fields, each of its type and within its bounds, no bool for an int, no
    float for an int); else ``None``."""
    if len(frame) > LIMIT:
        return None
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception:  # noqa: BLE001 - anything msgpack refuses is not well formed
        return None
    if not isinstance(obj, dict):
        return None
    version, kind = obj.get("v"), obj.get("t")
    if version != VERSION or isinstance(version, bool) or not isinstance(kind, str) or kind not in SCHEMA:
        return None
    schema = SCHEMA[kind]
    fields = {k: v for k, v in obj.items() if k not in ("v", "t")}
    if set(fields) != set(schema):
        return None
    for name, expected in schema.items():
        value = fields[name]
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            return None
        if isinstance(value, int) and not INT_LOW.get((kind, name), 0) <= value <= INT_HIGH.get((kind, name), MAX_INT):
            return None
        if isinstance(value, str) and len(value) > TEXT_MAX.get(name, 4096):
            return None
        if name == "conn" and "~" in value:  # (never in a connection id)
            return None
        if isinstance(value, bytes) and len(value) > BYTES_MAX.get(name, LIMIT):
            return None
        if isinstance(value, list) and len(value) > LIST_MAX.get((kind, name), LIMIT):
            return None
        if kind == "done" and name == "notices" and not all(isinstance(n, bytes) for n in value):
            return None
    return obj


def hello_message(hello: dict[str, Any], regions: dict[str, Any], label: str, conn: str | None = None) -> bytes:
    """A hello frame carrying these documents, under endpoint label ``label``."""
    doc = dict(hello)
    doc["protocol"] = {**doc["protocol"], "endpoint": label}
    return message("hello", conn=conn or uuid.uuid4().hex, hello=doc, regions=regions, lanes={})


# --- the victim process --------------------------------------------------------------------


class VictimDied(AssertionError):
    pass


#: Private memory the victim may allocate (RLIMIT_DATA): a few times what it needs.
VICTIM_DATA_LIMIT = 2 << 30
#: ``python -m kvtransport.tools.peer``, with the library's warnings on stderr (it logs through
#: a silent logger otherwise) and faulthandler: tracebacks on SIGSEGV, every thread's stack on
#: SIGUSR1 (what a deaf victim is doing).
PEER_MAIN = """
import faulthandler, logging, resource, runpy, signal, sys
# A peer field that makes the victim allocate gigabytes must fail fast here, not swap the host.
resource.setrlimit(resource.RLIMIT_DATA, (VICTIM_DATA_LIMIT, VICTIM_DATA_LIMIT))
faulthandler.enable()
faulthandler.register(signal.SIGUSR1, all_threads=True)
logging.basicConfig(level=logging.WARNING, format="victim %(levelname)s %(name)s: %(message)s")
sys.argv[0] = "kvtransport.tools.peer"
runpy.run_module("kvtransport.tools.peer", run_name="__main__", alter_sys=True)
""".replace("VICTIM_DATA_LIMIT", str(VICTIM_DATA_LIMIT))


class Victim:
    """``python -m kvtransport.tools.peer`` in a child process; every exchange has a timeout."""

    def __init__(
        self,
        driver: str,
        *,
        private: bool = False,
        pages: int = 64,
        layers: int = 4,
        item: int = 4096,
        aux_slots: int = 4,
        seed: int = 7,
        options: dict[str, str] | None = None,
        timeouts: dict[str, float] | None = None,
        name: str = "victim",
    ) -> None:
        self.driver, self.pages, self.layers, self.item, self.aux_slots = driver, pages, layers, item, aux_slots
        args = [
            *("--driver", driver, "--pages", str(pages), "--layers", str(layers), "--item", str(item)),
            *("--aux-slots", str(aux_slots), "--seed", str(seed), "--name", name),
            *("--options", json.dumps(options or {}), "--timeouts", json.dumps(timeouts or {})),
        ]
        if private:
            args.append("--private")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PEER_MAIN, *args],
            env={**os.environ, "KVTRANSPORT_SECRET": SECRET.decode()},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._err: list[str] = []
        threading.Thread(target=self._pump_out, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()
        self.address = ""
        self.name = ""
        self.accepted = 0  # connections popped with "accept" so far (index into its list)

    def ready(self) -> Victim:
        """Wait for the peer's first line (its address); spawning and waiting are split so a
        spare victim can boot while another test runs."""
        if not self.address:
            first = self._read(60)
            self.address, self.name = first["address"], first["name"]
        return self

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._err.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stderr(self) -> str:
        return "".join(self._err)

    def stderr_tail(self, n: int = 40) -> str:
        lines = [ln for ln in self._err if "transfer_engine" not in ln and "topology.cpp" not in ln]
        return "".join(lines[-n:])

    def stacks(self) -> str:
        """Every thread's Python stack in the victim, now (faulthandler on SIGUSR1)."""
        if self.proc.poll() is not None:
            return ""
        mark = len(self._err)
        os.kill(self.pid, signal.SIGUSR1)
        time.sleep(0.5)
        return "".join(self._err[mark:])

    def death(self) -> str | None:
        """``None`` while it runs; else how it ended (signal name or exit status)."""
        rc = self.proc.poll()
        if rc is None:
            return None
        if rc < 0:
            return f"killed by {signal.Signals(-rc).name}"
        return f"exited with status {rc}"

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise VictimDied(f"victim gave no answer within {timeout} s; stderr:\n{self.stderr_tail()}") from None
            if line is None:
                time.sleep(0.2)
                raise VictimDied(f"victim {self.death() or 'closed its stdout'}; stderr:\n{self.stderr_tail()}")
            if line.startswith("{"):
                result: dict[str, Any] = json.loads(line)
                return result

    def call(self, cmd: str, read_timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """One command (``timeout`` among ``fields`` is the peer's own); the result (an
        ``error`` key is returned, not raised)."""
        timeout = read_timeout if read_timeout is not None else 30.0 + float(fields.get("timeout", 0))
        if self.proc.poll() is not None:
            raise VictimDied(f"victim {self.death()}; stderr:\n{self.stderr_tail()}")
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise VictimDied(f"victim's stdin is gone ({exc}); {self.death()}; stderr:\n{self.stderr_tail()}") from exc
        return self._read(timeout)

    def ok(self, cmd: str, read_timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        result = self.call(cmd, read_timeout, **fields)
        if "error" in result:
            raise AssertionError(f"victim {cmd} failed: {result['error']}: {result['message']}")
        return result

    def accept_labelled(self, label: str, limit: int = 20000, timeout: float = 5.0) -> int:
        """Pop accepted connections until the one whose initiator calls itself ``label``;
        its index in the victim's connection list."""
        for _ in range(limit):
            result = self.ok("accept", timeout + 10, timeout=timeout)
            self.accepted += 1
            decision = result.get("decision") or {}
            if decision.get("initiator") == label:
                return self.accepted - 1
        raise AssertionError(f"the victim never accepted a connection from {label!r}")

    def proc_status(self) -> dict[str, int]:
        """VmRSS, VmHWM (KiB) and Threads from /proc/<pid>/status."""
        out = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "Threads"):
                    out[key] = int(value.split()[0])
        return out

    def all_digests(self) -> list[int]:
        return list(self.ok("digests", pages=list(range(self.pages)))["digests"])

    def aux_digests(self) -> list[int]:
        return [int(self.ok("aux_digest", slot=s)["digest"]) for s in range(self.aux_slots)]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("close", read_timeout=10)
            except (VictimDied, OSError):
                pass
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# --- capture --------------------------------------------------------------------------------


class RecordingProxy:
    """Relays a ROUTER (what the legitimate initiator dials) to the victim, one DEALER per
    client, recording ``("up", frame)`` (to the victim) and ``("down", frame)`` (from it)."""

    def __init__(self, target: str) -> None:
        self.target = target
        #: Every frame, its body if it was sealed (the proxy holds the deployment's secret and
        #: sees both nonces go by), and :attr:`sealed` the frames exactly as they went by.
        self.records: list[tuple[str, bytes]] = []
        self.sealed: list[tuple[str, bytes]] = []
        self._links: dict[bytes, Any] = {}
        self._inject: queue.Queue[bytes] = queue.Queue()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.address = ""
        self._thread = threading.Thread(target=self._run, daemon=True, name="recording-proxy")
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        ctx = zmq.Context()
        front = ctx.socket(zmq.ROUTER)
        front.setsockopt(zmq.LINGER, 0)
        port = front.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._ready.set()
        backs: dict[bytes, zmq.Socket[bytes]] = {}
        owner: dict[zmq.Socket[bytes], bytes] = {}
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                while not self._inject.empty():
                    frame = self._inject.get()
                    for back in backs.values():
                        back.send(frame)  # upstream, as if the recorded client had sent it
                for sock, _ in poller.poll(10):
                    if sock is front:
                        ident, *frames = front.recv_multipart()
                        back = backs.get(ident)
                        if back is None:
                            back = backs[ident] = ctx.socket(zmq.DEALER)
                            back.setsockopt(zmq.LINGER, 0)
                            back.connect(self.target)
                            owner[back] = ident
                            poller.register(back, zmq.POLLIN)
                        for f in frames:
                            self._record(ident, "up", f)
                        back.send_multipart(frames)
                    else:
                        frames = sock.recv_multipart()
                        for f in frames:
                            self._record(owner[sock], "down", f)
                        front.send_multipart([owner[sock], *frames])
        finally:
            for s in backs.values():
                s.close(0)
            front.close(0)
            ctx.term()

    def _record(self, ident: bytes, direction: str, frame: bytes) -> None:
        self.sealed.append((direction, frame))
        state = self._links.setdefault(ident, {})
        if frame[:1] == b"\xc1" and "link" in state:
            link = state["link"]
            key = link.out_key if direction == "up" else link.in_key
            if hmac.compare_digest(frame[9:41], hmac.new(key, frame[:9] + frame[41:], hashlib.sha256).digest()):
                frame = frame[41:]
        else:
            obj = well_formed(frame)
            if obj is not None and obj["t"] == "auth":
                state.update(conn=obj["conn"], nonce_i=obj["nonce"])
            elif obj is not None and obj["t"] == "challenge" and "nonce_i" in state:
                state["link"] = Link(master_key(SECRET), state["conn"], state["nonce_i"], obj["nonce"])
        self.records.append((direction, frame))

    def frames(self, direction: str, kind: str | None = None) -> list[bytes]:
        out = []
        for d, f in list(self.records):
            if d != direction:
                continue
            obj = well_formed(f)
            if kind is None or (obj is not None and obj["t"] == kind):
                out.append(f)
        return out

    def inject(self, frame: bytes) -> None:
        """Send ``frame`` upstream on the live relayed connection(s), exactly as given."""
        self._inject.put(frame)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclass
class Captured:
    """Legitimate frames recorded between a kvtransport endpoint and the victim."""

    hello: bytes
    welcome: bytes
    up: list[bytes]  # everything the legitimate initiator sent (bodies of sealed frames)
    down: list[bytes]  # everything the victim sent (bodies of sealed frames)
    sealed: list[bytes] = field(default_factory=list)  # every frame both ways, exactly as it went by

    @property
    def hello_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = unpack(self.hello)
        return obj

    @property
    def all(self) -> list[bytes]:
        return self.up + self.down

    def of_kind(self, kind: str) -> list[bytes]:
        return [f for f in self.all if (well_formed(f) or {}).get("t") == kind]

    def refusable_hello(self, conn: str) -> bytes:
        """A well-formed hello that any endpoint refuses (KV layout with other pages): answered
        with a ``refuse`` naming ``conn`` once the victim has handled everything before it."""
        obj = self.hello_obj
        obj["conn"] = conn
        obj["hello"]["protocol"]["endpoint"] = "hostile-sync"
        obj["hello"]["layout"]["page_size"] = 12345
        return pack(obj)


class StrikeLedger:
    """What each frame costs one attacker session on the victim, as ``endpoint.py`` and
    ``session.py`` count it: ``"ok"`` (handled, no strike), ``"strike"`` (a protocol violation:
    the 16th closes the session with a ``bye``) or ``"close"`` (ends the session at once: a
    ``bye``, any notice to a staged driver, whose bad notices end the connection, a frame so large
    that zmq drops the connection). The fuzz keeps a session under the strike limit while the
    transfers it holds are checked, so those checks are about a live session."""

    def __init__(self, *, two_sided: bool, recv_bytes: dict[str, int], send_tags: list[str], driver: str) -> None:
        self.two_sided = two_sided
        self.lanes = {"", driver}  # the victim's one lane: named, or "" (its chosen driver)
        self.recv_bytes = dict(recv_bytes)  # live receiving transfers -> the bytes a done must say
        self.send_tags = set(send_tags)
        self.strikes = 0

    def cost(self, frame: bytes | list[bytes]) -> str:
        if isinstance(frame, list):
            return "ok"  # a message of several frames is dropped unread
        if len(frame) + SEAL_OVERHEAD > ZMQ_LIMIT:
            return "close"
        obj = well_formed(frame)
        if obj is None:
            return "strike"
        kind = obj["t"]
        if kind in ("welcome", "refuse", "auth", "challenge", "proof"):
            return "strike"
        if kind in ("bye",):
            return "close"
        if kind == "notice":
            return "close" if self.two_sided and obj["lane"] in self.lanes else "strike"
        if kind == "done":
            notices = obj["notices"]
            if notices:
                # Handled first, each as a notice of the done's lane (at most 8 byte strings).
                if len(notices) > DONE_NOTICES_MAX or not all(isinstance(n, bytes) for n in notices):
                    return "strike"
                return "close" if self.two_sided and obj["lane"] in self.lanes else "strike"
            tag = obj["tag"]
            if tag in self.send_tags:
                return "strike"
            if tag in self.recv_bytes:
                # Right count: the transfer ends; wrong count: a violation that fails it. Either
                # way later dones for it are ignored.
                right = self.recv_bytes.pop(tag) == obj["bytes"]
                return "ok" if right and obj["lane"] in self.lanes else "strike"
        return "ok"

    def place(self, frame: bytes | list[bytes], budget: int) -> str:
        """Where ``frame`` goes for a session that may take ``budget`` strikes in all while it is
        checked: ``"live"`` (counted in, if a strike), ``"struck"`` (a strike over the budget) or
        ``"closing"`` (it ends the session). The ledger's state changes only for ``"live"``."""
        saved = dict(self.recv_bytes)
        c = self.cost(frame)
        if c == "ok":
            return "live"
        if c == "strike" and self.strikes < budget:
            self.strikes += 1
            return "live"
        self.recv_bytes = saved
        return "struck" if c == "strike" else "closing"


# --- the attacker's socket -------------------------------------------------------------------


class Deaf(AssertionError):
    pass


# --- the authentication exchange, as docs/security.md specifies it (deliberately not imported) ---

#: The secret every process of the test deployment shares (victims get it in KVTRANSPORT_SECRET).
SECRET = b"hostile-suite-deployment-secret-0123456789"


def master_key(secret: bytes) -> bytes:
    """K = HMAC-SHA256(key="kvtransport deployment secret v1", msg=secret); b"" when none is set."""
    return hmac.new(b"kvtransport deployment secret v1", secret, hashlib.sha256).digest()


def derive(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256(K, "kvtransport/1 " + label + for each part: u64be(len) + part)."""
    data = b"kvtransport/1 " + label + b"".join(len(p).to_bytes(8, "big") + p for p in parts)
    return hmac.new(key, data, hashlib.sha256).digest()


class Link:
    """One authenticated direction pair: frames out are ``0xC1 | u64be seq | mac | body``,
    mac = HMAC-SHA256(k_i2a, first 9 bytes + body); frames in verify under k_a2i."""

    def __init__(self, key: bytes, conn: str, nonce_i: bytes, nonce_a: bytes) -> None:
        parts = (conn.encode(), nonce_i, nonce_a)
        self.out_key = derive(key, b"session initiator->acceptor", *parts)
        self.in_key = derive(key, b"session acceptor->initiator", *parts)
        self.seq = 0

    def seal(self, body: bytes, seq: int | None = None) -> bytes:
        if seq is None:
            self.seq += 1
            seq = self.seq
        header = bytes([0xC1]) + seq.to_bytes(8, "big")
        return header + hmac.new(self.out_key, header + body, hashlib.sha256).digest() + body

    def open(self, frame: bytes) -> bytes | None:
        if len(frame) < 41 or frame[0] != 0xC1:
            return None
        mac = hmac.new(self.in_key, frame[:9] + frame[41:], hashlib.sha256).digest()
        return frame[41:] if hmac.compare_digest(mac, frame[9:41]) else None


class AuthRefused(Exception):
    pass


def authenticate(sock: zmq.Socket[bytes], secret: bytes, timeout: float = 10.0, conn: str | None = None) -> Link:
    """The initiator's side of the exchange on ``sock`` (a DEALER dialled to the victim)."""
    conn = conn or uuid.uuid4().hex
    key = master_key(secret)
    nonce_i = os.urandom(32)
    sock.send(message("auth", conn=conn, nonce=nonce_i))
    challenge = _expect_plain(sock, "challenge", timeout)
    nonce_a = challenge["nonce"]
    mac = derive(key, b"proof initiator", conn.encode(), nonce_i, nonce_a)
    sock.send(message("proof", conn=conn, nonce_i=nonce_i, nonce_a=nonce_a, mac=mac))
    answer = _expect_plain(sock, "proof", timeout)
    if (answer["nonce_i"], answer["nonce_a"]) != (nonce_i, nonce_a):
        raise AuthRefused("the victim's proof echoes other nonces")
    if not hmac.compare_digest(answer["mac"], derive(key, b"proof acceptor", conn.encode(), nonce_i, nonce_a)):
        raise AuthRefused("the victim's proof does not verify")
    link = Link(key, conn, nonce_i, nonce_a)
    link.conn = conn  # type: ignore[attr-defined]
    return link


def _expect_plain(sock: zmq.Socket[bytes], kind: str, timeout: float) -> dict[str, Any]:
    """The next unsealed ``kind`` (or a refusal) on ``sock``; sealed leftovers of an earlier
    session on the socket are skipped."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000) + 1):
            raise AuthRefused(f"no {kind} within {timeout} s")
        obj = well_formed(sock.recv())
        if obj is None:
            continue
        if obj["t"] == "refuse":
            raise AuthRefused(str(obj["reason"]))
        if obj["t"] == kind:
            return obj


class Attacker:
    """One DEALER dialling the victim's ROUTER over loopback (one route on the victim)."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        *,
        send_timeout_ms: int = 10000,
        secret: bytes | None = SECRET,
    ) -> None:
        """``secret``: the attacker is an insider holding the deployment's secret (every frame
        it sends is sealed in its own authenticated session, so the hostile bytes reach the
        victim's message handlers); ``None``: a stranger whose frames go out as they are."""
        assert address.startswith("tcp://127.0.0.1:"), address
        self.secret = secret
        self.link: Link | None = None
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
        self.sock.connect(address)
        self.sent = 0
        self.inbox: list[bytes] = []

    def authenticate(self, conn: str | None = None) -> Link:
        if self.link is None:
            assert self.secret is not None, "a stranger has no secret to authenticate with"
            self.link = authenticate(self.sock, self.secret, conn=conn)
        return self.link

    def send(self, frame: bytes | list[bytes], *, raw: bool = False) -> None:
        """``frame`` sealed in this attacker's session (authenticating first), or as it is for
        a stranger or with ``raw`` (a replayed capture, a forged seal)."""
        if self.secret is not None and not raw:
            link = self.authenticate()
            frame = [link.seal(f) for f in frame] if isinstance(frame, list) else link.seal(frame)
        try:
            if isinstance(frame, list):
                self.sock.send_multipart(frame)
            else:
                self.sock.send(frame)
        except zmq.Again as exc:
            raise Deaf(f"the victim stopped reading: a send blocked for 10 s after {self.sent} frames") from exc
        self.sent += 1

    def drain(self) -> list[bytes]:
        """Frames the victim sent us so far (kept in :attr:`inbox` too)."""
        got = []
        while self.sock.poll(0):
            got.extend(self._opened(f) for f in self.sock.recv_multipart())
        self.inbox.extend(got)
        return got

    def _opened(self, frame: bytes) -> bytes:
        """A sealed frame's body once it verifies in this attacker's session; else as it came."""
        if self.link is not None and frame[:1] == b"\xc1":
            body = self.link.open(frame)
            if body is not None:
                return body
        return frame

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        """The first well-formed frame from the victim matching ``pred``."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Deaf(f"no matching answer from the victim within {timeout} s")
            if self.sock.poll(int(min(left, 0.05) * 1000) + 1):
                for f in map(self._opened, self.sock.recv_multipart()):
                    self.inbox.append(f)
                    obj = well_formed(f)
                    if obj is not None and pred(obj):
                        return obj

    def handshake(self, hello: bytes, timeout: float = 10.0) -> dict[str, Any]:
        """Send a hello; the victim's welcome or refuse for its connection id."""
        conn = unpack(hello)["conn"]
        if self.secret is not None and self.link is None:
            try:
                self.authenticate(conn if isinstance(conn, str) else None)
            except AuthRefused as exc:
                return {"t": "refuse", "conn": conn, "reason": str(exc)}
        self.send(hello)
        return self.wait_for(lambda m: m["t"] in ("welcome", "refuse") and m.get("conn") == conn, timeout)

    def close(self) -> None:
        self.sock.close(0)


# --- hypothesis strategies over the schema ----------------------------------------------------

text_garbage = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "\x00", "\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"), "💥" * 3]),
    st.integers(1, 64).map(lambda n: "A" * n),
)
scalar = st.one_of(
    st.sampled_from(EXTREME_INTS),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from(SPECIAL_FLOATS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    text_garbage,
    st.binary(max_size=24),
)
nested = st.recursive(
    scalar,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.one_of(text_garbage, st.just("kv")), kids, max_size=4)
    ),
    max_leaves=12,
)


def wrong_for(expected: type) -> st.SearchStrategy[Any]:
    """Values of any type but ``expected`` (bools for ints included: the schema refuses them)."""
    others = {
        str: st.one_of(scalar.filter(lambda x: not isinstance(x, str)), st.lists(scalar, max_size=3)),
        bytes: st.one_of(scalar.filter(lambda x: not isinstance(x, bytes)), st.lists(scalar, max_size=3)),
        int: st.one_of(
            st.booleans(), st.sampled_from(SPECIAL_FLOATS), text_garbage, st.binary(max_size=8), st.none(), nested
        ),
        dict: st.one_of(scalar, st.lists(scalar, max_size=3)),
        list: st.one_of(scalar, st.dictionaries(text_garbage, scalar, max_size=3)),
    }
    return others[expected]


def right_for(expected: type) -> st.SearchStrategy[Any]:
    """Values of the right type, biased to the edges."""
    return {
        str: st.one_of(text_garbage, st.sampled_from(["t0", "t1", "hostile"])),
        bytes: st.one_of(
            st.binary(max_size=40),
            st.lists(st.sampled_from(EXTREME_INTS), max_size=6).map(
                lambda xs: b"".join((x % 2**64).to_bytes(8, "little") for x in xs)
            ),
        ),
        int: st.one_of(st.sampled_from(EXTREME_INTS), st.integers(-(2**63), 2**64 - 1)),
        dict: st.dictionaries(st.one_of(text_garbage, st.sampled_from(["kv", "aux", "protocol", "drivers"])), nested),
        # per state group a packed int64 array (or garbage in its place), up to past the 64 groups allowed
        list: st.lists(
            st.one_of(
                st.binary(max_size=24),
                st.lists(st.sampled_from(EXTREME_INTS), max_size=4).map(
                    lambda xs: b"".join((x % 2**64).to_bytes(8, "little") for x in xs)
                ),
                scalar,
            ),
            max_size=70,
        ),
    }[expected]


@st.composite
def schema_messages(draw: st.DrawFn) -> bytes:
    """A message laid out after the schema with one or more things wrong (or none)."""
    kind = draw(st.one_of(st.sampled_from(KINDS), st.sampled_from(["", "HELLO", "welcome ", "x" * 40]), scalar))
    schema = SCHEMA.get(kind, {"tag": str, "seq": int}) if isinstance(kind, str) else {"tag": str}
    obj: dict[Any, Any] = {}
    for name, expected in schema.items():
        how = draw(st.sampled_from(["right", "right", "wrong", "missing", "nested"]))
        if how == "right":
            obj[name] = draw(right_for(expected))
        elif how == "wrong":
            obj[name] = draw(wrong_for(expected))
        elif how == "nested":
            obj[name] = draw(nested)
    for _ in range(draw(st.integers(0, 2))):
        obj[draw(st.one_of(text_garbage, st.sampled_from(["v", "t", "tag", "conn", "hello"])))] = draw(nested)
    wrong_versions = st.sampled_from([0, 1, 3, -1, "2", None, 2.0, True, 2**64 - 1])
    obj["v"] = draw(st.one_of(st.just(VERSION), wrong_versions, scalar))
    obj["t"] = kind
    if draw(st.booleans()) and "v" in obj and draw(st.integers(0, 9)) == 0:
        del obj["v"]
    return pack(obj)


def paths_of(obj: Any, max_depth: int = 12) -> list[tuple[Any, ...]]:
    """Paths to every node of ``obj`` down to ``max_depth`` (not the root)."""
    out: list[tuple[Any, ...]] = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), obj)]
    while stack:
        prefix, node = stack.pop()
        if prefix:
            out.append(prefix)
        if len(prefix) >= max_depth:
            continue
        if isinstance(node, dict):
            stack.extend(((*prefix, k), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend(((*prefix, i), v) for i, v in enumerate(node))
    return out


def replaced(obj: Any, path: tuple[Any, ...], value: Any, delete: bool = False) -> Any:
    """A deep copy of ``obj`` with the node at ``path`` replaced (or deleted)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        out = dict(obj)
        if not rest and delete:
            out.pop(head, None)
        else:
            out[head] = replaced(obj[head], rest, value, delete)
        return out
    out_list = list(obj)
    if not rest and delete:
        del out_list[head]
    else:
        out_list[head] = replaced(obj[head], rest, value, delete)
    return out_list


def hello_mutations(base: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """Hellos (captured, then one or two nodes of the message replaced by hostile values:
    strings where maps or lists are expected, negative lengths, infinities, deep nesting...)."""
    paths = paths_of(base)
    swap = st.one_of(
        nested,
        st.sampled_from(EXTREME_INTS),
        st.sampled_from(SPECIAL_FLOATS),
        st.sampled_from(["", "abc", "a", "kv", "host", "cuda:99999999999999999999", "1" * 5000]),
        st.just(deep(DEEP - 10)),
        st.lists(st.sampled_from(["abc", "", "xyz1"]), min_size=1, max_size=3),
        st.lists(st.lists(st.integers(-(2**63), 2**64 - 1), min_size=3, max_size=3), min_size=1, max_size=2),
    )

    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        obj = dict(base)
        for _ in range(draw(st.integers(1, 2))):
            path = draw(st.sampled_from(paths))
            try:
                obj = replaced(obj, path, draw(swap), delete=draw(st.integers(0, 7)) == 0)
            except (KeyError, IndexError, TypeError):
                pass
        if isinstance(obj.get("conn"), str):
            obj["conn"] = uuid.uuid4().hex
        return pack(obj)

    return build()


staged_payloads = st.fixed_dictionaries(
    {"op": st.one_of(st.sampled_from(STAGED_OPS), scalar)},
    optional={
        "n": st.one_of(st.sampled_from(EXTREME_INTS), scalar),
        "slots": st.one_of(st.lists(st.one_of(st.sampled_from(EXTREME_INTS), scalar), max_size=4), scalar, nested),
        "slot": st.one_of(st.sampled_from(EXTREME_INTS), scalar),
        "hold_ms": st.one_of(st.sampled_from(EXTREME_INTS), scalar),
        "dst": st.one_of(right_for(bytes), scalar),
        "len": st.one_of(right_for(bytes), scalar),
        "off": st.one_of(right_for(bytes), scalar),
    },
).map(pack)


def u64s(*values: int) -> bytes:
    return b"".join((v % 2**64).to_bytes(8, "little") for v in values)


# --- the cheap seeded mutator -------------------------------------------------------------------


class Mutator:
    """Hostile frames from a seeded ``random.Random``: random bytes, truncations, byte flips,
    splices and structural mutations of captured legitimate frames, lying msgpack headers."""

    def __init__(self, seed: int, captured: list[bytes]) -> None:
        self.r = random.Random(seed)
        self.captured = [c for c in captured if c]
        self.objs = [unpack(c) for c in self.captured if well_formed(c) is not None]

    # values ----------------------------------------------------------------------------------

    def value(self, depth: int = 0) -> Any:
        r = self.r
        k = r.randrange(16 if depth < 3 else 10)
        if k < 3:
            return r.choice(EXTREME_INTS)
        if k == 3:
            return r.choice(SPECIAL_FLOATS)
        if k == 4:
            return r.choice([True, False, None])
        if k == 5:
            return r.choice(["", "abc", "a", "kv", "ptr", "-1", "nan", "\x00\xff", "cuda:1", "x" * r.randrange(300)])
        if k == 6:
            return r.randbytes(r.randrange(40))
        if k == 7:
            return r.randrange(-(2**63), 2**64)
        if k == 8:
            return msgpack.ExtType(r.randrange(128), r.randbytes(r.randrange(9)))
        if k == 9:
            return deep(r.choice([DEEP - 20, DEEP - 5, DEEP, 50]))
        if k < 13:
            return [self.value(depth + 1) for _ in range(r.randrange(4))]
        return {r.choice(["kv", "aux", "ptr", "length", "item_len", "kind", "x", ""]): self.value(depth + 1)}

    # frames ----------------------------------------------------------------------------------

    def random_bytes(self) -> bytes:
        r = self.r
        n = r.choice([0, 1, 2, 3, 5, 8, 16, 64, 300, 4096])
        return r.randbytes(r.randrange(n + 1))

    def lying_header(self) -> bytes:
        r = self.r
        heads = [b"\xdb", b"\xc6", b"\xdd", b"\xdf", b"\xc9", b"\xd9", b"\xdc", b"\xde"]
        body = r.choice(heads) + r.randbytes(4) + r.randbytes(r.randrange(12))
        return r.choice([body, b"\x83\xa1v\x01\xa1t\xa5hello" + body, b"\x81" + body])

    def truncated(self) -> bytes:
        c = self.r.choice(self.captured)
        return c[: self.r.randrange(len(c))]

    def flipped(self) -> bytes:
        c = bytearray(self.r.choice(self.captured))
        for _ in range(self.r.choice([1, 1, 2, 4, 16])):
            i = self.r.randrange(len(c))
            c[i] = self.r.choice([c[i] ^ (1 << self.r.randrange(8)), self.r.randrange(256), 0xFF, 0x00, 0xC1])
        return bytes(c)

    def spliced(self) -> bytes:
        a, b = self.r.choice(self.captured), self.r.choice(self.captured)
        return a[: self.r.randrange(len(a) + 1)] + b[self.r.randrange(len(b) + 1) :]

    def structural(self) -> bytes:
        """A captured message with a node (anywhere in it) replaced, deleted or added to."""
        r = self.r
        obj = r.choice(self.objs)
        for _ in range(r.choice([1, 1, 2, 3])):
            paths = paths_of(obj)
            path = r.choice(paths)
            op = r.randrange(6)
            try:
                if op == 0:
                    obj = replaced(obj, path, None, delete=True)
                elif op == 1:
                    parent = path[:-1]
                    node = obj
                    for p in parent:
                        node = node[p]
                    if isinstance(node, dict):
                        obj = replaced(obj, (*parent, r.choice(["x", "kv", "", "extra"])), self.value())
                    else:
                        obj = replaced(obj, path, self.value())
                else:
                    obj = replaced(obj, path, self.value())
            except (KeyError, IndexError, TypeError):
                pass
        if isinstance(obj, dict) and obj.get("t") == "hello" and isinstance(obj.get("conn"), str):
            obj["conn"] = uuid.uuid4().hex
        return pack(obj)

    def swapped(self) -> bytes:
        """Field values of one captured message moved into another's fields."""
        r = self.r
        a, b = dict(r.choice(self.objs)), r.choice(self.objs)
        keys_a = [k for k in a if k not in ("v", "t")]
        vals_b = [v for k, v in b.items() if k not in ("v", "t")]
        if keys_a and vals_b:
            a[r.choice(keys_a)] = r.choice(vals_b)
        if r.randrange(3) == 0:
            a["t"] = r.choice(KINDS)
        return pack(a)

    def frame(self) -> bytes | list[bytes]:
        r = self.r
        k = r.randrange(100)
        if k < 14:
            return self.random_bytes()
        if k < 18:
            return self.lying_header()
        if k < 32:
            return self.truncated()
        if k < 50:
            return self.flipped()
        if k < 56:
            return self.spliced()
        if k < 92:
            return self.structural()
        if k < 97:
            return self.swapped()
        if k < 99:
            return [self.r.choice(self.captured), self.random_bytes()]  # a 3-frame message on the ROUTER
        return b""


def session_frames(r: random.Random, sender_tags: list[str], recv_tags: list[str], pages: int) -> Iterator[bytes]:
    """Post-handshake messages with hostile fields for one attacker session: expects for the
    victim's sending transfers (odd page byte counts, huge indices, aux 2**64-1), dones for its
    receiving transfers and for unknown tags, aborts, pings, byes are left out (they end the
    session; the catalogue tests them)."""
    while True:
        k = r.randrange(10)
        if k < 4 and sender_tags:
            tag = sender_tags.pop(r.randrange(len(sender_tags)))
            how = r.randrange(8)
            if how == 0:
                body = r.randbytes(r.choice([1, 3, 7, 9, 15]))
            elif how == 1:
                body = u64s(*[r.choice(EXTREME_INTS) for _ in range(r.randrange(1, 4))])
            elif how == 2:
                body = u64s(pages, 2**62, 2**63 - 1)
            elif how == 3:
                body = u64s(1, 1)  # a page twice
            elif how == 4:
                body = b""
            else:
                body = u64s(*r.sample(range(pages), r.randrange(1, 4)))
            aux = r.choice([-1, -1, 0, 1, 2**31, 2**63 - 1, 2**64 - 1, -(2**63), 10**6])
            state = r.choice([[], [], [u64s(0)], [u64s(2**63 - 1)], [b"\x01"], [None], [u64s(1, 1)], [b""] * 70])
            yield message("expect", tag=tag, pages=body, aux=aux, prefix=0, state=state)
        elif k < 6:
            tag = r.choice([*recv_tags, "unknown-" + str(r.randrange(10**6))]) if recv_tags else "nobody"
            lane = r.choice(["", "", "no-such-driver", "x" * 64])
            notices = r.choice(
                [[], [], [], [b"\x81\xa2op\xa5chunk"], [b""], [1], ["text"], [None], [b"x"] * 9, [b""] * 8]
            )
            yield message("done", tag=tag, bytes=r.choice(EXTREME_INTS), lane=lane, notices=notices)
        elif k < 7:
            tag = r.choice([*sender_tags, "unknown-" + str(r.randrange(10**6))]) if sender_tags else "nobody"
            yield message("abort", tag=tag, reason=r.choice(["", "x" * 1000, "\x00"]))
            if r.random() < 0.5:  # and its confirmation, or one for a live or unknown transfer
                yield message("drained", tag=r.choice([tag, *recv_tags]) if recv_tags else tag)
        elif k < 8:
            yield message("ping", seq=r.choice(EXTREME_INTS))
        else:
            yield message(
                "expect", tag="early-" + str(r.randrange(10**6)), pages=r.randbytes(16), aux=-1, prefix=0, state=[]
            )


def near_limit(r: random.Random) -> bytes:
    """One frame at or just past the 4 MiB limit: a string field, a bytes field, raw bytes."""
    n = LIMIT - r.choice([64, 120, 200])
    k = r.randrange(5)
    if k == 0:
        return message("hello", conn="c" * n, hello={}, regions={}, lanes={})
    if k == 1:
        return message("abort", tag="t", reason="r" * n)
    if k == 2:
        return message("notice", payload=b"\x00" * n, lane="")
    if k == 3:
        return message("ping", seq=1, pad=b"\x00" * n)
    return b"\x81" + b"\x00" * (LIMIT + r.choice([0, 1, 64]))


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else default
