"""``kvtransport bench --hosts 2``: the main job across simulated hosts, and where its bytes went.

The parent process makes a :class:`~kvtransport.tools.simcluster.SimCluster` and runs the bench
(prefill side) on host 0 as a child; that child starts the decode side on host 1, both
listening on their rail-0 addresses. The parent reads every rail's byte counters before and
after and reports them against the KV bytes the bench moved: the proof that the bytes crossed
the link, and over which rail.

With ``--rails 2`` the data of the NIXL drivers goes over rail 1 (``UCX_NET_DEVICES=rail1`` on
both hosts) while the control channel and Mooncake's drivers (bound to the endpoint's address)
stay on rail 0: the data rail is then the last one, and the one a cut takes down.

``--cut-at S`` cuts host 0 off the data rail (both ways, silently, at the switch) S seconds
after the first timed request started, for ``--cut-for`` seconds. A request whose driver failed
over to another lane (``runtime.failover``: the connection kept one, and the control channel
lives) arrives over it: the report gives, per such request, when it moved and when it arrived
after the cut (the self-heal time). A request that failed instead is recorded with its
detection time, sent again on a new connection once the link is back, and reported with how
long after the cut it finally arrived.

The child learns its placement from a plan file (``--sim-plan``, a hidden flag): its listen
address, the decode side's launcher and address, and the commands that cut and restore the
rail (run by the child, so that the cut falls where its requests are).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtransport.spi.errors import ConfigError

#: The bench flags that shape the cluster, with whether each takes a value (not forwarded).
CLUSTER_FLAGS = {"--hosts": True, "--rails": True, "--rate": True, "--cut-at": True, "--cut-for": True}


@dataclass
class Across:
    """Where the two sides of a bench run when it spans simulated hosts."""

    listen: str
    decode_launcher: list[str]
    decode_listen: str
    cut_at: float | None = None
    cut_for: float = 5.0
    cut: list[list[str]] = field(default_factory=list)
    restore: list[list[str]] = field(default_factory=list)
    #: The rail ``cut`` takes down (the data rail: the last one).
    rail: int = 0

    @classmethod
    def load(cls, path: str) -> Across:
        with open(path, encoding="utf-8") as f:
            return cls(**json.load(f))


@dataclass
class CutRecord:
    """What a cut did to the bench's requests (times in seconds after the cut)."""

    at_s: float
    for_s: float
    cut_time: float = 0.0  # monotonic; 0 until the cut happened
    restore_time: float = 0.0
    failed: list[dict[str, Any]] = field(default_factory=list)
    recovered: list[dict[str, Any]] = field(default_factory=list)
    #: Requests whose driver failed over to another lane: from, to, when they moved and when
    #: they arrived (seconds after the cut).
    healed: list[dict[str, Any]] = field(default_factory=list)
    #: The rail the cut took down.
    rail: int = 0
    #: Commands of the cut or the restore that failed (the cut then did not happen, or the
    #: link may still be down: the report says so).
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["cut_time"], out["restore_time"]
        out["happened"] = self.cut_time > 0
        return out


class CutClock:
    """Runs the cut ``across.cut_at`` s after :meth:`start` and the restore ``cut_for`` s later."""

    def __init__(self, across: Across) -> None:
        assert across.cut_at is not None
        self.across = across
        self.record = CutRecord(across.cut_at, across.cut_for, rail=across.rail)
        self._timer: threading.Timer | None = None
        self._closing = threading.Event()
        self.restored = threading.Event()

    def start(self) -> None:
        if self._timer is None:
            self._timer = threading.Timer(self.across.cut_at or 0.0, self._cut)
            self._timer.daemon = True
            self._timer.start()

    def _cut(self) -> None:
        try:
            if self._closing.is_set() or not self._run(self.across.cut, "cut"):
                return
            self.record.cut_time = time.monotonic()
            self._closing.wait(self.across.cut_for)  # a bench that ends meanwhile restores at once
        finally:
            # Whatever happened, the link is put back (a restore of a link never cut is harmless).
            if self._run(self.across.restore, "restore"):
                self.record.restore_time = time.monotonic()
            self.restored.set()

    def _run(self, commands: list[list[str]], what: str) -> bool:
        for cmd in commands:
            try:
                subprocess.run(cmd, check=True, capture_output=True, timeout=20)
            except (OSError, subprocess.SubprocessError) as exc:
                self.record.errors.append(f"{what}: {' '.join(cmd)}: {exc}")
                return False
        return True

    def since_cut(self, when: float | None = None) -> float:
        return round((time.monotonic() if when is None else when) - self.record.cut_time, 3)

    def close(self) -> None:
        """Stop: a cut not made yet is not made, one in progress is restored now, and the
        timer's thread is joined (nothing touches the link after the bench)."""
        self._closing.set()
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join(60)


