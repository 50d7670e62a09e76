"""Rails chosen by topology: which network devices each GPU of this host should send through,
and why.

This module owns reading the host's PCIe and NUMA layout from sysfs (a root that defaults to
``/sys`` and can be pointed at a recorded tree), the distance between each GPU and each rail,
the per-GPU choice of the nearest rails, the user's forcing of rails (``KVTRANSPORT_RAILS``,
``KVTRANSPORT_RAILS_INSIST``) and the device lists the engines take (Mooncake's
``device_name``, UCX's ``UCX_NET_DEVICES``). It imports no transfer engine; reading never
raises (what cannot be read is left out, with a note), forcing raises
:class:`~kvtransport.spi.errors.ConfigError`.

What is a rail, in tiers (the first tier the host has is the one used):

1. RDMA devices (``/sys/class/infiniband/*``) with at least one ACTIVE port (or no port state
   to read), each with its netdevs (``device/net/*``, or ``ports/*/gid_attrs/ndevs/*`` for
   soft RoCE, whose PCI device is then its netdev's).
2. IP interfaces backed by a PCI device (``/sys/class/net/*`` resolving under a PCI address),
   up (``operstate`` ``up``), loopback excluded.
3. Virtual IP interfaces (no PCI device: veth pairs of a network namespace, the simulated rails
   of a test bed), up. They are rails only where nothing physical is, because on a real host
   bridges and tunnels (``docker0``) are up too and carry no KV. Sysfs does not say whether an
   interface has an address; an interface up without one is still listed (force rails to
   leave it out). Their NUMA node and PCIe distance are unknown: every one counts as equally
   near every GPU (level ``VIRT``), and the reason says so.

The distance of a GPU to a rail follows ``nvidia-smi topo -m``'s levels, nearest first, from
the two devices' resolved PCI paths (``/sys/devices/pci0000:xx/0000:..:../...``):

- ``PIX``: both sit right below the same PCIe switch (one switch between them);
- ``PXB``: they share a PCIe path below one root port, through more than one switch;
- ``PHB``: same PCIe host bridge (root complex), different root ports;
- ``NODE``: different host bridges of one NUMA node (or both NUMA nodes unknown);
- ``SYS``: different NUMA nodes (crossing the inter-socket link);
- ``VIRT``: the rail has no PCI device; distance unknown, counted equal.

Per GPU the rails at its best level are its rails, ordered by name (natural order:
``mlx5_2`` before ``mlx5_10``). With several, large transfers are striped across them by the
engines themselves: Mooncake slices a batch across the devices of its ``device_name`` list,
UCX across the rails of ``UCX_NET_DEVICES``; kvtransport only hands them the list.

GPUs are NVIDIA display or 3D controllers (vendor ``0x10de``, class ``0x0300xx``/``0x0302xx``)
under ``/sys/bus/pci/devices``, named ``cuda:N`` in the order of the CUDA driver's PCI bus ids
when it is given (:func:`host_rails` passes the probe's), else in PCI bus order (the order of
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and of ``nvidia-smi``).
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvtransport.spi.env import env_flag
from kvtransport.spi.errors import ConfigError
from kvtransport.spi.probe import probe_host

log = logging.getLogger(__name__)

ENV_RAILS = "KVTRANSPORT_RAILS"
ENV_RAILS_INSIST = "KVTRANSPORT_RAILS_INSIST"
ENV_VARS = (ENV_RAILS, ENV_RAILS_INSIST)

_NVIDIA = "0x10de"
#: PCI classes of GPUs: display controller (VGA) and 3D controller (data-centre GPUs).
_GPU_CLASSES = ("0x0300", "0x0302")
_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_HOST_BRIDGE = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")
_GPU_NAME = re.compile(r"^cuda:([0-9]{1,4})$")
_RAIL_NAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,64}$")
#: ``ARPHRD_LOOPBACK`` (``/sys/class/net/X/type``).
_LOOPBACK_TYPE = "772"

RailKind = Literal["rdma", "ip"]


class Level(enum.IntEnum):
    """How far a rail is from a GPU, nearest first (``nvidia-smi topo -m``'s names)."""

    PIX = 0
    PXB = 1
    PHB = 2
    NODE = 3
    SYS = 4
    VIRT = 5


@dataclass(frozen=True)
class PciPlace:
    """Where a PCI device sits: its host bridge, the chain of PCI addresses from the root port
    down to it, and its NUMA node (``None``: unknown, ``numa_node`` -1 or unreadable)."""

    host_bridge: str
    chain: tuple[str, ...]
    numa: int | None

    @property
    def address(self) -> str:
        return self.chain[-1] if self.chain else ""


@dataclass(frozen=True)
class Rail:
    """One network device KV can leave this host through."""

    name: str  # the RDMA device (mlx5_0) or the interface (eth0)
    kind: RailKind
    netdevs: tuple[str, ...] = ()
    place: PciPlace | None = None  # None: virtual, no PCI device
    port: int = 1  # the RDMA port UCX names (mlx5_0:1)

    @property
    def pci(self) -> str:
        return self.place.address if self.place else ""

    @property
    def numa(self) -> int | None:
        return self.place.numa if self.place else None

    @property
    def netdev(self) -> str:
        return self.netdevs[0] if self.netdevs else ""


@dataclass(frozen=True)
class Gpu:
    index: int
    place: PciPlace

    @property
    def name(self) -> str:
        return f"cuda:{self.index}"

    @property
    def pci(self) -> str:
        return self.place.address


@dataclass(frozen=True)
class GpuRails:
    """The rails one GPU uses, at which level, and the sentence that says why."""

    gpu: str
    pci: str
    numa: int | None
    rails: tuple[Rail, ...]
    level: Level | None  # None: no rail at all, or forced rails
    reason: str
    forced: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.rails)


