"""What every role of the SGLang backend shares: SGLang's base classes (imported here once, with
the version to install when they are missing), the timeouts, a room's transfer tag and the TP
sizes that pair, :class:`KVTransferError`, a request's failure as ``poll`` and
``failure_exception`` report it, and the rank's KV description read from SGLang's ``KVArgs``
(regions, memory kind, state types, the parallelism the backend serves)."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

try:
    from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer as BaseKVBootstrapServer
    from sglang.srt.disaggregation.base.conn import BaseKVManager as BaseKVManager
    from sglang.srt.disaggregation.base.conn import BaseKVReceiver as BaseKVReceiver
    from sglang.srt.disaggregation.base.conn import BaseKVSender as BaseKVSender
    from sglang.srt.disaggregation.base.conn import KVArgs as KVArgs
    from sglang.srt.disaggregation.base.conn import KVPoll as KVPoll
    from sglang.srt.disaggregation.base.conn import KVTransferMetric as KVTransferMetric
except ImportError as exc:  # pragma: no cover - exercised in a process without SGLang
    raise ImportError(
        "kvtransport.integrations.sglang needs SGLang's disaggregation classes "
        f"(sglang==0.5.23: pip install 'sglang==0.5.23'); importing them failed: {exc}"
    ) from exc

from kvtransport.integrations.pairing import request_tag
from kvtransport.integrations.sglang_topology import RankTopology
from kvtransport.runtime.endpoint import State, Timeouts, Transfer
from kvtransport.runtime.fanin import FanIn
from kvtransport.spi.env import env_number
from kvtransport.spi.errors import KVTransportError
from kvtransport.spi.memory import HOST, MemoryKind, RegionSet

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
#: SGLang's own timeout variables, honoured unless the kvtransport one is set (defaults: SGLang's).
SGLANG_TIMEOUTS = {
    "bootstrap": ("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0),
    "waiting": ("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0),
}


def sglang_timeouts(env: Any = None) -> Timeouts:
    """kvtransport's timeouts, with SGLang's ``SGLANG_DISAGGREGATION_*`` ones where the
    kvtransport variable is not set: a deployment tuned for SGLang's backends keeps its settings."""
    env = os.environ if env is None else env
    timeouts = Timeouts.from_env(env)
    changes = {
        field: env_number(theirs, default, env=env)
        for field, (theirs, default) in SGLANG_TIMEOUTS.items()
        if not env.get(Timeouts.ENV[field], "").strip()
    }
    return dataclasses.replace(timeouts, **changes)


def room_tag(room: int, prefill_tp: int, decode_tp: int, decode_rank: int) -> str:
    """The transfer tag decode rank ``decode_rank`` announces ``room`` under (``pairing.request_tag``
    of the room number)."""
    return request_tag(str(room), prefill_tp, decode_tp, decode_rank)


class KVTransferError(KVTransportError):
    """What ``failure_exception`` raises: SGLang's fields (room, reason) over a kvtransport error."""

    def __init__(self, bootstrap_room: int, failure_reason: str, cause: BaseException | None = None) -> None:
        super().__init__(f"KV transfer of room {bootstrap_room} failed: {failure_reason}")
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.cause = cause


def kv_memory(args: KVArgs, server_args: Any) -> MemoryKind:
    """Where the KV buffers live: ``cuda:<gpu_id>`` when the pointers are device memory."""
    if getattr(server_args, "device", "cuda") == "cpu" or not args.kv_data_ptrs:
        return HOST
    from kvtransport.staging.cuda_copy import is_device_pointer

    return MemoryKind(int(args.gpu_id)) if is_device_pointer(int(args.kv_data_ptrs[0])) else HOST


