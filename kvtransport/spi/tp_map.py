"""Which KV heads move between a prefill rank and a decode rank when the two sides run
different tensor-parallel sizes: a pure function of the two sides' shapes.

Sharding follows SGLang's (and vLLM's) rule: with ``H`` KV heads over ``T`` ranks, each rank
holds ``max(1, H // T)`` heads; with ``H >= T`` rank ``r`` holds heads ``[r*H/T, (r+1)*H/T)``,
with ``H < T`` the heads are replicated and rank ``r`` holds head ``r // (T / H)``. A decode
rank ``d`` of ``D`` is fed by the prefill ranks of :func:`sources` (SGLang's
``target_tp_ranks``): the one prefill rank ``d // (D/P)`` when decode is wider, the ``P/D``
ranks ``[d*P/D, (d+1)*P/D)`` when prefill is wider.

Every head decode rank ``d`` holds is written exactly once: by the first of its sources that
holds it (a head replicated over several prefill ranks is sent by one of them, not by each).
MLA's latent is one replicated buffer, so exactly one source (the first) sends it. A source
that owes a decode rank nothing still takes part in the transfer (it completes it with zero
bytes), so the decode side can count its sources.

For MHA, a :class:`HeadSlice` says which of the prefill rank's local heads go where among the
decode rank's local heads; :func:`kvtransport.spi.plan.plan_heads` turns it into byte runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvtransport.spi.errors import MemoryLayoutError
from kvtransport.spi.page_geometry import EngineLayout, Regroup, different_engines, geometry_of, regroup


class ShardedLayout(EngineLayout, Protocol):
    """The fields of a KV layout (``spi.memory.KVLayout``) that tensor parallelism shards by."""

    @property
    def total_kv_heads(self) -> int: ...
    @property
    def state_types(self) -> tuple[str, ...]: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def aux_item_lens(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class HeadSlice:
    """``count`` consecutive heads: the prefill rank's local heads from ``src_head`` go to the
    decode rank's local heads from ``dst_head`` (in units of heads within one token's row)."""

    src_head: int
    dst_head: int
    count: int


def check_shape(total_heads: int, tp_size: int, what: str) -> None:
    """The shapes the mapping serves: heads and ranks that divide one another."""
    if total_heads <= 0 or tp_size <= 0:
        raise MemoryLayoutError(f"{what}: {total_heads} KV heads over {tp_size} ranks")
    if total_heads % tp_size and tp_size % total_heads:
        raise MemoryLayoutError(
            f"{what}: {total_heads} KV heads cannot be sharded over {tp_size} ranks (one must divide the other)"
        )


def held_heads(total_heads: int, tp_size: int, rank: int) -> range:
    """The global KV heads rank ``rank`` of ``tp_size`` holds, in the order of its local heads."""
    if total_heads >= tp_size:
        per = total_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp_size // total_heads)
    return range(head, head + 1)


def _check_sizes(prefill_tp: int, decode_tp: int) -> None:
    if prefill_tp % decode_tp and decode_tp % prefill_tp:
        raise MemoryLayoutError(f"prefill TP {prefill_tp} and decode TP {decode_tp}: one must divide the other")


def sources(prefill_tp: int, decode_tp: int, decode_rank: int) -> range:
    """The prefill ranks decode rank ``decode_rank`` receives from (SGLang's target TP ranks)."""
    _check_sizes(prefill_tp, decode_tp)
    if decode_tp >= prefill_tp:
        p = decode_rank // (decode_tp // prefill_tp)
        return range(p, p + 1)
    ratio = prefill_tp // decode_tp
    return range(decode_rank * ratio, (decode_rank + 1) * ratio)


def targets(prefill_tp: int, prefill_rank: int, decode_tp: int) -> range:
    """The decode ranks prefill rank ``prefill_rank`` feeds: those whose :func:`sources` hold it
    (several when decode is wider, one otherwise)."""
    _check_sizes(prefill_tp, decode_tp)
    if decode_tp >= prefill_tp:
        ratio = decode_tp // prefill_tp
        return range(prefill_rank * ratio, (prefill_rank + 1) * ratio)
    d = prefill_rank // (prefill_tp // decode_tp)
    return range(d, d + 1)


def head_slice(
    total_heads: int, prefill_tp: int, prefill_rank: int, decode_tp: int, decode_rank: int
) -> HeadSlice | None:
    """MHA: what prefill rank ``prefill_rank`` writes into decode rank ``decode_rank``'s pages
    (``None``: nothing, it is not a source of that rank or another source sends those heads)."""
    check_shape(total_heads, prefill_tp, "prefill")
    check_shape(total_heads, decode_tp, "decode")
    feeding = sources(prefill_tp, decode_tp, decode_rank)
    if prefill_rank not in feeding:
        return None
    wanted = held_heads(total_heads, decode_tp, decode_rank)
    held = held_heads(total_heads, prefill_tp, prefill_rank)
    first, last = max(wanted.start, held.start), min(wanted.stop, held.stop)
    if first >= last:
        return None
    # A head several sources hold is sent by the first of them only.
    earlier = [held_heads(total_heads, prefill_tp, p) for p in feeding if p < prefill_rank]
    if any(h.start <= first < h.stop for h in earlier):
        return None
    return HeadSlice(first - held.start, first - wanted.start, last - first)


def latent_source(prefill_tp: int, decode_tp: int, decode_rank: int) -> int:
    """MLA: the one prefill rank that sends decode rank ``decode_rank`` the replicated latent."""
    return sources(prefill_tp, decode_tp, decode_rank)[0]


@dataclass(frozen=True)
class PairShape:
    """What a sending rank moves into one receiving rank's announced pages.

    ``kind``: ``"all"`` (whole pages: equal TP, or MLA's latent from its one source),
    ``"heads"`` (``slice`` of every token's heads, :func:`kvtransport.spi.plan.plan_heads`),
    ``"regroup"`` (the two sides are pools of different serving engines: ``regroup`` is one
    page's runs, :mod:`kvtransport.spi.page_geometry`, of ``slice``'s heads), or ``"none"``
    (this sender owes that receiver no KV bytes; it still completes the transfer).
    ``primary``: this sender is the receiver's first source, the one that sends the aux slot and
    state items (the others send KV only).
    """

    kind: str
    primary: bool = True
    slice: HeadSlice | None = None
    #: The sender is one of the receiver's sources at all (a rank that is not must not be
    #: announced to: it would complete with nothing).
    source: bool = True
    page_tokens: int = 0
    src_heads: int = 0
    dst_heads: int = 0
    head_bytes: int = 0
    regroup: Regroup | None = field(default=None, compare=False, repr=False)

    def kv_bytes_per_page(self, item_lens: tuple[int, ...]) -> int:
        """Bytes this pair writes into one announced page, over every KV region (the
        receiver's ``item_lens``)."""
        if self.kind == "all":
            return sum(item_lens)
        if self.regroup is not None:
            return self.regroup.bytes_per_page
        if self.kind == "none" or self.slice is None:
            return 0
        return len(item_lens) * self.page_tokens * self.slice.count * self.head_bytes


EQUAL = PairShape("all")


def total_heads_of(a: ShardedLayout, b: ShardedLayout) -> int:
    """The model's KV heads as either side states them (0: neither does)."""
    return a.total_kv_heads or b.total_kv_heads


def unequal_tp_problems(
    a: ShardedLayout, b: ShardedLayout, mine: str = "here", theirs: str = "at the peer"
) -> list[str]:
    """Why two layouts of different TP sizes cannot exchange pages (empty: they can)."""
    problems = []
    for layout, where in ((a, mine), (b, theirs)):
        if not (0 < layout.tp_size <= 1 << 16 and 0 <= layout.tp_rank < layout.tp_size):
            problems.append(f"tp_rank {layout.tp_rank} of tp_size {layout.tp_size} {where}")
        if not 0 <= layout.total_kv_heads <= 1 << 16 or layout.page_size <= 0:
            problems.append(f"total_kv_heads {layout.total_kv_heads}, page_size {layout.page_size} {where}")
    if problems:
        return problems
    if a.tp_size % b.tp_size and b.tp_size % a.tp_size:
        problems.append(f"tp_size: {a.tp_size} {mine}, {b.tp_size} {theirs}: one must divide the other")
        return problems
    if a.state_types or b.state_types:
        # Each rank's SWA window pages and Mamba state hold its own heads' share: moving them
        # between TP sizes needs their slicing too, which kvtransport does not do yet.
        types = sorted(set(a.state_types) | set(b.state_types))
        problems.append(
            f"tp_size: {a.tp_size} {mine}, {b.tp_size} {theirs}, with state buffers ({', '.join(types)}): "
            "kvtransport moves state between equal TP sizes only"
        )
        return problems
    if a.kv_split == "mla":
        return problems  # one replicated latent: equal pages (kv_item_lens, compared already)
    total = total_heads_of(a, b)
    if a.total_kv_heads and b.total_kv_heads and a.total_kv_heads != b.total_kv_heads:
        problems.append(f"total_kv_heads: {a.total_kv_heads} {mine}, {b.total_kv_heads} {theirs}")
        return problems
    if not total:
        problems.append(
            f"tp_size: {a.tp_size} {mine}, {b.tp_size} {theirs}, and neither side states the model's total KV "
            "heads (KVLayout.total_kv_heads), which unequal TP shards by"
        )
        return problems
    try:
        check_shape(total, a.tp_size, mine)
        check_shape(total, b.tp_size, theirs)
    except MemoryLayoutError as exc:
        return [str(exc)]
    head_bytes = _head_bytes(a, total)
    if len(a.kv_item_lens) != len(b.kv_item_lens):
        problems.append(f"KV regions: {len(a.kv_item_lens)} {mine}, {len(b.kv_item_lens)} {theirs}")
    for layout, where in ((a, mine), (b, theirs)):
        heads = len(held_heads(total, layout.tp_size, layout.tp_rank))
        if layout.num_kv_heads and layout.num_kv_heads != heads:
            problems.append(
                f"num_kv_heads {where}: {layout.num_kv_heads}, but TP rank {layout.tp_rank} of {layout.tp_size} "
                f"holds {heads} of {total}"
            )
        want = layout.page_size * heads * head_bytes
        if head_bytes <= 0 or any(n != want for n in layout.kv_item_lens):
            problems.append(
                f"kv_item_lens {where}: pages of {sorted(set(layout.kv_item_lens))[:3]} bytes, not {layout.page_size} "
                f"tokens x {heads} heads x {head_bytes} bytes (TP rank {layout.tp_rank} of {layout.tp_size})"
            )
    return problems


def _head_bytes(layout: ShardedLayout, total: int) -> int:
    heads = len(held_heads(total, layout.tp_size, layout.tp_rank))
    item = layout.kv_item_lens[0] if layout.kv_item_lens else 0
    return item // (layout.page_size * heads) if layout.page_size > 0 and heads else 0


def pair_shape(src: ShardedLayout, dst: ShardedLayout) -> PairShape:
    """What the rank of layout ``src`` moves into the pages the rank of layout ``dst``
    announces (the two already found compatible)."""
    if different_engines(src, dst):
        return _regrouped(src, dst)
    if src.tp_size == dst.tp_size:
        return EQUAL
    feeding = sources(src.tp_size, dst.tp_size, dst.tp_rank)
    primary, source = src.tp_rank == feeding[0], src.tp_rank in feeding
    if src.kv_split == "mla":
        return PairShape("all" if primary else "none", primary, source=source)
    total = total_heads_of(src, dst)
    cut = head_slice(total, src.tp_size, src.tp_rank, dst.tp_size, dst.tp_rank)
    return PairShape(
        "none" if cut is None else "heads",
        primary,
        cut,
        page_tokens=src.page_size,
        src_heads=len(held_heads(total, src.tp_size, src.tp_rank)),
        dst_heads=len(held_heads(total, dst.tp_size, dst.tp_rank)),
        head_bytes=_head_bytes(src, total),
        source=source,
    )


def _regrouped(src: ShardedLayout, dst: ShardedLayout) -> PairShape:
    """:func:`pair_shape` between pools of different engines: the heads this rank owes the
    receiver (all of them under equal TP; MLA's latent from the first source only), each
    token's moved by the regroup table of the two geometries."""
    feeding = sources(src.tp_size, dst.tp_size, dst.tp_rank)
    primary, source = src.tp_rank == feeding[0], src.tp_rank in feeding
    cut: HeadSlice | None
    if src.kv_split == "mla":
        cut = HeadSlice(0, 0, 1) if primary else None
    else:
        cut = head_slice(total_heads_of(src, dst), src.tp_size, src.tp_rank, dst.tp_size, dst.tp_rank)
    if cut is None:
        return PairShape("none", primary, source=source)
    table = regroup(geometry_of(src), geometry_of(dst), cut.src_head, cut.dst_head, cut.count)
    return PairShape("regroup", primary, cut, source=source, regroup=table)