@dataclass(frozen=True)
class Topology:
    """What sysfs says of this host's GPUs and network devices."""

    gpus: tuple[Gpu, ...] = ()
    rdma: tuple[Rail, ...] = ()
    ip: tuple[Rail, ...] = ()
    virtual: tuple[Rail, ...] = ()
    root: str = "/sys"
    notes: tuple[str, ...] = field(default=())

    @property
    def all_rails(self) -> tuple[Rail, ...]:
        return self.rdma + self.ip + self.virtual

    def candidates(self) -> tuple[tuple[Rail, ...], str]:
        """The rails GPUs choose among (the first tier the host has), and which tier."""
        if self.rdma:
            return self.rdma, "RDMA devices"
        if self.ip:
            return self.ip, "IP interfaces (no RDMA device)"
        if self.virtual:
            return self.virtual, "virtual IP interfaces (no RDMA device, no PCI network device)"
        return (), ""

    def rail(self, name: str) -> Rail | None:
        for rail in self.all_rails:
            if rail.name == name:
                return rail
        return None


# --- reading sysfs --------------------------------------------------------------------------


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _place(resolved: Path) -> PciPlace | None:
    """The PCI place of a resolved sysfs device path (the deepest PCI address in it: a netdev's
    path goes on below its PCI function, ``.../0000:00:03.0/virtio2/net/eth0``)."""
    parts = resolved.parts
    bridges = [i for i, p in enumerate(parts) if _HOST_BRIDGE.match(p)]
    if not bridges:
        return None
    start = bridges[-1]
    chain: list[str] = []
    last = start
    for i in range(start + 1, len(parts)):
        if _PCI_ADDRESS.match(parts[i]):
            chain.append(parts[i])
            last = i
        elif chain:
            break
    if not chain:
        return None
    numa_text = _read(Path(*parts[: last + 1]) / "numa_node")
    try:
        numa: int | None = int(numa_text)
    except ValueError:
        numa = None
    if numa is not None and numa < 0:
        numa = None
    return PciPlace(parts[start], tuple(chain), numa)


def _resolve(path: Path) -> Path | None:
    try:
        return path.resolve(strict=True)
    except (OSError, RuntimeError):
        return None


def _natural(name: str) -> tuple[tuple[tuple[int, str], ...], str]:
    """Natural order (``mlx5_2`` before ``mlx5_10``), ties (``mlx5_1``, ``mlx5_01``) by the name."""
    return tuple((int(tok), "") if tok.isdigit() else (-1, tok) for tok in re.findall(r"\d+|\D+", name)), name


