"""``kvtransport doctor``: what this host can do and why: its hello (capabilities, every
installed driver and why each is or is not usable, what to install), the control plane's
authentication, the discovery backend with whether it answers, and which rails (network
devices) each GPU sends through and why; rendered as text or JSON.
Also the loading helpers the other commands share (drivers, their variables, a KV layout).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.util
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence

from kvtransport import __version__
from kvtransport.negotiation.calibration_cache import ENV_CALIBRATION, cache_path, with_cached_models
from kvtransport.negotiation.hello import DriverHello, Hello, LoadedDrivers, build_hello, load_drivers
from kvtransport.negotiation.registry import DriverEntry, Policy, duplicates, list_drivers
from kvtransport.runtime.auth import control_plane_report, load_secret
from kvtransport.runtime.discovery_config import check_policy, discovery_from_env
from kvtransport.runtime.environment import warn_unknown_env_vars
from kvtransport.spi.errors import ConfigError, KVTransportError
from kvtransport.spi.memory import KVLayout, MemoryKind
from kvtransport.spi.probe import probe_host
from kvtransport.spi.topology import GpuRails, Topology, choose_rails, host_topology, nearest_rails


@contextlib.contextmanager
def native_stdout_to_stderr() -> Iterator[None]:
    """Send what native engines print to file descriptor 1 (UCX, Mooncake) to stderr, so
    ``--json`` output on stdout stays parseable."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all
        yield
        return
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def load_installed(entries: list[DriverEntry]) -> LoadedDrivers:
    with native_stdout_to_stderr():
        return load_drivers(entries=entries)


def driver_env_vars(loaded: LoadedDrivers) -> list[str]:
    return [var for cls in loaded.classes.values() for var in cls.env_vars]


def memory_layout(memory: str | None) -> KVLayout | None:
    return KVLayout.llama3_8b(MemoryKind.parse(memory)) if memory else None


def doctor(args: argparse.Namespace) -> int:
    entries = list_drivers()
    loaded = load_installed(entries)
    problems: list[str] = []
    try:
        policy = Policy.from_env(known=[e.name for e in entries])
    except KVTransportError as exc:
        policy = Policy()
        problems.append(str(exc))
    unknown = warn_unknown_env_vars(driver_vars=driver_env_vars(loaded))
    problems += [f"unknown environment variable {var} is ignored" for var in unknown]
    for name, group in duplicates(entries).items():
        problems.append(f"driver {name!r} is registered by " + " and ".join(e.distribution for e in group))
    hello = build_hello(with_calibration(loaded.hellos), policy=policy, layout=memory_layout(args.memory))
    authenticated, control, control_problem = control_plane_report(args.listen)
    if control_problem:
        problems.append(control_problem)
    discovery, discovery_problem = discovery_report()
    if discovery_problem:
        problems.append(discovery_problem)
    topology, rails, rails_problem = rails_report()
    if rails_problem:
        problems.append(rails_problem)
    usable = [n for n, d in hello.drivers.items() if d.usable]
    if not usable:
        problems.append("no driver is usable on this host")
    if args.json:
        doc = hello.to_dict()
        doc["diagnostics"] = {
            "entries": [e.to_dict() for e in entries],
            "problems": problems,
            "kvtransport": __version__,
            "control_plane": {"listen": args.listen, "authenticated": authenticated, "detail": control},
            "discovery": {"detail": discovery, "problem": discovery_problem},
            "rails": rails_document(topology, rails),
        }
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(render_doctor(hello, problems, control, discovery, rails_lines(topology, rails)))
    failed = not usable or control_problem or discovery_problem or rails_problem
    return 1 if (failed or any("No such driver" in p for p in problems)) else 0


