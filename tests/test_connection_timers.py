"""``ConnectionTimers``: one task looks at each connection when it asked to, on trio's clock.

Virtual time (``MockClock``, autojump) with the real trio scheduler: the looks come at the
times asked for, not before, and an entry nobody wants any more costs nothing and holds
nothing.  What a connection does on a look (time out, park) is ``ClientHandler.on_timer``,
covered end to end (``test_e2e_takeover.py``'s keepalive tests, ``test_e2e_parking.py``).
"""

from __future__ import annotations

import gc
import math
import weakref

import trio
import trio.testing

from mqttring.broker.timers import ConnectionTimers


class Watched:
    """Asks to be looked at again every ``period`` until ``stop_after`` looks."""

    def __init__(self, timers: ConnectionTimers, period: float, stop_after: int) -> None:
        self.timers = timers
        self.period = period
        self.stop_after = stop_after
        self.looks: list[tuple[float, float]] = []
        self.wanted = math.inf

    def arm(self, at: float) -> None:
        if at < self.wanted:
            self.wanted = at
            self.timers.watch(self, at)

    def wants_timer(self, at: float) -> bool:
        return at == self.wanted

    def on_timer(self, at: float, now: float) -> float:
        if at != self.wanted:
            return math.inf
        self.looks.append((at, now))
        self.wanted = math.inf
        if len(self.looks) >= self.stop_after:
            return math.inf
        self.wanted = now + self.period
        return self.wanted


def run_with_timers(body) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        timers = ConnectionTimers()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(timers.run)
            await body(timers)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_each_look_comes_at_the_time_asked_and_stops_when_told() -> None:
    seen: list[Watched] = []

    async def body(timers: ConnectionTimers) -> None:
        start = trio.current_time()
        a = Watched(timers, period=0.25, stop_after=4)
        b = Watched(timers, period=1.0, stop_after=2)
        a.arm(start + 0.25)
        b.arm(start + 2.0)
        seen.extend([a, b])
        await trio.sleep(10)
        assert [round(now - start, 6) for _, now in a.looks] == [0.25, 0.5, 0.75, 1.0]
        assert [round(now - start, 6) for _, now in b.looks] == [2.0, 3.0]
        assert all(now >= at for at, now in a.looks + b.looks)

    run_with_timers(body)
    assert len(seen) == 2


def test_an_earlier_entry_wakes_the_sleeping_task() -> None:
    async def body(timers: ConnectionTimers) -> None:
        start = trio.current_time()
        late = Watched(timers, period=1.0, stop_after=1)
        late.arm(start + 60)
        await trio.sleep(1)  # the task now sleeps until start + 60
        early = Watched(timers, period=1.0, stop_after=1)
        early.arm(trio.current_time() + 0.5)
        await trio.sleep(1)
        assert [round(now - start, 6) for _, now in early.looks] == [1.5]
        assert late.looks == []

    run_with_timers(body)


def test_a_superseded_entry_is_skipped() -> None:
    async def body(timers: ConnectionTimers) -> None:
        start = trio.current_time()
        w = Watched(timers, period=1.0, stop_after=1)
        w.arm(start + 5)
        w.arm(start + 2)  # earlier: the entry for +5 is stale from now on
        await trio.sleep(10)
        assert [round(at - start, 6) for at, _ in w.looks] == [2.0]

    run_with_timers(body)


def test_an_ended_connection_is_not_kept_alive_and_stale_entries_are_dropped() -> None:
    async def body(timers: ConnectionTimers) -> None:
        start = trio.current_time()
        gone = Watched(timers, period=1.0, stop_after=1)
        gone.arm(start + 3600)
        ref = weakref.ref(gone)
        del gone
        gc.collect()
        assert ref() is None, "a timer entry kept an ended connection in memory"
        # A connection that keeps arming earlier entries leaves stale ones behind; they
        # are dropped in one pass once they outnumber the live ones.
        busy = Watched(timers, period=1.0, stop_after=1)
        for k in range(5000):
            busy.wanted = math.inf  # as if its look came and it armed anew
            busy.arm(start + 3000 - k * 0.1)
        assert len(timers) <= ConnectionTimers.COMPACT_AFTER + 3
        await trio.sleep(3600)
        assert len(busy.looks) == 1

    run_with_timers(body)
