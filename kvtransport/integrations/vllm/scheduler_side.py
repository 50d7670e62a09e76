"""The scheduler side of vLLM's connector, without vLLM: which requests load KV from a prefill
instance (decode) or hold their blocks for a decode instance (prefill), which requests decode
will never load (their prefill is told at once, not at its lease), and the orders one step hands
to the workers.

A request object here is anything with vLLM's ``Request`` fields this reads
(``request_id``, ``kv_transfer_params``, ``prompt_token_ids``); the connector passes vLLM's own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtransport.integrations.vllm.params import (
    RemotePrefill,
    is_remote_decode,
    is_remote_prefill,
    parse,
    prompt_digest,
    request_id_problem,
    sglang_room,
    sign,
    verify,
    verify_signature,
)
from kvtransport.runtime.auth import Secret
from kvtransport.spi.errors import ConfigError

log = logging.getLogger(__name__)

#: Requests scheduled for an SGLang decode whose cached count waits for request_finished; and
#: the declines one step hands to the workers (vLLM takes the orders every step: only a flood of
#: requests ended between two steps reaches it, and the oldest then wait for prefill's lease).
MAX_PENDING = 65_536

__all__ = ["DeclineOrder", "FirstToken", "HoldOrder", "LoadOrder", "Orders", "SchedulerSide"]


@dataclass(frozen=True)
class FirstToken:
    """Prefill for an SGLang decode: what its aux slot gets with the KV (spi.handoff): the
    first output token, the prefix found cached, and the bootstrap room the proxy named."""

    token: int
    cached_tokens: int
    room: int


@dataclass(frozen=True)
class HoldOrder:
    """Prefill: hold ``blocks`` of ``request`` until decode read them; decode names them
    ``name`` (the request's id, or for an SGLang decode its bootstrap room), and an SGLang
    decode gets ``first_token`` in its aux slot."""

    request: str
    blocks: tuple[int, ...]
    name: str = ""
    first_token: FirstToken | None = None


@dataclass(frozen=True)
class LoadOrder:
    """Decode: fill ``blocks`` (after ``prefix`` blocks held already) from ``remote``; or, when
    the request's params were unusable, fail the load with ``error`` (vLLM's
    ``kv_load_failure_policy`` then decides: fail the request or recompute it)."""

    request: str
    blocks: tuple[int, ...]
    prefix: int
    remote: RemotePrefill | None
    error: str = ""


@dataclass(frozen=True)
class DeclineOrder:
    """Decode: ``request`` will never load its KV from ``remote`` (it ended before its load
    started, or goes on computing its prompt itself): every worker tells the prefill ranks it
    would have read from that nothing of it is wanted, and they give its blocks back at once."""

    request: str
    remote: RemotePrefill
    reason: str


@dataclass
class Orders:
    """One step's orders for every worker."""

    holds: list[HoldOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)
    declines: list[DeclineOrder] = field(default_factory=list)


