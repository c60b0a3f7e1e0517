"""``python -m benchmarks.repro_reset``: a subscriber that resets its connection mid-stream.

Why it is here: the first full benchmark run lost the mqttring node (exit 1) at the end of a
scenario, when subscribers closed while the broker still had data queued for them.  This
reproduces that in two seconds, outside the suite: a subscriber stops reading, a publisher
fills its queue, the subscriber closes with unread bytes (the kernel sends RST), and the
publisher keeps publishing.  A correct broker drops that one connection and keeps serving.
Exit status 0 if the node survived, 1 if it died (its log tail is printed).
"""

from __future__ import annotations

import sys
import time

from benchmarks import wire
from benchmarks.brokers import start_mqttring
from benchmarks.loadgen import open_conn, subscribe


def main() -> int:
    h = start_mqttring()
    if h.unavailable:
        print(f"mqttring not available: {h.unavailable}", file=sys.stderr)
        return 2
    try:
        sub, pre = open_conn(h.host, h.port, "repro-slow-sub")
        subscribe(sub, pre, ["repro/t"], 0, 5)
        pub, _ = open_conn(h.host, h.port, "repro-pub")
        batch = wire.publish("repro/t", b"x" * 64) * 100
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:
            pub.sendall(batch)
        sub.close()  # unread data in its receive buffer: RST to the broker
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 1.0:
                pub.sendall(batch)
        except OSError as exc:
            print(f"publisher connection failed too: {exc}")
        time.sleep(1.0)
        if h.alive():
            print("node survived the reset subscriber")
            return 0
        print(f"node DIED (exit {h.proc.returncode if h.proc else '?'}); log tail:")
        print(h.stderr_tail())
        return 1
    finally:
        h.stop()


if __name__ == "__main__":
    sys.exit(main())
