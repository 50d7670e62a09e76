"""An SGLang prefill's pages regrouped into a vLLM decode's blocks and a vLLM prefill's blocks
into an SGLang decode's pages (spi.page_geometry, the "regroup" pair shape), the first token's
handoff into SGLang's aux slot (spi.handoff), and the handshake's answer for every pairing of
the two engines.

The two pools are built the way each engine builds them, independently of the geometry code
under test: SGLang's as ``MHATokenToKVPool`` does (a ``[tokens, heads, dim]`` K and V buffer per
layer, pages of ``page_size`` tokens), vLLM's as ``allocate_kv_cache`` does (one backing buffer
in the physical order of its ``KVCacheLayout``, per-layer ``[blocks, heads, tokens, content]``
views, read by the connector's own ``describe_kv_caches``). The planned runs are executed byte by
byte, and every head's K and V of every token of every layer is then read back through vLLM's
view (``content[:dim]`` is K, ``content[dim:]`` V, as vLLM's attention backends split it).
"""

from __future__ import annotations

import ctypes
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.integrations.vllm.layout import describe_kv_caches
from kvtransport.negotiation.hello import layout_from_dict, layout_to_dict
from kvtransport.negotiation.negotiate import check_layouts
from kvtransport.runtime.planning import PairPlan
from kvtransport.spi.errors import InvalidPages, LayoutMismatch, ProtocolError
from kvtransport.spi.handoff import HANDOFF_SLOT_BYTES
from kvtransport.spi.memory import HOST, KVLayout, Region, RegionSet
from kvtransport.spi.tp_map import held_heads, pair_shape, sources

#: vLLM's KVCacheLayout permutations of the logical [L, B, H, N, C] (vllm/v1/kv_cache_layout.py).
VLLM_LAYOUTS = {
    "LBNHC": (0, 1, 3, 2, 4),
    "LBHNC": (0, 1, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BLHNC": (1, 0, 2, 3, 4),
}


class SglangPool:
    """One SGLang prefill rank's MHA pool: a K and a V buffer per layer, ``[slots, heads, dim]``."""

    def __init__(self, layers: int, pages: int, page: int, heads: int, dim: int, tp: int, rank: int, total: int):
        self.k = [torch.randn(pages * page, heads, dim, dtype=torch.float16) for _ in range(layers)]
        self.v = [torch.randn(pages * page, heads, dim, dtype=torch.float16) for _ in range(layers)]
        self.page, self.heads = page, heads
        self.first_head = held_heads(total, tp, rank).start
        # KVArgs' view of them (kv_data_ptrs, kv_data_lens, kv_item_lens): a page is an item.
        item = page * heads * dim * 2
        self.regions = RegionSet(
            kv=tuple(
                Region(t.data_ptr(), t.numel() * 2, HOST, item, f"kv{i}") for i, t in enumerate([*self.k, *self.v])
            )
        )
        self.layout = KVLayout(
            page_size=page,
            dtype="float16",
            num_layers=layers,
            kv_item_lens=self.regions.kv_item_lens,
            kv_split="kv",
            num_kv_heads=heads,
            total_kv_heads=total,
            tp_rank=rank,
            tp_size=tp,
            aux_item_lens=(64,),
            extra={"engine": "sglang", "role": "prefill"},
        )


class VllmPool:
    """One vLLM decode rank's KV as vLLM 0.33 allocates it in layout ``name``."""

    def __init__(
        self,
        name: str,
        layers: int,
        blocks: int,
        block: int,
        kernel: int,
        heads: int,
        dim: int,
        tp: int,
        rank: int,
        total: int = 0,
    ):
        per = block // kernel
        logical = (layers, blocks * per, heads, kernel, 2 * dim)
        perm = VLLM_LAYOUTS[name]
        physical = torch.full([logical[i] for i in perm], -1.0, dtype=torch.float16)
        view = physical.permute(*np.argsort(perm).tolist())  # back to [L, B, H, N, C]
        self.views = [(f"model.layers.{i}.self_attn.attn", view[i]) for i in range(layers)]
        self.block, self.kernel, self.per, self.dim = block, kernel, per, dim
        total = total or heads * tp
        kv = describe_kv_caches(
            self.views, block_size=block, use_mla=False, tp_rank=rank, tp_size=tp, total_kv_heads=total
        )
        self.regions, self.layout = kv.regions, kv.layout
        self.first_head = held_heads(total, tp, rank).start

    def token(self, layer: int, block: int, slot: int, part: int) -> torch.Tensor:
        """[heads, dim]: K (part 0) or V of the token in ``slot`` of ``block``, as vLLM reads it."""
        view = self.views[layer][1]
        kb, t = block * self.per + slot // self.kernel, slot % self.kernel
        return view[kb, :, t, part * self.dim : (part + 1) * self.dim]


def execute(plan: PairPlan, src_pages: list[int], dst_pages: list[int]) -> int:
    runs = plan.kv_runs(np.asarray(src_pages), np.asarray(dst_pages))
    for s, d, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), strict=True):
        ctypes.memmove(d, s, n)
    return len(runs)


