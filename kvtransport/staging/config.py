"""Staging ring geometry: ring size and chunk size, from the environment or driver options."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvtransport.spi.errors import ConfigError

ENV_RING_BYTES = "KVTRANSPORT_STAGING_RING_BYTES"
ENV_CHUNK_BYTES = "KVTRANSPORT_STAGING_CHUNK_BYTES"
OPT_RING = "staging.ring_bytes"
OPT_CHUNK = "staging.chunk_bytes"
#: Test hook (driver option): seconds the receiver waits before each scatter, a slow receiver.
OPT_SCATTER_DELAY = "staging.scatter_delay"
DEFAULT_RING_BYTES = 256 << 20
DEFAULT_CHUNK_BYTES = 8 << 20
#: Largest slot count per direction (it bounds every slot number a peer may name).
MAX_SLOTS = 1 << 16


@dataclass(frozen=True)
class RingConfig:
    """Ring size and chunk size; the ring holds ``slots`` chunks each way."""

    ring_bytes: int = DEFAULT_RING_BYTES
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self) -> None:
        if self.chunk_bytes < 4096 or self.ring_bytes < 2 * self.chunk_bytes:
            raise ConfigError(
                f"staging ring of {self.ring_bytes} bytes with {self.chunk_bytes}-byte chunks: chunks must be at "
                f"least 4 KiB and the ring must hold at least one chunk each way ({ENV_RING_BYTES}, {ENV_CHUNK_BYTES})"
            )
        if self.slots > MAX_SLOTS:
            raise ConfigError(f"a staging ring of more than {MAX_SLOTS} chunks each way; use larger chunks")

    @property
    def slots(self) -> int:
        """Slots per direction."""
        return self.ring_bytes // self.chunk_bytes // 2

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, options: Mapping[str, str] | None = None) -> RingConfig:
        """From ``KVTRANSPORT_STAGING_*``; an endpoint's ``driver_options`` (``staging.ring_bytes``,
        ``staging.chunk_bytes``) take precedence."""
        env = dict(os.environ) if env is None else dict(env)
        opts = dict(options or {})
        env.update({n: opts[k] for k, n in ((OPT_RING, ENV_RING_BYTES), (OPT_CHUNK, ENV_CHUNK_BYTES)) if k in opts})

        def read(name: str, default: int) -> int:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not a number of bytes") from None

        return cls(read(ENV_RING_BYTES, DEFAULT_RING_BYTES), read(ENV_CHUNK_BYTES, DEFAULT_CHUNK_BYTES))
