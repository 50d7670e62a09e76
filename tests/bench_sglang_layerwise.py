"""Layer-wise sends measured through SGLang's own scheduler: the tail from prefill's last layer
written to decode's SGLang seeing the transfer succeed (``pop_transferred``), whole chunks
against layer by layer, in one run.

A benchmark, not a test (nothing here asserts a time). One prefill and one decode rank of the
scheduler harness (tests/sglang_scheduler.py: SGLang 0.5.23's run_batch, its pools'
set_kv_buffer, its queues), a model whose KV per layer has Llama-3-8B's bytes (64 KV heads of
the harness's head size 16, bf16: 4 KiB a token, as 8 x 128) and ``--layers`` layers, each
layer's compute a sleep of ``--compute-ms-per-layer`` after its KV write. Both ranks start with
``KVTRANSPORT_LAYERWISE=1`` (the hooks are installed); a round with the flag 0 sends every
chunk whole. Rounds alternate; every byte is checked on decode.

    .venv/bin/python -m tests.bench_sglang_layerwise --tokens 2048 --layers 32 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from kvtransport.runtime.layer_groups import LayerwisePolicy
from tests import test_sglang_scheduler as harness


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length of each request")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--requests", type=int, default=1, help="requests per round (one forward each)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each kind, alternating")
    ap.add_argument("--compute-ms-per-layer", type=float, default=10.0)
    ap.add_argument("--driver", default="nixl-ucx")
    args = ap.parse_args(argv)

    harness.MODELS["bench"] = {
        **harness.TINY_LLAMA,
        "hidden_size": 64 * 16,
        "intermediate_size": 4096,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "num_hidden_layers": args.layers,
        "max_position_embeddings": max(8192, 2 * args.tokens),
    }
    harness.require_engines()
    tails: dict[str, list[float]] = {"whole": [], "layerwise": []}
    with tempfile.TemporaryDirectory(prefix="sglang-bench-") as tmp:
        cluster = harness.Cluster(Path(tmp), harness.Topo(tp=1), env={"KVTRANSPORT_LAYERWISE": "1"})
        try:
            pool_tokens = max(4096, args.requests * (args.tokens + 64))
            for _ in range(args.rounds):
                for kind in ("whole", "layerwise"):
                    cluster.configure(
                        model="bench",
                        driver=args.driver,
                        pool_tokens=pool_tokens,
                        layer_compute_s=args.compute_ms_per_layer / 1e3,
                        max_context=args.tokens + 64,
                        KVTRANSPORT_LAYERWISE="1" if kind == "layerwise" else "0",
                    )
                    reqs = harness.requests(cluster, [args.tokens] * args.requests)
                    out = cluster.run(reqs, timeout=300)
                    harness.assert_all_delivered(cluster, out, reqs)
                    for req in reqs:
                        (p,), (d,) = out.prefill[req["rid"]], out.decode[req["rid"]]
                        if kind == "layerwise":  # the chunk went layer by layer, unless it is short
                            assert p["layerwise"][0] == int(args.tokens >= LayerwisePolicy().min_tokens), p
                        tails[kind].append((d["transferred"] - p["computed"]) * 1e3)
        finally:
            cluster.close()
    whole, layered = statistics.median(tails["whole"]), statistics.median(tails["layerwise"])
    report: dict[str, Any] = {
        "driver": args.driver,
        "tokens": args.tokens,
        "layers": args.layers,
        "compute_ms_per_layer": args.compute_ms_per_layer,
        "samples": {k: len(v) for k, v in tails.items()},
        "tail_ms_p50": {"whole": round(whole, 2), "layerwise": round(layered, 2)},
        "tail_ratio": round(whole / layered, 2) if layered > 0 else None,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
