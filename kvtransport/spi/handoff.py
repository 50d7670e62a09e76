"""The first output token's handoff from a vLLM prefill into an SGLang decode: the rows of
SGLang's aux slot (its ``MetadataBuffers``) a vLLM prefill writes, where they lie in the slot of
the prefill's own handoff arena, and the bytes it puts there.

SGLang's decode takes from its aux slot, once the KV landed (``decode.py``,
``_commit_transfer_to_req``): the request's first output token (``output_ids[0]``), the prefix
its prefill found cached (``cached_tokens[0..3]``), and the room the slot was written for
(``bootstrap_room[0]``, checked against the request's: a slot of another room fails the
request). vLLM's prefill knows all three when it finishes a request (the token it sampled, its
``num_cached_tokens``, and the room the proxy named). What it does not have (the first token's
logprobs, a draft model's hidden states, a sampling mask) is not written: an SGLang decode with
speculative decoding is refused at handshake (:mod:`kvtransport.spi.cross_engine`), and a
request asking for logprobs must be prefilled by SGLang (the proxy's check:
``kvtransport.integrations.vllm.to_sglang``).

Which aux region holds which row is SGLang's order (``MetadataBuffers.get_buf_infos``); the
SGLang decode states it in its layout (``extra["aux_rows"]``: row name -> aux region number),
so the vLLM side never guesses it. Both ends compute the same :class:`Handoff` from that
statement: the writer plans its runs with it, the reader counts the bytes a complete transfer
writes with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtransport.spi.page_geometry import engine_of

__all__ = ["HANDOFF_ROWS", "HANDOFF_SLOT_BYTES", "Handoff", "handoff_between", "handoff_problem", "slot_content"]

#: The rows a vLLM prefill writes into an SGLang decode's aux slot, in the order they lie in the
#: prefill's handoff slot.
HANDOFF_ROWS = ("output_ids", "cached_tokens", "bootstrap_room")
#: Bytes of one slot of a vLLM worker's handoff arena: the three rows (64 bytes each in SGLang
#: 0.5.23, padded for RDMA's minimum) with room to spare; a decode stating larger rows is refused.
HANDOFF_SLOT_BYTES = 1024
#: The least each row must hold: one int32 token; the seven int32 counts SGLang's decode reads
#: (cached, device, host, storage, image, audio, video); one uint64 room.
_MIN_ROW_BYTES = {"output_ids": 4, "cached_tokens": 28, "bootstrap_room": 8}


@dataclass(frozen=True)
class Handoff:
    """Where each handoff row goes: ``rows[i]`` is the reader's aux region number of
    ``HANDOFF_ROWS[i]``, ``lengths[i]`` its bytes, ``offsets[i]`` where it starts in the
    writer's slot."""

    rows: tuple[int, ...]
    lengths: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.lengths)


def _is_sglang_decode(layout: Any) -> bool:
    """Whether ``layout`` is an SGLang decode rank's (its stated engine and role)."""
    return engine_of(layout) == "sglang" and layout.extra.get("role") == "decode"


def handoff_problem(reader: Any) -> str:
    """Why a vLLM prefill cannot write the first token's handoff into the aux slots of the SGLang
    decode whose layout is ``reader`` ('' when it can)."""
    if reader.extra.get("speculative"):
        return (
            "the SGLang decode runs speculative decoding, which reads the draft model's hidden states and top-k "
            "from the aux slot its prefill writes; a vLLM prefill has none to give"
        )
    stated = reader.extra.get("aux_rows")
    if not isinstance(stated, Mapping) or set(stated) != set(HANDOFF_ROWS):
        return (
            f"the SGLang decode does not state which aux regions hold {', '.join(HANDOFF_ROWS)} (extra 'aux_rows'): "
            "its kvtransport is older than 0.7.0, or it did not recognise SGLang's aux buffers (it says so at start)"
        )
    lens = tuple(reader.aux_item_lens)
    rows = [stated[name] for name in HANDOFF_ROWS]
    if not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < len(lens) for r in rows):
        return f"the SGLang decode's aux_rows {dict(stated)!r} name regions outside its {len(lens)} aux regions"
    if len(set(rows)) != len(rows):
        return f"the SGLang decode's aux_rows {dict(stated)!r} name one region twice"
    for name, row in zip(HANDOFF_ROWS, rows, strict=True):
        if lens[row] < _MIN_ROW_BYTES[name]:
            return f"the SGLang decode's {name} row has {lens[row]} bytes, fewer than {_MIN_ROW_BYTES[name]}"
    if sum(lens[r] for r in rows) > HANDOFF_SLOT_BYTES:
        return (
            f"the SGLang decode's handoff rows take {sum(lens[r] for r in rows)} bytes, more than a vLLM prefill's "
            f"handoff slot ({HANDOFF_SLOT_BYTES})"
        )
    return ""


def handoff_between(writer: Any, reader: Any) -> Handoff | None:
    """The handoff a rank of layout ``writer`` writes into a rank of layout ``reader``'s aux
    slot: a vLLM prefill's into an SGLang decode's, when the decode's statement is usable
    (the handshake refused the pair otherwise); ``None`` for every other pair (aux slots move
    region by region, or not at all)."""
    if writer is None or reader is None:
        return None
    if engine_of(writer) != "vllm" or not _is_sglang_decode(reader):
        return None
    if handoff_problem(reader):
        return None
    stated = reader.extra["aux_rows"]
    rows = tuple(int(stated[name]) for name in HANDOFF_ROWS)
    lengths = tuple(int(reader.aux_item_lens[r]) for r in rows)
    offsets = tuple(int(x) for x in np.cumsum((0, *lengths[:-1])))
    return Handoff(rows, lengths, offsets)


def slot_content(handoff: Handoff, *, token: int, cached_tokens: int, room: int) -> bytes:
    """The bytes of the writer's handoff slot: each row as SGLang's ``MetadataBuffers.set_buf``
    leaves it for a request without logprobs (``output_ids`` int32 ``[token, 0...]``;
    ``cached_tokens`` int32 ``[cached, cached, 0, 0, ...]``: the prefix was found in the
    prefill's device cache; ``bootstrap_room`` uint64 ``[room, 0...]``), little-endian."""
    if not (0 <= token < 2**31 and 0 <= cached_tokens < 2**31 and 0 < room < 2**64):
        raise ValueError(f"token {token}, cached_tokens {cached_tokens}, room {room} out of range")
    parts = []
    for name, length in zip(HANDOFF_ROWS, handoff.lengths, strict=True):
        row = bytearray(length)
        if name == "output_ids":
            row[:4] = np.int32(token).astype("<i4").tobytes()
        elif name == "cached_tokens":
            row[:8] = np.array([cached_tokens, cached_tokens], dtype="<i4").tobytes()
        else:
            row[:8] = np.uint64(room).astype("<u8").tobytes()
        parts.append(bytes(row))
    return b"".join(parts)