def forwarded(argv: Sequence[str]) -> list[str]:
    """``argv`` without the cluster's own flags (what the bench on host 0 is given)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in CLUSTER_FLAGS:
            skip = CLUSTER_FLAGS[name] and "=" not in a
            continue
        out.append(a)
    return out


def run(argv: Sequence[str], hosts: int, rails: int, rate: str | None, cut_at: float | None, cut_for: float,
        as_json: bool) -> int:  # fmt: skip
    """Make the cluster, run the bench on it, print its report and where the bytes went."""
    from kvtransport.tools.simcluster import SimCluster

    if hosts != 2:
        raise ConfigError("the bench runs one prefill and one decode: --hosts 2")
    if cut_at is not None and (cut_at < 0 or cut_for <= 0):
        raise ConfigError("--cut-at must be >= 0 and --cut-for > 0 seconds")
    data_rail = rails - 1
    with SimCluster(hosts, rails, rate) as cluster, tempfile.TemporaryDirectory(prefix="kvtsim-bench-") as tmp:
        plan = Across(
            listen=f"tcp://{cluster.address(0)}:0",
            decode_launcher=cluster.launcher(1),
            decode_listen=f"tcp://{cluster.address(1)}:0",
            cut_at=cut_at,
            cut_for=cut_for,
            cut=[cluster.port_command(0, data_rail, "down")],
            restore=[cluster.port_command(0, data_rail, "up")],
            rail=data_rail,
        )
        plan_path, report_path = os.path.join(tmp, "plan.json"), os.path.join(tmp, "report.json")
        with open(plan_path, "w", encoding="utf-8") as f:
            json.dump(asdict(plan), f)
        env = dict(os.environ)
        # Two hosts: the control channel is authenticated (a secret for this run, unless set).
        if not env.get("KVTRANSPORT_SECRET") and not env.get("KVTRANSPORT_SECRET_FILE"):
            env["KVTRANSPORT_SECRET"] = os.urandom(16).hex()
        if data_rail:
            env["UCX_NET_DEVICES"] = f"rail{data_rail}"  # the NIXL drivers' data on the data rail
        cmd = [*cluster.launcher(0), sys.executable, "-m", "kvtransport", *forwarded(argv)]
        cmd += ["--sim-plan", plan_path, "--sim-report", report_path]
        before = cluster.counters()
        child = subprocess.run(cmd, env=env, stdout=subprocess.PIPE if as_json else None, check=False)
        after = cluster.counters()
        if not os.path.exists(report_path):
            return child.returncode or 1
        with open(report_path, encoding="utf-8") as f:
            doc = json.load(f)
        links = {
            f"host{h}.rail{r}": {"tx": after[(h, r)].tx - before[(h, r)].tx, "rx": after[(h, r)].rx - before[(h, r)].rx}
            for (h, r) in sorted(after)
        }
        doc["cluster"] = {
            "hosts": hosts,
            "rails": rails,
            "rate": rate,
            "prefill_host": cluster.hostname(0),
            "decode_host": cluster.hostname(1),
            "addresses": {f"host{h}": [cluster.address(h, r) for r in range(rails)] for h in range(hosts)},
            "links": links,
        }
        if as_json:
            print(json.dumps(doc, indent=2))
        else:
            print(render(doc))
        return child.returncode


def render(doc: dict[str, Any]) -> str:
    """The cluster's lines: each rail's bytes against the KV moved, and what a cut did."""
    c, moved = doc["cluster"], int(doc.get("kv_bytes_moved", 0))
    lines = [
        f"  hosts       prefill on {c['prefill_host']} ({', '.join(c['addresses']['host0'])}), "
        f"decode on {c['decode_host']} ({', '.join(c['addresses']['host1'])}); own network, PID, IPC, "
        f"mount namespaces and /dev/shm each{'; rails shaped to ' + c['rate'] if c['rate'] else ''}",
        f"  KV moved    {moved / 1e9:.2f} GB prefill -> decode (every request that arrived: warm-up and baseline too"
        + (", plus what the tries a cut caught had sent)" if doc.get("cut") and doc["cut"]["failed"] else ")"),
    ]
    for r in range(c["rails"]):
        tx, rx = c["links"][f"host0.rail{r}"]["tx"], c["links"][f"host1.rail{r}"]["tx"]
        share = f" ({tx / moved:.0%} of the KV that arrived)" if moved else ""
        lines.append(f"  rail{r}       prefill host sent {tx / 1e9:.3f} GB{share}, decode host sent {rx / 1e9:.3f} GB")
    cut = doc.get("cut")
    for error in (cut or {}).get("errors", []):
        lines.append(f"  cut failed  {error}")
    if cut:
        if not cut["happened"]:
            lines.append(f"  cut         none: the bench ended before {cut['at_s']} s")
        else:
            lines.append(
                f"  cut         rail{cut.get('rail', 0)} of the prefill host, both ways, {cut['at_s']} s in for "
                f"{cut['for_s']} s"
            )
            for h in cut.get("healed", []):
                lines.append(
                    f"              request {h['request']} moved from {h['from']} to {h['to']} "
                    f"{h['moved_after_s']:.2f} s after the cut, arrived intact {h['after_s']:.2f} s after it"
                )
            for f in cut["failed"]:
                after = f"{f['after_s']:.2f} s after the cut"
                lines.append(f"              request {f['request']} failed {after}: {f['error']}")
            for f in cut["recovered"]:
                lines.append(
                    f"              request {f['request']} arrived intact {f['after_s']:.2f} s after the cut, "
                    f"{f['after_restore_s']:.2f} s after the link returned (sent again on a new connection)"
                )
            healed = cut.get("healed", [])
            if not cut["failed"] and not healed:
                lines.append("              no request was in flight or failed")
            if healed:
                lines.append(
                    f"              self-heal: {max(h['after_s'] for h in healed):.2f} s (the last request in flight "
                    "arrived over the other path); the failed lane stays out of that connection"
                )
            elif cut["failed"]:
                lines.append(
                    "              self-heal: none (no other lane: forced driver, KVTRANSPORT_FAILOVER=off, or a "
                    "multi-part send); requests went again on a new connection once the link was back"
                )
    return "\n".join(lines)