tp_pairs = st.sampled_from([(1, 1), (2, 2), (1, 2), (2, 1), (1, 4), (4, 2)])


#: The model shapes both directions' properties draw: every vLLM layout, kernel blocks of half a
#: block (token-major layouts only, as vLLM's backends), and TP pairs up to 4.
same_model = given(
    layout=st.sampled_from(sorted(VLLM_LAYOUTS)),
    layers=st.integers(1, 3),
    total_heads=st.sampled_from([1, 2, 4]),
    dim=st.sampled_from([2, 4, 8]),
    block=st.sampled_from([1, 2, 4, 8]),
    kernel_split=st.sampled_from([1, 2]),
    tps=tp_pairs,
    data=st.data(),
)


def sharded(total_heads: int, tps: tuple[int, int]) -> bool:
    """Whether both TP sizes shard ``total_heads`` (one divides the other)."""
    return all(not (total_heads % tp and tp % total_heads) for tp in tps)


def kernel_of(layout: str, block: int, split: int) -> int:
    """vLLM's kernel block: ``block // split`` where it divides and the layout is token-major."""
    return block // split if block % split == 0 and layout.startswith("L") else block


@settings(max_examples=60, deadline=None)
@same_model
def test_sglang_pages_land_in_vllm_blocks(layout, layers, total_heads, dim, block, kernel_split, tps, data) -> None:
    prefill_tp, decode_tp = tps
    if not sharded(total_heads, tps):
        return
    kernel = kernel_of(layout, block, kernel_split)
    decode_rank = data.draw(st.integers(0, decode_tp - 1))
    dst_heads = len(held_heads(total_heads, decode_tp, decode_rank))
    decode = VllmPool(layout, layers, 6, block, kernel, dst_heads, dim, decode_tp, decode_rank, total_heads)
    n = data.draw(st.integers(1, 5))
    src_pages = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n, unique=True))
    dst_pages = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n, unique=True))
    feeding = sources(prefill_tp, decode_tp, decode_rank)
    written = torch.zeros(dst_heads, dtype=torch.bool)
    for prefill_rank in feeding:
        src_heads = len(held_heads(total_heads, prefill_tp, prefill_rank))
        prefill = SglangPool(layers, 6, block, src_heads, dim, prefill_tp, prefill_rank, total_heads)
        check_layouts_ok(prefill.layout, decode.layout)
        plan = PairPlan(prefill.regions, prefill.layout, decode.regions, decode.layout, max_run_bytes=None)
        assert plan.sending.kind in ("regroup", "none")
        execute(plan, src_pages, dst_pages)
        # Every head this prefill rank sent is where vLLM reads it.
        moved = 0
        for h_global in held_heads(total_heads, prefill_tp, prefill_rank):
            hd = h_global - decode.first_head
            if not 0 <= hd < dst_heads or written[hd]:
                continue
            written[hd] = True
            moved += 1
            hs = h_global - prefill.first_head
            for sp, dp in zip(src_pages, dst_pages, strict=True):
                for t in range(block):
                    for layer in range(layers):
                        for part, buf in enumerate((prefill.k, prefill.v)):
                            want = buf[layer][sp * block + t, hs]
                            got = decode.token(layer, dp, t, part)[hd]
                            assert torch.equal(got, want), (layer, part, sp, dp, t, h_global)
        assert plan.sending.kv_bytes_per_page(decode.regions.kv_item_lens) == moved * layers * 2 * block * dim * 2
    # Every head of the decode rank came from exactly one source; pages not named stay unwritten.
    assert bool(written.all())
    untouched = [b for b in range(6) if b not in dst_pages]
    for b in untouched:
        assert bool((decode.token(0, b, 0, 0) == -1).all())


