"""Probe NIXL and its UCX backend on this host, once per process.

The probe imports the NIXL binding, then a child process creates a throw-away agent and
instantiates the backend:
that is the only reliable test that the UCX plugin exists in this wheel and that the user's
``UCX_TLS`` leaves UCX a usable transport (an unusable one fails with a bare
``NIXL_ERR_BACKEND``; we name the setting instead).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any

from kvtransport.spi.diagnose import import_failure
from kvtransport.spi.driver import DriverStatus

ENV_BACKEND = "KVTRANSPORT_NIXL_BACKEND"
ENV_BACKEND_PARAMS = "KVTRANSPORT_NIXL_BACKEND_PARAMS"
ENV_VARS = (ENV_BACKEND, ENV_BACKEND_PARAMS)

#: Python modules of the NIXL wheels, in the order tried.
NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")


@dataclass(frozen=True)
class NixlFacts:
    status: DriverStatus
    module: str = ""
    backend: str = ""
    backend_params: tuple[tuple[str, str], ...] = ()
    mem_types: tuple[str, ...] = ()


#: UCX transport names by family, as ``UCX_TLS`` may list them.
SHM_TLS = {"sm", "shm", "posix", "sysv", "cma", "xpmem", "knem"}
RDMA_TLS = {"ib", "rc", "rc_x", "rc_v", "ud", "ud_x", "ud_v", "dc", "dc_x", "rc_mlx5", "ud_mlx5", "dc_mlx5"}
CUDA_IPC_TLS = {"cuda", "cuda_ipc"}
#: Those in which the writer copies into the receiver's memory itself (cross-memory attach,
#: kernel-assisted copies, CUDA IPC), which no receiver can stop ("sm"/"shm" name them all).
WRITER_COPIES_TLS = {"sm", "shm", "cma", "knem", "xpmem", "cuda", "cuda_ipc"}


def allows(ucx_tls: str, family: set[str]) -> bool:
    """Whether a ``UCX_TLS`` value lets UCX use any transport of ``family``.

    Unset or ``all`` allows everything; ``^a,b`` excludes a and b; otherwise it is a list.
    """
    raw = ucx_tls.strip()
    if not raw:
        return True
    negate = raw.startswith("^")
    names = {t.strip() for t in raw.lstrip("^").split(",") if t.strip()}
    if negate:
        return not family <= names
    return "all" in names or bool(names & family)


def backend_config(env: dict[str, str] | None = None) -> tuple[str, dict[str, str], str]:
    """(backend name, init params, error) from the environment."""
    env = dict(os.environ) if env is None else env
    backend = env.get(ENV_BACKEND, "").strip() or "UCX"
    raw = env.get(ENV_BACKEND_PARAMS, "").strip()
    if not raw:
        return backend, {}, ""
    try:
        params = json.loads(raw)
    except json.JSONDecodeError as exc:
        return backend, {}, f"{ENV_BACKEND_PARAMS} is not a JSON object: {exc}"
    if not isinstance(params, dict):
        return backend, {}, f"{ENV_BACKEND_PARAMS} must be a JSON object of strings"
    return backend, {str(k): str(v) for k, v in params.items()}, ""


def import_nixl() -> tuple[ModuleType | None, BaseException | None]:
    first_error: BaseException | None = None
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name), None
        except Exception as exc:  # noqa: BLE001
            if first_error is None or not isinstance(exc, ModuleNotFoundError):
                first_error = exc
    return None, first_error


def quiet_nixl_logging() -> None:
    """NIXL logs every agent creation at INFO; keep the library quiet by default."""
    for name in NIXL_MODULES:
        logging.getLogger(name).setLevel(logging.WARNING)
        logging.getLogger(f"{name}._api").setLevel(logging.WARNING)


def version() -> str:
    for dist in ("nixl-cu12", "nixl-cu13", "nixl"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return ""


# Runs in a child process. Creating a UCX backend is the only real test of the wheel and of
# UCX_TLS, and on these machines a process that created one crashes (SIGSEGV) at interpreter
# exit unless another engine's libraries were loaded first; the child reports, then leaves
# with os._exit so the crash can never reach the caller's process.
_CHILD = """
import json, os, sys
module, backend, params = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = {}
try:
    nixl = __import__(module)
    agent = nixl.nixl_agent("kvtransport-probe-%d" % os.getpid(), nixl.nixl_agent_config(backends=[]))
    out["plugins"] = ", ".join(agent.get_plugin_list())
    if backend not in agent.get_plugin_list():
        out["missing_plugin"] = True
    else:
        agent.create_backend(backend, params)
        out["mem_types"] = list(agent.get_backend_mem_types(backend))
except Exception as exc:
    out["error"] = "%s: %s" % (type(exc).__name__, exc)
sys.stdout.write("KVTRANSPORT-PROBE " + json.dumps(out) + "\\n")
sys.stdout.flush()
os._exit(0)
"""


def _probe_backend_in_child(module: str, backend: str, params: dict[str, str], timeout: float = 20.0) -> dict[str, Any]:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, module, backend, json.dumps(params)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"creating the {backend} backend did not finish within {timeout:g} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("KVTRANSPORT-PROBE "):
            result: dict[str, Any] = json.loads(line.split(" ", 1)[1])
            return result
    return {"error": f"the probe process died (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"}


@functools.lru_cache(maxsize=1)
def probe_nixl() -> NixlFacts:
    module, error = import_nixl()
    if module is None:
        assert error is not None
        return NixlFacts(import_failure(error, module="nixl_cu12", install="pip install kvtransport-nixl"))
    quiet_nixl_logging()
    backend, params, config_error = backend_config()
    ver = version()
    if config_error:
        return NixlFacts(DriverStatus(False, config_error, fix=f"fix or unset {ENV_BACKEND_PARAMS}", version=ver))
    ucx_tls = os.environ.get("UCX_TLS", "")
    result = _probe_backend_in_child(module.__name__, backend, params)
    error = result.get("error", "")
    if result.get("missing_plugin"):
        return NixlFacts(
            DriverStatus(
                False,
                f"NIXL {ver} has no {backend} backend plugin (plugins: {result['plugins'] or 'none'})",
                fix="reinstall nixl-cu12, or set KVTRANSPORT_NIXL_BACKEND to an available backend",
                version=ver,
            )
        )
    if error:
        hint = f" with UCX_TLS={ucx_tls!r}" if ucx_tls else ""
        return NixlFacts(
            DriverStatus(
                False,
                f"NIXL could not create the {backend} backend{hint}: {error}",
                fix="unset UCX_TLS or include a transport this host has (e.g. UCX_TLS=tcp,self or shm,self)"
                if ucx_tls
                else "check UCX_* environment variables and the NIXL installation",
                version=ver,
            )
        )
    mem_types = tuple(result.get("mem_types", ()))
    return NixlFacts(
        DriverStatus(True, f"NIXL {ver} ({module.__name__}) with the {backend} backend", version=ver),
        module=module.__name__,
        backend=backend,
        backend_params=tuple(sorted(params.items())),
        mem_types=mem_types,
    )
