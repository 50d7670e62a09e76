"""Discovery on etcd: each prefill rank's route under a lease its owner keeps alive, with a
generation and the deployment secret's signature; readers look routes up with a bounded wait.

Keys (``prefix`` from ``KVTRANSPORT_DISCOVERY``; the instance is what SGLang calls the
bootstrap address, ``host:port``, percent-encoded into one path segment)::

    <prefix>/instances/<instance>/ranks/<dp_rank>/<tp_rank>  ->  signed entry (entries.py)

- **Leases.** A :class:`EtcdDirectory` that registers takes one lease of ``ttl`` seconds
  (``KVTRANSPORT_DISCOVERY_TTL``, 10 by default) and refreshes it every third of that on a
  daemon thread; a refresh that fails is tried again within a quarter of what is left of the
  lease.
  A process that dies stops refreshing: etcd deletes its entries when the lease expires, TTL
  after the last refresh, or TTL (plus etcd's election timeout) after etcd's leader last
  changed, whichever is later (a new leader renews every lease: docs/discovery.md). A lease
  that expired while its owner lived (etcd restarted without its data, a partition longer than
  the TTL) is replaced by a new one and the entry written again on the next refresh.
- **Each refresh checks the entry.** The owner reads its key with the lease etcd holds it on
  and writes its entry again unless the key holds this start's bytes on this start's lease:
  an entry put back without the lease (or on another) by anyone with write access would
  outlive its owner. Entries are signed with the lease they were written on (entries.py), and
  readers ignore one that etcd holds on another (``detached``).
- **Generations.** A start of a rank takes a generation larger than any under its key (the
  nanosecond clock of its start, or one more than what is there, whichever is larger: a clock
  that went back does not stop a restart) and writes it over its old entry, whose lease may
  still run. A client that finds a larger generation under its key when it refreshes has been
  superseded by a later start, and stops. Every write is a transaction conditional on the
  revision it read, so an old start cannot overwrite a newer one between its read and its put:
  readers find the newest start, and peers reconnect to it.
- **Who may write.** Readers accept only entries their deployment secret signed (entries.py);
  any other is ignored, counted (``forged``) and logged, rate-limited. Without a secret, every
  etcd endpoint must be on loopback unless ``KVTRANSPORT_INSECURE=1``.

etcd is reached through its HTTP gateway (etcd 3.4 or later) with ``etcd3gw`` (imported when
first used: install ``kvtransport[etcd]``), each request bounded as a whole (deadline_http.py).
A call tries the endpoint that answered last first, the others in their order, and those that
failed lately last (for 1 s, doubling up to 30 s while they keep failing); each try gets half
of what is left of the call's time while another endpoint remains (at most ``timeout``, 2 s by
default), so one hung, slow or black-holed member never uses up a refresh or a lookup.
"""

from __future__ import annotations

import base64
import functools
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtransport.integrations.bootstrap.routes import validated
from kvtransport.integrations.discovery.entries import Entry, ForgedEntry, decode_entry, encode_entry
from kvtransport.runtime.auth import RateLimitedLog, Secret, load_secret
from kvtransport.runtime.discovery_config import EtcdConfig, check_policy, discovery_ttl
from kvtransport.spi.errors import ConfigError, ConnectError, ProtocolError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between tries while etcd does not answer a first registration, doubling up to the cap.
FIRST_RETRY_S, MAX_RETRY_S = 0.5, 10.0
#: Seconds between reads while a looked-up rank has no entry yet.
LOOKUP_POLL_S = 0.05


class DiscoveryUnreachable(ConnectError):
    """No etcd endpoint answered: worth trying again, unlike a refusal."""


#: The most one request to one endpoint waits (a call with a deadline gives each less: below).
DEFAULT_TIMEOUT = 2.0
#: The least one request to one endpoint is given, however little of its call's time is left
#: (a lookup with no wait still reads once).
MIN_TRY_S = 0.1
#: An endpoint that failed is tried after the others for this long, doubling while it keeps
#: failing, up to the cap; then it is tried in its turn again.
FIRST_BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0
#: The API path of etcd's gateway (etcd 3.4 and later): fixed, so a call is one request.
API_PATH = "/v3/"


