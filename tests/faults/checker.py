"""The cluster contract, checked over what the clients recorded (pure functions, no I/O).

Why each rule is shaped the way it is (so that a failure is the broker's, not the harness'):

* Only *acknowledged* publishes (PUBACK seen) are owed to anyone; a publish whose connection
  died first may or may not arrive and is never counted as lost.
* A persistent subscriber is owed every acknowledged message *sent* after its first SUBACK:
  the session outlives connections.  A clean subscriber is owed a message only if one of its
  connection intervals (SUBACK ... close) covers the whole way from the send to ``GRACE``
  seconds after the PUBACK, or lasted until we closed it at the end of the run (an interval
  still open counts as covering).
* Duplicates are allowed at QoS 1 and only counted; a message that arrived at QoS 2 must
  arrive once (``qos2_duplicates``).  Order is MQTT's (4.6): per topic, per
  publisher *connection*; a lower sequence after a higher one is a reorder unless that
  sequence had already been delivered (then it is a re-delivery, counted as a duplicate).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from .workload import Acked, Delivery

#: Seconds after a PUBACK a clean subscriber must still be connected to be owed the message.
GRACE = 5.0
#: A second CONNACK 0 for a client id may leave the first connection open at most this long
#: (a takeover is one cross-node round trip and a close; the margin is wide).  A node that
#: cannot reach the client id's home must refuse or close, not keep a second live session.
TAKEOVER_BOUND = 5.0
SAMPLE = 10


@dataclass
class SubscriberRecord:
    name: str
    clean: bool
    deliveries: list[Delivery]
    first_suback: float | None
    intervals: list[list[float | None]]
    session_lost: list[float] = field(default_factory=list)


def owed(sub: SubscriberRecord, acked: Iterable[Acked]) -> list[Acked]:
    out = []
    for a in acked:
        if not sub.clean:
            if sub.first_suback is not None and a.t_sent > sub.first_suback:
                out.append(a)
            continue
        for start, end, by_us in sub.intervals:
            if start is None or a.t_sent <= start:
                continue
            if by_us or end is None or end >= a.t_ack + GRACE:
                out.append(a)
                break
    return out


def check_delivery(subs: list[SubscriberRecord], acked: list[Acked]) -> dict[str, Any]:
    """Loss, duplicates and order for every subscriber."""
    per_sub: dict[str, Any] = {}
    lost_persistent: set[tuple[str, int]] = set()
    lost_clean: set[tuple[str, int]] = set()
    delivered_anywhere: set[tuple[str, int]] = set()
    dups = reorders = q2_dups = 0
    samples: list[dict[str, Any]] = []
    acked_at = {(a.pub, a.seq): (a.t_sent, a.t_ack) for a in acked}
    for sub in subs:
        delivered: dict[tuple[str, int], int] = defaultdict(int)
        for d in sub.deliveries:
            delivered[(d.pub, d.seq)] += 1
            delivered_anywhere.add((d.pub, d.seq))
        sub_dups = sum(n - 1 for n in delivered.values() if n > 1)
        # Exactly once: a message that arrived at QoS 2 arrives once (publishers never send
        # a sequence number twice, so every second copy is the broker's).
        at_qos2: dict[tuple[str, int], int] = defaultdict(int)
        for d in sub.deliveries:
            if d.qos == 2:
                at_qos2[(d.pub, d.seq)] += 1
        sub_q2_dups = sum(n - 1 for n in at_qos2.values() if n > 1)
        q2_dups += sub_q2_dups
        for key in [k for k, n in at_qos2.items() if n > 1][:2]:
            if len(samples) < SAMPLE:
                copies = [d for d in sub.deliveries if (d.pub, d.seq) == key]
                samples.append({"kind": "qos2 duplicate", "sub": sub.name, "pub": key[0],
                                "seq": key[1], "topic": copies[0].topic,
                                "t": [round(d.t, 3) for d in copies],
                                "dup": [d.dup for d in copies]})
        # order per (topic, publisher, connection)
        highest: dict[tuple[str, str, int], int] = {}
        highest_t: dict[tuple[str, str, int], float] = {}
        seen: set[tuple[str, int]] = set()
        sub_reorders = 0
        for d in sub.deliveries:
            key = (d.topic, d.pub, d.conn)
            if d.seq < highest.get(key, 0) and (d.pub, d.seq) not in seen:
                sub_reorders += 1
                if len(samples) < SAMPLE:
                    ack = acked_at.get((d.pub, d.seq))
                    samples.append({"kind": "reorder", "sub": sub.name, "topic": d.topic,
                                    "pub": d.pub, "seq": d.seq, "after": highest[key],
                                    "t": round(d.t, 3), "dup": d.dup,
                                    "t_after": round(highest_t[key], 3),
                                    "t_sent": None if ack is None else round(ack[0], 3),
                                    "t_ack": None if ack is None else round(ack[1], 3)})
            if d.seq >= highest.get(key, 0):
                highest_t[key] = d.t
            highest[key] = max(highest.get(key, 0), d.seq)
            seen.add((d.pub, d.seq))
        due = owed(sub, acked)
        missing = [a for a in due if (a.pub, a.seq) not in delivered]
        for a in missing:
            (lost_clean if sub.clean else lost_persistent).add((a.pub, a.seq))
        for a in missing[:3]:
            if len(samples) < SAMPLE:
                samples.append({"kind": "lost", "sub": sub.name, "pub": a.pub, "seq": a.seq,
                                "topic": a.topic, "t_sent": round(a.t_sent, 3),
                                "t_ack": round(a.t_ack, 3)})
        dups += sub_dups
        reorders += sub_reorders
        per_sub[sub.name] = {"clean": sub.clean, "owed": len(due), "lost": len(missing),
                             "delivered": len(sub.deliveries), "duplicates": sub_dups,
                             "delivered_qos2": sum(at_qos2.values()),
                             "qos2_duplicates": sub_q2_dups,
                             "reorders": sub_reorders, "session_lost": len(sub.session_lost),
                             "intervals": [[None if v is None else round(v, 3) for v in i]
                                           for i in sub.intervals],
                             "first_suback": None if sub.first_suback is None
                             else round(sub.first_suback, 3)}
    acked_ids = {(a.pub, a.seq) for a in acked}
    return {
        "acked": len(acked),
        "lost_persistent": len(lost_persistent),
        "lost_clean": len(lost_clean),
        "acked_never_delivered": len(acked_ids - delivered_anywhere),
        "duplicates": dups,
        "qos2_duplicates": q2_dups,
        "reorders": reorders,
        "sessions_lost": sum(len(s.session_lost) for s in subs if not s.clean),
        "per_subscriber": per_sub,
        "samples": samples,
    }


def check_retained(last_acked: dict[str, int], seen: dict[str, dict[str, int | None]]
                   ) -> dict[str, Any]:
    """``seen[node][topic]``: the retained value a fresh subscriber on ``node`` got."""
    regressions = []
    for node, values in seen.items():
        for topic, want in last_acked.items():
            got = values.get(topic)
            if got is None or got < want:
                regressions.append({"node": node, "topic": topic, "got": got,
                                    "last_acked": want})
    return {"last_acked": last_acked, "seen": seen, "regressions": regressions}


def max_gap(times: list[float], start: float, end: float) -> float:
    """Longest interval in [start, end] without an event (the publish stall)."""
    points = sorted(t for t in times if start <= t <= end)
    edges = [start, *points, end]
    return max((b - a for a, b in pairwise(edges)), default=end - start)


def check_dual(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """Each probe: ``overlap_s`` seconds both connections with the id were up (also
    ``overlap_after_heal``, the part of it after the heal, for the report)."""
    violations = [p for p in probes if p.get("overlap_s", 0.0) > TAKEOVER_BOUND]
    return {"probes": probes, "violations": len(violations)}


def verdict(report: dict[str, Any]) -> list[str]:
    """The failed contract checks of one scenario run, each as a short sentence."""
    failures = []
    d = report["delivery"]
    if d["lost_persistent"]:
        failures.append(f"lost {d['lost_persistent']} acknowledged messages "
                        "(persistent subscribers)")
    if d["lost_clean"]:
        failures.append(f"lost {d['lost_clean']} acknowledged messages "
                        "(clean subscribers connected throughout)")
    if d.get("qos2_duplicates"):
        failures.append(f"{d['qos2_duplicates']} messages delivered at QoS 2 more than once "
                        "(exactly once broken)")
    if d["reorders"]:
        failures.append(f"{d['reorders']} deliveries out of order")
    if d["sessions_lost"]:
        failures.append(f"{d['sessions_lost']} persistent sessions lost (CONNACK without "
                        "session present)")
    r = report["retained"]
    if r["regressions"]:
        failures.append(f"{len(r['regressions'])} retained values older than the last "
                        "acknowledged (or missing)")
    if report["dual_sessions"]["violations"]:
        failures.append(f"{report['dual_sessions']['violations']} client ids live on two "
                        f"nodes at once for more than {TAKEOVER_BOUND:.0f} s")
    if report["convergence"]["seconds"] is None:
        failures.append("no convergence within "
                        f"{report['convergence']['bound_s']} s after the heal")
    missing = [w for w in report["wills"] if w["expected"] and w["delay_s"] is None]
    if missing:
        failures.append(f"{len(missing)} wills of broken connections never published")
    if report["crashes"]["unexpected_exits"] or report["crashes"]["tracebacks"]:
        failures.append(f"node crashes: {report['crashes']}")
    if report.get("gave_up"):
        failures.append(f"clients found no node accepting them for 60 s: {report['gave_up']}")
    if report.get("harness_errors"):
        failures.append(f"harness errors: {report['harness_errors']}")
    return failures
