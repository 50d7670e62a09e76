"""The route table (what a registered rank is, who owns it, how long it lives, how many) and the
room table (which DP rank serves a request, for instances that do not route by room number)."""

from __future__ import annotations

import collections
import hmac
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtransport.spi.env import env_number
from kvtransport.spi.errors import ProtocolError

ENV_ROUTE_TTL = "KVTRANSPORT_BOOTSTRAP_ROUTE_TTL"
DEFAULT_TTL = 600.0
DEFAULT_MAX_ROUTES = 4096

_HEX32 = re.compile(r"[0-9a-f]{32}")
DIGITS = re.compile(r"[0-9]{1,12}")  # int() would also take "+1", " 1" and "1_0"
_FIELDS = {"address": str, "tp_rank": int, "tp_size": int, "dp_rank": int, "endpoint": str}
#: What the instance publishes with each rank so a decode rank can route (all optional, with
#: the single-DP-rank defaults): how many DP ranks there are, whether a room's rank is
#: ``room % dp_size``, and the page size and KV dtype decode must match.
_OPTIONAL: dict[str, tuple[type, Any]] = {
    "dp_size": (int, 1),
    "follow_bootstrap_room": (bool, True),
    "page_size": (int, 0),
    "kv_cache_dtype": (str, ""),
}
DEFAULT_MAX_ROOMS = 65536
MAX_ROOMS_PER_QUERY = 65536
#: An answer: HTTP status and JSON body.
Reply = tuple[int, dict[str, Any]]


def route_ttl(env: Mapping[str, str] | None = None) -> float:
    """Seconds a route lives after its last refresh (``KVTRANSPORT_BOOTSTRAP_ROUTE_TTL``)."""
    return env_number(ENV_ROUTE_TTL, DEFAULT_TTL, env=env)


def route_key(dp_rank: int, tp_rank: int) -> str:
    return f"{dp_rank}/{tp_rank}"


def validated(doc: Any) -> dict[str, Any]:
    """The route fields of ``doc``, checked (anything else in it is dropped)."""
    if not isinstance(doc, dict):
        raise ProtocolError("a route must be a JSON object")
    out: dict[str, Any] = {}
    for name, kind in _FIELDS.items():
        value = doc.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ProtocolError(f"route field {name!r} must be {kind.__name__}, got {value!r}")
        out[name] = value
    if not out["address"].startswith("tcp://"):
        raise ProtocolError(f"route address {out['address']!r} is not tcp://host:port")
    if not 0 <= out["tp_rank"] < out["tp_size"]:
        raise ProtocolError(f"tp_rank {out['tp_rank']} is outside tp_size {out['tp_size']}")
    for name, (kind, default) in _OPTIONAL.items():
        value = doc.get(name, default)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ProtocolError(f"route field {name!r} must be {kind.__name__}, got {value!r}")
        out[name] = value
    if not 0 <= out["dp_rank"] < out["dp_size"]:
        raise ProtocolError(f"dp_rank {out['dp_rank']} is outside dp_size {out['dp_size']}")
    if out["page_size"] < 0 or len(out["kv_cache_dtype"]) > 64:
        raise ProtocolError("page_size must be >= 0 and kv_cache_dtype at most 64 characters")
    return out


