"""The ``kv_transfer_params`` a prefill instance returns with a finished request and a decode
instance receives with the same request (the proxy between them copies them): what they hold,
and their check.

They come from a client (through the proxy), so nothing in them is trusted: :func:`parse`
turns every malformed field into a :class:`~kvtransport.spi.errors.ConfigError` naming it, and
bounds every list and string, before a decode rank connects anywhere. The keys follow vLLM's
own connectors (``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``,
``tp_size``, ``remote_num_tokens``), with kvtransport's control addresses under
``remote_kvtransport``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtransport.spi.errors import ConfigError

__all__ = ["PARAMS_VERSION", "RemotePrefill", "is_remote_decode", "is_remote_prefill", "parse"]

#: What the layout of these params is; a decode rank refuses another.
PARAMS_VERSION = 1
#: Prefill TP sizes beyond this are refused (a hostile list must not make a rank connect to
#: thousands of addresses).
MAX_TP = 256
MAX_TEXT = 256


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode rank reads one request's KV from: the prefill instance's engine, the
    request's name there, its TP size and each prefill rank's control address, and how many
    tokens (and blocks of ``block_size``) of KV it computed."""

    engine_id: str
    request_id: str
    tp_size: int
    addresses: tuple[str, ...]
    num_tokens: int
    num_blocks: int
    block_size: int

    def to_params(self) -> dict[str, Any]:
        """The dict vLLM returns to the client with the prefill's response."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "tp_size": self.tp_size,
            "remote_num_tokens": self.num_tokens,
            "remote_kvtransport": {
                "version": PARAMS_VERSION,
                "addresses": list(self.addresses),
                "num_blocks": self.num_blocks,
                "block_size": self.block_size,
            },
        }


def is_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Prefill side: the request's KV goes to a decode instance once it is computed."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


def is_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """Decode side: the request's KV comes from a prefill instance."""
    return isinstance(params, Mapping) and params.get("do_remote_prefill") is True


def _text(params: Mapping[str, Any], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT or "@" in value:
        raise ConfigError(
            f"kv_transfer_params[{key!r}] must be a non-empty string of at most {MAX_TEXT} characters "
            f"without '@', got {_show(value)}"
        )
    return value


def _count(params: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = params.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"kv_transfer_params[{key!r}] must be an integer in [{low}, {high}], got {_show(value)}")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse(params: Mapping[str, Any] | None, *, block_size: int) -> RemotePrefill:
    """The remote prefill a decode request names, checked against this instance's
    ``block_size``; :class:`ConfigError` with the field and what was wrong otherwise."""
    if not isinstance(params, Mapping):
        raise ConfigError(f"kv_transfer_params must be a mapping, got {type(params).__name__}")
    ours = params.get("remote_kvtransport")
    if not isinstance(ours, Mapping):
        raise ConfigError(
            "kv_transfer_params has no 'remote_kvtransport' mapping: the prefill instance did not run "
            "kvtransport's connector (both instances need kv_connector='KVTransportConnector')"
        )
    version = ours.get("version")
    if version != PARAMS_VERSION:
        raise ConfigError(
            f"kv_transfer_params['remote_kvtransport']['version'] is {_show(version)}; this kvtransport reads "
            f"version {PARAMS_VERSION}: run the same kvtransport release on prefill and decode"
        )
    tp_size = _count(params, "tp_size", 1, MAX_TP)
    addresses = ours.get("addresses")
    if (
        not isinstance(addresses, list)
        or len(addresses) != tp_size
        or not all(isinstance(a, str) and 0 < len(a) <= MAX_TEXT for a in addresses)
    ):
        raise ConfigError(
            f"kv_transfer_params['remote_kvtransport']['addresses'] must list one control address per prefill "
            f"TP rank ({tp_size}), got {_show(addresses)}"
        )
    remote_block_size = _count(ours, "block_size", 1, 1 << 20)
    if remote_block_size != block_size:
        raise ConfigError(
            f"the prefill instance uses blocks of {remote_block_size} tokens, this decode instance {block_size}: "
            "run both with the same --block-size"
        )
    num_tokens = _count(params, "remote_num_tokens", 0, 1 << 40)
    num_blocks = _count(ours, "num_blocks", 0, 1 << 40)
    if num_blocks != math.ceil(num_tokens / block_size):
        raise ConfigError(
            f"kv_transfer_params says {num_tokens} tokens in {num_blocks} blocks of {block_size}; "
            f"they fill {math.ceil(num_tokens / block_size)}"
        )
    return RemotePrefill(
        engine_id=_text(params, "remote_engine_id"),
        request_id=_text(params, "remote_request_id"),
        tp_size=tp_size,
        addresses=tuple(addresses),
        num_tokens=num_tokens,
        num_blocks=num_blocks,
        block_size=block_size,
    )
