"""How this side's KV maps onto one peer's: the shape of what moves each way (all of a page, a
slice of its heads under unequal TP, regrouped into another serving engine's pages, or
nothing), the byte runs of a chunk of pages and of the
state items that go with the last chunk (checked against what the receiver announced: a
sending transfer's next chunk, ``chunk_runs``), and the bytes a complete receive transfer
writes.

A :class:`PairPlan` is made once per connection, after its handshake, from both sides' regions
and layouts; nothing in it changes afterwards, so the callers' threads plan with it at once.
It does no I/O and keeps no per-transfer state: each call's errors are
:class:`~kvtransport.spi.errors.InvalidPages` naming what does not pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvtransport.runtime.checks import NO_ITEMS, check_aux, state_items
from kvtransport.runtime.chunk import Chunk
from kvtransport.spi.errors import InvalidPages
from kvtransport.spi.handoff import Handoff, handoff_between
from kvtransport.spi.inbound import Claim
from kvtransport.spi.memory import KVLayout, RegionSet
from kvtransport.spi.plan import (
    RegionPairs,
    Runs,
    as_pages,
    check_pages,
    few_pages,
    plan,
    plan_heads,
    plan_regrouped,
)
from kvtransport.spi.tp_map import EQUAL, PairShape, pair_shape

if TYPE_CHECKING:
    from kvtransport.runtime.handles import Transfer


class PairPlan:
    """This side's regions and layout paired with one peer's (``peer_layout`` ``None``: a peer
    that stated no layout, whose pages are taken whole)."""

    def __init__(
        self,
        regions: RegionSet,
        layout: KVLayout,
        peer_regions: RegionSet,
        peer_layout: KVLayout | None,
        max_run_bytes: int | None,
    ) -> None:
        self.regions = regions
        self.peer_regions = peer_regions
        self.max_run_bytes = max_run_bytes
        #: What this side writes into the peer's pages, and the peer into this side's.
        self.sending = EQUAL if peer_layout is None else pair_shape(layout, peer_layout)
        self.receiving = EQUAL if peer_layout is None else pair_shape(peer_layout, layout)
        self._kv_pairs = RegionPairs(regions.kv, peer_regions.kv)
        # Per page and per aux slot, over every region (a model has dozens): asked for at each
        # announcement and each "done", the same for the connection's life.
        self._received_per_page = self.receiving.kv_bytes_per_page(tuple(r.item_len for r in regions.kv))
        #: A vLLM prefill's first-token handoff into an SGLang decode's aux slot (this side
        #: writes it, or reads it): rows of the reader's slot, not the slot region by region.
        self._handoff_out: Handoff | None = handoff_between(layout, peer_layout)
        handoff_in = handoff_between(peer_layout, layout)
        self._aux_slot_bytes = (
            handoff_in.total_bytes if handoff_in is not None else sum(r.item_len for r in regions.aux)
        )

    def shape(self, *, sending: bool) -> PairShape:
        return self.sending if sending else self.receiving

    def kv_runs(self, src: Any, dst: Any, kv: Sequence[int] | None = None) -> Runs:
        """The runs that move this side's pages ``src`` into the peer's pages ``dst``, in every
        KV region or, with ``kv``, in those regions only (a layer group's: ``runtime.layerwise``)."""
        shape = self.sending
        if shape.kind == "regroup":
            # Another engine's pool: each page's runs from the connection's table, out of this
            # side's regions ``kv`` (a layer group's) into wherever the peer keeps those layers
            # (its region numbers are not this side's).
            assert shape.regroup is not None
            return plan_regrouped(
                self.regions.kv,
                self.peer_regions.kv,
                src,
                dst,
                shape.regroup,
                only_src=kv,
                max_run_bytes=self.max_run_bytes,
            )
        mine = self.regions.kv if kv is None else tuple(self.regions.kv[i] for i in kv)
        theirs = self.peer_regions.kv if kv is None else tuple(self.peer_regions.kv[i] for i in kv)
        if shape.kind == "heads":
            assert shape.slice is not None
            return plan_heads(
                mine,
                theirs,
                src,
                dst,
                page_tokens=shape.page_tokens,
                src_heads=shape.src_heads,
                dst_heads=shape.dst_heads,
                head_bytes=shape.head_bytes,
                src_head=shape.slice.src_head,
                dst_head=shape.slice.dst_head,
                count=shape.slice.count,
                max_run_bytes=self.max_run_bytes,
            )
        if shape.kind == "none":
            # Nothing of these pages is this side's to write; the caller's indices still must be right.
            check_pages(as_pages(src, "source"), self.regions.num_pages, "source")
            return Runs.empty()
        pairs = self._kv_pairs if kv is None else RegionPairs(mine, theirs)
        return pairs.plan(src, dst, max_run_bytes=self.max_run_bytes)

    def chunk_runs(
        self, transfer: Transfer, src_pages: Any, last: bool, aux: int | None, state: Sequence[Any] | None
    ) -> tuple[Runs, int]:
        """The runs of sending transfer ``transfer``'s next chunk (this side's pages
        ``src_pages`` onto the next of those the receiver announced; with ``last``, its aux slot
        and state items too), and how many announced pages are covered after it. Reads what
        the receiver announced and how far earlier chunks went; changes nothing."""
        chunk = self.chunk(transfer, src_pages, last, aux, state)
        return self.part_runs(chunk, None, tail=last), chunk.stop

    def chunk(
        self, transfer: Transfer, src_pages: Any, last: bool, aux: int | None, state: Sequence[Any] | None
    ) -> Chunk:
        """Sending transfer ``transfer``'s next chunk, checked (as ``chunk_runs``) but not planned."""
        tag = transfer.tag
        assert transfer.dst_pages is not None
        few = few_pages(src_pages)
        src = few if few is not None else as_pages(src_pages, f"transfer {tag!r} source")
        start, stop = transfer.sent_pages, transfer.sent_pages + len(src)
        announced = transfer.dst_pages.size
        if stop > announced or (last and stop != announced):
            raise InvalidPages(
                f"transfer {tag!r}: the receiver announced {announced} pages; this chunk "
                f"would make {stop}{' (the last chunk must complete them)' if last else ''}"
            )
        listed = transfer.dst_page_list
        dst = listed[start:stop] if few is not None and listed is not None else transfer.dst_pages[start:stop]
        primary = self.sending.primary
        if not primary:
            # Another rank of this side sends the receiver's aux slot and state (unequal TP).
            aux, state = None, None
        elif last and aux is None and transfer.dst_aux >= 0:
            raise InvalidPages(
                f"transfer {tag!r}: the receiver announced aux slot {transfer.dst_aux}; the last chunk must carry one"
            )
        tail: list[Runs] = []
        if last and aux is not None:
            if transfer.dst_aux < 0:
                raise InvalidPages(f"transfer {tag!r}: aux sent but the receiver announced no aux slot")
            check_aux(aux, self.regions, f"transfer {tag!r} source aux")
            if self._handoff_out is not None:
                tail.append(self._handoff_runs(self._handoff_out, aux, transfer.dst_aux))
            else:
                tail.append(plan(self.regions.aux, self.peer_regions.aux, [aux], [transfer.dst_aux]))
        if state is not None and not last:
            raise InvalidPages(f"transfer {tag!r}: state items go with the last chunk")
        if last and primary and (state or transfer.dst_state):
            tail.append(self.state_runs(tag, state or (), transfer.dst_state))
        return Chunk(src, dst, start, stop, Runs.concat(tail) if tail else Runs.empty())

    def _handoff_runs(self, handoff: Handoff, slot: int, dst_slot: int) -> Runs:
        """The runs of a first-token handoff: this side's slot ``slot`` of its one aux region
        (the rows back to back) into the rows of the peer's aux slot ``dst_slot`` (checked
        against the peer's regions when it was announced)."""
        arena = self.regions.aux[0]
        peer = self.peer_regions.aux
        # The rows and lengths come from the peer's stated layout, the addresses from its
        # regions (the handshake checked they agree): every row stays inside its own item.
        if not 0 <= slot < arena.num_items or arena.item_len < handoff.total_bytes:
            raise InvalidPages(f"handoff slot {slot} is outside this side's arena of {arena.num_items} slots")
        for r, n in zip(handoff.rows, handoff.lengths, strict=True):
            if r >= len(peer) or n > peer[r].item_len or dst_slot >= peer[r].num_items:
                raise InvalidPages(f"the peer's aux row {r} cannot take {n} bytes in slot {dst_slot}")
        base = arena.ptr + slot * arena.item_len
        dst = [peer[r].ptr + dst_slot * peer[r].item_len for r in handoff.rows]
        return Runs.of_lists([base + off for off in handoff.offsets], dst, list(handoff.lengths))

    def part_runs(self, chunk: Chunk, kv: Sequence[int] | None, *, tail: bool) -> Runs:
        """The runs of ``chunk``'s pages in KV regions ``kv`` (``None``: all), with its aux
        slot and state items when ``tail``."""
        runs = self.kv_runs(chunk.src, chunk.dst, kv)
        return Runs.concat([runs, chunk.tail]) if tail and len(chunk.tail) else runs

    def state_runs(self, tag: str, state: Sequence[Any], dst_state: Sequence[npt.NDArray[np.int64]]) -> Runs:
        """Runs moving, per state group, the source items to the items the receiver announced
        (both sides must name as many; a group that one side lacks cannot move)."""
        src = state_items(state, self.regions, f"transfer {tag!r} source")
        parts = []
        for g in range(max(len(src), len(dst_state))):
            mine = src[g] if g < len(src) else NO_ITEMS
            theirs = dst_state[g] if g < len(dst_state) else NO_ITEMS
            if mine.size != theirs.size:
                raise InvalidPages(
                    f"transfer {tag!r}: state group {g} has {mine.size} source items, the receiver "
                    f"announced {theirs.size}; they pair one to one"
                )
            if not mine.size:
                continue
            if g >= len(self.peer_regions.state_groups):
                raise InvalidPages(f"transfer {tag!r}: state group {g} is not registered at the receiver")
            parts.append(
                plan(
                    self.regions.state_group(g),
                    self.peer_regions.state_group(g),
                    mine,
                    theirs,
                    max_run_bytes=self.max_run_bytes,
                )
            )
        return Runs.concat(parts)

    def expected_bytes(self, claim: Claim) -> int:
        """What a complete transfer writes into the pages (aux slot, state items) ``claim`` announced."""
        total = int(claim.pages.size) * self._received_per_page
        if not self.receiving.primary:
            return total  # the receiver's first source sends its aux slot and state
        if claim.aux >= 0:
            total += self._aux_slot_bytes
        for g, items in enumerate(claim.state):
            total += int(items.size) * sum(r.item_len for r in self.regions.state_group(g))
        return total
