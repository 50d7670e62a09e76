"""The test tiers' table (tests/tiers.py) names only tests that exist, and splits them as the
README says: the fast tier reaches every test file and every real driver."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.tiers import FAST_EXCEPTIONS, FULL, matches

ROOT = Path(__file__).resolve().parent.parent


def collected(*selections: tuple[str, ...]) -> list[list[str]]:
    """The node ids pytest collects under each selection (its arguments), the collections run
    side by side (each imports every test module: seconds)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args, "tests"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for args in selections
    ]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
        out.append([line for line in stdout.splitlines() if "::" in line])
    return out


def test_every_pattern_names_a_test_and_the_fast_tier_reaches_every_file_and_driver() -> None:
    every, fast = collected((), ("-m", "not full"))
    assert 0 < len(fast) < len(every)
    names: dict[str, list[str]] = {}
    for nodeid in every:
        path, _, name = nodeid.partition("::")
        names.setdefault(Path(path).stem, []).append(name.rpartition("::")[2])
    for table in (FULL, FAST_EXCEPTIONS):
        for stem, patterns in table.items():
            assert stem in names, f"tests/tiers.py names {stem}, which has no tests"
            for pattern in patterns:
                assert any(matches(n, pattern) for n in names[stem]), f"{stem}: {pattern} names no test"
    fast_files = {Path(n.partition("::")[0]).stem for n in fast}
    # Whole files in the full tier, by design: engines' own schedulers in processes (their parts
    # without the engine are in the fast tier: test_sglang, test_vllm_parts)
    campaigns = {"test_sglang_scheduler", "test_vllm", "test_cross_engine_cluster"}
    assert set(names) - fast_files == campaigns
    for driver in ("nixl-ucx", "mooncake-gdr", "mooncake-default-ring", "nixl-tiny-ring"):
        assert any(f"test_write_and_verify_bytes[{driver}]" in n for n in fast), driver


def test_a_pattern_takes_star_for_anything_and_brackets_as_they_are() -> None:
    assert matches("test_x[1-2-4-False]", "test_x[1-2-4-False]")
    assert not matches("test_x[1]", "test_x[1-2-4-False]")
    assert matches("test_x[4-2-0-True]", "test_x[4-*")
    assert not matches("test_y[4-2]", "test_x[4-*")
    assert matches("anything", "*")
