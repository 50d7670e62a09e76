"""What the proxy of a mixed deployment sends a vLLM prefill and an SGLang decode for one request
whose prompt vLLM computes and SGLang decodes: the same bootstrap room to both.

The vLLM prefill instance runs with ``kv_connector_extra_config["sglang_bootstrap"]`` =
``host:port``: its workers register there as one SGLang prefill instance (dp 1, its TP), and
worker 0 serves that registry (:mod:`~kvtransport.integrations.vllm.sglang_registry`). SGLang's
decode gets ``bootstrap_host``/``bootstrap_port`` = that address and ``bootstrap_room`` = the
room (:func:`sglang_decode_fields`); vLLM's prefill gets ``max_tokens=1`` and the
``kv_transfer_params`` of :func:`params_for_sglang_decode`. vLLM's prefill then holds the
request's blocks under the room; each SGLang decode rank announces its pages under it, and the
vLLM worker writes them, regrouped into SGLang's pages, with the first token's handoff in the
decode's aux slot (spi.handoff).

SGLang's decode reads a request's first-token logprobs and sampling mask from that aux slot too;
vLLM's prefill hands a connector none, so a request asking for either is refused here (prefill it
on SGLang).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from kvtransport.integrations.vllm.sglang_registry import parse_bootstrap
from kvtransport.spi.errors import ConfigError

__all__ = ["new_room", "params_for_sglang_decode", "sglang_decode_fields"]


def new_room() -> int:
    """A bootstrap room as SGLang's router makes one: a random whole number below 2**63 (never 0,
    which SGLang's decode reads as an aux slot nobody wrote)."""
    return secrets.randbelow(2**63 - 1) + 1


def _room(room: int) -> int:
    """``room`` if SGLang could have made it, else :class:`ConfigError` with the range."""
    if isinstance(room, bool) or not isinstance(room, int) or not 0 < room < 2**63:
        raise ConfigError(f"bootstrap room must be a whole number in [1, 2**63), got {room!r}")
    return room


def params_for_sglang_decode(
    room: int,
    *,
    logprobs: bool = False,
    top_logprobs: int = 0,
    token_ids_logprob: Sequence[int] | None = None,
    return_sampling_mask: bool = False,
) -> dict[str, Any]:
    """``kv_transfer_params`` for the vLLM prefill request whose KV the SGLang decode request of
    bootstrap room ``room`` reads. The keywords: what the client asked of the request (SGLang's
    ``return_logprob``, ``top_logprobs_num``, ``token_ids_logprob``, ``return_sampling_mask``);
    :class:`ConfigError` if any, since SGLang's decode would read the first token's logprobs or
    sampling mask from aux rows a vLLM prefill cannot fill (it would report zeros)."""
    asked = [
        name
        for name, value in (
            ("logprobs", logprobs),
            ("top logprobs", top_logprobs),
            ("token_ids_logprob", token_ids_logprob),
            ("a sampling mask", return_sampling_mask),
        )
        if value
    ]
    if asked:
        raise ConfigError(
            f"a request asking for {' and '.join(asked)} cannot be prefilled by vLLM for an SGLang decode: SGLang's "
            "decode reads the first token's from the aux slot its prefill writes, and vLLM's prefill hands a "
            "connector none (prefill such requests on SGLang)"
        )
    return {"do_remote_decode": True, "sglang_room": _room(room)}


def sglang_decode_fields(bootstrap: str, room: int) -> dict[str, Any]:
    """The fields of SGLang's generate request that send its decode to the vLLM prefill
    registered at ``bootstrap`` (its ``sglang_bootstrap``) for room ``room``."""
    host, port = parse_bootstrap(bootstrap)
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": _room(room)}
