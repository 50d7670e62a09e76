"""How ``nixl-ucx`` cuts a large batch into parts for its posting threads (the parts
themselves run on the real engine in ``test_conformance_engines.py``'s ``nixl-ucx/split``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

posters = pytest.importorskip("kvtransport_nixl.posters")


@given(
    lengths=st.lists(st.integers(1, 1 << 24), min_size=0, max_size=200),
    parts=st.integers(1, 8),
)
def test_parts_cover_every_run_once_with_about_equal_bytes(lengths: list[int], parts: int) -> None:
    runs = np.array(lengths, dtype=np.uint64)
    cuts = posters.split_points(runs, parts)
    assert cuts[0] == 0 and cuts[-1] == len(lengths)
    assert all(a < b for a, b in itertools.pairwise(cuts)) or len(lengths) == 0
    assert len(cuts) - 1 <= max(1, parts)
    total = sum(lengths)
    if len(lengths) >= 2 and parts >= 2:
        # Each slice holds at most its share plus one run: cuts sit at the run boundaries
        # nearest the equal shares.
        largest = max(lengths)
        for a, b in itertools.pairwise(cuts):
            assert sum(lengths[a:b]) <= total / parts + largest


def test_equal_runs_split_evenly() -> None:
    runs = np.full(16384, 32768, dtype=np.uint64)
    assert posters.split_points(runs, 2) == [0, 8192, 16384]
    assert posters.split_points(runs, 1) == [0, 16384]


def test_settings_from_options_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(posters.ENV_SPLIT_BYTES, "4096")
    assert posters.posters_from_env()[1] == 4096
    assert posters.posters_from_env({posters.OPT_SPLIT_BYTES: "1"})[1] == 1
    assert posters.posters_from_env({posters.OPT_POSTERS: "64"})[0] <= (__import__("os").cpu_count() or 1)
    monkeypatch.setenv(posters.ENV_POSTERS, "zero")
    with pytest.raises(Exception, match="KVTRANSPORT_NIXL_POSTERS"):
        posters.posters_from_env()
