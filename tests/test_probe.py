"""Host and driver probes, run for real on this machine (and on synthetic facts where the
machine cannot show a case)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtransport.negotiation.registry import load_driver
from kvtransport.spi.diagnose import import_failure
from kvtransport.spi.memory import MemoryKind
from kvtransport.spi.probe import host_id, judge_gdr, peermem_loaded, probe_host, rdma_devices

from .conftest import require_engines, run_cli


def test_host_id_is_equal_across_processes_and_stable() -> None:
    code = "from kvtransport.spi.probe import host_id; print(host_id())"
    ids = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        for _ in range(2)
    }
    assert ids == {host_id()}
    assert len(host_id()) == 16


def test_host_probe_is_fast_and_reports_unknowns_with_reasons() -> None:
    probe_host.cache_clear()
    start = time.monotonic()
    info = probe_host()
    assert time.monotonic() - start < 1.0
    if not info.cuda_devices:
        assert "CUDA" in info.cuda_note or "libcuda" in info.cuda_note
        ok, why = info.gdr_for(0)
        assert not ok and "cuda:0 not found" in why
    if not info.rdma_devices:
        assert "RDMA" in info.rdma_note
    assert "kvtransport" in info.versions


def test_rdma_devices_from_sysfs(tmp_path: Path) -> None:
    (tmp_path / "mlx5_0").mkdir()
    (tmp_path / "mlx5_1").mkdir()
    assert rdma_devices(str(tmp_path)) == (("mlx5_0", "mlx5_1"), "")
    assert rdma_devices(str(tmp_path / "absent"))[1].startswith("no RDMA devices")


def test_peermem_detection(tmp_path: Path) -> None:
    modules = tmp_path / "modules"
    modules.write_text("nvidia 1 0 - Live 0x0\nnvidia_peermem 16384 0 - Live 0x0\n")
    assert peermem_loaded(str(modules))
    modules.write_text("nvidia 1 0 - Live 0x0\n")
    assert not peermem_loaded(str(modules))


@pytest.mark.parametrize(
    ("attr", "dmabuf", "peermem", "rdma", "expected", "words"),
    [
        (1, 0, True, True, True, "nvidia_peermem"),
        (1, 1, False, True, True, "dma-buf"),
        (1, 0, False, True, False, "modprobe nvidia_peermem"),
        (0, 1, True, True, False, "does not support"),
        (None, None, True, True, None, "too old"),
        (1, 1, True, False, False, "no RDMA NIC"),
    ],
)
def test_gdr_judgement(attr, dmabuf, peermem, rdma, expected, words) -> None:  # type: ignore[no-untyped-def]
    gdr, reason = judge_gdr(attr, dmabuf, peermem, rdma)
    assert gdr is expected and words in reason


def test_import_failures_are_told_apart() -> None:
    missing = ModuleNotFoundError("No module named 'mooncake'", name="mooncake")
    status = import_failure(missing, module="mooncake", install="pip install 'kvtransport-mooncake[cpu]'")
    assert not status.available and "not installed" in status.reason
    assert status.fix == "pip install 'kvtransport-mooncake[cpu]'"

    verbs = ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
    status = import_failure(verbs, module="mooncake", install="x")
    assert "libibverbs.so.1" in status.reason and status.fix == "apt-get install libibverbs1"

    cuda = ImportError("libcudart.so.12: cannot open shared object file: No such file or directory")
    status = import_failure(
        cuda, module="mooncake", install="x", cpu_build_hint="pip install 'kvtransport-mooncake[cpu]'"
    )
    assert "needs CUDA" in status.reason and "[cpu]" in status.fix


def test_first_party_probes_on_this_host() -> None:
    require_engines()
    cpu_only = not probe_host().cuda_devices
    for name in ("nixl-ucx", "mooncake-gdr"):
        status = load_driver(name).probe()
        assert status.available, f"{name}: {status.reason} ({status.fix})"
        assert status.serves(MemoryKind())
        if cpu_only:
            assert not status.serves(MemoryKind(0))
            assert "CUDA" in status.why_not(MemoryKind(0))
    staged = load_driver("mooncake-staged").probe()
    assert staged.available and staged.serves(MemoryKind())  # host KV through the memcpy engine
    if cpu_only:
        assert not staged.serves(MemoryKind(0)) and "CUDA" in staged.why_not(MemoryKind(0))
    cuda_local = load_driver("cuda-local").probe()
    if cpu_only:
        assert not cuda_local.available and "CUDA" in cuda_local.reason


def test_unusable_ucx_tls_is_named_in_the_reason() -> None:
    require_engines()
    out = run_cli("doctor", "--json", env={"UCX_TLS": "cma,self"})
    doc = json.loads(out.stdout)
    status = doc["drivers"]["nixl-ucx"]["status"]
    if status["available"]:
        pytest.skip("this UCX build accepts UCX_TLS=cma,self here")
    assert "UCX_TLS='cma,self'" in status["reason"] and "UCX_TLS" in status["fix"]


def test_mooncake_rdma_forced_without_devices_is_explained() -> None:
    require_engines()
    if probe_host().rdma_devices:
        pytest.skip("this host has RDMA devices")
    out = run_cli("doctor", "--json", env={"KVTRANSPORT_MOONCAKE_PROTOCOL": "rdma"})
    status = json.loads(out.stdout)["drivers"]["mooncake-gdr"]["status"]
    assert not status["available"]
    assert "KVTRANSPORT_MOONCAKE_PROTOCOL=rdma" in status["reason"] and "RDMA" in status["reason"]
