"""The ``kvtransport`` command: its arguments, and ``negotiate``, ``calibrate``, ``bench`` and
``soak``; ``doctor`` is ``tools.doctor``.

``negotiate`` prints the decision between two hellos, honouring the env-var policy; like
``doctor`` it exits non-zero, with the typed error's message, when nothing can be used.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtransport import __version__
from kvtransport.negotiation.hello import Hello, build_hello, load_drivers
from kvtransport.negotiation.negotiate import Decision, negotiate
from kvtransport.negotiation.registry import Policy, list_drivers
from kvtransport.runtime.environment import warn_unknown_env_vars
from kvtransport.spi.errors import ConfigError, KVTransportError
from kvtransport.tools.doctor import (
    doctor,
    driver_env_vars,
    load_installed,
    memory_layout,
    native_stdout_to_stderr,
    with_calibration,
)

EXIT_ERROR = 2


def _setup_logging() -> None:
    level = os.environ.get("KVTRANSPORT_LOG_LEVEL", "WARNING").upper()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvtransport").setLevel(level)


# --- negotiate ------------------------------------------------------------------------------


def _read_hello(path: str) -> Hello:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KVTransportError(f"cannot read hello document {path}: {exc}") from exc
    return Hello.from_dict(data)


def negotiate_cmd(args: argparse.Namespace) -> int:
    entries = list_drivers()
    loaded = load_installed(entries)
    warn_unknown_env_vars(driver_vars=driver_env_vars(loaded))
    policy = Policy.from_env(known=[e.name for e in entries])
    layout = memory_layout(args.memory)
    hellos = with_calibration(loaded.hellos)
    this_host = build_hello(hellos, policy=policy, layout=layout, endpoint="local")
    local = _read_hello(args.local).with_policy(policy) if args.local else this_host
    if args.remote:
        remote = _read_hello(args.remote)
    else:
        remote = build_hello(
            hellos,
            policy=policy,
            layout=memory_layout(args.remote_memory) or layout,
            endpoint="remote",
        )
    decision = negotiate(local, remote, loaded.classes)
    if args.json:
        print(json.dumps(decision.to_dict(), indent=2, sort_keys=True))
    else:
        print(render_decision(decision))
    return 0


def render_decision(decision: Decision) -> str:
    lines = [
        f"{decision.initiator} -> {decision.acceptor}: {decision.driver} "
        f"({decision.path.value}, ~{decision.gbps:g} GB/s)",
        f"  why: {decision.reason}",
        f"  basis: {decision.basis} ({decision.basis_note})",
        *(
            [f"  lanes: {', '.join(decision.lanes)} (each transfer takes the one predicted fastest for its plan)"]
            if len(decision.lanes) > 1
            else []
        ),
        "",
        f"  {'DRIVER':<18}{'OUTCOME':<10}REASON",
    ]
    for c in decision.candidates:
        lines.append(f"  {c.driver:<18}{c.outcome:<10}{c.reason}")
    return "\n".join(lines)


# --- entry point ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtransport", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"kvtransport {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("doctor", help="this host's capabilities and every driver's status")
    p.add_argument("--json", action="store_true", help="print the hello document as JSON")
    p.add_argument("--memory", help="describe KV in this memory (host, cuda:N)")
    p.add_argument(
        "--listen",
        default="tcp://127.0.0.1:0",
        help="the control address an endpoint would listen on (is it authenticated there?)",
    )
    p.set_defaults(func=doctor)

    p = sub.add_parser("negotiate", help="the driver two hellos would agree on, and why")
    p.add_argument("--local", help="hello JSON of the initiator (default: this host)")
    p.add_argument("--remote", help="hello JSON of the acceptor (default: this host)")
    p.add_argument("--memory", help="KV memory of the default hellos (host, cuda:N)")
    p.add_argument("--remote-memory", help="KV memory of the default remote hello")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=negotiate_cmd)

    _add_bench(sub)
    _add_calibrate(sub)
    _add_soak(sub)
    return parser


def _add_calibrate(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure each driver's cost model on this host and save it for the negotiation",
        description="Move transfers of known shapes between two processes on this host with each usable "
        "driver (every byte verified), fit a cost model per driver (latency per batch, cost per descriptor, "
        "bandwidth), and save it to the per-user cache (KVTRANSPORT_CALIBRATION). Endpoints of this host "
        "then rank drivers by predicted time instead of nominal estimates.",
    )
    p.add_argument("--driver", action="append", help="driver to calibrate (repeatable; default: every usable one)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per shape (default 5; medians)")
    p.add_argument("--no-save", action="store_true", help="print the models without saving them")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any one step may take")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--connect",
        metavar="HOST:PORT",
        help="measure towards the host serving `kvtransport bench --listen` there, over the real link",
    )
    p.set_defaults(func=calibrate_cmd)


def calibrate_cmd(args: argparse.Namespace) -> int:
    from kvtransport.tools.calibration import calibrate

    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    spawn = None
    if args.connect:
        from kvtransport.tools.bench_remote import remote_peers

        spawn = remote_peers(args.connect, args.timeout)
    with native_stdout_to_stderr():
        report = calibrate(
            args.driver,
            reps=args.reps,
            save=not args.no_save,
            timeout=args.timeout,
            progress=None if args.json else sys.stderr,
            spawn=spawn,
        )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.render())
    return 0 if report.drivers and all(d.model is not None for d in report.drivers) else 1


def _add_soak(sub: Any) -> None:
    p = sub.add_parser(
        "soak",
        help="many verified transfers with aborts and concurrency; resources at start and end",
        description="Send many transfers of random sizes between two processes on this host, abort a share "
        "of them from either side, verify every byte of the rest, and report what both processes hold "
        "(RSS, fds, threads, the endpoint's tables) after the first wave and at the end.",
    )
    p.add_argument(
        "--driver",
        action="append",
        help="driver to soak (repeatable; default: every available driver that moves host memory)",
    )
    p.add_argument("--transfers", type=int, default=10_000, help="transfers per driver (default 10000)")
    p.add_argument("--concurrency", type=int, default=16, help="transfers in flight at once (default 16)")
    p.add_argument("--abort-rate", type=float, default=0.1, help="share of transfers aborted (default 0.1)")
    p.add_argument("--max-pages", type=int, default=48, help="largest transfer in 16 KiB pages (default 48)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any one wave may take")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=soak_cmd)


def soak_cmd(args: argparse.Namespace) -> int:
    from kvtransport.spi.memory import HOST
    from kvtransport.tools.soak import report_dict, run_soak

    names = args.driver
    if not names:
        loaded = load_drivers()
        names = [
            n
            for n, h in sorted(loaded.hellos.items())
            if h.status is not None and h.status.serves(HOST) and not n.startswith("example")
        ]
    if not names:
        raise KVTransportError("no driver that moves host memory is available here (see kvtransport doctor)")
    if args.transfers < 1 or args.concurrency < 1 or not 0 <= args.abort_rate < 1:
        raise KVTransportError("--transfers and --concurrency must be positive, --abort-rate in [0, 1)")
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    results = []
    if not args.json:
        print("kvtransport soak: prefill -> decode, two processes on loopback, every byte verified")
    for name in names:
        with native_stdout_to_stderr():
            r = run_soak(
                name,
                transfers=args.transfers,
                concurrency=args.concurrency,
                abort_rate=args.abort_rate,
                max_pages=args.max_pages,
                seed=args.seed,
                timeout=args.timeout,
            )
        results.append(r)
        if not args.json:
            print(r.render(), flush=True)
    report = report_dict(results)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


def _add_bench(sub: Any) -> None:
    from kvtransport.tools.bench import Workload

    w = Workload()
    p = sub.add_parser(
        "bench",
        # No abbreviations: --hosts runs the bench again on a simulated host with the flags it
        # was given, less its own, which it recognises by their full names.
        allow_abbrev=False,
        help="prefill -> decode transfer on loopback, verified, against the raw engine",
        description="Send KV pages between two processes on this host with the negotiated driver "
        "(or --driver), verify every byte, and compare with the driver's engine used directly.",
    )
    p.add_argument("--driver", help="use this driver on both sides (default: what the negotiation picks)")
    p.add_argument("--requests", type=int, default=w.requests, help=f"requests to send (default {w.requests})")
    p.add_argument(
        "--prompt-tokens", type=int, default=w.prompt_tokens, help=f"tokens per request (default {w.prompt_tokens})"
    )
    p.add_argument("--layers", type=int, default=w.layers, help=f"model layers (default {w.layers}, Llama-3-8B)")
    p.add_argument("--kv-heads", type=int, default=w.kv_heads)
    p.add_argument("--head-dim", type=int, default=w.head_dim)
    p.add_argument("--page-tokens", type=int, default=w.page_tokens)
    p.add_argument("--placement", choices=("scattered", "contiguous"), default=w.placement)
    p.add_argument("--pool-factor", type=int, default=w.pool_factor, help="pool size in requests' worth of pages")
    p.add_argument("--seed", type=int, default=w.seed)
    p.add_argument("--warmup", type=int, default=w.warmup, help="untimed (but verified) requests first")
    p.add_argument("--device", type=int, default=None, help="KV in device memory of this CUDA device")
    p.add_argument("--no-baseline", action="store_true", help="skip the raw-engine comparison")
    p.add_argument("--compare", metavar="DRIVER", help="also measure this driver on the same requests")
    p.add_argument(
        "--pin",
        action="store_true",
        help="prefill on the first half of the CPUs, decode on the rest: no core shared, as on two hosts",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any one step may take")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--connects",
        type=int,
        metavar="N",
        help="instead: time N handshakes with the deployment secret and N without",
    )
    p.add_argument(
        "--in-flight",
        type=int,
        metavar="N",
        help="instead: rounds of N requests sent at once against rounds of one (aggregate bandwidth)",
    )
    p.add_argument(
        "--consumer",
        choices=("vllm",),
        help="instead: a serving engine's connector against the endpoint on the same requests "
        "(vllm: per-request overhead of kvtransport.integrations.vllm; --prompt-tokens defaults to 256 here)",
    )
    lw = p.add_argument_group("layer-wise", "--layerwise: whole-request against layer-wise sends (docs/layerwise.md)")
    lw.add_argument(
        "--layerwise", action="store_true", help="instead: compute layers here and send whole and layer-wise"
    )
    lw.add_argument(
        "--compute-ms-per-layer", type=float, default=10.0, help="simulated prefill compute per layer (default 10)"
    )
    lw.add_argument(
        "--compute", choices=("busy", "matmul"), default="busy", help="how compute is simulated (default busy)"
    )
    sweep = p.add_argument_group("sweep", "--sweep: a grid of workloads, every path side by side (docs/performance.md)")
    sweep.add_argument("--sweep", action="store_true", help="instead: run the grid (full size unless --quick)")
    sweep.add_argument("--quick", action="store_true", help="the sweep's small grid (a few minutes)")
    sweep.add_argument("--models", type=_names, help="model presets, comma-separated (see --list-models)")
    sweep.add_argument("--list-models", action="store_true", help="print the model presets and exit")
    sweep.add_argument("--tokens", type=_ints, help="prompt lengths, comma-separated")
    sweep.add_argument("--page-sizes", type=_ints, help="tokens per page, comma-separated")
    sweep.add_argument("--placements", type=_names, help="contiguous, scattered, mixed (comma-separated)")
    sweep.add_argument("--concurrency", type=_ints, help="requests in flight, comma-separated")
    sweep.add_argument("--reps", type=int, help="timed rounds per point and path")
    sweep.add_argument("--drivers", type=_names, help="drivers to force (default: every usable one)")
    sweep.add_argument(
        "--no-layerwise", action="store_true", help="without the layerwise:choice path (docs/layerwise.md)"
    )
    sweep.add_argument("--max-pool-mib", type=int, help="skip points whose pools need more (MiB per process)")
    sweep.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="instead: serve decode sides to a bench on another host (--connect); token in KVTRANSPORT_BENCH_TOKEN",
    )
    sweep.add_argument(
        "--connect",
        metavar="HOST:PORT",
        help="run the decode sides on the host serving --listen (a sweep, or one workload without --sweep)",
    )
    sweep.add_argument("--plot", metavar="FILE.png", help="draw bandwidth and latency per path (needs [plot])")
    tr = p.add_argument_group("trace", "--trace FILE: open-loop replay of a serving trace (docs/performance.md)")
    tr.add_argument("--trace", metavar="FILE", help="instead: replay this JSON-lines trace (Mooncake's format)")
    tr.add_argument("--speedup", type=float, default=1.0, help="the trace's timestamps divided by this (default 1)")
    tr.add_argument(
        "--decode-cache-gib",
        type=float,
        default=8.0,
        help="the decode side's prefix cache, by the trace's block hashes, in KV bytes of the layout "
        "(default 8: at 4 layers, as a 64 GiB pool of the whole Llama-3-8B; 0: none)",
    )
    tr.add_argument("--pool-gib", type=float, default=1.0, help="decode pages for requests in flight (default 1)")
    hosts = p.add_argument_group("hosts", "--hosts 2: across simulated hosts on this machine (docs/network.md; root)")
    hosts.add_argument("--hosts", type=int, help="run the prefill and the decode on simulated hosts (2)")
    hosts.add_argument("--rails", type=int, default=1, help="links (switches) between the hosts (default 1)")
    hosts.add_argument(
        "--rate",
        help="shape every rail to this rate each way (tc: 10gbit, 800mbit); with --trace: Poisson arrivals, "
        "this many requests a second, instead of the trace's timestamps",
    )
    hosts.add_argument("--cut-at", type=float, help="cut the prefill host off rail 0 this many seconds in")
    hosts.add_argument("--cut-for", type=float, default=5.0, help="seconds the cut lasts (default 5)")
    hosts.add_argument("--sim-plan", help=argparse.SUPPRESS)  # the child's placement (bench_hosts)
    hosts.add_argument("--sim-report", help=argparse.SUPPRESS)  # where the child writes its report
    p.add_argument("--prefill-tp", type=int, default=1, help="prefill ranks (processes), each holding its heads")
    p.add_argument("--decode-tp", type=int, default=1, help="decode ranks (processes), each holding its heads")
    p.add_argument(
        "--decode-engine",
        choices=("vllm",),
        help="prefill ranks shaped as SGLang's pools, decode ranks as this engine's: pages regrouped on the way",
    )
    p.add_argument(
        "--prefill-engine",
        choices=("vllm",),
        help="prefill ranks shaped as this engine's pools, decode ranks as SGLang's: pages regrouped on the way",
    )
    p.set_defaults(func=bench_cmd)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _sweep(args: argparse.Namespace) -> int:
    from kvtransport.tools import sweep, sweep_grid, sweep_report

    grid = sweep_grid.with_overrides(
        sweep_grid.QUICK if args.quick else sweep_grid.FULL,
        models=args.models,
        tokens=args.tokens,
        page_tokens=args.page_sizes,
        placements=args.placements,
        in_flight=args.concurrency,
        reps=args.reps,
        drivers=args.drivers,
        max_pool_bytes=args.max_pool_mib << 20 if args.max_pool_mib is not None else None,
        baselines=False if args.no_baseline else None,
        layerwise=False if args.no_layerwise else None,
        seed=args.seed,
        warmup=max(0, args.warmup),
    )
    if args.plot:
        from kvtransport.tools.sweep_plot import require_matplotlib

        require_matplotlib()
    runner = sweep.Sweep(grid, timeout=args.timeout, progress=sys.stderr)
    if args.connect:
        from kvtransport.tools.bench_remote import remote_peers

        runner.remote = args.connect
        runner.spawn = remote_peers(args.connect, args.timeout)
        runner.clock_offset = lambda peer: peer.measure_clock()  # type: ignore[attr-defined]
    with native_stdout_to_stderr():
        doc = runner.run()
    # The figures first: a plot that fails must not take a long sweep's results with it.
    print(json.dumps(doc, indent=2) if args.json else sweep_report.render(doc), flush=True)
    if args.plot:
        from kvtransport.tools.sweep_plot import plot

        plot(doc, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0 if doc["ok"] else 1


#: Flags of the single bench that a sweep (or --connect) would silently ignore.
_NOT_WITH_SWEEP = {"driver": "--drivers", "compare": "--drivers", "in_flight": "--concurrency", "device": None}
_SWEEP_ONLY = (
    "quick",
    "models",
    "tokens",
    "page_sizes",
    "placements",
    "concurrency",
    "reps",
    "drivers",
    "plot",
    "no_layerwise",
)


def _check_bench_flags(args: argparse.Namespace) -> None:
    sweeping = args.sweep or args.connect
    if sweeping:
        for flag, instead in _NOT_WITH_SWEEP.items():
            if getattr(args, flag) is not None:
                hint = f" (use {instead})" if instead else " (the sweep runs on host memory)"
                raise ConfigError(f"--{flag.replace('_', '-')} does not apply to --sweep/--connect{hint}")
        if (args.prefill_tp, args.decode_tp) != (1, 1):
            raise ConfigError("--prefill-tp/--decode-tp do not apply to --sweep/--connect")
    else:
        given = [f"--{f.replace('_', '-')}" for f in _SWEEP_ONLY if getattr(args, f) not in (None, False)]
        if given:
            raise ConfigError(f"{', '.join(given)} need --sweep (or --connect)")


def _listen(args: argparse.Namespace) -> int:
    from kvtransport.tools.bench_remote import Listener, new_token, token_from_env

    token = token_from_env()
    limit = args.max_pool_mib << 20 if args.max_pool_mib is not None else 8 << 30
    listener = Listener(args.listen, token or new_token(), max_pool_bytes=limit)
    print(f"kvtransport bench --listen: serving decode sides on {listener.address}", file=sys.stderr)
    if not token:
        print(f"  clients need KVTRANSPORT_BENCH_TOKEN={listener.token}", file=sys.stderr)
    try:
        listener.serve()
    except KeyboardInterrupt:
        pass
    return 0


def bench_cmd(args: argparse.Namespace) -> int:
    from kvtransport.tools.bench import Workload, run

    if args.list_models:
        from kvtransport.tools.presets import PRESETS

        for p in PRESETS.values():
            print(f"{p.key:<18}{p.name:<17}{p.note}")
        return 0
    other_mode = args.listen or args.sweep or args.connect or args.connects is not None or args.in_flight is not None
    if args.pin and args.trace is None and (other_mode or (args.prefill_tp, args.decode_tp) != (1, 1)):
        raise KVTransportError("--pin pins the one prefill and one decode process of the plain bench only")
    if args.trace is not None:
        return _bench_trace(args, other_mode)
    if args.listen:
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # the peers it starts inherit it
        return _listen(args)
    stray = [f for f in _TRACE_ONLY if f in _flags_given(args)]
    if stray:
        raise ConfigError(f"{', '.join(stray)} need --trace")
    if args.hosts is not None and not args.sim_plan:
        from kvtransport.tools import bench_hosts

        if other_mode or args.layerwise or args.consumer or (args.prefill_tp, args.decode_tp) != (1, 1):
            raise ConfigError("--hosts runs the plain bench (one prefill, one decode) across simulated hosts")
        return bench_hosts.run(
            args.argv, args.hosts, args.rails, args.rate, args.cut_at, args.cut_for, as_json=args.json
        )
    if args.cut_at is not None or args.rate is not None:
        raise ConfigError("--cut-at and --rate need --hosts")
    _check_bench_flags(args)
    if args.connect and not args.sweep:
        # One workload between two hosts: a one-point sweep of the bench's own flags, with no
        # cap of its own (the listener has one).
        args.max_pool_mib = args.max_pool_mib or 1 << 30
        args.models = args.models or ("llama-3-8b",)
        args.tokens, args.page_sizes = args.tokens or (args.prompt_tokens,), args.page_sizes or (args.page_tokens,)
        args.placements = args.placements or (args.placement,)
        args.concurrency, args.reps = args.concurrency or (1,), args.reps or args.requests
        args.quick, args.sweep = True, True
    if args.sweep:
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        return _sweep(args)

    if args.connects is not None:
        from kvtransport.tools.bench import connect_cost, render_connect_cost

        if args.connects < 1:
            raise KVTransportError("--connects must be positive")
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        with native_stdout_to_stderr():
            doc = connect_cost(args.connects, args.driver, args.timeout)
        print(json.dumps(doc, indent=2) if args.json else render_connect_cost(doc))
        return 0
    if args.requests < 1 or args.prompt_tokens < 1 or args.pool_factor < 1:
        raise KVTransportError("--requests, --prompt-tokens and --pool-factor must be positive")
    workload = Workload(
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        page_tokens=args.page_tokens,
        prompt_tokens=args.prompt_tokens,
        requests=args.requests,
        pool_factor=args.pool_factor,
        placement=args.placement,
        seed=args.seed,
        warmup=max(0, args.warmup),
        device=args.device,
        model="custom" if (args.layers, args.kv_heads, args.head_dim) != (32, 8, 128) else "Llama-3-8B",
    )
    # Mooncake logs every set-up step at INFO; keep the report readable (MC_LOG_LEVEL=INFO
    # in the environment brings it back).
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    if (args.prefill_tp, args.decode_tp) != (1, 1) or args.decode_engine or args.prefill_engine:
        if args.in_flight is not None:
            raise KVTransportError(
                "--in-flight runs between one prefill and one decode rank, not with --prefill-tp/--decode-tp"
            )
        return _bench_tp(args, workload)
    if args.consumer == "vllm":
        # The connector lives above the tools (integrations): loaded only for this mode.
        from kvtransport.integrations.vllm import bench as vllm_bench

        tokens = 256 if args.prompt_tokens == Workload().prompt_tokens else args.prompt_tokens
        with native_stdout_to_stderr():
            doc = vllm_bench.run(
                driver=args.driver or "auto",
                requests=args.requests,
                tokens=tokens,
                layers=args.layers,
                item=workload.item_len,
            )
        print(json.dumps(doc, indent=2) if args.json else vllm_bench.render(doc))
        return 0
    if args.layerwise:
        from kvtransport.tools import bench_layerwise

        if args.in_flight is not None or args.compare:
            raise KVTransportError("--layerwise runs alone: not with --in-flight or --compare")
        with native_stdout_to_stderr():
            doc = bench_layerwise.run(
                workload,
                args.compute_ms_per_layer,
                compute=args.compute,
                driver=args.driver,
                timeout=args.timeout,
                progress=sys.stderr,
            )
        print(json.dumps(doc, indent=2) if args.json else bench_layerwise.render(doc))
        return 0 if doc["integrity"]["ok"] else 1
    if args.in_flight is not None:
        from kvtransport.tools.bench import in_flight, render_in_flight

        with native_stdout_to_stderr():
            doc = in_flight(workload, args.in_flight, driver=args.driver, timeout=args.timeout, progress=sys.stderr)
        print(json.dumps(doc, indent=2) if args.json else render_in_flight(doc))
        return 0 if doc["integrity"]["ok"] else 1
    across = None
    if args.sim_plan:
        from kvtransport.tools.bench_hosts import Across

        across = Across.load(args.sim_plan)
    with native_stdout_to_stderr():
        report = run(
            workload,
            driver=args.driver,
            baseline=not args.no_baseline,
            progress=sys.stderr,
            timeout=args.timeout,
            compare=args.compare,
            pin=args.pin,
            across=across,
        )
    if args.sim_report:
        with open(args.sim_report, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.render())
    return 0 if report.integrity_ok else 1


#: Flags of the other modes, refused with ``--trace`` rather than ignored.
_NOT_WITH_TRACE = {
    "--prompt-tokens",
    "--placement",
    "--pool-factor",
    "--warmup",
    "--cut-at",
    "--cut-for",
    "--rails",
    "--plot",
    "--compute-ms-per-layer",
    "--compute",
}
#: ... and flags of ``--trace`` refused without it.
_TRACE_ONLY = ("--speedup", "--decode-cache-gib", "--pool-gib")


def _flags_given(args: argparse.Namespace) -> set[str]:
    """The long flags on the command line (``--requests 5`` and ``--requests=5`` alike)."""
    return {a.split("=", 1)[0] for a in args.argv if a.startswith("--")}


def _bench_trace(args: argparse.Namespace, other_mode: Any) -> int:
    from kvtransport.tools import bench_trace

    given = _flags_given(args)
    if other_mode or args.hosts is not None or args.layerwise or args.consumer or args.compare or args.pin:
        raise ConfigError("--trace runs alone: one prefill and one decode process on loopback")
    if (args.prefill_tp, args.decode_tp) != (1, 1) or args.device is not None:
        raise ConfigError("--trace replays between one prefill and one decode rank on host memory")
    ignored = sorted(given & _NOT_WITH_TRACE)
    if ignored:
        raise ConfigError(f"{', '.join(ignored)} do not apply to --trace (its requests' lengths come from the trace)")
    if "--speedup" in given and args.rate is not None:
        raise ConfigError("--speedup scales the trace's timestamps, --rate replaces them: one or the other")
    if args.decode_cache_gib < 0 or args.pool_gib <= 0:
        raise ConfigError("--decode-cache-gib must be 0 or more, --pool-gib positive")
    rate = None
    if args.rate is not None:
        try:
            rate = float(args.rate)
        except ValueError:
            raise ConfigError(f"--rate with --trace is requests a second, not {args.rate!r}") from None
    # --requests and --layers have the plain bench's defaults; the replay's own (TraceSettings)
    # hold unless they were given.
    own = {"requests": args.requests} if "--requests" in given else {}
    own |= {"layers": args.layers} if "--layers" in given else {}
    settings = bench_trace.TraceSettings(
        path=args.trace,
        speedup=args.speedup,
        rate=rate,
        decode_cache_gib=args.decode_cache_gib,
        pool_gib=args.pool_gib,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        page_tokens=args.page_tokens,
        seed=args.seed,
        baseline=not args.no_baseline,
        **own,
    )
    if settings.requests is not None and settings.requests < 1:
        raise ConfigError("--requests must be positive")
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    with native_stdout_to_stderr():
        doc = bench_trace.run(settings, driver=args.driver, timeout=args.timeout, progress=sys.stderr)
    print(json.dumps(doc, indent=2) if args.json else bench_trace.render(doc))
    return 0 if doc["integrity"]["ok"] else 1


def _bench_tp(args: argparse.Namespace, workload: Any) -> int:
    from kvtransport.tools import bench_tp

    if args.prefill_tp < 1 or args.decode_tp < 1:
        raise KVTransportError("--prefill-tp and --decode-tp must be positive")
    if args.device is not None:
        raise KVTransportError("the unequal-TP bench runs on host memory")
    with native_stdout_to_stderr():
        report = bench_tp.run(
            workload,
            args.driver,
            args.prefill_tp,
            args.decode_tp,
            timeout=args.timeout,
            progress=sys.stderr,
            engines=_engines(args),
        )
    print(bench_tp.main_json(report) if args.json else report.render())
    return 0 if report.ok else 1


def _engines(args: argparse.Namespace) -> tuple[str, str]:
    """The engines the bench's prefill and decode pools are shaped as (('', ''): kvtransport's)."""
    if args.decode_engine and args.prefill_engine:
        raise KVTransportError("--decode-engine and --prefill-engine: one of the two sides is SGLang's, name the other")
    if args.decode_engine:
        return "sglang", args.decode_engine
    if args.prefill_engine:
        return args.prefill_engine, "sglang"
    return "", ""


def main(argv: Sequence[str] | None = None) -> int:
    _setup_logging()
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # bench --hosts runs itself on a host
    try:
        return int(args.func(args))
    except KVTransportError as exc:
        print(f"kvtransport: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
