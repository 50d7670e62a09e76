"""The public path of :mod:`kvtransport.spi.diagnose` (the driver SPI), kept for users and driver packages."""

from kvtransport.spi.diagnose import *  # noqa: F403