def whole(value: Any, what: str) -> int:
    """``value`` as a non-negative whole number of at most 64 bits (JSON has no integer type)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        raise ProtocolError(f"{what} must be a whole number in [0, 2**64), got {value!r}")
    return value


def room_rank_of(doc: Any) -> tuple[int, int]:
    """(bootstrap_room, dp_rank) of a ``/register_dp_rank`` body (SGLang's field names)."""
    if not isinstance(doc, dict):
        raise ProtocolError("the body must be a JSON object")
    return whole(doc.get("bootstrap_room"), "bootstrap_room"), whole(doc.get("dp_rank"), "dp_rank")


def rooms_of(doc: Any) -> list[int]:
    """The rooms of a ``/query_dp_ranks`` body (SGLang's ``{"bootstrap_rooms": [...]}``)."""
    rooms = doc.get("bootstrap_rooms") if isinstance(doc, dict) else None
    if not isinstance(rooms, list) or len(rooms) > MAX_ROOMS_PER_QUERY:
        raise ProtocolError(f"bootstrap_rooms must be a list of at most {MAX_ROOMS_PER_QUERY} rooms")
    return [whole(r, "a bootstrap room") for r in rooms]


def owner_of(doc: Any) -> str:
    owner = doc.get("owner") if isinstance(doc, dict) else None
    if not isinstance(owner, str) or not _HEX32.fullmatch(owner):
        raise ProtocolError("field 'owner' must be 32 lowercase hex digits (the registering client's token)")
    return owner


def ranks_of(query: str) -> tuple[int, int]:
    """(dp_rank, tp_rank) of a ``?dp_rank=&tp_rank=`` query; dp_rank defaults to 0."""
    values = urllib.parse.parse_qs(query)
    dp, tp = values.get("dp_rank", ["0"])[0], values.get("tp_rank", [""])[0]
    if not (DIGITS.fullmatch(dp) and DIGITS.fullmatch(tp)):
        raise ProtocolError("dp_rank and tp_rank must be whole numbers")
    return int(dp), int(tp)


# -- routes -------------------------------------------------------------------------------------


@dataclass
class _Entry:
    route: dict[str, Any]
    owner: str
    expires: float  # on ``RouteTable``'s clock


class RouteTable:
    """Live routes by (dp, tp) rank, each bound to the owner that registered it first.
    Thread-safe. Expired entries are dropped lazily: reads skip them, writes remove them."""

    def __init__(self, ttl: float, max_routes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.max_routes, self._clock = ttl, max_routes, clock
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def put(self, route: dict[str, Any], owner: str) -> Reply:
        key, now = route_key(route["dp_rank"], route["tp_rank"]), self._clock()
        with self._lock:
            self._drop_expired(now)
            held = self._entries.get(key)
            if held is not None and not hmac.compare_digest(held.owner, owner):
                return 409, {"error": _held_message(route["dp_rank"], route["tp_rank"], held.expires - now)}
            if held is None and len(self._entries) >= self.max_routes:
                return 507, {"error": f"the registry holds {self.max_routes} live routes, its limit"}
            self._entries[key] = _Entry(route, owner, now + self.ttl)
        return 200, {"ok": True, "ttl": self.ttl}

    def delete(self, dp_rank: int, tp_rank: int, owner: str) -> Reply:
        key, now = route_key(dp_rank, tp_rank), self._clock()
        with self._lock:
            self._drop_expired(now)
            held = self._entries.get(key)
            if held is None:
                return 404, {"error": f"no rank {key} registered"}
            if not hmac.compare_digest(held.owner, owner):
                return 409, {"error": _held_message(dp_rank, tp_rank, held.expires - now)}
            del self._entries[key]
        return 200, {"ok": True}

    def get(self, dp_rank: int, tp_rank: int) -> dict[str, Any] | None:
        now = self._clock()
        with self._lock:
            entry = self._entries.get(route_key(dp_rank, tp_rank))
            return _public(entry, now) if entry is not None and entry.expires > now else None

    def live(self) -> list[dict[str, Any]]:
        now = self._clock()
        with self._lock:
            return [_public(e, now) for e in self._entries.values() if e.expires > now]

    def _drop_expired(self, now: float) -> None:
        for key in [k for k, e in self._entries.items() if e.expires <= now]:
            del self._entries[key]


def _public(entry: _Entry, now: float) -> dict[str, Any]:
    """What a reader sees: the route and how long it lives, never the owner token (knowing it
    is what lets a client replace or remove a rank)."""
    return {**entry.route, "expires_in": round(entry.expires - now, 3)}


def _held_message(dp_rank: int, tp_rank: int, remaining: float) -> str:
    return (
        f"rank dp={dp_rank} tp={tp_rank} is held by another owner; it expires in {max(remaining, 0):.0f} s "
        "unless that owner refreshes it"
    )


# -- rooms --------------------------------------------------------------------------------------


class RoomTable:
    """Which DP rank took each request (bootstrap room), for decode ranks of an instance whose
    load balancer does not route by room number. Bounded: entries live ``ttl`` seconds and the
    oldest go first once ``max_rooms`` are held (a room is asked for within seconds of its
    registration, or never). Thread-safe."""

    def __init__(self, ttl: float, max_rooms: int = DEFAULT_MAX_ROOMS, clock: Callable[[], float] = time.monotonic):
        self.ttl, self.max_rooms, self._clock = ttl, max_rooms, clock
        self._rooms: collections.OrderedDict[int, tuple[int, float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rooms)

    def put(self, room: int, dp_rank: int) -> Reply:
        now = self._clock()
        with self._lock:
            self._rooms.pop(room, None)
            self._rooms[room] = (dp_rank, now + self.ttl)
            while len(self._rooms) > self.max_rooms or (self._rooms and next(iter(self._rooms.values()))[1] <= now):
                self._rooms.popitem(last=False)
        return 200, {"ok": True}

    def query(self, rooms: list[int]) -> dict[str, int]:
        now = self._clock()
        with self._lock:
            found = ((room, self._rooms.get(room)) for room in rooms)
            return {str(room): held[0] for room, held in found if held is not None and held[1] > now}
