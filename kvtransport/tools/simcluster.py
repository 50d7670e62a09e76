"""Several hosts simulated on one machine: network namespaces, one switch per rail, silent cuts.

A :class:`SimCluster` of N hosts and R rails is N+1 Linux network namespaces: one per host and
one holding the switches, a bridge per rail. Each host has one interface per rail (``rail0``,
``rail1``, ...), a veth whose other end is a port of that rail's bridge, with the address
``198.18.<rail>.<host + 1>/24``. A process started with :meth:`SimCluster.launcher` also gets
its own hostname (UTS), System V IPC, PID namespace, mount namespace and ``/dev/shm``: it
shares nothing with another simulated host that two real hosts would share, so UCX, Mooncake
and NIXL cannot take a shared-memory or cross-memory-attach shortcut, and their bytes cross
the rail (:meth:`SimCluster.counters` reads each rail's byte counters to prove it).

Failures, as the network makes them:

- :meth:`cut` with ``"both"`` takes the host's switch port down: nothing passes either way and
  neither host is told (its own interface stays up, with its routes: a pulled cable on the
  far side of a switch).
- ``"out"`` drops everything the host sends on the rail, ``"in"`` everything sent to it (a
  ``tbf`` qdisc that no packet fits through: this kernel has no ``netem``), silently.
- :meth:`shape` limits a rail's rate both ways (``tbf``).

Namespaces are named ``kvtsim-<pid>-<n>-...`` after the process that made them, which holds a
lock on ``<lock dir>/kvtsim-<pid>-<n>.lock`` (``flock``) for the cluster's life. They are
removed when the cluster is closed, when the owner's interpreter exits, and, after a crash that
skipped both, by the next cluster made on the machine (:func:`sweep_stale`: nobody holds the
lock any more; a lock works across PID namespaces, where a pid would not). Traffic stays inside
the namespaces: no host namespace has a route out of the machine, and the addresses are in
198.18.0.0/15, the range set aside for benchmarks (RFC 2544), so that the routes ``here=True``
adds to this process's namespace cannot shadow a network of the machine's.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from typing import Literal

from kvtransport.spi.errors import ConfigError, KVTransportError

PREFIX = "kvtsim"
_STALE = re.compile(rf"^({PREFIX}-(\d+)-\d+)-")
_COUNT = itertools.count()
_LIVE: set[SimCluster] = set()
_LIVE_LOCK = threading.Lock()
#: The capabilities a cluster needs: CAP_NET_ADMIN (namespaces' links, qdiscs) and CAP_SYS_ADMIN
#: (network namespaces, the hosts' own mount and PID namespaces).
_CAPS = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}
#: A ``tbf`` no packet fits through: a bucket smaller than any frame, a one-byte queue.
_DROP_ALL = ("tbf", "rate", "8bit", "burst", "16", "limit", "1")

Direction = Literal["both", "out", "in"]
#: The host number of this process's own namespace in a cluster made with ``here=True``.
HERE = -1
_HERE_LOCK = threading.Lock()


def unavailable() -> str | None:
    """Why a cluster cannot be made here (missing capability or tool), or None when it can."""
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"simulated hosts need {', '.join(missing)} (iproute2, util-linux)"
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return "simulated hosts need Linux (/proc/self/status: no CapEff)"
    lacking = [name for name, bit in _CAPS.items() if not eff >> bit & 1]
    if lacking:
        return f"simulated hosts need {' and '.join(lacking)} (run as root, or grant them)"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired as exc:
        raise KVTransportError(f"simulated cluster: {' '.join(args)} did not finish in 20 s") from exc
    if check and done.returncode != 0:
        raise KVTransportError(f"simulated cluster: {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _remove_namespace(ns: str) -> None:
    # A process left inside keeps the namespace alive (and its addresses bound): end them first.
    for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run("ip", "netns", "del", ns, check=False)


def _lock_dir() -> str:
    for folder in ("/run/kvtsim", os.path.join(tempfile.gettempdir(), "kvtsim")):
        try:
            os.makedirs(folder, exist_ok=True)
            return folder
        except OSError:
            continue
    raise KVTransportError("simulated cluster: no folder for its lock files (/run, the temp folder)")


def _held(tag: str) -> bool:
    """Whether a live process holds cluster ``tag``'s lock (its namespaces are in use)."""
    path = os.path.join(_lock_dir(), f"{tag}.lock")
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (releases the lock it may just have taken)
    return False


