"""A catch-up copies shards several at a time and reports what it copied as it goes.

An interop probe killed one node of a fresh 3-node cluster 3-15 s after start: the other
two were still copying their shards from it one at a time (~40 ms a shard on a loaded VM,
~35 s for the ~860 each), reported only at the end of the pass, and every shard not yet
reported had no other copy: clients of those shards were refused until the node came back.
``ShardMoves._copy_pass`` is driven here with its copy and its report replaced, so the pace
is a decision, tested without processes.
"""

from __future__ import annotations

from types import SimpleNamespace

import trio
import trio.testing

from mqttring.cluster.errors import PeerUnavailable
from mqttring.cluster.shard_moves import CATCH_UP_PARALLEL, CATCH_UP_REPORT_EVERY, ShardMoves


def _plane(copy, reports: list[list[int]]) -> SimpleNamespace:
    async def report(done: list[int]) -> None:
        reports.append(sorted(done))

    return SimpleNamespace(_copy_one=copy, _report_caught_up=report)


async def test_shards_are_copied_several_at_a_time(autojump_clock: trio.testing.MockClock
                                                   ) -> None:
    in_flight = peak = 0

    async def copy(shard: int) -> bool:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await trio.sleep(0.04)
        in_flight -= 1
        return True

    reports: list[list[int]] = []
    started = trio.current_time()
    failed, failure = await ShardMoves._copy_pass(_plane(copy, reports), list(range(100)))
    assert (failed, failure) == ([], None)
    assert peak == CATCH_UP_PARALLEL
    assert trio.current_time() - started < 100 * 0.04 / 2, "not one shard at a time"
    assert sorted(s for batch in reports for s in batch) == list(range(100))


async def test_what_is_copied_is_reported_while_the_rest_goes_on(
        autojump_clock: trio.testing.MockClock) -> None:
    """Shard 0's source hangs: the others count as caught up within the report period,
    not when the pass ends."""
    hung = trio.Event()

    async def copy(shard: int) -> bool:
        if shard == 0:
            await hung.wait()
        return True

    reports: list[list[int]] = []

    async def release_after_the_first_report() -> None:
        while not reports:
            await trio.sleep(0.1)
        hung.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(release_after_the_first_report)
        started = trio.current_time()
        await ShardMoves._copy_pass(_plane(copy, reports), list(range(20)))
    assert reports[0] == list(range(1, 20))
    assert trio.current_time() - started <= CATCH_UP_REPORT_EVERY + 0.2
    assert reports[1:] == [[0]]


async def test_failures_are_returned_and_the_rest_reported(
        autojump_clock: trio.testing.MockClock) -> None:
    async def copy(shard: int) -> bool:
        if shard % 5 == 0:
            raise PeerUnavailable("gone")
        return shard != 7  # 7: nothing to copy from (not reported)

    reports: list[list[int]] = []
    failed, failure = await ShardMoves._copy_pass(_plane(copy, reports), list(range(20)))
    assert sorted(failed) == [0, 5, 10, 15] and isinstance(failure, PeerUnavailable)
    assert sorted(s for batch in reports for s in batch) == [
        s for s in range(20) if s % 5 and s != 7]


async def test_a_report_cut_short_is_made_again(autojump_clock: trio.testing.MockClock
                                                ) -> None:
    """The periodic report still in flight when the copies end is cancelled: what it held
    is reported at the end, never dropped (a shard copied but never reported stays
    catching up for ever)."""
    commits: list[list[int]] = []

    async def slow_report(done: list[int]) -> None:
        await trio.sleep(0.5)  # a Raft commit
        commits.append(sorted(done))

    async def copy(shard: int) -> bool:
        await trio.sleep(CATCH_UP_REPORT_EVERY + 0.1 if shard else 0)
        return True

    plane = SimpleNamespace(_copy_one=copy, _report_caught_up=slow_report)
    await ShardMoves._copy_pass(plane, [0, 1])
    assert sorted(s for batch in commits for s in batch) == [0, 1]
