"""The shared --max-streams count (service/core/stream_limit.py) between two frontends' views of it, in one
process (flock excludes across open file descriptions, so two views exclude each other as two processes
do). The whole server with two frontend processes: tests/test_server_processes.py::
test_max_streams_is_the_servers_limit_shared_by_its_frontends."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from service.core.stream_limit import SharedStreamCounts, SharedStreamLimit, StreamLimit


def test_the_count_is_shared_and_a_cleared_slot_gives_its_places_back(tmp_path: Path) -> None:
    lock = tmp_path / "streams.lock"
    lock.touch()
    counts = SharedStreamCounts(multiprocessing.get_context("spawn").Array("i", 2, lock=False), str(lock))
    a, b = SharedStreamLimit(3, counts, 0), SharedStreamLimit(3, counts, 1)
    assert [a.try_acquire(), b.try_acquire(), a.try_acquire()] == [True, True, True]
    assert not b.try_acquire() and not a.try_acquire()  # 3 open over both: full for each
    b.release()
    assert a.try_acquire() and not b.try_acquire()
    counts.clear(0)  # frontend 0 died holding 3
    assert list(counts.slots) == [0, 0]
    assert [b.try_acquire() for _ in range(4)] == [True, True, True, False]


def test_in_process_limit() -> None:
    limit = StreamLimit(1)
    assert limit.try_acquire() and not limit.try_acquire()
    limit.release()
    assert limit.try_acquire()