class _Health:
    """What a store remembers of one endpoint that failed."""

    __slots__ = ("backoff", "until")

    def __init__(self) -> None:
        self.until = 0.0  # tried after the others until then (monotonic)
        self.backoff = 0.0  # how long the next failure sets it aside (0: it answered last time)


class EtcdStore:
    """One process's clients of one etcd cluster (shared by its directories: ``store_for``).

    Each call (:meth:`run`) tries the endpoints in turn: the one that answered last first, the
    others in their order, and those that failed lately last. Each try is one HTTP request
    bounded as a whole (``deadline_http``) by a share of what is left of the call's time: half
    of it while two or more endpoints are left to try, so that one hung, slow or black-holed
    member leaves the next one at least as long; never more than ``timeout``."""

    def __init__(self, config: EtcdConfig, timeout: float = DEFAULT_TIMEOUT) -> None:
        try:
            from etcd3gw.client import Etcd3Client  # noqa: F401 - whether the client is installed
        except ImportError as exc:
            raise ConfigError(
                f"discovery on etcd ({config.describe()}) needs the etcd3gw package: pip install 'kvtransport[etcd]'"
            ) from exc
        from kvtransport.integrations.discovery.deadline_http import deadline_session

        self.config = config
        self.timeout = timeout
        #: One session per endpoint (its connections), shared by the clients of every thread.
        self._sessions = [deadline_session(h, p) for h, p in config.endpoints]
        #: Each thread's clients: a client's timeout is set per try.
        self._local = threading.local()
        self._health = [_Health() for _ in config.endpoints]
        self._current = 0
        self._lock = threading.Lock()

    def _client(self, i: int, timeout: float) -> Any:
        from etcd3gw.client import Etcd3Client

        clients: list[Any] | None = getattr(self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = [None] * len(self._sessions)
        client = clients[i]
        if client is None:
            host, port = self.config.endpoints[i]
            client = clients[i] = Etcd3Client(host=host, port=port, timeout=timeout, api_path=API_PATH)
            client.session = self._sessions[i]
        client.timeout = timeout
        return client

    def order(self, now: float | None = None) -> list[int]:
        """The endpoints in the order a call tries them now."""
        now = time.monotonic() if now is None else now
        with self._lock:
            count = len(self._health)
            turn = [(self._current + k) % count for k in range(count)]
            ready = [i for i in turn if self._health[i].until <= now]
            aside = sorted((i for i in turn if self._health[i].until > now), key=lambda i: self._health[i].until)
        return ready + aside

    def unhealthy(self) -> list[str]:
        """The endpoints set aside now (``host:port``), for logs and tests."""
        now = time.monotonic()
        with self._lock:
            aside = [health.until > now for health in self._health]
        return [f"{h}:{p}" for (h, p), out in zip(self.config.endpoints, aside, strict=True) if out]

    def run(self, what: str, fn: Callable[[Any], T], deadline: float | None = None) -> T:
        """``fn(client)`` on each endpoint in :meth:`order` until one answers, within
        ``deadline`` (``timeout`` from now by default); raises :class:`DiscoveryUnreachable`
        naming every failure when none answers."""
        from etcd3gw.exceptions import Etcd3Exception
        from requests import RequestException

        start = time.monotonic()
        if deadline is None:
            deadline = start + self.timeout
        order = self.order(start)
        failures: list[str] = []
        for k, i in enumerate(order):
            left = deadline - time.monotonic()
            if failures and left <= 0:
                failures.append("out of time")
                break
            # Half of what is left while another endpoint remains: a member that hangs costs
            # the call at most that, and the next one still gets as long.
            share = max(left / min(len(order) - k, 2), MIN_TRY_S)
            try:
                result = fn(self._client(i, min(share, self.timeout)))
            except (Etcd3Exception, RequestException, OSError, KeyError, TypeError, ValueError) as exc:
                # KeyError and the rest: a gateway answer that is not what the client expects.
                host, port = self.config.endpoints[i]
                failures.append(f"{host}:{port}: {type(exc).__name__}: {_describe(exc)}")
                self._failed(i, host, port, exc)
                continue
            self._answered(i)
            return result
        raise DiscoveryUnreachable(f"etcd at {self.config.describe()}: {what} failed ({'; '.join(failures)})")

    def _failed(self, i: int, host: str, port: int, exc: BaseException) -> None:
        with self._lock:
            health = self._health[i]
            newly = health.backoff == 0
            health.backoff = min(max(health.backoff * 2, FIRST_BACKOFF_S), MAX_BACKOFF_S)
            health.until = time.monotonic() + health.backoff
            backoff = health.backoff
        if newly and len(self._health) > 1:
            _warnings.warning(
                "discovery: etcd endpoint %s:%d failed (%s: %s); tried after the others for %g s",
                host,
                port,
                type(exc).__name__,
                _describe(exc),
                backoff,
            )

    def _answered(self, i: int) -> None:
        with self._lock:
            self._current = i
            health = self._health[i]
            recovered = health.backoff > 0
            health.until = health.backoff = 0.0
        if recovered:
            host, port = self.config.endpoints[i]
            log.info("discovery: etcd endpoint %s:%d answers again", host, port)


_stores: dict[EtcdConfig, EtcdStore] = {}
_stores_lock = threading.Lock()


def store_for(config: EtcdConfig) -> EtcdStore:
    """The process's store of ``config`` (one per cluster a process names: a handful at most)."""
    with _stores_lock:
        store = _stores.get(config)
        if store is None:
            store = _stores[config] = EtcdStore(config)
        return store


#: Shared by every directory of the process: lookups make a directory each, and a stranger's
#: entries must not turn into a log line per lookup.
_warnings = RateLimitedLog(log)
_forged_lock = threading.Lock()
_forged_total = 0


def forged_entries() -> int:
    """Entries every directory of this process ignored because their signature did not verify."""
    return _forged_total


def _count_forged() -> None:
    global _forged_total
    with _forged_lock:
        _forged_total += 1


def _describe(exc: BaseException) -> str:
    """An exception's text (etcd3gw's keep theirs in ``detail_text``), cut short."""
    text = " ".join(str(part) for part in (exc, getattr(exc, "detail_text", None)) if part)
    return text[:200]


@dataclass(frozen=True)
class _Stored:
    """What etcd holds under a key: the value, its revision and the lease it is on (0: none)."""

    raw: bytes
    revision: int
    lease: int


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class EtcdDirectory:
    """The routes of one prefill instance (``instance``: its bootstrap address) on etcd.

    The same calls as :class:`~kvtransport.integrations.bootstrap.BootstrapClient`: a prefill
    rank registers and keeps its route alive; a decode rank looks routes up."""

    #: Rooms are not published here: instances that route by bootstrap room only.
    serves_rooms = False

    def __init__(
        self,
        instance: str,
        config: EtcdConfig,
        *,
        ttl: float | None = None,
        secret: Secret | None = None,
        generation: int | None = None,
    ) -> None:
        self.instance = instance
        self.config = config
        self.ttl = discovery_ttl() if ttl is None else ttl
        self._secret = load_secret() if secret is None else secret
        check_policy(config, self._secret)
        self._store = store_for(config)
        self.timeout = self._store.timeout
        self.base = config.describe()
        self._prefix = f"{config.prefix}/instances/{urllib.parse.quote(instance, safe='')}"
        #: This start's generation (raised at its first write above any already under its key).
        self.generation = time.time_ns() if generation is None else generation
        self._claimed = False  # this start has written its entry once
        self._lease: int | None = None
        #: When the lease runs out at the latest, as last renewed (monotonic; 0: none).
        self._lease_ends = 0.0
        self._route: dict[str, Any] | None = None
        self._interval = self.ttl / 3
        self._keeper: threading.Thread | None = None
        self._stop = threading.Event()
        #: Serialises this client's writes (held across their requests); ``close`` never takes it.
        self._write_lock = threading.Lock()
        self._lock = threading.Lock()  # the fields above, briefly
        #: Set while the route is registered.
        self.registered = threading.Event()
        #: Set once a later start of this rank took the key: this client stops refreshing.
        self.superseded = False
        #: Entries this directory ignored because their signature did not verify.
        self.forged = 0
        #: Entries this directory ignored because etcd holds them on another lease than the one
        #: they were signed for (put back without it, or on another: they would outlive their owner).
        self.detached = 0
        #: Times this owner found its own entry off its lease and put it back on.
        self.restored = 0

    def __repr__(self) -> str:
        return f"EtcdDirectory({self.instance!r} on {self.base})"

    def key(self, dp_rank: int, tp_rank: int) -> str:
        return f"{self._prefix}/ranks/{int(dp_rank)}/{int(tp_rank)}"

    # -- writes ---------------------------------------------------------------------------------

    def register(self, route: Mapping[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Publish ``route`` under its (dp, tp) key, on this client's lease (taken now if it has
        none or it expired). Raises :class:`ConnectError` when a later start of the rank holds
        the key, :class:`DiscoveryUnreachable` when etcd does not answer within ``timeout``."""
        clean = validated(dict(route))
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            try:
                if not self._write_lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
                    raise DiscoveryUnreachable(f"etcd at {self.base}: another write of this client is still waiting")
                try:
                    self._write(clean, deadline)
                finally:
                    self._write_lock.release()
                break
            except DiscoveryUnreachable:
                if time.monotonic() + FIRST_RETRY_S >= deadline:
                    raise
                time.sleep(FIRST_RETRY_S)
        with self._lock:
            self._route = clean
        self.registered.set()
        return {"ttl": self.ttl, "generation": self.generation}

    def _write(self, route: dict[str, Any], deadline: float | None) -> None:
        """Write this start's entry for ``route``: a transaction conditional on the revision
        just read, so that nothing written meanwhile (a later start) is overwritten."""
        key = self.key(route["dp_rank"], route["tp_rank"])
        for _ in range(4):
            current, revision = self._read(key, deadline)
            if current is not None and current.generation >= self.generation:
                if self._claimed and current.generation > self.generation:
                    self.superseded = True
                    raise ConnectError(
                        f"prefill rank dp={route['dp_rank']} tp={route['tp_rank']} of {self.instance} is registered "
                        f"in {self.base} by a later start (generation {current.generation} > {self.generation}); "
                        "this one no longer publishes it"
                    )
                if not self._claimed:
                    # A start takes the key whatever is there: what is there is an earlier start
                    # (whose clock may have run ahead of this host's).
                    self.generation = current.generation + 1
            if self._lease is None:
                asked = time.monotonic()
                self._lease = self._store.run("grant a lease", self._grant, deadline)
                self._lease_ends = asked + self.ttl
            value = encode_entry(self._secret, key, route, self.generation, self._lease)
            done = self._store.run(
                "put", functools.partial(self._put_if, key=key, value=value, revision=revision), deadline
            )
            if done is None:
                # The lease expired before this write (etcd restarted empty, or nothing refreshed
                # it for longer than its TTL): a new one, and the entry on it.
                log.info("discovery: the lease of %s expired in etcd; taking a new one", key)
                self._lease = None
                continue
            if done:
                self._claimed = True
                return
            # The key changed between the read and the write: read it again.
        raise DiscoveryUnreachable(f"etcd at {self.base}: {key} kept changing under this client's writes")

    def _grant(self, client: Any) -> int:
        return int(client.lease(ttl=max(2, round(self.ttl))).id)

    def _put_if(self, client: Any, *, key: str, value: bytes, revision: int) -> bool | None:
        """Put ``value`` on this client's lease if ``key`` is still at ``revision`` (0: absent).
        ``False``: it changed; ``None``: etcd no longer knows the lease."""
        from etcd3gw.exceptions import Etcd3Exception

        target = {"target": "MOD", "mod_revision": revision} if revision else {"target": "CREATE", "create_revision": 0}
        txn = {
            "compare": [{"key": _b64(key.encode()), "result": "EQUAL", **target}],
            "success": [{"request_put": {"key": _b64(key.encode()), "value": _b64(value), "lease": self._lease}}],
            "failure": [],
        }
        try:
            result = client.transaction(txn)
        except Etcd3Exception as exc:
            if "not found" in f"{exc} {exc.detail_text}".lower():
                return None
            raise
        return bool(result.get("succeeded", False))

    def keep_registered(
        self, route: Mapping[str, Any], interval: float | None = None, *, first_wait: float | None = None
    ) -> bool:
        """Register ``route``, then keep its lease alive (and the entry written) on a daemon
        thread every ``interval`` seconds (a third of the TTL by default; less than the TTL)
        until :meth:`close`. etcd not answering within ``first_wait`` is tried again in the
        background, with a warning. Returns whether the route is registered already."""
        clean = validated(dict(route))
        if interval is not None:
            if not 0 < interval < self.ttl:
                raise ConfigError(f"refresh interval {interval!r} must be a positive number of seconds below the TTL")
            self._interval = interval
        try:
            self.register(clean, timeout=first_wait)
            registered = True
        except DiscoveryUnreachable as exc:
            log.warning("discovery: %s; registering in the background until etcd answers", exc)
            with self._lock:
                self._route = clean
            registered = False
        with self._lock:
            if self._keeper is None:
                self._stop.clear()
                self._keeper = threading.Thread(target=self._keep, name="kvtransport-discovery-refresh", daemon=True)
                self._keeper.start()
        return registered

    def _keep(self) -> None:
        retry = FIRST_RETRY_S
        wait = self._interval if self.registered.is_set() else retry
        while not self._stop.wait(wait):
            with self._lock:
                route = self._route
            if route is None or self.superseded:
                return
            first = not self.registered.is_set()
            try:
                with self._write_lock:
                    if self._stop.is_set():
                        return
                    self._refresh(route)
            except Exception as exc:  # noqa: BLE001 - the refresher must outlive any one failure
                if self.superseded:
                    log.warning("discovery: %s", exc)
                    self.registered.clear()
                    return
                retry = min(retry * 2, MAX_RETRY_S)
                left = self._lease_ends - time.monotonic()
                if left > 0:
                    # The lease still runs: try again well before it ends. A back-off as long as
                    # what is left of the lease would turn one failed refresh into a lost entry.
                    wait = max(min(self._interval / 2, left / 4), LOOKUP_POLL_S)
                else:
                    self.registered.clear()
                    wait = retry
                _warnings.warning(
                    "discovery: refreshing rank dp=%s tp=%s of %s failed (next try in %.2g s; its lease %s): %s",
                    route["dp_rank"],
                    route["tp_rank"],
                    self.instance,
                    wait,
                    f"runs {left:.2g} s more" if left > 0 else "may have expired",
                    exc,
                )
                continue
            retry = FIRST_RETRY_S
            wait = self._interval
            self.registered.set()
            if first:
                log.info("discovery: rank dp=%s tp=%s of %s registered", route["dp_rank"], route["tp_rank"], self.base)

    def _refresh(self, route: dict[str, Any]) -> None:
        """One refresh: keep the lease alive (a lease etcd no longer knows is replaced), then
        check that the key holds this start's entry, byte for byte, on this lease, and write it
        again if not: an entry that went missing, was overwritten by something that is not a
        later start, or was put back off the lease (which would outlive this process)."""
        started = time.monotonic()
        deadline = started + self._interval
        if self._lease is not None:
            lease = self._lease
            left = self._store.run("refresh the lease", lambda c: self._lease_of(c, lease).refresh(), deadline)
            if left <= 0:
                log.info("discovery: the lease of %s expired in etcd; taking a new one", self.instance)
                self._lease = None
            else:
                self._lease_ends = started + left
        key = self.key(route["dp_rank"], route["tp_rank"])
        if self._lease is None:
            self._write(route, deadline)
            return
        stored = self._fetch(key, deadline)
        if stored is not None and stored.raw == encode_entry(self._secret, key, route, self.generation, self._lease):
            if stored.lease == self._lease:
                return
            # This start's own bytes, off its lease: put back by a client with write access.
            self.restored += 1
            _warnings.warning(
                "discovery: the entry of rank dp=%s tp=%s of %s is on %s, not on its owner's lease %d: "
                "someone with write access to etcd put it back; restoring it on the lease",
                route["dp_rank"],
                route["tp_rank"],
                self.instance,
                f"lease {stored.lease}" if stored.lease else "no lease",
                self._lease,
            )
        self._write(route, deadline)

    @staticmethod
    def _lease_of(client: Any, lease: int) -> Any:
        from etcd3gw.lease import Lease

        return Lease(lease, client=client)

    def register_room(self, room: int, dp_rank: int, timeout: float | None = None) -> None:
        raise ConfigError(
            "discovery on etcd serves prefill instances that route by bootstrap room "
            "(SGLang's --load-balance-method follow_bootstrap_room); one that registers each room needs the "
            "built-in bootstrap server (unset KVTRANSPORT_DISCOVERY)"
        )

    def unregister(self, timeout: float | None = None) -> None:
        """Stop refreshing and revoke the lease: etcd deletes this client's entries now. Waits
        at most ``timeout`` seconds (the request timeout by default); an entry not revoked then
        expires with its lease."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self.close(timeout)
        with self._lock:
            lease, self._lease = self._lease, None
            self._route = None
        self.registered.clear()
        if lease is not None:
            self._store.run("revoke the lease", lambda c: self._lease_of(c, lease).revoke(), deadline)

    def close(self, timeout: float | None = None) -> None:
        """Stop the refresher (the entries stay until the lease expires); waits for it at most
        ``timeout`` seconds (the request timeout by default)."""
        self._stop.set()
        with self._lock:
            keeper, self._keeper = self._keeper, None
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join(self.timeout if timeout is None else timeout)

    # -- reads ----------------------------------------------------------------------------------

    def _fetch(self, key: str, deadline: float | None = None) -> _Stored | None:
        """What etcd holds under ``key`` (``None``: nothing), with its revision and lease."""
        found = self._store.run("get", lambda c: c.get(key, metadata=True), deadline)
        if not found:
            return None
        raw, meta = found[0]
        return _Stored(bytes(raw), int(meta.get("mod_revision", 0)), int(meta.get("lease", 0) or 0))

    def _read(self, key: str, deadline: float | None = None) -> tuple[Entry | None, int]:
        """The verified entry under ``key`` (``None``: none, one this secret did not sign, or one
        etcd holds off the lease it was signed for: counted and logged) and the key's revision
        (0: absent)."""
        stored = self._fetch(key, deadline)
        if stored is None:
            return None, 0
        try:
            entry = decode_entry(self._secret, key, stored.raw)
        except ForgedEntry as exc:
            self.forged += 1
            _count_forged()
            _warnings.warning("discovery: %s", exc)
            return None, stored.revision
        except ProtocolError as exc:
            _warnings.warning("discovery: ignoring a malformed entry: %s", exc)
            return None, stored.revision
        if entry.lease is not None and entry.lease != stored.lease:
            # Its owner's bytes, put back without the lease (or on another one): such an entry
            # would outlive its owner and send readers to a dead address. The owner, while it
            # lives, puts it back on its lease at its next refresh.
            self.detached += 1
            _warnings.warning(
                "discovery: ignoring entry %r: signed for lease %d, held by etcd on %s (put back by someone with "
                "write access to etcd)",
                key,
                entry.lease,
                f"lease {stored.lease}" if stored.lease else "no lease",
            )
            return None, stored.revision
        return entry, stored.revision

    def lookup(self, dp_rank: int, tp_rank: int, wait: float, stop: threading.Event | None = None) -> dict[str, Any]:
        """The route of prefill rank (dp, tp), read again until it is registered or ``wait``
        passes (or ``stop`` is set); its ``generation`` is added to it."""
        key = self.key(dp_rank, tp_rank)
        deadline = time.monotonic() + wait
        forged_before, detached_before = self.forged, self.detached
        last = "no entry"
        while True:
            try:
                entry, _ = self._read(key, deadline)
                if entry is not None:
                    return {**entry.route, "generation": entry.generation}
                last = (
                    f"{self.forged - forged_before} forged entries"
                    if self.forged != forged_before
                    else f"{self.detached - detached_before} entries off their lease"
                    if self.detached != detached_before
                    else "no entry"
                )
            except DiscoveryUnreachable as exc:
                last = str(exc)
            if time.monotonic() >= deadline:
                raise ConnectError(
                    f"prefill rank dp={dp_rank} tp={tp_rank} of {self.instance} is not registered in {self.base} "
                    f"(waited {wait:g} s; {last}): not started yet, gone and its lease expired, or registered under "
                    "another instance name (docs/discovery.md)"
                )
            if stop is not None and stop.wait(LOOKUP_POLL_S):
                raise ConnectError(f"stopped looking up prefill rank dp={dp_rank} tp={tp_rank} in {self.base}")
            if stop is None:
                time.sleep(LOOKUP_POLL_S)

    def reachable(self) -> str:
        """ "" when etcd answers, else why not."""
        try:
            self._store.run("read the prefix", lambda c: c.get(self._prefix))
        except DiscoveryUnreachable as exc:
            return str(exc)
        return ""