def model_kv_heads(server_args: Any, attn_tp_size: int) -> tuple[int, int]:
    """(KV heads of one attention-TP rank, the model's KV heads) as SGLang's ``ModelConfig``
    counts them (its pools are built with ``get_num_kv_heads(attn_tp_size)``): what a decode
    rank's ``KVArgs`` lack (SGLang sets ``kv_head_num`` there only with its staging buffer, after
    the manager started), and what another engine's prefill regroups its pages by. ``(0, 0)``
    when the config cannot be read (the layout then states none, as before)."""
    try:
        from sglang.srt.configs.model_config import ModelConfig

        config = ModelConfig.from_server_args(server_args)
        return int(config.get_num_kv_heads(attn_tp_size)), int(config.get_total_num_kv_heads())
    except Exception as exc:  # noqa: BLE001 - an unreadable config states no heads
        log.debug("reading the model's KV heads: %s", exc)
        return 0, 0


def kv_dtype_name(args: KVArgs, server_args: Any) -> str:
    """The KV's dtype for another engine's decode to compare (the layout's ``extra["kv_dtype"]``;
    ``dtype`` keeps SGLang's own string, which SGLang peers compare as before): SGLang's resolved
    ``kv_cache_dtype_str``, or, where that is ``auto`` (the model's own dtype), the dtype SGLang's
    ``ModelConfig`` resolves for the model (``float32`` weights run as ``float16``...)."""
    name = str(getattr(args, "kv_cache_dtype_str", "") or "")
    if name and name != "auto":
        return name
    try:
        from sglang.srt.configs.model_config import ModelConfig

        return str(ModelConfig.from_server_args(server_args).dtype).removeprefix("torch.")
    except Exception as exc:  # noqa: BLE001 - an unreadable config leaves the name as SGLang gave it
        log.debug("resolving the KV dtype of %r: %s", name, exc)
        return name or "unknown"


#: State types (SGLang's ``StateType`` values) moved by kvtransport: each is a set of buffers
#: addressed by one index list that prefill and decode pair one to one (the SWA sub-pool's
#: window pages; a request's Mamba slot in every state tensor), between equal attention TP.
#: Pools with any other state type are refused when the manager starts (state_types_of).
SERVED_STATE_TYPES = ("swa", "mamba")


def state_types_of(args: KVArgs) -> tuple[str, ...]:
    """The rank's state groups by SGLang type name; :class:`KVTransportError` at start-up for a
    pool kvtransport cannot serve (rather than failing every request of that model)."""
    types = tuple(str(getattr(t, "value", t)) for t in (getattr(args, "state_types", None) or []))
    groups = list(getattr(args, "state_data_ptrs", None) or [])
    unserved = sorted({t for t in types if t not in SERVED_STATE_TYPES})
    if unserved:
        raise KVTransportError(
            f"this model's KV pool has state buffers of type {', '.join(unserved)}, which kvtransport does not "
            f"transfer (it serves {', '.join(SERVED_STATE_TYPES)}); run it with another "
            "--disaggregation-transfer-backend (mooncake serves it)"
        )
    if len(groups) != len(types):
        raise KVTransportError(f"KVArgs lists {len(types)} state types but {len(groups)} groups of state buffers")
    empty = [t for t, g in zip(types, groups, strict=True) if not g]
    if empty:
        raise KVTransportError(f"KVArgs has no buffers for state type {empty[0]}")
    return types


def _setting(bag: str, name: str, server_args: Any, default: Any) -> Any:
    """One of SGLang's settings as the scheduler runs with it: its published configuration
    (``runtime_context.get_<bag>()``), else the server-args object, else ``default``."""
    try:
        from sglang.srt import runtime_context

        return getattr(getattr(runtime_context, f"get_{bag}")(), name)
    except (ImportError, ValueError, RuntimeError, AttributeError):
        value = getattr(server_args, name, None)
        return default if value is None else value


def decode_allocation_policy(server_args: Any) -> str:
    """``--disaggregation-decode-allocation-policy`` as the scheduler runs with it (``early``
    when neither SGLang's published configuration nor the server args say)."""
    return str(_setting("disagg", "disaggregation_decode_allocation_policy", server_args, None) or "early")


def speculative(server_args: Any) -> bool:
    """Whether the scheduler runs speculative decoding (its aux slots then carry hidden states)."""
    algorithm = _setting("spec", "speculative_algorithm", server_args, None)
    return bool(algorithm) and str(algorithm).upper() not in ("NONE", "SPECULATIVEALGORITHM.NONE")


