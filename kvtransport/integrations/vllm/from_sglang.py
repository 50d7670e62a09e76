"""The ``kv_transfer_params`` that send a vLLM decode to an SGLang prefill: what the proxy of a
mixed deployment hands vLLM's decode with a request whose prompt an SGLang prefill instance
computed under a bootstrap room.

SGLang's prefill ranks publish their endpoints at the instance's bootstrap registry (or etcd,
``KVTRANSPORT_DISCOVERY``), where SGLang's own decode finds them; :func:`params_for_sglang_prefill`
looks them up the same way and names the room as the request, the tag each decode rank announces
its blocks under and the one SGLang's sender waits for. The prefill returns no params of its own,
so the proxy signs them, with the deployment secret (``KVTRANSPORT_SECRET``): decode checks the
MAC and the prompt's digest as it does for a vLLM prefill's (docs/vllm.md, 'Across engines').
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvtransport.integrations.discovery import directory_for
from kvtransport.integrations.vllm.params import MAX_TP, RemotePrefill, prompt_digest, sign
from kvtransport.runtime.auth import Secret, load_secret
from kvtransport.spi.errors import ConfigError

__all__ = ["params_for_sglang_prefill"]


def params_for_sglang_prefill(
    bootstrap_addr: str,
    room: int,
    prompt_token_ids: Sequence[int],
    *,
    block_size: int,
    dp_rank: int | None = None,
    wait_s: float = 5.0,
    secret: Secret | None = None,
) -> dict[str, Any]:
    """Params for a vLLM decode request whose KV the SGLang prefill at ``bootstrap_addr``
    computes under bootstrap room ``room`` for ``prompt_token_ids`` (the same ids the proxy
    sends both instances). ``dp_rank``: the prefill DP rank the router chose (default: the
    room's, ``room % dp_size``, as SGLang routes by room). :class:`ConfigError` when the
    instance's ranks cannot be looked up within ``wait_s`` or do not fit vLLM's blocks."""
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2**63:
        raise ConfigError(f"bootstrap room must be a whole number below 2**63, got {room!r}")
    directory = directory_for(bootstrap_addr)
    try:
        first = directory.lookup(0, 0, wait_s)
        dp_size, tp_size = int(first["dp_size"]), int(first["tp_size"])
        if dp_rank is None:
            if not first["follow_bootstrap_room"]:
                raise ConfigError(
                    f"the SGLang prefill at {bootstrap_addr} does not route rooms by number: pass the DP rank "
                    "the router chose"
                )
            dp_rank = room % dp_size
        if not 0 <= dp_rank < dp_size or not 0 < tp_size <= MAX_TP:
            raise ConfigError(f"DP rank {dp_rank} of {dp_size}, TP {tp_size} (at most {MAX_TP})")
        routes = [first if dp_rank == 0 and t == 0 else directory.lookup(dp_rank, t, wait_s) for t in range(tp_size)]
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"looking up the SGLang prefill ranks at {bootstrap_addr} failed: {type(exc).__name__}: {exc}"
        ) from exc
    page_size = int(first.get("page_size") or 0)
    if page_size and page_size != block_size:
        raise ConfigError(
            f"the SGLang prefill at {bootstrap_addr} uses pages of {page_size} tokens, the vLLM decode blocks of "
            f"{block_size}: run SGLang with --page-size {block_size} (or vLLM with --block-size {page_size})"
        )
    tokens = len(prompt_token_ids)
    remote = RemotePrefill(
        engine_id=f"sglang-{bootstrap_addr}-dp{dp_rank}",
        request_id=str(room),
        tp_size=tp_size,
        addresses=tuple(str(r["address"]) for r in routes),
        num_tokens=tokens,
        num_blocks=math.ceil(tokens / block_size),
        block_size=block_size,
        prompt_sha256=prompt_digest(prompt_token_ids, tokens),
    )
    return sign(remote, secret if secret is not None else load_secret()).to_params()