def check_layouts_ok(prefill: KVLayout, decode: KVLayout) -> None:
    assert prefill.incompatibilities(decode) == []
    assert decode.incompatibilities(prefill) == []


def test_regroup_runs_merge_where_both_sides_are_adjacent() -> None:
    """In vLLM a head's V sits between its K and the next head's K: the runs out of SGLang's
    K buffer stay one per head and token."""
    prefill = SglangPool(2, 4, 4, 2, 8, 1, 0, 2)
    decode = VllmPool("LBNHC", 2, 4, 4, 4, 2, 8, 1, 0)
    plan = PairPlan(prefill.regions, prefill.layout, decode.regions, decode.layout, max_run_bytes=None)
    assert plan.sending.regroup is not None
    assert len(plan.sending.regroup) == 2 * 2 * 4 * 2  # layers x K/V x tokens x heads
    assert execute(plan, [1, 2], [3, 0]) == 2 * 2 * 2 * 4 * 2


def test_pages_outside_either_pool_are_refused() -> None:
    prefill = SglangPool(1, 4, 4, 2, 8, 1, 0, 2)
    decode = VllmPool("LBNHC", 1, 4, 4, 4, 2, 8, 1, 0)
    plan = PairPlan(prefill.regions, prefill.layout, decode.regions, decode.layout, max_run_bytes=None)
    for src, dst in (([4], [0]), ([0], [4]), ([0, 1], [2, 2]), ([-1], [0])):
        with pytest.raises(InvalidPages):
            plan.kv_runs(np.asarray(src), np.asarray(dst))
    assert bool((decode.views[0][1] == -1).all())


def _hello_check(a: KVLayout, b: KVLayout) -> None:
    from types import SimpleNamespace

    def hello(layout: KVLayout, name: str) -> SimpleNamespace:
        return SimpleNamespace(layout=layout, label=lambda: name)

    check_layouts(hello(a, "decode"), hello(b, "prefill"))  # type: ignore[arg-type]


#: SGLang 0.5.23's aux rows without logprob options (MetadataBuffers: output_ids, cached_tokens,
#: four logprob rows, top-k p and index, hidden states, bootstrap_room), 64 bytes but the hidden
#: states' row; what its decode states of them (common.aux_rows, checked against SGLang's own
#: MetadataBuffers in test_sglang_aux_rows.py).
SGLANG_AUX = (64, 64, 64, 64, 16, 16, 64, 128, 64, 64)
SGLANG_ROWS = {"output_ids": 0, "cached_tokens": 1, "bootstrap_room": 9}


def as_sglang_decode(layout: KVLayout, **extra: object) -> KVLayout:
    """An SGLang pool's layout as its decode states it (role, aux rows, no speculative decoding)."""
    stated = {"engine": "sglang", "role": "decode", "aux_rows": SGLANG_ROWS, "speculative": False} | extra
    return dataclasses.replace(layout, aux_item_lens=SGLANG_AUX, extra={k: v for k, v in stated.items() if v != "-"})


def as_vllm_prefill(pool: VllmPool) -> tuple[RegionSet, KVLayout, np.ndarray]:
    """A vLLM pool with the handoff arena the connector registers beside it (connector.py)."""
    arena = np.zeros((4, HANDOFF_SLOT_BYTES), dtype=np.uint8)
    region = Region(int(arena.ctypes.data), arena.nbytes, HOST, HANDOFF_SLOT_BYTES, "aux[handoff]")
    regions = dataclasses.replace(pool.regions, aux=(region,))
    return regions, dataclasses.replace(pool.layout, aux_item_lens=(HANDOFF_SLOT_BYTES,)), arena