def sweep_stale() -> list[str]:
    """Remove the namespaces of clusters nobody holds any more (a crash); returns their names."""
    stale: list[str] = []
    for ns in _namespaces():
        m = _STALE.match(ns)
        if m and not _held(m.group(1)):
            _remove_namespace(ns)
            stale.append(ns)
    for tag in {m.group(1) for ns in stale if (m := _STALE.match(ns))}:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(_lock_dir(), f"{tag}.lock"))
    return stale


@dataclass(frozen=True)
class RailBytes:
    """One host's bytes on one rail: sent (``tx``) and received (``rx``), as its interface counts."""

    tx: int
    rx: int


class SimCluster:
    """``hosts`` simulated hosts joined by ``rails`` switches; a context manager (closing removes
    everything). ``rate``: a ``tc`` rate (``10gbit``) for every rail, both ways; None: unshaped.
    ``here``: this process's own network namespace is plugged into every switch too, at
    ``198.18.<rail>.254`` (:data:`HERE`), so that a test can hold one side itself; one cluster
    at a time can (the routes would clash)."""

    def __init__(self, hosts: int = 2, rails: int = 1, rate: str | None = None, *, here: bool = False) -> None:
        if not 2 <= hosts <= 64 or not 1 <= rails <= 8:
            raise ConfigError(f"a simulated cluster has 2-64 hosts and 1-8 rails, not {hosts} and {rails}")
        reason = unavailable()
        if reason is not None:
            raise ConfigError(reason)
        sweep_stale()
        self.hosts, self.rails = hosts, rails
        self.owner = os.getpid()
        tag = f"{PREFIX}-{self.owner}-{next(_COUNT)}"
        self._lock_path = os.path.join(_lock_dir(), f"{tag}.lock")
        self._lock = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # held until close (or this process's end)
        self.switch = f"{tag}-sw"
        self.netns = [f"{tag}-h{i}" for i in range(hosts)]
        self._rate: dict[tuple[int, int], str] = {}
        self._closed = False
        self.here = here
        self._here_links: list[str] = []
        self._here_held = False
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._build()
            if rate is not None:
                for host, rail in itertools.product([*range(hosts), *([HERE] if here else [])], range(rails)):
                    self.shape(host, rail, rate)
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for ns in (self.switch, *self.netns):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        if self.here:
            if not _HERE_LOCK.acquire(blocking=False):
                raise ConfigError("another simulated cluster is plugged into this process's namespace already")
            self._here_held = True
        for rail in range(self.rails):
            _run("ip", "-n", self.switch, "link", "add", f"br{rail}", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", f"br{rail}", "up")
            for host, ns in enumerate(self.netns):
                port = self._port(host, rail)
                _run("ip", "link", "add", f"rail{rail}", "netns", ns, "type", "veth", "peer", "name", port,
                     "netns", self.switch)  # fmt: skip
                _run("ip", "-n", self.switch, "link", "set", port, "master", f"br{rail}")
                _run("ip", "-n", self.switch, "link", "set", port, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(host, rail)}/24", "dev", f"rail{rail}")
                _run("ip", "-n", ns, "link", "set", f"rail{rail}", "up")
            if self.here:
                # Named after this process (one cluster at a time plugs in here): unique on the host.
                link = f"kvt{os.getpid()}x{rail}"
                _run("ip", "link", "add", link, "type", "veth", "peer", "name", f"here{rail}", "netns", self.switch)
                self._here_links.append(link)
                _run("ip", "-n", self.switch, "link", "set", f"here{rail}", "master", f"br{rail}")
                _run("ip", "-n", self.switch, "link", "set", f"here{rail}", "up")
                _run("ip", "addr", "add", f"{self.address(HERE, rail)}/24", "dev", link)
                _run("ip", "link", "set", link, "up")

    @staticmethod
    def _port(host: int, rail: int) -> str:
        """The switch's port of ``host`` on ``rail``."""
        return f"here{rail}" if host == HERE else f"h{host}r{rail}"

    def address(self, host: int, rail: int = 0) -> str:
        """``host``'s address on ``rail`` (reached over that rail only); :data:`HERE`: this
        process's (``here=True``)."""
        return f"198.18.{rail}.{254 if host == HERE else host + 1}"

    def hostname(self, host: int) -> str:
        return f"{PREFIX}-host{host}"

    def launcher(self, host: int) -> list[str]:
        """A command prefix that runs a program on ``host``: its network namespace, and its own
        hostname, IPC, PID and mount namespaces with a ``/dev/shm`` of its own. The program is
        killed with the launcher."""
        script = f'hostname {self.hostname(host)} && mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"'
        unshare = ["unshare", "--uts", "--ipc", "--pid", "--kill-child", "--mount", "--mount-proc"]
        return ["ip", "netns", "exec", self.netns[host], *unshare, "sh", "-c", script]

    def counters(self) -> dict[tuple[int, int], RailBytes]:
        """(host, rail) -> the bytes its interface on that rail sent and received so far."""
        out: dict[tuple[int, int], RailBytes] = {}
        for host, ns in enumerate(self.netns):
            links = json.loads(_run("ip", "-j", "-s", "-n", ns, "link", "show").stdout)
            for link in links:
                m = re.fullmatch(r"rail(\d+)", link.get("ifname", ""))
                if m:
                    stats = link.get("stats64", {})
                    out[(host, int(m.group(1)))] = RailBytes(stats["tx"]["bytes"], stats["rx"]["bytes"])
        return out

    def _host_end(self, host: int, rail: int) -> tuple[list[str], str]:
        """``tc``'s namespace arguments and the device of ``host``'s own end of ``rail``."""
        if host == HERE:
            return [], self._here_links[rail]
        return ["-n", self.netns[host]], f"rail{rail}"

    def port_command(self, host: int, rail: int, state: Literal["up", "down"]) -> list[str]:
        """The command that takes ``host``'s switch port on ``rail`` down (a silent cut both
        ways) or up again: for :meth:`cut` and :meth:`restore`, and for a process that cuts
        at a moment of its own (bench --cut-at)."""
        return ["ip", "-n", self.switch, "link", "set", self._port(host, rail), state]

    def cut(self, host: int, rail: int = 0, direction: Direction = "both") -> None:
        """Cut ``host`` off ``rail``, silently: ``both`` ways (its switch port down), or only what
        it sends (``out``) or only what it receives (``in``)."""
        if direction == "both":
            _run(*self.port_command(host, rail, "down"))
        elif direction == "out":
            where, dev = self._host_end(host, rail)
            _run("tc", *where, "qdisc", "replace", "dev", dev, "root", *_DROP_ALL)
        elif direction == "in":
            _run("tc", "-n", self.switch, "qdisc", "replace", "dev", self._port(host, rail), "root", *_DROP_ALL)
        else:
            raise ConfigError(f"a cut is both, out or in, not {direction!r}")

    def restore(self, host: int, rail: int = 0) -> None:
        """Undo every cut of ``host`` on ``rail`` (its rate limit, if any, stays)."""
        _run(*self.port_command(host, rail, "up"))
        where, dev = self._host_end(host, rail)
        _run("tc", *where, "qdisc", "del", "dev", dev, "root", check=False)
        _run("tc", "-n", self.switch, "qdisc", "del", "dev", self._port(host, rail), "root", check=False)
        if (host, rail) in self._rate:
            self.shape(host, rail, self._rate[(host, rail)])

    def shape(self, host: int, rail: int, rate: str) -> None:
        """Limit ``host``'s traffic on ``rail`` to ``rate`` each way (``tbf``; ``10gbit``, ``500mbit``)."""
        bits = _bits(rate)
        # A bucket of 4 ms at the rate (at least 64 KiB: a TSO segment), a queue of 50 ms.
        burst = max(64 * 1024, bits // 8 // 250)
        args = ("root", "tbf", "rate", rate, "burst", str(burst), "latency", "50ms")
        where, dev = self._host_end(host, rail)
        _run("tc", *where, "qdisc", "replace", "dev", dev, *args)
        _run("tc", "-n", self.switch, "qdisc", "replace", "dev", self._port(host, rail), *args)
        self._rate[(host, rail)] = rate

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self.owner:
            return  # a forked child: the cluster is its parent's
        for ns in (*self.netns, self.switch):
            _remove_namespace(ns)  # takes the veth pairs with it, the ends plugged in here too
        for link in self._here_links:
            _run("ip", "link", "del", link, check=False)
        if self._here_held:
            self._here_held = False
            _HERE_LOCK.release()
        with contextlib.suppress(OSError):
            os.unlink(self._lock_path)
        os.close(self._lock)
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def __enter__(self) -> SimCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def _bits(rate: str) -> int:
    """Bits per second of a ``tc`` rate (``10gbit``, ``500mbit``, ``1gbps``: bytes)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)", rate.strip().lower())
    if m is None:
        raise ConfigError(f"a rate is a number and a unit like 10gbit or 500mbit, not {rate!r}")
    value = float(m.group(1)) * _UNITS[m.group(2)] * (8 if m.group(3) == "bps" else 1)
    if value < 8000:
        raise ConfigError(f"a rate below 8kbit cannot carry a handshake: {rate!r}")
    return int(value)


@atexit.register
def _close_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for cluster in live:
        cluster.close()
