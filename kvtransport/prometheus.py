"""Deprecated alias of :mod:`kvtransport.runtime.prometheus`, where this module moved in 0.2."""

import warnings

from kvtransport.runtime.prometheus import *  # noqa: F403

warnings.warn(
    "kvtransport.prometheus moved to kvtransport.runtime.prometheus; the old path goes in a later release",
    DeprecationWarning,
    stacklevel=2,
)