@settings(max_examples=60, deadline=None)
@same_model
def test_vllm_blocks_land_in_sglang_pages(layout, layers, total_heads, dim, block, kernel_split, tps, data) -> None:
    """The reverse direction: a vLLM prefill rank's blocks (every layout vLLM resolves, kernel
    blocks smaller than a block) regrouped into an SGLang decode rank's K and V pages, each head
    of each token read back where SGLang's attention reads it (``k_buffer[layer][slot, head]``)."""
    prefill_tp, decode_tp = tps
    if not sharded(total_heads, tps):
        return
    kernel = kernel_of(layout, block, kernel_split)
    decode_rank = data.draw(st.integers(0, decode_tp - 1))
    dst_heads = len(held_heads(total_heads, decode_tp, decode_rank))
    decode = SglangPool(layers, 6, block, dst_heads, dim, decode_tp, decode_rank, total_heads)
    for buf in (*decode.k, *decode.v):
        buf.fill_(-1.0)
    decode_layout = as_sglang_decode(decode.layout)
    n = data.draw(st.integers(1, 5))
    src_pages = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n, unique=True))
    dst_pages = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n, unique=True))
    written = torch.zeros(dst_heads, dtype=torch.bool)
    for prefill_rank in sources(prefill_tp, decode_tp, decode_rank):
        src_heads = len(held_heads(total_heads, prefill_tp, prefill_rank))
        prefill = VllmPool(layout, layers, 6, block, kernel, src_heads, dim, prefill_tp, prefill_rank, total_heads)
        for _, view in prefill.views:
            view.copy_(torch.randn(view.shape, dtype=torch.float16))
        regions, prefill_layout, _ = as_vllm_prefill(prefill)
        check_layouts_ok(prefill_layout, decode_layout)
        plan = PairPlan(regions, prefill_layout, decode.regions, decode_layout, max_run_bytes=None)
        assert plan.sending.kind in ("regroup", "none")
        execute(plan, src_pages, dst_pages)
        for h_global in held_heads(total_heads, prefill_tp, prefill_rank):
            hd = h_global - decode.first_head
            if not 0 <= hd < dst_heads or written[hd]:
                continue
            written[hd] = True
            hs = h_global - prefill.first_head
            for sp, dp in zip(src_pages, dst_pages, strict=True):
                for t in range(block):
                    for layer in range(layers):
                        for part, buf in enumerate((decode.k, decode.v)):
                            want = prefill.token(layer, sp, t, part)[hs]
                            assert torch.equal(buf[layer][dp * block + t, hd], want), (layer, part, sp, dp, t)
    assert bool(written.all())
    for b in (b for b in range(6) if b not in dst_pages):
        assert bool((decode.k[0][b * block : (b + 1) * block] == -1).all())


