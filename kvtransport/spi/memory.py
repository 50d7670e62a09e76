"""Where KV cache lives: memory kinds, registered regions, and the KV layout peers compare.

A :class:`Region` is one contiguous, registrable range (a K or V buffer of one layer, an aux
metadata array, a state buffer) cut into equal items: one item is one page of that buffer. A
:class:`RegionSet` groups the regions an endpoint registers and rejects what cannot be right
(overlaps, empty regions, items that do not divide a region). A :class:`KVLayout` is what the
handshake compares between peers.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtransport.spi.cross_engine import cross_engine_problems
from kvtransport.spi.errors import MemoryLayoutError
from kvtransport.spi.page_geometry import different_engines, engine_of
from kvtransport.spi.tp_map import unequal_tp_problems

_CUDA_KIND = re.compile(r"^cuda:(\d{1,4})$")


@dataclass(frozen=True, order=True)
class MemoryKind:
    """``host`` memory, or device memory of CUDA device ``device`` (``cuda:N``)."""

    device: int | None = None

    @property
    def is_host(self) -> bool:
        return self.device is None

    @property
    def is_cuda(self) -> bool:
        return self.device is not None

    @property
    def family(self) -> str:
        """``host`` or ``cuda``: what drivers declare they can read and write."""
        return "host" if self.device is None else "cuda"

    def __str__(self) -> str:
        return "host" if self.device is None else f"cuda:{self.device}"

    @classmethod
    def parse(cls, text: str) -> MemoryKind:
        if text in ("host", "cpu"):
            return HOST
        match = _CUDA_KIND.match(text)
        if match:
            return cls(int(match.group(1)))
        raise MemoryLayoutError(f"unknown memory kind {text!r}: expected 'host' or 'cuda:N'")


HOST = MemoryKind(None)

#: No region may end past this address: every address and length the core handles then fits in
#: int64, and sums of two of them cannot wrap around in uint64.
MAX_ADDRESS = 1 << 63


def cuda(device: int) -> MemoryKind:
    return MemoryKind(device)


@dataclass(frozen=True)
class Region:
    """One contiguous registered range, made of ``length // item_len`` equal items (pages)."""

    ptr: int
    length: int
    kind: MemoryKind
    item_len: int
    name: str = ""

    def __post_init__(self) -> None:
        label = self.name or f"region@{self.ptr:#x}"
        if self.ptr <= 0:
            raise MemoryLayoutError(f"{label}: pointer must be positive, got {self.ptr}")
        if self.length <= 0:
            raise MemoryLayoutError(f"{label}: zero or negative length {self.length}")
        if self.item_len <= 0:
            raise MemoryLayoutError(f"{label}: item length must be positive, got {self.item_len}")
        if self.ptr + self.length > MAX_ADDRESS:
            raise MemoryLayoutError(f"{label}: ends past 2**63 (pointer {self.ptr:#x}, length {self.length})")
        if self.length % self.item_len:
            raise MemoryLayoutError(
                f"{label}: item length {self.item_len} does not divide region length "
                f"{self.length} (remainder {self.length % self.item_len})"
            )

    @property
    def end(self) -> int:
        return self.ptr + self.length

    @property
    def num_items(self) -> int:
        return self.length // self.item_len


def _check_disjoint(regions: Sequence[Region]) -> None:
    # Host memory sorts before device memory (-1 before device ordinals): KV on a GPU with aux
    # slots in host memory, as SGLang lays them out, is the common case.
    by_start = sorted(regions, key=lambda r: (-1 if r.kind.device is None else r.kind.device, r.ptr))
    for before, after in itertools.pairwise(by_start):
        if before.kind == after.kind and after.ptr < before.end:
            raise MemoryLayoutError(
                f"regions overlap: {before.name or hex(before.ptr)} "
                f"[{before.ptr:#x}, {before.end:#x}) and {after.name or hex(after.ptr)} "
                f"[{after.ptr:#x}, {after.end:#x})"
            )


#: Most state groups one endpoint may register (SGLang's richest pools have a handful).
MAX_STATE_GROUPS = 64


