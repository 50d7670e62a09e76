"""A small KV pool with random contents and per-page digests, so two processes can check that
every byte arrived where it should. KV in host memory (shared in ``/dev/shm`` for the fake
driver, or private), or in device memory on a CUDA host (``device=N``, through the CUDA driver
API); aux slots always in host memory, as SGLang keeps them. Optional state groups (``state``:
per group its item count, item size and number of buffers, like an SWA window pool or a Mamba
slot pool) live beside the KV, in the same memory."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtransport.spi.handoff import HANDOFF_ROWS, HANDOFF_SLOT_BYTES
from kvtransport.spi.memory import KVLayout, MemoryKind, RegionSet
from kvtransport.tools import shm

#: Tokens per page of every pool here (the layout's ``page_size``).
PAGE_TOKENS = 16


class DeviceBuffer:
    """``size`` bytes of device memory, read and written through host copies."""

    def __init__(self, cuda: Any, size: int) -> None:
        self.cuda = cuda
        self.size = size
        self.ptr = cuda.alloc(size)

    def read(self, offset: int, n: int) -> bytes:
        out = np.empty(n, dtype=np.uint8)
        self.cuda.memcpy(int(out.ctypes.data), self.ptr + offset, n)
        return out.tobytes()

    def write(self, offset: int, data: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        self.cuda.memcpy(self.ptr + offset, int(data.ctypes.data), data.nbytes)

    def close(self) -> None:
        if self.ptr:
            self.cuda.free(self.ptr)
            self.ptr = 0


#: Aux slots of an engine-shaped pool (the bench announces none: the handshake needs the rows).
ENGINE_AUX_SLOTS = 8


def _engine_aux(engine: str, role: str) -> tuple[int, ...] | None:
    """The aux regions' item lengths of a pool shaped as ``engine``'s in ``role``: a vLLM
    worker's handoff arena (one region of slots), an SGLang decode's handoff rows (one region a
    row, 64 bytes as in SGLang 0.5.23), none for an SGLang prefill; ``None``: not an engine's."""
    if engine == "vllm":
        return (HANDOFF_SLOT_BYTES,)
    if engine == "sglang":
        return (64,) * len(HANDOFF_ROWS) if role == "decode" else ()
    return None