def test_the_first_token_handoff_goes_into_the_named_rows_of_the_aux_slot() -> None:
    """With the last chunk, a vLLM prefill writes three rows of the SGLang decode's aux slot from
    its handoff slot: the token, the cached prefix and the room, each where the decode said it
    keeps them, and nothing else of the slot; the decode expects exactly those bytes."""
    from types import SimpleNamespace

    from kvtransport.spi.handoff import handoff_between, slot_content
    from kvtransport.spi.inbound import Claim

    decode = SglangPool(2, 4, 4, 2, 8, 1, 0, 2)
    rows = [np.full((8, n), 0xAB, dtype=np.uint8) for n in SGLANG_AUX]  # 8 aux slots a row
    decode_regions = RegionSet(
        kv=decode.regions.kv,
        aux=tuple(Region(int(r.ctypes.data), r.nbytes, HOST, r.shape[1], f"aux{i}") for i, r in enumerate(rows)),
    )
    decode_layout = as_sglang_decode(decode.layout)
    regions, prefill_layout, arena = as_vllm_prefill(VllmPool("LBNHC", 2, 4, 4, 4, 2, 8, 1, 0))
    handoff = handoff_between(prefill_layout, decode_layout)
    assert handoff is not None and handoff.rows == (0, 1, 9)
    content = slot_content(handoff, token=4242, cached_tokens=48, room=2**62 + 5)
    arena[3, : len(content)] = np.frombuffer(content, dtype=np.uint8)
    plan = PairPlan(regions, prefill_layout, decode_regions, decode_layout, max_run_bytes=None)
    transfer = SimpleNamespace(
        tag="7", dst_pages=np.asarray([2]), dst_page_list=None, sent_pages=0, dst_aux=5, dst_state=()
    )
    runs, _ = plan.chunk_runs(transfer, np.asarray([0]), True, 3, None)  # type: ignore[arg-type]
    for s_, d_, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), strict=True):
        ctypes.memmove(d_, s_, n)
    assert rows[0][5].view("<i4")[0] == 4242 and not rows[0][5].view("<i4")[1:].any()
    assert list(rows[1][5].view("<i4")[:3]) == [48, 48, 0]
    assert rows[9][5].view("<u8")[0] == 2**62 + 5
    for i, row in enumerate(rows):  # other rows, and other slots of these rows, untouched
        for slot in range(8):
            if not (slot == 5 and i in (0, 1, 9)):
                assert bool((row[slot] == 0xAB).all()), (i, slot)
    # The decode side counts the same bytes for the announcement (its KV pages plus the rows).
    reader = PairPlan(decode_regions, decode_layout, regions, prefill_layout, max_run_bytes=None)
    claim = Claim(np.asarray([2], dtype=np.int64), aux=5)
    assert reader.expected_bytes(claim) == runs.total_bytes
    # Between two SGLang ranks the slot still moves whole, region by region.
    sglang_prefill = dataclasses.replace(decode_layout, extra={"engine": "sglang", "role": "prefill"})
    whole = PairPlan(decode_regions, decode_layout, decode_regions, sglang_prefill, max_run_bytes=None)
    assert whole.expected_bytes(claim) == decode.regions.kv[0].item_len * 4 + sum(SGLANG_AUX)


def test_a_handoff_row_smaller_than_stated_is_refused_before_a_byte_is_written() -> None:
    """The planner's own check, behind the handshake's: rows are written where the peer's
    regions lie, with the lengths its layout states; a row region with smaller items (which
    the handshake refuses) raises InvalidPages instead of writing over the next slot."""
    decode = SglangPool(2, 4, 4, 2, 8, 1, 0, 2)
    lens = (*SGLANG_AUX[:9], 8)
    rows = [np.zeros((8, n), dtype=np.uint8) for n in lens]
    decode_regions = RegionSet(
        kv=decode.regions.kv,
        aux=tuple(Region(int(r.ctypes.data), r.nbytes, HOST, r.shape[1], f"aux{i}") for i, r in enumerate(rows)),
    )
    regions, prefill_layout, _ = as_vllm_prefill(VllmPool("LBNHC", 2, 4, 4, 4, 2, 8, 1, 0))
    plan = PairPlan(regions, prefill_layout, decode_regions, as_sglang_decode(decode.layout), max_run_bytes=None)
    transfer = SimpleNamespace(
        tag="7", dst_pages=np.asarray([2]), dst_page_list=None, sent_pages=0, dst_aux=7, dst_state=()
    )
    with pytest.raises(InvalidPages, match="aux row 9 cannot take 64 bytes"):
        plan.chunk_runs(transfer, np.asarray([0]), True, 0, None)  # type: ignore[arg-type]
    assert not any(r.any() for r in rows)


