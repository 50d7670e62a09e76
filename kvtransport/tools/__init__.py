"""The command line and the measuring tools built on the library: ``kvtransport doctor``,
``negotiate``, ``bench`` (and its sweep, TP, remote and calibration modes), ``soak`` and the GPU check.
Nothing in the library imports this package.
"""
