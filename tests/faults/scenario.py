"""One fault run: form a fresh cluster, drive the workload, inject a fault, heal, measure.

Runs inside the client namespace (``run.py`` re-executes itself there), so the paho clients
reach the node addresses directly; node processes are started into their own namespaces.

Timeline (seconds, full / short): warm-up 5 / 4, fault 12 / 8, then after the heal the
workload goes on for ``post`` 8 / 5 seconds while the convergence probe runs (bounded by
``CONVERGE_BOUND``); then publishers stop, the cluster is given ``SETTLE_BOUND`` to settle,
subscribers drain (bounded), and retained values are read on every node.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import checker
from .cluster import Cluster
from .netns import Topology
from .workload import (
    Conn,
    DualProbe,
    Publisher,
    Retainer,
    Role,
    Subscriber,
    WillClient,
)

#: ``none`` is the control: the same run without a fault, which must pass (a harness that
#: reports failures on a healthy cluster is the harness' bug).
SCENARIOS = ("none", "kill-follower", "kill-leader", "isolate", "partition", "loss", "sick",
             "power-loss", "join", "leave", "leader-leaves")
#: ``leave``: how long a graceful leave (SIGTERM) may take before it counts as a crash.
LEAVE_BOUND = 60.0
CONVERGE_BOUND = 20.0
SETTLE_BOUND = 30.0
DRAIN_BOUND = 20.0
QUIET = 3.0
TOTAL_RATE = 120.0  # data messages per second over all publishers
LOSS_PERCENT = 15
#: ``sick``: one follower loses this share of its packets to and from every other node.
SICK_LOSS_PERCENT = 40


@dataclass(frozen=True)
class Timing:
    warmup: float = 5.0
    fault: float = 12.0
    post: float = 8.0

    @classmethod
    def short(cls) -> Timing:
        return cls(4.0, 8.0, 5.0)


def _wait_until(t: float) -> None:
    """A fault window is a span of time by definition: hold it (bounded by ``t``)."""
    threading.Event().wait(max(0.0, t - time.monotonic()))


def converge(addresses: dict[str, tuple[str, int]], nodes: list[str], topics: list[str],
             t_heal: float, bound: float = CONVERGE_BOUND) -> dict[str, Any]:
    """Time from the heal until one round of probes, published on every probe topic through
    every node, reaches a fresh subscriber on every node."""
    tag = uuid.uuid4().hex[:6]
    received: dict[str, set[str]] = {n: set() for n in nodes}
    subs: dict[str, Conn | None] = dict.fromkeys(nodes)
    pubs: dict[str, Conn | None] = dict.fromkeys(nodes)
    deadline = time.monotonic() + bound
    rounds = 0
    last_missing: dict[str, int] = {}

    def on_message_for(node: str) -> Any:
        def on_message(client: Any, userdata: Any, msg: Any) -> None:
            received[node].add(msg.payload.decode(errors="replace"))
        return on_message

    try:
        while time.monotonic() < deadline:
            for node in nodes:
                if subs[node] is None or subs[node].closed.is_set():  # type: ignore[union-attr]
                    c = Conn(f"probe-s-{node}-{tag}-{rounds}", True, on_message_for(node))
                    ok = c.connect(node, addresses[node]) and \
                        c.subscribe(["mqf/probe/#"]) is not None
                    subs[node] = c if ok else None
                    if not ok:
                        c.close()
                if pubs[node] is None or pubs[node].closed.is_set():  # type: ignore[union-attr]
                    c = Conn("", True)
                    pubs[node] = c if c.connect(node, addresses[node]) else None
            if any(c is None for c in (*subs.values(), *pubs.values())):
                last_missing = {"unconnected": sum(c is None for c in (*subs.values(),
                                                                       *pubs.values()))}
                threading.Event().wait(0.3)
                continue
            rounds += 1
            t_round = time.monotonic()
            want = set()
            for node, pub in pubs.items():
                for topic in topics:
                    payload = f"{rounds}|{node}|{topic}"
                    want.add(payload)
                    pub.paho.publish(topic, payload.encode(), 1)  # type: ignore[union-attr]
            wait_end = min(deadline, t_round + 2.0)
            while time.monotonic() < wait_end:
                if all(want <= received[n] for n in nodes):
                    return {"seconds": round(t_round - t_heal, 3), "rounds": rounds,
                            "bound_s": bound}
                threading.Event().wait(0.05)
            last_missing = {n: len(want - received[n]) for n in nodes}
        return {"seconds": None, "rounds": rounds, "bound_s": bound,
                "last_missing": last_missing}
    finally:
        for c in (*subs.values(), *pubs.values()):
            if c is not None:
                c.close(disconnect=True)


def read_retained(addresses: dict[str, tuple[str, int]], node: str, topics: list[str],
                  timeout: float = 5.0) -> dict[str, int | None]:
    values: dict[str, int | None] = dict.fromkeys(topics)
    got = threading.Event()

    def on_message(client: Any, userdata: Any, msg: Any) -> None:
        if msg.retain and msg.topic in values:
            with contextlib.suppress(ValueError):
                values[msg.topic] = int(msg.payload)
            if all(v is not None for v in values.values()):
                got.set()

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = Conn("", True, on_message)
        if c.connect(node, addresses[node]) and c.subscribe(["mqf/r/#"]) is not None:
            got.wait(max(0.0, deadline - time.monotonic()))
            c.close(disconnect=True)
            return values
        c.close()
        threading.Event().wait(0.3)
    return values


def run_scenario(topology: Topology, nodes: list[str], scenario: str, out: Path,
                 timing: Timing, grace: float = 5.0, spare: str | None = None,
                 rate: float = TOTAL_RATE) -> dict[str, Any]:
    """``spare``: a namespace with no node in it, for the node that ``join`` adds."""
    if scenario == "join" and spare is None:
        raise ValueError("the join scenario needs a spare namespace")
    # A fresh cluster needs fresh data dirs: a node finding ``raft/peers.json`` of an
    # earlier run in the same place would try to rejoin that long-gone cluster.
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cluster = Cluster(topology, out, grace=grace,
                      node_names=[*nodes, spare] if scenario == "join" and spare else nodes)
    addresses = {n: cluster.nodes[n].mqtt for n in nodes}
    # The nodes the cluster has after the heal: the checks run against these.
    final = list(nodes)
    stop_pub, stop_sub = threading.Event(), threading.Event()
    roles: list[Role] = []
    duals: list[DualProbe] = []
    harness_errors: list[str] = []
    events: dict[str, float] = {}
    report: dict[str, Any] = {"scenario": scenario, "nodes": len(nodes), "timing":
                              timing.__dict__, "failure_grace": grace, "rate": rate}
    t0 = time.monotonic()
    try:
        cluster.form(nodes)
        view = cluster.settle(nodes, timeout=60)
        events["formed"] = time.monotonic()
        leader = cluster.leader()
        followers = [n for n in nodes if n != leader]
        victims: list[str]
        if scenario in ("kill-leader", "leader-leaves"):
            victims = [leader]
        elif scenario in ("kill-follower", "isolate", "sick", "leave"):
            victims = [followers[-1]]
        elif scenario == "partition":
            majority = [leader, *followers[: len(nodes) // 2]]
            victims = [n for n in nodes if n not in majority]
        elif scenario == "power-loss":
            victims = list(nodes)
        elif scenario in ("loss", "none", "join"):
            victims = []
        else:
            raise ValueError(f"unknown scenario {scenario}")
        others = [n for n in nodes if n not in victims]
        report.update(leader=leader, victims=victims)

        def order(i: int) -> list[str]:
            return nodes[i:] + nodes[:i]

        data_topics = [t for n in nodes for t in view.topic_owned_by(n, "mqf/d", 2)]
        probe_topics = [view.topic_owned_by(n, "mqf/probe")[0] for n in nodes]
        retained_topics = [view.topic_owned_by(n, "mqf/r")[0] for n in nodes[:3]]
        filter_sets = [["mqf/d/#"], ["mqf/d/+"], list(data_topics)]
        subs: list[Subscriber] = []
        for i, node in enumerate(nodes):
            # Persistent ones at QoS 2: what the QoS 2 publishers send must arrive once.
            subs.append(Subscriber(f"ps-{node}", order(i), addresses, stop_sub,
                                   filter_sets[i % 3], clean=False, qos=2))
            subs.append(Subscriber(f"cs-{node}", order(i), addresses, stop_sub,
                                   [*filter_sets[(i + 1) % 3], "mqf/will/#"], clean=True))
        roles += subs
        will_nodes = ([*victims, *victims, *others, *others] if victims else list(nodes))[:4]
        while len(will_nodes) < 4:
            will_nodes.append(nodes[len(will_nodes) % len(nodes)])
        wills = [WillClient(f"will-{k}", n, addresses, stop_sub, f"mqf/will/will-{k}")
                 for k, n in enumerate(will_nodes)]
        roles += wills
        for role in (*subs, *wills):
            role.start()
        for sub in subs:
            if not sub.ready.wait(20):
                raise RuntimeError(f"{sub.role_name} not subscribed in 20 s: {sub.errors}")
        for will in wills:
            if not will.connected.wait(20):
                raise RuntimeError(f"{will.role_name} not connected: {will.errors}")
        first_dual = victims[0] if victims else nodes[-1]
        second_nodes = [n for n in nodes if n not in victims and n != first_dual]
        for cid, clean in (("dual-p", False), ("dual-c", True)):
            probe = DualProbe(cid, clean, first_dual, second_nodes)
            if not probe.connect_first(addresses):
                harness_errors.append(f"{cid}: first connection refused")
            duals.append(probe)
        # Every second publisher at QoS 2: its PUBCOMP is an acknowledgement like a PUBACK,
        # and what it acknowledges must not be lost either.
        pubs = [Publisher(f"pub-{n}", order(i), addresses, stop_pub, data_topics,
                          rate / len(nodes), qos=2 if i % 2 else 1)
                for i, n in enumerate(nodes)]
        rets = [Retainer(f"ret-{k}", order((k + 1) % len(nodes)), addresses, stop_pub, t)
                for k, t in enumerate(retained_topics)]
        roles += [*pubs, *rets]
        for role in (*pubs, *rets):
            role.start()
        events["workload"] = time.monotonic()
        _wait_until(events["workload"] + timing.warmup)

        # ---------------------------------------------------------------- fault
        if scenario in ("kill-leader", "leader-leaves"):
            current = cluster.leader()
            if current != leader:  # not a failure: the victim is whoever leads now
                report["notes"] = [f"leader moved {leader} -> {current} before the fault"]
                victims = [current]
                report["victims"] = victims
        terms_before = cluster.raft_terms()
        events["fault"] = time.monotonic()
        if scenario.startswith("kill"):
            cluster.kill9(victims[0])
        elif scenario == "power-loss":
            for victim in victims:
                cluster.kill9(victim)
        elif scenario == "isolate":
            topology.isolate(victims[0])
        elif scenario == "partition":
            topology.partition([n for n in nodes if n not in victims], victims)
        elif scenario == "loss":
            topology.loss(LOSS_PERCENT)
        elif scenario == "sick":
            topology.degrade(victims[0], SICK_LOSS_PERCENT)
        elif scenario == "join":
            # Scaling out under load: a fresh node joins and takes its share of the shards
            # (sessions, retained, routes) while the workload runs.
            assert spare is not None
            cluster.start(spare, join=cluster.nodes[leader].cluster)
            report["join_ready_s"] = round(cluster.wait_ready(spare, timeout=timing.fault
                                                              + 30), 3)
            addresses[spare] = cluster.nodes[spare].mqtt
            final.append(spare)
        elif scenario in ("leave", "leader-leaves"):
            # Scaling in under load: the node hands its shards over and exits by itself;
            # its clients are closed and reconnect elsewhere.
            report["leave_s"] = round(cluster.terminate(victims[0], LEAVE_BOUND), 3)
            final.remove(victims[0])
        _wait_until(events["fault"] + min(2.0, timing.fault / 2))
        pending = list(duals)
        while pending and time.monotonic() < events["fault"] + timing.fault:
            pending = [p for p in pending if not p.try_second(addresses)]
            if pending:
                _wait_until(time.monotonic() + 1.0)
        _wait_until(events["fault"] + timing.fault)

        # ---------------------------------------------------------------- heal
        events["heal"] = time.monotonic()
        if scenario.startswith("kill"):
            cluster.restart(victims[0])
            report["restart_ready_s"] = round(cluster.wait_ready(victims[0]), 3)
        elif scenario == "power-loss":
            for victim in victims:  # all at once, each rejoining by the peers it remembers
                cluster.start(victim)
            report["restart_ready_s"] = round(max(cluster.wait_ready(v) for v in victims), 3)
        else:
            topology.heal()
        for p in pending:  # still refused during the fault: try once more after the heal
            p.try_second(addresses)
        report["convergence"] = converge(addresses, final, probe_topics, events["heal"])
        _wait_until(events["heal"] + timing.post)

        # ---------------------------------------------------------------- wind down
        stop_pub.set()
        events["stop"] = time.monotonic()
        for role in (*pubs, *rets):
            role.join(15)
        for pub in pubs:
            pub.drain(5.0)
        t_check = time.monotonic()
        report["dual_sessions"] = checker.check_dual(
            [_dual_summary(p, events, t_check) for p in duals])
        for p in duals:
            p.close()
        try:
            cluster.settle(final, timeout=SETTLE_BOUND)
            report["settled_s_after_stop"] = round(time.monotonic() - events["stop"], 3)
        except RuntimeError as exc:
            report["settled_s_after_stop"] = None
            report["settle_error"] = str(exc)[-400:]
        terms_after = cluster.raft_terms()
        report["raft"] = {"terms_before_fault": terms_before, "terms_after": terms_after,
                          "elections": max(terms_after.values(), default=0)
                          - max(terms_before.values(), default=0)}
        acked = [a for p in pubs for a in p.acked()]
        _drain(subs, acked)
        stop_sub.set()
        for role in (*wills, *subs):
            role.join(15)

        records = [checker.SubscriberRecord(s.role_name, s.clean, list(s.deliveries),
                                            s.first_suback, s.intervals, s.session_lost)
                   for s in subs]
        report["delivery"] = checker.check_delivery(records, acked)
        ack_times = [a.t_ack for a in acked]
        report["stall"] = {
            "max_gap_s": round(checker.max_gap(ack_times, events["workload"] + 1.0,
                                               events["stop"]), 3),
            "per_publisher_max_gap_s": {
                p.role_name: round(checker.max_gap([a.t_ack for a in p.acked()],
                                                   events["workload"] + 1.0,
                                                   events["stop"]), 3) for p in pubs},
            "abandoned_connections": sum(p.abandoned for p in pubs),
            "publisher_connections": {p.role_name: len(p.connections) for p in pubs},
        }
        before = [t for t in ack_times if events["workload"] <= t < events["fault"]]
        report["throughput"] = {"sent": sum(len(p.sent) for p in pubs), "acked": len(acked),
                                "per_s_before_fault": round(len(before) / max(
                                    1e-3, events["fault"] - events["workload"]), 1),
                                "per_s": round(len(acked) / max(1e-3, events["stop"]
                                                                - events["workload"]), 1)}
        # A power loss ends every node that held a will registration: they live in memory
        # (at the home and its replicas), so nobody is left to publish them (docs/design.md,
        # the contract, item 3; mosquitto publishes none after a crash either).
        report["wills"] = _wills(wills, subs, victims, events,
                                 promised=scenario != "power-loss")
        last = {r.topic: r.acked[-1][0] for r in rets if r.acked}
        seen = {n: read_retained(addresses, n, list(last)) for n in final}
        report["retained"] = checker.check_retained(last, seen)
    except Exception as exc:
        harness_errors.append(f"{type(exc).__name__}: {str(exc)[-1500:]}")
    finally:
        stop_pub.set()
        stop_sub.set()
        for p in duals:
            p.close()
        for role in roles:
            role.join(5)
        cluster.check_exits()
        report["crashes"] = {"unexpected_exits": cluster.unexpected_exits,
                             "tracebacks": cluster.tracebacks()}
        cluster.close()
    for role in roles:
        harness_errors += [f"{role.role_name}: {e}" for e in role.errors]
    report["harness_errors"] = harness_errors
    report["gave_up"] = [r.role_name for r in roles if r.gave_up is not None]
    report["events_s"] = {k: round(v - t0, 3) for k, v in events.items()}
    report["duration_s"] = round(time.monotonic() - t0, 1)
    report.setdefault("delivery", {"lost_persistent": 0, "lost_clean": 0, "reorders": 0,
                                   "sessions_lost": 0, "duplicates": 0,
                                   "qos2_duplicates": 0, "acked": 0})
    report.setdefault("retained", {"regressions": []})
    report.setdefault("dual_sessions", {"violations": 0})
    report.setdefault("convergence", {"seconds": None, "bound_s": CONVERGE_BOUND})
    report.setdefault("wills", [])
    report["failures"] = checker.verdict(report)
    report["ok"] = not report["failures"]
    return report


def _dual_summary(p: DualProbe, events: dict[str, float], t_check: float) -> dict[str, Any]:
    a, b = p.first, p.second
    out: dict[str, Any] = {"client_id": p.client_id, "clean": p.clean,
                           "first_node": p.first_node, "refusals": p.refusals,
                           "second_node": b.node if b else None}
    if a is None or b is None or p.second_at is None:
        out.update(overlap_s=0.0, overlap_after_heal=0.0)
        return out
    a_end = a.closed_at if a.closed.is_set() else t_check
    b_end = b.closed_at if b.closed.is_set() else t_check
    end = min(a_end or t_check, b_end or t_check)
    out["second_connack_s_after_fault"] = round(p.second_at - events["fault"], 3)
    out["first_closed_s_after_second"] = (round(a.closed_at - p.second_at, 3)
                                          if a.closed.is_set() and a.closed_at else None)
    out["overlap_s"] = round(max(0.0, end - p.second_at), 3)
    out["overlap_after_heal"] = round(max(0.0, end - max(p.second_at, events["heal"])), 3)
    return out


def _drain(subs: list[Subscriber], acked: list[Any]) -> None:
    """Let subscribers catch up: until nothing owed is missing, or ``QUIET`` seconds without
    a delivery, or ``DRAIN_BOUND``."""
    deadline = time.monotonic() + DRAIN_BOUND
    last_count, last_change = -1, time.monotonic()
    while time.monotonic() < deadline:
        count = sum(len(s.deliveries) for s in subs)
        if count != last_count:
            last_count, last_change = count, time.monotonic()
        missing = 0
        for s in subs:
            rec = checker.SubscriberRecord(s.role_name, s.clean, s.deliveries, s.first_suback,
                                           s.intervals)
            have = {(d.pub, d.seq) for d in s.deliveries}
            missing += sum((a.pub, a.seq) not in have for a in checker.owed(rec, acked))
        if missing == 0 or time.monotonic() - last_change > QUIET:
            return
        threading.Event().wait(0.25)


def _wills(wills: list[WillClient], subs: list[Subscriber], victims: list[str],
           events: dict[str, float], promised: bool = True) -> list[dict[str, Any]]:
    arrivals: dict[str, float] = {}
    for s in subs:
        for t, topic, _ in s.other:
            if topic.startswith("mqf/will/"):
                name = topic.rsplit("/", 1)[-1]
                arrivals[name] = min(arrivals.get(name, t), t)
    out = []
    for w in wills:
        broke = w.broken_at is not None
        arrived = arrivals.get(w.role_name)
        out.append({
            "client": w.role_name, "node": w.node, "on_victim": w.node in victims,
            "connection_broke": broke, "expected": broke and promised,
            "broke_s_after_fault": round(w.broken_at - events["fault"], 3) if broke else None,
            "delay_s": round(arrived - events["fault"], 3) if arrived and broke else None,
            "arrived_s_after_fault": round(arrived - events["fault"], 3) if arrived else None,
            "disconnect_sent": w.disconnect_sent,
            # A will after the client's DISCONNECT breaks MQTT-3.14.4-3.  A client that
            # could not write its DISCONNECT (connection already gone) may get its will.
            "spurious": arrived is not None and not broke and w.disconnect_sent,
        })
    return out