@pytest.mark.parametrize(
    ("decode_extra", "vllm_change", "reason"),
    [
        ({}, {}, ""),
        ({"speculative": True}, {}, "speculative decoding"),
        ({"aux_rows": "-"}, {}, "does not state which aux regions"),
        ({"aux_rows": {"output_ids": 0, "cached_tokens": 1, "bootstrap_room": 10}}, {}, "outside its 10 aux regions"),
        ({"aux_rows": {"output_ids": 0, "cached_tokens": 0, "bootstrap_room": 9}}, {}, "one region twice"),
        ({"aux_rows": {"output_ids": 0, "cached_tokens": 4, "bootstrap_room": 9}}, {}, "cached_tokens row has 16"),
        ({}, {"aux_item_lens": ()}, "no handoff slots"),
        ({}, {"extra": {"engine": "vllm", "role": "decode"}}, "neither prefills"),
        ({"role": "prefill"}, {"extra": {"engine": "vllm", "role": "prefill"}}, "neither decodes"),
        ({"role": "both"}, {}, "only SGLang prefill and decode ranks pair"),
    ],
)
def test_a_vllm_prefill_feeds_an_sglang_decode_only_with_what_it_needs(
    decode_extra: dict[str, object], vllm_change: dict[str, object], reason: str
) -> None:
    """The handshake's answer for a vLLM instance and an SGLang decode, the same from both ends:
    accepted when the decode says where its first-token rows are and needs nothing more; else
    refused, naming what is missing."""
    decode = as_sglang_decode(SglangPool(2, 4, 4, 2, 8, 1, 0, 2).layout, **decode_extra)
    _, prefill, _ = as_vllm_prefill(VllmPool("LBNHC", 2, 4, 4, 4, 2, 8, 1, 0))
    if vllm_change:
        prefill = dataclasses.replace(prefill, **vllm_change)
    if not reason:
        check_layouts_ok(prefill, decode)
        _hello_check(decode, prefill)
        return
    assert reason in " ".join(prefill.incompatibilities(decode))
    assert reason in " ".join(decode.incompatibilities(prefill))
    with pytest.raises(LayoutMismatch, match=reason):
        _hello_check(decode, prefill)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"block": 8, "kernel": 8}, "page_size: pages of 8 tokens on initiator decode, 4 on acceptor prefill"),
        ({"dim": 4}, "head size"),
        ({"layers": 3}, "num_layers"),
    ],
)
def test_pools_that_do_not_map_are_refused_naming_the_field(change: dict[str, int], field: str) -> None:
    prefill = SglangPool(2, 4, 4, 2, 8, 1, 0, 2).layout
    args = {"layers": 2, "blocks": 4, "block": 4, "kernel": 4, "heads": 2, "dim": 8} | change
    decode = VllmPool("LBNHC", *args.values(), 1, 0).layout
    with pytest.raises(LayoutMismatch, match=field):
        _hello_check(decode, prefill)


def test_an_unnamed_pool_still_pairs_with_a_named_one_of_the_same_pages() -> None:
    """kvtransport's own endpoints name no engine: their pages pair by size with any engine's."""
    prefill = SglangPool(2, 4, 4, 2, 8, 1, 0, 2).layout
    plain = dataclasses.replace(prefill, extra={})
    assert plain.incompatibilities(prefill) == []
    assert pair_shape(plain, prefill).kind == "all"


def test_mla_latent_pages_move_whole() -> None:
    """MLA's latent is one replicated row a token on both sides: each layer's page moves as
    one run, into the block vLLM reads it from (``[B, 1, N, C]``)."""
    layers, pages, page, latent = 2, 4, 4, 12
    buffers = [torch.randn(pages * page, 1, latent, dtype=torch.float16) for _ in range(layers)]
    regions = RegionSet(
        kv=tuple(Region(b.data_ptr(), b.numel() * 2, HOST, page * latent * 2, f"kv{i}") for i, b in enumerate(buffers))
    )
    sglang = KVLayout(
        page_size=page,
        dtype="float16",
        num_layers=layers,
        kv_item_lens=regions.kv_item_lens,
        kv_split="mla",
        num_kv_heads=1,
        extra={"engine": "sglang", "role": "prefill"},
    )
    cache = torch.full((layers, pages, page, 1, latent), -1.0, dtype=torch.float16)  # LBNHC
    views = [(f"l{i}", cache[i].permute(0, 2, 1, 3)) for i in range(layers)]
    vllm = describe_kv_caches(views, block_size=page, use_mla=True, tp_rank=0, tp_size=1, total_kv_heads=0)
    assert sglang.incompatibilities(vllm.layout) == []
    plan = PairPlan(regions, sglang, vllm.regions, vllm.layout, max_run_bytes=None)
    assert execute(plan, [2, 0], [1, 3]) == 2 * layers
    for layer in range(layers):
        for src, dst in ((2, 1), (0, 3)):
            assert torch.equal(views[layer][1][dst, 0], buffers[layer][src * page : (src + 1) * page, 0])