@dataclass(frozen=True)
class RegionSet:
    """The regions one endpoint registers: KV buffers, then aux and state buffers.

    Page ``p`` of KV buffer ``i`` lives at ``kv[i].ptr + p * kv[i].item_len``. All KV buffers
    hold the same number of pages (one page index addresses the same tokens in every layer).

    State buffers come in *groups* (``state_groups`` gives how many consecutive ``state``
    regions each group has): the buffers one index space addresses, such as the sliding-window
    sub-pool of a hybrid SWA model (one index = one window page of every SWA layer) or the
    Mamba pool (one index = one request's slot in every state tensor). Item ``i`` of every
    region of a group belongs together, as page ``p`` of every KV region does. Without
    ``state_groups``, all state regions form one group.
    """

    kv: tuple[Region, ...]
    aux: tuple[Region, ...] = ()
    state: tuple[Region, ...] = ()
    state_groups: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.kv:
            raise MemoryLayoutError("at least one KV region is required")
        if not self.state_groups and self.state:
            object.__setattr__(self, "state_groups", (len(self.state),))
        if len(self.state_groups) > MAX_STATE_GROUPS:
            raise MemoryLayoutError(f"{len(self.state_groups)} state groups; at most {MAX_STATE_GROUPS}")
        if any(n <= 0 for n in self.state_groups) or sum(self.state_groups) != len(self.state):
            raise MemoryLayoutError(
                f"state groups of {list(self.state_groups)} regions do not divide the {len(self.state)} state "
                "regions (every group has at least one region, and together they hold all of them)"
            )
        pages = {r.num_items for r in self.kv}
        if len(pages) != 1:
            raise MemoryLayoutError(
                f"KV regions hold different page counts {sorted(pages)}; every KV buffer must "
                "hold the same number of pages"
            )
        kinds = {r.kind for r in self.kv}
        if len(kinds) != 1:
            raise MemoryLayoutError(
                f"KV regions live in several memory kinds {sorted(map(str, kinds))}; one endpoint serves one device"
            )
        _check_disjoint(self.all())

    def all(self) -> tuple[Region, ...]:
        return self.kv + self.aux + self.state

    def state_group(self, group: int) -> tuple[Region, ...]:
        """The regions of state group ``group``, in registration order."""
        start = sum(self.state_groups[:group])
        return self.state[start : start + self.state_groups[group]]

    def state_slots(self, group: int) -> int:
        """How many items (pages, slots) every region of state group ``group`` can address."""
        return min(r.num_items for r in self.state_group(group))

    @property
    def state_item_lens(self) -> tuple[tuple[int, ...], ...]:
        """Bytes of one item of each state region, group by group."""
        return tuple(tuple(r.item_len for r in self.state_group(g)) for g in range(len(self.state_groups)))

    @property
    def kv_kind(self) -> MemoryKind:
        return self.kv[0].kind

    @property
    def num_pages(self) -> int:
        return self.kv[0].num_items

    @property
    def kv_item_lens(self) -> tuple[int, ...]:
        return tuple(r.item_len for r in self.kv)

    @classmethod
    def from_kv_args(
        cls,
        kv_data_ptrs: Sequence[int],
        kv_data_lens: Sequence[int],
        kv_item_lens: Sequence[int],
        *,
        kind: MemoryKind = HOST,
        aux_data_ptrs: Sequence[int] = (),
        aux_data_lens: Sequence[int] = (),
        aux_item_lens: Sequence[int] = (),
        state_data_ptrs: Sequence[int] = (),
        state_data_lens: Sequence[int] = (),
        state_item_lens: Sequence[int] = (),
        aux_kind: MemoryKind = HOST,
        state_kind: MemoryKind | None = None,
        state_groups: Sequence[int] = (),
    ) -> RegionSet:
        """Regions from lists shaped like SGLang's ``KVArgs`` (one item = one page); the state
        lists flattened, ``state_groups`` giving each group's count of buffers."""
        return cls(
            kv=_regions("kv", kv_data_ptrs, kv_data_lens, kv_item_lens, kind),
            aux=_regions("aux", aux_data_ptrs, aux_data_lens, aux_item_lens, aux_kind),
            state=_regions("state", state_data_ptrs, state_data_lens, state_item_lens, state_kind or kind),
            state_groups=tuple(int(n) for n in state_groups),
        )

    @classmethod
    def from_tensors(
        cls,
        kv: Iterable[Any],
        *,
        aux: Iterable[Any] = (),
        state: Iterable[Iterable[Any]] = (),
    ) -> RegionSet:
        """Regions from torch tensors whose first dimension is the page (or slot) index;
        ``state`` is a list of groups, each a list of tensors."""
        groups = [list(g) for g in state]
        flat = [t for g in groups for t in g]
        return cls(
            kv=tuple(_tensor_region(f"kv[{i}]", t) for i, t in enumerate(kv)),
            aux=tuple(_tensor_region(f"aux[{i}]", t) for i, t in enumerate(aux)),
            state=tuple(_tensor_region(f"state[{i}]", t) for i, t in enumerate(flat)),
            state_groups=tuple(len(g) for g in groups),
        )


