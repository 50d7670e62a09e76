"""HTTP to one etcd member's gateway in which every request ends by its deadline: a ``requests``
transport adapter, mounted on etcd3gw's session, that sends each request over ``http.client``
with the whole request (connect, send, every byte of the answer) bounded by the ``timeout``
it is given.

``requests`` bounds each socket operation, not the request: a member that accepts and sends a
byte every second never times out there, and a refresh that waits for it loses its lease. Here
each connect, send and receive waits at most what is left of the request's time, then the
request fails with ``requests``' own ``Timeout`` (etcd3gw turns it into its
``ConnectionTimeoutError``). Idle connections are kept for the next request (a handful at most)
and dropped when the member closed them; a connection that failed or timed out is closed. No
proxy applies: etcd is reached directly.
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
import time
from typing import Any

import requests
from requests.adapters import BaseAdapter
from requests.structures import CaseInsensitiveDict
from requests.utils import get_encoding_from_headers

#: Idle connections kept per member (one per thread that talks to it at the same time).
MAX_IDLE = 4
#: The most a gateway answer may hold (1,000 routes are about 600 KiB).
MAX_ANSWER_BYTES = 64 << 20


class _DeadlineSocket(socket.socket):
    """A socket each of whose waits ends at ``deadline`` (``time.monotonic()``)."""

    deadline = 0.0

    def _left(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("out of time")
        self.settimeout(left)

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        self._left()
        return super().recv_into(buffer, nbytes, flags)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        self._left()
        return super().recv(bufsize, flags)

    def sendall(self, data: Any, flags: int = 0) -> None:
        self._left()  # since Python 3.5 the timeout bounds the whole sendall
        super().sendall(data, flags)


class _Connection(http.client.HTTPConnection):
    deadline = 0.0

    def connect(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("out of time before connecting")
        raw = socket.create_connection((self.host, self.port), left)
        sock = _DeadlineSocket(raw.family, raw.type, raw.proto, fileno=raw.detach())
        sock.deadline = self.deadline
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    def start(self, deadline: float) -> None:
        self.deadline = deadline
        if isinstance(self.sock, _DeadlineSocket):
            self.sock.deadline = deadline


def _dropped(conn: _Connection) -> bool:
    """Whether an idle connection was closed by the member (readable: EOF, or bytes nobody asked for)."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


class DeadlineAdapter(BaseAdapter):
    """The adapter of one member (``host``, ``port``): ``send`` ends by ``timeout`` seconds
    (a number; a ``(connect, read)`` pair counts as their sum) after it starts."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self.host, self.port = host, port
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()

    def send(
        self,
        request: requests.PreparedRequest,
        stream: bool = False,
        timeout: Any = None,
        verify: Any = True,
        cert: Any = None,
        proxies: Any = None,
    ) -> requests.Response:
        if isinstance(timeout, tuple):
            timeout = sum(t for t in timeout if t is not None)
        budget = 2.0 if timeout is None else float(timeout)
        payload = request.body
        if payload is not None and not isinstance(payload, bytes | str):
            raise requests.exceptions.InvalidHeader("a streamed request body is not sent to etcd", request=request)
        deadline = time.monotonic() + budget
        conn = self._take()
        conn.start(deadline)
        connecting = conn.sock is None
        try:
            conn.request(str(request.method), request.path_url, body=payload, headers=dict(request.headers))
            connecting = False
            answer = conn.getresponse()
            body = answer.read(MAX_ANSWER_BYTES + 1)
        except TimeoutError as exc:  # socket.timeout is TimeoutError
            conn.close()
            kind = requests.exceptions.ConnectTimeout if connecting else requests.exceptions.ReadTimeout
            raise kind(f"{self.host}:{self.port}: no answer within {budget:.3g} s ({exc})", request=request) from exc
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise requests.exceptions.ConnectionError(
                f"{self.host}:{self.port}: {type(exc).__name__}: {exc}", request=request
            ) from exc
        except BaseException:
            conn.close()
            raise
        if len(body) > MAX_ANSWER_BYTES:
            conn.close()
            raise requests.exceptions.ConnectionError(
                f"{self.host}:{self.port}: an answer of more than {MAX_ANSWER_BYTES} bytes", request=request
            )
        if answer.will_close:
            conn.close()
        else:
            self._give_back(conn)
        response = requests.Response()
        response.status_code = answer.status
        response.reason = answer.reason
        response.headers = CaseInsensitiveDict(answer.getheaders())
        response.encoding = get_encoding_from_headers(response.headers)
        response._content = body  # what requests' own adapter fills in as the body is read
        response.url = str(request.url)
        response.request = request
        return response

    def _take(self) -> _Connection:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if not _dropped(conn):
                    return conn
                conn.close()
        return _Connection(self.host, self.port)

    def _give_back(self, conn: _Connection) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def deadline_session(host: str, port: int) -> requests.Session:
    """A session whose requests to ``http://`` URLs go through a :class:`DeadlineAdapter` of
    ``host``:``port`` (the session of one member's etcd3gw clients)."""
    session = requests.Session()
    session.trust_env = False  # no proxy, no .netrc: etcd is reached directly
    session.mount("http://", DeadlineAdapter(host, port))
    return session