def test_a_layer_groups_runs_move_only_its_layers() -> None:
    """A layer-wise send names this side's regions (SGLang's K_l and V_l): the regroup takes
    only their runs, into the vLLM blocks of those layers, and nothing of the other layers."""
    layers = 3
    prefill = SglangPool(layers, 4, 4, 2, 8, 1, 0, 2)
    for name in ("LBNHC", "BLNHC"):
        decode = VllmPool(name, layers, 4, 4, 4, 2, 8, 1, 0)
        plan = PairPlan(prefill.regions, prefill.layout, decode.regions, decode.layout, max_run_bytes=None)
        runs = plan.kv_runs(np.asarray([1]), np.asarray([2]), kv=[1, layers + 1])  # layer 1's K and V
        for s_, d_, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), strict=True):
            ctypes.memmove(d_, s_, n)
        for part, buf in enumerate((prefill.k, prefill.v)):
            for t in range(4):
                assert torch.equal(decode.token(1, 2, t, part), buf[1][4 + t])
                for other in (0, 2):
                    assert bool((decode.token(other, 2, t, part) == -1).all())


def test_a_hostile_peer_layout_is_refused_before_any_array_is_built() -> None:
    """A layout comes over the network: a block of 2**25 tokens, a TP size of 0 or a head count
    of millions is refused by its numbers, at once, with no geometry built for it."""
    import time

    prefill = SglangPool(2, 4, 4, 2, 8, 1, 0, 2).layout
    vllm = VllmPool("LBNHC", 2, 4, 4, 4, 2, 8, 1, 0).layout
    hostile = [
        dataclasses.replace(vllm, extra={**vllm.extra, "block_size": 1 << 25}, kv_item_lens=(1 << 40,) * 2),
        dataclasses.replace(vllm, tp_size=0),
        dataclasses.replace(vllm, num_kv_heads=1 << 30, total_kv_heads=1 << 30),
        dataclasses.replace(vllm, num_layers=1 << 30, kv_item_lens=(128,) * 2),
    ]
    # The hello's schema refuses the last three (counts out of bounds) before a layout is
    # built; the check of the numbers holds without it.
    for change in (
        {"tp_size": 0},
        {"num_kv_heads": 1 << 30, "total_kv_heads": 1 << 30},
        {"num_layers": 1 << 30, "kv_item_lens": [128] * 2},
    ):
        with pytest.raises(ProtocolError, match="outside its range"):
            layout_from_dict({**layout_to_dict(vllm), **change})
    for layout in hostile:
        started = time.monotonic()
        problems = prefill.incompatibilities(layout)
        assert problems and time.monotonic() - started < 0.5, problems


@pytest.mark.parametrize(
    ("sglang", "vllm", "ok"),
    [
        ("bf16", "bfloat16", True),
        ("fp8_e4m3", "float8_e4m3fn", True),
        ("auto", "float16", False),
        ("mxfp8", "mxfp8", False),
    ],
)
def test_sglang_dtype_names_are_compared_as_torch_names(sglang: str, vllm: str, ok: bool) -> None:
    import dataclasses

    prefill = dataclasses.replace(SglangPool(2, 4, 4, 2, 8, 1, 0, 2).layout, dtype=sglang)
    decode = dataclasses.replace(VllmPool("LBNHC", 2, 4, 4, 4, 2, 8, 1, 0).layout, dtype=vllm)
    problems = prefill.incompatibilities(decode)
    assert (problems == []) is ok, problems
    if not ok:
        assert "dtype" in problems[0]
    # SGLang's resolved name for ``auto`` (extra["kv_dtype"]) is what counts when it states one.
    resolved = dataclasses.replace(prefill, extra={**prefill.extra, "kv_dtype": vllm})
    assert (resolved.incompatibilities(decode) == []) is (vllm in ("bfloat16", "float8_e4m3fn", "float16"))