@dataclass
class KVPool:
    num_pages: int
    num_layers: int
    item_len: int
    aux_slots: int = 0
    aux_item_len: int = 64
    #: ``True``: buffers in ``/dev/shm`` (the fake driver maps the peer's); ``False``: private
    #: anonymous memory, enough for real engines.
    shared: bool = True
    #: CUDA device for the KV buffers (``None``: host memory).
    device: int | None = None
    #: State groups: ``(items, item_len, buffers)`` each.
    state: tuple[tuple[int, int, int], ...] = ()
    #: Unequal-TP tests: ``(total KV heads, TP size, TP rank)`` of this rank, and whether the
    #: buffers hold MLA's latent (one replicated row per token) instead of K and V heads.
    tp: tuple[int, int, int] | None = None
    mla: bool = False
    #: Tokens per page (the layout's ``page_size``; both sides must agree).
    page_tokens: int = PAGE_TOKENS
    #: The serving engine whose pool this one is shaped as (``bench --decode-engine`` /
    #: ``--prefill-engine``): '' (kvtransport's own: a buffer per region, none named),
    #: ``sglang`` (the same buffers, its layout naming SGLang and ``role``; a decode states aux
    #: rows for the first token's handoff, spi.handoff), or ``vllm`` (vLLM 0.33's LBNHC: one
    #: buffer per layer, a head's K and V side by side in each token, and the connector's
    #: handoff arena; ``num_layers`` still counts SGLang's K and V buffers, ``item_len``
    #: SGLang's page). The aux slots of an engine's pool are that engine's, not ``aux_slots``.
    engine: str = ""
    role: str = "prefill"
    _cuda: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        allocate = shm.allocate if self.shared else shm.allocate_private
        if self.engine not in ("", "sglang", "vllm") or (self.engine == "vllm" and (self.mla or self.num_layers % 2)):
            raise ValueError(f"a pool shaped as {self.engine!r} with {self.num_layers} buffers (MLA: {self.mla})")
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"a pool's role is prefill or decode, not {self.role!r}")
        vllm = self.engine == "vllm"
        #: This pool's buffers and their page size (vLLM: a K and a V page in one).
        self.region_count = self.num_layers // 2 if vllm else self.num_layers
        self.region_item = 2 * self.item_len if vllm else self.item_len
        size = self.num_pages * self.region_item
        if self.device is None:
            self.buffers: list[Any] = [allocate(size) for _ in range(self.region_count)]
        else:
            from kvtransport.staging.cuda_copy import CudaDriver

            self._cuda = CudaDriver(self.device)
            self.buffers = [DeviceBuffer(self._cuda, size) for _ in range(self.region_count)]
        aux_lens = _engine_aux(self.engine, self.role)
        if aux_lens is None:
            aux_lens = (self.aux_item_len,) if self.aux_slots else ()
        slots = ENGINE_AUX_SLOTS if self.engine else self.aux_slots
        self.aux = [allocate(slots * n) for n in aux_lens]
        self.state_buffers: list[list[Any]] = [
            [self._buffer(allocate, items * item_len) for _ in range(buffers)]
            for items, item_len, buffers in self.state
        ]
        flat = [b for group in self.state_buffers for b in group]
        kind = MemoryKind(self.device)
        self.regions = RegionSet.from_kv_args(
            [b.ptr for b in self.buffers],
            [b.size for b in self.buffers],
            [self.region_item] * self.region_count,
            kind=kind,
            aux_data_ptrs=[b.ptr for b in self.aux],
            aux_data_lens=[b.size for b in self.aux],
            aux_item_lens=list(aux_lens),
            state_data_ptrs=[b.ptr for b in flat],
            state_data_lens=[b.size for b in flat],
            state_item_lens=[item_len for _, item_len, buffers in self.state for _ in range(buffers)],
            state_groups=[buffers for _, _, buffers in self.state],
        )
        total, tp_size, tp_rank = self.tp if self.tp is not None else (0, 1, 0)
        heads = len(self._heads())
        if self.engine:
            extra: dict[str, Any] = {"engine": "sglang", "role": self.role}
            if self.role == "decode":
                extra |= {"aux_rows": {name: i for i, name in enumerate(HANDOFF_ROWS)}, "speculative": False}
            if vllm:
                extra = {"engine": "vllm", "block_size": self.page_tokens, "token_layout": "NHD", "packing": "layer"}
            head_bytes = self.item_len // (self.page_tokens * heads)
            self.layout = KVLayout(
                page_size=self.page_tokens,
                dtype="bfloat16",
                num_layers=self.num_layers // 2,
                kv_split="kv",
                num_kv_heads=heads,
                head_dim=head_bytes if vllm else 0,  # C: K and V, head_bytes / 2 bf16 elements each
                tp_size=tp_size,
                tp_rank=tp_rank,
                total_kv_heads=total or heads,
                kv_item_lens=(self.region_item,) * self.region_count,
                aux_item_lens=aux_lens,
                memory=kind,
                extra=extra,
            )
            return
        self.layout = KVLayout(
            page_size=self.page_tokens,
            dtype="bfloat16",
            num_layers=self.num_layers if self.mla else self.num_layers // 2 or 1,
            kv_split="mla" if self.mla else "kv",
            tp_size=tp_size,
            tp_rank=tp_rank,
            total_kv_heads=0 if self.mla else total,
            kv_item_lens=(self.item_len,) * self.num_layers,
            aux_item_lens=(self.aux_item_len,) * len(self.aux),
            memory=kind,
            state_types=tuple(f"group{g}" for g in range(len(self.state))),
            state_item_lens=self.regions.state_item_lens,
        )

    def _buffer(self, allocate: Any, size: int) -> Any:
        return allocate(size) if self.device is None else DeviceBuffer(self._cuda, size)

    def _all_buffers(self) -> list[Any]:
        return self.buffers + self.aux + [b for group in self.state_buffers for b in group]

    def fill(self, seed: int) -> None:
        """Random bytes everywhere (eight at a time: filling a GiB takes about 2 s)."""
        rng = np.random.default_rng(seed)
        for b in self._all_buffers():
            data = _random_bytes(rng, b.size)
            if isinstance(b, DeviceBuffer):
                b.write(0, data)
            else:
                b.array[:] = data

    def poison(self, pages: list[int]) -> None:
        """Overwrite ``pages`` in every layer, so bytes left from an earlier transfer can never
        pass for a fresh one."""
        idx = np.asarray(pages, dtype=np.int64)
        for b in self.buffers:
            if isinstance(b, DeviceBuffer):
                for p in idx.tolist():
                    self._cuda.memset(b.ptr + p * self.region_item, 0xA5, self.region_item)
            else:
                b.array.reshape(self.num_pages, self.region_item)[idx] = 0xA5

    def poison_state(self, group: int, items: list[int]) -> None:
        """Overwrite ``items`` of every buffer of state group ``group`` (host memory)."""
        item_len = self.state[group][1]
        idx = np.asarray(items, dtype=np.int64)
        for b in self.state_buffers[group]:
            b.array.reshape(-1, item_len)[idx] = 0x5A

    def page_digests(self, pages: list[int], regions: list[int] | None = None) -> list[int]:
        """crc32 of each page across every layer (order matters); ``regions``: across those
        KV regions only (a layer-wise send's groups)."""
        out = []
        buffers = self.buffers if regions is None else [self.buffers[i] for i in regions]
        for p in pages:
            crc = 0
            for b in buffers:
                start = p * self.region_item
                if isinstance(b, DeviceBuffer):
                    crc = zlib.crc32(b.read(start, self.region_item), crc)
                else:
                    crc = zlib.crc32(b.array[start : start + self.region_item].tobytes(), crc)
            out.append(crc)
        return out

    def aux_digest(self, slot: int) -> int:
        a = self.aux[0].array
        return zlib.crc32(a[slot * self.aux_item_len : (slot + 1) * self.aux_item_len].tobytes())

    def _heads(self) -> range:
        """The global heads this rank's rows hold (MLA: the one latent, 0)."""
        if self.tp is None or self.mla:
            return range(1)
        from kvtransport.spi.tp_map import held_heads

        return held_heads(*self.tp)

    def _head_rows(self, region: int, pages: np.ndarray[Any, Any], heads: range) -> np.ndarray[Any, Any]:
        """What region ``region`` holds in ``pages`` when filled by :meth:`fill_heads`: bytes
        that are a function of (region, page, token, global head, byte)."""
        head_bytes = self.item_len // (self.page_tokens * len(heads))
        p = pages.astype(np.int64)[:, None, None]
        t = np.arange(self.page_tokens, dtype=np.int64)[None, :, None]
        h = np.asarray(list(heads), dtype=np.int64)[None, None, :]
        # The (page, token, head) part on a small array, the byte part added in 16 bits: a GiB
        # pool fills in seconds.
        row = ((region * 7919 + p * 104729 + t * 131 + h * 65537) % 251).astype(np.uint16)
        byte = (np.arange(head_bytes, dtype=np.uint16) * 31 % 251).astype(np.uint16)
        return ((row[..., None] + byte) % 251).astype(np.uint8)

    def fill_heads(self) -> None:
        """Every page of every region: rows of heads a peer can check without this pool. A
        vLLM-shaped pool holds in layer ``l``'s block, for each token and head, the K row an
        SGLang-shaped pool's region ``l`` holds, then the V row of its region ``layers + l``."""
        pages = np.arange(self.num_pages)
        for i, b in enumerate(self.buffers):
            if self.engine == "vllm":
                k = self._head_rows(i, pages, self._heads())
                v = self._head_rows(self.region_count + i, pages, self._heads())
                b.array[:] = np.stack([k, v], axis=3).reshape(-1)
            else:
                b.array[:] = self._head_rows(i, pages, self._heads()).reshape(-1)

    def check_heads(self, src_pages: list[int], dst_pages: list[int]) -> str:
        """'' when page ``dst_pages[k]`` holds, in every region, what :meth:`fill_heads` of a
        rank holding any of this rank's heads wrote in its page ``src_pages[k]``; else the
        first difference."""
        heads = self._heads()
        dst = np.asarray(dst_pages, dtype=np.int64)
        if self.engine == "vllm":
            return self._check_vllm_heads(np.asarray(src_pages), dst, heads)
        src = np.asarray(src_pages, dtype=np.int64)
        for i, b in enumerate(self.buffers):
            got = b.array.reshape(self.num_pages, -1)[dst].reshape(len(dst_pages), self.page_tokens, len(heads), -1)
            wrong = _first_difference(got, self._head_rows(i, src, heads), src, dst, heads, f"region {i}: page")
            if wrong:
                return wrong
        return ""

    def _check_vllm_heads(self, src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any], heads: range) -> str:
        """``check_heads`` of a vLLM-shaped pool fed by SGLang-shaped ranks: in each token of
        layer ``l``'s block, head ``h``'s content is the K row SGLang's region ``l`` holds for it,
        then the V row of region ``layers + l`` (vLLM's ``content[:dim]``, ``content[dim:]``)."""
        layers = self.region_count
        for layer, b in enumerate(self.buffers):
            got = b.array.reshape(self.num_pages, -1)[dst].reshape(len(dst), self.page_tokens, len(heads), 2, -1)
            for part, region in enumerate((layer, layers + layer)):
                want = self._head_rows(region, src, heads)
                wrong = _first_difference(
                    got[:, :, :, part, :], want, src, dst, heads, f"layer {layer} {'KV'[part]}: block"
                )
                if wrong:
                    return wrong
        return ""

    def state_digests(self, group: int, items: list[int]) -> list[int]:
        """crc32 of each item of state group ``group`` across its buffers (order matters)."""
        item_len = self.state[group][1]
        out = []
        for i in items:
            crc = 0
            for b in self.state_buffers[group]:
                start = i * item_len
                if isinstance(b, DeviceBuffer):
                    crc = zlib.crc32(b.read(start, item_len), crc)
                else:
                    crc = zlib.crc32(b.array[start : start + item_len].tobytes(), crc)
            out.append(crc)
        return out

    def close(self) -> None:
        for b in self._all_buffers():
            b.close()
        if self._cuda is not None:
            self._cuda.release()
            self._cuda = None


def _random_bytes(rng: np.random.Generator, size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    data = np.empty(size, dtype=np.uint8)
    words = size // 8
    if words:
        data[: words * 8].view(np.uint64)[:] = rng.integers(0, 2**63, words, dtype=np.uint64)
    if size % 8:
        data[words * 8 :] = rng.integers(0, 256, size % 8, dtype=np.uint8)
    return data


def _first_difference(
    got: np.ndarray[Any, Any],
    want: np.ndarray[Any, Any],
    src: np.ndarray[Any, Any],
    dst: np.ndarray[Any, Any],
    heads: range,
    where: str,
) -> str:
    """'' when ``got`` ([pages, tokens, heads, bytes]) is ``want``; else where it first differs."""
    bad = np.argwhere(got != want)
    if not bad.size:
        return ""
    k, t, h, _ = (int(x) for x in bad[0])
    return (
        f"{where} {int(dst[k])} (from {int(src[k])}) token {t} local head {h} (global {heads[h]}) differs; "
        f"{len(bad)} bytes in all"
    )