def _by_name(rails: Iterable[Rail]) -> tuple[Rail, ...]:
    return tuple(sorted(rails, key=lambda r: _natural(r.name)))


def _read_gpus(root: Path, cuda_order: Sequence[str] | None) -> tuple[tuple[Gpu, ...], str]:
    devices = root / "bus" / "pci" / "devices"
    found: dict[str, PciPlace] = {}
    for address in _listdir(devices):
        entry = devices / address
        if _read(entry / "vendor").lower() != _NVIDIA:
            continue
        if not _read(entry / "class").lower().startswith(_GPU_CLASSES):
            continue
        resolved = _resolve(entry)
        place = _place(resolved) if resolved else None
        if place is not None:
            found[address.lower()] = place
    if not found:
        where = "no PCI devices listed" if not _listdir(devices) else "no NVIDIA GPU among the PCI devices"
        return (), f"no GPUs ({where} under {devices})"
    if cuda_order is None:
        return tuple(Gpu(i, found[a]) for i, a in enumerate(sorted(found))), ""
    gpus = []
    for index, bus_id in enumerate(cuda_order):
        place = found.get(_normal_bus_id(bus_id))
        if place is not None:
            gpus.append(Gpu(index, place))
    note = "" if gpus else f"none of the CUDA devices' PCI addresses ({', '.join(cuda_order)}) is under {devices}"
    return tuple(gpus), note


def _normal_bus_id(bus_id: str) -> str:
    """CUDA's ``00000000:1B:00.0`` or ``0000:1B:00.0`` as sysfs spells it (``0000:1b:00.0``)."""
    bus_id = bus_id.strip().lower()
    domain, _, rest = bus_id.partition(":")
    return f"{int(domain, 16):04x}:{rest}" if rest and re.fullmatch(r"[0-9a-f]+", domain) else bus_id


def _active_port(ports: Path) -> int | None:
    """The lowest ACTIVE port of an RDMA device; 1 when no port state can be read; ``None``
    when every port it has is down."""
    names = [p for p in _listdir(ports) if p.isdigit()]
    if not names:
        return 1
    states = {int(p): _read(ports / p / "state") for p in names}
    if not any(states.values()):
        return min(states)
    active = [p for p, state in states.items() if "ACTIVE" in state.upper()]
    return min(active) if active else None


def _read_rdma(root: Path) -> tuple[tuple[Rail, ...], list[str]]:
    base = root / "class" / "infiniband"
    rails, notes = [], []
    if not base.is_dir():
        return (), [f"no RDMA devices ({base} does not exist)"]
    for name in _listdir(base):
        entry = base / name
        port = _active_port(entry / "ports")
        if port is None:
            notes.append(f"RDMA device {name} left out: no ACTIVE port")
            continue
        netdevs = _listdir(entry / "device" / "net")
        if not netdevs:
            ndevs = {
                _read(entry / "ports" / p / "gid_attrs" / "ndevs" / g)
                for p in _listdir(entry / "ports")
                for g in _listdir(entry / "ports" / p / "gid_attrs" / "ndevs")
            }
            netdevs = sorted(n for n in ndevs if n)
        device = _resolve(entry / "device")
        place = _place(device) if device else None
        if place is None and netdevs:
            # Soft RoCE (rxe, siw) has no PCI device of its own: it sits where its netdev does.
            net = _resolve(root / "class" / "net" / netdevs[0])
            place = _place(net) if net else None
        rails.append(Rail(name, "rdma", tuple(netdevs), place, port))
    if not rails and not notes:
        notes.append(f"no RDMA devices under {base}")
    return _by_name(rails), notes


def _read_ip(root: Path, behind_rdma: set[str]) -> tuple[tuple[Rail, ...], tuple[Rail, ...], list[str]]:
    base = root / "class" / "net"
    physical, virtual = [], []
    for name in _listdir(base):
        entry = base / name
        if name == "lo" or _read(entry / "type") == _LOOPBACK_TYPE or name in behind_rdma:
            continue
        if _read(entry / "operstate").lower() != "up":
            continue
        resolved = _resolve(entry)
        place = _place(resolved) if resolved else None
        if place is None:
            virtual.append(Rail(name, "ip", (name,), None))
        else:
            physical.append(Rail(name, "ip", (name,), place))
    notes = [] if physical or virtual else [f"no IP interface up under {base} (loopback aside)"]
    return _by_name(physical), _by_name(virtual), notes


