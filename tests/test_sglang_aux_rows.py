"""The aux rows an SGLang decode states for a vLLM prefill's first-token handoff, checked against
SGLang 0.5.23's own ``MetadataBuffers`` in every shape its options give it (logprob rows, the
sampling mask's three rows, DSA's top-k row, the KV checksum row after the room), and the handoff
planned by kvtransport into those buffers read back with SGLang's own ``get_buf``: the token,
the cached counts and the room where SGLang's decode reads them, the rows it does not write left
as they were. Runs tests/sglang_aux_rows.py in a child process (SGLang's scheduler modules need
the torchvision stand-in, which this process keeps off its path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import require_engines

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def shapes() -> list[dict[str, object]]:
    require_engines()
    pytest.importorskip("sglang")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE / "stand_ins"), str(HERE.parent)])}
    done = subprocess.run(
        [sys.executable, str(HERE / "sglang_aux_rows.py")], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_every_shape_of_sglangs_metadata_buffers_is_read(shapes: list[dict[str, object]]) -> None:
    assert len(shapes) == 8
    counts = {s["count"] for s in shapes}
    assert counts == {10, 11, 12, 13, 14, 15}, counts


def test_the_stated_rows_are_sglangs_own(shapes: list[dict[str, object]]) -> None:
    for shape in shapes:
        assert shape["rows"] is not None, shape
        assert shape["named"] == {"output_ids": True, "cached_tokens": True, "bootstrap_room": True}, shape
        if shape["checksum"]:
            # Read without the option, the room would be the checksum row: the option decides.
            assert shape["misread_room"] is False, shape


def test_sglangs_decode_reads_the_handoff_kvtransport_wrote(shapes: list[dict[str, object]]) -> None:
    for shape in shapes:
        assert shape["read"] == {
            "output_id": 777,
            "cached_tokens": [32, 32, 0, 0, 0, 0, 0],
            "logprob": 0.5,  # not a handoff row: as the slot's owner left it
            "room": 123_456_789_012,
        }, shape