MUTABLE = ("page_size", "num_layers", "kv_item_lens", "num_kv_heads", "total_kv_heads", "tp_size", "tp_rank")


@settings(max_examples=300, deadline=None)
@given(
    layout=st.sampled_from(sorted(VLLM_LAYOUTS)),
    layers=st.integers(1, 3),
    total_heads=st.sampled_from([1, 2, 4]),
    dim=st.sampled_from([2, 4]),
    block=st.sampled_from([1, 2, 4]),
    tps=tp_pairs,
    data=st.data(),
)
def test_any_peer_layout_is_refused_with_reasons_or_maps_within_its_pages(
    layout: str, layers: int, total_heads: int, dim: int, block: int, tps: tuple[int, int], data: st.DataObject
) -> None:
    """A pair of pools that map, and then, half the time, one field of either side's layout
    changed to what a hostile or misconfigured peer could send (a huge, negative or zero number,
    an odd extra): the check answers with reasons (never an exception, quickly), the same from
    both ends, and a pair it accepts regroups every run inside both sides' pages."""
    import dataclasses
    import time

    prefill_tp, decode_tp = tps
    if (total_heads % prefill_tp and prefill_tp % total_heads) or (total_heads % decode_tp and decode_tp % total_heads):
        return
    p_rank, d_rank = data.draw(st.integers(0, prefill_tp - 1)), data.draw(st.integers(0, decode_tp - 1))
    p_heads, d_heads = len(held_heads(total_heads, prefill_tp, p_rank)), len(held_heads(total_heads, decode_tp, d_rank))
    sides = [
        SglangPool(layers, 2, block, p_heads, dim, prefill_tp, p_rank, total_heads).layout,
        VllmPool(layout, layers, 2, block, block, d_heads, dim, decode_tp, d_rank, total_heads).layout,
    ]
    if data.draw(st.booleans()):
        side = data.draw(st.integers(0, 1))
        field = data.draw(st.sampled_from([*MUTABLE, "block_size", "dtype", "kv_split"]))
        value = data.draw(st.sampled_from([0, -1, 3, 1 << 20, 1 << 40]))
        old = sides[side]
        if field == "kv_item_lens":
            sides[side] = dataclasses.replace(old, kv_item_lens=(abs(value) + 1,) * len(old.kv_item_lens))
        elif field == "block_size":
            sides[side] = dataclasses.replace(old, extra={**old.extra, "block_size": value})
        elif field == "dtype":
            sides[side] = dataclasses.replace(old, dtype=data.draw(st.sampled_from(["float32", "mxfp8", "auto"])))
        elif field == "kv_split":
            sides[side] = dataclasses.replace(old, kv_split=data.draw(st.sampled_from(["mla", "??"])))
        else:
            sides[side] = dataclasses.replace(old, **{field: value})
    a, b = sides
    started = time.monotonic()
    problems = a.incompatibilities(b)
    assert time.monotonic() - started < 1.0
    assert bool(problems) == bool(b.incompatibilities(a))  # the same answer from both ends
    if problems:
        return
    for src, dst in ((a, b), (b, a)):
        shape = pair_shape(src, dst)
        if shape.regroup is None:
            assert shape.kind == "none"
            continue
        table = shape.regroup
        assert bool((table.src_offset >= 0).all() and (table.dst_offset >= 0).all())
        assert bool((table.src_offset + table.length <= src.kv_item_lens[0]).all())
        assert bool((table.dst_offset + table.length <= dst.kv_item_lens[0]).all())
        assert int(table.src_region.max()) < len(src.kv_item_lens)
        assert int(table.dst_region.max()) < len(dst.kv_item_lens)