def read_topology(root: str | os.PathLike[str] = "/sys", cuda_order: Sequence[str] | None = None) -> Topology:
    """This host's GPUs and rails as sysfs under ``root`` lays them out. ``cuda_order``: the
    CUDA devices' PCI bus ids, in CUDA index order (``None``: PCI bus order). Never raises."""
    path = Path(root)
    notes: list[str] = []
    gpus, gpu_note = _read_gpus(path, cuda_order)
    if gpu_note:
        notes.append(gpu_note)
    rdma, rdma_notes = _read_rdma(path)
    notes += rdma_notes
    behind = {n for r in rdma for n in r.netdevs}
    ip, virtual, ip_notes = _read_ip(path, behind)
    notes += ip_notes
    return Topology(gpus, rdma, ip, virtual, str(path), tuple(notes))


# --- distance and choice (pure) ---------------------------------------------------------------


def distance(gpu: PciPlace, rail: Rail) -> tuple[Level, str]:
    """The level between a GPU and a rail, and what it means for this pair."""
    if rail.place is None:
        return Level.VIRT, "virtual interface without a PCI device: distance unknown, counted equal"
    place = rail.place
    if gpu.host_bridge == place.host_bridge:
        common = 0
        for a, b in zip(gpu.chain, place.chain, strict=False):
            if a != b:
                break
            common += 1
        if common == 0:
            return Level.PHB, f"same PCIe host bridge {gpu.host_bridge}, different root ports"
        # Below the common ancestor each device has a downstream port and itself: one switch.
        if len(gpu.chain) - common == 2 and len(place.chain) - common == 2 and common >= 2:
            return Level.PIX, f"same PCIe switch {gpu.chain[common - 1]}"
        return Level.PXB, f"same PCIe tree below {gpu.chain[common - 1]}, through more than one switch"
    if gpu.numa == place.numa:
        where = f"NUMA node {gpu.numa}" if gpu.numa is not None else "NUMA node (both unknown)"
        return Level.NODE, f"same {where}, different PCIe host bridges"
    if gpu.numa is None or place.numa is None:
        # One side's node unknown (no numa_node, or -1): it may be the same socket; not ranked
        # below a rail known to share the GPU's node, nor called cross-socket.
        return Level.NODE, f"NUMA node unknown (GPU on {_numa(gpu.numa)}, rail on {_numa(place.numa)})"
    return Level.SYS, f"cross-socket: GPU on NUMA node {_numa(gpu.numa)}, rail on NUMA node {_numa(place.numa)}"


def _numa(numa: int | None) -> str:
    return "?" if numa is None else str(numa)


def nearest(gpu: Gpu, rails: Iterable[Rail], tier: str = "") -> GpuRails:
    """The rails at ``gpu``'s best level, in natural name order, with the reason."""
    measured = [(distance(gpu.place, r), r) for r in rails]
    if not measured:
        why = f"no rail on this host{' (' + tier + ')' if tier else ''}"
        return GpuRails(gpu.name, gpu.pci, gpu.place.numa, (), None, f"{gpu.name} -> none ({why})")
    best = min(level for (level, _), _ in measured)
    chosen = sorted(((d, r) for (lv, d), r in measured if lv == best), key=lambda x: _natural(x[1].name))
    names = ", ".join(r.name for _, r in chosen)
    details = {d for d, _ in chosen}
    if len(details) == 1:
        detail = details.pop()
    else:
        detail = "; ".join(f"{r.name}: {d}" for d, r in chosen)
    if best == Level.SYS:
        detail += f"; no rail on the GPU's NUMA node {_numa(gpu.place.numa)}"
    reason = f"{gpu.name} -> {names} ({best.name}: {detail})"
    return GpuRails(gpu.name, gpu.pci, gpu.place.numa, tuple(r for _, r in chosen), best, reason)


def nearest_rails(topology: Topology) -> tuple[GpuRails, ...]:
    """Every GPU's nearest rails, in GPU order."""
    rails, tier = topology.candidates()
    return tuple(nearest(gpu, rails, tier) for gpu in topology.gpus)


