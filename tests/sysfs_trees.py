"""Writes the sysfs trees that the topology tests read (test_topology writes them into a
temporary folder; ``python -m tests.sysfs_trees DIR`` writes them into DIR to look at).

The trees were generated, not captured: no 8-GPU host is reachable from where kvtransport is
developed and tested. They lay out files and symlinks exactly as Linux does (``devices/pci*``
chains of PCI addresses with ``vendor``, ``class`` and ``numa_node``; ``bus/pci/devices/*``,
``class/infiniband/*`` and ``class/net/*`` as relative symlinks into ``devices``; an RDMA
device's ``device`` link, ``ports/N/state`` and its netdevs under ``device/net``), with only
the files :mod:`kvtransport.spi.topology` reads. A capture of a real host (``cp -P`` of those
files) can replace a tree as is.

- ``dgx-h100``: the published DGX H100 topology (``nvidia-smi topo -m`` on such a host): 8 H100
  GPUs at their PCI addresses (``1b``, ``43``, ``52``, ``61`` on NUMA node 0; ``9d``, ``c3``,
  ``d1``, ``df`` on node 1), each behind a PCIe switch it shares with one ConnectX-7 compute
  NIC (PIX), named as on that host: ``mlx5_0``, ``3``, ``4``, ``5``, ``6``, ``9``, ``10``,
  ``11`` in GPU order, plus two dual-port ConnectX-7 storage cards (``mlx5_1``/``2`` on node 0,
  ``mlx5_7``/``8`` on node 1) on root ports of their own. The NICs' and the bridges' bus
  numbers are modelled (each switch: upstream port, a downstream port per device). The
  compute NICs are InfiniBand (IPoIB netdevs ``ibp*``); ``docker0`` is up and virtual.
- ``one-socket-nics``: a PCIe 8-GPU server with every NIC on socket 0: GPUs 0-1 share a switch
  with ``mlx5_0``, GPUs 2-3 sit behind a switch of their own, ``mlx5_1`` is on a root port of
  another host bridge of node 0; GPUs 4-7 are on node 1, where there is no NIC. RoCE NICs
  (netdevs ``ens*np0``), and an onboard ``eno1`` (physical, up).
- ``namespaced``: a network namespace of a test bed: two GPUs, no RDMA device, and veth rails
  (``veth-kv0``, ``veth-kv1`` up, ``veth-kv2`` down) that have no PCI device.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


class Tree:
    """A sysfs tree being written under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def file(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    def link(self, rel: str, target: str) -> None:
        """A symlink at ``rel`` pointing at ``target`` (both relative to the root), written as
        Linux writes it: relative to the link's folder."""
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(os.path.relpath(self.root / target, path.parent))

    def pci(self, host_bridge: str, chain: list[str], numa: int, vendor: str = "0x8086", cls: str = "0x060400") -> str:
        """A PCI device at the end of ``chain`` below ``host_bridge`` (bridges on the way get
        ``numa_node`` too); returns its folder."""
        folder = f"devices/pci{host_bridge}"
        for address in chain:
            folder += f"/{address}"
            self.file(f"{folder}/numa_node", str(numa))
        self.file(f"{folder}/vendor", vendor)
        self.file(f"{folder}/class", cls)
        self.link(f"bus/pci/devices/{chain[-1]}", folder)
        return folder

    def gpu(self, host_bridge: str, chain: list[str], numa: int) -> None:
        self.pci(host_bridge, chain, numa, vendor="0x10de", cls="0x030200")

    def netdev(self, device: str, name: str, state: str = "up") -> None:
        folder = f"{device}/net/{name}"
        self.file(f"{folder}/operstate", state)
        self.file(f"{folder}/type", "1")
        self.link(f"class/net/{name}", folder)

    def rdma(self, host_bridge: str, chain: list[str], numa: int, name: str, netdev: str = "") -> None:
        device = self.pci(host_bridge, chain, numa, vendor="0x15b3", cls="0x020700")
        folder = f"{device}/infiniband/{name}"
        self.file(f"{folder}/ports/1/state", "4: ACTIVE")
        self.link(f"{folder}/device", device)
        self.link(f"class/infiniband/{name}", folder)
        if netdev:
            self.netdev(device, netdev)

    def virtual_net(self, name: str, state: str = "up", kind: str = "1") -> None:
        folder = f"devices/virtual/net/{name}"
        self.file(f"{folder}/operstate", state)
        self.file(f"{folder}/type", kind)
        self.link(f"class/net/{name}", folder)


def _switch(bus: int) -> list[str]:
    """Root port, switch upstream port and a downstream port below host bridge ``bus``."""
    return [f"0000:{bus:02x}:01.0", f"0000:{bus + 1:02x}:00.0"]


def write_dgx_h100(root: Path) -> None:
    tree = Tree(root)
    # (host bridge bus, GPU bus, compute NIC bus, NIC name, NUMA node)
    pairs = [
        (0x15, 0x1B, 0x18, "mlx5_0", 0),
        (0x3D, 0x43, 0x40, "mlx5_3", 0),
        (0x4C, 0x52, 0x4F, "mlx5_4", 0),
        (0x5B, 0x61, 0x5E, "mlx5_5", 0),
        (0x97, 0x9D, 0x9A, "mlx5_6", 1),
        (0xBD, 0xC3, 0xC0, "mlx5_9", 1),
        (0xCB, 0xD1, 0xCE, "mlx5_10", 1),
        (0xD9, 0xDF, 0xDC, "mlx5_11", 1),
    ]
    for bridge, gpu, nic, name, numa in pairs:
        up = _switch(bridge)
        down = f"0000:{bridge + 2:02x}"
        tree.gpu(f"0000:{bridge:02x}", [*up, f"{down}:01.0", f"0000:{gpu:02x}:00.0"], numa)
        tree.rdma(f"0000:{bridge:02x}", [*up, f"{down}:00.0", f"0000:{nic:02x}:00.0"], numa, name, f"ibp{nic}s0")
    for bridge, bus, names, numa in ((0x27, 0x2A, ("mlx5_1", "mlx5_2"), 0), (0xA7, 0xAA, ("mlx5_7", "mlx5_8"), 1)):
        for function, name in enumerate(names):
            chain = [f"0000:{bridge:02x}:01.0", f"0000:{bus:02x}:00.{function}"]
            tree.rdma(f"0000:{bridge:02x}", chain, numa, name, f"enp{bus}s0f{function}np{function}")
    tree.virtual_net("lo", kind="772")
    tree.virtual_net("docker0")


def write_one_socket_nics(root: Path) -> None:
    tree = Tree(root)
    # Node 0, host bridge 0x16: GPUs 0 and 1 and mlx5_0 behind one switch.
    up = _switch(0x16)
    tree.gpu("0000:16", [*up, "0000:18:00.0", "0000:1a:00.0"], 0)
    tree.gpu("0000:16", [*up, "0000:18:01.0", "0000:1b:00.0"], 0)
    tree.rdma("0000:16", [*up, "0000:18:02.0", "0000:1c:00.0"], 0, "mlx5_0", "ens1np0")
    # Node 0, host bridge 0x38: GPUs 2 and 3 behind a switch without a NIC.
    up = _switch(0x38)
    tree.gpu("0000:38", [*up, "0000:3a:00.0", "0000:3c:00.0"], 0)
    tree.gpu("0000:38", [*up, "0000:3a:01.0", "0000:3d:00.0"], 0)
    # Node 0, host bridge 0x4a: mlx5_1 on a root port; the onboard NIC on host bridge 0x00.
    tree.rdma("0000:4a", ["0000:4a:01.0", "0000:4c:00.0"], 0, "mlx5_1", "ens2np0")
    tree.netdev(tree.pci("0000:00", ["0000:00:1c.0", "0000:05:00.0"], 0, cls="0x020000"), "eno1")
    # Node 1: four GPUs, no NIC.
    for bridge, gpus in ((0x98, (0x9C, 0x9D)), (0xB8, (0xBC, 0xBD))):
        up = _switch(bridge)
        for port, gpu in enumerate(gpus):
            tree.gpu(f"0000:{bridge:02x}", [*up, f"0000:{bridge + 2:02x}:0{port}.0", f"0000:{gpu:02x}:00.0"], 1)
    tree.virtual_net("lo", kind="772")


def write_namespaced(root: Path) -> None:
    tree = Tree(root)
    up = _switch(0x16)
    tree.gpu("0000:16", [*up, "0000:18:00.0", "0000:1a:00.0"], 0)
    tree.gpu("0000:16", [*up, "0000:18:01.0", "0000:1b:00.0"], 0)
    tree.virtual_net("lo", kind="772")
    tree.virtual_net("veth-kv1")
    tree.virtual_net("veth-kv0")
    tree.virtual_net("veth-kv2", state="down")


TREES = {"dgx-h100": write_dgx_h100, "one-socket-nics": write_one_socket_nics, "namespaced": write_namespaced}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tests.sysfs_trees DIR", file=sys.stderr)
        return 2
    base = Path(argv[1])
    for name, write in TREES.items():
        if (base / name).exists():
            print(f"{base / name} exists; remove it first", file=sys.stderr)
            return 1
        write(base / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
