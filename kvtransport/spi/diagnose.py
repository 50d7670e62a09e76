"""Turn an engine's import failure into a reason and a fix a user can act on.

Drivers call :func:`import_failure` from ``probe()`` when importing their engine fails, so that
"engine not installed", "a system library is missing" and "this build needs CUDA" read
differently, each with the command that fixes it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

from kvtransport.spi.driver import DriverStatus

#: Shared libraries engines commonly need, and how to get them on Debian/Ubuntu.
SYSTEM_LIBRARY_FIXES = {
    "libibverbs.so.1": "apt-get install libibverbs1",
    "librdmacm.so.1": "apt-get install librdmacm1",
    "libnuma.so.1": "apt-get install libnuma1",
    "libucp.so.0": "apt-get install libucx0",
}
_CUDA_LIBS = re.compile(r"(libcuda\.so[.\d]*|libcudart\.so[.\d]*|libnvidia-ml\.so[.\d]*|libcublas\S*\.so[.\d]*)")
_MISSING_LIB = re.compile(r"(lib[\w+.-]+\.so[.\d]*): cannot open shared object file")


def import_failure(
    exc: BaseException,
    *,
    module: str,
    install: str,
    cpu_build_hint: str = "",
) -> DriverStatus:
    """A ``DriverStatus`` explaining why importing ``module`` failed.

    ``install`` is the pip command that installs the engine; ``cpu_build_hint`` what to install
    instead when the installed build needs CUDA on a host without it.
    """
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == module.split(".")[0]:
        return DriverStatus(False, f"engine not installed (no module {module!r})", fix=install)
    cuda = _CUDA_LIBS.search(text)
    if cuda:
        return DriverStatus(
            False,
            f"installed, but this build needs CUDA: {cuda.group(1)} is missing ({text})",
            fix=cpu_build_hint or "install the CUDA driver and toolkit runtime",
        )
    missing = _MISSING_LIB.search(text)
    if missing:
        lib = missing.group(1)
        fix = SYSTEM_LIBRARY_FIXES.get(lib, f"install the system package that provides {lib}")
        return DriverStatus(False, f"installed, but the system library {lib} is missing", fix=fix)
    return DriverStatus(False, f"engine failed to import: {text}", fix=install)


class NativeOutput:
    """What a native engine wrote to file descriptor 2 while :func:`capture_native_stderr` ran."""

    text = ""

    def tail(self, lines: int = 5) -> str:
        """The last few non-empty lines, for an error message."""
        kept = [line.strip() for line in self.text.splitlines() if line.strip()]
        return " | ".join(kept[-lines:])


@contextlib.contextmanager
def capture_native_stderr(echo: bool = True) -> Iterator[NativeOutput]:
    """Record what native code prints to stderr during a set-up call, then pass it on.

    Engines such as Mooncake report why a call failed only in their log (the call itself
    returns ``-1``); drivers wrap initialisation and registration in this so the error they
    raise can quote the engine's own words. The output is still written to the real stderr
    afterwards, so nothing the user would have seen is lost (``echo=False``: it is dropped,
    for an engine's known noise while it is torn down).
    """
    out = NativeOutput()
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield out
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.text = tmp.read().decode(errors="replace")
            if out.text and echo:
                sys.stderr.write(out.text)
                sys.stderr.flush()
