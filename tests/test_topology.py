"""Rails chosen by topology (spi.topology): the sysfs trees tests/sysfs_trees.py writes (a DGX
H100 layout, a host with every NIC on one socket, a network namespace with veth rails), this
machine's real /sys, forcing rails, and the device lists the engines take."""

from __future__ import annotations

import atexit
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtransport.spi.errors import ConfigError
from kvtransport.spi.topology import (
    ENV_RAILS,
    ENV_RAILS_INSIST,
    Gpu,
    GpuRails,
    Level,
    PciPlace,
    Rail,
    Topology,
    choose_rails,
    distance,
    format_rails,
    mooncake_device_names,
    nearest_rails,
    parse_rails,
    read_topology,
    ucx_net_devices,
)

from .sysfs_trees import TREES

#: The trees, written once for this module (a few hundred files and links: generated, not kept
#: in the repository).
SYSFS = Path(tempfile.mkdtemp(prefix="kvt-sysfs-"))
atexit.register(shutil.rmtree, SYSFS, True)
for _name, _write in TREES.items():
    _write(SYSFS / _name)
DGX = read_topology(SYSFS / "dgx-h100")
ONE_SOCKET = read_topology(SYSFS / "one-socket-nics")
NAMESPACED = read_topology(SYSFS / "namespaced")


def by_gpu(topology: Topology, env: dict[str, str] | None = None) -> dict[str, tuple[str, ...]]:
    return {g.gpu: g.names for g in choose_rails(topology, env or {})}


def test_dgx_h100_each_gpu_uses_the_nic_behind_its_own_switch() -> None:
    expected = ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"]
    chosen = choose_rails(DGX, {})
    assert [g.gpu for g in chosen] == [f"cuda:{i}" for i in range(8)]
    assert [g.names for g in chosen] == [(n,) for n in expected]
    assert {g.level for g in chosen} == {Level.PIX}
    assert chosen[0].reason == "cuda:0 -> mlx5_0 (PIX: same PCIe switch 0000:16:00.0)"
    assert [g.numa for g in chosen] == [0] * 4 + [1] * 4
    # The storage NICs, docker0 and lo are never a GPU's rail.
    assert {r.name for r in DGX.rdma} == {f"mlx5_{i}" for i in range(12)}
    assert [r.name for r in DGX.virtual] == ["docker0"] and not DGX.ip
    assert DGX.rail("mlx5_0") == Rail(
        "mlx5_0",
        "rdma",
        ("ibp24s0",),
        PciPlace("pci0000:15", ("0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0"), 0),
        1,
    )


def test_dgx_h100_gpus_named_in_the_cuda_drivers_order() -> None:
    order = ["00000000:DF:00.0", "0000:1B:00.0"]  # as cuDeviceGetPCIBusId spells them
    topology = read_topology(SYSFS / "dgx-h100", order)
    assert [(g.name, g.pci) for g in topology.gpus] == [("cuda:0", "0000:df:00.0"), ("cuda:1", "0000:1b:00.0")]
    assert by_gpu(topology) == {"cuda:0": ("mlx5_11",), "cuda:1": ("mlx5_0",)}


def test_one_socket_nics_far_gpus_get_every_nic_of_socket_0_and_are_told_why() -> None:
    chosen = {g.gpu: g for g in choose_rails(ONE_SOCKET, {})}
    assert [chosen[f"cuda:{i}"].level for i in range(8)] == [Level.PIX] * 2 + [Level.NODE] * 2 + [Level.SYS] * 4
    assert chosen["cuda:0"].names == chosen["cuda:1"].names == ("mlx5_0",)
    for i in range(2, 8):
        assert chosen[f"cuda:{i}"].names == ("mlx5_0", "mlx5_1")  # eno1 is no rail: the host has RDMA
    assert "same NUMA node 0, different PCIe host bridges" in chosen["cuda:2"].reason
    far = chosen["cuda:5"].reason
    assert far.startswith("cuda:5 -> mlx5_0, mlx5_1 (SYS: cross-socket")
    assert "NUMA node 1" in far and "NUMA node 0" in far
    assert [r.name for r in ONE_SOCKET.ip] == ["eno1"]


