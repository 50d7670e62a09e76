"""Deprecated alias of :mod:`kvtransport.tools.shm`, where this module moved in 0.2."""

import warnings

from kvtransport.tools.shm import *  # noqa: F403

warnings.warn(
    "kvtransport.shm moved to kvtransport.tools.shm; the old path goes in a later release",
    DeprecationWarning,
    stacklevel=2,
)
