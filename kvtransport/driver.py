"""The public path of :mod:`kvtransport.spi.driver` (the driver SPI), kept for users and driver packages."""

from kvtransport.spi.driver import *  # noqa: F403
