"""Model-based test: LsmStore against one dict per database, under random operation sequences.

Hypothesis drives puts, deletes, multi-op writes (sync API and async API from fresh trio
runs), gets, scans with every bound, TTL expiry, snapshots (read back through
``open_snapshot`` and compared with the model at that moment) and close + reopen of the
store, on real LMDB files.  The model is the obvious one: a dict per database, sorted on scan.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import trio
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from mqttring.lsm import EXPIRES_AT, Delete, Durability, LsmStore, Put, open_snapshot, shard_key
from mqttring.lsm.keys import key_range

DBS = ("queues", "retained")
keys = st.builds(lambda shard, suffix: shard_key(shard, suffix),
                 st.integers(0, 1), st.sampled_from([b"", b"a", b"ab", b"\xff"]))
values = st.one_of(
    st.none(), st.integers(-5, 5), st.text(max_size=5), st.binary(max_size=5),
    st.lists(st.integers(0, 3), max_size=3),
    st.fixed_dictionaries({EXPIRES_AT: st.sampled_from([1.0, 5.0, 9.0]), "m": st.integers(0, 9)}),
)
durabilities = st.sampled_from([Durability.DURABLE, Durability.LAZY])
bounds = st.one_of(st.none(), keys, st.just(b"\x00\x01"))
ops = st.one_of(
    st.builds(Put, st.sampled_from(DBS), keys, values),
    st.builds(Delete, st.sampled_from(DBS), keys),
)


def model_scan(model: dict[bytes, Any], prefix: bytes, start: bytes | None,
               end: bytes | None, limit: int | None) -> list[tuple[bytes, Any]]:
    rows = sorted((k, v) for k, v in model.items()
                  if k.startswith(prefix) and (start is None or k >= start)
                  and (end is None or k < end))
    return rows if limit is None else rows[:limit]


def make_machine(root: Path) -> type[RuleBasedStateMachine]:
    counter = itertools.count()

    class StoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.dir = root / f"case{next(counter)}"
            self.store = LsmStore(self.dir, map_size=128 * 1024, lazy_sync_ms=10)
            self.store.start()
            self.model: dict[str, dict[bytes, Any]] = {db: {} for db in DBS}
            self.seq = 0
            self.snapshots = 0
            # While held, the flusher commits nothing: writes (necessarily LAZY) stay in the
            # memtable, so reads must merge it over LMDB, tombstones included.
            self.held = False

        def teardown(self) -> None:
            self.store.close()

        def _apply(self, batch: list[Put | Delete]) -> None:
            for op in batch:
                if isinstance(op, Put):
                    self.model[op.db][op.key] = op.value
                else:
                    self.model[op.db].pop(op.key, None)

        def _durability(self, durability: Durability) -> Durability:
            return Durability.LAZY if self.held else durability

        @rule()
        def hold_flusher(self) -> None:
            self.held = not self.held
            self.store._queue.hold(self.held)

        def _wrote(self, seq: int) -> None:
            assert seq == self.seq + 1
            self.seq = seq

        @rule(db=st.sampled_from(DBS), key=keys, value=values, durability=durabilities)
        def put(self, db: str, key: bytes, value: Any, durability: Durability) -> None:
            self._wrote(self.store.write_sync([Put(db, key, value)], self._durability(durability)))
            self._apply([Put(db, key, value)])

        @rule(db=st.sampled_from(DBS), key=keys, durability=durabilities)
        def delete(self, db: str, key: bytes, durability: Durability) -> None:
            self._wrote(self.store.write_sync([Delete(db, key)], self._durability(durability)))
            self._apply([Delete(db, key)])

        @rule(batch=st.lists(ops, min_size=0, max_size=6), durability=durabilities)
        def write_batch(self, batch: list[Put | Delete], durability: Durability) -> None:
            self._wrote(self.store.write_sync(batch, self._durability(durability)))
            self._apply(batch)

        @rule(batch=st.lists(ops, min_size=1, max_size=4), durability=durabilities)
        def write_from_a_new_trio_run(self, batch: list[Put | Delete],
                                      durability: Durability) -> None:
            async def go() -> int:
                seq = await self.store.write(batch, self._durability(durability))
                final = {(op.db, op.key): op.value if isinstance(op, Put) else None
                         for op in batch}
                for (db, key), expected in final.items():  # read-your-writes, async API
                    assert await self.store.get(db, key) == expected
                return seq

            self._wrote(trio.run(go))
            self._apply(batch)

        @rule(db=st.sampled_from(DBS), key=keys)
        def get(self, db: str, key: bytes) -> None:
            assert self.store.get_sync(db, key) == self.model[db].get(key)

        @rule(db=st.sampled_from(DBS),
              prefix=st.sampled_from([b"", b"\x00", b"\x00\x01", b"\x00\x01a"]),
              start=bounds, end=bounds, limit=st.one_of(st.none(), st.integers(0, 4)))
        def scan(self, db: str, prefix: bytes, start: bytes | None, end: bytes | None,
                 limit: int | None) -> None:
            got = self.store.scan_sync(db, prefix, start=start, end=end, limit=limit)
            assert got == model_scan(self.model[db], prefix, start, end, limit)

        @rule(db=st.sampled_from(DBS), now=st.sampled_from([0.0, 5.0, 10.0]))
        def expire(self, db: str, now: float) -> None:
            expired = [k for k, v in self.model[db].items()
                       if isinstance(v, dict) and v[EXPIRES_AT] <= now]
            assert self.store.expire_sync(db, now) == len(expired)
            for key in expired:
                del self.model[db][key]
            if expired:
                self.seq = self.store.last_sequence

        @precondition(lambda self: not self.held)
        @rule(shards=st.one_of(st.none(), st.lists(st.integers(0, 3), max_size=2)))
        def snapshot(self, shards: list[int] | None) -> None:
            dest = self.dir.parent / f"{self.dir.name}-snap{self.snapshots}"
            self.snapshots += 1
            manifest = self.store.snapshot_sync(dest, shards=shards, node_id="n1")
            assert manifest.sequence == self.seq
            snap = open_snapshot(dest)
            assert snap.manifest == manifest
            for db in DBS:
                expected = sorted((k, v) for k, v in self.model[db].items()
                                  if shards is None or int.from_bytes(k[:2], "big") in shards)
                assert list(snap.rows(db)) == expected
                assert manifest.rows[db] == len(expected)

        @rule()
        def reopen(self) -> None:
            self.store.close()  # flushes even while held
            self.held = False
            self.store = LsmStore(self.dir, map_size=128 * 1024)
            assert self.store.last_sequence == self.seq
            self.store.start()

        @invariant()
        def sequence_matches(self) -> None:
            assert self.store.last_sequence == self.seq

        @invariant()
        def whole_databases_match(self) -> None:
            # Cheap with this few keys, and it catches merge bugs in whatever state the
            # memtable is in after every step, not only when a scan rule happens to run.
            for db in DBS:
                assert self.store.scan_sync(db) == sorted(self.model[db].items())

    return StoreMachine


def test_store_matches_dict_model(tmp_path):
    run_state_machine_as_test(
        make_machine(tmp_path),
        settings=settings(max_examples=60, stateful_step_count=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]))


def test_key_range_matches_model_filter():
    # The one helper the store's range logic rests on, checked exhaustively on tiny keys.
    alphabet = [b"", b"\x00", b"\x01", b"\xff", b"\x00\xff", b"\xff\xff", b"\x01\x00"]
    universe = sorted({a + b for a in alphabet for b in alphabet if a + b})
    for prefix in alphabet:
        for start in [None, *alphabet[1:]]:
            for end in [None, *alphabet[1:]]:
                low, high = key_range(prefix, start, end)
                got = [k for k in universe if k >= low and (high is None or k < high)]
                assert got == [k for k, _ in model_scan(dict.fromkeys(universe), prefix,
                                                        start, end, None)]