def test_namespaced_veth_rails_count_as_equally_near() -> None:
    chosen = choose_rails(NAMESPACED, {})
    assert [g.names for g in chosen] == [("veth-kv0", "veth-kv1")] * 2  # veth-kv2 is down
    assert {g.level for g in chosen} == {Level.VIRT}
    assert "distance unknown, counted equal" in chosen[0].reason
    assert any("no RDMA devices" in n for n in NAMESPACED.notes)
    assert ucx_net_devices(chosen[0]) == "veth-kv0,veth-kv1"
    assert mooncake_device_names(chosen[0]) == ""


def test_this_machines_sys_reads_without_crashing_and_says_what_is_missing() -> None:
    topology = read_topology("/sys")
    chosen = choose_rails(topology, {})
    assert len(chosen) == len(topology.gpus)
    if not topology.gpus:
        assert any(n.startswith("no GPUs") for n in topology.notes)
    if not Path("/sys/class/infiniband").is_dir():
        assert not topology.rdma and any("no RDMA devices" in n for n in topology.notes)
    assert all(r.name != "lo" for r in topology.all_rails)


def test_a_missing_root_gives_empty_results_with_reasons(tmp_path: Path) -> None:
    topology = read_topology(tmp_path / "nothing")
    assert topology.gpus == () and topology.all_rails == () and choose_rails(topology, {}) == ()
    assert len(topology.notes) == 3


def test_soft_roce_sits_where_its_netdev_is_and_down_ports_are_left_out(tmp_path: Path) -> None:
    from .sysfs_trees import Tree

    tree = Tree(tmp_path)
    tree.gpu("0000:16", ["0000:16:01.0", "0000:17:00.0", "0000:18:00.0", "0000:1a:00.0"], 0)
    device = tree.pci("0000:16", ["0000:16:01.0", "0000:17:00.0", "0000:18:01.0", "0000:1b:00.0"], 0, cls="0x020000")
    tree.netdev(device, "ens5")
    tree.file("devices/virtual/infiniband/rxe0/ports/1/state", "4: ACTIVE")
    tree.file("devices/virtual/infiniband/rxe0/ports/1/gid_attrs/ndevs/0", "ens5")
    tree.link("class/infiniband/rxe0", "devices/virtual/infiniband/rxe0")
    tree.rdma("0000:16", ["0000:16:01.0", "0000:17:00.0", "0000:18:02.0", "0000:1c:00.0"], 0, "mlx5_0")
    tree.file(
        "devices/pci0000:16/0000:16:01.0/0000:17:00.0/0000:18:02.0/0000:1c:00.0/infiniband/mlx5_0/ports/1/state",
        "1: DOWN",
    )
    topology = read_topology(tmp_path)
    assert [r.name for r in topology.rdma] == ["rxe0"] and topology.rdma[0].pci == "0000:1b:00.0"
    assert any("mlx5_0 left out: no ACTIVE port" in n for n in topology.notes)
    (only,) = choose_rails(topology, {})
    assert only.names == ("rxe0",) and only.level == Level.PIX


# --- forcing --------------------------------------------------------------------------------


def test_a_forced_rail_on_the_wrong_numa_node_is_refused_loudly_unless_insisted() -> None:
    env = {ENV_RAILS: "cuda:4=mlx5_0"}
    with pytest.raises(ConfigError) as err:
        choose_rails(DGX, env)
    message = str(err.value)
    for part in ("cuda:4", "mlx5_0", "NUMA node 1", "NUMA node 0", f"{ENV_RAILS_INSIST}=1"):
        assert part in message
    chosen = by_gpu(DGX, {**env, ENV_RAILS_INSIST: "1"})
    assert chosen["cuda:4"] == ("mlx5_0",) and chosen["cuda:0"] == ("mlx5_0",) and chosen["cuda:5"] == ("mlx5_9",)
    forced = choose_rails(DGX, {**env, ENV_RAILS_INSIST: "1"}, warn=False)[4]
    assert forced.forced and "forced by KVTRANSPORT_RAILS" in forced.reason and "insisted" in forced.reason


def test_forced_rails_per_gpu_and_as_a_default() -> None:
    env = {ENV_RAILS: "mlx5_1,mlx5_2;cuda:0=mlx5_0"}
    with pytest.raises(ConfigError, match="cuda:4"):  # the default puts node-1 GPUs on node-0 NICs
        choose_rails(DGX, env)
    chosen = by_gpu(ONE_SOCKET, {ENV_RAILS: "cuda:2=mlx5_1;cuda:3=eno1"})
    assert chosen["cuda:2"] == ("mlx5_1",) and chosen["cuda:3"] == ("eno1",) and chosen["cuda:0"] == ("mlx5_0",)


