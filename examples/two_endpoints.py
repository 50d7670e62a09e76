"""Two endpoints in one process, one verified transfer: the README's Python example."""

import time

import numpy as np

import kvtransport as kvt

PAGES, PAGE_BYTES = 64, 32 << 10  # per region: 64 pages of 16 tokens x 8 KV heads x 128 x bf16
layout = kvt.KVLayout(
    page_size=16, dtype="bfloat16", num_layers=4, kv_item_lens=(PAGE_BYTES,) * 8, num_kv_heads=8, head_dim=128
)


def kv_pool(seed: int) -> tuple[list[np.ndarray], kvt.RegionSet]:
    """4 layers x (K, V): eight host buffers of random bytes, registered where they are."""
    rng = np.random.default_rng(seed)
    buffers = [rng.integers(0, 256, PAGES * PAGE_BYTES, dtype=np.uint8) for _ in range(8)]
    pointers, sizes = [b.ctypes.data for b in buffers], [b.nbytes for b in buffers]
    return buffers, kvt.RegionSet.from_kv_args(pointers, sizes, [PAGE_BYTES] * 8)


prefill_kv, prefill_regions = kv_pool(1)
decode_kv, decode_regions = kv_pool(2)

with (
    kvt.Endpoint(prefill_regions, layout, name="prefill") as prefill,
    kvt.Endpoint(decode_regions, layout, name="decode") as decode,
):
    to_prefill = decode.connect(prefill.address)  # the handshake picks the driver for this pair
    to_decode = prefill.accept(timeout=10)
    print("driver:", to_prefill.decision.driver)  # .reason: why; .candidates: why not the others

    received = to_prefill.expect("req-1", [40, 41, 42])  # decode: where the request's pages go
    sent = to_decode.sender("req-1")  # prefill: the same request, by its tag
    while sent.poll() is kvt.State.BOOTSTRAPPING:  # until the announcement arrives (or it times out)
        time.sleep(0.001)
    sent.send([3, 4, 5])  # prefill pages 3, 4, 5 -> decode pages 40, 41, 42
    received.wait(timeout=10)  # Success, or raises why not (kvtransport.TransferTimeout, PeerLost, ...)


def page(buffer: np.ndarray, i: int) -> np.ndarray:
    return buffer[i * PAGE_BYTES : (i + 1) * PAGE_BYTES]


for src, dst in zip(prefill_kv, decode_kv, strict=True):
    if not all((page(src, s) == page(dst, d)).all() for s, d in [(3, 40), (4, 41), (5, 42)]):
        raise SystemExit("a page arrived wrong")
print("verified: 3 pages x 8 regions, byte for byte")
