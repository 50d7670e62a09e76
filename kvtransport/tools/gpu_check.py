"""The GPU figures of the staged path and ``cuda-local``, measured in one run on a CUDA host
(``scripts/gpu-check`` runs this after ``tests/test_gpu.py``).

Prints, and writes as JSON to ``--json PATH``:

- device-to-host and host-to-device copy bandwidth (pinned host memory) and device-to-device
  bandwidth, with the CUDA driver API, 512 MiB, median of five;
- the host driver ``mooncake-gdr`` on host KV (``kvtransport bench``);
- ``mooncake-staged`` on device KV, and its ratio to min(device-to-host, host driver);
- ``cuda-local`` on device KV, and its ratio to a same-process device-to-device copy of the
  same bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvtransport.spi.probe import probe_host
from kvtransport.tools.bench import Report, Workload, run

SIZE = 512 << 20


def _copy_gbps(cuda: Any, dst: int, src: int, size: int, repeat: int = 5) -> float:
    cuda.memcpy(dst, src, size)  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        cuda.memcpy(dst, src, size)
        times.append(time.perf_counter() - start)
    return size / statistics.median(times) / 1e9


def copy_bandwidths(device: int) -> dict[str, float]:
    from kvtransport.staging.cuda_copy import CudaDriver

    cuda = CudaDriver(device)
    a, b = cuda.alloc(SIZE), cuda.alloc(SIZE)
    host = np.zeros(SIZE, dtype=np.uint8)
    ptr = int(host.ctypes.data)
    pinned = cuda.pin(ptr, SIZE)
    try:
        return {
            "d2h_gbps": round(_copy_gbps(cuda, ptr, a, SIZE), 2),
            "h2d_gbps": round(_copy_gbps(cuda, a, ptr, SIZE), 2),
            "d2d_gbps": round(_copy_gbps(cuda, b, a, SIZE), 2),
        }
    finally:
        if pinned:
            cuda.unpin(ptr)
        cuda.free(a)
        cuda.free(b)
        cuda.release()


def _median(report: Report) -> float:
    return float(report.figures()["end_to_end"]["median_gbps"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    if not probe_host().cuda_devices:
        print("gpu-check: no CUDA device on this host; nothing to measure")
        return 0
    out: dict[str, Any] = {"device": str(probe_host().device(args.device))}
    out.update(copy_bandwidths(args.device))
    host_kv = Workload(requests=args.requests)
    device_kv = Workload(requests=args.requests, device=args.device)
    results: dict[str, Report] = {
        "host_driver": run(host_kv, driver="mooncake-gdr", baseline=True),
        "staged": run(device_kv, driver="mooncake-staged", baseline=False),
        "cuda_local": run(device_kv, driver="cuda-local", baseline=False),
    }
    for key, report in results.items():
        out[key] = {"gbps": _median(report), "integrity": report.integrity_ok, "figures": report.figures()}
    bound = min(out["d2h_gbps"], out["host_driver"]["gbps"])
    out["staged_ratio"] = round(out["staged"]["gbps"] / bound, 3) if bound else 0.0
    out["cuda_local_ratio"] = round(out["cuda_local"]["gbps"] / out["d2d_gbps"], 3) if out["d2d_gbps"] else 0.0
    print(f"device             {out['device']}")
    print(f"copies             D2H {out['d2h_gbps']} GB/s, H2D {out['h2d_gbps']} GB/s, D2D {out['d2d_gbps']} GB/s")
    print(f"host driver        mooncake-gdr on host KV: {out['host_driver']['gbps']} GB/s")
    print(
        f"mooncake-staged    {out['staged']['gbps']} GB/s = {out['staged_ratio']}x min(D2H, host driver) (target 0.8)"
    )
    print(f"cuda-local         {out['cuda_local']['gbps']} GB/s = {out['cuda_local_ratio']}x D2D copy (target 0.8)")
    ok = all(r.integrity_ok for r in results.values())
    print(f"integrity          {'OK' if ok else 'FAILED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
