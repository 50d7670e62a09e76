"""The command line and the measuring tools built on the library: ``kvtransport doctor``,
``negotiate``, ``bench`` (and its sweep, TP, remote and calibration modes), ``soak`` and the GPU check.
Nothing below it imports it; the test kit (``testing``) uses its KV pools and peer processes.
"""