# --- forcing --------------------------------------------------------------------------------

#: A parsed ``KVTRANSPORT_RAILS``: GPU index (``None``: every GPU not named) -> rail names.
RailsSpec = dict[int | None, tuple[str, ...]]


def parse_rails(text: str) -> RailsSpec:
    """``mlx5_0,mlx5_1`` (every GPU) or ``cuda:0=mlx5_0,mlx5_1;cuda:1=mlx5_2`` (per GPU; an
    entry without ``cuda:N=`` is the default for the GPUs not named). Raises ConfigError."""
    spec: RailsSpec = {}
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        gpu: int | None = None
        names_text = entry
        if "=" in entry:
            gpu_text, _, names_text = entry.partition("=")
            match = _GPU_NAME.match(gpu_text.strip())
            if not match:
                raise ConfigError(
                    f"{ENV_RAILS}={text!r}: {gpu_text.strip()!r} is not a GPU; write cuda:N=rail,rail (e.g. "
                    "cuda:0=mlx5_0,mlx5_1;cuda:1=mlx5_2) or a plain rail list for every GPU"
                )
            gpu = int(match.group(1))
        names = tuple(n.strip() for n in names_text.split(",") if n.strip())
        bad = [n for n in names if not _RAIL_NAME.match(n)]
        if bad or not names:
            what = f"{bad[0]!r} is not a device name" if bad else f"no rail given for {entry!r}"
            raise ConfigError(f"{ENV_RAILS}={text!r}: {what}")
        if gpu in spec:
            twice = f"cuda:{gpu}" if gpu is not None else "the default (an entry without cuda:N=)"
            raise ConfigError(f"{ENV_RAILS}={text!r}: {twice} given twice")
        spec[gpu] = names
    return spec


def format_rails(spec: Mapping[int | None, Sequence[str]]) -> str:
    """The ``KVTRANSPORT_RAILS`` text of a spec (:func:`parse_rails` reads it back)."""
    parts = [",".join(spec[None])] if None in spec else []
    parts += [f"cuda:{gpu}={','.join(spec[gpu])}" for gpu in sorted(g for g in spec if g is not None)]
    return ";".join(parts)


def choose_rails(topology: Topology, env: Mapping[str, str] | None = None, warn: bool = True) -> tuple[GpuRails, ...]:
    """Every GPU's rails: the nearest, or those ``KVTRANSPORT_RAILS`` forces. A forced rail that
    does not exist, a GPU that does not, or a rail on another NUMA node than its GPU (unless
    ``KVTRANSPORT_RAILS_INSIST=1``) raises ConfigError."""
    env = os.environ if env is None else env
    chosen = nearest_rails(topology)
    text = env.get(ENV_RAILS, "").strip()
    if not text:
        return chosen
    spec = parse_rails(text)
    insist = env_flag(ENV_RAILS_INSIST, False, env)
    missing = [n for names in spec.values() for n in names if topology.rail(n) is None]
    if missing:
        existing = ", ".join(r.name for r in topology.all_rails) or "none"
        raise ConfigError(f"{ENV_RAILS}: no rail {missing[0]!r} on this host; rails here: {existing}")
    known = {g.index for g in topology.gpus}
    unknown_gpus = sorted(g for g in spec if g is not None and g not in known)
    if unknown_gpus:
        raise ConfigError(
            f"{ENV_RAILS} names cuda:{unknown_gpus[0]}, which this host does not have; GPUs here: "
            f"{', '.join(g.name for g in topology.gpus) or 'none'}"
        )
    result = []
    for gpu, auto in zip(topology.gpus, chosen, strict=True):
        names = spec.get(gpu.index, spec.get(None))
        if names is None:
            result.append(auto)
            continue
        result.append(_forced(topology, gpu, names, insist, warn))
    return tuple(result)