def aux_rows(args: KVArgs, server_args: Any) -> dict[str, int] | None:
    """Which of ``KVArgs``' aux regions hold the rows a vLLM prefill writes for this decode
    (spi.handoff): SGLang 0.5.23's ``MetadataBuffers.get_buf_infos`` puts ``output_ids`` and
    ``cached_tokens`` first and ``bootstrap_room`` last, or last but one when
    ``--disaggregation-enable-kv-checksum`` adds the checksum row after it. ``None`` when the
    regions do not look like that (another SGLang): the handshake then refuses a vLLM prefill
    rather than write into rows it cannot name."""
    lens = [int(n) for n in getattr(args, "aux_item_lens", [])]
    checksum = bool(_setting("disagg", "disaggregation_enable_kv_checksum", server_args, False))
    room = len(lens) - (2 if checksum else 1)
    # The nine rows SGLang always has and the room's, with DSA's top-k row (+1) and the sampling
    # mask's three (+3) or not: any other count is an SGLang whose rows may have moved.
    if len(lens) - checksum not in (10, 11, 13, 14) or any(lens[i] != 64 for i in (0, 1, room)):
        return None
    return {"output_ids": 0, "cached_tokens": 1, "bootstrap_room": room}


def unserved_parallelism(topology: RankTopology) -> str:
    """What of this rank's parallel layout the backend cannot serve ('' when it serves all)."""
    parts = []
    if topology.pp_size > 1:
        parts.append(f"pipeline parallelism (pp_size {topology.pp_size})")
    if topology.attn_cp_size > 1:
        parts.append(f"attention context parallelism (attn_cp_size {topology.attn_cp_size})")
    return " and ".join(parts)


def regions_of(args: KVArgs, kind: MemoryKind) -> RegionSet:
    """``KVArgs`` as regions: KV (one item = one page), aux slots (host), and one state group
    per state type (its buffers, one item = one window page or one slot)."""

    def flat(name: str) -> list[int]:
        value = getattr(args, name, None) or []
        return [int(x) for group in value for x in (group if isinstance(group, list | tuple) else [group])]

    groups = [len(g) if isinstance(g, list | tuple) else 1 for g in getattr(args, "state_data_ptrs", None) or []]

    return RegionSet.from_kv_args(
        [int(p) for p in args.kv_data_ptrs],
        [int(n) for n in args.kv_data_lens],
        [int(n) for n in args.kv_item_lens],
        kind=kind,
        aux_data_ptrs=[int(p) for p in getattr(args, "aux_data_ptrs", [])],
        aux_data_lens=[int(n) for n in getattr(args, "aux_data_lens", [])],
        aux_item_lens=[int(n) for n in getattr(args, "aux_item_lens", [])],
        state_data_ptrs=flat("state_data_ptrs"),
        state_data_lens=flat("state_data_lens"),
        state_item_lens=flat("state_item_lens"),
        state_groups=groups,
    )


class _Failure:
    """A transfer's first error, kept for ``failure_exception``."""

    def __init__(self) -> None:
        self.error: KVTransportError | None = None

    def set(self, error: KVTransportError) -> None:
        self.error = self.error or error


def _env_flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value in ("1", "true", "yes", "on")


def _poll_of(transfer: Transfer | FanIn | None, failure: _Failure, before: int) -> int:
    if failure.error is not None:
        return int(KVPoll.Failed)
    if transfer is None:
        return before
    if transfer.state is State.FAILED:
        failure.set(transfer.error or KVTransportError("transfer failed"))
    return int(transfer.state)


def _stop(transfer: Transfer | FanIn | None, reason: str) -> None:
    """Abort ``transfer`` if it still runs (the peer hears of it)."""
    if transfer is not None and not transfer.state.final:
        transfer.abort(reason)


def _raise(room: int, failure: _Failure, transfer: Transfer | FanIn | None) -> None:
    error = failure.error or (transfer.error if transfer is not None else None)
    reason = f"{type(error).__name__}: {error}" if error else "the transfer failed"
    raise KVTransferError(room, reason, error)
