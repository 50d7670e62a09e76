"""Discovery on etcd: each prefill rank's route under a lease its owner keeps alive, with a
generation and the deployment secret's signature; readers look routes up with a bounded wait.

Keys (``prefix`` from ``KVTRANSPORT_DISCOVERY``; the instance is what SGLang calls the
bootstrap address, ``host:port``, percent-encoded into one path segment)::

    <prefix>/instances/<instance>/ranks/<dp_rank>/<tp_rank>  ->  signed entry (entries.py)

- **Leases.** A :class:`EtcdDirectory` that registers takes one lease of ``ttl`` seconds
  (``KVTRANSPORT_DISCOVERY_TTL``, 10 by default) and refreshes it every third of that on a
  daemon thread. A process that dies stops refreshing: etcd deletes its entries when the lease
  expires, at most ``ttl`` seconds later. A lease that expired while its owner lived (etcd
  restarted without its data, a partition longer than the TTL) is replaced by a new one and the
  entry written again on the next refresh: entries come back as their owners refresh.
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

etcd is reached through its HTTP gateway with ``etcd3gw`` (imported when first used: install
``kvtransport[etcd]``), endpoints tried in order, the one that answered last first. Every
request waits at most ``timeout`` seconds (2 by default); a call with a deadline tries no further
endpoint once it has passed.
"""

from __future__ import annotations

import base64
import functools
import itertools
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
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


#: Request timeout of a store (per request, per endpoint).
DEFAULT_TIMEOUT = 2.0


class EtcdStore:
    """One process's clients of one etcd cluster (shared by its directories: ``store_for``)."""

    def __init__(self, config: EtcdConfig, timeout: float = DEFAULT_TIMEOUT) -> None:
        try:
            from etcd3gw.client import Etcd3Client
        except ImportError as exc:
            raise ConfigError(
                f"discovery on etcd ({config.describe()}) needs the etcd3gw package: pip install 'kvtransport[etcd]'"
            ) from exc
        self.config = config
        self.timeout = timeout
        self._clients = [Etcd3Client(host=h, port=p, timeout=timeout) for h, p in config.endpoints]
        self._current = 0
        self._lock = threading.Lock()

    def run(self, what: str, fn: Callable[[Any], T], deadline: float | None = None) -> T:
        """``fn(client)`` on the endpoint that answered last, then on each other one until
        ``deadline``; raises :class:`DiscoveryUnreachable` naming every failure when none answers."""
        from etcd3gw.exceptions import Etcd3Exception
        from requests import RequestException

        with self._lock:
            first = self._current
        failures: list[str] = []
        count = len(self._clients)
        for i in itertools.islice(itertools.cycle(range(count)), first, first + count):
            if failures and deadline is not None and time.monotonic() >= deadline:
                failures.append("out of time")
                break
            try:
                result = fn(self._clients[i])
            except (Etcd3Exception, RequestException, OSError, KeyError, TypeError, ValueError) as exc:
                # KeyError and the rest: a gateway answer that is not what the client expects.
                host, port = self.config.endpoints[i]
                failures.append(f"{host}:{port}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            with self._lock:
                self._current = i
            return result
        raise DiscoveryUnreachable(f"etcd at {self.config.describe()}: {what} failed ({'; '.join(failures)})")


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
                self._lease = self._store.run("grant a lease", self._grant, deadline)
            value = encode_entry(self._secret, key, route, self.generation)
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
            if "not found" in str(exc).lower():
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
        while not self._stop.wait(self._interval if self.registered.is_set() else retry):
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
                self.registered.clear()
                _warnings.warning(
                    "discovery: refreshing rank dp=%s tp=%s of %s failed (next try in %g s): %s",
                    route["dp_rank"],
                    route["tp_rank"],
                    self.instance,
                    retry,
                    exc,
                )
                continue
            retry = FIRST_RETRY_S
            self.registered.set()
            if first:
                log.info("discovery: rank dp=%s tp=%s of %s registered", route["dp_rank"], route["tp_rank"], self.base)

    def _refresh(self, route: dict[str, Any]) -> None:
        """One refresh: keep the lease alive; a lease etcd no longer knows is replaced and the
        entry written again; an entry that went missing (or was overwritten by something that is
        not a later start) is written again."""
        deadline = time.monotonic() + self._interval
        if self._lease is not None:
            lease = self._lease
            left = self._store.run("refresh the lease", lambda c: self._lease_of(c, lease).refresh(), deadline)
            if left <= 0:
                log.info("discovery: the lease of %s expired in etcd; taking a new one", self.instance)
                self._lease = None
        key = self.key(route["dp_rank"], route["tp_rank"])
        current = None if self._lease is None else self._read(key, deadline)[0]
        if current is None or current.generation != self.generation:
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

    def _read(self, key: str, deadline: float | None = None) -> tuple[Entry | None, int]:
        """The verified entry under ``key`` (``None``: none, or one this secret did not sign:
        counted and logged) and the key's revision (0: absent)."""
        found = self._store.run("get", lambda c: c.get(key, metadata=True), deadline)
        if not found:
            return None, 0
        raw, meta = found[0]
        revision = int(meta.get("mod_revision", 0))
        try:
            return decode_entry(self._secret, key, raw), revision
        except ForgedEntry as exc:
            self.forged += 1
            _count_forged()
            _warnings.warning("discovery: %s", exc)
        except ProtocolError as exc:
            _warnings.warning("discovery: ignoring a malformed entry: %s", exc)
        return None, revision

    def lookup(self, dp_rank: int, tp_rank: int, wait: float, stop: threading.Event | None = None) -> dict[str, Any]:
        """The route of prefill rank (dp, tp), read again until it is registered or ``wait``
        passes (or ``stop`` is set); its ``generation`` is added to it."""
        key = self.key(dp_rank, tp_rank)
        deadline = time.monotonic() + wait
        forged_before = self.forged
        last = "no entry"
        while True:
            try:
                entry, _ = self._read(key, deadline)
                if entry is not None:
                    return {**entry.route, "generation": entry.generation}
                last = "no entry" if self.forged == forged_before else f"{self.forged - forged_before} forged entries"
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
