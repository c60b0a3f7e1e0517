"""Nothing acknowledged is lost on kill -9: real child processes, real SIGKILL, real LMDB.

Each round starts a child that writes to the same store with many concurrent trio writers:
every write puts two keys atomically (DURABLE, printed to stdout once acknowledged) and some
LAZY writes ride along.  The parent kills the child with SIGKILL at a random moment, then
reopens the store and checks: it opens cleanly, every acknowledged key is there with its
value (across all earlier rounds too), every pair is all-or-nothing, and the persisted
sequence covers every acknowledged sequence.  The map starts tiny so that it grows under
crash conditions too.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

from mqttring.lsm import LsmStore

CHILD = r"""
import sys, trio
from pathlib import Path
from mqttring.lsm import Durability, LsmStore, Put

path, round_no = Path(sys.argv[1]), int(sys.argv[2])

async def writer(store, w):
    i = 0
    while True:
        key = b"%04d-%03d-%06d" % (round_no, w, i)
        value = {"k": key, "pad": "p" * (i % 300)}
        if i % 5 == 4:
            await store.write([Put("archive", b"lazy-" + key, value)], Durability.LAZY)
        seq = await store.write([Put("queues", b"a-" + key, value),
                                 Put("inflight", b"b-" + key, value)])
        sys.stdout.write(f"{seq} {key.decode()}\n")
        sys.stdout.flush()
        i += 1

async def main():
    store = LsmStore(path, map_size=256 * 1024, lazy_sync_ms=5)
    store.start()
    print("ready", flush=True)
    async with trio.open_nursery() as nursery:
        for w in range(16):
            nursery.start_soon(writer, store, w)

trio.run(main)
"""

#: Seconds of kill rounds past the minimum (``LSM_CRASH_SECONDS`` for a longer search).
TIME_BUDGET = float(os.environ.get("LSM_CRASH_SECONDS", "15"))
MIN_ROUNDS = 12
MAX_ROUNDS = 60


def value_for(key: bytes) -> dict:
    i = int(key.rsplit(b"-", 1)[1])
    return {"k": key, "pad": "p" * (i % 300)}


def run_round(path, round_no: int, rng: random.Random) -> tuple[list[tuple[int, bytes]], int]:
    """Start a child, kill it at a random moment, return its acknowledged (seq, key)s."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(round_no)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first == b"ready\n", (first, proc.stderr.read() if proc.stderr else b"")
    time.sleep(rng.uniform(0.0, 0.3))
    os.kill(proc.pid, signal.SIGKILL)
    out, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()
    acked = []
    for line in out.split(b"\n")[:-1]:  # the last piece may be a half-written line
        seq, key = line.split(b" ")
        acked.append((int(seq), key))
    return acked, len(out)


def test_acknowledged_durable_writes_survive_sigkill(tmp_path):
    rng = random.Random(os.environ.get("LSM_CRASH_SEED", "3"))
    path = tmp_path / "store"
    acknowledged: dict[bytes, int] = {}
    started = time.monotonic()
    rounds = 0
    while rounds < MAX_ROUNDS and (rounds < MIN_ROUNDS
                                    or time.monotonic() - started < TIME_BUDGET):
        acked, _ = run_round(path, rounds, rng)
        for seq, key in acked:
            acknowledged[key] = seq
        rounds += 1

        store = LsmStore(path, map_size=256 * 1024)  # opens cleanly after the kill
        try:
            queues = dict(store.scan_sync("queues"))
            inflight = dict(store.scan_sync("inflight"))
            missing = [k for k in acknowledged if b"a-" + k not in queues]
            assert not missing, f"round {rounds}: {len(missing)} acknowledged keys lost"
            for key in acknowledged:
                assert queues[b"a-" + key] == value_for(key)
            # Atomic writes: the two halves of every write, acknowledged or not, agree.
            assert {k[2:] for k in queues} == {k[2:] for k in inflight}
            if acknowledged:
                assert store.last_sequence >= max(acknowledged.values())
            # Lazy rows that made it are intact (they may be missing, never corrupt).
            for key, value in store.scan_sync("archive"):
                assert value == value_for(key[len(b"lazy-"):])
        finally:
            store.close()
    print(f"{rounds} SIGKILL rounds, {len(acknowledged)} acknowledged durable writes checked")
    assert rounds >= MIN_ROUNDS
    assert len(acknowledged) > 1000, "children must have acknowledged writes before dying"
