"""The GPU check rehearsed on CPU (scripts/gpu_rehearse.sh --quick): offline, in a fresh
virtualenv of only the GPU host's preinstalled packages plus the carried wheels, each part in
a copy holding only what the device tool would send. Every step of scripts/gpu_check.sh runs;
a step that fails, a missing import or a part that leaves more than 8 files fails this test.
The rehearsal starts in the background when pytest has collected this test (tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.support.gpu_rehearsal import Rehearsal


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a first run builds the rehearsal venv (torch and all): minutes
def test_gpu_check_rehearsal_passes_offline(background_gpu_rehearsal: Rehearsal) -> None:
    # started in the background at collection, at nice 19 (tests/support/gpu_rehearsal.py)
    returncode, out = background_gpu_rehearsal.result(timeout_s=1700)
    tmp_path = background_gpu_rehearsal.directory
    assert returncode == 0, out[-6000:]
    assert "== rehearsal: passed" in out
    for part in (1, 2):
        files = sorted(p.name for p in (tmp_path / f"out{part}").iterdir())
        assert files == [f"log-part{part}.txt", f"steps-part{part}.tar.gz", f"tables-part{part}.md"]
    tables = (tmp_path / "out1" / "tables-part1.md").read_text() + (
        tmp_path / "out2" / "tables-part2.md"
    ).read_text()
    # One table per step, none marked failed: encoder (both contexts), engine (off and on),
    # real weights (CPU float32 and the other dtype), the server path (off and on).
    assert "FAILED" not in tables
    for needle in (
        "| trim (",
        "| full (",
        "| 2 | off |",
        "| 2 | on |",
        "| cpu | float32 | 1/1 |",
        "| cpu | bfloat16 |",
        "### Through asr-server",
    ):
        assert needle in tables, needle
    log2 = (tmp_path / "out2" / "log-part2.txt").read_text()
    assert "sha256 ok" in log2  # the weights were joined from part 1's piece and part 2's
    assert "IMPORT FAILED" not in log2
