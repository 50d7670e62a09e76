"""Runtime settings of an endpoint: timeouts and resource limits, and how the environment sets them.

Every ``KVTRANSPORT_*`` number an endpoint reads is parsed here (through ``spi.env``), with one error style: a value
that is not a positive number of the expected unit raises :class:`~kvtransport.spi.errors.ConfigError`
naming the variable, the value and what it takes. A serving engine that starts with a typo in its
environment should stop at start-up, not run with a default nobody chose.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import ClassVar

from kvtransport.spi.env import env_flag, env_int, env_number
from kvtransport.spi.errors import ConfigError


@dataclass(frozen=True)
class Timeouts:
    """Seconds each state may last, and the heartbeat settings (env vars override defaults)."""

    connect: float = 10.0
    bootstrap: float = 30.0
    waiting: float = 300.0
    transfer: float = 60.0
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 3.0
    #: How long a finished transfer stays filed under its tag (so late messages about it are
    #: recognised) before the endpoint forgets it; the caller's reference stays valid.
    retain_finished: float = 5.0
    #: How long a peer may take to confirm that the writes of a failed receive transfer stopped
    #: ("drained") before the connection is ended, so that its data path is fenced and the
    #: pages come back (a serving engine holds them until then; SGLang gives up after 30 s).
    drain: float = 10.0
    #: How long a request that waits for its peer's announcement may wait while connections to
    #: this endpoint fail authentication around its arrival, before it fails with that reason
    #: (SGLang's prefill; docs/security.md). At or above ``bootstrap`` it never fails early.
    auth_grace: float = 10.0
    #: How long a lane of a connection that can fail over may go without finishing a batch
    #: while one of its whole transfers is in flight, at least, before that transfer counts as
    #: failed there (a rail down, completions that stopped) and goes over another lane; a
    #: transfer's own limit is the larger of this and ``failover.STALL_FACTOR`` times its time
    #: at the rate the lane showed (a lane that showed none yet: the transfer timeout). A
    #: connection with one usable lane waits for the transfer timeout as ever.
    stall: float = 0.5
    #: How long a lane that failed over stays out of its connection before it is tried again
    #: (``runtime.failover``): doubled at each failure in a row, up to
    #: ``failover.QUARANTINE_MAX_S``; 0: a failed lane stays out for the connection's life.
    quarantine: float = 1.0

    ENV: ClassVar[dict[str, str]] = {
        "connect": "KVTRANSPORT_CONNECT_TIMEOUT",
        "bootstrap": "KVTRANSPORT_BOOTSTRAP_TIMEOUT",
        "waiting": "KVTRANSPORT_WAITING_TIMEOUT",
        "transfer": "KVTRANSPORT_TRANSFER_TIMEOUT",
        "heartbeat_interval": "KVTRANSPORT_HEARTBEAT_INTERVAL",
        "heartbeat_timeout": "KVTRANSPORT_HEARTBEAT_TIMEOUT",
        "retain_finished": "KVTRANSPORT_RETAIN_FINISHED",
        "drain": "KVTRANSPORT_DRAIN_TIMEOUT",
        "auth_grace": "KVTRANSPORT_AUTH_FAILURE_GRACE",
        "stall": "KVTRANSPORT_STALL_TIMEOUT",
        "quarantine": "KVTRANSPORT_QUARANTINE",
    }

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "quarantine" and value == 0:
                continue  # a failed lane is never taken back
            if not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"timeout {f.name}={value!r} must be a positive number of seconds")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError(
                f"heartbeat_timeout ({self.heartbeat_timeout} s) must exceed heartbeat_interval "
                f"({self.heartbeat_interval} s), or every peer would be declared lost"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Timeouts:
        d = cls()
        return cls(**{k: env_number(v, getattr(d, k), env=env) for k, v in cls.ENV.items()})


@dataclass(frozen=True)
class Limits:
    """Bounds on everything an endpoint holds for its peers, so no peer can make it grow without
    end. Each has an environment variable (``ENV``) and is documented in docs/environment.md."""

    #: Live connections (both directions); a hello beyond it is refused.
    max_connections: int = 1024
    #: Handshakes being processed at once (driver connects in flight); more are refused.
    max_pending_handshakes: int = 64
    #: Control connections open that carry no session (yet, or any more): beyond it the oldest
    #: is closed (``unclaimed.py``). Above ``max_pending_handshakes``: many peers that connect
    #: at once (a decode pool starting) must not push each other's handshakes out.
    max_unclaimed_connections: int = 256
    #: Announcements (``expect``) a peer may have outstanding for transfers this side has not
    #: created yet, per connection and over all connections.
    max_early_expects: int = 4096
    max_early_expects_total: int = 65536
    #: ... and in bytes of page lists (a 4k-token prompt in 16-token pages is 2 KiB).
    max_early_expect_bytes: int = 16 << 20
    max_early_expect_bytes_total: int = 256 << 20
    #: Early aborts remembered per connection (tags aborted before this side created them).
    max_early_aborts: int = 4096
    #: Live transfers per connection.
    max_transfers_per_connection: int = 65536
    #: Frames one receive pass handles before timers and heartbeats get their turn.
    frames_per_pass: int = 256
    #: Calls other threads may queue for the I/O thread before ``call`` applies backpressure.
    max_queued_calls: int = 65536
    #: Distinct unknown peers remembered for "warn once" logging.
    max_warned_peers: int = 1024
    #: A batch of at most this many bytes is handed to a ``thread_agnostic`` driver on the
    #: thread that calls ``send`` (when the driver's thread is idle); bigger ones go through
    #: the driver's thread, since an engine may copy inside ``submit`` (UCX's shared memory
    #: does) and ``send`` should not take the copy's time.
    inline_submit_bytes: int = 2 << 20
    #: Microseconds the caller's thread keeps checking a batch of at most 256 KiB it submitted
    #: (above) before the driver's thread takes over: a small request then completes with no
    #: thread wake-up (mooncake-gdr, 64 KiB: 0.1 ms less). 0 turns it off.
    inline_wait_us: int = 250
    #: A part of a transfer larger than a slice goes to its lane's driver in slices, at most
    #: ``slices_in_flight`` of a lane at a time, so that smaller transfers on the connection
    #: pass between them instead of waiting for its last byte (``runtime.pacing``). A slice is
    #: what the lane moves in ``slice_ms`` milliseconds at the rate it showed on the
    #: connection, at least ``slice_bytes`` bytes (twice that before a rate is known), at most
    #: 32 times it; ``slice_ms`` 0: always ``slice_bytes``. ``slice_bytes`` 0: every part whole.
    slice_bytes: int = 8 << 20
    slice_ms: int = 4
    slices_in_flight: int = 2

    ENV: ClassVar[dict[str, str]] = {
        "max_connections": "KVTRANSPORT_MAX_CONNECTIONS",
        "max_pending_handshakes": "KVTRANSPORT_MAX_PENDING_HANDSHAKES",
        "max_unclaimed_connections": "KVTRANSPORT_MAX_UNCLAIMED_CONNECTIONS",
        "max_early_expects": "KVTRANSPORT_MAX_EARLY_EXPECTS",
        "max_early_expects_total": "KVTRANSPORT_MAX_EARLY_EXPECTS_TOTAL",
        "max_early_expect_bytes": "KVTRANSPORT_MAX_EARLY_EXPECT_BYTES",
        "max_early_expect_bytes_total": "KVTRANSPORT_MAX_EARLY_EXPECT_BYTES_TOTAL",
        "max_early_aborts": "KVTRANSPORT_MAX_EARLY_ABORTS",
        "max_transfers_per_connection": "KVTRANSPORT_MAX_TRANSFERS_PER_CONNECTION",
        "frames_per_pass": "KVTRANSPORT_FRAMES_PER_PASS",
        "max_queued_calls": "KVTRANSPORT_MAX_QUEUED_CALLS",
        "max_warned_peers": "KVTRANSPORT_MAX_WARNED_PEERS",
        "inline_submit_bytes": "KVTRANSPORT_INLINE_SUBMIT_BYTES",
        "inline_wait_us": "KVTRANSPORT_INLINE_WAIT_US",
        "slice_bytes": "KVTRANSPORT_SLICE_BYTES",
        "slice_ms": "KVTRANSPORT_SLICE_MS",
        "slices_in_flight": "KVTRANSPORT_SLICES_IN_FLIGHT",
    }
    #: Limits that may be 0 (off).
    MAY_BE_ZERO: ClassVar[frozenset[str]] = frozenset({"inline_wait_us", "slice_bytes", "slice_ms"})

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name in self.MAY_BE_ZERO else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(
                    f"limit {f.name}={value!r} must be a {'non-negative' if least == 0 else 'positive'} whole number"
                )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Limits:
        d = cls()
        return cls(**{k: env_int(v, getattr(d, k), env=env, zero=k in cls.MAY_BE_ZERO) for k, v in cls.ENV.items()})


ENV_EXPRESS = "KVTRANSPORT_EXPRESS"


def express_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether sessions open an express stream for "done" (``KVTRANSPORT_EXPRESS``: 1, the
    default, or 0; docs/architecture.md says what it is)."""
    return env_flag(ENV_EXPRESS, True, env)


#: Every variable this module reads (the registry's unknown-variable warning knows them).
ENV_VARS: tuple[str, ...] = (*Timeouts.ENV.values(), *Limits.ENV.values(), ENV_EXPRESS)
