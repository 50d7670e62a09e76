"""Deprecated alias of :mod:`kvtransport.tools.baseline`, where this module moved in 0.2."""

import warnings

from kvtransport.tools.baseline import *  # noqa: F403

warnings.warn(
    "kvtransport.baseline moved to kvtransport.tools.baseline; the old path goes in a later release",
    DeprecationWarning,
    stacklevel=2,
)