def _forced(topology: Topology, gpu: Gpu, names: Sequence[str], insist: bool, warn: bool) -> GpuRails:
    rails = [rail for rail in map(topology.rail, names) if rail is not None]  # every one exists
    far = [r for r in rails if r.numa is not None and gpu.place.numa is not None and r.numa != gpu.place.numa]
    notes = []
    for rail in far:
        what = (
            f"{ENV_RAILS} puts {gpu.name} (NUMA node {gpu.place.numa}) on rail {rail.name} "
            f"(NUMA node {rail.numa}): every byte would cross the inter-socket link"
        )
        if not insist:
            raise ConfigError(
                f"{what}; pick a rail on NUMA node {gpu.place.numa}, or set {ENV_RAILS_INSIST}=1 to insist"
            )
        if warn:
            log.warning("%s (%s=1)", what, ENV_RAILS_INSIST)
        notes.append(f"{rail.name} on NUMA node {rail.numa}, insisted")
    unknown = [r.name for r in rails if r.numa is None or gpu.place.numa is None]
    if unknown:
        notes.append(f"NUMA node of {', '.join(unknown)} unknown, not checked")
    extra = f"; {'; '.join(notes)}" if notes else ""
    reason = f"{gpu.name} -> {', '.join(r.name for r in rails)} (forced by {ENV_RAILS}{extra})"
    return GpuRails(gpu.name, gpu.pci, gpu.place.numa, tuple(rails), None, reason, forced=True)


# --- what the engines take ------------------------------------------------------------------


def mooncake_device_names(rails: GpuRails) -> str:
    """Mooncake's ``device_name`` for ``initialize``: the RDMA devices, comma-separated ("" when
    none: Mooncake then uses every device it finds)."""
    return ",".join(r.name for r in rails.rails if r.kind == "rdma")


def ucx_net_devices(rails: GpuRails) -> str:
    """``UCX_NET_DEVICES`` for these rails: ``mlx5_0:1`` per RDMA device (device:port), the
    interface name per IP rail ("" when none: UCX then uses every device)."""
    return ",".join(f"{r.name}:{r.port}" if r.kind == "rdma" else r.name for r in rails.rails)


def cuda_order() -> tuple[str, ...] | None:
    """The CUDA devices' PCI bus ids in CUDA index order, as the CUDA driver reports them
    (``CUDA_VISIBLE_DEVICES`` applied); ``None`` without a CUDA driver (PCI bus order then)."""
    devices = probe_host().cuda_devices
    if not devices or any(not d.pci_bus_id for d in devices):
        # A device without its bus id would shift every later index: PCI bus order instead.
        return None
    return tuple(d.pci_bus_id for d in devices)


@functools.lru_cache(maxsize=4)
def _host_topology(root: str, order: tuple[str, ...] | None) -> Topology:
    return read_topology(root, order)


def host_topology(root: str = "/sys") -> Topology:
    """This host's topology, GPUs named as this process's CUDA driver names them (read once per
    process)."""
    return _host_topology(root, cuda_order())


def rails_for_gpu(index: int, env: Mapping[str, str] | None = None, root: str = "/sys") -> GpuRails | None:
    """``cuda:index``'s rails on this host (``None`` when sysfs does not list that GPU).
    Raises ConfigError for a bad ``KVTRANSPORT_RAILS``."""
    topology = host_topology(root)
    for gpu, rails in zip(topology.gpus, choose_rails(topology, env), strict=True):
        if gpu.index == index:
            return rails
    return None


def forced_rails(
    gpu: int | None, rails: Callable[[int], GpuRails | None], engine_choice: str
) -> tuple[GpuRails | None, str]:
    """The rails the user forced for an engine serving ``gpu``'s KV (``None``: host memory), or
    ``None`` and why the engine keeps its own choice (``engine_choice`` names it: "every RDMA
    device, Mooncake's choice"). A driver hands only forced rails to its engine: a list of the
    nearest ones alone would take away the engine's way to peers only other devices reach."""
    if gpu is None:
        return None, f"host-memory KV: {engine_choice}"
    chosen = rails(gpu)
    if chosen is None:
        return None, f"cuda:{gpu} not found in sysfs: {engine_choice}"
    if not chosen.rails:
        return None, f"{chosen.reason}: {engine_choice}"
    if not chosen.forced:
        return None, f"{chosen.reason}; {engine_choice} (force rails with KVTRANSPORT_RAILS)"
    return chosen, chosen.reason