def discovery_report(env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """For ``doctor``: (the discovery backend in one line, the problem that stops it, or "").
    An etcd backend is asked for its version on each endpoint (2 s each)."""
    try:
        config = discovery_from_env(env)
    except ConfigError as exc:
        return "misconfigured", str(exc)
    if config is None:
        return "built-in bootstrap registry (one per prefill instance; KVTRANSPORT_DISCOVERY unset)", ""
    where = config.describe()
    try:
        signed = check_policy(config, load_secret(env=env), env)
    except ConfigError as exc:
        return f"{where}: every serving process would refuse it", str(exc)
    if importlib.util.find_spec("etcd3gw") is None:
        return f"{where}: no client", "discovery on etcd needs the etcd3gw package: pip install 'kvtransport[etcd]'"
    answers, failures = [], []
    for host, port in config.endpoints:
        conn = http.client.HTTPConnection(host, port, timeout=2)
        try:
            conn.request("GET", "/version")
            reply = conn.getresponse()
            body = reply.read(4096)
            if reply.status != 200:
                raise OSError(f"HTTP {reply.status}")
            version = json.loads(body).get("etcdserver", "?")
            answers.append(f"{host}:{port} etcd {version}")
        except (OSError, ValueError, http.client.HTTPException) as exc:
            failures.append(f"{host}:{port}: {type(exc).__name__}: {exc}")
        finally:
            conn.close()
    if not answers:
        return f"{where}: unreachable", f"discovery: no etcd endpoint of {where} answers ({'; '.join(failures)})"
    note = f" (unreachable: {'; '.join(failures)})" if failures else ""
    return f"{where}: reachable, {', '.join(answers)}{note}; {signed}", ""


def rails_report(env: Mapping[str, str] | None = None) -> tuple[Topology, tuple[GpuRails, ...], str]:
    """For ``doctor``: this host's topology, each GPU's rails, and the problem with a forced
    rail (then the rails shown are the nearest ones, which an endpoint would refuse to replace)."""
    topology = host_topology()
    try:
        return topology, choose_rails(topology, env, warn=False), ""
    except ConfigError as exc:
        return topology, nearest_rails(topology), str(exc)


def rails_lines(topology: Topology, rails: Sequence[GpuRails]) -> list[str]:
    """The doctor's rails section: per GPU its rails and why, else what is missing."""
    candidates, tier = topology.candidates()
    names = ", ".join(r.name for r in candidates)
    lines = [f"  rails:   {tier + ': ' + names if tier else 'none'} (from {topology.root})"]
    lines += [f"    {r.reason}" for r in rails]
    lines += [f"    {note}" for note in topology.notes]
    return lines


def rails_document(topology: Topology, rails: Sequence[GpuRails]) -> dict[str, object]:
    _, tier = topology.candidates()
    return {
        "root": topology.root,
        "tier": tier,
        "gpus": [
            {
                "gpu": r.gpu,
                "pci": r.pci,
                "numa": r.numa,
                "rails": list(r.names),
                "level": r.level.name if r.level is not None else None,
                "forced": r.forced,
                "reason": r.reason,
            }
            for r in rails
        ],
        "notes": list(topology.notes),
    }


def render_doctor(
    hello: Hello, problems: Sequence[str], control: str = "", discovery: str = "", rails: Sequence[str] = ()
) -> str:
    host = hello.host
    lines = [f"kvtransport {__version__} on {host.hostname} (host id {host.host_id})", ""]
    if host.cuda_devices:
        for dev in host.cuda_devices:
            gdr = {True: "yes", False: "no", None: "unknown"}[dev.gdr]
            lines.append(f"  cuda:{dev.index}  {dev.name} {dev.pci_bus_id} {dev.uuid}  GDR: {gdr} ({dev.gdr_reason})")
    else:
        lines.append(f"  CUDA:    none ({host.cuda_note})")
    lines.append(f"  RDMA:    {', '.join(host.rdma_devices) if host.rdma_devices else 'none (' + host.rdma_note + ')'}")
    lines.append(f"  peermem: {'loaded' if host.peermem else 'not loaded'}")
    lines += rails
    versions = ", ".join(f"{k} {v}" for k, v in sorted(host.versions.items()))
    lines.append(f"  engines: {versions or 'none installed'}")
    if control:
        lines.append(f"  control: {control}")
    if discovery:
        lines.append(f"  routes:  {discovery}")
    lines.append(f"  costs:   {calibration_line(hello)}")
    lines += ["", f"  {'DRIVER':<18}{'STATUS':<13}{'MEMORY':<12}DETAIL"]
    for name in sorted(hello.drivers):
        entry = hello.drivers[name]
        if entry.status is None:
            lines.append(f"  {name:<18}{'broken':<13}{'-':<12}{entry.load_error}")
            continue
        status = entry.status
        state = "available" if status.available else "unavailable"
        memory = ",".join(status.memory) if status.available and status.memory else "-"
        detail = status.reason
        if status.fix:
            detail += f"\n  {'':<43}fix: {status.fix}"
        for family, note in sorted(status.memory_notes.items()):
            if status.available:
                detail += f"\n  {'':<43}{family}: {note}"
        for model in entry.costs:
            detail += f"\n  {'':<43}measured ({model.path}): {model.describe()}"
        lines.append(f"  {name:<18}{state:<13}{memory:<12}{detail}")
    policy = hello.policy
    if policy.force or policy.allow or policy.exclude:
        lines += [
            "",
            f"  policy: force={policy.force or '-'} allow={','.join(policy.allow) or '*'} "
            f"exclude={','.join(policy.exclude) or '-'}",
        ]
    if problems:
        lines += ["", "Problems:"] + [f"  - {p}" for p in problems]
    return "\n".join(lines)


def with_calibration(hellos: Mapping[str, DriverHello]) -> dict[str, DriverHello]:
    """The hellos with this host's cached cost models, as an endpoint here would send them."""
    return with_cached_models(hellos, probe_host().host_id)


def calibration_line(hello: Hello) -> str:
    usable = [n for n, d in hello.drivers.items() if d.usable]
    measured = [n for n in usable if hello.drivers[n].costs]
    path = cache_path()
    where = f"cache {path}" if path is not None else f"{ENV_CALIBRATION}=off"
    if not measured:
        return f"nominal estimates: no driver calibrated on this host ({where}; run kvtransport calibrate)"
    missing = sorted(set(usable) - set(measured))
    return f"measured for {', '.join(sorted(measured))} ({where})" + (
        f"; nominal for {', '.join(missing)} (kvtransport calibrate)" if missing else ""
    )