def test_a_forced_rail_or_gpu_that_does_not_exist_is_refused_with_what_exists() -> None:
    with pytest.raises(ConfigError, match=r"no rail 'mlx5_99'.*rails here: mlx5_0, mlx5_1, eno1"):
        choose_rails(ONE_SOCKET, {ENV_RAILS: "mlx5_99"})
    with pytest.raises(ConfigError, match=r"cuda:8.*GPUs here: cuda:0, .*cuda:7"):
        choose_rails(ONE_SOCKET, {ENV_RAILS: "cuda:8=mlx5_0"})
    for bad in ("gpu0=mlx5_0", "cuda:0=", "mlx5_0;mlx5_1", "cuda:0=a b"):
        with pytest.raises(ConfigError, match=ENV_RAILS):
            parse_rails(bad)
    with pytest.raises(ConfigError, match=ENV_RAILS_INSIST):
        choose_rails(DGX, {ENV_RAILS: "cuda:4=mlx5_0", ENV_RAILS_INSIST: "maybe"})


# --- the engines' lists ---------------------------------------------------------------------


def test_engine_device_lists_from_the_recorded_trees() -> None:
    far = choose_rails(ONE_SOCKET, {})[6]
    assert mooncake_device_names(far) == "mlx5_0,mlx5_1"
    assert ucx_net_devices(far) == "mlx5_0:1,mlx5_1:1"
    assert ucx_net_devices(choose_rails(DGX, {})[7]) == "mlx5_11:1"


# --- properties -----------------------------------------------------------------------------

_numa = st.one_of(st.none(), st.integers(0, 1))


@st.composite
def places(draw: st.DrawFn) -> PciPlace:
    bridge = draw(st.sampled_from(["pci0000:00", "pci0000:40", "pci0000:80"]))
    chain = draw(st.lists(st.sampled_from(["0000:01:00.0", "0000:02:00.0", "0000:03:00.0"]), min_size=1, max_size=4))
    return PciPlace(bridge, tuple(chain), draw(_numa))


@st.composite
def topologies(draw: st.DrawFn) -> Topology:
    gpus = tuple(Gpu(i, p) for i, p in enumerate(draw(st.lists(places(), min_size=1, max_size=4))))
    names = draw(st.lists(st.from_regex(r"mlx5_[0-9]{1,2}", fullmatch=True), unique=True, max_size=6))
    rails = tuple(Rail(n, "rdma", (), draw(st.one_of(st.none(), places()))) for n in names)
    return Topology(gpus=gpus, rdma=rails)


@given(topologies(), st.randoms())
def test_each_gpu_gets_every_rail_at_its_minimum_level_in_a_fixed_order(topology: Topology, rnd: random.Random) -> None:
    chosen = nearest_rails(topology)
    shuffled = list(topology.rdma)
    rnd.shuffle(shuffled)
    assert nearest_rails(Topology(gpus=topology.gpus, rdma=tuple(shuffled))) == chosen
    for gpu, result in zip(topology.gpus, chosen, strict=True):
        levels = {r.name: distance(gpu.place, r)[0] for r in topology.rdma}
        if not levels:
            assert result.rails == () and result.level is None
            continue
        best = min(levels.values())
        assert result.level == best and result.rails
        assert set(result.names) == {n for n, lv in levels.items() if lv == best}
        assert result.reason.startswith(f"{gpu.name} -> {', '.join(result.names)} ({best.name}: ")


@given(topologies())
def test_a_rail_at_the_gpus_own_place_is_as_near_as_can_be(topology: Topology) -> None:
    # A GPU and a rail at the same place are as near as two devices can be below one bridge.
    for gpu in topology.gpus:
        level, _ = distance(gpu.place, Rail("x", "rdma", (), gpu.place))
        assert level in (Level.PIX, Level.PXB)


_rail_names = st.lists(st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True), min_size=1, max_size=3).map(tuple)


@given(st.dictionaries(st.one_of(st.none(), st.integers(0, 16)), _rail_names, min_size=1, max_size=5))
def test_forced_rails_text_round_trips(spec: dict[int | None, tuple[str, ...]]) -> None:
    assert parse_rails(format_rails(spec)) == spec


# --- kvtransport doctor ---------------------------------------------------------------------