class SchedulerSide:
    """The scheduler's bookkeeping for one engine (``block_size`` tokens a block, TP
    ``tp_size``, engine ``engine_id``)."""

    def __init__(self, engine_id: str, block_size: int, tp_size: int, secret: Secret | None = None) -> None:
        self.engine_id = engine_id
        #: Signs the params prefill hands out and checks those decode is given.
        self.secret = secret if secret is not None else Secret.none()
        self.block_size = block_size
        self.tp_size = tp_size
        #: Each TP rank's control address, from the workers' handshake metadata.
        self.addresses: dict[int, str] = {}
        self._params: dict[str, RemotePrefill | ConfigError] = {}
        #: Prefill for SGLang decodes: the tokens of each request's prompt found in vLLM's prefix
        #: cache when it was scheduled (its first-token handoff's cached count).
        self._cached: dict[str, int] = {}
        self._orders = Orders()
        #: Prefill: requests whose blocks the workers hold for decode.
        self.holding: set[str] = set()

    def set_addresses(self, addresses: Mapping[int, str]) -> None:
        self.addresses.update(addresses)

    # -- decode -------------------------------------------------------------------------------

    def _check(self, request: Any, *, prompt: bool = True) -> RemotePrefill | ConfigError:
        """The request's params, parsed and verified (``prompt``: against its prompt too)."""
        try:
            got = parse(request.kv_transfer_params, block_size=self.block_size)
            if prompt:
                verify(got, request.prompt_token_ids or (), self.secret)
            else:
                verify_signature(got, self.secret)
        except ConfigError as exc:
            return exc
        return got

    def _remote(self, request: Any) -> RemotePrefill | ConfigError:
        got = self._params.get(request.request_id)
        if got is None:
            got = self._params[request.request_id] = self._check(request)
        return got

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """vLLM's ``get_num_new_matched_tokens``: a remote-prefill request loads the prompt's KV
        beyond what this instance holds, asynchronously. Unusable params still take the load
        path, which then fails with their error (never a silent local prefill)."""
        params = request.kv_transfer_params
        if isinstance(params, Mapping) and params.get("sglang_room") is not None:
            # Prefill for an SGLang decode: the prefix vLLM found cached is the cached count
            # SGLang's decode reports (vLLM's Request keeps none to read at request_finished).
            # vLLM calls request_finished for every request it frees, which pops it; the bound
            # is for requests it never scheduled.
            if len(self._cached) >= MAX_PENDING and request.request_id not in self._cached:
                self._cached.pop(next(iter(self._cached)))
            self._cached[request.request_id] = max(0, int(num_computed_tokens))
        if not is_remote_prefill(params):
            return 0, False
        remote = self._remote(request)
        prompt = len(request.prompt_token_ids or ())
        end = prompt if isinstance(remote, ConfigError) else min(remote.num_tokens, prompt)
        count = end - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, new_blocks: Sequence[int], held_blocks: int, num_external: int) -> None:
        """vLLM's ``update_state_after_alloc``: ``new_blocks`` receive the remote KV after the
        ``held_blocks`` this instance's prefix cache had. With nothing to receive, the request is
        computed here and never loads: its prefill is told so now."""
        params = request.kv_transfer_params
        if not is_remote_prefill(params):
            self._params.pop(request.request_id, None)
            return
        if num_external <= 0:
            # vLLM admitted it with no external tokens: its prefix cache holds all that prefill
            # computed, the request reads no cached KV (prompt logprobs), or vLLM trimmed the
            # hit. Nor does a preempted request load later: _decline clears do_remote_prefill.
            self._decline(request, "decode computes its prompt itself (nothing to load)")
            return
        remote = self._remote(request)
        self._params.pop(request.request_id, None)
        params["do_remote_prefill"] = False  # a second call (after the load) loads nothing
        if isinstance(remote, ConfigError):
            self._orders.loads.append(LoadOrder(request.request_id, tuple(new_blocks), held_blocks, None, str(remote)))
        else:
            self._orders.loads.append(LoadOrder(request.request_id, tuple(new_blocks), held_blocks, remote))

    def _decline(self, request: Any, reason: str) -> None:
        """``request`` will never load its remote KV: its prefill ranks are told (a
        :class:`DeclineOrder`), so they give its blocks back now, not when their lease runs out.
        Only params decode verified name whom to tell: those a load would refuse are not acted
        on (a client could otherwise free another request's blocks with a copy of its params).
        vLLM's serving layer ends a request it refused before the engine saw it
        (``abort_immediately``) with a placeholder prompt: then the MAC alone vouches for them."""
        params = request.kv_transfer_params
        params["do_remote_prefill"] = False  # once: neither a load nor a second decline follows
        remote = self._params.pop(request.request_id, None)
        if remote is None:
            remote = self._check(request, prompt=not getattr(request, "abort_immediately", False))
        if isinstance(remote, ConfigError):
            log.warning(
                "kvtransport vLLM decode: request %s will not load (%s); its params are refused (%s), so its prefill "
                "is not told and keeps the blocks until its lease runs out",
                request.request_id,
                reason,
                remote,
            )
            return
        declines = self._orders.declines
        if len(declines) >= MAX_PENDING:
            dropped = declines.pop(0)
            log.warning(
                "kvtransport vLLM decode: %d requests ended since the last step; prefill request %s is not told, its "
                "blocks come back at its lease",
                MAX_PENDING,
                dropped.remote.request_id,
            )
        declines.append(DeclineOrder(request.request_id, remote, reason))

    # -- prefill ------------------------------------------------------------------------------

    def finished(self, request: Any, block_ids: Sequence[int], completed: bool) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: a prefill request that ran to its end holds its blocks
        for decode and returns the params decode needs (``True``: vLLM frees the blocks only
        once a worker reports it finished sending). A decode request that ends before its load
        started tells its prefill (its load, if one started, is stopped by the workers)."""
        params = request.kv_transfer_params
        if is_remote_prefill(params):
            # update_state_after_alloc clears the flag before any load starts, so vLLM never
            # admitted this one: aborted while queued or waiting for free blocks, a deferred
            # load not started, refused by vLLM's serving layer, its grammar failed to compile.
            self._cached.pop(request.request_id, None)
            status = getattr(request, "status", None)
            self._decline(request, f"it ended ({status if status is not None else 'finished'}) before its load started")
            return False, None
        self._params.pop(request.request_id, None)
        cached = self._cached.pop(request.request_id, 0)
        if not is_remote_decode(params) or not completed or not block_ids:
            return False, None
        problem = request_id_problem(request.request_id)
        if problem:
            # Decode could never name it: holding its blocks would only pin them for the lease.
            log.error(
                "kvtransport vLLM prefill: request %r cannot be offered to decode: %s", request.request_id, problem
            )
            return False, None
        if len(self.addresses) != self.tp_size:
            log.error(
                "kvtransport vLLM prefill: request %s finished, but %d of %d workers published a control address; "
                "its KV cannot be offered to decode",
                request.request_id,
                len(self.addresses),
                self.tp_size,
            )
            return False, None
        num_tokens = int(request.num_computed_tokens)
        blocks = tuple(int(b) for b in block_ids)
        try:
            room = sglang_room(params)
        except ConfigError as exc:
            log.error("kvtransport vLLM prefill: request %s cannot be offered to decode: %s", request.request_id, exc)
            return False, None
        if room is not None:
            return self._hold_for_sglang(request, blocks, room, num_tokens, cached)
        self._orders.holds.append(HoldOrder(request.request_id, blocks, request.request_id))
        self.holding.add(request.request_id)
        remote = RemotePrefill(
            engine_id=self.engine_id,
            request_id=request.request_id,
            tp_size=self.tp_size,
            addresses=tuple(self.addresses[r] for r in range(self.tp_size)),
            num_tokens=num_tokens,
            num_blocks=-(-num_tokens // self.block_size),
            block_size=self.block_size,
            prompt_sha256=prompt_digest(request.prompt_token_ids or (), num_tokens),
        )
        return True, sign(remote, self.secret).to_params()

    def _hold_for_sglang(
        self, request: Any, blocks: tuple[int, ...], room: int, num_tokens: int, cached: int
    ) -> tuple[bool, dict[str, Any] | None]:
        """``finished`` for an SGLang decode: held under the room (the tag SGLang's decode
        announces), with the first token for its aux slot. SGLang's decode finds the ranks at
        the bootstrap registry they registered with (``sglang_bootstrap``), not in params."""
        output = list(getattr(request, "output_token_ids", ()) or ())
        if not output:
            log.error(
                "kvtransport vLLM prefill: request %s (SGLang room %d) finished without an output token: an SGLang "
                "decode needs the first one (send it with max_tokens=1)",
                request.request_id,
                room,
            )
            return False, None
        first = FirstToken(int(output[0]), cached, room)
        self._orders.holds.append(HoldOrder(request.request_id, blocks, str(room), first))
        self.holding.add(request.request_id)
        return True, {
            "do_remote_prefill": False,
            "do_remote_decode": False,
            "sglang_room": room,
            "remote_engine_id": self.engine_id,
            "tp_size": self.tp_size,
            "remote_num_tokens": num_tokens,
        }

    def sent(self, requests: Sequence[str] | set[str]) -> None:
        """Workers reported these requests' blocks released (read by decode or expired)."""
        self.holding.difference_update(requests)

    def take_orders(self) -> Orders:
        """This step's orders (``build_connector_meta``); the next step starts empty."""
        orders, self._orders = self._orders, Orders()
        return orders

    def has_orders(self) -> bool:
        """Whether orders wait for the next step (the engine must step to hand them over)."""
        orders = self._orders
        return bool(orders.holds or orders.loads or orders.declines)
