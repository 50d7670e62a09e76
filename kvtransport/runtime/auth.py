"""Who may talk to an endpoint: the deployment secret, the handshake that proves it both ways,
and the per-session seal on every later control message.

Every process of a deployment holds one secret (``KVTRANSPORT_SECRET``, or a file named by
``KVTRANSPORT_SECRET_FILE`` that only its owner can read). The control handshake proves
knowledge of it in both directions before either side reveals anything about itself
(docs/security.md has the full exchange and the reasons for HMAC over CurveZMQ):

1. initiator -> acceptor ``auth``      {conn, nonce_i}            (plain)
2. acceptor  -> initiator ``challenge`` {conn, nonce_a}            (plain; a cookie, nothing kept)
3. initiator -> acceptor ``proof``     {conn, nonce_i, nonce_a, HMAC(K, "initiator" | conn | nonce_i | nonce_a)}
4. acceptor  -> initiator ``proof``     {conn, nonce_i, nonce_a, HMAC(K, "acceptor"  | conn | nonce_i | nonce_a)}
5. from here every frame is *sealed* with a key of its direction derived from the same inputs:
   ``0xC1 | seq (8 bytes) | HMAC(k_dir, 0xC1 | seq | body) | body``; the receiver drops a frame whose
   MAC does not verify or whose sequence number is not above the last one it accepted.

The initiator proves first, so an acceptor (the side a stranger on the network can reach)
never hands a value derived from the secret to someone who has not proved it holds it; the
initiator proves only to the address it chose to dial, and learns the acceptor's proof before
it sends its hello. Fresh nonces on both sides make every session's keys new: a captured frame
verifies in no other session, and within its own session only once.

An endpoint without a secret runs the same exchange with a well-known key: it is then open to
anyone who can reach its port, which :func:`control_plane_policy` permits only on loopback or
with ``KVTRANSPORT_INSECURE=1``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtransport.spi.errors import ConfigError

if TYPE_CHECKING:
    from hashlib import _Hash

log = logging.getLogger(__name__)

ENV_SECRET = "KVTRANSPORT_SECRET"
ENV_SECRET_FILE = "KVTRANSPORT_SECRET_FILE"
ENV_INSECURE = "KVTRANSPORT_INSECURE"

#: Shortest secret accepted: 32 characters (``secrets.token_hex(16)`` is 128 random bits); a
#: person's password is not random, whatever its length.
MIN_SECRET_BYTES = 32
NONCE_BYTES = 32
MAC_BYTES = 32
#: First byte of a sealed frame; never the first byte of a msgpack document (0xC1 is unused).
SEALED = 0xC1
_HEADER = struct.Struct(">BQ")
_SEQ = struct.Struct(">Q")
_PREFIX = b"kvtransport/1 "
_NO_SECRET = b""


def _framed(parts: tuple[bytes, ...]) -> bytes:
    """``parts``, each length-prefixed, so that no two different inputs give the same bytes."""
    return b"".join(_SEQ.pack(len(p)) + p for p in parts)


@dataclass(frozen=True, repr=False)
class Secret:
    """The deployment's key, derived from the secret (never the secret itself), and where it
    came from. ``authenticated`` is False for the well-known key of an endpoint without one."""

    key: bytes
    source: str
    authenticated: bool

    def __repr__(self) -> str:  # never the key
        return f"Secret(source={self.source!r}, authenticated={self.authenticated})"

    def derive(self, label: bytes, *parts: bytes) -> bytes:
        """A key or proof for one purpose (``label``) bound to ``parts``."""
        return hmac.digest(self.key, _PREFIX + label + _framed(parts), hashlib.sha256)

    @classmethod
    def from_bytes(cls, raw: bytes, source: str) -> Secret:
        if len(raw) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"the secret from {source} is {len(raw)} bytes; use at least {MIN_SECRET_BYTES} random characters, "
                "e.g. the output of: python -c 'import secrets; print(secrets.token_hex(32))'"
            )
        return cls(hmac.digest(b"kvtransport deployment secret v1", raw, hashlib.sha256), source, True)

    @classmethod
    def none(cls) -> Secret:
        return cls(hmac.digest(b"kvtransport deployment secret v1", _NO_SECRET, hashlib.sha256), "none", False)


def load_secret(explicit: bytes | str | None = None, env: Mapping[str, str] | None = None) -> Secret:
    """The secret an endpoint uses: ``explicit`` if given, else ``KVTRANSPORT_SECRET``, else the
    file named by ``KVTRANSPORT_SECRET_FILE``, else none. Setting both variables is an error
    (which one wins would be a guess)."""
    env = os.environ if env is None else env
    if explicit is not None:
        raw = explicit.encode() if isinstance(explicit, str) else bytes(explicit)
        return Secret.from_bytes(raw, "the secret argument")
    value, path = env.get(ENV_SECRET, ""), env.get(ENV_SECRET_FILE, "")
    if value and path:
        raise ConfigError(f"both {ENV_SECRET} and {ENV_SECRET_FILE} are set; set one of them")
    if value:
        return Secret.from_bytes(value.encode(), ENV_SECRET)
    if path:
        return Secret.from_bytes(_read_secret_file(path), f"{ENV_SECRET_FILE}={path}")
    return Secret.none()


def _read_secret_file(path: str) -> bytes:
    """The secret in ``path``: a regular file (a symbolic link is followed, as Kubernetes
    mounts a Secret), owned by this user or by root, that nobody else may write and that is
    not readable by "other" (group read is allowed: a pod's ``fsGroup``)."""
    real = os.path.realpath(path)
    try:
        fd = os.open(real, os.O_RDONLY)
    except OSError as exc:
        raise ConfigError(f"{ENV_SECRET_FILE}={path}: cannot open it ({exc.strerror})") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{ENV_SECRET_FILE}={path} is not a regular file")
        if info.st_uid not in (os.geteuid(), 0):
            raise ConfigError(f"{ENV_SECRET_FILE}={path} belongs to uid {info.st_uid}, not to this user or root")
        if info.st_mode & 0o027:
            raise ConfigError(
                f"{ENV_SECRET_FILE}={path} is readable by others or writable by its group "
                f"(mode {stat.S_IMODE(info.st_mode):o}); run: chmod 600 {real}"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(1 << 16)
    finally:
        os.close(fd)
    return raw.rstrip(b"\r\n")


def is_loopback(listen: str) -> bool:
    """Whether a ``tcp://host:port`` listen address binds loopback only."""
    host = listen.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a wildcard, a name or an interface: reachable from elsewhere


def insecure_opt_out(env: Mapping[str, str]) -> bool:
    """Whether ``KVTRANSPORT_INSECURE=1`` says the network is trusted; raises
    :class:`ConfigError` for any value but 1, 0 or unset (a typo must not decide security)."""
    insecure = env.get(ENV_INSECURE, "").strip()
    if insecure not in ("", "0", "1"):
        raise ConfigError(f"{ENV_INSECURE}={insecure!r}: set it to 1 (trusted network) or unset it")
    return insecure == "1"


def control_plane_policy(listen: str, secret: Secret, env: Mapping[str, str] | None = None) -> str:
    """Whether an endpoint may listen on ``listen`` with ``secret``, and why, in one line.

    Raises :class:`ConfigError` for an endpoint reachable from other hosts without a secret,
    unless ``KVTRANSPORT_INSECURE=1`` says the network is trusted."""
    env = os.environ if env is None else env
    if secret.authenticated:
        return f"authenticated: deployment secret from {secret.source}"
    if is_loopback(listen):
        return "not authenticated: no secret, loopback only (any local user can connect; set KVTRANSPORT_SECRET)"
    if insecure_opt_out(env):
        return f"NOT AUTHENTICATED: {ENV_INSECURE}=1 on {listen}; anyone who reaches the port can read and write KV"
    raise ConfigError(
        f"refusing to listen on {listen} without a deployment secret: anyone who reaches it could read and "
        f"overwrite this rank's KV. Set {ENV_SECRET} (or {ENV_SECRET_FILE}) to the same random value in every "
        f"process of the deployment, or {ENV_INSECURE}=1 if the network is trusted"
    )


def control_plane_report(listen: str, env: Mapping[str, str] | None = None) -> tuple[bool, str, str]:
    """For ``kvtransport doctor``: (authenticated, one line saying so and why, the problem that
    would stop an endpoint listening on ``listen``, or "")."""
    try:
        secret = load_secret(env=env)
        return secret.authenticated, control_plane_policy(listen, secret, env), ""
    except ConfigError as exc:
        return False, f"an endpoint on {listen} would refuse to start", str(exc)


# -- the handshake ------------------------------------------------------------------------------


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def proof(secret: Secret, role: str, conn: str, nonce_i: bytes, nonce_a: bytes) -> bytes:
    """What ``role`` ("initiator" or "acceptor") sends to prove it holds the secret."""
    return secret.derive(b"proof " + role.encode(), conn.encode(), nonce_i, nonce_a)


def proof_ok(secret: Secret, role: str, conn: str, nonce_i: bytes, nonce_a: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(proof(secret, role, conn, nonce_i, nonce_a), mac)


#: Largest unsealed frame worth decoding: the exchange's messages and a refusal are a few
#: hundred bytes; a stranger's 4 MiB of nested msgpack would cost the I/O thread seconds.
MAX_UNSEALED_BYTES = 1024
_COOKIE = struct.Struct(">16sI12s")  # random, issue time (s), MAC: NONCE_BYTES in all


class ChallengeCookies:
    """The acceptor's nonce, made so that it keeps no state for a party that has not proved
    the secret: ``nonce_a`` carries its issue time and a MAC (under a key of this endpoint only)
    over the route, connection id and initiator's nonce it was issued for. The initiator's
    proof echoes both nonces; the acceptor checks the cookie, then the proof, and only then
    remembers anything. A flood of ``auth`` messages costs one HMAC each and no memory."""

    def __init__(self) -> None:
        self._key = os.urandom(32)

    def _mac(self, route: bytes, conn: str, nonce_i: bytes, rand: bytes, issued: int) -> bytes:
        data = _framed((route, conn.encode(), nonce_i, rand, _SEQ.pack(issued)))
        return hmac.digest(self._key, data, hashlib.sha256)[:12]

    def issue(self, route: bytes, conn: str, nonce_i: bytes, now: float | None = None) -> bytes:
        rand, issued = os.urandom(16), int(time.time() if now is None else now)
        return _COOKIE.pack(rand, issued, self._mac(route, conn, nonce_i, rand, issued))

    def valid(
        self, route: bytes, conn: str, nonce_i: bytes, nonce_a: bytes, max_age: float, now: float | None = None
    ) -> bool:
        if len(nonce_a) != _COOKIE.size:
            return False
        rand, issued, mac = _COOKIE.unpack(nonce_a)
        age = (time.time() if now is None else now) - issued
        return -1 <= age <= max_age and hmac.compare_digest(mac, self._mac(route, conn, nonce_i, rand, issued))


class Seal:
    """One session's message authentication, one key per direction. ``channel`` names what
    it seals: the control channel (``b"session"``) or the express stream (``b"express"``),
    keys of their own, so a frame of one never verifies on the other. Not thread-safe: one
    thread at a time seals (the I/O thread, or the express stream's writer under its lock),
    and the I/O thread opens."""

    __slots__ = ("_recv_inner", "_recv_outer", "_recv_seq", "_send_inner", "_send_outer", "_send_seq", "rejected")

    def __init__(
        self,
        secret: Secret,
        conn: str,
        nonce_i: bytes,
        nonce_a: bytes,
        *,
        initiator: bool,
        channel: bytes = b"session",
    ) -> None:
        parts = (conn.encode(), nonce_i, nonce_a)
        i2a = secret.derive(channel + b" initiator->acceptor", *parts)
        a2i = secret.derive(channel + b" acceptor->initiator", *parts)
        send_key, recv_key = (i2a, a2i) if initiator else (a2i, i2a)
        # Keyed once; each frame copies the keyed states (a third cheaper than hmac.digest).
        self._send_inner, self._send_outer = _hmac_states(send_key)
        self._recv_inner, self._recv_outer = _hmac_states(recv_key)
        self._send_seq = 0
        self._recv_seq = 0
        #: Frames dropped: MAC wrong, replayed or reordered, or malformed.
        self.rejected = 0

    def seal(self, body: bytes) -> bytes:
        """``0xC1 | seq | HMAC(k_dir, 0xC1 | seq | body) | body``."""
        self._send_seq += 1
        header = _HEADER.pack(SEALED, self._send_seq)
        return header + _hmac(self._send_inner, self._send_outer, header, body) + body

    def open(self, frame: bytes) -> bytes | None:
        """The body of an authentic, fresh frame; ``None`` (and counted) for anything else."""
        n = _HEADER.size
        if len(frame) < n + MAC_BYTES or frame[0] != SEALED:
            self.rejected += 1
            return None
        header, got, body = frame[:n], frame[n : n + MAC_BYTES], frame[n + MAC_BYTES :]
        if not hmac.compare_digest(got, _hmac(self._recv_inner, self._recv_outer, header, body)):
            self.rejected += 1
            return None
        seq = _HEADER.unpack(header)[1]
        if seq <= self._recv_seq:  # a replay, or a reordered copy of one
            self.rejected += 1
            return None
        self._recv_seq = seq
        return body


def _hmac_states(key: bytes) -> tuple[_Hash, _Hash]:
    """HMAC-SHA256 (RFC 2104) keyed once, as its inner and outer SHA-256 states: per frame, two
    copies and four C calls, where ``hmac.HMAC`` adds a Python-level call to each step (a
    sealed message's path runs on cores whose caches went cold between requests)."""
    block = hashlib.sha256().block_size
    if len(key) > block:
        key = hashlib.sha256(key).digest()
    key = key.ljust(block, b"\0")
    return hashlib.sha256(bytes(b ^ 0x36 for b in key)), hashlib.sha256(bytes(b ^ 0x5C for b in key))


def _hmac(inner: _Hash, outer: _Hash, header: bytes, body: bytes) -> bytes:
    """HMAC(key, header | body) from the states :func:`_hmac_states` made of key."""
    mac = inner.copy()
    mac.update(header)
    mac.update(body)
    out = outer.copy()
    out.update(mac.digest())
    return out.digest()


def is_sealed(frame: bytes) -> bool:
    return bool(frame) and frame[0] == SEALED


class RateLimitedLog:
    """Warnings about strangers, at most ``burst`` per ``period`` seconds: a flood of failed
    handshakes must not become a flood of log lines. Suppressed ones are counted and reported
    with the next warning that gets through."""

    def __init__(self, logger: logging.Logger, period: float = 10.0, burst: int = 5) -> None:
        self._log, self._period, self._burst = logger, period, burst
        self._window = 0.0
        self._count = 0
        self._suppressed = 0
        self._lock = threading.Lock()

    def warning(self, fmt: str, *args: object) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._window >= self._period:
                self._window, self._count = now, 0
            if self._count >= self._burst:
                self._suppressed += 1
                self._log.debug(fmt, *args)
                return False
            self._count += 1
            suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            self._log.warning(fmt + " (and %d similar, not logged)", *args, suppressed)
        else:
            self._log.warning(fmt, *args)
        return True
