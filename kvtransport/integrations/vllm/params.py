"""The ``kv_transfer_params`` a prefill instance returns with a finished request and a decode
instance receives with the same request (the proxy between them copies them): what they hold,
and their check.

They come from a client (through the proxy), so nothing in them is trusted: :func:`parse`
turns every malformed field into a :class:`~kvtransport.spi.errors.ConfigError` naming it, and
bounds every list and string, before a decode rank connects anywhere; :func:`verify` checks that
they were made for the prompt decode holds (a digest of its tokens) and, with a deployment
secret, by a process that holds it (a MAC over every field that says where the KV is). The keys follow vLLM's
own connectors (``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``,
``tp_size``, ``remote_num_tokens``), with kvtransport's control addresses under
``remote_kvtransport``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtransport.runtime.auth import Secret
from kvtransport.spi.errors import ConfigError

__all__ = [
    "PARAMS_VERSION",
    "RemotePrefill",
    "is_remote_decode",
    "is_remote_prefill",
    "parse",
    "prompt_digest",
    "request_id_problem",
    "sglang_room",
    "sign",
    "verify",
    "verify_signature",
]

#: What the layout of these params is; a decode rank refuses another.
PARAMS_VERSION = 1
#: Prefill TP sizes beyond this are refused (a hostile list must not make a rank connect to
#: thousands of addresses).
MAX_TP = 64
MAX_TEXT = 256
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAC_LABEL = b"vllm kv_transfer_params"


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
    #: sha256 of the prompt's first ``num_tokens`` token ids (int64, little-endian): what the
    #: KV was computed for; decode checks its own prompt against it.
    prompt_sha256: str = ""
    #: The deployment secret's MAC over everything above ('' without a secret): a client
    #: cannot pair a request's KV with another prompt, or point decode elsewhere.
    mac: str = ""

    def signed_fields(self) -> tuple[bytes, ...]:
        """What the MAC covers."""
        head = (self.engine_id, self.request_id, str(self.tp_size), str(self.num_tokens), str(self.block_size))
        return tuple(x.encode() for x in (*head, *self.addresses, self.prompt_sha256))

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
                "prompt_sha256": self.prompt_sha256,
                "mac": self.mac,
            },
        }


def is_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Prefill side: the request's KV goes to a decode instance once it is computed."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


def is_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """Decode side: the request's KV comes from a prefill instance."""
    return isinstance(params, Mapping) and params.get("do_remote_prefill") is True


def sglang_room(params: Mapping[str, Any] | None) -> int | None:
    """Prefill side: the SGLang bootstrap room the proxy gave a request whose decode is an
    SGLang instance (``kv_transfer_params["sglang_room"]``), ``None`` for a vLLM decode;
    :class:`ConfigError` for a room SGLang could not have made."""
    if not isinstance(params, Mapping) or params.get("sglang_room") is None:
        return None
    room = params["sglang_room"]
    if not isinstance(room, int) or isinstance(room, bool) or not 0 < room < 2**63:
        raise ConfigError(f"kv_transfer_params['sglang_room'] must be an integer in [1, 2**63), got {_show(room)}")
    return room


def request_id_problem(request_id: str) -> str:
    """Why a request name cannot be a transfer's name ('' when it can): a tag is at most
    ``MAX_TEXT`` characters and ``@`` separates a decode rank's number in it."""
    if not request_id or len(request_id) > MAX_TEXT or "@" in request_id:
        return f"a request offered to decode needs a name of 1 to {MAX_TEXT} characters without '@'"
    return ""


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
    digest, mac = ours.get("prompt_sha256"), ours.get("mac", "")
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise ConfigError(
            f"kv_transfer_params['remote_kvtransport']['prompt_sha256'] must be 64 hex digits, got {_show(digest)}"
        )
    if not isinstance(mac, str) or not (mac == "" or _HEX64.fullmatch(mac)):
        raise ConfigError(
            f"kv_transfer_params['remote_kvtransport']['mac'] must be '' or 64 hex digits, got {_show(mac)}"
        )
    return RemotePrefill(
        engine_id=_text(params, "remote_engine_id"),
        request_id=_text(params, "remote_request_id"),
        tp_size=tp_size,
        addresses=tuple(addresses),
        num_tokens=num_tokens,
        num_blocks=num_blocks,
        block_size=block_size,
        prompt_sha256=digest,
        mac=mac,
    )


def prompt_digest(token_ids: Sequence[int], num_tokens: int) -> str:
    """sha256 of the first ``num_tokens`` token ids, as int64 little-endian."""
    return hashlib.sha256(np.asarray(list(token_ids[:num_tokens]), dtype="<i8").tobytes()).hexdigest()


def sign(remote: RemotePrefill, secret: Secret) -> RemotePrefill:
    """``remote`` with the deployment's MAC ('' without a secret)."""
    if not secret.authenticated:
        return dataclasses.replace(remote, mac="")
    return dataclasses.replace(remote, mac=secret.derive(_MAC_LABEL, *remote.signed_fields()).hex())


def verify(remote: RemotePrefill, token_ids: Sequence[int], secret: Secret) -> None:
    """:class:`ConfigError` unless ``remote`` was made for ``token_ids`` (its first
    ``num_tokens``) and, with a deployment secret, by a process that holds it."""
    if prompt_digest(token_ids, remote.num_tokens) != remote.prompt_sha256:
        raise ConfigError(
            f"kv_transfer_params of prefill request {remote.request_id!r} were made for another prompt (its first "
            f"{remote.num_tokens} tokens differ from this request's): decode would load KV of other tokens"
        )
    verify_signature(remote, secret)


def verify_signature(remote: RemotePrefill, secret: Secret) -> None:
    """:class:`ConfigError` unless, with a deployment secret, ``remote`` was made by a process
    that holds it (nothing to check without one). What decode checks before it tells a prefill
    that a request it never loaded is not wanted: vLLM's serving layer hands such a request over
    with a placeholder prompt, so the prompt cannot be checked, but the MAC covers its digest."""
    if secret.authenticated:
        want = secret.derive(_MAC_LABEL, *remote.signed_fields())
        if not hmac.compare_digest(want.hex(), remote.mac):
            raise ConfigError(
                f"kv_transfer_params of prefill request {remote.request_id!r} are not signed with this deployment's "
                "secret (changed on the way, or made by a prefill with another KVTRANSPORT_SECRET)"
            )
