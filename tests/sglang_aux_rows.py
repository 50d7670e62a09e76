"""Run in a child process (SGLang's scheduler modules need the torchvision stand-in on the path,
which the test process keeps out): SGLang 0.5.23's own ``MetadataBuffers`` in each shape its
options give it, the rows kvtransport's SGLang decode states of them (``common.aux_rows``), and a
vLLM prefill's first-token handoff planned by kvtransport into those buffers and read back with
SGLang's own ``get_buf``. Prints one JSON line per shape: what was found, for the test to check."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
from types import SimpleNamespace

import numpy as np
import torch
from sglang.srt.disaggregation.utils import MetadataBuffers

from kvtransport.integrations.sglang.common import aux_rows
from kvtransport.runtime.planning import PairPlan
from kvtransport.spi.handoff import HANDOFF_ROWS, HANDOFF_SLOT_BYTES, handoff_between, slot_content
from kvtransport.spi.memory import HOST, KVLayout, Region, RegionSet

SLOT = 5


def layouts(items: list[int], rows: dict[str, int] | None) -> tuple[KVLayout, KVLayout]:
    # One layer, one head of 8 float16 a token, pages of 4 tokens: SGLang's K and V buffers,
    # vLLM's one buffer (a head's K and V side by side in each token).
    kv = KVLayout(page_size=4, dtype="float16", num_layers=1, kv_item_lens=(64, 64), num_kv_heads=1, total_kv_heads=1)
    decode = dataclasses.replace(
        kv,
        aux_item_lens=tuple(items),
        extra={"engine": "sglang", "role": "decode", "aux_rows": rows, "speculative": False},
    )
    vllm = {"engine": "vllm", "block_size": 4, "token_layout": "NHD", "packing": "layer"}
    prefill = dataclasses.replace(kv, kv_item_lens=(128,), head_dim=8, aux_item_lens=(HANDOFF_SLOT_BYTES,), extra=vllm)
    return prefill, decode


def one(checksum: bool, dsa: int, mask: bool) -> dict[str, object]:
    os.environ["SGLANG_ENABLE_DISAGG_SAMPLING_MASK"] = "1" if mask else "0"
    mb = MetadataBuffers(8, 32, torch.float16, 8, 4, output_dsa_topk_indices_dim=dsa, kv_checksum_enabled=checksum)
    ptrs, lens, items = mb.get_buf_infos()
    rows = aux_rows(SimpleNamespace(aux_item_lens=items), SimpleNamespace(disaggregation_enable_kv_checksum=checksum))
    out: dict[str, object] = {"checksum": checksum, "dsa": dsa, "mask": mask, "rows": rows, "count": len(items)}
    if rows is None:
        return out
    out["named"] = {name: ptrs[rows[name]] == getattr(mb, name).data_ptr() for name in HANDOFF_ROWS}
    # The control: the same buffers read with the checksum option the other way round.
    wrong = aux_rows(
        SimpleNamespace(aux_item_lens=items), SimpleNamespace(disaggregation_enable_kv_checksum=not checksum)
    )
    out["misread_room"] = wrong is not None and ptrs[wrong["bootstrap_room"]] == mb.bootstrap_room.data_ptr()
    # The handoff, planned by kvtransport from a vLLM prefill's arena into these buffers.
    prefill, decode = layouts(items, rows)
    handoff = handoff_between(prefill, decode)
    assert handoff is not None
    arena = np.zeros((2, HANDOFF_SLOT_BYTES), dtype=np.uint8)
    content = slot_content(handoff, token=777, cached_tokens=32, room=123_456_789_012)
    arena[1, : len(content)] = np.frombuffer(content, dtype=np.uint8)
    kv = [np.zeros(4 * n, dtype=np.uint8) for n in (128, 64, 64)]
    regions = [Region(int(a.ctypes.data), a.nbytes, HOST, a.nbytes // 4, f"kv{i}") for i, a in enumerate(kv)]
    mine = RegionSet(
        kv=tuple(regions[:1]), aux=(Region(int(arena.ctypes.data), arena.nbytes, HOST, HANDOFF_SLOT_BYTES),)
    )
    theirs = RegionSet(
        kv=tuple(regions[1:]),
        aux=tuple(Region(p, n, HOST, i, f"aux{k}") for k, (p, n, i) in enumerate(zip(ptrs, lens, items, strict=True))),
    )
    mb.bootstrap_room[SLOT] = 0  # what clear_slot leaves for the next owner
    mb.output_token_logprobs_val[SLOT] = 0.5  # a row the handoff does not write
    plan = PairPlan(mine, prefill, theirs, decode, max_run_bytes=None)
    transfer = SimpleNamespace(
        tag="r", dst_pages=np.asarray([1]), dst_page_list=None, sent_pages=0, dst_aux=SLOT, dst_state=()
    )
    runs, _ = plan.chunk_runs(transfer, np.asarray([0]), True, 1, None)
    for s, d, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), strict=True):
        ctypes.memmove(d, s, n)
    got = mb.get_buf(SLOT)
    out["read"] = {
        "output_id": int(got[0][0]),
        "cached_tokens": [int(x) for x in got[1][:7]],
        "logprob": float(got[2][0]),
        "room": int(got[-1][0]),
    }
    return out


def main() -> None:
    for checksum in (False, True):
        for dsa in (0, 16):
            for mask in (False, True):
                print(json.dumps(one(checksum, dsa, mask)), flush=True)


if __name__ == "__main__":
    main()
