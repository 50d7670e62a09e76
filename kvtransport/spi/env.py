"""Numbers from ``KVTRANSPORT_*`` environment variables, with one error style for the core and
the drivers alike: a value that is not a positive number of the expected unit raises
:class:`~kvtransport.spi.errors.ConfigError` naming the variable, the value and what it takes."""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvtransport.spi.errors import ConfigError


def env_number(
    name: str, default: float, *, integer: bool = False, env: Mapping[str, str] | None = None, zero: bool = False
) -> float:
    """The positive number in environment variable ``name`` (``default`` when unset or empty;
    ``zero``: 0 is allowed too)."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not {'a whole number' if integer else 'a number'}; unset it or give e.g. {default:g}"
        ) from None
    if not (value >= 0 if zero else value > 0) or value != value or value == float("inf"):
        raise ConfigError(
            f"{name}={raw!r} must be {'0 or more' if zero else 'positive'} and finite; "
            f"unset it or give e.g. {default:g}"
        )
    return value


def env_flag(name: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    """The switch in environment variable ``name``: 1 or 0 (also on/off, true/false, yes/no);
    ``default`` when unset or empty."""
    raw = (os.environ if env is None else env).get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "on", "true", "yes"):
        return True
    if raw in ("0", "off", "false", "no"):
        return False
    raise ConfigError(f"{name}={raw!r} must be 1 or 0; unset it for the default ({int(default)})")


def env_int(name: str, default: int, env: Mapping[str, str] | None = None, *, zero: bool = False) -> int:
    return int(env_number(name, default, integer=True, env=env, zero=zero))