def _regions(
    prefix: str,
    ptrs: Sequence[int],
    lens: Sequence[int],
    item_lens: Sequence[int],
    kind: MemoryKind,
) -> tuple[Region, ...]:
    if not len(ptrs) == len(lens) == len(item_lens):
        raise MemoryLayoutError(
            f"{prefix}: {len(ptrs)} pointers, {len(lens)} lengths and {len(item_lens)} item "
            "lengths; the three lists must have the same length"
        )
    return tuple(
        Region(int(p), int(n), kind, int(i), f"{prefix}[{k}]")
        for k, (p, n, i) in enumerate(zip(ptrs, lens, item_lens, strict=True))
    )


def _tensor_region(name: str, tensor: Any) -> Region:
    if not tensor.is_contiguous():
        raise MemoryLayoutError(f"{name}: tensor must be contiguous")
    if tensor.dim() < 1 or tensor.shape[0] == 0:
        raise MemoryLayoutError(f"{name}: tensor needs a non-empty page dimension")
    length = tensor.numel() * tensor.element_size()
    device = tensor.device
    kind = HOST if device.type == "cpu" else MemoryKind(int(device.index or 0))
    if device.type not in ("cpu", "cuda"):
        raise MemoryLayoutError(f"{name}: unsupported device {device}")
    return Region(int(tensor.data_ptr()), length, kind, length // int(tensor.shape[0]), name)


@dataclass(frozen=True)
class KVLayout:
    """What the handshake compares: the shape of one endpoint's KV pool.

    ``kv_item_lens`` is the byte size of one page in each KV region, in region order. Two
    layouts can exchange pages when everything but ``tp_rank`` and ``memory`` is equal
    (``num_kv_heads`` and ``head_dim`` of 0 mean "not stated" and match anything).
    """

    page_size: int
    dtype: str
    num_layers: int
    kv_item_lens: tuple[int, ...]
    memory: MemoryKind = HOST
    kv_split: str = "kv"  # "kv": separate K and V buffers; "mla": one latent buffer
    num_kv_heads: int = 0
    head_dim: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    #: The model's KV heads over all TP ranks (0: not stated): what unequal TP shards by.
    total_kv_heads: int = 0
    aux_item_lens: tuple[int, ...] = ()
    #: Per state group: what it holds (the application's name, e.g. SGLang's ``swa``,
    #: ``mamba``) and the bytes of one item of each of its buffers.
    state_types: tuple[str, ...] = ()
    state_item_lens: tuple[tuple[int, ...], ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    def incompatibilities(self, other: KVLayout, mine: str = "here", theirs: str = "at the peer") -> list[str]:
        """Every field that stops pages moving between the two layouts (empty: compatible)."""
        if different_engines(self, other):
            # Pools of two serving engines: their pages hold the same numbers in other places
            # (spi.page_geometry), and only one direction is served (spi.cross_engine).
            return cross_engine_problems(self, other, mine, theirs)
        problems = []
        # Unequal TP shards MHA heads differently on the two sides: per-rank page sizes and
        # head counts differ, and tp_map decides what each pair of ranks moves.
        sliced = self.tp_size != other.tp_size and self.kv_split == other.kv_split == "kv"
        # vLLM instances move no aux slot between them: their aux region is the handoff arena
        # for SGLang decodes (spi.handoff, new in 0.7.0), which an older peer does not have.
        both_vllm = engine_of(self) == engine_of(other) == "vllm"
        for name in (
            "page_size",
            "dtype",
            "num_layers",
            "kv_split",
            "num_kv_heads",
            "head_dim",
            "kv_item_lens",
            "aux_item_lens",
            "state_types",
            "state_item_lens",
        ):
            a, b = getattr(self, name), getattr(other, name)
            if name in ("num_kv_heads", "head_dim") and 0 in (a, b):
                # 0 is "not stated" (SGLang's decode side never sets kv_head_num): equal page
                # sizes (kv_item_lens, checked too) already mean the bytes line up.
                continue
            if sliced and name in ("num_kv_heads", "kv_item_lens"):
                continue
            if both_vllm and name == "aux_item_lens":
                continue
            if a != b:
                problems.append(f"{name}: {a!r} {mine}, {b!r} {theirs}")
        if self.tp_size != other.tp_size:
            problems += unequal_tp_problems(self, other, mine, theirs)
        return problems

    @classmethod
    def llama3_8b(cls, memory: MemoryKind = HOST) -> KVLayout:
        """Llama-3-8B: 32 layers x (K, V), 8 KV heads x 128, bf16, 16-token pages (32 KiB)."""
        item = 16 * 8 * 128 * 2
        return cls(
            page_size=16,
            dtype="bfloat16",
            num_layers=32,
            kv_item_lens=(item,) * 64,
            memory=memory,
            num_kv_heads=8,
            head_dim=128,
        )
