"""Where each head's K and V (or MLA's latent) of each token lies in one page of a serving
engine's KV pool, and the table of byte runs that moves one engine's page into another's: what
lets an SGLang prefill feed a vLLM decode.

The two engines keep the same numbers in different places. SGLang (``engine`` ``sglang``) has
a K buffer and a V buffer per layer, regions ``K_0..K_{L-1}, V_0..V_{L-1}``, a page
``[tokens, heads, dim]`` of each. vLLM 0.33 (``engine`` ``vllm``,
:mod:`kvtransport.integrations.vllm.layout`) has one buffer per layer (``packing`` ``layer``) or
one for all layers (``block``), a head's K and V side by side in each token's content (``C`` =
``2 * dim``; vLLM's attention backends split it as ``content[:dim]``, ``content[dim:]``), the
tokens of a block before its heads (``token_layout`` ``NHD``) or after them (``HND``, in kernel
blocks of ``n`` tokens). :func:`geometry_of` reads a :class:`PageGeometry` from a layout: for
every (layer, K/V, token of the page, local head), the region and the byte offset in that
region's page of ``unit`` bytes (one head's K, or V, or latent). :func:`regroup` pairs two
geometries into a :class:`Regroup` table (one page's runs, adjacent ones merged), computed once a
connection; :func:`plan_regroup` turns it and a chunk's page indices into runs.

Nothing here imports an engine or another ``spi`` module that would import this one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvtransport.spi.errors import InvalidPages, MemoryLayoutError

__all__ = [
    "DTYPE_BYTES",
    "PageGeometry",
    "Regroup",
    "different_engines",
    "engine_of",
    "geometry_of",
    "page_tokens",
    "plan_regroup",
    "regroup",
]

I64 = npt.NDArray[np.int64]

#: The most (layer, part, token, head) entries one page's geometry may have: a peer's layout
#: arrives at handshake, and a page of a real model has thousands (Llama-3-70B: 80 layers x
#: K/V x 16 tokens x 8 heads = 20,480), so a layout far beyond this is refused before any array
#: is built for it.
MAX_PAGE_ENTRIES = 1 << 21

#: Bytes of one element of the KV dtypes both engines name alike (torch's names).
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


class EngineLayout(Protocol):
    """The fields of a KV layout (``spi.memory.KVLayout``) a page's geometry is read from."""

    @property
    def page_size(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def kv_item_lens(self) -> tuple[int, ...]: ...
    @property
    def kv_split(self) -> str: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def extra(self) -> Mapping[str, Any]: ...


def engine_of(layout: EngineLayout) -> str:
    """The serving engine whose pool ``layout`` describes ('' when it names none: kvtransport's
    own endpoints, whose pages pair with any engine's of the same sizes)."""
    return str(layout.extra.get("engine") or "")


def different_engines(a: EngineLayout, b: EngineLayout) -> bool:
    """Both layouts name their engine, and the engines differ (their pages need regrouping)."""
    return bool(engine_of(a) and engine_of(b) and engine_of(a) != engine_of(b))


@dataclass(frozen=True)
class PageGeometry:
    """One page of a pool: ``tokens`` tokens of ``heads`` local KV heads, each head's K and V
    (``parts`` 2) or latent (``parts`` 1) ``unit`` bytes. ``region[l, p]`` is the KV region
    holding layer ``l``'s part ``p``; ``offset[l, p, t, h]`` the byte offset of token ``t``'s
    head ``h`` in that region's page."""

    tokens: int
    heads: int
    unit: int
    region: I64
    offset: I64

    @property
    def layers(self) -> int:
        return int(self.region.shape[0])

    @property
    def parts(self) -> int:
        return int(self.region.shape[1])


def _grid(layers: int, parts: int, tokens: int, heads: int) -> tuple[I64, I64, I64, I64]:
    """Index arrays over [layers, parts, tokens, heads], broadcastable."""
    return (
        np.arange(layers, dtype=np.int64)[:, None, None, None],
        np.arange(parts, dtype=np.int64)[None, :, None, None],
        np.arange(tokens, dtype=np.int64)[None, None, :, None],
        np.arange(heads, dtype=np.int64)[None, None, None, :],
    )


def geometry_of(layout: EngineLayout) -> PageGeometry:
    """The page geometry of ``layout``, or :class:`MemoryLayoutError` saying what it lacks."""
    parts = {"kv": 2, "mla": 1}.get(layout.kv_split)
    if parts is None:
        raise MemoryLayoutError(f"kv_split {layout.kv_split!r}: neither separate K and V ('kv') nor MLA's latent")
    layers, heads = int(layout.num_layers), int(layout.num_kv_heads) or (1 if parts == 1 else 0)
    items = tuple(int(n) for n in layout.kv_item_lens)
    if layers <= 0 or heads <= 0 or not items or len(set(items)) != 1:
        raise MemoryLayoutError(
            f"a page's geometry needs the layers ({layers}), the KV heads a rank holds ({layout.num_kv_heads}) and "
            f"KV pages of one size (got {sorted(set(items))[:4]})"
        )
    tokens = page_tokens(layout)
    if not 0 < layers * parts * tokens * heads <= MAX_PAGE_ENTRIES:
        raise MemoryLayoutError(
            f"a page of {layers} layers x {parts} parts x {tokens} tokens x {heads} heads: more than "
            f"{MAX_PAGE_ENTRIES} pieces (or none), which no model kvtransport maps has"
        )
    engine = engine_of(layout) or "sglang"  # an unnamed pool: SGLang's shape, kvtransport's own
    if engine == "sglang":
        return _sglang(layout, layers, parts, heads, items)
    if engine == "vllm":
        return _vllm(layout, layers, parts, heads, items)
    raise MemoryLayoutError(f"no page geometry is known for engine {engine!r}")


def page_tokens(layout: EngineLayout) -> int:
    """Tokens one page of ``layout`` holds (vLLM: its ``block_size``; SGLang: ``page_size``),
    read without building the geometry (0 when the layout does not say)."""
    if engine_of(layout) == "vllm":
        tokens = layout.extra.get("block_size")
        return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else 0
    return max(int(layout.page_size), 0)


def _sglang(layout: EngineLayout, layers: int, parts: int, heads: int, items: tuple[int, ...]) -> PageGeometry:
    tokens = int(layout.page_size)
    if len(items) != layers * parts or tokens <= 0:
        raise MemoryLayoutError(
            f"an SGLang pool of {layers} layers has {layers * parts} KV buffers of pages of tokens, got "
            f"{len(items)} and page_size {tokens}"
        )
    unit, rest = divmod(items[0], tokens * heads)
    if rest or unit <= 0:
        raise MemoryLayoutError(f"SGLang pages of {items[0]} bytes are not {tokens} tokens x {heads} heads")
    layer, p, t, h = _grid(layers, parts, tokens, heads)
    region = (p * layers + layer)[:, :, 0, 0]
    offset = np.broadcast_to((t * heads + h) * unit, (layers, parts, tokens, heads)).copy()
    return PageGeometry(tokens, heads, unit, region, offset)


def _vllm(layout: EngineLayout, layers: int, parts: int, heads: int, items: tuple[int, ...]) -> PageGeometry:
    extra = layout.extra
    tokens = extra.get("block_size")
    order, packing = extra.get("token_layout"), extra.get("packing")
    element = DTYPE_BYTES.get(str(layout.dtype))
    if not isinstance(tokens, int) or tokens <= 0 or order not in ("NHD", "HND") or packing not in ("layer", "block"):
        raise MemoryLayoutError(
            f"a vLLM layout states block_size, token_layout (NHD/HND) and packing (layer/block); got {dict(extra)}"
        )
    if element is None:
        raise MemoryLayoutError(f"vLLM KV of dtype {layout.dtype!r}: its element size is not known here")
    regions = layers if packing == "layer" else 1
    layer_page = items[0] if packing == "layer" else items[0] // layers
    content, rest = divmod(layer_page, tokens * heads * element)
    if len(items) != regions or rest or content <= 0 or content % parts or layer_page * (layers // regions) != items[0]:
        raise MemoryLayoutError(
            f"vLLM pages of {items[0]} bytes in {len(items)} region(s) are not {layers} layer(s) x {tokens} tokens x "
            f"{heads} heads x whole {parts}-part contents of {element}-byte elements"
        )
    row = content * element  # one head's content: its K then its V, or its latent
    unit = row // parts
    layer, p, t, h = _grid(layers, parts, tokens, heads)
    if order == "NHD":
        within = (t * heads + h) * row
    else:
        # HND: kernel blocks of n tokens, each [heads, n, content]; a page is tokens // n of them.
        rows = int(layout.page_size) // (layers if packing == "block" else 1)
        if rows <= 0 or tokens % rows:
            raise MemoryLayoutError(f"vLLM HND pages of {layout.page_size} rows do not split {tokens} tokens evenly")
        n = tokens // rows
        within = (t // n) * (heads * n * row) + h * (n * row) + (t % n) * row
    offset = within + p * unit + (0 if packing == "layer" else layer * layer_page)
    region = np.broadcast_to(layer[:, :, 0, 0] if packing == "layer" else np.zeros((1, 1), np.int64), (layers, parts))
    return PageGeometry(
        tokens,
        heads,
        unit,
        np.ascontiguousarray(region),
        np.broadcast_to(offset, (layers, parts, tokens, heads)).copy(),
    )


@dataclass(frozen=True)
class Regroup:
    """One page's runs from a source geometry to a destination one: run ``i`` moves
    ``length[i]`` bytes at ``src_offset[i]`` of the source page in region ``src_region[i]`` to
    ``dst_offset[i]`` of the destination page in region ``dst_region[i]``."""

    src_region: I64
    src_offset: I64
    dst_region: I64
    dst_offset: I64
    length: I64

    @property
    def bytes_per_page(self) -> int:
        return int(self.length.sum())

    def __len__(self) -> int:
        return int(self.length.size)


def regroup(src: PageGeometry, dst: PageGeometry, src_head: int, dst_head: int, count: int) -> Regroup:
    """The runs moving ``count`` heads of every token, layer and part of a ``src`` page (its
    local heads from ``src_head``) into a ``dst`` page (from ``dst_head``); runs adjacent on
    both sides merge. :class:`MemoryLayoutError` when the pages do not hold the same tokens,
    layers, parts and head size."""
    same = (src.layers, src.parts, src.tokens, src.unit) == (dst.layers, dst.parts, dst.tokens, dst.unit)
    if not same:
        raise MemoryLayoutError(
            f"pages of {src.layers} layers x {src.parts} parts x {src.tokens} tokens x heads of {src.unit} bytes "
            f"cannot be regrouped into pages of {dst.layers} x {dst.parts} x {dst.tokens} x {dst.unit}"
        )
    if count <= 0 or src_head < 0 or dst_head < 0 or src_head + count > src.heads or dst_head + count > dst.heads:
        raise MemoryLayoutError(
            f"heads [{src_head}, +{count}) of {src.heads} and [{dst_head}, +{count}) of {dst.heads}: outside a token"
        )
    shape = (src.layers, src.parts, src.tokens, count)
    src_region = np.broadcast_to(src.region[:, :, None, None], shape).ravel()
    dst_region = np.broadcast_to(dst.region[:, :, None, None], shape).ravel()
    src_offset = src.offset[:, :, :, src_head : src_head + count].ravel()
    dst_offset = dst.offset[:, :, :, dst_head : dst_head + count].ravel()
    order = np.lexsort((src_offset, dst_region, src_region))
    sr, so, dr, do = src_region[order], src_offset[order], dst_region[order], dst_offset[order]
    unit = np.int64(src.unit)
    # A run starts wherever it does not continue the one before on both sides.
    starts = np.ones(sr.size, dtype=bool)
    starts[1:] = (sr[1:] != sr[:-1]) | (dr[1:] != dr[:-1]) | (so[1:] != so[:-1] + unit) | (do[1:] != do[:-1] + unit)
    first = np.flatnonzero(starts)
    length = np.diff(np.append(first, sr.size)).astype(np.int64) * unit
    return Regroup(sr[first], so[first], dr[first], do[first], length)


def plan_regroup(
    src_regions: Sequence[Any],
    dst_regions: Sequence[Any],
    src_pages: I64,
    dst_pages: I64,
    table: Regroup,
    only_src: Sequence[int] | None = None,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """(src addresses, dst addresses, lengths) moving page ``src_pages[k]`` into page
    ``dst_pages[k]`` by ``table`` (with ``only_src``, its runs out of those source regions
    only). The pages must be checked already; every run is checked to lie inside its pages."""
    if src_pages.shape != dst_pages.shape:
        raise InvalidPages(f"{src_pages.size} source pages but {dst_pages.size} destination pages")
    keep = slice(None) if only_src is None else np.isin(table.src_region, np.asarray(only_src, dtype=np.int64))
    sr, so, dr, do, n = (
        a[keep] for a in (table.src_region, table.src_offset, table.dst_region, table.dst_offset, table.length)
    )
    for side, regions, which, offset in (("source", src_regions, sr, so), ("destination", dst_regions, dr, do)):
        if which.size and (int(which.max()) >= len(regions) or int(which.min()) < 0):
            raise InvalidPages(f"the regroup table names {side} region {int(which.max())} of {len(regions)}")
        items = np.array([int(r.item_len) for r in regions], dtype=np.int64)
        if which.size and bool(((offset < 0) | ((offset + n) > items[which])).any()):
            raise InvalidPages(f"the regroup table runs past a {side} page")
    if not src_pages.size or not sr.size:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty, empty
    s_ptr = np.array([int(r.ptr) for r in src_regions], dtype=np.uint64)[sr] + so.astype(np.uint64)
    s_item = np.array([int(r.item_len) for r in src_regions], dtype=np.uint64)[sr]
    d_ptr = np.array([int(r.ptr) for r in dst_regions], dtype=np.uint64)[dr] + do.astype(np.uint64)
    d_item = np.array([int(r.item_len) for r in dst_regions], dtype=np.uint64)[dr]
    src = s_ptr[None, :] + src_pages.astype(np.uint64)[:, None] * s_item[None, :]
    dst = d_ptr[None, :] + dst_pages.astype(np.uint64)[:, None] * d_item[None, :]
    length = np.broadcast_to(n.astype(np.uint64)[None, :], src.shape)
    return src.ravel(), dst.ravel(), np.ascontiguousarray(length).ravel()