def test_doctor_lists_each_gpus_rails_and_why() -> None:
    from kvtransport.tools.doctor import rails_document, rails_lines

    lines = rails_lines(ONE_SOCKET, choose_rails(ONE_SOCKET, {}))
    assert lines[0].startswith("  rails:   RDMA devices: mlx5_0, mlx5_1 (from ")
    assert lines[1] == "    cuda:0 -> mlx5_0 (PIX: same PCIe switch 0000:17:00.0)"
    assert len(lines) == 9 and "cross-socket" in lines[8]
    doc = rails_document(NAMESPACED, choose_rails(NAMESPACED, {}))
    assert doc["tier"] == "virtual IP interfaces (no RDMA device, no PCI network device)"
    assert doc["gpus"] == [
        {
            "gpu": f"cuda:{i}",
            "pci": pci,
            "numa": 0,
            "rails": ["veth-kv0", "veth-kv1"],
            "level": "VIRT",
            "forced": False,
            "reason": choose_rails(NAMESPACED, {})[i].reason,
        }
        for i, pci in enumerate(["0000:1a:00.0", "0000:1b:00.0"])
    ]
    empty = rails_lines(read_topology("/nonexistent"), ())
    assert empty[0].startswith("  rails:   none") and any("no GPUs" in line for line in empty)


# --- what the drivers pass their engines (pure: the engines need GPUs and RDMA to run) --------


def rails_of(topology: Topology, env: dict[str, str] | None = None) -> Callable[[int], GpuRails | None]:
    chosen = choose_rails(topology, env or {})
    return lambda index: next((g for g in chosen if g.gpu == f"cuda:{index}"), None)


def test_mooncake_is_given_rdma_rails_only_when_the_user_forces_them_under_rdma() -> None:
    """Topology's choice alone leaves Mooncake every device (its own nearest-first choice keeps
    a way to peers behind other NICs); forced rails are passed, RDMA ones only."""
    from kvtransport_mooncake.rails import device_filter

    far = rails_of(ONE_SOCKET)
    assert device_filter("rdma", 6, {}, far)[0] == ""
    assert "force rails with KVTRANSPORT_RAILS" in device_filter("rdma", 6, {}, far)[1]
    forced = rails_of(ONE_SOCKET, {ENV_RAILS: "cuda:6=mlx5_0,mlx5_1", ENV_RAILS_INSIST: "1"})
    assert device_filter("rdma", 6, {}, forced)[0] == "mlx5_0,mlx5_1"
    assert device_filter("rdma", 1, {}, rails_of(DGX, {ENV_RAILS: "cuda:1=mlx5_3"}))[0] == "mlx5_3"
    assert device_filter("tcp", 6, {}, forced) == ("", "protocol tcp: no RDMA device to choose")
    assert device_filter("rdma", None, {}, forced)[0] == ""  # host memory: Mooncake's choice
    assert device_filter("rdma", 9, {}, far)[0] == ""
    assert device_filter("rdma", 6, {"KVTRANSPORT_MOONCAKE_DEVICE": "mlx5_1"}, far) == (
        "mlx5_1",
        "set by KVTRANSPORT_MOONCAKE_DEVICE",
    )
    ip_only = rails_of(ONE_SOCKET, {ENV_RAILS: "cuda:2=eno1"})  # an IP rail: nothing for Mooncake
    assert device_filter("rdma", 2, {}, ip_only)[0] == ""


def test_nixl_agents_get_a_device_list_only_for_forced_rails_and_never_over_the_users() -> None:
    from kvtransport_nixl.rails import ENV_UCX_NET_DEVICES, net_devices

    # Topology's choice alone: UCX keeps every device (a list would drop its TCP devices).
    assert net_devices(6, {}, rails_of(ONE_SOCKET))[0] == ""
    assert net_devices(0, {}, rails_of(DGX))[0] == ""
    forced = rails_of(ONE_SOCKET, {ENV_RAILS: "cuda:6=mlx5_0,mlx5_1", ENV_RAILS_INSIST: "1"})
    assert net_devices(6, {}, forced)[0] == "mlx5_0:1, mlx5_1:1"  # NIXL splits on ", "
    kept = net_devices(6, {ENV_UCX_NET_DEVICES: "mlx5_4:1"}, forced)
    assert kept == ("", "UCX_NET_DEVICES=mlx5_4:1 set by the user: kept")
    assert net_devices(None, {}, forced)[0] == ""
    assert net_devices(0, {}, rails_of(NAMESPACED, {ENV_RAILS: "veth-kv1"}))[0] == "veth-kv1"
