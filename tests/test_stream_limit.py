"""The shared --max-streams count (service/recognizer/stream_limit.py) between two frontends' views of it, in one
process (flock excludes across open file descriptions, so two views exclude each other as two processes
do). The whole server with two frontend processes: tests/test_server_processes.py::
test_max_streams_is_the_servers_limit_shared_by_its_frontends."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from service.recognizer.stream_limit import (
    MAX_STREAMS,
    MAX_STREAMS_PER_TOKEN,
    SharedStreamCounts,
    SharedStreamLimit,
    StreamLimit,
)


def shared_counts(tmp_path: Path, frontends: int = 2, buckets: int = 64) -> SharedStreamCounts:
    lock = tmp_path / "streams.lock"
    lock.touch()
    ctx = multiprocessing.get_context("spawn")
    return SharedStreamCounts(
        ctx.Array("i", frontends, lock=False),
        str(lock),
        ctx.Array("q", buckets, lock=False),
        ctx.Array("i", frontends * buckets, lock=False),
    )


def test_the_count_is_shared_and_a_cleared_slot_gives_its_places_back(tmp_path: Path) -> None:
    counts = shared_counts(tmp_path)
    a, b = SharedStreamLimit(3, counts, 0), SharedStreamLimit(3, counts, 1)
    assert [a.take(), b.take(), a.take()] == [None, None, None]
    assert b.take() == MAX_STREAMS and a.take() == MAX_STREAMS  # 3 open over both: full for each
    b.release()
    assert a.take() is None and b.take() == MAX_STREAMS
    counts.clear(0)  # frontend 0 died holding 3
    assert list(counts.slots) == [0, 0]
    assert [b.take() for _ in range(4)] == [None, None, None, MAX_STREAMS]


def test_in_process_limit() -> None:
    limit = StreamLimit(1)
    assert limit.take() is None and limit.take() == MAX_STREAMS
    limit.release()
    assert limit.take() is None


def test_a_tokens_share_holds_across_frontends_and_other_tokens_are_admitted(tmp_path: Path) -> None:
    """Issue 26 #8: one token could hold every place. With --max-streams-per-token 2, a token's streams on
    both frontends count together; another token, and an anonymous caller, still get places; a place
    given back (or a dead frontend's) is the token's again."""
    counts = shared_counts(tmp_path)
    a, b = SharedStreamLimit(10, counts, 0, per_caller=2), SharedStreamLimit(10, counts, 1, per_caller=2)
    assert [a.take("token-A"), b.take("token-A")] == [None, None]
    assert a.take("token-A") == MAX_STREAMS_PER_TOKEN and b.take("token-A") == MAX_STREAMS_PER_TOKEN
    assert [a.take("token-B"), b.take("token-B"), a.take(""), b.take("")] == [None, None, None, None]
    b.release("token-A")
    assert a.take("token-A") is None and b.take("token-A") == MAX_STREAMS_PER_TOKEN
    counts.clear(0)  # frontend 0 died holding two of token-A's streams (and one of token-B's)
    assert [b.take("token-A"), b.take("token-A"), b.take("token-A")] == [None, None, MAX_STREAMS_PER_TOKEN]


def test_many_callers_reuse_the_buckets_their_streams_left(tmp_path: Path) -> None:
    """The per-token table has room for every caller holding a stream at once; a bucket whose streams
    are all given back serves the next caller."""
    counts = shared_counts(tmp_path, buckets=4)
    limit = SharedStreamLimit(100, counts, 0, per_caller=1)
    for n in range(50):  # 50 callers one after the other, each a stream at a time
        assert limit.take(f"token-{n}") is None
        assert limit.take(f"token-{n}") == MAX_STREAMS_PER_TOKEN
        limit.release(f"token-{n}")
    held = [limit.take(f"held-{n}") for n in range(4)]
    assert held == [None] * 4


def test_in_process_limit_per_token() -> None:
    limit = StreamLimit(10, per_caller=1)
    assert limit.take("token-A") is None and limit.take("token-A") == MAX_STREAMS_PER_TOKEN
    assert limit.take("token-B") is None and limit.take("") is None and limit.take("") is None
    limit.release("token-A")
    assert limit.take("token-A") is None
